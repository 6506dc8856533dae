"""Ops that cut, join and repeat: Concat, Split, Slice, Expand, Tile and Pad. Each output is
made of rectangular boxes of the inputs (concatenated, cut out, read with a step or with
stride 0 to repeat), or, for Pad, the input's box inside a border: strided copies
(movement.emit_box) whose sizes and strides come from the same plan the reference uses.

Every input that decides an output shape (Split's sizes, Slice's starts, Expand's shape,
Tile's repeats, Pad's pads) must fold to a compile-time constant; inference reads it with
``const_ints``, which names the node and the input when it does not. A splat input stays a
splat where the result is one too (Tile).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from flowc.errors import ShapeError
from flowc.ir.graph import Attrs, Node
from flowc.ir.types import TensorType
from flowc.ops import grad
from flowc.ops import sbp_rules as sr
from flowc.ops.movement import (
    MANY,
    Box,
    Fail,
    arg,
    const_input,
    const_ints,
    emit_box,
    launch_over,
    move_data,
    node_input,
    norm_axes,
    opt_arg,
)
from flowc.ops.registry import (
    InferCtx,
    SbpSignature,
    defop,
    ints,
    node_attrs,
    row_major_strides,
    set_vjp,
)

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.builder import AdapterNode
    from flowc.ir.graph import Value

FAMILY = "shape"


# -- Concat, Split -----------------------------------------------------------------------------


def _concat_infer(ctx: InferCtx) -> list[TensorType]:
    if "axis" not in ctx.attrs:
        raise ctx.fail("the 'axis' attribute is required")
    first = ctx.type(0)
    if first.rank == 0:
        raise ctx.fail("cannot concatenate scalars: the inputs need an axis")
    axis = ctx.axis(ctx.attr("axis"), first.rank)
    total = 0
    for i in range(ctx.num_inputs):
        t = ctx.type(i)
        if t.dtype != first.dtype:
            raise ctx.fail(f"inputs have different element types: {first.dtype} and {t.dtype}")
        same = t.rank == first.rank and all(
            d == e for k, (d, e) in enumerate(zip(t.shape, first.shape, strict=True)) if k != axis
        )
        if not same:
            raise ctx.fail(
                f"input {i} has shape {list(t.shape)}, which does not match input 0's "
                f"{list(first.shape)} outside axis {axis}"
            )
        total += t.shape[axis]
    shape = list(first.shape)
    shape[axis] = total
    return [first.with_shape(shape)]


def _concat_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    rank = outs[0].rank
    axis = ctx.axis(ctx.attr("axis"), rank)
    every = range(ctx.num_inputs)
    return [
        *(sr.sig(ctx, dict.fromkeys(every, sr.S(j)), sr.S(j), 1) for j in range(rank) if j != axis),
        sr.partial(ctx, outs, every),
    ]


def _concat_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    arrays = [x for x in xs if x is not None]
    return np.concatenate(arrays, axis=a["axis"] % arrays[0].ndim)


def _concat_emit(prog: Program, node: Node) -> None:
    """One copy per input, into its place along the axis."""
    out = node.outputs[0]
    shape = out.type.shape
    axis = node_attrs(node)["axis"] % len(shape)
    if prog.is_sized(node):
        _concat_sized(prog, node, axis)
        return
    os = row_major_strides(shape)
    at = 0
    for k, x in enumerate(node.inputs):
        if x is None:
            continue
        xs = row_major_strides(x.type.shape)
        # An input the memory plan had written straight into its slice needs no copy.
        if not prog.plan.writes_in_place(node, k):
            emit_box(prog, x, 0, out, at * os[axis], list(zip(x.type.shape, xs, os, strict=True)))
        at += x.type.shape[axis]


def _concat_sized(prog: Program, node: Node, axis: int) -> None:
    """A program with symbolic dims: one copy kernel per input, its place along the axis the
    sum of the earlier inputs' lengths in this run (the memory plan writes no input in place
    here: a place that moves with the sizes is no fixed offset)."""
    out = node.outputs[0]
    ot = out.type
    at = "0"
    for x in node.inputs:
        if x is None:
            continue
        t = x.type
        name = prog.kernel(
            "shape.cu.j2",
            "concat_sized",
            ctype=prog.ctype(x),
            outer=prog.count(t, 0, axis, "sizes"),
            inner=prog.count(t, axis + 1, t.rank, "sizes"),
            length=prog.dim(t, axis),
            total=prog.dim(ot, axis),
            at=at,
        )
        prog.launch_sized(name, prog.numel(t), [prog.cptr(x), prog.ptr(out)])
        at = f"{at} + {prog.dim(t, axis)}" if at != "0" else prog.dim(t, axis)


def _concat_import(n: AdapterNode) -> None:
    if n.opset < 4:
        n.attrs.setdefault("axis", 1)


defop(
    "Concat",
    FAMILY,
    sized=True,
    infer=_concat_infer,
    reference=_concat_ref,
    attrs={"axis": None},
    inputs=(1, MANY),
    onnx_import=_concat_import,
    emit=_concat_emit,
    sbp=_concat_sbp,
)


def _split_sizes(
    fail: Fail, dim: int, split: Sequence[int] | None, num_outputs: int | None, n_out: int
) -> list[int]:
    if split is not None:
        if num_outputs is not None:
            raise fail("give either the 'split' input or the 'num_outputs' attribute, not both")
        if len(split) != n_out:
            raise fail(f"split {list(split)} has {len(split)} entries for {n_out} outputs")
        if any(s < 0 for s in split) or sum(split) != dim:
            raise fail(f"split {list(split)} does not add up to the axis length {dim}")
        return list(split)
    if num_outputs is None:
        raise fail("needs the 'split' input or the 'num_outputs' attribute")
    if num_outputs != n_out:
        raise fail(f"num_outputs is {num_outputs} but the node has {n_out} outputs")
    # Chunks of ceil(dim / n); the last one takes what is left.
    chunk = -(-dim // n_out)
    last = dim - chunk * (n_out - 1)
    if last < 0:
        raise fail(f"an axis of length {dim} cannot be split into {n_out} chunks of {chunk}")
    return [chunk] * (n_out - 1) + [last]


def _split_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    if x.rank == 0:
        raise ctx.fail("cannot split a scalar: the input needs an axis")
    axis = ctx.axis(ctx.attr("axis"), x.rank)
    split = const_ints(ctx, 1, "split") if ctx.has(1) else None
    sizes = _split_sizes(
        ctx.fail, x.shape[axis], split, ctx.attrs.get("num_outputs"), ctx.num_outputs
    )
    outs = []
    for s in sizes:
        shape = list(x.shape)
        shape[axis] = s
        outs.append(x.with_shape(shape))
    return outs


def _split_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    rank = outs[0].rank
    axis = ctx.axis(ctx.attr("axis"), rank)
    return [*sr.same_axes(ctx, outs, (j for j in range(rank) if j != axis)), sr.partial(ctx, outs)]


def _split_ref(xs: list[np.ndarray | None], a: Attrs) -> list[np.ndarray]:
    x = arg(xs, 0)
    axis = a["axis"] % x.ndim
    split = opt_arg(xs, 1)
    if split is not None:
        sizes = ints(split)
    else:
        n = a["num_outputs"]
        sizes = _split_sizes(ValueError, x.shape[axis], None, n, n)
    return np.split(x, np.cumsum(sizes)[:-1].tolist(), axis=axis)


def _split_emit(prog: Program, node: Node) -> None:
    x = node_input(node, 0)
    axis = node_attrs(node)["axis"] % x.type.rank
    symbolic_axis = x.type.sym is not None and x.type.sym[axis] is not None
    if prog.is_sized(node) and (axis == 0 or symbolic_axis):
        raise prog.fail("with symbolic dims, Split cuts a fixed axis, not the first")
    if prog.is_sized(node) and not prog.leading_only(node):
        at = 0
        for o in node.outputs:
            starts = [at if k == axis else 0 for k in range(x.type.rank)]
            emit_gather_sized(prog, x, o, starts, [1] * x.type.rank)
            at += o.type.shape[axis]
        return
    xs = row_major_strides(x.type.shape)
    at = 0
    for o in node.outputs:
        shape = o.type.shape
        emit_box(
            prog,
            x,
            at * xs[axis],
            o,
            0,
            list(zip(shape, xs, row_major_strides(shape), strict=True)),
        )
        at += shape[axis]


def _split_import(n: AdapterNode) -> None:
    if n.opset < 13:
        n.attr_to_input("split", 1)
    x = n.input(0)
    if n.opset < 18 and n.input(1) is None and x is not None:
        # Before opset 18 no sizes meant equal parts, and an uneven split was invalid.
        axis, rank, count = int(n.attrs.get("axis", 0)), x.type.rank, len(n.output_names)
        if -rank <= axis < rank:
            dim = x.type.shape[axis]
            if dim % count:
                raise ShapeError(
                    f"Split node {n.name!r}: axis {axis} of length {dim} does not split evenly "
                    f"into {count} outputs"
                )
            n.set_input(1, n.const("split", [dim // count] * count, np.int64))


defop(
    "Split",
    FAMILY,
    infer=_split_infer,
    reference=_split_ref,
    attrs={"axis": 0, "num_outputs": None},
    inputs=(1, 2),
    outputs=(1, MANY),
    onnx_import=_split_import,
    emit=_split_emit,
    sized=True,
    sbp=_split_sbp,
)


# -- Slice -------------------------------------------------------------------------------------


def slice_plan(
    fail: Fail,
    shape: tuple[int, ...],
    starts: Sequence[int],
    ends: Sequence[int],
    axes: Sequence[int] | None,
    steps: Sequence[int] | None,
) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """The NumPy slices and the output shape, with the clamping rules of the ONNX spec."""
    rank = len(shape)
    if len(ends) != len(starts):
        raise fail(f"starts {list(starts)} and ends {list(ends)} differ in length")
    axes = list(range(len(starts))) if axes is None else list(axes)
    steps = [1] * len(starts) if steps is None else list(steps)
    if len(axes) != len(starts) or len(steps) != len(starts):
        raise fail(f"starts, ends, axes {axes} and steps {steps} must have the same length")
    norm = norm_axes(fail, axes, rank)
    slices = [slice(None)] * rank
    out = list(shape)
    for ax, start, end, step in zip(norm, starts, ends, steps, strict=True):
        dim = shape[ax]
        if step == 0:
            raise fail(f"step for axis {ax} is 0")
        start = start + dim if start < 0 else start
        end = end + dim if end < 0 else end
        if step > 0:
            start = min(max(start, 0), dim)
            end = min(max(end, 0), dim)
            out[ax] = max(0, -(-(end - start) // step))
        else:
            start = min(max(start, 0), dim - 1)
            end = min(max(end, -1), dim - 1)
            out[ax] = max(0, -(-(start - end) // -step))
        if out[ax] == 0:
            slices[ax] = slice(0, 0)
        else:
            # In Python a stop of -1 means "the last element", not "before index 0".
            slices[ax] = slice(start, None if end < 0 else end, step)
    return tuple(slices), tuple(out)


def _array_plan(
    fail: Fail,
    shape: tuple[int, ...],
    starts: np.ndarray,
    ends: np.ndarray,
    axes: np.ndarray | None,
    steps: np.ndarray | None,
) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """slice_plan of the constant inputs as arrays (axes and steps may be absent)."""
    return slice_plan(
        fail,
        shape,
        ints(starts),
        ints(ends),
        None if axes is None else ints(axes),
        None if steps is None else ints(steps),
    )


def _slice_infer(ctx: InferCtx) -> list[TensorType]:
    starts, ends = const_ints(ctx, 1, "starts"), const_ints(ctx, 2, "ends")
    axes = const_ints(ctx, 3, "axes") if ctx.has(3) else None
    steps = const_ints(ctx, 4, "steps") if ctx.has(4) else None
    _, shape = slice_plan(ctx.fail, ctx.shape(0), starts, ends, axes, steps)
    return [ctx.type(0).with_shape(shape)]


def _slice_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    """Axes the slice leaves whole split through: those not sliced and those sliced from
    the start to past the end with step 1 (the same constants keep all of a chunk)."""
    shape = ctx.shape(0)
    starts, ends = const_ints(ctx, 1, "starts"), const_ints(ctx, 2, "ends")
    axes = const_ints(ctx, 3, "axes") if ctx.has(3) else list(range(len(starts)))
    steps = const_ints(ctx, 4, "steps") if ctx.has(4) else [1] * len(starts)
    whole = set(range(len(shape)))
    for a, b, e, st in zip(axes, starts, ends, steps, strict=True):
        d = shape[a % len(shape)]
        if not (st == 1 and (b == 0 or b <= -d) and e >= d):
            whole.discard(a % len(shape))
    return [*sr.same_axes(ctx, outs, whole), sr.partial(ctx, outs)]


def _slice_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = arg(xs, 0)
    slices, _ = _array_plan(
        ValueError, x.shape, arg(xs, 1), arg(xs, 2), opt_arg(xs, 3), opt_arg(xs, 4)
    )
    return x[slices]


def _slice_import(n: AdapterNode) -> None:
    if n.opset < 10:
        n.attr_to_input("starts", 1)
        n.attr_to_input("ends", 2)
        n.attr_to_input("axes", 3)


def _slice_emit(prog: Program, node: Node) -> None:
    """A strided gather: the plan's first element and step per axis (steps may be negative)."""
    x, out = node_input(node, 0), node.outputs[0]
    starts, ends = const_input(node, 1), const_input(node, 2)
    axes, steps = const_input(node, 3), const_input(node, 4)
    assert starts is not None and ends is not None
    slices, shape = _array_plan(prog.fail, x.type.shape, starts, ends, axes, steps)
    xs = row_major_strides(x.type.shape)
    first = sum((sl.start or 0) * st for sl, st in zip(slices, xs, strict=True))
    box = [
        (n, (sl.step or 1) * st, d)
        for n, sl, st, d in zip(shape, slices, xs, row_major_strides(shape), strict=True)
    ]
    if x.type.sym is not None:
        sl = slices[0]
        moves = x.type.sym[0] is not None and ((sl.start or 0) != 0 or (sl.step or 1) != 1)
        if moves or not prog.leading_only(node):
            _slice_sized(prog, node, slices)
            return
    emit_box(prog, x, first, out, 0, box)


