"""Tensor types and placement: TensorType, Mesh, Sbp and NdSbp."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from flowc.ir.dtype import DType
from flowc.ir.symbolic import SymDim, dims_text

# The highest rank of a tensor: NumPy's limit (its reference interpreter and every constant
# are NumPy arrays), refused where a model is read.
MAX_RANK = 64


@dataclass(frozen=True)
class TensorType:
    """A tensor type. ``shape`` holds every dimension as a known non-negative integer: for a
    symbolic dimension (``sym``, see ir/symbolic.py), its size at the bound, so everything
    planned from types is planned for the largest run. ``sym`` is None for a static type."""

    shape: tuple[int, ...]
    dtype: DType
    sym: tuple[SymDim | None, ...] | None = None

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        object.__setattr__(self, "shape", shape)
        if self.sym is not None:
            sym = tuple(self.sym)
            if len(sym) != len(shape):
                raise ValueError(f"symbolic dims {sym} do not match the rank of {shape}")
            object.__setattr__(self, "sym", sym if any(d is not None for d in sym) else None)

    @property
    def is_dynamic(self) -> bool:
        return self.sym is not None

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        # Sub-byte types are stored one element per byte by NumPy/ml_dtypes.
        return self.numel * self.dtype.itemsize

    def with_shape(self, shape: tuple[int, ...] | list[int]) -> TensorType:
        return TensorType(tuple(shape), self.dtype)

    def with_dtype(self, dtype: DType) -> TensorType:
        return TensorType(self.shape, dtype, self.sym)

    def shape_at(self, values: Mapping[str, int]) -> tuple[int, ...]:
        """The shape when the symbols have sizes ``values``."""
        if self.sym is None:
            return self.shape
        return tuple(
            d if s is None else s.evaluate(values)
            for d, s in zip(self.shape, self.sym, strict=True)
        )

    def static(self) -> TensorType:
        """This type at the bound, with no symbolic dims."""
        return TensorType(self.shape, self.dtype)

    def __str__(self) -> str:
        return f"{self.dtype.short}[{', '.join(dims_text(self.shape, self.sym))}]"


# The most devices a mesh may hold, the product of its axes (and so the most pipeline
# stages, mesh axis 0): the compiler lays out, writes and simulates every rank's program.
MAX_MESH_DEVICES = 1 << 16
# The most micro-batches of a pipeline: each stage's program unrolls them all at compile
# time (the two-stage MLP of 65,536 rows: 1,024 in 3 s, 16,384 in 72 s, 65,536 in minutes).
MAX_MICROBATCHES = 1 << 10
# The most mesh axes: the placement search weighs every nd-SBP of every value, a number
# exponential in the axes (the transformer example: 1 s on 2 axes, 27 s on 3, minutes and
# gigabytes on 4 or 5). Three hold a pipeline over a 2-D (data x tensor) stage mesh.
MAX_MESH_AXES = 3


def mesh_size_problem(shape: tuple[int, ...]) -> str | None:
    """Why a mesh of ``shape`` cannot be (no axis, more than MAX_MESH_AXES, an axis below 1,
    more devices than MAX_MESH_DEVICES), or None; ``shape`` may hold integers of any size."""
    if not shape:
        return "a mesh needs at least one axis"
    if len(shape) > MAX_MESH_AXES:
        return f"the mesh has {len(shape)} axes; flowc supports at most {MAX_MESH_AXES}"
    if any(d < 1 for d in shape):
        return f"mesh axes need at least one device, got {list(shape)}"
    devices = math.prod(shape)
    if devices > MAX_MESH_DEVICES:
        # (a product of thousands of digits has no str())
        count = str(devices) if devices < 10**30 else "more than 10^30"
        return f"the mesh has {count} devices; flowc supports at most {MAX_MESH_DEVICES}"
    return None


@dataclass(frozen=True)
class Mesh:
    """A named, shaped grid of devices, e.g. ``gpus[2, 2]``: at most MAX_MESH_DEVICES."""

    name: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        problem = mesh_size_problem(shape)
        if problem is not None:
            raise ValueError(f"mesh {self.name!r}: {problem}")
        object.__setattr__(self, "shape", shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __str__(self) -> str:
        return f"{self.name}[{', '.join(str(d) for d in self.shape)}]"


@dataclass(frozen=True)
class Sbp:
    """The layout of a tensor along one mesh axis.

    kind 'S' splits tensor axis ``axis`` across the devices of the mesh axis, 'B' gives every
    device a full copy, 'P' gives every device a full-shape partial value whose element-wise
    sum is the logical tensor.
    """

    kind: str
    axis: int | None = None

    def __post_init__(self) -> None:
        if self.kind == "S":
            if self.axis is None or self.axis < 0:
                raise ValueError("S(axis) needs a non-negative tensor axis")
        elif self.kind in ("B", "P"):
            if self.axis is not None:
                raise ValueError(f"{self.kind} takes no axis")
        else:
            raise ValueError(f"unknown SBP kind {self.kind!r} (expected S, B or P)")

    @staticmethod
    def split(axis: int) -> Sbp:
        return Sbp("S", axis)

    def __str__(self) -> str:
        return f"S({self.axis})" if self.kind == "S" else self.kind


BROADCAST = Sbp("B")
PARTIAL = Sbp("P")


@dataclass(frozen=True)
class NdSbp:
    """One Sbp per mesh axis."""

    parts: tuple[Sbp, ...]

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("an nd-SBP needs at least one entry")
        object.__setattr__(self, "parts", tuple(self.parts))

    def check(self, ttype: TensorType, mesh: Mesh) -> None:
        """Raise ValueError if this placement does not fit the tensor type on the mesh."""
        if len(self.parts) != mesh.ndim:
            raise ValueError(
                f"placement {self} has {len(self.parts)} entries but mesh {mesh} has {mesh.ndim} axes"
            )
        for p in self.parts:
            if p.kind == "S" and p.axis is not None and p.axis >= ttype.rank:
                raise ValueError(
                    f"placement {self} splits axis {p.axis} of a rank-{ttype.rank} tensor"
                )

    def __str__(self) -> str:
        if len(self.parts) == 1:
            return str(self.parts[0])
        return "(" + ", ".join(str(p) for p in self.parts) + ")"
