"""How a logical tensor is laid out over a mesh: ranks, local shapes, shards.

Ranks are numbered row-major over the mesh shape (mesh axis 0 outermost), so on a 2x2 mesh
rank 1 is coordinate (0, 1). When several mesh axes split the same tensor axis, the chunks
are numbered in mixed radix with mesh axis 0 outermost: on a 2x2 mesh, (S(0), S(0)) gives
rank (i, j) chunk 2i + j of four.

``shard`` and ``unshard`` are the definition every other part checks against: the NumPy
simulator, the boxing tests and the lowering of weights to per-rank files.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator

import numpy as np

from flowc.ir.dtype import DType
from flowc.ir.types import Mesh, NdSbp, Sbp, TensorType

Coords = tuple[int, ...]


def all_coords(mesh: Mesh) -> list[Coords]:
    """Every device's coordinates, in rank order."""
    return list(itertools.product(*(range(n) for n in mesh.shape)))


def rank_of(mesh: Mesh, coords: Coords) -> int:
    r = 0
    for c, n in zip(coords, mesh.shape, strict=True):
        r = r * n + c
    return r


def coords_of(mesh: Mesh, rank: int) -> Coords:
    out = []
    for n in reversed(mesh.shape):
        out.append(rank % n)
        rank //= n
    return tuple(reversed(out))


def group_of(mesh: Mesh, coords: Coords, axis: int) -> list[Coords]:
    """The devices that differ from ``coords`` only along mesh axis ``axis``, in order."""
    return [(*coords[:axis], k, *coords[axis + 1 :]) for k in range(mesh.shape[axis])]


def split_factor(sbp: NdSbp, mesh: Mesh, tensor_axis: int) -> int:
    """How many pieces tensor axis ``tensor_axis`` is cut into."""
    return math.prod(
        n
        for p, n in zip(sbp.parts, mesh.shape, strict=True)
        if p.kind == "S" and p.axis == tensor_axis
    )


@functools.lru_cache(maxsize=1 << 16)
def fits(shape: tuple[int, ...], sbp: NdSbp, mesh: Mesh) -> bool:
    """True when every split axis exists and divides evenly (flowc splits only evenly, so
    every rank runs the same program on the same shapes)."""
    if len(sbp.parts) != mesh.ndim:
        return False
    for p in sbp.parts:
        if p.kind == "S" and (p.axis is None or p.axis >= len(shape)):
            return False
    return all(shape[d] % split_factor(sbp, mesh, d) == 0 for d in range(len(shape)))


def fits_type(t: TensorType, sbp: NdSbp, mesh: Mesh) -> bool:
    """fits, and no symbolic dim of ``t`` split (docs/dynamic.md): a rank's chunk of a dim
    that changes from run to run would be no fixed size."""
    if not fits(t.shape, sbp, mesh):
        return False
    return t.sym is None or all(
        split_factor(sbp, mesh, d) == 1 for d, s in enumerate(t.sym) if s is not None
    )


