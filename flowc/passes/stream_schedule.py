"""Stream schedule of a multi-rank program: the order of its nodes and where the compute
stream joins each collective.

Collectives run on a communication stream. Each starts as soon as its input is ready, and the
compute stream waits for it (an event) only before the first node that reads its result, so
compute that does not need it overlaps the transfer. The join points are what memory
planning needs: a collective's buffers stay reserved until its join.
"""

from __future__ import annotations

import heapq

from flowc.ir.graph import Graph, Node, Value
from flowc.passes.memory_plan import is_view

# The collective ops of flowc.ops.comm (not imported: that module imports code generation).
COLLECTIVES = frozenset({"AllReduce", "AllGather", "ReduceScatter", "AllToAll"})


def comm_early_order(graph: Graph) -> list[Node]:
    """A topological order that starts each collective as soon as its input is ready, so
    compute that does not need its result overlaps it (Kahn's algorithm; collectives first,
    then the original order)."""
    index = {n: k for k, n in enumerate(graph.nodes)}
    producer = {o: n for n in graph.nodes for o in n.outputs}
    waits: dict[Node, int] = {}
    users: dict[Node, list[Node]] = {n: [] for n in graph.nodes}
    for n in graph.nodes:
        deps = {producer[i] for i in n.inputs if i is not None and i in producer}
        waits[n] = len(deps)
        for d in deps:
            users[d].append(n)
    ready = [(0 if n.op in COLLECTIVES else 1, index[n], n) for n in graph.nodes if not waits[n]]
    heapq.heapify(ready)
    order: list[Node] = []
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        for u in users[n]:
            waits[u] -= 1
            if not waits[u]:
                heapq.heappush(ready, (0 if u.op in COLLECTIVES else 1, index[u], u))
    return order


def _joins(graph: Graph, steps: list[Node]) -> dict[int, int]:
    """Step of each collective -> the step whose node first reads its result (through
    views), or the end when only the caller reads it."""
    root: dict[Value, Value] = {}
    for node in steps:
        src = node.inputs[0] if node.inputs else None
        if is_view(graph, node) and src is not None:
            root[node.outputs[0]] = root.get(src, src)
    joins: dict[int, int] = {}
    for t, node in enumerate(steps):
        if node.op not in COLLECTIVES:
            continue
        outs = set(node.outputs)
        joins[t] = len(steps)
        for u in range(t + 1, len(steps)):
            later = steps[u]
            if is_view(graph, later):
                continue
            if any(i is not None and root.get(i, i) in outs for i in later.inputs):
                joins[t] = u
                break
    return joins


def stream_schedule(graph: Graph) -> tuple[list[Node], dict[int, int]]:
    steps = comm_early_order(graph)
    return steps, _joins(graph, steps)
