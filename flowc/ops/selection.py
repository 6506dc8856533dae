"""Ops that pick elements by their values: TopK (the k largest or smallest along an axis),
and Compress, NonZero and Unique, whose output lengths depend on the values. Known values
fold (a constant k, condition or input gives a fixed length); values of run time give the
output a *computed* length (docs/dynamic.md): the buffer holds its bound, the kernel writes
the run's count into the size table. TopK's count is its k, read on the device; Compress
imports as a Gather of NonZero's positions of its condition.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node, Value
from flowc.ir.symbolic import count_dim
from flowc.ir.types import TensorType
from flowc.ops import sbp_rules as sr
from flowc.ops.movement import arg, node_input
from flowc.ops.registry import InferCtx, SbpSignature, defop, node_attrs

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.builder import AdapterNode

FAMILY = "index"


# -- TopK --------------------------------------------------------------------------------------


def _topk_k(ctx: InferCtx) -> int | None:
    """k when it is a constant; None when it comes at run time."""
    if not ctx.has(1):
        raise ctx.fail("input 1 (k) is required")
    t = ctx.type(1)
    if t.numel != 1 or t.dtype != DType.I64 or t.sym is not None:
        raise ctx.fail(f"k must hold one int64 value, got {t}")
    k = ctx.maybe_const(1)
    return None if k is None else int(k.reshape(-1)[0])


def _topk_infer(ctx: InferCtx) -> list[TensorType]:
    """A constant k: k rows along the axis. A k of run time: the output holds its bound
    (the axis, or less with --bound), its length a count the kernel takes from k (ir/symbolic.py:
    a computed symbol), the same for both outputs."""
    x = ctx.type(0)
    if x.rank == 0:
        raise ctx.fail("needs an input of rank >= 1")
    axis = ctx.axis(ctx.attr("axis"), x.rank)
    k = _topk_k(ctx)
    shape = list(x.shape)
    sym = None
    if k is None:
        bound = output_bound(ctx, x.shape[axis])
        if bound > x.shape[axis]:
            raise ctx.fail(
                f"bound {bound} is more than the {x.shape[axis]} elements of axis {axis}, "
                "the most TopK gives"
            )
        shape[axis] = bound
        sym = tuple(count_dim() if d == axis else None for d in range(x.rank))
    elif not 0 <= k <= x.shape[axis]:
        raise ctx.fail(f"k = {k} is out of range for axis {axis} of shape {list(x.shape)}")
    else:
        shape[axis] = k
    types = [TensorType(tuple(shape), x.dtype, sym), TensorType(tuple(shape), DType.I64, sym)]
    return types[: ctx.num_outputs]


def _topk_ref(xs: list[np.ndarray | None], a: Attrs) -> list[np.ndarray]:
    x = arg(xs, 0)
    k = int(arg(xs, 1).reshape(-1)[0])
    axis = a["axis"] % x.ndim
    v = np.moveaxis(x, axis, -1)
    n = v.shape[-1]
    if a["largest"]:
        # Descending with ties to the lower index: a stable ascending sort of the reversed
        # row, read backwards. Negating would break on unsigned and minimum integers.
        order = n - 1 - np.argsort(v[..., ::-1], axis=-1, kind="stable")[..., ::-1]
    else:
        order = np.argsort(v, axis=-1, kind="stable")
    # sorted=0 leaves the order unspecified; sorted output is one valid order.
    idx = order[..., :k]
    values = np.take_along_axis(v, idx, axis=-1)
    return [np.moveaxis(values, -1, axis), np.moveaxis(idx, -1, axis).astype(np.int64)]


def _topk_emit(prog: Program, node: Node) -> None:
    """One thread per element ranks it in its row. Symbolic dims before the axis: the run's
    rows (the axis and what follows it fixed). A k of run time: the kernel reads it and
    writes it into the size table."""
    x = node_input(node, 0)
    a = node_attrs(node)
    t = x.type
    axis = a["axis"] % t.rank
    if t.sym is not None and any(t.sym[axis:]):
        raise prog.fail(
            "TopK of data with symbolic dims has a kernel where the axis and the dims after "
            f"it are fixed; here {t} along axis {axis}"
        )
    out = node.outputs[0]
    count = out.type.sym[axis] if out.type.sym is not None else None
    k_input = node_input(node, 1)
    with_indices = len(node.outputs) > 1
    outs = [prog.ptr(o) for o in node.outputs[:2]]
    common = {
        "ctype": prog.ctype(x),
        "len": t.shape[axis],
        "inner": math.prod(t.shape[axis + 1 :]),
        "largest": bool(a["largest"]),
        "is_float": t.dtype.is_float,
        "with_indices": with_indices,
    }
    if count is None:
        assert k_input.const is not None
        k = int(k_input.const.reshape(-1)[0])
        if k == 0:
            return
        name = prog.kernel("index.cu.j2", "topk", k=k, **common)
        prog.launch_numel(name, t, [prog.cptr(x), *outs])
        return
    if count.name is None or count.name not in prog.counts:
        raise prog.fail(
            f"TopK's k changes with the sizes ({count}): a k of run time is an input's value, "
            "a k computed from the sizes has no kernel yet"
        )
    name = prog.kernel(
        "index.cu.j2",
        "topk",
        k=0,
        slot=prog.slots[count.name],
        bound=out.type.shape[axis],
        **common,
    )
    args = [prog.cptr(x), prog.cptr(k_input), *outs, "error_flag", "ddims"]
    if t.sym is None:
        # at least one thread: the count is written even for an empty input
        prog.launch(name, max(t.numel, 1), [*args, f"(int64_t){t.numel}"])
    else:
        prog.launch_numel(name, t, args)


def _topk_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    rank = outs[0].rank
    axis = ctx.axis(ctx.attr("axis"), rank)
    return sr.same_axes(ctx, outs, (d for d in range(rank) if d != axis))


def _topk_import(n: AdapterNode) -> None:
    if n.opset < 10 and "k" in n.attrs:
        n.set_input(1, n.const("k", [n.attrs.pop("k")], np.int64))
    # --bound on either output (values or indices) bounds a k of run time
    bounds = [n.builder.bounds[o] for o in n.output_names if o in n.builder.bounds]
    if bounds:
        n.attrs["bound"] = min(bounds)


defop(
    "TopK",
    FAMILY,
    infer=_topk_infer,
    reference=_topk_ref,
    attrs={"axis": -1, "largest": 1, "sorted": 1, "bound": None},
    inputs=2,
    outputs=(1, 2),
    flops=lambda ins, outs, a: 0 if ins[0] is None else ins[0].numel,
    onnx_import=_topk_import,
    emit=_topk_emit,
    sized=True,
    sbp=_topk_sbp,
)


# -- Compress, NonZero, Unique: output shapes that depend on values ----------------------------
# (See the module docstring: the values that decide the length are compile-time constants.)


def _compress_indices(ctx: InferCtx) -> np.ndarray:
    cond = ctx.const(1, "condition")
    if cond.ndim != 1:
        raise ctx.fail(f"condition must be 1-D, got shape {list(cond.shape)}")
    return np.flatnonzero(cond.astype(bool))


def _compress_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    keep = _compress_indices(ctx)
    axis = ctx.attrs.get("axis")
    length = x.numel if axis is None else x.shape[ctx.axis(int(axis), x.rank)]
    if keep.size and keep[-1] >= length:
        raise ctx.fail(f"condition selects position {int(keep[-1])} of an axis of length {length}")
    if axis is None:
        return [TensorType((keep.size,), x.dtype)]
    ax = ctx.axis(int(axis), x.rank)
    return [x.with_shape((*x.shape[:ax], keep.size, *x.shape[ax + 1 :]))]


def _compress_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, cond = arg(xs, 0), arg(xs, 1)
    axis = a.get("axis")
    return np.compress(cond.astype(bool), x, axis=None if axis is None else int(axis))


def _compress_import(n: AdapterNode) -> list[Value] | None:
    """Compress is a Gather of the kept positions: known ones with the condition known, else
    NonZero's of the condition, a count computed at run time (docs/dynamic.md) within the
    condition's length or --bound OUTPUT=K."""
    x, cond = n.input(0), n.input(1)
    if x is None or cond is None:
        return None  # inference reports what is missing
    axis = n.attrs.get("axis")
    if axis is None:
        flat = n.const("flat", np.array([-1], np.int64))
        (x,) = n.emit("Reshape", [x, flat], suffix="flatten")
        axis = 0
    if cond.const is None:
        if cond.type.rank != 1:
            return None  # inference says the condition must be 1-D
        bound = n.builder.bounds.get(n.output_names[0]) if n.output_names else None
        (where,) = n.emit(
            "NonZero", [cond], {} if bound is None else {"bound": bound}, suffix="kept"
        )
        first = n.const("first", np.array([0], np.int64))
        (idx,) = n.emit("Squeeze", [where, first], suffix="kept_row")
        return n.emit("Gather", [x, idx], {"axis": int(axis)}, output_names=n.output_names)
    keep = np.flatnonzero(np.asarray(cond.const).astype(bool)).astype(np.int64)
    if keep.size and keep[-1] >= x.type.shape[int(axis) % x.type.rank]:
        return None  # out of range: inference says so
    idx = n.const("kept", keep)
    return n.emit("Gather", [x, idx], {"axis": int(axis)}, output_names=n.output_names)


