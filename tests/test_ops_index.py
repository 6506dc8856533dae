"""Indexing ops against onnxruntime: negative axes and indices, defaults, opset variants."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opcheck import check_op, make_op_model

from flowc.errors import InputError, ShapeError
from flowc.frontend.onnx import import_model
from flowc.interpreter import evaluate
from flowc.ir.graph import Attrs
from flowc.ir.symbolic import DimRange
from flowc.ops.registry import get_op

rng = np.random.default_rng(1)


def rand(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def i64(*v: int) -> np.ndarray:
    return np.array(v, np.int64)


def idx(
    high: int, shape: tuple[int, ...], negative: bool = True, dtype: Any = np.int64
) -> np.ndarray:
    """Random indices into an axis of length ``high``, negative ones included."""
    return rng.integers(-high if negative else 0, high, shape).astype(dtype)


def import_error(op: str, inputs: list[Any], attrs: dict[str, Any] | None = None, **kw: Any) -> str:
    model, _ = make_op_model(op, inputs, attrs, **kw)
    with pytest.raises(ShapeError) as e:
        import_model(model)
    return str(e.value)


# -- Gather family -----------------------------------------------------------------------------


@pytest.mark.parametrize("axis", [None, 0, 1, 2, -1, -3])
@pytest.mark.parametrize("ind_shape", [(), (4,), (2, 3)])
@pytest.mark.parametrize("opset", [11, 13])
def test_gather(axis: int | None, ind_shape: tuple[int, ...], opset: int) -> None:
    x = rand(3, 4, 5)
    dim = x.shape[axis or 0]
    attrs = {} if axis is None else {"axis": axis}
    check_op("Gather", [x, idx(dim, ind_shape)], attrs, opset=opset)


def test_gather_int32_indices_and_int_data() -> None:
    x = np.arange(24, dtype=np.int64).reshape(4, 6)
    check_op("Gather", [x, idx(6, (3,), dtype=np.int32)], {"axis": 1})
    check_op("Gather", [x, i64(-1, 0, -4)], {"axis": 0}, opset=9)


def test_gather_errors() -> None:
    msg = import_error("Gather", [rand(2, 3), i64(0)], {"axis": 2})
    assert "gather_0" in msg and "out of range" in msg
    assert "int32 or int64" in import_error("Gather", [rand(3), np.zeros(2, np.float32)])
    with pytest.raises(IndexError, match="out of range"):
        get_op("Gather").evaluate([rand(3), i64(3)], Attrs())


@pytest.mark.parametrize("axis", [0, 1, -1, -2])
@pytest.mark.parametrize("opset", [11, 13])
def test_gather_elements(axis: int, opset: int) -> None:
    x = rand(3, 4)
    shape = [2, 3]  # smaller than the data on the other axis too
    shape[axis] = 5
    check_op("GatherElements", [x, idx(x.shape[axis], tuple(shape))], {"axis": axis}, opset=opset)


def test_gather_elements_default_axis_and_error() -> None:
    check_op("GatherElements", [rand(4, 2, 3), idx(4, (4, 2, 3))])
    assert "rank" in import_error("GatherElements", [rand(3, 4), i64(0, 1)])


@pytest.mark.parametrize(
    ("data", "ind", "batch_dims"),
    [
        ((4, 5), (3, 1), 0),
        ((4, 5), (3, 2), 0),
        ((4, 5, 2), (2, 3, 2), 0),
        ((2, 5, 3), (2, 4, 1), 1),
        ((2, 3, 4, 5), (2, 3, 2), 2),
        ((2, 3, 4), (2, 2), 1),
    ],
)
@pytest.mark.parametrize("opset", [12, 13])
def test_gather_nd(
    data: tuple[int, ...], ind: tuple[int, ...], batch_dims: int, opset: int
) -> None:
    x = rand(*data)
    m = ind[-1]
    cols = [idx(data[batch_dims + k], ind[:-1]) for k in range(m)]
    indices = np.stack(cols, axis=-1)
    attrs = {"batch_dims": batch_dims} if batch_dims else {}
    check_op("GatherND", [x, indices], attrs, opset=opset)
    if not batch_dims:
        check_op("GatherND", [x, indices], opset=11)


def test_gather_nd_errors() -> None:
    assert "exceeds" in import_error("GatherND", [rand(2, 3), i64(0, 1, 0).reshape(1, 3)])
    msg = import_error("GatherND", [rand(2, 3), i64(0, 1, 0).reshape(3, 1)], {"batch_dims": 1})
    assert "batch" in msg


# -- Scatter family ----------------------------------------------------------------------------


def _unique_rows(dim: int, shape: tuple[int, ...], axis: int) -> np.ndarray:
    """Indices without repeats along ``axis``, so reduction 'none' is deterministic."""
    out = np.empty(shape, np.int64)
    for pos in np.ndindex(*[s for k, s in enumerate(shape) if k != axis]):
        perm = rng.permutation(dim)[: shape[axis]] - rng.integers(0, 2) * dim
        sl = list(pos)
        sl.insert(axis, slice(None))
        out[tuple(sl)] = perm
    return out


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize(
    ("reduction", "opset"),
    [(None, 11), (None, 13), ("none", 16), ("add", 16), ("mul", 16), ("max", 18), ("min", 18)],
)
def test_scatter_elements(axis: int, reduction: str | None, opset: int) -> None:
    x = rand(4, 5)
    shape = [3, 4]
    ax = axis % 2
    if reduction in (None, "none"):
        shape[ax] = min(shape[ax], x.shape[ax])
        ind = _unique_rows(x.shape[ax], tuple(shape), ax)
    else:
        shape[ax] = 6  # more updates than slots: repeated indices combine
        ind = idx(x.shape[ax], tuple(shape))
    attrs: dict[str, Any] = {"axis": axis}
    if reduction is not None:
        attrs["reduction"] = reduction
    check_op("ScatterElements", [x, ind, rand(*shape)], attrs, opset=opset)


def test_scatter_elements_int_and_errors() -> None:
    x = np.arange(12, dtype=np.int64).reshape(3, 4)
    check_op("ScatterElements", [x, i64(2, 0, 1, 2).reshape(1, 4), i64(7, 8, 9, 10).reshape(1, 4)])
    bad = [rand(3), i64(0), rand(2)]
    assert "differ in shape" in import_error("ScatterElements", bad)
    msg = import_error(
        "ScatterElements", [rand(3), i64(0), rand(1)], {"reduction": "sum"}, opset=18
    )
    assert "scatterelements_0" in msg and "reduction" in msg


@pytest.mark.parametrize(
    ("data", "ind"), [((6,), (3, 1)), ((4, 5), (3, 1)), ((4, 5), (3, 2)), ((3, 4, 5), (2, 2, 2))]
)
@pytest.mark.parametrize(
    ("reduction", "opset"),
    [(None, 11), (None, 13), ("add", 16), ("mul", 16), ("max", 18), ("min", 18)],
)
def test_scatter_nd(
    data: tuple[int, ...], ind: tuple[int, ...], reduction: str | None, opset: int
) -> None:
    x = rand(*data)
    m = ind[-1]
    rows = int(np.prod(ind[:-1]))
    if reduction is None:
        # Distinct target positions: 'none' with repeats is order-dependent.
        flat = rng.permutation(int(np.prod(data[:m])))[:rows]
        indices = np.stack(np.unravel_index(flat, data[:m]), axis=-1).reshape(ind)
        indices = indices - (rng.integers(0, 2, indices.shape) * np.array(data[:m]))
    else:
        indices = np.stack([idx(data[k], ind[:-1]) for k in range(m)], axis=-1)
    upd = rand(*ind[:-1], *data[m:])
    attrs = {} if reduction is None else {"reduction": reduction}
    check_op("ScatterND", [x, indices.astype(np.int64), upd], attrs, opset=opset)


def test_scatter_nd_errors() -> None:
    msg = import_error("ScatterND", [rand(4, 5), i64(0, 1).reshape(2, 1), rand(2, 4)])
    assert "scatternd_0" in msg and "[2, 5]" in msg


@pytest.mark.parametrize("axis", [None, 0, 1, -1])
@pytest.mark.parametrize("opset", [9, 10])
def test_scatter_old_name(axis: int | None, opset: int) -> None:
    x = rand(4, 5)
    ax = (axis or 0) % 2
    shape = (3, 4) if ax == 0 else (4, 3)
    attrs = {} if axis is None else {"axis": axis}
    ind = _unique_rows(x.shape[ax], shape, ax)
    check_op("Scatter", [x, ind, rand(*shape)], attrs, opset=opset)
    # Imported as ScatterElements: one spelling in the graph.
    model, _ = make_op_model("Scatter", [x, ind, rand(*shape)], attrs, opset=opset)
    assert [n.op for n in import_model(model).nodes] == ["ScatterElements"]


# -- TensorScatter and ReverseSequence ---------------------------------------------------------


@pytest.mark.parametrize(
    ("past", "update", "axis"),
    [((2, 6, 3), (2, 2, 3), None), ((2, 3, 6, 4), (2, 3, 6, 4), -2), ((3, 5), (3, 2), 1)],
)
@pytest.mark.parametrize("mode", [None, "linear", "circular"])
@pytest.mark.parametrize("with_indices", [False, True])
def test_tensor_scatter(
    past: tuple[int, ...],
    update: tuple[int, ...],
    axis: int | None,
    mode: str | None,
    with_indices: bool,
) -> None:
    ax = -2 if axis is None else axis
    size, length = past[ax], update[ax]
    attrs: dict[str, Any] = {}
    if axis is not None:
        attrs["axis"] = axis
    if mode is not None:
        attrs["mode"] = mode
    # Linear writes must fit; circular ones may start anywhere and wrap.
    high = size + 3 if mode == "circular" else size - length + 1
    w = rng.integers(0, high, past[0]).astype(np.int64) if with_indices else None
    got = check_op("TensorScatter", [rand(*past), rand(*update), w], attrs, opset=24)
    assert got["out0"].shape == past


def test_tensor_scatter_errors() -> None:
    past, upd = rand(2, 4, 3), rand(2, 2, 3)
    assert "cannot be 0" in import_error("TensorScatter", [past, upd], {"axis": 0}, opset=24)
    assert "may be shorter" in import_error("TensorScatter", [past, rand(2, 5, 3)], opset=24)
    assert "may be shorter" in import_error("TensorScatter", [past, rand(2, 2, 2)], opset=24)
    msg = import_error("TensorScatter", [past, upd], {"mode": "ring"}, opset=24)
    assert "tensorscatter_0" in msg and "linear, circular" in msg
    msg = import_error("TensorScatter", [past, upd, i64(0, 1, 2)], opset=24)
    assert "write_indices must be int64 of shape [2]" in msg
    # Bad write indices are data errors: negative, or a linear write past the end.
    for w, mode in ((i64(0, -1), "circular"), (i64(0, 3), "linear")):
        model, feeds = make_op_model("TensorScatter", [past, upd, w], {"mode": mode}, opset=24)
        with pytest.raises(InputError, match=r"write_indices\[1\]"):
            evaluate(import_model(model), feeds)


@pytest.mark.parametrize(
    ("shape", "batch_axis", "time_axis"),
    [((4, 5), 0, 1), ((5, 4), 1, 0), ((5, 3, 2), None, None), ((3, 6, 2, 2), 0, 1)],
)
def test_reverse_sequence(
    shape: tuple[int, ...], batch_axis: int | None, time_axis: int | None
) -> None:
    b = 1 if batch_axis is None else batch_axis
    attrs = {} if batch_axis is None else {"batch_axis": batch_axis, "time_axis": time_axis}
    steps = shape[1 - b]
    lens = rng.integers(0, steps + 1, shape[b]).astype(np.int64)
    lens[0] = steps  # every length from 0 to the whole sequence is valid
    x = rand(*shape)
    got = check_op("ReverseSequence", [x, lens], attrs, opset=10)["out0"]
    first = np.moveaxis(got, (b, 1 - b), (0, 1))[0]
    np.testing.assert_array_equal(first, np.moveaxis(x, (b, 1 - b), (0, 1))[0][::-1])


def test_reverse_sequence_int_data_and_errors() -> None:
    x = np.arange(12, dtype=np.int64).reshape(3, 4)
    check_op("ReverseSequence", [x, i64(2, 0, 3, 1)], opset=10)
    bad = import_error("ReverseSequence", [x, i64(2, 0, 3)], opset=10)
    assert "reversesequence_0" in bad and "of shape [4]" in bad
    attrs = {"batch_axis": 1, "time_axis": 1}
    assert "0 and 1" in import_error("ReverseSequence", [x, i64(1, 1, 1, 1)], attrs, opset=10)
    assert "rank >= 2" in import_error("ReverseSequence", [rand(3), i64(1, 1, 1)], opset=10)
    model, feeds = make_op_model("ReverseSequence", [x, i64(2, 0, 4, 1)], opset=10)
    with pytest.raises(InputError, match=r"sequence_lens\[2\] = 4 is outside \[0, 3\]"):
        evaluate(import_model(model), feeds)


# -- Trilu, TopK, OneHot, EyeLike --------------------------------------------------------------


@pytest.mark.parametrize("upper", [None, 0, 1])
@pytest.mark.parametrize("k", [None, 0, 1, -1, 3, -5])
@pytest.mark.parametrize("shape", [(4, 4), (3, 5), (2, 5, 3)])
def test_trilu(upper: int | None, k: int | None, shape: tuple[int, ...]) -> None:
    attrs = {} if upper is None else {"upper": upper}
    ins = [rand(*shape)] if k is None else [rand(*shape), np.array(k, np.int64)]
    check_op("Trilu", ins, attrs, opset=14)


def test_trilu_k_may_be_computed_at_run_time_and_errors() -> None:
    check_op("Trilu", [rand(3, 3), np.array(1, np.int64)], {"upper": 0})  # k is a graph input
    assert "rank >= 2" in import_error("Trilu", [rand(3)])


def _topk_case(n: int) -> np.ndarray:
    # Few distinct values: many ties, which must go to the lower index.
    return rng.integers(0, 4, (3, n)).astype(np.float32)


@pytest.mark.parametrize("axis", [None, 0, 1, -1, -2])
@pytest.mark.parametrize("largest", [None, 0, 1])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_topk(axis: int | None, largest: int | None, k: int) -> None:
    x = _topk_case(6)
    attrs = {k_: v for k_, v in (("axis", axis), ("largest", largest)) if v is not None}
    check_op("TopK", [x, i64(k)], attrs, opset=11, num_outputs=2, const_inputs=[1])


@pytest.mark.parametrize("opset", [1, 9, 10])
def test_topk_old_opsets(opset: int) -> None:
    x = _topk_case(7)
    if opset < 10:
        check_op("TopK", [x], {"k": 3}, opset=opset, num_outputs=2)
    else:
        check_op("TopK", [x, i64(3)], {"axis": 1}, opset=opset, num_outputs=2, const_inputs=[1])


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.float64])
def test_topk_dtypes(dtype: Any) -> None:
    x = rng.integers(0, 5, (2, 9)).astype(dtype)
    check_op("TopK", [x, i64(4)], {"largest": 1}, num_outputs=2, const_inputs=[1])
    check_op("TopK", [x, i64(4)], {"largest": 0}, num_outputs=2, const_inputs=[1])


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 9), st.booleans(), st.integers(0, 1))
def test_topk_random(n: int, largest: bool, axis: int) -> None:
    x = rng.integers(-3, 3, (n, n)).astype(np.float32)
    k = int(rng.integers(0, n + 1))
    attrs = {"largest": int(largest), "axis": axis}
    check_op("TopK", [x, i64(k)], attrs, num_outputs=2, const_inputs=[1])


def test_topk_unsorted_returns_the_same_set() -> None:
    # sorted=0 leaves the order unspecified: flowc returns sorted output, onnxruntime heap order.
    from flowc.harness.ort import run_onnxruntime
    from flowc.interpreter import evaluate

    x = rand(2, 8)
    model, feeds = make_op_model(
        "TopK", [x, i64(4)], {"sorted": 0}, num_outputs=2, const_inputs=[1]
    )
    ref = run_onnxruntime(model, feeds)
    got = evaluate(import_model(model), feeds)
    order = np.argsort(ref["out1"], axis=1)
    assert np.array_equal(np.sort(got["out1"], axis=1), np.take_along_axis(ref["out1"], order, 1))
    assert np.array_equal(np.take_along_axis(x, got["out1"], 1), got["out0"])


def test_topk_errors() -> None:
    msg = import_error("TopK", [rand(2, 3), i64(4)], num_outputs=2, const_inputs=[1])
    assert "topk_0" in msg and "k = 4" in msg
    msg = import_error("TopK", [rand(2, 3), i64(1, 2)], num_outputs=2)
    assert "k must hold one int64 value" in msg


def test_topk_k_of_run_time_is_a_computed_count() -> None:
    """k fed as an input: both outputs hold the axis (the bound) and share one count, the
    run's k (the kernel is checked in tests/test_dynamic.py and the conformance cases)."""
    model, _ = make_op_model("TopK", [rand(2, 3), i64(2)], num_outputs=2)
    g = import_model(model)
    assert g.symbols["n0"] == DimRange(0, 3, computed=True)
    assert [str(v.type) for v in g.outputs] == ["f32[2, n0]", "i64[2, n0]"]


