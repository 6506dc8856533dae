"""stdout while a command runs: a write that fails (``flowc ops > /dev/full``, a closed
pipe) is the output's fault, reported as an OutputError, not as an internal error."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from flowc.errors import OutputError


class BrokenPipe(OutputError):
    """Whoever read stdout stopped (``flowc ops | head -1``): nothing to say about it."""

    exit_code = 1


class _Guarded:
    """A text stream writing through ``stream``; an OSError on write or flush becomes an
    OutputError, and the first one is kept: a caller that catches it and goes on (click
    probes its streams) cannot hide it."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.error: OutputError | None = None

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            raise self._failed(e) from None

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            raise self._failed(e) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _failed(self, e: OSError) -> OutputError:
        if self.error is None:
            self.error = (
                BrokenPipe("stdout was closed")
                if e.errno == errno.EPIPE
                else OutputError(
                    f"cannot write the output to stdout: {e.strerror or e}",
                    hint="send it to a file or device with room for it",
                )
            )
        return self.error


def _silence(stream: TextIO) -> None:
    """Point the stream's file at /dev/null: the interpreter's last flush of what is still
    buffered cannot fail again (with a second message and exit status 120)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


@contextlib.contextmanager
def guarded_stdout() -> Iterator[None]:
    """Within: sys.stdout raises OutputError for a failed write; what is still buffered is
    written at the end, so a failure shows here and not at the interpreter's exit."""
    real = sys.stdout
    guarded = _Guarded(real)
    sys.stdout = guarded
    try:
        yield
        guarded.flush()
        if guarded.error is not None:
            raise guarded.error
    finally:
        sys.stdout = real
        if guarded.error is None:
            try:
                real.flush()  # on the way out of another error: what is left goes or not
            except OSError:
                _silence(real)
        else:
            _silence(real)
