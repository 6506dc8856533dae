"""The `flowc` command.

Errors in the user's input print as ``error: ...`` (with a hint) on stderr and exit with
code 2, without a traceback. Set FLOWC_DEBUG=1 to see the traceback of an internal error.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
import warnings
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click
import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flowc import __version__
from flowc.errors import FlowcError, FlowcWarning, InputError
from flowc.formatting import human_bytes, human_flops

F = TypeVar("F", bound=Callable[..., Any])

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


# -- option parsing ----------------------------------------------------------------------------


def parse_dims(text: str, what: str) -> tuple[int, ...]:
    parts = text.lower().replace(",", "x").split("x") if text else []
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        raise InputError(
            f"{what}: {text!r} is not a shape", hint="write dims as 1x3x224x224"
        ) from None
    if any(d < 0 for d in dims):
        raise InputError(f"{what}: {text!r} has a negative dimension")
    return dims


def parse_shapes(items: Sequence[str]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for item in items:
        name, sep, dims = item.rpartition("=")
        if not sep or not name:
            raise InputError(
                f"--shape {item!r}: expected NAME=DIMS", hint="e.g. --shape input=1x3x224x224"
            )
        shapes[name] = parse_dims(dims, f"--shape {name}")
    return shapes


def parse_dim_values(items: Sequence[str]) -> dict[str, int]:
    dims = {}
    for item in items:
        name, sep, value = item.rpartition("=")
        if not sep or not name:
            raise InputError(f"--dim {item!r}: expected SYMBOL=N", hint="e.g. --dim batch=1")
        try:
            dims[name] = int(value)
        except ValueError:
            raise InputError(f"--dim {item!r}: {value!r} is not an integer") from None
        if dims[name] < 1:
            raise InputError(f"--dim {item!r}: a dimension must be at least 1")
    return dims


# Pass-manager switches shared by every command that loads a model; set through click
# callbacks so each command's signature stays about its own options.
_pass_switches: dict[str, Any] = {
    "dump_after": (),
    "times": False,
    "weights": None,
    "search_nodes": None,
    "pipeline": None,
    "microbatches": 1,
    "stage_boundary": None,
}


def _remember(key: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def store(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        _pass_switches[key] = value

    return store


def model_options(fn: F) -> F:
    fn = click.option(
        "--weights",
        "model_weights",
        type=click.Path(dir_okay=False),
        default=None,
        expose_value=False,
        callback=_remember("weights"),
        help="Weights (.npz or .safetensors) for a .flow program's load(...) params.",
    )(fn)
    fn = click.option(
        "--dump-ir-after",
        multiple=True,
        metavar="PASS",
        expose_value=False,
        callback=_remember("dump_after"),
        help="Print the IR after this pass (to stderr); repeatable.",
    )(fn)
    fn = click.option(
        "--print-pass-times",
        is_flag=True,
        expose_value=False,
        callback=_remember("times"),
        help="Print how long each pass took (to stderr).",
    )(fn)
    fn = click.option(
        "--dim", "dims", multiple=True, metavar="SYMBOL=N", help="Value of a symbolic dimension."
    )(fn)
    fn = click.option(
        "--shape",
        "shapes",
        multiple=True,
        metavar="NAME=DIMS",
        help="Whole shape of an input, e.g. x=1x3x224x224.",
    )(fn)
    return click.argument("model", type=click.Path(dir_okay=False, path_type=Path))(fn)


def parse_bytes(text: str, what: str) -> int:
    """``1000000``, ``64MiB``, ``1.5GB``, ``512k`` -> bytes."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if m is None:
        raise InputError(f"{what} {text!r}: expected a byte count like 1000000, 64MiB or 1.5GB")
    scale = (1024 if m.group(3) else 1000) ** "_kmgt".index(m.group(2) or "_")
    return int(float(m.group(1)) * scale)


# flowc verify's default tolerance per --precision (max|got-ref| / max|ref| against the
# float32 reference): the error of the precision's rounding on the shared models, with room
# (docs/performance.md gives the measured figures).
VERIFY_TOLERANCE = {"fp32": 1e-4, "tf32": 1e-2, "fp16": 1e-2, "bf16": 5e-2}


def schedule_options(fn: F) -> F:
    fn = click.option(
        "--precision",
        type=click.Choice(["fp32", "tf32", "bf16", "fp16"]),
        default="fp32",
        show_default=True,
        help="fp32: exact float32 GEMMs and convolutions; tf32: those on tensor cores with "
        "TF32 inputs; bf16/fp16: weights and activations stored narrow, GEMMs and "
        "convolutions on tensor cores accumulating in float32, softmax, norms and "
        "reductions in float32 (inputs and outputs stay float32). docs/performance.md.",
    )(fn)
    fn = click.option(
        "--no-cuda-graph",
        is_flag=True,
        help="Launch the schedule's kernels directly in every run() instead of replaying one "
        "CUDA Graph of it (a mesh's programs always launch directly).",
    )(fn)
    fn = click.option(
        "--schedule-for",
        type=click.Choice(["latency", "memory"]),
        default="latency",
        show_default=True,
        help="latency: order and overlap the nodes for the modeled run time; memory: run them "
        "in the order of least peak memory (exact search where it is small enough), on one "
        "compute stream unless --streams asks for more. docs/memory.md.",
    )(fn)
    return click.option(
        "--streams",
        type=click.IntRange(min=1, max=32),
        default=None,
        metavar="N",
        help="Compute streams per device for independent branches (default: as many as the "
        "schedule's simulation finds worth their events, at most 4).",
    )(fn)


def parallel_options(fn: F) -> F:
    fn = click.option(
        "--stage-boundary",
        default=None,
        metavar="VALUE,...",
        expose_value=False,
        callback=_remember("stage_boundary"),
        help="With --pipeline P: the last value of each stage but the last (P-1 names), "
        "instead of the automatic partition.",
    )(fn)
    fn = click.option(
        "--microbatches",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        metavar="M",
        expose_value=False,
        callback=_remember("microbatches"),
        help="With --pipeline: split the batch (axis 0) into M micro-batches that stream "
        "through the stages.",
    )(fn)
    fn = click.option(
        "--pipeline",
        type=click.IntRange(min=1),
        default=None,
        metavar="P",
        expose_value=False,
        callback=_remember("pipeline"),
        help="Pipeline parallelism: P stages on mesh axis 0 (--mesh P: a device per stage; "
        "--mesh PxK: K per stage); the cuts come from --stage-boundary, the program's stage "
        "blocks, or the partition balancing the stages.",
    )(fn)
    fn = click.option(
        "--search-nodes",
        type=click.IntRange(min=0),
        default=None,
        metavar="N",
        expose_value=False,
        callback=_remember("search_nodes"),
        help="Branch-and-bound nodes the placement search may use (a work limit: the same "
        "plan on any machine; default 2000).",
    )(fn)
    fn = click.option(
        "--cost-profile",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Device and link rates for the search (TOML; default: H200 with NVLink).",
    )(fn)
    fn = click.option(
        "--mem-limit",
        default=None,
        metavar="BYTES",
        help="Per-device bytes for parameters + arena, e.g. 64MiB.",
    )(fn)
    fn = click.option(
        "--sbp",
        "sbps",
        multiple=True,
        metavar="NAME=SBP",
        help="Fix the layout of an input, parameter or value: x=S(0), w=(B,S(1)), x=S0.",
    )(fn)
    fn = click.option(
        "--parallel",
        type=click.Choice(["auto", "data", "none"]),
        default="auto",
        show_default=True,
        help="auto: searched; data: inputs split on batch, parameters whole; none: all whole.",
    )(fn)
    return click.option(
        "--mesh",
        default=None,
        metavar="N|AxB",
        help="Devices to run on: 4, or 2x4 for a 2-D mesh (one MPI rank per device).",
    )(fn)