def _slice_sized(prog: Program, node: Node, slices: tuple[slice, ...]) -> None:
    """Slice of a program with symbolic dims, beyond a symbolic batch taken whole: each
    axis's start and step over the run's strides. A symbolic axis's start is the run's,
    clamped as at any size (``x[-1:]``, the last token: its length plus -1; a negative
    step: at most its last element)."""
    x = node_input(node, 0)
    starts, axes = const_input(node, 1), const_input(node, 3)
    assert starts is not None
    rank = x.type.rank
    given = list(range(len(starts))) if axes is None else [a % rank for a in ints(axes)]
    raw = dict(zip(given, ints(starts), strict=True))
    sym = x.type.sym or (None,) * rank
    first: list[int | str] = []
    for k, sl in enumerate(slices):
        if sym[k] is None or k not in raw:
            first.append(sl.start or 0)
            continue
        d = prog.dim(x.type, k)
        at = f"({d} + {raw[k]})" if raw[k] < 0 else str(raw[k])
        top = d if (sl.step or 1) > 0 else f"({d} - 1)"
        first.append(f"({at} < 0 ? 0 : ({at} > {top} ? {top} : {at}))")
    emit_gather_sized(prog, x, node.outputs[0], first, [s.step or 1 for s in slices])


def emit_gather_sized(
    prog: Program, x: Value, out: Value, starts: Sequence[int | str], steps: list[int]
) -> None:
    """``out`` = x[starts[k]::steps[k] for each axis k] with out's dims, for a program with
    symbolic dims: the offsets and strides are the run's (transpose_sized with a first
    element)."""
    rank = x.type.rank
    strides = [prog.count(x.type, k + 1, rank, "sizes") for k in range(rank)]
    first = " + ".join(f"{b} * {s}" for b, s in zip(starts, strides, strict=True) if b != 0)
    name = prog.kernel(
        "shape.cu.j2",
        "transpose_sized",
        ctype=prog.ctype(out),
        dims=[prog.dim(out.type, k) for k in range(rank)],
        strides=[s if st == 1 else f"{st} * {s}" for s, st in zip(strides, steps, strict=True)],
        first=first,
    )
    prog.launch_sized(name, prog.numel(out.type), [prog.cptr(x), prog.ptr(out)])


