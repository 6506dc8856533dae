"""Convolutions: Conv and ConvTranspose, 1-D to 3-D, grouped, strided, dilated and padded.

This module also holds the sliding-window geometry (``Window``, ``window``,
``window_view``) that the pooling ops share: kernel, strides, dilations, explicit or
automatic pads and the output extent, resolved the way onnxruntime resolves them.

Conv is evaluated as im2col + one batched matrix product per group (a strided view of the
padded input gives every window without a Python loop over output pixels), so whole
ResNet/VGG-size models run through the reference in seconds. ConvTranspose is the transposed
product followed by a scatter-add over kernel positions.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from flowc.codegen.cpp import CTYPES
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node, Value
from flowc.ir.types import TensorType
from flowc.ops import grad
from flowc.ops import sbp_rules as sr
from flowc.ops.registry import (
    LIBRARY_SCRATCH,
    InferCtx,
    SbpFn,
    SbpSignature,
    defop,
    node_attrs,
)

if TYPE_CHECKING:
    from flowc.codegen.program import Program

FAMILY = "conv"

AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


# -- shared sliding-window geometry --------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """Where a window slides over the spatial axes, and how many outputs that gives."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pad_begin: tuple[int, ...]
    pad_end: tuple[int, ...]
    out: tuple[int, ...]

    @property
    def spans(self) -> tuple[int, ...]:
        """The extent one dilated kernel covers along each axis."""
        return tuple((k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations, strict=True))


def per_axis(attrs: Mapping[str, Any], name: str, nd: int, default: int) -> tuple[int, ...]:
    """A per-spatial-axis int attribute, checked for length and positivity."""
    v = attrs.get(name)
    if v is None:
        return (default,) * nd
    vals = tuple(int(x) for x in v)
    if len(vals) != nd:
        raise ValueError(f"{name} has {len(vals)} entries, expected {nd} (one per spatial axis)")
    if any(x < 1 for x in vals):
        raise ValueError(f"{name} must be positive, got {list(vals)}")
    return vals


def explicit_pads(attrs: Mapping[str, Any], nd: int) -> list[int]:
    """The ``pads`` attribute (begins then ends, zeros when absent), checked for length and
    sign."""
    v = attrs.get("pads")
    pads = [0] * (2 * nd) if v is None else [int(p) for p in v]
    if len(pads) != 2 * nd:
        raise ValueError(f"pads has {len(pads)} entries, expected {2 * nd} (begins then ends)")
    if any(p < 0 for p in pads):
        raise ValueError(f"pads must be >= 0 (negative pads are not supported), got {pads}")
    return pads


