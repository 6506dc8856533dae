"""Cutting a graph into pipeline stages.

A stage is a contiguous range of ``graph.nodes`` (a topological order), so every value flows
forward: from a stage to a later one. The partition minimizes the slowest stage, by dynamic
programming over the cut positions (exact for this model; O(P N^2) with N nodes, vectorized):

- A stage's time is its compute (each node's single-device time under the cost model, or the
  caller's ``node_time``) plus the transfers over its two cuts, received and sent.
- Every value produced before a cut and read by a node after it crosses the cut, skip
  connections included; a value crossing several cuts is relayed through the stages between
  and sent over each (stage s only talks to s-1 and s+1). Each value sent over a cut costs the
  pipeline link's alpha + bytes / bandwidth (the profile's link for mesh axis 0). Graph inputs
  go to the stages that read them and graph outputs are written by the stage that makes
  them: neither crosses a cut.
- With a memory limit per device, a stage must hold its parameters (every constant one of its
  nodes reads, once) plus its peak activations; a cut that breaks this is infeasible.
  Activations are counted on one micro-batch in the stage's node order: a buffer (a value and
  the views of it) is live from the node making it, or from the stage's start when it is
  received (graph inputs are counted as received by every stage from the first one reading
  them on, an upper bound), to its last reader in the stage, or to the stage's end when a
  later stage reads it (it is sent) or it is a graph output made here.

With K devices per stage the caller gives each node's time and each value's bytes on one of
them (from one placement of the whole graph on the stage mesh): compute, transfers and memory
are then per device.

Manual partitions name the last value of each stage but the last (``--stage-boundary``), or
come from the nodes' stage tags (the DSL's ``stage N { }`` blocks).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from flowc.errors import InputError
from flowc.ir.graph import Graph, Node, Value
from flowc.ir.names import did_you_mean
from flowc.ir.types import Mesh
from flowc.ops.registry import is_view
from flowc.parallel.cost import Link, Profile, load_profile, node_time
from flowc.parallel.strategies import Strategy, all_broadcast_signature
from flowc.schedule.labels import node_labels

_ONE_DEVICE = Mesh("stage", (1,))


def single_device_time(node: Node, profile: Profile) -> float:
    """``node``'s modeled seconds on one device: its all-broadcast strategy on a 1-device mesh."""
    return node_time(node, Strategy((all_broadcast_signature(node),)), _ONE_DEVICE, profile)


@dataclass(frozen=True)
class BoundaryValue:
    """A value sent over one cut, from stage ``src`` to stage ``dst`` = ``src`` + 1."""

    value: str
    src: int
    dst: int
    nbytes: int


@dataclass
class Partition:
    """Stages of a graph. Index c of ``boundaries`` / ``cut_s`` is the cut between stages c
    and c+1; stage s runs ``graph.nodes[starts[s]:starts[s+1]]`` (the last to the end)."""

    stages: int
    starts: list[int]  # first node index of each stage
    node_stage: list[int]  # the stage of each node, in graph.nodes order
    compute_s: list[float]  # per stage
    cut_s: list[float]  # per cut: the time of sending every value over it
    boundaries: list[list[BoundaryValue]]  # per cut
    param_bytes: list[int]  # per stage
    activation_bytes: list[int]  # per stage: the peak of live activations
    mem_limit: int | None
    manual: bool

    @property
    def stage_s(self) -> list[float]:
        """Per stage: compute plus the transfers over the cuts on both sides."""
        out = []
        for s, c in enumerate(self.compute_s):
            left = self.cut_s[s - 1] if s > 0 else 0.0
            right = self.cut_s[s] if s < self.stages - 1 else 0.0
            out.append(c + left + right)
        return out

    @property
    def max_s(self) -> float:
        return max(self.stage_s)

    @property
    def mean_s(self) -> float:
        return sum(self.stage_s) / self.stages

    @property
    def ratio(self) -> float:
        """Slowest stage over the mean stage: 1.0 is a perfect balance."""
        return self.max_s / self.mean_s if self.mean_s > 0 else 1.0

    def memory_bytes(self) -> list[int]:
        return [p + a for p, a in zip(self.param_bytes, self.activation_bytes, strict=True)]

    def summary(self, graph: Graph | None = None) -> str:
        """The partition as printed: each stage's node range, times and bytes, each cut's
        values; with ``graph`` (the one partitioned) each range also by its first and last
        node's labels (flowc.schedule.labels)."""
        ends = [*self.starts[1:], len(self.node_stage)]
        named: dict[int, str] = {}
        if graph is not None and len(graph.nodes) == len(self.node_stage):
            labels = node_labels(graph.nodes)
            for s in range(self.stages):
                if self.starts[s] < ends[s]:
                    first, last = graph.nodes[self.starts[s]], graph.nodes[ends[s] - 1]
                    named[s] = f" ({labels[first]} .. {labels[last]})"
        lines = [
            f"{self.stages} stages ({'manual' if self.manual else 'automatic'}): "
            f"max {self.max_s * 1e6:.1f} us, mean {self.mean_s * 1e6:.1f} us, "
            f"max/mean {self.ratio:.3f}"
        ]
        for s in range(self.stages):
            lines.append(
                f"  stage {s}: nodes {self.starts[s]}..{ends[s] - 1}{named.get(s, '')}, "
                f"{self.stage_s[s] * 1e6:.1f} us (compute {self.compute_s[s] * 1e6:.1f}), "
                f"params {self.param_bytes[s]} B, peak activations {self.activation_bytes[s]} B"
            )
        for c, vals in enumerate(self.boundaries):
            total = sum(b.nbytes for b in vals)
            names = ", ".join(b.value for b in vals)
            lines.append(
                f"  cut {c} -> {c + 1}: {len(vals)} values, {total} B, "
                f"{self.cut_s[c] * 1e6:.1f} us: {names}"
            )
        return "\n".join(lines)


