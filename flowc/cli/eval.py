"""`flowc eval`: run MODEL in flowc's NumPy reference (or, on a mesh, every rank of the
parallel program in the multi-rank simulator) and write its outputs."""

from __future__ import annotations

from pathlib import Path

import click
import numpy as np
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flowc.cli.common import (
    check_output_path,
    err,
    out,
    progress,
    read_graph_inputs,
    write_npz_atomic,
)
from flowc.cli.loading import load_model, load_parallel, parallel_settings
from flowc.cli.options import (
    ModelArgs,
    ParallelArgs,
    input_option,
    model_options,
    output_option,
    parallel_options,
    seed_option,
)
from flowc.errors import InputError


@click.command(name="eval", short_help="Evaluate MODEL with flowc's NumPy reference into OUT.npz.")
@model_options
@input_option()
@click.option(
    "--random-inputs", is_flag=True, help="Fill inputs not given with seeded random data."
)
@seed_option("Seed for --random-inputs.")
@output_option("output", "OUT.npz, keyed by output name.", required=True)
@parallel_options
def eval_cmd(
    model: ModelArgs,
    inputs: tuple[str, ...],
    random_inputs: bool,
    seed: int,
    output: Path,
    parallel: ParallelArgs,
) -> None:
    """Evaluate MODEL with flowc's NumPy reference; write the outputs to OUT.npz. With
    --mesh, every rank of the parallel program runs in the multi-rank simulator."""
    from flowc.interpreter import evaluate

    output = check_output_path(output)
    if parallel.pipeline is not None:
        raise InputError(
            "--pipeline: flowc eval does not simulate pipeline stages",
            hint="leave out --pipeline (the stages compute the same outputs), or build and "
            "run the pipeline with flowc verify --pipeline P",
        )
    popts = parallel_settings(model, parallel)
    random_seed = seed if random_inputs else None
    if popts is not None:
        from flowc.compiler import simulate_ranks
        from flowc.interpreter import check_feeds

        graph, result = load_parallel(model, popts)
        checked = check_feeds(graph, read_graph_inputs(inputs, graph, random_seed))
        progress(f"simulating {popts.mesh.size} ranks")
        outs = simulate_ranks(result, checked)
        results = {v.name: a for v, a in zip(graph.outputs, outs, strict=True)}
        write_npz_atomic(output, results)
        out.print(f"wrote {output} (simulated on {popts.mesh.size} ranks)")
        return
    graph = load_model(model)
    feeds = read_graph_inputs(inputs, graph, random_seed)
    with Progress(
        TextColumn("evaluating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as bar:
        task = bar.add_task("eval", total=len(graph.nodes))
        results = evaluate(graph, feeds, on_node=lambda k, n: bar.update(task, completed=k))
    write_npz_atomic(output, results)
    table = Table(show_edge=False)
    for col in ("output", "shape", "dtype", "min", "max", "mean"):
        table.add_column(col)
    for name, a in results.items():
        num = a.dtype.kind in "biuf" and a.size > 0
        stats = (
            [f"{a.min():.6g}", f"{a.max():.6g}", f"{a.astype(np.float64).mean():.6g}"]
            if num
            else ["", "", ""]
        )
        table.add_row(escape(name), str(list(a.shape)), str(a.dtype), *stats)
    out.print(table)
    out.print(f"wrote {output}")
