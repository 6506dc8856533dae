"""onnxruntime as the reference: run a model on given inputs with graph optimizations off,
so the comparison is with ONNX semantics, not with ORT's fused kernels."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx

from flowc.errors import FlowcError


def inference_mode(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose Dropout nodes have a constant training_mode of false. flowc compiles for
    inference and treats a constant-true training_mode as identity (with a warning); the
    reference must run the same function, not drop values at random."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    modes = {
        n.input[2]
        for n in m.graph.node
        if n.op_type == "Dropout" and len(n.input) > 2 and n.input[2]
    }
    for t in m.graph.initializer:
        if t.name in modes:
            t.CopyFrom(onnx.numpy_helper.from_array(np.array(False), t.name))
    return m


def run_onnxruntime(
    model: onnx.ModelProto | str, feeds: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    try:
        import onnxruntime as ort
    except ImportError:
        raise FlowcError(
            "onnxruntime is not installed; it is the reference flowc compares with",
            hint="pip install 'flowc[test]' (or run `make setup`)",
        ) from None
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    data = model if isinstance(model, str) else model.SerializeToString()
    sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    input_names = {i.name for i in sess.get_inputs()}
    outs = sess.run(names, {k: v for k, v in feeds.items() if k in input_names})
    return {n: np.asarray(o) for n, o in zip(names, outs, strict=True)}


def round_to(a: np.ndarray, precision: str) -> np.ndarray:
    """A float32 array rounded to the storage type of ``precision`` ("bf16", "fp16"), as
    flowc stores it (clamped to its finite range), and back in float32; others as they are."""
    from flowc.passes.precision import STORAGE, narrow_constant

    if precision not in STORAGE or a.dtype != np.float32:
        return a
    return np.asarray(narrow_constant(a, STORAGE[precision])).astype(np.float32)


def rounded_model(model: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """A copy of ``model`` whose float32 weights (initializers and Constant nodes of the main
    graph) are rounded to ``precision``'s storage type and computed in float32: what rounding
    the weights alone costs, the baseline `flowc verify --precision bf16|fp16` is judged by."""
    from onnx import numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        if t.data_type == onnx.TensorProto.FLOAT:
            t.CopyFrom(
                numpy_helper.from_array(round_to(numpy_helper.to_array(t), precision), t.name)
            )
    for n in m.graph.node:
        if n.op_type != "Constant":
            continue
        for a in n.attribute:
            if a.name == "value" and a.t.data_type == onnx.TensorProto.FLOAT:
                a.t.CopyFrom(
                    numpy_helper.from_array(
                        round_to(numpy_helper.to_array(a.t), precision), a.t.name
                    )
                )
    return m
