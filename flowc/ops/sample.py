"""Sampling ops: GridSample (N-D; linear, nearest and cubic; zeros, border and reflection
padding), RoiAlign, Col2Im and MaxUnpool.

GridSample applies its padding to every interpolation tap (as PyTorch does for bicubic and
onnxruntime for every mode): a tap outside the input reads 0, the nearest border pixel or
its mirror image. For linear and nearest sampling that is the same as first clamping or
reflecting the sampling position, which the ONNX reference implementation does. Positions
are computed in the grid's own float type, in onnxruntime's order of operations, so that
nearest rounding and floor pick the same pixels as it does.

RoiAlign follows onnxruntime's arithmetic in the input's type (sample positions,
bilinear weights; max mode takes the largest weighted corner, as onnxruntime and the
ONNX tests do). Col2Im sums every column entry into its image position; MaxUnpool scatters
its values by MaxPool's flat indices into zeros.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

import numpy as np

from flowc.codegen.cpp import c_float
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node, Value
from flowc.ir.types import TensorType
from flowc.ops.conv import explicit_pads, float_ctype, per_axis
from flowc.ops.registry import (
    InferCtx,
    defop,
    ints,
    node_attrs,
    row_major_strides,
)

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.builder import AdapterNode

FAMILY = "sample"


def _in(xs: list[np.ndarray | None], i: int) -> np.ndarray:
    x = xs[i] if i < len(xs) else None
    assert x is not None, f"input {i} is missing"
    return x


def _input(node: Node, i: int) -> Value:
    v = node.inputs[i] if i < len(node.inputs) else None
    assert v is not None, f"{node.op} node {node.name!r}: input {i} is missing"
    return v


def _coord_dtype(dt: np.dtype) -> np.dtype:
    """The float type positions are computed in: float64 stays, other floats use float32."""
    return np.dtype(np.float64) if dt == np.float64 else np.dtype(np.float32)


def _float_data(ctx: InferCtx, i: int, what: str) -> TensorType:
    t = ctx.type(i)
    if not t.dtype.is_float:
        raise ctx.fail(f"{what} must be a floating-point tensor, got {t.dtype}")
    return t


def _choice(ctx: InferCtx, name: str, allowed: tuple[str, ...]) -> str:
    v = str(ctx.attr(name))
    if v not in allowed:
        raise ctx.fail(f"{name} {v!r} is not one of {', '.join(allowed)}")
    return v


# -- GridSample ---------------------------------------------------------------------------------

_GS_MODES = ("linear", "nearest", "cubic")
_GS_PADDING = ("zeros", "border", "reflection")
_GS_TAPS = {"nearest": 1, "linear": 2, "cubic": 4}
# Sampling positions are clamped to +-2^40 before they become tap indices (NaN goes to the low
# end): far beyond any input, so no result changes, and no float-to-int conversion overflows.
_GS_BOUND = float(2**40)
_CUBIC_A = -0.75  # Keys' cubic convolution coefficient, as PyTorch and onnxruntime use


def _gridsample_import(n: AdapterNode) -> None:
    # Opset 16 spelled the 2-D modes bilinear and bicubic; opset 20 made them N-D.
    mode = n.attrs.get("mode")
    if n.opset < 20 and mode in ("bilinear", "bicubic"):
        n.attrs["mode"] = {"bilinear": "linear", "bicubic": "cubic"}[mode]


def _gridsample_infer(ctx: InferCtx) -> list[TensorType]:
    x = _float_data(ctx, 0, "X")
    grid = _float_data(ctx, 1, "grid")
    if x.rank < 3:
        raise ctx.fail(f"X must be N x C x spatial..., got shape {list(x.shape)}")
    r = x.rank - 2
    if grid.rank != x.rank or grid.shape[0] != x.shape[0] or grid.shape[-1] != r:
        raise ctx.fail(
            f"grid must have shape [N, out..., {r}] with N = {x.shape[0]} for X of shape "
            f"{list(x.shape)}, got {list(grid.shape)}"
        )
    _choice(ctx, "mode", _GS_MODES)
    _choice(ctx, "padding_mode", _GS_PADDING)
    if ctx.attr("align_corners") not in (0, 1):
        raise ctx.fail(f"align_corners must be 0 or 1, got {ctx.attr('align_corners')}")
    y = x.with_shape((x.shape[0], x.shape[1], *grid.shape[1:-1]))
    if 0 in x.shape[2:] and y.numel:
        raise ctx.fail(f"cannot sample from X of shape {list(x.shape)} with an empty axis")
    return [y]


def _denormalize(g: np.ndarray, size: int, align: bool) -> np.ndarray:
    """Normalized [-1, 1] positions to pixel positions, in g's float type and in
    onnxruntime's order of operations."""
    t = g.dtype.type
    one, two = t(1), t(2)
    pos = (g + one) / two * t(size - 1) if align else ((g + one) * t(size) - one) / two
    bound = t(_GS_BOUND)
    return np.minimum(np.where(pos >= -bound, pos, -bound), bound)


