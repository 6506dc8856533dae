"""Matrix products: MatMul (NumPy semantics, batch broadcasting) and Gemm.

MatMul promotes a 1-D first operand to a row and a 1-D second operand to a column, then
drops the added axis from the result, exactly as numpy.matmul does. Gemm keeps alpha, beta
and the transposes as attributes; its C operand broadcasts one way, to (M, N).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from flowc.codegen.cpp import CTYPES, c_float
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node, Value
from flowc.ir.types import TensorType
from flowc.ops import sbp_rules as sr
from flowc.ops.registry import InferCtx, SbpSignature, broadcast_shapes, defop, get_op

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.frontend.onnx import OnnxNode

FAMILY = "matmul"

_NUMERIC = frozenset(
    {DType.F16, DType.F32, DType.F64, DType.BF16, DType.I32, DType.I64, DType.U32, DType.U64}
)


def _check_dtypes(ctx: InferCtx, *idx: int) -> DType:
    dt = ctx.dtype(idx[0])
    if dt not in _NUMERIC:
        raise ctx.fail(f"does not support element type {dt}")
    for i in idx[1:]:
        if ctx.has(i) and ctx.dtype(i) != dt:
            raise ctx.fail(f"operands have different element types: {dt} and {ctx.dtype(i)}")
    return dt


def _product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b in a type NumPy multiplies well: narrow floats go through float32 (BLAS)."""
    if a.dtype.kind in "iu" or a.dtype == np.float64:
        return np.matmul(a, b)
    return np.matmul(a.astype(np.float32), b.astype(np.float32))


# -- code generation ------------------------------------------------------------------------------
# float32 products go through flowc::gemm (cuBLASLt on the GPU, CBLAS on the host); double and
# integer products use a direct kernel (one thread per output element), since the wrapper
# computes fp32 only. Templates: templates/kernels/matmul.cu.j2.

# C++ element type -> the type a direct product accumulates in. Signed integers accumulate
# unsigned so that overflow wraps (as NumPy's does) instead of being undefined behaviour.
_ACC = {
    "float": "float",
    "double": "double",
    "int32_t": "uint32_t",
    "int64_t": "uint64_t",
    "uint32_t": "uint32_t",
    "uint64_t": "uint64_t",
}


def _elem_type(prog: Program, v: Value) -> str:
    t = CTYPES.get(v.type.dtype)
    if t is None or t not in _ACC:
        raise prog.fail(
            f"element type {v.type.dtype} has no kernel yet (float32, float64, int32, int64, "
            "uint32 and uint64 do)"
        )
    return t


@dataclass(frozen=True)
class _BatchAxis:
    """One output batch axis (size > 1) and how far one step along it moves each operand."""

    size: int
    sa: int  # elements of A (0: A broadcasts along this axis)
    sb: int
    sc: int


def _batch_axes(
    a_batch: tuple[int, ...], b_batch: tuple[int, ...], m: int, n: int, k: int
) -> list[_BatchAxis]:
    rank = max(len(a_batch), len(b_batch))
    a_b = (1,) * (rank - len(a_batch)) + a_batch
    b_b = (1,) * (rank - len(b_batch)) + b_batch
    axes: list[_BatchAxis] = []
    sa, sb, sc = m * k, k * n, m * n
    for da, db in zip(reversed(a_b), reversed(b_b), strict=True):
        size = max(da, db)
        if size > 1:
            axes.append(_BatchAxis(size, sa if da > 1 else 0, sb if db > 1 else 0, sc))
        sa, sb, sc = sa * da, sb * db, sc * size
    axes.reverse()
    return axes


def _offsets_loop(axes: list[_BatchAxis], indent: str) -> list[str]:
    """C++ lines that turn the outer index `o` into element offsets oa, ob, oc."""
    lines = [f"{indent}int64_t rest = o, oa = 0, ob = 0, oc = 0;"]
    for ax in reversed(axes):
        lines.append(
            f"{indent}{{ const int64_t q = rest % {ax.size}; rest /= {ax.size}; "
            f"oa += q * {ax.sa}; ob += q * {ax.sb}; oc += q * {ax.sc}; }}"
        )
    lines.append(f"{indent}(void)rest;")
    return lines