defop(
    "Slice",
    FAMILY,
    infer=_slice_infer,
    reference=_slice_ref,
    inputs=(3, 5),
    onnx_import=_slice_import,
    emit=_slice_emit,
    sized=True,
    sbp=_slice_sbp,
)


# -- Expand, Tile, Pad -------------------------------------------------------------------------


def _expand_shape(fail: Fail, shape: tuple[int, ...], target: Sequence[int]) -> tuple[int, ...]:
    if any(d < 0 for d in target):
        raise fail(f"target shape {list(target)} has a negative dimension")
    rank = max(len(shape), len(target))
    a = (1,) * (rank - len(shape)) + tuple(shape)
    b = (1,) * (rank - len(target)) + tuple(target)
    out = []
    for d, e in zip(a, b, strict=True):
        if d != e and 1 not in (d, e):
            raise fail(f"the input of shape {list(shape)} cannot be expanded to {list(target)}")
        out.append(e if d == 1 else d)
    return tuple(out)


def _expand_infer(ctx: InferCtx) -> list[TensorType]:
    target = const_ints(ctx, 1, "shape")
    return [ctx.type(0).with_shape(_expand_shape(ctx.fail, ctx.shape(0), target))]


def _expand_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = arg(xs, 0)
    return np.broadcast_to(x, _expand_shape(ValueError, x.shape, ints(arg(xs, 1))))


