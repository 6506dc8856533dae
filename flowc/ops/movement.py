"""What the data-movement ops share: the shape family (reshape.py, layout.py, slicing.py,
constants.py, resize.py) and the index family (index.py, masks.py, selection.py).

- Reading inputs: ``arg`` and ``opt_arg`` in a NumPy reference, ``const_ints`` (a constant
  integer list; an error naming the node when it is only known at run time) and
  ``norm_axes`` in inference, ``node_input`` and ``const_input`` in an emitter.
- ``move_data``: a reference that only moves data keeps a splat input a splat.
- ``emit_box``: the strided copy of a box of elements (or one cudaMemcpyAsync when the box
  is one run of memory) that most shape ops emit.
- ``launch_over``: the launch of a kernel with a thread per output element.

This module registers no op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from flowc.codegen.cpp import BLOCK
from flowc.ir.graph import Node, is_splat, make_splat
from flowc.ops.registry import InferCtx, ints, numel, row_major_strides

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.graph import Value

# Builds the exception for a bad argument: ``ctx.fail`` during inference (a ShapeError that
# names the node), ``ValueError`` inside a reference, where inference already vetted the values.
Fail = Callable[[str], Exception]
MANY = 1 << 30


def arg(xs: Sequence[np.ndarray | None], i: int) -> np.ndarray:
    """Input i of a NumPy reference, which inference has made sure is there."""
    x = xs[i] if i < len(xs) else None
    assert x is not None, f"input {i} is missing"
    return x


def opt_arg(xs: Sequence[np.ndarray | None], i: int) -> np.ndarray | None:
    """Optional input i of a NumPy reference; None when absent."""
    return xs[i] if i < len(xs) else None


def const_ints(ctx: InferCtx, i: int, what: str) -> list[int]:
    """A constant integer input holding a list (a 0-d value counts as a 1-list)."""
    c = ctx.const(i, what)
    if c.dtype.kind not in "iu":
        raise ctx.fail(f"{what} must be an integer tensor, got {ctx.dtype(i)}")
    if c.ndim > 1:
        raise ctx.fail(f"{what} must be a 1-D tensor, got shape {list(c.shape)}")
    return ints(c)


def norm_axes(fail: Fail, axes: Sequence[int], rank: int, what: str = "axes") -> list[int]:
    """Normalize possibly negative axes; repeated or out-of-range ones are errors."""
    out = []
    for a in axes:
        if not -rank <= a < rank:
            raise fail(f"{what} {list(axes)}: axis {a} is out of range for rank {rank}")
        out.append(a % rank)
    if len(set(out)) != len(out):
        raise fail(f"{what} {list(axes)} repeats an axis")
    return out


def move_data(
    x: np.ndarray, shape: Sequence[int], fn: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """Apply a data-movement op; a splat stays a zero-stride splat of the new shape."""
    if is_splat(x):
        return make_splat(x.flat[0], tuple(shape), x.dtype)
    return fn(x)


# -- code generation helpers -------------------------------------------------------------------
# Most shape ops move elements without computing on them: each is a strided copy of a box
# (templates/kernels/shape.cu.j2, strided_copy) whose sizes and strides come from the same
# plan the reference uses. Shape-deciding inputs are constants (inference insists), read here
# from the input Values.


def node_input(node: Node, i: int) -> Value:
    """Input i of a node being emitted, which inference has made sure is there."""
    v = node.inputs[i] if i < len(node.inputs) else None
    assert v is not None, f"{node.op} node {node.name!r}: input {i} is missing"
    return v


def const_input(node: Node, i: int) -> np.ndarray | None:
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


def emit_box(
    prog: Program,
    src: Value,
    src_at: int,
    dst: Value,
    dst_at: int,
    box: Box,
) -> None:
    """Copy a box of elements from ``src`` (starting at element src_at) into ``dst``. A
    ``dst`` of symbolic type (Transpose, Slice, Split of a program with symbolic dims, their
    first axis the only one that changes with the sizes: Program.leading_only) is the whole
    box: it copies this run's elements."""
    total = numel([size for size, _, _ in box])
    run_total = None
    if dst.type.sym is not None:
        assert dst_at == 0 and total == dst.type.numel, "a symbolic box is its whole destination"
        run_total = prog.numel(dst.type)
    if total == 0:
        return
    dims = _simplify_box(box)
    count = str(total) if run_total is None else run_total
    if not dims or (len(dims) == 1 and dims[0][1:] == (1, 1)):
        # One run of memory: the copy engine does it.
        itemsize = dst.type.dtype.itemsize
        prog.memcpy(
            _offset(prog.ptr(dst), dst_at),
            _offset(prog.cptr(src), src_at),
            total * itemsize if run_total is None else f"({run_total}) * {itemsize}",
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
    args = [_offset(prog.cptr(src), src_at), _offset(prog.ptr(dst), dst_at), f"(int64_t){count}"]
    if run_total is None:
        prog.launch(name, total, args)
    else:  # the kernel's outermost axis takes what the count leaves: the symbolic one
        prog.launch_grid(name, [prog.grid(run_total)], BLOCK, args)


def launch_over(prog: Program, kernel: str, out: Value, reads: Sequence[Value | None] = ()) -> None:
    """Launch ``kernel`` with a thread per element of ``out``; its arguments are the pointers
    of ``reads`` (an absent optional input, None, passes nothing), out's and the count."""
    n = out.type.numel
    ptrs = [prog.cptr(v) for v in reads if v is not None]
    prog.launch(kernel, n, [*ptrs, prog.ptr(out), f"(int64_t){n}"])
