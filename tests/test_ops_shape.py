"""Shape and data-movement ops against onnxruntime, across the opsets whose spelling differs.

Inputs that decide an output shape (Reshape's shape, Slice's starts, Pad's pads, ...) are
initializers (``const_inputs``): flowc compiles static shapes, and a model that computes such
an input at run time is rejected with a ShapeError naming the node (tested below).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper
from opcheck import check_op, make_op_model

from flowc.errors import ShapeError
from flowc.frontend.onnx import import_model
from flowc.ir.graph import Attrs, is_splat
from flowc.ops.registry import get_op

rng = np.random.default_rng(0)
BIG = 2**63 - 1


def rand(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def i64(*v: int) -> np.ndarray:
    return np.array(v, np.int64)


def f32(*v: float) -> np.ndarray:
    return np.array(v, np.float32)


def import_error(op: str, inputs: list[Any], attrs: dict[str, Any] | None = None, **kw: Any) -> str:
    model, _ = make_op_model(op, inputs, attrs, **kw)
    with pytest.raises(ShapeError) as e:
        import_model(model)
    return str(e.value)


# -- Reshape, Flatten, Transpose, Squeeze, Unsqueeze -------------------------------------------


@pytest.mark.parametrize(
    ("shape", "target", "allowzero"),
    [
        ((2, 3, 4), [4, -1], 0),
        ((2, 3, 4), [0, -1], 0),
        ((2, 3, 4), [0, 0, 4], 0),
        ((2, 3, 4), [-1], 0),
        ((2, 3, 4), [2, 1, 3, 1, 4], 0),
        ((6,), [2, 3], 1),
        ((2, 0, 3), [0, 5], 1),
        ((2, 0, 3), [0, -1], 0),
        ((1,), [], 0),
    ],
)
def test_reshape(shape: tuple[int, ...], target: list[int], allowzero: int) -> None:
    # allowzero exists since opset 14; without it, opset 13 and 21 must agree.
    attrs = {"allowzero": allowzero} if allowzero else {}
    for opset in (21,) if allowzero else (13, 21):
        check_op("Reshape", [rand(*shape), i64(*target)], attrs, opset=opset, const_inputs=[1])


def test_reshape_opset4_shape_attribute() -> None:
    check_op("Reshape", [rand(2, 3, 4)], {"shape": [4, 0, -1]}, opset=4)


def test_reshape_errors_name_node_and_shapes() -> None:
    msg = import_error("Reshape", [rand(2, 3), i64(4, 2)], const_inputs=[1])
    assert "reshape_0" in msg and "[2, 3]" in msg and "[4, 2]" in msg
    assert "-1" in import_error("Reshape", [rand(2, 3), i64(-1, -1)], const_inputs=[1])
    msg = import_error("Reshape", [rand(2, 3), i64(1, 6, 0)], const_inputs=[1])
    assert "position 2" in msg


def test_shape_input_computed_at_run_time_is_rejected() -> None:
    # The shape is a graph input here, not an initializer: its value is unknown at compile time.
    msg = import_error("Reshape", [rand(2, 3), i64(3, 2)])
    assert "reshape_0" in msg and "compile time" in msg


def test_data_movement_keeps_splats() -> None:
    fill = np.broadcast_to(np.float32(2), (4, 6))
    for op, ins in [
        ("Reshape", [fill, i64(2, -1)]),
        ("Transpose", [fill]),
        ("Unsqueeze", [fill, i64(0)]),
        ("Expand", [fill, i64(3, 1, 1)]),
        ("Tile", [fill, i64(2, 1)]),
    ]:
        out = get_op(op).evaluate(ins, Attrs())[0]
        assert is_splat(out) and float(out.flat[0]) == 2.0, op


@pytest.mark.parametrize("axis", [-3, -1, 0, 1, 2, 3])
def test_flatten(axis: int) -> None:
    check_op("Flatten", [rand(2, 3, 4)], {"axis": axis}, opset=13)
    if axis >= 0:
        check_op("Flatten", [rand(2, 3, 4)], {"axis": axis}, opset=9)


def test_flatten_default_and_error() -> None:
    check_op("Flatten", [rand(2, 3, 4)])
    assert "out of range" in import_error("Flatten", [rand(2, 3)], {"axis": 3})


@pytest.mark.parametrize("perm", [None, [0, 2, 1], [2, 0, 1], [1, 2, 0]])
def test_transpose(perm: list[int] | None) -> None:
    check_op("Transpose", [rand(2, 3, 4)], {"perm": perm} if perm else {})


def test_transpose_bad_perm() -> None:
    assert "permutation" in import_error("Transpose", [rand(2, 3)], {"perm": [0, 0]})


@pytest.mark.parametrize("axes", [None, [0], [-1], [0, -1], [2, 0]])
@pytest.mark.parametrize("opset", [11, 13, 21])
def test_squeeze(axes: list[int] | None, opset: int) -> None:
    x = rand(1, 3, 1)
    if opset < 13:
        check_op("Squeeze", [x], {"axes": axes} if axes else {}, opset=opset)
    else:
        ins = [x] if axes is None else [x, i64(*axes)]
        check_op("Squeeze", ins, opset=opset, const_inputs=[1])


def test_squeeze_non_unit_axis_fails() -> None:
    msg = import_error("Squeeze", [rand(1, 3), i64(1)], const_inputs=[1])
    assert "squeeze_0" in msg and "axis 1" in msg
    assert "compile time" in import_error("Squeeze", [rand(1, 3), i64(0)])


@pytest.mark.parametrize("axes", [[0], [-1], [1, 3], [-1, 0], [4, 0, 2]])
@pytest.mark.parametrize("opset", [11, 13, 21])
def test_unsqueeze(axes: list[int], opset: int) -> None:
    x = rand(2, 3)
    if opset < 13:
        check_op("Unsqueeze", [x], {"axes": axes}, opset=opset)
    else:
        check_op("Unsqueeze", [x, i64(*axes)], opset=opset, const_inputs=[1])


def test_unsqueeze_errors() -> None:
    assert "repeats" in import_error("Unsqueeze", [rand(2), i64(0, 0)], const_inputs=[1])
    assert "out of range" in import_error("Unsqueeze", [rand(2), i64(3)], const_inputs=[1])


# -- Concat, Split -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("axis", "opset"),
    # negative axes exist since opset 11
    [(a, o) for a in (0, 1, -1, -2) for o in (4, 11, 13) if a >= 0 or o >= 11],
)
def test_concat(axis: int, opset: int) -> None:
    shapes = [[2, 3], [2, 3], [2, 3]]
    for k, s in enumerate(shapes):
        s[axis] += k
    check_op("Concat", [rand(*s) for s in shapes], {"axis": axis}, opset=opset)


def test_concat_int_and_single_input() -> None:
    check_op("Concat", [np.arange(6, dtype=np.int64).reshape(2, 3)], {"axis": 0})
    check_op("Concat", [rand(0, 3), rand(2, 3)], {"axis": 0})


def test_concat_errors() -> None:
    assert "axis" in import_error("Concat", [rand(2), rand(2)])
    msg = import_error("Concat", [rand(2, 3), rand(3, 3)], {"axis": 1})
    assert "concat_0" in msg and "[3, 3]" in msg


@pytest.mark.parametrize(
    ("split", "axis"), [([2, 4], 1), ([1, 1, 4], -1), ([3, 0, 3], 1), (None, 1), (None, -2)]
)
@pytest.mark.parametrize("opset", [11, 13, 18])
def test_split(split: list[int] | None, axis: int, opset: int) -> None:
    x = rand(2, 6)
    n = len(split) if split else 2
    if split is None:
        attrs: dict[str, Any] = {"axis": axis, "num_outputs": n} if opset >= 18 else {"axis": axis}
        check_op("Split", [x], attrs, opset=opset, num_outputs=n)
    elif opset < 13:
        check_op("Split", [x], {"axis": axis, "split": split}, opset=opset, num_outputs=n)
    else:
        check_op(
            "Split", [x, i64(*split)], {"axis": axis}, opset=opset, num_outputs=n, const_inputs=[1]
        )


@pytest.mark.parametrize(("dim", "n"), [(5, 3), (6, 4), (7, 2), (4, 4)])
def test_split_num_outputs_uneven(dim: int, n: int) -> None:
    check_op("Split", [rand(dim, 2)], {"num_outputs": n}, opset=18, num_outputs=n)


def test_split_errors() -> None:
    assert "evenly" in import_error("Split", [rand(5)], opset=13, num_outputs=2)
    assert "negative" not in import_error(
        "Split", [rand(5)], {"num_outputs": 4}, opset=18, num_outputs=4
    )
    msg = import_error("Split", [rand(5), i64(2, 2)], opset=13, num_outputs=2, const_inputs=[1])
    assert "split_0" in msg and "add up" in msg


# -- Slice -------------------------------------------------------------------------------------

SLICES = [
    ([0], [2], [0], None),
    ([1, -3], [BIG, -1], [0, 2], None),
    ([-100], [100], [1], None),
    ([4], [-BIG], [1], [-1]),
    ([-1], [-7], [2], [-2]),
    ([5, 0], [0, 3], [0, 1], [-2, 2]),
    ([2], [2], [0], None),
    ([0, 0, 0], [1, 1, 1], [-1, -2, -3], [1, 1, 1]),
    ([3], [-100], [-1], [-3]),
    ([10], [0], [2], [-1]),
]


@pytest.mark.parametrize(("starts", "ends", "axes", "steps"), SLICES)
def test_slice(
    starts: list[int], ends: list[int], axes: list[int], steps: list[int] | None
) -> None:
    x = rand(4, 3, 6)
    # negative axes exist since opset 11
    for opset in (13,) if any(a < 0 for a in axes) else (10, 13):
        ins = [x, i64(*starts), i64(*ends), i64(*axes), None if steps is None else i64(*steps)]
        check_op("Slice", ins, opset=opset, const_inputs=[1, 2, 3, 4])


def test_slice_opset9_attributes_and_default_axes() -> None:
    x = rand(4, 5)
    check_op("Slice", [x], {"starts": [1, -2], "ends": [BIG, 5], "axes": [0, 1]}, opset=9)
    check_op("Slice", [x], {"starts": [1], "ends": [3]}, opset=9)
    check_op("Slice", [x, i64(1, 0), i64(3, -1)], const_inputs=[1, 2])
    check_op("Slice", [x, np.array([1], np.int32), np.array([3], np.int32)], const_inputs=[1, 2])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(-9, 9) | st.sampled_from([BIG, -BIG]),
            st.integers(-9, 9) | st.sampled_from([BIG, -BIG]),
            st.sampled_from([1, 2, 3, -1, -2, -4]),
        ),
        min_size=1,
        max_size=2,
    )
)
def test_slice_random(specs: list[tuple[int, int, int]]) -> None:
    x = rand(5, 7)
    # onnxruntime reads an end of INT64_MAX with a negative step as "to the front"; the spec
    # clamps it to the last index, which makes the slice empty. flowc follows the spec.
    specs = [(s, e, k) for s, e, k in specs if not (e == BIG and k < 0)] or [(0, 1, 1)]
    axes = list(range(len(specs)))
    starts, ends, steps = (i64(*col) for col in zip(*specs, strict=True))
    check_op("Slice", [x, starts, ends, i64(*axes), steps], const_inputs=[1, 2, 3, 4])


def test_slice_int64_max_end_with_negative_step_follows_the_spec() -> None:
    x = np.arange(5, dtype=np.float32)
    out = get_op("Slice").evaluate([x, i64(3), i64(BIG), i64(0), i64(-1)], Attrs())[0]
    assert out.shape == (0,)
    out = get_op("Slice").evaluate([x, i64(3), i64(-BIG - 1), i64(0), i64(-1)], Attrs())[0]
    assert out.tolist() == [3, 2, 1, 0]


def test_slice_errors() -> None:
    assert "step" in import_error(
        "Slice", [rand(4), i64(0), i64(2), i64(0), i64(0)], const_inputs=[1, 2, 3, 4]
    )
    assert "repeats" in import_error(
        "Slice", [rand(4, 4), i64(0, 0), i64(2, 2), i64(0, -2)], const_inputs=[1, 2, 3]
    )
    assert "compile time" in import_error("Slice", [rand(4), i64(0), i64(2)], const_inputs=[1])


# -- Expand, Tile, Pad -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "target"),
    [
        ((3, 1), [2, 1, 4]),
        ((1,), [3]),
        ((2, 3), [3]),
        ((2, 3), [1, 1]),
        ((2, 1, 3), [2, 4, 1]),
        ((), [2, 2]),
    ],
)
@pytest.mark.parametrize("opset", [8, 13])
def test_expand(shape: tuple[int, ...], target: list[int], opset: int) -> None:
    check_op("Expand", [rand(*shape), i64(*target)], opset=opset, const_inputs=[1])


def test_expand_error() -> None:
    msg = import_error("Expand", [rand(2, 3), i64(4, 3)], const_inputs=[1])
    assert "expand_0" in msg and "[2, 3]" in msg and "[4, 3]" in msg


@pytest.mark.parametrize(
    ("shape", "reps"), [((2, 3), [1, 2]), ((2, 3), [3, 1]), ((4,), [0]), ((1, 2, 1), [2, 2, 3])]
)
@pytest.mark.parametrize("opset", [6, 13])
def test_tile(shape: tuple[int, ...], reps: list[int], opset: int) -> None:
    check_op("Tile", [rand(*shape), i64(*reps)], opset=opset, const_inputs=[1])


def test_tile_error() -> None:
    assert "one entry per axis" in import_error("Tile", [rand(2, 3), i64(2)], const_inputs=[1])


PADS = [[1, 0, 2, 1], [0, 2, 0, 0], [-1, 1, 1, -2], [2, -1, -1, 2], [0, 0, 0, 0]]


@pytest.mark.parametrize("pads", PADS)
@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad(pads: list[int], mode: str) -> None:
    x = rand(4, 5)
    check_op("Pad", [x, i64(*pads), f32(1.5)], {"mode": mode}, const_inputs=[1, 2])


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
@pytest.mark.parametrize("opset", [2, 11, 13])
def test_pad_opsets(mode: str, opset: int) -> None:
    x = rand(3, 4)
    pads = [1, 2, 0, 1]
    if opset < 11:
        attrs: dict[str, Any] = {"mode": mode, "pads": pads}
        if mode == "constant":
            attrs["value"] = -2.0
        check_op("Pad", [x], attrs, opset=opset)
    else:
        check_op("Pad", [x, i64(*pads)], {"mode": mode}, opset=opset, const_inputs=[1])


@pytest.mark.parametrize("axes", [[1], [-1], [0, 2], [2, 0]])
def test_pad_axes_opset18(axes: list[int]) -> None:
    x = rand(2, 3, 4)
    pads = [1] * len(axes) + [2] * len(axes)  # reflect needs pads < the axis length
    check_op(
        "Pad",
        [x, i64(*pads), f32(0.5), i64(*axes)],
        {"mode": "constant"},
        opset=18,
        const_inputs=[1, 2, 3],
    )
    check_op(
        "Pad",
        [x, i64(*pads[::-1]), None, i64(*axes)],
        {"mode": "edge"},
        opset=18,
        const_inputs=[1, 3],
    )


def test_pad_int_constant() -> None:
    x = np.arange(6, dtype=np.int64).reshape(2, 3)
    check_op("Pad", [x, i64(1, 1, 1, 1), np.array(7, np.int64)], const_inputs=[1, 2])


def test_pad_errors() -> None:
    assert "2 entries" in import_error("Pad", [rand(2, 3), i64(1, 1)], const_inputs=[1])
    assert "reflect" in import_error(
        "Pad", [rand(2, 3), i64(0, 3, 0, 0)], {"mode": "reflect"}, const_inputs=[1]
    )
    assert "below zero" in import_error("Pad", [rand(2, 3), i64(-2, 0, -1, 0)], const_inputs=[1])


# -- Shape, Size, ConstantOfShape, Constant, Range -------------------------------------------


@pytest.mark.parametrize(
    ("start", "end"), [(None, None), (1, None), (-2, None), (0, -1), (-10, 10), (2, 1)]
)
def test_shape(start: int | None, end: int | None) -> None:
    attrs = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
    check_op("Shape", [rand(2, 3, 4)], attrs, opset=15)
    check_op("Shape", [rand(2, 3, 4)], attrs)


def test_shape_and_size_of_runtime_input_fold() -> None:
    check_op("Shape", [rand(2, 3)], opset=13)
    check_op("Size", [rand(2, 3, 4)], opset=13)
    check_op("Size", [rand(0, 3)])
    model, _ = make_op_model("Size", [rand(2, 5)])
    g = import_model(model)
    assert not g.nodes and g.outputs[0].const is not None and int(g.outputs[0].const) == 10


@pytest.mark.parametrize(
    "value", [None, np.array([3.5], np.float32), np.array([7], np.int64), np.array([1], np.bool_)]
)
@pytest.mark.parametrize("shape", [[2, 3], [0], [], [40]])
def test_constant_of_shape(value: np.ndarray | None, shape: list[int]) -> None:
    attrs = {} if value is None else {"value": numpy_helper.from_array(value, "v")}
    check_op(
        "ConstantOfShape",
        [np.array(shape, np.int64)],
        attrs,
        const_inputs=[0],
        opset=9 if shape else 21,
    )


def test_constant_of_shape_is_a_splat() -> None:
    value = numpy_helper.from_array(np.array([2.0], np.float32), "v")
    model, _ = make_op_model("ConstantOfShape", [i64(64, 128)], {"value": value}, const_inputs=[0])
    out = import_model(model).outputs[0]
    assert out.const is not None and is_splat(out.const) and float(out.const[5, 7]) == 2.0
    assert "compile time" in import_error("ConstantOfShape", [i64(2, 3)])


@pytest.mark.parametrize(
    "attrs",
    [
        {"value": numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "v")},
        {"value": numpy_helper.from_array(np.array(5, np.int32), "v")},
        {"value_float": 2.5},
        {"value_floats": [1.0, 2.0, 3.0]},
        {"value_int": 7},
        {"value_ints": [4, 5]},
    ],
)
def test_constant(attrs: dict[str, Any]) -> None:
    check_op("Constant", [], attrs, opset=13)


def test_constant_sparse_value() -> None:
    # onnxruntime returns a SparseTensor object here, so compare with the dense value directly.
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(f32(1, 2), "vals"),
        numpy_helper.from_array(i64(1, 4), "idx"),
        [2, 3],
    )
    model, _ = make_op_model("Constant", [], {"sparse_value": sparse}, opset=13)
    out = import_model(model).outputs[0].const
    assert out is not None and np.array_equal(out, f32(0, 1, 0, 0, 2, 0).reshape(2, 3))


def test_constant_errors() -> None:
    assert "exactly one" in import_error("Constant", [], {"value_float": 1.0, "value_int": 2})
    assert "not supported" in import_error("Constant", [], {"value_string": "hi"})


@pytest.mark.parametrize(
    ("start", "limit", "delta", "dtype"),
    [
        (0, 10, 3, np.int64),
        (10, 0, -3, np.int32),
        (5, 5, 1, np.int64),
        (0, -4, 1, np.int64),
        (0.5, 3.2, 0.7, np.float32),
        (1.0, -2.0, -0.25, np.float32),
        (0.1, 1.0, 0.1, np.float32),
        (-3.0, 3.0, 1.5, np.float64),
    ],
)
def test_range(start: float, limit: float, delta: float, dtype: Any) -> None:
    ins = [np.array(v, dtype) for v in (start, limit, delta)]
    check_op("Range", ins, const_inputs=[0, 1, 2], opset=11)


def test_range_errors() -> None:
    assert "delta is 0" in import_error(
        "Range", [i64(0)[0], i64(5)[0], i64(0)[0]], const_inputs=[0, 1, 2]
    )
    assert "compile time" in import_error(
        "Range", [np.int64(0), np.int64(5), np.int64(1)], const_inputs=[0, 1]
    )


# -- Identity, Dropout -------------------------------------------------------------------------


def _chain(op: str, attrs: dict[str, Any], opset: int, extra_out: bool = False) -> Any:
    """x -> op -> Neg -> y (and op's mask as a second output)."""
    outs = ["mid", "mask"] if extra_out else ["mid"]
    nodes = [
        helper.make_node(op, ["x"], outs, name="n0", **attrs),
        helper.make_node("Neg", ["mid"], ["y"], name="n1"),
    ]
    vis = [helper.make_tensor_value_info("y", 1, [2, 3])]
    if extra_out:
        vis.append(helper.make_tensor_value_info("mask", 9, [2, 3]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [2, 3])], vis)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize(
    ("op", "attrs", "opset"),
    [("Identity", {}, 13), ("Dropout", {}, 13), ("Dropout", {"ratio": 0.3}, 7)],
)
def test_identity_and_dropout_vanish(op: str, attrs: dict[str, Any], opset: int) -> None:
    g = import_model(_chain(op, attrs, opset))
    assert g.op_counts() == {"Neg": 1}


