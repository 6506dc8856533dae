"""fuse_gemm: a MatMul or Gemm with what follows it, as exporters spell it, becomes one
FusedGemm node (flowc/ops/matmul.py): one cuBLASLt call with an epilogue instead of a GEMM
and separate element-wise kernels.

Forwards from the product, each step the only use of the value before it:

- a bias: ``Add`` of a constant with one value per output column (a Linear's bias; Gemm's
  own C of shape [N] or [1, N] is one too);
- a residual: ``Add`` of a tensor of the output's shape (read in place as the GEMM's C,
  beta = 1; C and D are different buffers);
- then an activation: ``Relu``, or a GELU in its tanh spelling
  0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) with Pow(x, 3) or x*x*x, in any operand
  order. cuBLASLt's GELU epilogue is that approximation, so only it fuses; the erf GELU
  (TorchScript's x * 0.5 * (1 + erf(x / sqrt 2)), ONNX Gelu) stays exact and becomes one
  element-wise kernel in fuse_elementwise.

An activation is recognized by what it computes, not by its node list: the element-wise
nodes that read only the product (and scalar constants) are evaluated on sample points
with flowc's references and compared with ReLU and the tanh GELU (and told apart from the
erf GELU, which differs by up to 2e-4 there).

Backwards from the product, each operand is followed through Transpose, Reshape and a Split
along an axis as long as its elements keep a fixed stride per logical axis and one of its
last two axes is contiguous: K^T becomes the GEMM's transpose flag, a head split or a Split
chunk of a fused projection is read in place through leading dimensions and batch strides
(what a strided-batched call cannot step over becomes a loop of calls).

In float16/bfloat16 programs widen_types has put float32 casts around every element-wise
op; casts between the GEMM's type and float32 are looked through (the fused GEMM rounds once,
at its end, as a tensor-core GEMM with float32 accumulation does).

A training step's backward products take cuBLASLt's backward epilogues (one 2-D product,
no bias, residual or alpha):

- DGELU: the product's only use is ``Mul(product, f)`` where ``f`` is computed by
  element-wise nodes from one value x alone and is, on sample points, the derivative of the
  tanh GELU at x (Gelu(approximate=tanh)'s VJP; fuse_gelu made an exporter's spelling one
  Gelu before the backward was built): x becomes the epilogue's aux input. Its n must be a
  multiple of 8 (cuBLASLt's aux leading dimension).
- BGRAD: a ReduceSum over every axis but the last of the gradient a weight-gradient product
  sums over k (op(A) = G^T, as Gemm's VJP reads it, or op(B) = G), or of a DGELU's result
  (the bias gradient of the layer whose GELU it is), becomes the product's second output.
  It is written in the product's type (cast where the program summed in float32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flowc.ir.dtype import DType
from flowc.ir.graph import Graph, Node, Value
from flowc.ir.types import TensorType
from flowc.ops.matmul import NARROW, Operand
from flowc.ops.reduce import reduced_axes
from flowc.ops.registry import get_op, node_attrs
from flowc.passes.live_uses import LiveUses
from flowc.passes.manager import register_pass

FUSED = "FusedGemm"
FLOATS = (DType.F32, DType.F16, DType.BF16)
# Sample points of the activation check: where the tanh and erf GELUs differ most (|x| ~ 2)
# and the tails.
_SAMPLES = np.concatenate([np.linspace(-6.0, 6.0, 97), [-2.2, -1.9, 1.9, 2.2, 0.3, -0.3]])
# The tanh and erf GELUs differ by up to 2e-4 at these points; a spelling matches within this.
_MATCH_TOL = 2e-6
_ACTIVATION_OPS = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "Tanh", "Erf", "Gelu", "Relu", "Max", "Cast", "Identity"}
)


def _erf_gelu(x: np.ndarray) -> np.ndarray:
    from math import erf

    return np.array([0.5 * v * (1.0 + erf(v / np.sqrt(2.0))) for v in x.reshape(-1)])


def _transparent(node: Node, dt: DType) -> bool:
    """A cast between a narrow GEMM's type and float32 (widen_types' work), looked through."""
    if node.op != "Cast" or dt not in NARROW or node.inputs[0] is None:
        return False
    pair = {node.inputs[0].type.dtype, node.outputs[0].type.dtype}
    return pair <= {dt, DType.F32}


@dataclass
class _Chain:
    """The product's epilogue found so far."""

    dt: DType
    members: list[Node] = field(default_factory=list)
    bias: Value | None = None
    residual: Value | None = None
    activation: str = "none"
    # The last point whose value has the GEMM's type, where the fused node can end.
    done: _Done | None = None

    def mark(self, cur: Value) -> None:
        if cur.type.dtype == self.dt:
            self.done = _Done(list(self.members), cur, self.bias, self.residual, self.activation)


