"""lower_ops: rewrite ops that have no kernel of their own into the ops their import adapter
lowers them to.

Several ops (LSTM, GRU, RNN, Einsum, DFT, STFT, the integer matmul/conv forms, Compress, the
training updates, ...) compile through their ONNX import adapter, which replaces the node by
ops that have kernels. A graph that reaches the compiler without passing through the ONNX
importer (a DSL program calling `lstm(...)`, a hand-built graph) still holds the op itself;
this pass runs the same adapter on it, so such a graph compiles exactly like an imported
model. The IR keeps ONNX's newest attribute forms, so the adapter sees the newest opset.
"""

from __future__ import annotations

import onnx

from flowc.ir.builder import AdapterNode, GraphBuilder
from flowc.ir.graph import Graph, Node, Value
from flowc.ops.registry import get_op
from flowc.passes.manager import register_pass


def _needs_lowering(node: Node) -> bool:
    opdef = get_op(node.op)
    return (
        opdef.emit is None
        and opdef.cexpr is None
        and not opdef.view
        and opdef.onnx_import is not None
    )


@register_pass("lower_ops")
def lower_ops(graph: Graph) -> Graph:
    if not any(_needs_lowering(n) for n in graph.nodes):
        return graph

    opset = onnx.defs.onnx_opset_version()
    nodes = graph.nodes
    graph.nodes = []
    builder = GraphBuilder(graph)
    replaced: dict[Value, Value] = {}
    for node in nodes:
        node.inputs = [replaced.get(i, i) if i is not None else None for i in node.inputs]
        if not _needs_lowering(node):
            graph.nodes.append(node)
            continue
        names = [o.name for o in node.outputs]
        onode = AdapterNode(
            builder, node.op, opset, node.name, list(node.inputs), dict(node.attrs), names
        )
        adapter = get_op(node.op).onnx_import
        assert adapter is not None
        outs = adapter(onode)
        if outs is None:
            # The adapter only normalized attributes: the op stays as it is.
            graph.nodes.append(node)
            continue
        for old, new in zip(node.outputs, outs, strict=False):
            replaced[old] = new
    for old, new in replaced.items():
        if new.sbp is None:
            new.sbp = old.sbp  # a placed value's layout binds what replaces it
        if old in graph.outputs:
            _output_keeps_its_name(graph, old, new)
    builder.flush_warnings()
    graph.remove_unused()
    return graph


def _output_keeps_its_name(graph: Graph, old: Value, new: Value) -> None:
    """A graph output replaced by a lowering keeps its name (the program's API)."""
    if new in graph.outputs or new in graph.inputs or new.const is not None:
        copy = graph.add_node("Identity", [new], [new.type], name=f"{old.name}/out")
        new = copy.outputs[0]
    graph.outputs = [new if o is old else o for o in graph.outputs]
    name = old.name
    graph.rename(old, graph.unique_name(f"{name}.lowered"))
    graph.rename(new, name)
