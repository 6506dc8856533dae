"""A plan by OneFlow's SBP inference: the layouts of the graph's inputs and constants are
given, and each node in turn takes the strategy of least modeled time for the layouts its
inputs already have (their boxing plus its own work), never looking ahead.

This is what data parallelism means for a training step (`--parallel data`): the batch
inputs split on axis 0, the parameters and optimizer state in their fixed layouts, every op
of the forward and backward takes its inputs' splits (the loss's mean a partial sum, a
weight's gradient a partial sum, which the update's first reader all-reduces), whatever a
global search would trade away: on a small batch, gathering the inputs and computing
everything on every device models cheaper than all-reducing the gradients, and the search
picks that.
"""

from __future__ import annotations

from collections.abc import Mapping

from flowc.errors import InputError
from flowc.ir.graph import Graph, Value
from flowc.ir.layout import broadcast
from flowc.ir.types import Mesh, NdSbp
from flowc.parallel.cost import Profile, boxing_time, node_time
from flowc.parallel.plan import Plan
from flowc.parallel.strategies import strategies


def propagated_plan(
    graph: Graph, mesh: Mesh, profile: Profile, given: Mapping[Value, NdSbp], method: str
) -> Plan:
    """``given``: the layouts of the graph's inputs (every one) and of any value a node makes
    (a state's next value, which must leave the step as its state entered). Constants not
    in it are whole."""
    value_sbp: dict[Value, NdSbp] = {}
    for v in graph.inputs:
        if v not in given:
            raise AssertionError(f"propagated_plan: no layout given for input {v.name!r}")
        value_sbp[v] = given[v]
    for c in graph.constants:
        value_sbp[c] = given.get(c, broadcast(mesh))
    node_strategy = {}
    for node in graph.nodes:
        best, best_time = None, 0.0
        for s in strategies(node, mesh):
            if any(o in given and s.output(j) != given[o] for j, o in enumerate(node.outputs)):
                continue
            t = node_time(node, s, mesh, profile)
            for i, x in enumerate(node.inputs):
                want = s.input(i)
                if x is not None and want is not None and want != value_sbp[x]:
                    t += boxing_time(x.type, mesh, value_sbp[x], want, profile)
            # Strictly less: ties keep the earlier strategy (all-B first), so the plan is
            # the same on every machine.
            if best is None or t < best_time:
                best, best_time = s, t
        if best is None:
            wanted = ", ".join(f"{o.name} {given[o]}" for o in node.outputs if o in given)
            raise InputError(
                f"node {node.name or node.op!r} ({node.op}) has no strategy that makes {wanted}",
                hint="give that value another layout, or none",
            )
        node_strategy[node] = best
        for j, o in enumerate(node.outputs):
            value_sbp[o] = best.output(j)
    return Plan(mesh, node_strategy, value_sbp, method)