@pytest.mark.parametrize("axis", [None, 0, 1, -1, -2, -3])
@pytest.mark.parametrize("opset", [9, 11])
def test_onehot(axis: int | None, opset: int) -> None:
    depth = 5
    ind = idx(depth, (2, 3), negative=opset >= 11)
    attrs = {} if axis is None else {"axis": axis}
    values = np.array([-1.0, 3.0], np.float32)
    check_op(
        "OneHot", [ind, np.array(depth, np.int64), values], attrs, opset=opset, const_inputs=[1]
    )


def test_onehot_value_types_and_out_of_range() -> None:
    ind = np.array([0, 2, 7, -1, -9], np.int64)  # 7 and -9 are out of range: all-off rows
    check_op("OneHot", [ind, np.array([4], np.int64), np.array([0, 1], np.int64)], const_inputs=[1])
    check_op(
        "OneHot",
        [
            np.array([1.7, 0.0, 3.2], np.float32),
            np.array(4.0, np.float32),
            np.array([2, 5], np.float32),
        ],
        const_inputs=[1],
    )


def test_onehot_errors() -> None:
    bad_values = [i64(0), np.array(3, np.int64), np.zeros(3, np.float32)]
    assert "[off, on]" in import_error("OneHot", bad_values, const_inputs=[1])
    good = [i64(0), np.array(3, np.int64), np.zeros(2, np.float32)]
    assert "compile time" in import_error("OneHot", good)