def window(
    spatial: Sequence[int],
    kernel: Sequence[int],
    attrs: Mapping[str, Any],
    *,
    ceil_mode: bool = False,
) -> Window:
    """Resolve strides, dilations and pads (explicit or auto_pad) into a Window.

    Raises ValueError with a user-facing message; callers turn it into a node error.
    """
    nd = len(spatial)
    kernel = tuple(int(k) for k in kernel)
    if len(kernel) != nd:
        raise ValueError(f"kernel_shape has {len(kernel)} entries, expected {nd}")
    if any(k < 1 for k in kernel):
        raise ValueError(f"kernel_shape must be positive, got {list(kernel)}")
    strides = per_axis(attrs, "strides", nd, 1)
    dilations = per_axis(attrs, "dilations", nd, 1)
    spans = [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]
    auto_pad = str(attrs.get("auto_pad", "NOTSET"))
    if auto_pad not in AUTO_PADS:
        raise ValueError(f"auto_pad {auto_pad!r} is not one of {', '.join(AUTO_PADS)}")

    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        # The output keeps ceil(in / stride) positions; the odd pad goes last for SAME_UPPER.
        out = [-(-n // s) for n, s in zip(spatial, strides, strict=True)]
        total = [
            max(0, (o - 1) * s + sp - n)
            for o, s, sp, n in zip(out, strides, spans, spatial, strict=True)
        ]
        begin = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total]
        end = [t - b for t, b in zip(total, begin, strict=True)]
        return Window(kernel, strides, dilations, tuple(begin), tuple(end), tuple(out))

    if auto_pad == "VALID":
        begin, end = [0] * nd, [0] * nd
    else:
        pads = explicit_pads(attrs, nd)
        begin, end = pads[:nd], pads[nd:]
    out = []
    for i in range(nd):
        room = spatial[i] + begin[i] + end[i] - spans[i]
        if room < 0:
            raise ValueError(
                f"the kernel spans {spans[i]} on spatial axis {i}, more than the padded input "
                f"({spatial[i] + begin[i] + end[i]})"
            )
        o = (-(-room // strides[i]) if ceil_mode else room // strides[i]) + 1
        # A window that would start inside the end padding is dropped (ceil_mode only).
        if ceil_mode and (o - 1) * strides[i] >= spatial[i] + begin[i]:
            o -= 1
        out.append(o)
    return Window(kernel, strides, dilations, tuple(begin), tuple(end), tuple(out))


def window_view(x: np.ndarray, w: Window, fill: Any) -> np.ndarray:
    """A (lead..., *out, *kernel) view of every window of x's trailing spatial axes.

    x is padded with ``fill`` (a copy only when padding is needed); the end padding also
    covers windows that ceil_mode lets run past the explicit pads.
    """
    nd = len(w.out)
    lead = x.ndim - nd
    spatial = x.shape[lead:]
    spans = w.spans
    reach = [
        max(0, (o - 1) * s + sp - n - b)
        for o, s, sp, n, b in zip(w.out, w.strides, spans, spatial, w.pad_begin, strict=True)
    ]
    if any(w.pad_begin) or any(reach):
        widths = [(0, 0)] * lead + list(zip(w.pad_begin, reach, strict=True))
        x = np.pad(x, widths, mode="constant", constant_values=fill)
    v = sliding_window_view(x, spans, axis=tuple(range(lead, x.ndim)))
    index = (
        [slice(None)] * lead
        + [slice(0, (o - 1) * s + 1, s) for o, s in zip(w.out, w.strides, strict=True)]
        + [slice(None, None, d) for d in w.dilations]
    )
    return v[tuple(index)]


def compute_dtype(dt: np.dtype) -> np.dtype:
    """The type to accumulate in: float64 stays, narrower floats widen to float32."""
    return np.dtype(np.float64) if dt == np.float64 else np.dtype(np.float32)


def _check_float(ctx: InferCtx, *idx: int) -> None:
    dt = ctx.dtype(idx[0])
    if not dt.is_float:
        raise ctx.fail(f"needs a floating-point input, got {dt}")
    for i in idx[1:]:
        if ctx.has(i) and ctx.dtype(i) != dt:
            raise ctx.fail(f"input {i} has element type {ctx.dtype(i)}, expected {dt}")


def _check_kernel_attr(ctx: InferCtx, kernel: tuple[int, ...]) -> None:
    ks = ctx.attrs.get("kernel_shape")
    if ks is not None and tuple(int(k) for k in ks) != kernel:
        raise ctx.fail(f"kernel_shape {list(ks)} does not match the weight's {list(kernel)}")


def _bias_check(ctx: InferCtx, channels: int) -> None:
    if ctx.has(2) and ctx.shape(2) != (channels,):
        raise ctx.fail(f"bias must have shape [{channels}], got {list(ctx.shape(2))}")


# -- code generation helpers shared with pool and norm ------------------------------------------


def float_ctype(prog: Program, v: Value) -> str:
    """The C++ type of a float32/float64 value; a clear codegen error for other types."""
    t = CTYPES.get(v.type.dtype)
    if t not in ("float", "double"):
        raise prog.fail(f"element type {v.type.dtype} has no kernel yet (float32 and float64 do)")
    return t


def flat_index(names: Sequence[str], sizes: Sequence[int]) -> str:
    """The row-major offset of coordinates ``names`` in an array of ``sizes`` (Horner form)."""
    expr = names[0]
    for name, size in zip(names[1:], sizes[1:], strict=True):
        expr = f"({expr}) * {size} + {name}" if " " in expr else f"{expr} * {size} + {name}"
    return expr


# -- SBP ----------------------------------------------------------------------------------------


def _conv_sbp(w_out: int, w_in: int) -> SbpFn:
    """Conv is linear in X and in W (and adds the bias): split the batch; with one group,
    split the output channels (W's axis ``w_out``, the bias with them) or the input channels
    (W's axis ``w_in``) into partial sums, the bias then P so that it is added once. Split
    groups would need a local ``group`` attribute, and spatial splits a halo: neither is
    offered."""

    def sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
        sigs = [
            sr.sig(ctx, {0: sr.S(0)}, sr.S(0), 1),
            sr.partial(ctx, outs, (0, 2)),
            sr.partial(ctx, outs, (1, 2)),
        ]
        if ctx.attr("group") == 1:
            sigs.append(sr.sig(ctx, {1: sr.S(w_out), 2: sr.S(0)}, sr.S(1), 1))
            sigs.append(sr.sig(ctx, {0: sr.S(1), 1: sr.S(w_in), 2: sr.P}, sr.P, 1))
        return sigs

    return sbp


# -- Conv -------------------------------------------------------------------------------------


def _conv_window(x: tuple[int, ...], w: tuple[int, ...], a: Attrs) -> Window:
    return window(x[2:], w[2:], a)


def _conv_infer(ctx: InferCtx) -> list[TensorType]:
    _check_float(ctx, 0, 1, 2)
    x, w = ctx.shape(0), ctx.shape(1)
    if len(x) < 3:
        raise ctx.fail(f"input must be N x C x spatial..., got shape {list(x)}")
    if len(w) != len(x):
        raise ctx.fail(f"weight has rank {len(w)}, expected {len(x)} like the input {list(x)}")
    group = int(ctx.attr("group"))
    if group < 1 or x[1] % group or w[0] % group:
        raise ctx.fail(f"group {group} must divide the {x[1]} input and {w[0]} output channels")
    if w[1] * group != x[1]:
        raise ctx.fail(
            f"weight {list(w)} expects {w[1] * group} input channels (group {group}), "
            f"the input has {x[1]}"
        )
    _check_kernel_attr(ctx, w[2:])
    _bias_check(ctx, w[0])
    geo = ctx.check(_conv_window, x, w, ctx.attrs)
    return [TensorType((x[0], w[0], *geo.out), ctx.dtype(0))]


def _conv_compute(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    """Conv (bias included) in the compute type, before the one rounding to x's type."""
    x, w, b = xs[0], xs[1], xs[2] if len(xs) > 2 else None
    assert x is not None and w is not None
    geo = _conv_window(x.shape, w.shape, a)
    ct = compute_dtype(x.dtype)
    n, c = x.shape[:2]
    m = w.shape[0]
    g = int(a["group"])
    cg, mg = c // g, m // g
    nd = len(geo.out)
    p, k = math.prod(geo.out), math.prod(geo.kernel)

    win = window_view(x.astype(ct, copy=False), geo, 0)  # (N, C, *out, *kernel)
    win = win.reshape(n, g, cg, *geo.out, *geo.kernel)
    # One copy into im2col layout (G, Cg*K, N*P), then one BLAS product per group. Taking the
    # weights on the left copies whole output rows at a time and, for N = 1, leaves the
    # result already in N x C x spatial order.
    order = (1, 2, *range(3 + nd, 3 + 2 * nd), 0, *range(3, 3 + nd))
    cols = win.transpose(order).reshape(g, cg * k, n * p)
    # The product accumulates in float64: a BLAS's float32 kernels sum output rows at tile
    # edges in another order than inside tiles, so channels with equal weights would differ
    # in their last bits, and a softmax of large equal logits (the onnx package's light
    # models) is sensitive to exactly that. Rounded back once, equal channels stay equal.
    y = np.matmul(
        w.astype(np.float64).reshape(g, mg, cg * k), cols.astype(np.float64, copy=False)
    ).astype(ct, copy=False)  # (G, Mg, N*P)
    y = y.reshape(m, n, p).transpose(1, 0, 2).reshape(n, m, *geo.out)
    if b is not None:
        y = y + b.astype(ct).reshape(m, *([1] * nd))
    return y


def _conv_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = xs[0]
    assert x is not None
    return np.ascontiguousarray(_conv_compute(xs, a), dtype=x.dtype)


def _conv_flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    w = ins[1]
    assert w is not None
    return 2 * outs[0].numel * math.prod(w.shape[1:])


# cuDNN's workspace: the algorithms a plan may take (exact float32 leaves out FFT and Winograd,
# runtime_cpp/flowc/conv.h) need at most the input lowered to columns (the GEMM algorithm's
# im2col: every output pixel times every filter tap of every input channel), none of it for a
# 1x1 convolution of stride 1, plus the scratch every library call gets (matmul.py). An
# algorithm that would want more (FFT of a large TF32 or narrow convolution) is left out of
# the choice, never a failed call.
def _conv_workspace(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    x, w = ins[0], ins[1]
    assert x is not None and w is not None
    y = outs[0]
    taps = math.prod(w.shape[2:])
    strides = a.get("strides") or ()
    if taps == 1 and all(int(s) == 1 for s in strides):
        return LIBRARY_SCRATCH
    pixels = y.numel // max(1, y.shape[1])  # n x the output's spatial size
    return LIBRARY_SCRATCH + pixels * x.shape[1] * taps * x.dtype.itemsize


# Element types the convolution wrapper (runtime_cpp/flowc/conv.h) takes, as its DataType
# enumerator.
_LIBRARY_TYPES = {
    DType.F32: "kF32",
    DType.F16: "kF16",
    DType.BF16: "kBF16",
}
# What the direct kernels accumulate in, per element type.
_ACC_TYPES = {DType.F32: "float", DType.F64: "double", DType.F16: "float", DType.BF16: "float"}
# Float16/bfloat16 convolutions are emitted natively (tensor cores, float32 accumulation).
NARROW = frozenset({DType.F16, DType.BF16})


def library_fields(node: Node) -> dict[str, int] | None:
    """The flowc::ConvDesc geometry of a Conv/FusedConv node when the convolution wrapper
    (cuDNN / im2col + CBLAS) runs it: 1-D or 2-D, float32/16 or bfloat16, pads that fit one
    symmetric pad per axis. None: the direct kernel runs it."""
    x, w = node.inputs[0], node.inputs[1]
    assert x is not None and w is not None
    return library_geometry(x.type.shape, w.type.shape, x.type.dtype, node_attrs(node))


def library_geometry(
    xs: tuple[int, ...], ws: tuple[int, ...], dtype: DType, a: Mapping[str, Any]
) -> dict[str, int] | None:
    """library_fields of a convolution of an input of shape ``xs`` by weights ``ws``."""
    if dtype not in _LIBRARY_TYPES:
        return None
    geo = _conv_window(xs, ws, Attrs(dict(a)))
    spatial = xs[2:]
    nd = len(spatial)
    # The wrapper takes one pad per axis, used at both ends. An uneven pad still fits when the
    # shorter pad gives the same windows: every window starts at o * stride - pad_begin, so
    # only the output extent can differ.
    fits = all(
        (size + 2 * pb - span) // s + 1 == o
        for size, pb, span, s, o in zip(
            spatial, geo.pad_begin, geo.spans, geo.strides, geo.out, strict=True
        )
    )
    if nd not in (1, 2) or not fits:
        return None
    two = (1,) * (2 - nd)  # a 1-D convolution is a 2-D one of height 1
    h, wd = (*two, *spatial)
    r, s = (*two, *geo.kernel)
    sh, sw = (*two, *geo.strides)
    dh, dw = (*two, *geo.dilations)
    ph, pw = ((0,) * (2 - nd) + geo.pad_begin)[-2:]
    return {
        "n": xs[0],
        "c": xs[1],
        "h": h,
        "w": wd,
        "k": ws[0],
        "r": r,
        "s": s,
        "groups": int(a["group"]),
        "stride_h": sh,
        "stride_w": sw,
        "pad_h": ph,
        "pad_w": pw,
        "dil_h": dh,
        "dil_w": dw,
    }


def _emit_conv(prog: Program, node: Node, residual: Value | None, relu: bool) -> None:
    """Conv or FusedConv: y = act(conv(x, w) + b + z), one library call through a plan made
    in create() (the wrapper fuses the epilogue, or falls back to one epilogue kernel), or
    the direct kernel with the epilogue in it."""
    x, w = node.inputs[0], node.inputs[1]
    assert x is not None and w is not None
    b = node.inputs[2] if len(node.inputs) > 2 else None
    y = node.outputs[0]
    dt = x.type.dtype
    if dt not in _ACC_TYPES:
        raise prog.fail(f"element type {dt} has no convolution kernel yet")
    if y.type.numel == 0:
        return
    fields = library_fields(node)
    if fields is not None:

        def plan(images: int) -> str:
            return prog.library_plan(
                "conv",
                "conv.cu.j2",
                "conv_plan",
                handle=prog.conv,
                geometry={**fields, "n": images},
                type=_LIBRARY_TYPES[dt],
                tf32=prog.tf32,
                has_bias=b is not None,
                has_residual=residual is not None,
                relu=relu,
                workspace=prog.library_workspace(node),
            )

        operands = {
            "x": prog.cptr(x),
            "w": prog.cptr(w),
            "b": prog.cptr(b) if b is not None else None,
            "z": prog.cptr(residual) if residual is not None else None,
            "y": prog.ptr(y),
            "stream": prog.stream,
        }
        what = f"{node.op} {node.name}"
        if x.type.sym is None:
            prog.call("conv.cu.j2", "conv_run", what, plan=plan(fields["n"]), **operands)
            return
        # A symbolic batch (Program.leading_only): plans for the powers of two up to the
        # bound and the bound itself; a run's batch goes through the fewest of them.
        bound = x.type.shape[0]
        sizes = sorted({1 << k for k in range(bound.bit_length()) if 1 << k <= bound} | {bound})
        prog.call(
            "conv.cu.j2",
            "conv_run_batches",
            what,
            plans=[f"&{plan(n)}" for n in sizes],
            sizes=sizes,
            n=prog.dim(x.type, 0, "hdims"),
            x_image=math.prod(x.type.shape[1:]) * dt.itemsize,
            y_image=math.prod(y.type.shape[1:]) * y.type.dtype.itemsize,
            **operands,
        )
        return
    a = node_attrs(node)
    geo = _conv_window(x.type.shape, w.type.shape, a)
    _direct(
        prog,
        "conv_direct",
        node,
        geo.out,
        geo.kernel,
        geo.strides,
        geo.dilations,
        geo.pad_begin,
        w.type.shape[0] // int(a["group"]),
        residual=residual,
        relu=relu,
    )


def _conv_emit(prog: Program, node: Node) -> None:
    _emit_conv(prog, node, None, False)


def _direct(
    prog: Program,
    macro: str,
    node: Node,
    out: tuple[int, ...],
    kernel: tuple[int, ...],
    strides: tuple[int, ...],
    dilations: tuple[int, ...],
    pads: tuple[int, ...],
    mg: int,
    *,
    residual: Value | None = None,
    relu: bool = False,
) -> None:
    x, w = node.inputs[0], node.inputs[1]
    assert x is not None and w is not None
    b = node.inputs[2] if len(node.inputs) > 2 else None
    y = node.outputs[0]
    c = x.type.shape[1]
    group = int(node_attrs(node)["group"])
    spatial = x.type.shape[2:]
    nd = len(spatial)
    name = prog.kernel(
        "conv.cu.j2",
        macro,
        ctype=prog.ctype(x),
        acc_type=_ACC_TYPES[x.type.dtype],
        out=list(out),
        spatial=list(spatial),
        kernel=list(kernel),
        strides=list(strides),
        dilations=list(dilations),
        pads=list(pads),
        c=c,
        cg=c // group,
        mc=y.type.shape[1],
        mg=mg,
        has_bias=b is not None,
        has_residual=residual is not None,
        relu=relu,
        x_index=flat_index([f"i{d}" for d in range(nd)], spatial),
        w_index=flat_index([f"k{d}" for d in range(nd)], kernel),
    )
    args = [
        prog.cptr(x),
        prog.cptr(w),
        *([prog.cptr(b)] if b is not None else []),
        *([prog.cptr(residual)] if residual is not None else []),
        prog.ptr(y),
    ]
    prog.launch_numel(name, y.type, args)


def spread_back(
    b: grad.GradBuilder,
    g: Value,
    w: Value,
    geo: Window,
    spatial: Sequence[int],
    group: int,
    pad_end: Sequence[int] | None = None,
) -> Value:
    """The ConvTranspose of ``g`` (a windowed op's output gradient) by ``w`` over ``geo``'s
    window, back to an input of ``spatial`` extent: each output's gradient spread over its
    window's taps (Conv's data gradient; the pools' with a kernel of ones). output_padding
    restores what the stride dropped at the end; ``pad_end`` (default the window's) may grow
    to cover a window that ceil_mode ran past the input."""
    nd = len(spatial)
    end = list(geo.pad_end if pad_end is None else pad_end)
    back = [
        (geo.out[i] - 1) * geo.strides[i] - geo.pad_begin[i] - end[i] + geo.spans[i]
        for i in range(nd)
    ]
    return grad.op1(
        b,
        "ConvTranspose",
        g,
        w,
        group=group,
        strides=list(geo.strides),
        dilations=list(geo.dilations),
        pads=[*geo.pad_begin, *end],
        output_padding=[spatial[i] - back[i] for i in range(nd)],
    )


def _window_weight_grad(
    b: grad.GradBuilder,
    src: Value,
    g: Value,
    group: int,
    strides: Sequence[int],
    dilations: Sequence[int],
    pad_begin: Sequence[int],
    pad_end: Sequence[int],
    kernel: Sequence[int],
) -> Value:
    """R[q, c, k] = sum over n and window positions p of g[n, q, p] * src[n, c', p s - pad + k d]
    (c' the c-th channel of q's group): a weight's gradient where ``src`` (N, Cs, S...) is
    what the window slides over and ``g`` (N, Cq, P...) what sits at the window positions
    (Conv: X and the output's gradient; ConvTranspose: the output's gradient and X). One Conv
    with batch and channels exchanged (src as Cs/G x (G N), g as Cq x N per group; stride
    and dilation trade places), cut to the kernel's extent; shape (Cq, Cs/G, kernel)."""
    n, cs, sp = src.type.shape[0], src.type.shape[1], list(src.type.shape[2:])
    cq, pos = g.type.shape[1], list(g.type.shape[2:])
    nd = len(sp)
    csg, cqg = cs // group, cq // group
    axes = list(range(3, 3 + nd))
    st = grad.reshape(b, src, [n, group, csg, *sp])
    st = grad.reshape(b, grad.op1(b, "Transpose", st, perm=[2, 1, 0, *axes]), [csg, group * n, *sp])
    gt = grad.reshape(b, g, [n, group, cqg, *pos])
    gt = grad.reshape(b, grad.op1(b, "Transpose", gt, perm=[1, 2, 0, *axes]), [cq, n, *pos])
    # Windows that reach past the end of src's padding add nothing: the end pad need only
    # let every kernel position have its window.
    need_end = [
        max(
            0, (pos[i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - sp[i] - pad_begin[i]
        )
        for i in range(nd)
    ]
    r = grad.op1(
        b,
        "Conv",
        st,
        gt,
        group=group,
        strides=list(dilations),
        dilations=list(strides),
        pads=[*pad_begin, *(max(e, ne) for e, ne in zip(pad_end, need_end, strict=True))],
    )
    if tuple(r.type.shape[2:]) != tuple(kernel):
        r = grad.op1(
            b,
            "Slice",
            r,
            grad.ints(b, [0] * nd),
            grad.ints(b, list(kernel)),
            grad.ints(b, list(range(2, 2 + nd))),
        )
    return grad.op1(b, "Transpose", r, perm=[1, 0, *range(2, 2 + nd)])


def _conv_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """Conv's gradients as convolutions (no new kernel): the data's is the ConvTranspose of
    the output's gradient by W (same strides, dilations, pads and groups; output_padding
    gives back X's extent where the stride dropped a remainder); the weight's is a Conv of X
    by the output's gradient with the roles of batch and channels swapped (group g: the
    inputs' channels of g by its outputs'; stride and dilation exchanged), cut to the
    kernel's extent; the bias's the output's gradient summed over all but the channels."""
    g = gouts[0]
    x, w = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    if g is None or x is None or w is None:
        return [None] * len(node.inputs)
    a = node_attrs(node)
    xs, ws = x.type.shape, w.type.shape
    geo = _conv_window(xs, ws, a)
    nd, group = len(xs) - 2, int(a["group"])
    out: list[Value | None] = [None] * len(node.inputs)
    # Where the forward runs through the library, so do its gradients (cuDNN's backward
    # calls); otherwise as convolutions.
    library = library_geometry(xs, ws, x.type.dtype, a) is not None
    fwd = {k: a[k] for k in _CONV_ATTRS if a.get(k) is not None}
    if need[0]:
        if library:
            out[0] = grad.op1(b, "ConvGradData", g, w, **fwd, x_shape=list(xs))
        else:
            out[0] = spread_back(b, g, w, geo, xs[2:], group)
    if need[1]:
        if library:
            out[1] = grad.op1(b, "ConvGradFilter", x, g, **fwd, w_shape=list(ws))
        else:
            out[1] = _window_weight_grad(
                b, x, g, group, geo.strides, geo.dilations, geo.pad_begin, geo.pad_end, ws[2:]
            )
    if bias is not None and len(need) > 2 and need[2]:
        out[2] = grad.reduce_sum(b, g, [0, *range(2, 2 + nd)], keepdims=False)
    return out


_CONV_TRANSPOSE_ATTRS = {
    "auto_pad": "NOTSET",
    "group": 1,
    "dilations": None,
    "kernel_shape": None,
    "output_padding": None,
    "output_shape": None,
    "pads": None,
    "strides": None,
}
_CONV_ATTRS = {
    "auto_pad": "NOTSET",
    "group": 1,
    "dilations": None,
    "kernel_shape": None,
    "pads": None,
    "strides": None,
}

defop(
    "Conv",
    FAMILY,
    infer=_conv_infer,
    reference=_conv_ref,
    attrs=_CONV_ATTRS,
    inputs=(2, 3),
    flops=_conv_flops,
    sbp=_conv_sbp(w_out=0, w_in=1),
    emit=_conv_emit,
    library="conv",
    sized_leading=True,
    workspace=_conv_workspace,
    narrow=NARROW,
    vjp=_conv_vjp,
)


# -- ConvGradData, ConvGradFilter ---------------------------------------------------------------
# A convolution's gradients as the library's backward calls (cuDNN's BackwardData and
# BackwardFilter, deterministic algorithms only; im2col + GEMM on the host): what Conv's VJP
# emits where the forward runs through the library (library_geometry). Each carries the
# forward's attributes and the shape of what it differentiates (x_shape / w_shape).


def _grad_forward(a: Mapping[str, Any]) -> Attrs:
    """The forward Conv's attributes of a gradient op's."""
    return Attrs({k: a[k] for k in _CONV_ATTRS if k in a}).merged(_CONV_ATTRS)


def _grad_shape(ctx: InferCtx, name: str) -> tuple[int, ...]:
    shape = ctx.attr(name)
    if not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 1 for n in shape):
        raise ctx.fail(f"{name} must be the positive sizes of the differentiated tensor")
    return shape


def _grad_check(
    ctx: InferCtx, xs: tuple[int, ...], ws: tuple[int, ...], dy: tuple[int, ...]
) -> None:
    a = _grad_forward(ctx.attrs)
    if len(xs) != len(ws) or len(xs) < 3:
        raise ctx.fail(f"x {list(xs)} and w {list(ws)} are no convolution's operands")
    geo = ctx.check(_conv_window, xs, ws, a)
    want = (xs[0], ws[0], *geo.out)
    if tuple(dy) != want:
        raise ctx.fail(
            f"the output's gradient has shape {list(dy)}, the convolution's is {list(want)}"
        )
    _check_float(ctx, 0, 1)


def _grad_data_infer(ctx: InferCtx) -> list[TensorType]:
    xs = _grad_shape(ctx, "x_shape")
    _grad_check(ctx, xs, ctx.shape(1), ctx.shape(0))
    return [TensorType(xs, ctx.dtype(0))]


def _grad_filter_infer(ctx: InferCtx) -> list[TensorType]:
    ws = _grad_shape(ctx, "w_shape")
    _grad_check(ctx, ctx.shape(0), ws, ctx.shape(1))
    return [TensorType(ws, ctx.dtype(0))]


def _data_transpose_attrs(
    xs: tuple[int, ...], ws: tuple[int, ...], a: Mapping[str, Any]
) -> dict[str, Any]:
    """The ConvTranspose that is the data's gradient (spread_back's attributes)."""
    geo = _conv_window(xs, ws, Attrs(dict(a)))
    spatial = xs[2:]
    nd = len(spatial)
    back = [
        (geo.out[i] - 1) * geo.strides[i] - geo.pad_begin[i] - geo.pad_end[i] + geo.spans[i]
        for i in range(nd)
    ]
    return {
        "group": int(a["group"]),
        "strides": list(geo.strides),
        "dilations": list(geo.dilations),
        "pads": [*geo.pad_begin, *geo.pad_end],
        "output_padding": [spatial[i] - back[i] for i in range(nd)],
    }


def _grad_data_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    dy, w = xs[0], xs[1]
    assert dy is not None and w is not None
    x_shape = tuple(int(n) for n in a["x_shape"])
    attrs = _data_transpose_attrs(x_shape, w.shape, _grad_forward(a))
    ct = Attrs(attrs).merged(_CONV_TRANSPOSE_ATTRS)
    return _conv_transpose_ref([dy, w], ct)


def _grad_filter_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    """_window_weight_grad's Conv with batch and channels exchanged, in NumPy."""
    x, dy = xs[0], xs[1]
    assert x is not None and dy is not None
    fwd = _grad_forward(a)
    ws = tuple(int(n) for n in a["w_shape"])
    geo = _conv_window(x.shape, ws, fwd)
    group = int(fwd["group"])
    n, cs, sp = x.shape[0], x.shape[1], list(x.shape[2:])
    cq, pos = dy.shape[1], list(dy.shape[2:])
    nd = len(sp)
    csg, cqg = cs // group, cq // group
    axes = list(range(3, 3 + nd))
    st = x.reshape(n, group, csg, *sp).transpose(2, 1, 0, *axes).reshape(csg, group * n, *sp)
    gt = dy.reshape(n, group, cqg, *pos).transpose(1, 2, 0, *axes).reshape(cq, n, *pos)
    need_end = [
        max(0, (pos[i] - 1) * geo.strides[i] + (ws[2 + i] - 1) * geo.dilations[i] + 1 - sp[i]
            - geo.pad_begin[i])
        for i in range(nd)
    ]  # fmt: skip
    conv = Attrs(
        {
            "group": group,
            "strides": list(geo.dilations),
            "dilations": list(geo.strides),
            "pads": [
                *geo.pad_begin,
                *(max(e, m) for e, m in zip(geo.pad_end, need_end, strict=True)),
            ],
        }
    ).merged(_CONV_ATTRS)
    r = _conv_ref([np.ascontiguousarray(st), np.ascontiguousarray(gt)], conv)
    r = r[(slice(None), slice(None), *(slice(0, k) for k in ws[2:]))]
    return np.ascontiguousarray(r.transpose(1, 0, *range(2, 2 + nd)))


def _grad_operands(
    ins: list[TensorType | None], a: Attrs
) -> tuple[TensorType, tuple[int, ...], tuple[int, ...]]:
    """A gradient op's output gradient type and the forward's x and w shapes."""
    a0, a1 = ins[0], ins[1]
    assert a0 is not None and a1 is not None
    if a.get("x_shape") is not None:  # ConvGradData(dy, w)
        return a0, tuple(int(n) for n in a["x_shape"]), a1.shape
    return a1, a0.shape, tuple(int(n) for n in a["w_shape"])  # ConvGradFilter(x, dy)


def _grad_flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    # The forward's multiply-adds: each output gradient element meets every tap of its window.
    dy, _, ws = _grad_operands(ins, a)
    return 2 * dy.numel * math.prod(ws[1:])


def _grad_workspace(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    # As the forward's (_conv_workspace): the input's columns, which the deterministic
    # backward algorithms stay within.
    dy, xs, ws = _grad_operands(ins, a)
    pixels = dy.numel // max(1, dy.shape[1])
    return LIBRARY_SCRATCH + pixels * xs[1] * math.prod(ws[2:]) * dy.dtype.itemsize


def _grad_emit(prog: Program, node: Node, which: str) -> None:
    """One backward library call through a plan made in create()."""
    a, b = node.inputs[0], node.inputs[1]
    assert a is not None and b is not None
    out = node.outputs[0]
    attrs = node_attrs(node)
    fwd = _grad_forward(attrs)
    if which == "kData":
        dy, w = a, b
        xs, ws = tuple(int(n) for n in attrs["x_shape"]), w.type.shape
        operand = w
    else:
        x, dy = a, b
        xs, ws = x.type.shape, tuple(int(n) for n in attrs["w_shape"])
        operand = x
    if out.type.numel == 0:
        return
    fields = library_geometry(xs, ws, dy.type.dtype, fwd)
    if fields is None:
        raise prog.fail("its convolution does not run through the library (Conv's VJP emits none)")
    plan = prog.library_plan(
        "conv_bwd",
        "conv.cu.j2",
        "conv_bwd_plan",
        handle=prog.conv,
        geometry=fields,
        type=_LIBRARY_TYPES[dy.type.dtype],
        tf32=prog.tf32,
        which=which,
        workspace=prog.library_workspace(node),
    )
    prog.call(
        "conv.cu.j2",
        "conv_bwd_run",
        f"{node.op} {node.name}",
        plan=plan,
        a=prog.cptr(operand),
        dy=prog.cptr(dy),
        out=prog.ptr(out),
        stream=prog.stream,
    )


defop(
    "ConvGradData",
    FAMILY,
    infer=_grad_data_infer,
    reference=_grad_data_ref,
    attrs={**_CONV_ATTRS, "x_shape": None},
    inputs=2,
    flops=_grad_flops,
    emit=lambda prog, node: _grad_emit(prog, node, "kData"),
    library="conv",
    workspace=_grad_workspace,
    narrow=NARROW,
)
defop(
    "ConvGradFilter",
    FAMILY,
    infer=_grad_filter_infer,
    reference=_grad_filter_ref,
    attrs={**_CONV_ATTRS, "w_shape": None},
    inputs=2,
    flops=_grad_flops,
    emit=lambda prog, node: _grad_emit(prog, node, "kFilter"),
    library="conv",
    workspace=_grad_workspace,
    narrow=NARROW,
)


# -- FusedConv ------------------------------------------------------------------------------
# What passes/fuse_conv.py makes of a Conv and the Add (a residual) and Relu after it:
# y = act(conv(x, w) + b + z), inputs (X, W, B?, Z?), computed in float and rounded once.

ACTIVATIONS = ("", "Relu")


def _fused_conv_infer(ctx: InferCtx) -> list[TensorType]:
    act = ctx.attr("activation")
    if act not in ACTIVATIONS:
        raise ctx.fail(f"activation {act!r} is not one of {', '.join(map(repr, ACTIVATIONS))}")
    base = InferCtx(
        ctx.op,
        ctx.node_name,
        list(ctx.types[:3]),
        list(ctx.consts[:3]),
        ctx.attrs,
        1,
    )
    (y,) = _conv_infer(base)
    if ctx.has(3) and (ctx.shape(3) != y.shape or ctx.dtype(3) != y.dtype):
        raise ctx.fail(
            f"the residual must be {y.dtype}{list(y.shape)} like the result, got "
            f"{ctx.dtype(3)}{list(ctx.shape(3))}"
        )
    return [y]


def _fused_conv_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = xs[0]
    assert x is not None
    y = _conv_compute(xs[:3], a)
    z = xs[3] if len(xs) > 3 else None
    if z is not None:
        y = y + z.astype(y.dtype)
    if a["activation"] == "Relu":
        y = np.where(y < 0, np.zeros((), y.dtype), y)  # NaN stays NaN
    return np.ascontiguousarray(y, dtype=x.dtype)


def _fused_conv_flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    extra = (ins[3] is not None if len(ins) > 3 else False) + (a["activation"] != "")
    return _conv_flops(ins, outs, a) + extra * outs[0].numel


def _fused_conv_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    """Conv's batch and output-channel splits, the residual laid out like the result. The
    activation is not linear, so no partial sums."""
    sigs = [sr.sig(ctx, {0: sr.S(0), 3: sr.S(0)}, sr.S(0), 1)]
    if ctx.attr("group") == 1:
        sigs.append(sr.sig(ctx, {1: sr.S(0), 2: sr.S(0), 3: sr.S(1)}, sr.S(1), 1))
    return sigs


def _fused_conv_emit(prog: Program, node: Node) -> None:
    z = node.inputs[3] if len(node.inputs) > 3 else None
    _emit_conv(prog, node, z, node_attrs(node)["activation"] == "Relu")


defop(
    "FusedConv",
    FAMILY,
    infer=_fused_conv_infer,
    reference=_fused_conv_ref,
    attrs={**_CONV_ATTRS, "activation": ""},
    inputs=(2, 4),
    flops=_fused_conv_flops,
    sbp=_fused_conv_sbp,
    emit=_fused_conv_emit,
    library="conv",
    sized_leading=True,
    workspace=_conv_workspace,
    narrow=NARROW,
)


# -- ConvTranspose ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TransposeGeometry:
    out: tuple[int, ...]
    pad_begin: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]


def _transpose_geometry(
    x: tuple[int, ...], w: tuple[int, ...], a: Mapping[str, Any]
) -> _TransposeGeometry:
    """Output extent and leading pad, resolved as ONNX (and onnxruntime) resolve them.

    An output_shape, given or implied by SAME_* (input * stride), fixes the total padding;
    its odd unit goes to the end for SAME_UPPER and to the start otherwise. VALID pads
    nothing; NOTSET without output_shape uses the explicit pads.
    """
    spatial, kernel = x[2:], w[2:]
    nd = len(spatial)
    strides = per_axis(a, "strides", nd, 1)
    dilations = per_axis(a, "dilations", nd, 1)
    adj = a.get("output_padding")
    adj = (0,) * nd if adj is None else tuple(int(v) for v in adj)
    if len(adj) != nd:
        raise ValueError(f"output_padding has {len(adj)} entries, expected {nd}")
    for i in range(nd):
        if not 0 <= adj[i] < max(strides[i], dilations[i]):
            raise ValueError(
                f"output_padding {list(adj)} must be smaller than the stride or dilation on "
                f"spatial axis {i}"
            )
    auto_pad = str(a.get("auto_pad", "NOTSET"))
    if auto_pad not in AUTO_PADS:
        raise ValueError(f"auto_pad {auto_pad!r} is not one of {', '.join(AUTO_PADS)}")
    full = [
        (n - 1) * s + (k - 1) * d + 1 + p
        for n, s, k, d, p in zip(spatial, strides, kernel, dilations, adj, strict=True)
    ]
    shape = a.get("output_shape")
    if shape is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        shape = tuple(n * s for n, s in zip(spatial, strides, strict=True))
    if shape is not None:
        shape = tuple(int(v) for v in shape)
        if len(shape) != nd or any(v < 1 for v in shape):
            raise ValueError(f"output_shape {list(shape)} must give {nd} positive sizes")
        # An output larger than the full result is zero beyond it (total padding 0).
        total = [max(0, f - o) for f, o in zip(full, shape, strict=True)]
        begin = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total]
        out = list(shape)
    elif auto_pad == "VALID":
        begin, out = [0] * nd, full
    else:
        pads = explicit_pads(a, nd)
        begin = pads[:nd]
        out = [f - pads[i] - pads[nd + i] for i, f in enumerate(full)]
        if any(o < 1 for o in out):
            raise ValueError(f"pads {pads} leave an empty output {out}")
    return _TransposeGeometry(tuple(out), tuple(begin), strides, dilations)


def _conv_transpose_infer(ctx: InferCtx) -> list[TensorType]:
    _check_float(ctx, 0, 1, 2)
    x, w = ctx.shape(0), ctx.shape(1)
    if len(x) < 3:
        raise ctx.fail(f"input must be N x C x spatial..., got shape {list(x)}")
    if len(w) != len(x):
        raise ctx.fail(f"weight has rank {len(w)}, expected {len(x)} like the input {list(x)}")
    group = int(ctx.attr("group"))
    if group < 1 or x[1] % group:
        raise ctx.fail(f"group {group} must divide the {x[1]} input channels")
    if w[0] != x[1]:
        raise ctx.fail(f"weight {list(w)} expects {w[0]} input channels, the input has {x[1]}")
    _check_kernel_attr(ctx, w[2:])
    _bias_check(ctx, w[1] * group)
    geo = ctx.check(_transpose_geometry, x, w, ctx.attrs)
    return [TensorType((x[0], w[1] * group, *geo.out), ctx.dtype(0))]


def _conv_transpose_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, w, b = xs[0], xs[1], xs[2] if len(xs) > 2 else None
    assert x is not None and w is not None
    geo = _transpose_geometry(x.shape, w.shape, a)
    ct = compute_dtype(x.dtype)
    n, c = x.shape[:2]
    spatial, kernel = x.shape[2:], w.shape[2:]
    nd = len(spatial)
    g = int(a["group"])
    cg, mg = c // g, w.shape[1]
    p = math.prod(spatial)

    xm = x.astype(ct, copy=False).reshape(n, g, cg, p).transpose(1, 0, 3, 2).reshape(g, n * p, cg)
    wm = w.astype(ct, copy=False).reshape(g, cg, mg * math.prod(kernel))
    cols = np.matmul(xm, wm).reshape(g, n, *spatial, mg, *kernel)
    # (N, G, Mg, *kernel, *in): indexing one kernel position gives an (N, G, Mg, *in) view.
    order = (1, 0, 2 + nd, *range(3 + nd, 3 + 2 * nd), *range(2, 2 + nd))
    cols = cols.transpose(order)

    full = [
        (i - 1) * s + (k - 1) * d + 1
        for i, s, k, d in zip(spatial, geo.strides, kernel, geo.dilations, strict=True)
    ]
    extent = [max(f, pb + o) for f, pb, o in zip(full, geo.pad_begin, geo.out, strict=True)]
    acc = np.zeros((n, g, mg, *extent), dtype=ct)
    for pos in itertools.product(*(range(k) for k in kernel)):
        target = tuple(
            slice(q * d, q * d + (i - 1) * s + 1, s)
            for q, d, i, s in zip(pos, geo.dilations, spatial, geo.strides, strict=True)
        )
        acc[(slice(None),) * 3 + target] += cols[(slice(None),) * 3 + pos]
    crop = tuple(slice(pb, pb + o) for pb, o in zip(geo.pad_begin, geo.out, strict=True))
    y = acc[(slice(None),) * 3 + crop].reshape(n, g * mg, *geo.out)
    if b is not None:
        y = y + b.astype(ct).reshape(g * mg, *([1] * nd))
    return np.ascontiguousarray(y, dtype=x.dtype)


def _conv_transpose_flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    x, w = ins[0], ins[1]
    assert x is not None and w is not None
    return 2 * x.numel * math.prod(w.shape[1:])


def _conv_transpose_emit(prog: Program, node: Node) -> None:
    x, w = node.inputs[0], node.inputs[1]
    assert x is not None and w is not None
    float_ctype(prog, x)
    geo = _transpose_geometry(x.type.shape, w.type.shape, node_attrs(node))
    if node.outputs[0].type.numel == 0:
        return
    kernel = w.type.shape[2:]
    _direct(
        prog,
        "conv_transpose_direct",
        node,
        geo.out,
        kernel,
        geo.strides,
        geo.dilations,
        geo.pad_begin,
        w.type.shape[1],
    )


def _conv_transpose_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """ConvTranspose is the adjoint of a Conv in its input: the data's gradient is that Conv
    of the output's gradient by W (strides, dilations, begin pads and groups kept; the end
    pad whatever lets X's windows fit, the extra cut off); the weight's is the same window
    sum as Conv's with the roles of X and the output's gradient exchanged; the bias's a sum."""
    g = gouts[0]
    x, w = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    if g is None or x is None or w is None:
        return [None] * len(node.inputs)
    a = node_attrs(node)
    xs, ws = x.type.shape, w.type.shape
    geo = _transpose_geometry(xs, ws, a)
    nd, group = len(xs) - 2, int(a["group"])
    ys = g.type.shape[2:]
    spans = [(k - 1) * d + 1 for k, d in zip(ws[2:], geo.dilations, strict=True)]
    end = [
        max(0, (xs[2 + i] - 1) * geo.strides[i] + spans[i] - ys[i] - geo.pad_begin[i])
        for i in range(nd)
    ]
    out: list[Value | None] = [None] * len(node.inputs)
    if need[0]:
        dx = grad.op1(
            b,
            "Conv",
            g,
            w,
            group=group,
            strides=list(geo.strides),
            dilations=list(geo.dilations),
            pads=[*geo.pad_begin, *end],
        )
        if tuple(dx.type.shape[2:]) != tuple(xs[2:]):
            dx = grad.op1(
                b,
                "Slice",
                dx,
                grad.ints(b, [0] * nd),
                grad.ints(b, list(xs[2:])),
                grad.ints(b, list(range(2, 2 + nd))),
            )
        out[0] = dx
    if need[1]:
        out[1] = _window_weight_grad(
            b, g, x, group, geo.strides, geo.dilations, geo.pad_begin, end, ws[2:]
        )
    if bias is not None and len(need) > 2 and need[2]:
        out[2] = grad.reduce_sum(b, g, [0, *range(2, 2 + nd)], keepdims=False)
    return out


defop(
    "ConvTranspose",
    FAMILY,
    infer=_conv_transpose_infer,
    reference=_conv_transpose_ref,
    attrs=_CONV_TRANSPOSE_ATTRS,
    inputs=(2, 3),
    flops=_conv_transpose_flops,
    sbp=_conv_sbp(w_out=1, w_in=0),
    emit=_conv_transpose_emit,
    vjp=_conv_transpose_vjp,
)
