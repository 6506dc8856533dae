"""Normalizations: BatchNormalization (inference form), LayerNormalization,
InstanceNormalization, GroupNormalization, LRN, MeanVarianceNormalization and
LpNormalization.

Statistics are taken in float64 and the result is cast back, so float32 outputs stay well
within onnxruntime's rounding. The BatchNormalization op is the inference form; a node in
training mode (opsets 14+) is imported as the reductions and element-wise ops that compute the
batch statistics and the running-statistics update.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from flowc.codegen.cpp import DIVMOD_LIMIT, c_float, fast_divmod
from flowc.errors import ShapeError
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node
from flowc.ir.types import TensorType
from flowc.ops import grad
from flowc.ops import sbp_rules as sr
from flowc.ops.conv import compute_dtype, float_ctype
from flowc.ops.movement import node_input
from flowc.ops.reduce import vec_width
from flowc.ops.registry import (
    InferCtx,
    SbpSignature,
    defop,
    elementwise_flops,
    ints,
    node_attrs,
    row_major_strides,
    set_vjp,
)

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.builder import AdapterNode
    from flowc.ir.graph import Value

FAMILY = "norm"


def _float_input(ctx: InferCtx, min_rank: int = 2) -> TensorType:
    x = ctx.type(0)
    if not x.dtype.is_float:
        raise ctx.fail(f"needs a floating-point input, got {x.dtype}")
    if x.rank < min_rank:
        what = "N x C" if min_rank == 2 else "N x C x spatial..."
        raise ctx.fail(f"input must be {what}, got shape {list(x.shape)}")
    return x


def _per_channel(ctx: InferCtx, idx: Sequence[int], channels: int, names: Sequence[str]) -> None:
    for i, name in zip(idx, names, strict=True):
        if ctx.shape(i) != (channels,):
            raise ctx.fail(
                f"{name} must have shape [{channels}] (one per channel), got {list(ctx.shape(i))}"
            )
        if not ctx.dtype(i).is_float:
            raise ctx.fail(f"{name} must be floating-point, got {ctx.dtype(i)}")


def _channel_view(v: np.ndarray, rank: int) -> np.ndarray:
    """A per-channel vector shaped to broadcast against an N x C x ... tensor."""
    return v.astype(np.float64).reshape(-1, *([1] * (rank - 2)))


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts one way (NumPy rules) to ``target``."""
    return len(shape) <= len(target) and all(
        d in (1, t) for d, t in zip(shape[::-1], target[::-1], strict=False)
    )


def _req(xs: list[np.ndarray | None], i: int) -> np.ndarray:
    x = xs[i]
    assert x is not None
    return x


# -- code generation (templates/kernels/norm.cu.j2) ----------------------------------------------
# Normalizations over many elements run one block per row, Welford statistics merged by warp
# shuffles (`normalize`); sizes and eps are kernel arguments. BatchNormalization runs per
# plane (runtime sizes, the channel by a precomputed fast division), LRN one thread per element.

MAX_BLOCKS = 1 << 16  # rows beyond this are strided over by the blocks
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y


def offset_expr(var: str, dims: Sequence[tuple[int, int]]) -> str:
    """The offset of flat index ``var`` over axes ``dims`` (size, stride), outermost first:
    sum of coordinate * stride; a stride of 0 (a broadcast axis) adds nothing."""
    merged: list[tuple[int, int]] = []
    for size, stride in dims:
        if size == 1:
            continue
        if merged and merged[-1][1] == size * stride:  # contiguous with the axis before
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    terms = []
    inner = 1
    for k in range(len(merged) - 1, -1, -1):
        size, stride = merged[k]
        if stride:
            coord = var if inner == 1 else f"{var} / {inner}"
            if k > 0:  # the outermost coordinate needs no modulo: var stays in range
                coord = f"({coord}) % {size}" if inner != 1 else f"{var} % {size}"
            terms.append(coord if stride == 1 else f"({coord}) * {stride}")
        inner *= size
    return " + ".join(reversed(terms)) or "0"


def _block_threads(size: int) -> int:
    """A power of two (the shuffles halve it), one warp at least, 256 at most."""
    return min(256, max(32, 1 << max(0, size - 1).bit_length()))


