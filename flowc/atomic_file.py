"""Writing a file so that a reader never sees half of it: a temporary file beside the
target, synced, then renamed over it. A failed write removes the temporary file and leaves
the old target as it was.

atomic_write() is the one implementation: a context manager yielding the temporary file, for
writers that stream (a zip archive member by member); write_file_atomic() writes bytes
already in memory through it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from flowc.errors import FlowcError

# How an OSError becomes the error the user sees; the default names the file.
ErrorFactory = Callable[[OSError], Exception]


@contextmanager
def atomic_write(
    path: Path,
    *,
    cannot_open: ErrorFactory | None = None,
    cannot_write: ErrorFactory | None = None,
) -> Iterator[BinaryIO]:
    """Yield a binary file that becomes ``path`` when the block ends without an exception.

    An OSError creating the temporary file raises ``cannot_open(e)``, one while writing,
    syncing or renaming raises ``cannot_write(e)`` (both by default a FlowcError "cannot
    write PATH: reason"); any other exception propagates. Either way the temporary file is
    gone and ``path`` is untouched.
    """
    path = Path(path)

    def default(e: OSError) -> Exception:
        return FlowcError(f"cannot write {path}: {e.strerror or e}")

    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise (cannot_open or default)(e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            # mkstemp's file is private (0600); the result gets a new file's usual permissions.
            mask = os.umask(0)
            os.umask(mask)
            os.chmod(f.fileno(), 0o666 & ~mask)
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise (cannot_write or default)(e) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically; an OSError becomes a FlowcError naming it."""
    with atomic_write(path) as f:
        f.write(data)
