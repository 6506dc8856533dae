"""Micro-batch schedules of a pipeline and their event simulation.

A pipeline of P stages runs M micro-batches. Each stage fires a list of **actors** in a fixed
order; an actor is one micro-batch's forward (F) or backward (B) pass over the stage:

- GPipe: every stage runs F0 .. F(M-1) (inference order); with ``backward=True`` the backward
  passes follow once all forwards are done, last micro-batch first (its forward finished last,
  so on the last stage its backward is the first one ready).
- 1F1B (PipeDream-flush): stage s warms up with min(P-s-1, M) forwards, then alternates one
  forward and one backward, then cools down with the remaining backwards. Stage s then holds
  at most P-s micro-batches of activations (forward done, backward not yet), so at most P in
  the whole pipeline, where GPipe with backward holds all M.

Dependencies: F(s, m) reads F(s-1, m)'s output; B(s, m) reads B(s+1, m)'s gradient, and B(s, m)
needs the stage's own F(s, m) (its stashed activations; for the last stage this is the only
input). A value between stages arrives ``transfer_s`` after its producer ends. The transfer
runs beside the compute (a communication stream), so it delays the consumer but does not
occupy either stage; transfers over one link do not contend with each other.

``simulate`` fires each stage's actors in list order, each as soon as its inputs have arrived
and the stage has finished the actor before it, and reports what a static schedule needs:
start/end of every actor, makespan, busy and idle time per stage, the bubble fraction and the
most micro-batches in flight per stage (how many output registers the stage's boundary needs).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Phase(enum.Enum):
    F = "F"  # forward
    B = "B"  # backward


@dataclass(frozen=True)
class Actor:
    """One micro-batch's pass over one stage."""

    stage: int
    microbatch: int
    phase: Phase

    def __str__(self) -> str:
        return f"{self.phase.value}{self.microbatch}@s{self.stage}"


# Per stage, its actors in firing order.
Schedule = list[list[Actor]]


@dataclass(frozen=True)
class Firing:
    """An actor with its modeled start and end (seconds from the start of the step)."""

    stage: int
    microbatch: int
    phase: Phase
    start: float
    end: float

    @property
    def actor(self) -> Actor:
        return Actor(self.stage, self.microbatch, self.phase)


@dataclass
class PipelineRun:
    """The simulation of a schedule."""

    stages: int
    microbatches: int
    firings: list[list[Firing]]  # per stage, in firing order
    makespan: float
    busy_s: list[float]  # per stage: time spent running actors
    max_in_flight: list[int]  # per stage: see in_flight()

    @property
    def idle_s(self) -> list[float]:
        return [self.makespan - b for b in self.busy_s]

    @property
    def bubble(self) -> float:
        """The fraction of stage-time left idle: sum of idle / (stages x makespan)."""
        if self.makespan <= 0:
            return 0.0
        return sum(self.idle_s) / (self.stages * self.makespan)


