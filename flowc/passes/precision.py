"""store_bf16, store_fp16: the storage side of ``--precision bf16|fp16``.

Every float32 value of the graph is stored in the narrow type: weights, activations,
intermediate masks. The graph's inputs and outputs keep the model's float32 (a Cast at each
edge), so the C API and its callers do not change. Where each op computes is the op's
business, decided by the passes after this one: an op whose OpDef lists the type in
``narrow`` (GEMMs and convolutions: tensor cores with float32 accumulation) reads and
writes it itself; widen_types gives every other op float32 operands and rounds its result
once, so softmax, layer/RMS norm, reductions, exp/pow/log and masks compute in float32;
fuse_elementwise then folds those casts into the element-wise kernels.

Constants are clamped to the narrow type's finite range before rounding: a mask spelled
with float32's most negative value becomes float16's most negative finite value, not -inf,
so that 0 x mask stays 0 (not NaN) and a masked row of scores keeps finite values.
Infinities written as such stay infinite.

``--precision fp32`` (exact) and ``tf32`` change no types: they are the math mode of
float32 GEMMs and convolutions (Program.precision, code generation).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Graph, Node, Value, is_splat, keep_counts, make_splat
from flowc.ops.registry import get_op
from flowc.passes.manager import register_pass

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
# The storage type of each narrow precision, and the pass that applies it.
STORAGE = {"bf16": DType.BF16, "fp16": DType.F16}
STORAGE_PASS = {"bf16": "store_bf16", "fp16": "store_fp16"}

# Float inputs that are parameters, not data: ONNX requires them in float32 (Resize's roi
# and scales, Upsample's scales), so they keep it.
_FLOAT32_PARAMS: dict[str, frozenset[int]] = {
    "Resize": frozenset({1, 2}),
    "Upsample": frozenset({1}),
}


def narrow_constant(a: np.ndarray, narrow: DType) -> np.ndarray:
    """``a`` (float32) clamped to ``narrow``'s finite range and rounded to it; infinities
    and NaNs as they are."""
    limit = float(np.finfo(narrow.np).max)
    if is_splat(a):
        return make_splat(narrow_constant(np.asarray(a.flat[0]), narrow), a.shape, narrow.np)
    clamped = np.where(np.isfinite(a), np.clip(a, -limit, limit), a)
    return np.asarray(clamped).astype(narrow.np)


def store_narrow(graph: Graph, narrow: DType) -> Graph:
    f32 = DType.F32
    users = graph.users()
    replaced: dict[Value, Value] = {}
    nodes: list[Node] = []

    def cast(v: Value, to: DType, name: str) -> tuple[Node, Value]:
        out = Value(graph.claim_name(name), v.type.with_dtype(to))
        return Node("Cast", [v], [out], {"to": to.onnx, "saturate": 0}, name=out.name), out

    for x in graph.inputs:
        if x.type.dtype == f32 and users.get(x):
            node, out = cast(x, narrow, f"{x.name}.{narrow.short}")
            nodes.append(node)
            replaced[x] = out
    for c in list(graph.constants):
        assert c.const is not None
        if c.type.dtype == f32 and users.get(c):
            replaced[c] = graph.add_constant(
                f"{c.name}.{narrow.short}", narrow_constant(c.const, narrow)
            )
            replaced[c].sbp = c.sbp  # a placed parameter stays placed
    changed = bool(replaced)
    for node in graph.nodes:
        params = _FLOAT32_PARAMS.get(node.op, frozenset())
        node.inputs = [
            v if v is None or k in params else replaced.get(v, v) for k, v in enumerate(node.inputs)
        ]
        if node.op == "Cast" and int(node.attrs.get("to", 0)) == f32.onnx:
            # A cast to float32 inside the model is a cast to the storage type now.
            node.attrs = Attrs({**node.attrs, "to": narrow.onnx})
            changed = True
        types = get_op(node.op).infer_types(node)
        nodes.append(node)
        for out, t in zip(node.outputs, types, strict=False):
            if out.type.dtype != f32:
                continue
            changed = True
            if t.dtype == narrow:
                out.type = keep_counts(t, out.type)
            else:
                # The op insists on float32 (a type attribute, a float32-only result): its
                # result is stored narrow for its users.
                cnode, cout = cast(out, narrow, f"{out.name}.{narrow.short}")
                nodes.append(cnode)
                replaced[out] = cout
    if not changed:
        return graph
    # Graph outputs: the model's float32 under the model's names (an input or a constant
    # passed through as an output stays what it was).
    outputs: list[Value] = []
    widened: dict[Value, Value] = {}
    for o in graph.outputs:
        if o.producer is None:
            outputs.append(o)
            continue
        o = replaced.get(o, o)
        if o.type.dtype != narrow or o in widened:
            outputs.append(widened.get(o, o))
            continue
        name = o.name
        graph.rename(o, graph.unique_name(f"{name}.{narrow.short}"))
        back = Value(graph.claim_name(name), o.type.with_dtype(f32))
        nodes.append(Node("Cast", [o], [back], {"to": f32.onnx, "saturate": 0}, name=name))
        outputs.append(back)
        widened[o] = back
    graph.nodes = nodes
    graph.outputs = outputs
    graph.remove_unused()
    return graph


def _storage_pass(narrow: DType) -> Callable[[Graph], Graph]:
    return lambda graph: store_narrow(graph, narrow)


for _precision, _pass in STORAGE_PASS.items():
    register_pass(_pass)(_storage_pass(STORAGE[_precision]))