def _gemm_call(
    prog: Program,
    node: Node,
    ptrs: tuple[str, str, str],
    shape: tuple[int, int, int],
    trans: tuple[bool, bool],
    axes: list[_BatchAxis],
    alpha: float,
    beta: float,
) -> None:
    """One flowc::gemm over the trailing batch axes (strided, stride 0 where an operand
    broadcasts, or folded into M), looping over the leading axes that cannot be strided."""
    m, n, k = shape
    # The longest run of trailing axes along which each operand either steps or broadcasts
    # uniformly is one strided batch; the axes before it are a loop of calls.
    split = len(axes)
    if axes:
        run = (axes[-1].sa > 0, axes[-1].sb > 0)
        while split > 0 and (axes[split - 1].sa > 0, axes[split - 1].sb > 0) == run:
            split -= 1
    inner, outer = axes[split:], axes[:split]
    batch = math.prod(ax.size for ax in inner)
    stride_a, stride_b = m * k, k * n
    if inner and inner[-1].sb == 0 and not trans[0]:
        # B is shared by the whole run and A's rows are contiguous: one taller product.
        m, batch = m * batch, 1
    elif inner:
        stride_a = stride_a if inner[-1].sa > 0 else 0
        stride_b = stride_b if inner[-1].sb > 0 else 0
    lines = [
        "[&]() -> flowc::Status {",
        f"    flowc::GemmDesc d = flowc::packed_gemm({m}, {n}, {k}, {str(trans[0]).lower()}, "
        f"{str(trans[1]).lower()}, {batch});",
    ]
    if batch > 1:
        lines.append(f"    d.stride_a = {stride_a};")
        lines.append(f"    d.stride_b = {stride_b};")
    if alpha != 1.0:
        lines.append(f"    d.alpha = {c_float(alpha)};")
    if beta != 0.0:
        lines.append(f"    d.beta = {c_float(beta)};")
    a, b, c = ptrs
    if not outer:
        lines.append(f"    return flowc::gemm({prog.blas}, d, {a}, {b}, {c}, {prog.stream});")
    else:
        lines += [
            f"    const float* pa = {a};",
            f"    const float* pb = {b};",
            f"    float* pc = {c};",
            f"    for (int64_t o = 0; o < {math.prod(ax.size for ax in outer)}; ++o) {{",
            *_offsets_loop(outer, "      "),
            f"      const flowc::Status s = flowc::gemm({prog.blas}, d, pa + oa, pb + ob, pc + oc, {prog.stream});",
            "      if (!s.ok()) return s;",
            "    }",
            "    return flowc::Status::Ok();",
        ]
    lines.append("  }()")
    prog.call("\n  ".join(lines), f"{node.op} {node.name}")


def _direct(
    prog: Program,
    values: tuple[Value, Value, Value | None],
    out: Value,
    shape: tuple[int, int, int],
    trans: tuple[bool, bool],
    axes: list[_BatchAxis],
    alpha: float = 1.0,
    beta: float = 1.0,
    c_index: str = "0",
) -> None:
    a, b, c = values
    t = _elem_type(prog, a)
    acc = _ACC[t]
    m, n, k = shape
    a_row, a_col = (1, m) if trans[0] else (k, 1)
    b_row, b_col = (1, k) if trans[1] else (n, 1)
    if t in ("float", "double"):
        result = "acc" if alpha == 1.0 else f"{c_float(alpha, acc)} * acc"
        if c is not None:
            result += " + cv" if beta == 1.0 else f" + {c_float(beta, acc)} * cv"
    elif alpha == 1.0 and (c is None or beta == 1.0):
        result = "acc" if c is None else f"acc + static_cast<{acc}>(cv)"
    else:
        # NumPy's reference scales an integer product in float64 and truncates back.
        result = f"{float(alpha).hex()} * static_cast<double>(static_cast<{t}>(acc))"
        if c is not None:
            result += f" + {float(beta).hex()} * static_cast<double>(cv)"
    name = prog.kernel(
        "matmul.cu.j2",
        "matmul_direct",
        ctype=t,
        acc_type=acc,
        m=m,
        n=n,
        k=k,
        batch=[{"size": ax.size, "sa": ax.sa, "sb": ax.sb} for ax in axes],
        a_row=a_row,
        a_col=a_col,
        b_row=b_row,
        b_col=b_col,
        has_c=c is not None,
        c_index=c_index,
        result=result,
    )
    args = [prog.cptr(a), prog.cptr(b), *([prog.cptr(c)] if c is not None else []), prog.ptr(out)]
    total = out.type.numel
    prog.launch(name, total, [*args, f"(int64_t){total}"])


def _zero(prog: Program, out: Value) -> None:
    prog.stmt(f"cudaMemsetAsync({prog.ptr(out)}, 0, {out.type.nbytes}, {prog.stream});")