def test_dropout_mask_is_a_true_splat() -> None:
    g = import_model(_chain("Dropout", {}, 13, extra_out=True))
    assert g.op_counts() == {"Neg": 1}
    mask = g.outputs[1].const
    assert (
        mask is not None
        and mask.dtype == np.bool_
        and mask.shape == (2, 3)
        and mask.all()
        and is_splat(mask)
    )


@pytest.mark.parametrize("opset", [7, 10, 12, 13, 21])
def test_dropout_matches_onnxruntime(opset: int) -> None:
    x = rand(3, 4)
    attrs = {} if opset >= 12 else {"ratio": 0.5}
    # onnxruntime gives an all-zero mask before opset 12, against the spec (nothing is dropped,
    # so the mask is all ones); compare the mask with onnxruntime only where it follows the spec.
    check_op("Dropout", [x], attrs, opset=opset, num_outputs=2 if opset >= 12 else 1)
    check_op("Identity", [x], opset=opset)
    model, _ = make_op_model("Dropout", [x], attrs, opset=opset, num_outputs=2)
    mask = import_model(model).outputs[1].const
    assert mask is not None and mask.shape == x.shape and (mask == 1).all()
    assert mask.dtype == (np.bool_ if opset >= 10 else np.float32)


def test_dropout_training_mode() -> None:
    from flowc.errors import FlowcWarning

    ratio = np.array(0.5, np.float32)
    model, _ = make_op_model("Dropout", [rand(2), ratio, np.array(True)], const_inputs=[1, 2])
    # A constant true is an export mistake: identity, with a warning naming the node.
    with pytest.warns(FlowcWarning, match="training_mode=true.*'dropout_0'"):
        g = import_model(model)
    assert g.nodes == [] or [n.op for n in g.nodes] == ["Identity"]
    # Only known at run time: an error.
    assert "training_mode" in import_error(
        "Dropout", [rand(2), ratio, np.array(False)], const_inputs=[1]
    )
    check_op("Dropout", [rand(2), ratio, np.array(False)], const_inputs=[1, 2])