def parallel_settings(
    model: Path,
    mesh: str | None,
    parallel: str,
    sbps: Sequence[str],
    mem_limit: str | None,
    cost_profile: Path | None,
) -> Any:
    """ParallelOptions from the command line and, for a .flow program, its own mesh and
    placements (its mesh when no --mesh is given; its placements are constraints like
    --sbp, which wins for the same value); None for a one-device program."""
    from flowc.parallel import ParallelOptions, parse_mesh, parse_sbp

    if _pass_switches["pipeline"] is not None:
        return pipeline_settings(model, mesh, parallel, sbps, mem_limit, cost_profile)
    alone = [
        o
        for o, given in (
            ("--microbatches", _pass_switches["microbatches"] != 1),
            ("--stage-boundary", _pass_switches["stage_boundary"] is not None),
        )
        if given
    ]
    if alone:
        raise InputError(f"{', '.join(alone)} need{'s' if len(alone) == 1 else ''} --pipeline P")
    m = parse_mesh(mesh) if mesh is not None else None
    program_mesh, placed = None, {}
    if model.suffix.lower() == ".flow":
        from flowc.frontend import ImportOptions, load_graph

        graph = load_graph(model, ImportOptions(weights=_pass_switches["weights"]))
        program_mesh = graph.mesh
        placed = {v.name: v.sbp for v in graph.values() if v.sbp is not None}
    if m is None:
        m = program_mesh
    if m is None:
        given = [o for o, v in (("--sbp", sbps), ("--mem-limit", mem_limit)) if v]
        if parallel != "auto":
            given.append("--parallel")
        if cost_profile is not None:
            given.append("--cost-profile")
        if _pass_switches["search_nodes"] is not None:
            given.append("--search-nodes")
        if given:
            raise InputError(
                f"{', '.join(given)} need{'s' if len(given) == 1 else ''} --mesh",
                hint="e.g. --mesh 4 or --mesh 2x2 (or a mesh declaration in the program)",
            )
        return None
    if placed and program_mesh is not None and program_mesh.shape != m.shape:
        shape = "x".join(map(str, program_mesh.shape))
        raise InputError(
            f"{model}: its placements are for mesh {shape}, but --mesh is "
            f"{'x'.join(map(str, m.shape))}",
            hint=f"use --mesh {shape}, or remove the program's @ annotations",
        )
    fixed = dict(parse_sbp(t, m) for t in sbps)
    if m.size == 1:
        # One device: every layout is whole; the program is the ordinary one.
        return None
    if parallel != "none":
        # `none` keeps every value whole: the program's placements do not apply.
        fixed = {**placed, **fixed}
    limit = parse_bytes(mem_limit, "--mem-limit") if mem_limit is not None else None
    return ParallelOptions(
        m, parallel, fixed, limit, cost_profile, node_limit=_pass_switches["search_nodes"]
    )


def pipeline_settings(
    model: Path,
    mesh: str | None,
    parallel: str,
    sbps: Sequence[str],
    mem_limit: str | None,
    cost_profile: Path | None,
) -> Any:
    """A PipelineSpec from --pipeline P [--mesh PxK] [--microbatches M] [--stage-boundary]."""
    import math

    from flowc.compiler import PipelineSpec, check_pipeline_mesh
    from flowc.ir.types import Mesh
    from flowc.parallel import ParallelOptions, parse_mesh
    from flowc.schedule.partition import parse_stage_boundaries

    stages = int(_pass_switches["pipeline"])
    if sbps:
        raise InputError(
            "--sbp is not supported with --pipeline yet",
            hint="leave the layouts to the search on each stage's devices",
        )
    if mesh is not None:
        m = parse_mesh(mesh)
    else:
        program_mesh = None
        if model.suffix.lower() == ".flow":
            from flowc.frontend import ImportOptions, load_graph

            program_mesh = load_graph(model, ImportOptions(weights=_pass_switches["weights"])).mesh
        m = program_mesh or Mesh("gpus", (stages,))
    text = _pass_switches["stage_boundary"]
    spec = PipelineSpec(
        stages,
        m,
        microbatches=int(_pass_switches["microbatches"]),
        boundaries=parse_stage_boundaries(text) if text is not None else None,
        mem_limit=parse_bytes(mem_limit, "--mem-limit") if mem_limit is not None else None,
    )
    check_pipeline_mesh(spec)
    if math.prod(m.shape[1:]) > 1:
        spec.stage_options = ParallelOptions(
            Mesh("stage", m.shape[1:]),
            parallel,
            {},
            None,
            cost_profile,
            node_limit=_pass_switches["search_nodes"],
        )
    elif cost_profile is not None:
        spec.stage_options = ParallelOptions(Mesh("stage", (1,)), "none", {}, None, cost_profile)
    return spec


def load_parallel(
    model: Path, shapes: Sequence[str], dims: Sequence[str], popts: Any, times: Any = None
) -> tuple[Any, Any]:
    """The logical graph and its parallelized form (plan, rank graph, cost, memory)."""
    from flowc.parallel import parallelize
    from flowc.passes.split_projections import split_projections

    graph = split_projections(load(model, shapes, dims, times=times))
    graph.verify()
    _progress(
        f"placing {len(graph.nodes)} nodes on mesh {'x'.join(map(str, popts.mesh.shape))} "
        f"({popts.method})"
    )
    t0 = time.perf_counter()
    result = (
        parallelize(graph, popts)
        if times is None
        else times.run("parallel placement", lambda: parallelize(graph, popts))
    )
    _progress(f"plan ready in {time.perf_counter() - t0:.2f} s")
    return graph, result


def load(
    model: Path,
    shapes: Sequence[str],
    dims: Sequence[str],
    *,
    for_compile: bool = False,
    times: Any = None,
    precision: str = "fp32",
) -> Any:
    """Import and run the passes. With ``times`` (a StageTimes), the import and each pass
    are added to it for the caller to print with the later stages; otherwise
    --print-pass-times prints them here."""
    from flowc.frontend import ImportOptions, load_graph
    from flowc.passes.manager import DEFAULT_PIPELINE, PassManager, compile_pipeline

    opts = ImportOptions(
        shapes=parse_shapes(shapes), dims=parse_dim_values(dims), weights=_pass_switches["weights"]
    )
    t0 = time.perf_counter()
    graph = load_graph(model, opts)
    import_seconds = time.perf_counter() - t0
    pm = PassManager(
        compile_pipeline(precision) if for_compile else DEFAULT_PIPELINE,
        dump_after=set(_pass_switches["dump_after"]),
    )
    graph = pm.run(graph)
    for name, text in pm.dumps:
        sys.stderr.write(f"# IR after {name}\n{text}")
    if times is not None:
        times.stages.append(("import", import_seconds))
        times.stages.extend((f"pass {name}", seconds) for name, seconds in pm.timings)
    elif _pass_switches["times"]:
        err.print(f"pass times: import {import_seconds * 1e3:.1f} ms", markup=False)
        for name, seconds in pm.timings:
            err.print(f"  {name}: {seconds * 1e3:.1f} ms", markup=False)
    return graph


# -- commands ----------------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flowc")
def cli() -> None:
    """flowc: compile deep-learning graphs (ONNX) ahead of time."""


