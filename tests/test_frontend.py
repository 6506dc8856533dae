"""The ONNX importer's own behaviour: external data, folding, output names, node order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from flowc.errors import InputError, ModelLoadError, ShapeError
from flowc.frontend.onnx import ImportOptions, import_model, import_onnx
from flowc.harness.compare import max_rel_error
from flowc.harness.ort import run_onnxruntime
from flowc.interpreter import evaluate
from flowc.ir.verify import verify_graph


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[str],
    inits=(),
    opset: int = 17,
) -> onnx.ModelProto:  # type: ignore[no-untyped-def]
    g = helper.make_graph(
        nodes,
        "g",
        inputs,
        [helper.make_empty_tensor_value_info(o) for o in outputs],
        initializer=list(inits),
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_external_data_initializers(tmp_path: Path) -> None:
    w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    m = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
        ["y"],
        [numpy_helper.from_array(w, "w")],
    )
    path = tmp_path / "ext.onnx"
    onnx.save(
        m,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="ext.bin",
        size_threshold=0,
    )
    assert (tmp_path / "ext.bin").stat().st_size == w.nbytes
    x = np.ones((4, 64), np.float32)
    got = evaluate(import_onnx(path), {"x": x})["y"]
    assert max_rel_error(got, x @ w) <= 1e-5
    (tmp_path / "ext.bin").unlink()
    with pytest.raises(ModelLoadError, match="cannot read external weights"):
        import_onnx(path)


def test_shape_subgraph_folds_to_constants() -> None:
    # y = reshape(x, concat(shape(x)[0:1], [-1])): the usual exporter idiom for flatten.
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
        helper.make_node("Unsqueeze", ["b", "axes"], ["b1"]),
        helper.make_node("Concat", ["b1", "minus1"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array([0], np.int64), "axes"),
        numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
    ]
    m = _model(
        nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 4])], ["y"], inits
    )
    g = import_model(m, ImportOptions(dims={"n": 5}))
    assert g.op_counts() == {"Reshape": 1}
    assert g.outputs[0].type.shape == (5, 12)
    with pytest.raises(InputError, match="dynamic dimension 0 \\('n'\\)"):
        import_model(m)


def test_identity_and_dropout_vanish_but_output_names_stay() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Dropout", ["r"], ["d"]),
        helper.make_node("Identity", ["d"], ["y"]),
        helper.make_node("Identity", ["x"], ["x_copy"]),
    ]
    m = _model(
        nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])], ["y", "x_copy"]
    )
    g = import_model(m)
    verify_graph(g)
    assert [o.name for o in g.outputs] == ["y", "x_copy"]
    # The Relu's output takes the name y; x_copy must stay a node (it forwards a graph input).
    assert g.op_counts() == {"Identity": 1, "Relu": 1}
    x = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    out = evaluate(g, {"x": x})
    assert np.array_equal(out["y"], np.maximum(x, 0)) and np.array_equal(out["x_copy"], x)


def test_nodes_out_of_order_are_sorted() -> None:
    nodes = [helper.make_node("Neg", ["a"], ["y"]), helper.make_node("Relu", ["x"], ["a"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])], ["y"])
    g = import_model(m)
    assert [n.op for n in g.nodes] == ["Relu", "Neg"]
    with pytest.raises(ModelLoadError, match="reads \\['nope'\\]"):
        import_model(_model([helper.make_node("Neg", ["nope"], ["y"])], [], ["y"]))


def test_local_functions_are_inlined() -> None:
    fn = helper.make_function(
        "my.fns", "Swish", ["x"], ["y"],
        [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])],
        opset_imports=[helper.make_opsetid("", 17)],
    )  # fmt: skip
    g = helper.make_graph(
        [helper.make_node("Swish", ["x"], ["y"], domain="my.fns")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])],
    )
    m = helper.make_model(
        g,
        functions=[fn],
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.fns", 1)],
    )
    x = np.linspace(-3, 3, 8).astype(np.float32)
    ref = run_onnxruntime(m, {"x": x})["y"]
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "f.onnx"
        onnx.save(m, str(p))
        got = evaluate(import_onnx(p), {"x": x})["y"]
    assert max_rel_error(got, ref) <= 1e-6


def test_declared_output_type_is_checked() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [3])],
    )  # fmt: skip
    with pytest.raises(ShapeError, match="declares i64 but the graph computes f32"):
        import_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def test_folding_does_not_blow_up_constants() -> None:
    # Expand of a 4 KiB row to 4 MiB stays a node; a small result and a fill still fold.
    row = np.arange(1024, dtype=np.float32)
    nodes = [
        helper.make_node("Expand", ["row", "big"], ["e"]),
        helper.make_node("Expand", ["row", "small"], ["f"]),
        helper.make_node("ConstantOfShape", ["big"], ["z"]),
        helper.make_node("Add", ["x", "e"], ["y1"]),
        helper.make_node("Add", ["x", "z"], ["y2"]),
        helper.make_node("Add", ["f", "f"], ["y3"]),
    ]
    inits = [
        numpy_helper.from_array(row, "row"),
        numpy_helper.from_array(np.array([1024, 1024], np.int64), "big"),
        numpy_helper.from_array(np.array([4, 1024], np.int64), "small"),
    ]
    m = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1024, 1024])],
        ["y1", "y2", "y3"],
        inits,
    )
    g = import_model(m)
    assert g.op_counts() == {"Add": 2, "Expand": 1}
    x = np.ones((1024, 1024), np.float32)
    out = evaluate(g, {"x": x})
    assert np.array_equal(out["y1"], x + row) and np.array_equal(
        out["y3"], np.tile(2 * row, (4, 1))
    )
