"""The printed plan of `flowc inspect --mesh ...`: layouts, collectives, totals, memory, and
the same figures for the data-parallel and all-broadcast plans beside it."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from flowc.formatting import human_bytes
from flowc.ir.graph import Graph
from flowc.ir.layout import broadcast, local_type
from flowc.parallel import Parallelized
from flowc.schedule.labels import node_labels, short_name

# What the comparison's memory column counts (flowc.compiler.measure, Memory.total), printed
# under the table.
MEMORY_COLUMN = (
    "memory/device = the bytes one device holds for its rank program: parameters (its shards "
    "of the weights, 256-byte aligned, constant fills included)\n"
    "  + arena (every intermediate value, boxing buffers included, at its planned offset, and "
    "the cuda target's cuBLASLt/cuDNN workspaces)\n"
    "  not counted: the model's inputs and outputs (the caller's memory), the CUDA-graph "
    "staging copies, what CUDA and NCCL allocate for themselves.\n"
    "  --mem-limit bounds this number; the other plans are measured without it (their "
    "workspaces not capped at a 16th of it)."
)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"


@dataclass
class Summary:
    """One plan's headline figures, for the comparison table."""

    method: str
    total_s: float
    compute_s: float
    comm_s: float
    collectives: int
    comm_bytes: int
    params: int
    memory: int


def summarize(result: Parallelized) -> Summary:
    steps = [st for _, _, st in result.cost.boxing if not st.is_local]
    return Summary(
        result.plan.method,
        result.cost.total_s,
        result.cost.compute_s,
        result.cost.comm_s,
        len(steps),
        sum(st.bytes_per_rank for st in steps),
        result.memory.params,
        result.memory.total,
    )


def search_notes(stats: dict[str, float]) -> list[str]:
    """What a reader must know about how far the search got: the gap when the plan is not
    proven optimal, a fallback to a uniform plan, a wall-clock stop."""
    notes = []
    if "optimal" in stats and not stats["optimal"]:
        gap, gap_s = stats.get("gap", float("inf")), stats.get("gap_s", float("inf"))
        within = (
            f"within {gap * 100:.2f}% ({_us(gap_s)}) of the best bound"
            if gap_s != float("inf")
            else "with no bound on how far from the optimum"
        )
        how = (
            "memory priced (Lagrangian bound)"
            if "lagrangian_solves" in stats
            else f"node limit {int(stats.get('node_limit', 0))} reached"
        )
        notes.append(f"search: NOT PROVEN OPTIMAL: {within}; {how}")
    if stats.get("fallback"):
        notes.append(
            "search: the search's own plan was worse than a uniform plan; that one is used"
        )
    if "reproducible" in stats and not stats["reproducible"]:
        notes.append(
            "search: the wall-clock backstop stopped the solver: this plan depends on the "
            "machine's speed and load and is NOT REPRODUCIBLE"
        )
    return notes


def print_plan(
    console: Console,
    graph: Graph,
    result: Parallelized,
    others: list[tuple[str, Summary | str]],
    mem_limit: int | None,
) -> None:
    plan, cost, mesh = result.plan, result.cost, result.plan.mesh
    whole = broadcast(mesh)
    stats = plan.stats
    head = f"[bold]plan ({plan.method})[/] on mesh {'x'.join(map(str, mesh.shape))} ({mesh.size} devices)"
    if "solve_s" in stats:
        head += (
            f"; search: {int(stats.get('nodes_before', 0))} nodes, "
            f"{int(stats.get('nodes_after', 0))} after reductions, "
        )
        if stats.get("eliminated"):
            head += f"solved exactly by elimination in {stats['solve_s']:.2f} s"
        else:
            head += (
                f"{int(stats.get('variables', 0))} ILP variables, "
                f"solved in {stats['solve_s']:.2f} s"
            )
    if "lagrangian_solves" in stats:
        head += f" (memory priced: {int(stats['lagrangian_solves'])} solves)"
    if stats.get("optimal"):
        head += ", proven optimal"
    if result.attempts > 1:
        head += f"; {result.attempts} attempts to fit the memory limit"
    console.print(head)
    for line in search_notes(stats):
        console.print(line)

    layouts = Table(
        title="layout per value (B = whole on every device)", title_justify="left", show_edge=False
    )
    for col in ("value", "kind", "type", "layout", "per device"):
        layouts.add_column(col)
    values = [(v, "input") for v in graph.inputs] + [(c, "param") for c in graph.constants]
    values += [(o, n.op) for n in graph.nodes for o in n.outputs]
    for v, kind in values:
        sbp = plan.value_sbp[v]
        layouts.add_row(
            Text(v.name),
            escape(kind),
            str(v.type),
            str(sbp),
            "" if sbp == whole else str(local_type(v.type, sbp, mesh)),
        )
    console.print(layouts)

    coll = Table(title="collectives", title_justify="left", show_edge=False)
    for col in ("value", "for", "collective", "mesh axis", "layouts", "bytes sent/rank", "modeled"):
        coll.add_column(col)
    from flowc.parallel.cost import step_time

    # Who needs each collective, by its label (flowc.schedule.labels); value names stay
    # whole: they are what --sbp NAME=... takes. Names are Text: shown as they are, neither
    # markup nor emoji codes.
    labels = node_labels(graph.nodes)
    for v, who, st in cost.boxing:
        coll.add_row(
            Text(v.name),
            "output"
            if who is None
            else Text(labels[who] if who in labels else short_name(who.name or who.op)),
            st.collective,
            str(st.mesh_axis),
            f"{st.src} -> {st.dst}",
            str(st.bytes_per_rank),
            _us(step_time(st, result.profile, v.type, mesh)),
        )
    if cost.boxing:
        console.print(coll)
    else:
        console.print("collectives: none")
    me = summarize(result)
    console.print(
        f"per rank: {me.collectives} collectives, {me.comm_bytes} bytes sent ({human_bytes(me.comm_bytes)}); "
        f"modeled time {_us(me.total_s)} = compute {_us(me.compute_s)} + communication {_us(me.comm_s)}"
    )
    console.print(
        f"memory per device: {result.memory.total} B ({human_bytes(result.memory.total)}) = parameters "
        f"{result.memory.params} B + arena {result.memory.arena} B"
        + (f"; limit {mem_limit} B" if mem_limit is not None else "")
    )
    cmp = Table(title="compared with", title_justify="left", show_edge=False)
    for col in (
        "plan",
        "modeled time",
        "compute",
        "communication",
        "collectives",
        "bytes sent/rank",
        "memory/device",
    ):
        cmp.add_column(col)
    for name, s in [(plan.method, me), *others]:
        if isinstance(s, str):
            cmp.add_row(escape(name), escape(s), "", "", "", "", "")
        else:
            cmp.add_row(
                escape(name),
                _us(s.total_s),
                _us(s.compute_s),
                _us(s.comm_s),
                str(s.collectives),
                str(s.comm_bytes),
                f"{s.memory} B",
            )
    console.print(cmp)
    console.print(MEMORY_COLUMN, markup=False)
