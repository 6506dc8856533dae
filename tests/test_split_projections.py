"""split_projections: a projection whose output is split on its columns becomes one
projection per chunk, computing the same values (checked with the NumPy reference)."""

from __future__ import annotations

import warnings

import numpy as np
from conftest import SHARED_MODELS

from flowc.errors import FlowcWarning
from flowc.frontend import load_graph
from flowc.interpreter import evaluate, random_inputs
from flowc.ir import DType, Graph, TensorType
from flowc.ir.builder import GraphBuilder
from flowc.ir.verify import verify_graph
from flowc.passes.manager import PassManager
from flowc.passes.split_projections import split_projections


def _same_outputs(before: Graph, after: Graph, feeds: dict[str, np.ndarray]) -> None:
    a, b = evaluate(before, feeds), evaluate(after, feeds)
    assert list(a) == list(b)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6)


def test_gpt2_attention_projections_are_split() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlowcWarning)
        g = PassManager(("fold_constants", "simplify")).run(
            load_graph(SHARED_MODELS / "gpt2_tiny.onnx")
        )
    feeds = random_inputs(g, seed=0)
    ref = evaluate(g, feeds)
    gemms, splits = g.op_counts()["Gemm"], g.op_counts()["Split"]
    g = split_projections(g)
    verify_graph(g)
    assert "Split" not in g.op_counts()
    assert g.op_counts()["Gemm"] == gemms + 2 * splits  # q, k, v instead of one, per layer
    for k, v in evaluate(g, feeds).items():
        np.testing.assert_allclose(v, ref[k], rtol=1e-5, atol=1e-6)


def _projection(op: str, sizes: list[int] | None, trans_b: int = 0, bias: bool = False) -> Graph:
    g = Graph("p")
    b = GraphBuilder(g, fold=False)
    rng = np.random.default_rng(0)
    x = g.add_input("x", TensorType((6, 8), DType.F32))
    w_shape = (12, 8) if trans_b else (8, 12)
    w = b.constant("w", rng.standard_normal(w_shape).astype(np.float32))
    ins = [x, w]
    attrs = {"transB": trans_b} if op == "Gemm" else {}
    if bias:
        ins.append(b.constant("c", rng.standard_normal(12).astype(np.float32)))
    (y,) = b.emit(op, ins, attrs, name="proj")
    shape = b.constant("shape", np.array([2, 3, 12], np.int64))
    (r,) = b.emit("Reshape", [y, shape], name="view")
    split_in = [r]
    if sizes is not None:
        split_in.append(b.constant("sizes", np.array(sizes, np.int64)))
    n = len(sizes) if sizes is not None else 3
    outs = b.emit(
        "Split",
        split_in,
        {"axis": -1, "num_outputs": n} if sizes is None else {"axis": 2},
        name="split",
        num_outputs=n,
    )
    (s,) = b.emit("Sum", [outs[0], outs[-1]], name="use")
    g.outputs = [s, *outs[1:-1]]
    return g


def test_matmul_and_gemm_with_bias_and_uneven_chunks() -> None:
    for op, sizes, trans_b, bias in [
        ("MatMul", None, 0, False),
        ("Gemm", [3, 6, 3], 1, True),
        ("Gemm", [4, 4, 4], 0, True),
    ]:
        g = _projection(op, sizes, trans_b, bias)
        before = _projection(op, sizes, trans_b, bias)
        feeds = random_inputs(g, seed=1)
        split_projections(g)
        verify_graph(g)
        assert "Split" not in g.op_counts(), (op, sizes)
        assert g.op_counts()[op] == 3
        _same_outputs(before, g, feeds)


def test_a_projection_read_elsewhere_is_left_alone() -> None:
    g = _projection("MatMul", None)
    proj = next(n for n in g.nodes if n.op == "MatMul")
    g.outputs.append(proj.outputs[0])  # the fused result is needed whole
    split_projections(g)
    assert g.op_counts()["Split"] == 1 and g.op_counts()["MatMul"] == 1
