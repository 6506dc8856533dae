"""Parallel placement: choose a layout (nd-SBP) for every value on a device mesh, insert
the collectives, and lower to one rank's program.

``make_plan`` chooses a plan for a logical graph and ``ParallelOptions``; ``parse_mesh`` and
``parse_sbp`` read the command-line forms. The loop that re-plans until the compiled program
fits a memory limit is the driver's (``flowc.compiler.parallelize``): it measures with the
later stages, which this package never imports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from flowc.errors import InputError
from flowc.ir.graph import Graph, Value
from flowc.ir.layout import broadcast, fits, fits_type
from flowc.ir.names import did_you_mean
from flowc.ir.types import Mesh, NdSbp, Sbp, mesh_size_problem
from flowc.parallel.cost import PlanCost, Profile
from flowc.parallel.lower import Physical
from flowc.parallel.plan import Plan

METHODS = ("auto", "data", "none")


def parse_mesh(text: str) -> Mesh:
    """``4`` or ``2x4`` (also ``2,4``) -> Mesh, of at most MAX_MESH_DEVICES devices."""
    parts = [p.strip() for p in re.split(r"[x,]", text.strip().lower())]
    shown = text if len(text) <= 40 else text[:37] + "..."
    # ASCII digits only (str.isdigit takes superscripts), and few enough for int()
    if not all(re.fullmatch(r"[0-9]{1,4300}", p) and int(p) >= 1 for p in parts):
        raise InputError(
            f"--mesh {shown!r}: expected device counts per mesh axis, like 4 or 2x4",
        )
    shape = tuple(int(p) for p in parts)
    problem = mesh_size_problem(shape)
    if problem is not None:
        raise InputError(
            f"--mesh {shown!r}: {problem}",
            hint="give the devices the program runs on, e.g. --mesh 8 or --mesh 2x4",
        )
    return Mesh("gpus", shape)


_ONE = re.compile(r"^\s*(?:S\s*\(\s*(\d+)\s*\)|S\s*(\d+)|(B)|(P))\s*$", re.IGNORECASE)


def parse_sbp(text: str, mesh: Mesh) -> tuple[str, NdSbp]:
    """``NAME=SBP``: ``x=S(0)``, ``x=S0``, ``w=(B,S(1))``, ``w=B,S1`` -> (name, NdSbp)."""
    name, eq, spec = text.rpartition("=")
    if not eq or not name:
        raise InputError(f"--sbp {text!r}: expected NAME=SBP, like x=S(0) or w=(B,S(1))")
    body = spec.strip()
    if body.startswith("(") and body.endswith(")") and not _ONE.match(body):
        body = body[1:-1]
    items = re.split(r",(?![^(]*\))", body)
    parts = []
    for item in items:
        m = _ONE.match(item)
        if m is None:
            raise InputError(
                f"--sbp {text!r}: {item.strip()!r} is not a layout",
                hint="each mesh axis takes S(i) (or Si) to split tensor axis i, B or P",
            )
        axis = m.group(1) or m.group(2)
        parts.append(Sbp("S", int(axis)) if axis is not None else Sbp("B" if m.group(3) else "P"))
    if len(parts) != mesh.ndim:
        raise InputError(
            f"--sbp {text!r}: gives {len(parts)} entr{'y' if len(parts) == 1 else 'ies'} but mesh "
            f"{'x'.join(map(str, mesh.shape))} has {mesh.ndim} axes",
            hint="give one layout per mesh axis, e.g. (S(0), B) on a 2-D mesh",
        )
    return name, NdSbp(tuple(parts))


@dataclass
class ParallelOptions:
    mesh: Mesh
    method: str = "auto"
    sbp: dict[str, NdSbp] = field(default_factory=dict)  # value name -> fixed layout
    mem_limit: int | None = None  # per-device bytes: parameters + arena
    profile: Path | None = None
    # Branch-and-bound nodes the search may use (None: search.NODE_LIMIT); a work limit, so
    # any value keeps the plan reproducible.
    node_limit: int | None = None
    # Compute streams of the compiled rank program, whose arena the memory limit counts
    # (None: the schedule's own choice; see stream_count).
    streams: int | None = None

    def stream_count(self) -> int | None:
        """Under a memory limit one compute stream (its arena is the smallest: concurrent
        branches keep more values alive), unless --streams says otherwise."""
        return self.streams if self.streams is not None or self.mem_limit is None else 1


@dataclass
class Memory:
    """Per-device bytes of a lowered program."""

    params: int
    arena: int

    @property
    def total(self) -> int:
        return self.params + self.arena


@dataclass
class Parallelized:
    plan: Plan
    physical: Physical
    cost: PlanCost
    memory: Memory
    profile: Profile
    attempts: int = 1

    @property
    def proven_optimal(self) -> bool:
        """Whether the search proved its plan optimal (plans it did not search: True)."""
        return bool(self.plan.stats.get("optimal", 1.0))

    @property
    def gap(self) -> float:
        """How much cheaper a plan could still be, as a fraction of this one's modeled time
        (0 when proven optimal; inf when the search had no bound)."""
        return float(self.plan.stats.get("gap", 0.0))

    @property
    def reproducible(self) -> bool:
        """False when the solver's wall-clock backstop, not its node limit, stopped it."""
        return bool(self.plan.stats.get("reproducible", 1.0))


