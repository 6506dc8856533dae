"""Linear algebra: Einsum and Det.

Einsum is lowered on ONNX import to ops flowc already compiles: each operand's repeated
letters (diagonals) become a Gather over the merged axes, letters no later operand or the
output needs are summed away (ReduceSum), and the operands are contracted pairwise, left to
right, with Transpose/Reshape around a batched MatMul (or a broadcast Mul and ReduceSum when
nothing is contracted or MatMul lacks the element type). A final Transpose puts the output
letters in order. The Einsum op itself (what a DSL program builds) evaluates with NumPy's
einsum and has no kernel of its own.

Every ellipsis stands for the same number of axes (as the specification requires); their sizes
broadcast like NumPy's (1 against n). A letter has one size wherever it appears.

Det runs Gaussian elimination with partial pivoting in float64, one thread per matrix.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node
from flowc.ir.types import TensorType
from flowc.ops import sbp_rules as sr
from flowc.ops.common import NodeLowering, required_inputs
from flowc.ops.conv import float_ctype
from flowc.ops.matmul import _NUMERIC as MATMUL_TYPES
from flowc.ops.movement import node_input
from flowc.ops.registry import InferCtx, SbpSignature, defop, first

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.builder import AdapterNode
    from flowc.ir.graph import Value

FAMILY = "linalg"


# -- Einsum: the equation ---------------------------------------------------------------------

# A label names one axis of the computation: a letter, or ".k" for the k-th axis the
# ellipsis stands for.
Label = str


class EquationError(ValueError):
    """An equation that does not parse, or does not fit the operands' shapes."""


@dataclass(frozen=True)
class Equation:
    terms: tuple[tuple[Label, ...], ...]  # one label per axis of each operand
    output: tuple[Label, ...]
    sizes: dict[Label, int]  # every label's size (ellipsis axes broadcast)


_TERM = re.compile(r"[A-Za-z]*(\.\.\.)?[A-Za-z]*")


def _split_term(term: str, what: str) -> tuple[str, str, bool]:
    """(letters before the ellipsis, letters after it, whether it has one)."""
    if not _TERM.fullmatch(term):
        raise EquationError(f"{what} {term!r} may hold only letters and one ellipsis ('...')")
    before, dots, after = term.partition("...")
    return before, after, bool(dots)


def parse_equation(equation: object, shapes: list[tuple[int, ...]]) -> Equation:
    if not isinstance(equation, str):
        raise EquationError(f"the equation must be a string, got {equation!r}")
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    if "->" in rhs:
        raise EquationError(f"equation {equation!r} has more than one '->'")
    terms_text = lhs.split(",")
    if len(terms_text) != len(shapes):
        raise EquationError(
            f"equation {equation!r} has {len(terms_text)} operand term(s) but the node has "
            f"{len(shapes)} input(s)"
        )
    parts = [_split_term(t, "operand term") for t in terms_text]
    # The ellipsis stands for the axes the letters leave over: the same number in every
    # operand (the specification says so, and onnxruntime checks it); their sizes broadcast.
    widths: list[int] = []
    for (before, after, dots), shape, text in zip(parts, shapes, terms_text, strict=True):
        letters = len(before) + len(after)
        if len(shape) < letters or (not dots and len(shape) != letters):
            raise EquationError(
                f"operand term {text!r} names {letters} axes but the operand has rank "
                f"{len(shape)} (shape {list(shape)})"
            )
        widths.append(len(shape) - letters if dots else 0)
    width = max(widths, default=0)
    for (_, _, dots), w, text in zip(parts, widths, terms_text, strict=True):
        if dots and w != width:
            raise EquationError(
                f"the ellipsis of operand term {text!r} stands for {w} axes but another "
                f"operand's for {width}: every ellipsis must stand for the same number"
            )
    ellipsis = tuple(f".{k}" for k in range(width))
    terms: list[tuple[Label, ...]] = []
    sizes: dict[Label, int] = {}
    for (before, after, dots), shape in zip(parts, shapes, strict=True):
        labels = (*before, *(ellipsis if dots else ()), *after)
        for label, size in zip(labels, shape, strict=True):
            known = sizes.get(label)
            if known is None or known == size:
                sizes[label] = size
            elif label.startswith(".") and 1 in (known, size):
                sizes[label] = max(known, size)
            else:
                what = "an ellipsis axis" if label.startswith(".") else f"letter {label!r}"
                raise EquationError(f"{what} has size {known} in one operand and {size} in another")
        terms.append(labels)
    any_dots = any(dots for _, _, dots in parts)
    if arrow:
        before, after, dots = _split_term(rhs, "output term")
        if width and not dots:
            raise EquationError(
                f"the operands' ellipsis stands for {width} axes but the output term {rhs!r} "
                "has no ellipsis to put them in"
            )
        output = (*before, *(ellipsis if dots else ()), *after)
        for label in before + after:
            if label not in sizes:
                raise EquationError(f"output letter {label!r} appears in no operand")
        if len(set(output)) != len(output):
            raise EquationError(f"output term {rhs!r} repeats a letter")
    else:
        # Implicit form: the ellipsis axes, then the letters seen exactly once, in ASCII order.
        seen = [c for t in terms_text for c in t if c.isalpha()]
        once = sorted(c for c in set(seen) if seen.count(c) == 1)
        output = (*(ellipsis if any_dots else ()), *once)
    return Equation(tuple(terms), tuple(output), sizes)


