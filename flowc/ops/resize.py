"""Resize and Upsample: an input's axes stretched or shrunk by scales or to sizes, each output
sample read from the input coordinate its coordinate transformation maps it to (nearest,
linear or cubic; antialiased linear/cubic import as matrix products). The reference computes
the coordinates in float32 step by step as onnxruntime does, and the kernel's C++ expression
(``_coord_expr``) repeats the same operations in the same order, so nearest rounding picks the
same side. Scales, sizes and (for tf_crop_and_resize) the roi must be compile-time constants.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from flowc.codegen.cpp import c_float, c_literal
from flowc.errors import ShapeError
from flowc.ir.graph import Attrs, Node
from flowc.ir.types import TensorType
from flowc.ops import grad
from flowc.ops.movement import Fail, arg, const_input, launch_over, node_input, norm_axes, opt_arg
from flowc.ops.registry import InferCtx, defop, ints, node_attrs, row_major_strides

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.builder import AdapterNode
    from flowc.ir.graph import Value

FAMILY = "shape"


# -- Resize, Upsample --------------------------------------------------------------------------

_COORD_MODES = (
    "half_pixel",
    "half_pixel_symmetric",
    "pytorch_half_pixel",
    "align_corners",
    "asymmetric",
    "tf_crop_and_resize",
    "tf_half_pixel_for_nn",  # opsets 11-12 only; kept so those models import unchanged
)
_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
_RESIZE_MODES = ("nearest", "linear", "cubic")
_POLICIES = ("stretch", "not_larger", "not_smaller")
_f32 = np.float32


@dataclass(frozen=True)
class _ResizePlan:
    out_shape: tuple[int, ...]
    scales: tuple[float, ...]  # float32 values, one per axis; 1 where nothing resizes
    roi: tuple[float, ...]  # starts then ends, one per axis (float32 values)
    # The resized length align_corners divides by, per axis: scale * input length in float32
    # when scales are given (not the truncated output size; ONNX's reference and test data),
    # the output size when sizes are.
    lengths: tuple[float, ...]


def _present(a: np.ndarray | None) -> np.ndarray | None:
    """Opsets 11-13 pass an empty tensor for an absent scales or roi."""
    return None if a is None or a.size == 0 else a


def _resize_plan(
    fail: Fail,
    in_shape: tuple[int, ...],
    roi: np.ndarray | None,
    scales: np.ndarray | None,
    sizes: np.ndarray | None,
    a: Mapping[str, Any],
) -> _ResizePlan:
    rank = len(in_shape)
    for name, allowed in (
        ("mode", _RESIZE_MODES),
        ("coordinate_transformation_mode", _COORD_MODES),
        ("nearest_mode", _NEAREST_MODES),
        ("keep_aspect_ratio_policy", _POLICIES),
    ):
        if a[name] not in allowed:
            raise fail(f"{name} {a[name]!r} is not one of {', '.join(allowed)}")
    if a["antialias"]:
        # Linear and cubic antialiasing import as matrix products (_antialias_resize).
        raise fail(f"antialias=1 needs mode linear or cubic, not {a['mode']!r}")
    if rank == 0:
        raise fail("cannot resize a scalar")
    axes = norm_axes(fail, a["axes"], rank) if a.get("axes") is not None else list(range(rank))
    scales, sizes = _present(scales), _present(sizes)
    if (scales is None) == (sizes is None):
        raise fail("exactly one of 'scales' and 'sizes' must be given")
    full = [_f32(1)] * rank
    out = list(in_shape)
    lengths = [float(n) for n in in_shape]
    if scales is not None:
        s = [_f32(v) for v in np.asarray(scales, np.float32).reshape(-1)]
        if len(s) != len(axes):
            raise fail(
                f"scales {[float(v) for v in s]} needs {len(axes)} entries (one per resized axis)"
            )
        if any(not v > 0 for v in s):
            raise fail(f"scales {[float(v) for v in s]} must be positive")
        for ax, v in zip(axes, s, strict=True):
            full[ax] = v
            # onnxruntime multiplies in float and truncates.
            out[ax] = int(v * _f32(in_shape[ax]))
            lengths[ax] = float(v * _f32(in_shape[ax]))
    else:
        assert sizes is not None
        z = ints(sizes)
        if len(z) != len(axes):
            raise fail(f"sizes {z} needs {len(axes)} entries (one per resized axis)")
        for ax, d in zip(axes, z, strict=True):
            if d < 0 or (in_shape[ax] == 0 and d != 0):
                raise fail(f"sizes {z}: cannot resize axis {ax} of length {in_shape[ax]} to {d}")
            out[ax] = d
            full[ax] = _f32(d) / _f32(in_shape[ax]) if in_shape[ax] else _f32(1)
        policy = a["keep_aspect_ratio_policy"]
        if policy != "stretch":
            chosen = [full[ax] for ax in axes]
            common = min(chosen) if policy == "not_larger" else max(chosen)
            for ax in axes:
                full[ax] = common
                out[ax] = math.floor(float(common * _f32(in_shape[ax])) + 0.5)
    box = [0.0] * rank + [1.0] * rank
    roi = _present(roi)
    if roi is not None:
        r = [float(v) for v in np.asarray(roi, np.float32).reshape(-1)]
        if len(r) != 2 * len(axes):
            raise fail(f"roi {r} needs {2 * len(axes)} entries (start and end per resized axis)")
        for k, ax in enumerate(axes):
            box[ax], box[rank + ax] = r[k], r[len(axes) + k]
    if scales is None:
        lengths = [float(n) for n in out]
    return _ResizePlan(tuple(out), tuple(float(v) for v in full), tuple(box), tuple(lengths))


def _resize_types(
    ctx: InferCtx,
    a: Mapping[str, Any],
    roi: np.ndarray | None,
    scales: np.ndarray | None,
    sizes: np.ndarray | None,
) -> list[TensorType]:
    x = ctx.type(0)
    plan = _resize_plan(ctx.fail, x.shape, roi, scales, sizes, a)
    if a["mode"] != "nearest" and not x.dtype.is_float:
        raise ctx.fail(f"{a['mode']} interpolation needs a floating-point input, got {x.dtype}")
    return [x.with_shape(plan.out_shape)]


def _resize_infer(ctx: InferCtx) -> list[TensorType]:
    scales = ctx.const(2, "scales") if ctx.has(2) else None
    sizes = ctx.const(3, "sizes") if ctx.has(3) else None
    if sizes is not None and sizes.dtype != np.int64:
        raise ctx.fail(f"sizes must be int64, got {ctx.dtype(3)}")
    # tf_crop_and_resize reads the roi to place every sample: the kernel bakes it in.
    crop = ctx.attr("coordinate_transformation_mode") == "tf_crop_and_resize"
    roi = ctx.const(1, "roi") if crop and ctx.has(1) else ctx.maybe_const(1)
    return _resize_types(ctx, ctx.attrs, roi, scales, sizes)


def _original_coords(
    mode: str, n_out: int, n_in: int, scale: float, start: float, end: float, length: float
) -> np.ndarray:
    """Output index -> input coordinate, in float32 step by step as onnxruntime computes it."""
    x = np.arange(n_out, dtype=np.float32)
    s, half = _f32(scale), _f32(0.5)
    if mode == "asymmetric":
        return x / s
    if mode == "half_pixel":
        return (x + half) / s - half
    if mode == "tf_half_pixel_for_nn":
        return (x + half) / s
    if mode == "pytorch_half_pixel":
        return (x + half) / s - half if n_out > 1 else np.zeros(n_out, np.float32)
    if mode == "align_corners":
        if n_out == 1:
            return np.zeros(1, np.float32)
        return x * _f32(n_in - 1) / (_f32(length) - _f32(1))
    if mode == "tf_crop_and_resize":
        lo, hi = _f32(start), _f32(end)
        if n_out > 1:
            return lo * _f32(n_in - 1) + x * (hi - lo) * _f32(n_in - 1) / _f32(n_out - 1)
        return np.full(1, 0.5 * float(lo + hi) * (n_in - 1), np.float32)
    assert mode == "half_pixel_symmetric", mode
    adjustment = _f32(n_out) / (s * _f32(n_in))
    offset = _f32(n_in) / _f32(2) * (_f32(1) - adjustment)
    return (float(offset) + (x.astype(np.float64) + 0.5) / float(s) - 0.5).astype(np.float32)


def _coord_expr(
    mode: str, n_out: int, n_in: int, scale: float, start: float, end: float, length: float, c: str
) -> str:
    """The C++ float expression of _original_coords for output index ``c``: the same float32
    operations in the same order (no multiply feeds an add, so no FMA contraction changes
    the rounding), so nearest rounding picks the reference's side."""
    x = f"static_cast<float>({c})"
    s = _f32(scale)

    def lit(v: Any, t: str = "float") -> str:
        return c_float(float(v), t)

    if mode == "asymmetric":
        return f"{x} / {lit(s)}"
    if mode == "half_pixel" or (mode == "pytorch_half_pixel" and n_out > 1):
        return f"({x} + 0.5f) / {lit(s)} - 0.5f"
    if mode == "tf_half_pixel_for_nn":
        return f"({x} + 0.5f) / {lit(s)}"
    if mode == "pytorch_half_pixel" or (mode == "align_corners" and n_out == 1):
        return "0.0f"
    if mode == "align_corners":
        return f"{x} * {lit(_f32(n_in - 1))} / {lit(_f32(length) - _f32(1))}"
    if mode == "tf_crop_and_resize":
        lo, hi = _f32(start), _f32(end)
        if n_out > 1:
            return (
                f"{lit(lo * _f32(n_in - 1))} + {x} * {lit(hi - lo)} * {lit(_f32(n_in - 1))} / "
                f"{lit(_f32(n_out - 1))}"
            )
        return lit(_f32(0.5 * float(lo + hi) * (n_in - 1)))
    assert mode == "half_pixel_symmetric", mode
    adjustment = _f32(n_out) / (s * _f32(n_in))
    offset = _f32(n_in) / _f32(2) * (_f32(1) - adjustment)
    return (
        f"static_cast<float>({lit(float(offset), 'double')} + (static_cast<double>({c}) + 0.5) / "
        f"{lit(float(s), 'double')} - 0.5)"
    )


