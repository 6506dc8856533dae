"""Softmax, LogSoftmax and Hardmax against onnxruntime, old (2-D coercion) opsets included."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opcheck import check_op, make_op_model

from flowc.errors import ShapeError
from flowc.frontend.onnx import import_model
from flowc.ir.graph import Attrs
from flowc.ops.registry import get_op

OPS = ["Softmax", "LogSoftmax", "Hardmax"]


def logits(shape: tuple[int, ...], seed: int = 0, dtype: type = np.float32) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 3).astype(dtype)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    ("shape", "attrs"),
    [
        ((7,), {}),
        ((3, 5), {}),
        ((3, 5), {"axis": 0}),
        ((2, 3, 4), {"axis": 1}),
        ((2, 3, 4), {"axis": -2}),
        ((2, 3, 4), {"axis": -3}),
        ((2, 1, 3, 4), {"axis": 3}),
    ],
)
@pytest.mark.parametrize("opset", [13, 21])
def test_new_semantics(op: str, shape: tuple[int, ...], attrs: dict[str, int], opset: int) -> None:
    got = check_op(op, [logits(shape)], attrs, opset=opset)["out0"]
    axis = attrs.get("axis", -1)
    if op == "Softmax":
        np.testing.assert_allclose(got.sum(axis=axis), 1.0, rtol=1e-5)
    elif op == "Hardmax":
        assert (got.sum(axis=axis) == 1).all()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    ("shape", "attrs"),
    [
        ((3, 5), {}),  # default axis 1 is the last: no reshape needed
        ((2, 3, 4), {}),  # default axis 1 of a rank-3 input: normalized over 3 x 4 jointly
        ((2, 3, 4), {"axis": 0}),
        ((2, 3, 4), {"axis": -2}),
        ((2, 3, 4), {"axis": 2}),
        ((2, 3, 2, 2), {"axis": 1}),
        ((4,), {"axis": 0}),
    ],
)
@pytest.mark.parametrize("opset", [9, 11])
def test_old_semantics(op: str, shape: tuple[int, ...], attrs: dict[str, int], opset: int) -> None:
    if opset < 11 and "axis" in attrs:
        attrs = {"axis": attrs["axis"] % len(shape)}  # negative axes arrive in opset 11
    got = check_op(op, [logits(shape, seed=opset)], attrs, opset=opset)["out0"]
    assert got.shape == shape
    axis = attrs.get("axis", 1) % len(shape)
    rows = got.reshape(int(np.prod(shape[:axis])), -1)
    if op == "Softmax":
        np.testing.assert_allclose(rows.sum(axis=1), 1.0, rtol=1e-5)
    elif op == "Hardmax":
        assert (rows.sum(axis=1) == 1).all()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_float_types(op: str, dtype: type) -> None:
    x = logits((3, 6), dtype=dtype)
    if op == "Hardmax" and dtype == np.float64:
        # onnxruntime has no float64 Hardmax; the one-hot answer is the float32 one.
        (got,) = get_op(op).evaluate([x], Attrs({"axis": 0}))
        ref = check_op(op, [x.astype(np.float32)], {"axis": 0})["out0"]
        assert got.dtype == np.float64 and (got == ref).all()
        return
    tol = 2e-3 if dtype == np.float16 else 1e-12
    check_op(op, [x], {"axis": 0}, tol=tol)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_large_logits_are_stable(op: str) -> None:
    x = np.array([[1e4, 1e4 - 1, -1e4], [-1e4, -1e4, -1e4 + 2]], np.float32)
    got = check_op(op, [x], {})["out0"]
    assert np.isfinite(got).all()


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_infinite_logits(op: str) -> None:
    # An infinite max gives inf - inf: NaN rows, as onnxruntime computes.
    x = np.array([[np.inf, 1.0], [-np.inf, -np.inf], [0.0, -np.inf]], np.float32)
    got = check_op(op, [x], {})["out0"]
    assert np.isnan(got[:2]).all() and not np.isnan(got[2]).any()


def test_hardmax_ties_pick_the_first() -> None:
    x = np.array([[3, 1, 3], [0, 0, 0], [1, 2, 2]], np.float32)
    got = check_op("Hardmax", [x], {})["out0"]
    assert got.tolist() == [[1, 0, 0], [1, 0, 0], [0, 1, 0]]


@pytest.mark.parametrize("op", OPS)
def test_empty_axis(op: str) -> None:
    # An empty input goes in as an initializer: the importer reads a 0 dim of a graph input
    # as dynamic.
    for opset in (11, 13):
        got = check_op(
            op, [np.zeros((2, 0, 3), np.float32)], {"axis": 1}, opset=opset, const_inputs=[0]
        )
        assert got["out0"].shape == (2, 0, 3)
    (got,) = get_op(op).evaluate([np.zeros((2, 0), np.float32)], Attrs({}))
    assert got.shape == (2, 0)


@settings(max_examples=25, deadline=None)
@given(
    op=st.sampled_from(OPS),
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple),
    data=st.data(),
    opset=st.sampled_from([11, 13]),
)
def test_random(op: str, shape: tuple[int, ...], data: st.DataObject, opset: int) -> None:
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    got = check_op(op, [logits(shape, seed=len(shape))], {"axis": axis}, opset=opset)["out0"]
    assert got.shape == shape


def test_old_opset_keeps_reshape_out_when_axis_is_last() -> None:
    model, _ = make_op_model("Softmax", [logits((2, 3, 4))], {"axis": 2}, opset=11)
    graph = import_model(model)
    assert [n.op for n in graph.nodes] == ["Softmax"]
    assert graph.nodes[0].attrs["axis"] == 2
    model, _ = make_op_model("Softmax", [logits((2, 3, 4))], {}, opset=11)
    graph = import_model(model)
    assert [n.op for n in graph.nodes] == ["Reshape", "Softmax", "Reshape"]


@pytest.mark.parametrize(
    ("op", "x", "attrs", "opset", "message"),
    [
        ("Softmax", np.ones((2, 3), np.float32), {"axis": 2}, 13, "axis 2 is out of range"),
        ("LogSoftmax", np.ones((2, 3), np.float32), {"axis": -3}, 21, "axis -3 is out of range"),
        ("Hardmax", np.ones((2, 3), np.int32), {}, 13, "needs a floating-point input, got i32"),
        ("Softmax", np.array(1.0, np.float32), {}, 13, "got a scalar"),
        # Opset 11's default axis 1 does not exist in a 1-D input.
        ("Softmax", np.ones(3, np.float32), {}, 11, "axis 1 is out of range"),
        ("Hardmax", np.ones((2, 3), np.float32), {"axis": 5}, 11, "axis 5 is out of range"),
    ],
)
def test_errors_name_the_node(
    op: str, x: np.ndarray, attrs: dict[str, int], opset: int, message: str
) -> None:
    model, _ = make_op_model(op, [x], attrs, opset=opset)
    with pytest.raises(ShapeError, match=message) as info:
        import_model(model)
    assert f"{op.lower()}_0" in str(info.value)


def test_flops() -> None:
    model, _ = make_op_model("Softmax", [logits((4, 8))], {})
    graph = import_model(model)
    assert get_op("Softmax").count_flops(graph.nodes[0]) == 8 * 32