class StageCosts:
    """What the partition needs from a graph, as arrays over node indices 0..N-1; ``cost(i, j)``
    and ``memory(i, j)`` are the time and bytes of a stage running nodes [i, j)."""

    def __init__(
        self,
        graph: Graph,
        profile: Profile,
        node_time_fn: Callable[[Node], float] | None = None,
        value_bytes_fn: Callable[[Value], int] | None = None,
    ) -> None:
        self.graph = graph
        size = value_bytes_fn or (lambda v: v.type.nbytes)
        self.size = size
        nodes = graph.nodes
        n = self.n = len(nodes)
        self.link: Link = profile.axis_link(0)
        index = {node: k for k, node in enumerate(nodes)}
        timer = node_time_fn or (lambda node: single_device_time(node, profile))
        self.time_s = np.array([float(timer(node)) for node in nodes], dtype=np.float64)
        self.prefix = np.concatenate([[0.0], np.cumsum(self.time_s)])

        # Node readers of every value (graph outputs are not readers).
        readers: dict[Value, list[int]] = {}
        for k, node in enumerate(nodes):
            for v in node.inputs:
                if v is not None:
                    readers.setdefault(v, []).append(k)
        self.readers = readers
        self.index = index

        # Crossings: value v made by node p and last read by node q crosses cuts p+1..q.
        count = np.zeros(n + 2)
        nbytes = np.zeros(n + 2)
        self.made: list[tuple[Value, int, int]] = []  # (value, producer, last reader)
        for k, node in enumerate(nodes):
            for v in node.outputs:
                last = max(readers.get(v, [k]))
                self.made.append((v, k, last))
                if last > k:
                    count[k + 1] += 1
                    count[last + 1] -= 1
                    nbytes[k + 1] += size(v)
                    nbytes[last + 1] -= size(v)
        self.cut_count = np.cumsum(count)[: n + 1]
        self.cut_bytes = np.cumsum(nbytes)[: n + 1]
        # cut_time[c]: sending everything over the cut before node c; none before 0 or after N.
        self.cut_time = self.cut_count * self.link.alpha + self.cut_bytes / self.link.bandwidth
        self.cut_time[0] = 0.0
        self.cut_time[n] = 0.0
        self._mem: np.ndarray | None = None
        self._prepared = False

    def cost(self, i: int, j: int) -> float:
        return float(self.prefix[j] - self.prefix[i] + self.cut_time[i] + self.cut_time[j])

    def cost_row(self, j: int) -> np.ndarray:
        """cost(i, j) for every i in [0, j)."""
        i = np.arange(j)
        return self.prefix[j] - self.prefix[i] + self.cut_time[i] + self.cut_time[j]

    def crossing(self, c: int) -> list[tuple[Value, int]]:
        """The values crossing the cut before node c, with their bytes, in production order."""
        return [(v, self.size(v)) for v, p, last in self.made if p < c <= last]

    # -- memory -----------------------------------------------------------------------------

    def _prepare_memory(self) -> None:
        graph, n = self.graph, self.n
        nodes = graph.nodes
        # Parameters: constant c is in stage [i, j) when its first reader at or after i is < j.
        consts = [c for c in graph.constants if c in self.readers]
        self._cbytes = np.array([self.size(c) for c in consts], dtype=np.float64)
        at = np.arange(n + 1)
        self._next_use = np.empty((len(consts), n + 1), dtype=np.int64)
        for r, c in enumerate(consts):
            uses = np.array([*sorted(set(self.readers[c])), n])
            self._next_use[r] = uses[np.searchsorted(uses, at)]
        # Buffers: a value and the views of it share one, live from its maker to its last
        # reader over the whole group. Graph inputs are made "before node 0" (index -1).
        root: dict[Value, Value] = {}
        for node in nodes:
            if is_view(graph, node) and node.inputs and node.inputs[0] is not None:
                src = node.inputs[0]
                for o in node.outputs:
                    root[o] = root.get(src, src)
        made_at: dict[Value, int] = {v: -1 for v in graph.inputs}
        for k, node in enumerate(nodes):
            for o in node.outputs:
                made_at[o] = k
        last: dict[Value, int] = {}
        nbytes: dict[Value, int] = {}
        outputs: set[Value] = set()
        out_set = set(graph.outputs)
        for v, p in made_at.items():
            buf = root.get(v, v)
            if buf not in made_at:  # a view of a constant: counted with the parameters
                continue
            nbytes.setdefault(buf, self.size(buf))
            last[buf] = max(last.get(buf, made_at[buf]), max(self.readers.get(v, [p])))
            if v in out_set:
                outputs.add(buf)
        bufs = sorted(nbytes, key=lambda b: made_at[b])
        self._p = np.array([made_at[b] for b in bufs], dtype=np.int64)
        self._l = np.array([last[b] for b in bufs], dtype=np.int64)
        self._b = np.array([nbytes[b] for b in bufs], dtype=np.float64)
        self._o = np.array([b in outputs for b in bufs], dtype=bool)
        self._prepared = True

    def memory_row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """For stages starting at node i: parameter bytes and peak activation bytes of the
        stage [i, j), indexed by j (0 for j <= i)."""
        if not self._prepared:
            self._prepare_memory()
        n = self.n
        params = np.zeros(n + 1)
        peaks = np.zeros(n + 1)
        if i >= n:
            return params, peaks
        if len(self._cbytes):
            first = np.bincount(self._next_use[:, i], weights=self._cbytes, minlength=n + 1)
            params[i + 1 :] = np.cumsum(first)[i:n]
        start = np.maximum(self._p, i)
        # A graph output made in the stage stays until the stage's end (it is written out).
        end = np.where(self._o & (self._p >= i), n - 1, self._l)
        keep = end >= start
        diff = np.zeros(n + 1)
        np.add.at(diff, start[keep], self._b[keep])
        np.add.at(diff, end[keep] + 1, -self._b[keep])
        peaks[i + 1 :] = np.maximum.accumulate(np.cumsum(diff)[i:n])
        return params, peaks

    def memory(self) -> np.ndarray:
        """The (N+1) x (N+1) table of parameter plus peak activation bytes of stage [i, j)."""
        if self._mem is None:
            rows = [np.add(*self.memory_row(i)) for i in range(self.n + 1)]
            self._mem = np.stack(rows)
        return self._mem


