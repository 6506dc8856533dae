"""ONNX control flow (If, Loop, Scan) imported as a static program, and function ops expanded
into their ONNX function bodies: against onnxruntime, in the NumPy reference and on the host."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper
from opcheck import Case, check_compiled, check_op, run_onnxruntime

from flowc.errors import ShapeError, UnsupportedOpError
from flowc.frontend.onnx import import_model
from flowc.interpreter import evaluate

rng = np.random.default_rng(11)


def rand(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _model(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:  # type: ignore[no-untyped-def]
    g = helper.make_graph(nodes, "control", inputs, outputs, initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _vi(name: str, shape: list[int] | None, t: int = T.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, t, shape)


def _against_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    ref = run_onnxruntime(model, feeds)
    graph = import_model(model)
    got = evaluate(graph, feeds)
    for name, r in ref.items():
        np.testing.assert_allclose(got[name], r, rtol=1e-5, atol=1e-6, err_msg=name)


def _branches(shape: list[int]) -> tuple[onnx.GraphProto, onnx.GraphProto]:
    # Each branch reads the outer value x: ONNX scoping.
    then_g = helper.make_graph(
        [helper.make_node("Mul", ["x", "x"], ["t"])], "then", [], [_vi("t", shape)]
    )
    else_g = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["e"])], "else", [], [_vi("e", shape)]
    )
    return then_g, else_g


def test_if_with_a_run_time_condition_selects_per_output() -> None:
    then_g, else_g = _branches([3, 4])
    m = _model(
        [helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)],
        [_vi("c", [], T.BOOL), _vi("x", [3, 4])],
        [_vi("y", [3, 4])],
    )
    x = rand(3, 4)
    for c in (True, False):
        _against_ort(m, {"c": np.array(c), "x": x})
    ops = import_model(m).op_counts()
    assert ops.get("Where") == 1 and "If" not in ops


def test_if_with_a_known_condition_imports_one_branch() -> None:
    then_g, else_g = _branches([3])
    m = _model(
        [
            helper.make_node("Constant", [], ["c"], value=helper.make_tensor("c", T.BOOL, [], [0])),
            helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g),
        ],
        [_vi("x", [3])],
        [_vi("y", [3])],
    )
    _against_ort(m, {"x": rand(3)})
    assert import_model(m).op_counts() == {"Neg": 1}


def test_if_branches_of_different_shapes_need_a_known_condition() -> None:
    then_g = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["t"])], "then", [], [_vi("t", [3])]
    )
    else_g = helper.make_graph(
        [helper.make_node("Concat", ["x", "x"], ["e"], axis=0)], "else", [], [_vi("e", [6])]
    )
    m = _model(
        [helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)],
        [_vi("c", [], T.BOOL), _vi("x", [3])],
        [_vi("y", None)],
    )
    with pytest.raises(ShapeError, match="both branches must give the same shapes"):
        import_model(m)


def _loop_body() -> onnx.GraphProto:
    # state s += x * i; scan output: the running state.
    return helper.make_graph(
        [
            helper.make_node("Cast", ["i"], ["fi"], to=T.FLOAT),
            helper.make_node("Mul", ["x", "fi"], ["xi"]),
            helper.make_node("Add", ["s_in", "xi"], ["s_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Identity", ["s_out"], ["scan"]),
        ],
        "body",
        [_vi("i", [], T.INT64), _vi("cond_in", [], T.BOOL), _vi("s_in", [2, 3])],
        [_vi("cond_out", [], T.BOOL), _vi("s_out", [2, 3]), _vi("scan", [2, 3])],
    )


def test_loop_with_a_constant_trip_count_unrolls() -> None:
    trip = helper.make_tensor("trip", T.INT64, [], [4])
    cond = helper.make_tensor("cond", T.BOOL, [], [1])
    m = _model(
        [helper.make_node("Loop", ["trip", "cond", "s0"], ["s", "scans"], body=_loop_body())],
        [_vi("s0", [2, 3]), _vi("x", [2, 3])],
        [_vi("s", [2, 3]), _vi("scans", [4, 2, 3])],
        inits=[trip, cond],
    )
    _against_ort(m, {"s0": rand(2, 3), "x": rand(2, 3)})


def test_loop_trip_count_at_run_time_is_a_clear_error() -> None:
    cond = helper.make_tensor("cond", T.BOOL, [], [1])
    m = _model(
        [helper.make_node("Loop", ["trip", "cond", "s0"], ["s", "scans"], body=_loop_body())],
        [_vi("trip", [], T.INT64), _vi("s0", [2, 3]), _vi("x", [2, 3])],
        [_vi("s", [2, 3]), _vi("scans", None)],
        inits=[cond],
    )
    with pytest.raises(ShapeError, match=r"trip count.*must be known at compile time"):
        import_model(m)


def _scan_body() -> onnx.GraphProto:
    # Running sum over the scanned rows, and each row times two as a scan output.
    return helper.make_graph(
        [
            helper.make_node("Add", ["acc_in", "row"], ["acc_out"]),
            helper.make_node("Add", ["row", "row"], ["twice"]),
        ],
        "body",
        [_vi("acc_in", [3]), _vi("row", [3])],
        [_vi("acc_out", [3]), _vi("twice", [3])],
    )


@pytest.mark.parametrize(
    ("in_axis", "in_dir", "out_axis", "out_dir"), [(0, 0, 0, 0), (1, 1, 1, 0), (0, 0, -1, 1)]
)
def test_scan_unrolls_along_any_axis_and_direction(
    in_axis: int, in_dir: int, out_axis: int, out_dir: int
) -> None:
    xs = rand(4, 3) if in_axis == 0 else rand(3, 4)
    m = _model(
        [
            helper.make_node(
                "Scan",
                ["init", "xs"],
                ["final", "ys"],
                body=_scan_body(),
                num_scan_inputs=1,
                scan_input_axes=[in_axis],
                scan_input_directions=[in_dir],
                scan_output_axes=[out_axis],
                scan_output_directions=[out_dir],
            )
        ],
        [_vi("init", [3]), _vi("xs", list(xs.shape))],
        [_vi("final", [3]), _vi("ys", None)],
    )
    _against_ort(m, {"init": rand(3), "xs": xs})


def test_control_flow_compiles_for_the_host(tmp_path: Path) -> None:
    then_g, else_g = _branches([3, 4])
    trip = helper.make_tensor("trip", T.INT64, [], [3])
    cond = helper.make_tensor("cond", T.BOOL, [], [1])
    loop_body = _loop_body()
    m = _model(
        [
            helper.make_node("If", ["c", *[]], ["y"], then_branch=then_g, else_branch=else_g),
            helper.make_node("Loop", ["trip", "cond", "s0"], ["s", "scans"], body=loop_body),
            helper.make_node(
                "Scan", ["init", "rows"], ["final", "ys"], body=_scan_body(), num_scan_inputs=1
            ),
        ],
        [
            _vi("c", [], T.BOOL),
            _vi("x", [3, 4]),
            _vi("s0", [2, 3]),
            _vi("init", [3]),
            _vi("rows", [5, 3]),
        ],
        [
            _vi("y", [3, 4]),
            _vi("s", [2, 3]),
            _vi("scans", [3, 2, 3]),
            _vi("final", [3]),
            _vi("ys", [5, 3]),
        ],
        inits=[trip, cond],
    )
    # The loop body reads an outer x of another shape: give it one of its own.
    m.graph.node[1].attribute[0].g.node[1].input[0] = "x2"
    m.graph.input.append(_vi("x2", [2, 3]))
    feeds = {
        "c": np.array(False),
        "x": rand(3, 4),
        "s0": rand(2, 3),
        "init": rand(3),
        "rows": rand(5, 3),
        "x2": rand(2, 3),
    }
    check_compiled([Case("Identity", list(feeds.values()))], tmp_path, model=m)


# -- function ops ---------------------------------------------------------------------------------


def test_function_ops_expand_to_their_bodies() -> None:
    x = rand(2, 3, 4)
    check_op("RMSNormalization", [x, rand(4)], {"epsilon": 1e-3}, opset=23, tol=1e-4)
    logits = rand(4, 5)
    labels = rng.integers(0, 5, 4).astype(np.int64)
    for reduction in ("mean", "sum", "none"):
        check_op(
            "SoftmaxCrossEntropyLoss",
            [logits, labels],
            {"reduction": reduction},
            opset=13,
            tol=1e-4,
        )
        check_op("NegativeLogLikelihoodLoss", [logits, labels], {"reduction": reduction}, opset=13)
    check_op("Celu", [x], {"alpha": 0.7}, opset=12)
    graph = import_model(
        helper.make_model(
            helper.make_graph(
                [helper.make_node("RMSNormalization", ["x", "s"], ["y"])],
                "g",
                [_vi("x", [2, 4]), _vi("s", [4])],
                [_vi("y", [2, 4])],
            ),
            opset_imports=[helper.make_opsetid("", 23)],
        )
    )
    # Expanded: only ops flowc has kernels for, no RMSNormalization node.
    assert "RMSNormalization" not in graph.op_counts() and "ReduceMean" in graph.op_counts()


def test_function_ops_compile_for_the_host(tmp_path: Path) -> None:
    logits = rand(4, 5)
    labels = rng.integers(0, 5, 4).astype(np.int64)
    check_compiled(
        [
            Case("SoftmaxCrossEntropyLoss", [logits, labels], {"reduction": "mean"}, tol=1e-4),
            Case("NegativeLogLikelihoodLoss", [logits, labels], {"reduction": "none"}),
            Case("RMSNormalization", [rand(2, 3, 4), rand(4)], tol=1e-4),
        ],
        tmp_path,
        opset=23,
    )


def test_an_op_with_neither_kernel_nor_function_is_reported_cleanly() -> None:
    m = _model(
        [helper.make_node("StringNormalizer", ["x"], ["y"])],
        [_vi("x", [2])],
        [_vi("y", [2])],
    )
    with pytest.raises(UnsupportedOpError, match="StringNormalizer"):
        import_model(m)
