"""Reduce*, ArgMax/ArgMin, CumSum and CumProd against onnxruntime, every opset spelling included."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opcheck import check_op, make_op_model

from flowc.errors import ShapeError
from flowc.frontend.onnx import import_model
from flowc.ir.builder import GraphBuilder
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Graph
from flowc.ir.types import TensorType
from flowc.ops.registry import get_op

REDUCE_OPS = [
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceSumSquare",
]

# The opset where each op's axes moved from an attribute to input 1.
AXES_INPUT_SINCE = {op: 18 for op in REDUCE_OPS} | {"ReduceSum": 13}


def data(op: str, shape: tuple[int, ...], seed: int = 0, dtype: type = np.float32) -> np.ndarray:
    """Inputs each op is well defined on: LogSum needs a positive sum, Prod stays near 1."""
    rng = np.random.default_rng(seed)
    if op == "ReduceLogSum":
        x = rng.uniform(0.1, 2.0, shape)
    elif op == "ReduceProd":
        x = rng.uniform(0.8, 1.25, shape) * rng.choice([-1.0, 1.0], shape)
    else:
        x = rng.uniform(-3.0, 3.0, shape)
    return x.astype(dtype)


def reduce_check(
    op: str,
    x: np.ndarray,
    axes: list[int] | None,
    opset: int = 18,
    tol: float = 1e-5,
    **attrs: int,
) -> np.ndarray:
    """Spell axes the way ``opset`` does (attribute or constant input) and check the op."""
    consts = [1, *empty_as_const(x)]
    if opset >= AXES_INPUT_SINCE[op]:
        inputs: list[np.ndarray | None] = [x]
        if axes is not None:
            inputs.append(np.array(axes, np.int64))
        return check_op(op, inputs, attrs, opset=opset, const_inputs=consts, tol=tol)["out0"]
    if axes is not None:
        attrs = {**attrs, "axes": axes}  # type: ignore[dict-item]
    return check_op(op, [x], attrs, opset=opset, const_inputs=consts, tol=tol)["out0"]


def empty_as_const(x: np.ndarray) -> list[int]:
    """Empty tensors go in as initializers: the importer reads a 0 dim of a graph input as
    dynamic (see the report), and a constant input exercises the same reference anyway."""
    return [0] if x.size == 0 else []


REDUCE_CASES = [
    # (shape, axes, attributes)
    ((3, 4, 5), [1], {}),
    ((3, 4, 5), [0, -1], {"keepdims": 0}),
    ((3, 4, 5), None, {}),
    ((3, 4, 5), [], {"keepdims": 0}),
    ((3, 4, 5), [1, -2], {}),  # the same axis twice: onnxruntime reduces it once
    ((2, 3), [], {"noop_with_empty_axes": 1}),
    ((2, 3), None, {"noop_with_empty_axes": 1, "keepdims": 0}),
    ((2, 0, 3), [1], {}),  # reducing nothing gives the op's identity
    ((2, 0, 3), [0, 2], {"keepdims": 0}),
    ((), None, {}),
    ((7,), [-1], {"keepdims": 0}),
]


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize(("shape", "axes", "attrs"), REDUCE_CASES)
def test_reduce_cases(
    op: str, shape: tuple[int, ...], axes: list[int] | None, attrs: dict[str, int]
) -> None:
    got = reduce_check(op, data(op, shape), axes, **attrs)
    keep = attrs.get("keepdims", 1)
    if attrs.get("noop_with_empty_axes") and not axes:
        assert got.shape == shape
    elif keep:
        assert got.ndim == len(shape)


def test_reduce_identities_on_empty() -> None:
    x = np.zeros((2, 0), np.float32)
    expect = {
        "ReduceSum": 0.0,
        "ReduceMean": 0.0,  # undefined in ONNX; onnxruntime's 0
        "ReduceMax": -np.inf,
        "ReduceMin": np.inf,
        "ReduceProd": 1.0,
        "ReduceL1": 0.0,
        "ReduceL2": 0.0,
        "ReduceLogSum": -np.inf,
        "ReduceLogSumExp": -np.inf,
        "ReduceSumSquare": 0.0,
    }
    for op, value in expect.items():
        got = reduce_check(op, x, [1], keepdims=0)
        assert got.shape == (2,)
        assert (got == value).all(), op


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("opset", [9, 11, 13, 18, 21])
def test_reduce_opsets(op: str, opset: int) -> None:
    # Negative axes arrive in opset 11.
    axes = [0, 2] if opset < 11 else [0, -1]
    got = reduce_check(op, data(op, (2, 3, 4), seed=opset), axes, opset=opset, keepdims=0)
    assert got.shape == (3,)
    got = reduce_check(op, data(op, (2, 3), seed=1), None, opset=opset)
    assert got.shape == (1, 1)


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_reduce_integers(op: str, dtype: type) -> None:
    rng = np.random.default_rng(3)
    low = 1 if op == "ReduceLogSum" else -6
    x = rng.integers(low, 7, (3, 4)).astype(dtype)
    reduce_check(op, x, [1])
    reduce_check(op, x, [0], keepdims=0)
    reduce_check(op, np.zeros((3, 0), dtype), [1])


def test_reduce_integer_edge_cases() -> None:
    # Mean truncates toward zero; LogSum of a non-positive sum is the type's minimum.
    got = reduce_check("ReduceMean", np.array([[-3, -2], [3, 2]], np.int32), [1], keepdims=0)
    assert got.tolist() == [-2, 2]
    got = reduce_check("ReduceLogSum", np.array([[3, -5], [3, -3]], np.int32), [1], keepdims=0)
    assert got.tolist() == [np.iinfo(np.int32).min] * 2
    # The exponentials are accumulated in the integer type.
    x = np.array([[3, 2, 2, 2, 2, 2, 2, 2, 2, 2]], np.int32)
    assert reduce_check("ReduceLogSumExp", x, [1], keepdims=0).tolist() == [3]


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.bool_])
def test_reduce_max_min_small_types(op: str, dtype: type) -> None:
    x = np.random.default_rng(4).integers(0, 5, (3, 4)).astype(dtype)
    reduce_check(op, x, [1], opset=20)
    empty = np.zeros((3, 0), dtype)
    if dtype != np.bool_:
        reduce_check(op, empty, [1], opset=20)
        return
    # onnxruntime refuses an empty bool reduction; ONNX asks for the type's extreme value.
    (got,) = get_op(op).evaluate([empty, np.array([1])], Attrs({}))
    assert got.tolist() == [[op == "ReduceMin"]] * 3


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_reduce_float_types(op: str, dtype: type) -> None:
    tol = 2e-3 if dtype == np.float16 else 1e-12
    reduce_check(op, data(op, (4, 6), dtype=dtype), [1], tol=tol)


def test_reduce_log_sum_exp_is_stable() -> None:
    x = np.array([[1000.0, 999.0, -np.inf], [-np.inf, -np.inf, -np.inf]], np.float32)
    got = reduce_check("ReduceLogSumExp", x, [1], keepdims=0)
    assert np.isfinite(got[0]) and got[1] == -np.inf
    x = np.array([[np.inf, 1.0], [-1e30, 1e30]], np.float32)
    assert reduce_check("ReduceLogSumExp", x, [1], keepdims=0)[0] == np.inf


@settings(max_examples=30, deadline=None)
@given(
    op=st.sampled_from(REDUCE_OPS),
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple),
    data_=st.data(),
    keepdims=st.integers(0, 1),
)
def test_reduce_random(
    op: str, shape: tuple[int, ...], data_: st.DataObject, keepdims: int
) -> None:
    rank = len(shape)
    axes = data_.draw(st.lists(st.integers(-rank, rank - 1), max_size=rank, unique=True))
    got = reduce_check(op, data(op, shape, seed=len(axes)), axes, keepdims=keepdims)
    reduced = {a % rank for a in axes} or set(range(rank))
    if keepdims:
        expect = tuple(1 if k in reduced else d for k, d in enumerate(shape))
    else:
        expect = tuple(d for k, d in enumerate(shape) if k not in reduced)
    assert got.shape == expect


# -- ArgMax / ArgMin ------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize(
    ("shape", "attrs"),
    [
        ((5,), {}),
        ((3, 4), {"axis": 1}),
        ((3, 4, 5), {"axis": -1, "keepdims": 0}),
        ((3, 4, 5), {"axis": -3}),
        ((2, 3, 4), {"axis": 1, "keepdims": 0, "select_last_index": 1}),
        ((0, 4), {"axis": 1}),
    ],
)
def test_arg_reduce(op: str, shape: tuple[int, ...], attrs: dict[str, int]) -> None:
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    got = check_op(op, [x], attrs, const_inputs=empty_as_const(x))["out0"]
    assert got.dtype == np.int64


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("select_last_index", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.int64, np.uint8])
def test_arg_reduce_ties(op: str, select_last_index: int, dtype: type) -> None:
    # Values from {0, 1, 2} tie often along an axis of 6.
    x = np.random.default_rng(6).integers(0, 3, (4, 6, 3)).astype(dtype)
    got = check_op(op, [x], {"axis": 1, "select_last_index": select_last_index})["out0"]
    row = np.array([2, 0, 2, 1, 0, 2], dtype)
    first, last = (0, 5) if op == "ArgMax" else (1, 4)
    got_row = check_op(op, [row], {"select_last_index": select_last_index, "keepdims": 0})
    assert int(got_row["out0"]) == (last if select_last_index else first)
    assert got.shape == (4, 1, 3)


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("opset", [9, 11, 12, 13, 21])
def test_arg_reduce_opsets(op: str, opset: int) -> None:
    x = np.random.default_rng(opset).standard_normal((3, 4, 2)).astype(np.float32)
    attrs = {"axis": 1 if opset < 11 else -2, "keepdims": 0}
    if opset >= 12:
        attrs["select_last_index"] = 1
    assert check_op(op, [x], attrs, opset=opset)["out0"].shape == (3, 2)


# -- CumSum -----------------------------------------------------------------------------------


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize(("shape", "axis"), [((6,), 0), ((3, 5), 1), ((3, 5), -2), ((2, 3, 4), -1)])
def test_cumsum(exclusive: int, reverse: int, shape: tuple[int, ...], axis: int) -> None:
    x = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    attrs = {"exclusive": exclusive, "reverse": reverse}
    got = check_op("CumSum", [x, np.array(axis, np.int64)], attrs, const_inputs=[1])["out0"]
    first = got.take(-1 if reverse else 0, axis=axis)
    expect = np.zeros_like(first) if exclusive else x.take(-1 if reverse else 0, axis=axis)
    np.testing.assert_allclose(first, expect, rtol=1e-6)


@pytest.mark.parametrize(
    ("dtype", "opset"),
    # float16 CumSum arrives in opset 14.
    [
        (d, o)
        for d in (np.float64, np.float16, np.int32, np.int64)
        for o in (11, 14, 21)
        if not (d == np.float16 and o < 14)
    ],
)
def test_cumsum_types_and_opsets(dtype: type, opset: int) -> None:
    x = np.random.default_rng(8).integers(-5, 6, (3, 4)).astype(dtype)
    for axis in (np.array(1, np.int32), np.array([-1], np.int64)):
        got = check_op("CumSum", [x, axis], {"exclusive": 1}, opset=opset, const_inputs=[1])
        assert got["out0"].dtype == dtype


def test_cumsum_empty_axis() -> None:
    x = np.zeros((3, 0), np.float32)
    got = check_op("CumSum", [x, np.array(1)], {"exclusive": 1, "reverse": 1}, const_inputs=[0, 1])
    assert got["out0"].shape == (3, 0)


# -- CumProd ----------------------------------------------------------------------------------


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize(("shape", "axis"), [((6,), 0), ((3, 5), 1), ((3, 5), -2), ((2, 3, 4), -1)])
def test_cumprod(exclusive: int, reverse: int, shape: tuple[int, ...], axis: int) -> None:
    x = np.random.default_rng(9).uniform(0.5, 1.5, shape).astype(np.float32)
    attrs = {"exclusive": exclusive, "reverse": reverse}
    got = check_op("CumProd", [x, np.array(axis, np.int64)], attrs, opset=26, const_inputs=[1])
    first = got["out0"].take(-1 if reverse else 0, axis=axis)
    expect = np.ones_like(first) if exclusive else x.take(-1 if reverse else 0, axis=axis)
    np.testing.assert_allclose(first, expect, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int64])
def test_cumprod_types(dtype: type) -> None:
    x = np.random.default_rng(10).integers(-5, 6, (3, 4)).astype(dtype)
    for axis in (np.array(1, np.int32), np.array([-2], np.int64)):
        for attrs in ({}, {"exclusive": 1, "reverse": 1}):
            got = check_op("CumProd", [x, axis], attrs, opset=26, const_inputs=[1])
            assert got["out0"].dtype == dtype


def test_cumprod_integers_wrap() -> None:
    # Products past int32 wrap, as onnxruntime's integer arithmetic does.
    x = np.full((12,), 17, np.int32)
    got = check_op("CumProd", [x, np.array(0, np.int64)], {}, opset=26, const_inputs=[1])
    assert got["out0"][-1] == np.int32(np.uint32(17**12 % 2**32).view(np.int32))


def test_cumprod_empty_axis() -> None:
    x = np.zeros((3, 0), np.float32)
    got = check_op("CumProd", [x, np.array(1)], {"exclusive": 1}, opset=26, const_inputs=[0, 1])
    assert got["out0"].shape == (3, 0)


# -- error paths ------------------------------------------------------------------------------


def import_one(
    op: str, inputs: list[np.ndarray | None], attrs: dict, opset: int = 21, **kw: object
) -> None:
    model, _ = make_op_model(op, inputs, attrs, opset=opset, **kw)  # type: ignore[arg-type]
    import_model(model)


@pytest.mark.parametrize(
    ("op", "inputs", "attrs", "const_inputs", "opset", "message"),
    [
        (
            "ReduceSum",
            [np.ones((2, 3), np.float32), np.array([2])],
            {},
            [1],
            21,
            "axes entry 2 is out of range",
        ),
        (
            "ReduceMean",
            [np.ones((2, 3), np.float32)],
            {"axes": [-3]},
            [],
            13,
            "axes entry -3 is out of range",
        ),
        (
            "ReduceMax",
            [np.ones((2, 3), np.float32), np.array([1])],
            {},
            [],
            21,
            "must be known at compile time",
        ),
        (
            "ReduceSum",
            [np.ones((2, 3), np.float32), np.array([[1]])],
            {},
            [1],
            21,
            "1-D integer tensor",
        ),
        (
            "ReduceMean",
            [np.ones((2, 3), np.float32)],
            {"axes": [1]},
            [],
            18,
            "'axes' is not an attribute of ReduceMean in opset 18",
        ),
        ("ReduceSum", [np.ones((2, 3), np.bool_)], {}, [], 21, "needs a numeric input, got bool"),
        ("ArgMax", [np.ones((2, 3), np.float32)], {"axis": 2}, [], 21, "axis 2 is out of range"),
        ("ArgMin", [np.ones((2, 0), np.float32)], {"axis": -1}, [0], 21, "has size 0"),
        ("ArgMax", [np.array(1.0, np.float32)], {}, [], 21, "got a scalar"),
        ("CumSum", [np.array(1.0, np.float32), np.array(0)], {}, [1], 21, "got a scalar"),
        (
            "CumSum",
            [np.ones((2, 3), np.float32), np.array([0, 1])],
            {},
            [1],
            21,
            "axis must be one integer",
        ),
        (
            "CumSum",
            [np.ones((2, 3), np.float32), np.array(-3)],
            {},
            [1],
            21,
            "axis -3 is out of range",
        ),
        (
            "CumSum",
            [np.ones((2, 3), np.float32), np.array(1)],
            {},
            [],
            21,
            "must be known at compile time",
        ),
        ("CumProd", [np.array(1.0, np.float32), np.array(0)], {}, [1], 26, "got a scalar"),
        ("CumProd", [np.ones((2, 3), np.float32), np.array(2)], {}, [1], 26, "out of range"),
        ("CumProd", [np.ones((2, 3), np.bool_), np.array(0)], {}, [1], 26, "numeric input"),
    ],
)
def test_errors_name_the_node(
    op: str,
    inputs: list[np.ndarray],
    attrs: dict,
    const_inputs: list[int],
    opset: int,
    message: str,
) -> None:
    with pytest.raises(ShapeError, match=message) as info:
        import_one(op, inputs, attrs, opset=opset, const_inputs=const_inputs)
    assert f"{op.lower()}_0" in str(info.value)


def test_flops_count_input_elements() -> None:
    g = Graph()
    b = GraphBuilder(g)
    x = g.add_input("x", TensorType((4, 5, 6), DType.F32))
    axes = b.constant("axes", np.array([1], np.int64))
    for op in [*REDUCE_OPS, "ArgMax", "CumSum", "CumProd"]:
        ins = [x, axes] if op != "ArgMax" else [x]
        node = b.emit(op, ins, name=op)[0].producer
        assert node is not None
        assert get_op(op).count_flops(node) == 120
