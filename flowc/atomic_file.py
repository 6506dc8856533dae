"""Writing a file so that a reader never sees half of it: a temporary file beside the
target, synced, then renamed over it. A failed write removes the temporary file and leaves
the old target as it was.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from flowc.errors import FlowcError


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically; an OSError becomes a FlowcError naming it."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise FlowcError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        # mkstemp's file is private (0600); the result gets a new file's usual permissions.
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(fd, 0o666 & ~mask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise FlowcError(f"cannot write {path}: {e.strerror or e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
