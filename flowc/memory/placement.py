"""Static memory placement over plain intervals: give every buffer a byte offset so that no
two buffers live at the same time share a byte, with the peak (the arena) as low as the
work limit allows.

This module stands alone: it imports the standard library and NumPy only (no other flowc
module), so code generation, the CLI and outside tools can use it without the compiler
(write_offsets_csv alone imports flowc's file writer, when called).

A buffer is an :class:`Interval`: live on the half-open step interval ``[start, end)`` and
needing ``size`` bytes at an offset that is a multiple of ``align``. Two buffers conflict when
their step intervals intersect (one ending at ``t`` and one starting at ``t`` do not) and both
have bytes.

:func:`place` works in two stages:

1. **Greedy.** Buffers are placed one by one, each in a gap between the already placed
   buffers it conflicts with, for several orderings (size, lifetime length, number of
   conflicts, area, the fullest time step it lives through) and two gap rules (best fit:
   the tightest gap that holds it; first fit: the lowest), keeping the lowest peak -- as
   XLA's heap simulator tries several orderings and keeps the best. These need each
   buffer's conflicts listed, as many as the square of the buffers, so they run only
   while there are few enough (GREEDY_WORK). Two time sweeps always run: best fit in
   order of start, as an allocator would see the program, forward and backward in time,
   with the free gaps kept sorted (no conflict lists; 100,000 buffers in about a second).
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
   searched first for the capacity asked for (else for the lower bound, given up early
   when no dive gets near placing everything, then a ladder of C above it, the slack
   halving, down to the first that fails), then for a shrinking C (binary search between
   the highest C that failed and the best peak) while the work limit lasts. Each decision
   tries several tie-break orders in turn with a node limit that doubles (one order often
   finishes in a single dive where another thrashes).
   After each placement, the unplaced buffers that no longer share a time step split into
   groups searched one after the other, so a failing group never makes the search retry
   another group's choices (MiniMalloc's dynamic decomposition). Two strategies (dynamic
   TWA and TWC, as MiniMalloc's SubSolve) search each such group afresh: from its own
   lowest offsets, ranked by the bytes still to place in its fullest section rather than
   the initial ones. The search runs on an explicit stack (one level per placed buffer),
   and a group of buffers apart in time from the rest is searched only when its conflict
   and section lists stay below SEARCH_PAIRS.

The work limit counts search nodes, never seconds, so the result is the same on every run
and machine. A placement is ``optimal`` when its peak equals the lower bound, or when the
search exhausted the next lower target without reaching the limit.

The lower bound is the maximum over time of the summed sizes of the live buffers, sizes as
given (not rounded up to their alignment): it holds for any placement, aligned or not.

:func:`check_placement` verifies a placement independently of the placer: a sweep over
time that keeps the live buffers' byte ranges in order of offset and compares each new
buffer with its neighbours in that order.

One idea: interval placement; kept whole because it stands alone (see above) and the
search, its bounds and the CSV form share the Interval/Placement records.
"""

from __future__ import annotations

import bisect
import csv
import io
import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

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

# Search nodes for place()'s default: at most about 7 s of CPython on each MiniMalloc
# instance (154-454 buffers; bench/minimalloc_bench.py on 2 cores, D without a capacity,
# all of it at tight targets; most take under 2.7 s); no search at all where the greedy
# stage already reaches the bound.
DEFAULT_WORK_LIMIT = 40_000

# The most bytes all the live buffers may need stacked (sizes plus alignment padding):
# offsets and the sums the search forms stay far from int64's limit (2 EiB).
ARENA_LIMIT = 2**61

# The greedy orderings place each buffer among the placed ones it conflicts with, from
# lists of them; a run costs about 15 us a buffer plus 1 us a conflicting pair in
# CPython, so they run while buffers plus pairs stay below this (about 5 s for the ten
# runs; a timeline of 6,000 model-like buffers has about 200,000 pairs). Beyond it only
# the time sweeps run, which need no lists.
GREEDY_WORK = 500_000

