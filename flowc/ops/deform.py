"""DeformConv (opset 19): a convolution whose taps sample the input at learned offsets.

Tap k of output position o reads the input at ``o * stride - pad_begin + k * dilation +
offset[n, og, k, :, o]`` (one fractional coordinate per spatial axis), interpolated
multilinearly (bilinear in 2-D) from the neighbouring input elements, each neighbour outside
the input reading 0; the sample is scaled by the optional ``mask[n, og, k, o]``. The input
channels are split into ``offset_group`` groups that each have their own offsets and mask.
The rest is Conv: grouped weights [M, C / group, kernel...] and an optional bias.

The reference samples every (channel, tap, output position) column with NumPy gathers (one
per interpolation corner) and then multiplies by the weights per group; the kernel runs one
thread per output element, which walks its group's channels and taps and sums the sampled,
masked values times the weights.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

import numpy as np

from flowc.ir.graph import Attrs, Node
from flowc.ir.types import TensorType
from flowc.ops.conv import Window, compute_dtype, float_ctype, window
from flowc.ops.registry import InferCtx, defop, node_attrs

if TYPE_CHECKING:
    from flowc.codegen.program import Program

FAMILY = "conv"


def _geometry(x: tuple[int, ...], w: tuple[int, ...], a: Attrs) -> Window:
    # DeformConv has no auto_pad: explicit pads (or none) only.
    return window(x[2:], w[2:], {k: v for k, v in a.items() if k != "auto_pad"})


def _deform_infer(ctx: InferCtx) -> list[TensorType]:
    x, w = ctx.type(0), ctx.type(1)
    if x.dtype.np.kind != "f":
        raise ctx.fail(f"needs a floating-point input, got {x.dtype}")
    for i, what in ((1, "W"), (2, "offset"), (3, "B"), (4, "mask")):
        if ctx.has(i) and ctx.dtype(i) != x.dtype:
            raise ctx.fail(
                f"{what} (input {i}) has element type {ctx.dtype(i)}, expected {x.dtype}"
            )
    if x.rank < 3:
        raise ctx.fail(f"X must be N x C x spatial..., got shape {list(x.shape)}")
    if w.rank != x.rank:
        raise ctx.fail(f"W has rank {w.rank}, expected {x.rank} like X {list(x.shape)}")
    n, c = x.shape[:2]
    m = w.shape[0]
    nd = x.rank - 2
    group, og = int(ctx.attr("group")), int(ctx.attr("offset_group"))
    if group < 1 or c % group or m % group:
        raise ctx.fail(f"group {group} must divide the {c} input and {m} output channels")
    if w.shape[1] * group != c:
        raise ctx.fail(
            f"W {list(w.shape)} expects {w.shape[1] * group} input channels (group {group}), "
            f"X has {c}"
        )
    if og < 1 or c % og:
        raise ctx.fail(f"offset_group {og} must divide the {c} input channels")
    ks = ctx.attrs.get("kernel_shape")
    if ks is not None and tuple(int(k) for k in ks) != w.shape[2:]:
        raise ctx.fail(f"kernel_shape {list(ks)} does not match W's {list(w.shape[2:])}")
    geo = ctx.check(_geometry, x.shape, w.shape, ctx.attrs)
    taps = math.prod(geo.kernel)
    want = (n, og * taps * nd, *geo.out)
    if ctx.shape(2) != want:
        raise ctx.fail(
            f"offset must have shape {list(want)} (N, offset_group * kernel taps * {nd}, "
            f"output spatial...), got {list(ctx.shape(2))}"
        )
    if ctx.has(3) and ctx.shape(3) != (m,):
        raise ctx.fail(f"B must have shape [{m}], got {list(ctx.shape(3))}")
    if ctx.has(4):
        want_mask = (n, og * taps, *geo.out)
        if ctx.shape(4) != want_mask:
            raise ctx.fail(
                f"mask must have shape {list(want_mask)} (N, offset_group * kernel taps, "
                f"output spatial...), got {list(ctx.shape(4))}"
            )
    return [TensorType((n, m, *geo.out), x.dtype)]


def _sample(x: np.ndarray, offset: np.ndarray, geo: Window, og: int, ct: np.dtype) -> np.ndarray:
    """The sampled columns, (N, C, taps, P): input channel c at tap k of output position p."""
    n, c = x.shape[:2]
    spatial = x.shape[2:]
    nd = len(spatial)
    taps, p = math.prod(geo.kernel), math.prod(geo.out)
    # Where each tap of each output position sits before its offset: (taps, nd, P).
    k_coords = np.indices(geo.kernel).reshape(nd, taps)
    o_coords = np.indices(geo.out).reshape(nd, p)
    strides = np.array(geo.strides).reshape(nd, 1)
    dil = np.array(geo.dilations).reshape(nd, 1)
    begin = np.array(geo.pad_begin).reshape(nd, 1)
    base = (o_coords * strides - begin)[None] + (k_coords * dil).T[:, :, None]
    pos = base[None, None].astype(ct) + offset.astype(ct).reshape(n, og, taps, nd, p)
    # A coordinate at or past -1 / size (or NaN) has no neighbour inside: every corner reads 0.
    size = np.array(spatial, dtype=ct).reshape(nd, 1)
    inside = np.all((pos > -1) & (pos < size), axis=3)  # (N, og, taps, P)
    pos = np.where(inside[:, :, :, None], pos, 0)
    low = np.floor(pos)
    frac = pos - low
    low = low.astype(np.int64)
    flat_x = x.astype(ct, copy=False).reshape(n, og, c // og, math.prod(spatial))
    elem_strides = np.array(
        [math.prod(spatial[d + 1 :]) for d in range(nd)], dtype=np.int64
    ).reshape(nd, 1)
    cols = np.zeros((n, og, c // og, taps * p), dtype=ct)
    for corner in itertools.product((0, 1), repeat=nd):
        step = np.array(corner, dtype=np.int64).reshape(nd, 1)
        idx = low + step  # (N, og, taps, nd, P)
        weight = np.prod(np.where(step == 1, frac, 1 - frac), axis=3)
        ok = inside & np.all((idx >= 0) & (idx < np.array(spatial).reshape(nd, 1)), axis=3)
        flat = np.where(ok, np.sum(idx * elem_strides, axis=3), 0).reshape(n, og, 1, taps * p)
        vals = np.take_along_axis(flat_x, np.broadcast_to(flat, cols.shape), axis=3)
        cols += vals * np.where(ok, weight, 0).reshape(n, og, 1, taps * p)
    return cols.reshape(n, c, taps, p)


def _deform_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, w, offset = xs[0], xs[1], xs[2]
    b = xs[3] if len(xs) > 3 else None
    mask = xs[4] if len(xs) > 4 else None
    assert x is not None and w is not None and offset is not None
    geo = _geometry(x.shape, w.shape, a)
    ct = compute_dtype(x.dtype)
    n, c = x.shape[:2]
    m = w.shape[0]
    g, og = int(a["group"]), int(a["offset_group"])
    taps, p = math.prod(geo.kernel), math.prod(geo.out)
    cols = _sample(x, offset, geo, og, ct)  # (N, C, taps, P)
    if mask is not None:
        per_channel = mask.astype(ct).reshape(n, og, 1, taps, p)
        cols = (cols.reshape(n, og, c // og, taps, p) * per_channel).reshape(n, c, taps, p)
    cg, mg = c // g, m // g
    # (G, Cg * taps, N * P) times the group's weights (G, Mg, Cg * taps).
    cols = cols.reshape(n, g, cg * taps, p).transpose(1, 2, 0, 3).reshape(g, cg * taps, n * p)
    y = np.matmul(w.astype(ct).reshape(g, mg, cg * taps), cols)
    y = y.reshape(m, n, p).transpose(1, 0, 2)
    if b is not None:
        y = y + b.astype(ct).reshape(1, m, 1)
    return np.ascontiguousarray(y.reshape(n, m, *geo.out), dtype=x.dtype)


def _deform_flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    w = ins[1]
    assert w is not None
    nd = w.rank - 2
    # Per channel and tap: 2^nd corner reads with their weights, the mask and the product.
    return outs[0].numel * math.prod(w.shape[1:]) * (2 + 2 * (1 << nd))


def _deform_emit(prog: Program, node: Node) -> None:
    x, w, offset = node.inputs[0], node.inputs[1], node.inputs[2]
    assert x is not None and w is not None and offset is not None
    b = node.inputs[3] if len(node.inputs) > 3 else None
    mask = node.inputs[4] if len(node.inputs) > 4 else None
    y = node.outputs[0]
    t = float_ctype(prog, x)
    a = node_attrs(node)
    geo = _geometry(x.type.shape, w.type.shape, a)
    if y.type.numel == 0:
        return
    c = x.type.shape[1]
    m = w.type.shape[0]
    group, og = int(a["group"]), int(a["offset_group"])
    spatial = x.type.shape[2:]
    nd = len(spatial)
    name = prog.kernel(
        "deform.cu.j2",
        "deform_conv",
        ctype=t,
        out=list(geo.out),
        spatial=list(spatial),
        kernel=list(geo.kernel),
        strides=list(geo.strides),
        dilations=list(geo.dilations),
        pads=list(geo.pad_begin),
        c=c,
        cg=c // group,
        mc=m,
        mg=m // group,
        og=og,
        c_per_og=c // og,
        taps=math.prod(geo.kernel),
        positions=math.prod(geo.out),
        corners=[list(cr) for cr in itertools.product((0, 1), repeat=nd)],
        has_bias=b is not None,
        has_mask=mask is not None,
    )
    args = [prog.cptr(x), prog.cptr(w), prog.cptr(offset)]
    if b is not None:
        args.append(prog.cptr(b))
    if mask is not None:
        args.append(prog.cptr(mask))
    prog.launch(name, y.type.numel, [*args, prog.ptr(y), f"(int64_t){y.type.numel}"])


defop(
    "DeformConv",
    FAMILY,
    infer=_deform_infer,
    reference=_deform_ref,
    attrs={
        "dilations": None,
        "group": 1,
        "kernel_shape": None,
        "offset_group": 1,
        "pads": None,
        "strides": None,
    },
    inputs=(3, 5),
    flops=_deform_flops,
    emit=_deform_emit,
)
