"""Memory plan: every intermediate in one arena at a static offset, reused along the
schedule's happens-before order.

The schedule gives the order the nodes run in and, with several streams, which of them are
ordered at all (vector clocks over the emitted per-stream program). Each intermediate's
buffer is accessed by its writer and its readers; views (Reshape, Squeeze, ...) are aliases,
so reading a view reads its base. Two buffers may share bytes only when every access of one
happens before the other's first write -- on one stream that is "its live interval ends
before the other's begins"; across streams, an event must order them. An element-wise node
whose input is last read by that node (every other reader happens before it) writes its
output in place, into the input's bytes. Buffers are placed greedily by size, each in the
tightest gap left by the placed buffers it may not share with (best fit), 256-byte aligned.

Each stream that calls a library (cuBLASLt, cuDNN: the op's ``library``) gets one more
buffer on the GPU, its workspace: as large as the most any of its calls can use (the op's
``workspace`` bound from its shapes, at most the cost profile's workspace, the cap). The
workspaces sit on top of the arena, above every value: the host target, whose library
calls need no workspace, allocates only the values' part (``host_arena_bytes``), and both
targets share one plan of offsets.

Graph inputs and outputs live in the caller's memory and constants in the weights, so none
of them is in the arena; nothing is ever written into an input or a constant. A view whose
result is a graph output (an Identity of an input, a Reshape of a weight) stays a copy node;
an output that is an input or a constant itself is listed in ``output_copies`` for code
generation to copy.

In place where it is free (aliases: a value at a fixed byte offset inside another's bytes):

- A Concat whose slices are contiguous (the dims before the axis multiply to 1, as a
  batch-1 NCHW channel concat) has each eligible input written by its producer straight
  into its slice of the output: the input is an arena value produced by a node that runs
  (not a graph input, constant, output or view, not itself an alias), appears once in that
  Concat and lives in no other. The Concat then copies only the other inputs, and runs
  nothing when there are none (``elided``).
- A Split or a step-1 static Slice whose outputs are contiguous slices of its (arena) input
  makes them views at the slice's offset and runs nothing; its readers only read pointers.
- Every alias offset is a multiple of ``ALIGN``, so every arena pointer stays 256-aligned
  (what the GEMM plans and vector loads assume); a slice that is not stays a copy.

A value with aliases and its aliases form one buffer (a *family*) whose accesses are all
of theirs: so the element-wise in-place rule and the reuse rule below see every access of
the shared bytes -- nothing is written over them while any alias may still be read. An
in-place element-wise output takes a whole buffer only (same offset, same size), never a
slice.

Lifetimes and placement: each buffer is an interval over the issue order, ``[start,
join)``: from its first access to the first step after which every later step happens
after all its accesses (its *join*; on one stream just after its last access; a buffer read
on another stream lives until the event that joins that stream back). Two buffers whose
intervals do not meet are ordered, so a placement without overlapping live intervals is
safe; the lower bound is the peak of live bytes over those intervals. Library workspaces
are such intervals too, as are the values Send/Recv and collectives read and write (plain
registers). A pipeline stage's registers of count k are its k micro-batch copies (the
unrolled program, flowc.schedule.unroll): copies the schedule leaves unordered are live
together and get distinct bytes. The graph's staging buffers (model.cu's CUDA-graph
copies of the inputs and outputs) live through the whole run, outside the arena.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from flowc.ir.graph import Graph, Node, Value
from flowc.memory.placement import Interval, place
from flowc.ops.registry import get_op, is_view

if TYPE_CHECKING:
    from flowc.schedule.program import Schedule

ALIGN = 256
# Search nodes the interval placer may spend per plan (deterministic; see placement.py).
PLACEMENT_WORK_LIMIT = 2_000
# Alias candidates tried one by one per plan (each trial plans without placing).
MAX_ALIAS_TRIALS = 256
INPLACE_FAMILIES = frozenset({"elementwise"})

__all__ = ["ALIGN", "Buffer", "MemoryPlan", "Order", "is_view", "plan_memory"]


def aligned(nbytes: int) -> int:
    return max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)


@dataclass
class Order:
    """What the planner needs of a schedule: the nodes that run, in issue order, and for each
    its stream, its 1-based position there and its vector clock (how many actors of each
    stream happen before it, itself included)."""

    steps: list[Node]
    stream: list[int]
    pos: list[int]
    clock: list[tuple[int, ...]]
    _on: list[list[int]] | None = field(default=None, repr=False, compare=False)

    def on_stream(self) -> list[list[int]]:
        """Each stream's steps (issue indices) in order."""
        if self._on is None:
            on: list[list[int]] = [[] for _ in range(self.num_streams)]
            for t, s in enumerate(self.stream):
                on[s].append(t)
            self._on = on
        return self._on

    @property
    def num_streams(self) -> int:
        return len(self.clock[0]) if self.clock else 1

    def hb(self, a: int, b: int) -> bool:
        """Step ``a`` happens before (or is) step ``b``."""
        return a == b or self.clock[b][self.stream[a]] >= self.pos[a]

    @staticmethod
    def linear(graph: Graph, nodes: list[Node] | None = None) -> Order:
        """One stream: the graph's topological order (verified), views left out."""
        steps = [n for n in _topological(graph, nodes) if not is_view(graph, n)]
        return Order(
            steps,
            [0] * len(steps),
            list(range(1, len(steps) + 1)),
            [(k,) for k in range(1, len(steps) + 1)],
        )

    @staticmethod
    def of(schedule: Schedule) -> Order:
        ag = schedule.actors
        return Order(
            [ag.actors[a].node for a in schedule.issue],
            [schedule.stream_of[a] for a in schedule.issue],
            [schedule.pos[a] for a in schedule.issue],
            [schedule.clock[a] for a in schedule.issue],
        )