def _expand_emit(prog: Program, node: Node) -> None:
    """Broadcast axes read with stride 0."""
    x, out = node_input(node, 0), node.outputs[0]
    if prog.is_sized(node):
        prog.broadcast_sized(x, out)
        return
    shape = out.type.shape
    xshape = (1,) * (len(shape) - x.type.rank) + x.type.shape
    box = [
        (n, 0 if d == 1 else s, t)
        for n, d, s, t in zip(
            shape, xshape, row_major_strides(xshape), row_major_strides(shape), strict=True
        )
    ]
    emit_box(prog, x, 0, out, 0, box)


defop(
    "Expand",
    FAMILY,
    infer=_expand_infer,
    reference=_expand_ref,
    inputs=2,
    emit=_expand_emit,
    sized=True,
    # Split like a broadcasting element-wise op; each rank expands to its own output shape.
    sbp=lambda ctx, outs: [*sr.broadcast_splits(ctx, outs, data=(0,)), sr.partial(ctx, outs)],
    localize=sr.local_shape_input(1),
)


def _tile_shape(fail: Fail, shape: tuple[int, ...], repeats: Sequence[int]) -> tuple[int, ...]:
    if len(repeats) != len(shape):
        raise fail(f"repeats {list(repeats)} needs one entry per axis of the shape {list(shape)}")
    if any(r < 0 for r in repeats):
        raise fail(f"repeats {list(repeats)} has a negative entry")
    return tuple(d * r for d, r in zip(shape, repeats, strict=True))


