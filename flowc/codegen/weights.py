"""A weights file's layout, and its bytes streamed rather than joined.

A weights file is a 64-byte header (``FLOWCWT1``, then little-endian u64s: version 1, the
stored bytes, the CRC-32 of those bytes, the layout id, three zeros) followed by the stored
constants, each at its 256-aligned offset, zero-padded. The data is never held in memory
as one ``bytes``: a layout keeps, per stored constant, a function giving its array (the
constant itself, which may be a view over a memory-mapped model file, or one rank's shard,
sliced only when asked for), and ``chunks()`` yields the file's data piece by piece, so a
writer computes the CRC as a running value while it writes (``write_weights_file``).

A constant that is a view of a memory-mapped model file (``flowc.ir.mapped_files``) is copied
into the weights file by the kernel (``os.copy_file_range``), from the file to the file,
without the writer paging the mapping in and copying it through user space; the CRC is
still computed over the mapped bytes themselves, in the CRC thread.
"""

from __future__ import annotations

import os
import queue
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO

import numpy as np

from flowc.ir.graph import Value
from flowc.ir.mapped_files import file_source

WEIGHTS_MAGIC = b"FLOWCWT1"
HEADER_BYTES = 64
# Where the CRC sits in the header: after the magic, the version and the stored bytes.
_CRC_AT = len(WEIGHTS_MAGIC) + 16
_ZEROS = bytes(256)
# Pieces the writer and the CRC thread share (a large tensor is split so the two overlap).
_PIECE = 8 << 20


@dataclass
class WeightsLayout:
    offsets: dict[Value, int]
    stored_bytes: int  # bytes in the weights file
    device_bytes: int  # stored bytes plus space for fills
    # Names, types and offsets (and for one rank of a mesh: the rank, the mesh and the shard
    # layouts): a file for this layout fits any build of it, and no other rank's.
    layout_id: int
    # (offset, the constant's data) per stored constant, by offset: read when written.
    parts: list[tuple[int, Callable[[], np.ndarray]]] = field(default_factory=list)

    def chunks(self) -> Iterator[memoryview]:
        """The stored bytes in order, padding included, without copying a contiguous array."""
        for raw, _ in self.sourced_chunks():
            yield raw

    def sourced_chunks(self) -> Iterator[tuple[memoryview, tuple[int, int] | None]]:
        """``chunks()``, each with where its bytes lie in a mapped model file (descriptor,
        offset), when they do."""
        pos = 0
        for offset, data_of in self.parts:
            if offset < pos:
                raise ValueError(f"weights data at offset {offset} overlaps the previous constant")
            if offset > pos:
                yield memoryview(_ZEROS)[: offset - pos], None
            a = data_of()
            source = file_source(a)
            raw = _as_bytes(a)
            yield raw, source
            pos = offset + raw.nbytes
        if self.stored_bytes > pos:
            yield memoryview(_ZEROS)[: self.stored_bytes - pos], None

    @property
    def crc(self) -> int:
        """CRC-32 of the stored bytes (computed on each call: a running value over chunks)."""
        crc = 0
        for c in self.chunks():
            crc = zlib.crc32(c, crc)
        return crc

    @property
    def data(self) -> bytes:
        """The stored bytes joined (for small layouts and tests; writers use ``chunks``)."""
        return b"".join(self.chunks())


def _as_bytes(a: np.ndarray) -> memoryview:
    """A C-contiguous view of ``a``'s bytes, as ``a.tobytes()`` would give them (a copy only
    when ``a`` is not C-contiguous, e.g. a column shard)."""
    a = np.ascontiguousarray(a)
    if a.dtype.hasobject:
        return memoryview(a.tobytes())
    return a.reshape(-1).view(np.uint8).data


def header(layout: WeightsLayout, crc: int) -> bytes:
    fields = [1, layout.stored_bytes, crc, layout.layout_id, 0, 0, 0]
    return WEIGHTS_MAGIC + np.array(fields, "<u8").tobytes()


def write_weights_file(f: IO[bytes], layout: WeightsLayout) -> int:
    """Write the weights file for ``layout`` into ``f`` (open for writing and seekable, at
    position 0): the header with a CRC of 0, the data, then the CRC into the header.
    Returns the CRC. The CRC runs in a second thread over the same pieces while this one
    writes them (zlib and file writes release the GIL), so the two overlap; a bounded queue
    keeps at most a few pieces alive at once."""
    f.write(header(layout, 0))
    pieces: queue.Queue[memoryview | None] = queue.Queue(maxsize=4)
    crc = 0

    def run_crc() -> None:
        nonlocal crc
        while (piece := pieces.get()) is not None:
            crc = zlib.crc32(piece, crc)

    worker = threading.Thread(target=run_crc, name="flowc-weights-crc", daemon=True)
    worker.start()
    written = 0
    out = _out_fd(f)
    copy_ok = out is not None
    try:
        for chunk, source in layout.sourced_chunks():
            for at in range(0, chunk.nbytes, _PIECE):
                piece = chunk[at : at + _PIECE]
                pieces.put(piece)
                if copy_ok and out is not None and source is not None:
                    copy_ok = _copy_range(source[0], source[1] + at, out, piece.nbytes)
                    if copy_ok:
                        written += piece.nbytes
                        continue
                    # Back to the piece's start: what was copied of it is written again.
                    os.lseek(out, HEADER_BYTES + written, os.SEEK_SET)
                if out is not None:
                    _write_all(out, piece)
                else:
                    f.write(piece)
                written += piece.nbytes
    finally:
        pieces.put(None)
        worker.join()
    if written != layout.stored_bytes:  # a constant's data changed size after the layout
        raise ValueError(f"weights data is {written} bytes, the layout says {layout.stored_bytes}")
    f.seek(_CRC_AT)
    f.write(np.array([crc], "<u8").tobytes())
    f.seek(0, os.SEEK_END)
    return crc


def _out_fd(f: IO[bytes]) -> int | None:
    """The descriptor to write ``f`` through (flushed, at its position), or None when ``f`` is
    no file (a BytesIO)."""
    try:
        fd = f.fileno()
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        return None
    f.flush()
    os.lseek(fd, f.tell(), os.SEEK_SET)
    return fd


def _write_all(fd: int, data: memoryview) -> None:
    while data.nbytes:
        data = data[os.write(fd, data) :]


def _copy_range(src: int, offset: int, out: int, count: int) -> bool:
    """Copy ``count`` bytes of ``src`` from ``offset`` to ``out`` at its position, in the
    kernel. False (having copied some or none; ``out``'s position is then unknown) where the
    kernel or the file systems do not support it: the caller writes instead."""
    copy = getattr(os, "copy_file_range", None)
    if copy is None:
        return False
    while count:
        try:
            n = copy(src, out, count, offset)
        except OSError:
            return False
        if n <= 0:  # the source file shrank under the mapping
            return False
        count -= n
        offset += n
    return True


def same_file_bytes(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two files hold the same bytes, read a block at a time."""
    if os.path.getsize(a) != os.path.getsize(b):
        return False
    block = 1 << 20
    with open(a, "rb") as fa, open(b, "rb") as fb:
        # The first block holds the header: a different CRC or layout id stops there.
        while True:
            x = fa.read(block)
            if x != fb.read(block):
                return False
            if not x:
                return True