def _emit_normalize(
    prog: Program,
    node: Node,
    rows: int,
    size: int,
    row_offset: str,
    elem_offset: str,
    eps: float,
    affine: tuple[Value | None, str, Value | None, str] = (None, "0", None, "0"),
    stats: Sequence[Value] = (),
    eps_on_std: bool = False,
    sized_rows: tuple[str, str] | None = None,
) -> None:
    """``row_offset`` and ``elem_offset`` (and the affine indices) are C++ expressions of
    ``row``, ``j`` and ``size`` (the kernel's runtime row length). ``sized_rows``: a program
    with symbolic dims, the row count over the kernel's size table and over run()'s."""
    x = node_input(node, 0)
    y = node.outputs[0]
    t = float_ctype(prog, x)
    if rows == 0:
        return
    if size == 0:
        raise prog.fail("cannot normalize over an empty axis")
    scale, scale_index, bias, bias_index = affine
    # 16-byte loads for contiguous float rows whose scale and bias (if any) follow j.
    contiguous = (
        row_offset == "row * size"
        and elem_offset == "j"
        and (scale is None or scale_index == "j")
        and (bias is None or bias_index == "j")
        and all(v is None or v.type.dtype == DType.F32 for v in (scale, bias))
    )
    vec = vec_width(x.type.dtype, size) if contiguous else 1
    block = _block_threads(-(-size // vec))
    name = prog.kernel(
        "norm.cu.j2",
        "normalize",
        ctype=t,
        acc_type=t,
        vec=vec,
        row_offset=row_offset,
        elem_offset=elem_offset,
        eps_on_std=eps_on_std,
        scale_t=float_ctype(prog, scale) if scale is not None else "",
        scale_index=scale_index,
        bias_t=float_ctype(prog, bias) if bias is not None else "",
        bias_index=bias_index,
        mean_t=float_ctype(prog, stats[0]) if len(stats) > 0 else "",
        inv_t=float_ctype(prog, stats[1]) if len(stats) > 1 else "",
        **({"rows_sized": sized_rows[0]} if sized_rows is not None else {}),
    )
    args = [prog.cptr(x)]
    args += [prog.cptr(v) for v in (scale, bias) if v is not None]
    args += [prog.ptr(v) for v in stats]
    if sized_rows is not None:
        args += [prog.ptr(y), "ddims", f"(int64_t){size}", c_float(eps, t)]
        prog.launch_grid(name, [prog.grid(sized_rows[1], 1, MAX_BLOCKS)], block, args)
        return
    args += [prog.ptr(y), f"(int64_t){rows}", f"(int64_t){size}", c_float(eps, t)]
    prog.launch_blocks(name, min(rows, MAX_BLOCKS), block, 0, args)


def _layernorm_emit(prog: Program, node: Node) -> None:
    x = node_input(node, 0)
    a = node_attrs(node)
    shape = x.type.shape
    axis = int(a["axis"]) % len(shape)
    norm = shape[axis:]
    rows, size = math.prod(shape[:axis]), math.prod(norm)

    def index(v: Value | None) -> str:
        if v is None:
            return "0"
        vs = (1,) * (len(norm) - v.type.rank) + v.type.shape
        dims = [
            (n, s if d > 1 else 0) for n, d, s in zip(norm, vs, row_major_strides(vs), strict=True)
        ]
        return offset_expr("j", dims)

    scale = node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    sized_rows = None
    if prog.is_sized(node):
        if any(
            v is not None and v.type.sym is not None and any(v.type.sym[-len(norm) :])
            for v in (x, scale, bias)
        ):
            raise prog.fail("a LayerNormalization over symbolic dims has no kernel yet")
        sized_rows = (prog.count(x.type, 0, axis, "sizes"), prog.count(x.type, 0, axis, "hdims"))
    _emit_normalize(
        prog,
        node,
        rows,
        size,
        "row * size",
        "j",
        float(a["epsilon"]),
        (scale, index(scale), bias, index(bias)),
        node.outputs[1:3],
        sized_rows=sized_rows,
    )


def _instancenorm_emit(prog: Program, node: Node) -> None:
    x = node_input(node, 0)
    n, c = x.type.shape[:2]
    size = math.prod(x.type.shape[2:])
    channel = offset_expr("row", [(n, 0), (c, 1)])
    _emit_normalize(
        prog,
        node,
        n * c,
        size,
        "row * size",
        "j",
        float(node_attrs(node)["epsilon"]),
        (node.inputs[1], channel, node.inputs[2], channel),
    )


def _groupnorm_emit(prog: Program, node: Node) -> None:
    x = node_input(node, 0)
    a = node_attrs(node)
    n, c = x.type.shape[:2]
    groups = int(a["num_groups"])
    spatial = math.prod(x.type.shape[2:])
    size = c // groups * spatial
    # Channel of element j of row (n, g): g * (C / G) + j / spatial.
    parts = [
        offset_expr("row", [(n, 0), (groups, c // groups)]),
        offset_expr("j", [(c // groups, 1), (spatial, 0)]),
    ]
    channel = " + ".join(p for p in parts if p != "0") or "0"
    _emit_normalize(
        prog,
        node,
        n * groups,
        size,
        "row * size",
        "j",
        float(a["epsilon"]),
        (node.inputs[1], channel, node.inputs[2], channel),
    )


def _mvn_emit(prog: Program, node: Node) -> None:
    x = node_input(node, 0)
    shape = x.type.shape
    axes = sorted({int(ax) % len(shape) for ax in node_attrs(node)["axes"]})
    strides = row_major_strides(shape)
    kept = [(shape[k], strides[k]) for k in range(len(shape)) if k not in axes]
    reduced = [(shape[k], strides[k]) for k in axes]
    _emit_normalize(
        prog,
        node,
        math.prod(d for d, _ in kept),
        math.prod(d for d, _ in reduced),
        offset_expr("row", kept),
        offset_expr("j", reduced),
        1e-9,
        eps_on_std=True,
    )


def _batchnorm_emit(prog: Program, node: Node) -> None:
    x = node_input(node, 0)
    y = node.outputs[0]
    t = float_ctype(prog, x)
    params = [node.inputs[i] for i in range(1, 5)]
    types = []
    for v in params:
        assert v is not None
        types.append(float_ctype(prog, v))
    if y.type.numel == 0:
        return
    channels = x.type.shape[1]
    inner = math.prod(x.type.shape[2:])
    planes = math.prod(x.type.shape[:2])
    if planes >= DIVMOD_LIMIT:
        raise prog.fail(f"{planes} planes (N x C) are more than the 2^31 this kernel indexes")
    vec = vec_width(x.type.dtype, inner)
    name = prog.kernel(
        "norm.cu.j2",
        "batch_norm",
        ctype=t,
        acc_type=t,
        scale_t=types[0],
        bias_t=types[1],
        mean_t=types[2],
        var_t=types[3],
        vec=vec,
    )
    # Threads across a plane (a warp at least), planes along y; x-blocks only as many as
    # one plane needs.
    items = -(-inner // vec)
    threads = _block_threads(items)
    grid_x = min(-(-items // threads), MAX_BLOCKS)
    grid_y = min(planes, MAX_GRID_Y)
    args = [prog.cptr(x), *(prog.cptr(v) for v in params if v is not None), prog.ptr(y)]
    args += [
        f"(int64_t){planes}",
        f"(int64_t){inner}",
        fast_divmod(channels),
        c_float(float(node_attrs(node)["epsilon"]), t),
    ]
    prog.launch_grid(name, [grid_x, grid_y], threads, args)


def _lrn_emit(prog: Program, node: Node) -> None:
    x = node_input(node, 0)
    y = node.outputs[0]
    t = float_ctype(prog, x)
    a = node_attrs(node)
    size = int(a["size"])
    name = prog.kernel(
        "norm.cu.j2",
        "lrn",
        ctype=t,
        acc_type=t,
        inner=math.prod(x.type.shape[2:]),
        channels=x.type.shape[1],
        before=(size - 1) // 2,
        after=size - 1 - (size - 1) // 2,
        alpha_over_size=c_float(float(a["alpha"]) / size, t),
        beta=c_float(float(a["beta"]), t),
        bias=c_float(float(a["bias"]), t),
    )
    n = y.type.numel
    prog.launch(name, n, [prog.cptr(x), prog.ptr(y), f"(int64_t){n}"])


# -- BatchNormalization ---------------------------------------------------------------------------


def _batchnorm_infer(ctx: InferCtx) -> list[TensorType]:
    if ctx.attr("training_mode"):
        raise ctx.fail(
            "training_mode=1 is not supported: flowc compiles inference graphs; export the "
            "model in evaluation mode"
        )
    if ctx.num_outputs > 1:
        raise ctx.fail("only the inference form (one output, Y) is supported")
    x = _float_input(ctx)
    _per_channel(ctx, range(1, 5), x.shape[1], ("scale", "B", "input_mean", "input_var"))
    return [x]


def _channel_sbp(ctx: InferCtx, outs: list[TensorType], free: Iterable[int]) -> list[SbpSignature]:
    """Per-channel parameters (every input but X) follow a channel split and are B under the
    splits of ``free`` (axes other than the channel's that the statistics do not span)."""
    params = dict.fromkeys(range(1, ctx.num_inputs), sr.S(0))
    return [sr.sig(ctx, {0: sr.S(1), **params}, sr.S(1), 1), *sr.same_axes(ctx, outs, free)]


def _batchnorm_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    # The statistics are inputs (inference form): no axis is normalized over.
    return _channel_sbp(ctx, outs, (d for d in range(outs[0].rank) if d != 1))


def _batchnorm_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = _req(xs, 0)
    scale, bias, mean, var = (_channel_view(_req(xs, i), x.ndim) for i in range(1, 5))
    # Fold the statistics once (in float64), then one pass over x in its own precision.
    inv = scale / np.sqrt(var + a["epsilon"])
    ct = compute_dtype(x.dtype)
    y = (x.astype(ct, copy=False) - mean.astype(ct)) * inv.astype(ct) + bias.astype(ct)
    return y.astype(x.dtype, copy=False)


def _batchnorm_import(n: AdapterNode) -> list[Value] | None:
    # is_test and consumed_inputs (opsets < 7) describe training bookkeeping; spatial=1 (the
    # default before opset 9) is the per-channel form every later opset uses.
    if int(n.attrs.get("spatial", 1)) == 0:
        raise ShapeError(
            f"BatchNormalization node {n.name!r}: spatial=0 (statistics per element, not per "
            "channel) is not supported",
            hint="re-export the model with opset 9 or newer",
        )
    for attr in ("spatial", "is_test", "consumed_inputs"):
        n.attrs.pop(attr, None)
    if n.builder.training:
        # A model imported to train it: batch statistics whatever the export's mode, the
        # running statistics the step's state (flowc.training.step lowers the op).
        attrs: dict[str, Any] = {k: n.attrs[k] for k in ("epsilon", "momentum") if k in n.attrs}
        return n.emit("TrainBatchNorm", n.inputs, attrs, num_outputs=3)
    if n.opset >= 14 and int(n.attrs.get("training_mode", 0)):
        return _batchnorm_training(n)
    if len(n.output_names) == 1:
        return None
    if any(n.output_names[1:]):
        raise ShapeError(
            f"BatchNormalization node {n.name!r}: outputs {n.output_names[1:]} are "
            "training-mode statistics; flowc supports the inference form (Y only)",
            hint="export the model in evaluation mode",
        )
    return n.emit("BatchNormalization", n.inputs, n.attrs, output_names=n.output_names[:1])


def _batchnorm_training(n: AdapterNode, unbiased: bool = False) -> list[Value]:
    """training_mode=1 (opsets 14+): normalize with the batch's own statistics (population
    variance over every axis but the channel) and return the updated running mean and
    variance, input * momentum + batch * (1 - momentum). Imported as the reductions and
    element-wise ops it is made of, so nothing new needs a kernel. ``unbiased``: the running
    variance takes the batch's unbiased variance (x n / (n - 1)), as PyTorch keeps it (and
    TrainBatchNorm)."""
    x, scale, bias, mean, var = (n.input(i) for i in range(5))
    assert x is not None and scale is not None and bias is not None
    assert mean is not None and var is not None
    rank, c = x.type.rank, x.type.shape[1]
    dt = x.type.dtype.np
    axes = n.const("axes", np.array([d for d in range(rank) if d != 1], np.int64))
    per_channel = n.const("per_channel", np.array([c] + [1] * (rank - 2), np.int64))
    momentum = float(n.attrs.get("momentum", 0.9))
    eps = float(n.attrs.get("epsilon", 1e-5))

    def emit(op: str, ins: list[Value | None], attrs: dict[str, Any] | None = None) -> Value:
        return n.emit(op, ins, attrs or {}, suffix=op.lower())[0]

    batch_mean = emit("ReduceMean", [x, axes], {"keepdims": 1})
    centered = emit("Sub", [x, batch_mean])
    batch_var = emit("ReduceMean", [emit("Mul", [centered, centered]), axes], {"keepdims": 1})
    inv = emit("Reciprocal", [emit("Sqrt", [emit("Add", [batch_var, n.const("eps", eps, dt)])])])
    (y,) = n.emit(
        "Add",
        [
            emit("Mul", [emit("Mul", [centered, inv]), emit("Reshape", [scale, per_channel])]),
            emit("Reshape", [bias, per_channel]),
        ],
        suffix="y",
        output_names=n.output_names[:1],
    )
    outs = [y]
    flat = n.const("flat", np.array([c], np.int64))
    for k, (running, batch) in enumerate(((mean, batch_mean), (var, batch_var)), start=1):
        if len(n.output_names) <= k or not n.output_names[k]:
            break
        keep = emit("Mul", [running, n.const("momentum", momentum, dt)])
        rest = 1.0 - momentum
        if unbiased and k == 2:
            count = x.type.numel // c
            rest *= count / (count - 1)
        new = emit("Mul", [emit("Reshape", [batch, flat]), n.const("rest", rest, dt)])
        outs += n.emit("Add", [keep, new], suffix=f"running{k}", output_names=[n.output_names[k]])
    return outs


defop(
    "BatchNormalization",
    FAMILY,
    infer=_batchnorm_infer,
    reference=_batchnorm_ref,
    attrs={"epsilon": 1e-5, "momentum": 0.9, "training_mode": 0},
    inputs=5,
    flops=elementwise_flops(2),
    sbp=_batchnorm_sbp,
    onnx_import=_batchnorm_import,
    emit=_batchnorm_emit,
)


# -- TrainBatchNorm ------------------------------------------------------------------------------
# BatchNormalization as a training step runs it (a model imported to train it, any export
# mode): Y from the batch's statistics, and the running mean and variance's next values,
# running * momentum + batch * (1 - momentum), the variance's unbiased as PyTorch keeps it.
# Inputs X, scale, B, running mean, running variance; outputs Y, the two next values. It
# has no kernel: the training step lowers it to its reductions and element-wise ops
# (lower_train_batchnorms), and the step's inference program runs BatchNormalization.

TRAIN_BN_ATTRS = {"epsilon": 1e-5, "momentum": 0.9}


def _train_bn_infer(ctx: InferCtx) -> list[TensorType]:
    x = _float_input(ctx)
    _per_channel(ctx, range(1, 5), x.shape[1], ("scale", "B", "running_mean", "running_var"))
    if x.shape[1] and x.numel // x.shape[1] < 2:
        raise ctx.fail(
            f"training needs more than one value per channel (shape {list(x.shape)}): the "
            "batch's variance is undefined"
        )
    return [x, ctx.type(3), ctx.type(4)]


def _train_bn_ref(xs: list[np.ndarray | None], a: Attrs) -> list[np.ndarray]:
    x = _req(xs, 0)
    scale, bias, mean, var = (_req(xs, i) for i in range(1, 5))
    axes = tuple(d for d in range(x.ndim) if d != 1)
    x64 = x.astype(np.float64)
    bm, bv = x64.mean(axis=axes), x64.var(axis=axes)
    view = (-1, *([1] * (x.ndim - 2)))
    y = (x64 - bm.reshape(view)) / np.sqrt(bv.reshape(view) + a["epsilon"])
    y = y * scale.astype(np.float64).reshape(view) + bias.astype(np.float64).reshape(view)
    count = x.size // x.shape[1]
    m = float(a["momentum"])
    new_mean = mean.astype(np.float64) * m + bm * (1 - m)
    new_var = var.astype(np.float64) * m + bv * count / (count - 1) * (1 - m)
    return [y.astype(x.dtype), new_mean.astype(mean.dtype), new_var.astype(var.dtype)]


defop(
    "TrainBatchNorm",
    FAMILY,
    infer=_train_bn_infer,
    reference=_train_bn_ref,
    attrs=TRAIN_BN_ATTRS,
    inputs=5,
    outputs=3,
)


def lower_train_batchnorm(n: AdapterNode) -> list[Value]:
    """A TrainBatchNorm node (as an AdapterNode: its inputs and attributes) as its reductions
    and element-wise ops: Y and the two running statistics' next values. The training step
    lowers each one after keeping the forward it infers with (flowc.training.step)."""
    n.attrs = {**TRAIN_BN_ATTRS, **n.attrs, "training_mode": 1}
    return _batchnorm_training(n, unbiased=True)


# -- LayerNormalization ---------------------------------------------------------------------------


def _layernorm_infer(ctx: InferCtx) -> list[TensorType]:
    x = _float_input(ctx, 1)
    axis = ctx.axis(int(ctx.attr("axis")), x.rank)
    norm = x.shape[axis:]
    for i, name in ((1, "Scale"), (2, "B")):
        if ctx.has(i) and not _broadcasts_to(ctx.shape(i), norm):
            raise ctx.fail(
                f"{name} of shape {list(ctx.shape(i))} does not broadcast to the normalized "
                f"shape {list(norm)} (axis {axis})"
            )
    try:
        stash = DType.from_onnx(int(ctx.attr("stash_type")))
    except ValueError as e:
        raise ctx.fail(f"bad stash_type: {e}") from None
    if ctx.num_outputs > 3:
        raise ctx.fail(f"has at most 3 outputs (Y, Mean, InvStdDev), got {ctx.num_outputs}")
    stats = TensorType((*x.shape[:axis], *([1] * (x.rank - axis))), stash)
    return [x, stats, stats][: max(ctx.num_outputs, 1)]


def _layernorm_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    # Y and the statistics (same rank, size 1 on the normalized axes) split alike.
    return sr.same_axes(ctx, outs, range(ctx.axis(int(ctx.attr("axis")), outs[0].rank)))


def _layernorm_ref(xs: list[np.ndarray | None], a: Attrs) -> list[np.ndarray]:
    x = _req(xs, 0)
    axis = int(a["axis"]) % x.ndim
    axes = tuple(range(axis, x.ndim))
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=axes, keepdims=True)
    centered = x64 - mean
    inv = 1.0 / np.sqrt((centered * centered).mean(axis=axes, keepdims=True) + a["epsilon"])
    y = centered * inv * _req(xs, 1).astype(np.float64)
    if len(xs) > 2 and xs[2] is not None:
        y = y + xs[2].astype(np.float64)
    stash = DType.from_onnx(int(a["stash_type"])).np
    return [y.astype(x.dtype), mean.astype(stash), inv.astype(stash)]


defop(
    "LayerNormalization",
    FAMILY,
    infer=_layernorm_infer,
    reference=_layernorm_ref,
    attrs={"axis": -1, "epsilon": 1e-5, "stash_type": 1},
    inputs=(2, 3),
    outputs=(1, 3),
    flops=elementwise_flops(8),
    sbp=_layernorm_sbp,
    emit=_layernorm_emit,
    sized=True,
)


# -- InstanceNormalization and GroupNormalization -------------------------------------------------


def _normalize(x: np.ndarray, axes: tuple[int, ...], eps: float) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) over ``axes``, in float64."""
    x64 = x.astype(np.float64)
    centered = x64 - x64.mean(axis=axes, keepdims=True)
    var = (centered * centered).mean(axis=axes, keepdims=True)
    return centered / np.sqrt(var + eps)


def _instancenorm_infer(ctx: InferCtx) -> list[TensorType]:
    x = _float_input(ctx, 3)
    _per_channel(ctx, (1, 2), x.shape[1], ("scale", "B"))
    return [x]


def _instancenorm_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = _req(xs, 0)
    y = _normalize(x, tuple(range(2, x.ndim)), a["epsilon"])
    y = y * _channel_view(_req(xs, 1), x.ndim) + _channel_view(_req(xs, 2), x.ndim)
    return y.astype(x.dtype)


defop(
    "InstanceNormalization",
    FAMILY,
    infer=_instancenorm_infer,
    reference=_instancenorm_ref,
    attrs={"epsilon": 1e-5},
    inputs=3,
    flops=elementwise_flops(6),
    sbp=lambda ctx, outs: _channel_sbp(ctx, outs, (0,)),
    emit=_instancenorm_emit,
)


def _groupnorm_infer(ctx: InferCtx) -> list[TensorType]:
    x = _float_input(ctx, 3)
    if "num_groups" not in ctx.attrs:
        raise ctx.fail("the num_groups attribute is required")
    groups = int(ctx.attr("num_groups"))
    if groups < 1 or x.shape[1] % groups:
        raise ctx.fail(f"num_groups {groups} must divide the {x.shape[1]} channels")
    _per_channel(ctx, (1, 2), x.shape[1], ("scale", "bias"))
    return [x]


def _groupnorm_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = _req(xs, 0)
    n, c = x.shape[:2]
    g = int(a["num_groups"])
    grouped = x.reshape(n, g, c // g, -1)
    y = _normalize(grouped, (2, 3), a["epsilon"]).reshape(x.shape)
    y = y * _channel_view(_req(xs, 1), x.ndim) + _channel_view(_req(xs, 2), x.ndim)
    return y.astype(x.dtype)


def _groupnorm_import(n: AdapterNode) -> None:
    if n.opset >= 21:
        return
    # Opset 18 gives scale and bias per group; the canonical (opset 21) form is per channel,
    # each channel taking its group's value.
    x = n.input(0)
    assert x is not None
    groups = int(n.attrs.get("num_groups", 0))
    channels = x.type.shape[1] if x.type.rank > 1 else 0
    if groups < 1 or channels % groups:
        raise ShapeError(
            f"GroupNormalization node {n.name!r}: num_groups {groups} must divide the "
            f"{channels} channels"
        )
    index = n.const("group_of_channel", np.repeat(np.arange(groups), channels // groups))
    for i, name in ((1, "scale"), (2, "bias")):
        v = n.input(i)
        assert v is not None
        if v.type.shape != (groups,):
            raise ShapeError(
                f"GroupNormalization node {n.name!r}: opset {n.opset} wants {name} of shape "
                f"[{groups}] (one per group), got {list(v.type.shape)}"
            )
        if v.const is not None:
            n.set_input(i, n.const(name, np.repeat(v.const, channels // groups)))
        else:
            n.set_input(i, n.emit("Gather", [v, index], {"axis": 0}, suffix=name)[0])


defop(
    "GroupNormalization",
    FAMILY,
    infer=_groupnorm_infer,
    reference=_groupnorm_ref,
    attrs={"epsilon": 1e-5, "num_groups": None, "stash_type": 1},
    inputs=3,
    flops=elementwise_flops(6),
    # A channel split would need a local num_groups; batch entries are independent.
    sbp=lambda ctx, outs: sr.same_axes(ctx, outs, (0,)),
    onnx_import=_groupnorm_import,
    emit=_groupnorm_emit,
)


# -- LRN and MeanVarianceNormalization ----------------------------------------------------------


def _lrn_infer(ctx: InferCtx) -> list[TensorType]:
    x = _float_input(ctx, 3)
    if "size" not in ctx.attrs:
        raise ctx.fail("the size attribute is required")
    if int(ctx.attr("size")) < 1:
        raise ctx.fail(f"size must be positive, got {ctx.attr('size')}")
    return [x]


def _lrn_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = _req(xs, 0)
    size = int(a["size"])
    x64 = x.astype(np.float64)
    # The window over channels runs from c - floor((size-1)/2) to c + ceil((size-1)/2).
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    padded = np.pad(x64 * x64, [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2))
    square_sum = sliding_window_view(padded, size, axis=1).sum(axis=-1)
    y = x64 / (a["bias"] + a["alpha"] / size * square_sum) ** a["beta"]
    return y.astype(x.dtype)


defop(
    "LRN",
    FAMILY,
    infer=_lrn_infer,
    reference=_lrn_ref,
    attrs={"alpha": 1e-4, "beta": 0.75, "bias": 1.0, "size": None},
    flops=elementwise_flops(8),
    # The window runs over channels only.
    sbp=lambda ctx, outs: sr.same_axes(ctx, outs, (d for d in range(outs[0].rank) if d != 1)),
    emit=_lrn_emit,
)


def _mvn_infer(ctx: InferCtx) -> list[TensorType]:
    x = _float_input(ctx, 1)
    axes = [ctx.axis(ax, x.rank, "axes entry") for ax in ints(ctx.attr("axes"))]
    if len(set(axes)) != len(axes):
        raise ctx.fail(f"axes {list(ctx.attr('axes'))} repeat an axis")
    return [x]


def _mvn_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    rank = outs[0].rank
    axes = {int(a) % rank for a in ctx.attr("axes")}
    return sr.same_axes(ctx, outs, (d for d in range(rank) if d not in axes))


def _mvn_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = _req(xs, 0)
    axes = tuple(int(ax) % x.ndim for ax in a["axes"])
    x64 = x.astype(np.float64)
    centered = x64 - x64.mean(axis=axes, keepdims=True)
    std = np.sqrt((centered * centered).mean(axis=axes, keepdims=True))
    # ONNX adds its epsilon (1e-9) to the standard deviation, not to the variance.
    return (centered / (std + 1e-9)).astype(x.dtype)


defop(
    "MeanVarianceNormalization",
    FAMILY,
    infer=_mvn_infer,
    reference=_mvn_ref,
    attrs={"axes": (0, 2, 3)},
    flops=elementwise_flops(6),
    sbp=_mvn_sbp,
    emit=_mvn_emit,
)


# -- LpNormalization ------------------------------------------------------------------------------


def _lpnorm_axis(ctx: InferCtx) -> int:
    p = ctx.attr("p")
    if p not in (1, 2):
        raise ctx.fail(f"p must be 1 or 2, got {p!r}")
    return ctx.axis(int(ctx.attr("axis")), ctx.type(0).rank)


def _lpnorm_infer(ctx: InferCtx) -> list[TensorType]:
    x = _float_input(ctx, 1)
    _lpnorm_axis(ctx)
    return [x]


def _lpnorm_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    axis = _lpnorm_axis(ctx)
    return sr.same_axes(ctx, outs, (d for d in range(outs[0].rank) if d != axis))


def _lpnorm_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = _req(xs, 0)
    axis = int(a["axis"]) % x.ndim
    x64 = x.astype(np.float64)
    if a["p"] == 1:
        norm = np.abs(x64).sum(axis=axis, keepdims=True)
    else:
        norm = np.sqrt((x64 * x64).sum(axis=axis, keepdims=True))
    # A zero norm (an all-zero line) gives zeros, not NaN, as the specification says.
    safe = np.where(norm == 0, 1.0, norm)
    return np.where(norm == 0, 0.0, x64 / safe).astype(x.dtype)


def _lpnorm_emit(prog: Program, node: Node) -> None:
    x = node_input(node, 0)
    y = node.outputs[0]
    t = float_ctype(prog, x)
    a = node_attrs(node)
    shape = x.type.shape
    axis = int(a["axis"]) % len(shape)
    outer, size = math.prod(shape[:axis]), shape[axis]
    inner = math.prod(shape[axis + 1 :])
    rows = outer * inner
    if rows == 0 or size == 0:
        return
    block = _block_threads(size)
    name = prog.kernel(
        "norm.cu.j2",
        "lp_normalize",
        ctype=t,
        acc_type=t,
        rows=rows,
        size=size,
        row_offset=offset_expr("row", [(outer, size * inner), (inner, 1)]),
        elem_offset=offset_expr("j", [(size, inner)]),
        p=int(a["p"]),
    )
    prog.launch_blocks(name, min(rows, MAX_BLOCKS), block, 0, [prog.cptr(x), prog.ptr(y)])


defop(
    "LpNormalization",
    FAMILY,
    infer=_lpnorm_infer,
    reference=_lpnorm_ref,
    attrs={"axis": -1, "p": 2},
    flops=elementwise_flops(3),
    sbp=_lpnorm_sbp,
    emit=_lpnorm_emit,
)


# -- gradients (VJP rules: flowc/ops/grad.py) ---------------------------------------------------


def _normalized_grad(
    b: grad.GradBuilder, gs: Value, x: Value, axes: list[int], eps: float, want_dx: bool
) -> tuple[Value | None, Value]:
    """For xhat = (x - mean) rstd over ``axes`` and ``gs`` the gradient reaching xhat (the
    output's times the scale): dx = rstd (gs - mean(gs) - xhat mean(gs xhat)) (when asked)
    and xhat, the statistics recomputed from x (the forward's Mean and InvStdDev outputs
    carry no gradient)."""
    ax = grad.ints(b, axes)
    mean = grad.op1(b, "ReduceMean", x, ax, keepdims=1)
    centered = grad.op1(b, "Sub", x, mean)
    var = grad.op1(b, "ReduceMean", grad.op1(b, "Mul", centered, centered), ax, keepdims=1)
    rstd = grad.op1(
        b, "Reciprocal", grad.op1(b, "Sqrt", grad.op1(b, "Add", var, grad.scalar(b, eps, x)))
    )
    xhat = grad.op1(b, "Mul", centered, rstd)
    if not want_dx:
        return None, xhat
    m1 = grad.op1(b, "ReduceMean", gs, ax, keepdims=1)
    m2 = grad.op1(b, "ReduceMean", grad.op1(b, "Mul", gs, xhat), ax, keepdims=1)
    inner = grad.op1(b, "Sub", grad.op1(b, "Sub", gs, m1), grad.op1(b, "Mul", xhat, m2))
    return grad.op1(b, "Mul", rstd, inner), xhat


def _layernorm_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """Y = xhat * scale + B with xhat over the axes from ``axis`` (_normalized_grad); dscale
    and dB are G xhat and G summed to their shapes."""
    g = gouts[0]
    x, scale = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    grads: list[Value | None] = [None] * len(node.inputs)
    if g is None or x is None or scale is None:
        return grads
    rank = x.type.rank
    axes = list(range(int(node.attrs.get("axis", -1)) % rank, rank))
    eps = float(node.attrs.get("epsilon", 1e-5))
    gs = grad.op1(b, "Mul", g, scale)
    grads[0], xhat = _normalized_grad(b, gs, x, axes, eps, need[0])
    if need[1]:
        grads[1] = grad.unbroadcast(b, grad.op1(b, "Mul", g, xhat), scale.type.shape)
    if bias is not None and need[2]:
        grads[2] = grad.unbroadcast(b, g, bias.type.shape)
    return grads


def _channel_norm_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """InstanceNormalization (each channel of each example over its spatial axes) and
    GroupNormalization (each group of channels of each example): xhat over those elements,
    Y = xhat * scale[c] + B[c]; dx through _normalized_grad on x seen as (N, groups, rest),
    dscale and dB are G xhat and G summed over all but the channels."""
    g = gouts[0]
    x, scale, bias = node.inputs[0], node.inputs[1], node.inputs[2]
    grads: list[Value | None] = [None] * len(node.inputs)
    if g is None or x is None or scale is None:
        return grads
    a = node_attrs(node)
    xs = x.type.shape
    n, c = xs[0], xs[1]
    groups = c if node.op == "InstanceNormalization" else int(a["num_groups"])
    eps = float(a["epsilon"])
    view = grad.reshape(b, scale, [c, *([1] * (len(xs) - 2))])
    flat = [n, groups, math.prod(xs[1:]) // groups]
    gs = grad.reshape(b, grad.op1(b, "Mul", g, view), flat)
    dx, xhat = _normalized_grad(b, gs, grad.reshape(b, x, flat), [2], eps, need[0])
    if dx is not None:
        grads[0] = grad.reshape(b, dx, list(xs))
    others = [0, *range(2, len(xs))]
    if need[1]:
        gx = grad.op1(b, "Mul", g, grad.reshape(b, xhat, list(xs)))
        grads[1] = grad.reduce_sum(b, gx, others, keepdims=False)
    if bias is not None and need[2]:
        grads[2] = grad.reduce_sum(b, g, others, keepdims=False)
    return grads


def _channel_window_sum(b: grad.GradBuilder, t: Value, size: int, before: int) -> Value:
    """t's sums over a window of ``size`` channels starting ``before`` channels back (LRN's
    square sums; the other way round, their adjoint): one Conv by ones over t seen as
    (N, 1, C, rest)."""
    shape = list(t.type.shape)
    flat = grad.reshape(b, t, [shape[0], 1, shape[1], math.prod(shape[2:])])
    ones = b.const(np.ones((1, 1, size, 1), t.type.dtype.np), "channel_window")
    s = grad.op1(b, "Conv", flat, ones, pads=[before, 0, size - 1 - before, 0])
    return grad.reshape(b, s, shape)


def _lrn_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """y = x d^-beta with d = bias + alpha/size S and S the window sums of x^2 over channels:
    dx = g d^-beta - (2 alpha beta / size) x W'(g x d^(-beta-1)), W' the window's adjoint (the
    same sums with the window mirrored)."""
    g, x = gouts[0], node.inputs[0]
    if g is None or x is None or not need[0]:
        return [None]
    a = node_attrs(node)
    size, alpha, beta = int(a["size"]), float(a["alpha"]), float(a["beta"])
    before = (size - 1) // 2
    squares = _channel_window_sum(b, grad.op1(b, "Mul", x, x), size, before)
    d = grad.op1(
        b,
        "Add",
        grad.op1(b, "Mul", squares, grad.scalar(b, alpha / size, x)),
        grad.scalar(b, float(a["bias"]), x),
    )
    d_beta = grad.op1(b, "Pow", d, grad.scalar(b, -beta, x))
    direct = grad.op1(b, "Mul", g, d_beta)
    inner = grad.op1(b, "Div", grad.op1(b, "Mul", grad.op1(b, "Mul", g, x), d_beta), d)
    spread = _channel_window_sum(b, inner, size, size - 1 - before)
    coef = grad.scalar(b, -2.0 * alpha * beta / size, x)
    return [grad.op1(b, "Add", direct, grad.op1(b, "Mul", coef, grad.op1(b, "Mul", x, spread)))]


set_vjp("LayerNormalization", _layernorm_vjp)
set_vjp("LRN", _lrn_vjp)
set_vjp("InstanceNormalization", _channel_norm_vjp)
set_vjp("GroupNormalization", _channel_norm_vjp)