def _tile_infer(ctx: InferCtx) -> list[TensorType]:
    repeats = const_ints(ctx, 1, "repeats")
    return [ctx.type(0).with_shape(_tile_shape(ctx.fail, ctx.shape(0), repeats))]


def _tile_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = arg(xs, 0)
    reps = ints(arg(xs, 1))
    return move_data(x, _tile_shape(ValueError, x.shape, reps), lambda v: np.tile(v, reps))


def _tile_emit(prog: Program, node: Node) -> None:
    """Each axis of length d repeated r times is two box axes: the repeat (source stride 0)
    and the element within the copy."""
    x, out = node_input(node, 0), node.outputs[0]
    reps = const_input(node, 1)
    assert reps is not None
    box: Box = []
    for d, r, s, t in zip(
        x.type.shape,
        ints(reps),
        row_major_strides(x.type.shape),
        row_major_strides(out.type.shape),
        strict=True,
    ):
        box += [(r, 0, d * t), (d, s, t)]
    emit_box(prog, x, 0, out, 0, box)


def _tile_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    once = (j for j, r in enumerate(const_ints(ctx, 1, "repeats")) if r == 1)
    return [*sr.same_axes(ctx, outs, once), sr.partial(ctx, outs)]


defop(
    "Tile",
    FAMILY,
    infer=_tile_infer,
    reference=_tile_ref,
    inputs=2,
    emit=_tile_emit,
    sbp=_tile_sbp,
)

_PAD_MODES = ("constant", "reflect", "edge", "wrap")


