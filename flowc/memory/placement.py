"""Static memory placement over plain intervals: give every buffer a byte offset so that no
two buffers live at the same time share a byte, with the peak (the arena) as low as the
work limit allows.

This module stands alone: it imports the standard library and NumPy only (no other flowc
module), so code generation, the CLI and outside tools can use it without the compiler.

A buffer is an :class:`Interval`: live on the half-open step interval ``[start, end)`` and
needing ``size`` bytes at an offset that is a multiple of ``align``. Two buffers conflict when
their step intervals intersect (one ending at ``t`` and one starting at ``t`` do not) and both
have bytes.

:func:`place` works in two stages:

1. **Greedy.** Buffers are placed one by one, each in a gap between the already placed
   buffers it conflicts with, for several orderings (size, lifetime length, number of
   conflicts, area, the fullest time step it lives through) and two gap rules (best fit:
   the tightest gap that holds it; first fit: the lowest), keeping the lowest peak -- as
   XLA's heap simulator tries several orderings and keeps the best.
2. **Search.** A depth-first search over *canonical* placements, after MiniMalloc (Moffitt,
   ASPLOS 2023): any placement can be pushed down until every buffer rests on one it
   conflicts with (or on 0) without raising the peak, and then the buffers, taken in order
   of offset, each sit at the lowest aligned offset above the buffers placed before them.
   So the search only ever chooses *which* buffer comes next; its offset follows. Offsets
   never decrease along a branch (buffers at one offset come in a fixed order), a buffer is
   never placed at or above the top some unplaced buffer would have at its own lowest
   offset (that buffer could go below it: a needless gap), and a branch dies as soon as
   some time step's floor plus the bytes still to place there exceeds the target; when
   the buffer just placed has no unplaced buffer above it, its alternatives are not tried
   (a failure there is not its fault). Each decision "does everything fit in C bytes?" is
   searched first for the capacity asked for, then for a shrinking C (binary search
   between the highest C that failed and the best peak) while the work limit lasts. Each
   decision tries several tie-break orders in turn with a node limit that doubles (one
   order often finishes in a single dive where another thrashes). After each placement,
   the unplaced buffers that no longer share a time step split into groups searched one
   after the other, so a failing group never makes the search retry another group's
   choices (MiniMalloc's dynamic decomposition). Two strategies (dynamic TWA and
   TWC, as MiniMalloc's SubSolve) search each such group afresh: from its own lowest
   offsets, ranked by the bytes still to place in its fullest section rather than the
   initial ones.

The work limit counts search nodes, never seconds, so the result is the same on every run
and machine. A placement is ``optimal`` when its peak equals the lower bound, or when the
search exhausted the next lower target without reaching the limit.

The lower bound is the maximum over time of the summed sizes of the live buffers, sizes as
given (not rounded up to their alignment): it holds for any placement, aligned or not.

:func:`check_placement` verifies a placement independently of the placer (a sweep over
time with a pairwise byte-range test of the live buffers).

One idea: interval placement; kept whole because it stands alone (see above) and the
search, its bounds and the CSV form share the Interval/Placement records.
"""

from __future__ import annotations

import contextlib
import csv
import os
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DEFAULT_WORK_LIMIT",
    "Interval",
    "Placement",
    "PlacementError",
    "check_placement",
    "lower_bound",
    "place",
    "read_csv",
    "write_offsets_csv",
]

# Search nodes for place()'s default: at most about 4 s of CPython on each MiniMalloc
# instance (154-454 buffers; bench/minimalloc_bench.py on 2 cores, up to 11 s when other
# jobs load them); no search at all where the greedy stage already reaches the bound.
DEFAULT_WORK_LIMIT = 40_000


class PlacementError(ValueError):
    """A placement (or its input) is invalid: the message names the buffers and why."""


@dataclass(frozen=True)
class Interval:
    """A buffer live on the half-open step interval ``[start, end)``, needing ``size`` bytes
    at an offset that is a multiple of ``align``."""

    id: int
    start: int
    end: int
    size: int
    align: int = 1