# A group of buffers is searched when its conflicting pairs plus the time sections its
# buffers span stay below this: the search keeps both as arrays.
SEARCH_PAIRS = 4_000_000


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
    # The id as a file spelled it when that was not an integer (MiniMalloc's own examples
    # name buffers "b1", ...): `id` is then the buffer's row number, and the offsets CSV
    # writes the name back.
    name: str | None = None


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
    need = 0
    for iv in intervals:
        if iv.id in seen:
            raise PlacementError(f"buffer {iv.id}: duplicate id")
        seen.add(iv.id)
        for what in ("start", "end", "size", "align"):
            value = getattr(iv, what)
            if not -(2**63) <= value < 2**63:
                raise PlacementError(f"buffer {iv.id}: {what} {value} does not fit int64")
        if iv.end < iv.start:
            raise PlacementError(f"buffer {iv.id}: end {iv.end} before start {iv.start}")
        if iv.size < 0:
            raise PlacementError(f"buffer {iv.id}: negative size {iv.size}")
        if iv.align < 1:
            raise PlacementError(f"buffer {iv.id}: alignment {iv.align} is not positive")
        if _live(iv):
            need += iv.size + iv.align - 1
    if need > ARENA_LIMIT:
        # No placement needs more than every buffer stacked (each padded to its alignment);
        # below this bound no offset or sum the placer forms overflows int64.
        raise PlacementError(
            f"the buffers need up to {need} bytes stacked (sizes plus alignment padding); "
            f"the placer handles at most {ARENA_LIMIT} (2^61)"
        )


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
    # Sweep over time: at each start, compare the new buffer's bytes with the buffers live
    # then. Their byte ranges are kept in order of offset; as long as they do not overlap
    # each other, a new range overlaps one of them exactly when it overlaps its neighbour
    # below or above in that order, so each start costs a bisection, not a pass over all
    # the live buffers. A buffer found overlapping is reported and left out, so the ones
    # kept never overlap. Ends at t come before starts at t (half-open lifetimes).
    keep = [k for k, iv in enumerate(ivs) if _live(iv) and iv.id in offsets]
    starts = sorted(keep, key=lambda k: (ivs[k].start, k))
    ends = sorted(keep, key=lambda k: (ivs[k].end, k))
    live: list[tuple[int, int]] = []  # (offset, index), sorted
    inside = [False] * len(ivs)
    ei = 0
    for k in starts:
        if len(problems) > 20:
            break
        a = ivs[k]
        t = a.start
        while ei < len(ends) and ivs[ends[ei]].end <= t:
            j = ends[ei]
            ei += 1
            if inside[j]:
                del live[bisect.bisect_left(live, (offsets[ivs[j].id], j))]
        ao = offsets[a.id]
        at = bisect.bisect_left(live, (ao, k))
        clash = False
        for _, j in live[max(at - 1, 0) : at + 1]:
            b = ivs[j]
            bo = offsets[b.id]
            if ao < bo + b.size and bo < ao + a.size:
                clash = True
                problems.append(
                    f"buffers {a.id} and {b.id} are both live at step {t} and share bytes "
                    f"[{max(ao, bo)}, {min(ao + a.size, bo + b.size)})"
                )
        if not clash:
            live.insert(at, (ao, k))
            inside[k] = True
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise PlacementError("invalid placement: " + "; ".join(problems[:10]) + more)


# -- the problem, preprocessed ------------------------------------------------------------------


class _Problem:
    """The live buffers as arrays: sizes, alignments, the half-open range of time sections
    each covers (a section lies between consecutive distinct endpoints), the bytes live in
    each section, the fullest section each buffer lives through and how many buffers it
    conflicts with. The conflicts themselves are not listed here: there can be as many as
    the square of the buffers (a hundred thousand buffers alive together), so only groups
    with few enough get lists (_conflicts)."""

    def __init__(self, ivs: list[Interval]) -> None:
        self.ivs = ivs
        n = len(ivs)
        self.n = n
        self.size = np.fromiter((iv.size for iv in ivs), dtype=np.int64, count=n)
        self.align = np.fromiter((iv.align for iv in ivs), dtype=np.int64, count=n)
        start = np.fromiter((iv.start for iv in ivs), dtype=np.int64, count=n)
        end = np.fromiter((iv.end for iv in ivs), dtype=np.int64, count=n)
        self.start, self.end = start, end
        points = np.unique(np.concatenate([start, end]))
        self.lo = np.searchsorted(points, start).astype(np.int64)
        self.hi = np.searchsorted(points, end).astype(np.int64)
        self.nsec = max(len(points) - 1, 0)
        # Section totals (the bytes live in each section) from a difference array; no
        # dense section x buffer matrix.
        diff = np.zeros(self.nsec + 1, dtype=np.int64)
        np.add.at(diff, self.lo, self.size)
        np.add.at(diff, self.hi, -self.size)
        self.total = np.cumsum(diff)[:-1]
        # The fullest section each buffer lives through (MiniMalloc's "total").
        self.fullest = _range_max(self.total, self.lo, self.hi)
        # Conflicts of i: the buffers starting before i ends, less those ending by the time
        # it starts (all of which started before it ends), less i itself.
        self.degree = (
            np.searchsorted(np.sort(start), end, side="left")
            - np.searchsorted(np.sort(end), start, side="right")
            - 1
        )
        self.pairs = int(self.degree.sum()) // 2

    def components(self) -> list[np.ndarray]:
        """Groups of buffers whose lifetimes chain together, each in order of (start, end);
        no buffer crosses between two groups' time ranges, so each can be placed on its own
        from offset 0."""
        order = np.lexsort((self.end, self.start))
        reach = np.maximum.accumulate(self.end[order])
        cuts = np.flatnonzero(self.start[order][1:] >= reach[:-1]) + 1
        return np.split(order, cuts)