defop(
    "Compress",
    FAMILY,
    infer=_compress_infer,
    reference=_compress_ref,
    attrs={"axis": None},
    inputs=2,
    onnx_import=_compress_import,
)


def _nonzero_infer(ctx: InferCtx) -> list[TensorType]:
    """Known data: the exact count. Data of run time: the output holds its bound (the
    `bound` attribute, --bound, else every element), its length a count the kernel
    computes (ir/symbolic.py: a computed symbol)."""
    c = ctx.maybe_const(0)
    if c is not None:
        return [TensorType((max(c.ndim, 1), int(np.count_nonzero(c))), DType.I64)]
    x = ctx.type(0)
    bound = output_bound(ctx, x.numel)
    return [TensorType((max(x.rank, 1), bound), DType.I64, (None, count_dim()))]


def output_bound(ctx: InferCtx, most: int) -> int:
    """The rows a data-dependent output holds: its ``bound`` attribute (from --bound) or
    ``most``, what the op can produce at all."""
    b = ctx.attrs.get("bound")
    if b is None:
        return most
    if int(b) < 0:
        raise ctx.fail(f"bound {b} is negative")
    return int(b)


def _nonzero_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = arg(xs, 0)
    return np.array(np.nonzero(np.atleast_1d(x)), dtype=np.int64).reshape(max(x.ndim, 1), -1)