def _cubic_coeffs(t: np.ndarray) -> list[np.ndarray]:
    """The four Keys cubic weights of taps floor(x) - 1 .. floor(x) + 2, t = x - floor(x)."""
    a = _CUBIC_A
    u, v, w = t + 1, 1 - t, 2 - t
    return [
        ((a * u - 5 * a) * u + 8 * a) * u - 4 * a,
        ((a + 2) * t - (a + 3)) * t * t + 1,
        ((a + 2) * v - (a + 3)) * v * v + 1,
        ((a * w - 5 * a) * w + 8 * a) * w - 4 * a,
    ]


def _reflect(i: np.ndarray, size: int, align: bool) -> np.ndarray:
    """Integer tap positions mirrored into [0, size): about the pixel edges (-0.5 and
    size - 0.5) without align_corners, about the corner pixel centers with it."""
    if align:
        if size == 1:
            return np.zeros_like(i)
        period = 2 * (size - 1)
        m = np.mod(i, period)
        return np.where(m >= size, period - m, m)
    period = 2 * size
    m = np.mod(i, period)
    return np.where(m >= size, period - 1 - m, m)


def _taps(
    g: np.ndarray, size: int, mode: str, padding: str, align: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sampling position (g's shape): the tap indices (clamped or mirrored), whether
    each tap is inside the input, and its weight (float64); taps on a new last axis."""
    pos = _denormalize(g, size, align)
    if mode == "nearest":
        base = np.rint(pos)
        weights = [np.ones(pos.shape)]
    else:
        fl = np.floor(pos)
        if mode == "linear":
            base = fl
            # onnxruntime's two weights: (x1 + 1) - x and x - x1, each in the grid's type.
            weights = [((fl + 1) - pos).astype(np.float64), (pos - fl).astype(np.float64)]
        else:
            base = fl - 1
            weights = _cubic_coeffs((pos - fl).astype(np.float64))
    idx = base.astype(np.int64)[..., None] + np.arange(len(weights))
    w = np.stack(weights, axis=-1)
    inside = (idx >= 0) & (idx < size)
    if padding == "zeros":
        idx = np.where(inside, idx, 0)
    elif padding == "border":
        idx = np.clip(idx, 0, size - 1)
        inside = np.ones_like(inside)
    else:
        idx = _reflect(idx, size, align)
        inside = np.ones_like(inside)
    return idx, inside, w


def _gridsample_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, grid = _in(xs, 0), _in(xs, 1)
    n, c, spatial = x.shape[0], x.shape[1], x.shape[2:]
    r = len(spatial)
    out = grid.shape[1:-1]
    if n * c * math.prod(out) == 0:
        return np.zeros((n, c, *out), x.dtype)
    mode, padding, align = a["mode"], a["padding_mode"], bool(a["align_corners"])
    g = grid.astype(_coord_dtype(grid.dtype)).reshape(n, -1, r)
    points = g.shape[1]
    k = _GS_TAPS[mode]
    # Gather every tap: values of shape (N, C, points, K, ..., K), one K axis per spatial
    # axis; the grid's last entry is the position along the last spatial axis.
    index: list[np.ndarray] = [
        np.arange(n).reshape(n, 1, 1, *([1] * r)),
        np.arange(c).reshape(1, c, 1, *([1] * r)),
    ]
    valid = np.ones((1,) * (3 + r), bool)
    weights = []
    for d in range(r):
        idx, inside, w = _taps(g[..., r - 1 - d], spatial[d], mode, padding, align)
        shape = (n, 1, points, *([1] * d), k, *([1] * (r - 1 - d)))
        index.append(idx.reshape(shape))
        valid = valid & inside.reshape(shape)
        weights.append(w.reshape(n, 1, points, *([1] * d), k))
    vals = np.where(valid, x[tuple(index)].astype(np.float64), 0.0)
    # Interpolate along the last spatial axis first, then outwards (onnxruntime's nesting).
    for d in reversed(range(r)):
        vals = (vals * weights[d]).sum(axis=-1)
    return vals.reshape(n, c, *out).astype(x.dtype)


def _gridsample_flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    x = ins[0]
    r = 0 if x is None else x.rank - 2
    return 2 * _GS_TAPS.get(str(a["mode"]), 1) ** r * outs[0].numel


def _gridsample_emit(prog: Program, node: Node) -> None:
    x, grid, y = _input(node, 0), _input(node, 1), node.outputs[0]
    t = float_ctype(prog, x)
    gt = float_ctype(prog, grid)
    a = node_attrs(node)
    spatial = list(x.type.shape[2:])
    points = math.prod(grid.type.shape[1:-1])
    if y.type.numel == 0:
        return
    mode = str(a["mode"])
    name = prog.kernel(
        "sample.cu.j2",
        "grid_sample",
        ctype=t,
        gtype=gt,
        spatial=spatial,
        xstrides=row_major_strides(spatial),
        plane=math.prod(spatial),
        points=points,
        channels=x.type.shape[1],
        mode=mode,
        padding=str(a["padding_mode"]),
        align=bool(a["align_corners"]),
        taps=_GS_TAPS[mode],
        bound=c_float(_GS_BOUND, gt),
        sizes=[c_float(float(s), gt) for s in spatial],
        sizes_m1=[c_float(float(s - 1), gt) for s in spatial],
        cubic_a=c_float(_CUBIC_A, t),
    )
    n = y.type.numel
    prog.launch(name, n, [prog.cptr(x), prog.cptr(grid), prog.ptr(y), f"(int64_t){n}"])


defop(
    "GridSample",
    FAMILY,
    infer=_gridsample_infer,
    reference=_gridsample_ref,
    attrs={"align_corners": 0, "mode": "linear", "padding_mode": "zeros"},
    inputs=2,
    flops=_gridsample_flops,
    onnx_import=_gridsample_import,
    emit=_gridsample_emit,
)


# -- RoiAlign -----------------------------------------------------------------------------------


def _roialign_import(n: AdapterNode) -> None:
    # Opset 10 had no coordinate_transformation_mode and did not shift by half a pixel.
    if n.opset < 16:
        n.attrs.setdefault("coordinate_transformation_mode", "output_half_pixel")


def _roialign_infer(ctx: InferCtx) -> list[TensorType]:
    x = _float_data(ctx, 0, "X")
    rois, bi = ctx.type(1), ctx.type(2)
    if x.rank != 4:
        raise ctx.fail(f"X must be N x C x H x W, got shape {list(x.shape)}")
    if rois.dtype != x.dtype:
        raise ctx.fail(f"rois are {rois.dtype} but X is {x.dtype}")
    if rois.rank != 2 or rois.shape[1] != 4:
        raise ctx.fail(f"rois must have shape [num_rois, 4], got {list(rois.shape)}")
    if bi.dtype != DType.I64:
        raise ctx.fail(f"batch_indices must be int64, got {bi.dtype}")
    if bi.shape != rois.shape[:1]:
        raise ctx.fail(
            f"batch_indices must have shape [{rois.shape[0]}] (one per roi), got {list(bi.shape)}"
        )
    _choice(ctx, "mode", ("avg", "max"))
    _choice(ctx, "coordinate_transformation_mode", ("half_pixel", "output_half_pixel"))
    oh, ow = int(ctx.attr("output_height")), int(ctx.attr("output_width"))
    if oh < 1 or ow < 1:
        raise ctx.fail(f"output_height and output_width must be positive, got {oh}, {ow}")
    if not math.isfinite(float(ctx.attr("spatial_scale"))):
        raise ctx.fail(f"spatial_scale must be finite, got {ctx.attr('spatial_scale')}")
    if int(ctx.attr("sampling_ratio")) < 0:
        raise ctx.fail(f"sampling_ratio must be >= 0, got {ctx.attr('sampling_ratio')}")
    if 0 in x.shape[2:] and rois.shape[0] and x.shape[1]:
        raise ctx.fail(f"cannot pool from X of shape {list(x.shape)} with an empty axis")
    return [x.with_shape((rois.shape[0], x.shape[1], oh, ow))]


def _bilinear_1d(
    p: np.ndarray, size: int, t: type
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """onnxruntime's RoiAlign corner taps along one axis: (inside, low, high, w_low, w_high),
    positions below 0 taken as 0 and the last pixel repeated past the end."""
    inside = (p >= -1.0) & (p <= size)
    p = np.where(inside & (p > 0), p, t(0))  # outside samples weigh 0; keep the casts safe
    low = p.astype(np.int64)
    last = low >= size - 1
    low = np.where(last, size - 1, low)
    high = np.where(last, size - 1, low + 1)
    p = np.where(last, low.astype(t), p)
    frac = p - low.astype(t)
    return inside, low, high, t(1) - frac, frac


def _roialign_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, rois, bi = _in(xs, 0), _in(xs, 1), _in(xs, 2)
    t = _coord_dtype(x.dtype).type
    _, c, h, w = x.shape
    oh, ow = int(a["output_height"]), int(a["output_width"])
    ratio = int(a["sampling_ratio"])
    half = a["coordinate_transformation_mode"] == "half_pixel"
    scale = t(np.float32(a["spatial_scale"]))
    shift = t(0.5) if half else t(0)
    out = np.zeros((rois.shape[0], c, oh, ow), np.float64)
    r = rois.astype(t)
    for k in range(rois.shape[0]):
        b = int(bi[k])
        if not 0 <= b < x.shape[0]:
            raise IndexError(f"batch index {b} of roi {k} is out of range [0, {x.shape[0] - 1}]")
        x1, y1, x2, y2 = (r[k, j] * scale - shift for j in range(4))
        rw, rh = x2 - x1, y2 - y1
        if not half:  # malformed rois become 1 x 1
            rw, rh = max(rw, t(1)), max(rh, t(1))
        bh, bw = rh / t(oh), rw / t(ow)
        gh = ratio if ratio > 0 else int(np.ceil(rh / t(oh)))
        gw = ratio if ratio > 0 else int(np.ceil(rw / t(ow)))
        count = max(gh * gw, 1)
        if gh <= 0 or gw <= 0:
            continue  # no samples: avg and max both give 0
        # Sample positions, (bins, samples per bin) per axis, in onnxruntime's order.
        ys = (y1 + np.arange(oh, dtype=t)[:, None] * bh) + (
            (np.arange(gh) + 0.5).astype(t) * bh / t(gh)
        )
        xs_ = (x1 + np.arange(ow, dtype=t)[:, None] * bw) + (
            (np.arange(gw) + 0.5).astype(t) * bw / t(gw)
        )
        iny, ylo, yhi, hy, ly = _bilinear_1d(ys, h, t)
        inx, xlo, xhi, hx, lx = _bilinear_1d(xs_, w, t)

        def grid(v: np.ndarray, u: np.ndarray) -> np.ndarray:  # (oh, gh) x (ow, gw)
            return v[:, :, None, None] * u[None, None, :, :]

        inside = grid(iny, inx)
        corners = []
        for yi, wy in ((ylo, hy), (yhi, ly)):
            for xi, wx in ((xlo, hx), (xhi, lx)):
                wgt = np.where(inside, grid(wy, wx), t(0))
                yy = np.where(inside, yi[:, :, None, None], 0)
                xx = np.where(inside, xi[None, None, :, :], 0)
                corners.append(wgt * x[b][:, yy, xx].astype(t))  # (C, oh, gh, ow, gw)
        if a["mode"] == "avg":
            s = sum(v.astype(np.float64) for v in corners)
            out[k] = s.sum(axis=(2, 4)) / count
        else:
            m = np.maximum(np.maximum(np.maximum(corners[0], corners[1]), corners[2]), corners[3])
            out[k] = m.max(axis=(2, 4))
    return out.astype(x.dtype)


def _roialign_flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    ratio = max(int(a["sampling_ratio"]), 1)
    return 8 * ratio * ratio * outs[0].numel


def _roialign_emit(prog: Program, node: Node) -> None:
    x, rois, bi, y = _input(node, 0), _input(node, 1), _input(node, 2), node.outputs[0]
    t = float_ctype(prog, x)
    a = node_attrs(node)
    n = y.type.numel
    if n == 0:
        return
    name = prog.kernel(
        "sample.cu.j2",
        "roi_align",
        ctype=t,
        batch=x.type.shape[0],
        channels=x.type.shape[1],
        height=x.type.shape[2],
        width=x.type.shape[3],
        out_h=int(a["output_height"]),
        out_w=int(a["output_width"]),
        ratio=int(a["sampling_ratio"]),
        half_pixel=a["coordinate_transformation_mode"] == "half_pixel",
        scale=c_float(float(np.float32(a["spatial_scale"])), t),
        mode=str(a["mode"]),
    )
    args = [
        prog.cptr(x),
        prog.cptr(rois),
        prog.cptr(bi),
        prog.ptr(y),
        "error_flag",
        f"(int64_t){n}",
    ]
    prog.launch(name, n, args)


defop(
    "RoiAlign",
    FAMILY,
    infer=_roialign_infer,
    reference=_roialign_ref,
    attrs={
        "coordinate_transformation_mode": "half_pixel",
        "mode": "avg",
        "output_height": 1,
        "output_width": 1,
        "sampling_ratio": 0,
        "spatial_scale": 1.0,
    },
    inputs=3,
    flops=_roialign_flops,
    onnx_import=_roialign_import,
    emit=_roialign_emit,
)


# -- Col2Im -------------------------------------------------------------------------------------


class _Col2ImGeometry:
    """Image and block shapes with strides, dilations, begin pads and block counts."""

    def __init__(self, image: list[int], block: list[int], a: Attrs) -> None:
        nd = len(image)
        self.image = image
        self.block = block
        self.strides = list(per_axis(a, "strides", nd, 1))
        self.dilations = list(per_axis(a, "dilations", nd, 1))
        pads = explicit_pads(a, nd)
        self.pads = pads[:nd]
        self.counts = []
        for d in range(nd):
            span = (block[d] - 1) * self.dilations[d] + 1
            room = image[d] + pads[d] + pads[nd + d] - span
            if room < 0:
                raise ValueError(
                    f"block of {block[d]} (dilation {self.dilations[d]}) does not fit image axis "
                    f"{d} of {image[d]} with pads {pads[d]}, {pads[nd + d]}"
                )
            self.counts.append(room // self.strides[d] + 1)


def _col2im_geometry(ctx: InferCtx) -> _Col2ImGeometry:
    image = ints(ctx.const(1, "image_shape"))
    block = ints(ctx.const(2, "block_shape"))
    if len(image) != len(block) or not image:
        raise ctx.fail(f"image_shape {image} and block_shape {block} must have the same length")
    if any(d < 1 for d in image) or any(d < 1 for d in block):
        raise ctx.fail(f"image_shape {image} and block_shape {block} must be positive")
    return ctx.check(_Col2ImGeometry, image, block, ctx.attrs)


def _col2im_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    if x.dtype in (DType.BOOL,) or x.dtype.is_complex:
        raise ctx.fail(f"does not support element type {x.dtype}")
    geo = _col2im_geometry(ctx)
    if x.rank != 3:
        raise ctx.fail(f"input must be N x (C * block size) x blocks, got shape {list(x.shape)}")
    size = math.prod(geo.block)
    if x.shape[1] % size:
        raise ctx.fail(
            f"input axis 1 ({x.shape[1]}) must be a multiple of the block size {size} "
            f"(block_shape {geo.block})"
        )
    if x.shape[2] != math.prod(geo.counts):
        raise ctx.fail(
            f"input axis 2 ({x.shape[2]}) must be the number of blocks {math.prod(geo.counts)} "
            f"({' x '.join(map(str, geo.counts))})"
        )
    return [x.with_shape((x.shape[0], x.shape[1] // size, *geo.image))]


def _col2im_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = _in(xs, 0)
    geo = _Col2ImGeometry(ints(_in(xs, 1)), ints(_in(xs, 2)), a)
    n = x.shape[0]
    c = x.shape[1] // math.prod(geo.block)
    acc = np.float64 if x.dtype.kind == "f" else x.dtype
    cols = x.astype(acc).reshape(n, c, *geo.block, *geo.counts)
    # Sum into the padded image, one kernel tap at a time (a strided slice each).
    padded = [
        (b - 1) * dl + (k - 1) * s + 1
        for b, dl, k, s in zip(geo.block, geo.dilations, geo.counts, geo.strides, strict=True)
    ]
    img = np.zeros((n, c, *padded), acc)
    for tap in itertools.product(*(range(b) for b in geo.block)):
        where = tuple(
            slice(t * dl, t * dl + (k - 1) * s + 1, s)
            for t, dl, k, s in zip(tap, geo.dilations, geo.counts, geo.strides, strict=True)
        )
        key: tuple[slice | int, ...] = (slice(None), slice(None), *tap)
        img[(slice(None), slice(None), *where)] += cols[key]
    out = np.zeros((n, c, *geo.image), acc)
    # The padded image may stop short of the end padding, or (with pads) start before the image.
    src = tuple(
        slice(p, min(p + d, e)) for p, d, e in zip(geo.pads, geo.image, padded, strict=True)
    )
    dst = tuple(slice(0, s.stop - s.start) if s.stop > s.start else slice(0, 0) for s in src)
    out[(slice(None), slice(None), *dst)] = img[(slice(None), slice(None), *src)]
    return out.astype(x.dtype)


def _col2im_flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    return 0 if ins[0] is None else ins[0].numel


def _col2im_emit(prog: Program, node: Node) -> None:
    x, y = _input(node, 0), node.outputs[0]
    t = prog.ctype(x)
    image_v, block_v = _input(node, 1), _input(node, 2)
    assert image_v.const is not None and block_v.const is not None
    geo = _Col2ImGeometry(ints(image_v.const), ints(block_v.const), node_attrs(node))
    n = y.type.numel
    if n == 0:
        return
    name = prog.kernel(
        "sample.cu.j2",
        "col2im",
        ctype=t,
        acc=t,
        image=geo.image,
        block=geo.block,
        strides=geo.strides,
        dilations=geo.dilations,
        pads=geo.pads,
        counts=geo.counts,
        block_strides=row_major_strides(geo.block),
        count_strides=row_major_strides(geo.counts),
        block_size=math.prod(geo.block),
        blocks=math.prod(geo.counts),
    )
    prog.launch(name, n, [prog.cptr(x), prog.ptr(y), f"(int64_t){n}"])


defop(
    "Col2Im",
    FAMILY,
    infer=_col2im_infer,
    reference=_col2im_ref,
    attrs={"dilations": None, "pads": None, "strides": None},
    inputs=3,
    flops=_col2im_flops,
    dsl_name="col2im",
    emit=_col2im_emit,
)


# -- MaxUnpool ----------------------------------------------------------------------------------


def _unpool_shape(x_shape: tuple[int, ...], a: Attrs) -> tuple[int, ...]:
    """The shape MaxUnpool infers from its attributes: MaxPool's input size, run backwards."""
    kernel = a.get("kernel_shape")
    if kernel is None:
        raise ValueError("the kernel_shape attribute is required")
    nd = len(x_shape) - 2
    kernel = [int(k) for k in kernel]
    if len(kernel) != nd or any(k < 1 for k in kernel):
        raise ValueError(f"kernel_shape {kernel} must have {nd} positive entries")
    strides = per_axis(a, "strides", nd, 1)
    pads = explicit_pads(a, nd)
    out = tuple(
        (x_shape[2 + d] - 1) * strides[d] - (pads[d] + pads[nd + d]) + kernel[d] for d in range(nd)
    )
    if any(o < 1 for o in out):
        raise ValueError(f"the unpooled spatial shape {list(out)} is not positive")
    return (*x_shape[:2], *out)


def _maxunpool_infer(ctx: InferCtx) -> list[TensorType]:
    x = _float_data(ctx, 0, "X")
    ind = ctx.type(1)
    if x.rank < 3:
        raise ctx.fail(f"X must be N x C x spatial..., got shape {list(x.shape)}")
    if ind.dtype != DType.I64 or ind.shape != x.shape:
        raise ctx.fail(
            f"I must be int64 of X's shape {list(x.shape)}, got {ind.dtype} {list(ind.shape)}"
        )
    shape = ctx.check(_unpool_shape, x.shape, ctx.attrs)
    if ctx.has(2):
        given = tuple(ints(ctx.const(2, "output_shape")))
        if len(given) != x.rank or any(g < s for g, s in zip(given, shape, strict=True)):
            raise ctx.fail(
                f"output_shape {list(given)} must have rank {x.rank} and hold the unpooled "
                f"shape {list(shape)}"
            )
        shape = given
    return [x.with_shape(shape)]


def _maxunpool_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    """The indices count in the unpooled shape the attributes give; a larger output_shape
    holds that block at its origin (the ONNX reference's and test data's reading)."""
    x, ind = _in(xs, 0), _in(xs, 1)
    shape = _unpool_shape(x.shape, a)
    out_shape = shape if len(xs) < 3 or xs[2] is None else tuple(ints(xs[2]))
    total = math.prod(shape)
    i = ind.astype(np.int64).reshape(-1)
    if i.size and (i.min() < 0 or i.max() >= total):
        bad = i[(i < 0) | (i >= total)][0]
        raise IndexError(f"index {bad} is out of range [0, {total - 1}] (unpooled shape {shape})")
    flat = np.zeros(total, x.dtype)
    flat[i] = x.reshape(-1)  # with repeated indices the last value wins
    out = np.zeros(out_shape, x.dtype)
    out[tuple(slice(0, s) for s in shape)] = flat.reshape(shape)
    return out


def _maxunpool_emit(prog: Program, node: Node) -> None:
    x, ind, y = _input(node, 0), _input(node, 1), node.outputs[0]
    t = float_ctype(prog, x)
    shape = _unpool_shape(x.type.shape, node_attrs(node))
    prog.zero(prog.ptr_void(y), y.type.nbytes)
    n = x.type.numel
    if n == 0:
        return
    same = shape == y.type.shape
    name = prog.kernel(
        "sample.cu.j2",
        "max_unpool",
        ctype=t,
        total=math.prod(shape),
        dims=[] if same else list(zip(shape, row_major_strides(y.type.shape), strict=True)),
    )
    args = [prog.cptr(x), prog.cptr(ind), prog.ptr(y), "error_flag", f"(int64_t){n}"]
    prog.launch(name, n, args)


defop(
    "MaxUnpool",
    FAMILY,
    infer=_maxunpool_infer,
    reference=_maxunpool_ref,
    attrs={"kernel_shape": None, "pads": None, "strides": None},
    inputs=(2, 3),
    emit=_maxunpool_emit,
)