@cli.command()
@model_options
@click.option(
    "--print-ir",
    is_flag=True,
    help="Write the IR (DSL text) to stdout; the summary goes to stderr.",
)
@click.option("--memory", is_flag=True, help="Plan memory: arena bytes, lower bound, naive sum.")
@click.option(
    "--schedule",
    "show_schedule",
    is_flag=True,
    help="Print the static schedule per rank: streams, firing order, events, modeled "
    "start/end, makespan and critical path.",
)
@click.option(
    "--gantt",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="OUT.png",
    help="Draw the modeled schedule as a Gantt chart (PNG); implies --schedule.",
)
@click.option(
    "--pipeline-schedule",
    type=click.Choice(["gpipe", "1f1b"]),
    default=None,
    help="With --pipeline and --schedule: simulate this micro-batch order on the stages' "
    "modeled forward times (1f1b adds backward actors at a synthetic 2x the forward time).",
)
@click.option(
    "--report",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    metavar="DIR",
    help="Write DIR/index.html: the graph (Graphviz dot), memory over time, the schedule's "
    "Gantt chart and these tables (with --memory's) on one self-contained page. "
    "docs/report.md.",
)
@schedule_options
@parallel_options
def inspect(
    model: Path,
    shapes: tuple[str, ...],
    dims: tuple[str, ...],
    print_ir: bool,
    memory: bool,
    show_schedule: bool,
    gantt: Path | None,
    streams: int | None,
    no_cuda_graph: bool,  # the schedule printed is the same either way
    precision: str,
    schedule_for: str,
    mesh: str | None,
    parallel: str,
    sbps: tuple[str, ...],
    mem_limit: str | None,
    cost_profile: Path | None,
    pipeline_schedule: str | None,
    report: Path | None,
) -> None:
    """Summarize MODEL: inputs, outputs, ops, parameter bytes, FLOPs; with --mesh, the
    parallel plan beside the data-parallel and all-broadcast ones; with --schedule, the
    static schedule the compiled program runs."""
    from flowc.ir.graph import is_splat
    from flowc.ops.registry import get_op

    show_schedule = show_schedule or gantt is not None
    if streams is not None and not show_schedule:
        raise InputError("--streams needs --schedule", hint="e.g. --schedule --streams 2")
    if gantt is not None and gantt.suffix.lower() != ".png":
        raise InputError(f"--gantt {gantt}: a Gantt chart is drawn as PNG", hint="give OUT.png")
    popts = parallel_settings(model, mesh, parallel, sbps, mem_limit, cost_profile)
    from flowc.compiler import PipelineSpec

    if pipeline_schedule is not None and not (isinstance(popts, PipelineSpec) and show_schedule):
        raise InputError(
            "--pipeline-schedule needs --pipeline P and --schedule",
            hint="e.g. --pipeline 4 --microbatches 8 --schedule --pipeline-schedule 1f1b",
        )
    if isinstance(popts, PipelineSpec) and schedule_for != "latency":
        raise InputError(
            "--schedule-for memory with --pipeline: a pipeline's stages are scheduled for "
            "latency only",
            hint="leave out --schedule-for, or inspect without --pipeline",
        )
    if report is not None:
        from flowc.report import check_target

        # Before the slow steps: a missing `dot` or a file in the way fails at once.
        check_target(report)
    if isinstance(popts, PipelineSpec) and report is not None:
        raise InputError(
            "--report with --pipeline is not supported yet",
            hint="inspect the model without --pipeline (a .flow program's stage blocks are "
            "marked in the report's graph)",
        )
    if isinstance(popts, PipelineSpec):
        _inspect_pipeline(
            model, shapes, dims, popts, show_schedule, pipeline_schedule or "gpipe", streams, gantt
        )
        return
    if popts is not None:
        logical, result, recorded = _inspect_plan(
            model, shapes, dims, popts, print_ir, record=report is not None
        )
        if show_schedule:
            _inspect_schedule(
                err if print_ir else out,
                result.physical.graph,
                streams,
                gantt,
                popts.mesh.shape,
                schedule_for,
            )
        if report is not None:
            _write_report(report, model, recorded, logical, result, popts, streams, schedule_for)
        return

    # With --memory or --schedule the graph is the one code generation uses: after fusion.
    memory = memory or report is not None
    compiled = memory or show_schedule
    graph = load(model, shapes, dims, for_compile=compiled, precision=precision)
    console = err if print_ir else out
    if report is not None:
        # The page shows what is printed here: record it (wide: tables are not squeezed).
        console = _recording(console)
    if print_ir:
        sys.stdout.write(str(graph))
        sys.stdout.flush()
    meta = graph.meta
    console.print(
        f"[bold]{escape(model.name)}[/]  graph {escape(repr(graph.name))}"
        + (f", {meta['format']} opset {meta['opset']}" if "opset" in meta else "")
        + (f", from {meta['producer']}" if meta.get("producer") else "")
    )
    io = Table(title="inputs and outputs", title_justify="left", show_edge=False)
    io.add_column("kind")
    io.add_column("name")
    io.add_column("type")
    for v in graph.inputs:
        io.add_row("input", escape(v.name), str(v.type))
    for v in graph.outputs:
        io.add_row("output", escape(v.name), str(v.type))
    console.print(io)
    from flowc.passes.manager import DEFAULT_PIPELINE, compile_pipeline

    # Say which passes ran: with --memory the table counts the compiled (fused) graph's nodes.
    passes = ", ".join(compile_pipeline(precision) if compiled else DEFAULT_PIPELINE)
    ops = Table(
        title=f"ops ({len(graph.nodes)} nodes after {passes})",
        title_justify="left",
        show_edge=False,
    )
    ops.add_column("op")
    ops.add_column("count", justify="right")
    ops.add_column("FLOPs", justify="right")
    flops_by_op: dict[str, int] = {}
    for n in graph.nodes:
        flops_by_op[n.op] = flops_by_op.get(n.op, 0) + get_op(n.op).count_flops(n)
    for op, count in graph.op_counts().items():
        ops.add_row(op, str(count), human_flops(flops_by_op[op]))
    console.print(ops)
    total = sum(c.type.nbytes for c in graph.constants)
    splat = sum(c.type.nbytes for c in graph.constants if c.const is not None and is_splat(c.const))
    console.print(
        f"parameters: {len(graph.constants)} tensors, {human_bytes(total)}"
        + (f" ({human_bytes(splat)} of them fills, not stored)" if splat else "")
    )
    console.print(f"estimated FLOPs: {human_flops(sum(flops_by_op.values()))} per run")
    if memory:
        from flowc.compiler import plan_schedule, schedule_graph

        sched = schedule_graph(graph, schedule_for=schedule_for)
        plan = plan_schedule(sched)
        console.print(
            f"memory plan: arena {plan.arena_bytes} B ({human_bytes(plan.arena_bytes)}), "
            f"lower bound {plan.lower_bound} B ({plan.arena_bytes / max(plan.lower_bound, 1):.3f}x), "
            f"naive sum {plan.naive_bytes} B; {len(plan.buffers)} buffers, "
            f"{plan.inplace} outputs written in place; {plan.concat_inplace} Concat inputs "
            f"written into their slice, {plan.views_inplace} Split/Slice outputs as views"
        )
        if plan.workspaces:
            streams_ = ", ".join(str(s) for s in sorted(plan.workspaces))
            console.print(
                f"  of which library workspaces: {len(plan.workspaces)} x "
                f"{human_bytes(plan.workspace_bytes)} (cuBLASLt/cuDNN scratch of stream(s) "
                f"{streams_}; the cost profile's [device] workspace)",
                markup=False,
            )
    if show_schedule:
        _inspect_schedule(console, graph, streams, gantt, None, schedule_for)
    if report is not None:
        _write_report(report, model, console, graph, None, None, streams, schedule_for, sched, plan)


def _recording(base: Console) -> Console:
    return Console(
        file=base.file,
        width=base.width if base.is_terminal else 160,
        highlight=False,
        soft_wrap=True,
        record=True,
    )


def _write_report(
    directory: Path,
    model: Path,
    console: Console,
    graph: Any,
    result: Any,
    popts: Any,
    streams: int | None,
    schedule_for: str,
    sched: Any = None,
    plan: Any = None,
) -> None:
    """--report DIR: the page of flowc.report, from what inspect computed and printed. On a
    mesh the logical graph is drawn with its layouts and collectives, and the memory plan
    and schedule are the rank program's (the arena the plan's memory line counts)."""
    from flowc.compiler import plan_schedule, schedule_graph
    from flowc.report import Report, rich_html, write_report

    sbp: dict[Any, Any] = {}
    collectives: dict[Any, list[str]] = {}
    ranks = 1
    notes: list[str] = []
    if result is not None:
        sbp = dict(result.plan.value_sbp)
        for v, who, st in result.cost.boxing:
            if not st.is_local:
                collectives.setdefault((v, who), []).append(st.collective)
        ranks = result.plan.mesh.size
        _progress("scheduling the rank program for the report")
        sched = schedule_graph(
            result.physical.graph, result.profile, popts.stream_count(), schedule_for
        )
        plan = plan_schedule(sched)
        notes.append(
            f"mesh {'x'.join(map(str, result.plan.mesh.shape))}: the graph is the logical one "
            "with each value's layout; memory and schedule are one rank's program."
        )
    page = Report(
        title=model.name,
        graph=graph,
        plan=plan,
        schedule=sched,
        tables_html=rich_html(console),
        sbp=sbp,
        collectives=collectives,
        ranks=ranks,
        notes=notes,
    )
    t0 = time.perf_counter()
    written = write_report(directory, page, progress=_progress)
    _progress(f"report written in {time.perf_counter() - t0:.2f} s")
    err.print(f"wrote {escape(str(written.path))}")