@pytest.mark.parametrize("k", [None, 0, 1, -2, 5])
@pytest.mark.parametrize("dtype", [None, 1, 7, 11])
@pytest.mark.parametrize("shape", [(3, 3), (2, 5), (4, 1)])
def test_eyelike(k: int | None, dtype: int | None, shape: tuple[int, int]) -> None:
    attrs = {n: v for n, v in (("k", k), ("dtype", dtype)) if v is not None}
    check_op("EyeLike", [rand(*shape)], attrs, opset=9)


def test_eyelike_int_input_and_error() -> None:
    check_op("EyeLike", [np.zeros((2, 3), np.int32)], {"k": 1})
    assert "2-D" in import_error("EyeLike", [rand(2, 2, 2)])


def test_gather_scalar_result_folds() -> None:
    # A 1-D constant indexed by a scalar gives a 0-d array (np.take alone gives a NumPy scalar).
    out = get_op("Gather").evaluate([i64(4, 5, 6), np.array(-1, np.int64)], Attrs())[0]
    assert isinstance(out, np.ndarray) and out.shape == () and int(out) == 6
    check_op("Gather", [i64(4, 5, 6), np.array(1, np.int64)], const_inputs=[0, 1])


# -- Compress, NonZero, Unique ------------------------------------------------------------------