def _topological(graph: Graph, nodes: list[Node] | None) -> list[Node]:
    defined = set(graph.inputs) | set(graph.constants)
    order = list(graph.nodes) if nodes is None else nodes
    for node in order:
        missing = [i.name for i in node.inputs if i is not None and i not in defined]
        if missing:
            raise ValueError(
                f"node {node.name or node.op!r} reads {missing} before they are computed"
            )
        defined.update(node.outputs)
    return order


@dataclass
class Buffer:
    """One arena allocation: a base value and the values that reuse its bytes (in place, or
    as aliases at ``value_offset``). ``start``/``end`` span its accesses in issue order;
    ``writer`` is the step of its first write, ``writers`` every step that writes it (several
    for a Concat whose inputs are written in place), ``last[s]`` the position on stream s of
    its last access there (0: none) and ``join`` the end of its lifetime (exclusive: the
    first step after which every later step happens after all its accesses)."""

    id: int
    values: list[Value]
    size: int
    start: int
    end: int
    offset: int = -1
    writer: int = -1
    last: list[int] = field(default_factory=list)
    workspace: int = -1  # the stream whose library workspace this is (-1: values)
    writers: list[int] = field(default_factory=list)
    join: int = -1


@dataclass
class MemoryPlan:
    order: Order
    buffers: list[Buffer]
    value_buffer: dict[Value, int]  # every arena value (views included) -> its buffer
    arena_bytes: int
    lower_bound: int
    naive_bytes: int
    inplace: int  # element-wise values written into an input's bytes
    output_copies: list[Value] = field(default_factory=list)
    workspaces: dict[int, int] = field(default_factory=dict)  # stream -> its workspace buffer
    workspace_cap: int = 0  # the most a workspace may hold (the cost profile's)
    # The values' part of the arena, below the workspaces: all a host build allocates.
    host_arena_bytes: int = 0
    # Aliases: each arena value's byte offset inside its buffer (0 when absent).
    value_offset: dict[Value, int] = field(default_factory=dict)
    # Nodes that run nothing: their results are aliases (a Concat all of whose inputs are
    # written in place, a Split or Slice made views).
    elided: set[Node] = field(default_factory=set)
    # A Concat's inputs written in place: (node, input index) pairs.
    concat_inputs: set[tuple[Node, int]] = field(default_factory=set)
    concat_inplace: int = 0  # Concat inputs written straight into their slice
    views_inplace: int = 0  # Split/Slice outputs made views
    alias_bytes: int = 0  # the aligned bytes of the aliased values (no buffer of their own)
    strategy: str = "greedy"  # the placement's strategy

    def workspace_offset(self, stream: int) -> int:
        return self.buffers[self.workspaces[stream]].offset

    def workspace_size(self, stream: int) -> int:
        """The bytes of ``stream``'s workspace (0: none)."""
        k = self.workspaces.get(stream)
        return self.buffers[k].size if k is not None else 0

    def workspace_total(self) -> int:
        return sum(self.buffers[k].size for k in self.workspaces.values())

    @property
    def steps(self) -> list[Node]:
        return self.order.steps

    def offset(self, v: Value) -> int:
        return self.buffers[self.value_buffer[v]].offset + self.value_offset.get(v, 0)

    def writes_in_place(self, node: Node, index: int) -> bool:
        """Whether input ``index`` of Concat ``node`` was written into its slice already
        (code generation copies only the others)."""
        return (node, index) in self.concat_inputs