# nearest_mode -> the rounding of the source coordinate (in double), as _nearest_index does.
_ROUNDING = {
    "round_prefer_floor": {"fn": "ceil", "bias": " - 0.5"},
    "round_prefer_ceil": {"fn": "floor", "bias": " + 0.5"},
    "floor": {"fn": "floor", "bias": ""},
    "ceil": {"fn": "ceil", "bias": ""},
}


def _nearest_index(orig: np.ndarray, mode: str) -> np.ndarray:
    o = orig.astype(np.float64)
    if mode == "round_prefer_floor":
        r = np.ceil(o - 0.5)
    elif mode == "round_prefer_ceil":
        r = np.floor(o + 0.5)
    elif mode == "floor":
        r = np.floor(o)
    else:
        r = np.ceil(o)
    return r.astype(np.int64)


def _linear_taps(orig: np.ndarray, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    c = np.clip(orig, _f32(0), _f32(n_in - 1))
    i1 = np.minimum(c.astype(np.int64), n_in - 1)
    i2 = np.minimum(i1 + 1, n_in - 1)
    w2 = np.abs(c - i1.astype(np.float32))
    w1 = np.abs(c - i2.astype(np.float32))
    edge = i1 == i2
    w1 = np.where(edge, _f32(0.5), w1)
    w2 = np.where(edge, _f32(0.5), w2)
    return np.stack([i1, i2], 1), np.stack([w1, w2], 1).astype(np.float64)


def _cubic_taps(
    orig: np.ndarray, n_in: int, a: float, exclude_outside: int
) -> tuple[np.ndarray, np.ndarray]:
    base = np.floor(orig)
    t = (orig - base).astype(np.float64)[:, None]
    d = np.concatenate([t + 1, t, 1 - t, 2 - t], axis=1)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    w = np.where(d <= 1, near, far)
    pos = base.astype(np.int64)[:, None] + np.arange(-1, 3)
    if exclude_outside:
        w = np.where((pos >= 0) & (pos < n_in), w, 0.0)
        w = w / w.sum(axis=1, keepdims=True)
    return np.clip(pos, 0, n_in - 1), w


def _along(v: np.ndarray, axis: int, rank: int) -> np.ndarray:
    shape = [1] * rank
    shape[axis] = v.shape[0]
    return v.reshape(shape)


def _resize_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = arg(xs, 0)
    plan = _resize_plan(ValueError, x.shape, opt_arg(xs, 1), opt_arg(xs, 2), opt_arg(xs, 3), a)
    if plan.out_shape == x.shape:
        return x  # onnxruntime copies the input when no axis changes length
    if 0 in plan.out_shape:
        return np.zeros(plan.out_shape, x.dtype)
    rank = x.ndim
    coord = a["coordinate_transformation_mode"]
    outside = np.zeros((1,) * rank, bool)
    coords: list[np.ndarray | None] = []
    for ax in range(rank):
        n_in, s = x.shape[ax], plan.scales[ax]
        if s == 1:
            # onnxruntime maps an axis with scale 1 one to one, whatever the coordinate mode.
            coords.append(None)
            continue
        orig = _original_coords(
            coord, plan.out_shape[ax], n_in, s, plan.roi[ax], plan.roi[rank + ax], plan.lengths[ax]
        )
        coords.append(orig)
        if coord == "tf_crop_and_resize":
            outside = outside | _along((orig < 0) | (orig > n_in - 1), ax, rank)
    if a["mode"] == "nearest":
        out = _resize_nearest(x, coords, a["nearest_mode"])
    else:
        out = _resize_interp(x, coords, a)
    if outside.any():
        out = np.where(outside, np.asarray(a["extrapolation_value"]).astype(x.dtype), out)
    return out


def _resize_nearest(x: np.ndarray, coords: list[np.ndarray | None], mode: str) -> np.ndarray:
    idx = [
        np.arange(n) if c is None else np.clip(_nearest_index(c, mode), 0, n - 1)
        for n, c in zip(x.shape, coords, strict=True)
    ]
    return x[np.ix_(*idx)]


def _resize_interp(x: np.ndarray, coords: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    """Separable linear/cubic interpolation: one axis at a time, accumulated in float64."""
    acc = x.astype(np.float64)
    for ax, c in enumerate(coords):
        if c is None:
            continue
        n_in = x.shape[ax]
        if a["mode"] == "linear":
            taps, w = _linear_taps(c, n_in)
        else:
            taps, w = _cubic_taps(c, n_in, a["cubic_coeff_a"], a["exclude_outside"])
        out = np.take(acc, taps[:, 0], axis=ax) * _along(w[:, 0], ax, x.ndim)
        for t in range(1, taps.shape[1]):
            out += np.take(acc, taps[:, t], axis=ax) * _along(w[:, t], ax, x.ndim)
        acc = out
    return acc.astype(x.dtype)


def _axis_matrices(
    shape: tuple[int, ...],
    roi: np.ndarray | None,
    scales: np.ndarray | None,
    sizes: np.ndarray | None,
    a: Mapping[str, Any],
) -> list[np.ndarray | None]:
    """Resize as a product of one matrix per axis (output length x input length; None where
    the axis maps one to one), from the same coordinates and taps as the reference: nearest
    picks one input, linear and cubic weigh their taps, and tf_crop_and_resize's samples
    outside the roi (the extrapolation value, a constant) weigh nothing."""
    plan = _resize_plan(ValueError, shape, roi, scales, sizes, a)
    rank = len(shape)
    if plan.out_shape == shape:
        return [None] * rank
    coord = a["coordinate_transformation_mode"]
    out: list[np.ndarray | None] = []
    for ax in range(rank):
        n_in, n_out, s = shape[ax], plan.out_shape[ax], plan.scales[ax]
        if s == 1:
            out.append(None)
            continue
        m = np.zeros((n_out, n_in), np.float64)
        if n_out and n_in:
            orig = _original_coords(
                coord, n_out, n_in, s, plan.roi[ax], plan.roi[rank + ax], plan.lengths[ax]
            )
            rows = np.arange(n_out)
            if a["mode"] == "nearest":
                m[rows, np.clip(_nearest_index(orig, a["nearest_mode"]), 0, n_in - 1)] = 1.0
            else:
                if a["mode"] == "linear":
                    taps, w = _linear_taps(orig, n_in)
                else:
                    taps, w = _cubic_taps(orig, n_in, a["cubic_coeff_a"], a["exclude_outside"])
                for t in range(taps.shape[1]):
                    np.add.at(m, (rows, taps[:, t]), w[:, t])
            if coord == "tf_crop_and_resize":
                m[(orig < 0) | (orig > n_in - 1)] = 0.0
        out.append(m)
    return out


def _resize_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """Resize is linear in its input and separable: the gradient is the output gradient
    through each resized axis's matrix transposed (flowc/ops/grad.py: adjoint_along)."""
    g, x = gouts[0], node.inputs[0]
    grads: list[Value | None] = [None] * len(node.inputs)
    if g is None or x is None or not need[0]:
        return grads
    a = node_attrs(node)
    # The roi matters (and is a constant) only for tf_crop_and_resize.
    roi = (
        const_input(node, 1)
        if a["coordinate_transformation_mode"] == "tf_crop_and_resize"
        else None
    )
    matrices = _axis_matrices(x.type.shape, roi, const_input(node, 2), const_input(node, 3), a)
    for axis in reversed(range(x.type.rank)):
        m = matrices[axis]
        if m is not None:
            g = grad.adjoint_along(b, g, axis, m)
    grads[0] = g
    return grads


def _resize_flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    taps = {"nearest": 0, "linear": 2, "cubic": 4}.get(a["mode"], 0)
    x = ins[0]
    resized = 0 if x is None else sum(d != e for d, e in zip(x.shape, outs[0].shape, strict=True))
    return 2 * taps * resized * outs[0].numel


def _legacy_resize(n: AdapterNode, scales: Value | None) -> list[Value]:
    """Resize-10 and Upsample: asymmetric coordinates; nearest truncates on an axis that grows
    and rounds up on one that shrinks (onnxruntime's rule for these opsets). The canonical op
    has one nearest_mode, so a mix of growing and shrinking axes becomes two Resizes (nearest
    is separable, so the result is the same)."""
    x = n.input(0)
    mode = n.attrs.get("mode", "nearest")

    def resize(inp: Value | None, sc: Value | None, nearest: str, **kw: Any) -> list[Value]:
        attrs = {
            "mode": mode,
            "coordinate_transformation_mode": "asymmetric",
            "nearest_mode": nearest,
        }
        return n.emit("Resize", [inp, None, sc], attrs, **kw)

    s = None if scales is None or scales.const is None else np.asarray(scales.const, np.float32)
    if mode != "nearest" or s is None or not (s < 1).any():
        return resize(x, scales, "floor", output_names=n.output_names)
    if not (s > 1).any():
        return resize(x, scales, "ceil", output_names=n.output_names)
    down = n.const("scales_down", np.where(s < 1, s, 1), np.float32)
    up = n.const("scales_up", np.where(s < 1, 1, s), np.float32)
    (shrunk,) = resize(x, down, "ceil", suffix="shrink")
    return resize(shrunk, up, "floor", output_names=n.output_names)


def _resize_import(n: AdapterNode) -> list[Value] | None:
    if n.opset < 11:
        return _legacy_resize(n, n.input(1))
    if n.attrs.get("antialias") and n.attrs.get("mode", "nearest") in ("linear", "cubic"):
        return _antialias_resize(n)
    return None


def _antialias_weights(
    mode: str, coord: str, n_in: int, n_out: int, scale: float, length: float, a: Mapping[str, Any]
) -> np.ndarray:
    """The [n_out, n_in] matrix of an antialiased linear/cubic resize along one axis: when
    shrinking, the filter widens by 1/scale so every input sample contributes (ONNX's
    definition: its coefficients, window placement and edge clamping)."""
    x_ori = _original_coords(coord, n_out, n_in, scale, 0.0, 1.0, length).astype(np.float64)
    s = min(scale, 1.0)
    w = np.zeros((n_out, n_in), np.float64)
    for i, x in enumerate(x_ori):
        base = math.floor(x)
        ratio = 1.0 if x == base else x - base
        if mode == "linear":
            start = math.floor(-1 / s) + 1
            taps = (np.arange(start, 2 - start) - ratio) * s
            coeffs = np.clip(1 - np.abs(taps), 0, 1)
        else:
            ca = float(a["cubic_coeff_a"])
            start = math.floor(-2 / s) + 1
            d = np.abs((np.arange(start, 2 - start) - ratio) * s)
            near = ((ca + 2) * d - (ca + 3)) * d * d + 1
            far = ((ca * d - 5 * ca) * d + 8 * ca) * d - 4 * ca
            coeffs = np.where(d <= 1, near, np.where(d < 2, far, 0.0))
        coeffs = coeffs / coeffs.sum()
        k = len(coeffs)
        pad = math.ceil(k / 2)
        xp = x + pad
        p = math.floor(xp)
        frac = xp - p
        if k % 2 == 0:
            offset = -(k // 2) if frac == 0 else -(k // 2) + 1
        else:
            offset = -((k - 1) // 2) + (0 if frac <= 0.5 else 1)
        idx = p + offset + np.arange(k) - pad
        if a["exclude_outside"]:
            coeffs = np.where((idx < 0) | (idx >= n_in), 0.0, coeffs)
            total = coeffs.sum()
            coeffs = coeffs / (total if total else 1.0)
        np.add.at(w[i], np.clip(idx, 0, n_in - 1), coeffs)
    return w


def _antialias_resize(n: AdapterNode) -> list[Value]:
    """An antialiased linear/cubic Resize as one constant matrix product per resized axis:
    the filter's footprint depends on the scale, which flowc knows at compile time, so the
    whole resize is a static linear map and needs no kernel of its own."""
    x = n.input(0)
    assert x is not None
    a = {**_RESIZE_DEFAULTS, **n.attrs, "antialias": 0}
    where = f"Resize node {n.name!r}"
    consts: list[np.ndarray | None] = []
    for k, what in ((1, "roi"), (2, "scales"), (3, "sizes")):
        v = n.input(k)
        if v is not None and v.const is None and v.type.numel:
            raise ShapeError(f"{where}: input {k} ({what}) must be known at compile time")
        consts.append(None if v is None else v.const)
    if a["coordinate_transformation_mode"] == "tf_crop_and_resize":
        raise ShapeError(f"{where}: antialias with tf_crop_and_resize is not supported")

    def fail(message: str) -> ShapeError:
        return ShapeError(f"{where}: {message}")

    shape = x.type.shape
    plan = _resize_plan(fail, shape, consts[0], consts[1], consts[2], a)
    axes = [ax for ax in range(len(shape)) if plan.scales[ax] != 1]
    if not axes:
        return n.emit("Identity", [x], output_names=n.output_names)
    cur: Value = x
    rank = len(shape)
    for j, ax in enumerate(axes):
        w = _antialias_weights(
            a["mode"],
            a["coordinate_transformation_mode"],
            shape[ax],
            plan.out_shape[ax],
            plan.scales[ax],
            plan.lengths[ax],
            a,
        )
        last = j == len(axes) - 1
        perm = [d for d in range(rank) if d != ax] + [ax]
        moved = ax != rank - 1
        if moved:
            (cur,) = n.emit("Transpose", [cur], {"perm": perm}, suffix=f"to_last{ax}")
        wt = n.const(f"antialias{ax}", w.T.astype(x.type.dtype.np))
        names = n.output_names if last and not moved else None
        (cur,) = n.emit("MatMul", [cur, wt], suffix=f"antialias{ax}", output_names=names)
        if moved:
            back = [perm.index(d) for d in range(rank)]
            (cur,) = n.emit(
                "Transpose",
                [cur],
                {"perm": back},
                suffix=f"from_last{ax}",
                output_names=n.output_names if last else None,
            )
    return [cur]


def _emit_resize(
    prog: Program,
    node: Node,
    a: Mapping[str, Any],
    roi: np.ndarray | None,
    scales: np.ndarray | None,
    sizes: np.ndarray | None,
) -> None:
    x, out = node_input(node, 0), node.outputs[0]
    plan = _resize_plan(prog.fail, x.type.shape, roi, scales, sizes, a)
    if plan.out_shape == x.type.shape:
        prog.copy(out, x)  # as the reference: no axis changes length, no interpolation
        return
    if out.type.numel == 0:
        return
    rank = x.type.rank
    coord = a["coordinate_transformation_mode"]
    dims = []
    for ax, (n_in, n_out, s, st) in enumerate(
        zip(x.type.shape, plan.out_shape, plan.scales, row_major_strides(x.type.shape), strict=True)
    ):
        resized = s != 1
        if not resized and n_out != n_in:
            raise prog.fail(f"internal: axis {ax} has scale 1 but changes length")
        dims.append(
            {
                "axis": ax,
                "size": n_out,
                "stride": st,
                "resized": resized,
                "last": n_in - 1,
                "last_f": c_float(float(n_in - 1)),
                "coord": _coord_expr(
                    coord,
                    n_out,
                    n_in,
                    s,
                    plan.roi[ax],
                    plan.roi[rank + ax],
                    plan.lengths[ax],
                    f"c{ax}",
                )
                if resized
                else "",
            }
        )
    ca = float(a["cubic_coeff_a"])
    cubic = {
        "a": f"({c_float(ca, 'double')})",
        "a2": f"({c_float(ca + 2, 'double')})",
        "a3": f"({c_float(ca + 3, 'double')})",
        "a4": f"({c_float(4 * ca, 'double')})",
        "a5": f"({c_float(5 * ca, 'double')})",
        "a8": f"({c_float(8 * ca, 'double')})",
        "exclude": bool(a["exclude_outside"]),
    }
    t = prog.ctype(x)
    fill = np.asarray(a["extrapolation_value"]).astype(x.type.dtype.np)
    name = prog.kernel(
        "shape.cu.j2",
        "resize",
        ctype=t,
        dims=dims,
        mode=a["mode"],
        rounding=_ROUNDING[a["nearest_mode"]],
        extrapolate=coord == "tf_crop_and_resize",
        fill=c_literal(fill, x.type.dtype, t),
        cubic=cubic,
    )
    launch_over(prog, name, out, [x])


def _resize_emit(prog: Program, node: Node) -> None:
    a = node_attrs(node)
    roi_in = node.inputs[1] if len(node.inputs) > 1 else None
    if (
        roi_in is not None
        and roi_in.const is None
        and a["coordinate_transformation_mode"] == "tf_crop_and_resize"
    ):
        raise prog.fail("the roi input must be a constant for tf_crop_and_resize")
    roi = roi_in.const if roi_in is not None else None
    _emit_resize(prog, node, a, roi, const_input(node, 2), const_input(node, 3))


_RESIZE_DEFAULTS = {
    "antialias": 0,
    "axes": None,
    "coordinate_transformation_mode": "half_pixel",
    "cubic_coeff_a": -0.75,
    "exclude_outside": 0,
    "extrapolation_value": 0.0,
    "keep_aspect_ratio_policy": "stretch",
    "mode": "nearest",
    "nearest_mode": "round_prefer_floor",
}

defop(
    "Resize",
    FAMILY,
    infer=_resize_infer,
    reference=_resize_ref,
    attrs=_RESIZE_DEFAULTS,
    inputs=(1, 4),
    flops=_resize_flops,
    onnx_import=_resize_import,
    emit=_resize_emit,
    vjp=_resize_vjp,
)


# Upsample (opsets 7-9) imports as Resize; as an op of its own (the DSL's form: X and a scales
# input, every scale >= 1) it is Resize with asymmetric coordinates and truncating nearest.
def _upsample_attrs(a: Mapping[str, Any]) -> Attrs:
    legacy = {
        "mode": a["mode"],
        "coordinate_transformation_mode": "asymmetric",
        "nearest_mode": "floor",
    }
    return Attrs(legacy).merged(_RESIZE_DEFAULTS)


def _upsample_infer(ctx: InferCtx) -> list[TensorType]:
    scales = ctx.const(1, "scales")
    if (np.asarray(scales, np.float32) < 1).any():
        raise ctx.fail(f"scales {scales.tolist()} must all be >= 1")
    return _resize_types(ctx, _upsample_attrs(ctx.attrs), None, scales, None)


def _upsample_import(n: AdapterNode) -> list[Value]:
    if "scales" in n.attrs:  # opset 7 gives the scales as an attribute
        return _legacy_resize(n, n.const("scales", n.attrs.pop("scales"), np.float32))
    return _legacy_resize(n, n.input(1))


def _upsample_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    g, x = gouts[0], node.inputs[0]
    if g is None or x is None or not need[0]:
        return [None, None]
    a = _upsample_attrs(node_attrs(node))
    for axis, m in reversed(
        list(enumerate(_axis_matrices(x.type.shape, None, const_input(node, 1), None, a)))
    ):
        if m is not None:
            g = grad.adjoint_along(b, g, axis, m)
    return [g, None]


defop(
    "Upsample",
    FAMILY,
    infer=_upsample_infer,
    reference=lambda xs, a: _resize_ref([arg(xs, 0), None, arg(xs, 1)], _upsample_attrs(a)),
    attrs={"mode": "nearest"},
    inputs=2,
    flops=lambda ins, outs, a: _resize_flops(ins, outs, _upsample_attrs(a)),
    onnx_import=_upsample_import,
    emit=lambda prog, node: _emit_resize(
        prog, node, _upsample_attrs(node_attrs(node)), None, const_input(node, 1), None
    ),
    vjp=_upsample_vjp,
)
