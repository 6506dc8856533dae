"""Input files must be regular files.

A FIFO given as a model blocks the read forever; a symlink to /dev/zero or a character
device reads until memory runs out. onnx refuses external data files that are not regular
(after resolving links); flowc applies the same rule to everything it reads: .onnx and
.flow models, --weights files and --input arrays.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from flowc.atomic_file import file_kind
from flowc.errors import FlowcError, ModelLoadError


def check_regular_file(
    path: str | os.PathLike[str], what: str, error: type[FlowcError] = ModelLoadError
) -> Path:
    """``path`` if it names a regular file (following symlinks), else ``error`` saying what
    it is instead. Never opens it, so a FIFO cannot block."""
    p = Path(path)
    try:
        st = os.stat(p)  # follows symlinks, as opening would
    except FileNotFoundError:
        raise error(f"{what} {p}: no such file") from None
    except OSError as e:  # a name too long, a loop of links, no permission on a directory
        raise error(f"{what} {p}: cannot read it ({e.strerror or e})") from None
    if stat.S_ISREG(st.st_mode):
        return p
    kind = file_kind(st.st_mode)
    target = ""
    if p.is_symlink():
        target = f" (a link to {os.path.realpath(p)})"
    raise error(
        f"{what} {p}{target} is {kind}, not a regular file",
        hint="give the path of a file on disk",
    )
