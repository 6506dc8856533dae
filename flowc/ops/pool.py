"""Pooling: MaxPool (with ONNX's flat Indices), AveragePool, LpPool and the global forms.

Every windowed pool reduces a strided view of the padded input (see ``conv.window_view``)
over its kernel axes, so there is no Python loop over output positions. Window geometry
(auto_pad, ceil_mode, dilations) is shared with Conv; a window that ceil_mode lets run past
the end padding covers nothing there: it is neither a max candidate nor counted by the mean.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from flowc.codegen.cpp import CTYPES, c_float
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node
from flowc.ir.types import TensorType
from flowc.ops import grad
from flowc.ops import sbp_rules as sr
from flowc.ops.conv import (
    Window,
    compute_dtype,
    flat_index,
    float_ctype,
    spread_back,
    window,
    window_view,
)
from flowc.ops.movement import node_input
from flowc.ops.registry import (
    EmitFn,
    InferCtx,
    InferFn,
    RefFn,
    SbpFn,
    SbpSignature,
    defop,
    node_attrs,
    set_vjp,
)

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.graph import Value

FAMILY = "pool"

_WINDOW_ATTRS = {
    "auto_pad": "NOTSET",
    "ceil_mode": 0,
    "dilations": None,
    "kernel_shape": None,
    "pads": None,
    "strides": None,
}

_MAXPOOL_TYPES = frozenset({DType.F16, DType.F32, DType.F64, DType.BF16, DType.I8, DType.U8})


def _geometry(shape: tuple[int, ...], a: Attrs) -> Window:
    return window(shape[2:], a["kernel_shape"], a, ceil_mode=bool(a["ceil_mode"]))


def _window_infer(ctx: InferCtx, allowed: Callable[[DType], bool]) -> Window:
    x = ctx.type(0)
    if not allowed(x.dtype):
        raise ctx.fail(f"does not support element type {x.dtype}")
    if x.rank < 3:
        raise ctx.fail(f"input must be N x C x spatial..., got shape {list(x.shape)}")
    if "kernel_shape" not in ctx.attrs:
        raise ctx.fail("the kernel_shape attribute is required")
    if ctx.attr("ceil_mode") not in (0, 1):
        raise ctx.fail(f"ceil_mode must be 0 or 1, got {ctx.attr('ceil_mode')}")
    return ctx.check(_geometry, x.shape, ctx.attrs)


def _is_float(dt: DType) -> bool:
    return dt.is_float


def _pool_flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    return outs[0].numel * math.prod(a["kernel_shape"])


def _kernel_axes(nd: int) -> tuple[int, ...]:
    return tuple(range(-nd, 0))


def _taps_inside(spatial: tuple[int, ...], w: Window, keep: tuple[int, ...]) -> np.ndarray:
    """Per output position, how many kernel taps land on the input grown by ``keep``.

    ``keep`` holds the begin then end pads that count as input (all of them with
    count_include_pad, none without); spatial-only, so it is cheap.
    """
    nd = len(spatial)
    keep_begin, keep_end = keep[:nd], keep[nd:]
    ones = np.ones([n + b + e for n, b, e in zip(spatial, keep_begin, keep_end, strict=True)])
    rest = tuple(p - k for p, k in zip(w.pad_begin, keep_begin, strict=True))
    view = window_view(ones, dataclasses.replace(w, pad_begin=rest), 0.0)
    return view.sum(axis=_kernel_axes(nd))


# -- code generation (templates/kernels/pool.cu.j2: one thread per output element) -------------


def _window_params(node: Node) -> tuple[Window, dict[str, object]]:
    x = node_input(node, 0)
    geo = _geometry(x.type.shape, node_attrs(node))
    spatial = x.type.shape[2:]
    nd = len(spatial)
    return geo, {
        "out": list(geo.out),
        "spatial": list(spatial),
        "kernel": list(geo.kernel),
        "strides": list(geo.strides),
        "dilations": list(geo.dilations),
        "pads": list(geo.pad_begin),
        "x_index": flat_index([f"i{d}" for d in range(nd)], spatial),
    }


def _maxpool_emit(prog: Program, node: Node) -> None:
    x = node_input(node, 0)
    y = node.outputs[0]
    t = CTYPES.get(x.type.dtype)
    if t not in ("float", "double", "int8_t", "uint8_t"):
        raise prog.fail(f"element type {x.type.dtype} has no kernel yet")
    geo, params = _window_params(node)
    nd = len(geo.out)
    spatial = x.type.shape[2:]
    if x.type.dtype.is_float:
        lowest = c_float(-math.inf, t)
    else:
        lowest = f"static_cast<{t}>({int(np.iinfo(x.type.dtype.np).min)})"
    with_indices = len(node.outputs) > 1
    names = [f"b{d}" for d in range(nd)]
    if int(node_attrs(node)["storage_order"]) == 1:  # column-major spatial positions
        index = flat_index(names[::-1], spatial[::-1])
    else:
        index = flat_index(names, spatial)
    name = prog.kernel(
        "pool.cu.j2",
        "max_pool",
        ctype=t,
        lo=[0] * nd,
        lowest=lowest,
        with_indices=with_indices,
        index_expr=index,
        **params,
    )
    outs = [prog.ptr(o) for o in node.outputs[:2]]
    prog.launch_numel(name, y.type, [prog.cptr(x), *outs])


def _sum_pool_emit(prog: Program, node: Node) -> None:
    x = node_input(node, 0)
    y = node.outputs[0]
    t = float_ctype(prog, x)
    a = node_attrs(node)
    geo, params = _window_params(node)
    spatial = x.type.shape[2:]
    if node.op == "AveragePool":
        mode, p, acc = "avg", 1, t
        keep = bool(a["count_include_pad"])
    else:
        # flowc's reference (and onnxruntime) take the powers in double.
        mode, p, acc = "lp", int(a["p"]), "double"
        keep = False
    if p < 1:
        raise prog.fail(f"p must be a positive integer, got {p}")
    lo = [-b for b in geo.pad_begin] if keep else [0] * len(spatial)
    hi = [n + e for n, e in zip(spatial, geo.pad_end, strict=True)] if keep else list(spatial)
    name = prog.kernel(
        "pool.cu.j2",
        "sum_pool",
        ctype=t,
        acc_type=acc,
        mode=mode,
        p=p,
        lo=lo,
        hi=hi,
        check_inside=keep,
        **params,
    )
    prog.launch_numel(name, y.type, [prog.cptr(x), prog.ptr(y)])


def _global_emit(prog: Program, node: Node) -> None:
    x = node_input(node, 0)
    y = node.outputs[0]
    t = float_ctype(prog, x)
    mode = {"GlobalAveragePool": "avg", "GlobalMaxPool": "max", "GlobalLpPool": "lp"}[node.op]
    p = int(node_attrs(node)["p"]) if mode == "lp" else 1
    if p < 1:
        raise prog.fail(f"p must be a positive integer, got {p}")
    size = math.prod(x.type.shape[2:])
    planes = y.type.numel
    if size == 0 or planes == 0:
        return
    name = prog.kernel(
        "pool.cu.j2",
        "global_pool",
        ctype=t,
        acc_type="double" if mode == "lp" else t,
        mode=mode,
        p=p,
        size=size,
    )
    prog.launch_numel(name, x.type, [prog.cptr(x), prog.ptr(y)], stop=2)


# -- SBP --------------------------------------------------------------------------------------------


def _pool_sbp(linear: bool) -> SbpFn:
    """Windows never cross batch entries or channels: split either. An average is linear.
    MaxPool's Indices count positions in the whole tensor, so a split would number them
    locally: with that output, only all-B."""

    def sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
        if len(outs) > 1:
            return []
        sigs = sr.same_axes(ctx, outs, (0, 1))
        return [*sigs, sr.partial(ctx, outs)] if linear else sigs

    return sbp


def _window_pool(
    name: str,
    infer: InferFn,
    reference: RefFn,
    attrs: dict[str, object],
    linear: bool,
    emit: EmitFn,
    outputs: tuple[int, int] = (1, 1),
) -> None:
    """Declare a windowed pool: the window attributes plus ``attrs``, a FLOP per kernel tap
    of each output element, the SBP signatures of ``_pool_sbp``."""
    defop(
        name,
        FAMILY,
        infer=infer,
        reference=reference,
        attrs={**_WINDOW_ATTRS, **attrs},
        outputs=outputs,
        flops=_pool_flops,
        sbp=_pool_sbp(linear),
        emit=emit,
        sized_leading=True,
    )


# -- MaxPool --------------------------------------------------------------------------------------


def _maxpool_infer(ctx: InferCtx) -> list[TensorType]:
    geo = _window_infer(ctx, lambda dt: dt in _MAXPOOL_TYPES)
    if ctx.attr("storage_order") not in (0, 1):
        raise ctx.fail(f"storage_order must be 0 or 1, got {ctx.attr('storage_order')}")
    if ctx.num_outputs > 2:
        raise ctx.fail(f"has at most 2 outputs (Y, Indices), got {ctx.num_outputs}")
    x = ctx.type(0)
    y = x.with_shape((*x.shape[:2], *geo.out))
    return [y, y.with_dtype(DType.I64)][: max(ctx.num_outputs, 1)]


def _lowest(dt: np.dtype) -> float:
    """The padding value no element can lose a max to (ml_dtypes floats have kind 'V')."""
    return float(np.iinfo(dt).min) if dt.kind in "iu" else -math.inf


def _maxpool_ref(xs: list[np.ndarray | None], a: Attrs) -> list[np.ndarray]:
    x = xs[0]
    assert x is not None
    geo = _geometry(x.shape, a)
    nd = len(geo.out)
    spatial = x.shape[2:]
    win = window_view(x, geo, _lowest(x.dtype))
    flat = win.reshape(*win.shape[: 2 + nd], -1)
    # First maximum in kernel order, as onnxruntime breaks ties.
    arg = flat.argmax(axis=-1)
    y = np.take_along_axis(flat, arg[..., None], axis=-1)[..., 0]

    taps = np.unravel_index(arg, geo.kernel)
    coords = []
    for i in range(nd):
        o = np.arange(geo.out[i]).reshape([-1 if j == i else 1 for j in range(nd)])
        coords.append(o * geo.strides[i] + taps[i] * geo.dilations[i] - geo.pad_begin[i])
    # Indices count in the unpadded input, flattened over N, C and the spatial axes; with
    # storage_order 1 the spatial axes are flattened column-major.
    order = range(nd) if a["storage_order"] == 0 else reversed(range(nd))
    spatial_idx = np.zeros(arg.shape, dtype=np.int64)
    for i in order:
        spatial_idx = spatial_idx * spatial[i] + coords[i]
    plane = np.arange(x.shape[0] * x.shape[1], dtype=np.int64).reshape(x.shape[:2] + (1,) * nd)
    indices = plane * math.prod(spatial) + spatial_idx
    return [np.ascontiguousarray(y), indices.astype(np.int64)]


_window_pool(
    "MaxPool",
    _maxpool_infer,
    _maxpool_ref,
    {"storage_order": 0},
    linear=False,
    emit=_maxpool_emit,
    outputs=(1, 2),
)


# -- AveragePool and LpPool -------------------------------------------------------------------------


def _avgpool_infer(ctx: InferCtx) -> list[TensorType]:
    geo = _window_infer(ctx, _is_float)
    x = ctx.type(0)
    return [x.with_shape((*x.shape[:2], *geo.out))]


def _avgpool_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = xs[0]
    assert x is not None
    geo = _geometry(x.shape, a)
    nd = len(geo.out)
    ct = compute_dtype(x.dtype)
    total = window_view(x.astype(ct, copy=False), geo, 0).sum(axis=_kernel_axes(nd))
    # The divisor counts the taps on real input, plus the explicit pads with
    # count_include_pad; never the run-off that ceil_mode adds past the end padding.
    keep = geo.pad_begin + geo.pad_end if a["count_include_pad"] else (0,) * (2 * nd)
    count = _taps_inside(x.shape[2:], geo, keep)
    return (total / count.astype(ct)).astype(x.dtype)


_window_pool(
    "AveragePool",
    _avgpool_infer,
    _avgpool_ref,
    {"count_include_pad": 0},
    linear=True,
    emit=_sum_pool_emit,
)


def _lp_norm(x: np.ndarray, a: Attrs, total: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """The p-norm (p: the attribute) of each window ``total`` sums, taken in float64."""
    p = float(a["p"])
    return (total(np.abs(x.astype(np.float64)) ** p) ** (1.0 / p)).astype(x.dtype)


def _lppool_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = xs[0]
    assert x is not None
    geo = _geometry(x.shape, a)
    axes = _kernel_axes(len(geo.out))
    return _lp_norm(x, a, lambda powered: window_view(powered, geo, 0.0).sum(axis=axes))


_window_pool("LpPool", _avgpool_infer, _lppool_ref, {"p": 2}, linear=False, emit=_sum_pool_emit)


# -- global pools -----------------------------------------------------------------------------------


def _global_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    if not x.dtype.is_float:
        raise ctx.fail(f"needs a floating-point input, got {x.dtype}")
    if x.rank < 3:
        raise ctx.fail(f"input must be N x C x spatial..., got shape {list(x.shape)}")
    return [x.with_shape((*x.shape[:2], *([1] * (x.rank - 2))))]


def _spatial_axes(x: np.ndarray) -> tuple[int, ...]:
    return tuple(range(2, x.ndim))


def _global_avg(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = xs[0]
    assert x is not None
    ct = compute_dtype(x.dtype)
    return x.mean(axis=_spatial_axes(x), keepdims=True, dtype=ct).astype(x.dtype)


def _global_max(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = xs[0]
    assert x is not None
    return x.max(axis=_spatial_axes(x), keepdims=True)


def _global_lp(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = xs[0]
    assert x is not None
    return _lp_norm(x, a, lambda powered: powered.sum(axis=_spatial_axes(x), keepdims=True))


def _global_flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    x = ins[0]
    assert x is not None
    return x.numel


for _op, _ref, _attrs, _linear in (
    ("GlobalAveragePool", _global_avg, None, True),
    ("GlobalMaxPool", _global_max, None, False),
    ("GlobalLpPool", _global_lp, {"p": 2}, False),
):
    defop(
        _op,
        FAMILY,
        infer=_global_infer,
        reference=_ref,
        attrs=_attrs,
        flops=_global_flops,
        sbp=_pool_sbp(linear=_linear),
        emit=_global_emit,
        sized_leading=True,
    )


# -- gradients (VJP rules: flowc/ops/grad.py) ---------------------------------------------------


def _global_avg_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """Each input element gets its plane's output gradient over the plane's size."""
    g, x = gouts[0], node.inputs[0]
    if g is None or x is None or not need[0]:
        return [None]
    size = math.prod(x.type.shape[2:])
    return [grad.expand_to(b, grad.op1(b, "Mul", g, grad.scalar(b, 1.0 / size, g)), x.type.shape)]


def _avgpool_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """Each window's gradient over its divisor, spread back over the window's taps: the
    ConvTranspose of g / count by a kernel of ones, one channel per group (no new kernel).
    A window that ceil_mode runs past the end padding reaches no input there: the end pad
    grows to cover it."""
    g, x = gouts[0], node.inputs[0]
    if g is None or x is None or not need[0]:
        return [None]
    a = node_attrs(node)
    xs = x.type.shape
    geo = _geometry(xs, a)
    nd, c = len(geo.out), xs[1]
    keep = geo.pad_begin + geo.pad_end if a["count_include_pad"] else (0,) * (2 * nd)
    count = _taps_inside(xs[2:], geo, keep).reshape(1, 1, *geo.out)
    dt = g.type.dtype.np
    scaled = grad.op1(b, "Mul", g, b.const((1.0 / count).astype(dt), "inverse_count"))
    end = [
        max(
            geo.pad_end[i],
            (geo.out[i] - 1) * geo.strides[i] + geo.spans[i] - xs[2 + i] - geo.pad_begin[i],
        )
        for i in range(nd)
    ]
    ones = b.const(np.ones((c, 1, *geo.kernel), dt), "window")
    return [spread_back(b, scaled, ones, geo, xs[2:], c, end)]


# -- MaxPoolGrad: MaxPool's gradient through the forward's argmax ---------------------------------
# Inputs: the output's gradient and the argmax (MaxPool's Indices, storage_order 0); attrs:
# the pool's window and the input's shape. Each input element sums, in output order, the
# gradients of the outputs whose argmax it is (templates/kernels/pool.cu.j2: max_pool_grad).


def _maxpool_grad_infer(ctx: InferCtx) -> list[TensorType]:
    g, idx = ctx.type(0), ctx.type(1)
    given = ctx.attr("shape")
    if not isinstance(given, (list, tuple)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in given
    ):
        raise ctx.fail(f"shape must be the input's dimensions (a list of ints), got {given!r}")
    shape = tuple(given)
    if not g.dtype.is_float or idx.dtype != DType.I64 or idx.shape != g.shape:
        raise ctx.fail(f"expects a float gradient and int64 indices of its shape, got {g}, {idx}")
    if len(shape) != g.rank or shape[:2] != g.shape[:2]:
        raise ctx.fail(f"shape {list(shape)} does not match the gradient {list(g.shape)}")
    geo = ctx.check(_geometry, shape, ctx.attrs)
    if tuple(geo.out) != g.shape[2:]:
        raise ctx.fail(f"the window gives {list(geo.out)} outputs, the gradient {list(g.shape)}")
    return [g.with_shape(shape)]


def _maxpool_grad_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    g, idx = xs[0], xs[1]
    assert g is not None and idx is not None
    shape = tuple(int(d) for d in a["shape"])
    dx = np.zeros(math.prod(shape), dtype=g.dtype)
    np.add.at(dx, idx.reshape(-1), g.reshape(-1))
    return dx.reshape(shape)


def _maxpool_grad_emit(prog: Program, node: Node) -> None:
    g, idx, dx = node_input(node, 0), node_input(node, 1), node.outputs[0]
    t = float_ctype(prog, g)
    shape = tuple(int(d) for d in node_attrs(node)["shape"])
    geo = _geometry(shape, node_attrs(node))
    name = prog.kernel(
        "pool.cu.j2",
        "max_pool_grad",
        ctype=t,
        out=list(geo.out),
        spatial=list(shape[2:]),
        strides=list(geo.strides),
        pads=list(geo.pad_begin),
        spans=list(geo.spans),
    )
    n = dx.type.numel
    prog.launch(name, n, [prog.cptr(g), prog.cptr(idx), prog.ptr(dx), f"(int64_t){n}"])


defop(
    "MaxPoolGrad",
    FAMILY,
    infer=_maxpool_grad_infer,
    reference=_maxpool_grad_ref,
    attrs={**_WINDOW_ATTRS, "shape": None},
    inputs=2,
    emit=_maxpool_grad_emit,
)


def _maxpool_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """The gradient goes to each window's first maximum (the forward's tie rule): the pool
    runs again for its argmax (the forward may not have asked for Indices), then MaxPoolGrad."""
    g, x = gouts[0], node.inputs[0]
    if g is None or x is None or not need[0]:
        return [None]
    window = {k: v for k, v in node_attrs(node).items() if k in _WINDOW_ATTRS}
    _, idx = b.emit("MaxPool", [x], {**window, "storage_order": 0}, num_outputs=2)
    return [grad.op1(b, "MaxPoolGrad", g, idx, **window, shape=list(x.type.shape))]


set_vjp("GlobalAveragePool", _global_avg_vjp)
set_vjp("MaxPool", _maxpool_vjp)
set_vjp("AveragePool", _avgpool_vjp)