def storage_roots(graph: Graph) -> dict[Value, Value]:
    """Each value -> the value whose storage it uses (itself unless it is a view)."""
    root: dict[Value, Value] = {v: v for v in [*graph.inputs, *graph.constants]}
    for node in graph.nodes:
        for o in node.outputs:
            root[o] = o
        src = node.inputs[0] if node.inputs else None
        if is_view(graph, node) and src is not None:
            root[node.outputs[0]] = root[src]
    return root


def _ints(v: Value | None) -> list[int] | None:
    if v is None:
        return None
    if v.const is None:
        raise ValueError(f"{v.name!r} is not a constant")
    return [int(x) for x in np.asarray(v.const).reshape(-1)]


def _slice_first(node: Node) -> int | None:
    """The element offset of a Slice's output in its input when the output is one
    contiguous run of it (static, step 1, the dims before the first sliced one multiply to
    1); None otherwise."""
    from flowc.ops.slicing import slice_plan

    x = node.inputs[0]
    assert x is not None
    try:
        starts, ends = _ints(node.inputs[1]), _ints(node.inputs[2])
        axes = _ints(node.inputs[3]) if len(node.inputs) > 3 else None
        steps = _ints(node.inputs[4]) if len(node.inputs) > 4 else None
    except ValueError:
        return None
    if starts is None or ends is None or any(s != 1 for s in steps or []):
        return None
    slices, shape = slice_plan(ValueError, x.type.shape, starts, ends, axes, steps)
    if tuple(shape) != tuple(node.outputs[0].type.shape):
        return None
    cut = [k for k, (d, e) in enumerate(zip(x.type.shape, shape, strict=True)) if d != e]
    if not cut or math.prod(shape) == 0:
        return None if cut else 0
    first = cut[0]
    if math.prod(x.type.shape[:first]) != 1 or any(k != first for k in cut):
        return None
    strides = [math.prod(x.type.shape[k + 1 :]) for k in range(x.type.rank)]
    return int(slices[first].start or 0) * strides[first]


def _stacks(whole: Value, parts: list[Value], axis: int) -> bool:
    """Whether ``parts`` stacked along ``axis`` have exactly ``whole``'s shape and type."""
    shape = whole.type.shape
    for p in parts:
        ps = p.type.shape
        if p.type.dtype != whole.type.dtype or len(ps) != len(shape):
            return False
        if any(d != e for k, (d, e) in enumerate(zip(ps, shape, strict=True)) if k != axis):
            return False
    return sum(p.type.shape[axis] for p in parts) == shape[axis]


