"""Convolution fusion: BatchNormalization folded into the preceding Conv/Gemm
(passes/fold_batchnorm.py), Conv + bias + residual + Relu as one FusedConv
(passes/fuse_conv.py), library plans made in create() (run() only executes them), float16 and
bfloat16 convolutions emitted natively; checked against onnxruntime on the host target, and
the CUDA build compiled and linked."""

from __future__ import annotations

import os
import re
import subprocess
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from conftest import SHARED_MODELS
from onnx import TensorProto, helper, numpy_helper
from test_models import LIGHT_DIR, _shared_io

from flowc.compiler import compile_graph
from flowc.frontend.onnx import ImportOptions, import_model, import_onnx
from flowc.harness.build import build, build_dir, run
from flowc.harness.compare import max_rel_error
from flowc.harness.ort import inference_mode, run_onnxruntime
from flowc.interpreter import evaluate
from flowc.ir.graph import is_splat
from flowc.passes.manager import COMPILE_PIPELINE, PassManager, compile_pipeline

F32, F16, BF16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16


def _exact(a: np.ndarray, narrow: type) -> np.ndarray:
    """``a`` rounded to ``narrow`` and back: float32 values the narrow type holds exactly."""
    return a.astype(narrow).astype(np.float32)


class _Model:
    """An onnx.helper graph under construction."""

    def __init__(self, seed: int = 14) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.n = 0

    def rand(self, *shape: int, lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
        return self.rng.uniform(lo, hi, shape).astype(np.float32)

    def const(self, a: np.ndarray, dtype: type | None = None) -> str:
        self.n += 1
        name = f"w{self.n}"
        arr = a if dtype is None else a.astype(dtype)
        if dtype is ml_dtypes.bfloat16:  # make_tensor rounds float values to bfloat16
            self.inits.append(helper.make_tensor(name, BF16, a.shape, a.flatten().tolist()))
        else:
            self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def op(self, op: str, inputs: list[str], **attrs: object) -> str:
        self.n += 1
        out = f"{op.lower()}{self.n}"
        self.nodes.append(helper.make_node(op, inputs, [out], name=f"n{self.n}", **attrs))
        return out

    def bn(self, x: str, c: int) -> str:
        return self.op(
            "BatchNormalization",
            [
                x,
                self.const(self.rand(c, lo=0.5, hi=1.5)),
                self.const(self.rand(c)),
                self.const(self.rand(c, lo=-0.5, hi=0.5)),
                self.const(self.rand(c, lo=0.5, hi=2.0)),
            ],
            epsilon=1e-3,
        )

    def model(
        self, inputs: list[tuple[str, int, list[int]]], outputs: list[str]
    ) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            "conv_fusion",
            [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
            [helper.make_empty_tensor_value_info(o) for o in outputs],
            initializer=self.inits,
        )
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        return m


def _patterns(narrow: bool) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Every fused pattern in one float32 model, and (``narrow``) a float16 and a bfloat16
    branch; ``narrow=False`` gives the same graph in float32 (the onnxruntime reference: the
    narrow branches' values are exactly representable, so only the result's rounding
    differs)."""
    m = _Model()
    _rand = m.rand
    x = "x"
    # Conv (no bias) -> BN -> Relu: folded, the BN's shift becomes the bias, Relu fused.
    r1 = m.op("Relu", [m.bn(m.op("Conv", [x, m.const(_rand(8, 3, 3, 3))], pads=[1] * 4), 8)])
    # Conv + bias -> BN -> Add(shortcut) -> Relu: ResNet's block end.
    c2 = m.op("Conv", [r1, m.const(_rand(8, 8, 3, 3) / 4), m.const(_rand(8))], pads=[1] * 4)
    r2 = m.op("Relu", [m.op("Add", [m.bn(c2, 8), r1])])
    # Conv -> Add(per-channel constant, an exporter's separate bias) -> Relu.
    r3 = m.op(
        "Relu",
        [m.op("Add", [m.op("Conv", [r2, m.const(_rand(8, 8, 1, 1))]), m.const(_rand(1, 8, 1, 1))])],
    )
    # Sum of two strided convolutions (a downsampling block's shortcut), no activation.
    c4 = m.op("Conv", [r2, m.const(_rand(4, 8, 3, 3) / 4), m.const(_rand(4))], strides=[2, 2])
    c5 = m.op("Conv", [r2, m.const(_rand(4, 8, 3, 3) / 4)], strides=[2, 2])
    out4 = m.op("Sum", [c4, c5])
    # A grouped convolution read twice (a graph output and a Relu): not fused.
    c6 = m.op("Conv", [r3, m.const(_rand(8, 4, 3, 3)), m.const(_rand(8))], pads=[1] * 4, group=2)
    out6 = m.op("Relu", [c6])
    # Asymmetric pads: the direct kernel, with the residual and the Relu in it.
    c7 = m.op("Conv", [r2, m.const(_rand(4, 8, 2, 2)), m.const(_rand(4))], pads=[0, 0, 1, 1])
    c8 = m.op("Conv", [r2, m.const(_rand(4, 8, 1, 1)), m.const(_rand(4))])
    out7 = m.op("Relu", [m.op("Add", [c7, c8])])
    # Gemm -> BN (rank 2): folded into B and C.
    flat = m.op("Flatten", [out4])
    gemm = m.op("Gemm", [flat, m.const(_rand(6, 64) / 8), m.const(_rand(6))], transB=1, beta=0.5)
    outg = m.bn(gemm, 6)
    outputs = [out4, c6, out6, out7, outg]
    inputs = [("x", F32, [1, 3, 9, 9])]
    feeds = {"x": _rand(1, 3, 9, 9)}
    # float16: Conv + bias + residual + Relu on float16 tensors.
    h, hz = _exact(_rand(1, 4, 7, 7), np.float16), _exact(_rand(1, 6, 7, 7), np.float16)
    t16 = F16 if narrow else F32
    d16 = np.float16 if narrow else None
    c16 = m.op(
        "Conv",
        [
            "h",
            m.const(_exact(_rand(6, 4, 3, 3), np.float16), d16),
            m.const(_exact(_rand(6), np.float16), d16),
        ],
        pads=[1] * 4,
    )
    outputs.append(m.op("Relu", [m.op("Add", [c16, "hz"])]))
    inputs += [("h", t16, [1, 4, 7, 7]), ("hz", t16, [1, 6, 7, 7])]
    feeds["h"], feeds["hz"] = (
        (h, hz) if not narrow else (h.astype(np.float16), hz.astype(np.float16))
    )
    # bfloat16 between casts (the model's edges stay float32): Conv + bias + Relu, computed by
    # the direct kernel (float accumulation, one rounding).
    bf = ml_dtypes.bfloat16
    b_in = m.op("Cast", ["xb"], to=BF16 if narrow else F32)
    cb = m.op(
        "Conv",
        [
            b_in,
            m.const(_exact(_rand(5, 4, 3, 3), bf), bf if narrow else None),
            m.const(_exact(_rand(5), bf), bf if narrow else None),
        ],
        strides=[2, 2],
        pads=[0, 0, 2, 2],  # asymmetric: the direct kernel, in bfloat16
    )
    outputs.append(m.op("Cast", [m.op("Relu", [cb])], to=F32))
    inputs.append(("xb", F32, [2, 4, 9, 9]))
    feeds["xb"] = _exact(_rand(2, 4, 9, 9), bf)
    return m.model(inputs, outputs), feeds


# Tolerance per output: float32, then one rounding to float16 / bfloat16.
_TOL = {"f32": 1e-4, "f16": 2e-3, "bf16": 1e-2}


def _tols(model: onnx.ModelProto) -> dict[str, float]:
    names = [o.name for o in model.graph.output]
    return {n: _TOL["f32"] for n in names[:-2]} | {names[-2]: _TOL["f16"], names[-1]: _TOL["bf16"]}


def _reference(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    ref_model, _ = _patterns(False)  # the same seed: the same weights
    return run_onnxruntime(ref_model, {k: np.asarray(v, np.float32) for k, v in feeds.items()})


def _passes(graph):  # type: ignore[no-untyped-def]
    return PassManager(COMPILE_PIPELINE).run(graph)


# -- the passes, against onnxruntime through flowc's NumPy reference -------------------------


def test_passes_fold_and_fuse_every_pattern() -> None:
    model, feeds = _patterns(True)
    graph = _passes(import_model(model))
    ops = graph.op_counts()
    assert "BatchNormalization" not in ops and "Add" not in ops and "Sum" not in ops, ops
    # conv1..3, the Sum (one of its two convolutions), conv7 with conv8's Add, float16, bfloat16.
    assert ops["FusedConv"] == 7, ops
    # c6 (read twice), the Sum's other operand, c8 (the residual): Conv with their bias.
    assert ops["Conv"] == 3, ops
    assert ops.get("Relu") == 1, ops  # c6's second reader
    fused = [n for n in graph.nodes if n.op == "FusedConv"]
    assert {n.attrs["activation"] for n in fused} == {"", "Relu"}
    assert sum(len(n.inputs) == 4 for n in fused) == 4  # the residuals: r1, Sum, c8, hz
    # The narrow convolutions stay in their types (no widening casts around them).
    narrow = [n for n in fused if n.outputs[0].type.dtype.short in ("f16", "bf16")]
    assert sorted(n.outputs[0].type.dtype.short for n in narrow) == ["bf16", "f16"]
    got = evaluate(graph, feeds)
    ref = _reference(feeds)
    for name, tol in _tols(model).items():
        assert max_rel_error(np.asarray(got[name], np.float32), ref[name]) <= tol, name


def test_fold_batchnorm_keeps_fills_splats_and_skips_shared_results() -> None:
    # Light ResNet-50's weights are ConstantOfShape fills: folding keeps them splats.
    graph = PassManager([*COMPILE_PIPELINE[:3], "fold_batchnorm"]).run(
        import_model(onnx.load(str(LIGHT_DIR / "light_resnet50.onnx")))
    )
    assert "BatchNormalization" not in graph.op_counts()
    held = [c.const for c in graph.constants if c.const is not None]
    assert sum(a.nbytes for a in held if not is_splat(a)) < 1 << 20
    # A Conv whose result is also read elsewhere keeps its BatchNormalization.
    m = _Model()
    c = m.op("Conv", ["x", m.const(m.rand(4, 3, 1, 1))])
    model = m.model([("x", F32, [1, 3, 4, 4])], [m.bn(c, 4), c])
    graph = _passes(import_model(model))
    assert graph.op_counts().get("BatchNormalization") == 1
    feeds = {"x": m.rand(1, 3, 4, 4)}
    got, ref = evaluate(graph, feeds), run_onnxruntime(model, feeds)
    for k in ref:
        assert max_rel_error(got[k], ref[k]) <= 1e-5, k


def test_caffe2_scale_and_shift_after_a_conv_fold() -> None:
    # Inception v2's spelling: Conv -> BN -> Mul(per-channel) -> Add(per-channel) -> Relu.
    m = _Model()
    c = m.op("Conv", ["x", m.const(m.rand(4, 3, 3, 3))], pads=[1] * 4)
    scaled = m.op("Mul", [m.const(m.rand(4, 1, 1)), m.bn(c, 4)])
    y = m.op("Relu", [m.op("Add", [scaled, m.const(m.rand(1, 4, 1, 1))])])
    model = m.model([("x", F32, [2, 3, 5, 5])], [y])
    graph = _passes(import_model(model))
    assert graph.op_counts() == {"FusedConv": 1}
    feeds = {"x": m.rand(2, 3, 5, 5)}
    got, ref = evaluate(graph, feeds), run_onnxruntime(model, feeds)
    assert max_rel_error(got[y], ref[y]) <= 1e-5


def test_resnet_tiny_fuses_and_matches_onnxruntime() -> None:
    feeds, _ = _shared_io("resnet_tiny")
    path = SHARED_MODELS / "resnet_tiny.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = import_onnx(path, ImportOptions(shapes={k: v.shape for k, v in feeds.items()}))
    graph = _passes(graph)
    ops = graph.op_counts()
    assert ops.get("FusedConv") == 13 and "Relu" not in ops and "Add" not in ops, ops
    got = evaluate(graph, feeds)
    ref = run_onnxruntime(inference_mode(onnx.load(str(path))), feeds)
    for k in ref:
        assert max_rel_error(got[k], ref[k]) <= 1e-4, k


# -- generated code ---------------------------------------------------------------------------


def _run_body(model_cu: str) -> str:
    start = model_cu.index("static int run_stage_0(")
    return model_cu[start : model_cu.index("\n}\n", start)]


def _create_body(model_cu: str) -> str:
    start = model_cu.index("_create(const char* weights_path")
    return model_cu[start : model_cu.index("\n}\n", start)]


def test_light_resnet50_bf16_launches_per_run(tmp_path: Path) -> None:
    """Item 7's goal, counted in the generated run(): kernels plus library calls."""
    graph = PassManager(compile_pipeline("bf16")).run(
        import_model(onnx.load(str(LIGHT_DIR / "light_resnet50.onnx")))
    )
    compile_graph(graph, tmp_path / "out", precision="bf16")
    src = (tmp_path / "out" / "model.cu").read_text()
    body = _run_body(src)
    kernels = body.count("FLOWC_LAUNCH(")
    calls = len(re.findall(r"flowc::Status st = flowc::run_(conv|gemm)\(", body))
    assert calls == 54  # 53 convolutions (BN, Relu, residual fused) and the classifier
    assert kernels + calls <= 70, (kernels, calls)
    assert "cudnn" not in body and "plan_conv" not in body and "ConvDesc" not in body
    # Repeated blocks share plans: fewer plans than convolutions, all made in create().
    plans = _create_body(src).count("flowc::plan_conv(")
    assert 0 < plans < 53


@pytest.fixture(scope="module")
def patterns_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    model, feeds = _patterns(True)
    out = tmp_path_factory.mktemp("conv_fusion") / "out"
    compile_graph(_passes(import_model(model)), out, poison=True)
    bdir = build(out, "host", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
    return out, feeds


def test_fused_patterns_compiled_match_onnxruntime(
    patterns_build: tuple[Path, dict[str, np.ndarray]],
) -> None:
    out, feeds = patterns_build
    model, _ = _patterns(True)
    ref = _reference(feeds)
    body = _run_body((out / "model.cu").read_text())
    # run() executes plans only: no descriptor, no algorithm query, no plan made per call.
    assert "plan_conv" not in body and "ConvDesc" not in body and "cudnn" not in body
    assert body.count("flowc::run_conv(") == 8  # all but the two asymmetric pads (direct kernel)
    # The fused call (one library call per convolution), then the named fallback: the plain
    # convolution and one epilogue kernel; with the race-revealing order too.
    # The emulated cuDNN refusing the fused call (FLOWC_SIM_REFUSE_FUSED_CONV) takes the same
    # fallback at the first call, with the plain convolution's own algorithm (tests/runtime/
    # libs.cu checks the algorithm).
    for env in (
        {},
        {"FLOWC_CONV_UNFUSED": "1"},
        {"FLOWC_SIM_REFUSE_FUSED_CONV": "1"},
        {"FLOWC_SIM_ORDER": "shuffle:3"},
    ):
        got, _ = run(out, feeds, env=env)
        for name, tol in _tols(model).items():
            assert max_rel_error(np.asarray(got[name], np.float32), ref[name]) <= tol, (env, name)
    # The emulator's per-kernel counts: the epilogue kernel runs only in the fallback, once
    # per library convolution with a bias, residual or ReLU (all 8 but the Sum's bias-free one),
    # in create()'s warm-up run and in the run: 2 x 7.
    assert _epilogue_kernels(out, feeds, {}) == 0
    assert _epilogue_kernels(out, feeds, {"FLOWC_CONV_UNFUSED": "1"}) == 14
    # Refused at the first call, every fused one (all 7 have a bias) falls back for good.
    assert _epilogue_kernels(out, feeds, {"FLOWC_SIM_REFUSE_FUSED_CONV": "1"}) == 14


def _epilogue_kernels(out: Path, feeds: dict[str, np.ndarray], env: dict[str, str]) -> int:
    args = [str(build_dir(out, "host") / "model_main"), "--weights", str(out / "weights.bin")]
    args += ["--out-dir", str(out)]
    for k, (name, a) in enumerate(feeds.items()):
        np.save(out / f"in{k}.npy", a)
        args += ["--input", f"{name}={out / f'in{k}.npy'}"]
    r = subprocess.run(
        args, capture_output=True, text=True, env={**os.environ, **env, "FLOWC_SIM_STATS": "1"}
    )
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stderr.splitlines() if line.strip()]
    return sum(int(row[1]) for row in rows if row[0].startswith("conv_epilogue"))


def test_fused_patterns_cuda_build_compiles_and_links(tmp_path: Path) -> None:
    from test_runtime import CUDA

    missing = CUDA.missing(["cublasLt", "cudnn"])
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"missing {', '.join(missing)} (CI must have them)")
        pytest.skip(f"no {', '.join(missing)} here: the CUDA build is not checked")
    model, _ = _patterns(True)
    out = tmp_path / "out"
    compile_graph(_passes(import_model(model)), out, precision="tf32")
    bdir = build(out, "cuda", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
    undefined = subprocess.run(
        ["nm", "-D", "--undefined-only", str(bdir / "libconv_fusion_model.so")],
        capture_output=True,
        text=True,
    ).stdout
    for sym in ("cudnnConvolutionBiasActivationForward", "cudnnGetConvolutionForwardAlgorithm_v7"):
        assert sym in undefined, sym
