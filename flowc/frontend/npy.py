"""Reading .npy arrays (a weights .npz's members; an --input file) with the header checked
before NumPy reads the data.

NumPy's reader takes the header for a Python literal and trusts it: a header holding a call
fails with "malformed node or string: <ast.Call object at 0x...>", a dimension past int64
with an OverflowError, and a shape of terabytes in a .npz member is allocated before the
data is found missing. Here each of those is an error that says what the header holds and
why it cannot be.
"""

from __future__ import annotations

import ast
import math
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

from flowc.errors import FlowcError, InputError
from flowc.ir.types import MAX_RANK

MAGIC = b"\x93NUMPY"
# NumPy's own limit on the header (np.load's max_header_size).
MAX_HEADER_BYTES = 10000
# A dimension, an element count and a byte count are int64s (NumPy's intp on 64-bit).
MAX_INT64 = (1 << 63) - 1

Error = Callable[[str], FlowcError]


def _shown(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _literal_problem(text: str) -> str:
    """What in the header ``text`` is no plain value (a call, a name, an expression)."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return f"is not a Python dictionary: {_shown(text.strip())}"
    plain = (
        ast.Expression,
        ast.Dict,
        ast.Tuple,
        ast.List,
        ast.Constant,
        ast.UnaryOp,
        ast.USub,
        ast.UAdd,
        ast.Load,
    )
    for node in ast.walk(tree):
        if not isinstance(node, plain):
            part = ast.get_source_segment(text.strip(), node) or type(node).__name__
            return (
                f"holds {_shown(part, 40)}, which is no plain value (a header holds numbers, "
                "strings, True/False and tuples)"
            )
    return f"is not a plain Python dictionary: {_shown(text.strip())}"


def read_header(f: IO[bytes], what: str, error: Error) -> tuple[dict[str, Any], int]:
    """The header dictionary of the .npy stream ``f`` (at its start) and the offset of the
    data; ``error(message)`` makes the exception for a header that cannot be read."""
    start = f.read(8)
    if len(start) < 8 or not start.startswith(MAGIC):
        raise error(f"{what} is not a .npy file (it does not start with \\x93NUMPY)")
    version = (start[6], start[7])
    if version not in ((1, 0), (2, 0), (3, 0)):
        raise error(
            f"{what}: .npy format version {version[0]}.{version[1]} is not one NumPy writes"
        )
    width = 2 if version == (1, 0) else 4
    raw = f.read(width)
    if len(raw) < width:
        raise error(f"{what}: the file ends inside the .npy header")
    length = int.from_bytes(raw, "little")
    if length > MAX_HEADER_BYTES:
        raise error(
            f"{what}: a .npy header of {length} bytes; NumPy reads at most {MAX_HEADER_BYTES}"
        )
    data = f.read(length)
    if len(data) < length:
        raise error(f"{what}: the file ends inside the .npy header")
    try:
        text = data.decode("utf-8" if version == (3, 0) else "latin-1")
    except UnicodeDecodeError:
        raise error(f"{what}: the .npy header is not UTF-8 text") from None
    try:
        header = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise error(f"{what}: the .npy header {_literal_problem(text)}") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise error(
            f"{what}: the .npy header {_shown(text.strip())} is not a dictionary of 'descr', "
            "'fortran_order' and 'shape'"
        )
    return header, 8 + width + length


def _checked(header: dict[str, Any], what: str, error: Error) -> tuple[np.dtype, tuple[int, ...]]:
    shape = header["shape"]
    if not isinstance(shape, tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in shape
    ):
        raise error(f"{what}: the .npy header's shape {shape!r} is not a tuple of integers")
    if len(shape) > MAX_RANK:
        raise error(
            f"{what}: the .npy header's shape has {len(shape)} dimensions; flowc holds tensors "
            f"of rank at most {MAX_RANK}"
        )
    for k, d in enumerate(shape):
        if not 0 <= d <= MAX_INT64:
            shown = str(d) if abs(d) < 10**30 else "a number of more than 30 digits"
            raise error(
                f"{what}: dimension {k} of the .npy header's shape is {shown}, outside 0 to "
                f"{MAX_INT64} (int64)"
            )
    if not isinstance(header["fortran_order"], bool):
        raise error(
            f"{what}: the .npy header's fortran_order {header['fortran_order']!r} is not a bool"
        )
    try:
        dtype = np.lib.format.descr_to_dtype(header["descr"])
    except (ValueError, TypeError, KeyError):
        raise error(
            f"{what}: the .npy header's descr {_shown(repr(header['descr']), 40)} is no NumPy "
            "element type"
        ) from None
    if dtype.hasobject:
        raise error(f"{what} holds Python objects; flowc reads arrays of numbers only")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_INT64:
        raise error(
            f"{what}: the .npy header's shape {list(shape)} of {dtype} is more than {MAX_INT64} "
            "bytes"
        )
    return dtype, shape


def read_npy(f: IO[bytes], size: int, what: str, error: Error = InputError) -> np.ndarray:
    """The array in the .npy stream ``f`` of ``size`` bytes (seekable, at its start), the
    header checked first and the data's length against it."""
    header, offset = read_header(f, what, error)
    dtype, shape = _checked(header, what, error)
    need = math.prod(shape) * dtype.itemsize
    if size - offset < need:
        raise error(
            f"{what}: the .npy header declares {dtype}{list(shape)} ({need} bytes of data), "
            f"but only {max(size - offset, 0)} bytes follow it"
        )
    f.seek(0)
    try:
        return np.lib.format.read_array(f, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise error(f"{what} is not a readable .npy file ({e})") from None


def load_npy(path: Path, what: str, error: Error = InputError) -> np.ndarray:
    """The array of the .npy file ``path`` (a regular file; the caller checks that)."""
    with open(path, "rb") as f:
        return read_npy(f, os.fstat(f.fileno()).st_size, what, error)


def load_npz(path: Path, what: str, error: Error = InputError) -> dict[str, np.ndarray]:
    """Every array of the .npz file ``path`` by name (a member ``w.npy`` is ``w``, as
    np.load names them), each member's header checked."""
    arrays: dict[str, np.ndarray] = {}
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                name = info.filename
                key = name[:-4] if name.endswith(".npy") else name
                with z.open(info) as f:
                    arrays[key] = read_npy(f, info.file_size, f"{what}: array {key!r}", error)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError) as e:
        raise error(f"{what} cannot be read: it is not a .npz (zip) file ({e})") from None
    return arrays