def _pad_widths(
    fail: Fail, shape: tuple[int, ...], pads: Sequence[int], axes: Sequence[int] | None, mode: str
) -> list[tuple[int, int]]:
    """(begin, end) per axis; negative entries crop."""
    rank = len(shape)
    if mode not in _PAD_MODES:
        raise fail(f"mode {mode!r} is not one of {', '.join(_PAD_MODES)}")
    norm = list(range(rank)) if axes is None else norm_axes(fail, axes, rank)
    if len(pads) != 2 * len(norm):
        raise fail(f"pads {list(pads)} must have 2 entries per padded axis ({2 * len(norm)})")
    widths = [(0, 0)] * rank
    for k, ax in enumerate(norm):
        widths[ax] = (pads[k], pads[k + len(norm)])
    for ax, (b, e) in enumerate(widths):
        kept = shape[ax] + min(b, 0) + min(e, 0)
        if kept < 0:
            raise fail(f"pads {list(pads)} crop axis {ax} of shape {list(shape)} below zero")
        grow = max(b, 0) + max(e, 0)
        if mode == "reflect" and grow and max(b, e) > kept - 1:
            raise fail(
                f"reflect padding of {max(b, e)} needs axis {ax} to keep more than that many "
                f"elements; it keeps {kept}"
            )
        if mode in ("edge", "wrap") and grow and kept == 0:
            raise fail(f"{mode} padding cannot extend axis {ax}: it is empty after cropping")
    return widths


def _pad_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    pads = const_ints(ctx, 1, "pads")
    axes = const_ints(ctx, 3, "axes") if ctx.has(3) else None
    if ctx.has(2) and ctx.type(2).numel != 1:
        raise ctx.fail(f"constant_value must hold one value, got shape {list(ctx.shape(2))}")
    widths = _pad_widths(ctx.fail, x.shape, pads, axes, ctx.attr("mode"))
    return [x.with_shape([d + b + e for d, (b, e) in zip(x.shape, widths, strict=True)])]


def _pad_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    """Unpadded axes split through. Padding copies elements or adds a constant: linear
    unless that constant is non-zero (or unknown until run time)."""
    shape = ctx.shape(0)
    axes = const_ints(ctx, 3, "axes") if ctx.has(3) else None
    mode = ctx.attr("mode")
    widths = _pad_widths(ctx.fail, shape, const_ints(ctx, 1, "pads"), axes, mode)
    sigs = sr.same_axes(ctx, outs, (j for j, w in enumerate(widths) if w == (0, 0)))
    value = ctx.maybe_const(2)
    if mode != "constant" or not ctx.has(2) or (value is not None and not value.any()):
        sigs.append(sr.partial(ctx, outs))
    return sigs


def _pad_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = arg(xs, 0)
    axes = opt_arg(xs, 3)
    widths = _pad_widths(
        ValueError, x.shape, ints(arg(xs, 1)), None if axes is None else ints(axes), a["mode"]
    )
    # Negative pads crop first, then the rest pads what is left (as onnxruntime does).
    crop = tuple(slice(-min(b, 0), x.shape[k] + min(e, 0)) for k, (b, e) in enumerate(widths))
    kept = x[crop]
    grow = [(max(b, 0), max(e, 0)) for b, e in widths]
    mode = a["mode"]
    if mode == "constant":
        cv = opt_arg(xs, 2)
        value = cv.reshape(-1)[0] if cv is not None else 0
        return np.pad(kept, grow, mode="constant", constant_values=np.asarray(value, x.dtype))
    return np.pad(kept, grow, mode=mode)


def _pad_import(n: AdapterNode) -> None:
    if n.opset < 11:
        if "paddings" in n.attrs:  # opset 1's name for pads
            n.attrs["pads"] = n.attrs.pop("paddings")
        n.attr_to_input("pads", 1)
        x = n.input(0)
        assert x is not None
        n.attr_to_input("value", 2, x.type.dtype.np)


