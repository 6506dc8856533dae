"""Shape and data-movement ops: Reshape, Flatten, Transpose, Squeeze/Unsqueeze, Concat, Split,
Slice, Expand, Tile, Pad, Shape, Size, ConstantOfShape, Constant, Range, Identity, Dropout,
Resize/Upsample, DepthToSpace and SpaceToDepth.

Every input that decides an output shape (Reshape's shape, Slice's starts, Pad's pads, ...)
must fold to a compile-time constant; inference reads it with ``ctx.const`` so a run-time
value gives an error that names the node and the input. Ops that only move data keep a splat
input a splat, so folding a large fill (ConstantOfShape -> Reshape -> Expand) never
materializes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from flowc.codegen.cpp import c_float, c_literal
from flowc.errors import ShapeError
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node, is_splat, make_splat
from flowc.ir.types import TensorType
from flowc.ops import sbp_rules as sr
from flowc.ops.registry import (
    InferCtx,
    SbpSignature,
    defop,
    ints,
    node_attrs,
    numel,
    row_major_strides,
    same_as_input,
)

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.builder import AdapterNode
    from flowc.ir.graph import Value

FAMILY = "shape"

# Builds the exception for a bad argument: ``ctx.fail`` during inference (a ShapeError that
# names the node), ``ValueError`` inside a reference, where inference already vetted the values.
Fail = Callable[[str], Exception]
MANY = 1 << 30


def _in(xs: Sequence[np.ndarray | None], i: int) -> np.ndarray:
    x = xs[i] if i < len(xs) else None
    assert x is not None, f"input {i} is missing"
    return x


def _opt(xs: Sequence[np.ndarray | None], i: int) -> np.ndarray | None:
    return xs[i] if i < len(xs) else None


def _const_ints(ctx: InferCtx, i: int, what: str) -> list[int]:
    """A constant integer input holding a list (a 0-d value counts as a 1-list)."""
    c = ctx.const(i, what)
    if c.dtype.kind not in "iu":
        raise ctx.fail(f"{what} must be an integer tensor, got {ctx.dtype(i)}")
    if c.ndim > 1:
        raise ctx.fail(f"{what} must be a 1-D tensor, got shape {list(c.shape)}")
    return ints(c)


def _axes(fail: Fail, axes: Sequence[int], rank: int, what: str = "axes") -> list[int]:
    """Normalize possibly negative axes; repeated or out-of-range ones are errors."""
    out = []
    for a in axes:
        if not -rank <= a < rank:
            raise fail(f"{what} {list(axes)}: axis {a} is out of range for rank {rank}")
        out.append(a % rank)
    if len(set(out)) != len(out):
        raise fail(f"{what} {list(axes)} repeats an axis")
    return out


def _move(
    x: np.ndarray, shape: Sequence[int], fn: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """Apply a data-movement op; a splat stays a zero-stride splat of the new shape."""
    if is_splat(x):
        return make_splat(x.flat[0], tuple(shape), x.dtype)
    return fn(x)


# -- code generation helpers -------------------------------------------------------------------
# Most of these ops move elements without computing on them: each is a strided copy of a box
# (templates/kernels/shape.cu.j2, strided_copy) whose sizes and strides come from the same
# plan the reference uses. Shape-deciding inputs are constants (inference insists), read here
# from the input Values.


def _input(node: Node, i: int) -> Value:
    v = node.inputs[i] if i < len(node.inputs) else None
    assert v is not None, f"{node.op} node {node.name!r}: input {i} is missing"
    return v


def _const_input(node: Node, i: int) -> np.ndarray | None:
    """The value of constant input i; None when the input is absent."""
    v = node.inputs[i] if i < len(node.inputs) else None
    if v is None:
        return None
    assert v.const is not None, f"{node.op} node {node.name!r}: input {i} is not a constant"
    return v.const


# (size, source stride, destination stride) per axis of a box, outermost first.
Box = list[tuple[int, int, int]]


def _simplify_box(box: Box) -> Box:
    """Drop unit axes and merge neighbours that are contiguous in both source and destination,
    so a box that is one run of memory becomes a single axis."""
    merged: Box = []
    for size, s, d in box:
        if size == 1:
            continue
        if merged and merged[-1][1] == s * size and merged[-1][2] == d * size:
            merged[-1] = (merged[-1][0] * size, s, d)
        else:
            merged.append((size, s, d))
    return merged


def _offset(ptr: str, at: int) -> str:
    return f"{ptr} + {at}" if at else ptr


def emit_box(prog: Program, src: Value, src_at: int, dst: Value, dst_at: int, box: Box) -> None:
    """Copy a box of elements from ``src`` (starting at element src_at) into ``dst``."""
    total = numel([size for size, _, _ in box])
    if total == 0:
        return
    dims = _simplify_box(box)
    if not dims or (len(dims) == 1 and dims[0][1:] == (1, 1)):
        # One run of memory: the copy engine does it.
        prog.stmt(
            f"cudaMemcpyAsync({_offset(prog.ptr(dst), dst_at)}, {_offset(prog.cptr(src), src_at)}, "
            f"{total * dst.type.dtype.itemsize}, cudaMemcpyDeviceToDevice, {prog.stream});"
        )
        return
    sizes = [size for size, _, _ in dims]
    linear = [d for _, _, d in dims] == row_major_strides(sizes)
    name = prog.kernel(
        "shape.cu.j2",
        "strided_copy",
        ctype=prog.ctype(dst),
        dims=[{"size": size, "src": s, "dst": d} for size, s, d in dims],
        dst_linear=linear,
    )
    prog.launch(
        name,
        total,
        [_offset(prog.cptr(src), src_at), _offset(prog.ptr(dst), dst_at), f"(int64_t){total}"],
    )


def _emit_permuted(prog: Program, node: Node, view: Sequence[int], perm: Sequence[int]) -> None:
    """The output is the input seen as ``view``, transposed by ``perm``, made contiguous."""
    x, out = _input(node, 0), node.outputs[0]
    vs = row_major_strides(view)
    ts = row_major_strides([view[p] for p in perm])
    emit_box(prog, x, 0, out, 0, [(view[p], vs[p], ts[k]) for k, p in enumerate(perm)])


# -- Reshape, Flatten, Transpose, Squeeze, Unsqueeze -------------------------------------------
# Moving data is linear, so every op here passes P through. A row-major reshape (Reshape,
# Flatten, Squeeze, Unsqueeze) maps a split through as sbp_rules.reshape_pairs says.


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
    shape = _const_ints(ctx, 1, "shape")
    return [x.with_shape(_reshape_target(ctx.fail, x.shape, shape, ctx.attr("allowzero")))]


def _reshape_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = _in(xs, 0)
    shape = _reshape_target(ValueError, x.shape, ints(_in(xs, 1)), a["allowzero"])
    return _move(x, shape, lambda v: v.reshape(shape))


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
    x = _in(xs, 0)
    shape = _flatten_shape(ValueError, x.shape, a["axis"])
    return _move(x, shape, lambda v: v.reshape(shape))


defop(
    "Flatten",
    FAMILY,
    infer=_flatten_infer,
    reference=_flatten_ref,
    attrs={"axis": 1},
    view=True,
    sbp=_reshape_sbp,
)


def _perm(fail: Fail, a: Mapping[str, Any], rank: int) -> list[int]:
    perm = a.get("perm")
    if perm is None:
        return list(range(rank))[::-1]
    perm = list(perm)
    if sorted(perm) != list(range(rank)):
        raise fail(f"perm {perm} is not a permutation of the {rank} axes")
    return perm


def _transpose_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    perm = _perm(ctx.fail, ctx.attrs, x.rank)
    return [x.with_shape([x.shape[p] for p in perm])]


def _transpose_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = _in(xs, 0)
    perm = _perm(ValueError, a, x.ndim)
    return _move(x, [x.shape[p] for p in perm], lambda v: np.transpose(v, perm))


def _transpose_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    perm = _perm(ctx.fail, ctx.attrs, outs[0].rank)
    return [*sr.splits(ctx, outs, ((p, j) for j, p in enumerate(perm))), sr.partial(ctx, outs)]


def _transpose_emit(prog: Program, node: Node) -> None:
    x = _input(node, 0)
    _emit_permuted(prog, node, x.type.shape, _perm(prog.fail, node.attrs, x.type.rank))


defop(
    "Transpose",
    FAMILY,
    infer=_transpose_infer,
    reference=_transpose_ref,
    attrs={"perm": None},
    emit=_transpose_emit,
    sbp=_transpose_sbp,
)


def _squeeze_shape(
    fail: Fail, shape: tuple[int, ...], axes: Sequence[int] | None
) -> tuple[int, ...]:
    if axes is None:
        return tuple(d for d in shape if d != 1)
    norm = _axes(fail, axes, len(shape))
    for ax in norm:
        if shape[ax] != 1:
            raise fail(
                f"cannot squeeze axis {ax} of shape {list(shape)}: its size is {shape[ax]}, not 1"
            )
    return tuple(d for k, d in enumerate(shape) if k not in norm)


def _squeeze_infer(ctx: InferCtx) -> list[TensorType]:
    axes = _const_ints(ctx, 1, "axes") if ctx.has(1) else None
    return [ctx.type(0).with_shape(_squeeze_shape(ctx.fail, ctx.shape(0), axes))]


def _squeeze_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = _in(xs, 0)
    axes = _opt(xs, 1)
    shape = _squeeze_shape(ValueError, x.shape, None if axes is None else ints(axes))
    return _move(x, shape, lambda v: v.reshape(shape))


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
    norm = set(_axes(fail, axes, rank))
    rest = iter(shape)
    return tuple(1 if k in norm else next(rest) for k in range(rank))


def _unsqueeze_infer(ctx: InferCtx) -> list[TensorType]:
    axes = _const_ints(ctx, 1, "axes")
    return [ctx.type(0).with_shape(_unsqueeze_shape(ctx.fail, ctx.shape(0), axes))]


def _unsqueeze_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = _in(xs, 0)
    shape = _unsqueeze_shape(ValueError, x.shape, ints(_in(xs, 1)))
    return _move(x, shape, lambda v: v.reshape(shape))


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


def _concat_import(n: AdapterNode) -> None:
    if n.opset < 4:
        n.attrs.setdefault("axis", 1)


defop(
    "Concat",
    FAMILY,
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
    split = _const_ints(ctx, 1, "split") if ctx.has(1) else None
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
    x = _in(xs, 0)
    axis = a["axis"] % x.ndim
    split = _opt(xs, 1)
    if split is not None:
        sizes = ints(split)
    else:
        n = a["num_outputs"]
        sizes = _split_sizes(ValueError, x.shape[axis], None, n, n)
    return np.split(x, np.cumsum(sizes)[:-1].tolist(), axis=axis)


def _split_emit(prog: Program, node: Node) -> None:
    x = _input(node, 0)
    axis = node_attrs(node)["axis"] % x.type.rank
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
    sbp=_split_sbp,
)


# -- Slice -------------------------------------------------------------------------------------


def _slice_plan(
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
    norm = _axes(fail, axes, rank)
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


def _slice_infer(ctx: InferCtx) -> list[TensorType]:
    starts, ends = _const_ints(ctx, 1, "starts"), _const_ints(ctx, 2, "ends")
    axes = _const_ints(ctx, 3, "axes") if ctx.has(3) else None
    steps = _const_ints(ctx, 4, "steps") if ctx.has(4) else None
    _, shape = _slice_plan(ctx.fail, ctx.shape(0), starts, ends, axes, steps)
    return [ctx.type(0).with_shape(shape)]


def _slice_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    """Axes the slice leaves whole split through: those not sliced and those sliced from
    the start to past the end with step 1 (the same constants keep all of a chunk)."""
    shape = ctx.shape(0)
    starts, ends = _const_ints(ctx, 1, "starts"), _const_ints(ctx, 2, "ends")
    axes = _const_ints(ctx, 3, "axes") if ctx.has(3) else list(range(len(starts)))
    steps = _const_ints(ctx, 4, "steps") if ctx.has(4) else [1] * len(starts)
    whole = set(range(len(shape)))
    for a, b, e, st in zip(axes, starts, ends, steps, strict=True):
        d = shape[a % len(shape)]
        if not (st == 1 and (b == 0 or b <= -d) and e >= d):
            whole.discard(a % len(shape))
    return [*sr.same_axes(ctx, outs, whole), sr.partial(ctx, outs)]


def _slice_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = _in(xs, 0)
    axes, steps = _opt(xs, 3), _opt(xs, 4)
    slices, _ = _slice_plan(
        ValueError,
        x.shape,
        ints(_in(xs, 1)),
        ints(_in(xs, 2)),
        None if axes is None else ints(axes),
        None if steps is None else ints(steps),
    )
    return x[slices]


def _slice_import(n: AdapterNode) -> None:
    if n.opset < 10:
        n.attr_to_input("starts", 1)
        n.attr_to_input("ends", 2)
        n.attr_to_input("axes", 3)


def _slice_emit(prog: Program, node: Node) -> None:
    """A strided gather: the plan's first element and step per axis (steps may be negative)."""
    x, out = _input(node, 0), node.outputs[0]
    starts, ends = _const_input(node, 1), _const_input(node, 2)
    axes, steps = _const_input(node, 3), _const_input(node, 4)
    assert starts is not None and ends is not None
    slices, shape = _slice_plan(
        prog.fail,
        x.type.shape,
        ints(starts),
        ints(ends),
        None if axes is None else ints(axes),
        None if steps is None else ints(steps),
    )
    xs = row_major_strides(x.type.shape)
    first = sum((sl.start or 0) * st for sl, st in zip(slices, xs, strict=True))
    box = [
        (n, (sl.step or 1) * st, d)
        for n, sl, st, d in zip(shape, slices, xs, row_major_strides(shape), strict=True)
    ]
    emit_box(prog, x, first, out, 0, box)