def _check_einsum(ctx: InferCtx) -> Equation:
    if ctx.num_inputs == 0:
        raise ctx.fail("needs at least one input")
    dt = ctx.dtype(0)
    if not (dt.is_float or dt.is_int):
        raise ctx.fail(f"needs numeric inputs, got {dt}")
    for i in range(1, ctx.num_inputs):
        if ctx.dtype(i) != dt:
            raise ctx.fail(f"inputs have different element types: {dt} and {ctx.dtype(i)}")
    try:
        return parse_equation(
            ctx.attrs.get("equation"), [ctx.shape(i) for i in range(ctx.num_inputs)]
        )
    except EquationError as e:
        raise ctx.fail(str(e)) from None


def _einsum_infer(ctx: InferCtx) -> list[TensorType]:
    eq = _check_einsum(ctx)
    return [TensorType(tuple(eq.sizes[label] for label in eq.output), ctx.dtype(0))]


def _einsum_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    ops = [x for x in xs if x is not None]
    dt = ops[0].dtype
    # Floats in float64 (NumPy's einsum knows no bfloat16), rounded once at the end.
    work = [x.astype(np.float64) if dt.kind not in "iu" else x for x in ops]
    with np.errstate(over="ignore"):
        r = np.einsum(str(a["equation"]).replace(" ", ""), *work)
    return np.asarray(r).astype(dt)


def _einsum_flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    """A multiply-add per operand for every point of the full index space."""
    shapes = [t.shape for t in ins if t is not None]
    try:
        eq = parse_equation(a.get("equation"), shapes)
    except EquationError:
        return 0
    return len(shapes) * math.prod(eq.sizes.values())


# -- Einsum: the lowering ---------------------------------------------------------------------


class _Lowering(NodeLowering):
    """Emits the ops that compute an einsum into the importing graph."""

    def __init__(self, n: AdapterNode, eq: Equation, dtype: DType) -> None:
        super().__init__(n, dtype)
        self.eq = eq

    def emit(
        self, op: str, inputs: list[Value | None], attrs: dict[str, object] | None = None
    ) -> Value:
        return self.n.emit(op, inputs, attrs, suffix=f"einsum{self.next_step()}_{op.lower()}")[0]

    def const(self, what: str, values: list[int]) -> Value:
        return self.n.const(f"einsum{self.next_step()}_{what}", values, np.int64)

    def reshape(self, v: Value, shape: list[int]) -> Value:
        if tuple(shape) == v.type.shape:
            return v
        # allowzero: a 0 in the shape is an empty axis, not "copy the input's".
        return self.emit("Reshape", [v, self.const("shape", shape)], {"allowzero": 1})

    def permute(self, v: Value, perm: list[int]) -> Value:
        if perm == list(range(len(perm))):
            return v
        return self.emit("Transpose", [v], {"perm": perm})

    def transpose(self, v: Value, labels: list[Label], order: list[Label]) -> Value:
        """``v`` with its axes (named by distinct ``labels``) put in ``order``."""
        return self.permute(v, [labels.index(label) for label in order])

    def diagonals(self, v: Value, labels: list[Label]) -> tuple[Value, list[Label]]:
        """Take the diagonal of every letter the term repeats ('ii' -> 'i'): move its axes
        last, merge them, and gather the positions whose coordinates all agree."""
        while len(set(labels)) != len(labels):
            rep = next(label for label in labels if labels.count(label) > 1)
            others = [label for label in labels if label != rep]
            k, size = labels.count(rep), self.eq.sizes[rep]
            at = [j for j, label in enumerate(labels) if label != rep]
            v = self.permute(v, at + [j for j, label in enumerate(labels) if label == rep])
            v = self.reshape(v, [self.eq.sizes[label] for label in others] + [size**k])
            step = sum(size**j for j in range(k))
            index = self.const("diagonal", [i * step for i in range(size)])
            v = self.emit("Gather", [v, index], {"axis": len(others)})
            labels = [*others, rep]
        return v, labels

    def drop_broadcast(self, v: Value, labels: list[Label]) -> tuple[Value, list[Label]]:
        """Drop ellipsis axes of size 1 that other operands have longer: the operand is the
        same all along them, so leaving it without the label broadcasts it (and, when the
        label is summed, the other operands sum it)."""
        keep = [
            label
            for label, d in zip(labels, v.type.shape, strict=True)
            if not (d == 1 and self.eq.sizes[label] != 1)
        ]
        if len(keep) == len(labels):
            return v, labels
        return self.reshape(v, [self.eq.sizes[label] for label in keep]), keep

    def sum_out(self, v: Value, labels: list[Label], keep: set[Label]) -> tuple[Value, list[Label]]:
        axes = [k for k, label in enumerate(labels) if label not in keep]
        if not axes:
            return v, labels
        v = self.emit("ReduceSum", [v, self.const("axes", axes)], {"keepdims": 0})
        return v, [label for label in labels if label in keep]

    def contract(
        self, a: Value, la: list[Label], b: Value, lb: list[Label], later: set[Label]
    ) -> tuple[Value, list[Label]]:
        """The product of two operands, summed over the labels they share and nothing later
        needs. Every label the two do not share is kept (sum_out dropped the others)."""
        batch = [label for label in la if label in lb and label in later]
        summed = [label for label in la if label in lb and label not in later]
        a_only = [label for label in la if label not in lb]
        b_only = [label for label in lb if label not in la]

        def sizes(labels: list[Label]) -> list[int]:
            return [self.eq.sizes[label] for label in labels]

        out = batch + a_only + b_only
        if summed and self.dtype in MATMUL_TYPES:
            # [batch, M, K] @ [batch, K, N] with every group of axes merged into one.
            am = self.reshape(
                self.transpose(a, la, batch + a_only + summed),
                [math.prod(sizes(batch)), math.prod(sizes(a_only)), math.prod(sizes(summed))],
            )
            bm = self.reshape(
                self.transpose(b, lb, batch + summed + b_only),
                [math.prod(sizes(batch)), math.prod(sizes(summed)), math.prod(sizes(b_only))],
            )
            return self.reshape(self.emit("MatMul", [am, bm]), sizes(out)), out
        # Broadcast product over [batch, a_only, b_only, summed], then sum the last axes.
        ones_a, ones_b = [1] * len(a_only), [1] * len(b_only)
        ab = self.reshape(
            self.transpose(a, la, batch + a_only + summed),
            sizes(batch) + sizes(a_only) + ones_b + sizes(summed),
        )
        bb = self.reshape(
            self.transpose(b, lb, batch + b_only + summed),
            sizes(batch) + ones_a + sizes(b_only) + sizes(summed),
        )
        v = self.emit("Mul", [ab, bb])
        full = out + summed
        return self.sum_out(v, full, set(out))


