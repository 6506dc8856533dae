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
buffer, its workspace: written by the stream's first library call and accessed by each
later one, so other values use those bytes before the first call and after the last.

Graph inputs and outputs live in the caller's memory and constants in the weights, so none
of them is in the arena; nothing is ever written into an input or a constant. A view whose
result is a graph output (an Identity of an input, a Reshape of a weight) stays a copy node;
an output that is an input or a constant itself is listed in ``output_copies`` for code
generation to copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flowc.ir.graph import Graph, Node, Value
from flowc.ops.registry import get_op, is_view

if TYPE_CHECKING:
    from flowc.schedule.program import Schedule

ALIGN = 256
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
    """One arena allocation: a base value and the values that reuse its bytes in place.
    ``start``/``end`` span its accesses in issue order; ``writer`` is the step of its first
    write and ``last[s]`` the position on stream s of its last access there (0: none)."""

    id: int
    values: list[Value]
    size: int
    start: int
    end: int
    offset: int = -1
    writer: int = -1
    last: list[int] = field(default_factory=list)
    workspace: int = -1  # the stream whose library workspace this is (-1: values)


@dataclass
class MemoryPlan:
    order: Order
    buffers: list[Buffer]
    value_buffer: dict[Value, int]  # every arena value (views included) -> its buffer
    arena_bytes: int
    lower_bound: int
    naive_bytes: int
    inplace: int  # values written into an input's bytes
    output_copies: list[Value] = field(default_factory=list)
    workspaces: dict[int, int] = field(default_factory=dict)  # stream -> its workspace buffer
    workspace_bytes: int = 0  # each workspace's size

    def workspace_offset(self, stream: int) -> int:
        return self.buffers[self.workspaces[stream]].offset

    @property
    def steps(self) -> list[Node]:
        return self.order.steps

    def offset(self, v: Value) -> int:
        return self.buffers[self.value_buffer[v]].offset


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


def plan_memory(graph: Graph, order: Order | None = None, workspace_bytes: int = 0) -> MemoryPlan:
    """``workspace_bytes``: the library workspace of each stream that calls one (0: none)."""
    order = Order.linear(graph) if order is None else order
    steps = order.steps
    ns = order.num_streams
    root = storage_roots(graph)
    outputs = set(graph.outputs)
    external = set(graph.inputs) | set(graph.constants) | outputs

    readers: dict[Value, list[int]] = {}
    for t, node in enumerate(steps):
        for i in node.inputs:
            if i is not None:
                readers.setdefault(root[i], []).append(t)

    buffer_of: dict[Value, Buffer] = {}
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
            host: Buffer | None = None
            if opdef.family in INPLACE_FAMILIES and len(node.outputs) == 1:
                for i in node.inputs:
                    if i is None:
                        continue
                    b = buffer_of.get(root[i])
                    # Same element count and width: element k is read and written by the same
                    # thread, so overwriting is safe once every other access of the input's
                    # bytes happens before this node.
                    if (
                        b is not None
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
                host = Buffer(len(buffers), [o], size, t, t, writer=t, last=[0] * ns)
                buffers.append(host)
                buffer_of[o] = host
            touch(host, t)
            for reader in readers.get(o, []):
                touch(host, reader)

    workspaces: dict[int, int] = {}
    if workspace_bytes > 0:
        for t, node in enumerate(steps):
            if not get_op(node.op).library:
                continue
            s = order.stream[t]
            if s not in workspaces:
                workspaces[s] = len(buffers)
                buffers.append(
                    Buffer(
                        len(buffers),
                        [],
                        aligned(workspace_bytes),
                        t,
                        t,
                        writer=t,
                        last=[0] * ns,
                        workspace=s,
                    )
                )
            touch(buffers[workspaces[s]], t)

    _place(buffers, order)
    value_buffer = {v: b.id for b in buffers for v in b.values}
    for v, r in root.items():
        if v is not r and r in buffer_of:
            value_buffer[v] = buffer_of[r].id
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
        lower_bound=live_bytes_bound(buffers, len(steps)),
        naive_bytes=sum(b.size for b in buffers),
        inplace=inplace,
        output_copies=copies,
        workspaces=workspaces,
        workspace_bytes=aligned(workspace_bytes) if workspaces else 0,
    )


def _all_before(b: Buffer, t: int, order: Order) -> bool:
    """Every access of ``b`` recorded so far happens before step ``t`` or is ``t`` itself
    (``t`` reading it is the in-place write's own read)."""
    clock = order.clock[t]
    s = order.stream[t]
    return all(b.last[k] <= (order.pos[t] if k == s else clock[k]) for k in range(len(b.last)))


def _ordered(a: Buffer, b: Buffer, order: Order) -> bool:
    """Every access of ``a`` happens before ``b``'s first write (so before all of ``b``'s
    accesses: they all follow that write)."""
    if a.end >= b.start:
        return False
    clock = order.clock[b.writer]
    return all(last <= clock[k] for k, last in enumerate(a.last))


def live_bytes_bound(buffers: list[Buffer], num_steps: int) -> int:
    """The most bytes live at any step of the issue order: buffers whose accesses interleave
    there are never ordered, so no placement can use less."""
    delta = [0] * (num_steps + 2)
    for b in buffers:
        delta[b.start] += b.size
        delta[b.end + 1] -= b.size
    best = live = 0
    for d in delta:
        live += d
        best = max(best, live)
    return best


def _place(buffers: list[Buffer], order: Order) -> None:
    """Greedy by size, best fit: largest first, each into the tightest gap among the placed
    buffers it may not share bytes with."""
    placed: list[Buffer] = []
    for b in sorted(buffers, key=lambda x: (-x.size, x.start, x.id)):
        busy = sorted(
            (p for p in placed if not _ordered(p, b, order) and not _ordered(b, p, order)),
            key=lambda p: (p.offset, p.id),
        )
        best_offset, best_gap = -1, None
        cursor = 0
        for p in busy:
            gap = p.offset - cursor
            if gap >= b.size and (best_gap is None or gap < best_gap):
                best_offset, best_gap = cursor, gap
            cursor = max(cursor, p.offset + p.size)
        b.offset = best_offset if best_offset >= 0 else cursor
        placed.append(b)
