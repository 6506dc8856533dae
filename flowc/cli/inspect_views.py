"""The views of `flowc inspect` beyond the summary: a mesh's parallel plan, a pipeline's
stages, the static schedule (printed and drawn), and the --report page."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from flowc.cli.common import err, out, progress, recording
from flowc.cli.loading import load_model, load_parallel
from flowc.cli.options import ModelArgs
from flowc.errors import FlowcError
from flowc.formatting import dims_text


def write_report_page(
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
    notes: list[str] | None = None,
    ranks: int = 1,
) -> None:
    """--report DIR: the page of flowc.report, from what inspect computed and printed. On a
    mesh the logical graph is drawn with its layouts and collectives, and the memory plan
    and schedule are the rank program's (the arena the plan's memory line counts)."""
    from flowc.compiler import plan_schedule, schedule_graph
    from flowc.report import Report, rich_html, write_report

    sbp: dict[Any, Any] = {}
    collectives: dict[Any, list[str]] = {}
    notes = list(notes or [])
    if result is not None:
        sbp = dict(result.plan.value_sbp)
        for v, who, st in result.cost.boxing:
            if not st.is_local:
                collectives.setdefault((v, who), []).append(st.collective)
        ranks = result.plan.mesh.size
        progress("scheduling the rank program for the report")
        sched = schedule_graph(
            result.physical.graph, result.profile, popts.stream_count(), schedule_for
        )
        plan = plan_schedule(sched)
        notes.append(
            f"mesh {dims_text(result.plan.mesh.shape)}: the graph is the logical one "
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
    written = write_report(directory, page, progress=progress)
    progress(f"report written in {time.perf_counter() - t0:.2f} s")
    err.print(f"wrote {escape(str(written.path))}")


def print_schedule(
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
    from flowc.report import node_labels

    sched = schedule_graph(graph, streams=streams, schedule_for=schedule_for)
    ag = sched.actors
    # The model's names, shortened and unique (flowc.schedule.labels); printed as plain text
    # (markup and emoji codes off), so a name is shown as it is.
    names = node_labels([a.node for a in ag.actors])
    us = 1e6
    ranks = 1
    if mesh_shape is None:
        console.print("schedule of rank 0 (one device):", markup=False)
    else:
        for d in mesh_shape:
            ranks *= d
        console.print(
            f"schedule of rank 0 (mesh {dims_text(mesh_shape)}: all {ranks} ranks "
            "run the same rank graph, so the same schedule; printed once):",
            markup=False,
        )

    def label(a: int) -> str:
        actor = ag.actors[a]
        return f"{a} '{names[actor.node]}' ({actor.op}, {sched.stream_name(sched.stream_of[a])})"

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
                f"  {names[actor.node]} [{actor.op}]" + (f"  {', '.join(marks)}" if marks else ""),
                markup=False,
                emoji=False,
            )
    console.print(f"  events ({len(sched.events)}):", markup=False)
    for e in sched.events:
        console.print(
            f"    e{e.id} [{e.kind}]: recorded after {label(e.record_after)}, "
            f"waited for before {label(e.wait_before)}",
            markup=False,
            emoji=False,
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
            emoji=False,
        )
    if gantt is not None:
        from flowc.report import draw_gantt

        data = {"version": 1, "ranks": [sched.to_json(rank=r) for r in range(ranks)]}
        draw_gantt(data, gantt, title=graph.name)
        console.print(f"  wrote {gantt}", markup=False)


def print_pipeline(
    model: ModelArgs,
    spec: Any,
    show_schedule: bool,
    order: str,
    streams: int | None,
    gantt: Path | None,
    precision: str = "fp32",
    report: Path | None = None,
) -> None:
    """The stages of --pipeline P: the partition and, with --schedule, the micro-batch
    simulation of ``order`` over the stages' modeled times; with --report, the page of the
    micro-batch graph marked by stage, with stage 0's schedule and memory plan."""
    from flowc.compiler import (
        StageTimes,
        build_pipeline,
        is_placed,
        plan_schedule,
        schedule_graph,
        schedule_pipeline,
        simulate_pipeline_order,
        stage_profile,
    )

    graph = load_model(model, for_compile=True, precision=precision, placed=is_placed(spec))
    profile = stage_profile(spec)
    pipe, part = build_pipeline(graph, spec, profile, StageTimes())
    console = recording(out) if report is not None else out
    console.print(
        f"[bold]{escape(model.path.name)}[/]: {spec.stages} pipeline stages on mesh "
        f"{dims_text(spec.mesh.shape)} ({pipe.ranks_per_stage} device(s) per stage), "
        f"{spec.microbatches} micro-batch(es)"
    )
    # Plain text (escaping it as well would print the backslashes).
    console.print(part.summary(pipe.microbatch_graph), markup=False, emoji=False)
    if pipe.placements:
        console.print(pipe.placement_summary(), markup=False, emoji=False)
    programs = None
    m = spec.microbatches
    run = None
    if show_schedule:
        scheds = [schedule_graph(s.graph, profile, streams) for s in pipe.stages]
        forward = [s.makespan_s for s in scheds]
        run = simulate_pipeline_order(spec.stages, m, forward, order)
        console.print(
            f"{order} over {m} micro-batch(es): makespan {run.makespan * 1e6:.3f} us, bubble "
            f"{run.bubble:.3f} (the ideal for equal stages: "
            f"{(spec.stages - 1) / (m + spec.stages - 1):.3f})",
            markup=False,
        )
        for s, firings in enumerate(run.firings):
            text = " ".join(f"{f.phase.name}{f.microbatch}" for f in firings)
            console.print(
                f"  stage {s}: forward {forward[s] * 1e6:.3f} us per micro-batch, busy "
                f"{run.busy_s[s] * 1e6:.3f} us, at most {run.max_in_flight[s]} micro-batch(es) "
                f"in flight; order {text}",
                markup=False,
            )
    if show_schedule or report is not None:
        # What the generated program runs: each stage's micro-batches unrolled, the cuts
        # double-buffered, receives waiting for the sender's modeled sends.
        _, programs = schedule_pipeline(pipe, profile, streams)
    if show_schedule:
        assert programs is not None
        span = max(p.makespan_s for p in programs)
        console.print(
            f"the program's schedule (micro-batches unrolled per stage): makespan "
            f"{span * 1e6:.3f} us; stages end at "
            + ", ".join(f"{p.makespan_s * 1e6:.3f}" for p in programs)
            + " us",
            markup=False,
        )
    if report is not None:
        assert programs is not None and pipe.microbatch_graph is not None
        write_report_page(
            report,
            model.path,
            console,
            pipe.microbatch_graph,
            None,
            None,
            streams,
            "latency",
            programs[0],
            plan_schedule(programs[0]),
            notes=[
                f"pipeline of {spec.stages} stages on mesh {dims_text(spec.mesh.shape)}, "
                f"{m} micro-batch(es): the graph is one micro-batch's, boxed by stage; "
                "memory and schedule are stage 0's program (its micro-batches unrolled)."
            ],
            ranks=spec.mesh.size,
        )
    if gantt is None or run is None:
        return
    from flowc.report import draw_gantt

    assert programs is not None
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
                            "name": f"{f.phase.name}{f.microbatch}",
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
        title=f"{model.path.stem}: {spec.stages} stages, {m} micro-batches, {order}",
    )
    out.print(f"wrote {path}", markup=False)


def print_plan_view(
    model: ModelArgs,
    popts: Any,
    print_ir: bool,
    record: bool = False,
    precision: str = "fp32",
) -> tuple[Any, Any, Console]:
    """--mesh: the plan beside the data-parallel and all-broadcast ones; the logical graph,
    the parallel result and the console printed on (recording, for --report)."""
    import dataclasses

    from flowc.compiler import parallelize
    from flowc.report.plan import Summary, print_plan, summarize

    graph, result = load_parallel(model, popts, precision=precision)
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
        recording(base)
        if record
        else base
        if base.is_terminal
        else Console(file=base.file, width=160, highlight=False, soft_wrap=True)
    )
    console.print(f"[bold]{escape(model.path.name)}[/]  graph {escape(repr(graph.name))}")
    print_plan(console, graph, result, others, popts.mem_limit)
    return graph, result, console