@dataclass
class Placement:
    offsets: dict[int, int]  # id -> byte offset
    peak: int  # max(offset + size), 0 for no buffers
    lower_bound: int  # max over time of the live bytes (sizes as given)
    strategy: str  # which strategy produced the offsets, for reports
    optimal: bool  # peak == lower_bound, or the search proved no lower peak exists


# -- validation, lower bound, checker --------------------------------------------------------


def _validate(intervals: Sequence[Interval]) -> None:
    seen: set[int] = set()
    for iv in intervals:
        if iv.id in seen:
            raise PlacementError(f"buffer {iv.id}: duplicate id")
        seen.add(iv.id)
        if iv.end < iv.start:
            raise PlacementError(f"buffer {iv.id}: end {iv.end} before start {iv.start}")
        if iv.size < 0:
            raise PlacementError(f"buffer {iv.id}: negative size {iv.size}")
        if iv.align < 1:
            raise PlacementError(f"buffer {iv.id}: alignment {iv.align} is not positive")


def _live(iv: Interval) -> bool:
    """Whether a buffer can conflict with anything: it has bytes and a non-empty lifetime."""
    return iv.size > 0 and iv.end > iv.start


def lower_bound(intervals: Iterable[Interval]) -> int:
    """The maximum over time of the summed sizes of the live buffers (half-open lifetimes:
    a buffer ending at t and one starting at t are never counted together)."""
    events: list[tuple[int, int]] = []
    for iv in intervals:
        if _live(iv):
            events.append((iv.start, iv.size))
            events.append((iv.end, -iv.size))
    # At equal times the ends (negative) sort before the starts.
    events.sort()
    best = cur = 0
    for _, delta in events:
        cur += delta
        best = max(best, cur)
    return best


def check_placement(
    intervals: Iterable[Interval], offsets: dict[int, int], *, capacity: int | None = None
) -> None:
    """Raise PlacementError unless every buffer has a non-negative offset that is a multiple
    of its alignment, fits ``capacity`` (when given), and no two buffers live at the same
    time share a byte."""
    ivs = list(intervals)
    problems: list[str] = []
    for iv in ivs:
        if iv.id not in offsets:
            problems.append(f"buffer {iv.id}: no offset")
            continue
        off = offsets[iv.id]
        if off < 0:
            problems.append(f"buffer {iv.id}: negative offset {off}")
        if iv.align > 1 and off % iv.align:
            problems.append(f"buffer {iv.id}: offset {off} is not a multiple of {iv.align}")
        if capacity is not None and off + iv.size > capacity:
            problems.append(
                f"buffer {iv.id}: bytes [{off}, {off + iv.size}) exceed capacity {capacity}"
            )
    # Sweep: at each start, compare the new buffer's bytes with every buffer live then.
    # Ends at t come before starts at t (half-open lifetimes).
    events = sorted(
        ((iv.start, 1, k) for k, iv in enumerate(ivs) if _live(iv) and iv.id in offsets),
        key=lambda e: e[0],
    )
    ends = sorted(
        ((iv.end, k) for k, iv in enumerate(ivs) if _live(iv) and iv.id in offsets),
    )
    live: set[int] = set()
    ei = 0
    for t, _, k in events:
        while ei < len(ends) and ends[ei][0] <= t:
            live.discard(ends[ei][1])
            ei += 1
        a = ivs[k]
        ao = offsets[a.id]
        for j in live:
            b = ivs[j]
            bo = offsets[b.id]
            if ao < bo + b.size and bo < ao + a.size:
                problems.append(
                    f"buffers {a.id} and {b.id} are both live at step {t} and share bytes "
                    f"[{max(ao, bo)}, {min(ao + a.size, bo + b.size)})"
                )
                if len(problems) > 20:
                    break
        live.add(k)
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise PlacementError("invalid placement: " + "; ".join(problems[:10]) + more)


# -- the problem, preprocessed ------------------------------------------------------------------