def find_aliases(
    graph: Graph,
    steps: list[Node],
    root: dict[Value, Value],
    external: set[Value],
    allowed: set[Node] | None = None,
) -> tuple[dict[Value, tuple[Value, int]], set[Node], set[tuple[Node, int]]]:
    """Which values live inside another's bytes: value -> (the value it lies in, byte
    offset), the nodes that then run nothing, and the Concat inputs written in place; only
    at the nodes of ``allowed`` (None: anywhere)."""
    parent: dict[Value, tuple[Value, int]] = {}
    elided: set[Node] = set()
    concat_inputs: set[tuple[Node, int]] = set()
    running = {id(n) for n in steps}
    step_of = {id(n): t for t, n in enumerate(steps)}
    read_at: dict[Value, list[int]] = {}  # reads of each value's storage, views included
    for t, n in enumerate(steps):
        for i in n.inputs:
            if i is not None:
                read_at.setdefault(root[i], []).append(t)
    tops: set[Value] = set()  # Concat outputs holding inputs in place

    def in_arena(v: Value) -> bool:
        return v not in external and root[v] is v and v.producer is not None

    for node in steps:
        if allowed is not None and node not in allowed:
            continue
        if any(v is not None and v.type.sym is not None for v in (*node.inputs, *node.outputs)):
            # symbolic dims: a slice's offset changes with the run's sizes, the plan's cannot
            continue
        if node.op == "Concat" and len(node.outputs) == 1:
            out = node.outputs[0]
            axis = int(node.attrs.get("axis", 0)) % max(out.type.rank, 1)
            if not in_arena(out) or math.prod(out.type.shape[:axis]) != 1:
                continue
            if not _stacks(out, [i for i in node.inputs if i is not None], axis):
                continue  # types that do not add up (a hand-built graph): leave it a copy
            itemsize = out.type.dtype.itemsize
            row = math.prod(out.type.shape[axis + 1 :]) * itemsize
            seen = [i for i in node.inputs if i is not None]
            at = 0
            for k, x in enumerate(node.inputs):
                if x is None:
                    continue
                off = at * row
                at += x.type.shape[axis]
                producer = x.producer
                if (
                    in_arena(x)
                    and seen.count(x) == 1
                    and x not in parent
                    and producer is not None
                    and id(producer) in running
                    and producer not in elided
                    and x not in tops
                    and all(r <= step_of[id(node)] for r in read_at.get(x, []))
                    and off % ALIGN == 0
                    and x.type.nbytes > 0
                ):
                    parent[x] = (out, off)
                    concat_inputs.add((node, k))
            if any((node, k) in concat_inputs for k in range(len(node.inputs))):
                tops.add(out)
            if all((node, k) in concat_inputs for k, x in enumerate(node.inputs) if x is not None):
                elided.add(node)
        elif node.op in ("Split", "Slice"):
            x = node.inputs[0]
            if x is None or root[x] in external or root[x].producer is None:
                continue
            if any(o in external or o.type.nbytes == 0 for o in node.outputs):
                continue
            itemsize = x.type.dtype.itemsize
            if node.op == "Split":
                axis = int(node.attrs.get("axis", 0)) % max(x.type.rank, 1)
                if math.prod(x.type.shape[:axis]) != 1 or not _stacks(x, node.outputs, axis):
                    continue
                row = math.prod(x.type.shape[axis + 1 :]) * itemsize
                offs, at = [], 0
                for o in node.outputs:
                    offs.append(at * row)
                    at += o.type.shape[axis]
            else:
                first = _slice_first(node)
                if first is None:
                    continue
                offs = [first * itemsize]
            if any(off % ALIGN for off in offs):
                continue
            base = root[x]
            for o, off in zip(node.outputs, offs, strict=True):
                parent[o] = (base, off)
            elided.add(node)
    return parent, elided, concat_inputs


def plan_memory(
    graph: Graph,
    order: Order | None = None,
    workspace_bytes: int = 0,
    *,
    alias: bool | None = None,
) -> MemoryPlan:
    """``workspace_bytes``: the cap on each library-calling stream's workspace, which is
    the most its calls can use (module docstring; 0: none).
    ``alias``: write Concat inputs in place and make Split/Slice outputs views (module
    docstring) -- None: when that does not make the arena larger, True: always; False keeps
    every value in bytes of its own (element-wise in place still)."""
    order = Order.linear(graph) if order is None else order
    if alias is False:
        return _plan(graph, order, workspace_bytes, set())
    if alias:
        return _plan(graph, order, workspace_bytes, None)
    # In place only where it is free: an alias family holds its whole output from its first
    # member's write (and a view its base until the view's last read), which can cost more
    # than the copies it saves. So each candidate node, in issue order, is kept when the
    # lower bound (the peak of live bytes) does not rise with it, and the placed result
    # when its arena is not above the plan without aliases.
    full = _plan(graph, order, workspace_bytes, None, place=False)
    candidates = _alias_nodes(full)
    if not candidates:
        return _plan(graph, order, workspace_bytes, set())
    chosen: set[Node] = set()
    best = _plan(graph, order, workspace_bytes, chosen, place=False).lower_bound
    for node in candidates[:MAX_ALIAS_TRIALS]:
        trial = _plan(graph, order, workspace_bytes, chosen | {node}, place=False)
        if trial.lower_bound <= best and _alias_nodes(trial):
            chosen.add(node)
            best = trial.lower_bound
    without = _plan(graph, order, workspace_bytes, set())
    if not chosen:
        return without
    with_aliases = _plan(graph, order, workspace_bytes, chosen)
    return with_aliases if with_aliases.arena_bytes <= without.arena_bytes else without


