"""The compile-time simulation of a rank's actors on its streams.

Each stream runs its actors in order; an actor starts once the previous one on its stream
has finished, every actor it reads from has finished (plus one event's cost when that
actor ran on another stream) and its release time (a receive: when the sender sends) has
come. Concurrent kernels share the device: each occupies its share
(its blocks against what the SMs hold at once), and while the running shares sum past 1
every running actor progresses at 1/sum of its solo speed -- so overlapping two kernels
that each fill the device gains nothing, and overlapping small ones does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flowc.parallel.cost import Profile
from flowc.schedule.actors import ActorGraph


@dataclass
class Timing:
    start: list[float]
    end: list[float]
    makespan: float


def simulate(
    ag: ActorGraph, stream_of: list[int], orders: list[list[int]], profile: Profile
) -> Timing:
    n = len(ag.actors)
    start = [math.nan] * n
    end = [math.nan] * n
    head = [0] * len(orders)
    remaining: dict[int, float] = {}
    now = 0.0
    done = 0
    event = profile.event_overhead

    def available(a: int) -> float | None:
        """When actor ``a`` may start, or None while something it needs is unfinished."""
        t = ag.actors[a].release_s
        for d in ag.actors[a].deps:
            if math.isnan(end[d]):
                return None
            t = max(t, end[d] + (event if stream_of[d] != stream_of[a] else 0.0))
        return t

    while done < n:
        # Start every stream head that may start now.
        busy = {stream_of[a] for a in remaining}
        wake = math.inf
        for s, order in enumerate(orders):
            if s in busy or head[s] >= len(order):
                continue
            a = order[head[s]]
            t = available(a)
            if t is None:
                continue
            if t <= now + 1e-15:
                start[a] = now
                remaining[a] = ag.actors[a].time_s
            else:
                wake = min(wake, t)
        if not remaining:
            if wake == math.inf:
                raise ValueError("the stream orders wait on each other (not a topological order)")
            now = wake
            continue
        load = sum(ag.actors[a].share for a in remaining)
        rate = 1.0 / max(1.0, load)
        step = min(min(r / rate for r in remaining.values()), wake - now)
        now += step
        finished = []
        for a in remaining:
            remaining[a] -= step * rate
            if remaining[a] <= 1e-15:
                finished.append(a)
        for a in finished:
            del remaining[a]
            end[a] = now
            s = stream_of[a]
            head[s] += 1
            done += 1
    return Timing(start, end, max(end, default=0.0))