class _Problem:
    """The live buffers as arrays: sizes, alignments, the half-open range of time sections
    each covers (a section lies between consecutive distinct endpoints), and each buffer's
    conflicting buffers."""

    def __init__(self, ivs: list[Interval]) -> None:
        self.ivs = ivs
        n = len(ivs)
        self.n = n
        self.size = np.array([iv.size for iv in ivs], dtype=np.int64)
        self.align = np.array([iv.align for iv in ivs], dtype=np.int64)
        start = np.array([iv.start for iv in ivs], dtype=np.int64)
        end = np.array([iv.end for iv in ivs], dtype=np.int64)
        self.start, self.end = start, end
        points = np.unique(np.concatenate([start, end])) if n else np.zeros(0, np.int64)
        self.lo = np.searchsorted(points, start).astype(np.int64)
        self.hi = np.searchsorted(points, end).astype(np.int64)
        self.nsec = max(len(points) - 1, 0)
        # Section totals (the bytes live in each section) from a difference array; no
        # dense section x buffer matrix, so thousands of buffers stay cheap.
        diff = np.zeros(self.nsec + 1, dtype=np.int64)
        np.add.at(diff, self.lo, self.size)
        np.add.at(diff, self.hi, -self.size)
        self.total = np.cumsum(diff)[:-1]
        # Conflicting buffers: those starting before i ends (a prefix in start order) and
        # ending after i starts.
        by_start = np.argsort(start, kind="stable")
        sorted_start = start[by_start]
        self.nbrs = []
        for i in range(n):
            cand = by_start[: np.searchsorted(sorted_start, end[i], side="left")]
            cand = cand[end[cand] > start[i]]
            self.nbrs.append(np.sort(cand[cand != i]))
        # The fullest section each buffer lives through (MiniMalloc's "total").
        self.fullest = np.array(
            [int(self.total[self.lo[i] : self.hi[i]].max()) for i in range(n)], dtype=np.int64
        )

    def components(self) -> list[list[int]]:
        """Groups of buffers whose lifetimes chain together; no buffer crosses between two
        groups' time ranges, so each can be placed on its own from offset 0."""
        order = sorted(range(self.n), key=lambda i: (int(self.start[i]), int(self.end[i])))
        groups: list[list[int]] = []
        reach = None
        for i in order:
            if reach is None or self.start[i] >= reach:
                groups.append([])
                reach = int(self.end[i])
            groups[-1].append(i)
            reach = max(reach, int(self.end[i]))
        return groups


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


# -- greedy -------------------------------------------------------------------------------------


def _greedy(p: _Problem, order: Sequence[int], best_fit: bool) -> list[int]:
    """Place the buffers in ``order``, each in a gap among the placed buffers it conflicts
    with: the tightest gap that holds it (best fit) or the lowest (first fit); above them all
    when no gap does."""
    n = p.n
    off = [-1] * n
    size = p.size.tolist()
    align = p.align.tolist()
    nbrs = [x.tolist() for x in p.nbrs]
    for i in order:
        blocks = sorted((off[j], off[j] + size[j]) for j in nbrs[i] if off[j] >= 0)
        s, a = size[i], align[i]
        choice = -1
        choice_gap = -1
        cur = 0
        for b0, b1 in blocks:
            o = _round_up(cur, a)
            if o + s <= b0:
                gap = b0 - cur
                if not best_fit:
                    choice = o
                    break
                if choice < 0 or gap < choice_gap:
                    choice, choice_gap = o, gap
            cur = max(cur, b1)
        if choice < 0:
            choice = _round_up(cur, a)
        off[i] = choice
    return off


def _orderings(p: _Problem) -> list[tuple[str, list[int]]]:
    n = p.n
    size = p.size.tolist()
    life = (p.end - p.start).tolist()
    nconf = [len(x) for x in p.nbrs]
    area = (p.size * (p.end - p.start)).tolist()
    fullest = p.fullest.tolist()
    start = p.start.tolist()
    idx = range(n)
    return [
        ("size", sorted(idx, key=lambda i: (-size[i], -life[i], start[i], i))),
        ("lifetime", sorted(idx, key=lambda i: (-life[i], -size[i], start[i], i))),
        ("conflicts", sorted(idx, key=lambda i: (-nconf[i], -size[i], start[i], i))),
        ("area", sorted(idx, key=lambda i: (-area[i], -size[i], start[i], i))),
        ("fullest", sorted(idx, key=lambda i: (-fullest[i], -size[i], -life[i], i))),
    ]


