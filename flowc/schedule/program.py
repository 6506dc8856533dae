"""A rank's schedule as the program it becomes: per stream, the actors in firing order; the
host's issue order; the events between streams; the vector clocks they define.

The simulated start times decide the issue order (a topological order of actors and
stream order). Walking it, each actor's vector clock is what it knows has finished: the
previous actor on its stream, plus, through an event, everything its cross-stream inputs
knew. An input from another stream needs an event (read after write) only when the clock
does not already cover it through an earlier one. Memory planning reuses bytes only along
this happens-before order, so a register reused across streams is always ordered by these
events (write after read) without extra ones.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from flowc.ir.graph import Node
from flowc.schedule.actors import ActorGraph
from flowc.schedule.labels import node_labels
from flowc.schedule.simulate import Timing


@dataclass(frozen=True)
class Event:
    id: int
    record_after: int  # actor whose stream records it once the actor is done
    wait_before: int  # actor whose stream waits for it
    kind: str  # "raw": a register written on one stream, read on another


@dataclass
class Schedule:
    actors: ActorGraph
    num_compute: int  # compute streams 0..num_compute-1 (0 is the caller's stream)
    stream_of: list[int]
    streams: list[list[int]]  # each stream's actors in firing order
    issue: list[int]  # the order the host issues the actors in
    events: list[Event]
    clock: list[tuple[int, ...]]  # per actor: per stream, how many of its actors hb-precede
    pos: list[int]  # per actor: 1-based position on its stream
    start_s: list[float]
    end_s: list[float]
    makespan_s: float
    critical_path: list[int]
    waits: dict[int, list[Event]] = field(default_factory=dict)  # actor -> events before it
    records: dict[int, list[Event]] = field(default_factory=dict)  # actor -> events after it
    # Bytes of library scratch per stream that calls cuBLASLt/cuDNN (the profile's), which
    # the memory plan places in the arena.
    workspace_bytes: int = 0

    @property
    def num_streams(self) -> int:
        return len(self.streams)

    def stream_name(self, s: int) -> str:
        return f"compute{s}" if s < self.num_compute else "comm"

    def hb(self, a: int, b: int) -> bool:
        """Whether actor ``a`` finishes before actor ``b`` starts in every run."""
        return a == b or self.clock[b][self.stream_of[a]] >= self.pos[a]

    def needs_fork(self, s: int) -> bool:
        """Whether stream ``s`` needs an event of its own to start after the run's start on
        stream 0: not when its first actor waits, through the schedule's events, for an
        actor of stream 0 (which stream 0 runs after the start)."""
        return not self.streams[s] or self.clock[self.streams[s][0]][0] == 0

    def needs_join(self, s: int) -> bool:
        """Whether stream ``s`` needs an event of its own to join stream 0 at the end: not
        when its last actor happens before stream 0's last one already."""
        if not self.streams[s]:
            return False
        return not self.streams[0] or not self.hb(self.streams[s][-1], self.streams[0][-1])

    def to_json(self, rank: int = 0, stage: int = 0) -> dict[str, Any]:
        ag = self.actors
        us = 1e6
        # What a person reads for each actor (the Gantt chart's bar labels): the model's
        # name, shortened and unique in this schedule (flowc.schedule.labels); "name" is
        # the node's own, as the trace records it.
        labels = node_labels([a.node for a in ag.actors])
        return {
            "rank": rank,
            "stage": stage,
            "makespan_us": round(self.makespan_s * us, 4),
            "critical_path": list(self.critical_path),
            "streams": [
                {"id": s, "name": self.stream_name(s), "actors": list(order)}
                for s, order in enumerate(self.streams)
            ],
            "actors": [
                {
                    "id": a.id,
                    "name": a.name,
                    "label": labels[a.node],
                    "op": a.op,
                    "kind": a.kind,
                    "stream": self.stream_of[a.id],
                    "stage": a.stage,
                    "microbatch": a.microbatch,
                    "start_us": round(self.start_s[a.id] * us, 4),
                    "end_us": round(self.end_s[a.id] * us, 4),
                    "reads": [ag.registers[r].value.name for r in a.inputs],
                    "writes": [ag.registers[r].value.name for r in a.outputs],
                }
                for a in ag.actors
            ],
            "events": [
                {
                    "id": e.id,
                    "record_after": e.record_after,
                    "wait_before": e.wait_before,
                    "kind": e.kind,
                }
                for e in self.events
            ],
        }


