"""DFT, STFT, MelWeightMatrix and BitCast: flowc's reference and import lowering against
onnxruntime, the lowering's structure, the errors, and one host build."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto
from opcheck import Case, check_compiled, check_op, make_op_model

from flowc.errors import ShapeError
from flowc.frontend.onnx import import_model
from flowc.interpreter import evaluate
from flowc.ir.graph import Attrs
from flowc.ops.registry import get_op
from flowc.ops.signal import dft_matrix

RNG = np.random.default_rng(5)


def rand(*shape: int, dtype: type = np.float32) -> np.ndarray:
    return RNG.uniform(-1.0, 1.0, shape).astype(dtype)


def i64(v: int) -> np.ndarray:
    return np.array(v, np.int64)


# -- DFT ----------------------------------------------------------------------------------------

DFT_CASES = [
    # (input, dft_length, axis, attrs)
    (rand(2, 8, 1), None, 1, {}),
    (rand(2, 8, 2), None, 1, {}),
    (rand(3, 7, 2), None, -2, {"inverse": 1}),
    (rand(2, 5, 6, 1), None, 1, {}),  # not the last signal axis: transposed around the product
    (rand(2, 5, 6, 2), None, 0, {"inverse": 1}),
    (rand(2, 9, 1), None, 1, {"onesided": 1}),
    (rand(2, 10, 1), None, 1, {"onesided": 1}),
    (rand(2, 6, 2), None, 1, {"onesided": 1, "inverse": 1}),  # IRFFT, length 10
    (rand(2, 5, 2), 9, 1, {"onesided": 1, "inverse": 1}),  # odd IRFFT length
    (rand(2, 6, 1), 10, 1, {}),  # dft_length pads
    (rand(2, 10, 2), 6, 1, {}),  # dft_length truncates
    (rand(2, 10, 2), 7, 1, {"inverse": 1}),
]


@pytest.mark.parametrize("x, length, axis, attrs", DFT_CASES)
def test_dft_matches_onnxruntime(
    x: np.ndarray, length: int | None, axis: int, attrs: dict[str, int]
) -> None:
    dft_length = None if length is None else i64(length)
    check_op("DFT", [x, dft_length, i64(axis)], attrs, opset=20, const_inputs=(1, 2), tol=1e-5)


def test_dft_irfft_with_missing_bins_matches_onnx_reference() -> None:
    # Fewer one-sided bins than dft_length // 2 + 1: the missing ones are zeros (NumPy's
    # irfft, the ONNX reference); onnxruntime reads them differently.
    x = rand(2, 5, 2)
    attrs = {"onesided": 1, "inverse": 1}
    for length in (10, 12):
        check_op(
            "DFT",
            [x, i64(length), i64(1)],
            attrs,
            opset=20,
            const_inputs=(1, 2),
            tol=1e-5,
            reference="onnx",
        )


def test_dft_opset17_axis_attribute_and_default() -> None:
    x = rand(2, 6, 5, 2)
    check_op("DFT", [x], {"axis": 2}, opset=17, tol=1e-5)
    # Opset 17's default axis is 1; opset 20's is -2.
    got17 = check_op("DFT", [x], {}, opset=17, tol=1e-5)["out0"]
    got20 = check_op("DFT", [x], {}, opset=20, tol=1e-5)["out0"]
    z = x[..., 0] + 1j * x[..., 1].astype(np.float64)
    np.testing.assert_allclose(got17[..., 0], np.fft.fft(z, axis=1).real, 0, 1e-5)
    np.testing.assert_allclose(got20[..., 1], np.fft.fft(z, axis=2).imag, 0, 1e-5)


def test_dft_float64_and_float16() -> None:
    check_op(
        "DFT", [rand(2, 8, 2, dtype=np.float64), None, i64(1)], {}, opset=20, const_inputs=(2,)
    )
    got = check_op(
        "DFT",
        [rand(2, 8, 1, dtype=np.float16), None, i64(1)],
        {},
        opset=20,
        const_inputs=(2,),
        tol=2e-3,
    )
    assert got["out0"].dtype == np.float16


def test_dft_lowers_to_one_matmul() -> None:
    model, _ = make_op_model("DFT", [rand(2, 8, 1), None, i64(-2)], opset=20, const_inputs=(2,))
    ops = [n.op for n in import_model(model).nodes]
    assert "DFT" not in ops and ops.count("MatMul") == 1 and "Transpose" not in ops
    model, _ = make_op_model("DFT", [rand(2, 8, 3, 1), None, i64(1)], opset=20, const_inputs=(2,))
    ops = [n.op for n in import_model(model).nodes]
    assert ops.count("MatMul") == 1 and ops.count("Transpose") == 2


def test_dft_matrix_is_exact_at_quarter_turns() -> None:
    # Forward DFT of length 8 on a real input: the k = 0, 2, 4, 6 columns are 0 and +-1.
    w = dft_matrix(8, 1, 8, inverse=False, onesided=False, window=None).reshape(8, 8, 2)
    for k in (0, 2, 4, 6):
        assert set(np.unique(w[:, k, :])) <= {-1.0, 0.0, 1.0}
    # A real signal's DC and Nyquist bins come out with an exactly zero imaginary part.
    x = rand(1, 8, 1)
    model, feeds = make_op_model("DFT", [x, None, i64(1)], opset=20, const_inputs=(2,))
    y = evaluate(import_model(model), feeds)["out0"]
    assert y[0, 0, 1] == 0.0 and y[0, 4, 1] == 0.0


def test_dft_reference_matches_numpy() -> None:
    x = rand(3, 10, 2)
    op = get_op("DFT")
    z = x[..., 0].astype(np.float64) + 1j * x[..., 1]
    (y,) = op.evaluate([x, None, i64(1)], Attrs({"inverse": 1}))
    want = np.fft.ifft(z, axis=1)
    np.testing.assert_allclose(y[..., 0], want.real, atol=1e-6)
    np.testing.assert_allclose(y[..., 1], want.imag, atol=1e-6)


def test_dft_errors() -> None:
    x = rand(2, 8, 2)
    with pytest.raises(ShapeError, match="axis 2 is out of range"):
        import_model(make_op_model("DFT", [x, None, i64(2)], opset=20, const_inputs=(2,))[0])
    with pytest.raises(ShapeError, match=r"input 2 \(axis\) must be known at compile time"):
        import_model(make_op_model("DFT", [x, None, i64(1)], opset=20)[0])
    with pytest.raises(ShapeError, match="size 1 or 2"):
        import_model(make_op_model("DFT", [rand(2, 8, 3)], opset=17)[0])
    with pytest.raises(ShapeError, match="must be positive"):
        import_model(make_op_model("DFT", [x, i64(0), i64(1)], opset=20, const_inputs=(1, 2))[0])
    # Long transforms: the dense matrix would be huge; refused before it is built.
    big = rand(1, 8192, 2)
    with pytest.raises(ShapeError, match="computes DFTs as dense products"):
        import_model(make_op_model("DFT", [big, None, i64(1)], opset=20, const_inputs=(2,))[0])


# -- STFT ---------------------------------------------------------------------------------------

STFT_CASES = [
    # (signal, frame_step, window, frame_length, attrs)
    (rand(2, 64, 1), 8, None, 16, {}),
    (rand(2, 64, 1), 8, np.hanning(16).astype(np.float32), None, {}),
    (rand(1, 50, 1), 7, np.hamming(12).astype(np.float32), 12, {"onesided": 0}),
    (rand(2, 40, 2), 5, None, 10, {"onesided": 0}),
]


@pytest.mark.parametrize("signal, step, window, length, attrs", STFT_CASES)
@pytest.mark.parametrize("const_window", [False, True])
def test_stft_matches_onnxruntime(
    signal: np.ndarray,
    step: int,
    window: np.ndarray | None,
    length: int | None,
    attrs: dict[str, int],
    const_window: bool,
) -> None:
    frame_length = None if length is None else i64(length)
    consts = (1, 3, 2) if const_window else (1, 3)
    check_op(
        "STFT",
        [signal, i64(step), window, frame_length],
        attrs,
        opset=17,
        const_inputs=consts,
        tol=1e-5,
    )


def test_stft_errors() -> None:
    with pytest.raises(ShapeError, match="the window has 8 samples but frame_length is 16"):
        import_model(
            make_op_model(
                "STFT", [rand(1, 64, 1), i64(4), rand(8), i64(16)], opset=17, const_inputs=(1, 3)
            )[0]
        )
    with pytest.raises(ShapeError, match=r"frame_length 80 must be in \[1, 64\]"):
        import_model(
            make_op_model(
                "STFT", [rand(1, 64, 1), i64(4), None, i64(80)], opset=17, const_inputs=(1, 3)
            )[0]
        )


# -- MelWeightMatrix ----------------------------------------------------------------------------


def _mel_inputs(
    bins: int, length: int, rate: int, lo: float, hi: float, dtype: type = np.int64
) -> list[np.ndarray | None]:
    return [
        np.array(bins, dtype),
        np.array(length, dtype),
        np.array(rate, dtype),
        np.array(lo, np.float32),
        np.array(hi, np.float32),
    ]


@pytest.mark.parametrize(
    "bins, length, rate, lo, hi",
    [(8, 16, 8192, 0.0, 4096.0), (10, 64, 16000, 20.0, 7600.0), (40, 512, 16000, 125.0, 7500.0)],
)
def test_mel_weight_matrix_folds_and_matches_onnxruntime(
    bins: int, length: int, rate: int, lo: float, hi: float
) -> None:
    inputs = _mel_inputs(bins, length, rate, lo, hi)
    got = check_op("MelWeightMatrix", inputs, {}, opset=17, const_inputs=range(5))
    assert got["out0"].shape == (length // 2 + 1, bins)
    model, _ = make_op_model("MelWeightMatrix", inputs, opset=17, const_inputs=range(5))
    assert import_model(model).nodes == []  # a constant


def test_mel_weight_matrix_output_type_and_int32_inputs() -> None:
    inputs = _mel_inputs(6, 32, 8000, 0.0, 3000.0, np.int32)
    got = check_op(
        "MelWeightMatrix",
        inputs,
        {"output_datatype": TensorProto.DOUBLE},
        opset=17,
        const_inputs=range(5),
    )
    assert got["out0"].dtype == np.float64


def test_mel_weight_matrix_errors() -> None:
    inputs = _mel_inputs(8, 16, 8000, 0.0, 20000.0)
    with pytest.raises(ShapeError, match="lies above the spectrum"):
        import_model(make_op_model("MelWeightMatrix", inputs, opset=17, const_inputs=range(5))[0])
    with pytest.raises(ShapeError, match=r"input 3 \(lower_edge_hertz\) must be known"):
        import_model(
            make_op_model("MelWeightMatrix", inputs, opset=17, const_inputs=(0, 1, 2, 4))[0]
        )


# -- BitCast ------------------------------------------------------------------------------------

# (input, to, reference): onnxruntime has no BitCast for bool, and bfloat16 has no NumPy type
# in its Python API; ONNX's reference evaluator checks those.
BITCASTS = [
    (rand(3, 4), TensorProto.INT32, "onnxruntime"),
    (rand(5, dtype=np.float64), TensorProto.UINT64, "onnxruntime"),
    (np.array([-1, 0, 7, -128], np.int8), TensorProto.UINT8, "onnxruntime"),
    (np.array([0, 0x3C00, 0x7C00, 0x8001], np.uint16), TensorProto.FLOAT16, "onnxruntime"),
    (np.array([1.5, -2.0, 65504.0], np.float16), TensorProto.INT16, "onnxruntime"),
    (np.array(2.5, np.float32), TensorProto.UINT32, "onnxruntime"),
    (np.array([1, 0, 1], np.bool_), TensorProto.UINT8, "onnx"),
    (np.array([1.5, -2.0, 3.25], np.float16), TensorProto.BFLOAT16, "onnx"),
]


@pytest.mark.parametrize("x, to, reference", BITCASTS)
def test_bitcast_matches_reference(x: np.ndarray, to: int, reference: str) -> None:
    got = check_op("BitCast", [x], {"to": to}, opset=26, reference=reference)
    assert got["out0"].tobytes() == x.tobytes()


def test_bitcast_narrow_types_keep_the_bits() -> None:
    import ml_dtypes

    op = get_op("BitCast")
    x = np.array([-1, 3, -8, 7], ml_dtypes.int4)
    (y,) = op.evaluate([x], Attrs({"to": TensorProto.UINT4}))
    assert y.dtype == ml_dtypes.uint4 and [int(v) for v in y] == [15, 3, 8, 7]
    (f,) = op.evaluate([x], Attrs({"to": TensorProto.FLOAT4E2M1}))
    assert f.view(np.uint8).tolist() == x.view(np.uint8).tolist()


def test_bitcast_is_a_view_and_checks_widths() -> None:
    assert get_op("BitCast").view
    with pytest.raises(ShapeError, match="same width: f32 has 32 bits, f16 has 16"):
        import_model(make_op_model("BitCast", [rand(3)], {"to": TensorProto.FLOAT16}, opset=26)[0])
    x = np.array([1, 2], np.uint8)
    with pytest.raises(ShapeError, match="u8 has 8 bits, i4 has 4"):
        import_model(make_op_model("BitCast", [x], {"to": TensorProto.INT4}, opset=26)[0])


# -- one host build -----------------------------------------------------------------------------


def test_signal_ops_compiled(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cases = [
        Case("DFT", [rand(2, 8, 1), None, i64(1)], const_inputs=(2,)),
        Case("DFT", [rand(2, 5, 6, 2), None, i64(1)], {"inverse": 1}, const_inputs=(2,)),
        Case("DFT", [rand(3, 9, 1), i64(12), i64(-2)], {"onesided": 1}, const_inputs=(1, 2)),
        Case(
            "DFT", [rand(2, 6, 2), None, i64(1)], {"onesided": 1, "inverse": 1}, const_inputs=(2,)
        ),
        Case("DFT", [rand(2, 8, 1, dtype=np.float64), None, i64(1)], const_inputs=(2,)),
        Case("STFT", [rand(2, 64, 1), i64(8), rand(16)], const_inputs=(1,)),
        Case("STFT", [rand(1, 40, 2), i64(5), None, i64(10)], {"onesided": 0}, const_inputs=(1, 3)),
        Case("BitCast", [rand(3, 4)], {"to": TensorProto.INT32}),
        Case("BitCast", [np.array([0, 0x3C00, 0xC000], np.uint16)], {"to": TensorProto.FLOAT16}),
        Case("BitCast", [np.array([1.5, -2.0, 65504.0], np.float16)], {"to": TensorProto.INT16}),
    ]
    check_compiled(cases, tmp_path, opset=26)
