"""`flowc inspect`: what a model holds, and with options what flowc makes of it (the memory
plan, a mesh's parallel plan, the static schedule, a report page)."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from flowc.cli.common import err, out, recording
from flowc.cli.inspect_views import (
    print_pipeline,
    print_plan_view,
    print_schedule,
    write_report_page,
)
from flowc.cli.loading import load_model, parallel_settings
from flowc.cli.options import (
    ModelArgs,
    ParallelArgs,
    ScheduleArgs,
    TrainArgs,
    flag_option,
    model_options,
    parallel_options,
    path_option,
    schedule_options,
    training_options,
)
from flowc.errors import InputError
from flowc.formatting import human_bytes, human_flops
from flowc.ir.printer import print_graph


@click.command(
    name="inspect", short_help="Summarize MODEL; with options its plan, memory, schedule."
)
@model_options
@flag_option("--print-ir", "Write the IR (DSL text) to stdout; the summary goes to stderr.")
@flag_option("--memory", "Plan memory: arena bytes, lower bound, naive sum.")
@flag_option(
    "--schedule",
    "Print the static schedule per rank: streams, firing order, events, modeled "
    "start/end, makespan and critical path.",
    dest="show_schedule",
)
@path_option(
    "--gantt",
    metavar="OUT.png",
    help="Draw the modeled schedule as a Gantt chart (PNG); implies --schedule.",
)
@path_option(
    "--report",
    directory=True,
    metavar="DIR",
    help="Write DIR/index.html: the graph (Graphviz dot), memory over time, the schedule's "
    "Gantt chart and these tables (with --memory's) on one self-contained page. "
    "docs/report.md.",
)
@schedule_options
@parallel_options
@flag_option(
    "--train",
    "Inspect MODEL's training step (with the training options): parameters, optimizer "
    "state, gradients, saved activations; with --memory the step's plan; with --print-ir "
    "the whole step.",
)
@training_options
def inspect(
    model: ModelArgs,
    print_ir: bool,
    memory: bool,
    show_schedule: bool,
    gantt: Path | None,
    report: Path | None,
    schedule: ScheduleArgs,  # its --no-cuda-graph: the schedule printed is the same either way
    parallel: ParallelArgs,
    train: bool,
    training: TrainArgs,
) -> None:
    """Summarize MODEL: inputs, outputs, ops, parameter bytes, FLOPs; with --mesh, the
    parallel plan beside the data-parallel and all-broadcast ones; with --schedule, the
    static schedule the compiled program runs."""
    from flowc.ir.graph import is_splat
    from flowc.ops.registry import get_op

    streams, precision, schedule_for = schedule.streams, schedule.precision, schedule.schedule_for
    if train or training != TrainArgs():
        import dataclasses

        if parallel.mesh is not None or parallel.pipeline is not None:
            raise InputError(
                "flowc inspect --train shows the step on one device; a mesh's or a "
                "pipeline's placement of it is printed by the compile",
                hint="flowc compile MODEL --train ... --mesh/--pipeline ... -o OUT (or flowc "
                "train)",
            )
        training = dataclasses.replace(training, mem_limit=parallel.mem_limit)
        _inspect_training(model, train, training, memory, print_ir, precision)
        return

    show_schedule = show_schedule or gantt is not None
    if streams is not None and not show_schedule:
        raise InputError("--streams needs --schedule", hint="e.g. --schedule --streams 2")
    if gantt is not None:
        from flowc.atomic_file import Kind, check_output

        if (
            check_output(gantt, "--gantt").kind is not Kind.STREAM
            and gantt.suffix.lower() != ".png"
        ):
            raise InputError(f"--gantt {gantt}: a Gantt chart is drawn as PNG", hint="give OUT.png")
    popts = parallel_settings(model, parallel)
    from flowc.compiler import PipelineSpec

    pipeline_schedule = parallel.pipeline_schedule
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
    if isinstance(popts, PipelineSpec):
        print_pipeline(
            model,
            popts,
            show_schedule,
            pipeline_schedule or "gpipe",
            streams,
            gantt,
            precision=precision,
            report=report,
        )
        return
    if popts is not None:
        logical, result, recorded = print_plan_view(
            model, popts, print_ir, record=report is not None, precision=precision
        )
        if show_schedule:
            print_schedule(
                err if print_ir else out,
                result.physical.graph,
                streams,
                gantt,
                popts.mesh.shape,
                schedule_for,
            )
        if report is not None:
            write_report_page(
                report, model.path, recorded, logical, result, popts, streams, schedule_for
            )
        return

    # With --memory or --schedule the graph is the one code generation uses: after fusion.
    memory = memory or report is not None
    compiled = memory or show_schedule
    graph = load_model(model, for_compile=compiled, precision=precision)
    console = err if print_ir else out
    if report is not None:
        # The page shows what is printed here: record it (wide: tables are not squeezed).
        console = recording(console)
    if print_ir:
        sys.stdout.write(print_graph(graph))
        sys.stdout.flush()
    meta = graph.meta
    console.print(
        f"[bold]{escape(model.path.name)}[/]  graph {escape(repr(graph.name))}"
        + (f", {meta['format']} opset {meta['opset']}" if "opset" in meta else "")
        + (f", from {meta['producer']}" if meta.get("producer") else "")
    )
    io = Table(title="inputs and outputs", title_justify="left", show_edge=False)
    io.add_column("kind")
    io.add_column("name")
    io.add_column("type")
    for v in graph.inputs:
        io.add_row("input", Text(v.name), Text(str(v.type)))
    for v in graph.outputs:
        io.add_row("output", Text(v.name), Text(str(v.type)))
    console.print(io)
    if graph.symbols:
        # both ends of each range, and the counts the program computes
        console.print(
            Text(
                "symbolic dims: "
                + ", ".join(f"{name}:{r}" for name, r in graph.symbols.items())
                + " (the memory and the costs below are at the bound)"
            )
        )
    from flowc.compiler import pass_list

    # Say which passes ran: with --memory the table counts the compiled (fused) graph's nodes.
    passes = ", ".join(pass_list(precision, compiled))
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
            sizes = ", ".join(
                f"stream {s} {human_bytes(plan.workspace_size(s))}" for s in sorted(plan.workspaces)
            )
            console.print(
                f"  of which library workspaces (cuda target only): {sizes} (cuBLASLt/cuDNN "
                f"scratch, each the most its stream's calls can use, at most the cost "
                f"profile's {human_bytes(plan.workspace_cap)}); host target arena "
                f"{plan.host_arena_bytes} B ({human_bytes(plan.host_arena_bytes)})",
                markup=False,
            )
    if show_schedule:
        print_schedule(console, graph, streams, gantt, None, schedule_for)
    if report is not None:
        write_report_page(
            report, model.path, console, graph, None, None, streams, schedule_for, sched, plan
        )


def _inspect_training(
    model: ModelArgs,
    train: bool,
    training: TrainArgs,
    memory: bool,
    print_ir: bool,
    precision: str = "fp32",
) -> None:
    """`flowc inspect --train`: what the training step holds and keeps (``precision``: as
    `flowc train --precision` compiles it)."""
    import dataclasses

    from flowc.compiler import load_training, plan_schedule, schedule_graph
    from flowc.trainer import spec_of, with_train_block

    if not train:
        raise InputError(
            "the training options need --train", hint="flowc inspect MODEL --train ..."
        )
    training = with_train_block(model.path, training)
    spec = dataclasses.replace(spec_of(training, "flowc inspect --train"), precision=precision)
    step = load_training(model, spec, batch=training.batch)
    graph = step.graph
    console = err if print_ir else out
    if print_ir:
        sys.stdout.write(print_graph(graph))
        sys.stdout.flush()
    types = {v.name: v.type for v in graph.inputs}
    param_bytes = sum(types[p].nbytes for p in step.params)
    state_bytes = sum(types[s].nbytes for states in step.optimizer_state.values() for s in states)
    console.print(
        f"[bold]{escape(model.path.name)}[/]: training step, {len(graph.nodes)} nodes, "
        f"{spec.optimizer.kind} on {escape(spec.loss.kind)} "
        f"(batch inputs: {escape(', '.join(step.batch))})"
        + (
            f", {step.micro_batches} micro-batches a step (their gradients accumulated)"
            if step.micro_batches > 1
            else ""
        )
    )
    table = Table(title="what the step holds", title_justify="left", show_edge=False)
    table.add_column("kind")
    table.add_column("tensors", justify="right")
    table.add_column("bytes", justify="right")
    table.add_row("trained parameters", str(len(step.params)), human_bytes(param_bytes))
    table.add_row(
        "optimizer state",
        str(sum(len(v) for v in step.optimizer_state.values())),
        human_bytes(state_bytes),
    )
    if step.buffers:
        table.add_row(
            "running statistics (batch norms')",
            str(len(step.buffers)),
            human_bytes(sum(types[b].nbytes for b in step.buffers)),
        )
    table.add_row("gradients (in the arena)", str(len(step.params)), human_bytes(param_bytes))
    table.add_row("saved activations", "", human_bytes(step.saved_activation_bytes()))
    console.print(table)
    if step.recompute is not None:
        for line in step.recompute.lines():
            console.print(escape(line))
    if precision in ("bf16", "fp16"):
        s = spec.scaling
        console.print(
            f"{precision} mixed precision: activations and their gradients {precision}; "
            "parameters, optimizer state, gradient sums and the loss float32"
            + (
                f"; dynamic loss scaling from {s.init:g} (x{s.growth:g} after {s.interval} "
                f"finite steps, x{s.backoff:g} on overflow)"
                if step.loss_scaled
                else ""
            )
        )
    if step.shared:
        console.print(
            "initializers used by several nodes (ties, or an exporter's deduplication; their "
            "gradients add up): "
            + ", ".join(f"{escape(n)} ({k} uses)" for n, k in sorted(step.shared.items())),
        )
    dropouts = len({n.attrs["stream"] for n in graph.nodes if n.op == "TrainDropout"})
    if dropouts:
        console.print(
            f"{dropouts} dropout(s) in the forward, masks keyed by seed {spec.seed}, the step "
            "and the element (flowc train --seed)"
        )
    if step.no_gradient:
        console.print(
            "no gradient reaches (kept as they are): " + ", ".join(map(escape, step.no_gradient))
        )
    if memory:
        # As compile_step schedules a step: in the order of least peak memory.
        sched = schedule_graph(graph, schedule_for="memory")
        plan = plan_schedule(sched)
        console.print(
            f"memory plan of the step: arena {plan.arena_bytes} B ({human_bytes(plan.arena_bytes)}), "
            f"lower bound {plan.lower_bound} B ({plan.arena_bytes / max(plan.lower_bound, 1):.3f}x), "
            f"naive sum {plan.naive_bytes} B; parameters and optimizer state are the model's "
            "state, outside the arena, updated in place"
        )