def _range_max(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``max(values[lo[k]:hi[k]])`` for every k (each range non-empty): the sparse-table
    query, one level of the table at a time, so memory stays linear."""
    out = np.empty(len(lo), dtype=values.dtype)
    level = np.frexp((hi - lo).astype(np.float64))[1] - 1  # floor(log2(span))
    table = values
    k = 0
    while len(lo):
        sel = np.flatnonzero(level == k)
        if len(sel):
            out[sel] = np.maximum(table[lo[sel]], table[hi[sel] - (1 << k)])
        if not (level > k).any():
            break
        table = np.maximum(table[: -(1 << k)], table[1 << k :])
        k += 1
    return out


def _conflicts(start: np.ndarray, end: np.ndarray) -> list[np.ndarray]:
    """For each buffer, the indices (ascending) of the buffers whose lifetimes meet its own:
    taken in order of start, buffer k meets exactly the ones after it that start before it
    ends, a run of positions; each pair is listed from both sides."""
    n = len(start)
    by_start = np.argsort(start, kind="stable")
    reach = np.searchsorted(start[by_start], end[by_start], side="left")
    count = reach - np.arange(n) - 1
    first = np.repeat(np.arange(n), count)
    second = first + 1 + (np.arange(len(first)) - np.repeat(np.cumsum(count) - count, count))
    a, b = by_start[first], by_start[second]
    src = np.concatenate([a, b])
    dst = np.concatenate([b, a])
    order = np.lexsort((dst, src))
    return np.split(dst[order], np.cumsum(np.bincount(src, minlength=n))[:-1])


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


# -- greedy -------------------------------------------------------------------------------------


def _greedy(p: _Problem, nbrs: list[list[int]], order: Sequence[int], best_fit: bool) -> list[int]:
    """Place the buffers in ``order``, each in a gap among the placed buffers it conflicts
    with: the tightest gap that holds it (best fit) or the lowest (first fit); above them all
    when no gap does."""
    n = p.n
    off = [-1] * n
    size = p.size.tolist()
    align = p.align.tolist()
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
    life = [iv.end - iv.start for iv in p.ivs]  # Python ints: no int64 overflow
    nconf = p.degree.tolist()
    area = [s * w for s, w in zip(size, life, strict=True)]
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


def _sweep(p: _Problem, backward: bool) -> list[int]:
    """Best fit in order of time, as an allocator would run the program: buffers in order of
    start (larger first at one step), each in the tightest gap left between the buffers
    live then, or above them all; a buffer's bytes are free again from its end. Forward or
    with time reversed. Needs no conflict lists: the gaps are kept in order of length
    (bisect) and by their ends (to merge a freed block with its neighbours), so a hundred
    thousand buffers take about a second."""
    n = p.n
    size = p.size.tolist()
    align = p.align.tolist()
    if backward:
        start = [-iv.end for iv in p.ivs]
        end = [-iv.start for iv in p.ivs]
    else:
        start = [iv.start for iv in p.ivs]
        end = [iv.end for iv in p.ivs]
    order = sorted(range(n), key=lambda i: (start[i], -size[i], i))
    ending = sorted(range(n), key=lambda i: (end[i], i))
    gaps: list[tuple[int, int]] = []  # (length, start), sorted
    gap_end: dict[int, int] = {}  # start -> end
    gap_start: dict[int, int] = {}  # end -> start
    top = 0  # everything from here up is free
    off = [0] * n

    def add(a: int, b: int) -> None:
        if b > a:
            gap_end[a], gap_start[b] = b, a
            bisect.insort(gaps, (b - a, a))

    def remove(a: int) -> int:
        b = gap_end.pop(a)
        del gap_start[b]
        del gaps[bisect.bisect_left(gaps, (b - a, a))]
        return b

    def free(a: int, b: int) -> None:
        nonlocal top
        if a in gap_start:
            a0 = gap_start[a]
            remove(a0)
            a = a0
        if b == top:
            top = a
            return
        if b in gap_end:
            b = remove(b)
        add(a, b)

    k = 0
    for i in order:
        while k < n and end[ending[k]] <= start[i]:
            j = ending[k]
            k += 1
            free(off[j], off[j] + size[j])
        s, al = size[i], align[i]
        g = bisect.bisect_left(gaps, (s, -1))
        choice = -1
        # The shortest gaps that hold s bytes; an alignment may push it out of a few.
        for length, a in gaps[g : g + 8]:
            o = _round_up(a, al)
            if o + s <= a + length:
                remove(a)
                add(a, o)
                add(o + s, a + length)
                choice = o
                break
        if choice < 0:
            choice = _round_up(top, al)
            add(top, choice)
            top = choice + s
        off[i] = choice
    return off


def _peak_of(p: _Problem, off: Sequence[int]) -> int:
    return int(max((o + s for o, s in zip(off, p.size.tolist(), strict=True)), default=0))


# -- canonical search ---------------------------------------------------------------------------


class _OutOfWork(Exception):
    pass


class _Search:
    """MiniMalloc-style decision search on one group of buffers: is there a placement within
    ``capacity`` bytes? Counts its nodes (``nodes``) against the budget it is given."""

    def __init__(self, p: _Problem, members: np.ndarray) -> None:
        self.members = members
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
        self.by_lo = np.argsort(self.lo, kind="stable")
        self.pos = np.empty(m, dtype=np.int64)
        self.pos[self.by_lo] = np.arange(m)
        self.pair_buf = bufs
        self.pair_start = np.searchsorted(secs, self.busy).astype(np.int64)
        start = p.start[self.members]
        end = p.end[self.members]
        # Every neighbour lives in the same group (groups are apart in time).
        self.nbrs = _conflicts(start, end)
        # Static orders to break ties at one offset, tried in turn: MiniMalloc's TWA, WAT
        # and TAW (the fullest section's Total, lifetime Width, Area; larger first), and
        # sweeps in time (latest end first, earliest start first, latest start first).
        # No one order suits every instance: on the MiniMalloc set each of these is the
        # first to fit at least one instance in a single dive; the most useful come first.
        # Width and area in floating point, start by its rank: the int64 differences and
        # products could overflow (a key only orders, exactness does not matter).
        width = end.astype(np.float64) - start.astype(np.float64)
        start_rank = np.unique(start, return_inverse=True)[1].reshape(-1)
        self.keys = {
            "T": p.fullest[self.members],
            "W": width,
            "A": self.size * width,
            "Z": self.size,
            "E": end,
            "-S": -start_rank,
            "S": start_rank,
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
        # The most buffers the last _dfs had placed at once: how near its target it came.
        self.deepest = 0

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

    def solve(
        self, capacity: int, budget: int, give_up: bool = False
    ) -> tuple[list[int] | None, bool]:
        """(offsets, exhausted): offsets when a placement within ``capacity`` was found.
        Round robin over the tie-break orders with a node limit doubling from 2 per buffer
        (as MiniMalloc): an order that suits the instance finishes early. exhausted is True
        when one search ran to its end without a placement (so there is none). Raises
        _OutOfWork when the budget is spent; ``nodes`` then holds what was used. With
        ``give_up``, also when no dive of the first two rounds placed half the buffers."""
        used = 0
        self.nodes = 0
        if (self.size > capacity).any() or (self.total0 > capacity).any():
            return None, True
        limit = self.m
        while True:
            limit *= 2
            deepest = 0
            for (names, dynamic), rank in zip(self.strategies, self.ranks, strict=True):
                take = min(limit, budget - used)
                if take <= 0:
                    self.nodes = used
                    raise _OutOfWork
                try:
                    sol, exhausted = self._dfs(capacity, take, rank, names if dynamic else None)
                except _OutOfWork:
                    used += take
                    deepest = max(deepest, self.deepest)
                    continue
                self.nodes += used
                return sol, exhausted
            if give_up and limit == 4 * self.m and 2 * deepest < self.m:
                # Two rounds (every order with 2, then 4 nodes a buffer) and no dive got
                # half the buffers in: the target is far out of reach, and more rounds do
                # not bring it closer. On the MiniMalloc set D's lower bound stays at 84
                # of 213 buffers through every round (all 26,666 nodes it was given),
                # while the lower bounds that fit only in a third round (E, I, K) had a
                # dive past 90% after two.
                self.nodes = used
                raise _OutOfWork

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
        # Undo records: (buffer, raised neighbours, their old lowest offsets, old floors),
        # or (-1, a group, its old ranks, None) for a dynamic group's fresh rank.
        trail: list[tuple[int, np.ndarray, np.ndarray, np.ndarray | None]] = []
        self.nodes = 0
        self.deepest = depth = 0  # buffers placed: the most at once, and now

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
            nonlocal depth
            depth += 1
            if depth > self.deepest:
                self.deepest = depth
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
            nonlocal depth
            while len(trail) > mark:
                b, ids, o_saved, f_saved = trail.pop()
                if b < 0:
                    # A group's fresh rank (dynamic strategies), taken back.
                    rank[ids] = o_saved
                    continue
                assert f_saved is not None
                depth -= 1
                placed[b] = False
                offset[b] = -1
                min_off[ids] = o_saved
                eff[ids] = o_saved
                eff[b] = min_off[b]
                floor[lo[b] : hi[b]] = f_saved
                total[lo[b] : hi[b]] += size[b]

        # A group of unplaced buffers is a span [pa, pb) of positions in by_lo: the groups
        # a placement leaves are apart in time, so every unplaced buffer in that span
        # belongs to the group (and comes in the order the search ranks ties by).
        by_lo = self.by_lo
        pos = self.pos

        def members_of(pa: int, pb: int) -> np.ndarray:
            seg = by_lo[pa:pb]
            return seg[~placed[seg]]

        def split(members: np.ndarray) -> list[tuple[int, int]]:
            # members come in by_lo order, so sorted by lo already.
            reach = np.maximum.accumulate(hi[members])
            cuts = (np.flatnonzero(lo[members][1:] >= reach[:-1]) + 1).tolist()
            firsts = members[[0, *cuts]].tolist()
            lasts = members[[c - 1 for c in cuts] + [len(members) - 1]].tolist()
            return [(int(pos[a]), int(pos[b]) + 1) for a, b in zip(firsts, lasts, strict=True)]

        def candidates(
            members: np.ndarray, last_off: int, last_rank: int, s0: int, s1: int
        ) -> list[int]:
            mo = min_off[members]
            ms = size[members]
            # Canonical: offsets never decrease; at one offset, buffers come in rank order.
            keep = (mo > last_off) | ((mo == last_off) & (rank[members] > last_rank))
            # Dominance: at or above some unplaced buffer's lowest top, that buffer could
            # go underneath instead -- a needless gap.
            keep &= mo < int((mo + ms).min())
            # Every section still holding bytes must fit them above this offset.
            keep &= mo + int(total[s0:s1].max()) <= capacity
            ids = members[keep]
            return ids[np.lexsort((rank[ids], min_off[ids]))].tolist()

        # The depth-first search runs on an explicit stack (its depth is the number of
        # buffers, far past Python's recursion limit on large groups). Two kinds of frame:
        # a node [pa, pb, last_off, last_rank, tried, mark, hatless, ...] chooses which
        # buffer of its group comes next; a conjunction [groups, next, off, rank, fresh]
        # searches the groups a placement left, one after the other, and fails as soon as
        # one does. A node resumed after a failed child takes its next candidate from the
        # list it kept, or recomputes a long one: the undo restores exactly the state it
        # first saw (ranks included), so it is the same list.
        stack: list[list] = [[split(by_lo), 0, -1, -1, False]]
        result: bool | None = None  # the last finished frame's answer; None: just pushed
        while stack:
            fr = stack[-1]
            if fr[0].__class__ is list:  # a conjunction
                groups = fr[0]
                if result is False or fr[1] == len(groups):
                    stack.pop()
                    result = result is not False
                    continue
                pa, pb = groups[fr[1]]
                fr[1] += 1
                if fr[4]:
                    # The groups are independent now: each is a problem of its own over
                    # the placed buffers, searched from its lowest offsets (canonical
                    # within itself) with a rank from what it has left to place.
                    assert dynamic is not None
                    g = members_of(pa, pb)
                    left = np.array([int(total[lo[j] : hi[j]].max()) for j in g.tolist()])
                    trail.append((-1, g, rank[g].copy(), None))
                    rank[g] = self._rank(dynamic, g, left)
                    stack.append([pa, pb, -1, -1, 0, 0, False])
                else:
                    stack.append([pa, pb, fr[2], fr[3], 0, 0, False])
                result = None
                continue
            pa, pb, last_off, last_rank = fr[0], fr[1], fr[2], fr[3]
            if result is True:
                stack.pop()
                continue
            if result is None:
                self.nodes += 1
                if self.nodes > limit:
                    raise _OutOfWork
            else:
                undo(fr[5])
                if fr[6]:
                    # Nothing unplaced lies above the buffer that failed: had another
                    # buffer come there, the failure would be the same.
                    stack.pop()
                    continue
            members = members_of(pa, pb)
            if len(fr) == 8:
                cands, s0, s1 = fr[7]
            else:
                s0, s1 = int(lo[members].min()), int(hi[members].max())
                cands = candidates(members, last_off, last_rank, s0, s1)
                if len(cands) <= 32:
                    # Kept for resuming (a few; a long list is recomputed).
                    fr.append((cands, s0, s1))
            result = False
            while fr[4] < len(cands):
                b = cands[fr[4]]
                fr[4] += 1
                o = int(min_off[b])
                mark = len(trail)
                hatless, a0, a1 = put(b, o)
                # Sections outside [a0, a1) passed before and are no fuller now; the
                # offset's own rise is covered by the filter above.
                if check(o, max(s0, a0), min(s1, a1)):
                    if len(members) == 1:
                        result = True
                        break
                    groups = split(members[members != b])
                    fr[5], fr[6] = mark, hatless
                    fresh = dynamic is not None and len(groups) > 1
                    stack.append([groups, 0, o, int(rank[b]), fresh])
                    result = None
                    break
                undo(mark)
                if hatless:
                    break
            if result is not None:
                stack.pop()
        if result:
            return [int(x) for x in offset], False
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

    def consider(off: list[int], name: str) -> None:
        nonlocal best_off, best_peak, strategy
        peak = _peak_of(p, off)
        if best_off is None or peak < best_peak:
            best_off, best_peak, strategy = off, peak, name

    if p.n + p.pairs <= GREEDY_WORK:
        nbrs = [x.tolist() for x in _conflicts(p.start, p.end)]
        for name, order in _orderings(p):
            for best_fit in (True, False):
                consider(
                    _greedy(p, nbrs, order, best_fit),
                    f"greedy {name}, {'best' if best_fit else 'first'} fit",
                )
                if best_peak == lb:
                    break  # nothing can be lower
            if best_peak == lb:
                break
        del nbrs
    for backward in (False, True):
        if best_peak != lb:
            consider(_sweep(p, backward), f"sweep {'backward' if backward else 'forward'}")
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
    first the capacity when asked for, else the lower bound, with two thirds of the budget
    (a quarter of the rest once it is met; the lower bound is given up early when its
    dives stay far from placing everything). When the lower bound fails, a ladder of
    targets above it, the slack halving (lb + lb/2, lb + lb/4, ...), down to the first
    that fails. Then a binary search over the multiples of ``unit`` between the highest
    target that failed and the best peak. Each try after the first gets a third of what
    is left (at least two dives); a loose target is met in about one node per buffer. A
    target that runs out of work counts as failed. Returns (offsets, peak, improved,
    proven optimal).

    A group is searched only where that can work: a placement takes at least one node per
    buffer, so a group with more buffers than a try's budget is left out of that try (at
    no cost), and a group with more than SEARCH_PAIRS conflicts plus sections spanned
    would need too much memory for the search's arrays. Such a group keeps its greedy
    placement."""
    groups = p.components()
    searches: list[_Search | None] = [None] * len(groups)
    sizes = p.size.tolist()

    # What a group's search keeps: its conflicting pairs (both ways) and sections spanned.
    weight = [int(p.degree[g].sum()) + int((p.hi[g] - p.lo[g]).sum()) for g in groups]
    can = [w <= SEARCH_PAIRS for w in weight]
    kept = 0  # the weight of the searches built and kept; past SEARCH_PAIRS they go
    # Each group's best offsets so far and their peak: a group already within a target
    # needs no new search for it.
    mine: list[tuple[list[int], int]] = []
    for g in groups:
        sub = [best_off[i] for i in g.tolist()]
        mine.append((sub, max(o + sizes[i] for o, i in zip(sub, g.tolist(), strict=True))))
    left = work_limit
    improved = False
    proven_lo = lb  # no peak below this exists (the lower bound holds for any placement)

    def attempt(target: int, budget: int, give_up: bool = False) -> tuple[bool, bool]:
        """Fit every group within target; (found, proven impossible). Spends from left.
        ``give_up``: see _Search.solve."""
        nonlocal left, kept
        budget = min(budget, left)
        need = [k for k in range(len(groups)) if mine[k][1] > target]
        if any(not can[k] or len(groups[k]) > budget for k in need):
            return False, False
        for k in need:
            if len(groups[k]) > budget:
                return False, False  # what is left cannot place it
            g = searches[k]
            if g is None:
                if kept + weight[k] > SEARCH_PAIRS:
                    searches[:] = [None] * len(groups)
                    kept = 0
                g = searches[k] = _Search(p, groups[k])
                kept += weight[k]
            try:
                sol, exhausted = g.solve(target, budget, give_up)
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
            for k, i in enumerate(g.tolist()):
                off[i] = sol[k]
        return off, max(pk for _, pk in mine)

    def dive(target: int) -> int:
        # A loose target is met in one dive, about one node per buffer.
        return 2 * max(
            (len(groups[k]) for k in range(len(groups)) if mine[k][1] > target), default=0
        )

    # Every canonical offset and top is a multiple of unit (it divides every size and
    # every alignment above 1), so the lowest peak is one: the binary search tries only
    # multiples (MiniMalloc's sizes are multiples of 1,024 bytes: ten fewer tries).
    unit = 0
    for x in (*sizes, *(a for a in p.align.tolist() if a > 1)):
        unit = math.gcd(unit, x)
    failed = lb - 1  # the highest target that failed (proven or out of work)
    # The first target: the capacity asked for, or else the lower bound. Most of the
    # budget goes there: fitting is what the caller asked for, and a tight target is
    # where the search prunes best. Without it, K went to a binary search from the greedy
    # peak, whose looser targets took the budget: 1.122x its lower bound, against 1.000x
    # with the capacity (its lower bound).
    asked = capacity is not None and lb <= capacity
    first = capacity if capacity is not None and asked else lb
    if first < best_peak:
        # Without a capacity the lower bound may be out of reach, and then its two
        # thirds were all lost (D: 26,666 nodes, and 1.0685x against 1.0633x with the
        # capacity); a lower bound whose dives stay far from placing everything is given
        # up after two rounds (_Search.solve), leaving the rest to the targets above it.
        # A capacity asked for gets its whole share: fitting it is the point.
        found, infeasible = attempt(first, left * 2 // 3, give_up=not asked)
        if found:
            best_off, best_peak = current()
            improved = True
            # It fits: going lower is a bonus, worth a quarter of what is left.
            left //= 4
        else:
            failed = first
            if infeasible:
                proven_lo = -(-(first + 1) // unit) * unit
    lo = -(-(failed + 1) // unit) * unit
    if not asked and failed == first:
        # The lower bound failed. The lowest peak lies a few percent above it, far below
        # the greedy peak (12-39% above on the MiniMalloc set), and a binary search from
        # the greedy peak spends its tries where the answer is not: its middles land on
        # whichever tight targets happen to be costly (D: 1,046,528 takes 19,900 nodes
        # where 1,048,576 takes 8,000; it ended at 1.0685x). So first a ladder, the slack
        # above the lower bound halving (a half, a quarter, ... of it), down to the first
        # rung that fails; each rung met is a new best peak, and the binary search then
        # only narrows the last step. D meets lb + lb/16 (1.0633x, as with its capacity),
        # J lb + lb/16 and then 1,036,288 in the binary search (1.0476x, from 1.0549x).
        k = 1
        while left > 0 and lb >> k:
            target = -(-(lb + (lb >> k)) // unit) * unit
            k += 1
            if target >= best_peak:
                continue  # the greedy stage or a rung met already does as well
            if target < lo:
                break
            found, infeasible = attempt(target, max(left // 3, dive(target)))
            if not found:
                lo = target + unit
                if infeasible:
                    proven_lo = max(proven_lo, target + unit)
                break
            best_off, best_peak = current()
            improved = True
    while lo < best_peak and left > 0:
        # The middle multiple of unit in [lo, best_peak).
        target = lo + (-(-(best_peak - lo) // unit) - 1) // 2 * unit
        # A third of what is left: a loose target is met in one dive (about one node
        # per buffer), a tight one may take all it gets.
        found, infeasible = attempt(target, max(left // 3, dive(target)))
        if found:
            best_off, best_peak = current()
            improved = True
        else:
            lo = target + unit
            if infeasible:
                proven_lo = max(proven_lo, target + unit)
    return best_off, best_peak, improved, proven_lo >= best_peak


# -- MiniMalloc's CSV format ----------------------------------------------------------------


CSV_COLUMNS = ("id", "lower", "upper", "size")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _int64(text: str, what: str, where: str) -> int:
    """``text`` as an integer that fits int64; PlacementError naming ``where`` otherwise."""
    shown = text if len(text) <= 32 else f"{text[:24]}... ({len(text)} characters)"
    try:
        value = int(text)
    except ValueError:
        # int() refuses more than 4,300 digits: out of range all the same.
        if not re.fullmatch(r"[+-]?[0-9]+", text):
            raise PlacementError(f"{where}: {what} {shown!r} is not an integer") from None
        value = INT64_MAX + 1
    if not INT64_MIN <= value <= INT64_MAX:
        raise PlacementError(
            f"{where}: {what} {shown} is outside the 64-bit integer range "
            f"[-2^63, 2^63-1] ({INT64_MIN} to {INT64_MAX})"
        )
    return value


def read_csv(path: str | os.PathLike[str]) -> list[Interval]:
    """Buffers from a MiniMalloc CSV: a header naming ``id,lower,upper,size`` (in any order,
    other columns ignored; an ``alignment`` column is read when present), then one buffer a
    row, live on the half-open interval [lower, upper). Ids are integers or names (when any
    id is not an integer, every buffer keeps its id as ``Interval.name`` and is numbered by
    row); every other value must fit int64. Raises PlacementError naming the file and line
    of the first bad row."""
    name = os.fspath(path)
    out: list[Interval] = []
    seen: dict[int | str, int] = {}  # an id (a number, or a name) -> its line
    ids: list[int | str] = []
    texts: list[str] = []  # each id as written
    rows = None
    try:
        with open(name, newline="", encoding="utf-8") as f:
            rows = csv.reader(f)
            first = next(rows, None)
            if first is None:
                raise PlacementError(
                    f"{name}: empty file; expected a header line id,lower,upper,size"
                )
            header = [h.strip().lower() for h in first]
            missing = [c for c in CSV_COLUMNS if c not in header]
            if missing:
                raise PlacementError(
                    f"{name}:1: header {','.join(first)!r} lacks column(s) "
                    f"{', '.join(missing)}; expected id,lower,upper,size"
                )
            cols = [(c, header.index(c)) for c in CSV_COLUMNS]
            if "alignment" in header:
                cols.append(("alignment", header.index("alignment")))
            for row in rows:
                lineno = rows.line_num
                if not row or all(not c.strip() for c in row):
                    continue
                where = f"{name}:{lineno}"
                if len(row) != len(header):
                    raise PlacementError(
                        f"{where}: {len(row)} field(s), the header has {len(header)}"
                    )
                vals = {c: _int64(row[k].strip(), c, where) for c, k in cols if c != "id"}
                text = row[cols[0][1]].strip()
                if not text:
                    raise PlacementError(f"{where}: the id is empty")
                number = re.fullmatch(r"[+-]?[0-9]+", text) is not None
                bid: int | str = _int64(text, "id", where) if number else text
                lo, hi, size = vals["lower"], vals["upper"], vals["size"]
                if lo >= hi:
                    raise PlacementError(
                        f"{where}: buffer {bid}: lower {lo} must be below upper {hi} "
                        "(the interval [lower, upper) is half-open)"
                    )
                if size < 0:
                    raise PlacementError(f"{where}: buffer {bid}: negative size {size}")
                align = vals.get("alignment", 1)
                if align < 1:
                    raise PlacementError(f"{where}: buffer {bid}: alignment {align} below 1")
                if bid in seen:
                    raise PlacementError(
                        f"{where}: buffer id {bid} repeats (first on line {seen[bid]})"
                    )
                seen[bid] = lineno
                ids.append(bid)
                texts.append(text)
                out.append(Interval(len(out), lo, hi, size, align))
    except OSError as e:
        raise PlacementError(f"{name}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise PlacementError(f"{name}: not a text file") from None
    except csv.Error as e:
        where = f"{name}:{rows.line_num}" if rows is not None else name
        raise PlacementError(f"{where}: not a CSV row ({e})") from None
    if all(isinstance(i, int) for i in ids):
        return [
            Interval(int(i), v.start, v.end, v.size, v.align) for i, v in zip(ids, out, strict=True)
        ]
    # Names (a number among them is a name too): numbered by row, written back as given.
    return [
        Interval(v.id, v.start, v.end, v.size, v.align, name=t)
        for t, v in zip(texts, out, strict=True)
    ]


def write_offsets_csv(
    path: str | os.PathLike[str],
    intervals: Sequence[Interval],
    offsets: dict[int, int],
    *,
    cannot_open: Callable[[OSError], Exception] | None = None,
    cannot_write: Callable[[OSError], Exception] | None = None,
) -> None:
    """``id,lower,upper,size,offset`` rows, written through flowc.atomic_file.atomic_write:
    a regular file is replaced whole (no half-written file is ever seen), a FIFO or
    character device written through; ``cannot_open`` and ``cannot_write`` turn an OSError
    into the caller's error (atomic_write's own by default). atomic_write is imported
    here, not above, so that the placer itself keeps needing nothing but the standard
    library and NumPy."""
    from flowc.atomic_file import atomic_write

    with atomic_write(Path(path), cannot_open=cannot_open, cannot_write=cannot_write) as raw:
        f = io.TextIOWrapper(raw, encoding="utf-8", newline="")
        w = csv.writer(f, lineterminator="\n")
        w.writerow([*CSV_COLUMNS, "offset"])
        for iv in intervals:
            w.writerow([iv.name or iv.id, iv.start, iv.end, iv.size, offsets[iv.id]])
        f.flush()
        f.detach()  # the binary file stays open: atomic_write finishes it
