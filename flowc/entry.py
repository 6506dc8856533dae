"""The `flowc` command's entry point: as light as a module can be, so that Ctrl-C while the
heavy modules (NumPy, ONNX, rich) are still importing ends quietly, as it does later."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from flowc.cli import main as cli_main
    except KeyboardInterrupt:
        sys.stderr.write("aborted\n")
        sys.exit(130)
    cli_main()
