"""Views: Reshape, Flatten, Squeeze, Unsqueeze, Identity and Dropout. Each output holds the
input's elements in the same row-major order, only under another shape (or the same one):
Reshape, Flatten, Squeeze, Unsqueeze and Identity are views (the memory plan aliases the
output to the input; no code runs), a row-major reshape maps a split through as
sbp_rules.reshape_pairs says, and a splat input stays a splat (``move_data``), so folding a
large fill (ConstantOfShape -> Reshape -> Expand) never materializes it. Identity and Dropout
(an identity at inference, its mask all ones) vanish on import.

The inputs that decide the shape (Reshape's shape, Squeeze/Unsqueeze's axes) must fold to
compile-time constants; inference reads them with ``const_ints``, which names the node and
the input when one is only known at run time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from flowc.errors import ShapeError
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, make_splat
from flowc.ir.types import TensorType
from flowc.ops import grad
from flowc.ops import sbp_rules as sr
from flowc.ops.movement import Fail, arg, const_ints, move_data, norm_axes, opt_arg
from flowc.ops.random import import_train_dropout
from flowc.ops.registry import (
    InferCtx,
    SbpSignature,
    defop,
    ints,
    numel,
    same_as_input,
    set_vjp,
)

if TYPE_CHECKING:
    from flowc.ir.builder import AdapterNode
    from flowc.ir.graph import Value

FAMILY = "shape"


# -- Reshape, Flatten, Squeeze, Unsqueeze -----------------------------------------------------
# Moving data is linear, so every op here passes P through; a row-major reshape maps a split
# through as sbp_rules.reshape_pairs says.


def _reshaped(x: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """The reference of every op here: the elements in the same order under ``shape``."""
    return move_data(x, shape, lambda v: v.reshape(shape))


def _reshape_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    return [
        *sr.splits(ctx, outs, sr.reshape_pairs(ctx.shape(0), outs[0].shape)),
        sr.partial(ctx, outs),
    ]


def _reshape_target(
    fail: Fail, in_shape: tuple[int, ...], shape: Sequence[int], allowzero: int
) -> tuple[int, ...]:
    out: list[int] = []
    infer_at = None
    for k, d in enumerate(shape):
        if d == -1:
            if infer_at is not None:
                raise fail(f"target shape {list(shape)} has more than one -1")
            infer_at = k
            out.append(1)
        elif d == 0 and not allowzero:
            if k >= len(in_shape):
                raise fail(
                    f"target shape {list(shape)}: 0 at position {k} copies an input dimension, "
                    f"but the input {list(in_shape)} has rank {len(in_shape)}"
                )
            out.append(in_shape[k])
        elif d < 0:
            raise fail(f"target shape {list(shape)} has the invalid dimension {d}")
        else:
            out.append(d)
    if allowzero and infer_at is not None and 0 in shape:
        raise fail(f"target shape {list(shape)}: allowzero=1 forbids 0 together with -1")
    total = numel(in_shape)
    known = numel(out)
    if infer_at is not None and known != 0 and total % known == 0:
        out[infer_at] = total // known
    elif infer_at is not None or known != total:
        resolved = [-1 if k == infer_at else d for k, d in enumerate(out)]
        raise fail(
            f"cannot reshape the input of shape {list(in_shape)} ({total} elements) "
            f"to {list(shape)}" + (f" (= {resolved})" if resolved != list(shape) else "")
        )
    return tuple(out)


def _reshape_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    shape = const_ints(ctx, 1, "shape")
    return [x.with_shape(_reshape_target(ctx.fail, x.shape, shape, ctx.attr("allowzero")))]


def _reshape_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = arg(xs, 0)
    shape = _reshape_target(ValueError, x.shape, ints(arg(xs, 1)), a["allowzero"])
    return _reshaped(x, shape)


def _reshape_import(n: AdapterNode) -> None:
    if n.opset < 5:
        n.attrs.pop("consumed_inputs", None)
        n.attr_to_input("shape", 1)


defop(
    "Reshape",
    FAMILY,
    infer=_reshape_infer,
    reference=_reshape_ref,
    attrs={"allowzero": 0},
    inputs=2,
    view=True,
    onnx_import=_reshape_import,
    sbp=_reshape_sbp,
    localize=sr.local_shape_input(1),
)


def _flatten_shape(fail: Fail, shape: tuple[int, ...], axis: int) -> tuple[int, int]:
    rank = len(shape)
    if not -rank <= axis <= rank:
        raise fail(f"axis {axis} is out of range [{-rank}, {rank}] for a rank-{rank} tensor")
    axis = axis + rank if axis < 0 else axis
    return numel(shape[:axis]), numel(shape[axis:])


def _flatten_infer(ctx: InferCtx) -> list[TensorType]:
    return [ctx.type(0).with_shape(_flatten_shape(ctx.fail, ctx.shape(0), ctx.attr("axis")))]


def _flatten_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = arg(xs, 0)
    shape = _flatten_shape(ValueError, x.shape, a["axis"])
    return _reshaped(x, shape)


defop(
    "Flatten",
    FAMILY,
    infer=_flatten_infer,
    reference=_flatten_ref,
    attrs={"axis": 1},
    view=True,
    sbp=_reshape_sbp,
)


def _squeeze_shape(
    fail: Fail, shape: tuple[int, ...], axes: Sequence[int] | None
) -> tuple[int, ...]:
    if axes is None:
        return tuple(d for d in shape if d != 1)
    norm = norm_axes(fail, axes, len(shape))
    for ax in norm:
        if shape[ax] != 1:
            raise fail(
                f"cannot squeeze axis {ax} of shape {list(shape)}: its size is {shape[ax]}, not 1"
            )
    return tuple(d for k, d in enumerate(shape) if k not in norm)


def _squeeze_infer(ctx: InferCtx) -> list[TensorType]:
    axes = const_ints(ctx, 1, "axes") if ctx.has(1) else None
    x = ctx.type(0)
    out = x.with_shape(_squeeze_shape(ctx.fail, ctx.shape(0), axes))
    if x.sym is not None and axes is not None:
        # The kept dims keep their symbols (a count the data decides among them: NonZero's
        # row of a 1-D input, which Compress gathers by).
        gone = set(norm_axes(ctx.fail, axes, x.rank))
        kept = tuple(s for k, s in enumerate(x.sym) if k not in gone)
        if any(s is not None for s in kept):
            out = TensorType(out.shape, out.dtype, kept)
    return [out]


def _squeeze_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = arg(xs, 0)
    axes = opt_arg(xs, 1)
    shape = _squeeze_shape(ValueError, x.shape, None if axes is None else ints(axes))
    return _reshaped(x, shape)


def _squeeze_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    # Without axes, each rank would also drop the axes a split leaves at size 1.
    return _reshape_sbp(ctx, outs) if ctx.has(1) else [sr.partial(ctx, outs)]


def _axes_attr_to_input(n: AdapterNode) -> None:
    if n.opset < 13:
        n.attr_to_input("axes", 1)


defop(
    "Squeeze",
    FAMILY,
    infer=_squeeze_infer,
    reference=_squeeze_ref,
    inputs=(1, 2),
    view=True,
    onnx_import=_axes_attr_to_input,
    sbp=_squeeze_sbp,
)


def _unsqueeze_shape(fail: Fail, shape: tuple[int, ...], axes: Sequence[int]) -> tuple[int, ...]:
    rank = len(shape) + len(axes)
    norm = set(norm_axes(fail, axes, rank))
    rest = iter(shape)
    return tuple(1 if k in norm else next(rest) for k in range(rank))


def _unsqueeze_infer(ctx: InferCtx) -> list[TensorType]:
    axes = const_ints(ctx, 1, "axes")
    return [ctx.type(0).with_shape(_unsqueeze_shape(ctx.fail, ctx.shape(0), axes))]


def _unsqueeze_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = arg(xs, 0)
    shape = _unsqueeze_shape(ValueError, x.shape, ints(arg(xs, 1)))
    return _reshaped(x, shape)


defop(
    "Unsqueeze",
    FAMILY,
    infer=_unsqueeze_infer,
    reference=_unsqueeze_ref,
    inputs=2,
    view=True,
    onnx_import=_axes_attr_to_input,
    sbp=_reshape_sbp,
)


# -- Identity, Dropout: they vanish on import ---------------------------------------------------


def _identity_import(n: AdapterNode) -> list[Value]:
    x = n.input(0)
    assert x is not None
    return [x]


defop(
    "Identity",
    FAMILY,
    infer=same_as_input,
    reference=lambda xs, a: arg(xs, 0),
    view=True,
    onnx_import=_identity_import,
    sbp=lambda ctx, outs: [*sr.same_axes(ctx, outs, range(outs[0].rank)), sr.partial(ctx, outs)],
)


def _dropout_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    return [x, x.with_dtype(DType.BOOL)][: ctx.num_outputs]


def _dropout_ref(xs: list[np.ndarray | None], a: Attrs) -> list[np.ndarray]:
    x = arg(xs, 0)
    return [x, make_splat(True, x.shape, np.dtype(np.bool_))]


def _dropout_import(n: AdapterNode) -> list[Value]:
    x = n.input(0)
    assert x is not None
    training = n.input(2)
    if training is not None and training.const is None:
        raise ShapeError(
            f"Dropout node {n.name!r}: input 2 (training_mode) must be known at compile time: "
            "flowc compiles inference graphs",
            hint="export the model in inference mode (PyTorch: model.eval() before exporting)",
        )
    training_on = training is not None and training.const is not None
    training_on = training_on and bool(training.const.reshape(-1)[0])  # type: ignore[union-attr]
    if training_on and n.builder.training:
        # A model imported to train it drops for real (flowc/ops/random.py).
        return import_train_dropout(n, x)
    if training_on:
        # Exporters write training_mode=true when the model was not put in eval mode; random
        # dropout has no place in a compiled inference program, so it is dropped, loudly.
        n.builder.warn(
            "Dropout has training_mode=true; flowc compiles for inference and treats it as "
            "identity (onnxruntime would drop values at random). Export the model after "
            "model.eval() to silence this",
            n.name,
        )
    outs = [x]
    if len(n.output_names) > 1 and n.output_names[1]:
        # Nothing is dropped at inference: the mask is all ones (bool since opset 10, before
        # that the input's type). onnxruntime returns zeros for opsets 7-11; the spec says ones.
        dtype = np.dtype(np.bool_) if n.opset >= 10 else x.type.dtype.np
        outs.append(n.const("mask", make_splat(1, x.type.shape, dtype)))
    return outs


defop(
    "Dropout",
    FAMILY,
    infer=_dropout_infer,
    reference=_dropout_ref,
    attrs={"seed": None},
    inputs=(1, 3),
    outputs=(1, 2),
    onnx_import=_dropout_import,
    # The mask output is bool: it cannot be a partial sum.
    sbp=lambda ctx, outs: sr.same_axes(ctx, outs, range(outs[0].rank)),
)


# -- gradients (VJP rules: flowc/ops/grad.py) ---------------------------------------------------
# Each of these only re-shapes its data: the gradient is re-shaped back.

for _name in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"):
    set_vjp(_name, grad.to_shape_of)
