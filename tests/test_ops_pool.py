"""Pools against onnxruntime: MaxPool (with Indices in both storage orders), AveragePool
(count_include_pad), LpPool, the global pools; auto_pad, ceil_mode, dilations, the opset
spellings and the shape errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from opcheck import check_op, make_op_model

from flowc.errors import ShapeError
from flowc.frontend.onnx import import_model
from flowc.interpreter import evaluate
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, make_splat
from flowc.ir.types import TensorType
from flowc.ops.registry import get_op

rng = np.random.default_rng(3)


def rand(*shape: int, dtype: type = np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


WINDOWS: list[dict[str, Any]] = [
    {"kernel_shape": [3, 2]},
    {"kernel_shape": [3, 2], "pads": [1, 0, 2, 1]},
    {"kernel_shape": [3, 2], "strides": [2, 3]},
    {"kernel_shape": [2, 3], "strides": [3, 2], "pads": [0, 1, 1, 1]},
    {"kernel_shape": [3, 2], "strides": [2, 2], "dilations": [2, 1]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
    {"kernel_shape": [3, 2], "strides": [2, 3], "auto_pad": "SAME_LOWER"},
    {"kernel_shape": [3, 2], "strides": [2, 2], "auto_pad": "VALID", "dilations": [1, 2]},
]


@pytest.mark.parametrize("ceil_mode", [0, 1])
@pytest.mark.parametrize("attrs", WINDOWS)
def test_maxpool(attrs: dict[str, Any], ceil_mode: int) -> None:
    x = rand(2, 3, 9, 8)
    for order in (0, 1):
        got = check_op(
            "MaxPool", [x], {**attrs, "ceil_mode": ceil_mode, "storage_order": order}, num_outputs=2
        )
        # The indices point at the maxima in the flattened input.
        if order == 0:
            np.testing.assert_array_equal(x.reshape(-1)[got["out1"]], got["out0"])


@pytest.mark.parametrize("ceil_mode", [0, 1])
@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("attrs", WINDOWS)
def test_averagepool(attrs: dict[str, Any], count_include_pad: int, ceil_mode: int) -> None:
    attrs = {**attrs, "ceil_mode": ceil_mode, "count_include_pad": count_include_pad}
    check_op("AveragePool", [rand(2, 3, 9, 8)], attrs)


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("attrs", WINDOWS[:5])
def test_lppool(attrs: dict[str, Any], p: int) -> None:
    check_op("LpPool", [rand(2, 3, 9, 8)], {**attrs, "p": p})
    check_op("LpPool", [rand(1, 2, 7, 6)], {**attrs, "p": p, "ceil_mode": 1})


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool", "LpPool"])
def test_1d_and_3d(op: str) -> None:
    extra = {"num_outputs": 2} if op == "MaxPool" else {}
    check_op(op, [rand(2, 3, 11)], {"kernel_shape": [3], "strides": [2], "pads": [1, 0]}, **extra)
    attrs = {"kernel_shape": [2, 3, 2], "strides": [2, 1, 2], "pads": [1, 0, 1, 0, 1, 1]}
    check_op(op, [rand(1, 2, 7, 6, 5)], attrs, **extra)
    check_op(op, [rand(1, 2, 7, 6, 5)], {**attrs, "storage_order": 1} if extra else attrs, **extra)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_maxpool_integers(dtype: type) -> None:
    lo = 0 if dtype == np.uint8 else -100
    x = rng.integers(lo, 100, (1, 2, 7, 7)).astype(dtype)
    check_op("MaxPool", [x], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]})


def test_float16_and_float64() -> None:
    attrs = {"kernel_shape": [2, 2], "pads": [1, 1, 0, 0]}
    check_op("MaxPool", [rand(1, 2, 5, 5, dtype=np.float16)], attrs, tol=1e-3)
    check_op("MaxPool", [rand(1, 2, 5, 5, dtype=np.float64)], attrs)
    # onnxruntime has no float16/float64 AveragePool: agree with the float32 path instead.
    x = rand(1, 2, 5, 5)
    a = Attrs({"kernel_shape": (2, 2), "pads": (1, 1, 0, 0)})
    op = get_op("AveragePool")
    single = check_op("AveragePool", [x], attrs)["out0"]
    for dtype, tol in ((np.float16, 1e-3), (np.float64, 1e-6)):
        got = op.evaluate([x.astype(dtype)], a)[0]
        assert got.dtype == dtype
        np.testing.assert_allclose(got, single, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("op", "opset", "attrs", "outputs"),
    [
        ("MaxPool", 7, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, 1),
        ("MaxPool", 8, {"kernel_shape": [3, 3], "strides": [2, 2], "storage_order": 1}, 2),
        ("MaxPool", 10, {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, 2),
        ("MaxPool", 11, {"kernel_shape": [2, 2], "dilations": [2, 2]}, 1),
        (
            "AveragePool",
            7,
            {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1},
            1,
        ),
        ("AveragePool", 10, {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, 1),
        ("AveragePool", 11, {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER"}, 1),
        ("AveragePool", 19, {"kernel_shape": [2, 2], "dilations": [2, 1]}, 1),
        ("LpPool", 2, {"kernel_shape": [2, 2], "p": 3}, 1),
        ("LpPool", 11, {"kernel_shape": [3, 2], "strides": [2, 1]}, 1),
        ("LpPool", 18, {"kernel_shape": [3, 2], "dilations": [1, 2], "ceil_mode": 1}, 1),
    ],
)
def test_opsets(op: str, opset: int, attrs: dict[str, Any], outputs: int) -> None:
    check_op(op, [rand(2, 3, 9, 8)], attrs, opset=opset, num_outputs=outputs)


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize(
    ("mode", "pads"), [("SAME_UPPER", [1, 0, 2, 0]), ("SAME_LOWER", [2, 0, 1, 0])]
)
def test_same_with_dilation_follows_the_spec(op: str, mode: str, pads: list[int]) -> None:
    # onnxruntime sizes SAME pads with the undilated kernel; ONNX says ceil(in / stride)
    # outputs with pads for the dilated span: axis 0 (in 10, stride 2, span 5) needs 3,
    # axis 1 (in 9, stride 3, span 3) none. flowc follows ONNX, i.e. these explicit pads.
    x = rand(1, 2, 10, 9)
    attrs = {"kernel_shape": [3, 2], "strides": [2, 3], "dilations": [2, 2]}
    model, feeds = make_op_model(op, [x], {**attrs, "auto_pad": mode})
    got = evaluate(import_model(model), feeds)["out0"]
    ref = check_op(op, [x], {**attrs, "pads": pads})["out0"]
    assert got.shape == (1, 2, 5, 3)
    np.testing.assert_allclose(got, ref, rtol=1e-6)


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"])
@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 3, 5, 4), (1, 2, 3, 4, 3)])
def test_global(op: str, shape: tuple[int, ...]) -> None:
    got = check_op(op, [rand(*shape)])
    assert got["out0"].shape == (*shape[:2], *([1] * (len(shape) - 2)))
    if op == "GlobalLpPool":
        check_op(op, [rand(*shape)], {"p": 3})
        check_op(op, [rand(*shape)], {"p": 1}, opset=2)


def test_reference_accepts_read_only_splat_inputs() -> None:
    x = make_splat(2.0, (1, 1, 4, 4), np.dtype(np.float32))
    a = Attrs({"kernel_shape": (3, 3), "pads": (1, 1, 1, 1)})
    avg = get_op("AveragePool").evaluate([x], a)[0]
    mx, idx = get_op("MaxPool").evaluate([x], a)
    np.testing.assert_allclose(avg, np.full((1, 1, 4, 4), 2.0))
    np.testing.assert_allclose(mx, np.full((1, 1, 4, 4), 2.0))
    assert idx.dtype == np.int64 and idx.min() >= 0 and idx.max() < 16


def test_flops() -> None:
    f32 = DType.F32
    mp, gap = get_op("MaxPool"), get_op("GlobalAveragePool")
    assert mp.flops is not None and gap.flops is not None
    ins: list[TensorType | None] = [TensorType((1, 2, 8, 8), f32)]
    assert mp.flops(ins, [TensorType((1, 2, 4, 4), f32)], Attrs({"kernel_shape": (2, 2)})) == 128
    assert gap.flops(ins, [TensorType((1, 2, 1, 1), f32)], Attrs()) == 128


@pytest.mark.parametrize(
    ("op", "attrs", "outputs", "message"),
    [
        ("MaxPool", {}, 1, "required attribute 'kernel_shape' is not set"),
        ("MaxPool", {"kernel_shape": [12, 2]}, 1, "more than the padded input"),
        (
            "MaxPool",
            {"kernel_shape": [2, 2], "storage_order": 2},
            2,
            "storage_order must be 0 or 1",
        ),
        ("AveragePool", {"kernel_shape": [2, 2], "pads": [1, 1]}, 1, "pads has 2 entries"),
        ("AveragePool", {"kernel_shape": [2, 2, 2]}, 1, "kernel_shape has 3 entries"),
        ("LpPool", {"kernel_shape": [2, 2], "dilations": [0, 1]}, 1, "dilations must be positive"),
        ("AveragePool", {"kernel_shape": [2, 2], "ceil_mode": 2}, 1, "ceil_mode must be 0 or 1"),
    ],
)
def test_errors(op: str, attrs: dict[str, Any], outputs: int, message: str) -> None:
    model, _ = make_op_model(op, [rand(1, 2, 9, 8)], attrs, num_outputs=outputs)
    with pytest.raises(ShapeError, match=message) as e:
        import_model(model)
    assert f"{op.lower()}_0" in str(e.value)


def test_integer_average_is_rejected() -> None:
    model, _ = make_op_model(
        "AveragePool", [np.ones((1, 1, 4, 4), np.int32)], {"kernel_shape": [2, 2]}
    )
    with pytest.raises(ShapeError, match="does not support element type i32"):
        import_model(model)
