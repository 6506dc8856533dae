"""Sampling ops against onnxruntime: GridSample (every mode, padding and align_corners, 1-D
to 3-D, ties for nearest, positions far outside), RoiAlign (both opsets' coordinates, avg
and max, fixed and adaptive sampling), Col2Im and MaxUnpool; the opset spellings, the
compile-time inputs, the shape errors and one host build of them all."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from opcheck import Case, check_compiled, check_op, make_op_model

from flowc.errors import ShapeError
from flowc.frontend.onnx import import_model
from flowc.interpreter import evaluate
from flowc.ir.graph import Attrs
from flowc.ops.registry import get_op

rng = np.random.default_rng(5)


def rand(*shape: int, dtype: type = np.float32, lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(dtype)


def grid(*shape: int, dtype: type = np.float32, spread: float = 1.8) -> np.ndarray:
    """Positions mostly inside [-1, 1], some far outside; the first few land exactly on
    pixel centers and half-way between them (ties for nearest)."""
    g = rand(*shape, dtype=dtype, lo=-spread, hi=spread)
    flat = g.reshape(-1)
    ties = np.array([-1.0, -0.5, 0.0, 0.25, 0.5, 1.0, -0.75, 0.75], dtype)
    flat[: ties.size] = ties[: flat.size]
    flat[-3:] = [-4.3, 3.9, -2.6][-min(3, flat.size) :]
    return g


MODES = ["linear", "nearest", "cubic"]
PADDINGS = ["zeros", "border", "reflection"]


@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("mode", MODES)
def test_gridsample_2d(mode: str, padding: str, align: int) -> None:
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    check_op("GridSample", [rand(2, 3, 5, 4), grid(2, 6, 7, 2)], attrs, opset=20)
    check_op(
        "GridSample",
        [rand(1, 2, 4, 6, dtype=np.float64), grid(1, 3, 5, 2, dtype=np.float64, spread=6.0)],
        attrs,
        opset=20,
        tol=1e-12,
    )


@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_gridsample_3d(mode: str, padding: str, align: int) -> None:
    # onnxruntime samples 4-D and 5-D inputs (cubic only 4-D).
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    check_op("GridSample", [rand(2, 2, 3, 4, 5), grid(2, 2, 3, 4, 3)], attrs, opset=20)


def test_gridsample_1d_and_4d_follow_the_separable_definition() -> None:
    """Beyond onnxruntime's 2-D and 3-D: a 1-D sample is the 2-D one on a height-1 image
    sampled at its center row; a 4-D linear sample of an input constant along the first
    axis is the 3-D one."""
    x = rand(2, 3, 7)
    g = grid(2, 5, 1)
    op = get_op("GridSample")
    for mode, padding in itertools.product(MODES, PADDINGS):
        a = Attrs({"mode": mode, "padding_mode": padding, "align_corners": 1})
        (y1,) = op.evaluate([x, g], a)
        g2 = np.concatenate([g, np.zeros_like(g)], axis=-1)[:, None, :, :]
        (y2,) = op.evaluate([x[:, :, None, :], g2], a)
        np.testing.assert_allclose(y1, y2[:, :, 0, :], rtol=1e-6, atol=1e-6)
    x3 = rand(1, 2, 3, 4, 5)
    g3 = grid(1, 2, 3, 2, 3)
    a = Attrs({"mode": "linear", "padding_mode": "border"})
    (y3,) = op.evaluate([x3, g3], a)
    x4 = np.repeat(x3[:, :, None], 4, axis=2)
    g4 = np.concatenate([g3, rand(1, 2, 3, 2, 1)], axis=-1)[:, None]
    (y4,) = op.evaluate([x4, g4], a)
    np.testing.assert_allclose(y4[:, :, 0], y3, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_gridsample_opset16_spellings(mode: str) -> None:
    attrs = {"mode": mode, "padding_mode": "reflection"}
    check_op("GridSample", [rand(1, 2, 4, 5), grid(1, 3, 3, 2)], attrs, opset=16)


def test_gridsample_errors() -> None:
    x = rand(1, 2, 4, 5)
    for bad, attrs, msg in [
        (grid(1, 3, 3, 3), {}, "grid must have shape"),
        (grid(2, 3, 3, 2), {}, "grid must have shape"),
        (grid(1, 3, 2), {}, "grid must have shape"),
        (grid(1, 3, 3, 2), {"mode": "bilinear"}, "mode 'bilinear'"),
        (grid(1, 3, 3, 2), {"padding_mode": "wrap"}, "padding_mode"),
        (grid(1, 3, 3, 2), {"align_corners": 2}, "align_corners"),
        (grid(1, 3, 3, 2).astype(np.int64), {}, "grid must be a floating-point"),
    ]:
        model, _ = make_op_model("GridSample", [x, bad], attrs, opset=20)
        with pytest.raises(ShapeError, match=msg):
            import_model(model)


def test_gridsample_reflection_mirrors_about_the_edges() -> None:
    """A hand-checked case: a 1 x 3 row, nearest, reflection. Without align_corners the
    mirror is the pixel edge (index -1 reads 0, index 3 reads 2, index -4 reads 2); with it
    the corner centers (-1 reads 1, 3 reads 1, 4 reads 0)."""
    x = np.array([[[[10.0, 20.0, 30.0]]]], np.float32)
    op = get_op("GridSample")

    def at(positions: list[float], align: int) -> list[float]:
        # pixel position p along the width is normalized to 2 (p + 0.5) / 3 - 1 or p - 1
        n = [(2 * (p + 0.5) / 3 - 1) if not align else (p - 1) for p in positions]
        g = np.array([[[[v, 0.0] for v in n]]], np.float32)
        a = Attrs({"mode": "nearest", "padding_mode": "reflection", "align_corners": align})
        return [float(v) for v in op.evaluate([x, g], a)[0].reshape(-1)]

    assert at([-1, 3, -4, 1], 0) == [10.0, 30.0, 30.0, 20.0]
    assert at([-1, 3, 4, 2], 1) == [20.0, 20.0, 10.0, 30.0]


# -- RoiAlign ---------------------------------------------------------------------------------

ROIS = [
    [0, 0, 9, 9],
    [1.3, 2.2, 7.9, 5.1],
    [-2, -3, 4, 20],  # partly outside the map
    [5, 5, 5.2, 5.1],  # smaller than a pixel
    [3, 4, 2, 1],  # malformed: ends before it starts
    [11, 9, 14, 15],  # beyond the map
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ratio", [0, 2])
@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("coords", ["opset10", "half_pixel", "output_half_pixel"])
def test_roialign(coords: str, mode: str, ratio: int, dtype: type) -> None:
    x = rand(2, 3, 10, 12, dtype=dtype)
    rois = np.array(ROIS, dtype)
    bi = np.array([0, 1, 1, 0, 1, 0], np.int64)
    attrs: dict[str, Any] = {
        "mode": mode,
        "sampling_ratio": ratio,
        "output_height": 3,
        "output_width": 4,
        "spatial_scale": 0.8,
    }
    opset = 10 if coords == "opset10" else 16
    if opset == 16:
        attrs["coordinate_transformation_mode"] = coords
    tol = 1e-5 if dtype == np.float32 else 1e-12
    check_op("RoiAlign", [x, rois, bi], attrs, opset=opset, tol=tol)


def test_roialign_opset10_is_output_half_pixel() -> None:
    x, rois, bi = (
        rand(1, 2, 6, 6),
        np.array([[1.0, 1.5, 4.0, 5.0]], np.float32),
        np.zeros(1, np.int64),
    )
    model10, feeds = make_op_model("RoiAlign", [x, rois, bi], {"output_height": 2}, opset=10)
    model16, _ = make_op_model(
        "RoiAlign",
        [x, rois, bi],
        {"output_height": 2, "coordinate_transformation_mode": "output_half_pixel"},
        opset=16,
    )
    a = evaluate(import_model(model10), feeds)["out0"]
    b = evaluate(import_model(model16), feeds)["out0"]
    np.testing.assert_array_equal(a, b)


def test_roialign_errors() -> None:
    x, rois = rand(2, 3, 5, 5), rand(4, 4, lo=0, hi=4)
    for inputs, attrs, msg in [
        ([x, rand(4, 5), np.zeros(4, np.int64)], {}, r"rois must have shape \[num_rois, 4\]"),
        ([x, rois, np.zeros(3, np.int64)], {}, "batch_indices must have shape"),
        ([x, rois, np.zeros(4, np.int32)], {}, "batch_indices must be int64"),
        ([x[0], rois, np.zeros(4, np.int64)], {}, "X must be N x C x H x W"),
        ([x, rois, np.zeros(4, np.int64)], {"mode": "sum"}, "mode 'sum'"),
        ([x, rois, np.zeros(4, np.int64)], {"output_width": 0}, "must be positive"),
    ]:
        model, _ = make_op_model("RoiAlign", inputs, attrs, opset=16)
        with pytest.raises(ShapeError, match=msg):
            import_model(model)
    with pytest.raises(IndexError, match="batch index 2"):
        get_op("RoiAlign").evaluate([x, rois, np.array([0, 1, 2, 0], np.int64)], Attrs({}))


# -- Col2Im -----------------------------------------------------------------------------------

COL2IM = [
    ({}, [5, 5], [1, 5]),
    ({"strides": [2, 2]}, [5, 5], [3, 3]),
    ({"pads": [0, 1, 0, 1]}, [5, 5], [1, 5]),
    ({"dilations": [1, 5]}, [6, 6], [2, 2]),
    ({"dilations": [2, 1], "strides": [2, 3], "pads": [1, 2, 0, 1]}, [7, 8], [2, 3]),
    ({"strides": [3, 3]}, [8, 7], [2, 2]),  # strides past the block: some pixels get nothing
    ({}, [3, 4, 5], [1, 1, 5]),
    ({"strides": [2], "pads": [1, 2]}, [9], [3]),
]


def _blocks(image: list[int], block: list[int], a: dict[str, Any]) -> int:
    nd = len(image)
    s, d = a.get("strides", [1] * nd), a.get("dilations", [1] * nd)
    p = a.get("pads", [0] * (2 * nd))
    return int(
        np.prod(
            [
                (image[i] + p[i] + p[nd + i] - (block[i] - 1) * d[i] - 1) // s[i] + 1
                for i in range(nd)
            ]
        )
    )


@pytest.mark.parametrize(("attrs", "image", "block"), COL2IM)
def test_col2im(attrs: dict[str, Any], image: list[int], block: list[int]) -> None:
    x = rand(2, 3 * int(np.prod(block)), _blocks(image, block, attrs))
    shapes = [np.array(image, np.int64), np.array(block, np.int64)]
    check_op("Col2Im", [x, *shapes], attrs, opset=18, const_inputs=(1, 2))


def test_col2im_float64_and_int_match_a_direct_sum() -> None:
    """onnxruntime has only float32 Col2Im: other types against the definition, summed
    entry by entry."""
    attrs = {"dilations": [2, 1], "strides": [2, 3], "pads": [1, 2, 0, 1]}
    image, block = [7, 8], [2, 3]
    counts = [3, 3]  # (7 + 1 + 0 - 3) // 2 + 1, (8 + 2 + 1 - 3) // 3 + 1
    for dtype in (np.float64, np.int32):
        x = (rand(2, 2 * 6, 9) * 100).astype(dtype)
        want = np.zeros((2, 2, *image), dtype)
        for n, c, k0, k1, b0, b1 in itertools.product(
            range(2), range(2), range(2), range(3), range(counts[0]), range(counts[1])
        ):
            i, j = b0 * 2 - 1 + k0 * 2, b1 * 3 - 2 + k1
            if 0 <= i < image[0] and 0 <= j < image[1]:
                want[n, c, i, j] += x[n, c * 6 + k0 * 3 + k1, b0 * counts[1] + b1]
        (got,) = get_op("Col2Im").evaluate(
            [x, np.array(image, np.int64), np.array(block, np.int64)], Attrs(attrs)
        )
        assert got.dtype == dtype
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_col2im_shapes_must_be_constants_and_fit() -> None:
    x = rand(1, 5, 5)
    model, _ = make_op_model(
        "Col2Im", [x, np.array([5, 5], np.int64), np.array([1, 5], np.int64)], opset=18
    )
    with pytest.raises(ShapeError, match="must be known at compile time"):
        import_model(model)
    for image, block, msg in [
        ([5, 5], [2, 5], "multiple of the block size"),
        ([6, 5], [1, 5], "number of blocks 6"),
        ([5], [1, 5], "same length"),
        ([2, 2], [3, 3], "does not fit"),
    ]:
        model, _ = make_op_model(
            "Col2Im",
            [x, np.array(image, np.int64), np.array(block, np.int64)],
            opset=18,
            const_inputs=(1, 2),
        )
        with pytest.raises(ShapeError, match=msg):
            import_model(model)


# -- MaxUnpool --------------------------------------------------------------------------------

UNPOOL: list[tuple[dict[str, Any], tuple[int, ...]]] = [
    ({"kernel_shape": [2, 2], "strides": [2, 2]}, (2, 3, 6, 8)),
    ({"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1]}, (2, 3, 5, 7)),
    ({"kernel_shape": [3, 3]}, (1, 2, 6, 5)),  # overlapping windows repeat indices
    ({"kernel_shape": [2], "strides": [2]}, (2, 2, 8)),
    ({"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]}, (1, 2, 4, 6, 4)),
]


@pytest.mark.parametrize(("attrs", "shape"), UNPOOL)
def test_maxunpool_inverts_maxpool(attrs: dict[str, Any], shape: tuple[int, ...]) -> None:
    # Positive values: a pooled maximum never loses to the zeros unpooling leaves.
    y, i = get_op("MaxPool").evaluate([rand(*shape, lo=0.1)], Attrs(attrs))
    got = check_op("MaxUnpool", [y, i], attrs, opset=11)["out0"]
    assert got.shape == shape
    # With output_shape equal to the unpooled shape (onnxruntime and ONNX agree there).
    check_op("MaxUnpool", [y, i, np.array(shape, np.int64)], attrs, opset=11, const_inputs=(2,))
    # Pooling the unpooled tensor gives the pooled values back.
    (again, _) = get_op("MaxPool").evaluate([got], Attrs(attrs))
    np.testing.assert_array_equal(again, y)


def test_maxunpool_larger_output_shape_holds_the_unpooled_block_at_its_origin() -> None:
    """The ONNX test's reading: indices count in the 4 x 4 shape the attributes give, which
    sits at the origin of the 5 x 5 output. (onnxruntime counts them in the 5 x 5 output.)"""
    x = np.array([[[[5, 6], [7, 8]]]], np.float32)
    i = np.array([[[[5, 7], [13, 15]]]], np.int64)
    model, feeds = make_op_model(
        "MaxUnpool",
        [x, i, np.array([1, 1, 5, 5], np.int64)],
        {"kernel_shape": [2, 2], "strides": [2, 2]},
        opset=11,
        const_inputs=(2,),
    )
    got = evaluate(import_model(model), feeds)["out0"]
    want = np.zeros((1, 1, 5, 5), np.float32)
    want[0, 0, 1, 1], want[0, 0, 1, 3], want[0, 0, 3, 1], want[0, 0, 3, 3] = 5, 6, 7, 8
    np.testing.assert_array_equal(got, want)


def test_maxunpool_errors() -> None:
    x, i = rand(1, 1, 2, 2), np.array([[[[0, 3], [9, 15]]]], np.int64)
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2]}
    model, _ = make_op_model("MaxUnpool", [x, i, np.array([1, 1, 4, 4], np.int64)], attrs)
    with pytest.raises(ShapeError, match="must be known at compile time"):
        import_model(model)
    for inputs, a, msg in [
        ([x, i, np.array([1, 1, 3, 4], np.int64)], attrs, "must have rank 4 and hold"),
        ([x, i[..., :1]], attrs, "I must be int64 of X's shape"),
        ([x, i.astype(np.int32)], attrs, "I must be int64"),
        ([x, i], {}, "required attribute 'kernel_shape' is not set"),
        ([x, i], {"kernel_shape": [2]}, "must have 2 positive entries"),
    ]:
        model, _ = make_op_model("MaxUnpool", inputs, a, opset=11, const_inputs=(2,))
        with pytest.raises(ShapeError, match=msg):
            import_model(model)
    with pytest.raises(IndexError, match="index 16 is out of range"):
        get_op("MaxUnpool").evaluate([x, i + 1], Attrs(attrs))


# -- one host build of them all ---------------------------------------------------------------


def test_sample_ops_compiled(tmp_path: Any) -> None:
    pool = {"kernel_shape": [2, 2], "strides": [2, 2]}
    py, pi = get_op("MaxPool").evaluate([rand(2, 3, 6, 8)], Attrs(pool))
    pool3 = {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1]}
    qy, qi = get_op("MaxPool").evaluate([rand(1, 2, 5, 7)], Attrs(pool3))
    x = rand(2, 3, 10, 12)
    rois = np.array(ROIS, np.float32)
    bi = np.array([0, 1, 1, 0, 1, 0], np.int64)
    roi_attrs = {"output_height": 3, "output_width": 4, "spatial_scale": 0.8}

    def gs(mode: str, padding: str, align: int) -> dict[str, Any]:
        return {"mode": mode, "padding_mode": padding, "align_corners": align}

    cases = [
        Case("GridSample", [rand(2, 3, 5, 4), grid(2, 6, 7, 2)], gs("linear", "zeros", 0)),
        Case("GridSample", [rand(2, 3, 5, 4), grid(2, 6, 7, 2)], gs("nearest", "border", 0)),
        Case("GridSample", [rand(2, 3, 5, 4), grid(2, 6, 7, 2)], gs("nearest", "zeros", 1)),
        Case("GridSample", [rand(2, 3, 5, 4), grid(2, 6, 7, 2)], gs("cubic", "reflection", 1)),
        Case("GridSample", [rand(2, 3, 5, 4), grid(2, 6, 7, 2)], gs("cubic", "border", 0)),
        Case(
            "GridSample",
            [rand(1, 2, 4, 6, dtype=np.float64), grid(1, 3, 5, 2, dtype=np.float64, spread=6)],
            gs("linear", "reflection", 0),
            tol=1e-12,
        ),
        Case("GridSample", [rand(2, 2, 3, 4, 5), grid(2, 2, 3, 4, 3)], gs("linear", "border", 1)),
        Case(
            "GridSample", [rand(2, 2, 3, 4, 5), grid(2, 2, 3, 4, 3)], gs("nearest", "reflection", 0)
        ),
        Case("RoiAlign", [x, rois, bi], {**roi_attrs, "sampling_ratio": 0}),
        Case(
            "RoiAlign",
            [x.astype(np.float64), rois.astype(np.float64), bi],
            {**roi_attrs, "mode": "max", "sampling_ratio": 2},
            tol=1e-12,
        ),
        Case(
            "RoiAlign",
            [x, rois, bi],
            {**roi_attrs, "coordinate_transformation_mode": "output_half_pixel", "mode": "max"},
        ),
        Case(
            "Col2Im",
            [rand(2, 12, 9), np.array([7, 8], np.int64), np.array([2, 3], np.int64)],
            {"dilations": [2, 1], "strides": [2, 3], "pads": [1, 2, 0, 1]},
            const_inputs=(1, 2),
        ),
        Case(
            "Col2Im",
            [rand(1, 10, 12), np.array([3, 4, 5], np.int64), np.array([1, 1, 5], np.int64)],
            const_inputs=(1, 2),
        ),
        Case("MaxUnpool", [py, pi], pool),
        Case("MaxUnpool", [qy, qi, np.array([1, 2, 5, 7], np.int64)], pool3, const_inputs=(2,)),
    ]
    code = check_compiled(cases, tmp_path, opset=20)
    assert "flowc::ew::mul_rn(" in code  # positions are never contracted into an FMA