defop(
    "Slice",
    FAMILY,
    infer=_slice_infer,
    reference=_slice_ref,
    inputs=(3, 5),
    onnx_import=_slice_import,
    emit=_slice_emit,
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
    target = _const_ints(ctx, 1, "shape")
    return [ctx.type(0).with_shape(_expand_shape(ctx.fail, ctx.shape(0), target))]


def _expand_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = _in(xs, 0)
    return np.broadcast_to(x, _expand_shape(ValueError, x.shape, ints(_in(xs, 1))))


def _expand_emit(prog: Program, node: Node) -> None:
    """Broadcast axes read with stride 0."""
    x, out = _input(node, 0), node.outputs[0]
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
    repeats = _const_ints(ctx, 1, "repeats")
    return [ctx.type(0).with_shape(_tile_shape(ctx.fail, ctx.shape(0), repeats))]


def _tile_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = _in(xs, 0)
    reps = ints(_in(xs, 1))
    return _move(x, _tile_shape(ValueError, x.shape, reps), lambda v: np.tile(v, reps))


def _tile_emit(prog: Program, node: Node) -> None:
    """Each axis of length d repeated r times is two box axes: the repeat (source stride 0)
    and the element within the copy."""
    x, out = _input(node, 0), node.outputs[0]
    reps = _const_input(node, 1)
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
    once = (j for j, r in enumerate(_const_ints(ctx, 1, "repeats")) if r == 1)
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
    norm = list(range(rank)) if axes is None else _axes(fail, axes, rank)
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
    pads = _const_ints(ctx, 1, "pads")
    axes = _const_ints(ctx, 3, "axes") if ctx.has(3) else None
    if ctx.has(2) and ctx.type(2).numel != 1:
        raise ctx.fail(f"constant_value must hold one value, got shape {list(ctx.shape(2))}")
    widths = _pad_widths(ctx.fail, x.shape, pads, axes, ctx.attr("mode"))
    return [x.with_shape([d + b + e for d, (b, e) in zip(x.shape, widths, strict=True)])]


def _pad_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    """Unpadded axes split through. Padding copies elements or adds a constant: linear
    unless that constant is non-zero (or unknown until run time)."""
    shape = ctx.shape(0)
    axes = _const_ints(ctx, 3, "axes") if ctx.has(3) else None
    mode = ctx.attr("mode")
    widths = _pad_widths(ctx.fail, shape, _const_ints(ctx, 1, "pads"), axes, mode)
    sigs = sr.same_axes(ctx, outs, (j for j, w in enumerate(widths) if w == (0, 0)))
    value = ctx.maybe_const(2)
    if mode != "constant" or not ctx.has(2) or (value is not None and not value.any()):
        sigs.append(sr.partial(ctx, outs))
    return sigs


def _pad_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = _in(xs, 0)
    axes = _opt(xs, 3)
    widths = _pad_widths(
        ValueError, x.shape, ints(_in(xs, 1)), None if axes is None else ints(axes), a["mode"]
    )
    # Negative pads crop first, then the rest pads what is left (as onnxruntime does).
    crop = tuple(slice(-min(b, 0), x.shape[k] + min(e, 0)) for k, (b, e) in enumerate(widths))
    kept = x[crop]
    grow = [(max(b, 0), max(e, 0)) for b, e in widths]
    mode = a["mode"]
    if mode == "constant":
        cv = _opt(xs, 2)
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
    x, out = _input(node, 0), node.outputs[0]
    mode = node_attrs(node)["mode"]
    pads, axes = _const_input(node, 1), _const_input(node, 3)
    assert pads is not None
    shape = x.type.shape
    widths = _pad_widths(prog.fail, shape, ints(pads), None if axes is None else ints(axes), mode)
    if out.type.numel == 0:
        return
    if not shape:
        prog.copy(out, x)
        return
    dims = [
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
    name = prog.kernel(
        "shape.cu.j2", "pad", ctype=prog.ctype(out), dims=dims, mode=mode, has_value=has_value
    )
    n = out.type.numel
    args = [prog.cptr(x), *([prog.cptr(value)] if has_value and value else []), prog.ptr(out)]
    prog.launch(name, n, [*args, f"(int64_t){n}"])


defop(
    "Pad",
    FAMILY,
    infer=_pad_infer,
    reference=_pad_ref,
    attrs={"mode": "constant"},
    inputs=(2, 4),
    onnx_import=_pad_import,
    emit=_pad_emit,
    sbp=_pad_sbp,
)


# -- Shape, Size, ConstantOfShape, Constant, Range -------------------------------------------


def _shape_dims(shape: tuple[int, ...], a: Mapping[str, Any]) -> list[int]:
    # ONNX clamps start/end into [0, rank] after adding rank to negatives: Python slicing.
    return list(shape[a["start"] : a.get("end")])


defop(
    "Shape",
    FAMILY,
    infer=lambda ctx: [TensorType((len(_shape_dims(ctx.shape(0), ctx.attrs)),), DType.I64)],
    reference=lambda xs, a: np.array(_shape_dims(_in(xs, 0).shape, a), dtype=np.int64),
    attrs={"start": 0, "end": None},
    shape_only=True,
)
defop(
    "Size",
    FAMILY,
    infer=lambda ctx: [TensorType((), DType.I64)],
    reference=lambda xs, a: np.array(_in(xs, 0).size, dtype=np.int64),
    shape_only=True,
)


def _fill_value(a: Mapping[str, Any]) -> np.ndarray:
    v = a.get("value")
    return np.zeros(1, np.float32) if v is None else np.asarray(v)


def _dtype(ctx: InferCtx, dt: np.dtype) -> DType:
    try:
        return DType.from_numpy(dt)
    except ValueError as e:
        raise ctx.fail(str(e)) from None


def _const_of_shape_infer(ctx: InferCtx) -> list[TensorType]:
    shape = _const_ints(ctx, 0, "shape")
    if any(d < 0 for d in shape):
        raise ctx.fail(f"shape {shape} has a negative dimension")
    value = _fill_value(ctx.attrs)
    if value.size != 1:
        raise ctx.fail(f"'value' must hold one element, got shape {list(value.shape)}")
    return [TensorType(tuple(shape), _dtype(ctx, value.dtype))]


def _const_of_shape_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    value = _fill_value(a)
    return make_splat(value.reshape(-1)[0], tuple(ints(_in(xs, 0))), value.dtype)


def _const_of_shape_emit(prog: Program, node: Node) -> None:
    # Folding normally turns this node into a splat constant; this is the fallback.
    out = node.outputs[0]
    t = prog.ctype(out)
    value = c_literal(_fill_value(node.attrs).reshape(-1)[0], out.type.dtype, t)
    name = prog.kernel("common.cu.j2", "fill", ctype=t)
    n = out.type.numel
    prog.launch(name, n, [prog.ptr(out), value, f"(int64_t){n}"])


defop(
    "ConstantOfShape",
    FAMILY,
    infer=_const_of_shape_infer,
    reference=_const_of_shape_ref,
    attrs={"value": None},
    emit=_const_of_shape_emit,
)

_CONSTANT_ATTRS: dict[str, Callable[[Any], np.ndarray]] = {
    "value": np.asarray,
    "sparse_value": np.asarray,  # the importer has already made it dense
    "value_float": lambda v: np.array(v, np.float32),
    "value_floats": lambda v: np.array(v, np.float32).reshape(-1),
    "value_int": lambda v: np.array(v, np.int64),
    "value_ints": lambda v: np.array(v, np.int64).reshape(-1),
}


def _constant_value(fail: Fail, a: Mapping[str, Any]) -> np.ndarray:
    given = [k for k in a if k.startswith(("value", "sparse_value"))]
    if len(given) != 1:
        raise fail(f"needs exactly one value attribute, got {given or 'none'}")
    key = given[0]
    if key not in _CONSTANT_ATTRS:
        raise fail(f"'{key}' constants are not supported (strings are not a tensor type here)")
    return _CONSTANT_ATTRS[key](a[key])


def _constant_infer(ctx: InferCtx) -> list[TensorType]:
    v = _constant_value(ctx.fail, ctx.attrs)
    return [TensorType(v.shape, _dtype(ctx, v.dtype))]


defop(
    "Constant",
    FAMILY,
    infer=_constant_infer,
    reference=lambda xs, a: _constant_value(ValueError, a),
    inputs=0,
)


def _range_count(start: np.ndarray, limit: np.ndarray, delta: np.ndarray) -> int:
    if start.dtype.kind in "iu":
        s, lim, d = int(start), int(limit), int(delta)
        return max(0, -(-(lim - s) // d))
    # onnxruntime subtracts in the element type, then divides in double.
    diff = np.asarray(limit - start, start.dtype)
    return max(0, math.ceil(float(diff) / float(delta)))


def _range_infer(ctx: InferCtx) -> list[TensorType]:
    names = ("start", "limit", "delta")
    dt = ctx.dtype(0)
    vals = []
    for i, what in enumerate(names):
        if ctx.dtype(i) != dt:
            raise ctx.fail(
                f"start, limit and delta must share one type; {what} is {ctx.dtype(i)}, start is {dt}"
            )
        c = ctx.const(i, what)
        if c.size != 1:
            raise ctx.fail(f"{what} must be a scalar, got shape {list(c.shape)}")
        vals.append(c.reshape(()))
    if not (dt.is_int or dt.is_float):
        raise ctx.fail(f"needs numeric inputs, got {dt}")
    if float(vals[2]) == 0:
        raise ctx.fail("delta is 0")
    return [TensorType((_range_count(*vals),), dt)]


def _range_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    start, limit, delta = (_in(xs, i).reshape(()) for i in range(3))
    n = _range_count(start, limit, delta)
    if start.dtype.kind in "iu":
        return (int(start) + int(delta) * np.arange(n, dtype=np.int64)).astype(start.dtype)
    steps = np.arange(n, dtype=np.float64) * float(delta)
    return (float(start) + steps).astype(start.dtype)


def _range_emit(prog: Program, node: Node) -> None:
    # Runs when folding declined (a large result); start and delta are constants.
    out = node.outputs[0]
    start, delta = _const_input(node, 0), _const_input(node, 2)
    assert start is not None and delta is not None
    s, d = start.reshape(()), delta.reshape(())
    is_float = out.type.dtype.is_float
    if is_float:
        lits = [c_float(float(s), "double"), c_float(float(d), "double")]
    else:
        # uint64 arithmetic wraps where the int64 of the reference would overflow.
        lits = [f"{int(s) % (1 << 64)}ULL", f"{int(d) % (1 << 64)}ULL"]
    name = prog.kernel(
        "shape.cu.j2",
        "range_fill",
        ctype=prog.ctype(out),
        start=lits[0],
        delta=lits[1],
        is_float=is_float,
    )
    n = out.type.numel
    prog.launch(name, n, [prog.ptr(out), f"(int64_t){n}"])


defop("Range", FAMILY, infer=_range_infer, reference=_range_ref, inputs=3, emit=_range_emit)


# -- Identity, Dropout: they vanish on import ---------------------------------------------------


def _identity_import(n: AdapterNode) -> list[Value]:
    x = n.input(0)
    assert x is not None
    return [x]


defop(
    "Identity",
    FAMILY,
    infer=same_as_input,
    reference=lambda xs, a: _in(xs, 0),
    view=True,
    onnx_import=_identity_import,
    sbp=lambda ctx, outs: [*sr.same_axes(ctx, outs, range(outs[0].rank)), sr.partial(ctx, outs)],
)


def _dropout_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    return [x, x.with_dtype(DType.BOOL)][: ctx.num_outputs]


def _dropout_ref(xs: list[np.ndarray | None], a: Attrs) -> list[np.ndarray]:
    x = _in(xs, 0)
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
    if training is not None and training.const is not None and bool(training.const.reshape(-1)[0]):
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
    axes = _axes(fail, a["axes"], rank) if a.get("axes") is not None else list(range(rank))
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
    x = _in(xs, 0)
    plan = _resize_plan(ValueError, x.shape, _opt(xs, 1), _opt(xs, 2), _opt(xs, 3), a)
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
    x, out = _input(node, 0), node.outputs[0]
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
    n = out.type.numel
    prog.launch(name, n, [prog.cptr(x), prog.ptr(out), f"(int64_t){n}"])


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
    _emit_resize(prog, node, a, roi, _const_input(node, 2), _const_input(node, 3))


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


defop(
    "Upsample",
    FAMILY,
    infer=_upsample_infer,
    reference=lambda xs, a: _resize_ref([_in(xs, 0), None, _in(xs, 1)], _upsample_attrs(a)),
    attrs={"mode": "nearest"},
    inputs=2,
    flops=lambda ins, outs, a: _resize_flops(ins, outs, _upsample_attrs(a)),
    onnx_import=_upsample_import,
    emit=lambda prog, node: _emit_resize(
        prog, node, _upsample_attrs(node_attrs(node)), None, _const_input(node, 1), None
    ),
)


# -- DepthToSpace, SpaceToDepth ----------------------------------------------------------------


def _block(ctx: InferCtx) -> tuple[TensorType, int]:
    x = ctx.type(0)
    b = ctx.attrs.get("blocksize")
    if b is None or b < 1:
        raise ctx.fail(f"needs a positive 'blocksize' attribute, got {b}")
    if x.rank != 4:
        raise ctx.fail(f"needs a 4-D NCHW input, got shape {list(x.shape)}")
    return x, int(b)


def _d2s_infer(ctx: InferCtx) -> list[TensorType]:
    x, b = _block(ctx)
    n, c, h, w = x.shape
    if c % (b * b):
        raise ctx.fail(f"channels {c} are not a multiple of blocksize² = {b * b}")
    if ctx.attr("mode") not in ("DCR", "CRD"):
        raise ctx.fail(f"mode {ctx.attr('mode')!r} is not DCR or CRD")
    return [x.with_shape((n, c // (b * b), h * b, w * b))]


def _d2s_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = _in(xs, 0)
    b = a["blocksize"]
    n, c, h, w = x.shape
    if a["mode"] == "DCR":
        t = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
    else:
        t = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
    return t.reshape(n, c // (b * b), h * b, w * b)


def _d2s_emit(prog: Program, node: Node) -> None:
    a = node_attrs(node)
    b = a["blocksize"]
    n, c, h, w = _input(node, 0).type.shape
    if a["mode"] == "DCR":
        _emit_permuted(prog, node, (n, b, b, c // (b * b), h, w), (0, 3, 4, 1, 5, 2))
    else:
        _emit_permuted(prog, node, (n, c // (b * b), b, b, h, w), (0, 1, 4, 2, 5, 3))


defop(
    "DepthToSpace",
    FAMILY,
    infer=_d2s_infer,
    reference=_d2s_ref,
    attrs={"blocksize": None, "mode": "DCR"},
    emit=_d2s_emit,
    # Each input row or column becomes blocksize consecutive ones; in CRD mode each input
    # channel block becomes one output channel (in DCR the output channel is innermost).
    sbp=lambda ctx, outs: [
        *sr.same_axes(ctx, outs, (0, 1, 2, 3) if ctx.attr("mode") == "CRD" else (0, 2, 3)),
        sr.partial(ctx, outs),
    ],
)


def _s2d_infer(ctx: InferCtx) -> list[TensorType]:
    x, b = _block(ctx)
    n, c, h, w = x.shape
    if h % b or w % b:
        raise ctx.fail(f"height {h} and width {w} must be multiples of the blocksize {b}")
    if ctx.attr("mode") not in ("DCR", "CRD"):
        raise ctx.fail(f"mode {ctx.attr('mode')!r} is not DCR or CRD")
    return [x.with_shape((n, c * b * b, h // b, w // b))]


def _s2d_perm(mode: str) -> tuple[int, ...]:
    # Of (n, c, h/b, b_h, w/b, b_w): DCR puts the block offsets before the channel, CRD after.
    return (0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4)


def _s2d_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = _in(xs, 0)
    b = a["blocksize"]
    n, c, h, w = x.shape
    t = x.reshape(n, c, h // b, b, w // b, b).transpose(_s2d_perm(a["mode"]))
    return t.reshape(n, c * b * b, h // b, w // b)


def _s2d_emit(prog: Program, node: Node) -> None:
    a = node_attrs(node)
    b = a["blocksize"]
    n, c, h, w = _input(node, 0).type.shape
    _emit_permuted(prog, node, (n, c, h // b, b, w // b, b), _s2d_perm(a["mode"]))


defop(
    "SpaceToDepth",
    FAMILY,
    infer=_s2d_infer,
    reference=_s2d_ref,
    attrs={"blocksize": None, "mode": "DCR"},
    emit=_s2d_emit,
    # In DCR the output channels interleave the blocks with the input channels: no channel
    # split; in CRD each input channel becomes a run of output channels.
    sbp=lambda ctx, outs: [
        *sr.same_axes(ctx, outs, (0, 1, 2, 3) if ctx.attr("mode") == "CRD" else (0, 2, 3)),
        sr.partial(ctx, outs),
    ],
)