def make_schedule(
    ag: ActorGraph, stream_of: list[int], orders: list[list[int]], num_compute: int, timing: Timing
) -> Schedule:
    n = len(ag.actors)
    pos = [0] * n
    for order in orders:
        for k, a in enumerate(order):
            pos[a] = k + 1
    prev = {order[k]: order[k - 1] for order in orders for k in range(1, len(order))}
    issue = _issue_order(ag, prev, timing)
    ns = len(orders)
    clock: list[tuple[int, ...]] = [()] * n
    last_on: list[tuple[int, ...]] = [(0,) * ns for _ in range(ns)]
    events: list[Event] = []
    for b in issue:
        s = stream_of[b]
        c = list(last_on[s])
        # Latest-finishing inputs first: their clocks tend to cover the others'.
        for a in sorted(ag.actors[b].deps, key=lambda d: (-timing.end[d], d)):
            sa = stream_of[a]
            if sa == s or c[sa] >= pos[a]:
                continue
            events.append(Event(len(events), a, b, "raw"))
            c = [max(x, y) for x, y in zip(c, clock[a], strict=True)]
        c[s] = pos[b]
        clock[b] = tuple(c)
        last_on[s] = clock[b]
    sched = Schedule(
        ag,
        num_compute,
        stream_of,
        orders,
        issue,
        events,
        clock,
        pos,
        timing.start,
        timing.end,
        timing.makespan,
        _critical_path(ag, prev, stream_of, timing),
    )
    for e in events:
        sched.waits.setdefault(e.wait_before, []).append(e)
        sched.records.setdefault(e.record_after, []).append(e)
    return sched


def _issue_order(ag: ActorGraph, prev: dict[int, int], timing: Timing) -> list[int]:
    """Kahn's algorithm over data and stream-order edges, earliest modeled start first: an
    event's record is always issued before its wait."""
    n = len(ag.actors)
    preds = [set(a.deps) for a in ag.actors]
    for b, a in prev.items():
        preds[b].add(a)
    users: list[list[int]] = [[] for _ in range(n)]
    for b in range(n):
        for a in preds[b]:
            users[a].append(b)
    waiting = [len(p) for p in preds]
    ready = [(timing.start[b], b) for b in range(n) if not waiting[b]]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, a = heapq.heappop(ready)
        order.append(a)
        for u in users[a]:
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, (timing.start[u], u))
    if len(order) != n:
        raise ValueError("stream orders contradict the data dependences")
    return order


def _critical_path(
    ag: ActorGraph, prev: dict[int, int], stream_of: list[int], timing: Timing
) -> list[int]:
    """From the last actor to finish back through what held up each start: the input or
    stream predecessor that finished last."""
    if not ag.actors:
        return []
    a: int | None = max(range(len(ag.actors)), key=lambda k: (timing.end[k], -k))
    path: list[int] = []
    while a is not None:
        path.append(a)
        cands = [*ag.actors[a].deps, *([prev[a]] if a in prev else [])]
        a = max(cands, key=lambda d: (timing.end[d], d)) if cands else None
        if a is not None and math.isnan(timing.end[a]):
            break
    return path[::-1]


@dataclass(frozen=True)
class StreamOp:
    """One operation of the emitted program, in the order the host issues it: ``run`` a node
    on a stream, ``record`` an event on a stream, or make a stream ``wait`` for the latest
    record of an event (CUDA's semantics). Code generation lists these beside the C++ it
    writes, so the memory checker can replay exactly what was emitted."""

    kind: str  # "run" | "record" | "wait"
    stream: int
    node: Node | None = None
    event: int = -1
