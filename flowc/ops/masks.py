"""Ops whose output element is chosen by comparing its coordinates: Trilu (the input where
the column is on the chosen side of the k-th diagonal, 0 elsewhere), EyeLike (1 on the k-th
diagonal) and OneHot (on where the coordinate along the new axis equals the index). Their
kernels (templates/kernels/index.cu.j2) compute each element from its position alone.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from flowc.codegen.cpp import c_int
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node
from flowc.ir.types import TensorType
from flowc.ops import sbp_rules as sr
from flowc.ops.movement import arg, launch_over, node_input
from flowc.ops.registry import InferCtx, SbpSignature, defop, node_attrs

if TYPE_CHECKING:
    from flowc.codegen.program import Program

FAMILY = "index"


# -- Trilu -------------------------------------------------------------------------------------


def _trilu_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    if x.rank < 2:
        raise ctx.fail(f"needs rank >= 2, got shape {list(x.shape)}")
    if ctx.has(1) and (ctx.type(1).numel != 1 or ctx.dtype(1) != DType.I64):
        raise ctx.fail(f"k must be one int64 value, got {ctx.type(1)}")
    return [x]


def _trilu_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = arg(xs, 0)
    k = int(xs[1].reshape(-1)[0]) if len(xs) > 1 and xs[1] is not None else 0
    return np.triu(x, k) if a["upper"] else np.tril(x, k)


def _trilu_emit(prog: Program, node: Node) -> None:
    x, out = node_input(node, 0), node.outputs[0]
    kv = node.inputs[1] if len(node.inputs) > 1 else None
    k_at = kv is not None and kv.const is None
    k = 0 if kv is None or kv.const is None else int(kv.const.reshape(-1)[0])
    rows, cols = x.type.shape[-2:]
    params = {
        "ctype": prog.ctype(x),
        "upper": bool(node_attrs(node)["upper"]),
        "k": c_int(k, "int64_t"),
        "k_at": k_at,
    }
    if prog.is_sized(node):
        # every dim the run's (a causal mask over seq x seq)
        t, rank = x.type, x.type.rank
        name = prog.kernel(
            "index.cu.j2",
            "trilu",
            **params,
            rows=prog.dim(t, rank - 2),
            cols=prog.dim(t, rank - 1),
            total=prog.numel(t, "sizes"),
        )
        reads = [prog.cptr(x), *([prog.cptr(kv)] if k_at and kv is not None else [])]
        prog.launch_sized(name, prog.numel(t), [*reads, prog.ptr(out)])
        return
    name = prog.kernel("index.cu.j2", "trilu", **params, rows=rows, cols=cols)
    launch_over(prog, name, out, [x, kv if k_at else None])


defop(
    "Trilu",
    FAMILY,
    infer=_trilu_infer,
    reference=_trilu_ref,
    attrs={"upper": 1},
    inputs=(1, 2),
    emit=_trilu_emit,
    sized=True,
    # Batch axes split; zeroing a fixed triangle is linear.
    sbp=lambda ctx, outs: [
        *sr.same_axes(ctx, outs, range(outs[0].rank - 2)),
        sr.partial(ctx, outs),
    ],
)


# -- OneHot, EyeLike ---------------------------------------------------------------------------


def _onehot_depth(depth: np.ndarray) -> int:
    return int(depth.reshape(-1)[0])


def _onehot_infer(ctx: InferCtx) -> list[TensorType]:
    ind, values = ctx.type(0), ctx.type(2)
    depth_arr = ctx.const(1, "depth")
    if depth_arr.size != 1:
        raise ctx.fail(f"depth must be one value, got shape {list(depth_arr.shape)}")
    depth = _onehot_depth(depth_arr)
    if depth < 1:
        raise ctx.fail(f"depth must be positive, got {depth}")
    if values.numel != 2 or values.rank != 1:
        raise ctx.fail(f"values must be a 1-D [off, on] pair, got shape {list(values.shape)}")
    rank = ind.rank + 1
    axis = ctx.axis(ctx.attr("axis"), rank)
    shape = list(ind.shape)
    shape.insert(axis, depth)
    return [TensorType(tuple(shape), values.dtype)]


def _onehot_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    ind, values = arg(xs, 0), arg(xs, 2)
    depth = _onehot_depth(arg(xs, 1))
    axis = a["axis"] % (ind.ndim + 1)
    i = ind.astype(np.int64)  # float indices truncate, as onnxruntime casts them
    i = np.where(i < 0, i + depth, i)  # still out of range: an all-off row
    hot = np.moveaxis(i[..., None] == np.arange(depth), -1, axis)
    return np.where(hot, values[1], values[0]).astype(values.dtype)


def _onehot_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    # The new depth axis sits at ``axis``; the indices' axes keep their order around it.
    axis = ctx.axis(ctx.attr("axis"), outs[0].rank)
    return sr.splits(ctx, outs, ((d, d + (d >= axis)) for d in range(outs[0].rank - 1)))


def _onehot_emit(prog: Program, node: Node) -> None:
    ind, values, out = node_input(node, 0), node_input(node, 2), node.outputs[0]
    dv = node_input(node, 1).const
    assert dv is not None
    axis = node_attrs(node)["axis"] % (ind.type.rank + 1)
    name = prog.kernel(
        "index.cu.j2",
        "onehot",
        itype=prog.ctype(ind),
        ctype=prog.ctype(out),
        depth=_onehot_depth(dv),
        inner=math.prod(ind.type.shape[axis:]),
    )
    launch_over(prog, name, out, [ind, values])


defop(
    "OneHot",
    FAMILY,
    infer=_onehot_infer,
    reference=_onehot_ref,
    attrs={"axis": -1},
    inputs=3,
    emit=_onehot_emit,
    sbp=_onehot_sbp,
)


def _eyelike_dtype(x: np.ndarray | TensorType, a: Attrs) -> DType:
    if a.get("dtype") is not None:
        return DType.from_onnx(int(a["dtype"]))
    return x.dtype if isinstance(x, TensorType) else DType.from_numpy(x.dtype)


def _eyelike_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    if x.rank != 2:
        raise ctx.fail(f"needs a 2-D input, got shape {list(x.shape)}")
    try:
        dtype = _eyelike_dtype(x, ctx.attrs)
    except ValueError as e:
        raise ctx.fail(f"bad 'dtype' attribute: {e}") from None
    return [x.with_dtype(dtype)]


def _eyelike_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = arg(xs, 0)
    rows, cols = x.shape
    return np.eye(rows, cols, k=a["k"], dtype=_eyelike_dtype(x, a).np)


def _eyelike_emit(prog: Program, node: Node) -> None:
    out = node.outputs[0]
    name = prog.kernel(
        "index.cu.j2",
        "eyelike",
        ctype=prog.ctype(out),
        cols=out.type.shape[1],
        k=c_int(int(node_attrs(node)["k"]), "int64_t"),
    )
    launch_over(prog, name, out)


defop(
    "EyeLike",
    FAMILY,
    infer=_eyelike_infer,
    reference=_eyelike_ref,
    attrs={"dtype": None, "k": 0},
    emit=_eyelike_emit,
)
