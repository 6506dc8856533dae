"""The `flowc` command: the click group, its commands (one module each in flowc/cli/) and
main(), which turns errors into messages.

Errors in the user's input print as ``error: ...`` (with a hint) on stderr and exit with
code 2, without a traceback. Set FLOWC_DEBUG=1 to see the traceback of an internal error.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

import click
from rich.markup import escape

from flowc.cli.build import build_cmd
from flowc.cli.common import err
from flowc.cli.compile import compile_cmd
from flowc.cli.conformance import conformance
from flowc.cli.convert import convert_cmd
from flowc.cli.eval import eval_cmd
from flowc.cli.inspect import inspect
from flowc.cli.ops import ops
from flowc.cli.plan_memory import plan_memory_cmd
from flowc.cli.run import run_cmd
from flowc.cli.stdout import BrokenPipe, guarded_stdout
from flowc.cli.train import train_cmd
from flowc.cli.verify import verify
from flowc.errors import FlowcError, FlowcWarning
from flowc.version import __version__


def _print_cmake_dir(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from flowc.resources import cmake_dir

    click.echo(str(cmake_dir()))
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flowc")
@click.option(
    "--cmake-dir",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_cmake_dir,
    help="Print the folder of flowc's CMake package (CMake's flowc_DIR, for "
    "find_package(flowc): docs/cmake.md) and exit.",
)
def cli() -> None:
    """flowc: compile deep-learning graphs, ONNX models and .flow DSL programs, ahead of
    time into standalone CUDA C++ projects (with a host build of the same sources)."""


COMMANDS = (
    build_cmd,
    compile_cmd,
    conformance,
    convert_cmd,
    eval_cmd,
    inspect,
    ops,
    plan_memory_cmd,
    run_cmd,
    train_cmd,
    verify,
)
for _command in COMMANDS:
    cli.add_command(_command)


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    if issubclass(category, FlowcWarning):
        err.print(f"[bold yellow]warning:[/] {escape(str(message))}")
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


_default_showwarning = warnings.showwarning


def main(argv: Sequence[str] | None = None) -> None:
    warnings.showwarning = _show_warning
    # Each warning says what was done to the user's files or results: never deduplicated.
    warnings.simplefilter("always", FlowcWarning)
    try:
        with guarded_stdout():
            cli.main(
                args=list(argv) if argv is not None else None,
                prog_name="flowc",
                standalone_mode=False,
            )
    except BrokenPipe as e:
        sys.exit(e.exit_code)  # the reader has all it wanted (`flowc ops | head`)
    except FlowcError as e:
        err.print(f"[bold red]error:[/] {escape(e.message)}")
        if e.hint:
            err.print(f"  hint: {e.hint}", markup=False)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        err.print("interrupted")
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except Exception as e:
        if os.environ.get("FLOWC_DEBUG"):
            traceback.print_exc()
        err.print(f"[bold red]internal error:[/] {type(e).__name__}: {escape(str(e))}")
        err.print(
            "  this is a bug in flowc; rerun with FLOWC_DEBUG=1 for the traceback", markup=False
        )
        sys.exit(70)