@dataclass
class _Done:
    members: list[Node]
    result: Value
    bias: Value | None
    residual: Value | None
    activation: str


class Fuser:
    def __init__(self, graph: Graph, views: bool = True) -> None:
        self.graph = graph
        self.live = LiveUses(graph)
        self.outs = self.live.outs
        self.views = views

    @property
    def users(self) -> dict[Value, list[Node]]:
        return self.live.users

    def only_user(self, v: Value) -> Node | None:
        us = self.users.get(v, [])
        if len(us) != 1 or v in self.outs:
            return None
        return us[0]

    # -- forwards: the epilogue ------------------------------------------------------------

    def _bias_of(self, c: Value, n: int, rank: int, dt: DType) -> Value | None:
        if c.const is None or c.type.numel != n or c.type.rank > rank:
            return None
        if c.type.rank and c.type.shape[-1] != n:
            return None
        if c.type.dtype != dt:
            if not c.type.dtype.is_float:
                return None
            return self.graph.add_constant(f"{c.name}.{dt}", np.asarray(c.const).astype(dt.np))
        return c

    def _residual_of(self, r: Value, shape: tuple[int, ...], dt: DType) -> Value | None:
        if r.type.shape != shape:
            return None
        if r.type.dtype == dt:
            return r
        p = r.producer
        if (
            p is not None
            and _transparent(p, dt)
            and p.inputs[0] is not None
            and p.inputs[0].type.dtype == dt
        ):
            return p.inputs[0]
        return None

    def activation(
        self, x: Value, kinds: tuple[str, ...] = ("relu", "gelu_tanh")
    ) -> tuple[str, list[Node], Value] | None:
        """The activation computed by element-wise nodes that read only ``x`` (and scalar
        constants): its name (one of ``kinds``: relu, gelu_tanh, gelu_erf), its nodes and
        its result."""
        if x in self.outs:
            return None
        region: set[Node] = set()
        inside: set[Value] = {x}
        frontier = [x]
        while frontier:
            v = frontier.pop()
            for u in self.users.get(v, []):
                if u in region or u.op not in _ACTIVATION_OPS or len(u.outputs) != 1:
                    continue
                if u.outputs[0].type.shape != x.type.shape or not all(
                    i is None or i in inside or (i.const is not None and i.type.numel == 1)
                    for i in u.inputs
                ):
                    continue
                region.add(u)
                inside.add(u.outputs[0])
                frontier.append(u.outputs[0])
        order = [n for n in self.graph.nodes if n in region]  # topological
        # The longest prefix whose values other than its last are used only inside it.
        for k in range(len(order), 0, -1):
            sub = order[:k]
            inner = set(sub)
            if any(u not in inner for u in self.users.get(x, [])):
                return None
            last = sub[-1].outputs[0]
            if any(
                n.outputs[0] in self.outs
                or any(u not in inner for u in self.users.get(n.outputs[0], []))
                for n in sub[:-1]
            ):
                continue
            name = _classify(x, sub, last)
            if name in kinds:
                return name, sub, last
        return None

    def epilogue(self, out: Value, dt: DType) -> _Chain:
        ch = _Chain(dt)
        cur = out
        ch.mark(cur)
        n = out.type.shape[-1]
        while True:
            u = self.only_user(cur)
            if u is None:
                # Several users: only an activation (which reads x more than once) fits.
                act = self.activation(cur) if ch.activation == "none" else None
                if act is None:
                    break
                ch.activation, nodes, cur = act
                ch.members.extend(nodes)
                ch.mark(cur)
                continue
            if _transparent(u, dt) or (
                # A Reshape keeping the last axis (PyTorch's Linear on 3-D input: a 2-D
                # Gemm between two views): columns and elements stay where they were.
                u.op == "Reshape"
                and u.inputs[0] is cur
                and u.outputs[0].type.rank >= 1
                and u.outputs[0].type.shape[-1] == n
            ):
                ch.members.append(u)
            elif u.op == "Add" and ch.activation == "none" and len(u.inputs) == 2:
                other = u.inputs[1] if u.inputs[0] is cur else u.inputs[0]
                if other is None or other is cur or u.outputs[0].type.shape != cur.type.shape:
                    break
                bias = self._bias_of(other, n, cur.type.rank, dt) if ch.bias is None else None
                if bias is not None:
                    ch.bias = bias
                else:
                    res = self._residual_of(other, cur.type.shape, dt)
                    if res is None or ch.residual is not None:
                        break
                    ch.residual = res
                ch.members.append(u)
            elif ch.activation == "none":
                act = self.activation(cur)
                if act is None:
                    break
                ch.activation, nodes, result = act
                ch.members.extend(nodes)
                cur = result
                ch.mark(cur)
                continue
            else:
                break
            cur = u.outputs[0]
            ch.mark(cur)
        return ch

    # -- training's backward products ------------------------------------------------------

    def dgelu(self, out: Value, dt: DType) -> tuple[list[Node], Value, Value] | None:
        """The tanh GELU's gradient the product ``out`` feeds (out * GELU'(x)): the nodes a
        DGELU epilogue replaces, its result (in dt) and the GELU's input x (in dt)."""
        members: list[Node] = []
        cur, n = out, out.type.shape[-1]
        while True:
            u = self.only_user(cur)
            if u is None:
                return None
            if not (_transparent(u, dt) or _keeps_last_axis(u, cur, n)):
                break
            members.append(u)
            cur = u.outputs[0]
        if u.op != "Mul" or len(u.inputs) != 2 or u.outputs[0].type.shape != cur.type.shape:
            return None
        f = u.inputs[1] if u.inputs[0] is cur else u.inputs[0]
        found = self._derivative(f, u) if f is not None and f is not cur else None
        if found is None:
            return None
        nodes, x = found
        got = _evaluate(x, nodes, nodes[-1].outputs[0])
        if got is None or not _is_gelu_tanh_grad(got):
            return None
        aux, p = x, x.producer
        if x.type.dtype != dt and p is not None and _transparent(p, dt) and p.inputs[0] is not None:
            aux = p.inputs[0]
        if aux.type.dtype != dt or aux.type.numel != out.type.numel or aux.type.shape[-1] != n:
            return None
        members += [*nodes, u]
        cur = u.outputs[0]
        while cur.type.dtype != dt:
            v = self.only_user(cur)
            if v is None or not _transparent(v, dt):
                return None
            members.append(v)
            cur = v.outputs[0]
        return members, cur, aux

    def _derivative(
        self, f: Value, reader: Node, limit: int = 160
    ) -> tuple[list[Node], Value] | None:
        """The element-wise nodes that compute ``f`` (read by ``reader`` alone) from one value
        x and scalar constants, each of their values read only among them: (the nodes in
        order, x). A producer joins once every reader of its value has, so the region stops
        at x, which the forward reads too (repeated until nothing joins: readers join in any
        order)."""
        if f in self.outs or self.users.get(f, []) != [reader]:
            return None
        region: set[Node] = set()
        values = [f]
        grown = True
        while grown:
            grown = False
            for v in values:
                p = v.producer
                if (
                    p is None
                    or p in region
                    or p.op not in _ACTIVATION_OPS
                    or len(p.outputs) != 1
                    or v.type.shape != f.type.shape
                    or (v is not f and (v in self.outs or not self.users.get(v)))
                    or (v is not f and any(u not in region for u in self.users[v]))
                ):
                    continue
                region.add(p)
                if len(region) > limit:
                    return None
                values += [i for i in p.inputs if i is not None and i not in values]
                grown = True
        if f.producer not in region:
            return None
        leaves: list[Value] = []
        for v in values:
            if v.producer is not None and v.producer in region:
                continue
            if v.const is not None:
                if v.type.numel != 1:
                    return None
            elif v not in leaves:
                leaves.append(v)
        if len(leaves) != 1:
            return None
        return _ordered(list(region)), leaves[0]

    def operand_sums(self, base: Value, view: Operand, which: str, dt: DType) -> Node | None:
        """A ReduceSum of what the product sums over k in op(A) (``which`` "a") or op(B)
        ("b"), when that operand is a packed [k, c] matrix in ``base``'s buffer read as it is
        (op(B)) or transposed (op(A), as Gemm's VJP reads the output gradient)."""
        if len(view.shape) != 2:
            return None
        k, c = (view.shape[1], view.shape[0]) if which == "a" else view.shape
        packed = Operand.packed((k, c))
        if not view.same(packed.transposed() if which == "a" else packed):
            return None
        if base.type.numel != k * c or not base.type.shape or base.type.shape[-1] != c:
            return None
        return self.column_sums(base, c, dt)

    def column_sums(self, base: Value, c: int, dt: DType) -> Node | None:
        """A ReduceSum over every axis but the last (c values) of ``base`` or of a value with
        its elements in the same order (Reshapes keeping the last axis, casts between dt and
        float32)."""
        same = [base]
        for v in same:  # grows as it goes
            near = list(self.users.get(v, []))
            if v.producer is not None:
                near.append(v.producer)
            for nd in near:
                if nd.op != "Reshape" and not _transparent(nd, dt):
                    continue
                for w in (nd.inputs[0], nd.outputs[0]):
                    if (
                        w is not None
                        and w not in same
                        and w.type.numel == base.type.numel
                        and w.type.shape
                        and w.type.shape[-1] == c
                    ):
                        same.append(w)
        for v in same:
            for u in self.users.get(v, []):
                if (
                    u.op == "ReduceSum"
                    and u.inputs[0] is v
                    and u.outputs[0].type.numel == c
                    and reduced_axes(u) == list(range(v.type.rank - 1))
                ):
                    return u
        return None

    # -- backwards: operand views ----------------------------------------------------------

    def view_of(self, v: Value, dt: DType) -> tuple[Value, Operand]:
        """The buffer to read ``v`` from and how (v itself, packed, when nothing better)."""
        best: tuple[Value, Operand] = (v, Operand.packed(v.type.shape))
        if not self.views:
            return best
        steps: list[Node] = []
        cur = v
        while cur.producer is not None and len(steps) < 16:
            p = cur.producer
            src = p.inputs[0] if p.inputs else None
            if src is None or p.op not in ("Transpose", "Reshape", "Split", "Cast"):
                break
            if p.op == "Cast" and not _transparent(p, dt):
                break
            steps.append(p)
            cur = src
            if cur.type.dtype != dt:
                continue
            view = _apply(Operand.packed(cur.type.shape), list(reversed(steps)), v)
            # A view laid out as v itself gains nothing (its Reshapes are free).
            if view is not None and view.matrix() is not None and not view.same(best[1]):
                best = (cur, view)
        return best


