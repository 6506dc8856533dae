"""Reads and writes at positions a tensor names: Gather, GatherElements, GatherND and
GatherShard (the Gather a rank runs on its chunk of a table split along the gathered axis:
vocabulary-parallel embeddings), ScatterElements (and Scatter, its deprecated opset 9-10
name), ScatterND, TensorScatter (a KV-cache write at per-batch indices) and ReverseSequence
(per-batch lengths). The positions are only known at run time, so every kernel checks them
and raises the model's error flag instead of touching memory out of bounds.

Negative indices count from the end of their axis. An index outside [-n, n) is an error
(onnxruntime rejects it too); the reference raises IndexError naming the axis and the range.
Ops that pick by value (TopK, NonZero, Unique, Compress) are in selection.py, those whose
output is a pattern of coordinates (Trilu, OneHot, EyeLike) in masks.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node, Value
from flowc.ir.types import TensorType
from flowc.ops import grad
from flowc.ops import sbp_rules as sr
from flowc.ops.movement import arg, node_input
from flowc.ops.registry import (
    InferCtx,
    SbpSignature,
    defop,
    node_attrs,
    row_major_strides,
    set_vjp,
)

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.builder import AdapterNode

FAMILY = "index"


def _int_indices(ctx: InferCtx, i: int, what: str = "indices") -> TensorType:
    t = ctx.type(i)
    if t.dtype not in (DType.I32, DType.I64):
        raise ctx.fail(f"{what} must be int32 or int64, got {t.dtype}")
    return t


def _wrap(idx: np.ndarray, dim: int, what: str) -> np.ndarray:
    """Indices in [-dim, dim) as non-negative int64; anything else is an IndexError."""
    i = idx.astype(np.int64)
    if i.size and (i.min() < -dim or i.max() >= dim):
        bad = i[(i < -dim) | (i >= dim)].reshape(-1)[0]
        raise IndexError(f"{what} {bad} is out of range [{-dim}, {dim - 1}]")
    return np.where(i < 0, i + dim, i)


# -- code generation helpers -------------------------------------------------------------------
# Kernels are in templates/kernels/index.cu.j2. Every kernel that reads an index checks it and
# raises the model's error flag (which run() reports) instead of touching memory out of bounds.


def _indexed(prog: Program, kernel: str, n: int, args: list[str]) -> None:
    """Launch a kernel that checks indices: it also gets the error flag."""
    prog.launch(kernel, n, [*args, "error_flag", f"(int64_t){n}"])


def _indexed_over(prog: Program, kernel: str, out: Value, reads: list[Value | None]) -> None:
    """``_indexed`` with a thread per element of ``out``, reading ``reads`` (None: an absent
    optional input, passed as nothing) and writing out."""
    ptrs = [prog.cptr(v) for v in reads if v is not None]
    _indexed(prog, kernel, out.type.numel, [*ptrs, prog.ptr(out)])


# -- Gather family -----------------------------------------------------------------------------


def _gather_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    ind = _int_indices(ctx, 1)
    if x.rank == 0:
        raise ctx.fail("cannot gather from a scalar")
    axis = ctx.axis(ctx.attr("axis"), x.rank)
    out = x.with_shape(x.shape[:axis] + ind.shape + x.shape[axis + 1 :])
    if x.sym is not None or ind.sym is not None:
        # symbolic dims carry over (the indices' row a count the data decides: Compress)
        xs = x.sym or (None,) * x.rank
        sym = (*xs[:axis], *(ind.sym or (None,) * ind.rank), *xs[axis + 1 :])
        if any(d is not None for d in sym):
            out = TensorType(out.shape, out.dtype, sym)
    return [out]


def _gather_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = arg(xs, 0)
    axis = a["axis"] % x.ndim
    i = _wrap(arg(xs, 1), x.shape[axis], f"index on axis {axis}")
    return np.asarray(np.take(x, i, axis=axis))  # a 0-d result would be a NumPy scalar


def _gather_emit(prog: Program, node: Node) -> None:
    x, ind, out = node_input(node, 0), node_input(node, 1), node.outputs[0]
    axis = node_attrs(node)["axis"] % x.type.rank
    if prog.is_sized(node):
        # sizes over the run's size table (a symbolic table axis too: its bound checks)
        xt = x.type
        name = prog.kernel(
            "index.cu.j2",
            "gather",
            ctype=prog.ctype(x),
            itype=prog.ctype(ind),
            dim=prog.dim(xt, axis),
            count=prog.count(ind.type, 0, ind.type.rank, "sizes"),
            inner=prog.count(xt, axis + 1, xt.rank, "sizes"),
            total=prog.numel(out.type, "sizes"),
        )
        args = [prog.cptr(x), prog.cptr(ind), prog.ptr(out), "error_flag"]
        prog.launch_sized(name, prog.numel(out.type), args)
        return
    name = prog.kernel(
        "index.cu.j2",
        "gather",
        ctype=prog.ctype(x),
        itype=prog.ctype(ind),
        dim=x.type.shape[axis],
        count=ind.type.numel,
        inner=math.prod(x.type.shape[axis + 1 :]),
    )
    _indexed_over(prog, name, out, [x, ind])


def _gather_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    """Index axes map to the output's axes [axis, axis + q), the table's other axes around
    them. A table split along the gathered axis runs GatherShard: each rank gathers the rows
    it holds and zeros for the rest, so the parts add up to the result (P)."""
    rank, q = len(ctx.shape(0)), len(ctx.shape(1))
    axis = ctx.axis(ctx.attr("axis"), rank)
    table = ((d, d if d < axis else d + q - 1) for d in range(rank) if d != axis)
    local = [
        # Constant indices whose k-th rows point only into the matching block of the table
        # (a mask flattened over the batch and gathered back per sample): both split, each
        # rank's GatherShard finds every index in its own chunk, and no sum is needed.
        sr.sig(ctx, {0: sr.S(axis), 1: sr.S(k)}, sr.S(axis + k), 1, physical="GatherShard")
        for k in range(q)
        if _block_local(ctx.consts[1], k, ctx.shape(0)[axis])
    ]
    return [
        *sr.splits(ctx, outs, ((k, axis + k) for k in range(q)), data=1),
        *sr.splits(ctx, outs, table),
        sr.partial(ctx, outs),
        sr.sig(ctx, {0: sr.S(axis)}, sr.P, 1, physical="GatherShard"),
        *local,
    ]


def _block_local(ind: np.ndarray | None, k: int, rows: int) -> bool:
    """Whether index row t (along axis ``k``) only names table rows [t, t+1) * rows/n: then
    for any split of both into the same number of blocks, block j's indices stay in block j."""
    if ind is None or ind.ndim == 0 or ind.size == 0:
        return False
    n = ind.shape[k]
    if n < 2 or rows % n:
        return False
    i = ind.astype(np.int64)
    i = np.where(i < 0, i + rows, i)
    t = np.arange(n).reshape([-1 if d == k else 1 for d in range(ind.ndim)])
    return bool(np.all((i >= 0) & (i < rows) & (i // (rows // n) == t)))


defop(
    "Gather",
    FAMILY,
    infer=_gather_infer,
    reference=_gather_ref,
    attrs={"axis": 0},
    inputs=2,
    emit=_gather_emit,
    sized=True,
    sbp=_gather_sbp,
)


# GatherShard: Gather on this rank's chunk of a table split along ``axis`` by the mesh axes
# ``shard_axes`` (of the mesh of shape ``mesh``; chunks in mixed radix, mesh axis 0
# outermost, as flowc.ir.layout numbers them). Indices are global: those in the chunk
# are offset to it, the others give zeros. The reference reads the rank's mesh coordinates
# from the ``coords`` attribute the simulator adds; generated code reads them at run time.


def _shard_digits(a: Attrs) -> list[tuple[int, int]]:
    """(mesh axis, its size) for each digit of the chunk number, most significant first."""
    return [(m, int(a["mesh"][m])) for m in sorted(a["shard_axes"])]


def _gather_shard_infer(ctx: InferCtx) -> list[TensorType]:
    mesh, axes = ctx.attrs.get("mesh"), ctx.attrs.get("shard_axes")
    if not mesh or not axes or any(not 0 <= m < len(mesh) for m in axes):
        raise ctx.fail(f"shard_axes {axes} must name axes of the mesh {mesh}")
    return _gather_infer(ctx)


def _gather_shard_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = arg(xs, 0)
    axis = a["axis"] % x.ndim
    rows = x.shape[axis]
    chunk, count = 0, 1
    for m, n in _shard_digits(a):
        chunk, count = chunk * n + int(a["coords"][m]), count * n
    i = _wrap(arg(xs, 1), rows * count, f"index on axis {axis}") - chunk * rows
    inside = (i >= 0) & (i < rows)
    picked = np.take(x, np.where(inside, i, 0), axis=axis)
    mask = inside.reshape((1,) * axis + inside.shape + (1,) * (x.ndim - axis - 1))
    return np.asarray(np.where(mask, picked, np.zeros((), x.dtype)))


def _gather_shard_emit(prog: Program, node: Node) -> None:
    x, ind, out = node_input(node, 0), node_input(node, 1), node.outputs[0]
    a = node_attrs(node)
    axis = a["axis"] % x.type.rank
    rows = x.type.shape[axis]
    chunk, count = "0", 1
    for m, n in _shard_digits(a):
        chunk, count = f"({chunk}) * {n} + static_cast<int64_t>({prog.mesh_coord(m)})", count * n
    name = prog.kernel(
        "index.cu.j2",
        "gather_shard",
        ctype=prog.ctype(x),
        itype=prog.ctype(ind),
        dim=rows,
        total=rows * count,
        count=ind.type.numel,
        inner=math.prod(x.type.shape[axis + 1 :]),
    )
    args = [prog.cptr(x), prog.cptr(ind), prog.ptr(out), f"({chunk}) * {rows}"]
    _indexed(prog, name, out.type.numel, args)


defop(
    "GatherShard",
    FAMILY,
    infer=_gather_shard_infer,
    reference=_gather_shard_ref,
    attrs={"axis": 0, "mesh": None, "shard_axes": None, "microbatch": 0},
    inputs=2,
    emit=_gather_shard_emit,
)


def _check_fits(ctx: InferCtx, ind: TensorType, x: TensorType, axis: int) -> None:
    """GatherElements' and ScatterElements' indices: the data's rank, and no longer than the
    data on the other axes (they address its corner)."""
    if ind.rank != x.rank or any(
        i > d for k, (i, d) in enumerate(zip(ind.shape, x.shape, strict=True)) if k != axis
    ):
        raise ctx.fail(
            f"indices of shape {list(ind.shape)} must have the data's rank and fit inside "
            f"the data's shape {list(x.shape)} outside axis {axis}"
        )


def _gather_elements_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    ind = _int_indices(ctx, 1)
    axis = ctx.axis(ctx.attr("axis"), x.rank)
    _check_fits(ctx, ind, x, axis)
    return [x.with_shape(ind.shape)]


def _gather_elements_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, ind = arg(xs, 0), arg(xs, 1)
    axis = a["axis"] % x.ndim
    # Indices may be smaller than the data on the other axes: read the matching corner.
    corner = tuple(slice(None) if k == axis else slice(0, n) for k, n in enumerate(ind.shape))
    i = _wrap(ind, x.shape[axis], f"index on axis {axis}")
    return np.take_along_axis(x[corner], i, axis=axis)


def _gather_elements_emit(prog: Program, node: Node) -> None:
    x, ind, out = node_input(node, 0), node_input(node, 1), node.outputs[0]
    if x.type.rank == 0:
        raise prog.fail("cannot gather elements from a scalar")
    axis = node_attrs(node)["axis"] % x.type.rank
    xs = row_major_strides(x.type.shape)
    name = prog.kernel(
        "index.cu.j2",
        "gather_elements",
        ctype=prog.ctype(x),
        itype=prog.ctype(ind),
        dims=[
            {"axis": k, "size": n, "stride": s}
            for k, (n, s) in enumerate(zip(ind.type.shape, xs, strict=True))
        ],
        axis=axis,
        dim=x.type.shape[axis],
        dim_stride=xs[axis],
    )
    _indexed_over(prog, name, out, [x, ind])


defop(
    "GatherElements",
    FAMILY,
    infer=_gather_elements_infer,
    reference=_gather_elements_ref,
    attrs={"axis": 0},
    inputs=2,
    emit=_gather_elements_emit,
)


def _gather_nd_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    ind = _int_indices(ctx, 1)
    b = ctx.attr("batch_dims")
    if ind.rank < 1 or x.rank < 1:
        raise ctx.fail("data and indices must have rank >= 1")
    if not 0 <= b < min(x.rank, ind.rank):
        raise ctx.fail(f"batch_dims {b} must be in [0, {min(x.rank, ind.rank) - 1}]")
    if x.shape[:b] != ind.shape[:b]:
        raise ctx.fail(
            f"the first {b} (batch) dims of data {list(x.shape)} and indices "
            f"{list(ind.shape)} differ"
        )
    m = ind.shape[-1]
    if m > x.rank - b:
        raise ctx.fail(
            f"indices' last dim {m} exceeds the data's rank {x.rank} minus batch_dims {b}"
        )
    return [x.with_shape(ind.shape[:-1] + x.shape[b + m :])]


def _gather_nd_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, ind = arg(xs, 0), arg(xs, 1)
    b = a["batch_dims"]
    m = ind.shape[-1]
    batch = int(np.prod(x.shape[:b], dtype=np.int64))
    rows = int(np.prod(ind.shape[b:-1], dtype=np.int64))
    data = x.reshape((batch, *x.shape[b:]))
    flat = ind.reshape(batch, rows, m)
    cols = [_wrap(flat[..., k], x.shape[b + k], f"index on axis {b + k}") for k in range(m)]
    key = (np.arange(batch)[:, None], *cols)
    return data[key].reshape(ind.shape[:-1] + x.shape[b + m :])


def _gather_nd_emit(prog: Program, node: Node) -> None:
    x, ind, out = node_input(node, 0), node_input(node, 1), node.outputs[0]
    b = node_attrs(node)["batch_dims"]
    m = ind.type.shape[-1]
    xs = row_major_strides(x.type.shape)
    if out.type.numel == 0:
        return
    name = prog.kernel(
        "index.cu.j2",
        "gather_nd",
        ctype=prog.ctype(x),
        itype=prog.ctype(ind),
        axes=[{"size": x.type.shape[b + k], "stride": xs[b + k]} for k in range(m)],
        inner=math.prod(x.type.shape[b + m :]),
        rows_per_batch=math.prod(ind.type.shape[b:-1]),
        batch_stride=math.prod(x.type.shape[b:]),
    )
    _indexed_over(prog, name, out, [x, ind])


defop(
    "GatherND",
    FAMILY,
    infer=_gather_nd_infer,
    reference=_gather_nd_ref,
    attrs={"batch_dims": 0},
    inputs=2,
    emit=_gather_nd_emit,
)


# -- Scatter family ----------------------------------------------------------------------------

_REDUCTIONS: dict[str, Callable[..., None] | None] = {
    "none": None,
    "add": np.add.at,
    "mul": np.multiply.at,
    "max": np.maximum.at,
    "min": np.minimum.at,
}


def _check_reduction(ctx: InferCtx) -> None:
    # Scatter (ScatterElements' old name) has no reduction attribute: it always overwrites.
    r = ctx.attrs.get("reduction", "none")
    if r not in _REDUCTIONS:
        raise ctx.fail(f"reduction {r!r} is not one of {', '.join(_REDUCTIONS)}")


def _scatter(out: np.ndarray, key: tuple[np.ndarray, ...], upd: np.ndarray, reduction: str) -> None:
    at = _REDUCTIONS[reduction]
    if at is None:
        # With repeated indices the last update wins, as in onnxruntime.
        out[key] = upd
    else:
        at(out, key, upd)


def _scatter_elements_infer(ctx: InferCtx) -> list[TensorType]:
    x, upd = ctx.type(0), ctx.type(2)
    ind = _int_indices(ctx, 1)
    axis = ctx.axis(ctx.attr("axis"), x.rank)
    _check_reduction(ctx)
    if upd.dtype != x.dtype:
        raise ctx.fail(f"updates are {upd.dtype} but the data is {x.dtype}")
    if ind.shape != upd.shape:
        raise ctx.fail(f"indices {list(ind.shape)} and updates {list(upd.shape)} differ in shape")
    _check_fits(ctx, ind, x, axis)
    return [x]


def _scatter_elements_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, ind, upd = arg(xs, 0), arg(xs, 1), arg(xs, 2)
    axis = a["axis"] % x.ndim
    key: list[np.ndarray] = list(np.indices(ind.shape, sparse=True))
    key[axis] = _wrap(ind, x.shape[axis], f"index on axis {axis}")
    out = np.array(x, copy=True)
    _scatter(out, tuple(key), upd, str(a.get("reduction", "none")))
    return out


def _scatter_start(prog: Program, node: Node) -> tuple[Value, Value, Value, Value]:
    """A scatter's data, indices, updates and output, the data copied to the output first
    (the kernel then writes the updates over it or combines them into it)."""
    x, ind, upd = (node_input(node, k) for k in range(3))
    out = node.outputs[0]
    prog.copy(out, x)
    return x, ind, upd, out


def _scatter_elements_emit(prog: Program, node: Node) -> None:
    x, ind, upd, out = _scatter_start(prog, node)
    a = node_attrs(node)
    axis = a["axis"] % x.type.rank
    shape = ind.type.shape
    if ind.type.numel == 0:
        return
    xs, ids = row_major_strides(x.type.shape), row_major_strides(shape)
    lines = [
        {"size": n, "istride": i, "ostride": o}
        for k, (n, i, o) in enumerate(zip(shape, ids, xs, strict=True))
        if k != axis and n != 1
    ]
    name = prog.kernel(
        "index.cu.j2",
        "scatter_elements",
        ctype=prog.ctype(x),
        itype=prog.ctype(ind),
        lines=lines,
        count=shape[axis],
        istride=ids[axis],
        ostride=xs[axis],
        dim=x.type.shape[axis],
        reduction=a.get("reduction", "none"),
    )
    n = ind.type.numel // shape[axis]
    _indexed(prog, name, n, [prog.cptr(ind), prog.cptr(upd), prog.ptr(out)])


defop(
    "ScatterElements",
    FAMILY,
    infer=_scatter_elements_infer,
    reference=_scatter_elements_ref,
    attrs={"axis": 0, "reduction": "none"},
    inputs=3,
    emit=_scatter_elements_emit,
    flops=lambda ins, outs, a: 0 if a["reduction"] == "none" or ins[2] is None else ins[2].numel,
)


def _scatter_import(n: AdapterNode) -> list[Value]:
    # Scatter (opsets 9-10) is ScatterElements under its old name, without reductions.
    return n.emit("ScatterElements", n.inputs, n.attrs, output_names=n.output_names[:1])


defop(
    "Scatter",
    FAMILY,
    infer=_scatter_elements_infer,
    reference=_scatter_elements_ref,
    attrs={"axis": 0},
    inputs=3,
    onnx_import=_scatter_import,
    emit=_scatter_elements_emit,
)


def _scatter_nd_infer(ctx: InferCtx) -> list[TensorType]:
    x, upd = ctx.type(0), ctx.type(2)
    ind = _int_indices(ctx, 1)
    _check_reduction(ctx)
    if upd.dtype != x.dtype:
        raise ctx.fail(f"updates are {upd.dtype} but the data is {x.dtype}")
    if ind.rank < 1 or ind.shape[-1] > x.rank:
        raise ctx.fail(
            f"indices of shape {list(ind.shape)} need rank >= 1 and a last dim <= the "
            f"data's rank {x.rank}"
        )
    want = ind.shape[:-1] + x.shape[ind.shape[-1] :]
    if upd.shape != want:
        raise ctx.fail(f"updates must have shape {list(want)}, got {list(upd.shape)}")
    return [x]


def _scatter_nd_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, ind, upd = arg(xs, 0), arg(xs, 1), arg(xs, 2)
    m = ind.shape[-1]
    flat = ind.reshape(-1, m)
    key = tuple(_wrap(flat[:, k], x.shape[k], f"index on axis {k}") for k in range(m))
    out = np.array(x, copy=True)
    _scatter(out, key, upd.reshape((flat.shape[0], *x.shape[m:])), a["reduction"])
    return out


def _scatter_nd_emit(prog: Program, node: Node) -> None:
    """ScatterND, and ScatterNDShard (rows [start, start + rows) of a whole split along axis
    0 by ``shard_axes``: the kernel checks indices against the whole and skips others')."""
    x, ind, upd, out = _scatter_start(prog, node)
    a = node_attrs(node)
    m = ind.type.shape[-1]
    xs = row_major_strides(x.type.shape)
    rows = math.prod(ind.type.shape[:-1])
    inner = math.prod(x.type.shape[m:])
    if rows == 0:
        return
    args = [prog.cptr(ind), prog.cptr(upd), prog.ptr(out)]
    whole0 = 0
    if node.op == "ScatterNDShard":
        chunk, count = "0", 1
        for axis, n in _shard_digits(a):
            chunk, count = (
                f"({chunk}) * {n} + static_cast<int64_t>({prog.mesh_coord(axis)})",
                count * n,
            )
        whole0 = x.type.shape[0] * count
        args.append(f"({chunk}) * {x.type.shape[0]}")
    name = prog.kernel(
        "index.cu.j2",
        "scatter_nd",
        ctype=prog.ctype(x),
        itype=prog.ctype(ind),
        axes=[{"size": x.type.shape[k], "stride": xs[k]} for k in range(m)],
        rows=rows,
        inner=inner,
        reduction=a["reduction"],
        whole0=whole0,
    )
    _indexed(prog, name, inner, args)


def _scatter_nd_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    """The data's axes past the indexed ones split with the updates' matching axes; the
    first indexed axis split with indices and updates whole runs ScatterNDShard (each rank
    applies the updates that land in its rows: an embedding table's gradient on the table's
    shard); a sum (reduction add) is linear in data and updates together, P with P, or P
    with the index rows split (each rank adds its rows: data parallelism's gradient)."""
    x, ind = ctx.shape(0), ctx.shape(1)
    m, lead = ind[-1], len(ind) - 1
    sigs = [sr.sig(ctx, {0: sr.S(k), 2: sr.S(lead + k - m)}, sr.S(k), 1) for k in range(m, len(x))]
    if m >= 1:
        sigs.append(sr.sig(ctx, {0: sr.S(0)}, sr.S(0), 1, physical="ScatterNDShard"))
    if ctx.attr("reduction") == "add":
        sigs.append(sr.sig(ctx, {0: sr.P, 2: sr.P}, sr.P, 1))
        sigs += [sr.sig(ctx, {0: sr.P, 1: sr.S(j), 2: sr.S(j)}, sr.P, 1) for j in range(lead)]
    return sigs


defop(
    "ScatterND",
    FAMILY,
    infer=_scatter_nd_infer,
    reference=_scatter_nd_ref,
    attrs={"reduction": "none"},
    inputs=3,
    emit=_scatter_nd_emit,
    flops=lambda ins, outs, a: 0 if a["reduction"] == "none" or ins[2] is None else ins[2].numel,
    sbp=_scatter_nd_sbp,
)


# ScatterNDShard: ScatterND on this rank's rows of data split along axis 0 by the mesh axes
# ``shard_axes`` (chunks in mixed radix, as GatherShard's). Indices are global: an update
# whose first index falls in the rank's rows is applied there, the others are skipped (they
# belong to another rank); an index outside the whole axis is an error as in ScatterND.


def _scatter_nd_shard_infer(ctx: InferCtx) -> list[TensorType]:
    mesh, axes = ctx.attrs.get("mesh"), ctx.attrs.get("shard_axes")
    if not mesh or not axes or any(not 0 <= m < len(mesh) for m in axes):
        raise ctx.fail(f"shard_axes {axes} must name axes of the mesh {mesh}")
    if ctx.shape(1)[-1:] in ((), (0,)):
        raise ctx.fail("the shard's rows are chosen by the first index: indices need one")
    return _scatter_nd_infer(ctx)


def _scatter_nd_shard_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, ind, upd = arg(xs, 0), arg(xs, 1), arg(xs, 2)
    rows = x.shape[0]
    chunk, count = 0, 1
    for m, n in _shard_digits(a):
        chunk, count = chunk * n + int(a["coords"][m]), count * n
    k = ind.shape[-1]
    flat = ind.reshape(-1, k)
    first = _wrap(flat[:, 0], rows * count, "index on axis 0") - chunk * rows
    mine = (first >= 0) & (first < rows)
    key = (
        first[mine],
        *(_wrap(flat[mine, j], x.shape[j], f"index on axis {j}") for j in range(1, k)),
    )
    out = np.array(x, copy=True)
    _scatter(out, key, upd.reshape((flat.shape[0], *x.shape[k:]))[mine], a["reduction"])
    return out


defop(
    "ScatterNDShard",
    FAMILY,
    infer=_scatter_nd_shard_infer,
    reference=_scatter_nd_shard_ref,
    attrs={"reduction": "none", "mesh": None, "shard_axes": None, "microbatch": 0},
    inputs=3,
    emit=_scatter_nd_emit,
)


# -- TensorScatter -----------------------------------------------------------------------------
# A KV-cache update: the cache keeps its shape, and each batch entry's `update` (shorter along
# `axis`) is written at that entry's write index (0 when absent), wrapping around the axis in
# circular mode. Negative write indices, and linear writes that run past the end, are errors
# (as in onnxruntime).

_TENSOR_SCATTER_MODES = ("linear", "circular")


def _tensor_scatter_axis(ctx: InferCtx) -> int:
    past, upd = ctx.type(0), ctx.type(1)
    if past.rank < 2:
        raise ctx.fail(f"past_cache needs rank >= 2 (batch and sequence), got {list(past.shape)}")
    axis = ctx.axis(int(ctx.attr("axis")), past.rank)
    if axis == 0:
        raise ctx.fail("axis cannot be 0, the batch axis")
    if ctx.attr("mode") not in _TENSOR_SCATTER_MODES:
        raise ctx.fail(f"mode {ctx.attr('mode')!r} is not one of linear, circular")
    if upd.dtype != past.dtype:
        raise ctx.fail(f"update is {upd.dtype} but past_cache is {past.dtype}")
    fits = upd.rank == past.rank and all(
        u == p if k != axis else u <= p
        for k, (u, p) in enumerate(zip(upd.shape, past.shape, strict=True))
    )
    if not fits:
        raise ctx.fail(
            f"update of shape {list(upd.shape)} must match past_cache {list(past.shape)} "
            f"except along axis {axis}, where it may be shorter"
        )
    if ctx.has(2) and (ctx.dtype(2) != DType.I64 or ctx.shape(2) != past.shape[:1]):
        raise ctx.fail(
            f"write_indices must be int64 of shape [{past.shape[0]}] (one per batch entry), "
            f"got {ctx.type(2)}"
        )
    return axis


def _tensor_scatter_infer(ctx: InferCtx) -> list[TensorType]:
    _tensor_scatter_axis(ctx)
    return [ctx.type(0)]


def _tensor_scatter_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    past, upd = arg(xs, 0), arg(xs, 1)
    w = xs[2] if len(xs) > 2 and xs[2] is not None else np.zeros(past.shape[0], np.int64)
    axis = int(a["axis"]) % past.ndim
    size, length = past.shape[axis], upd.shape[axis]
    out = np.array(past, copy=True)
    for b, start in enumerate(int(i) for i in w):
        if start < 0:
            raise ValueError(f"write_indices[{b}] = {start} is negative")
        if a["mode"] == "linear" and start + length > size:
            raise ValueError(
                f"write_indices[{b}] = {start} plus the update's {length} positions runs past "
                f"the cache's {size} (linear mode)"
            )
        pos = (start + np.arange(length)) % size
        dst = np.moveaxis(out[b], axis - 1, 0)  # a view: writes land in out
        dst[pos] = np.moveaxis(upd[b], axis - 1, 0)
    return out


def _tensor_scatter_emit(prog: Program, node: Node) -> None:
    past, upd, out = node_input(node, 0), node_input(node, 1), node.outputs[0]
    w = node.inputs[2] if len(node.inputs) > 2 else None
    a = node_attrs(node)
    shape = past.type.shape
    axis = int(a["axis"]) % len(shape)
    name = prog.kernel(
        "index.cu.j2",
        "tensor_scatter",
        ctype=prog.ctype(past),
        batch_stride=math.prod(shape[1:]),
        size=shape[axis],
        length=upd.type.shape[axis],
        inner=math.prod(shape[axis + 1 :]),
        has_indices=w is not None,
        circular=a["mode"] == "circular",
    )
    _indexed_over(prog, name, out, [past, upd, w])


def _tensor_scatter_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    # Axes other than the sequence split alike in the cache and the update; a batch split
    # takes the batch entries' write indices along.
    axis = _tensor_scatter_axis(ctx)
    others = (d for d in range(outs[0].rank) if d != axis)
    return [
        sr.sig(ctx, {0: sr.S(d), 1: sr.S(d), 2: sr.S(0) if d == 0 else sr.B}, sr.S(d), 1)
        for d in others
    ]


defop(
    "TensorScatter",
    FAMILY,
    infer=_tensor_scatter_infer,
    reference=_tensor_scatter_ref,
    attrs={"axis": -2, "mode": "linear"},
    inputs=(2, 3),
    emit=_tensor_scatter_emit,
    sbp=_tensor_scatter_sbp,
)


# -- ReverseSequence ---------------------------------------------------------------------------
# Each batch entry reverses its first sequence_lens[b] steps along the time axis and keeps the
# rest. A length outside [0, time steps] is an error (as in onnxruntime).


def _reverse_sequence_axes(ctx: InferCtx) -> tuple[int, int]:
    x = ctx.type(0)
    if x.rank < 2:
        raise ctx.fail(f"needs rank >= 2 (batch and time axes), got shape {list(x.shape)}")
    b, t = ctx.attr("batch_axis"), ctx.attr("time_axis")
    if {b, t} != {0, 1}:
        raise ctx.fail(f"batch_axis and time_axis must be 0 and 1 in some order, got {b} and {t}")
    lens = ctx.type(1)
    if lens.dtype != DType.I64 or lens.shape != (x.shape[b],):
        raise ctx.fail(
            f"sequence_lens must be int64 of shape [{x.shape[b]}] (one per batch entry), got {lens}"
        )
    return int(b), int(t)


def _reverse_sequence_infer(ctx: InferCtx) -> list[TensorType]:
    _reverse_sequence_axes(ctx)
    return [ctx.type(0)]


def _reverse_sequence_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, lens = arg(xs, 0), arg(xs, 1)
    b_axis, t_axis = int(a["batch_axis"]), int(a["time_axis"])
    steps = x.shape[t_axis]
    out = np.array(x, copy=True)
    src = np.moveaxis(x, (b_axis, t_axis), (0, 1))
    dst = np.moveaxis(out, (b_axis, t_axis), (0, 1))  # a view: writes land in out
    for b, n in enumerate(int(v) for v in lens):
        if not 0 <= n <= steps:
            raise ValueError(f"sequence_lens[{b}] = {n} is outside [0, {steps}]")
        dst[b, :n] = src[b, :n][::-1]
    return out


def _reverse_sequence_emit(prog: Program, node: Node) -> None:
    x, lens, out = node_input(node, 0), node_input(node, 1), node.outputs[0]
    a = node_attrs(node)
    shape = x.type.shape
    name = prog.kernel(
        "index.cu.j2",
        "reverse_sequence",
        ctype=prog.ctype(x),
        dim1=shape[1],
        inner=math.prod(shape[2:]),
        time_first=int(a["time_axis"]) == 0,
        steps=shape[int(a["time_axis"])],
    )
    _indexed_over(prog, name, out, [x, lens])


def _reverse_sequence_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    # Batch entries (with their lengths) and the trailing axes are independent.
    b, _ = _reverse_sequence_axes(ctx)
    return [
        sr.sig(ctx, {0: sr.S(b), 1: sr.S(0)}, sr.S(b), 1),
        *sr.same_axes(ctx, outs, range(2, outs[0].rank)),
    ]


defop(
    "ReverseSequence",
    FAMILY,
    infer=_reverse_sequence_infer,
    reference=_reverse_sequence_ref,
    attrs={"batch_axis": 1, "time_axis": 0},
    inputs=2,
    emit=_reverse_sequence_emit,
    sbp=_reverse_sequence_sbp,
)


# -- gradients (VJP rules: flowc/ops/grad.py) ---------------------------------------------------


def _gather_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """The gradient of Gather's data (an embedding table): the output's gradient added into
    a zero table at the gathered rows, by ScatterND with reduction add, whose kernel walks
    the rows in order for each element (repeated indices add deterministically, no float
    atomics). Along an axis other than 0, the table is transposed to put it first."""
    g, data, idx = gouts[0], node.inputs[0], node.inputs[1]
    if g is None or data is None or idx is None or not need[0]:
        return [None, None]
    rank = data.type.rank
    axis = int(node.attrs.get("axis", 0)) % rank
    n = idx.type.numel
    # The output is data.shape[:axis] + idx.shape + data.shape[axis+1:]: move the indexed
    # part first, flattened to n rows.
    lead, tail = data.type.shape[:axis], data.type.shape[axis + 1 :]
    if axis:
        k = idx.type.rank
        perm = [*range(axis, axis + k), *range(axis), *range(axis + k, axis + k + len(tail))]
        g = grad.op1(b, "Transpose", g, perm=perm)
    rows = grad.reshape(b, g, (n, *lead, *tail))
    where = grad.reshape(b, idx, (n, 1))
    moved = (data.type.shape[axis], *lead, *tail)
    zeros = b.const(np.zeros(moved, data.type.dtype.np), "zeros")
    table = grad.op1(b, "ScatterND", zeros, where, rows, reduction="add")
    if axis:
        back = [*range(1, axis + 1), 0, *range(axis + 1, rank)]
        table = grad.op1(b, "Transpose", table, perm=back)
    return [table, None]


set_vjp("Gather", _gather_vjp)
