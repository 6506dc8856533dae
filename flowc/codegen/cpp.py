"""Writing C++ text safely: string literals, identifiers, element types, numbers."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from flowc.errors import FlowcError
from flowc.ir.dtype import DType

CTYPES = {
    DType.F32: "float",
    DType.F64: "double",
    DType.I64: "int64_t",
    DType.I32: "int32_t",
    DType.I16: "int16_t",
    DType.I8: "int8_t",
    DType.U8: "uint8_t",
    DType.U16: "uint16_t",
    DType.U32: "uint32_t",
    DType.U64: "uint64_t",
    DType.BOOL: "bool",
    # Storage-only types (runtime_cpp/flowc/narrow.h): only casts and views touch them.
    DType.F16: "flowc::f16",
    DType.BF16: "flowc::bf16",
    DType.F8E4M3FN: "flowc::f8e4m3fn",
    DType.F8E4M3FNUZ: "flowc::f8e4m3fnuz",
    DType.F8E5M2: "flowc::f8e5m2",
    DType.F8E5M2FNUZ: "flowc::f8e5m2fnuz",
    DType.F8E8M0: "flowc::f8e8m0",
    DType.F4E2M1: "flowc::f4e2m1",
    DType.F6E2M3: "flowc::f6e2m3",
    DType.F6E3M2: "flowc::f6e3m2",
    DType.I4: "flowc::i4",
    DType.U4: "flowc::u4",
    DType.I2: "flowc::i2",
    DType.U2: "flowc::u2",
}


def ctype(dt: DType) -> str:
    try:
        return CTYPES[dt]
    except KeyError:
        raise CodegenError(
            f"element type {dt} has no kernels yet (supported: {', '.join(str(d) for d in CTYPES)})"
        ) from None


def c_string(text: str) -> str:
    """A C string literal holding ``text``'s UTF-8 bytes exactly: everything but plain
    printable ASCII is an octal escape, so quotes, backslashes, newlines, ``*/`` and ``??``
    trigraphs can never end the literal or a comment early."""
    out = []
    for b in text.encode("utf-8", "surrogateescape"):  # a file name's non-UTF-8 bytes too
        ch = chr(b)
        if 0x20 <= b < 0x7F and ch not in '"\\?*/':
            out.append(ch)
        else:
            out.append(f"\\{b:03o}")
    return '"' + "".join(out) + '"'


# Characters that may not reach a comment: line breaks of every kind (C, CMake and editors
# disagree on which end a line), other controls, the bidi controls that let text read
# differently from how it compiles (CVE-2021-42574), and lone surrogates (a file name's
# bytes that are not UTF-8, as Python decodes them), which no UTF-8 file can hold.
_UNSAFE_IN_COMMENT = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)


def c_comment(text: str) -> str:
    """``text`` made safe inside a C/C++ ``//`` or ``/* */`` comment: controls, line and
    bidi characters become ``?``, ``*/`` and ``/*`` are broken apart, and a trailing
    backslash (which would continue a ``//`` comment onto the next line) is dropped, so the
    comment always ends where the template ends it. Lossy by design: a comment is for
    people; exact names go through c_string."""
    s = _UNSAFE_IN_COMMENT.sub("?", text)
    while "*/" in s or "/*" in s or "??" in s:  # "??/" is a trigraph backslash pre-C++17
        s = s.replace("*/", "* /").replace("/*", "/ *").replace("??", "? ?")
    return s.rstrip("\\")


def cmake_comment(text: str) -> str:
    """``text`` made safe inside a CMake ``#`` line comment: no control, line or bidi
    character (a newline would start a command), and no ``[[``/``]]`` bracket openers."""
    s = _UNSAFE_IN_COMMENT.sub("?", text)
    return s.replace("[", "(").replace("]", ")")


def cmake_string(text: str) -> str:
    """A quoted CMake argument holding ``text`` exactly: backslash, quote and ``$`` (variable
    references) escaped; ``;`` escaped so the string stays one list element. Line breaks
    and other controls are refused: CMake's quoted arguments cannot carry them portably."""
    if _UNSAFE_IN_COMMENT.search(text):
        raise CodegenError(
            f"{text!r}: control or bidi characters cannot go into a CMake file",
            hint="rename it with plain characters",
        )
    s = text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace(";", "\\;")
    return f'"{s}"'


# The longest symbol prefix: it names the project's library, lib<prefix>_model.so, and
# CMake's <prefix>_model.dir beside it, and a file name holds 255 bytes.
MAX_PREFIX = 200


def is_c_ident(text: str) -> bool:
    """Whether ``text`` is a C identifier (ASCII letters, digits, underscores)."""
    return re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", text) is not None


def c_ident(text: str, fallback: str = "model") -> str:
    """A C identifier derived from ``text`` (letters, digits, underscores; not starting with a digit)."""
    s = re.sub(r"[^A-Za-z0-9_]", "_", text).strip("_") or fallback
    return f"m_{s}" if s[0].isdigit() else s


def c_float(x: float, t: str = "float") -> str:
    """A literal of type ``t`` with exactly the value ``x``."""
    if math.isnan(x):
        return f"static_cast<{t}>(NAN)"
    if math.isinf(x):
        return f"static_cast<{t}>({'-' if x < 0 else ''}INFINITY)"
    if t == "float":
        return f"{float(np.float32(x)).hex()}f"
    if t == "double":
        return float(x).hex()
    return f"static_cast<{t}>({float(x).hex()})"


class CodegenError(FlowcError):
    """A graph the code generator cannot emit (yet): the message names the node and the op."""


def c_int(value: int, t: str) -> str:
    """An integer literal of C++ type ``t`` that compiles warning-free at the type's limits."""
    v = int(value)
    if t == "bool":
        return "true" if v else "false"
    if v == -(1 << 63):
        return "static_cast<int64_t>(-9223372036854775807LL - 1)"
    if v < 0:
        return f"static_cast<{t}>({v}LL)"
    return f"static_cast<{t}>({v}ULL)"


def c_literal(value: Any, dtype: DType, t: str) -> str:
    """A C++ constant of element type ``dtype`` (C++ type ``t``) with exactly ``value``."""
    if dtype.is_float:
        return c_float(float(value), t)
    if dtype == DType.BOOL:
        return "true" if bool(value) else "false"
    return c_int(int(value), t)


# The generated code's launch geometry (a spelling of FLOWC_LAUNCH's grid): threads per
# block of the grid-stride kernels, and the most blocks a grid-stride launch asks for.
BLOCK = 256
MAX_GRID = 1 << 20

# Numerators of FlowcDivmod (templates/kernels/common.cu.j2) stay below this.
DIVMOD_LIMIT = 1 << 31


def divmod_magic(d: int) -> tuple[int, int, int]:
    """(d, mul, shr) such that n // d == (n * mul >> 32) >> shr for 0 <= n < 2^31 (d > 1;
    d == 1 is the kernel's own case): shr + 32 = 31 + ceil(log2 d), mul = ceil(2^(shr+32) / d),
    which fits 32 bits. The round-up error n * (mul * d - 2^(shr+32)) / 2^(shr+32) stays below
    1 / d for n < 2^31, so the floor is exact (the scheme CUTLASS's FastDivmod uses)."""
    if not 1 <= d < DIVMOD_LIMIT:
        raise CodegenError(f"internal: fast division by {d} (needs 1 <= d < 2^31)")
    if d == 1:
        return 1, 0, 0
    p = 31 + (d - 1).bit_length()
    return d, -(-(1 << p) // d), p - 32


def fast_divmod(d: int) -> str:
    """The C++ FlowcDivmod literal for divisor ``d``, as a kernel argument. A zero-size
    dimension has no element to index (the launch is skipped): it divides by 1."""
    dd, mul, shr = divmod_magic(max(d, 1))
    return f"FlowcDivmod{{{dd}u, {mul}u, {shr}u}}"
