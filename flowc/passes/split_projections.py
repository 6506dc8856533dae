"""split_projections: a fused projection followed by a Split becomes separate projections.

GPT-2's attention computes q, k and v with one MatMul/Gemm against a [hidden, 3 * hidden]
weight and splits the result on its last axis. Split along that axis has no split signature
(the chunks would straddle ranks), so the whole projection would stay unsharded. As separate
projections, each weight's columns can be split on its own, and attention heads shard.

Pattern: MatMul(x, W) or Gemm(x, W[, C]) with a constant 2-D W (and a constant bias of shape
[N] or [1, N]), then any Reshapes that keep the last axis, then a Split of the last axis.
Each chunk becomes its own projection (the matching columns of W and C) and Reshapes.
"""

from __future__ import annotations

import numpy as np

from flowc.ir.graph import Graph, Node, Value
from flowc.ops.registry import get_op, node_attrs
from flowc.passes.manager import register_pass


def _only_user(users: dict[Value, list[Node]], v: Value, graph_outputs: set[Value]) -> Node | None:
    us = users.get(v, [])
    if len(us) != 1 or v in graph_outputs:
        return None
    return us[0]


def _column_axis(node: Node) -> int | None:
    """Which axis of W holds the output columns, or None when the node does not qualify."""
    w = node.inputs[1] if len(node.inputs) > 1 else None
    if w is None or w.const is None or w.type.rank != 2:
        return None
    if node.op == "MatMul":
        return 1
    a = node_attrs(node)
    if int(a["transA"]) != 0:
        return None
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        c = node.inputs[2]
        n = w.type.shape[0 if int(a["transB"]) else 1]
        if c.const is None or c.type.shape not in ((n,), (1, n)):
            return None
    return 0 if int(a["transB"]) else 1


def _rewrite(graph: Graph, proj: Node, users: dict[Value, list[Node]]) -> bool:
    col = _column_axis(proj)
    if col is None:
        return False
    outs = graph.kept()
    chain: list[Node] = []
    v = proj.outputs[0]
    n = v.type.shape[-1]
    while True:
        u = _only_user(users, v, outs)
        if u is None:
            return False
        if u.op == "Reshape" and u.inputs[0] is v and u.outputs[0].type.shape[-1] == n:
            chain.append(u)
            v = u.outputs[0]
            continue
        break
    split = u
    if split.op != "Split" or split.inputs[0] is not v:
        return False
    if int(node_attrs(split)["axis"]) % v.type.rank != v.type.rank - 1:
        return False
    sizes = [o.type.shape[-1] for o in split.outputs]
    w = proj.inputs[1]
    assert w is not None and w.const is not None
    bias = proj.inputs[2] if len(proj.inputs) > 2 else None
    new_nodes: list[Node] = []
    start = 0
    for k, (size, out) in enumerate(zip(sizes, split.outputs, strict=True)):
        cols = slice(start, start + size)
        start += size
        wk = graph.add_constant(
            f"{w.name}/part{k}", w.const[:, cols] if col == 1 else w.const[cols, :]
        )
        ins: list[Value | None] = [proj.inputs[0], wk]
        if bias is not None:
            assert bias.const is not None
            ins.append(graph.add_constant(f"{bias.name}/part{k}", bias.const[..., cols]))
        pk = Node(proj.op, ins, [], proj.attrs, f"{proj.name}/part{k}")
        pk.outputs = [_new_value(graph, f"{proj.outputs[0].name}/part{k}", pk)]
        new_nodes.append(pk)
        cur = pk.outputs[0]
        for r in chain:
            shape = (*r.outputs[0].type.shape[:-1], size)
            s = graph.add_constant(f"{r.name}/shape{k}", np.array(shape, dtype=np.int64))
            rk = Node("Reshape", [cur, s], [], {}, f"{r.name}/part{k}")
            rk.outputs = [_new_value(graph, f"{r.outputs[0].name}/part{k}", rk)]
            new_nodes.append(rk)
            cur = rk.outputs[0]
        graph.replace_uses(out, cur)
        # The chunk keeps its name (graph outputs are named; --sbp finds values by name).
        cur.name, out.name = out.name, cur.name
    at = graph.nodes.index(split)
    graph.nodes[at:at] = new_nodes
    return True


def _new_value(graph: Graph, name: str, node: Node) -> Value:
    (t,) = get_op(node.op).infer_types(node)
    return Value(graph.claim_name(name), t, producer=node)


@register_pass("split_projections")
def split_projections(graph: Graph) -> Graph:
    changed = False
    for node in list(graph.nodes):
        if node.op in ("MatMul", "Gemm"):
            changed |= _rewrite(graph, node, graph.users())
    if changed:
        graph.remove_unused()
    return graph