def _check_counts(stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise ValueError(
            f"a pipeline needs stages >= 1 and microbatches >= 1, got {stages}, {microbatches}"
        )


def gpipe(stages: int, microbatches: int, backward: bool = False) -> Schedule:
    """GPipe: all forwards in micro-batch order, then (training) all backwards, last first."""
    _check_counts(stages, microbatches)
    out: Schedule = []
    for s in range(stages):
        order = [Actor(s, m, Phase.F) for m in range(microbatches)]
        if backward:
            order += [Actor(s, m, Phase.B) for m in reversed(range(microbatches))]
        out.append(order)
    return out


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B: stage s runs min(P-s-1, M) warm-up forwards, then forward/backward pairs, then the
    cool-down backwards."""
    _check_counts(stages, microbatches)
    out: Schedule = []
    for s in range(stages):
        warm = min(stages - s - 1, microbatches)
        order = [Actor(s, m, Phase.F) for m in range(warm)]
        for i in range(microbatches - warm):
            order += [Actor(s, warm + i, Phase.F), Actor(s, i, Phase.B)]
        order += [Actor(s, m, Phase.B) for m in range(microbatches - warm, microbatches)]
        out.append(order)
    return out


def dependencies(actor: Actor, stages: int) -> list[Actor]:
    """The actors whose results ``actor`` reads (see the module docstring)."""
    s, m = actor.stage, actor.microbatch
    if actor.phase is Phase.F:
        return [Actor(s - 1, m, Phase.F)] if s > 0 else []
    deps = [Actor(s, m, Phase.F)]
    if s < stages - 1:
        deps.append(Actor(s + 1, m, Phase.B))
    return deps


def _per_stage(x: float | Sequence[float], n: int, what: str) -> list[float]:
    vals = [float(x)] * n if isinstance(x, (int, float)) else [float(v) for v in x]
    if len(vals) != n:
        raise ValueError(f"{what}: expected {n} values (one per stage), got {len(vals)}")
    if any(v < 0 for v in vals):
        raise ValueError(f"{what}: times must be >= 0, got {vals}")
    return vals


def validate(schedule: Schedule, microbatches: int) -> None:
    """Raises ValueError unless every stage lists each of its actors exactly once: F for every
    micro-batch, and B for all of them or none (the same choice on every stage)."""
    stages = len(schedule)
    _check_counts(stages, microbatches)
    phases = {a.phase for order in schedule for a in order}
    want_phases = [Phase.F, Phase.B] if Phase.B in phases else [Phase.F]
    for s, order in enumerate(schedule):
        want = [Actor(s, m, p) for p in want_phases for m in range(microbatches)]
        if set(order) != set(want) or len(order) != len(want):
            raise ValueError(
                f"stage {s}: the schedule must list {', '.join(map(str, want))} once each"
            )


def simulate(
    schedule: Schedule,
    microbatches: int,
    forward_s: float | Sequence[float],
    backward_s: float | Sequence[float] = 0.0,
    transfer_s: float | Sequence[float] = 0.0,
) -> PipelineRun:
    """Fires ``schedule`` (per stage, actors in order) with per-stage F and B times and the
    transfer time of each cut (one value, or P-1: cut c between stages c and c+1).

    Raises ValueError for a malformed schedule or one that deadlocks (an actor ordered before
    one it depends on, on its own stage or through another)."""
    validate(schedule, microbatches)
    stages = len(schedule)
    f_s = _per_stage(forward_s, stages, "forward_s")
    b_s = _per_stage(backward_s, stages, "backward_s")
    x_s = _per_stage(transfer_s, stages - 1, "transfer_s") if stages > 1 else []
    done: dict[Actor, float] = {}
    firings: list[list[Firing]] = [[] for _ in range(stages)]
    free = [0.0] * stages
    pos = [0] * stages
    remaining = sum(len(o) for o in schedule)
    while remaining:
        progressed = False
        for s in range(stages):
            while pos[s] < len(schedule[s]):
                a = schedule[s][pos[s]]
                ready = 0.0
                blocked = False
                for d in dependencies(a, stages):
                    if d not in done:
                        blocked = True
                        break
                    hop = 0.0 if d.stage == s else x_s[min(d.stage, s)]
                    ready = max(ready, done[d] + hop)
                if blocked:
                    break
                start = max(ready, free[s])
                end = start + (f_s[s] if a.phase is Phase.F else b_s[s])
                done[a] = end
                free[s] = end
                firings[s].append(Firing(s, a.microbatch, a.phase, start, end))
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [str(schedule[s][pos[s]]) for s in range(stages) if pos[s] < len(schedule[s])]
            raise ValueError(f"the schedule deadlocks: {', '.join(stuck)} wait for each other")
    makespan = max((f.end for fs in firings for f in fs), default=0.0)
    busy = [sum(f.end - f.start for f in fs) for fs in firings]
    return PipelineRun(
        stages, microbatches, firings, makespan, busy, in_flight(firings, x_s, stages)
    )


def in_flight(firings: list[list[Firing]], transfer_s: Sequence[float], stages: int) -> list[int]:
    """Per stage, the most micro-batches held at once. With backward passes a micro-batch is
    held from its F's start to its B's end (stashed activations); forward only, from its F's
    start until its output has reached the next stage (the register is then free; the last
    stage's until its F ends)."""
    out = []
    for s, fs in enumerate(firings):
        start: dict[int, float] = {}
        end: dict[int, float] = {}
        training = any(f.phase is Phase.B for f in fs)
        for f in fs:
            if f.phase is Phase.F:
                start[f.microbatch] = f.start
                if not training:
                    end[f.microbatch] = f.end + (transfer_s[s] if s < stages - 1 else 0.0)
            else:
                end[f.microbatch] = f.end
        # Sweep: at equal times a release comes before an acquire (the register is reused).
        events = sorted([(t, 1) for t in start.values()] + [(t, -1) for t in end.values()])
        level = peak = 0
        for _, d in events:
            level += d
            peak = max(peak, level)
        out.append(peak)
    return out