def _fmt_bytes(b: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{int(b)} B"


def _min_max(cost: Callable[[int], np.ndarray], n: int, stages: int) -> tuple[float, list[int]]:
    """The DP: stage starts minimizing the largest cost(i, j) over the stages; ``cost(j)``
    gives cost(i, j) for every i < j. Ties go to the earliest cut."""
    best = np.full((stages + 1, n + 1), math.inf)
    arg = np.zeros((stages + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for j in range(1, n + 1):
        row = cost(j)  # over i in [0, j)
        for k in range(1, min(stages, j) + 1):
            cand = np.maximum(best[k - 1, :j], row)
            i = int(np.argmin(cand))
            best[k, j] = cand[i]
            arg[k, j] = i
    starts = [0] * stages
    j = n
    for k in range(stages, 0, -1):
        i = int(arg[k, j])
        starts[k - 1] = i
        j = i
    return float(best[stages, n]), starts


def partition(
    graph: Graph,
    stages: int,
    profile: Profile | None = None,
    mem_limit: int | None = None,
    boundaries: Sequence[str] | None = None,
    node_time_fn: Callable[[Node], float] | None = None,
    node_stages: bool = False,
    value_bytes_fn: Callable[[Value], int] | None = None,
) -> Partition:
    """Cuts ``graph`` into ``stages`` stages: the given ``boundaries`` (value names, one per
    cut: a stage ends after the node making its value), or with ``node_stages`` the nodes'
    own stage tags (the DSL's ``stage N { }`` blocks, see node_stage_starts), or else the
    partition minimizing the slowest stage under ``mem_limit`` bytes per device (see the
    module docstring). A manual partition over the memory limit is refused. ``node_time_fn``
    and ``value_bytes_fn`` give a node's time and a value's bytes on one device when a stage
    has several (default: the single-device time, the whole value)."""
    n = len(graph.nodes)
    if stages < 1:
        raise InputError(f"a pipeline needs at least 1 stage, got {stages}")
    if stages > n:
        raise InputError(
            f"cannot cut the graph's {n} nodes into {stages} pipeline stages: every stage needs "
            "at least one node",
            hint=f"use at most {n} stages",
        )
    if mem_limit is not None and mem_limit <= 0:
        raise InputError(f"the memory limit per device must be positive, got {mem_limit}")
    costs = StageCosts(graph, profile or load_profile(), node_time_fn, value_bytes_fn)
    manual = boundaries is not None or node_stages
    if boundaries is not None:
        if node_stages:
            raise InputError(
                "--stage-boundary cannot be combined with the program's stage blocks",
                hint="leave out one of the two",
            )
        starts = manual_starts(graph, stages, boundaries)
    elif node_stages:
        starts = node_stage_starts(graph, stages)
    elif mem_limit is None:
        _, starts = _min_max(costs.cost_row, n, stages)
    else:
        mem = costs.memory()
        limit = float(mem_limit)

        def feasible_cost(j: int) -> np.ndarray:
            row = costs.cost_row(j)
            return np.where(mem[:j, j] <= limit, row, math.inf)

        value, starts = _min_max(feasible_cost, n, stages)
        if math.isinf(value):
            need, _ = _min_max(lambda j: mem[:j, j], n, stages)
            raise InputError(
                f"no partition of the graph into {stages} pipeline stages fits the memory limit "
                f"of {_fmt_bytes(limit)} per device (parameters plus peak activations of a "
                f"stage); the best partition needs {_fmt_bytes(need)} on its fullest device",
                hint=f"raise --mem-limit to at least {math.ceil(need)} bytes, or use more "
                "pipeline stages",
            )
    return _describe(graph, costs, stages, starts, mem_limit, manual=manual)


def parse_stage_boundaries(text: str) -> list[str]:
    """``--stage-boundary A,B,C`` as a list of value names."""
    names = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in names):
        raise InputError(
            f"--stage-boundary {text!r}: expected value names separated by commas, e.g. "
            "--stage-boundary h3,h7",
        )
    return names


def node_stage_starts(graph: Graph, stages: int) -> list[int]:
    """Stage starts from the nodes' stage tags (``Node.stage``). A node without a tag (made
    outside any stage block, or by a pass) joins the stage of the tagged node before it (the
    first tagged node's stage at the start). The tags must be 0..stages-1, every one used, and
    never decrease along the graph's order (a stage only reads from earlier ones)."""
    nodes = graph.nodes
    tags = [n.stage for n in nodes]
    first = next((t for t in tags if t is not None), None)
    if first is None:
        raise InputError(
            "the graph has no stage blocks to take the pipeline stages from",
            hint="wrap the bindings in `stage N { ... }` blocks, or leave the stages to the "
            "automatic partition",
        )
    filled: list[int] = []
    for t in tags:
        filled.append(t if t is not None else (filled[-1] if filled else first))
    for k in range(1, len(nodes)):
        if filled[k] < filled[k - 1]:
            raise InputError(
                f"stage blocks out of order: node {nodes[k].name or nodes[k].op!r} of stage "
                f"{filled[k]} comes after node {nodes[k - 1].name or nodes[k - 1].op!r} of stage "
                f"{filled[k - 1]}; a stage may only read values of the stages before it",
                hint="number the stage blocks in the order the data flows",
            )
    used = sorted(set(filled))
    if used != list(range(stages)):
        raise InputError(
            f"the program's stage blocks are numbered {', '.join(map(str, used))}, but the "
            f"pipeline has {stages} stages: they must be numbered 0 to {stages - 1}, each used",
            hint=f"give --pipeline {len(used)}" if used == list(range(len(used))) else None,
        )
    return [filled.index(s) for s in range(stages)]


def manual_starts(graph: Graph, stages: int, boundaries: Sequence[str]) -> list[int]:
    """Stage starts from boundary value names, with errors that say which name is wrong."""
    n = len(graph.nodes)
    if len(boundaries) != stages - 1:
        raise InputError(
            f"--stage-boundary names {len(boundaries)} value(s) for {stages} pipeline stages; "
            f"{stages} stages need {stages - 1} (the last value of every stage but the last)",
        )
    producer: dict[str, int] = {}
    for k, node in enumerate(graph.nodes):
        for o in node.outputs:
            producer[o.name] = k
    not_made = {v.name for v in graph.inputs} | {c.name for c in graph.constants}
    starts = [0]
    for b in boundaries:
        if b not in producer:
            if b in not_made:
                raise InputError(
                    f"--stage-boundary {b!r} is a graph input or a constant, not made by a node: "
                    "a stage ends after the node that makes the value named",
                    hint="name an output of the last node of the stage",
                )
            raise InputError(
                f"--stage-boundary {b!r}: the graph has no value of that name",
                hint=did_you_mean(b, producer, "`flowc inspect MODEL` lists the values"),
            )
        start = producer[b] + 1
        if start <= starts[-1]:
            prev = boundaries[len(starts) - 2] if len(starts) > 1 else None
            why = (
                f"is made at or before {prev!r} (node {starts[-1] - 1})"
                if prev is not None
                else "cannot end a stage"
            )
            raise InputError(
                f"--stage-boundary {b!r} (made by node {producer[b]}) {why}: the boundaries "
                "must be in the graph's order and leave every stage at least one node",
            )
        if start >= n:
            raise InputError(
                f"--stage-boundary {b!r} is made by the graph's last node: the last stage "
                "would be empty",
                hint="name a value made earlier",
            )
        starts.append(start)
    return starts


def _describe(
    graph: Graph,
    costs: StageCosts,
    stages: int,
    starts: list[int],
    mem_limit: int | None,
    manual: bool,
) -> Partition:
    n = costs.n
    ends = [*starts[1:], n]
    node_stage = [s for s in range(stages) for _ in range(starts[s], ends[s])]
    compute = [float(costs.prefix[e] - costs.prefix[b]) for b, e in zip(starts, ends, strict=True)]
    cut_s = [float(costs.cut_time[c]) for c in starts[1:]]
    bounds = [
        [BoundaryValue(v.name, s, s + 1, nb) for v, nb in costs.crossing(c)]
        for s, c in enumerate(starts[1:])
    ]
    pbytes, abytes = [], []
    for b, e in zip(starts, ends, strict=True):
        params, peaks = costs.memory_row(b)
        pbytes.append(int(params[e]))
        abytes.append(int(peaks[e]))
    if mem_limit is not None and manual:
        for s in range(stages):
            if pbytes[s] + abytes[s] > mem_limit:
                raise InputError(
                    f"pipeline stage {s} of --stage-boundary needs "
                    f"{_fmt_bytes(pbytes[s] + abytes[s])} (parameters {_fmt_bytes(pbytes[s])}, "
                    f"peak activations {_fmt_bytes(abytes[s])}), more than the memory limit of "
                    f"{_fmt_bytes(mem_limit)} per device",
                    hint="move the boundaries, or leave them out for the automatic partition",
                )
    return Partition(
        stages, starts, node_stage, compute, cut_s, bounds, pbytes, abytes, mem_limit, manual
    )
