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

from flowc.ir.graph import Graph, Value
from flowc.ir.layout import broadcast
from flowc.ir.types import Mesh, NdSbp
from flowc.parallel.cost import Profile, boxing_time, node_time
from flowc.parallel.plan import Plan
from flowc.parallel.strategies import strategies


def propagated_plan(
    graph: Graph, mesh: Mesh, profile: Profile, given: Mapping[Value, NdSbp], method: str
) -> Plan:
    """``given``: the layouts of the graph's inputs (every one), and those that values a node
    makes must end in (a state's next value leaves the step as its state entered: graph
    outputs are boxed to Plan.leaves_as). Constants not in it are whole."""
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
            t = node_time(node, s, mesh, profile)
            # A value given a layout (a state's next value) is boxed to it after its node:
            # its node may still be cheaper in another (a ZeRO update on the shards, then one
            # all-gather of the parameter, not one per moment before it).
            for j, o in enumerate(node.outputs):
                if o in given and s.output(j) != given[o]:
                    t += boxing_time(o.type, mesh, s.output(j), given[o], profile)
            for i, x in enumerate(node.inputs):
                want = s.input(i)
                if x is not None and want is not None and want != value_sbp[x]:
                    t += boxing_time(x.type, mesh, value_sbp[x], want, profile)
            # Strictly less: ties keep the earlier strategy (all-B first), so the plan is
            # the same on every machine.
            if best is None or t < best_time:
                best, best_time = s, t
        assert best is not None  # the all-B strategy is always there
        node_strategy[node] = best
        for j, o in enumerate(node.outputs):
            value_sbp[o] = best.output(j)
    return Plan(mesh, node_strategy, value_sbp, method)
