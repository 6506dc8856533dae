"""simplify: drop nodes that compute nothing (Identity, inference-mode Dropout), then dead code.

A graph output keeps its name: when the value to forward is an inner one, it takes the
output's name; when it is a graph input or another output, the Identity stays.
"""

from __future__ import annotations

from flowc.ir.graph import Graph, Node
from flowc.passes.manager import register_pass

_FORWARDING = ("Identity", "Dropout")


def _forwards(node: Node) -> bool:
    if node.op not in _FORWARDING:
        return False
    # A Dropout whose mask is read still computes something (an all-true mask).
    return len(node.outputs) == 1


@register_pass("simplify")
def simplify(graph: Graph) -> Graph:
    kept: list[Node] = []
    outputs = set(graph.outputs)
    inputs = set(graph.inputs)
    for node in graph.nodes:
        src = node.inputs[0] if node.inputs else None
        if not _forwards(node) or src is None:
            kept.append(node)
            continue
        out = node.outputs[0]
        if out in outputs:
            if src in inputs or src in outputs or src.const is not None:
                kept.append(node)
                continue
            src.name, out.name = out.name, src.name
        graph.replace_uses(out, src)
        outputs = set(graph.outputs)
    graph.nodes = kept
    graph.remove_unused()
    return graph
