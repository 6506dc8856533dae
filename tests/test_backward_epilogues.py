"""Training's backward products with cuBLASLt's backward epilogues: fuse_gelu makes an
exporter's GELU one Gelu before the backward is built; fuse_gemm gives the product that
computes a GELU's output gradient the DGELU epilogue (with the bias gradient of the layer
before it: DGELU_BGRAD) and a weight-gradient product its bias's gradient (BGRADA/BGRADB).
Checked against onnxruntime (the GELU spellings), NumPy in float64 (the FusedGemm's
reference and its host build) and JAX + optax (a GELU MLP trained for 20 AdamW steps)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import optax
import pytest
from jax_reference import forward
from onnx import TensorProto, helper, numpy_helper
from test_fuse_gemm import _Model, _tanh_gelu, fusion_model

from flowc.compiler import compile_graph
from flowc.frontend.onnx import ImportOptions, import_model
from flowc.harness.build import build, run
from flowc.harness.compare import max_rel_error
from flowc.harness.ort import run_onnxruntime
from flowc.interpreter import evaluate
from flowc.ir.builder import GraphBuilder
from flowc.ir.dtype import DType
from flowc.ir.graph import Graph
from flowc.ir.types import TensorType
from flowc.passes.manager import PassManager
from flowc.trainer import compile_step, load_data, run_steps, spec_from

jax.config.update("jax_enable_x64", True)


def test_fuse_gelu_makes_each_spelling_one_gelu() -> None:
    m = fusion_model()
    graph = import_model(m.proto(), ImportOptions())
    graph = PassManager(["fold_constants", "simplify", "fuse_gelu"]).run(graph)
    gelus = {
        n.outputs[0].name: n.attrs.get("approximate", "none") for n in graph.nodes if n.op == "Gelu"
    }
    assert gelus == {
        "gelu_pow": "tanh",
        "gelu_cube": "tanh",
        "gelu_erf": "none",
        "onnx_gelu_tanh": "tanh",
        "onnx_gelu_erf": "none",
    }
    assert not any(n.op in ("Tanh", "Erf", "Pow") for n in graph.nodes)
    want = run_onnxruntime(m.proto(), m.feeds)
    got = evaluate(graph, m.feeds)
    for name in gelus:
        assert max_rel_error(got[name], want[name]) < 1e-6, name


def _product(attrs: dict[str, Any], aux: bool) -> Graph:
    """One FusedGemm with a backward epilogue: op(A) [9, 13], op(B) [13, 16]."""
    ta, tb = bool(attrs.get("transA")), bool(attrs.get("transB"))
    g = Graph("backward_epilogue")
    a = g.add_input("a", TensorType((13, 9) if ta else (9, 13), DType.F32))
    w = g.add_input("b", TensorType((16, 13) if tb else (13, 16), DType.F32))
    ins: list[Any] = [a, w]
    if aux:
        ins += [None, None, g.add_input("x", TensorType((9, 16), DType.F32))]
    outs = GraphBuilder(g).emit(
        "FusedGemm", ins, attrs, num_outputs=2 if attrs.get("bias_grad") else 1
    )
    g.outputs = list(outs)
    return g


def _float64_want(feeds: dict[str, np.ndarray], attrs: dict[str, Any]) -> list[np.ndarray]:
    a = feeds["a"].astype(np.float64)
    w = feeds["b"].astype(np.float64)
    a = a.T if attrs.get("transA") else a
    w = w.T if attrs.get("transB") else w
    y = a @ w
    if attrs.get("activation") == "dgelu_tanh":
        x = feeds["x"].astype(np.float64)
        c, k = np.sqrt(2 / np.pi), 0.044715
        t = np.tanh(c * (x + k * x**3))
        y = y * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * k * x * x))
    sums = {"a": lambda: a.sum(1), "b": lambda: w.sum(0), "out": lambda: y.sum(0)}
    grad = attrs.get("bias_grad")
    return [y, sums[grad]()] if grad else [y]


CASES = [
    {"activation": "dgelu_tanh"},
    {"activation": "dgelu_tanh", "bias_grad": "out", "transB": 1},
    {"bias_grad": "a", "transA": 1},
    {"bias_grad": "b"},
    {"bias_grad": "b", "transA": 1, "transB": 1},
]


@pytest.mark.parametrize("attrs", CASES, ids=lambda a: "-".join(f"{k}={v}" for k, v in a.items()))
def test_backward_epilogue_reference_and_host_build(attrs: dict[str, Any], tmp_path: Path) -> None:
    graph = _product(attrs, aux=attrs.get("activation") == "dgelu_tanh")
    rng = np.random.default_rng(2)
    feeds = {v.name: rng.uniform(-2, 2, v.type.shape).astype(np.float32) for v in graph.inputs}
    want = _float64_want(feeds, attrs)
    ref = evaluate(graph, feeds)
    for o, w in zip(graph.outputs, want, strict=True):
        assert max_rel_error(ref[o.name], w) < 1e-6, o.name
    out = tmp_path / "p"
    compile_graph(graph, out, poison=True)
    assert "flowc::GemmEpilogueIo" in "".join(p.read_text() for p in out.rglob("*.cu"))
    build(out, "host", quick=True)
    got, _ = run(out, feeds)
    for o, w in zip(graph.outputs, want, strict=True):
        assert max_rel_error(got[o.name], w) < 1e-5, o.name


def test_a_backward_epilogue_is_refused_where_it_does_not_apply() -> None:
    from flowc.errors import FlowcError

    for attrs, aux, says in [
        ({"activation": "dgelu_tanh"}, False, "reads the GELU's input"),
        ({"bias_grad": "out"}, False, "comes with activation dgelu_tanh"),
        ({"bias_grad": "b", "alpha": 2.0}, False, "no bias, residual or alpha"),
        ({"bias_grad": "c"}, False, "bias_grad must be one of"),
    ]:
        with pytest.raises(FlowcError, match=says):
            _product(attrs, aux)


def _gelu_mlp(path: Path) -> Path:
    """x [4, 6, 8] -> Linear(8, 16) + ReLU -> Linear(16, 16) + tanh GELU (the exporters'
    spelling) -> as [24, 16], Gemm(16 -> 4, transB, C = bias) -> y [4, 6, 4]."""
    rng = np.random.default_rng(4)
    m = _Model()
    m.inputs.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6, 8]))

    def weight(name: str, *shape: int) -> str:
        w = rng.uniform(-0.5, 0.5, shape).astype(np.float32)
        m.inits.append(numpy_helper.from_array(w, name))
        return name

    h0 = m.op("Relu", m.op("Add", m.op("MatMul", "x", weight("w0", 8, 16)), weight("b0", 16)))
    h1 = m.op("Add", m.op("MatMul", h0, weight("w1", 16, 16)), weight("b1", 16))
    g = m.op("Reshape", _tanh_gelu(m, h1, cube=False, out="gelu"), m.const_i64([24, 16]))
    z = m.op("Gemm", g, weight("w2", 4, 16), weight("b2", 4), transB=1)
    m.op("Reshape", z, m.const_i64([4, 6, 4]), out="y")
    m.output("y")
    onnx.save(m.proto(), str(path))
    return path


@pytest.mark.parametrize(("precision", "tol"), [("fp32", 1e-5), ("bf16", 3e-2)])
def test_a_gelu_mlp_trains_with_the_backward_epilogues_as_jax_does(
    tmp_path: Path, precision: str, tol: float
) -> None:
    """Float32 against JAX in float64 at 1e-5; bfloat16 (the epilogues found through
    widen_types' casts, the bias gradients rounded to bfloat16 as the product is) within 3%."""
    model = _gelu_mlp(tmp_path / "mlp.onnx")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((8, 6, 8)).astype(np.float32)
    target = rng.standard_normal((8, 6, 4)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, y_true=target)
    spec = spec_from("mse:y,y_true", "adamw:lr=0.01")
    step, project = compile_step(
        model, spec, tmp_path / "s", batch=4, target="host", precision=precision
    )
    epilogues = sorted(
        (str(n.attrs.get("activation", "none")), str(n.attrs.get("bias_grad", "")))
        for n in step.graph.nodes
        if n.op == "FusedGemm"
    )
    # W2's gradient with b2's (Gemm's VJP reads dy^T: op(A)), the GELU's gradient with
    # b1's (the result's columns), W0's with b0's (op(B): the ReLU's gradient).
    assert ("none", "a") in epilogues and ("none", "b") in epilogues, epilogues
    assert ("dgelu_tanh", "out") in epilogues, epilogues
    # The GELU is one node: its backward keeps its input alone.
    assert step.graph.op_counts().get("Tanh") is None
    project.build("host", quick=True)
    arrays = load_data(tmp_path / "d.npz", step)
    with project.load("host") as loaded:
        got = run_steps(loaded, step, arrays, steps=20, batch=4, shuffle=False)

    proto = onnx.load(str(model))
    f = forward(proto)
    params = {
        t.name: jnp.asarray(numpy_helper.to_array(t), jnp.float64)
        for t in proto.graph.initializer
        if t.name.startswith(("w", "b"))
    }

    def loss_fn(p: Any, xb: Any, yb: Any) -> Any:
        return ((f(p, {"x": xb})["y"] - yb) ** 2).mean()

    tx = optax.adamw(0.01, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
    state, want = tx.init(params), []
    grad_fn = jax.value_and_grad(loss_fn)
    for s in range(20):
        idx = np.arange(s * 4, s * 4 + 4) % 8
        xb, yb = (jnp.asarray(a[idx], jnp.float64) for a in (x, target))
        loss, g = grad_fn(params, xb, yb)
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
        want.append(float(loss))
    worst = max(abs(a - b) / abs(b) for a, b in zip(got.losses, want, strict=True))
    assert worst < tol, (worst, got.losses[:3], want[:3])


def test_the_backward_epilogues_build_for_cuda_without_a_warning(tmp_path: Path) -> None:
    """The GELU MLP's bf16 step (DGELU_BGRAD, BGRADA and BGRADB on cuBLASLt, their aux and
    bias-gradient pointers) compiled and linked with nvcc, warning-free."""
    from conftest import require_cuda_build_toolchain

    require_cuda_build_toolchain()
    spec = spec_from("mse:y,y_true", "adamw:lr=0.01")
    _, project = compile_step(
        _gelu_mlp(tmp_path / "mlp.onnx"), spec, tmp_path / "s", batch=4, target="cuda",
        precision="bf16",
    )  # fmt: skip
    source = "".join(p.read_text() for p in project.path.rglob("*.cu"))
    for epilogue in ("kDGeluBgrad", "kBgradA", "kBgradB"):
        assert f"flowc::GemmEpilogue::{epilogue}" in source, epilogue
    bdir = build(project.path, "cuda", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
