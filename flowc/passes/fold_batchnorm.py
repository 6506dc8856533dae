"""fold_batchnorm: an inference BatchNormalization right after a Conv (or a Gemm) with constant
weights becomes part of that op's weights and bias, at compile time; so does a Mul of a Conv's
result by a per-channel constant (Caffe2 exports spell a scale that way after their BN).

BN(y) = (y - mean) * s + beta with s = scale / sqrt(var + eps), per channel (axis 1). For
y = conv(x, W) + b that is conv(x, W * s) + (b - mean) * s + beta: the output channel k of W is
scaled by s[k]. For a Gemm, y = alpha * A B + beta_c * C, the columns of op(B) scale, and C
becomes (beta_c * C) * s + (beta - mean * s) with beta_c = 1. The algebra runs in float64 and is
rounded once to the weight's type. The producer must feed only the BatchNormalization (the
unnormalized result is needed nowhere else) and every BN parameter must be a constant.

Folded weights are new constants (named after the original weight, ``W.bn``): a weights file
for the compiled program carries the folded values, not the model's BN parameters. All-equal
inputs (the fills of ConstantOfShape weights) give an all-equal result, kept a splat.
"""

from __future__ import annotations

import numpy as np

from flowc.ir.graph import Attrs, Graph, Node, Value, is_splat, make_splat
from flowc.ops.registry import node_attrs
from flowc.passes.manager import register_pass


def _f64(v: Value) -> np.ndarray:
    assert v.const is not None
    return v.const.astype(np.float64)


def _scaled(w: Value, s: np.ndarray, axis: int) -> np.ndarray:
    """``w`` with its slices along ``axis`` multiplied by ``s`` (float64), in w's type."""
    assert w.const is not None
    dt = w.const.dtype
    if is_splat(w.const) and np.all(s == s[0]):
        return make_splat(float(w.const.flat[0]) * float(s[0]), w.const.shape, dt)
    shape = [1] * w.const.ndim
    shape[axis] = s.size
    return (w.const.astype(np.float64) * s.reshape(shape)).astype(dt)


def _as_dtype(a: np.ndarray, like: np.dtype) -> np.ndarray:
    if a.size > 1 and np.all(a == a.flat[0]):
        return make_splat(a.flat[0], a.shape, like)
    return a.astype(like)


def _fold_conv(graph: Graph, conv: Node, s: np.ndarray, t: np.ndarray, mean: np.ndarray) -> bool:
    w = conv.inputs[1]
    b = conv.inputs[2] if len(conv.inputs) > 2 else None
    if w is None or w.const is None or (b is not None and b.const is None):
        return False
    b64 = _f64(b) if b is not None else np.zeros(s.shape)
    new_w = graph.add_constant(f"{w.name}.bn", _scaled(w, s, 0))
    bias = (b64 - mean) * s + t
    new_b = graph.add_constant(f"{w.name}.bn_bias", _as_dtype(bias, w.const.dtype))
    conv.inputs = [conv.inputs[0], new_w, new_b]
    return True


def _fold_gemm(graph: Graph, gemm: Node, s: np.ndarray, t: np.ndarray, mean: np.ndarray) -> bool:
    bmat = gemm.inputs[1]
    c = gemm.inputs[2] if len(gemm.inputs) > 2 else None
    y = gemm.outputs[0]
    if bmat is None or bmat.const is None or (c is not None and c.const is None):
        return False
    a = node_attrs(gemm)
    beta = float(a["beta"])
    n = y.type.shape[1]
    new_b = graph.add_constant(f"{bmat.name}.bn", _scaled(bmat, s, 0 if a["transB"] else 1))
    c64 = np.zeros((n,)) if c is None or beta == 0.0 else beta * _f64(c)
    shape = np.broadcast_shapes(c64.shape, (1, n)) if c64.ndim > 1 else (n,)
    cs = np.broadcast_to(c64, shape) * s + (t - mean * s)
    new_c = graph.add_constant(f"{bmat.name}.bn_bias", _as_dtype(cs, bmat.const.dtype))
    gemm.inputs = [gemm.inputs[0], new_b, new_c]
    gemm.attrs = Attrs({**gemm.attrs, "beta": 1.0})
    return True


def channel_vector(v: Value | None, channels: int, rank: int) -> np.ndarray | None:
    """``v``'s values when it is a per-channel constant broadcasting over a [N, K, ...]
    result: [K, 1, ...] or [1, K, 1, ...]."""
    if v is None or v.const is None:
        return None
    shape = v.type.shape
    if len(shape) not in (rank - 1, rank) or len(shape) < 2:
        return None
    lead = shape[: len(shape) - (rank - 1)]
    if any(d != 1 for d in lead) or shape[len(lead)] != channels:
        return None
    if any(d != 1 for d in shape[len(lead) + 1 :]):
        return None
    return np.asarray(v.const).reshape(channels)


def _fold_scale(
    graph: Graph, mul: Node, users: dict[Value, list[Node]], outputs: set[Value], removed: set[Node]
) -> None:
    """A Conv's result times a per-channel constant (Caffe2's BN spelled Mul + Add after a
    SpatialBN, as in Inception v2): the scale goes into the weights and the bias."""
    for k in (0, 1):
        x, other = mul.inputs[k], mul.inputs[1 - k]
        prod = x.producer if x is not None else None
        if x is None or prod is None or prod.op != "Conv" or prod in removed:
            continue
        if x in outputs or len(users.get(x, [])) != 1 or prod.stage != mul.stage:
            continue
        s = channel_vector(other, x.type.shape[1], x.type.rank)
        if s is None or mul.outputs[0].type != x.type or not x.type.dtype.is_float:
            continue
        s64 = s.astype(np.float64)
        zero = np.zeros(s64.shape)
        if _fold_conv(graph, prod, s64, zero, zero):
            prod.outputs = [mul.outputs[0]]
            mul.outputs[0].producer = prod
            removed.add(mul)
        return


@register_pass("fold_batchnorm")
def fold_batchnorm(graph: Graph) -> Graph:
    users = graph.users()
    outputs = graph.kept()
    removed: set[Node] = set()
    for bn in graph.nodes:
        if bn.op == "Mul":
            _fold_scale(graph, bn, users, outputs, removed)
            continue
        if bn.op != "BatchNormalization" or len(bn.outputs) != 1:
            continue
        x = bn.inputs[0]
        params = bn.inputs[1:5]
        if x is None or len(params) != 4 or any(p is None or p.const is None for p in params):
            continue
        prod = x.producer
        if (
            prod is None
            or prod.op not in ("Conv", "Gemm")
            or prod in removed
            or x in outputs
            or len(users.get(x, [])) != 1
            or prod.stage != bn.stage
            or not x.type.dtype.is_float
        ):
            continue
        scale, beta, mean, var = (_f64(p) for p in params if p is not None)
        eps = float(node_attrs(bn)["epsilon"])
        s = scale / np.sqrt(var + eps)
        if prod.op == "Conv":
            folded = _fold_conv(graph, prod, s, beta, mean)
        else:
            folded = x.type.rank == 2 and _fold_gemm(graph, prod, s, beta, mean)
        if not folded:
            continue
        # The producer now computes the normalized value: it takes over BN's output (its
        # name and any graph-output role).
        y = bn.outputs[0]
        prod.outputs = [y]
        y.producer = prod
        removed.add(bn)
    if removed:
        graph.nodes = [n for n in graph.nodes if n not in removed]
        graph.remove_unused()
    return graph