def _alias_nodes(plan: MemoryPlan) -> list[Node]:
    """The nodes whose results alias in ``plan`` (elided, or a Concat with an input in
    place), in issue order."""
    concats = {id(n) for n, _ in plan.concat_inputs}
    return [n for n in plan.steps if n in plan.elided or id(n) in concats]


def _plan(
    graph: Graph,
    order: Order,
    workspace_bytes: int,
    allowed: set[Node] | None,
    *,
    place: bool = True,
) -> MemoryPlan:
    """The plan with aliases at the nodes of ``allowed`` that qualify (None: at all that
    do); ``place=False`` leaves offsets unset (for the lower bound alone)."""
    steps = order.steps
    ns = order.num_streams
    root = storage_roots(graph)
    outputs = set(graph.outputs)
    external = set(graph.inputs) | set(graph.constants) | outputs
    parent, elided, concat_inputs = (
        find_aliases(graph, steps, root, external, allowed)
        if allowed is None or allowed
        else ({}, set(), set())
    )

    def family(v: Value) -> tuple[Value, int]:
        off = 0
        while v in parent:
            v, k = parent[v]
            off += k
        return v, off

    readers: dict[Value, list[int]] = {}
    producer_step: dict[Value, int] = {}
    for t, node in enumerate(steps):
        for i in node.inputs:
            if i is not None:
                readers.setdefault(root[i], []).append(t)
        for o in node.outputs:
            producer_step[o] = t
    members: dict[Value, list[Value]] = {}
    for v in parent:
        members.setdefault(family(v)[0], []).append(v)

    buffer_of: dict[Value, Buffer] = {}
    value_offset: dict[Value, int] = {}
    buffers: list[Buffer] = []
    inplace = 0

    def touch(b: Buffer, t: int) -> None:
        b.start, b.end = min(b.start, t), max(b.end, t)
        b.last[order.stream[t]] = max(b.last[order.stream[t]], order.pos[t])

    for t, node in enumerate(steps):
        opdef = get_op(node.op)
        for o in node.outputs:
            if o in external:
                continue
            size = aligned(o.type.nbytes)
            top, off = family(o)
            if top in members:
                # A family: one buffer, made at its first member's write, that carries every
                # member's accesses from the start (so nothing reuses or writes over its
                # bytes in place while any member may still be read).
                host = buffer_of.get(top)
                if host is None:
                    host = Buffer(
                        len(buffers), [], aligned(top.type.nbytes), t, t, writer=t, last=[0] * ns
                    )
                    buffers.append(host)
                    for m in [top, *members[top]]:
                        buffer_of[m] = host
                        if m in producer_step and m.producer not in elided:
                            touch(host, producer_step[m])
                        for r in readers.get(m, []):
                            touch(host, r)
                host.values.append(o)
                value_offset[o] = off
                if node not in elided:
                    host.writers.append(t)
                continue
            host = None
            if opdef.family in INPLACE_FAMILIES and len(node.outputs) == 1:
                for i in node.inputs:
                    if i is None:
                        continue
                    b = buffer_of.get(root[i])
                    # Same element count and width: element k is read and written by the same
                    # thread, so overwriting is safe once every other access of the input's
                    # bytes happens before this node. Only a whole buffer (not an alias's
                    # slice of one) is taken.
                    if (
                        b is not None
                        and value_offset.get(root[i], 0) == 0
                        and i.type.numel == o.type.numel
                        and i.type.dtype.itemsize == o.type.dtype.itemsize
                        and b.size == size
                        and _all_before(b, t, order)
                    ):
                        host = b
                        break
            if host is not None:
                host.values.append(o)
                inplace += 1
                buffer_of[o] = host
            else:
                host = Buffer(len(buffers), [o], size, t, t, writer=t, last=[0] * ns, writers=[t])
                buffers.append(host)
                buffer_of[o] = host
            touch(host, t)
            for reader in readers.get(o, []):
                touch(host, reader)
    for b in buffers:
        b.writers = sorted(set(b.writers)) or [b.start]
        b.writer = b.writers[0]

    workspaces: dict[int, int] = {}
    values = list(buffers)
    if workspace_bytes > 0:
        for t, node in enumerate(steps):
            need = get_op(node.op).workspace_bytes(node, workspace_bytes)
            if need <= 0:
                continue
            s = order.stream[t]
            if s not in workspaces:
                workspaces[s] = len(buffers)
                buffers.append(
                    Buffer(
                        len(buffers), [], 0, t, t, writer=t, last=[0] * ns, workspace=s, writers=[t]
                    )
                )
            ws = buffers[workspaces[s]]
            ws.size = max(ws.size, aligned(need))
            touch(ws, t)

    for b in buffers:
        b.join = join_step(b, order)
    strategy = _place(values) if place else "none"
    host_arena = max((b.offset + b.size for b in values), default=0)
    above = aligned(host_arena)
    for s_ in sorted(workspaces):
        # Above every value (module docstring), one after another.
        ws = buffers[workspaces[s_]]
        ws.offset = above
        above += ws.size
    value_buffer = {v: b.id for b in buffers for v in b.values}
    for v, rv in root.items():
        if v is not rv and rv in buffer_of:
            value_buffer[v] = buffer_of[rv].id
            if rv in value_offset:
                value_offset[v] = value_offset[rv]
    arena = max((b.offset + b.size for b in buffers), default=0)
    # A view whose result is an output is a copy node already (is_view); what remains are
    # outputs that are an input or a constant themselves, or repeat an earlier output.
    copies = [
        o
        for k, o in enumerate(graph.outputs)
        if o in set(graph.inputs) or o in set(graph.constants) or o in graph.outputs[:k]
    ]
    return MemoryPlan(
        order=order,
        buffers=buffers,
        value_buffer=value_buffer,
        arena_bytes=arena,
        # Of the values' part, plus the workspaces stacked on top of it.
        lower_bound=live_bytes_bound(values, len(steps))
        + sum(buffers[k].size for k in workspaces.values()),
        naive_bytes=sum(b.size for b in buffers),
        inplace=inplace,
        output_copies=copies,
        workspaces=workspaces,
        workspace_cap=workspace_bytes,
        host_arena_bytes=host_arena,
        value_offset={v: k for v, k in value_offset.items() if k},
        elided=elided,
        concat_inputs=concat_inputs,
        concat_inplace=len(concat_inputs),
        views_inplace=len(parent) - len(concat_inputs),
        alias_bytes=sum(aligned(v.type.nbytes) for v in parent),
        strategy=strategy,
    )


