"""MatMul and Gemm against onnxruntime: broadcasting, 1-D promotion, transposes, C shapes,
dtypes, the opset spellings, and the shape errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opcheck import check_op, make_op_model

from flowc.errors import ShapeError
from flowc.frontend.onnx import import_model
from flowc.interpreter import evaluate
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs
from flowc.ir.types import TensorType
from flowc.ops.registry import get_op

rng = np.random.default_rng(7)


def rand(shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
    if np.dtype(dtype).kind in "iu":
        return rng.integers(0 if np.dtype(dtype).kind == "u" else -5, 5, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def flowc_outputs(
    op: str, inputs: list[np.ndarray], attrs: dict[str, object], opset: int
) -> dict[str, np.ndarray]:
    model, feeds = make_op_model(op, inputs, attrs, opset=opset)
    return evaluate(import_model(model), feeds)


MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((4,), (4, 5)),
    ((3, 4), (4,)),
    ((4,), (4,)),
    ((2, 3, 4), (4, 5)),
    ((4,), (2, 4, 5)),
    ((2, 3, 4), (4,)),
    ((2, 1, 3, 4), (5, 4, 6)),
    ((1, 3, 4), (2, 4, 5)),
]


@pytest.mark.parametrize(("a", "b"), MATMUL_SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_matmul(a: tuple[int, ...], b: tuple[int, ...], dtype: type) -> None:
    check_op("MatMul", [rand(a, dtype), rand(b, dtype)])


@pytest.mark.parametrize("opset", [9, 13])
def test_matmul_float16_and_old_opset(opset: int) -> None:
    check_op(
        "MatMul", [rand((2, 3, 8), np.float16), rand((8, 5), np.float16)], opset=opset, tol=1e-3
    )


@settings(max_examples=15, deadline=None)
@given(
    batch_a=st.lists(st.sampled_from([1, 2, 3]), max_size=3),
    batch_b=st.lists(st.sampled_from([1, 2, 3]), max_size=3),
    m=st.integers(1, 4),
    k=st.integers(1, 5),
    n=st.integers(1, 4),
)
def test_matmul_batch_broadcast(
    batch_a: list[int], batch_b: list[int], m: int, k: int, n: int
) -> None:
    # Align the batch dims from the right and make them broadcast-compatible.
    width = min(len(batch_a), len(batch_b))
    for i in range(1, width + 1):
        if batch_a[-i] != batch_b[-i] and 1 not in (batch_a[-i], batch_b[-i]):
            batch_b[-i] = 1
    got = check_op("MatMul", [rand((*batch_a, m, k)), rand((*batch_b, k, n))])
    out = got["out0"]
    assert out.shape == (*np.broadcast_shapes(tuple(batch_a), tuple(batch_b)), m, n)


C_SHAPES = [None, (3, 5), (5,), (1, 5), (3, 1), (1,), ()]


@pytest.mark.parametrize("c", C_SHAPES)
@pytest.mark.parametrize(("trans_a", "trans_b"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemm(c: tuple[int, ...] | None, trans_a: int, trans_b: int) -> None:
    a = rand((4, 3) if trans_a else (3, 4))
    b = rand((5, 4) if trans_b else (4, 5))
    ins = [a, b] if c is None else [a, b, rand(c)]
    check_op("Gemm", ins, {"transA": trans_a, "transB": trans_b, "alpha": 0.5, "beta": 2.0})
    got = check_op("Gemm", ins, {"transA": trans_a, "transB": trans_b})
    assert got["out0"].shape == (3, 5)


@pytest.mark.parametrize("opset", [7, 9, 11, 13])
def test_gemm_opsets(opset: int) -> None:
    check_op("Gemm", [rand((3, 4)), rand((4, 5)), rand((5,))], {"alpha": 0.25}, opset=opset)
    check_op(
        "Gemm",
        [rand((4, 3), np.float64), rand((4, 5), np.float64), rand((3, 5), np.float64)],
        {"transA": 1, "beta": 0.5},
        opset=opset,
    )


def test_gemm_opset6_broadcast_attribute_is_dropped() -> None:
    # onnxruntime has no Gemm-6 kernel: compare with the formula directly.
    a, b, c = rand((3, 4)), rand((5, 4)), rand((5,))
    got = flowc_outputs("Gemm", [a, b, c], {"broadcast": 1, "transB": 1, "alpha": 2.0}, opset=6)
    np.testing.assert_allclose(got["out0"], 2.0 * a @ b.T + c, rtol=1e-5, atol=1e-5)


def test_gemm_integer() -> None:
    # onnxruntime has no integer Gemm kernel either.
    a, b, c = rand((3, 4), np.int32), rand((4, 5), np.int32), rand((3, 5), np.int32)
    got = flowc_outputs("Gemm", [a, b, c], {}, opset=13)["out0"]
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, a @ b + c)


def test_flops() -> None:
    f32 = DType.F32
    mm, gemm = get_op("MatMul"), get_op("Gemm")
    assert mm.flops is not None and gemm.flops is not None
    ins: list[TensorType | None] = [TensorType((2, 3, 4), f32), TensorType((4, 5), f32)]
    assert mm.flops(ins, [TensorType((2, 3, 5), f32)], Attrs()) == 2 * (2 * 3 * 5) * 4
    gins: list[TensorType | None] = [TensorType((4, 3), f32), TensorType((4, 5), f32)]
    attrs = Attrs({"transA": 1}).merged(gemm.attrs)
    # The product plus the alpha/beta epilogue.
    assert gemm.flops(gins, [TensorType((3, 5), f32)], attrs) == 2 * 15 * 4 + 2 * 15


@pytest.mark.parametrize(
    ("op", "inputs", "attrs", "message"),
    [
        ("MatMul", [rand((3, 4)), rand((5, 6))], {}, "inner dimensions differ"),
        ("MatMul", [rand((2, 3, 4)), rand((3, 4, 5))], {}, "do not broadcast"),
        ("MatMul", [rand((3, 4)), rand((4, 5), np.float64)], {}, "different element types"),
        ("Gemm", [rand((3, 4)), rand((5, 4))], {}, "inner dimensions differ"),
        ("Gemm", [rand((3, 4)), rand((4, 5)), rand((3, 4))], {}, "does not broadcast"),
        ("Gemm", [rand((2, 3, 4)), rand((4, 5))], {}, "must be 2-D"),
    ],
)
def test_errors(op: str, inputs: list[np.ndarray], attrs: dict[str, object], message: str) -> None:
    model, _ = make_op_model(op, inputs, attrs)
    with pytest.raises(ShapeError, match=message) as e:
        import_model(model)
    assert f"{op.lower()}_0" in str(e.value)
