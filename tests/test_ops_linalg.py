"""Einsum (lowered on import to Transpose/Reshape/Gather/ReduceSum/MatMul/Mul) and Det against
onnxruntime, plus the host build of these and the other ops added beside them (CumProd,
LpNormalization, ReverseSequence, TensorScatter, Scatter): one build per opset."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest
from opcheck import Case, check_compiled, check_op, make_op_model

from flowc.errors import ShapeError
from flowc.frontend.onnx import import_model
from flowc.interpreter import evaluate
from flowc.ir.graph import Attrs
from flowc.ops.registry import get_op

rng = np.random.default_rng(23)


def rand(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-4, 5, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


# -- Einsum -------------------------------------------------------------------------------------

EQUATIONS: list[tuple[str, list[tuple[int, ...]]]] = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),  # matmul
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),  # batch matmul
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]),  # attention scores
    ("ij,kj->ik", [(3, 4), (5, 4)]),
    ("ji,kj->ik", [(4, 3), (5, 4)]),
    ("abc, cd -> abd", [(2, 3, 4), (4, 5)]),  # spaces
    ("Ab,bC->AC", [(2, 3), (3, 4)]),  # upper case letters
    ("ij->ji", [(3, 4)]),  # transpose
    ("ba", [(2, 3)]),  # implicit: letters sorted, so a transpose
    ("ij->i", [(3, 4)]),  # sums
    ("ij->", [(3, 4)]),
    ("i,i", [(5,), (5,)]),  # inner product (implicit: a scalar)
    ("i,j->ij", [(3,), (4,)]),  # outer product
    ("ij,ij->ij", [(3, 4), (3, 4)]),  # element-wise
    ("ij,jk", [(2, 3), (3, 4)]),  # implicit output ik
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),  # a chain
    ("i,i,i->i", [(4,), (4,), (4,)]),
    ("ijk,ikl->", [(2, 3, 4), (2, 4, 5)]),  # a full contraction
    ("ii->i", [(4, 4)]),  # diagonal
    ("ii", [(4, 4)]),  # trace
    ("iji->ij", [(3, 2, 3)]),  # a diagonal over axes apart
    ("iii->i", [(3, 3, 3)]),
    ("ij,jj->i", [(2, 3), (3, 3)]),  # a diagonal inside a product
    ("...ii->...i", [(2, 3, 4, 4)]),  # batch diagonal
    ("...i->...", [(2, 3, 4)]),
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (2, 5, 4, 2)]),  # ellipsis axes broadcast
    ("ij...,jk...->ik...", [(2, 3, 6), (3, 4, 1)]),
    ("i...,i...->...", [(2, 3, 1), (2, 1, 4)]),  # summed letter, broadcast ellipsis
    ("->", [()]),  # a scalar
    ("ij,jk->ik", [(3, 0), (0, 5)]),  # an empty contraction: zeros
]


@pytest.mark.parametrize(("equation", "shapes"), EQUATIONS)
def test_einsum(equation: str, shapes: list[tuple[int, ...]]) -> None:
    # Data seeded by the case, not by test order (xdist runs tests in any order); a trace of
    # random numbers can cancel to near zero, so the relative error gets 1e-4.
    r = np.random.default_rng(zlib.crc32(f"{equation}{shapes}".encode()))
    xs = [r.standard_normal(s).astype(np.float32) for s in shapes]
    got = check_op("Einsum", xs, {"equation": equation}, opset=12, tol=1e-4)
    # The Einsum op's own reference (what a DSL program evaluates) agrees with the lowering.
    want = get_op("Einsum").evaluate(list(xs), Attrs({"equation": equation}))[0]
    model, feeds = make_op_model("Einsum", xs, {"equation": equation}, opset=12)
    lowered = evaluate(import_model(model), feeds)["out0"]
    assert lowered.shape == want.shape == got["out0"].shape
    np.testing.assert_allclose(lowered, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int64])
@pytest.mark.parametrize(
    ("equation", "shapes"),
    [("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]), ("i,j->ij", [(3,), (4,)]), ("ii->i", [(3, 3)])],
)
def test_einsum_types(equation: str, shapes: list[tuple[int, ...]], dtype: Any) -> None:
    got = check_op("Einsum", [rand(*s, dtype=dtype) for s in shapes], {"equation": equation})
    assert got["out0"].dtype == dtype


def test_einsum_lowers_to_existing_ops() -> None:
    model, _ = make_op_model(
        "Einsum", [rand(2, 3, 4), rand(2, 4, 5)], {"equation": "bij,bjk->bki"}, opset=12
    )
    ops = [n.op for n in import_model(model).nodes]
    assert "Einsum" not in ops and "MatMul" in ops and "Transpose" in ops
    # An outer product multiplies with broadcasting: nothing to contract.
    model, _ = make_op_model("Einsum", [rand(3), rand(4)], {"equation": "i,j->ij"}, opset=12)
    assert "Mul" in [n.op for n in import_model(model).nodes]


@pytest.mark.parametrize("dtype", [np.int16, np.uint8])
@pytest.mark.parametrize(
    ("equation", "shapes"),
    [("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]), ("ij,jj->i", [(2, 3), (3, 3)])],
)
def test_einsum_without_matmul_multiplies_and_sums(
    equation: str, shapes: list[tuple[int, ...]], dtype: Any
) -> None:
    # MatMul has no kernel for these types: the product is a broadcast Mul and a ReduceSum.
    # (onnxruntime has no Einsum for them either: compare with the op's own reference.)
    xs = [rng.integers(0, 5, s).astype(dtype) for s in shapes]
    model, feeds = make_op_model("Einsum", xs, {"equation": equation}, opset=12)
    g = import_model(model)
    assert "MatMul" not in [n.op for n in g.nodes] and "Mul" in [n.op for n in g.nodes]
    want = get_op("Einsum").evaluate(list(xs), Attrs({"equation": equation}))[0]
    got = evaluate(g, feeds)["out0"]
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, want)


def test_einsum_upper_case_implicit() -> None:
    # onnxruntime rejects upper case letters in implicit form (the specification allows them:
    # upper case sorts before lower case), so compare with NumPy.
    x = rand(2, 3)
    model, feeds = make_op_model("Einsum", [x], {"equation": "bA"}, opset=12)
    got = evaluate(import_model(model), feeds)["out0"]
    np.testing.assert_array_equal(got, np.einsum("bA", x))
    assert got.shape == (3, 2)


@pytest.mark.parametrize(
    ("equation", "shapes", "message"),
    [
        ("ij,jk->ik", [(3, 4)], "2 operand term"),
        ("ij->ij", [(3, 4, 5)], "names 2 axes but the operand has rank 3"),
        ("ij,jk->ik", [(3, 4), (5, 6)], "letter 'j' has size 4 in one operand and 5"),
        ("i1->i", [(3, 3)], "only letters and one ellipsis"),
        ("..i->i", [(3, 3)], "only letters and one ellipsis"),
        ("ij->k", [(3, 4)], "output letter 'k' appears in no operand"),
        ("ij->ii", [(3, 3)], "repeats a letter"),
        ("ij->i->j", [(3, 3)], "more than one '->'"),
        ("...ij,...jk->...ik", [(2, 1, 3, 4), (5, 4, 2)], "every ellipsis must stand for"),
        ("...ij->ij", [(2, 3, 4)], "no ellipsis to put them in"),
        ("...i,...i->...", [(2, 3), (4, 3)], "an ellipsis axis has size 2"),
    ],
)
def test_einsum_errors(equation: str, shapes: list[tuple[int, ...]], message: str) -> None:
    model, _ = make_op_model("Einsum", [rand(*s) for s in shapes], {"equation": equation})
    with pytest.raises(ShapeError, match=message) as e:
        import_model(model)
    assert "einsum_0" in str(e.value)


def test_einsum_needs_matching_numeric_types() -> None:
    model, _ = make_op_model("Einsum", [rand(3), rand(3, dtype=np.float64)], {"equation": "i,i"})
    with pytest.raises(ShapeError, match="different element types"):
        import_model(model)
    model, _ = make_op_model("Einsum", [np.ones(3, np.bool_)], {"equation": "i"})
    with pytest.raises(ShapeError, match="numeric"):
        import_model(model)


# -- Det ------------------------------------------------------------------------------------------


DET_SHAPES = [(2, 2), (1, 1), (3, 3), (4, 3, 3), (2, 2, 5, 5), (0, 3, 3), (8, 8)]


@pytest.mark.parametrize("shape", DET_SHAPES)
def test_det(shape: tuple[int, ...]) -> None:
    got = check_op("Det", [rand(*shape)], {}, opset=22, tol=1e-4)
    assert got["out0"].shape == shape[:-2] and got["out0"].dtype == np.float32


@pytest.mark.parametrize("shape", DET_SHAPES)
def test_det_float64(shape: tuple[int, ...]) -> None:
    # onnxruntime has no float64 Det: compare with NumPy.
    x = rand(*shape, dtype=np.float64)
    model, feeds = make_op_model("Det", [x], {}, opset=22)
    got = evaluate(import_model(model), feeds)["out0"]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, np.linalg.det(x), rtol=1e-12)


def test_det_singular_and_permuted() -> None:
    singular = np.array([[1, 2, 3], [2, 4, 6], [0, 1, 1]], np.float32)
    swap = np.array([[0, 1], [1, 0]], np.float32)  # a pivot must swap rows: det -1
    got = check_op("Det", [np.stack([singular[:2, :2] * 0, swap])], {}, opset=22)["out0"]
    np.testing.assert_array_equal(got, [0, -1])
    assert check_op("Det", [singular], {}, opset=22)["out0"] == 0


@pytest.mark.parametrize(
    ("x", "message"),
    [
        (rand(2, 3), "square matrices"),
        (rand(3), "square matrices"),
        (rand(2, 2, dtype=np.int32), "floating-point"),
    ],
)
def test_det_errors(x: np.ndarray, message: str) -> None:
    model, _ = make_op_model("Det", [x], {}, opset=22)
    with pytest.raises(ShapeError, match=message):
        import_model(model)


# -- the host build -------------------------------------------------------------------------------


def test_linalg_and_new_ops_compiled(tmp_path) -> None:  # type: ignore[no-untyped-def]
    axis = np.array(1, np.int64)
    cases = [
        Case("Einsum", [rand(*s) for s in shapes], {"equation": eq}) for eq, shapes in EQUATIONS
    ]
    cases += [
        Case(
            "Einsum",
            [rand(2, 3, 4, dtype=np.int64), rand(2, 4, 5, dtype=np.int64)],
            {"equation": "bij,bjk->bik"},
        ),
        Case("Einsum", [rand(3, dtype=np.int32), rand(4, dtype=np.int32)], {"equation": "i,j->ij"}),
        Case("Det", [rand(2, 2)], tol=1e-4),
        Case("Det", [rand(3, 4, 4)], tol=1e-4),
        Case("Det", [rand(5, 5, 6, 6)], tol=1e-4),
        Case("Det", [np.array([[0, 1, 2], [1, 0, 3], [2, 3, 0]], np.float32)]),
        Case(
            "CumProd", [rng.uniform(0.5, 1.5, (3, 4, 5)).astype(np.float32), axis], const_inputs=[1]
        ),
        Case(
            "CumProd",
            [rand(4, 6, dtype=np.int64), np.array(-1, np.int32)],
            {"exclusive": 1, "reverse": 1},
            const_inputs=[1],
        ),
        Case(
            "CumProd",
            [rand(5, 3, dtype=np.int32), np.array(0, np.int64)],
            {"reverse": 1},
            const_inputs=[1],
        ),
        Case(
            "CumProd",
            [rand(7, dtype=np.float64), np.array(0, np.int64)],
            {"exclusive": 1},
            const_inputs=[1],
        ),
        Case("LpNormalization", [rand(3, 4, 5)]),
        Case("LpNormalization", [rand(3, 4, 5)], {"p": 1, "axis": 1}),
        Case("LpNormalization", [rand(2, 700)], {"p": 2, "axis": -1}),
        Case("LpNormalization", [np.zeros((2, 3), np.float32)], {"p": 2, "axis": 0}),
        Case("LpNormalization", [rand(4, 3, dtype=np.float64)], {"p": 1, "axis": 0}),
        Case(
            "ReverseSequence",
            [rand(4, 5, 3), np.array([5, 0, 3, 1], np.int64)],
            {"batch_axis": 0, "time_axis": 1},
        ),
        Case("ReverseSequence", [rand(5, 3, 2, 2, dtype=np.int64), np.array([2, 5, 4], np.int64)]),
        Case("TensorScatter", [rand(2, 3, 6, 4), rand(2, 3, 2, 4), np.array([1, 4], np.int64)]),
        Case(
            "TensorScatter",
            [rand(3, 5, 2), rand(3, 3, 2), np.array([4, 0, 7], np.int64)],
            {"axis": 1, "mode": "circular"},
        ),
        Case(
            "TensorScatter",
            [rand(2, 4, 3, dtype=np.float64), rand(2, 4, 2, dtype=np.float64)],
            {"axis": -1},
        ),
    ]
    code = check_compiled(cases, tmp_path, opset=26)
    log = tmp_path / "project" / "build-host" / "flowc-build.log"
    assert "warning" not in log.read_text().lower()
    # Einsum compiles through existing kernels (a MatMul among them), Det through its own.
    assert "_det(" in code and "_cumulative(" in code and "_lp_normalize(" in code