def _fixed(graph: Graph, opts: ParallelOptions) -> dict[Value, NdSbp]:
    by_name = {v.name: v for v in graph.values()}
    out: dict[Value, NdSbp] = {}
    for name, sbp in opts.sbp.items():
        v = by_name.get(name)
        if v is None:
            raise InputError(
                f"--sbp {name}=...: the graph has no value named {name!r}",
                hint=did_you_mean(
                    name, by_name, "`flowc inspect MODEL --print-ir` lists the value names"
                ),
            )
        if fits(v.type.shape, sbp, opts.mesh) and not fits_type(v.type, sbp, opts.mesh):
            raise InputError(
                f"--sbp {name}={sbp}: {v.type} has symbolic dims, which are never split: a "
                "rank's chunk of a dim that changes from run to run would be no fixed size",
                hint="split a fixed dim, or fix the dim with --dim NAME=N",
            )
        if not fits(v.type.shape, sbp, opts.mesh):
            raise InputError(
                f"--sbp {name}={sbp}: does not split {v.type} evenly on mesh {opts.mesh}",
                hint="split only axes whose size divides by the mesh axes that split them",
            )
        if sbp.parts and any(p.kind == "P" for p in sbp.parts) and v in graph.inputs:
            raise InputError(f"--sbp {name}={sbp}: a graph input cannot be partial (P)")
        out[v] = sbp
    return out


def workspace_within(profile: Profile, mem_limit: int | None) -> Profile:
    """The profile whose library workspace (per stream, in the arena) takes at most a 16th
    of a memory limit: cuBLASLt and cuDNN then pick only algorithms that fit (with none at
    all they still run, on fewer algorithms)."""
    if mem_limit is None or profile.workspace <= mem_limit // 16:
        return profile
    import dataclasses

    return dataclasses.replace(profile, workspace=mem_limit // 16 // 256 * 256)


def _with_state(
    graph: Graph, mesh: Mesh, fixed: dict[Value, NdSbp], whole: bool = True
) -> dict[Value, NdSbp]:
    """A training step's state leaves the step as it entered (a constraint of every plan):
    each state input and the output written over it take one layout, whole (B) on every
    device unless --sbp places one of them; with ``whole`` False those --sbp does not place
    are left to the search (which prices the next value's boxing back to the state's
    layout, and counts the state's bytes against the memory limit: ZeRO per tensor)."""
    by_name = {v.name: v for v in graph.values()}
    out = dict(fixed)
    for name, written in graph.state.items():
        x = by_name[name]
        pair = [x] if written is None else [x, by_name[written]]
        layouts = {fixed[v] for v in pair if v in fixed}
        if len(layouts) > 1:
            raise InputError(
                f"--sbp: state {name!r} must leave the step as it enters it, but its input and "
                f"{written!r} are placed {' and '.join(map(str, layouts))}",
                hint="place one of them (the other follows)",
            )
        if not layouts and not whole:
            continue
        layout = layouts.pop() if layouts else broadcast(mesh)
        split_axes = {p.axis for p in layout.parts if p.kind == "S"}
        if len(split_axes) > 1 or any(p.kind == "P" for p in layout.parts):
            raise InputError(
                f"--sbp {name}={layout}: a state splits on one tensor axis (over any of the "
                "mesh axes, whole along the others) or stays whole; never partial",
                hint=f"e.g. --sbp {name}=" + ",".join("S0" for _ in mesh.shape) + ", or B",
            )
        for v in pair:
            out[v] = layout
    return out


def _batch_split(graph: Graph, mesh: Mesh, fixed: dict[Value, NdSbp]) -> dict[Value, NdSbp]:
    """Data parallelism for a training step: the batch inputs split on axis 0 over every
    device, the state as ``fixed`` places it."""
    split = NdSbp(tuple(Sbp("S", 0) for _ in mesh.shape))
    out = dict(fixed)
    for v in graph.inputs:
        if v in out:
            continue
        if v.type.rank == 0 or v.type.shape[0] % mesh.size:
            raise InputError(
                f"data parallelism splits the batch input {v.name!r} ({v.type}) on axis 0 over "
                f"all {mesh.size} devices of mesh {mesh}, but its batch is "
                f"{v.type.shape[0] if v.type.rank else 'none (a scalar)'}",
                hint=f"use a --batch that divides by {mesh.size}",
            )
        out[v] = split
    return out


def make_plan(
    graph: Graph,
    opts: ParallelOptions,
    profile: Profile,
    method: str,
    param_limit: int | None = None,
) -> Plan:
    from flowc.parallel.propagate import propagated_plan
    from flowc.parallel.search import broadcast_plan, data_parallel_plan, search

    fixed = _fixed(graph, opts)
    if method == "none":
        if fixed:
            raise InputError(
                "--sbp placements need --parallel auto or data (none keeps everything whole)"
            )
        return broadcast_plan(graph, opts.mesh)
    if graph.state:
        fixed = _with_state(graph, opts.mesh, fixed, whole=method != "auto")
        if method == "data":
            given = _batch_split(graph, opts.mesh, fixed)
            return propagated_plan(graph, opts.mesh, profile, given, "data")
    if method == "data":
        return data_parallel_plan(graph, opts.mesh, profile, fixed, node_limit=opts.node_limit)
    return search(
        graph,
        opts.mesh,
        profile,
        fixed=fixed,
        param_limit=param_limit,
        node_limit=opts.node_limit,
    )


__all__ = [
    "METHODS",
    "Memory",
    "ParallelOptions",
    "Parallelized",
    "make_plan",
    "parse_mesh",
    "parse_sbp",
]
