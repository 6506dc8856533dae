"""The `flowc` command's entry point: as light as a module can be, so that Ctrl-C while the
heavy modules (NumPy, ONNX, rich) are still importing ends quietly, as it does later."""

from __future__ import annotations

import os
import signal


def guard_start_up() -> None:
    """Until the command starts, Ctrl-C ends the process at once with "interrupted" and exit
    code 130. Nothing has been done yet, so there is nothing to clean up, and Python's own
    KeyboardInterrupt cannot be trusted this early: raised inside an import lock's weakref
    callback it is printed and swallowed (the command then runs on), and raised while an
    extension module runs code through PyRun_String CPython marks it unhandled, so the
    process ends killed by SIGINT (-2) whatever catches it."""
    signal.signal(signal.SIGINT, _abort_start_up)


def _abort_start_up(signum: int, frame: object) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.write(2, b"interrupted\n")
    os._exit(130)


def main() -> None:
    guard_start_up()
    from flowc.cli import main as cli_main

    # The command runs: Ctrl-C is a KeyboardInterrupt again, which it handles (cleanup,
    # "interrupted", 130); so is SIGTERM (a build system stopping flowc), which must end
    # the compilers flowc started as well.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        cli_main()
    except SystemExit as e:
        if e.code == 130:
            _exit_interrupted()
        raise
    finally:
        _quit_on_ctrl_c_no_more()


def _exit_interrupted() -> None:
    """The command was interrupted and has cleaned up (its with-blocks and handlers ran as
    the KeyboardInterrupt unwound them): leave with 130 now. Through the interpreter's normal
    exit, a KeyboardInterrupt that met an extension's PyRun_String on its way (a lazy import
    of NumPy or ONNX when Ctrl-C came) would make CPython end the process by SIGINT instead,
    whatever caught it."""
    import contextlib
    import sys

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(130)


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _quit_on_ctrl_c_no_more() -> None:
    """The command is over (done, or leaving with its exit code): a Ctrl-C from here on has
    nothing left to stop, and would only end the interpreter's shutdown by SIGINT, turning
    the exit status into a kill."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
