"""fold_constants: evaluate every node whose inputs are all known at compile time.

The ONNX importer already folds while it builds; this pass does the same for graphs built
any other way (the DSL, rewrites by later passes), through the same builder code.
"""

from __future__ import annotations

from flowc.ir.builder import (
    evaluate_node,
    fold_forced,
    fold_inputs,
    small_enough_to_fold,
    worth_folding,
)
from flowc.ir.graph import Graph, compact_constant
from flowc.ops.registry import get_op
from flowc.passes.manager import register_pass


@register_pass("fold_constants")
def fold_constants(graph: Graph) -> Graph:
    kept = []
    for node in graph.nodes:
        opdef = get_op(node.op)
        arrays = fold_inputs(opdef, node.inputs)
        key = f"{node.op}:{node.outputs[0].name}" if node.outputs else node.op
        forced = fold_forced(graph, key)
        if (
            arrays is None
            or forced is False
            or not (forced or small_enough_to_fold([o.type for o in node.outputs], arrays, opdef))
        ):
            if arrays is not None:
                graph.fold_decisions[key] = False
            kept.append(node)
            continue
        where = f"{node.op} node {node.name!r}"
        outs = evaluate_node(opdef, arrays, node.attrs, [o.type for o in node.outputs], where)
        if not (forced or worth_folding(arrays, outs)):
            graph.fold_decisions[key] = False
            kept.append(node)
            continue
        graph.fold_decisions[key] = True
        for o, a in zip(node.outputs, outs, strict=False):
            o.producer = None
            o.const = compact_constant(a)
            o.const.setflags(write=False)
            graph.constants.append(o)
    graph.nodes = kept
    graph.remove_unused()
    return graph