def _einsum_import(n: AdapterNode) -> list[Value]:
    ins = required_inputs(n)
    ctx = InferCtx(
        "Einsum", n.name, [v.type for v in ins], [v.const for v in ins], Attrs(n.attrs), 1
    )
    eq = _check_einsum(ctx)
    low = _Lowering(n, eq, ins[0].type.dtype)
    operands = []
    for v, term in zip(ins, eq.terms, strict=True):
        v, labels = low.diagonals(v, list(term))
        operands.append(low.drop_broadcast(v, labels))
    out = set(eq.output)
    acc, la = operands[0]
    for k in range(1, len(operands)):
        b, lb = operands[k]
        later = out.union(*(set(ls) for _, ls in operands[k + 1 :]))
        # Letters only one side has and nothing later needs are summed before the product.
        acc, la = low.sum_out(acc, la, later | set(lb))
        b, lb = low.sum_out(b, lb, later | set(la))
        acc, la = low.contract(acc, la, b, lb, later)
    acc, la = low.sum_out(acc, la, out)
    return [low.transpose(acc, la, list(eq.output))]


defop(
    "Einsum",
    FAMILY,
    infer=_einsum_infer,
    reference=_einsum_ref,
    attrs={"equation": None},
    inputs=(1, 64),
    flops=_einsum_flops,
    onnx_import=_einsum_import,
)


# -- Det ------------------------------------------------------------------------------------------

# Elimination keeps a thread's matrix in a local array; bigger matrices would not fit.
DET_MAX = 32


def _det_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    if not x.dtype.is_float:
        raise ctx.fail(f"needs a floating-point input, got {x.dtype}")
    if x.rank < 2 or x.shape[-1] != x.shape[-2]:
        raise ctx.fail(f"needs square matrices in the last two axes, got shape {list(x.shape)}")
    return [x.with_shape(x.shape[:-2])]


def _det_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = first(xs)
    m = x.shape[-1]
    if m == 0:
        return np.ones(x.shape[:-2], x.dtype)  # the empty product
    return np.asarray(np.linalg.det(x.astype(np.float64))).astype(x.dtype)


def _det_emit(prog: Program, node: Node) -> None:
    x = node_input(node, 0)
    y = node.outputs[0]
    t = float_ctype(prog, x)
    m = x.type.shape[-1]
    if m > DET_MAX:
        raise prog.fail(f"matrices of {m}x{m} have no kernel yet (up to {DET_MAX}x{DET_MAX} do)")
    name = prog.kernel("linalg.cu.j2", "det", ctype=t, m=m)
    n = y.type.numel
    prog.launch(name, n, [prog.cptr(x), prog.ptr(y), f"(int64_t){n}"])


def _det_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    # Matrices are independent: batch axes split.
    return sr.same_axes(ctx, outs, range(outs[0].rank))


defop(
    "Det",
    FAMILY,
    infer=_det_infer,
    reference=_det_ref,
    flops=lambda ins, outs, a: 0 if ins[0] is None else ins[0].numel * ins[0].shape[-1],
    sbp=_det_sbp,
    emit=_det_emit,
)