def _pad_emit(prog: Program, node: Node) -> None:
    x, out = node_input(node, 0), node.outputs[0]
    mode = node_attrs(node)["mode"]
    pads, axes = const_input(node, 1), const_input(node, 3)
    assert pads is not None
    shape = x.type.shape
    widths = _pad_widths(prog.fail, shape, ints(pads), None if axes is None else ints(axes), mode)
    if out.type.numel == 0:
        return
    if not shape:
        prog.copy(out, x)
        return
    dims: list[dict[str, int | bool | str]] = [
        {
            "size": n,
            "stride": s,
            "lo": max(b, 0),
            "kept": d + min(b, 0) + min(e, 0),
            "crop": -min(b, 0),
            "padded": b > 0 or e > 0,
        }
        for n, d, s, (b, e) in zip(
            out.type.shape, shape, row_major_strides(shape), widths, strict=True
        )
    ]
    value = node.inputs[2] if len(node.inputs) > 2 else None
    has_value = mode == "constant" and value is not None
    if prog.is_sized(node):
        # the run's sizes and strides; a symbolic axis keeps its run length plus the pads
        xt, rank = x.type, x.type.rank
        for k, (d, (b, e)) in enumerate(zip(dims, widths, strict=True)):
            d["size"] = prog.dim(out.type, k)
            d["stride"] = prog.count(xt, k + 1, rank, "sizes")
            if xt.sym is not None and xt.sym[k] is not None:
                if mode != "constant" and (b or e):
                    # (reflect, edge and wrap read inside a length known at run time only,
                    # which a small run may leave empty)
                    raise prog.fail(
                        f"Pad in {mode} mode along symbolic axis {k}: only constant padding "
                        "of a symbolic axis has a kernel"
                    )
                kept = f"({prog.dim(xt, k)} + {min(b, 0) + min(e, 0)})"
                d.update(kept=kept, reflect=f"(2 * {kept} - 2)", last=f"({kept} - 1)")
        name = prog.kernel(
            "shape.cu.j2",
            "pad",
            ctype=prog.ctype(out),
            dims=dims,
            mode=mode,
            has_value=has_value,
            total=prog.numel(out.type, "sizes"),
        )
        reads = [prog.cptr(x), *([prog.cptr(value)] if has_value and value is not None else [])]
        prog.launch_sized(name, prog.numel(out.type), [*reads, prog.ptr(out)])
        return
    name = prog.kernel(
        "shape.cu.j2", "pad", ctype=prog.ctype(out), dims=dims, mode=mode, has_value=has_value
    )
    launch_over(prog, name, out, [x, value if has_value else None])


defop(
    "Pad",
    FAMILY,
    infer=_pad_infer,
    reference=_pad_ref,
    attrs={"mode": "constant"},
    inputs=(2, 4),
    onnx_import=_pad_import,
    emit=_pad_emit,
    sized=True,
    sbp=_pad_sbp,
)


# -- gradients (VJP rules: flowc/ops/grad.py) ---------------------------------------------------


def _concat_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """Each input's part of the gradient, sliced out along the axis."""
    g = gouts[0]
    if g is None:
        return [None] * len(node.inputs)
    axis = int(node.attrs["axis"]) % g.type.rank
    grads: list[Value | None] = []
    at = 0
    for x, wanted in zip(node.inputs, need, strict=True):
        assert x is not None
        size = x.type.shape[axis]
        if wanted:
            grads.append(
                grad.op1(
                    b,
                    "Slice",
                    g,
                    grad.ints(b, [at]),
                    grad.ints(b, [at + size]),
                    grad.ints(b, [axis]),
                )
            )
        else:
            grads.append(None)
        at += size
    return grads


def _split_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """The parts' gradients joined along the axis (zeros for a part none flows to)."""
    x = node.inputs[0]
    if x is None or not need[0] or all(g is None for g in gouts):
        return [None] * len(node.inputs)
    axis = int(node.attrs.get("axis", 0)) % x.type.rank
    parts = [
        g if g is not None else b.const(np.zeros(o.type.shape, o.type.dtype.np), "zeros")
        for g, o in zip(gouts, node.outputs, strict=True)
    ]
    joined = parts[0] if len(parts) == 1 else grad.op1(b, "Concat", *parts, axis=axis)
    return [joined] + [None] * (len(node.inputs) - 1)


