"""widen_types: compute storage-only element types (float16, bfloat16, float8/6/4, 2- and
4-bit integers) in float32 / int32.

flowc's kernels are written for the compute types; the storage-only ones only have to be
held and converted (runtime_cpp/flowc/narrow.h). So every node that reads or writes one,
other than a Cast or a view, gets its narrow inputs cast up and its narrow outputs computed
wide and cast back: one rounding per op, which is what NumPy's float16 arithmetic and
onnxruntime's CPU kernels for these types do. An op whose OpDef lists the node's narrow
types in ``narrow`` (GEMMs and convolutions on tensor cores, kernels that load narrow and
compute in float32) handles them itself and is left alone. Narrow constants are widened at compile time.
After this pass fuse_elementwise folds the casts into the neighbouring element-wise kernels.
"""

from __future__ import annotations

from flowc.codegen.cpp import CodegenError
from flowc.ir.graph import Graph, Node, Value, keep_counts
from flowc.ir.types import TensorType
from flowc.ops.registry import get_op
from flowc.passes.manager import register_pass

# Ops that handle storage-only types themselves: conversions, pure views of the bytes, and the
# (de)quantizations, whose kernels read and write int4 / float8 / ... directly.
_NATIVE = frozenset({"Cast", "Identity", "QuantizeLinear", "DequantizeLinear"})


def _narrow(v: Value | None) -> bool:
    return v is not None and v.type.dtype.storage_only


@register_pass("widen_types")
def widen_types(graph: Graph) -> Graph:
    if not any(_narrow(v) for n in graph.nodes for v in (*n.inputs, *n.outputs)):
        return graph
    widened: dict[Value, Value] = {}
    nodes: list[Node] = []

    def wide(v: Value) -> Value:
        if v not in widened:
            dt = v.type.dtype.compute_type
            if v.const is not None:
                widened[v] = graph.add_constant(f"{v.name}.{dt}", v.const.astype(dt.np))
            else:
                out = Value(graph.claim_name(f"{v.name}.{dt}"), v.type.with_dtype(dt))
                nodes.append(Node("Cast", [v], [out], {"to": dt.onnx}, name=f"{out.name}"))
                widened[v] = out
        return widened[v]

    for node in graph.nodes:
        opdef = get_op(node.op)
        if (
            node.op in _NATIVE
            or opdef.view
            or not any(_narrow(v) for v in (*node.inputs, *node.outputs))
            or all(
                v.type.dtype in opdef.narrow
                for v in (*node.inputs, *node.outputs)
                if v is not None and _narrow(v)
            )
        ):
            nodes.append(node)
            continue
        node.inputs = [wide(v) if v is not None and _narrow(v) else v for v in node.inputs]
        types: list[TensorType] = opdef.infer(opdef.ctx(node))
        backs: list[Node] = []
        for k, (out, t) in enumerate(zip(node.outputs, types, strict=False)):
            t = keep_counts(t, out.type)
            if t == out.type:
                if t.dtype.storage_only:
                    raise CodegenError(
                        f"{node.op} node {node.name!r} writes {t.dtype} itself; flowc computes "
                        f"{t.dtype} values in {t.dtype.compute_type} and this op has no "
                        "conversion of its own yet",
                        hint="cast the op's result in the model instead",
                    )
                continue
            w = Value(graph.claim_name(f"{out.name}.{t.dtype}"), t, producer=node)
            node.outputs[k] = w
            backs.append(
                Node("Cast", [w], [out], {"to": out.type.dtype.onnx, "saturate": 0}, name=w.name)
            )
        nodes.append(node)
        nodes.extend(backs)
    graph.nodes = nodes
    graph.remove_unused()
    return graph
