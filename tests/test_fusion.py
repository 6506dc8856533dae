"""fuse_elementwise: groups, semantics kept (NumPy reference), one kernel in the build."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import SHARED_MODELS

from flowc.frontend.onnx import ImportOptions, import_onnx
from flowc.harness.compare import max_rel_error
from flowc.interpreter import evaluate, random_inputs
from flowc.ir import DType, Graph, TensorType
from flowc.ir.printer import print_graph
from flowc.ir.verify import verify_graph
from flowc.passes.fuse_elementwise import fuse_elementwise


def _gelu_like() -> Graph:
    g = Graph("g")
    t = TensorType((4, 8), DType.F32)
    x = g.add_input("x", t)
    b = g.add_constant("b", np.linspace(-1, 1, 8).astype(np.float32))
    half = g.add_constant("half", np.array(0.5, np.float32))
    a = g.add_node("Add", [x, b], [t], output_names=["a"]).outputs[0]
    e = g.add_node("Erf", [a], [t], output_names=["e"]).outputs[0]
    m = g.add_node("Mul", [e, half], [t], output_names=["m"]).outputs[0]
    y = g.add_node("Tanh", [m], [t], output_names=["y"]).outputs[0]
    z = g.add_node("Relu", [a], [t], output_names=["z"]).outputs[0]  # a has two readers
    g.outputs = [y, z]
    return g


def test_chains_fuse_and_keep_their_value() -> None:
    g = _gelu_like()
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    before = evaluate(g, {"x": x})
    fuse_elementwise(g)
    verify_graph(g)
    # Add has two readers, so it stays; Erf -> Mul -> Tanh fuse; Relu stands alone.
    assert [n.op for n in g.nodes] == ["Add", "FusedElementwise", "Relu"]
    after = evaluate(g, {"x": x})
    for k in before:
        assert np.array_equal(before[k], after[k])
    assert "fused_elementwise(" in print_graph(g)


@pytest.mark.parametrize("name", ["bert_tiny", "gpt2_tiny", "vit_tiny"])
def test_models_fused_match_unfused(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = import_onnx(
            SHARED_MODELS / f"{name}.onnx",
            ImportOptions(dims={"batch": 2, "seq": 8}) if name == "bert_tiny" else None,
        )
    feeds = random_inputs(g, seed=1)
    before = evaluate(g, feeds)
    n_before = len(g.nodes)
    fuse_elementwise(g)
    verify_graph(g)
    assert len(g.nodes) < n_before and "FusedElementwise" in g.op_counts()
    after = evaluate(g, feeds)
    for k in before:
        assert max_rel_error(after[k], before[k]) <= 1e-6


def test_fused_chain_compiles_to_one_kernel(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from opcheck import Case, check_compiled

    nodes = [
        helper.make_node("Add", ["x", "b"], ["a"]),
        helper.make_node("Erf", ["a"], ["e"]),
        helper.make_node("Mul", ["e", "x"], ["m"]),
        helper.make_node("Sigmoid", ["m"], ["y"]),
    ]
    g = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])],
        initializer=[numpy_helper.from_array(np.linspace(-1, 1, 5).astype(np.float32), "b")],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(3).standard_normal((3, 5)).astype(np.float32)
    source = check_compiled(
        [Case("chain", [x])], tmp_path, model=onnx.ModelProto.FromString(model.SerializeToString())
    )
    assert source.count("__global__") == 1 and "_fused(" in source
