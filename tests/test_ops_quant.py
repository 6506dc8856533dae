"""Quantization ops: QuantizeLinear / DequantizeLinear (per tensor, per axis, blocked, every
quantized type), MatMulInteger, ConvInteger, QLinearMatMul and QLinearConv.

The NumPy reference (and, for the integer products, the import lowering) against onnxruntime
where it runs the types (8- and 16-bit integers), else against ONNX's reference evaluator
(int4/int2, float8, float4/6, which onnxruntime's Python API cannot feed or return); then the
compiled host build of a batch of such nodes, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from opcheck import Case, check_compiled, check_op, make_op_model, run_onnxruntime

from flowc.compiler import compile_graph
from flowc.errors import FlowcError
from flowc.frontend.onnx import import_model
from flowc.harness.build import build, run
from flowc.interpreter import evaluate
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs
from flowc.ops.registry import get_op
from flowc.passes.manager import COMPILE_PIPELINE, PassManager

RNG = np.random.default_rng(5)


def rand(*shape: int, lo: float = -4.0, hi: float = 4.0, dtype: Any = np.float32) -> np.ndarray:
    return RNG.uniform(lo, hi, shape).astype(dtype)


def qints(*shape: int, dtype: Any = np.uint8) -> np.ndarray:
    info = np.iinfo(dtype)
    return RNG.integers(info.min, int(info.max) + 1, shape).astype(dtype)


def ties(scale: float) -> np.ndarray:
    """x / scale lands exactly halfway between integers (rounds to even), plus values far
    outside every range (saturation) and exact zeros."""
    halves = np.arange(-6, 6) + 0.5
    return (np.concatenate([halves, [0.0, -0.0, 1e6, -1e6]]) * scale).astype(np.float32)


# -- QuantizeLinear / DequantizeLinear against onnxruntime ------------------------------------

QUANTIZE = [
    # per tensor: ties to even, saturation, with and without a zero point (uint8 by default)
    ([ties(0.5), np.float32(0.5), np.uint8(3)], {}, 13),
    ([ties(0.25), np.float32(0.25), np.int8(-3)], {}, 13),
    ([ties(2.0), np.float32(2.0)], {}, 13),
    ([ties(0.5), np.float32(0.5), np.uint8(100)], {}, 10),
    # per axis, on a middle axis and the last one (negative)
    ([rand(2, 3, 4), rand(3, lo=0.05, hi=0.5), qints(3, dtype=np.int8)], {"axis": 1}, 13),
    ([rand(2, 3, 4), rand(4, lo=0.05, hi=0.5), qints(4)], {"axis": -1}, 13),
    # blocked: the block size divides the axis or leaves a short last block
    ([rand(3, 8), rand(3, 4, lo=0.05, hi=0.5), qints(3, 4)], {"axis": 1, "block_size": 2}, 21),
    (
        [rand(5, 2, 3), rand(2, 2, 3, lo=0.05, hi=0.5), qints(2, 2, 3, dtype=np.int8)],
        {"axis": 0, "block_size": 3},
        21,
    ),
    # 16-bit outputs, output_dtype without a zero point
    ([rand(4, 5, lo=-9e3, hi=9e4), np.float32(0.75), np.uint16(1000)], {}, 21),
    ([rand(4, 5, lo=-4e4, hi=4e4), np.float32(0.5)], {"output_dtype": TensorProto.INT16}, 21),
    ([rand(6), np.float32(0.1)], {"output_dtype": TensorProto.INT8}, 21),
    # float16 input and scale (the division rounds to float16)
    ([rand(2, 7, dtype=np.float16), np.float16(0.3), np.int8(1)], {}, 21),
]


@pytest.mark.parametrize("inputs, attrs, opset", QUANTIZE)
def test_quantize_linear_matches_onnxruntime(
    inputs: list[np.ndarray], attrs: dict[str, Any], opset: int
) -> None:
    check_op("QuantizeLinear", inputs, attrs, opset=opset, tol=0.0)


DEQUANTIZE = [
    ([qints(7), np.float32(0.5), np.uint8(3)], {}, 13),
    ([qints(7, dtype=np.int8), np.float32(0.125)], {}, 10),
    ([qints(2, 3, 4, dtype=np.int8), rand(3, lo=0.01, hi=1), qints(3, dtype=np.int8)], {}, 13),
    ([qints(2, 3, 4), rand(4, lo=0.01, hi=1), qints(4)], {"axis": -1}, 13),
    ([np.arange(-5, 5, dtype=np.int32) * 99991, np.float32(0.37)], {}, 13),
    ([qints(3, 8), rand(3, 3, lo=0.01, hi=1), qints(3, 3)], {"axis": 1, "block_size": 3}, 21),
    ([qints(9, dtype=np.int16), np.float32(0.01), np.int16(-7)], {}, 21),
    ([qints(9, dtype=np.uint16), np.float32(0.01), np.uint16(7)], {}, 21),
    # float16 scale: a float16 result
    ([qints(2, 5), np.float16(0.0123), np.uint8(128)], {}, 21),
]


@pytest.mark.parametrize("inputs, attrs, opset", DEQUANTIZE)
def test_dequantize_linear_matches_onnxruntime(
    inputs: list[np.ndarray], attrs: dict[str, Any], opset: int
) -> None:
    check_op("DequantizeLinear", inputs, attrs, opset=opset, tol=0.0)


def test_quantize_with_constant_scale_and_zero_point() -> None:
    # Scale and zero point as initializers (weights), not graph inputs.
    x = rand(3, 4)
    check_op(
        "QuantizeLinear",
        [x, rand(4, lo=0.1, hi=1), qints(4)],
        {"axis": 1},
        opset=13,
        const_inputs=(1, 2),
        tol=0.0,
    )


# -- the integer products against onnxruntime -------------------------------------------------

MATMUL_INTEGER = [
    [qints(4, 3), qints(3, 2), np.uint8(12), np.uint8(200)],
    [qints(4, 5), qints(5, 3, dtype=np.int8), np.uint8(3), qints(3, dtype=np.int8)],
    [qints(2, 3, 4, dtype=np.int8), qints(4, 6, dtype=np.int8)],
    [qints(2, 3, 4), qints(2, 4, 6), np.uint8(128)],
]


@pytest.mark.parametrize("inputs", MATMUL_INTEGER)
def test_matmul_integer_matches_onnxruntime(inputs: list[np.ndarray]) -> None:
    check_op("MatMulInteger", inputs, opset=10, tol=0.0)


def _qmm(a_dt: Any, b_dt: Any, a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> list[Any]:
    return [
        qints(*a_shape, dtype=a_dt),
        np.float32(0.05),
        qints(dtype=a_dt),
        qints(*b_shape, dtype=b_dt),
        np.float32(0.03),
        qints(dtype=b_dt),
        np.float32(0.7),
        qints(dtype=a_dt),
    ]


QLINEAR_MATMUL = [
    _qmm(np.uint8, np.uint8, (3, 8), (8, 5)),
    _qmm(np.int8, np.int8, (2, 3, 8), (2, 8, 5)),
    _qmm(np.uint8, np.int8, (2, 3, 8), (8, 5)),
]


@pytest.mark.parametrize("inputs", QLINEAR_MATMUL)
def test_qlinear_matmul_matches_onnxruntime(inputs: list[np.ndarray]) -> None:
    check_op("QLinearMatMul", inputs, opset=21, tol=0.0)


CONV_INTEGER = [
    ([qints(1, 2, 5, 5), qints(3, 2, 3, 3), np.uint8(7), np.uint8(9)], {"pads": [1, 1, 1, 1]}),
    ([qints(2, 4, 6, 5), qints(4, 2, 2, 3)], {"group": 2, "strides": [2, 1]}),
    ([qints(1, 3, 7), qints(2, 3, 3), np.uint8(1)], {"dilations": [2]}),
]


@pytest.mark.parametrize("inputs, attrs", CONV_INTEGER)
def test_conv_integer_matches_onnxruntime(inputs: list[np.ndarray], attrs: dict[str, Any]) -> None:
    check_op("ConvInteger", inputs, attrs, opset=10, tol=0.0)


def _qconv(
    x_shape: tuple[int, ...], w_shape: tuple[int, ...], per_channel: bool, bias: bool
) -> list[Any]:
    m = w_shape[0]
    w_scale = rand(m, lo=0.01, hi=0.05) if per_channel else np.float32(0.02)
    out = [
        qints(*x_shape),
        np.float32(0.05),
        np.uint8(120),
        qints(*w_shape, dtype=np.int8),
        w_scale,
        np.zeros(m, np.int8) if per_channel else np.int8(0),
        np.float32(0.4),
        np.uint8(110),
    ]
    if bias:
        out.append(RNG.integers(-2000, 2000, m).astype(np.int32))
    return out


QLINEAR_CONV = [
    (_qconv((1, 2, 6, 6), (3, 2, 3, 3), per_channel=False, bias=False), {"pads": [1, 1, 1, 1]}),
    (_qconv((2, 4, 5, 7), (4, 2, 3, 2), per_channel=True, bias=True), {"group": 2}),
    (_qconv((1, 3, 9, 9), (5, 3, 3, 3), per_channel=True, bias=True), {"strides": [2, 2]}),
]


@pytest.mark.parametrize("inputs, attrs", QLINEAR_CONV)
def test_qlinear_conv_matches_onnxruntime(inputs: list[np.ndarray], attrs: dict[str, Any]) -> None:
    check_op("QLinearConv", inputs, attrs, opset=10, tol=0.0)


@pytest.mark.parametrize(
    "op, inputs, attrs, opset",
    [
        ("MatMulInteger", MATMUL_INTEGER[1], {}, 10),
        ("QLinearMatMul", QLINEAR_MATMUL[1], {}, 21),
        ("ConvInteger", *CONV_INTEGER[0], 10),
        ("QLinearConv", *QLINEAR_CONV[1], 10),
    ],
)
def test_integer_product_references_match_onnxruntime(
    op: str, inputs: list[np.ndarray], attrs: dict[str, Any], opset: int
) -> None:
    """The ops' own NumPy references (what a program naming them evaluates), not the
    lowering the ONNX import uses."""
    model, feeds = make_op_model(op, inputs, attrs, opset=opset)
    want = next(iter(run_onnxruntime(model, feeds).values()))
    got = get_op(op).evaluate([np.asarray(a) for a in inputs], Attrs(attrs))[0]
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


# -- narrow types against ONNX's reference evaluator ------------------------------------------

FLOAT8 = [DType.F8E4M3FN, DType.F8E4M3FNUZ, DType.F8E5M2, DType.F8E5M2FNUZ]
NARROW_INTS = [DType.I4, DType.U4, DType.I2, DType.U2]
SMALL_FLOATS = [DType.F4E2M1, DType.F6E2M3, DType.F6E3M2]


def _narrow_cases() -> list[tuple[str, list[np.ndarray], dict[str, Any]]]:
    """(op, inputs, attrs): every narrow type quantized (per axis, blocked, float8 with and
    without saturation) and dequantized."""
    x = np.concatenate([ties(0.5), rand(12, lo=-600, hi=600)]).reshape(4, 7)
    cases: list[tuple[str, list[np.ndarray], dict[str, Any]]] = []
    for dt in NARROW_INTS:
        lo, hi = (-2, 1) if dt == DType.I2 else (0, 3) if dt == DType.U2 else (-8, 7)
        if dt == DType.U4:
            lo, hi = 0, 15
        zp = RNG.integers(lo, hi + 1, 4).astype(dt.np)
        cases.append(("QuantizeLinear", [x, np.full(4, 0.5, np.float32), zp], {"axis": 0}))
        cases.append(
            (
                "QuantizeLinear",
                [x, rand(4, 3, lo=0.3, hi=3), zp.repeat(3).reshape(4, 3)],
                {"axis": 1, "block_size": 3},
            )
        )
        q = RNG.integers(lo, hi + 1, (4, 7)).astype(dt.np)
        cases.append(("DequantizeLinear", [q, rand(7, lo=0.1, hi=2), zp[:1].repeat(7)], {}))
    for dt in FLOAT8:
        for sat in (1, 0):
            zp = np.zeros((), dt.np)
            cases.append(("QuantizeLinear", [x, np.float32(0.25), zp], {"saturate": sat}))
        bits = np.arange(256, dtype=np.uint8).view(dt.np).reshape(16, 16)
        cases.append(("DequantizeLinear", [bits, rand(16, lo=0.1, hi=2)], {"axis": 0}))
        cases.append(("DequantizeLinear", [bits, np.float16(0.375)], {"axis": 0, "block_size": 0}))
    for dt in SMALL_FLOATS:
        zp = np.zeros(7, dt.np)
        cases.append(("QuantizeLinear", [x, rand(7, lo=0.1, hi=4), zp], {"axis": 1}))
        grid = (np.arange(64, dtype=np.uint8) & (0xF if dt == DType.F4E2M1 else 0x3F)).view(dt.np)
        cases.append(("DequantizeLinear", [grid, np.float32(1.5), np.zeros((), dt.np)], {}))
    # output_dtype picks a narrow type without a zero point; int32 input and scale divide in
    # float64; the precision attribute rounds the division to float16 (x kept inside float16's
    # range: the evaluator casts an infinite quotient to int32 unsaturated).
    cases.append(("QuantizeLinear", [x, np.float32(0.5)], {"output_dtype": TensorProto.INT4}))
    ints32 = np.arange(-12, 12, dtype=np.int32) * 7
    cases.append(("QuantizeLinear", [ints32, np.int32(3), np.int8(0)], {}))
    cases.append(
        (
            "QuantizeLinear",
            [np.clip(x, -1e3, 1e3), np.float32(0.3), np.int8(0)],
            {"precision": TensorProto.FLOAT16},
        )
    )
    return cases


def _evaluator_model(
    cases: list[tuple[str, list[np.ndarray], dict[str, Any]]],
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    nodes, vis, outs, feeds = [], [], [], {}
    for k, (op, inputs, attrs) in enumerate(cases):
        names = []
        for i, a in enumerate(inputs):
            name = f"c{k}_in{i}"
            names.append(name)
            vis.append(
                helper.make_tensor_value_info(
                    name, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)
                )
            )
            feeds[name] = np.asarray(a)
        nodes.append(helper.make_node(op, names, [f"c{k}_out"], name=f"case{k}", **attrs))
        outs.append(helper.make_empty_tensor_value_info(f"c{k}_out"))
    graph = helper.make_graph(nodes, "narrow_quant", vis, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)])
    model.ir_version = 11
    inferred = onnx.shape_inference.infer_shapes(model)
    del model.graph.output[:]
    model.graph.output.extend(inferred.graph.output)
    return model, feeds


def _same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    dt = DType.from_numpy(want.dtype)
    if dt.is_int:
        np.testing.assert_array_equal(got.astype(np.int32), want.astype(np.int32), err_msg=what)
    elif dt.itemsize < 4:
        # narrow floats: bit for bit, any NaN matching any NaN
        g, w = got.astype(np.float32), want.astype(np.float32)
        assert np.array_equal(np.isnan(g), np.isnan(w)), what
        keep = ~np.isnan(w)
        view = np.uint8 if want.dtype.itemsize == 1 else np.uint16
        np.testing.assert_array_equal(got.view(view)[keep], want.view(view)[keep], err_msg=what)
    else:  # float32: NaN matches NaN
        np.testing.assert_array_equal(got, want, err_msg=what)


def _evaluator(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in model.graph.output]
    return dict(zip(names, ReferenceEvaluator(model).run(None, feeds), strict=True))


def test_narrow_types_reference_matches_onnx_evaluator() -> None:
    model, feeds = _evaluator_model(_narrow_cases())
    want = _evaluator(model, feeds)
    got = evaluate(import_model(model), feeds)
    for name, w in want.items():
        _same_bits(np.asarray(got[name]), np.asarray(w), name)


# -- compiled host builds ---------------------------------------------------------------------


def test_quantization_ops_compiled(tmp_path: Path) -> None:
    """The 8/16-bit cases above in one host build, against onnxruntime."""
    cases = [Case("QuantizeLinear", ins, attrs, tol=0.0) for ins, attrs, o in QUANTIZE if o >= 13]
    cases += [
        Case("DequantizeLinear", ins, attrs, tol=0.0) for ins, attrs, o in DEQUANTIZE if o >= 13
    ]
    cases += [Case("QLinearMatMul", ins, tol=0.0) for ins in QLINEAR_MATMUL]
    cases += [Case("QLinearConv", ins, attrs, tol=0.0) for ins, attrs in QLINEAR_CONV]
    code = check_compiled(cases, tmp_path, opset=21)
    assert "quantize_linear" in code and "dequantize_linear" in code
    log = tmp_path / "project" / "build-host" / "flowc-build.log"
    assert "warning" not in log.read_text().lower()


def test_integer_products_compiled(tmp_path: Path) -> None:
    cases = [Case("MatMulInteger", ins, tol=0.0) for ins in MATMUL_INTEGER]
    cases += [Case("ConvInteger", ins, attrs, tol=0.0) for ins, attrs in CONV_INTEGER]
    check_compiled(cases, tmp_path, opset=10)
    log = tmp_path / "project" / "build-host" / "flowc-build.log"
    assert "warning" not in log.read_text().lower()


def test_narrow_types_compiled_bit_for_bit(tmp_path: Path) -> None:
    """int4/int2/float8/float4/float6 read and written by the kernels themselves (widen_types
    leaves these ops alone), against ONNX's reference evaluator, with a warning-free build."""
    model, feeds = _evaluator_model(_narrow_cases())
    want = _evaluator(model, feeds)
    g = PassManager(COMPILE_PIPELINE).run(import_model(model))
    assert not any(n.op == "Cast" for n in g.nodes)  # nothing widened around them
    out = tmp_path / "host"
    compile_graph(g, out, poison=True)
    bdir = build(out, "host", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
    got, _ = run(out, feeds, target="host")
    for name, w in want.items():
        _same_bits(np.asarray(got[name]), np.asarray(w), name)


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op, inputs, attrs, message",
    [
        (
            "QuantizeLinear",
            [rand(2, 3), rand(2, lo=0.1)],
            {"axis": 1},
            "neither one value nor one per index of axis 1",
        ),
        (
            "QuantizeLinear",
            [rand(2, 6), rand(2, 2, lo=0.1)],
            {"axis": 1, "block_size": 2},
            "expected [2, 3]",
        ),
        (
            "QuantizeLinear",
            [rand(2, 6), rand(2, 3, lo=0.1)],
            {"axis": 1, "block_size": 4},
            "expected [2, 2]",
        ),
        (
            "QuantizeLinear",
            [rand(4), np.float32(1), np.uint8(0)],
            {"output_dtype": TensorProto.INT8},
            "differs from the zero point's type",
        ),
        ("DequantizeLinear", [rand(4), np.float32(1)], {}, "must be a quantized type"),
        (
            "DequantizeLinear",
            [qints(4), np.float32(1), np.int8(0)],
            {},
            "expected x's type u8",
        ),
    ],
)
def test_bad_quantization_parameters_are_clear_errors(
    op: str, inputs: list[np.ndarray], attrs: dict[str, Any], message: str
) -> None:
    model, _ = make_op_model(op, inputs, attrs, opset=25)
    with pytest.raises(FlowcError) as ei:
        import_model(model)
    assert message in str(ei.value)


def test_float8_qlinear_matmul_is_a_clear_error() -> None:
    f8 = np.zeros((2, 2), ml_dtypes.float8_e4m3fn)
    z = np.zeros((), ml_dtypes.float8_e4m3fn)
    one = np.float32(1)
    model, _ = make_op_model("QLinearMatMul", [f8, one, z, f8, one, z, one, z], opset=21)
    with pytest.raises(FlowcError) as ei:
        import_model(model)
    assert "must be int8 or uint8" in str(ei.value)