def _matmul_emit(prog: Program, node: Node) -> None:
    a, b = node.inputs[0], node.inputs[1]
    assert a is not None and b is not None
    out = node.outputs[0]
    _elem_type(prog, a)
    a2 = (1, *a.type.shape) if a.type.rank == 1 else a.type.shape
    b2 = (*b.type.shape, 1) if b.type.rank == 1 else b.type.shape
    m, k, n = a2[-2], a2[-1], b2[-1]
    if out.type.numel == 0:
        return
    if k == 0:
        _zero(prog, out)
        return
    axes = _batch_axes(a2[:-2], b2[:-2], m, n, k)
    if a.type.dtype == DType.F32:
        ptrs = (prog.cptr(a), prog.cptr(b), prog.ptr(out))
        _gemm_call(prog, node, ptrs, (m, n, k), (False, False), axes, 1.0, 0.0)
    else:
        _direct(prog, (a, b, None), out, (m, n, k), (False, False), axes)


def _c_index(c: Value | None, row: str, col: str) -> str:
    """Where Gemm's C (broadcast one way to M x N) holds the element of (row, col)."""
    if c is None:
        return "0"
    c0, c1 = (1, 1, *c.type.shape)[-2:]
    terms = []
    if c0 > 1:
        terms.append(f"{row} * {c1}" if c1 > 1 else row)
    if c1 > 1:
        terms.append(col)
    return " + ".join(terms) or "0"


def _gemm_emit(prog: Program, node: Node) -> None:
    at = node.attrs.merged(get_op(node.op).attrs)
    a, b = node.inputs[0], node.inputs[1]
    assert a is not None and b is not None
    c = node.inputs[2] if len(node.inputs) > 2 else None
    out = node.outputs[0]
    _elem_type(prog, a)
    trans = (bool(at["transA"]), bool(at["transB"]))
    alpha, beta = float(at["alpha"]), float(at["beta"])
    m, n = out.type.shape
    k = a.type.shape[0] if trans[0] else a.type.shape[1]
    if beta == 0.0:
        c = None  # beta * C adds nothing (onnxruntime does not read C either)
    if out.type.numel == 0:
        return
    if a.type.dtype != DType.F32:
        index = _c_index(c, "row", "col")
        _direct(prog, (a, b, c), out, (m, n, k), trans, [], alpha, beta, index)
        return
    if c is not None:
        # The GEMM reads C from the output: put C (broadcast) there first.
        if c.type.shape == out.type.shape and k > 0:
            prog.copy(out, c)
        else:
            scale = c_float(beta) if k == 0 else ""
            name = prog.kernel(
                "matmul.cu.j2",
                "broadcast_copy",
                ctype="float",
                cols=n,
                index=_c_index(c, "r", "c"),
                scale=scale,
            )
            prog.launch(name, m * n, [prog.cptr(c), prog.ptr(out), f"(int64_t){m * n}"])
    if k == 0:
        if c is None:
            _zero(prog, out)
        return
    ptrs = (prog.cptr(a), prog.cptr(b), prog.ptr(out))
    _gemm_call(prog, node, ptrs, (m, n, k), trans, [], alpha, beta if c is not None else 0.0)


# -- MatMul -------------------------------------------------------------------------------------


def _matmul_infer(ctx: InferCtx) -> list[TensorType]:
    dt = _check_dtypes(ctx, 0, 1)
    a, b = ctx.shape(0), ctx.shape(1)
    if not a or not b:
        raise ctx.fail(f"operands must have rank >= 1, got shapes {list(a)} and {list(b)}")
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise ctx.fail(f"inner dimensions differ: {list(a)} @ {list(b)} ({a2[-1]} vs {b2[-2]})")
    batch = broadcast_shapes(ctx, a2[:-2], b2[:-2])
    out = [*batch]
    if len(a) > 1:
        out.append(a2[-2])
    if len(b) > 1:
        out.append(b2[-1])
    return [TensorType(tuple(out), dt)]


def _matmul_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    # A 1-D operand has no m (or n) axis to split, and the output has none either.
    ra, rb = len(ctx.shape(0)), len(ctx.shape(1))
    ro = len(outs[0].shape)
    sigs = [
        sr.sig(ctx, {0: sr.S(ra - 1), 1: sr.S(max(rb - 2, 0))}, sr.P, 1),
        sr.partial(ctx, outs, (0,)),
        sr.partial(ctx, outs, (1,)),
    ]
    if ra > 1:
        sigs.append(sr.sig(ctx, {0: sr.S(ra - 2)}, sr.S(ro - 1 - (rb > 1)), 1))
    if rb > 1:
        sigs.append(sr.sig(ctx, {1: sr.S(rb - 1)}, sr.S(ro - 1), 1))
    batch = ro - (ra > 1) - (rb > 1)
    for j in range(batch):
        if outs[0].shape[j] != 1:
            given = {i: sr.aligned(ctx.shape(i)[:-2], batch, j) for i in (0, 1)}
            sigs.append(sr.sig(ctx, given, sr.S(j), 1))
    return sigs


