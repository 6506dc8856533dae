"""GEMM plans made once in create(): run() only executes them (no cuBLASLt descriptor, layout,
preference or heuristic call in it); float16/bfloat16 GEMMs on the host against NumPy
(inputs in the narrow type, the product in float64, rounded once, as a tensor-core GEMM with
float32 accumulation rounds); the CUDA build of the same program compiles and links."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from flowc.compiler import compile_graph
from flowc.frontend.onnx import import_model
from flowc.harness.build import build, run
from flowc.ir.graph import Graph
from flowc.passes.manager import COMPILE_PIPELINE, PassManager

F16, BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
# One unit in the last place, relative: 10 and 7 stored mantissa bits.
ULP = {F16: 2.0**-10, BF16: 2.0**-7}
ONNX_TYPE = {F16: TensorProto.FLOAT16, BF16: TensorProto.BFLOAT16}


def _narrow(rng: np.random.Generator, dtype: np.dtype, *shape: int) -> np.ndarray:
    return rng.uniform(-1.0, 1.0, shape).astype(dtype)


def _model() -> tuple[onnx.ModelProto, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The model, its feeds, and each output's float64 value before the one rounding (the
    same each call: the build and the checks make it separately)."""
    rng = np.random.default_rng(3)
    feeds = {
        "a16": _narrow(rng, F16, 2, 3, 8),
        "x16": _narrow(rng, F16, 4, 8),
        "p16": _narrow(rng, F16, 2, 1, 3, 8),
        "q16": _narrow(rng, F16, 3, 8, 4),
        "u": _narrow(rng, BF16, 3, 8),
        "v": _narrow(rng, BF16, 8, 4),
    }
    w16, b16, c16 = _narrow(rng, F16, 8, 5), _narrow(rng, F16, 5, 8), _narrow(rng, F16, 5)
    wb, bb = _narrow(rng, BF16, 8, 4), _narrow(rng, BF16, 4)
    inits = [
        numpy_helper.from_array(w16, "w16"),
        numpy_helper.from_array(b16, "b16"),
        numpy_helper.from_array(c16, "c16"),
        helper.make_tensor("wb", TensorProto.BFLOAT16, wb.shape, wb.astype(np.float32).ravel()),
        helper.make_tensor("bb", TensorProto.BFLOAT16, bb.shape, bb.astype(np.float32).ravel()),
    ]
    nodes = [
        # Batched against a shared weight: one taller product.
        helper.make_node("MatMul", ["a16", "w16"], ["mm16"]),
        # Gemm's C as the bias epilogue, then a ReLU through widen_types' float32 casts.
        helper.make_node("Gemm", ["x16", "b16", "c16"], ["g16"], transB=1),
        helper.make_node("Relu", ["g16"], ["gemm16_relu"]),
        # Broadcast on both batch axes: a loop of strided calls.
        helper.make_node("MatMul", ["p16", "q16"], ["loop16"]),
        helper.make_node("MatMul", ["u", "v"], ["mmbf"]),
        helper.make_node("MatMul", ["u", "wb"], ["ub"]),
        helper.make_node("Add", ["ub", "bb"], ["biasbf"]),
    ]
    ins = [helper.make_tensor_value_info(k, ONNX_TYPE[a.dtype], a.shape) for k, a in feeds.items()]
    outs = [
        helper.make_empty_tensor_value_info(o)
        for o in ("mm16", "gemm16_relu", "loop16", "mmbf", "biasbf")
    ]
    graph = helper.make_graph(nodes, "narrow_gemms", ins, outs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 9

    def f(a: np.ndarray) -> np.ndarray:
        return a.astype(np.float64)

    exact = {
        "mm16": f(feeds["a16"]) @ f(w16),
        "gemm16_relu": np.maximum(f(feeds["x16"]) @ f(b16).T + f(c16), 0.0),
        "loop16": f(feeds["p16"]) @ f(feeds["q16"]),
        "mmbf": f(feeds["u"]) @ f(feeds["v"]),
        "biasbf": f(feeds["u"]) @ f(wb) + f(bb),
    }
    return model, feeds, exact


def _graph(model: onnx.ModelProto) -> Graph:
    return PassManager(COMPILE_PIPELINE).run(import_model(model))


@pytest.fixture(scope="module")
def host_project(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Graph]:
    model, _, _ = _model()
    graph = _graph(model)
    out = tmp_path_factory.mktemp("gemm_plans") / "out"
    compile_graph(graph, out, poison=True)
    bdir = build(out, "host", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
    return out, graph


def _between(text: str, start: str, end: str) -> str:
    i = text.index(start)
    return text[i : text.index(end, i)]


def test_run_only_executes_plans(host_project: tuple[Path, Graph]) -> None:
    out, graph = host_project
    code = (out / "model.cu").read_text()
    create = _between(code, "_create(const char* weights_path", "trace.open(")
    run_code = _between(code, "static int run_stage_0(", "_synchronize(")
    # No descriptor, layout, preference or heuristic work in run(): only the plans' calls.
    for word in ("cublasLt", "GemmDesc", "plan_gemm", "packed_gemm", "Heuristic"):
        assert word not in run_code, word
    gemms = sum(n.op in ("MatMul", "Gemm", "FusedGemm") for n in graph.nodes)
    plans = len(re.findall(r"flowc::plan_gemm\(", create))
    assert gemms == 5 and plans == gemms, (gemms, plans)
    assert len(re.findall(r"flowc::run_gemm\(", run_code)) == gemms
    # The narrow GEMMs are the library's (no widening casts around them), with the bias and
    # ReLU in its epilogue, and every plan states its operands' alignment.
    assert create.count("flowc::DataType::kF16") == 3 and create.count("kBF16") == 2
    assert "GemmEpilogue::kReluBias" in create and "GemmEpilogue::kBias" in create
    assert create.count("d.align_a = ") == plans
    assert "Cast" not in graph.op_counts() and "FusedElementwise" not in graph.op_counts()
    # The loop of calls over the unstridable batch axes executes one plan.
    assert re.search(r"for \(int64_t o = 0; o < 2; \+\+o\)", run_code)


def test_narrow_gemms_match_numpy(host_project: tuple[Path, Graph]) -> None:
    out, _ = host_project
    _, feeds, exact = _model()
    got, _ = run(out, feeds)
    for name, ref in exact.items():
        y = got[name]
        dt = y.dtype
        assert dt in ULP and y.shape == ref.shape, (name, dt, y.shape)
        rounded = ref.astype(dt).astype(np.float64)
        # float32 accumulation against float64: at most one rounding step apart.
        err = np.abs(y.astype(np.float64) - rounded)
        assert np.all(err <= ULP[dt] * np.maximum(np.abs(ref), 2.0**-14)), (name, err.max())
        # And the result is rounded once: most elements are exactly the rounded float64.
        assert np.mean(err == 0) >= 0.9, (name, np.mean(err == 0))


def test_tf32_precision_sets_the_compute_mode(tmp_path: Path) -> None:
    model, _, _ = _model()
    graph = _graph(model)
    out = tmp_path / "out"
    compile_graph(graph, out, precision="tf32")
    # Only the float32 GEMMs may round to TF32; this program's are all narrow.
    assert "d.tf32 = true" not in (out / "model.cu").read_text()
    f32 = helper.make_model(
        helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])],
            "f32",
            [
                helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4]),
                helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 2]),
            ],
            [helper.make_empty_tensor_value_info("y")],
        ),
        opset_imports=[helper.make_opsetid("", 20)],
    )
    f32.ir_version = 9
    for precision, expected in (("fp32", False), ("tf32", True)):
        out = tmp_path / precision
        compile_graph(_graph(f32), out, precision=precision)
        assert ("d.tf32 = true" in (out / "model.cu").read_text()) == expected, precision


def test_cuda_build_compiles_and_links(tmp_path: Path) -> None:
    from test_runtime import CUDA

    missing = CUDA.missing(["cublasLt"])
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"missing {', '.join(missing)} (CI must have them)")
        pytest.skip(f"no {', '.join(missing)} here: the CUDA build is not checked")
    model, _, _ = _model()
    out = tmp_path / "out"
    compile_graph(_graph(model), out, prefix="gemms")
    bdir = build(out, "cuda", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
    undefined = subprocess.run(
        ["nm", "-D", "--undefined-only", str(bdir / "libgemms_model.so")],
        capture_output=True,
        text=True,
    ).stdout
    for sym in (
        "cublasLtMatmul",
        "cublasLtMatmulAlgoGetHeuristic",
        "cublasLtMatmulPreferenceSetAttribute",
    ):
        assert sym in undefined, sym
