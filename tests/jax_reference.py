"""The training tests' reference: an ONNX model's forward written in jax.numpy (float64) by a
small translator here, checked against onnxruntime before use; jax.grad and optax then give
the gradients and the updates flowc's compiled step must match."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx
from jax.scipy.special import erf
from onnx import numpy_helper

from flowc.ops.random import dropout_keep

jax.config.update("jax_enable_x64", True)


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _softmax(x: Any, axis: int) -> Any:
    return jax.nn.softmax(x, axis=axis)


def _layer_norm(x: Any, scale: Any, bias: Any | None, axis: int, eps: float) -> Any:
    axes = tuple(range(axis % x.ndim, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mean) / jnp.sqrt(var + eps) * scale
    return y + bias if bias is not None else y


def _op(node: onnx.NodeProto, ins: list[Any], consts: Mapping[str, np.ndarray]) -> list[Any]:
    a = _attrs(node)
    t = node.op_type
    if t == "Gemm":
        x, w = ins[0], ins[1]
        x = x.T if a.get("transA", 0) else x
        w = w.T if a.get("transB", 0) else w
        y = a.get("alpha", 1.0) * (x @ w)
        return [y + a.get("beta", 1.0) * ins[2] if len(ins) > 2 else y]
    if t == "MatMul":
        return [jnp.matmul(ins[0], ins[1])]
    simple: dict[str, Callable[..., Any]] = {
        "Add": jnp.add,
        "Sub": jnp.subtract,
        "Mul": jnp.multiply,
        "Div": jnp.divide,
        "Pow": jnp.power,
        "Relu": jax.nn.relu,
        "Tanh": jnp.tanh,
        "Sigmoid": jax.nn.sigmoid,
        "Sqrt": jnp.sqrt,
        "Erf": erf,
        "Neg": jnp.negative,
        "Exp": jnp.exp,
        "Identity": lambda x: x,
    }
    if t in simple:
        return [simple[t](*ins)]
    if t == "Softmax":
        return [_softmax(ins[0], a.get("axis", -1))]
    if t == "LogSoftmax":
        return [jax.nn.log_softmax(ins[0], axis=a.get("axis", -1))]
    if t == "Gelu":
        return [jax.nn.gelu(ins[0], approximate=a.get("approximate", b"none") == b"tanh")]
    if t == "LayerNormalization":
        return [
            _layer_norm(
                ins[0],
                ins[1],
                ins[2] if len(ins) > 2 else None,
                a.get("axis", -1),
                a.get("epsilon", 1e-5),
            )
        ]
    if t == "Transpose":
        return [jnp.transpose(ins[0], a.get("perm"))]
    if t == "Reshape":
        shape = [int(d) for d in consts[node.input[1]]]
        shape = [ins[0].shape[i] if d == 0 else d for i, d in enumerate(shape)]
        return [jnp.reshape(ins[0], shape)]
    raise NotImplementedError(f"the JAX translator has no {t}")


def forward(
    model: onnx.ModelProto, value: str | None = None
) -> Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]:
    """f(params, inputs) -> {name: array}: the model's outputs (and ``value``, any value of
    the graph) computed in jax.numpy from its initializers as ``params``."""
    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}

    def run(params: Mapping[str, Any], inputs: Mapping[str, Any]) -> dict[str, Any]:
        env: dict[str, Any] = {**{k: jnp.asarray(v) for k, v in consts.items()}, **params, **inputs}
        for node in model.graph.node:
            outs = _op(node, [env[n] for n in node.input if n], consts)
            for name, v in zip(node.output, outs, strict=False):
                env[name] = v
        names = [o.name for o in model.graph.output] + ([value] if value else [])
        return {n: env[n] for n in names}

    return run


def cross_entropy(logits: Any, labels: Any) -> Any:
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return -picked.mean()


def _reshape_target(x: Any, shape: np.ndarray, allowzero: int) -> list[int]:
    dims = [int(d) for d in shape]
    if not allowzero:
        dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return dims


def ir_forward(
    graph: Any, seed: int = 0
) -> Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]:
    """f(params, inputs) -> {value name: array} over a flowc graph's nodes (the canonical
    ONNX ops the import leaves), in jax.numpy: a translation checked against onnxruntime on
    the original ONNX model before it is used as a reference. A training dropout
    (TrainDropout) applies the mask flowc's NumPy Philox draws for ``seed`` and the step
    ``inputs["train/step"]`` (injected: the reference's randomness is flowc's, the rest is
    JAX's); without that input it passes its input, as inference does. A batch norm
    (TrainBatchNorm) normalizes by the batch's statistics when ``inputs`` holds the step (a
    training call) and gives the running statistics' next values as its other outputs, else
    by the running statistics."""

    def const(v: Any) -> np.ndarray:
        assert v is not None and v.const is not None, (
            "a shape, axes or index input must be constant"
        )
        return np.asarray(v.const)

    def run(params: Mapping[str, Any], inputs: Mapping[str, Any]) -> dict[str, Any]:
        env: dict[Any, Any] = {}
        for v in graph.inputs:
            if v.name == "train/step" and v.name not in inputs:
                env[v] = None
                continue
            env[v] = params[v.name] if v.name in params else jnp.asarray(inputs[v.name])
        for c in graph.constants:
            env[c] = jnp.asarray(c.const)
        for node in graph.nodes:
            a = dict(node.attrs)
            ins = [env[i] if i is not None else None for i in node.inputs]
            t = node.op
            if t in ("Reshape",):
                outs = [
                    jnp.reshape(
                        ins[0],
                        _reshape_target(ins[0], const(node.inputs[1]), a.get("allowzero", 0)),
                    )
                ]
            elif t == "Split":
                axis = a.get("axis", 0)
                if len(node.inputs) > 1 and node.inputs[1] is not None:
                    cuts = np.cumsum([int(s) for s in const(node.inputs[1])])[:-1]
                    outs = list(jnp.split(ins[0], cuts, axis=axis))
                else:  # equal parts, one per output
                    outs = list(jnp.split(ins[0], len(node.outputs), axis=axis))
            elif t == "TrainDropout":
                if ins[1] is None:
                    outs = [ins[0]]
                else:
                    ratio = float(a["ratio"])
                    keep = dropout_keep(
                        tuple(ins[0].shape), ratio, seed, int(a["stream"]), int(ins[1])
                    )
                    outs = [jnp.where(keep, ins[0] / (1.0 - ratio), 0.0)]
            elif t == "TrainBatchNorm":
                x, scale, bias, rm, rv = ins
                eps, m = float(a.get("epsilon", 1e-5)), float(a.get("momentum", 0.9))
                view = (-1, *([1] * (x.ndim - 2)))
                if "train/step" in inputs:  # training: the batch's statistics
                    axes = tuple(d for d in range(x.ndim) if d != 1)
                    mean, var = x.mean(axis=axes), x.var(axis=axes)
                    n = x.size // x.shape[1]
                    nexts = [rm * m + mean * (1 - m), rv * m + var * n / (n - 1) * (1 - m)]
                else:  # inference: the running statistics
                    mean, var = rm, rv
                    nexts = [rm, rv]
                y = (x - mean.reshape(view)) / jnp.sqrt(var.reshape(view) + eps)
                outs = [y * scale.reshape(view) + bias.reshape(view), *nexts]
            elif t == "Conv":
                nd = ins[0].ndim - 2
                pads = a.get("pads") or [0] * (2 * nd)
                y = jax.lax.conv_general_dilated(
                    ins[0],
                    ins[1],
                    window_strides=a.get("strides") or [1] * nd,
                    padding=[(pads[i], pads[i + nd]) for i in range(nd)],
                    rhs_dilation=a.get("dilations") or [1] * nd,
                    feature_group_count=int(a.get("group", 1)),
                )
                if len(ins) > 2 and ins[2] is not None:
                    y = y + ins[2].reshape(-1, *([1] * nd))
                outs = [y]
            elif t == "MaxPool":
                nd = ins[0].ndim - 2
                pads = a.get("pads") or [0] * (2 * nd)
                outs = [
                    jax.lax.reduce_window(
                        ins[0],
                        -jnp.inf,
                        jax.lax.max,
                        (1, 1, *a["kernel_shape"]),
                        (1, 1, *(a.get("strides") or [1] * nd)),
                        [(0, 0), (0, 0), *((pads[i], pads[i + nd]) for i in range(nd))],
                    )
                ]
            elif t == "GlobalAveragePool":
                outs = [ins[0].mean(axis=tuple(range(2, ins[0].ndim)), keepdims=True)]
            elif t == "Gather":
                outs = [jnp.take(ins[0], ins[1], axis=a.get("axis", 0))]
            elif t == "Where":
                outs = [jnp.where(ins[0], ins[1], ins[2])]
            elif t == "IsNaN":
                outs = [jnp.isnan(ins[0])]
            elif t == "And":
                outs = [jnp.logical_and(ins[0], ins[1])]
            elif t == "Cast":
                from flowc.ir.dtype import DType

                outs = [ins[0].astype(DType.from_onnx(int(a["to"])).np)]
            elif t == "Expand":
                shape = np.broadcast_shapes(
                    ins[0].shape, tuple(int(d) for d in const(node.inputs[1]))
                )
                outs = [jnp.broadcast_to(ins[0], shape)]
            elif t == "Flatten":
                ax = a.get("axis", 1)
                ax = ax + ins[0].ndim if ax < 0 else ax  # axis == rank: (all, 1)
                lead = int(np.prod(ins[0].shape[:ax]))
                outs = [jnp.reshape(ins[0], (lead, ins[0].size // max(lead, 1)))]
            elif t == "Transpose":
                outs = [jnp.transpose(ins[0], a.get("perm"))]
            elif t == "LayerNormalization":
                outs = [
                    _layer_norm(
                        ins[0],
                        ins[1],
                        ins[2] if len(ins) > 2 else None,
                        a.get("axis", -1),
                        a.get("epsilon", 1e-5),
                    )
                ]
            else:
                proto = onnx.helper.make_node(
                    t, [], [], **{k: v for k, v in a.items() if v is not None}
                )
                outs = _op(proto, ins, {})
            for o, val in zip(node.outputs, outs, strict=False):
                env[o] = val
        return {
            v.name: env[v] for v in [*graph.outputs, *(o for n in graph.nodes for o in n.outputs)]
        }

    return run
