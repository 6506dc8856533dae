"""Static tensor types and placement: TensorType, Mesh, Sbp and NdSbp."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flowc.ir.dtype import DType


@dataclass(frozen=True)
class TensorType:
    """A fully static tensor type: every dimension is a known non-negative integer."""

    shape: tuple[int, ...]
    dtype: DType

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        object.__setattr__(self, "shape", shape)

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
        return TensorType(self.shape, dtype)

    def __str__(self) -> str:
        return f"{self.dtype.short}[{', '.join(str(d) for d in self.shape)}]"


@dataclass(frozen=True)
class Mesh:
    """A named, shaped grid of devices, e.g. ``gpus[2, 2]``."""

    name: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.shape or any(int(d) < 1 for d in self.shape):
            raise ValueError(f"mesh {self.name!r} needs positive axis sizes, got {self.shape}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

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
