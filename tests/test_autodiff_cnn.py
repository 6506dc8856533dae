"""Training II's VJP rules for the CNN ops (Conv, ConvTranspose, MaxPool, AveragePool,
GlobalAveragePool, LRN, the channel norms, Pad in every mode, Resize and Upsample), each against float64 central
finite differences of the op's own NumPy reference over its attribute space
(tests/test_autodiff.py's check_vjp), and a small CNN's backward compiled for the host
against the float64 evaluation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_autodiff import check_vjp, host_matches_float64

R = np.random.default_rng(7)


def r(*shape: int) -> np.ndarray:
    return R.standard_normal(shape)


CONV_CASES: list[tuple[tuple[int, ...], tuple[int, ...], dict[str, Any], bool]] = [
    ((2, 3, 5, 5), (4, 3, 3, 3), {}, True),
    ((1, 2, 7, 6), (3, 2, 3, 2), {"strides": [2, 2], "pads": [1, 0, 1, 1]}, True),
    ((1, 2, 8, 8), (2, 2, 3, 3), {"dilations": [2, 2], "pads": [2, 2, 2, 2]}, False),
    ((2, 4, 6, 5), (6, 2, 3, 3), {"group": 2, "strides": [2, 1], "pads": [1, 1, 1, 1]}, True),
    ((1, 3, 5, 5), (3, 1, 3, 3), {"group": 3, "auto_pad": "SAME_UPPER"}, False),  # depthwise
    ((2, 2, 9), (3, 2, 4), {"strides": [3], "pads": [1, 2]}, True),  # 1-D, a dropped remainder
]


@pytest.mark.parametrize(("xs", "ws", "attrs", "bias"), CONV_CASES)
def test_conv_vjp(
    xs: tuple[int, ...], ws: tuple[int, ...], attrs: dict[str, Any], bias: bool
) -> None:
    inputs = [r(*xs), r(*ws) * 0.5] + ([r(ws[0])] if bias else [])
    check_vjp("Conv", inputs, attrs)


@pytest.mark.parametrize(
    "attrs",
    [
        {"kernel_shape": [2, 2], "strides": [2, 2]},
        {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]},  # count_include_pad 0: edge divisors
        {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1},
        {"kernel_shape": [3, 2], "strides": [2, 2], "ceil_mode": 1},  # a window past the end
    ],
)
def test_average_pool_vjp(attrs: dict[str, Any]) -> None:
    check_vjp("AveragePool", [r(2, 3, 7, 6)], attrs)


def test_global_average_pool_vjp() -> None:
    check_vjp("GlobalAveragePool", [r(2, 3, 4, 5)])


def test_a_cnn_backward_compiled_for_the_host_matches_float64(tmp_path: Path) -> None:
    from flowc.autodiff import gradients
    from flowc.ir.builder import GraphBuilder
    from flowc.ir.dtype import DType
    from flowc.ir.graph import Graph
    from flowc.ir.types import TensorType

    def network(dt: DType) -> Graph:
        g = Graph("cnn")
        b = GraphBuilder(g, fold=False)
        x = g.add_input("x", TensorType((2, 3, 8, 8), dt))
        w1 = g.add_input("w1", TensorType((4, 3, 3, 3), dt))
        b1 = g.add_input("b1", TensorType((4,), dt))
        w2 = g.add_input("w2", TensorType((4, 2, 3, 3), dt))
        w3 = g.add_input("w3", TensorType((4, 3, 2, 2), dt))
        h = b.emit("Conv", [x, w1, b1], {"pads": [1, 1, 1, 1]})[0]
        # Overlapping windows: an element may be the maximum of several.
        h = b.emit("MaxPool", [h], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]})[0]
        h = b.emit("Relu", [h])[0]
        h = b.emit("LRN", [h], {"size": 3, "alpha": 0.5, "beta": 0.75, "bias": 1.5})[0]
        h = b.emit("AveragePool", [h], {"kernel_shape": [2, 2], "strides": [2, 2]})[0]
        h = b.emit("Conv", [h, w2], {"group": 2, "strides": [2, 2], "pads": [1, 1, 1, 1]})[0]
        h = b.emit("ConvTranspose", [h, w3], {"strides": [2, 2]})[0]
        h = b.emit("GlobalAveragePool", [h])[0]
        loss = b.emit("ReduceSum", [b.emit("Mul", [h, h])[0]], {"keepdims": 0})[0]
        params = [x, w1, b1, w2, w3]
        grads = gradients(g, loss, params)
        g.outputs = [loss, *(grads[p] for p in params)]  # type: ignore[misc]
        return g

    g32, g64 = network(DType.F32), network(DType.F64)
    rng = np.random.default_rng(2)
    feeds = {v.name: rng.standard_normal(v.type.shape) * 0.5 for v in g64.inputs}
    host_matches_float64(g32, g64, feeds, tmp_path / "out")


@pytest.mark.parametrize(
    "attrs",
    [
        {"kernel_shape": [2, 2], "strides": [2, 2]},
        {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]},  # overlapping windows
        {"kernel_shape": [3, 2], "strides": [2, 1], "dilations": [2, 1], "ceil_mode": 1},
    ],
)
def test_max_pool_vjp(attrs: dict[str, Any]) -> None:
    # Random values: no ties, so the maximum is differentiable where it is measured.
    check_vjp("MaxPool", [r(2, 3, 7, 6)], attrs)


CONV_TRANSPOSE_CASES: list[tuple[tuple[int, ...], tuple[int, ...], dict[str, Any], bool]] = [
    ((2, 3, 4, 4), (3, 2, 3, 3), {}, True),
    ((1, 2, 3, 4), (2, 3, 3, 2), {"strides": [2, 2], "pads": [1, 0, 1, 1]}, True),
    ((1, 2, 3, 3), (2, 2, 3, 3), {"strides": [2, 2], "output_padding": [1, 1]}, False),
    ((1, 4, 3, 3), (4, 1, 3, 3), {"group": 2, "dilations": [2, 1], "pads": [1, 1, 1, 1]}, True),
    ((2, 2, 5), (2, 3, 4), {"strides": [3], "pads": [1, 2]}, False),  # 1-D
]


@pytest.mark.parametrize(("xs", "ws", "attrs", "bias"), CONV_TRANSPOSE_CASES)
def test_conv_transpose_vjp(
    xs: tuple[int, ...], ws: tuple[int, ...], attrs: dict[str, Any], bias: bool
) -> None:
    out_channels = ws[1] * int(attrs.get("group", 1))
    inputs = [r(*xs), r(*ws) * 0.5] + ([r(out_channels)] if bias else [])
    check_vjp("ConvTranspose", inputs, attrs)


def test_instance_and_group_norm_vjps() -> None:
    x = r(2, 6, 3, 4)
    check_vjp("InstanceNormalization", [x, r(6), r(6)], {"epsilon": 1e-5})
    check_vjp("GroupNormalization", [x, r(6), r(6)], {"num_groups": 3, "epsilon": 1e-5})
    check_vjp("GroupNormalization", [r(2, 4, 5), r(4), r(4)], {"num_groups": 1})  # 1-D, one group


@pytest.mark.parametrize(
    ("pads", "axes"),
    [
        ([0, 0, 1, 2, 0, 0, 2, 1], None),  # a border on the spatial axes
        ([1, -1, 0, 2], [1, 3]),  # pad one axis and crop another, by axes
    ],
)
def test_constant_pad_vjp(pads: list[int], axes: list[int] | None) -> None:
    inputs = [r(2, 3, 4, 5), np.asarray(pads, np.int64)]
    consts = {1: inputs[1]}
    if axes is not None:
        inputs += [np.zeros((), np.float64), np.asarray(axes, np.int64)]
        consts.update({2: inputs[2], 3: inputs[3]})
    check_vjp("Pad", inputs, {"mode": "constant"}, consts=consts)


@pytest.mark.parametrize("mode", ["reflect", "edge", "wrap"])
@pytest.mark.parametrize(
    ("pads", "axes"),
    [
        ([0, 0, 2, 1, 0, 0, 1, 2], None),  # borders copied on both spatial axes
        ([1, -1, 2, 1], [3, 2]),  # axis 2 cropped before and padded after; axes backwards
    ],
)
def test_copying_pad_vjps(mode: str, pads: list[int], axes: list[int] | None) -> None:
    # Border elements are copies: their gradients add onto the elements they copy.
    inputs = [r(2, 3, 4, 5), np.asarray(pads, np.int64)]
    consts = {1: inputs[1]}
    if axes is not None:
        inputs += [np.zeros((), np.float64), np.asarray(axes, np.int64)]
        consts.update({2: inputs[2], 3: inputs[3]})
    check_vjp("Pad", inputs, {"mode": mode}, consts=consts)


RESIZE_CASES: list[tuple[dict[str, Any], list[float] | None, list[int] | None]] = [
    ({"mode": "nearest"}, [1, 1, 2, 2], None),  # upsampling: each input feeds four outputs
    ({"mode": "nearest", "nearest_mode": "floor"}, [1, 1, 0.6, 1.7], None),  # both ways
    ({"mode": "linear"}, [1, 1, 2, 1.5], None),  # half_pixel: edges clamp
    ({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, None, [2, 3, 7, 3]),
    ({"mode": "cubic"}, [1, 1, 1.6, 0.8], None),
    ({"mode": "cubic", "exclude_outside": 1, "cubic_coeff_a": -0.5}, [1, 1, 2, 2], None),
    (
        {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"},
        None,
        [2, 3, 1, 9],
    ),
]


@pytest.mark.parametrize(("attrs", "scales", "sizes"), RESIZE_CASES)
def test_resize_vjp(
    attrs: dict[str, Any], scales: list[float] | None, sizes: list[int] | None
) -> None:
    x = r(2, 3, 4, 5)
    empty = np.zeros(0, np.float32)
    sc = empty if scales is None else np.asarray(scales, np.float32)
    inputs = [x, empty, sc] + ([] if sizes is None else [np.asarray(sizes, np.int64)])
    consts = {i: a for i, a in enumerate(inputs) if i}
    check_vjp("Resize", inputs, attrs, consts=consts)


def test_crop_and_resize_vjp_gives_the_extrapolated_samples_no_gradient() -> None:
    x = r(1, 2, 5, 6)
    roi = np.asarray([0, 0, -0.2, 0.1, 1, 1, 0.9, 1.3], np.float32)  # outside on both axes
    sizes = np.asarray([1, 2, 4, 7], np.int64)
    attrs = {
        "mode": "linear",
        "coordinate_transformation_mode": "tf_crop_and_resize",
        "extrapolation_value": 3.0,
    }
    inputs = [x, roi, np.zeros(0, np.float32), sizes]
    check_vjp("Resize", inputs, attrs, consts={1: roi, 2: inputs[2], 3: sizes})


def test_upsample_vjp() -> None:
    scales = np.asarray([1, 1, 2, 3], np.float32)
    check_vjp("Upsample", [r(1, 2, 3, 2), scales], {"mode": "nearest"}, consts={1: scales})


@pytest.mark.parametrize("size", [3, 4])  # an even window is lopsided: its adjoint mirrors it
def test_lrn_vjp(size: int) -> None:
    attrs = {"size": size, "alpha": 0.5, "beta": 0.75, "bias": 1.5}
    check_vjp("LRN", [r(2, 6, 3, 2)], attrs)


@pytest.mark.parametrize(("xs", "ws", "attrs", "bias"), CONV_CASES)
def test_library_gradient_ops_match_the_convolutions_they_replace(
    xs: tuple[int, ...], ws: tuple[int, ...], attrs: dict[str, Any], bias: bool
) -> None:
    """ConvGradData and ConvGradFilter (cuDNN's backward calls; what Conv's VJP emits where
    the forward runs through the library): their references against Conv's gradient built
    as convolutions (the path float64 takes, checked against finite differences above)."""
    from flowc.autodiff import gradients
    from flowc.interpreter import evaluate
    from flowc.ir.builder import GraphBuilder
    from flowc.ir.dtype import DType
    from flowc.ir.graph import Attrs, Graph
    from flowc.ir.types import TensorType
    from flowc.ops.conv import library_geometry
    from flowc.ops.registry import get_op

    g = Graph("conv")
    b = GraphBuilder(g, fold=False)
    x = g.add_input("x", TensorType(xs, DType.F64))
    w = g.add_input("w", TensorType(ws, DType.F64))
    y = b.emit("Conv", [x, w], attrs, name="conv")[0]
    dy = g.add_input("dy", TensorType(y.type.shape, DType.F64))
    loss = b.emit("ReduceSum", [b.emit("Mul", [y, dy])[0]], {"keepdims": 0})[0]
    grads = gradients(g, loss, [x, w])
    g.outputs = [grads[x], grads[w]]  # type: ignore[list-item]
    feeds = {"x": r(*xs), "w": r(*ws), "dy": r(*y.type.shape)}
    want_dx, want_dw = (evaluate(g, feeds)[o.name] for o in g.outputs)
    merged = g.nodes[0].attrs.merged(get_op("Conv").attrs)
    fwd = {k: v for k, v in merged.items() if v is not None}
    assert library_geometry(xs, ws, DType.F32, merged) is not None  # 1-D ones too (height 1)
    dx = get_op("ConvGradData").evaluate([feeds["dy"], feeds["w"]], Attrs({**fwd, "x_shape": xs}))[
        0
    ]
    dw = get_op("ConvGradFilter").evaluate(
        [feeds["x"], feeds["dy"]], Attrs({**fwd, "w_shape": ws})
    )[0]
    np.testing.assert_allclose(dx, want_dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-12, atol=1e-12)