def _inspect_schedule(
    console: Console,
    graph: Any,
    streams: int | None,
    gantt: Path | None,
    mesh_shape: tuple[int, ...] | None,
    schedule_for: str = "latency",
) -> None:
    """Print the schedule the compiled program runs (one rank's: an SPMD mesh runs the same
    rank graph, so the same schedule, on every rank) and draw it with --gantt."""
    from flowc.compiler import schedule_graph

    sched = schedule_graph(graph, streams=streams, schedule_for=schedule_for)
    ag = sched.actors
    us = 1e6
    ranks = 1
    if mesh_shape is None:
        console.print("schedule of rank 0 (one device):", markup=False)
    else:
        for d in mesh_shape:
            ranks *= d
        console.print(
            f"schedule of rank 0 (mesh {'x'.join(map(str, mesh_shape))}: all {ranks} ranks "
            "run the same rank graph, so the same schedule; printed once):",
            markup=False,
        )

    def label(a: int) -> str:
        actor = ag.actors[a]
        return f"{a} {actor.name!r} ({actor.op}, {sched.stream_name(sched.stream_of[a])})"

    n_compute = sched.num_compute
    console.print(
        f"  {len(ag.actors)} actors on {sched.num_streams} stream(s) ({n_compute} compute"
        + (", 1 communication" if sched.num_streams > n_compute else "")
        + f"), {len(sched.events)} event(s), modeled makespan {sched.makespan_s * us:.3f} us"
        + (
            ""
            if streams is not None
            else " (stream count: the simulator's choice)"
            if schedule_for == "latency"
            else " (the order of least peak memory on one compute stream)"
        ),
        markup=False,
    )
    for s, order in enumerate(sched.streams):
        console.print(
            f"  stream {s} {sched.stream_name(s)}"
            + (" (the caller's stream)" if s == 0 else "")
            + f": {len(order)} actor(s) in firing order",
            markup=False,
        )
        console.print(
            f"    {'#':>4} {'actor':>5}  {'start_us':>10} {'end_us':>10}  name [op]  events",
            markup=False,
        )
        for k, a in enumerate(order):
            actor = ag.actors[a]
            marks = [f"wait e{e.id}" for e in sched.waits.get(a, [])]
            marks += [f"record e{e.id}" for e in sched.records.get(a, [])]
            console.print(
                f"    {k + 1:>4} {a:>5}  {sched.start_s[a] * us:>10.3f} {sched.end_s[a] * us:>10.3f}"
                f"  {actor.name} [{actor.op}]" + (f"  {', '.join(marks)}" if marks else ""),
                markup=False,
            )
    console.print(f"  events ({len(sched.events)}):", markup=False)
    for e in sched.events:
        console.print(
            f"    e{e.id} [{e.kind}]: recorded after {label(e.record_after)}, "
            f"waited for before {label(e.wait_before)}",
            markup=False,
        )
    path = sched.critical_path
    console.print(
        f"  critical path ({len(path)} actors, ending at "
        f"{(sched.end_s[path[-1]] if path else 0.0) * us:.3f} us):",
        markup=False,
    )
    for a in path:
        console.print(
            f"    {label(a)}  {sched.start_s[a] * us:.3f} .. {sched.end_s[a] * us:.3f} us",
            markup=False,
        )
    if gantt is not None:
        from flowc.schedule.gantt import draw_gantt

        data = {"version": 1, "ranks": [sched.to_json(rank=r) for r in range(ranks)]}
        draw_gantt(data, gantt, title=graph.name)
        console.print(f"  wrote {gantt}", markup=False)


def _inspect_pipeline(
    model: Path,
    shapes: Sequence[str],
    dims: Sequence[str],
    spec: Any,
    show_schedule: bool,
    order: str,
    streams: int | None,
    gantt: Path | None,
) -> None:
    """The stages of --pipeline P: the partition and, with --schedule, the micro-batch
    simulation of ``order`` over the stages' modeled times."""
    from flowc.compiler import StageTimes, build_pipeline, schedule_graph, schedule_pipeline
    from flowc.parallel.cost import load_profile
    from flowc.schedule.pipeline import Phase, gpipe, one_f_one_b, simulate

    graph = load(model, shapes, dims, for_compile=True)
    profile = load_profile(spec.stage_options.profile if spec.stage_options else None)
    pipe, part = build_pipeline(graph, spec, profile, StageTimes())
    out.print(
        f"[bold]{escape(model.name)}[/]: {spec.stages} pipeline stages on mesh "
        f"{'x'.join(map(str, spec.mesh.shape))} ({pipe.ranks_per_stage} device(s) per stage), "
        f"{spec.microbatches} micro-batch(es)"
    )
    out.print(escape(part.summary()), markup=False)
    if pipe.placements:
        out.print(escape(pipe.placement_summary()), markup=False)
    if not show_schedule:
        return
    scheds = [schedule_graph(s.graph, profile, streams) for s in pipe.stages]
    forward = [s.makespan_s for s in scheds]
    m = spec.microbatches
    if order == "1f1b":
        # Inference graphs have no backward: 1F1B is simulated on a synthetic backward of
        # twice the forward, as a training step's would roughly be.
        run = simulate(one_f_one_b(spec.stages, m), m, forward, [2 * f for f in forward])
    else:
        run = simulate(gpipe(spec.stages, m), m, forward)
    out.print(
        f"{order} over {m} micro-batch(es): makespan {run.makespan * 1e6:.3f} us, bubble "
        f"{run.bubble:.3f} (the ideal for equal stages: "
        f"{(spec.stages - 1) / (m + spec.stages - 1):.3f})",
        markup=False,
    )
    for s, firings in enumerate(run.firings):
        text = " ".join(f"{'F' if f.phase == Phase.F else 'B'}{f.microbatch}" for f in firings)
        out.print(
            f"  stage {s}: forward {forward[s] * 1e6:.3f} us per micro-batch, busy "
            f"{run.busy_s[s] * 1e6:.3f} us, at most {run.max_in_flight[s]} micro-batch(es) in "
            f"flight; order {text}",
            markup=False,
        )
    # What the generated program runs: each stage's micro-batches unrolled, the cuts
    # double-buffered, receives waiting for the sender's modeled sends.
    _, programs = schedule_pipeline(pipe, profile, streams)
    span = max(p.makespan_s for p in programs)
    out.print(
        f"the program's schedule (micro-batches unrolled per stage): makespan "
        f"{span * 1e6:.3f} us; stages end at "
        + ", ".join(f"{p.makespan_s * 1e6:.3f}" for p in programs)
        + " us",
        markup=False,
    )
    if gantt is None:
        return
    from flowc.schedule.gantt import draw_gantt

    if order == "gpipe":
        timeline = {
            "version": 1,
            "ranks": [
                p.to_json(rank=s * pipe.ranks_per_stage, stage=s) for s, p in enumerate(programs)
            ],
        }
    else:
        timeline = {
            "version": 1,
            "ranks": [
                {
                    "rank": s * pipe.ranks_per_stage,
                    "stage": s,
                    "makespan_us": run.makespan * 1e6,
                    "critical_path": [],
                    "streams": [{"id": 0, "name": "stage", "actors": list(range(len(fs)))}],
                    "actors": [
                        {
                            "id": k,
                            "name": f"{'F' if f.phase == Phase.F else 'B'}{f.microbatch}",
                            "op": f.phase.name,
                            "kind": "node",
                            "stream": 0,
                            "stage": s,
                            "microbatch": f.microbatch,
                            "start_us": f.start * 1e6,
                            "end_us": f.end * 1e6,
                        }
                        for k, f in enumerate(fs)
                    ],
                    "events": [],
                }
                for s, fs in enumerate(run.firings)
            ],
        }
    path = draw_gantt(
        timeline,
        gantt,
        color_by="microbatch",
        title=f"{model.stem}: {spec.stages} stages, {m} micro-batches, {order}",
    )
    out.print(f"wrote {path}", markup=False)


def _inspect_plan(
    model: Path,
    shapes: Sequence[str],
    dims: Sequence[str],
    popts: Any,
    print_ir: bool,
    record: bool = False,
) -> tuple[Any, Any, Console]:
    import dataclasses

    from flowc.parallel import parallelize
    from flowc.parallel.report import Summary, print_plan, summarize

    graph, result = load_parallel(model, shapes, dims, popts)
    if print_ir:
        sys.stdout.write(str(result.physical.graph))
        sys.stdout.flush()
    others: list[tuple[str, Summary | str]] = []
    for method in ("data", "none"):
        if method == popts.method:
            continue
        try:
            # The all-B baseline has no constraints; data keeps the given layouts.
            sbp = {} if method == "none" else popts.sbp
            alt = parallelize(
                graph, dataclasses.replace(popts, method=method, mem_limit=None, sbp=sbp)
            )
            others.append((method, summarize(alt)))
        except FlowcError as e:
            others.append((method, f"not possible: {e.message}"))
    base = err if print_ir else out
    # Plans are wide tables: do not squeeze them to 80 columns when piped.
    console = (
        _recording(base)
        if record
        else base
        if base.is_terminal
        else Console(file=base.file, width=160, highlight=False, soft_wrap=True)
    )
    console.print(f"[bold]{escape(model.name)}[/]  graph {escape(repr(graph.name))}")
    print_plan(console, graph, result, others, popts.mem_limit)
    return graph, result, console