@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_compress_with_a_known_condition_is_a_gather(axis: int | None) -> None:
    x = rand(3, 4)
    n = x.size if axis is None else x.shape[axis]
    cond = rng.random(n) > 0.4
    attrs = {} if axis is None else {"axis": axis}
    check_op("Compress", [x, cond], attrs, opset=11, const_inputs=[1])
    model, _ = make_op_model("Compress", [x, cond], attrs, opset=11, const_inputs=[1])
    assert "Gather" in import_model(model).op_counts()


def test_compress_with_a_run_time_condition_counts_on_the_device() -> None:
    """A condition of run time: the kept positions are NonZero's (a count the program
    computes, at most the condition's length), gathered."""
    x = rand(4, 3)
    for cond in (np.array([True, False, True, True]), np.zeros(4, bool)):
        check_op("Compress", [x, cond], {"axis": 0}, opset=11)
    model, _ = make_op_model("Compress", [x, np.array([True, False, True, True])], opset=11)
    g = import_model(model)
    assert str(g.outputs[0].type) == "f32[n0]"
    assert g.symbols["n0"].computed and g.symbols["n0"].hi == 4


def test_nonzero_and_unique_fold_when_their_input_is_known_and_count_when_not() -> None:
    x = np.array([[0, 2, 0], [3, 0, 3]], np.int64)
    check_op("NonZero", [x], opset=13, const_inputs=[0])
    for sorted_ in (0, 1):
        for axis in (None, 0, 1):
            attrs = {"sorted": sorted_} | ({} if axis is None else {"axis": axis})
            check_op("Unique", [x], attrs, opset=11, num_outputs=4, const_inputs=[0])
    # Data of run time: the values, first indices and counts hold their bound, every slice,
    # their length a count the program computes (docs/dynamic.md); the inverse is per slice.
    model, _ = make_op_model("Unique", [x], {"sorted": 0}, opset=11, num_outputs=4)
    g = import_model(model)
    types = [str(o.type) for o in g.outputs]
    assert types == ["i64[n0]", "i64[n0]", "i64[6]", "i64[n0]"]
    assert g.symbols["n0"].computed and g.symbols["n0"].hi == 6