def _evaluate(x: Value, nodes: list[Node], result: Value) -> np.ndarray | None:
    """``result`` of ``nodes`` (casts as identities) at the sample points as x, or None where
    an op does not take them."""
    env: dict[Value, np.ndarray] = {x: _SAMPLES}
    for n in nodes:
        opdef = get_op(n.op)
        ins: list[np.ndarray | None] = []
        for i in n.inputs:
            if i is None:
                ins.append(None)
            elif i in env:
                ins.append(env[i])
            else:
                assert i.const is not None
                ins.append(np.asarray(i.const, dtype=np.float64).reshape(()))
        if n.op in ("Cast", "Identity"):
            env[n.outputs[0]] = np.asarray(ins[0], dtype=np.float64)
            continue
        try:
            with np.errstate(all="ignore"):
                (y,) = opdef.evaluate(ins, n.attrs)
        except Exception:  # an op that does not take these operands: not an activation
            return None
        env[n.outputs[0]] = np.asarray(y, dtype=np.float64).reshape(-1)
    got = env.get(result)
    if got is None or got.shape != _SAMPLES.shape:
        return None
    return got


def _classify(x: Value, nodes: list[Node], result: Value) -> str | None:
    """Evaluate ``nodes`` on sample points; the activation they are."""
    got = _evaluate(x, nodes, result)
    if got is None:
        return None
    if np.allclose(got, np.maximum(_SAMPLES, 0.0), rtol=0, atol=_MATCH_TOL):
        return "relu"
    # The tanh GELU with its constants exact, or rounded to the program's narrow storage type
    # (--precision bf16/fp16 stores them narrow: a model's 0.044715 becomes 0.04468 in bf16).
    s = _SAMPLES
    gelus = [
        0.5 * s * (1.0 + np.tanh(c2 * (s + c1 * s**3)))
        for c1, c2 in _narrow_constants(0.044715, np.sqrt(2.0 / np.pi))
    ]
    erf_gelu = np.allclose(got, _erf_gelu(s), rtol=0, atol=_MATCH_TOL)
    if any(np.allclose(got, g, rtol=0, atol=_MATCH_TOL) for g in gelus) and not erf_gelu:
        return "gelu_tanh"
    return "gelu_erf" if erf_gelu else None