def _split_input(item: str, names: Sequence[str]) -> tuple[str, str]:
    # Names may contain '=', paths too: take the split whose left side names an input.
    for i, ch in enumerate(item):
        if ch == "=" and item[:i] in names:
            return item[:i], item[i + 1 :]
    name, sep, _ = item.partition("=")
    if not sep:
        raise InputError(f"--input {item!r}: expected NAME=PATH.npy")
    raise InputError(
        f"--input {item!r}: the model has no input named {name!r}",
        hint="its inputs are: " + ", ".join(map(repr, names)),
    )


def _read_npy(path: str, name: str) -> np.ndarray:
    from flowc.frontend.files import check_regular_file

    p = Path(path)
    if not p.exists():
        raise InputError(f"--input {name}: {p}: no such file")
    check_regular_file(p, f"--input {name}:", InputError)  # not a FIFO or /dev/zero
    try:
        a = np.load(p, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise InputError(f"--input {name}: {p} is not a readable .npy file ({e})") from None
    if not isinstance(a, np.ndarray):
        raise InputError(f"--input {name}: {p} holds several arrays; give one .npy per input")
    return a


def check_output_path(path: Path) -> Path:
    """Fail before any work when the output cannot be written."""
    path = path.resolve()
    if not path.name.endswith(".npz"):
        raise InputError(f"-o {path}: the output file must end in .npz")
    if not path.parent.is_dir():
        raise InputError(f"-o {path}: directory {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK) or path.is_dir():
        raise InputError(f"-o {path}: cannot write there")
    return path


def as_declared_type(name: str, a: np.ndarray, specs: Sequence[Any]) -> np.ndarray:
    """An input array read as its declared element type where NumPy could not say it: a
    bfloat16, float8 or int4 array saved by NumPy has no type descr of its own and comes
    back as raw bytes (``|V2``, ``|V1``); those are taken as the model's declared type
    when the item size matches. Every other array is returned unchanged."""
    from flowc.ir.dtype import DType

    if a.dtype.kind != "V" or a.dtype.fields is not None:
        return a
    spec = next((s for s in specs if str(s["name"]) == name), None)
    if spec is None:
        return a
    want = DType.from_short(str(spec["dtype"])).np
    if a.dtype.itemsize != want.itemsize:
        raise InputError(
            f"--input {name}: raw {a.dtype.itemsize}-byte items cannot be "
            f"{spec['dtype']} ({want.itemsize} byte(s) each)",
            hint=f"save the array as {spec['dtype']} (ml_dtypes.{want.name})",
        )
    return a.view(want)


def read_graph_inputs(items: Sequence[str], graph: Any) -> dict[str, np.ndarray]:
    """--input options for ``graph``'s inputs, raw-byte arrays taken as their declared types."""
    specs = [{"name": v.name, "dtype": v.type.dtype.short} for v in graph.inputs]
    feeds = read_inputs(items, [v.name for v in graph.inputs])
    return {k: as_declared_type(k, a, specs) for k, a in feeds.items()}


def read_inputs(items: Sequence[str], names: Sequence[str]) -> dict[str, np.ndarray]:
    """--input NAME=PATH.npy options as arrays by input name."""
    feeds = {}
    for item in items:
        name, path = _split_input(item, names)
        feeds[name] = _read_npy(path, name)
    return feeds


def _file_mode() -> int:
    """Permissions a new file gets under the process's umask (mkstemp makes them 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_npz_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """An .npz keyed by name, written to a temporary file beside ``path`` and then renamed, so
    there is never a half-written file. Written member by member (not np.savez(**arrays)) so
    any output name works as a key."""
    from flowc.harness import build

    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise InputError(f"-o {path}: cannot write there ({e.strerror})") from None
    try:
        with (
            os.fdopen(fd, "wb") as f,
            zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as z,
        ):
            for name, a in arrays.items():
                with z.open(f"{name}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(
                        member, build.raw_npy(np.asanyarray(a)), allow_pickle=False
                    )
        os.chmod(tmp, _file_mode())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise InputError(f"-o {path}: writing failed ({e.strerror or e})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@cli.command(name="eval")
@model_options
@click.option("--input", "inputs", multiple=True, metavar="NAME=PATH.npy", help="An input array.")
@click.option(
    "--random-inputs", is_flag=True, help="Fill inputs not given with seeded random data."
)
@click.option("--seed", default=0, show_default=True, help="Seed for --random-inputs.")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="OUT.npz, keyed by output name.",
)
@parallel_options
def eval_cmd(
    model: Path,
    shapes: tuple[str, ...],
    dims: tuple[str, ...],
    inputs: tuple[str, ...],
    random_inputs: bool,
    seed: int,
    output: Path,
    mesh: str | None,
    parallel: str,
    sbps: tuple[str, ...],
    mem_limit: str | None,
    cost_profile: Path | None,
) -> None:
    """Evaluate MODEL with flowc's NumPy reference; write the outputs to OUT.npz. With
    --mesh, every rank of the parallel program runs in the multi-rank simulator."""
    from flowc.interpreter import evaluate
    from flowc.interpreter import random_inputs as make_random

    output = check_output_path(output)
    popts = parallel_settings(model, mesh, parallel, sbps, mem_limit, cost_profile)
    if popts is not None:
        from flowc.interpreter import check_feeds
        from flowc.parallel.simulate import simulate

        graph, result = load_parallel(model, shapes, dims, popts)
        feeds = read_graph_inputs(inputs, graph)
        if random_inputs:
            for k, v in make_random(graph, seed).items():
                feeds.setdefault(k, v)
        checked = check_feeds(graph, feeds)
        _progress(f"simulating {popts.mesh.size} ranks")
        outs = simulate(result.physical, checked)
        results = {v.name: a for v, a in zip(graph.outputs, outs, strict=True)}
        write_npz_atomic(output, results)
        out.print(f"wrote {output} (simulated on {popts.mesh.size} ranks)")
        return
    graph = load(model, shapes, dims)
    feeds = read_graph_inputs(inputs, graph)
    if random_inputs:
        for k, v in make_random(graph, seed).items():
            feeds.setdefault(k, v)
    with Progress(
        TextColumn("evaluating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as progress:
        task = progress.add_task("eval", total=len(graph.nodes))
        results = evaluate(graph, feeds, on_node=lambda k, n: progress.update(task, completed=k))
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


def _progress(msg: str) -> None:
    err.print(f"[dim]flowc:[/] {escape(msg)}")


def choose_target(target: str | None, purpose: str, sanitize: bool = False) -> str:
    """``target`` as given, or the default for ``purpose`` (``build``: cuda where nvcc is
    found; ``run``: cuda only where a GPU is present; a sanitized build is a host build);
    says which it chose either way."""
    from flowc.toolchain import default_target

    if target is not None:
        _progress(f"target {target}")
        return target
    if sanitize:
        _progress("target host (sanitizers build for the host)")
        return "host"
    chosen, why = default_target(purpose)
    _progress(f"target {chosen} ({why}; --target to choose)")
    return chosen


def require_gpu(what: str) -> None:
    """Refuse to run a CUDA build on a machine the driver reports no GPU on, before any
    device call could fail with a misleading message (out of memory, no device)."""
    from flowc.toolchain import gpu_count

    if gpu_count() == 0:
        raise FlowcError(
            f"{what}: this machine has no GPU to run the CUDA build on",
            hint="use --target host here, or run on a machine with a GPU",
        )


@cli.command(name="compile")
@model_options
@click.option(
    "-o",
    "--output",
    "project",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Project directory OUT/.",
)
@click.option(
    "--target",
    type=click.Choice(["cuda", "host"]),
    default=None,
    help="The build to suggest; both build from the same OUT/ (default: cuda where nvcc is found, else host).",
)
@click.option(
    "--arch", default="sm_90", show_default=True, help="CUDA architecture for the CUDA build."
)
@click.option("--prefix", default=None, help="C symbol prefix (default: from the model's name).")
@click.option(
    "--force",
    is_flag=True,
    help="Write into a non-empty OUT/ that is no flowc project (still deletes nothing).",
)
@schedule_options
@parallel_options
def compile_cmd(
    model: Path,
    shapes: tuple[str, ...],
    dims: tuple[str, ...],
    project: Path,
    target: str | None,
    arch: str,
    prefix: str | None,
    force: bool,
    mesh: str | None,
    parallel: str,
    sbps: tuple[str, ...],
    mem_limit: str | None,
    cost_profile: Path | None,
    streams: int | None,
    no_cuda_graph: bool,
    precision: str,
    schedule_for: str,
) -> None:
    """Compile MODEL into a standalone C++ project OUT/ (model.cu, model.h, main.cu, weights,
    CMake). OUT/ keeps every file flowc did not write (flowc_model.json lists those it did);
    a non-empty OUT/ that is no flowc project is refused unless --force."""
    import re
    import shlex

    from flowc.codegen.cpp import is_c_ident
    from flowc.codegen.project import check_project_dir

    # Everything the command line decides is checked before the (slow) model work.
    if re.fullmatch(r"sm_[0-9]+", arch) is None:
        raise InputError(f"--arch {arch}: expected sm_NN, e.g. sm_90")
    if prefix is not None and not is_c_ident(prefix):
        raise InputError(
            f"--prefix {prefix!r} is not a C identifier",
            hint="use ASCII letters, digits and underscores, not starting with a digit",
        )
    check_project_dir(project, force)
    popts = parallel_settings(model, mesh, parallel, sbps, mem_limit, cost_profile)
    target = choose_target(target, "build")
    compile_model(
        model,
        shapes,
        dims,
        project,
        popts,
        prefix=prefix,
        arch=arch[3:],
        force=force,
        streams=streams,
        cuda_graph=not no_cuda_graph,
        precision=precision,
        schedule_for=schedule_for,
    )
    shown = shlex.quote(str(project))
    out.print(
        f"wrote {shown}/; build it with: flowc build {shown} --target {target}",
        markup=False,
    )


def compile_model(
    model: Path,
    shapes: Sequence[str],
    dims: Sequence[str],
    project: Path,
    popts: Any,
    prefix: str | None = None,
    arch: str = "90",
    force: bool = False,
    streams: int | None = None,
    cuda_graph: bool = True,
    precision: str = "fp32",
    schedule_for: str = "latency",
) -> None:
    """Load, (parallelize,) schedule, plan memory, generate and write OUT/: what compile and
    verify share. --print-pass-times prints every stage's time at the end."""
    from flowc.codegen.cpp import c_ident
    from flowc.compiler import PipelineSpec, StageTimes, compile_graph, compile_pipeline

    times = StageTimes()
    if isinstance(popts, PipelineSpec) and schedule_for != "latency":
        raise InputError(
            "--schedule-for memory with --pipeline: a pipeline's stages are scheduled for "
            "latency only",
            hint="leave out --schedule-for, or compile without --pipeline",
        )
    if isinstance(popts, PipelineSpec):
        graph = load(model, shapes, dims, for_compile=True, times=times, precision=precision)
        spec = popts
        _progress(
            f"cutting {len(graph.nodes)} nodes into {spec.stages} pipeline stages on mesh "
            f"{'x'.join(map(str, spec.mesh.shape))}, {spec.microbatches} micro-batch"
            + ("es" if spec.microbatches != 1 else "")
        )
        compiled = compile_pipeline(
            graph,
            project,
            spec,
            prefix=prefix,
            source=model.name,
            arch=arch,
            force=force,
            streams=streams,
            times=times,
            precision=precision,
        )
        _progress(compiled.partition.summary().splitlines()[0])
    elif popts is None:
        graph = load(model, shapes, dims, for_compile=True, times=times, precision=precision)
        _progress(f"generating {project}/")
        compile_graph(
            graph,
            project,
            prefix=prefix,
            source=model.name,
            arch=arch,
            force=force,
            streams=streams,
            times=times,
            cuda_graph=cuda_graph,
            precision=precision,
            schedule_for=schedule_for,
        )
    else:
        import dataclasses

        if precision in ("bf16", "fp16"):
            raise InputError(
                f"--precision {precision} with --mesh: narrow storage is not placed over a "
                "mesh yet",
                hint="use --precision fp32 or tf32 with --mesh, or --pipeline P",
            )

        # The memory limit counts the arena of the program as compiled: the same streams.
        popts = dataclasses.replace(popts, streams=streams)
        streams = popts.stream_count()
        logical, result = load_parallel(model, shapes, dims, popts, times=times)
        _progress(
            f"generating {project}/ for {popts.mesh.size} ranks "
            f"({result.memory.total} bytes per device)"
        )
        compile_graph(
            result.physical.graph,
            project,
            prefix=prefix or c_ident(logical.name),
            source=model.name,
            arch=arch,
            physical=result.physical,
            force=force,
            streams=streams,
            times=times,
            cuda_graph=cuda_graph,
            profile=result.profile,  # the one the memory limit was measured with
            precision=precision,
            schedule_for=schedule_for,
        )
    if _pass_switches["times"]:
        err.print("stage times:", markup=False)
        for line in times.lines():
            err.print(line, markup=False)


@cli.command(name="convert")
@model_options
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="OUT.flow; the weights go beside it as OUT.weights.npz.",
)
def convert_cmd(model: Path, shapes: tuple[str, ...], dims: tuple[str, ...], output: Path) -> None:
    """Write MODEL as a DSL program (OUT.flow) and its weights (OUT.weights.npz), which the
    program loads by a path relative to itself."""
    from flowc.ir.graph import is_splat
    from flowc.ir.printer import INLINE_MAX, print_graph

    output = output.resolve()
    if output.suffix != ".flow":
        raise InputError(f"-o {output}: the program's file name must end in .flow")
    if not output.parent.is_dir():
        raise InputError(f"-o {output}: directory {output.parent} does not exist")
    graph = load(model, shapes, dims)
    stored: dict[str, np.ndarray] = {
        c.name: c.const
        for c in graph.constants
        if c.const is not None and not is_splat(c.const) and c.const.size > INLINE_MAX
    }
    weights = output.with_name(output.stem + ".weights.npz")
    text = print_graph(graph, weights=weights.name if stored else None)
    # The weights first: the program never names a file that is not there yet; if the
    # program cannot be written, the new weights go too.
    if stored:
        write_npz_atomic(weights, stored)
    fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, _file_mode())
        os.replace(tmp, output)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        if stored:
            weights.unlink(missing_ok=True)
        raise
    out.print(
        f"wrote {escape(str(output))} ({len(graph.nodes)} nodes)"
        + (f" and {escape(weights.name)} ({len(stored)} arrays)" if stored else "")
    )


