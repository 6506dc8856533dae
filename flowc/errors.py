"""flowc's error types. Each carries a message that says what, where and what to do.

The CLI prints them without a traceback and exits with ``exit_code``.
"""

from __future__ import annotations


class FlowcError(Exception):
    """An error in the user's input or request, reported without a traceback."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class ModelLoadError(FlowcError):
    """The model file is missing, unreadable or not a valid model."""


class UnsupportedOpError(FlowcError):
    """The model uses ops flowc does not implement (all of them are listed)."""


class ShapeError(FlowcError):
    """Shape or type inference failed for a node."""


class InputError(FlowcError):
    """A user-supplied input (array, shape, dim) is missing or does not fit."""


class VerifyError(FlowcError):
    """The IR is malformed; raised by flowc.ir.verify.verify_graph."""

    exit_code = 1


class FlowcWarning(UserWarning):
    """Something flowc did on the user's behalf that changes results; printed as ``warning:``."""


class OutputError(FlowcError):
    """The command's output could not be written to stdout (a full disk, a device error):
    an I/O error, exit 74 (EX_IOERR), not a bug."""

    exit_code = 74
