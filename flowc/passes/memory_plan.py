"""Memory plan v1: every intermediate in one arena at a static offset.

Over a schedule (a topological order of the nodes), each intermediate gets a live interval
from the step that produces it to the last step that reads it. Views (Reshape, Squeeze, ...)
are aliases: reading a view reads its base, so it extends the base's interval and takes no
space. An element-wise node whose input dies at that node writes its output in place, into
the input's bytes. Buffers are then placed greedily by size, each in the smallest gap that
fits among the buffers live at the same time (best fit), 256-byte aligned.

Graph inputs and outputs live in the caller's memory and constants in the weights, so none
of them is in the arena; nothing is ever written into an input or a constant. A view whose
result is a graph output (an Identity of an input, a Reshape of a weight) stays a copy node;
an output that is an input or a constant itself is listed in ``output_copies`` for code
generation to copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowc.ir.graph import Graph, Node, Value
from flowc.ops.registry import get_op

ALIGN = 256
INPLACE_FAMILIES = frozenset({"elementwise"})


def aligned(nbytes: int) -> int:
    return max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)


def schedule(graph: Graph) -> list[Node]:
    """The execution order: the graph's topological order (verified)."""
    defined = set(graph.inputs) | set(graph.constants)
    for node in graph.nodes:
        missing = [i.name for i in node.inputs if i is not None and i not in defined]
        if missing:
            raise ValueError(
                f"node {node.name or node.op!r} reads {missing} before they are computed"
            )
        defined.update(node.outputs)
    return list(graph.nodes)


def is_view(graph: Graph, node: Node) -> bool:
    """A view node that stays an alias: one whose result is a graph output must be copied."""
    return get_op(node.op).view and node.outputs[0] not in set(graph.outputs)


@dataclass
class Buffer:
    """One arena allocation: a base value and the values that reuse its bytes in place."""

    id: int
    values: list[Value]
    size: int
    start: int
    end: int
    offset: int = -1


@dataclass
class MemoryPlan:
    steps: list[Node]
    buffers: list[Buffer]
    value_buffer: dict[Value, int]  # every arena value (views included) -> its buffer
    arena_bytes: int
    lower_bound: int
    naive_bytes: int
    inplace: int  # values written into an input's bytes
    output_copies: list[Value] = field(default_factory=list)

    def offset(self, v: Value) -> int:
        return self.buffers[self.value_buffer[v]].offset


def _storage_roots(graph: Graph, steps: list[Node]) -> dict[Value, Value]:
    """Each value -> the value whose storage it uses (itself unless it is a view)."""
    root: dict[Value, Value] = {v: v for v in [*graph.inputs, *graph.constants]}
    for node in steps:
        for o in node.outputs:
            root[o] = o
        src = node.inputs[0] if node.inputs else None
        if is_view(graph, node) and src is not None:
            root[node.outputs[0]] = root[src]
    return root


def plan_memory(
    graph: Graph, steps: list[Node] | None = None, joins: dict[int, int] | None = None
) -> MemoryPlan:
    """``joins`` maps the step of a node that runs on another stream (a collective) to the
    step where the compute stream waits for it: until then the other stream may still read
    its inputs and write its outputs, so their bytes stay reserved through that step (the
    happens-before order the events define, not the linear one)."""
    steps = schedule(graph) if steps is None else steps
    joins = joins or {}
    root = _storage_roots(graph, steps)
    outputs = set(graph.outputs)
    external = set(graph.inputs) | set(graph.constants) | outputs
    step_of = {o: t for t, node in enumerate(steps) for o in node.outputs}

    # Last read of each storage root, through any view.
    last_use: dict[Value, int] = {}
    for t, node in enumerate(steps):
        for i in node.inputs:
            if i is not None:
                last_use[root[i]] = max(last_use.get(root[i], 0), joins.get(t, t))
        for o in node.outputs:
            if t in joins:
                last_use[root[o]] = max(last_use.get(root[o], t), joins[t])

    # Buffers: one per arena root, unless an element-wise node can write over a dying input.
    buffer_of: dict[Value, Buffer] = {}
    buffers: list[Buffer] = []
    inplace = 0
    for t, node in enumerate(steps):
        if is_view(graph, node):
            continue
        opdef = get_op(node.op)
        for o in node.outputs:
            if o in external:
                continue
            size = aligned(o.type.nbytes)
            end = last_use.get(o, t)
            host: Buffer | None = None
            if opdef.family in INPLACE_FAMILIES and len(node.outputs) == 1:
                for i in node.inputs:
                    if i is None:
                        continue
                    r = root[i]
                    b = buffer_of.get(r)
                    # Same element count and width: element k is read and written by the same
                    # thread, so overwriting is safe once nothing else reads the input.
                    if (
                        b is not None
                        and b.end == t
                        and last_use.get(r) == t
                        and i.type.numel == o.type.numel
                        and i.type.dtype.itemsize == o.type.dtype.itemsize
                        and b.size == size
                    ):
                        host = b
                        break
            if host is not None:
                host.values.append(o)
                host.end = max(host.end, end)
                inplace += 1
                buffer_of[o] = host
            else:
                b = Buffer(len(buffers), [o], size, step_of[o], max(end, step_of[o]))
                buffers.append(b)
                buffer_of[o] = b

    _place(buffers)
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
        steps=steps,
        buffers=buffers,
        value_buffer=value_buffer,
        arena_bytes=arena,
        lower_bound=live_bytes_bound(buffers, len(steps)),
        naive_bytes=sum(b.size for b in buffers),
        inplace=inplace,
        output_copies=copies,
    )


def live_bytes_bound(buffers: list[Buffer], num_steps: int) -> int:
    """The most bytes live at any step: no placement can use less."""
    delta = [0] * (num_steps + 2)
    for b in buffers:
        delta[b.start] += b.size
        delta[b.end + 1] -= b.size
    best = live = 0
    for d in delta:
        live += d
        best = max(best, live)
    return best


def _place(buffers: list[Buffer]) -> None:
    """Greedy by size, best fit: largest first, each into the tightest gap that holds it."""
    placed: list[Buffer] = []
    for b in sorted(buffers, key=lambda x: (-x.size, x.start, x.id)):
        busy = sorted(
            (p for p in placed if p.start <= b.end and b.start <= p.end),
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
