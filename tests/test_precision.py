"""--precision: narrow storage (bf16/fp16) and the float32 math modes, checked against
onnxruntime's float32 result on the host target, and the CUDA builds of narrow programs
compile and link warning-free."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import SHARED_MODELS, run_cli
from onnx import TensorProto, helper, numpy_helper

from flowc.compiler import compile_graph
from flowc.frontend import ImportOptions, load_graph
from flowc.frontend.onnx import import_model
from flowc.harness.build import build, run
from flowc.harness.compare import max_rel_error
from flowc.harness.ort import run_onnxruntime
from flowc.interpreter import evaluate
from flowc.ir.dtype import DType
from flowc.passes.manager import PassManager, compile_pipeline

F32_MIN = float(np.finfo(np.float32).min)


def masked_scores() -> onnx.ModelProto:
    """Scores plus an additive mask spelled with float32's most negative value, as
    transformers' exporters write it, then a softmax: in float16 the mask must stay finite
    (0 x mask is 0, a masked row keeps its finite maximum)."""
    nodes = [
        helper.make_node("Sub", ["one", "m"], ["inv"]),
        helper.make_node("Mul", ["inv", "fmin"], ["bias"]),
        helper.make_node("Add", ["s", "bias"], ["t"]),
        helper.make_node("Softmax", ["t"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "masked",
        [
            helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 8]),
            helper.make_tensor_value_info("m", TensorProto.FLOAT, [2, 8]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [
            numpy_helper.from_array(np.array(1.0, np.float32), "one"),
            numpy_helper.from_array(np.array(F32_MIN, np.float32), "fmin"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def prepared(model: onnx.ModelProto, precision: str) -> object:
    return PassManager(compile_pipeline(precision)).run(import_model(model))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_storage_is_narrow_inside_and_float32_at_the_edges(precision: str) -> None:
    narrow = DType.BF16 if precision == "bf16" else DType.F16
    # Right after the storage pass: every float32 constant and value is narrow.
    g = PassManager(("lower_ops", f"store_{precision}")).run(import_model(masked_scores()))
    assert {c.type.dtype for c in g.constants} == {narrow}
    limit = float(np.finfo(narrow.np).max)
    for c in g.constants:
        # float32's minimum is clamped to the narrow type's most negative finite value.
        assert c.const is not None
        assert np.isfinite(c.const.astype(np.float32)).all()
        assert c.const.astype(np.float32).min() >= -limit
    assert {o.type.dtype for n in g.nodes[:-1] for o in n.outputs} == {narrow}
    g = prepared(masked_scores(), precision)
    assert [(v.name, v.type.dtype) for v in g.inputs] == [("s", DType.F32), ("m", DType.F32)]
    assert [(v.name, v.type.dtype) for v in g.outputs] == [("y", DType.F32)]


def test_fp16_mask_of_float32_min_gives_no_nan() -> None:
    # The rounding points of the compiled program, run by the interpreter (bert_tiny's fp16
    # host build below runs a mask of this kind through the kernels).
    model = masked_scores()
    rng = np.random.default_rng(0)
    s = rng.standard_normal((2, 8)).astype(np.float32)
    m = np.ones((2, 8), np.float32)
    m[0, 5:] = 0  # padding
    feeds = {"s": s, "m": m}
    ref = run_onnxruntime(model, feeds)["y"]
    got = evaluate(prepared(model, "fp16"), feeds)  # type: ignore[arg-type]
    assert np.isfinite(got["y"]).all()
    assert (got["y"][0, 5:] == 0).all()
    assert max_rel_error(got["y"], ref) < 1e-2


def _bert_feeds() -> dict[str, np.ndarray]:
    io = np.load(SHARED_MODELS / "bert_tiny.io.npz")
    ids = io["in:input_ids"]
    mask = io["in:attention_mask"].copy()
    mask[1, 20:] = 0  # the second sequence is padded
    return {"input_ids": ids, "attention_mask": mask}


# The error of each precision's rounding (max|got-ref| / max|ref| against onnxruntime's
# float32) on bert_tiny, as measured: about 1e-3 at fp16, 1e-2 at bf16 (8 significant bits).
# Twice those is the bound (docs/performance.md).
BERT_BOUND = {"fp16": 3e-3, "bf16": 3e-2}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_bert_tiny_with_padding_matches_onnxruntime(precision: str, tmp_path: Path) -> None:
    feeds = _bert_feeds()
    path = SHARED_MODELS / "bert_tiny.onnx"
    ref = run_onnxruntime(onnx.load(str(path)), feeds)
    graph = load_graph(path, ImportOptions(shapes={k: v.shape for k, v in feeds.items()}))
    graph = PassManager(compile_pipeline(precision)).run(graph)
    if precision == "bf16":
        # The interpreter runs the same rounding points; no build needed for the second one.
        got = evaluate(graph, feeds)
    else:
        out = tmp_path / "out"
        compile_graph(graph, out, precision=precision)
        build(out, "host", quick=True)
        got, _ = run(out, feeds, target="host")
    for name, r in ref.items():
        assert np.isfinite(got[name]).all()
        assert max_rel_error(got[name], r) < BERT_BOUND[precision], name


def test_verify_takes_precision_and_tf32_is_float32_storage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = run_cli(
        ["verify", str(SHARED_MODELS / "mlp.onnx"), "--precision", "bf16", "--target", "host"],
        capsys,
    )
    assert code == 0, text
    assert "PASS" in text
    out = tmp_path / "tf32"
    code, text = run_cli(
        ["compile", str(SHARED_MODELS / "mlp.onnx"), "-o", str(out), "--precision", "tf32"],
        capsys,
    )
    assert code == 0, text
    import json

    assert json.loads((out / "flowc_model.json").read_text())["precision"] == "tf32"
    code, text = run_cli(
        [
            "compile",
            str(SHARED_MODELS / "mlp.onnx"),
            "-o",
            str(tmp_path / "m"),
            "--precision",
            "fp16",
            "--mesh",
            "2",
        ],
        capsys,
    )
    # A mesh takes every precision (tests/test_option_matrix.py runs them all).
    assert code == 0, text
    meta = json.loads((tmp_path / "m" / "flowc_model.json").read_text())
    assert meta["precision"] == "fp16"


@pytest.mark.parametrize(("name", "precision"), [("bert_tiny", "bf16"), ("resnet_tiny", "fp16")])
def test_cuda_build_of_narrow_program_compiles_and_links(
    name: str, precision: str, tmp_path: Path
) -> None:
    from test_runtime import CUDA

    missing = CUDA.missing(["cublasLt", "cudnn"])
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"missing {', '.join(missing)} (CI must have them)")
        pytest.skip(f"no {', '.join(missing)} here: the CUDA build is not checked")
    io = np.load(SHARED_MODELS / f"{name}.io.npz")
    shapes = {k[3:]: io[k].shape for k in io.files if k.startswith("in:")}
    graph = load_graph(SHARED_MODELS / f"{name}.onnx", ImportOptions(shapes=shapes))
    graph = PassManager(compile_pipeline(precision)).run(graph)
    out = tmp_path / "out"
    compile_graph(graph, out, prefix=name, precision=precision)
    bdir = build(out, "cuda", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
