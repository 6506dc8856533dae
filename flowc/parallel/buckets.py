"""Gradient buckets: a rank graph's all-reduces merged into fewer, larger ones.

Data parallelism all-reduces every gradient, and each all-reduce pays the link's latency
once: a transformer's few hundred gradients pay it a few hundred times, most of them for a
bias or a norm's scale of a few kilobytes. A bucket is one AllReduce node of several parts
(one NCCL group on the GPU, one packed MPI call on the host: one latency for all of them).

``bucket_all_reduces`` walks the all-reduces in the graph's order (a training step's: the
backward's, so the last layer's gradients first) and gathers consecutive ones over the same
mesh axis and of the same type into a bucket until its bytes reach ``cap``; the bucket's
node takes the place of its last part (all its inputs made), and the graph is put back in
topological order. A part joins only if it does not depend on the bucket's earlier parts
(a tensor-parallel forward's chained all-reduces never merge: that would be a cycle).

Waiting for the last part delays the first parts' reductions and the updates that read
them; the driver weighs that against the latencies saved by the schedule's simulation over
a few caps (``CAPS``), as OneFlow and PyTorch's DDP do by hand with a fixed bucket size.
"""

from __future__ import annotations

from flowc.ir.graph import Graph, Node

# The caps the driver tries (bytes per bucket; 0: no buckets, each all-reduce alone).
CAPS = (0, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26)


def _key(node: Node) -> tuple[object, ...]:
    x = node.inputs[0]
    assert x is not None
    return (tuple(node.attrs["mesh"]), int(node.attrs["mesh_axis"]), x.type.dtype)


def bucket_all_reduces(graph: Graph, cap: int) -> int:
    """Merge ``graph``'s all-reduces into buckets of at most ``cap`` bytes (a single part
    larger than the cap is a bucket alone); returns the number of all-reduce nodes removed."""
    if cap <= 0:
        return 0
    position = {n: k for k, n in enumerate(graph.nodes)}
    buckets: list[list[Node]] = []
    current: list[Node] = []
    size = 0

    def depends_on(node: Node, members: list[Node]) -> bool:
        """Whether ``node`` reads (through any path) an output of ``members``; the search
        stops at nodes before the first member, which cannot."""
        targets = set(members)
        first = position[members[0]]
        seen: set[Node] = set()
        todo = [node]
        while todo:
            n = todo.pop()
            for i in n.inputs:
                p = i.producer if i is not None else None
                if p is None or p in seen or p not in position or position[p] < first:
                    continue
                if p in targets:
                    return True
                seen.add(p)
                todo.append(p)
        return False

    for node in graph.nodes:
        if node.op != "AllReduce" or len(node.inputs) != 1:
            continue
        nbytes = node.outputs[0].type.nbytes
        fits = current and size + nbytes <= cap and _key(node) == _key(current[0])
        if fits and not depends_on(node, current):
            current.append(node)
            size += nbytes
            continue
        if len(current) > 1:
            buckets.append(current)
        current, size = [node], nbytes
    if len(current) > 1:
        buckets.append(current)
    if not buckets:
        return 0
    replaced: dict[Node, Node | None] = {}
    for members in buckets:
        last = members[-1]
        merged = Node(
            "AllReduce",
            [m.inputs[0] for m in members],
            [m.outputs[0] for m in members],  # the same values: their uses stay
            last.attrs,
            f"bucket/{last.name}",
        )
        for m in members:
            replaced[m] = None
        replaced[last] = merged
    nodes: list[Node] = []
    for n in graph.nodes:
        if n not in replaced:
            nodes.append(n)
        elif (merged_node := replaced[n]) is not None:
            nodes.append(merged_node)
    graph.nodes = nodes
    graph.sort_topologically()
    return sum(len(m) - 1 for m in buckets)
