"""Stream assignment: which stream each actor of a rank runs on, and in what order.

Collectives and point-to-point transfers run on one communication stream, so compute that
does not need their result overlaps them. Compute actors go to up to N compute streams by
list scheduling: ready actors in order of their upward rank (the longest modeled path from
them to the end), each onto the stream where it could start first (an input from another
stream costs an event). When some actors have release times (a pipeline stage's receives),
the ready actor that can start first goes next instead (ties by upward rank), so a stream
does not queue a receive that comes late ahead of work that could run now. Stream 0 is the
caller's stream. With no N given, the simulator
picks: more streams only when the modeled time drops by more than an event's cost.
"""

from __future__ import annotations

import heapq

from flowc.parallel.cost import Profile
from flowc.schedule.actors import Actor, ActorGraph
from flowc.schedule.program import Schedule, make_schedule
from flowc.schedule.simulate import simulate

MAX_AUTO_STREAMS = 4
COMM_KINDS = frozenset({"collective", "send", "recv", "exchange"})


def upward_rank(ag: ActorGraph) -> list[float]:
    users = ag.users()
    rank = [0.0] * len(ag.actors)
    for a in reversed(ag.actors):
        rank[a.id] = a.time_s + max((rank[u] for u in users[a.id]), default=0.0)
    return rank


def assign(
    ag: ActorGraph,
    compute_streams: int,
    profile: Profile,
    rank: list[float] | None = None,
    comm_stream: bool = True,
) -> tuple[list[int], list[list[int]]]:
    """Stream of each actor and each stream's firing order (compute streams first, then the
    communication stream when there is communication). ``rank``: the ready actors'
    priority, highest first (default: the upward rank). ``comm_stream=False``: transfers
    on the compute streams too (a pipeline stage's exchanges, which must come in its
    order)."""
    has_comm = comm_stream and any(a.kind in COMM_KINDS for a in ag.actors)
    comm = compute_streams
    orders: list[list[int]] = [[] for _ in range(compute_streams + (1 if has_comm else 0))]
    stream_of = [-1] * len(ag.actors)
    end = [0.0] * len(ag.actors)
    free = [0.0] * len(orders)
    rank = upward_rank(ag) if rank is None else rank
    users = ag.users()
    waiting = [len(a.deps) for a in ag.actors]
    ready = [(-rank[a.id], a.id) for a in ag.actors if not a.deps]
    heapq.heapify(ready)
    event = profile.event_overhead
    timed = any(a.release_s > 0 for a in ag.actors)

    def start_on(s: int, actor: Actor) -> float:
        t = max(free[s], actor.release_s)
        for d in actor.deps:
            t = max(t, end[d] + (event if stream_of[d] != s else 0.0))
        return t

    def place(actor: Actor) -> int:
        if has_comm and actor.kind in COMM_KINDS:
            return comm
        # The earliest start; on a tie, the stream of the input that finished last (no
        # event), then the lowest stream.
        last = max(actor.deps, key=lambda d: (end[d], d), default=None)
        home = stream_of[last] if last is not None and stream_of[last] < compute_streams else 0
        return min(range(compute_streams), key=lambda k: (start_on(k, actor), k != home, k))

    while ready:
        if timed:
            # The ready actor that can start first (then by upward rank).
            pick = min(ready, key=lambda e: (start_on(place(ag.actors[e[1]]), ag.actors[e[1]]), e))
            ready.remove(pick)
            heapq.heapify(ready)
            a = pick[1]
        else:
            _, a = heapq.heappop(ready)
        actor = ag.actors[a]
        s = place(actor)
        t = start_on(s, actor)
        stream_of[a] = s
        end[a] = t + actor.time_s
        free[s] = end[a]
        orders[s].append(a)
        for u in users[a]:
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, (-rank[u], u))
    return stream_of, orders


def schedule_actors(
    ag: ActorGraph,
    profile: Profile,
    streams: int | None = None,
    rank: list[float] | None = None,
    comm_stream: bool = True,
) -> Schedule:
    """The rank's schedule on ``streams`` compute streams (at most; unused ones are dropped),
    or on the number the simulator prefers (1 to MAX_AUTO_STREAMS); ``rank`` and
    ``comm_stream`` as in assign."""
    if streams is not None and streams < 1:
        raise ValueError("streams must be at least 1")
    candidates = [streams] if streams is not None else list(range(1, MAX_AUTO_STREAMS + 1))
    best: Schedule | None = None
    for n in candidates:
        stream_of, orders = assign(ag, n, profile, rank, comm_stream)
        stream_of, orders, n_used = _drop_empty(stream_of, orders, n)
        timing = simulate(ag, stream_of, orders, profile)
        sched = make_schedule(ag, stream_of, orders, n_used, timing)
        if best is None or sched.makespan_s < best.makespan_s - profile.event_overhead:
            best = sched
        if n_used < n:
            break  # more streams than the graph's width: nothing more to gain
    assert best is not None
    best.workspace_bytes = profile.workspace
    return best


def _drop_empty(
    stream_of: list[int], orders: list[list[int]], compute: int
) -> tuple[list[int], list[list[int]], int]:
    keep = [s for s in range(len(orders)) if orders[s] or s == 0]
    renumber = {s: k for k, s in enumerate(keep)}
    used = sum(1 for s in keep if s < compute)
    return [renumber[s] for s in stream_of], [orders[s] for s in keep], used
