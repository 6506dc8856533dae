"""The `flowc` command (flowc/cli/app.py): the click group and main()."""

from flowc.cli.app import VERIFY_TOLERANCE, cli, load, main

__all__ = ["VERIFY_TOLERANCE", "cli", "load", "main"]