@cli.command(name="build")
@click.argument("project", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--target",
    type=click.Choice(["cuda", "host"]),
    default=None,
    help="Default: cuda where nvcc is found, else host.",
)
@click.option(
    "--sanitize",
    default=None,
    metavar="address,undefined",
    help="Host target only: build with AddressSanitizer and/or UBSan, comma-separated "
    "(into build-host-asan, ...; run it with `flowc run --sanitize`).",
)
def build_cmd(project: Path, target: str | None, sanitize: str | None) -> None:
    """Build a project made by `flowc compile` (CMake; the compiler's errors are shown)."""
    from flowc.harness.build import build

    # Sanitizers exist on the host build only: asking for them picks it.
    target = choose_target(target, "build", sanitize=bool(sanitize))
    bdir = build(project, target, progress=_progress, sanitize=sanitize)
    out.print(f"built {escape(str(bdir))}/model_main")


@cli.command(name="run")
@click.argument("project", type=click.Path(file_okay=False, path_type=Path))
@click.option("--input", "inputs", multiple=True, metavar="NAME=PATH.npy", help="An input array.")
@click.option(
    "--weights",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Another weights file of the same layout.",
)
@click.option(
    "--target",
    type=click.Choice(["cuda", "host"]),
    default=None,
    help="Default: cuda where a GPU is present, else host.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="OUT.npz, keyed by output name (optional with --bench).",
)
@click.option(
    "--sanitize",
    default=None,
    metavar="address,undefined",
    help="Run the build made by `flowc build --sanitize` with the same value (host only).",
)
@click.option(
    "--bench",
    type=int,
    default=None,
    metavar="N",
    help="Also time the model: N runs queued back to back (throughput), N one at a time "
    "(latency median and p90), after a few warm-up runs.",
)
@click.option(
    "--stats",
    is_flag=True,
    help="Print the launches per run (kernels + library calls) and the copies, as the host "
    "emulator counts them (FLOWC_STATS=1 in the environment does the same).",
)
def run_cmd(
    project: Path,
    inputs: tuple[str, ...],
    weights: Path | None,
    target: str | None,
    output: Path | None,
    sanitize: str | None,
    bench: int | None,
    stats: bool,
) -> None:
    """Run a built project on .npy inputs; write its outputs to OUT.npz and, with --bench N,
    print its latency and throughput; with --stats, its launches per run."""
    from flowc.harness.build import bench_figures, project_info, run

    if bench is not None and not 1 <= bench <= 1_000_000:
        raise InputError(
            f"--bench {bench}: expected a number of runs from 1 to 1000000",
            hint="for example --bench 100",
        )
    if output is None and bench is None and not stats:
        raise InputError(
            "flowc run needs -o OUT.npz for the outputs (or --bench N to time the model, "
            "--stats to count its launches)"
        )
    if output is not None:
        output = check_output_path(output)
    info = project_info(project)
    if weights is not None and not weights.is_file():
        # Not only missing: a FIFO or a device would hang the driver or never end.
        what = "no such file" if not weights.exists() else "not a regular file"
        raise InputError(f"--weights {weights}: {what}", hint="give a weights file flowc wrote")
    target = choose_target(target, "run", sanitize=bool(sanitize))
    if target == "cuda":
        require_gpu(f"flowc run {project}")
    specs = info["inputs"]
    assert isinstance(specs, list)
    feeds = read_inputs(inputs, [str(spec["name"]) for spec in specs])
    feeds = {k: as_declared_type(k, a, specs) for k, a in feeds.items()}
    env: dict[str, str] = {}
    if stats:
        env["FLOWC_STATS"] = "1"
    if target == "host" and "OMP_WAIT_POLICY" not in os.environ:
        # libgomp reads it before main; its default spin-wait takes the cores from OpenBLAS's
        # threads (the driver would restart itself with it; set here, it need not).
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    results, stdout = run(
        project,
        feeds,
        target=target,
        weights=weights,
        sanitize=sanitize,
        bench=bench or 0,
        env=env,
    )
    if output is not None:
        write_npz_atomic(output, results)
        out.print(f"wrote {escape(str(output))}")
    # The driver's FLOWC_STATS lines (asked for by --stats or by the inherited environment).
    counted = [
        line
        for line in stdout.splitlines()
        if line.startswith(("launches per run", "copies per run"))
    ]
    for line in counted:
        out.print(escape(line))
    if (stats or os.environ.get("FLOWC_STATS", "0") not in ("", "0")) and not counted:
        if target == "host":
            err.print(
                "[yellow]note:[/] the driver printed no launch counts; a project built by an "
                "older flowc prints none: rebuild it with `flowc build`"
            )
        else:
            err.print(
                "[yellow]note:[/] launches are counted by the host emulator only (this was a "
                f"{target} run); build and run the project with --target host to count them"
            )
    if bench is not None:
        f = bench_figures(stdout)
        lat = f["latency_ms"]
        ranks = f"{f['ranks']} rank" + ("s" if f["ranks"] != 1 else "")
        out.print(
            f"latency: median {lat['median']:.3f} ms, p90 {lat['p90']:.3f} ms, "
            f"min {lat['min']:.3f} ms ({f['runs']} runs, each synchronized)"
        )
        out.print(
            f"throughput: {f['throughput_runs_per_s']:.1f} runs/s ({f['runs']} runs queued "
            f"back to back; {f['warmup']} warm-up runs first; {f['target']}, {ranks})"
        )