def _narrow_constants(*cs: float) -> list[tuple[float, ...]]:
    """``cs`` exact, and rounded to each narrow storage type (--precision bf16/fp16 stores a
    model's or a VJP's constants narrow)."""
    return [cs, *(tuple(float(np.asarray(c).astype(dt.np)) for c in cs) for dt in NARROW)]


def _erf_gelu_grad(x: np.ndarray) -> np.ndarray:
    from math import erf

    cdf = np.array([0.5 * (1.0 + erf(v / np.sqrt(2.0))) for v in x])
    return cdf + x * np.exp(-0.5 * x * x) / np.sqrt(2.0 * np.pi)


def _is_gelu_tanh_grad(got: np.ndarray) -> bool:
    """The derivative of the tanh GELU (as Gelu's VJP builds it, its constants exact or
    narrow), told apart from the erf GELU's."""
    x = _SAMPLES
    for c, k, k3 in _narrow_constants(np.sqrt(2.0 / np.pi), 0.044715, 3 * 0.044715):
        t = np.tanh(c * (x + k * x**3))
        want = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + k3 * x * x)
        if np.allclose(got, want, rtol=0, atol=_MATCH_TOL):
            break
    else:
        return False
    return not np.allclose(got, _erf_gelu_grad(x), rtol=0, atol=_MATCH_TOL)


