"""fuse_gelu: a GELU spelled in element-wise nodes, as exporters write it (the tanh
approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) or the exact x/2 (1 + erf(x /
sqrt 2))), becomes one Gelu node (approximate "tanh" or "none").

It runs on a model before its training step is built (compiler.TRAIN_FUSIONS): Gelu's VJP is
one derivative of x, so the backward keeps x alone instead of the spelling's intermediate
values (x^3, the tanh, 1 + tanh, x/2), and the tanh GELU's gradient can meet the GEMM that
computes the gradient it scales as cuBLASLt's DGELU epilogue (fuse_gemm).

A GELU is recognized as fuse_gemm recognizes an epilogue's activation: by evaluating the nodes
that read only x (and scalar constants) on sample points.
"""

from __future__ import annotations

from flowc.ir.graph import Graph, Node, Value
from flowc.passes.fuse_gemm import FLOATS, Fuser
from flowc.passes.manager import register_pass

_APPROXIMATE = {"gelu_tanh": "tanh", "gelu_erf": "none"}


@register_pass("fuse_gelu")
def fuse_gelu(graph: Graph) -> Graph:
    fz = Fuser(graph)
    starts: list[Value] = list(graph.inputs)
    for node in graph.nodes:
        starts.extend(o for o in node.outputs if o is not None)
    for x in starts:
        if x.type.dtype not in FLOATS or (
            x.producer is not None and x.producer not in fz.live.alive
        ):
            continue
        found = fz.activation(x, kinds=tuple(_APPROXIMATE))
        if found is None:
            continue
        kind, nodes, result = found
        if len(nodes) == 1 and nodes[0].op == "Gelu":
            continue
        replaced = result.producer  # before Node() makes itself the producer
        assert replaced is not None
        gelu = Node("Gelu", [x], [result], {"approximate": _APPROXIMATE[kind]}, name=replaced.name)
        gelu.stage = replaced.stage
        where = graph.nodes.index(replaced)
        graph.nodes[where] = gelu
        fz.live.add(gelu)
        fz.live.drop(replaced)
        fz.live.matched()
    fz.live.finish()
    return graph