def _slice_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """The gradient put back where the slice took it from, zeros elsewhere: along an axis
    of step s > 1, each element followed by s - 1 zeros (an axis padded after it and merged),
    a negative step's gradient reversed first; then padded to the input's shape."""
    g, x = gouts[0], node.inputs[0]
    grads: list[Value | None] = [None] * len(node.inputs)
    if g is None or x is None or not need[0]:
        return grads
    consts = [
        None if i >= len(node.inputs) or v is None else v.const
        for i, v in enumerate(node.inputs[:5])
    ]
    consts += [None] * (5 - len(consts))
    starts, ends = consts[1], consts[2]
    assert starts is not None and ends is not None
    slices, _ = _array_plan(ShapeError, x.type.shape, starts, ends, consts[3], consts[4])
    pads_before, pads_after = [], []
    for axis, (sl, dim) in enumerate(zip(slices, x.type.shape, strict=True)):
        n = g.type.shape[axis]
        step = sl.step or 1
        if n == 0:
            pads_before.append(0)
            pads_after.append(dim)
            continue
        first = sl.start or 0
        if step < 0:
            # The elements first, first - |s|, ...: reversed, they run upwards from the last.
            first += (n - 1) * step
            step = -step
            g = grad.op1(
                b,
                "Slice",
                g,
                grad.ints(b, [n - 1]),
                grad.ints(b, [-(2**63)]),
                grad.ints(b, [axis]),
                grad.ints(b, [-1]),
            )
        if step > 1:
            rank = g.type.rank
            shape = list(g.type.shape)
            g = grad.op1(b, "Unsqueeze", g, grad.ints(b, [axis + 1]))
            widen = [0] * (rank + 1) * 2
            widen[rank + 1 + axis + 1] = step - 1
            g = grad.op1(b, "Pad", g, grad.ints(b, widen), mode="constant")
            shape[axis] = n * step
            g = grad.reshape(b, g, shape)
            span = (n - 1) * step + 1
            g = grad.op1(
                b, "Slice", g, grad.ints(b, [0]), grad.ints(b, [span]), grad.ints(b, [axis])
            )
        pads_before.append(first)
        pads_after.append(dim - first - g.type.shape[axis])
    pads = pads_before + pads_after
    grads[0] = g if not any(pads) else grad.op1(b, "Pad", g, grad.ints(b, pads), mode="constant")
    return grads


def _expand_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    g, x = gouts[0], node.inputs[0]
    if g is None or x is None or not need[0]:
        return [None] * len(node.inputs)
    return [grad.unbroadcast(b, g, x.type.shape)] + [None] * (len(node.inputs) - 1)


def _pad_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """Constant padding's gradient is the padding undone: Pad by the negated pads (what was
    added is cropped, what was cropped comes back as zeros), on the same axes. The other
    modes copy input elements into the border: per changed axis, the output is a selection
    matrix times the input (the reference's own Pad of an identity matrix), so the gradient
    adds each border element's gradient back onto the element it copies, one axis at a time."""
    g, x = gouts[0], node.inputs[0]
    if g is None or x is None or not need[0]:
        return [None] * len(node.inputs)
    mode = node_attrs(node)["mode"]
    pads = const_input(node, 1)
    assert pads is not None
    rest: list[Value | None] = [None] * (len(node.inputs) - 1)
    if mode == "constant":
        axes = node.inputs[3] if len(node.inputs) > 3 else None
        neg = grad.ints(b, [-int(p) for p in pads.reshape(-1)])
        return [grad.op1(b, "Pad", g, neg, None, axes, mode="constant"), *rest]
    axes_c = const_input(node, 3) if len(node.inputs) > 3 else None
    widths = _pad_widths(
        ShapeError,
        x.type.shape,
        ints(pads),
        None if axes_c is None else ints(axes_c),
        mode,
    )
    for axis, (begin, end) in reversed(list(enumerate(widths))):
        if (begin, end) == (0, 0):
            continue
        n = x.type.shape[axis]
        eye = np.eye(n, dtype=np.float64)
        # Pad of the identity along its columns: row i says where input element i lands.
        placed = _pad_ref([eye, np.asarray([0, begin, 0, end], np.int64)], Attrs({"mode": mode}))
        g = grad.adjoint_along(b, g, axis, placed.T)
    return [g, *rest]


set_vjp("Concat", _concat_vjp)
set_vjp("Pad", _pad_vjp)
set_vjp("Split", _split_vjp)
set_vjp("Slice", _slice_vjp)
set_vjp("Expand", _expand_vjp)
