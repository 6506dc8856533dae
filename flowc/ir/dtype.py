"""Element types: every ONNX numeric type and bool.

Each DType knows its ONNX enum, its NumPy dtype (ml_dtypes supplies bfloat16, the float8,
float4/6 and the 2/4-bit integer types) and a short name used by the printer and the DSL.
"""

from __future__ import annotations

import enum
from typing import Any

import ml_dtypes
import numpy
import numpy as np


class DType(enum.Enum):
    # value: (short name, ONNX TensorProto enum, numpy dtype)
    F32 = ("f32", 1, np.dtype(np.float32))
    U8 = ("u8", 2, np.dtype(np.uint8))
    I8 = ("i8", 3, np.dtype(np.int8))
    U16 = ("u16", 4, np.dtype(np.uint16))
    I16 = ("i16", 5, np.dtype(np.int16))
    I32 = ("i32", 6, np.dtype(np.int32))
    I64 = ("i64", 7, np.dtype(np.int64))
    BOOL = ("bool", 9, np.dtype(np.bool_))
    F16 = ("f16", 10, np.dtype(np.float16))
    F64 = ("f64", 11, np.dtype(np.float64))
    U32 = ("u32", 12, np.dtype(np.uint32))
    U64 = ("u64", 13, np.dtype(np.uint64))
    C64 = ("c64", 14, np.dtype(np.complex64))
    C128 = ("c128", 15, np.dtype(np.complex128))
    BF16 = ("bf16", 16, np.dtype(ml_dtypes.bfloat16))
    F8E4M3FN = ("f8e4m3fn", 17, np.dtype(ml_dtypes.float8_e4m3fn))
    F8E4M3FNUZ = ("f8e4m3fnuz", 18, np.dtype(ml_dtypes.float8_e4m3fnuz))
    F8E5M2 = ("f8e5m2", 19, np.dtype(ml_dtypes.float8_e5m2))
    F8E5M2FNUZ = ("f8e5m2fnuz", 20, np.dtype(ml_dtypes.float8_e5m2fnuz))
    U4 = ("u4", 21, np.dtype(ml_dtypes.uint4))
    I4 = ("i4", 22, np.dtype(ml_dtypes.int4))
    F4E2M1 = ("f4e2m1", 23, np.dtype(ml_dtypes.float4_e2m1fn))
    F8E8M0 = ("f8e8m0", 24, np.dtype(ml_dtypes.float8_e8m0fnu))
    U2 = ("u2", 25, np.dtype(ml_dtypes.uint2))
    I2 = ("i2", 26, np.dtype(ml_dtypes.int2))
    F6E2M3 = ("f6e2m3", 27, np.dtype(ml_dtypes.float6_e2m3fn))
    F6E3M2 = ("f6e3m2", 28, np.dtype(ml_dtypes.float6_e3m2fn))

    @property
    def short(self) -> str:
        return str(self.value[0])

    @property
    def onnx(self) -> int:
        return int(self.value[1])

    @property
    def np(self) -> numpy.dtype[Any]:
        dt: numpy.dtype[Any] = self.value[2]
        return dt

    @property
    def itemsize(self) -> int:
        return int(self.np.itemsize)

    @property
    def is_float(self) -> bool:
        return self in _FLOATS

    @property
    def is_int(self) -> bool:
        return self in _INTS

    @property
    def is_signed(self) -> bool:
        return self in _SIGNED

    @property
    def is_complex(self) -> bool:
        return self in (DType.C64, DType.C128)

    @property
    def storage_only(self) -> bool:
        """A type generated code stores and converts but does not compute in (float16,
        bfloat16, float8/6/4, 2- and 4-bit integers): kernels run in :attr:`compute_type`."""
        return self in _STORAGE_ONLY

    @property
    def compute_type(self) -> DType:
        """The type kernels compute a storage-only type's values in (itself otherwise)."""
        if not self.storage_only:
            return self
        return DType.F32 if self.is_float else DType.I32

    @staticmethod
    def from_onnx(code: int) -> DType:
        try:
            return _BY_ONNX[code]
        except KeyError:
            raise ValueError(
                f"ONNX element type {code} is not supported (strings are not)"
            ) from None

    @staticmethod
    def from_numpy(dt: numpy.dtype[Any] | type) -> DType:
        try:
            return _BY_NP[np.dtype(dt)]
        except KeyError:
            raise ValueError(f"NumPy dtype {np.dtype(dt)} has no flowc DType") from None

    @staticmethod
    def from_short(name: str) -> DType:
        try:
            return _BY_SHORT[name]
        except KeyError:
            raise ValueError(f"unknown element type {name!r}") from None

    def __repr__(self) -> str:
        return f"DType.{self.name}"

    def __str__(self) -> str:
        return self.short


_FLOATS = frozenset(
    {
        DType.F32,
        DType.F16,
        DType.F64,
        DType.BF16,
        DType.F8E4M3FN,
        DType.F8E4M3FNUZ,
        DType.F8E5M2,
        DType.F8E5M2FNUZ,
        DType.F4E2M1,
        DType.F8E8M0,
        DType.F6E2M3,
        DType.F6E3M2,
    }
)
_SIGNED_INTS = frozenset({DType.I8, DType.I16, DType.I32, DType.I64, DType.I4, DType.I2})
_INTS = _SIGNED_INTS | {DType.U8, DType.U16, DType.U32, DType.U64, DType.U4, DType.U2}
_SIGNED = _SIGNED_INTS | _FLOATS | {DType.C64, DType.C128}
_BY_ONNX = {d.onnx: d for d in DType}
_BY_NP = {d.np: d for d in DType}
_BY_SHORT = {d.short: d for d in DType}

_STORAGE_ONLY = frozenset(
    {
        DType.F16,
        DType.BF16,
        DType.F8E4M3FN,
        DType.F8E4M3FNUZ,
        DType.F8E5M2,
        DType.F8E5M2FNUZ,
        DType.F8E8M0,
        DType.F4E2M1,
        DType.F6E2M3,
        DType.F6E3M2,
        DType.I4,
        DType.U4,
        DType.I2,
        DType.U2,
    }
)
