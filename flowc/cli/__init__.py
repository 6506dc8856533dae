"""The `flowc` command: flowc/cli/app.py holds the click group and main(); each command is a
module of its own (compile.py, inspect.py, ...), the options they share are options.py, and
what else they share (consoles, --input, OUT.npz, the target) is common.py.

Nothing else in flowc imports this package: the commands are the top layer.
"""

from flowc.cli.app import cli, main

__all__ = ["cli", "main"]