def _matmul_ref(xs: list[np.ndarray | None], at: Attrs) -> np.ndarray:
    a, b = xs[0], xs[1]
    assert a is not None and b is not None
    return np.asarray(_product(a, b), dtype=a.dtype)


def _matmul_flops(ins: list[TensorType | None], outs: list[TensorType], at: Attrs) -> int:
    a = ins[0]
    assert a is not None
    return 2 * outs[0].numel * a.shape[-1]


defop(
    "MatMul",
    FAMILY,
    infer=_matmul_infer,
    reference=_matmul_ref,
    inputs=2,
    flops=_matmul_flops,
    sbp=_matmul_sbp,
    emit=_matmul_emit,
    library="blas",
)


# -- Gemm ---------------------------------------------------------------------------------------


def _gemm_infer(ctx: InferCtx) -> list[TensorType]:
    dt = _check_dtypes(ctx, 0, 1, 2)
    a, b = ctx.shape(0), ctx.shape(1)
    if len(a) != 2 or len(b) != 2:
        raise ctx.fail(f"A and B must be 2-D, got shapes {list(a)} and {list(b)}")
    m, k = a[::-1] if ctx.attr("transA") else a
    kb, n = b[::-1] if ctx.attr("transB") else b
    if k != kb:
        raise ctx.fail(
            f"inner dimensions differ: A' is {m}x{k}, B' is {kb}x{n} "
            f"(transA={ctx.attr('transA')}, transB={ctx.attr('transB')})"
        )
    if ctx.has(2):
        c = ctx.shape(2)
        if len(c) > 2 or any(d not in (1, t) for d, t in zip(c[::-1], (n, m), strict=False)):
            raise ctx.fail(f"C of shape {list(c)} does not broadcast to [{m}, {n}]")
    return [TensorType((m, n), dt)]


def _gemm_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    # A' = A or A^T: A's m axis is 0 and its k axis 1, swapped by transA; likewise B's k and
    # n axes by transB. C broadcasts to [M, N] and follows the output's split where it has
    # that axis; under a k split every part adds its own share of C, so C must be P.
    # Integer products scaled by alpha or beta truncate, which is not linear.
    am, ak = (1, 0) if ctx.attr("transA") else (0, 1)
    bk, bn = (1, 0) if ctx.attr("transB") else (0, 1)
    c = ctx.shape(2) if ctx.has(2) else ()
    sigs = [
        sr.sig(ctx, {0: sr.S(am), 2: sr.aligned(c, 2, 0)}, sr.S(0), 1),
        sr.sig(ctx, {1: sr.S(bn), 2: sr.aligned(c, 2, 1)}, sr.S(1), 1),
    ]
    if outs[0].dtype.is_float or ctx.attr("alpha") == ctx.attr("beta") == 1.0:
        sigs += [
            sr.sig(ctx, {0: sr.S(ak), 1: sr.S(bk), 2: sr.P}, sr.P, 1),
            sr.partial(ctx, outs, (0, 2)),
            sr.partial(ctx, outs, (1, 2)),
        ]
    return sigs


def _gemm_ref(xs: list[np.ndarray | None], at: Attrs) -> np.ndarray:
    a, b = xs[0], xs[1]
    c = xs[2] if len(xs) > 2 else None
    assert a is not None and b is not None
    dt = a.dtype
    y = _product(a.T if at["transA"] else a, b.T if at["transB"] else b)
    # Python-float scalars keep y's precision (NumPy 2 treats them as weakly typed).
    if at["alpha"] != 1.0:
        y = y * at["alpha"]
    if c is not None:
        y = y + (c.astype(y.dtype) * at["beta"] if at["beta"] != 1.0 else c.astype(y.dtype))
    return y.astype(dt, copy=False)


def _gemm_flops(ins: list[TensorType | None], outs: list[TensorType], at: Attrs) -> int:
    a = ins[0]
    assert a is not None
    k = a.shape[0] if at["transA"] else a.shape[1]
    return 2 * outs[0].numel * k + 2 * outs[0].numel


def _gemm_import(n: OnnxNode) -> None:
    # Opsets 1-6 ask for broadcast=1 before C may broadcast; the canonical form always
    # broadcasts, which is a superset.
    n.attrs.pop("broadcast", None)


defop(
    "Gemm",
    FAMILY,
    infer=_gemm_infer,
    reference=_gemm_ref,
    attrs={"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0},
    inputs=(2, 3),
    flops=_gemm_flops,
    onnx_import=_gemm_import,
    sbp=_gemm_sbp,
    emit=_gemm_emit,
    library="blas",
)