@cli.command()
@model_options
@click.option(
    "--target",
    type=click.Choice(["host", "cuda"]),
    default=None,
    help="Default: cuda where a GPU is present, else host.",
)
@click.option(
    "--input",
    "inputs",
    multiple=True,
    metavar="NAME=PATH.npy",
    help="An input array (others: seeded random).",
)
@click.option("--seed", default=0, show_default=True, help="Seed for the random inputs.")
@click.option(
    "--tol",
    type=float,
    default=None,
    help="Largest error allowed: max|got-ref| / max|ref| (default: by --precision, "
    "fp32 1e-4, tf32 1e-2, fp16 1e-2, bf16 5e-2).",
)
@click.option(
    "-o",
    "--output",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the project here (default: a temporary directory).",
)
@schedule_options
@parallel_options
def verify(
    model: Path,
    shapes: tuple[str, ...],
    dims: tuple[str, ...],
    target: str | None,
    inputs: tuple[str, ...],
    seed: int,
    tol: float | None,
    out_dir: Path | None,
    mesh: str | None,
    parallel: str,
    sbps: tuple[str, ...],
    mem_limit: str | None,
    cost_profile: Path | None,
    streams: int | None,
    no_cuda_graph: bool,
    precision: str,
    schedule_for: str,
) -> None:
    """Compile MODEL, build, run, and compare every output with onnxruntime (the NumPy
    reference for a .flow program)."""
    from flowc.harness.build import build, run
    from flowc.harness.compare import compare
    from flowc.harness.ort import run_onnxruntime
    from flowc.interpreter import random_inputs as make_random

    if model.suffix.lower() not in (".onnx", ".flow"):
        raise InputError(f"{model}: verify takes an .onnx model or a .flow program")
    if model.suffix.lower() == ".onnx":
        # The reference first: no half-minute build before finding it missing.
        try:
            import onnxruntime  # noqa: F401
        except ImportError as e:
            raise FlowcError(
                f"verify compares with onnxruntime, which cannot be imported ({e})",
                hint="pip install onnxruntime (or pip install 'flowc[test]')",
            ) from None
    target = choose_target(target, "run")
    if target == "cuda":
        require_gpu(f"flowc verify {model.name}")
    popts = parallel_settings(model, mesh, parallel, sbps, mem_limit, cost_profile)
    graph = load(model, shapes, dims)
    feeds = read_graph_inputs(inputs, graph)
    for k, v in make_random(graph, seed).items():
        feeds.setdefault(k, v)
    with tempfile.TemporaryDirectory(prefix="flowc-verify-") as tmp:
        project = out_dir or Path(tmp) / "out"
        _progress(f"compiling {model.name}")
        compile_model(
            model,
            shapes,
            dims,
            project,
            popts,
            streams=streams,
            cuda_graph=not no_cuda_graph,
            precision=precision,
            schedule_for=schedule_for,
        )
        build(project, target, progress=_progress)
        _progress("running")
        got, _ = run(project, feeds, target=target)
    if model.suffix.lower() == ".flow":
        # A DSL program has no onnxruntime counterpart: flowc's NumPy reference is the judge.
        from flowc.interpreter import evaluate

        reference = "the NumPy reference"
        ref = evaluate(graph, feeds)
    else:
        import onnx

        from flowc.harness.ort import inference_mode

        reference = "onnxruntime"
        ref = run_onnxruntime(inference_mode(onnx.load(str(model))), feeds)
    if tol is None:
        tol = VERIFY_TOLERANCE[precision]
    table = Table(show_edge=False)
    for col in ("output", "shape", "error", "result"):
        table.add_column(col)
    ok = True
    for name, r in ref.items():
        c = compare(name, got[name], r, tol)
        ok &= c.ok
        table.add_row(
            escape(name),
            str(list(c.shape)),
            f"{c.error:.2e}",
            "PASS" if c.ok else f"FAIL {escape(c.reason)}",
        )
    out.print(table)
    if not ok:
        raise FlowcError(f"{model.name}: some outputs differ from {reference} by more than {tol}")