def _keeps_last_axis(u: Node, cur: Value, n: int) -> bool:
    """A Reshape of ``cur`` that keeps its last axis (n): columns stay where they were."""
    return (
        u.op == "Reshape"
        and u.inputs[0] is cur
        and u.outputs[0].type.rank >= 1
        and u.outputs[0].type.shape[-1] == n
    )


def _ordered(nodes: list[Node]) -> list[Node]:
    """``nodes`` each after those of them it reads."""
    inside, done, order = set(nodes), set(), []
    for start in nodes:
        stack = [(start, False)]
        while stack:
            n, expanded = stack.pop()
            if expanded:
                order.append(n)
                continue
            if n in done:
                continue
            done.add(n)
            stack.append((n, True))
            for i in n.inputs:
                if i is not None and i.producer in inside and i.producer not in done:
                    stack.append((i.producer, False))
    return order


def _apply(op: Operand, steps: list[Node], target: Value) -> Operand | None:
    """``op`` (a view of the first step's input) through ``steps``; None when a step has no
    fixed stride per axis."""
    for p in steps:
        out = next((o for o in p.outputs if o is not None), None)
        if p.op == "Cast":
            continue
        if p.op == "Transpose":
            perm = node_attrs(p).get("perm")
            rank = len(op.shape)
            order = [int(a) for a in perm] if perm else list(reversed(range(rank)))
            op = Operand(
                tuple(op.shape[a] for a in order), tuple(op.strides[a] for a in order), op.offset
            )
        elif p.op == "Reshape":
            assert out is not None
            r = _reshaped(op, p.outputs[0].type.shape)
            if r is None:
                return None
            op = r
        elif p.op == "Split":
            axis = int(node_attrs(p)["axis"]) % len(op.shape)
            # Which chunk is on the path: the output that the next step (or target) reads.
            nxt = steps[steps.index(p) + 1] if p is not steps[-1] else None
            want = nxt.inputs[0] if nxt is not None else target
            start = 0
            for o in p.outputs:
                if o is want:
                    break
                start += o.type.shape[axis]
            else:
                return None
            assert want is not None
            shape = list(op.shape)
            shape[axis] = want.type.shape[axis]
            op = Operand(tuple(shape), op.strides, op.offset + start * op.strides[axis])
    return op if op.shape == target.type.shape else None


