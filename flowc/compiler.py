"""The compile driver: frontend -> passes -> parallel -> schedule -> memory -> codegen ->
write, in that order, each stage handed the previous one's result.

Nothing downstream calls back up: code generation gets the schedule and the memory plan it
writes down, the memory planner gets the schedule's happens-before order, the schedule gets
the (rank) graph. Each stage is timed for ``--print-pass-times``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from flowc.codegen.program import WeightsLayout, generate
from flowc.codegen.project import check_project_dir, write_project
from flowc.ir.graph import Graph
from flowc.memory.plan import MemoryPlan, Order, plan_memory
from flowc.parallel.cost import Profile, load_profile
from flowc.schedule.actors import build_actor_graph
from flowc.schedule.program import Schedule, StreamOp
from flowc.schedule.streams import schedule_actors

if TYPE_CHECKING:
    from flowc.parallel.lower import Physical

T = TypeVar("T")


@dataclass
class StageTimes:
    """Seconds per stage, in the order they ran (a stage run twice adds up)."""

    stages: list[tuple[str, float]] = field(default_factory=list)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stages.append((name, time.perf_counter() - t0))

    def run(self, name: str, fn: Callable[[], T]) -> T:
        with self.stage(name):
            return fn()

    def lines(self) -> list[str]:
        total = sum(s for _, s in self.stages)
        out = [f"  {name}: {s * 1e3:.1f} ms" for name, s in self.stages]
        return [*out, f"  total: {total * 1e3:.1f} ms"]


@dataclass
class Compiled:
    graph: Graph
    physical: Physical | None
    schedule: Schedule
    memory: MemoryPlan
    files: dict[str, str]
    weights: list[WeightsLayout]
    program: list[StreamOp]  # the emitted stream operations (the memory checker's input)


def schedule_graph(
    graph: Graph, profile: Profile | None = None, streams: int | None = None
) -> Schedule:
    """A rank graph's actors, simulated on ``streams`` compute streams (None: the
    simulator's choice)."""
    profile = load_profile() if profile is None else profile
    return schedule_actors(build_actor_graph(graph, profile), profile, streams)


def plan_schedule(schedule: Schedule) -> MemoryPlan:
    """The memory plan along ``schedule``'s happens-before order."""
    return plan_memory(schedule.actors.graph, Order.of(schedule))


def arena_bytes(graph: Graph, profile: Profile | None = None) -> int:
    """The arena a rank graph needs as compiled (for the placement search's memory limit)."""
    return plan_schedule(schedule_graph(graph, profile)).arena_bytes


def generate_program(
    graph: Graph,
    *,
    physical: Physical | None = None,
    prefix: str | None = None,
    source: str = "",
    arch: str = "90",
    poison: bool = False,
    streams: int | None = None,
    profile: Profile | None = None,
    times: StageTimes | None = None,
) -> Compiled:
    """Schedule, plan memory for, and generate the program of ``graph`` (for a multi-rank
    program, its rank graph with ``physical``)."""
    times = StageTimes() if times is None else times
    profile = load_profile() if profile is None else profile
    sched = times.run("schedule", lambda: schedule_graph(graph, profile, streams))
    memory = times.run("memory plan", lambda: plan_schedule(sched))
    files, weights, ops = times.run(
        "code generation",
        lambda: generate(
            graph,
            sched,
            memory,
            prefix=prefix,
            source=source,
            arch=arch,
            poison=poison,
            physical=physical,
        ),
    )
    return Compiled(graph, physical, sched, memory, files, weights, ops)


def compile_graph(
    graph: Graph,
    out: Path,
    prefix: str | None = None,
    source: str = "",
    arch: str = "90",
    poison: bool = False,
    physical: Physical | None = None,
    force: bool = False,
    streams: int | None = None,
    times: StageTimes | None = None,
) -> Compiled:
    """Write OUT/ for ``graph``. ``poison`` fills dead arena bytes with NaN between uses and
    lets FLOWC_DROP_EVENT drop an event (debugging aids the tests use). OUT/ keeps what
    flowc did not write (see codegen/project.py); ``force`` allows a non-empty OUT/ that is
    no flowc project."""
    times = StageTimes() if times is None else times
    check_project_dir(out, force)  # before the (slow) generation
    compiled = generate_program(
        graph,
        physical=physical,
        prefix=prefix,
        source=source,
        arch=arch,
        poison=poison,
        streams=streams,
        times=times,
    )
    times.run("write", lambda: write_project(out, compiled.files, compiled.weights, force=force))
    return compiled