@cli.command()
@click.option("--target", type=click.Choice(["ref", "host"]), default="ref", show_default=True)
@click.option(
    "--filter", "pattern", default=None, metavar="REGEX", help="Only cases whose name matches."
)
@click.option("--jobs", "-j", default=os.cpu_count() or 1, show_default="CPUs", help="Processes.")
@click.option(
    "--group-size",
    default=120,
    show_default=True,
    help="host: cases compiled side by side into one build.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the per-case results here (default for a full run: the cache's results-TARGET.json).",
)
@click.option(
    "--write-table",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the support table (e.g. docs/ONNX_SUPPORT.md) from the full ref and host results.",
)
@click.option(
    "--expected-failures",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Fail (exit 1) when a case not listed fails or a listed case passes.",
)
@click.option(
    "--update-expected",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the list of failing cases here.",
)
def conformance(
    target: str,
    pattern: str | None,
    jobs: int,
    group_size: int,
    json_path: Path | None,
    write_table: Path | None,
    expected_failures: Path | None,
    update_expected: Path | None,
) -> None:
    """Run the ONNX node test cases of the installed onnx package through flowc: `ref`
    evaluates flowc's NumPy reference, `host` compiles, builds and runs on the host."""
    from flowc import conformance as conf

    if jobs < 1:
        raise InputError(f"--jobs {jobs}: expected at least 1")
    if group_size < 1:
        raise InputError(f"--group-size {group_size}: expected at least 1")
    full = pattern is None
    if not full and (write_table or update_expected):
        raise InputError(
            "--write-table and --update-expected need a run of every case (no --filter)"
        )
    expected = conf.read_expected_failures(expected_failures) if expected_failures else None
    root, cases = conf.materialize(progress=_progress)
    chosen = conf.select(cases, pattern)
    _progress(f"running {len(chosen)} cases on {target} with {jobs} process(es)")
    t0 = time.perf_counter()
    with Progress(
        TextColumn(f"conformance ({target})"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("[green]{task.fields[passed]} passed"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as progress:
        task = progress.add_task("run", total=len(chosen), passed=0)
        passed = 0

        def advance(r: Any) -> None:
            nonlocal passed
            passed += r.status == "pass"
            progress.update(task, advance=1, passed=passed)

        results = conf.run_cases(
            root, chosen, target, jobs=jobs, on_result=advance, group_size=group_size
        )
    seconds = time.perf_counter() - t0
    s = conf.summarize(results)
    table = Table(title=f"onnx {conf.onnx_version()} node cases, {target}", show_edge=False)
    table.add_column("result")
    table.add_column("cases", justify="right")
    table.add_row("passed", str(s.passed))
    table.add_row("  by folding to constants", str(s.folded))
    table.add_row("mismatch", str(s.counts["mismatch"]))
    table.add_row("unsupported op", str(s.counts["unsupported"]))
    table.add_row("other error", str(s.counts["error"]))
    table.add_row("total", str(s.total))
    out.print(table)
    out.print(
        f"{target}: {s.passed} / {s.total} passed in {seconds:.1f} s; {s.frozen} cases had inputs bound to their test values"
    )
    for reason, count in conf.failure_categories(results, 10):
        out.print(f"  {count:5d}  {escape(reason)}")
    if json_path is None and full:
        json_path = root / f"results-{target}.json"
    if json_path is not None:
        conf.write_results(json_path, target, results, full=full)
        out.print(f"wrote {escape(str(json_path))}")
    if update_expected is not None:
        conf.write_expected_failures(update_expected, target, results)
        out.print(f"wrote {escape(str(update_expected))}")
    if write_table is not None:
        others = {t: conf.read_results(root / f"results-{t}.json") for t in conf.TARGETS}
        others[target] = results
        conf.write_support_table(write_table, cases, others["ref"], others["host"])
        out.print(f"wrote {escape(str(write_table))}")
    if expected is not None:
        new, fixed = conf.check_expected(expected, results, full=full)
        for name in new:
            r = next(r for r in results if r.name == name)
            err.print(f"unexpected failure: {name}: {r.status}: {escape(r.message)}")
        for name in fixed:
            err.print(f"listed as failing, but passes (or is no case): {name}")
        if new or fixed:
            raise FlowcError(
                f"{len(new)} unexpected failure(s), {len(fixed)} listed case(s) passing",
                hint=f"fix them, or update the list: flowc conformance --target {target} "
                f"--update-expected {expected_failures}",
            )


@cli.command(name="plan-memory")
@click.argument("csv_file", metavar="FILE.csv", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--offsets",
    "offsets_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write id,lower,upper,size,offset here.",
)
@click.option(
    "--capacity", default=None, metavar="BYTES", help="Look for a placement within BYTES."
)
@click.option(
    "--work-limit",
    default=None,
    type=int,
    help="Search nodes for the exact search (default: the placer's; 0: greedy only).",
)
def plan_memory_cmd(
    csv_file: Path, offsets_path: Path | None, capacity: str | None, work_limit: int | None
) -> None:
    """Place the buffers of a MiniMalloc CSV (id,lower,upper,size; live on [lower, upper))
    at static offsets: prints the peak, the lower bound and their ratio."""
    from flowc.memory import placement

    cap = parse_bytes(capacity, "--capacity") if capacity is not None else None
    limit = placement.DEFAULT_WORK_LIMIT if work_limit is None else work_limit
    if limit < 0:
        raise InputError(f"--work-limit {limit}: expected 0 or more search nodes")
    try:
        intervals = placement.read_csv(csv_file)
    except placement.PlacementError as e:
        raise InputError(str(e), hint="rows are id,lower,upper,size with lower < upper") from None
    t0 = time.perf_counter()
    result = placement.place(intervals, capacity=cap, work_limit=limit, exact=limit > 0)
    seconds = time.perf_counter() - t0
    # The placer's output goes through the independent checker before anyone uses it.
    placement.check_placement(intervals, result.offsets)
    ratio = result.peak / result.lower_bound if result.lower_bound else 1.0
    table = Table(show_header=False, show_edge=False)
    table.add_column()
    table.add_column(justify="right")
    table.add_row("buffers", str(len(intervals)))
    table.add_row("lower bound", f"{result.lower_bound} ({human_bytes(result.lower_bound)})")
    table.add_row("peak", f"{result.peak} ({human_bytes(result.peak)})")
    if cap is not None:
        table.add_row("capacity", f"{cap} ({'fits' if result.peak <= cap else 'does not fit'})")
    table.add_row("strategy", result.strategy + (", optimal" if result.optimal else ""))
    table.add_row("time", f"{seconds:.2f} s")
    out.print(table)
    if offsets_path is not None:
        try:
            placement.write_offsets_csv(offsets_path, intervals, result.offsets)
        except OSError as e:
            raise InputError(
                f"--offsets {offsets_path}: cannot write ({e.strerror or e})"
            ) from None
        out.print(f"wrote {escape(str(offsets_path))}")
    out.print(f"peak {result.peak} lower_bound {result.lower_bound} ratio {ratio:.4f}")
    if cap is not None and result.peak > cap:
        unmet = FlowcError(
            f"{csv_file.name}: no placement within {cap} bytes found; the best peak is "
            f"{result.peak} ({result.peak - cap} bytes over)",
            hint="raise --work-limit to search longer, or --capacity",
        )
        unmet.exit_code = 1  # not an input error: the search fell short
        raise unmet


@cli.command()
def ops() -> None:
    """List the supported ops, by family."""
    from flowc.ops.registry import all_ops

    families: dict[str, list[str]] = {}
    for op in all_ops():
        families.setdefault(op.family, []).append(op.name)
    for fam in sorted(families):
        out.print(f"[bold]{fam}[/] ({len(families[fam])}): " + " ".join(families[fam]))
    out.print(f"{sum(len(v) for v in families.values())} ops with kernels or import lowerings")
    from flowc.frontend.onnx_control import CONTROL_OPS
    from flowc.frontend.onnx_functions import expandable_ops

    known = {op.name for op in all_ops()} | set(CONTROL_OPS)
    funcs = expandable_ops(known)
    out.print(
        f"[bold]control flow[/] ({len(CONTROL_OPS)}, resolved at import: known conditions, "
        "unrolled loops): " + " ".join(CONTROL_OPS)
    )
    out.print(
        f"[bold]function ops[/] ({len(funcs)}, imported through their ONNX function body): "
        + " ".join(funcs)
    )


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
    try:
        cli.main(
            args=list(argv) if argv is not None else None, prog_name="flowc", standalone_mode=False
        )
    except FlowcError as e:
        err.print(f"[bold red]error:[/] {escape(e.message)}")
        if e.hint:
            err.print(f"  hint: {e.hint}", markup=False)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        err.print("aborted")
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err.print("aborted")
        sys.exit(130)
    except Exception as e:
        if os.environ.get("FLOWC_DEBUG"):
            traceback.print_exc()
        err.print(f"[bold red]internal error:[/] {type(e).__name__}: {escape(str(e))}")
        err.print(
            "  this is a bug in flowc; rerun with FLOWC_DEBUG=1 for the traceback", markup=False
        )
        sys.exit(70)


if __name__ == "__main__":
    main()