def _nonzero_emit(prog: Program, node: Node) -> None:
    """One block counts the nonzero elements per thread's chunk, scans the counts, and
    writes each one's coordinates packed at the run's count (rows past the bound dropped,
    the flag raised); the count goes into the run's size table."""
    x, out = node_input(node, 0), node.outputs[0]
    t = x.type
    count = out.type.sym[1] if out.type.sym is not None else None
    if count is None or count.name is None:
        raise prog.fail("NonZero's output has no computed length")
    dims = [{"axis": a, "size": prog.dim(t, a)} for a in range(t.rank)] or [
        {"axis": 0, "size": "1"}
    ]
    name = prog.kernel(
        "index.cu.j2",
        "nonzero",
        ctype=prog.ctype(x),
        dims=dims,
        bound=out.type.shape[1],
        slot=prog.slots[count.name],
        threads=NONZERO_THREADS,
    )
    prog.launch_grid(
        name, [1], NONZERO_THREADS, [prog.cptr(x), prog.ptr(out), "error_flag", "ddims"]
    )


# One block does NonZero: its threads split the input into chunks and scan their counts.
NONZERO_THREADS = 256


def _nonzero_import(n: AdapterNode) -> None:
    bound = n.builder.bounds.get(n.output_names[0]) if n.output_names else None
    if bound is not None:
        n.attrs["bound"] = bound


defop(
    "NonZero",
    FAMILY,
    infer=_nonzero_infer,
    reference=_nonzero_ref,
    attrs={"bound": None},
    emit=_nonzero_emit,
    sized=True,
    onnx_import=_nonzero_import,
)


def _unique_parts(x: np.ndarray, a: Attrs) -> list[np.ndarray]:
    axis = a.get("axis")
    ax = None if axis is None else int(axis) % max(x.ndim, 1)
    values, first, inverse, counts = np.unique(
        x, return_index=True, return_inverse=True, return_counts=True, axis=ax
    )
    if not a["sorted"]:
        # In order of first occurrence: renumber everything by that order.
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        values = np.take(values, order, axis=0 if ax is None else ax)
        first, counts, inverse = first[order], counts[order], rank[inverse.reshape(-1)]
    return [
        values,
        first.astype(np.int64),
        inverse.reshape(-1).astype(np.int64),
        counts.astype(np.int64),
    ]


