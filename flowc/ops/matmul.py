"""Matrix products: MatMul (NumPy semantics, batch broadcasting) and Gemm.

MatMul promotes a 1-D first operand to a row and a 1-D second operand to a column, then
drops the added axis from the result, exactly as numpy.matmul does. Gemm keeps alpha, beta
and the transposes as attributes; its C operand broadcasts one way, to (M, N).

One idea: the GEMM family beside matmul.cu.j2 (MatMul, Gemm and their fused forms, sharing
one cuBLASLt plan and epilogue description); kept whole because an op family is one module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from flowc.codegen.cpp import CTYPES, MAX_GRID, c_float
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node, Value
from flowc.ir.types import Sbp, TensorType
from flowc.ops import grad
from flowc.ops import sbp_rules as sr
from flowc.ops.registry import (
    LIBRARY_SCRATCH,
    FlopsFn,
    InferCtx,
    SbpSignature,
    broadcast_shapes,
    defop,
    get_op,
    set_vjp,
)

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.builder import AdapterNode

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
    """a @ b in a type NumPy multiplies well, accumulating float32 and narrower floats in
    float64 and rounding once to float32: a BLAS's float32 kernels sum the columns at tile
    edges in another order than inside tiles, so equal columns would differ in their last
    bits, which a softmax of huge logits (the onnx package's light models) magnifies."""
    if a.dtype.kind in "iu" or a.dtype == np.float64:
        return np.matmul(a, b)
    return np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(np.float32)


# -- code generation ------------------------------------------------------------------------------
# float32, float16 and bfloat16 products go through a GEMM plan (runtime_cpp/flowc/gemm.h:
# cuBLASLt on the GPU, CBLAS on the host) made once in create(); run() only executes it. The
# narrow types run on tensor cores with float32 accumulation and one rounding of the result.
# double and integer products use a direct kernel (one thread per output element).
# Templates: templates/kernels/matmul.cu.j2.

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
# Element types of the GEMM library path -> flowc::DataType.
_GEMM_TYPES = {DType.F32: "kF32", DType.F16: "kF16", DType.BF16: "kBF16"}
NARROW = frozenset({DType.F16, DType.BF16})
# The alignment flowc guarantees: arena buffers and weights start at multiples of 256 bytes;
# the caller's input and output pointers must be 16-byte aligned (model.h says so).
ARENA_ALIGN = 256
CALLER_ALIGN = 16
# Epilogue activations (FusedGemm's `activation`) -> flowc::GemmEpilogue, without and with a bias.
_EPILOGUES = {
    "none": ("kNone", "kBias"),
    "relu": ("kRelu", "kReluBias"),
    "gelu_tanh": ("kGelu", "kGeluBias"),
}
# The backward epilogues: (activation, bias_grad) -> flowc::GemmEpilogue.
_BACKWARD_EPILOGUES = {
    ("dgelu_tanh", ""): "kDGelu",
    ("dgelu_tanh", "out"): "kDGeluBgrad",
    ("none", "a"): "kBgradA",
    ("none", "b"): "kBgradB",
}


def _elem_type(prog: Program, v: Value) -> str:
    if v.type.dtype in _GEMM_TYPES:
        return CTYPES[v.type.dtype]
    t = CTYPES.get(v.type.dtype)
    if t is None or t not in _ACC:
        raise prog.fail(
            f"element type {v.type.dtype} has no kernel yet (float32, float16, bfloat16, "
            "float64, int32, int64, uint32 and uint64 do)"
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


@dataclass(frozen=True)
class Operand:
    """How a GEMM reads one operand of logical shape (*batch, rows, cols) from its buffer:
    element (i...) is at buffer[offset + sum(i * stride)]. A packed tensor has row-major
    strides; a transpose of the last two axes swaps them; a head split or a Split chunk
    read in place has the strides of the tensor it is a view of."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    @staticmethod
    def packed(shape: tuple[int, ...]) -> Operand:
        strides: list[int] = []
        step = 1
        for d in reversed(shape):
            strides.append(step)
            step *= d
        return Operand(tuple(shape), tuple(reversed(strides)))

    def transposed(self) -> Operand:
        """The operand with its last two axes swapped (no data moves)."""
        s, t = self.shape, self.strides
        return Operand((*s[:-2], s[-1], s[-2]), (*t[:-2], t[-1], t[-2]), self.offset)

    def matrix(self) -> tuple[bool, int] | None:
        """(transposed, leading dimension) of the trailing matrix as BLAS reads it, or None
        when neither axis is contiguous."""
        rows, cols = self.shape[-2:]
        s_r, s_c = self.strides[-2:]
        if s_c == 1 or cols == 1:
            ld = s_r if rows > 1 else cols
            if ld >= cols:
                return False, ld
        if s_r == 1 or rows == 1:
            ld = s_c if cols > 1 else rows
            if ld >= rows:
                return True, ld
        return None

    def same(self, other: Operand) -> bool:
        """The same elements in the same places (strides of size-1 axes do not matter)."""
        return (
            self.shape == other.shape
            and self.offset == other.offset
            and all(
                d == 1 or s == t
                for d, s, t in zip(self.shape, self.strides, other.strides, strict=True)
            )
        )

    def to_attr(self) -> tuple[int, ...]:
        return (self.offset, *self.strides)

    @staticmethod
    def from_attr(shape: tuple[int, ...], view: tuple[int, ...]) -> Operand:
        return Operand(tuple(shape), tuple(view[1:]), view[0])


def gemm_expressible(a: Operand, b: Operand) -> bool:
    """Whether one GEMM (a loop of strided-batched calls) can read these operands."""
    return a.matrix() is not None and b.matrix() is not None


@dataclass(frozen=True)
class _Axis:
    """One output batch axis (size > 1) and the step along it of A, B and C/D, in elements."""

    size: int
    steps: tuple[int, int, int]


def _strided_batch(
    a: Operand, b: Operand, out_batch: tuple[int, ...], m: int, n: int
) -> list[_Axis]:
    rank = len(out_batch)

    def steps_of(op: Operand) -> list[int]:
        lead = op.shape[:-2]
        pad = rank - len(lead)
        return [0 if j < pad or lead[j - pad] == 1 else op.strides[j - pad] for j in range(rank)]

    sa, sb = steps_of(a), steps_of(b)
    axes: list[_Axis] = []
    sc = m * n
    c_steps = [0] * rank
    for j in reversed(range(rank)):
        c_steps[j] = sc
        sc *= out_batch[j]
    for j in range(rank):
        if out_batch[j] > 1:
            axes.append(_Axis(out_batch[j], (sa[j], sb[j], c_steps[j])))
    return axes


def _alignment(base: int, *elements: int, itemsize: int) -> int:
    """The largest power of two dividing ``base`` and every byte offset ``elements`` give."""
    g = base
    for e in elements:
        g = math.gcd(g, e * itemsize)
    return g & -g if g else base


def _base_align(prog: Program, v: Value) -> int:
    """The alignment ``v``'s storage starts at: an arena buffer's, or the caller's pointer
    plus the byte offset of a pipeline micro-batch's slice of it (12 bytes into a 16-byte
    aligned buffer is 4-byte aligned)."""
    root = prog.root(v)
    for c in (v, root):
        if c in prog.graph.inputs or c in prog.graph.outputs:
            return _alignment(CALLER_ALIGN, prog.caller_offsets.get(c, 0), itemsize=1)
    return ARENA_ALIGN


@dataclass
class GemmCall:
    """One GEMM node's operands for emit_gemm: values with how they are read, and the
    epilogue (bias: one value per output column; residual: C, packed like the output)."""

    a: Value
    a_view: Operand
    b: Value
    b_view: Operand
    out: Value
    out_batch: tuple[int, ...]  # the output's batch axes (MatMul's 1-D promotions kept)
    alpha: float = 1.0
    beta: float = 0.0  # of the residual, or (no residual) of what the output holds already
    bias: Value | None = None
    residual: Value | None = None
    activation: str = "none"
    aux: Value | None = None  # dgelu_tanh: the GELU's input, packed like the output
    bias_grad: Value | None = None  # the bias gradient the epilogue writes
    bias_grad_of: str = ""  # "a", "b" (op(A) / op(B) summed over k) or "out" (D's columns)


def _c_base(prog: Program, g: GemmCall) -> int:
    """The alignment C and D start at (the residual's too, read as C)."""
    bases = [_base_align(prog, g.out)]
    if g.residual is not None:
        bases.append(_base_align(prog, g.residual))
    return min(bases)


def _gemm_plan(prog: Program, node: Node, g: GemmCall, **shape: Any) -> str:
    """The GEMM plan (made in create()) of ``node``'s call ``g`` for the problem ``shape``
    (gemm_plan's m, n, k, transposes, batch, leading dims, strides, epilogue, ld_aux,
    alignments): the handle of its stream, the scalars, the type, TF32 and the workspace
    bound filled in."""
    dt = g.a.type.dtype
    return prog.library_plan(
        "gemm",
        "matmul.cu.j2",
        "gemm_plan",
        handle=prog.blas,
        alpha=g.alpha,
        beta=g.beta,
        type=_GEMM_TYPES[dt] if dt != DType.F32 else None,
        tf32=prog.tf32,
        workspace=prog.library_workspace(node),
        **shape,
    )


def _emit_gemm_sized(prog: Program, node: Node, g: GemmCall) -> None:
    """A GEMM of a program with symbolic dims: a packed A whose rows (every dim but the last,
    flattened) change with the run, times a B of fixed size, into a packed output. The plan
    is made for the rows at the bound; each run multiplies the first rows of this run
    (flowc::run_gemm_rows), which A, C and D hold packed, a prefix of their buffers."""
    a, b = g.a_view, g.b_view
    k = a.shape[-1]
    n = b.shape[-1]
    mb = b.matrix()
    packed_a = a.offset == 0 and a.same(Operand.packed(a.shape)) and a.shape == g.a.type.shape
    if (
        g.b.type.sym is not None
        or any(d != 1 for d in b.shape[:-2])
        or mb is None
        or not packed_a
        or g.aux is not None
        or g.bias_grad is not None
        or (g.bias is not None and g.bias.type.sym is not None)
    ):
        if _emit_tiled_sized(prog, g):
            return
        raise prog.fail(
            "a product with symbolic dims is size-generic as packed rows times a matrix of "
            "fixed size, or as packed (or transposed) operands with a forward epilogue "
            f"(A {g.a.type}, B {g.b.type})"
        )
    trans_b, ldb = mb
    rows_bound = g.a.type.numel // max(k, 1)
    size = g.a.type.dtype.itemsize
    align_a = _alignment(_base_align(prog, g.a), itemsize=size)
    align_b = _alignment(_base_align(prog, g.b), b.offset, itemsize=size)
    plan = _gemm_plan(
        prog,
        node,
        g,
        m=rows_bound,
        n=n,
        k=k,
        trans_a=False,
        trans_b=trans_b,
        batch=1,
        lda=k,
        ldb=ldb,
        strides=None,
        epilogue=_EPILOGUES[g.activation][g.bias is not None],
        ld_aux=0,
        align=(align_a, align_b, _c_base(prog, g)),
    )
    prog.call(
        "matmul.cu.j2",
        "gemm_run_rows",
        f"{node.op} {node.name}",
        plan=plan,
        rows=f"({prog.numel(g.a.type)}) / {max(k, 1)}",
        a=prog.cptr(g.a),
        b=prog.cptr(g.b),
        b_offset=b.offset,
        c=prog.cptr(g.residual) if g.residual is not None else None,
        d=prog.ptr(g.out),
        bias=prog.cptr(g.bias) if g.bias is not None else None,
        stream=prog.stream,
    )


def _stored(v: Value, view: Operand) -> bool | None:
    """Whether ``view`` reads ``v`` transposed (False: as it is packed; None: neither)."""
    packed = Operand.packed(v.type.shape)
    if view.shape == v.type.shape and view.same(packed):
        return False
    if v.type.rank >= 2 and view.same(packed.transposed()):
        return True
    return None


# The tiled kernel's tile edge: 16 x 16 outputs per block of 256 threads.
_TILE = 16


def _emit_tiled_sized(prog: Program, g: GemmCall) -> bool:
    """A product whose matrices change size (attention's q K^T and P V unfused, a Gram
    matrix): flowc's tiled kernel, every extent and step read from the run's sizes (a
    library call would need the bucket's layout, the operands hold the run's packed).
    False when the operands are views other than a transpose, or the epilogue is a
    backward one."""
    ta, tb = _stored(g.a, g.a_view), _stored(g.b, g.b_view)
    if ta is None or tb is None or g.aux is not None or g.bias_grad is not None:
        return False
    if g.residual is None and g.beta != 0.0:
        return False
    at, bt, ot = g.a.type, g.b.type, g.out.type
    ra, rb, ro = at.rank, bt.rank, ot.rank
    if ot.rank < 2 or len(g.out_batch) != ro - 2:
        return False

    batch = []
    for i in range(ro - 2):
        if ot.shape[i] == 1 and (ot.sym is None or ot.sym[i] is None):
            continue
        steps = []
        for t, r in ((at, ra), (bt, rb)):
            j = i - (ro - r)
            moves = j >= 0 and (t.shape[j] != 1 or (t.sym is not None and t.sym[j] is not None))
            steps.append(prog.count(t, j + 1, r, "sizes") if moves else "")
        batch.append({"size": prog.dim(ot, i), "sa": steps[0], "sb": steps[1]})
    # A(row, kk) and B(kk, col) in their buffers: packed, or transposed packed
    a_row, a_col = ("1", prog.dim(at, ra - 1)) if ta else (prog.dim(at, ra - 1), "1")
    b_row, b_col = ("1", prog.dim(bt, rb - 1)) if tb else (prog.dim(bt, rb - 1), "1")
    dt = g.a.type.dtype
    name = prog.kernel(
        "matmul.cu.j2",
        "matmul_tiled_sized",
        ctype=CTYPES[dt],
        m=prog.dim(ot, ro - 2),
        n=prog.dim(ot, ro - 1),
        k=prog.dim(at, ra - 2 if ta else ra - 1),
        batch=batch,
        batch_total=prog.count(ot, 0, ro - 2, "sizes"),
        a_row=a_row,
        a_col=a_col,
        b_row=b_row,
        b_col=b_col,
        alpha=c_float(g.alpha, "float"),
        beta=c_float(g.beta, "float"),
        has_bias=g.bias is not None,
        has_c=g.residual is not None,
        epilogue=_EPILOGUES[g.activation][g.bias is not None],
    )
    args = [prog.cptr(g.a), prog.cptr(g.b)]
    args += [prog.cptr(v) for v in (g.bias, g.residual) if v is not None]
    m_host, n_host = prog.dim(ot, ro - 2, "hdims"), prog.dim(ot, ro - 1, "hdims")
    tiles = f"(({m_host}) + {_TILE - 1}) / {_TILE} * ((({n_host}) + {_TILE - 1}) / {_TILE})"
    grid = [prog.grid(tiles, 1, MAX_GRID), prog.grid(prog.count(ot, 0, ro - 2), 1, 65535)]
    prog.launch_grid(name, grid, _TILE * _TILE, [*args, prog.ptr(g.out), "ddims"])
    return True


def emit_gemm(prog: Program, node: Node, g: GemmCall) -> None:
    """A GEMM plan (made in create()) over the trailing batch axes along which every operand
    steps uniformly (one strided batch; B shared by the batch and A's rows contiguous: one
    taller product), and a loop of calls over the leading axes that cannot be strided."""
    if prog.is_sized(node):
        _emit_gemm_sized(prog, node, g)
        return
    dt = g.a.type.dtype
    a, b = g.a_view, g.b_view
    m, k = a.shape[-2:]
    n = b.shape[-1]
    ma, mb = a.matrix(), b.matrix()
    if ma is None or mb is None:
        raise AssertionError(f"{node.name}: a GEMM operand with no contiguous axis")
    (trans_a, lda), (trans_b, ldb) = ma, mb
    axes = _strided_batch(a, b, g.out_batch, m, n)
    split = len(axes)
    while split > 0:
        # An axis joins the strided run when every operand's step along it is the next
        # axis's step times its size (or both are 0: a broadcast along both).
        if split < len(axes):
            cur, nxt = axes[split - 1], axes[split]
            if any(s != t * nxt.size for s, t in zip(cur.steps, nxt.steps, strict=True)):
                break
        split -= 1
    inner, outer = axes[split:], axes[:split]
    batch = math.prod(ax.size for ax in inner)
    backward = g.aux is not None or g.bias_grad is not None
    if backward and (axes or g.alpha != 1.0 or g.residual is not None or g.bias is not None):
        raise AssertionError(f"{node.name}: a backward epilogue on more than one plain product")
    stride_a, stride_b, stride_c = inner[-1].steps if inner else (m * k, k * n, m * n)
    if batch > 1 and stride_b == 0 and not trans_a and stride_a == m * lda:
        # B is shared by the whole run and A's rows are evenly spaced across it.
        m, batch = m * batch, 1
    size = dt.itemsize
    batched = (stride_a, stride_b, stride_c) if batch > 1 else (0, 0, 0)
    outer_steps = [ax.steps for ax in outer]
    align_a = _alignment(
        _base_align(prog, g.a), a.offset, batched[0], *(s[0] for s in outer_steps), itemsize=size
    )
    align_b = _alignment(
        _base_align(prog, g.b), b.offset, batched[1], *(s[1] for s in outer_steps), itemsize=size
    )
    align_c = _alignment(_c_base(prog, g), batched[2], *(s[2] for s in outer_steps), itemsize=size)
    plan = _gemm_plan(
        prog,
        node,
        g,
        m=m,
        n=n,
        k=k,
        trans_a=trans_a,
        trans_b=trans_b,
        batch=batch,
        lda=lda,
        ldb=ldb,
        strides=batched if batch > 1 else None,
        epilogue=(
            _BACKWARD_EPILOGUES[g.activation, g.bias_grad_of]
            if backward
            else _EPILOGUES[g.activation][g.bias is not None]
        ),
        ld_aux=n if g.aux is not None else 0,
        align=(align_a, align_b, align_c),
    )
    operands = {
        "plan": plan,
        "a": prog.cptr(g.a),
        "a_offset": a.offset,
        "b": prog.cptr(g.b),
        "b_offset": b.offset,
        "c": prog.cptr(g.residual) if g.residual is not None else None,
        "d": prog.ptr(g.out),
        "bias": prog.cptr(g.bias) if g.bias is not None else None,
        "stream": prog.stream,
    }
    what = f"{node.op} {node.name}"
    if not outer:
        aux = prog.cptr(g.aux) if g.aux is not None else None
        bias_grad = prog.ptr(g.bias_grad) if g.bias_grad is not None else None
        prog.call("matmul.cu.j2", "gemm_run", what, aux=aux, bias_grad=bias_grad, **operands)
        return
    count = math.prod(ax.size for ax in outer)
    loop = [{"size": ax.size, "steps": ax.steps} for ax in outer]
    prog.call(
        "matmul.cu.j2", "gemm_loop", what, ctype=CTYPES[dt], axes=loop, count=count, **operands
    )


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
    prog.zero(prog.ptr(out), out.type.nbytes)


def _promoted(v: Value, first: bool) -> tuple[int, ...]:
    """MatMul's 1-D operand promoted to a row (first) or a column (second)."""
    if v.type.rank != 1:
        return v.type.shape
    return (1, *v.type.shape) if first else (*v.type.shape, 1)


def _matmul_emit(prog: Program, node: Node) -> None:
    a, b = node.inputs[0], node.inputs[1]
    assert a is not None and b is not None
    out = node.outputs[0]
    _elem_type(prog, a)
    a2, b2 = _promoted(a, True), _promoted(b, False)
    m, k, n = a2[-2], a2[-1], b2[-1]
    if out.type.numel == 0:
        return
    if k == 0:
        _zero(prog, out)
        return
    if a.type.dtype not in _GEMM_TYPES and prog.is_sized(node):
        raise prog.fail(f"a {a.type.dtype} product with symbolic dims has no kernel yet")
    if a.type.dtype in _GEMM_TYPES:
        batch = tuple(np.broadcast_shapes(a2[:-2], b2[:-2]))
        emit_gemm(prog, node, GemmCall(a, Operand.packed(a2), b, Operand.packed(b2), out, batch))
    else:
        axes = _batch_axes(a2[:-2], b2[:-2], m, n, k)
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
    if prog.is_sized(node) and (a.type.dtype not in _GEMM_TYPES or trans[0]):
        raise prog.fail("a Gemm with symbolic dims is size-generic for float A, not transposed")
    if a.type.dtype not in _GEMM_TYPES:
        index = _c_index(c, "row", "col")
        _direct(prog, (a, b, c), out, (m, n, k), trans, [], alpha, beta, index)
        return
    av, bv = Operand.packed(a.type.shape), Operand.packed(b.type.shape)
    g = GemmCall(
        a, av.transposed() if trans[0] else av, b, bv.transposed() if trans[1] else bv, out, ()
    )
    g.alpha = alpha
    if c is not None and k > 0 and c.type.shape == out.type.shape:
        g.residual, g.beta = c, beta  # read in place: C and D are different buffers
    elif c is not None and k > 0 and beta == 1.0 and c.type.numel == n and c.type.rank >= 1:
        g.bias = c  # (N,) or (1, N): the library's bias epilogue
    elif c is not None:
        if prog.is_sized(node):
            raise prog.fail("a Gemm with symbolic dims takes no C broadcast along columns yet")
        # A C broadcast along columns (or a scalar): put it, broadcast, into the output
        # first; the GEMM then reads C from there.
        scale = c_float(beta) if k == 0 else ""
        name = prog.kernel(
            "matmul.cu.j2",
            "broadcast_copy",
            ctype=CTYPES[a.type.dtype],
            cols=n,
            index=_c_index(c, "r", "c"),
            scale=scale,
        )
        prog.launch(name, m * n, [prog.cptr(c), prog.ptr(out), f"(int64_t){m * n}"])
        g.beta = beta
    if k == 0:
        if c is None:
            _zero(prog, out)
        return
    emit_gemm(prog, node, g)


def fused_operands(node: Node) -> tuple[Operand, Operand]:
    """FusedGemm's A and B as the GEMM reads them from its first two inputs."""
    a, b = node.inputs[0], node.inputs[1]
    assert a is not None and b is not None
    at = node.attrs.merged(get_op(node.op).attrs)
    views = []
    for v, which in ((a, "a"), (b, "b")):
        shape, view = at[f"{which}_shape"], at[f"{which}_view"]
        assert isinstance(shape, tuple) and isinstance(view, tuple)
        if view:
            views.append(
                Operand.from_attr(tuple(int(d) for d in shape), tuple(int(s) for s in view))
            )
        else:
            packed = Operand.packed(v.type.shape)
            views.append(packed.transposed() if at[f"trans{which.upper()}"] else packed)
    return views[0], views[1]


def _fused_emit(prog: Program, node: Node) -> None:
    at = node.attrs.merged(get_op(node.op).attrs)
    a, b, bias, res, aux = (*node.inputs, None, None, None)[:5]
    assert a is not None and b is not None
    out = node.outputs[0]
    av, bv = fused_operands(node)
    if out.type.numel == 0:
        return
    g = GemmCall(a, av, b, bv, out, out.type.shape[:-2], alpha=float(at["alpha"]))
    g.bias = bias
    g.activation = str(at["activation"])
    if res is not None:
        g.residual, g.beta = res, float(at["beta"])
    g.aux = aux
    if at["bias_grad"]:
        g.bias_grad, g.bias_grad_of = node.outputs[1], str(at["bias_grad"])
    emit_gemm(prog, node, g)


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


# cuBLASLt's workspace holds split-K partial sums (in float32, the compute type: narrow plans
# allow no other reduction, runtime_cpp/flowc/gemm.h) and the counters its split and stream-K
# kernels keep per tile. A call uses at most: the whole output in float32 once per K split,
# K split at most GEMM_MAX_SPLITS ways into parts of at least GEMM_MIN_SPLIT_K, plus
# LIBRARY_SCRATCH for the counters. (flowc's bounds, not NVIDIA's figures: a workspace under
# what an algorithm wants only drops that algorithm from the heuristic's choice.)
GEMM_MAX_SPLITS = 16
GEMM_MIN_SPLIT_K = 256


def gemm_workspace(out_numel: int, k: int) -> int:
    splits = min(GEMM_MAX_SPLITS, -(-k // GEMM_MIN_SPLIT_K))
    return LIBRARY_SCRATCH + (4 * out_numel * splits if splits > 1 else 0)


def _flops_workspace(flops: FlopsFn) -> FlopsFn:
    """A GEMM op's workspace bound from its flops (2 m n k per output element pair)."""

    def bound(ins: list[TensorType | None], outs: list[TensorType], at: Attrs) -> int:
        n = max(1, outs[0].numel)
        return gemm_workspace(n, flops(ins, outs, at) // (2 * n))

    return bound


defop(
    "MatMul",
    FAMILY,
    infer=_matmul_infer,
    reference=_matmul_ref,
    inputs=2,
    flops=_matmul_flops,
    sbp=_matmul_sbp,
    emit=_matmul_emit,
    sized=True,
    library="blas",
    workspace=_flops_workspace(_matmul_flops),
    narrow=NARROW,
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


def _gemm_import(n: AdapterNode) -> None:
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
    sized=True,
    library="blas",
    workspace=_flops_workspace(_gemm_flops),
    narrow=NARROW,
)


# -- FusedGemm: a GEMM with its epilogue, made by the fuse_gemm pass ---------------------------
# act(alpha * A @ B + beta * residual + bias), in one library call (cuBLASLt's epilogues; the
# host emulates them exactly). Inputs: A, B, bias (optional; one value per output column, the
# bias of a Linear), residual (optional; C, of the output's shape, read in place). transA /
# transB read an input with its last two axes swapped; a_view / b_view, when given, read it
# as (offset, *strides) in elements of its buffer for a logical operand of shape a_shape /
# b_shape (a head split, a Split chunk, without a copy). activation: none, relu, or
# gelu_tanh (the tanh approximation of GELU, which is what cuBLASLt computes).
#
# Training's backward products take cuBLASLt's backward epilogues, on one 2-D product with no
# bias, residual or alpha: activation dgelu_tanh multiplies the product by the derivative of
# gelu_tanh at input 4, the GELU's input (the product being the gradient of its output), and
# bias_grad adds a second output, a bias gradient of shape [len]: "a" sums op(A) over k
# (m values), "b" op(B) over k (n values), "out" the result's columns (n values; with
# dgelu_tanh, the bias gradient of the layer whose GELU this is).

ACTIVATIONS = ("none", "relu", "gelu_tanh", "dgelu_tanh")
BIAS_GRADS = ("", "a", "b", "out")


def _fused_shapes(ctx: InferCtx) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shapes = []
    for i, which in ((0, "a"), (1, "b")):
        shape, view = ctx.attr(f"{which}_shape"), ctx.attr(f"{which}_view")
        assert isinstance(shape, tuple) and isinstance(view, tuple)
        if not view:
            x = ctx.shape(i)
            if ctx.attr(f"trans{which.upper()}") and len(x) >= 2:
                x = (*x[:-2], x[-1], x[-2])
            shapes.append(x)
            continue
        shape = tuple(int(d) for d in shape)
        if len(view) != len(shape) + 1 or len(shape) < 2:
            raise ctx.fail(f"{which}_view needs an offset and one stride per axis of {which}_shape")
        offset, strides = int(view[0]), [int(s) for s in view[1:]]
        last = offset + sum((d - 1) * s for d, s in zip(shape, strides, strict=True))
        if offset < 0 or min(strides) < 0 or (math.prod(shape) and last >= math.prod(ctx.shape(i))):
            raise ctx.fail(
                f"{which}_view reads outside its input ({math.prod(ctx.shape(i))} elements)"
            )
        shapes.append(shape)
    return shapes[0], shapes[1]


def _fused_infer(ctx: InferCtx) -> list[TensorType]:
    dt = _check_dtypes(ctx, 0, 1, 2, 3)
    if dt not in _GEMM_TYPES:
        raise ctx.fail(f"computes float32, float16 and bfloat16, not {dt}")
    a, b = _fused_shapes(ctx)
    if len(a) < 2 or len(b) < 2:
        raise ctx.fail(f"operands must have rank >= 2, got {list(a)} and {list(b)}")
    if a[-1] != b[-2]:
        raise ctx.fail(f"inner dimensions differ: {list(a)} @ {list(b)}")
    out = (*broadcast_shapes(ctx, a[:-2], b[:-2]), a[-2], b[-1])
    if ctx.has(2) and math.prod(ctx.shape(2)) != b[-1]:
        raise ctx.fail(f"the bias of shape {list(ctx.shape(2))} must have {b[-1]} elements")
    if ctx.has(3) and ctx.shape(3) != out:
        raise ctx.fail(f"the residual of shape {list(ctx.shape(3))} must be {list(out)}")
    act, bias_grad = ctx.attr("activation"), ctx.attr("bias_grad")
    if act not in ACTIVATIONS:
        raise ctx.fail(f"activation must be one of {', '.join(ACTIVATIONS)}")
    if bias_grad not in BIAS_GRADS:
        raise ctx.fail(f"bias_grad must be one of {', '.join(map(repr, BIAS_GRADS))}")
    if act == "dgelu_tanh" and not ctx.has(4):
        raise ctx.fail("activation dgelu_tanh reads the GELU's input (input 4)")
    if ctx.has(4) and (act != "dgelu_tanh" or ctx.shape(4) != out):
        raise ctx.fail(f"input 4 is dgelu_tanh's GELU input, of the output's shape {list(out)}")
    if act == "dgelu_tanh" or bias_grad:
        if len(out) != 2 or ctx.has(2) or ctx.has(3) or ctx.attr("alpha") != 1.0:
            raise ctx.fail(
                "a backward epilogue (dgelu_tanh, bias_grad) takes one 2-D product with no "
                "bias, residual or alpha"
            )
        if bias_grad == "out" and act != "dgelu_tanh":
            raise ctx.fail("bias_grad 'out' comes with activation dgelu_tanh")
    types = [TensorType(out, dt)]
    if bias_grad:
        types.append(TensorType((out[0] if bias_grad == "a" else out[1],), dt))
    return types


def _view_array(x: np.ndarray, op: Operand) -> np.ndarray:
    flat = np.ascontiguousarray(x).reshape(-1)
    return np.lib.stride_tricks.as_strided(
        flat[op.offset :], op.shape, tuple(s * flat.itemsize for s in op.strides), writeable=False
    )


def gelu_tanh(y: np.ndarray) -> np.ndarray:
    return 0.5 * y * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (y + 0.044715 * y**3)))


def gelu_tanh_grad(x: np.ndarray) -> np.ndarray:
    c, k = np.sqrt(2.0 / np.pi), 0.044715
    t = np.tanh(c * (x + k * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * k * x * x)


def _fused_ref(xs: list[np.ndarray | None], at: Attrs) -> np.ndarray | list[np.ndarray]:
    a, b, bias, res, aux = (*xs, None, None, None)[:5]
    assert a is not None and b is not None
    ops = []
    for x, which in ((a, "a"), (b, "b")):
        view = at[f"{which}_view"]
        assert isinstance(view, tuple)
        if view:
            shape = at[f"{which}_shape"]
            assert isinstance(shape, tuple)
            ops.append(_view_array(x, Operand.from_attr(shape, view)))
        else:
            ops.append(np.swapaxes(x, -1, -2) if at[f"trans{which.upper()}"] else x)
    y = _product(ops[0], ops[1])
    if at["activation"] == "dgelu_tanh" or at["bias_grad"]:
        acc = np.float64 if a.dtype == np.float64 else np.float32
        if aux is not None:
            y = (y.astype(acc) * gelu_tanh_grad(aux.astype(acc))).astype(acc)
        sums = {
            "a": lambda: ops[0].astype(acc).sum(axis=-1),
            "b": lambda: ops[1].astype(acc).sum(axis=-2),
            "out": lambda: np.asarray(y).astype(acc).sum(axis=-2),
        }
        out = np.asarray(y).astype(a.dtype, copy=False)
        if not at["bias_grad"]:
            return out
        return [out, sums[str(at["bias_grad"])]().astype(a.dtype)]
    if at["alpha"] != 1.0:
        y = y * at["alpha"]
    if res is not None:
        y = y + res.astype(y.dtype) * at["beta"]
    if bias is not None:
        y = y + bias.astype(y.dtype).reshape(-1)
    if at["activation"] == "relu":
        y = np.maximum(y, 0)
    elif at["activation"] == "gelu_tanh":
        y = gelu_tanh(y)
    return np.asarray(y).astype(a.dtype, copy=False)


def _backward_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    """A backward epilogue's product split by rows, columns or (without the GELU gradient,
    which is not linear) k; the bias gradient follows what it sums: the split rows of op(A)
    or columns of op(B) are a split of their sums, the sums of one whole operand are whole
    on every device, and a split of what is summed leaves partial sums."""
    ta, tb = bool(ctx.attr("transA")), bool(ctx.attr("transB"))
    a_m, a_k = (1, 0) if ta else (0, 1)
    b_k, b_n = (1, 0) if tb else (0, 1)
    grad, dgelu = str(ctx.attr("bias_grad")), ctx.attr("activation") == "dgelu_tanh"

    def sig(given: dict[int, Sbp], out: Sbp, of: dict[str, Sbp]) -> SbpSignature:
        if dgelu:
            given[4] = out
        return sr.sig(ctx, given, [out, of[grad]] if grad else out, len(outs))

    sigs = [
        sig({0: sr.S(a_m)}, sr.S(0), {"a": sr.S(0), "b": sr.B, "out": sr.P}),
        sig({1: sr.S(b_n)}, sr.S(1), {"a": sr.B, "b": sr.S(0), "out": sr.S(0)}),
    ]
    if not dgelu:
        sigs.append(sig({0: sr.S(a_k), 1: sr.S(b_k)}, sr.P, {"a": sr.P, "b": sr.P}))
    return sigs


def _fused_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    # Splits of the inputs as they are or transposed (transA/transB); a view's offsets and
    # strides are the whole tensor's, so a node with one stays broadcast.
    if ctx.attr("a_view") or ctx.attr("b_view"):
        return []
    if ctx.attr("activation") == "dgelu_tanh" or ctx.attr("bias_grad"):
        return _backward_sbp(ctx, outs)
    ta, tb = bool(ctx.attr("transA")), bool(ctx.attr("transB"))
    ra, rb, ro = len(ctx.shape(0)), len(ctx.shape(1)), len(outs[0].shape)
    a_m, a_k = (ra - 1, ra - 2) if ta else (ra - 2, ra - 1)
    b_k, b_n = (rb - 1, rb - 2) if tb else (rb - 2, rb - 1)
    res = 3 if ctx.has(3) else None

    def with_res(given: dict[int, Sbp], out: Sbp) -> SbpSignature:
        if res is not None:
            given[res] = out
        return sr.sig(ctx, given, out, 1)

    sigs = [with_res({0: sr.S(a_m)}, sr.S(ro - 2))]
    n_split: dict[int, Sbp] = {1: sr.S(b_n)}
    if ctx.has(2):
        n_split[2] = sr.S(len(ctx.shape(2)) - 1)
    sigs.append(with_res(n_split, sr.S(ro - 1)))
    if ctx.attr("activation") == "none":
        # A k split sums partial products: linear only without an activation. A bias and a
        # residual are then taken as P too (one rank adds them, the others add zeros),
        # never B, which every rank would add.
        added = tuple(i for i in (2, 3) if ctx.has(i))
        given: dict[int, Sbp] = {0: sr.S(a_k), 1: sr.S(b_k), **dict.fromkeys(added, sr.P)}
        sigs.append(sr.sig(ctx, given, sr.P, 1))
        sigs += [sr.partial(ctx, outs, (0, *added)), sr.partial(ctx, outs, (1, *added))]
    for j in range(ro - 2):
        if outs[0].shape[j] != 1:
            given = {i: sr.aligned(ctx.shape(i)[:-2], ro - 2, j) for i in (0, 1)}
            sigs.append(with_res(given, sr.S(j)))
    return sigs


def _fused_flops(ins: list[TensorType | None], outs: list[TensorType], at: Attrs) -> int:
    a = ins[0]
    assert a is not None
    shape = at["a_shape"] if at["a_view"] else a.shape[::-1] if at["transA"] else a.shape
    assert isinstance(shape, tuple)
    extra = sum(1 for t in ins[2:] if t is not None) + (at["activation"] != "none")
    sums = 0
    if at["bias_grad"] == "a" or at["bias_grad"] == "b":
        sums = outs[1].numel * int(shape[-1])
    elif at["bias_grad"] == "out":
        sums = outs[0].numel
    return 2 * outs[0].numel * int(shape[-1]) + extra * outs[0].numel + sums


defop(
    "FusedGemm",
    FAMILY,
    infer=_fused_infer,
    reference=_fused_ref,
    attrs={
        "alpha": 1.0,
        "beta": 1.0,
        "activation": "none",
        "transA": 0,
        "transB": 0,
        "a_shape": (),
        "a_view": (),
        "b_shape": (),
        "b_view": (),
        "bias_grad": "",
    },
    inputs=(2, 5),
    outputs=(1, 2),
    flops=_fused_flops,
    sbp=_fused_sbp,
    emit=_fused_emit,
    sized=True,
    library="blas",
    workspace=_flops_workspace(_fused_flops),
    narrow=NARROW,
)


# -- gradients (VJP rules: flowc/ops/grad.py) ---------------------------------------------------


def _matmul_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """Y = A @ B with NumPy's rules: a 1-D A is a row [1, K], a 1-D B a column [K, 1] (their
    axis then dropped from Y); batch axes broadcast. dA = G @ B^T and dB = A^T @ G on the
    promoted shapes, summed over the batch axes an operand broadcast along."""
    g, (x, w) = gouts[0], node.inputs[:2]
    if g is None or x is None or w is None:
        return [None, None]
    xs, ws = x.type.shape, w.type.shape
    x2 = grad.reshape(b, x, (1, *xs)) if len(xs) == 1 else x
    w2 = grad.reshape(b, w, (*ws, 1)) if len(ws) == 1 else w
    gshape = list(g.type.shape)
    if len(xs) == 1:
        gshape.insert(len(gshape) - (0 if len(ws) == 1 else 1), 1)
    if len(ws) == 1:
        gshape.append(1)
    g2 = grad.reshape(b, g, gshape)
    grads: list[Value | None] = [None, None]
    if need[0]:
        dx = grad.op1(b, "MatMul", g2, grad.transpose_last2(b, w2))
        grads[0] = grad.reshape(b, grad.unbroadcast(b, dx, x2.type.shape), xs)
    if need[1] and len(ws) == 2 and len(xs) >= 3:
        # One W for every batch item: one product over all the batch's rows (k = their count),
        # not a batched product of W's size per item summed after.
        rows = math.prod(xs[:-1])
        x_rows = grad.reshape(b, x, (rows, xs[-1]))
        g_rows = grad.reshape(b, g2, (rows, ws[-1]))
        grads[1] = grad.op1(b, "Gemm", x_rows, g_rows, transA=1)
    elif need[1]:
        dw = grad.op1(b, "MatMul", grad.transpose_last2(b, x2), g2)
        grads[1] = grad.reshape(b, grad.unbroadcast(b, dw, w2.type.shape), ws)
    return grads


def _gemm_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """Y = alpha A' B' + beta C (A' = A or A^T, B' likewise): dA' = alpha G B'^T,
    dB' = alpha A'^T G (transposed back where the operand was), dC = beta G summed to C."""
    g = gouts[0]
    x, w = node.inputs[0], node.inputs[1]
    c = node.inputs[2] if len(node.inputs) > 2 else None
    grads: list[Value | None] = [None] * len(node.inputs)
    if g is None or x is None or w is None:
        return grads
    alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
    trans_a, trans_b = int(node.attrs.get("transA", 0)), int(node.attrs.get("transB", 0))
    ga = g if alpha == 1.0 else grad.op1(b, "Mul", g, grad.scalar(b, alpha, g))
    if need[0]:
        # dA' = G B'^T; dA = dA'^T = B' G^T when A was transposed.
        if trans_a:
            grads[0] = grad.op1(b, "Gemm", w, ga, transA=trans_b, transB=1)
        else:
            grads[0] = grad.op1(b, "Gemm", ga, w, transB=1 - trans_b)
    if need[1]:
        # dB' = A'^T G; dB = dB'^T = G^T A' when B was transposed.
        if trans_b:
            grads[1] = grad.op1(b, "Gemm", ga, x, transA=1, transB=trans_a)
        else:
            grads[1] = grad.op1(b, "Gemm", x, ga, transA=1 - trans_a)
    if c is not None and len(need) > 2 and need[2]:
        gc = g if beta == 1.0 else grad.op1(b, "Mul", g, grad.scalar(b, beta, g))
        grads[2] = grad.unbroadcast(b, gc, c.type.shape)
    return grads


set_vjp("MatMul", _matmul_vjp)
set_vjp("Gemm", _gemm_vjp)
