"""A parallel plan: the strategy of every node and the layout of every value on a mesh."""

from __future__ import annotations

from dataclasses import dataclass, field

from flowc.ir.graph import Graph, Node, Value
from flowc.ir.types import BROADCAST, Mesh, NdSbp
from flowc.parallel.strategies import Strategy


@dataclass
class Plan:
    """``value_sbp`` is each value's layout where it is produced (graph inputs and constants
    included); a consumer whose strategy wants another layout gets boxing in between, and
    graph outputs are boxed to all-B. ``method`` says how the plan was made (auto, data,
    none, or given)."""

    mesh: Mesh
    node_strategy: dict[Node, Strategy]
    value_sbp: dict[Value, NdSbp]
    method: str = "auto"
    # Filled by the search: solver statistics for `flowc inspect` (variables, seconds, ...).
    stats: dict[str, float] = field(default_factory=dict)

    def leaves_as(self, graph: Graph, v: Value) -> NdSbp:
        """The layout graph output ``v`` leaves the program in: a training step's state as
        its input entered (written over it), any other output whole."""
        for name, written in graph.state.items():
            if written == v.name:
                x = next(i for i in graph.inputs if i.name == name)
                return self.value_sbp[x]
        return NdSbp(tuple(BROADCAST for _ in self.mesh.shape))

    def wanted(self, node: Node, i: int) -> NdSbp | None:
        """The layout node's strategy needs for input i."""
        return self.node_strategy[node].input(i)

    def check(self, graph: Graph) -> None:
        """Every node and value has a layout, and every value is produced as its consumer's
        strategy says (boxing only happens on edges)."""
        for node in graph.nodes:
            s = self.node_strategy.get(node)
            if s is None:
                raise AssertionError(f"plan has no strategy for node {node.name!r}")
            for j, o in enumerate(node.outputs):
                if self.value_sbp.get(o) != s.output(j):
                    raise AssertionError(f"plan: output {o.name!r} disagrees with its node")
        for v in [*graph.inputs, *graph.constants]:
            if v not in self.value_sbp:
                raise AssertionError(f"plan has no layout for {v.name!r}")
