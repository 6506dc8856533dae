"""Memory-mapped model files, noted by the frontend that maps them, so that a writer can
tell a constant that is a view of one (``file_source``) and copy its bytes file to file
(flowc/codegen/weights.py) instead of through the mapping.
"""

from __future__ import annotations

import mmap
import os
import weakref

import numpy as np

# A mapped model file's mapping -> (a descriptor of the file, the mapping's address); the
# descriptor is closed when the mapping goes.
_MAPPED: weakref.WeakKeyDictionary[mmap.mmap, tuple[int, int]] = weakref.WeakKeyDictionary()


def register_mapped_file(mapped: mmap.mmap, fd: int) -> None:
    """Note that ``mapped`` maps the whole of the file open as ``fd`` (from offset 0), so
    that constants viewing it can be copied file to file."""
    if mapped in _MAPPED or len(mapped) == 0:
        return
    own = os.dup(fd)
    address = int(np.frombuffer(mapped, dtype=np.uint8, count=1).ctypes.data)
    _MAPPED[mapped] = (own, address)
    weakref.finalize(mapped, os.close, own)


def file_source(a: np.ndarray) -> tuple[int, int] | None:
    """(descriptor, offset) of ``a``'s bytes in a registered mapped file, when ``a`` is a
    C-contiguous view of it; else None."""
    if not a.flags.c_contiguous or a.dtype.hasobject or a.nbytes == 0:
        return None
    root: object = a
    while isinstance(root, np.ndarray) and root.base is not None:
        root = root.base
    if isinstance(root, memoryview):  # np.frombuffer's base: a view of the mapping
        root = root.obj
    if not isinstance(root, mmap.mmap):
        return None
    found = _MAPPED.get(root)
    if found is None:
        return None
    fd, address = found
    offset = int(a.ctypes.data) - address
    if offset < 0 or offset + a.nbytes > len(root):
        return None
    return fd, offset
