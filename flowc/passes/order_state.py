"""Order a training step's state writes (Graph.state) after their inputs' readers.

A state output (a parameter's or an optimizer moment's next value) is written over its
input's bytes, so its writer must run after every other node reading those bytes: the
forward's and the backward's readers of a weight come before the update that overwrites it
(a MatMul's input gradient reads the weight and nothing orders it before the weight's own
update otherwise). This pass

- gives a writer that reads the input other than element by element (a copy of a MatMul's
  result over its own operand, say) a result of its own and writes the state with an
  Identity after it, so every write over a state input is in place or reads nothing of it;
- puts the nodes in an order where each writer follows those readers (a stable
  topological order of the data edges plus those), which the actor graph then keeps as
  dependencies (flowc.schedule.actors) and the memory checker verifies.

It runs last, after the fusions, which may merge a writer with its producers.
"""

from __future__ import annotations

import heapq

from flowc.errors import FlowcError
from flowc.ir.graph import Graph, Node, Value
from flowc.ops.registry import state_writes
from flowc.passes.manager import register_pass


@register_pass("order_state_writes")
def order_state_writes(graph: Graph) -> Graph:
    for w in state_writes(graph):
        if not w.in_place:
            _copy_out(graph, w.writer, w.output)
    writes = state_writes(graph)
    if writes:
        graph.nodes = _ordered(graph, {w.writer: w.readers for w in writes})
    return graph


def _copy_out(graph: Graph, writer: Node, out: Value) -> None:
    """``writer`` writes a new value; an Identity copies it into ``out``."""
    fresh = Value(graph.claim_name(out.name + ".value"), out.type, producer=writer)
    writer.outputs = [fresh if o is out else o for o in writer.outputs]
    copy = Node("Identity", [fresh], [out], name=graph.unique_name(out.name + ".write"))
    graph.nodes.insert(graph.nodes.index(writer) + 1, copy)


def _ordered(graph: Graph, after: dict[Node, list[Node]]) -> list[Node]:
    """The nodes in a topological order of their data edges and of ``after`` (a writer ->
    the nodes it follows), as close to the current order as that allows."""
    position = {n: k for k, n in enumerate(graph.nodes)}
    producer = {o: n for n in graph.nodes for o in n.outputs}
    preds: dict[Node, set[Node]] = {}
    for n in graph.nodes:
        ps = {producer[i] for i in n.inputs if i is not None and i in producer}
        ps.update(after.get(n, []))
        ps.discard(n)
        preds[n] = ps
    succs: dict[Node, list[Node]] = {n: [] for n in graph.nodes}
    for n, ps in preds.items():
        for p in ps:
            succs[p].append(n)
    waiting = {n: len(ps) for n, ps in preds.items()}
    ready = [(position[n], n.name, id(n)) for n in graph.nodes if waiting[n] == 0]
    by_id = {id(n): n for n in graph.nodes}
    heapq.heapify(ready)
    order: list[Node] = []
    while ready:
        _, _, key = heapq.heappop(ready)
        n = by_id[key]
        order.append(n)
        for s in succs[n]:
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(ready, (position[s], s.name, id(s)))
    if len(order) != len(graph.nodes):
        stuck = next(n for n in graph.nodes if waiting[n] > 0)
        raise FlowcError(
            f"the state write {stuck.op} {stuck.name!r} cannot follow every reader of the "
            "state it overwrites: a reader depends on the new value"
        )
    return order