def _all_before(b: Buffer, t: int, order: Order) -> bool:
    """Every access of ``b`` recorded so far happens before step ``t`` or is ``t`` itself
    (``t`` reading it is the in-place write's own read)."""
    clock = order.clock[t]
    s = order.stream[t]
    return all(b.last[k] <= (order.pos[t] if k == s else clock[k]) for k in range(len(b.last)))


def join_step(b: Buffer, order: Order) -> int:
    """The end of ``b``'s lifetime in issue order (exclusive): one past the last step that
    does not happen after every access of ``b`` (at least one past its last access). Clocks
    only grow along a stream, so on each stream the steps that do are a suffix: a binary
    search per stream finds where it begins."""
    end = b.end + 1
    if order.num_streams == 1:
        return end
    on = order.on_stream()
    for ts in on:
        lo, hi = 0, len(ts)  # the first index on the stream whose step covers every access
        while lo < hi:
            mid = (lo + hi) // 2
            c = order.clock[ts[mid]]
            if all(last <= c[k] for k, last in enumerate(b.last)):
                hi = mid
            else:
                lo = mid + 1
        if lo > 0:
            end = max(end, ts[lo - 1] + 1)
    return end


def live_bytes_bound(buffers: list[Buffer], num_steps: int) -> int:
    """The most bytes live at any step of the issue order, each buffer live on [start,
    join): no placement whose lifetimes do not meet can use less."""
    delta = [0] * (num_steps + 2)
    for b in buffers:
        delta[b.start] += b.size
        delta[max(b.join, b.end + 1)] -= b.size
    best = live = 0
    for d in delta:
        live += d
        best = max(best, live)
    return best


def _place(buffers: list[Buffer]) -> str:
    """Offsets for buffers live on [start, join), through the interval placer (greedy
    orderings, then its exact search under a deterministic work limit); returns its
    strategy's name."""
    intervals = [Interval(b.id, b.start, max(b.join, b.end + 1), b.size, ALIGN) for b in buffers]
    result = place(intervals, work_limit=PLACEMENT_WORK_LIMIT)
    for b in buffers:
        b.offset = result.offsets[b.id]
    return str(result.strategy)