def test_identity_and_dropout_references() -> None:
    x = rand(2, 3)
    assert np.array_equal(get_op("Identity").evaluate([x], Attrs())[0], x)
    y, mask = get_op("Dropout").evaluate([x], Attrs())
    assert np.array_equal(y, x) and mask.dtype == np.bool_ and mask.all()


# -- Resize, Upsample --------------------------------------------------------------------------

COORDS = ["half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel", "half_pixel_symmetric"]
SCALES = [(2.0, 3.0), (0.5, 0.6), (1.7, 0.75), (1.0, 2.5)]


def _resize_reference(coord: str, shape: tuple[int, ...], hw: tuple[float, float]) -> str:
    """Whom to compare with: where scale * length is fractional, align_corners divides by
    that fractional length in ONNX's reference and its test data but by the truncated output
    length in onnxruntime; flowc follows ONNX."""
    lengths = [float(np.float32(h) * np.float32(n)) for h, n in zip(hw, shape[-2:], strict=True)]
    fractional = any(not v.is_integer() for v in lengths)
    return "onnx" if coord == "align_corners" and fractional else "onnxruntime"


@pytest.mark.parametrize("coord", COORDS)
@pytest.mark.parametrize("nearest", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
@pytest.mark.parametrize("hw", SCALES)
def test_resize_nearest_scales(coord: str, nearest: str, hw: tuple[float, float]) -> None:
    x = rand(1, 2, 4, 5)
    attrs = {"mode": "nearest", "coordinate_transformation_mode": coord, "nearest_mode": nearest}
    ref = _resize_reference(coord, x.shape, hw)
    check_op("Resize", [x, None, f32(1, 1, *hw)], attrs, opset=19, const_inputs=[2], reference=ref)


@pytest.mark.parametrize("coord", COORDS)
@pytest.mark.parametrize("sizes", [(7, 9), (2, 3), (1, 1), (4, 11)])
@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_sizes(coord: str, sizes: tuple[int, int], mode: str) -> None:
    x = rand(2, 1, 4, 5)
    check_op(
        "Resize",
        [x, None, None, i64(2, 1, *sizes)],
        {"mode": mode, "coordinate_transformation_mode": coord},
        opset=19,
        const_inputs=[3],
    )


@pytest.mark.parametrize("coord", [*COORDS, "tf_crop_and_resize"])
@pytest.mark.parametrize("hw", SCALES)
@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_resize_interpolating(coord: str, hw: tuple[float, float], mode: str) -> None:
    x = rand(1, 2, 5, 6)
    roi = f32(0, 0, 0.2, 0.1, 1, 1, 0.9, 0.7) if coord == "tf_crop_and_resize" else None
    attrs = {"mode": mode, "coordinate_transformation_mode": coord, "extrapolation_value": -1.0}
    ref = _resize_reference(coord, x.shape, hw)
    check_op(
        "Resize", [x, roi, f32(1, 1, *hw)], attrs, opset=13, const_inputs=[1, 2], reference=ref
    )


@pytest.mark.parametrize("shape", [(6,), (3, 4), (2, 3, 4), (1, 1, 2, 3, 4)])
def test_resize_linear_ranks(shape: tuple[int, ...]) -> None:
    sizes = [
        d if k < len(shape) - 3 or (len(shape) == 5 and k < 2) else 2 * d + 1
        for k, d in enumerate(shape)
    ]
    if len(shape) == 1:
        check_op(
            "Resize", [rand(*shape), None, None, i64(*sizes)], {"mode": "nearest"}, const_inputs=[3]
        )
        return
    check_op(
        "Resize", [rand(*shape), None, None, i64(*sizes)], {"mode": "linear"}, const_inputs=[3]
    )


def test_resize_tf_crop_and_resize_extrapolates() -> None:
    x = rand(1, 1, 4, 4)
    roi = f32(0, 0, -0.4, 0.3, 1, 1, 1.2, 1.5)
    for mode in ("nearest", "linear", "cubic"):
        attrs = {
            "mode": mode,
            "coordinate_transformation_mode": "tf_crop_and_resize",
            "extrapolation_value": 9.0,
        }
        check_op("Resize", [x, roi, None, i64(1, 1, 5, 3)], attrs, opset=18, const_inputs=[1, 3])


@pytest.mark.parametrize("a", [-0.5, -0.75])
@pytest.mark.parametrize("exclude", [0, 1])
def test_resize_cubic_options(a: float, exclude: int) -> None:
    attrs = {"mode": "cubic", "cubic_coeff_a": a, "exclude_outside": exclude}
    check_op(
        "Resize", [rand(1, 1, 4, 5), None, f32(1, 1, 1.6, 0.8)], attrs, opset=13, const_inputs=[2]
    )


@pytest.mark.parametrize("policy", ["stretch", "not_larger", "not_smaller"])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_opset18_axes_and_policy(policy: str, mode: str) -> None:
    x = rand(1, 2, 6, 4)
    attrs = {"mode": mode, "axes": [2, 3], "keep_aspect_ratio_policy": policy}
    check_op("Resize", [x, None, None, i64(9, 9)], attrs, opset=18, const_inputs=[3])
    check_op(
        "Resize",
        [x, None, f32(1.5, 0.5)],
        {"mode": mode, "axes": [2, 3]},
        opset=18,
        const_inputs=[2],
    )


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("opset", [11, 13])
def test_resize_opset11_empty_scales(mode: str, opset: int) -> None:
    x = rand(1, 1, 3, 4)
    empty = np.zeros(0, np.float32)
    check_op(
        "Resize",
        [x, empty, empty, i64(1, 1, 5, 2)],
        {"mode": mode},
        opset=opset,
        const_inputs=[1, 2, 3],
    )
    check_op(
        "Resize",
        [x, empty, f32(1, 1, 2, 1.5)],
        {"mode": mode, "coordinate_transformation_mode": "tf_half_pixel_for_nn"}
        if mode == "nearest"
        else {"mode": mode},
        opset=opset,
        const_inputs=[1, 2],
    )


def test_resize_integer_nearest() -> None:
    for dtype in (np.int32, np.uint8):
        x = rng.integers(0, 100, (1, 1, 3, 4)).astype(dtype)
        check_op("Resize", [x, None, f32(1, 1, 2.5, 0.5)], {"mode": "nearest"}, const_inputs=[2])
    msg = import_error("Resize", [x, None, f32(1, 1, 2, 2)], {"mode": "linear"}, const_inputs=[2])
    assert "floating-point" in msg


@pytest.mark.parametrize("scales", [(1, 1, 2, 3), (1, 1, 0.6, 0.5), (1, 1, 1.5, 0.6), (1, 1, 3, 1)])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_opset10(scales: tuple[float, ...], mode: str) -> None:
    check_op(
        "Resize", [rand(1, 2, 4, 10), f32(*scales)], {"mode": mode}, opset=10, const_inputs=[1]
    )


@pytest.mark.parametrize(
    ("scales", "mode"),
    # onnxruntime's linear Upsample only takes outer (batch, channel) scales of 1
    [
        (s, m)
        for s in [(1, 1, 2, 3), (1, 1, 2, 2), (1, 2, 1.5, 2.5)]
        for m in ("nearest", "linear")
        if m == "nearest" or s[1] == 1
    ],
)
def test_upsample(scales: tuple[float, ...], mode: str) -> None:
    x = rand(1, 2, 3, 4)
    check_op("Upsample", [x], {"mode": mode, "scales": [float(s) for s in scales]}, opset=7)
    check_op("Upsample", [x, f32(*scales)], {"mode": mode}, opset=9, const_inputs=[1])


def test_upsample_is_resize_and_references_agree() -> None:
    model, _ = make_op_model(
        "Upsample", [rand(1, 1, 2, 2), f32(1, 1, 2, 3)], opset=9, const_inputs=[1]
    )
    assert import_model(model).op_counts() == {"Resize": 1}
    x = rand(1, 1, 2, 2)
    up = get_op("Upsample").evaluate([x, f32(1, 1, 2, 3)], Attrs({"mode": "nearest"}))[0]
    assert np.array_equal(up, np.repeat(np.repeat(x, 2, axis=2), 3, axis=3))


def test_resize_mixed_opset10_splits_in_two() -> None:
    model, _ = make_op_model(
        "Resize", [rand(1, 1, 4, 10), f32(1, 1, 1.5, 0.6)], opset=10, const_inputs=[1]
    )
    assert import_model(model).op_counts() == {"Resize": 2}


def test_resize_errors() -> None:
    x = rand(1, 1, 4, 4)
    msg = import_error(
        "Resize",
        [x, None, f32(1, 1, 0.5, 0.5)],
        {"mode": "nearest", "antialias": 1},
        const_inputs=[2],
    )
    assert "resize_0" in msg and "antialias" in msg and "linear or cubic" in msg
    assert "exactly one" in import_error(
        "Resize", [x, None, f32(1, 1, 2, 2), i64(1, 1, 8, 8)], const_inputs=[2, 3]
    )
    assert "4 entries" in import_error("Resize", [x, None, f32(2, 2)], const_inputs=[2])
    assert "compile time" in import_error("Resize", [x, None, f32(1, 1, 2, 2)])


# -- DepthToSpace, SpaceToDepth ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
@pytest.mark.parametrize("block", [1, 2, 3])
def test_depth_to_space(mode: str, block: int) -> None:
    x = rand(2, 2 * block * block, 3, 2)
    check_op("DepthToSpace", [x], {"blocksize": block, "mode": mode}, opset=13)
    if mode == "DCR":
        check_op("DepthToSpace", [x], {"blocksize": block}, opset=11)


@pytest.mark.parametrize("block", [1, 2, 3])
def test_space_to_depth(block: int) -> None:
    check_op("SpaceToDepth", [rand(2, 3, 2 * block, 3 * block)], {"blocksize": block}, opset=13)


def test_depth_space_errors() -> None:
    assert "multiple" in import_error("DepthToSpace", [rand(1, 6, 2, 2)], {"blocksize": 2})
    assert "multiples" in import_error("SpaceToDepth", [rand(1, 1, 3, 4)], {"blocksize": 2})


@pytest.mark.parametrize(
    ("op", "inputs", "kw"),
    [
        ("Expand", [rand(2, 1), i64(2, 3)], {}),
        ("Tile", [rand(2, 1), i64(1, 2)], {}),
        ("Pad", [rand(2, 3), i64(1, 1, 1, 1)], {}),
        ("Unsqueeze", [rand(2), i64(0)], {}),
        ("Split", [rand(4), i64(2, 2)], {"num_outputs": 2}),
    ],
)
def test_runtime_shape_inputs_are_rejected(
    op: str, inputs: list[np.ndarray], kw: dict[str, Any]
) -> None:
    # Every input here is a graph input: values that decide a shape are unknown at compile time.
    msg = import_error(op, inputs, **kw)
    assert f"{op.lower()}_0" in msg and "compile time" in msg


@pytest.mark.parametrize("mode", ["linear", "cubic"])
@pytest.mark.parametrize(
    ("scales", "sizes"), [((1, 1, 0.6, 0.8), None), (None, (1, 2, 3, 5)), ((1, 1, 0.5, 1.5), None)]
)
@pytest.mark.parametrize("exclude_outside", [0, 1])
def test_resize_antialias(
    mode: str,
    scales: tuple[float, ...] | None,
    sizes: tuple[int, ...] | None,
    exclude_outside: int,
) -> None:
    # Antialiased linear/cubic resizes import as one constant matrix product per axis.
    x = rand(1, 2, 7, 9)
    attrs = {"mode": mode, "antialias": 1, "exclude_outside": exclude_outside}
    inputs = [
        x,
        None,
        None if scales is None else f32(*scales),
        None if sizes is None else i64(*sizes),
    ]
    got = check_op("Resize", inputs, attrs, opset=18, const_inputs=[2, 3], tol=1e-5)
    want_hw = {(0.6, 0.8): (4, 7), (0.5, 1.5): (3, 13)}.get(scales[2:] if scales else (), (3, 5))
    assert next(iter(got.values())).shape[2:] == want_hw
