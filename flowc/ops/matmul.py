"""Matrix products: MatMul (NumPy semantics, batch broadcasting) and Gemm.

MatMul promotes a 1-D first operand to a row and a 1-D second operand to a column, then
drops the added axis from the result, exactly as numpy.matmul does. Gemm keeps alpha, beta
and the transposes as attributes; its C operand broadcasts one way, to (M, N).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs
from flowc.ir.types import TensorType
from flowc.ops.registry import InferCtx, broadcast_shapes, defop

if TYPE_CHECKING:
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
)
