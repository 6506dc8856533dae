"""The `flowc` command's entry point: as light as a module can be, so that Ctrl-C while the
heavy modules (NumPy, ONNX, rich) are still importing ends quietly, as it does later."""

from __future__ import annotations

import signal
import sys


def main() -> None:
    try:
        from flowc.cli import main as cli_main
    except KeyboardInterrupt:
        _quit_on_ctrl_c_no_more()
        sys.stderr.write("aborted\n")
        sys.exit(130)
    try:
        cli_main()
    finally:
        _quit_on_ctrl_c_no_more()


def _quit_on_ctrl_c_no_more() -> None:
    """The command is over (done, or leaving with its exit code): a Ctrl-C from here on has
    nothing left to stop, and would only end the interpreter's shutdown by SIGINT, turning
    the exit status into a kill."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