@functools.lru_cache(maxsize=1 << 16)
def local_shape(shape: tuple[int, ...], sbp: NdSbp, mesh: Mesh) -> tuple[int, ...]:
    if not fits(shape, sbp, mesh):
        raise ValueError(
            f"placement {sbp} does not split shape {list(shape)} evenly on mesh {mesh}"
        )
    return tuple(d // split_factor(sbp, mesh, k) for k, d in enumerate(shape))


def local_type(t: TensorType, sbp: NdSbp, mesh: Mesh) -> TensorType:
    return t.with_shape(local_shape(t.shape, sbp, mesh))


def chunk_index(sbp: NdSbp, mesh: Mesh, coords: Coords, tensor_axis: int) -> int:
    """Which of the ``split_factor`` chunks of ``tensor_axis`` the device at ``coords`` holds."""
    idx = 0
    for p, n, c in zip(sbp.parts, mesh.shape, coords, strict=True):
        if p.kind == "S" and p.axis == tensor_axis:
            idx = idx * n + c
    return idx


def is_partial_root(sbp: NdSbp, coords: Coords) -> bool:
    """True when this device is coordinate 0 on every P axis (the one holding a B value's
    data once it becomes P by zeroing the rest)."""
    return all(c == 0 for p, c in zip(sbp.parts, coords, strict=True) if p.kind == "P")


def shard(
    logical: np.ndarray,
    sbp: NdSbp,
    mesh: Mesh,
    coords: Coords,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """The piece of ``logical`` the device at ``coords`` holds.

    For P axes the logical value is spread as partial sums: with ``rng`` as random parts that
    add up to it (what tests want), else all of it on the root and zeros elsewhere.
    """
    local = logical
    for d in range(logical.ndim):
        f = split_factor(sbp, mesh, d)
        if f > 1:
            size = logical.shape[d] // f
            k = chunk_index(sbp, mesh, coords, d)
            local = np.take(local, range(k * size, (k + 1) * size), axis=d)
    local = np.array(local, order="C")
    p_axes = [a for a, p in enumerate(sbp.parts) if p.kind == "P"]
    if not p_axes:
        return local
    if rng is None:
        return local if is_partial_root(sbp, coords) else np.zeros_like(local)
    # Random parts: every device but the last along each P axis gets noise; the last one
    # gets what makes the sum exact. Draws depend only on coordinates, so the parts of one
    # group add up whatever order devices are visited in.
    parts = np.zeros_like(local)
    for a in p_axes:
        n = mesh.shape[a]
        # B axes must hold equal copies, so they do not enter the draw.
        key_coords = tuple(
            c if p.kind != "B" else -1 for p, c in zip(sbp.parts, coords, strict=True)
        )
        key = hash((key_coords[:a] + key_coords[a + 1 :], a)) & 0xFFFF
        noise = (
            np.random.default_rng(key).standard_normal((n - 1, *local.shape)).astype(local.dtype)
        )
        if coords[a] < n - 1:
            parts = parts + noise[coords[a]]
        else:
            parts = parts - noise.sum(axis=0).astype(local.dtype)
    # Spread the value itself only onto the P-root, so the noise sums to zero per P axis.
    return (local if is_partial_root(sbp, coords) else np.zeros_like(local)) + parts


def unshard(locals_: dict[Coords, np.ndarray], sbp: NdSbp, mesh: Mesh) -> np.ndarray:
    """The logical tensor the devices' pieces represent (sums over P axes, concatenation in
    chunk order over S axes). Raises ValueError when B copies disagree."""
    coords = all_coords(mesh)
    first = locals_[coords[0]]
    rank = first.ndim
    full_shape = tuple(first.shape[d] * split_factor(sbp, mesh, d) for d in range(rank))
    out = np.zeros(full_shape, dtype=np.float64 if first.dtype.kind == "f" else first.dtype)
    # Each distinct piece is added once per P-group member; B copies are compared.
    seen: dict[tuple[tuple[int, ...], Coords], np.ndarray] = {}
    for c in coords:
        piece = locals_[c]
        index = tuple(chunk_index(sbp, mesh, c, d) for d in range(rank))
        p_key = tuple(c[a] for a, p in enumerate(sbp.parts) if p.kind == "P")
        key = (index, p_key)
        if key in seen:
            if not np.array_equal(seen[key], piece, equal_nan=piece.dtype.kind == "f"):
                raise ValueError(f"devices hold different copies of a broadcast piece (at {c})")
            continue
        seen[key] = piece
        sl = tuple(
            slice(index[d] * piece.shape[d], (index[d] + 1) * piece.shape[d]) for d in range(rank)
        )
        if any(p.kind == "P" for p in sbp.parts):
            out[sl] = out[sl] + piece
        else:
            out[sl] = piece
    return out.astype(first.dtype)


def nd_sbps(rank: int, mesh: Mesh, partial: bool = True) -> Iterator[NdSbp]:
    """Every nd-SBP of a rank-``rank`` tensor on ``mesh`` (S of each axis, B, and P)."""
    one = [Sbp("B"), *(Sbp("S", d) for d in range(rank))] + ([Sbp("P")] if partial else [])
    for parts in itertools.product(one, repeat=mesh.ndim):
        yield NdSbp(tuple(parts))


def broadcast(mesh: Mesh) -> NdSbp:
    return NdSbp(tuple(Sbp("B") for _ in mesh.shape))


# The float types a partial sum is never held in: a P value of one of them is carried in
# float32 until its reduction, and rounded after it (docs/parallel.md, "Narrow types").
NARROW_FLOATS = frozenset({DType.F16, DType.BF16})


def has_partial(sbp: NdSbp) -> bool:
    return any(p.kind == "P" for p in sbp.parts)


def carried_type(t: TensorType, sbp: NdSbp) -> TensorType:
    """The type a value of logical type ``t`` is held in under layout ``sbp``: its own, but
    float32 for a narrow float partial sum (each rank's part is not rounded before the
    sum, so a mesh computes what one device computes)."""
    if t.dtype in NARROW_FLOATS and has_partial(sbp):
        return t.with_dtype(DType.F32)
    return t