def _reshaped(op: Operand, shape: tuple[int, ...]) -> Operand | None:
    """``op`` reshaped (row-major order of its logical elements) as a strided view, or None."""
    if 0 in op.shape or 0 in shape:
        return None  # nothing to read: not worth a view
    # Group the old axes (size-1 ones dropped) into runs that each merge to one stride.
    old = [(d, s) for d, s in zip(op.shape, op.strides, strict=True) if d != 1]
    new_strides: list[int] = []
    i = 0
    for d in shape:
        if d == 1:
            new_strides.append(0)
            continue
        # Take old axes until their product reaches d; the run must be contiguous in memory.
        if i >= len(old):
            return None
        size, stride = old[i]
        if size % d == 0 and size != d:
            # Split an old axis: d outer, size / d inner.
            old[i] = (size // d, stride)
            new_strides.append(stride * (size // d))
            continue
        prod = size
        inner_stride = stride
        j = i + 1
        while prod < d and j < len(old):
            nsize, nstride = old[j]
            if inner_stride != nstride * nsize:
                return None
            prod *= nsize
            inner_stride = nstride
            j += 1
        if prod != d:
            return None
        new_strides.append(inner_stride)
        i = j
    if i != len(old):
        return None
    return Operand(tuple(shape), tuple(new_strides), op.offset)


def _fuse(fz: Fuser, node: Node) -> bool:
    out = node.outputs[0]
    dt = out.type.dtype
    if dt not in FLOATS or len(node.outputs) != 1:
        return False
    a, b = node.inputs[0], node.inputs[1]
    if a is None or b is None or a.type.dtype != dt or b.type.dtype != dt:
        return False
    alpha, beta = 1.0, 1.0
    bias = residual = None
    if node.op == "MatMul":
        if a.type.rank < 2 or b.type.rank < 2:
            return False
        av, bv = Operand.packed(a.type.shape), Operand.packed(b.type.shape)
        abase, bbase = a, b
        if out.type.numel:
            abase, av = fz.view_of(a, dt)
            bbase, bv = fz.view_of(b, dt)
    else:
        at = node_attrs(node)
        alpha, beta = float(at["alpha"]), float(at["beta"])
        abase, bbase = a, b
        av, bv = Operand.packed(a.type.shape), Operand.packed(b.type.shape)
        if int(at["transA"]):
            av = av.transposed()
        if int(at["transB"]):
            bv = bv.transposed()
        c = node.inputs[2] if len(node.inputs) > 2 else None
        if c is not None and beta != 0.0:
            n = out.type.shape[-1]
            if c.type.shape == out.type.shape:
                residual = c
            elif c.type.numel == n and c.type.rank >= 1 and c.type.shape[-1] == n:
                if beta != 1.0:
                    if c.const is None:
                        return False
                    c = fz.graph.add_constant(
                        f"{c.name}.scaled", (np.asarray(c.const) * beta).astype(dt.np)
                    )
                bias = c
            else:
                return False  # a C broadcast along columns: Gemm's own path
        if residual is None:
            beta = 1.0  # a bias was scaled above; FusedGemm's beta scales the residual only
    if a.type.numel == 0 or b.type.numel == 0:
        return False
    k = av.shape[-1]
    if k == 0:
        return False
    if out.type.rank == 2 and alpha == 1.0 and bias is None and residual is None:
        found = _backward(fz, out, dt, (abase, av), (bbase, bv))
        if found is not None:
            _fuse_backward(fz, node, found, (abase, av), (bbase, bv))
            return True
    done = fz.epilogue(out, dt).done
    assert done is not None
    if (bias is not None and done.bias is not None) or (
        residual is not None and done.residual is not None
    ):
        return False
    bias = bias or done.bias
    residual = residual or done.residual
    result = done.result
    changed_views = abase is not a or bbase is not b
    # Reshapes and casts alone fuse nothing: a GEMM with nothing gained stays as it is.
    gained = any(n.op not in ("Reshape", "Cast") for n in done.members)
    if (
        not gained
        and not changed_views
        and (node.op == "MatMul" or (bias is None and residual is None))
    ):
        return False
    if not gained:
        result = out
    activation = done.activation
    attrs: dict[str, object] = {"alpha": alpha, "beta": beta, "activation": activation}
    _view_attrs(attrs, (abase, av), (bbase, bv))
    replaced = result.producer  # before Node() makes itself the producer
    assert replaced is not None
    where = fz.graph.nodes.index(replaced)
    g = fz.graph
    before: list[Node] = []
    if residual is not None and residual.type.shape != out.type.shape:
        # Read as the GEMM's output shape: a Reshape is a view, no kernel.
        flat = Value(g.claim_name(f"{residual.name}.as_gemm"), out.type)
        before.append(_reshape(g, residual, flat))
        residual = flat
    made = result
    if result.type.shape != out.type.shape:
        # The chain went through Reshapes: the GEMM writes its own shape, a view the rest.
        made = Value(g.claim_name(f"{out.name}.fused"), out.type)
    fused = Node(FUSED, _inputs(abase, bbase, bias, residual), [made], attrs, name=node.name)
    fused.stage = node.stage  # a DSL stage block's cut stays where it was
    after = [_reshape(g, made, result)] if made is not result else []
    for extra in [*before, *after]:
        extra.stage = node.stage
    g.nodes[where : where + 1] = [*before, fused, *after]
    for new in [*before, fused, *after]:
        fz.live.add(new)
    # The members (and views) only the replaced node read are dead now.
    fz.live.drop(replaced)
    return True


def _view_attrs(attrs: dict[str, object], *operands: tuple[Value, Operand]) -> None:
    """How the fused node reads A and B from their buffers: as they are, transposed, or as a
    strided view."""
    for which, (base, view) in zip("ab", operands, strict=True):
        packed = Operand.packed(base.type.shape)
        if view.same(packed):
            continue
        if base.type.rank >= 2 and view.same(packed.transposed()):
            attrs[f"trans{which.upper()}"] = 1  # shape-free: splits across devices keep it
        else:
            attrs[f"{which}_shape"], attrs[f"{which}_view"] = view.shape, view.to_attr()


@dataclass
class _Backward:
    """A backward product's epilogue: the GELU gradient (its result and the GELU's input,
    aux) and the ReduceSum whose bias gradient the product writes (of op(A), op(B) or its
    result's columns)."""

    result: Value
    aux: Value | None
    sums: Node | None
    sums_of: str


def _backward(
    fz: Fuser, out: Value, dt: DType, a: tuple[Value, Operand], b: tuple[Value, Operand]
) -> _Backward | None:
    n = out.type.shape[-1]
    # cuBLASLt's aux leading dimension (the GELU input's row length) is a multiple of 8.
    dgelu = fz.dgelu(out, dt) if n % 8 == 0 else None
    if dgelu is not None:
        _, result, aux = dgelu
        sums = fz.column_sums(result, n, dt)
        return _Backward(result, aux, sums, "out" if sums is not None else "")
    for which, (base, view) in zip("ab", (a, b), strict=True):
        sums = fz.operand_sums(base, view, which, dt)
        if sums is not None and not _reaches(sums, [a[0], b[0]]):
            return _Backward(out, None, sums, which)
    return None


def _reaches(node: Node, values: list[Value]) -> bool:
    """Whether any of ``values`` is computed from ``node``'s outputs (a bias gradient that the
    product's operands depend on cannot be written by it)."""
    seen: set[Node] = set()
    stack = [v.producer for v in values if v.producer is not None]
    while stack:
        p = stack.pop()
        if p is node:
            return True
        if p in seen:
            continue
        seen.add(p)
        stack.extend(i.producer for i in p.inputs if i is not None and i.producer is not None)
    return False


def _fuse_backward(
    fz: Fuser, node: Node, bw: _Backward, a: tuple[Value, Operand], b: tuple[Value, Operand]
) -> None:
    """Replace the product (and its GELU gradient's nodes) with one FusedGemm writing the
    result and the bias gradient; the ReduceSum's value is defined from the latter."""
    g, out = fz.graph, node.outputs[0]
    dt = out.type.dtype
    # Before Node() makes the fused node the producer of what it defines.
    replaced = bw.result.producer if bw.aux is not None else node
    assert replaced is not None
    attrs: dict[str, object] = {
        "activation": "dgelu_tanh" if bw.aux is not None else "none",
        "bias_grad": bw.sums_of,
    }
    _view_attrs(attrs, a, b)
    before: list[Node] = []
    aux = bw.aux
    if aux is not None and aux.type.shape != out.type.shape:
        flat = Value(g.claim_name(f"{aux.name}.as_gemm"), out.type)
        before.append(_reshape(g, aux, flat))
        aux = flat
    made = bw.result
    if made.type.shape != out.type.shape:
        made = Value(g.claim_name(f"{out.name}.fused"), out.type)
    outputs = [made]
    after = [_reshape(g, made, bw.result)] if made is not bw.result else []
    if bw.sums is not None:
        # The bias gradient in the product's type, then as the ReduceSum had it (float32 in
        # a narrow program; its shape, a view).
        sums = bw.sums.outputs[0]
        vector = TensorType((sums.type.numel,), dt)
        cur = sums if vector == sums.type else Value(g.claim_name(f"{sums.name}.fused"), vector)
        outputs.append(cur)
        if cur.type.dtype != sums.type.dtype:
            wide = TensorType(vector.shape, sums.type.dtype)
            to = sums if wide == sums.type else Value(g.claim_name(f"{sums.name}.wide"), wide)
            cast = Node(
                "Cast", [cur], [to], {"to": wide.dtype.onnx}, name=g.claim_name(f"{to.name}.cast")
            )
            after.append(cast)
            cur = to
        if cur is not sums:
            after.append(_reshape(g, cur, sums))
    fused = Node(FUSED, _inputs(a[0], b[0], None, None, aux), outputs, attrs, name=node.name)
    for extra in [*before, fused, *after]:
        extra.stage = node.stage
    where = g.nodes.index(replaced)
    g.nodes[where : where + 1] = [*before, fused, *after]
    if bw.sums is not None:
        g.nodes.remove(bw.sums)
    for new in [*before, fused, *after]:
        fz.live.add(new)
    fz.live.drop(replaced)
    if bw.sums is not None:
        fz.live.drop(bw.sums)
        # The bias gradient is written by the product now, which may come after the
        # ReduceSum's readers; the graph's order is topological again before anything (the
        # removal of dead nodes among them) reads it.
        g.sort_topologically()


def _inputs(*values: Value | None) -> list[Value | None]:
    """A node's inputs without the absent ones at the end (as the printed form reads back)."""
    out = list(values)
    while out and out[-1] is None:
        out.pop()
    return out


def _reshape(g: Graph, src: Value, dst: Value) -> Node:
    """``dst`` = Reshape(``src``) to dst's shape (its producer from now on)."""
    shape = g.add_constant(f"{dst.name}.shape", np.array(dst.type.shape, dtype=np.int64))
    return Node("Reshape", [src, shape], [dst], {}, name=g.claim_name(f"{dst.name}.view"))


@register_pass("fuse_gemm")
def fuse_gemm(graph: Graph) -> Graph:
    return _fuse_all(graph, views=True)


@register_pass("fuse_gemm_packed")
def fuse_gemm_packed(graph: Graph) -> Graph:
    """fuse_gemm with every operand read as it is (packed), for a graph the placement search
    will split over devices: a strided view's offsets and strides are the whole tensor's, so
    a GEMM that reads one runs only whole on every device, where the Transpose or Reshape
    it would absorb splits like any op (a head split of q and K^T stays a head split)."""
    return _fuse_all(graph, views=False)


def _fuse_all(graph: Graph, views: bool) -> Graph:
    fz = Fuser(graph, views)
    for node in list(graph.nodes):
        if node.op in ("MatMul", "Gemm") and node in fz.live.alive and _fuse(fz, node):
            # The fused members are dead now and out of the uses the next match reads (kept
            # up to date, not rebuilt: a rebuild per match is quadratic on a deep model).
            fz.live.matched()
    fz.live.finish()
    return graph
