"""A node order that keeps the memory plan's peak of live bytes low (``--schedule-for memory``).

The peak is counted as the memory plan (flowc.memory.plan) counts its lower bound on a
one-stream order: each output of a node that runs code is allocated at its writer and freed
after its last reader; views (Reshape, Squeeze, ...) are aliases of their base, so reading a
view reads the base and a view costs nothing; graph inputs, outputs and constants are not in
the arena; an element-wise node whose input buffer it reads last (same element count and
width, same aligned size) writes its output into that input's bytes; every size is rounded
up to 256 bytes; the library workspace (cuBLASLt/cuDNN: the largest any call can use, at
most the cap) sits on top of the values for the whole run, the same bytes in every order,
so it adds to every peak and decides nothing. That is ``plan_memory(..., alias=False)``: the plan's
Concat-input and Split/Slice aliases, which it makes only where they do not raise its bound
(and keeps only where the arena does not grow), are not counted, so the plan of the chosen
order can only be lower; the compiler (flowc.compiler.schedule_graph) keeps the exporter's
order where the plan says its arena is smaller. The rules are copied here rather than
imported, because the schedule comes before memory in flowc's data flow;
tests/test_memory_order.py checks them against the plan's own bound on random graphs, so
the two cannot drift apart unnoticed.

The search (Serenity, Ahn et al., MLSys 2020):

* **Divide and conquer.** A node that is an ancestor or a descendant of every other node (the
  graph narrows to it: a residual block's closing Add, each layer of a chain) comes at the
  same place in every topological order, so the order splits there into segments that are
  solved one after another; values crossing a cut are live across it whatever the order,
  and a segment's best order does not depend on the others' (the peak is the largest
  segment peak). This is lossless.
* **Exact dynamic programming** per segment over its downward-closed sets of scheduled
  nodes, level by level (a level: the sets of k nodes). The live bytes after a set depend
  on the set alone, so for each set only the smallest peak reaching it matters. States
  whose peak already reaches the best order known (the exporter's, or a greedy one) are
  dropped: the search only looks for a strictly better order, and if none is left, the
  known one is optimal.
* **Beyond the state bound** (``max_states`` sets made by the exact searches, all segments
  together), a segment is searched again keeping each level's best states by (peak, live
  bytes), about ``max_states`` made over all its levels: a beam search over the same
  states, so the result is at least as good as the greedy and exporter orders, but not
  proven optimal (``exact`` is False).

Ties go to the exporter's order where it is optimal, then to the first order found
expanding ready nodes by their index in the graph, so the result is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowc.ir.graph import Graph, Node, Value
from flowc.ops.registry import get_op, is_view

# flowc.memory.plan's ALIGN and INPLACE_FAMILIES (see the module docstring).
ALIGN = 256
INPLACE_FAMILIES = frozenset({"elementwise"})
# About 6 us a state in CPython: the exact search gives up after 1-2 s, and a beam of the
# same total size takes as long again.
DEFAULT_MAX_STATES = 1 << 18
DEFAULT_BEAM = 64  # the fewest states a beam level keeps (segments of very many levels)

__all__ = ["DEFAULT_MAX_STATES", "MemoryOrder", "memory_order", "order_peak"]


def _aligned(nbytes: int) -> int:
    return max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)


@dataclass
class MemoryOrder:
    """The chosen order and what the search found out about it."""

    nodes: list[Node]  # every node of the graph (views included), topologically ordered
    peak: int  # its peak of live bytes (the memory plan's lower bound on one stream)
    exporter_peak: int  # the same for the graph's own node order
    exact: bool  # no segment hit the state bound: no order has a lower peak
    segments: int  # segments the cut points split the graph into
    largest_segment: int  # nodes that run code in the largest one
    states: int  # dynamic-programming states visited, all segments together


class _Problem:
    """The graph's nodes that run code (actors), in graph order, and what the cost model
    needs of each: dependences (through views), arena values read and written, in-place
    candidates, library calls."""

    def __init__(self, graph: Graph, workspace_bytes: int) -> None:
        self.graph = graph
        # On top of every peak (the plan puts the workspace above the values).
        self.workspace = 0
        outputs = set(graph.outputs)
        external: set[Value] = set(graph.inputs) | set(graph.constants) | outputs
        self.views: list[Node] = []
        self.actors: list[Node] = []
        root: dict[Value, Value] = {}
        producer: dict[Value, int] = {}  # arena value -> its writer
        # The actors each value needs done before it exists (a view: what its inputs need).
        needs: dict[Value, int] = {}
        preds: list[int] = []
        for node in graph.nodes:
            src = node.inputs[0] if node.inputs else None
            mask = 0
            for i in node.inputs:
                if i is not None:
                    mask |= needs.get(i, 0)
            if is_view(graph, node):
                self.views.append(node)
                for o in node.outputs:
                    needs[o] = mask
                if src is not None:
                    root[node.outputs[0]] = root.get(src, src)
                continue
            a = len(self.actors)
            self.actors.append(node)
            preds.append(mask)
            for o in node.outputs:
                needs[o] = 1 << a
                if o not in external:
                    producer[o] = a
        self.preds = preds
        self.writer = producer
        n = len(self.actors)
        self.size: dict[Value, int] = {v: _aligned(v.type.nbytes) for v in producer}
        # reads[a]: the distinct arena values actor a reads (views through their base).
        self.reads: list[list[Value]] = []
        self.readers: dict[Value, list[int]] = {v: [] for v in producer}
        for a, node in enumerate(self.actors):
            seen: list[Value] = []
            for i in node.inputs:
                if i is None:
                    continue
                r = root.get(i, i)
                if r in producer and r not in seen:
                    seen.append(r)
                    self.readers[r].append(a)
            self.reads.append(seen)
        self.out_bytes = [0] * n  # bytes a writes in the arena
        self.out_pending = [0] * n  # of those, the values somebody reads later
        self.inplace: list[list[Value]] = [[] for _ in range(n)]
        self.inplace_bytes = [0] * n
        if workspace_bytes > 0:
            self.workspace = max(
                (
                    _aligned(get_op(n.op).workspace_bytes(n, workspace_bytes))
                    for n in self.actors
                    if get_op(n.op).library
                ),
                default=0,
            )
        for a, node in enumerate(self.actors):
            arena_outs = [o for o in node.outputs if o in producer]
            self.out_bytes[a] = sum(self.size[o] for o in arena_outs)
            self.out_pending[a] = sum(self.size[o] for o in arena_outs if self.readers[o])
            if get_op(node.op).family in INPLACE_FAMILIES and len(node.outputs) == 1 and arena_outs:
                o = arena_outs[0]
                self.inplace_bytes[a] = self.size[o]
                for i in node.inputs:
                    if i is None:
                        continue
                    r = root.get(i, i)
                    if (
                        r in producer
                        and i.type.numel == o.type.numel
                        and i.type.dtype.itemsize == o.type.dtype.itemsize
                        and self.size[r] == self.size[o]
                        and r not in self.inplace[a]
                    ):
                        self.inplace[a].append(r)
        succ: list[list[int]] = [[] for _ in range(n)]
        for a in range(n):
            m = preds[a]
            while m:
                low = m & -m
                succ[low.bit_length() - 1].append(a)
                m ^= low
        self.succ = succ

    def cut_points(self) -> list[int]:
        """Actors that are an ancestor or a descendant of every other actor."""
        n = len(self.actors)
        anc = [0] * n
        for a in range(n):
            m, p = 0, self.preds[a]
            while p:
                low = p & -p
                b = low.bit_length() - 1
                m |= anc[b] | low
                p ^= low
            anc[a] = m
        desc = [0] * n
        for a in reversed(range(n)):
            m = 0
            for s in self.succ[a]:
                m |= desc[s] | (1 << s)
            desc[a] = m
        full = (1 << n) - 1
        return [a for a in range(n) if anc[a] | desc[a] | (1 << a) == full]


class _Segment:
    """Actors lo..hi-1 of the problem (every earlier actor done first, every later one
    after), in local bit positions 0..m-1, with the transition function of the search."""

    def __init__(self, p: _Problem, lo: int, hi: int, base_live: int) -> None:
        self.lo, self.hi, self.m = lo, hi, hi - lo
        self.base_live = base_live
        m = self.m
        self.full = (1 << m) - 1
        self.pred = [(p.preds[a] >> lo) & self.full for a in range(lo, hi)]
        self.succ = [[s - lo for s in p.succ[a] if s < hi] for a in range(lo, hi)]

        def local_mask(v: Value) -> int | None:
            """Readers of v in the segment; None when one comes after the segment (then v
            outlives it: never freed, never overwritten in place here)."""
            mask = 0
            for r in p.readers[v]:
                if r >= hi:
                    return None
                if r >= lo:
                    mask |= 1 << (r - lo)
            return mask

        # Per actor: (readers mask, bytes) of each value it may free, the readers masks of
        # its in-place candidates.
        self.frees: list[list[tuple[int, int]]] = []
        self.cands: list[list[int]] = []
        for a in range(lo, hi):
            fr = []
            for v in p.reads[a]:
                mk = local_mask(v)
                if mk is not None:
                    fr.append((mk, p.size[v]))
            self.frees.append(fr)
            cs = []
            for v in p.inplace[a]:
                mk = local_mask(v)
                if mk is not None:
                    cs.append(mk)
            self.cands.append(cs)
        self.out_bytes = p.out_bytes[lo:hi]
        self.out_pending = p.out_pending[lo:hi]
        self.inplace_bytes = p.inplace_bytes[lo:hi]
        # A bound no order beats: during each actor, the values it reads and the values
        # that outlive the segment are live, and its outputs are written.
        through = {v for v, rs in p.readers.items() if p.writer[v] < lo and rs and rs[-1] >= hi}
        through_bytes = sum(p.size[v] for v in through)
        self.most_ready = 1  # the most actors ready at once along the greedy order
        self.lower_bound = 0
        for k, a in enumerate(range(lo, hi)):
            need = through_bytes + sum(p.size[v] for v in p.reads[a] if v not in through)
            need += self.out_bytes[k] - (self.inplace_bytes[k] if self.cands[k] else 0)
            self.lower_bound = max(self.lower_bound, need)

    def step(self, s: int, t: int, live: int) -> tuple[int, int]:
        """Scheduling local actor t after the set s (live bytes ``live``): the bytes live
        while it runs, and after."""
        tb = 1 << t
        s2 = s | tb
        alloc = self.out_bytes[t]
        for mk in self.cands[t]:
            if mk & ~s2 == 0:
                alloc -= self.inplace_bytes[t]
                break
        during = live + alloc
        after = live + self.out_pending[t]
        for mk, nb in self.frees[t]:
            if mk & ~s2 == 0:
                after -= nb
        return during, after

    def ready_after(self, ready: int, s2: int, t: int) -> int:
        ready &= ~(1 << t)
        for u in self.succ[t]:
            if self.pred[u] & ~s2 == 0:
                ready |= 1 << u
        return ready

    def peak_of(self, order: list[int]) -> tuple[int, int]:
        """The peak of a local order and the live bytes after it."""
        s, live, peak = 0, self.base_live, 0
        for t in order:
            during, live = self.step(s, t, live)
            peak = max(peak, during)
            s |= 1 << t
        return peak, live

    def greedy(self) -> list[int]:
        """Each time the ready actor that leaves the fewest bytes live (then the one with
        the smallest peak while it runs, then the lowest index)."""
        s, live, order = 0, self.base_live, []
        ready = sum(1 << t for t in range(self.m) if self.pred[t] == 0)
        while ready:
            self.most_ready = max(self.most_ready, ready.bit_count())
            best: tuple[int, int, int] | None = None
            r = ready
            while r:
                low = r & -r
                t = low.bit_length() - 1
                r ^= low
                during, after = self.step(s, t, live)
                key = (after, during, t)
                if best is None or key < best:
                    best = key
            assert best is not None
            t = best[2]
            order.append(t)
            s |= 1 << t
            live = best[0]
            ready = self.ready_after(ready, s, t)
        return order

    def search(
        self, bound: int, limit: int | None = None, width: int | None = None
    ) -> tuple[list[int] | None, bool, int]:
        """The order of least peak below ``bound`` (None if there is none); whether the
        search finished (False: more than ``limit`` states, the answer is void); the states
        it made. ``width``: keep at most that many states per level (a beam search, not
        exact)."""
        # State: the set done -> (peak so far, live bytes, ready actors, previous set, actor).
        start_ready = sum(1 << t for t in range(self.m) if self.pred[t] == 0)
        cur: dict[int, tuple[int, int, int, int, int]] = {
            0: (0, self.base_live, start_ready, 0, -1)
        }
        levels = [cur]
        made = 1
        # The transition (see step), inlined: this loop is the search's whole cost.
        out_bytes, out_pending, inplace_bytes = self.out_bytes, self.out_pending, self.inplace_bytes
        cands, frees, succ, pred = self.cands, self.frees, self.succ, self.pred
        for _ in range(self.m):
            nxt: dict[int, tuple[int, int, int, int, int]] = {}
            for s, (peak, live, ready, _s, _t) in cur.items():
                r = ready
                while r:
                    low = r & -r
                    r ^= low
                    t = low.bit_length() - 1
                    s2 = s | low
                    not_done = ~s2
                    during = live + out_bytes[t]
                    for mk in cands[t]:
                        if not mk & not_done:
                            during -= inplace_bytes[t]
                            break
                    if during < peak:
                        during = peak
                    if during >= bound:
                        continue
                    old = nxt.get(s2)
                    if old is None:
                        after = live + out_pending[t]
                        for mk, nb in frees[t]:
                            if not mk & not_done:
                                after -= nb
                        ready2 = ready ^ low
                        for u in succ[t]:
                            if not pred[u] & not_done:
                                ready2 |= 1 << u
                        nxt[s2] = (during, after, ready2, s, t)
                    elif during < old[0]:
                        nxt[s2] = (during, old[1], old[2], s, t)
                if limit is not None and made + len(nxt) > limit:
                    return None, False, made + len(nxt)
            made += len(nxt)
            if width is not None and len(nxt) > width:
                keep = sorted(nxt.items(), key=lambda kv: (kv[1][0], kv[1][1], kv[0]))
                nxt = dict(keep[:width])
            if not nxt:
                return None, True, made
            levels.append(nxt)
            cur = nxt
        order: list[int] = []
        s = self.full
        for level in reversed(levels[1:]):
            _p, _l, _r, s_prev, t = level[s]
            order.append(t)
            s = s_prev
        return order[::-1], True, made


def _segments(p: _Problem) -> list[tuple[int, int]]:
    """Actor ranges between the cut points, each cut point a segment of its own."""
    out: list[tuple[int, int]] = []
    start = 0
    for c in p.cut_points():
        if c > start:
            out.append((start, c))
        out.append((c, c + 1))
        start = c + 1
    if start < len(p.actors):
        out.append((start, len(p.actors)))
    return out


def _with_views(p: _Problem, actors: list[int]) -> list[Node]:
    """The actors in the given order, each view right after the last node it reads (the
    views that read only inputs and constants first), in graph order among themselves."""
    graph = p.graph
    defined: set[Value] = set(graph.inputs) | set(graph.constants)
    waiting = {
        id(v): sum(1 for i in v.inputs if i is not None and i not in defined) for v in p.views
    }
    by_value: dict[Value, list[Node]] = {}
    for v in p.views:
        for i in v.inputs:
            if i is not None and i not in defined:
                by_value.setdefault(i, []).append(v)
    rank = {id(v): k for k, v in enumerate(p.views)}
    out: list[Node] = []

    def release(values: list[Value], ready: list[Node]) -> None:
        for val in values:
            for v in by_value.get(val, []):
                waiting[id(v)] -= 1
                if waiting[id(v)] == 0:
                    ready.append(v)

    def flush(ready: list[Node]) -> None:
        while ready:
            ready.sort(key=lambda v: rank[id(v)])
            v = ready.pop(0)
            out.append(v)
            release(list(v.outputs), ready)

    flush([v for v in p.views if waiting[id(v)] == 0])
    for a in actors:
        node = p.actors[a]
        out.append(node)
        ready: list[Node] = []
        release(list(node.outputs), ready)
        flush(ready)
    return out


def memory_order(
    graph: Graph,
    workspace_bytes: int = 0,
    max_states: int = DEFAULT_MAX_STATES,
    beam: int = DEFAULT_BEAM,
) -> MemoryOrder:
    """The order of ``graph``'s nodes with the least peak of live bytes found (see the module
    docstring); ``workspace_bytes``: the cap on the library workspace, as the memory plan
    takes it.
    The exact searches make at most ``max_states`` states in all; a segment that needs more
    is searched again by a beam of about ``max_states`` states in all (at least ``beam``
    per level)."""
    p = _Problem(graph, workspace_bytes)
    actors: list[int] = []
    peak = exporter_peak = states = largest = 0
    exact = True
    live = 0
    budget = max_states  # states the exact searches may still make, all segments together
    segments = _segments(p)
    for lo, hi in segments:
        seg = _Segment(p, lo, hi, live)
        largest = max(largest, seg.m)
        best = list(range(seg.m))
        best_peak, live = seg.peak_of(best)  # live bytes after it: the same for any order
        exporter_peak = max(exporter_peak, best_peak)
        if seg.m > 1 and best_peak > seg.lower_bound:
            greedy = seg.greedy()
            greedy_peak, _ = seg.peak_of(greedy)
            if greedy_peak < best_peak:
                best, best_peak = greedy, greedy_peak
        if seg.m > 1 and best_peak > seg.lower_bound:
            found, finished, made = seg.search(best_peak, limit=budget)
            budget = max(0, budget - made)
            if not finished:
                # Past the bound: a beam over the same states (no proof of optimality).
                exact = False
                # About max_states states made: each level expands each kept state by
                # up to the ready actors.
                width = max(beam, max_states // (seg.m * seg.most_ready))
                found, _, beam_made = seg.search(best_peak, width=width)
                made += beam_made
            states += made
            if found is not None:
                best = found
                best_peak, _ = seg.peak_of(found)
        peak = max(peak, best_peak)
        actors.extend(lo + t for t in best)
    return MemoryOrder(
        _with_views(p, actors),
        peak + p.workspace,
        exporter_peak + p.workspace,
        exact,
        len(segments),
        largest,
        states,
    )


def order_peak(graph: Graph, nodes: list[Node] | None = None, workspace_bytes: int = 0) -> int:
    """The peak of live bytes of running ``graph``'s nodes in the order ``nodes`` (default:
    the graph's own), as the search counts it."""
    p = _Problem(graph, workspace_bytes)
    index = {id(node): a for a, node in enumerate(p.actors)}
    order = [
        index[id(node)] for node in (graph.nodes if nodes is None else nodes) if id(node) in index
    ]
    if sorted(order) != list(range(len(p.actors))):
        raise ValueError("the order does not list every node of the graph that runs code once")
    return _Segment(p, 0, len(p.actors), 0).peak_of(order)[0] + p.workspace
