"""`flowc convert`: MODEL as a DSL program and its weights file."""

from __future__ import annotations

import contextlib
from pathlib import Path

import click
import numpy as np
from rich.markup import escape

from flowc.atomic_file import atomic_write, check_output, restorable
from flowc.cli.common import out, write_npz_atomic
from flowc.cli.loading import load_model
from flowc.cli.options import ModelArgs, model_options, output_option
from flowc.errors import InputError


@click.command(
    name="convert", short_help="Write MODEL as a .flow DSL program and its weights file."
)
@model_options
@output_option("output", "OUT.flow; the weights go beside it as OUT.weights.npz.", required=True)
def convert_cmd(model: ModelArgs, output: Path) -> None:
    """Write MODEL as a DSL program (OUT.flow) and its weights (OUT.weights.npz), which the
    program loads by a path relative to itself."""
    from flowc.ir.graph import is_splat
    from flowc.ir.printer import INLINE_MAX, print_graph

    output = output.absolute()
    if output.suffix != ".flow":
        raise InputError(f"-o {output}: the program's file name must end in .flow")
    check_output(output, "-o")
    graph = load_model(model)
    stored: dict[str, np.ndarray] = {
        c.name: c.const
        for c in graph.constants
        if c.const is not None and not is_splat(c.const) and c.const.size > INLINE_MAX
    }
    weights = output.with_name(output.stem + ".weights.npz")
    text = print_graph(graph, weights=weights.name if stored else None)
    # Both files are written whole before either replaces anything, the weights renamed
    # into place first (the program never names a file that is not there yet); should the
    # program then fail, the weights file they replaced comes back.
    with (
        restorable(weights) if stored else contextlib.nullcontext(),
        atomic_write(output) as program,
    ):
        program.write(text.encode("utf-8"))
        if stored:
            write_npz_atomic(weights, stored)
    out.print(
        f"wrote {escape(str(output))} ({len(graph.nodes)} nodes)"
        + (f" and {escape(weights.name)} ({len(stored)} arrays)" if stored else "")
    )
