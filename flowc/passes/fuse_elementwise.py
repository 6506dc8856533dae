"""fuse_elementwise: chains of element-wise ops become one FusedElementwise node (one kernel).

A producer joins its consumer's group when both are element-wise ops with a C++ expression,
the producer's result is read only by that consumer (and is not a graph output), and it has
as many elements as the consumer's result, so fusing never recomputes a value per element of
a bigger broadcast. Broadcasting inside a group is fine: every operand is read at the group
output's coordinates through its own broadcast strides.

A group runs where its last member stood. In a training step a producer stays apart when
joining would carry two or more of its full-size inputs past other kernels (a gradient
accumulation's running sum, fused, would hold every micro-batch's gradient to the end).
"""

from __future__ import annotations

import json

from flowc.ir.graph import Graph, Node, Value
from flowc.ops.registry import get_op
from flowc.passes.manager import register_pass

FUSED = "FusedElementwise"


def fusible(node: Node) -> bool:
    # CastLike reads only its first input's data (the second gives a type): kept apart.
    return (
        len(node.outputs) == 1
        and node.op not in (FUSED, "CastLike")
        and get_op(node.op).cexpr is not None
    )


def program_of(members: list[Node]) -> tuple[list[Value], str]:
    """The group's external inputs and its program (JSON): steps in order, each naming its
    operands as external input k (k >= 0) or the result of step j (-(j + 1))."""
    produced = {m.outputs[0]: j for j, m in enumerate(members)}
    externals: list[Value] = []
    steps: list[dict[str, object]] = []
    for m in members:
        args: list[int | None] = []
        for i in m.inputs:
            if i is None:
                args.append(None)
            elif i in produced:
                args.append(-(produced[i] + 1))
            else:
                if i not in externals:
                    externals.append(i)
                args.append(externals.index(i))
        o = m.outputs[0]
        steps.append(
            {
                "op": m.op,
                "args": args,
                "attrs": {k: (list(v) if isinstance(v, tuple) else v) for k, v in m.attrs.items()},
                "dtype": o.type.dtype.short,
                "shape": list(o.type.shape),
            }
        )
    return externals, json.dumps(steps, sort_keys=True, separators=(",", ":"))


def _held_longer(graph: Graph, group: list[Node], at: int, position: dict[Node, int]) -> bool:
    """Whether fusing ``group`` into a consumer at position ``at`` would keep two or more of
    its full-size inputs alive across other work (a kernel that is not element-wise) where
    alone it would have reduced them to one result there: a gradient accumulation's sum
    of micro-batches, fused, would keep every micro-batch's gradient until the last."""
    last = position[group[-1]]
    if not any(not fusible(graph.nodes[k]) for k in range(last + 1, at)):
        return False
    inside = {m.outputs[0] for m in group}
    out = group[-1].outputs[0]
    big = {
        i
        for m in group
        for i in m.inputs
        if i is not None and i not in inside and i.const is None and i.type.numel == out.type.numel
    }
    return len(big) >= 2


@register_pass("fuse_elementwise")
def fuse_elementwise(graph: Graph) -> Graph:
    users = graph.users()
    outputs = graph.kept()
    position = {n: k for k, n in enumerate(graph.nodes)}
    group_of: dict[Value, list[Node]] = {}  # a group's result -> its members, in order
    for node in graph.nodes:
        if not fusible(node):
            continue
        members: list[Node] = []
        out = node.outputs[0]
        for i in node.inputs:
            if i is None or i not in group_of or i in outputs:
                continue
            if len(users.get(i, [])) != 1 or i.type.numel != out.type.numel:
                continue
            if graph.state and _held_longer(graph, group_of[i], position[node], position):
                continue  # a training step's memory: see _held_longer
            members.extend(group_of.pop(i))
        members.append(node)
        group_of[out] = members
    fused_at: dict[Node, Node] = {}
    removed: set[Node] = set()
    for result, members in group_of.items():
        if len(members) < 2:
            continue
        externals, program = program_of(members)
        last = members[-1]
        fused = Node(FUSED, list(externals), [result], {"program": program}, name=last.name)
        fused_at[last] = fused
        removed.update(members[:-1])
    graph.nodes = [fused_at.get(n, n) for n in graph.nodes if n not in removed]
    return graph
