"""Conv and ConvTranspose against onnxruntime: 1-D to 3-D, groups (depthwise included),
strides, dilations, explicit and automatic pads, output_padding/output_shape, and errors."""

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
from flowc.ops.conv import window
from flowc.ops.registry import get_op

rng = np.random.default_rng(11)


def rand(*shape: int, dtype: type = np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


CONV_CASES: list[tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]] = [
    ((2, 4, 9, 8), (6, 4, 3, 3), {}),
    ((2, 4, 9, 8), (6, 4, 3, 3), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
    (
        (2, 4, 9, 8),
        (6, 2, 3, 2),
        {"group": 2, "strides": [2, 1], "dilations": [1, 2], "pads": [1, 0, 2, 1]},
    ),
    ((1, 4, 8, 8), (4, 1, 3, 3), {"group": 4, "pads": [1, 1, 1, 1]}),
    ((1, 4, 8, 8), (8, 1, 3, 3), {"group": 4, "strides": [2, 2]}),
    ((1, 3, 10, 7), (4, 3, 3, 4), {"auto_pad": "SAME_UPPER", "strides": [2, 3]}),
    ((1, 3, 10, 7), (4, 3, 3, 4), {"auto_pad": "SAME_LOWER", "strides": [2, 3]}),
    ((1, 3, 10, 7), (4, 3, 3, 4), {"auto_pad": "VALID", "strides": [2, 3], "dilations": [2, 1]}),
    ((1, 3, 10, 7), (4, 3, 1, 1), {"auto_pad": "NOTSET", "strides": [3, 2]}),
    ((2, 3, 11), (5, 3, 4), {"strides": [3], "dilations": [2], "pads": [2, 1]}),
    ((2, 3, 11), (5, 3, 4), {"auto_pad": "SAME_UPPER"}),
    ((1, 6, 5, 6, 7), (6, 1, 2, 3, 2), {"group": 6, "pads": [1, 1, 0, 0, 1, 1]}),
    ((1, 4, 5, 6, 7), (2, 4, 3, 3, 3), {"strides": [1, 2, 2], "dilations": [2, 1, 1]}),
]


@pytest.mark.parametrize(("x", "w", "attrs"), CONV_CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_conv(x: tuple[int, ...], w: tuple[int, ...], attrs: dict[str, Any], bias: bool) -> None:
    ins = [rand(*x), rand(*w)] + ([rand(w[0])] if bias else [])
    check_op("Conv", ins, attrs)


@pytest.mark.parametrize("opset", [1, 11])
def test_conv_old_opsets(opset: int) -> None:
    check_op(
        "Conv", [rand(1, 2, 6, 6), rand(3, 2, 3, 3), rand(3)], {"pads": [1, 1, 1, 1]}, opset=opset
    )


def test_conv_weights_as_initializers_and_other_floats() -> None:
    check_op(
        "Conv",
        [rand(1, 3, 7, 7), rand(4, 3, 3, 3), rand(4)],
        {"strides": [2, 2]},
        const_inputs=(1, 2),
    )
    # onnxruntime has no float64 Conv: the float64 path must agree with float32 onnxruntime.
    x, w = rand(1, 2, 6, 5, dtype=np.float64), rand(3, 2, 2, 2, dtype=np.float64)
    ref = check_op("Conv", [x.astype(np.float32), w.astype(np.float32)], {})["out0"]
    got = get_op("Conv").evaluate([x, w], Attrs())[0]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    f16 = np.float16
    check_op("Conv", [rand(1, 2, 6, 5, dtype=f16), rand(3, 2, 2, 2, dtype=f16)], {}, tol=2e-3)


@pytest.mark.parametrize(
    ("mode", "pads"), [("SAME_UPPER", [1, 0, 2, 0]), ("SAME_LOWER", [2, 0, 1, 0])]
)
def test_conv_same_with_dilation_follows_the_spec(mode: str, pads: list[int]) -> None:
    # onnxruntime refuses auto_pad SAME with dilations. The ONNX rule: ceil(in / stride)
    # outputs; here axis 0 (in 10, stride 2, span 5) needs 3 pads, the odd one last for
    # SAME_UPPER, and axis 1 (in 9, stride 3, span 3) needs none.
    x, w = rand(1, 2, 10, 9), rand(3, 2, 3, 2)
    attrs = {"strides": [2, 3], "dilations": [2, 2]}
    model, feeds = make_op_model("Conv", [x, w], {**attrs, "auto_pad": mode})
    got = evaluate(import_model(model), feeds)["out0"]
    ref = check_op("Conv", [x, w], {**attrs, "pads": pads})["out0"]
    assert got.shape == (1, 3, 5, 3)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


TRANSPOSE_CASES: list[tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]] = [
    ((2, 4, 5, 6), (4, 3, 3, 3), {}),
    (
        (2, 4, 5, 6),
        (4, 3, 3, 2),
        {
            "group": 2,
            "strides": [2, 3],
            "dilations": [2, 1],
            "pads": [1, 0, 0, 2],
            "output_padding": [1, 2],
        },
    ),
    ((1, 2, 5), (2, 3, 3), {"strides": [3], "output_padding": [1]}),
    ((1, 2, 3, 4, 5), (2, 3, 2, 3, 2), {"strides": [1, 2, 1], "pads": [0, 1, 0, 1, 0, 1]}),
    ((1, 4, 4, 4), (4, 1, 3, 3), {"group": 4, "strides": [2, 2], "pads": [1, 1, 1, 1]}),
]


@pytest.mark.parametrize(("x", "w", "attrs"), TRANSPOSE_CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_conv_transpose(
    x: tuple[int, ...], w: tuple[int, ...], attrs: dict[str, Any], bias: bool
) -> None:
    group = attrs.get("group", 1)
    ins = [rand(*x), rand(*w)] + ([rand(w[1] * group)] if bias else [])
    check_op("ConvTranspose", ins, attrs)


@pytest.mark.parametrize("auto_pad", ["NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"])
@pytest.mark.parametrize("output_shape", [None, [10, 12], [8, 9], [12, 13]])
def test_conv_transpose_auto_pad_and_output_shape(
    auto_pad: str, output_shape: list[int] | None
) -> None:
    attrs: dict[str, Any] = {"auto_pad": auto_pad, "strides": [2, 2]}
    if output_shape is not None:
        attrs["output_shape"] = output_shape
    got = check_op("ConvTranspose", [rand(1, 2, 5, 6), rand(2, 3, 3, 3), rand(3)], attrs)
    if output_shape is not None:
        assert got["out0"].shape[2:] == tuple(output_shape)


@pytest.mark.parametrize("opset", [1, 11])
def test_conv_transpose_old_opsets(opset: int) -> None:
    check_op(
        "ConvTranspose", [rand(1, 2, 4, 4), rand(2, 3, 3, 3)], {"strides": [2, 2]}, opset=opset
    )


def test_reference_accepts_read_only_splat_inputs() -> None:
    x = make_splat(0.5, (1, 2, 5, 5), np.dtype(np.float32))
    w = make_splat(1.0, (3, 2, 3, 3), np.dtype(np.float32))
    y = get_op("Conv").evaluate([x, w], Attrs({"pads": (1, 1, 1, 1)}))[0]
    assert y.shape == (1, 3, 5, 5)
    assert y[0, 0, 2, 2] == pytest.approx(0.5 * 18) and y[0, 0, 0, 0] == pytest.approx(0.5 * 8)
    yt = get_op("ConvTranspose").evaluate(
        [x, make_splat(1.0, (2, 3, 2, 2), np.dtype(np.float32))], Attrs()
    )[0]
    assert yt.shape == (1, 3, 6, 6) and yt[0, 0, 0, 0] == pytest.approx(1.0)


def test_window_geometry() -> None:
    w = window((224, 224), (7, 7), {"strides": (2, 2), "pads": (3, 3, 3, 3)})
    assert w.out == (112, 112) and w.spans == (7, 7)
    w = window((9,), (3,), {"auto_pad": "SAME_LOWER", "strides": (2,)})
    assert (w.out, w.pad_begin, w.pad_end) == ((5,), (1,), (1,))
    w = window((10,), (3,), {"auto_pad": "SAME_LOWER", "strides": (1,)})
    assert (w.out, w.pad_begin, w.pad_end) == ((10,), (1,), (1,))
    w = window((8,), (2,), {"auto_pad": "SAME_UPPER", "strides": (3,)})
    assert (w.out, w.pad_begin, w.pad_end) == ((3,), (0,), (0,))


def test_flops() -> None:
    f32 = DType.F32
    conv, convt = get_op("Conv"), get_op("ConvTranspose")
    assert conv.flops is not None and convt.flops is not None
    ins: list[TensorType | None] = [TensorType((1, 4, 8, 8), f32), TensorType((6, 2, 3, 3), f32)]
    assert conv.flops(ins, [TensorType((1, 6, 8, 8), f32)], Attrs({"group": 2})) == 2 * 384 * 18
    tins: list[TensorType | None] = [TensorType((1, 4, 5, 5), f32), TensorType((4, 3, 2, 2), f32)]
    assert convt.flops(tins, [TensorType((1, 3, 6, 6), f32)], Attrs()) == 2 * 100 * 12


@pytest.mark.parametrize(
    ("op", "x", "w", "attrs", "message"),
    [
        ("Conv", (1, 4, 8, 8), (6, 3, 3, 3), {}, "input channels"),
        ("Conv", (1, 4, 8, 8), (6, 2, 3, 3), {"group": 3}, "group 3 must divide"),
        ("Conv", (1, 4, 8, 8), (6, 4, 3, 3), {"kernel_shape": [2, 2]}, "does not match the weight"),
        ("Conv", (1, 4, 4, 4), (6, 4, 5, 5), {}, "more than the padded input"),
        ("Conv", (1, 4, 8, 8), (6, 4, 3, 3), {"pads": [1, 1]}, "pads has 2 entries"),
        ("Conv", (1, 4, 8, 8), (6, 4, 3, 3), {"strides": [0, 1]}, "strides must be positive"),
        ("Conv", (1, 4, 8, 8), (6, 4, 3), {}, "weight has rank 3"),
        ("ConvTranspose", (1, 4, 8, 8), (3, 2, 3, 3), {}, "expects 3 input channels"),
        ("ConvTranspose", (1, 4, 4, 4), (4, 2, 3, 3), {"output_padding": [2, 0]}, "output_padding"),
    ],
)
def test_errors(
    op: str, x: tuple[int, ...], w: tuple[int, ...], attrs: dict[str, Any], message: str
) -> None:
    model, _ = make_op_model(op, [rand(*x), rand(*w)], attrs)
    with pytest.raises(ShapeError, match=message) as e:
        import_model(model)
    assert f"{op.lower()}_0" in str(e.value)


def test_bad_auto_pad_is_reported() -> None:
    model, _ = make_op_model("Conv", [rand(1, 2, 5, 5), rand(3, 2, 3, 3)], {"auto_pad": "SAME"})
    with pytest.raises(ShapeError, match="auto_pad 'SAME' is not one of"):
        import_model(model)