def _unique_infer(ctx: InferCtx) -> list[TensorType]:
    """Known data: the exact outputs. Data of run time: values, first indices and counts
    hold every slice (the bound), their length the count the kernel computes; the inverse
    indices have one entry per slice; a fifth output, the kernel's int64 scratch, comes
    from the ONNX adapter."""
    axis = ctx.attrs.get("axis")
    c = ctx.maybe_const(0)
    if c is not None:
        if axis is not None:
            ctx.axis(int(axis), c.ndim)
        parts = _unique_parts(c, ctx.attrs)
        types = [TensorType(parts[0].shape, ctx.dtype(0))]
        types += [TensorType(p.shape, DType.I64) for p in parts[1:]]
        types.append(TensorType((4 * max(parts[2].size, 1),), DType.I64))
        return types[: max(ctx.num_outputs, 1)]
    x = ctx.type(0)
    if x.sym is not None:
        raise ctx.fail("Unique of data with symbolic dims has no kernel yet")
    y_shape: tuple[int, ...]
    if axis is None:
        slices, y_shape, at = x.numel, (x.numel,), 0
    else:
        ax = ctx.axis(int(axis), x.rank)
        slices, y_shape, at = x.shape[ax], x.shape, ax
    n = count_dim()
    y_sym = tuple(n if k == at else None for k in range(len(y_shape)))
    types = [
        TensorType(y_shape, x.dtype, y_sym),
        TensorType((slices,), DType.I64, (n,)),
        TensorType((slices,), DType.I64),
        TensorType((slices,), DType.I64, (n,)),
        TensorType((4 * max(slices, 1),), DType.I64),
    ]
    return types[: max(ctx.num_outputs, 1)]


def _unique_ref(xs: list[np.ndarray | None], a: Attrs) -> list[np.ndarray]:
    parts = _unique_parts(arg(xs, 0), a)
    return [*parts, np.zeros(4 * max(parts[2].size, 1), np.int64)]


def _unique_emit(prog: Program, node: Node) -> None:
    """One thread: a heap sort of the slices' indices by (slice, index), the groups of equal
    slices, renumbered by first occurrence unless sorted, written packed at the count."""
    x = node_input(node, 0)
    if len(node.outputs) < 5:
        raise prog.fail("needs its scratch output (the ONNX adapter gives it one)")
    y = node.outputs[0]
    a = node_attrs(node)
    count = next((d for d in y.type.sym or () if d is not None), None)
    if count is None or count.name is None:
        raise prog.fail("Unique's output has no computed length")
    shape = x.type.shape
    if a.get("axis") is None:
        outer, slices, inner = 1, x.type.numel, 1
    else:
        ax = int(a["axis"]) % x.type.rank
        outer, slices, inner = math.prod(shape[:ax]), shape[ax], math.prod(shape[ax + 1 :])
    name = prog.kernel(
        "index.cu.j2",
        "unique",
        ctype=prog.ctype(x),
        outer=outer,
        slices=slices,
        inner=inner,
        sort=bool(a["sorted"]),
        slot=prog.slots[count.name],
    )
    args = [prog.cptr(x), *(prog.ptr(o) for o in node.outputs[:5]), "ddims"]
    prog.launch_grid(name, [1], 1, args)


def _unique_import(n: AdapterNode) -> list[Value] | None:
    """All four outputs and the scratch (the kernel writes them together)."""
    base = n.name or "Unique"
    names = [
        (n.output_names[k] if k < len(n.output_names) and n.output_names[k] else f"{base}:{k}")
        for k in range(4)
    ]
    outs = n.emit("Unique", n.inputs, n.attrs, output_names=[*names, f"{base}:scratch"])
    return outs[: max(len(n.output_names), 1)]


defop(
    "Unique",
    FAMILY,
    infer=_unique_infer,
    reference=_unique_ref,
    attrs={"axis": None, "sorted": 1},
    outputs=(1, 5),
    emit=_unique_emit,
    sized=True,
    onnx_import=_unique_import,
)
