"""The one writer for every file flowc outputs (eval/run -o, convert -o, inspect --gantt and
--report, plan-memory --offsets, the conformance lists): it replaces only what it may.

What stands at the output path decides how it is written:

- nothing, or a regular file: a temporary file beside it, synced, then renamed over it, so a
  reader never sees half of it and a failed write leaves the old file as it was (a replaced
  file keeps its permission bits; a new one gets the umask's);
- a character device or a FIFO (``-o /dev/null``, ``-o >(gzip > x)``): written through, never
  replaced. A FIFO is opened without blocking, so one with no reader is an error, not a hang;
- a symbolic link: followed to its final target, which the two rules above then apply to (a
  link to a regular file keeps being a link; the file it names is replaced);
- a directory, a socket or a block device: refused, nothing written.

Replacing a device node with a regular file is what made ``-o /dev/null`` as root destroy
the machine's /dev/null; that is why nothing here ever renames over anything but a regular
file. (The files of a compiled project are written by codegen/project.py, which stages and
swaps a whole folder; it uses ``classify`` to apply the same rules to what it finds there.)

atomic_write() is the implementation: a context manager yielding a binary file, for writers
that stream (a zip archive member by member); write_file_atomic() writes bytes already in
memory through it; check_output() refuses, before any work, a path it would refuse later.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import io
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

from flowc.errors import FlowcError

# How an OSError becomes the error the user sees; the default names the file.
ErrorFactory = Callable[[OSError], Exception]


class OutputError(FlowcError):
    """An output path that flowc will not write (a directory, a socket, a FIFO nobody
    reads...): the message says what stands there and what to do."""


class Kind(enum.Enum):
    """How an output path is written."""

    NEW = "new"  # nothing there yet: created through a temporary file
    REGULAR = "regular"  # a regular file: replaced through a temporary file
    STREAM = "stream"  # a character device or FIFO: written through


@dataclass(frozen=True)
class Target:
    """Where the bytes of an output go: ``path`` with symbolic links resolved."""

    path: Path
    kind: Kind
    mode: int | None = None  # a replaced regular file's permission bits


_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """What a path is, for messages ("a FIFO (named pipe)"), from its ``st_mode``."""
    return next((k for test, k in _KINDS if test(mode)), "not a regular file")


def classify(path: Path | str, what: str | None = None) -> Target:
    """What writing an output at ``path`` means (see the module docstring); raises
    OutputError for a path no output may be written to. ``what`` names the option in
    messages (``-o``, ``--offsets``); by default the path alone is named."""
    given = Path(path)
    label = f"{what} {given}" if what else str(given)
    real = Path(os.path.realpath(given))
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        if not real.parent.is_dir():
            raise OutputError(
                f"{label}: folder {real.parent} does not exist",
                hint="create the folder first, or choose another path",
            ) from None
        return Target(real, Kind.NEW)
    except OSError as e:
        raise OutputError(f"{label}: cannot inspect it ({e.strerror or e})") from None
    if stat.S_ISLNK(st.st_mode):  # realpath stops at a loop
        raise OutputError(
            f"{label}: a loop of symbolic links", hint="remove the link, or choose another path"
        )
    if stat.S_ISREG(st.st_mode):
        return Target(real, Kind.REGULAR, stat.S_IMODE(st.st_mode))
    if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode):
        return Target(real, Kind.STREAM)
    shown = label if real == given.absolute() else f"{label} (-> {real})"
    raise OutputError(
        f"{shown}: {file_kind(st.st_mode)}; flowc writes an output to a regular file, a character "
        "device or a FIFO only",
        hint="choose a file path",
    )


def check_output(path: Path | str, what: str | None = None) -> Target:
    """``classify`` for a command to call before its work; also refuses a folder it cannot
    write into where a file is to be created or replaced."""
    target = classify(path, what)
    if target.kind is not Kind.STREAM and not os.access(target.path.parent, os.W_OK | os.X_OK):
        label = f"{what} {path}" if what else str(path)
        raise OutputError(
            f"{label}: folder {target.path.parent} is not writable",
            hint="choose a folder you can write to",
        )
    return target


class _WriteThrough(io.FileIO):
    """A character device or FIFO as a stream that cannot seek, even where the kernel lets
    it (/dev/null does, and always answers 0): writers that seek back to patch what they
    wrote (a zip archive's offsets) then write a form that needs no seeking."""

    def seekable(self) -> bool:
        return False

    def seek(self, pos: int, whence: int = 0) -> int:
        raise io.UnsupportedOperation("seek")

    def tell(self) -> int:
        raise io.UnsupportedOperation("tell")


def _open_stream(path: Path) -> int:
    """A write descriptor on a character device or FIFO, opened without blocking (a FIFO
    with no reader fails with ENXIO at once) and then set blocking for the writes."""
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not (stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
            # Swapped for something else since it was classified: write nothing.
            raise OSError(errno.EAGAIN, "the path changed while it was being opened")
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def atomic_write(
    path: Path,
    *,
    cannot_open: ErrorFactory | None = None,
    cannot_write: ErrorFactory | None = None,
) -> Iterator[BinaryIO]:
    """Yield a binary file that becomes ``path`` when the block ends without an exception
    (a regular file or a new one), or that writes through to it (a character device or a
    FIFO). A path no output may go to raises OutputError before anything is written.

    An OSError opening the output raises ``cannot_open(e)``, one while writing, syncing or
    renaming raises ``cannot_write(e)`` (both by default a FlowcError "cannot write PATH:
    reason"); any other exception propagates. Either way a temporary file is gone and a
    replaced file is untouched.
    """
    path = Path(path)

    def default(e: OSError) -> Exception:
        return FlowcError(f"cannot write {path}: {e.strerror or e}")

    target = classify(path)
    if target.kind is Kind.STREAM:
        try:
            fd = _open_stream(target.path)
        except OSError as e:
            if e.errno == errno.ENXIO:
                raise OutputError(
                    f"{path}: a FIFO that no process is reading",
                    hint="start the reader first, or choose a file path",
                ) from None
            raise (cannot_open or default)(e) from None
        try:
            with io.BufferedWriter(_WriteThrough(fd, "wb")) as stream:
                yield cast(BinaryIO, stream)
                stream.flush()
        except OSError as e:
            raise (cannot_write or default)(e) from None
        return

    final = target.path
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    except OSError as e:
        raise (cannot_open or default)(e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            # mkstemp's file is private (0600): the result keeps the replaced file's bits, or
            # gets a new file's usual permissions.
            if target.mode is not None:
                mode = target.mode
            else:
                mask = os.umask(0)
                os.umask(mask)
                mode = 0o666 & ~mask
            os.chmod(f.fileno(), mode)
            yield f
            f.flush()
            os.fsync(f.fileno())
        # Only a regular file (or nothing) is ever renamed over: check again just before,
        # so a node put there meanwhile is not destroyed.
        now = classify(path)
        if now.path != final or now.kind is Kind.STREAM:
            raise OutputError(f"{path}: changed while flowc was writing it; nothing written")
        os.replace(tmp, final)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise (cannot_write or default)(e) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` as atomic_write does; an OSError becomes a FlowcError
    naming it."""
    with atomic_write(path) as f:
        f.write(data)


@contextmanager
def restorable(path: Path) -> Iterator[None]:
    """Undo, when the block fails, what it did to the output at ``path``: a regular file
    there before gets its old bytes back (kept through a hard link, or a copy where the
    file system has none), a file the block created is removed. A character device or FIFO
    is left alone: what went through it cannot be taken back."""
    target = classify(path)
    backup: Path | None = None
    if target.kind is Kind.REGULAR:
        folder = target.path.parent
        backup = folder / f".{target.path.name}.{os.getpid()}.{secrets.token_hex(4)}.old"
        try:
            os.link(target.path, backup)
        except OSError:
            try:
                shutil.copy2(target.path, backup)
            except OSError as e:
                Path(backup).unlink(missing_ok=True)
                raise FlowcError(
                    f"cannot keep a copy of {path} to restore on failure: {e.strerror or e}"
                ) from None
    try:
        yield
    except BaseException:
        try:
            if backup is not None:
                os.replace(backup, target.path)
            elif target.kind is Kind.NEW:
                target.path.unlink(missing_ok=True)
        except OSError:
            pass  # the original error is the one to report
        raise
    if backup is not None:
        backup.unlink(missing_ok=True)