def _peak_of(p: _Problem, off: Sequence[int]) -> int:
    return int(max((o + s for o, s in zip(off, p.size.tolist(), strict=True)), default=0))


# -- canonical search ---------------------------------------------------------------------------


class _OutOfWork(Exception):
    pass


class _Search:
    """MiniMalloc-style decision search on one group of buffers: is there a placement within
    ``capacity`` bytes? Counts its nodes (``nodes``) against the budget it is given."""

    def __init__(self, p: _Problem, members: list[int]) -> None:
        self.members = np.array(members, dtype=np.int64)
        m = len(members)
        self.m = m
        self.size = p.size[self.members]
        self.align = p.align[self.members]
        lo = p.lo[self.members]
        hi = p.hi[self.members]
        s0, s1 = int(lo.min()), int(hi.max())
        self.lo = (lo - s0).astype(np.int64)
        self.hi = (hi - s0).astype(np.int64)
        self.nsec = s1 - s0
        size = self.size
        diff = np.zeros(self.nsec + 1, dtype=np.int64)
        np.add.at(diff, self.lo, size)
        np.add.at(diff, self.hi, -size)
        self.total0 = np.cumsum(diff)[:-1]
        # (section, buffer) pairs grouped by section, for per-section minima in one call;
        # busy: the sections some buffer lives in.
        counts = self.hi - self.lo
        bufs = np.repeat(np.arange(m, dtype=np.int64), counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        secs = np.repeat(self.lo, counts) + (np.arange(len(bufs), dtype=np.int64) - first)
        order = np.lexsort((bufs, secs))
        secs, bufs = secs[order], bufs[order]
        self.busy = np.unique(secs)
        self.pair_buf = bufs
        self.pair_start = np.searchsorted(secs, self.busy).astype(np.int64)
        local = np.full(p.n, -1, dtype=np.int64)
        local[self.members] = np.arange(m)
        # Every neighbour lives in the same group (groups are apart in time).
        self.nbrs = [local[p.nbrs[int(g)]] for g in self.members]
        # Static orders to break ties at one offset, tried in turn: MiniMalloc's TWA, WAT
        # and TAW (the fullest section's Total, lifetime Width, Area; larger first), and
        # sweeps in time (latest end first, earliest start first, latest start first).
        # No one order suits every instance: on the MiniMalloc set each of these is the
        # first to fit at least one instance in a single dive; the most useful come first.
        start = p.start[self.members]
        end = p.end[self.members]
        width = end - start
        self.keys = {
            "T": p.fullest[self.members],
            "W": width,
            "A": self.size * width,
            "Z": self.size,
            "E": end,
            "-S": -start,
            "S": start,
            "C": self.hi - self.lo,
        }
        # Tie-break strategies tried in turn: (keys, dynamic). Static: one rank for the whole
        # search. Dynamic (MiniMalloc's SubSolve): whenever a placement splits the unplaced
        # buffers into groups apart in time, each group is searched afresh from its lowest
        # offsets with a rank recomputed from what is left -- "T" then means the fullest
        # section's bytes still to place. On the MiniMalloc set, dynamic TWA fits I in
        # about 1,800 nodes where no static order does in 25,000, but loses F (static TWA:
        # about 300). The third key matters too: E's 131-buffer group takes 18,196 nodes
        # with TWA and 532 with TWC (C: the number of sections spanned, MiniMalloc's
        # "sections"). No one order suits every instance, so each strategy here is the
        # first to fit at least one of them; TWC comes last, where it costs the others'
        # binary search least (third, it left C at 1.003x instead of its lower bound).
        self.strategies: list[tuple[tuple[str, str, str], bool]] = [
            (("T", "W", "A"), False),
            (("T", "W", "A"), True),
            (("W", "A", "T"), False),
            (("E", "W", "A"), False),
            (("-S", "A", "W"), False),
            (("-S", "Z", "W"), False),
            (("S", "W", "A"), False),
            (("T", "A", "W"), False),
            (("T", "W", "C"), True),
        ]
        self.ranks = [self._rank(keys, np.arange(m), None) for keys, _ in self.strategies]
        self.nodes = 0

    def _rank(
        self, names: tuple[str, str, str], ids: np.ndarray, fullest: np.ndarray | None
    ) -> np.ndarray:
        """Ranks 0.. of buffers ``ids`` by three keys, larger first (then by index); with
        ``fullest``, the "T" key is that array (one entry per id) instead of the static one."""
        cols = [fullest if (k == "T" and fullest is not None) else self.keys[k][ids] for k in names]
        order = np.lexsort((ids, -cols[2], -cols[1], -cols[0]))
        rank = np.empty(len(ids), dtype=np.int64)
        rank[order] = np.arange(len(ids))
        return rank

    def solve(self, capacity: int, budget: int) -> tuple[list[int] | None, bool]:
        """(offsets, exhausted): offsets when a placement within ``capacity`` was found.
        Round robin over the tie-break orders with a node limit doubling from 2 per buffer
        (as MiniMalloc): an order that suits the instance finishes early. exhausted is True
        when one search ran to its end without a placement (so there is none). Raises
        _OutOfWork when the budget is spent; ``nodes`` then holds what was used."""
        used = 0
        self.nodes = 0
        if (self.size > capacity).any() or (self.total0 > capacity).any():
            return None, True
        limit = self.m
        while True:
            limit *= 2
            for (names, dynamic), rank in zip(self.strategies, self.ranks, strict=True):
                take = min(limit, budget - used)
                if take <= 0:
                    self.nodes = used
                    raise _OutOfWork
                try:
                    sol, exhausted = self._dfs(capacity, take, rank, names if dynamic else None)
                except _OutOfWork:
                    used += take
                    continue
                self.nodes += used
                return sol, exhausted

    def _dfs(
        self,
        capacity: int,
        limit: int,
        rank: np.ndarray,
        dynamic: tuple[str, str, str] | None,
    ) -> tuple[list[int] | None, bool]:
        """One depth-first search with one tie-break order; raises _OutOfWork past
        ``limit`` nodes. After each placement, the unplaced buffers that no longer share a
        section with each other split into groups searched one after the other: a group
        that fails fails the placement, without retrying the other groups' choices
        (MiniMalloc's dynamic decomposition). With ``dynamic`` (the rank's keys), each such
        group starts afresh (any offset, its own rank from the bytes left to place)."""
        m = self.m
        rank = rank.copy()  # dynamic groups rewrite their members' ranks
        size = self.size
        align = self.align
        big = np.iinfo(np.int64).max // 4
        min_off = np.zeros(m, dtype=np.int64)
        placed = np.zeros(m, dtype=bool)
        offset = np.full(m, -1, dtype=np.int64)
        floor = np.zeros(self.nsec, dtype=np.int64)
        total = self.total0.copy()
        busy, pair_buf = self.busy, self.pair_buf
        # Pair ranges per busy section (one past the end appended), and each section's
        # first busy index at or after it.
        pstart = np.append(self.pair_start, len(pair_buf))
        bpos = np.searchsorted(busy, np.arange(self.nsec + 1))
        # min_off with placed buffers out of the way, for the per-section minima.
        eff = min_off.copy()
        lo, hi = self.lo, self.hi
        nbrs = self.nbrs
        trail: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
        self.nodes = 0

        def check(cur: int, s0: int, s1: int) -> bool:
            # Each section's floor: above the placed buffers there, at least the lowest
            # offset an unplaced buffer there can take, and (offsets never decrease along
            # a branch) at least the current offset. Floor plus the bytes still to place
            # there must fit. Checked over sections [s0, s1) only.
            k0, k1 = int(bpos[s0]), int(bpos[s1])
            if k0 == k1:
                return True
            p0, p1 = int(pstart[k0]), int(pstart[k1])
            low = np.minimum.reduceat(eff[pair_buf[p0:p1]], pstart[k0:k1] - p0)
            secs = busy[k0:k1]
            t = total[secs]
            f = np.maximum(np.maximum(floor[secs], low), cur)
            return bool(((f + t)[t > 0] <= capacity).all())

        def put(b: int, o: int) -> tuple[bool, int, int]:
            """Place b at o. Returns whether nothing unplaced conflicts with it, and the
            sections whose floor, lowest offset or bytes to place changed."""
            top = o + int(size[b])
            placed[b] = True
            offset[b] = o
            eff[b] = big
            ids = nbrs[b]
            ids = ids[~placed[ids]]
            o_saved = min_off[ids].copy()
            need = np.maximum(o_saved, top)
            al = align[ids]
            raised = -(-need // al) * al
            min_off[ids] = raised
            eff[ids] = raised
            f_saved = floor[lo[b] : hi[b]].copy()
            floor[lo[b] : hi[b]] = top
            total[lo[b] : hi[b]] -= size[b]
            trail.append((b, ids, o_saved, f_saved))
            a0, a1 = int(lo[b]), int(hi[b])
            moved = ids[raised > o_saved]
            if len(moved):
                a0 = min(a0, int(lo[moved].min()))
                a1 = max(a1, int(hi[moved].max()))
            return len(ids) == 0, a0, a1

        def undo(mark: int) -> None:
            while len(trail) > mark:
                b, ids, o_saved, f_saved = trail.pop()
                placed[b] = False
                offset[b] = -1
                min_off[ids] = o_saved
                eff[ids] = o_saved
                eff[b] = min_off[b]
                floor[lo[b] : hi[b]] = f_saved
                total[lo[b] : hi[b]] += size[b]

        def split(members: np.ndarray) -> list[np.ndarray]:
            order = members[np.argsort(lo[members], kind="stable")]
            reach = np.maximum.accumulate(hi[order])
            cuts = np.flatnonzero(lo[order][1:] >= reach[:-1]) + 1
            return np.split(order, cuts) if len(cuts) else [order]

        def fresh(groups: list[np.ndarray]) -> bool:
            # The groups are independent now: each is a problem of its own over the
            # placed buffers, searched from its lowest offsets (canonical within itself)
            # with a rank from what it has left to place. Ranks are restored on failure,
            # so the enclosing search sees the order it started with.
            assert dynamic is not None
            saved = []
            for g in groups:
                saved.append((g, rank[g].copy()))
                left = np.array([int(total[lo[j] : hi[j]].max()) for j in g.tolist()])
                rank[g] = self._rank(dynamic, g, left)
                if not search(g, -1, -1):
                    for h, r in reversed(saved):
                        rank[h] = r
                    return False
            return True

        def search(members: np.ndarray, last_off: int, last_rank: int) -> bool:
            self.nodes += 1
            if self.nodes > limit:
                raise _OutOfWork
            mo = min_off[members]
            ms = size[members]
            s0, s1 = int(lo[members].min()), int(hi[members].max())
            # Canonical: offsets never decrease; at one offset, buffers come in rank order.
            keep = (mo > last_off) | ((mo == last_off) & (rank[members] > last_rank))
            # Dominance: at or above some unplaced buffer's lowest top, that buffer could
            # go underneath instead -- a needless gap.
            keep &= mo < int((mo + ms).min())
            # Every section still holding bytes must fit them above this offset.
            keep &= mo + int(total[s0:s1].max()) <= capacity
            ids = members[keep]
            cands = ids[np.lexsort((rank[ids], min_off[ids]))].tolist()
            for b in cands:
                o = int(min_off[b])
                mark = len(trail)
                hatless, a0, a1 = put(b, o)
                rest = members[members != b]
                # Sections outside [a0, a1) passed before and are no fuller now; the
                # offset's own rise is covered by the filter above.
                if check(o, max(s0, a0), min(s1, a1)):
                    if len(rest) == 0:
                        return True
                    rb = int(rank[b])
                    groups = split(rest)
                    if dynamic is None or len(groups) == 1:
                        if all(search(g, o, rb) for g in groups):
                            return True
                    elif fresh(groups):
                        return True
                undo(mark)
                if hatless:
                    # Nothing unplaced lies above b: had another buffer come here, the
                    # failure would be the same.
                    break
            return False

        old_limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(old_limit, 4 * m + 200))
        try:
            everyone = np.arange(m)
            if all(search(g, -1, -1) for g in split(everyone)):
                return [int(x) for x in offset], False
        finally:
            sys.setrecursionlimit(old_limit)
        return None, True


# -- the placer ---------------------------------------------------------------------------------


def place(
    intervals: Iterable[Interval],
    *,
    capacity: int | None = None,
    work_limit: int = DEFAULT_WORK_LIMIT,
    exact: bool = True,
) -> Placement:
    """Offsets for ``intervals`` (see the module docstring). With ``capacity``, the search
    first looks for a placement within it; whatever happens, the lowest peak found is
    returned (the caller compares it with the capacity). ``exact=False`` stops after the
    greedy stage. ``work_limit`` bounds the search nodes; the result is deterministic."""
    ivs = list(intervals)
    _validate(ivs)
    if capacity is not None and capacity < 0:
        raise PlacementError(f"capacity {capacity} is negative")
    if work_limit < 0:
        raise PlacementError(f"work limit {work_limit} is negative")
    lb = lower_bound(ivs)
    live = [iv for iv in ivs if _live(iv)]
    offsets = {iv.id: 0 for iv in ivs if not _live(iv)}
    if not live:
        return Placement(offsets, 0, lb, "trivial", True)
    p = _Problem(live)

    best_off: list[int] | None = None
    best_peak = 0
    strategy = ""
    for name, order in _orderings(p):
        for best_fit in (True, False):
            off = _greedy(p, order, best_fit)
            peak = _peak_of(p, off)
            if best_off is None or peak < best_peak:
                best_off, best_peak = off, peak
                strategy = f"greedy {name}, {'best' if best_fit else 'first'} fit"
            if best_peak == lb:
                break  # nothing can be lower
        if best_peak == lb:
            break
    assert best_off is not None
    optimal = best_peak == lb
    if exact and not optimal and work_limit > 0:
        best_off, best_peak, found, optimal = _search(
            p, lb, best_off, best_peak, capacity, work_limit
        )
        if found:
            strategy = "canonical search"
    for iv, o in zip(live, best_off, strict=True):
        offsets[iv.id] = o
    return Placement(offsets, best_peak, lb, strategy, optimal or best_peak == lb)


def _search(
    p: _Problem,
    lb: int,
    best_off: list[int],
    best_peak: int,
    capacity: int | None,
    work_limit: int,
) -> tuple[list[int], int, bool, bool]:
    """Look for lower peaks with the canonical decision search, under one node budget:
    first the capacity (when asked for and the greedy stage missed it) with two thirds of
    the budget (a quarter of the rest once it is met), then a binary search between the
    highest target that failed (or the lower bound) and the best peak, each try with a
    third of what is left; a loose target is met in about one node per buffer. A target
    that runs out of work counts as failed. Returns (offsets, peak, improved, proven optimal)."""
    groups = [_Search(p, g) for g in p.components()]
    # Each group's best offsets so far and their peak: a group already within a target
    # needs no new search for it.
    mine: list[tuple[list[int], int]] = []
    for g in groups:
        sub = [best_off[i] for i in g.members.tolist()]
        mine.append((sub, max(o + int(s) for o, s in zip(sub, g.size, strict=True))))
    left = work_limit
    improved = False
    proven_lo = lb  # no peak below this exists (the lower bound holds for any placement)

    def attempt(target: int, budget: int) -> tuple[bool, bool]:
        """Fit every group within target; (found, proven impossible). Spends from left."""
        nonlocal left
        budget = min(budget, left)
        for k, g in enumerate(groups):
            if mine[k][1] <= target:
                continue
            try:
                sol, exhausted = g.solve(target, budget)
            except _OutOfWork:
                left -= g.nodes
                return False, False
            left -= g.nodes
            budget -= g.nodes
            if sol is None:
                return False, exhausted
            mine[k] = (sol, max(o + int(s) for o, s in zip(sol, g.size, strict=True)))
        return True, False

    def current() -> tuple[list[int], int]:
        off = [0] * p.n
        for g, (sol, _) in zip(groups, mine, strict=True):
            for k, i in enumerate(g.members.tolist()):
                off[i] = sol[k]
        return off, max(pk for _, pk in mine)

    failed = lb - 1  # the highest target that failed (proven or out of work)
    if capacity is not None and lb <= capacity < best_peak:
        # Most of the budget: fitting is what the caller asked for; the rest lowers the
        # peak should it fail.
        found, infeasible = attempt(capacity, left * 2 // 3)
        if found:
            best_off, best_peak = current()
            improved = True
            # It fits: going lower is a bonus, worth a quarter of what is left.
            left //= 4
        else:
            failed = capacity
            if infeasible:
                proven_lo = capacity + 1
    lo = failed + 1
    while lo < best_peak and left > 0:
        target = (lo + best_peak - 1) // 2
        # A third of what is left: a loose target is met in one dive (about one node
        # per buffer), a tight one may take all it gets.
        found, infeasible = attempt(target, max(left // 3, 2 * max(g.m for g in groups)))
        if found:
            best_off, best_peak = current()
            improved = True
        else:
            lo = target + 1
            if infeasible:
                proven_lo = max(proven_lo, target + 1)
    return best_off, best_peak, improved, proven_lo >= best_peak


# -- MiniMalloc's CSV format ----------------------------------------------------------------


CSV_COLUMNS = ("id", "lower", "upper", "size")


def read_csv(path: str | os.PathLike[str]) -> list[Interval]:
    """Buffers from a MiniMalloc CSV: a header naming ``id,lower,upper,size`` (in any order,
    other columns ignored; an ``alignment`` column is read when present), then one buffer a
    row, live on the half-open interval [lower, upper). Raises PlacementError naming the
    file and line of the first bad row."""
    name = os.fspath(path)
    try:
        with open(name, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except OSError as e:
        raise PlacementError(f"{name}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise PlacementError(f"{name}: not a text file") from None
    if not rows:
        raise PlacementError(f"{name}: empty file; expected a header line id,lower,upper,size")
    header = [h.strip().lower() for h in rows[0]]
    missing = [c for c in CSV_COLUMNS if c not in header]
    if missing:
        raise PlacementError(
            f"{name}:1: header {','.join(rows[0])!r} lacks column(s) {', '.join(missing)}; "
            "expected id,lower,upper,size"
        )
    col = {c: header.index(c) for c in CSV_COLUMNS}
    align_col = header.index("alignment") if "alignment" in header else None
    out: list[Interval] = []
    seen: dict[int, int] = {}
    for lineno, row in enumerate(rows[1:], start=2):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != len(header):
            raise PlacementError(
                f"{name}:{lineno}: {len(row)} field(s), the header has {len(header)}"
            )
        vals: dict[str, int] = {}
        for c in (*CSV_COLUMNS, "alignment"):
            k = col.get(c) if c != "alignment" else align_col
            if k is None:
                continue
            text = row[k].strip()
            try:
                vals[c] = int(text)
            except ValueError:
                raise PlacementError(f"{name}:{lineno}: {c} {text!r} is not an integer") from None
        bid, lo, hi, size = vals["id"], vals["lower"], vals["upper"], vals["size"]
        if lo >= hi:
            raise PlacementError(
                f"{name}:{lineno}: buffer {bid}: lower {lo} must be below upper {hi} "
                "(the interval [lower, upper) is half-open)"
            )
        if size < 0:
            raise PlacementError(f"{name}:{lineno}: buffer {bid}: negative size {size}")
        align = vals.get("alignment", 1)
        if align < 1:
            raise PlacementError(f"{name}:{lineno}: buffer {bid}: alignment {align} below 1")
        if bid in seen:
            raise PlacementError(
                f"{name}:{lineno}: buffer id {bid} repeats (first on line {seen[bid]})"
            )
        seen[bid] = lineno
        out.append(Interval(bid, lo, hi, size, align))
    return out


def write_offsets_csv(
    path: str | os.PathLike[str], intervals: Sequence[Interval], offsets: dict[int, int]
) -> None:
    """``id,lower,upper,size,offset`` rows, written to a temporary file beside ``path`` and
    renamed over it, so no half-written file is ever seen."""
    name = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(name))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(name)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow([*CSV_COLUMNS, "offset"])
            for iv in intervals:
                w.writerow([iv.id, iv.start, iv.end, iv.size, offsets[iv.id]])
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
