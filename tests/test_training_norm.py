"""Training II's batch norm: a model imported to train normalizes by the batch's statistics,
whatever mode it was exported in, and the step keeps the running mean and variance as state,
updated with momentum (the variance's unbiased, as PyTorch keeps it), neither trained nor
decayed; run() (inference) normalizes by them. Against JAX and optax (the forward translated
from the graph and checked against onnxruntime first) over 20 AdamW steps, the running
statistics included, and run() after training against onnxruntime with the exported model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
import optax
from jax_reference import ir_forward
from onnx import TensorProto, helper, numpy_helper

from flowc.harness.compare import max_rel_error
from flowc.trainer import compile_step, export_onnx, load_data, run_steps, spec_from

ROWS, BATCH, STEPS = 32, 8, 20


def _bn_mlp(path: Path) -> None:
    """x [B, 16] -> Gemm (no bias) -> BatchNormalization (exported in eval mode) -> Relu -> Gemm."""
    rng = np.random.default_rng(3)
    inits = {
        "w1": rng.standard_normal((16, 32)) * 0.3,
        "gamma": 1.0 + rng.standard_normal(32) * 0.1,
        "beta": rng.standard_normal(32) * 0.1,
        "running_mean": rng.standard_normal(32) * 0.1,
        "running_var": 1.0 + np.abs(rng.standard_normal(32)) * 0.2,
        "w2": rng.standard_normal((32, 10)) * 0.3,
        "b2": np.zeros(10),
    }
    nodes = [
        # No bias before the norm (it would get no gradient but float32's rounding noise,
        # which Adam scales up to steps of its own).
        helper.make_node("Gemm", ["x", "w1"], ["h"]),
        helper.make_node(
            "BatchNormalization",
            ["h", "gamma", "beta", "running_mean", "running_var"],
            ["hn"],
            epsilon=1e-5,
            momentum=0.9,
        ),
        helper.make_node("Relu", ["hn"], ["r"]),
        helper.make_node("Gemm", ["r", "w2", "b2"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "bn_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def _check_against_jax(
    got: Any, loss_fn: Any, trained: Any, stats: Any, tx: Any, batches: list[Any]
) -> None:
    """The reference run: ``loss_fn(params, stats, x, labels) -> (loss, next stats)`` under
    ``tx`` over ``batches``, the running statistics carried from step to step (no gradient);
    flowc's losses within 1e-5 of it and its parameters and statistics within 1e-4."""
    state, losses = tx.init(trained), []
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    for xb, yb in batches:
        (loss, new_stats), g = grad_fn(trained, stats, xb, yb)
        updates, state = tx.update(g, state, trained)
        trained = optax.apply_updates(trained, updates)
        stats = jax.lax.stop_gradient(new_stats)
        losses.append(float(loss))
    worst = max(abs(a - b) / abs(b) for a, b in zip(got.losses, losses, strict=True))
    assert worst < 1e-5, worst
    for name, ref in {**trained, **stats}.items():
        assert max_rel_error(got.params[name], np.asarray(ref)) < 1e-4, name


def test_batch_norm_trains_as_jax_does_and_infers_with_its_running_statistics(
    tmp_path: Path,
) -> None:
    from flowc.compiler import TRAIN_PRE_PASSES
    from flowc.frontend import ImportOptions, load_graph
    from flowc.passes.manager import PassManager

    model = tmp_path / "bn_mlp.onnx"
    _bn_mlp(model)
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((ROWS, 16)) * 2 + 0.5).astype(np.float32)
    labels = rng.integers(0, 10, ROWS).astype(np.int64)
    np.savez(tmp_path / "d.npz", x=x, labels=labels)

    graph = PassManager(TRAIN_PRE_PASSES).run(
        load_graph(model, ImportOptions(trainable=True, batch=BATCH))
    )
    assert [n.op for n in graph.nodes if n.op == "TrainBatchNorm"] == ["TrainBatchNorm"]
    f = ir_forward(graph)
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    (want,) = sess.run(None, {"x": x[:BATCH]})
    params0 = {k: jnp.asarray(v, jnp.float64) for k, v in graph.params.items()}
    assert max_rel_error(np.asarray(f(params0, {"x": x[:BATCH]})["logits"]), want) < 1e-5

    spec = spec_from("cross_entropy:logits,labels", "adamw:lr=0.01,eps=1e-6,weight_decay=0.05")
    step, project = compile_step(model, spec, tmp_path / "step", batch=BATCH, target="host")
    assert step.buffers == ["running_mean", "running_var"]
    assert "running_mean" not in step.params and "gamma" in step.params
    project.build("host", quick=True)
    arrays = load_data(tmp_path / "d.npz", step)
    with project.load("host") as m:
        got = run_steps(m, step, arrays, steps=STEPS, batch=BATCH, shuffle=False)
        predicted = m.run({"x": x[:BATCH]})["logits"]

    buffers = ("running_mean", "running_var")
    trained = {k: v for k, v in params0.items() if k not in buffers}
    stats = {k: params0[k] for k in buffers}

    def loss_fn(p: Any, s: Any, xb: Any, yb: Any) -> Any:
        out = f({**p, **s}, {"x": xb, "train/step": np.asarray(0, np.int64)})
        logp = jax.nn.log_softmax(out["logits"], axis=-1)
        loss = -jnp.take_along_axis(logp, yb[:, None], axis=-1).mean()
        bn = next(n for n in graph.nodes if n.op == "TrainBatchNorm")
        return loss, {
            "running_mean": out[bn.outputs[1].name],
            "running_var": out[bn.outputs[2].name],
        }

    rows = [np.arange(s * BATCH, (s + 1) * BATCH) % ROWS for s in range(STEPS)]
    batches = [(jnp.asarray(x[r]), jnp.asarray(labels[r])) for r in rows]
    _check_against_jax(
        got,
        loss_fn,
        trained,
        stats,
        optax.adamw(0.01, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.05),
        batches,
    )
    # The running statistics moved, and no gradient or decay touched them: momentum alone.
    assert not np.allclose(got.params["running_var"], np.asarray(params0["running_var"]))

    # run() normalizes by the running statistics the steps left: onnxruntime on the exported
    # model (its initializers replaced by the trained values) agrees.
    export_onnx(model, got.params, tmp_path / "trained.onnx")
    sess = ort.InferenceSession(str(tmp_path / "trained.onnx"), providers=["CPUExecutionProvider"])
    (want,) = sess.run(None, {"x": x[:BATCH]})
    assert max_rel_error(predicted, want) < 1e-5


def test_accumulated_micro_batches_normalize_each_by_its_own_statistics(tmp_path: Path) -> None:
    """--accumulate 2: each micro-batch's forward normalizes by its own batch statistics (as
    K forward passes in PyTorch would), the loss over both micro-batches' labels, and the
    running statistics updated twice in order; against JAX doing exactly that."""
    from flowc.compiler import TRAIN_PRE_PASSES
    from flowc.frontend import ImportOptions, load_graph
    from flowc.passes.manager import PassManager

    model = tmp_path / "bn_mlp.onnx"
    _bn_mlp(model)
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((ROWS, 16)) * 2 + 0.5).astype(np.float32)
    labels = rng.integers(0, 10, ROWS).astype(np.int64)
    np.savez(tmp_path / "d.npz", x=x, labels=labels)
    micro, k_count, steps = 4, 2, 6
    spec = spec_from("cross_entropy:logits,labels", "sgd:lr=0.1,momentum=0.9", accumulate=k_count)
    step, project = compile_step(model, spec, tmp_path / "step", batch=micro, target="host")
    project.build("host", quick=True)
    arrays = load_data(tmp_path / "d.npz", step)
    with project.load("host") as m:
        got = run_steps(m, step, arrays, steps=steps, batch=micro, shuffle=False)

    graph = PassManager(TRAIN_PRE_PASSES).run(
        load_graph(model, ImportOptions(trainable=True, batch=micro))
    )
    f = ir_forward(graph)
    bn = next(n for n in graph.nodes if n.op == "TrainBatchNorm")
    params0 = {k: jnp.asarray(v, jnp.float64) for k, v in graph.params.items()}
    buffers = ("running_mean", "running_var")
    trained = {k: v for k, v in params0.items() if k not in buffers}
    stats = {k: params0[k] for k in buffers}

    def loss_fn(p: Any, s: Any, xb: Any, yb: Any) -> Any:
        total = 0.0
        for j in range(k_count):
            rows = slice(j * micro, (j + 1) * micro)
            out = f({**p, **s}, {"x": xb[rows], "train/step": np.asarray(0, np.int64)})
            logp = jax.nn.log_softmax(out["logits"], axis=-1)
            total = total - jnp.take_along_axis(logp, yb[rows, None], axis=-1).sum()
            s = {"running_mean": out[bn.outputs[1].name], "running_var": out[bn.outputs[2].name]}
        return total / (k_count * micro), s

    rows = [np.arange(s * micro * k_count, (s + 1) * micro * k_count) % ROWS for s in range(steps)]
    batches = [(jnp.asarray(x[r]), jnp.asarray(labels[r])) for r in rows]
    _check_against_jax(got, loss_fn, trained, stats, optax.sgd(0.1, momentum=0.9), batches)


def _resnet_style(path: Path) -> None:
    """A residual CNN with batch norms (the shared resnet_tiny had its norms folded at
    export): stem conv-BN-ReLU and a 3x3 max pool, one residual block (two conv-BN, the skip added before the
    ReLU), a strided conv-BN-ReLU, global average pooling and a classifier."""
    rng = np.random.default_rng(9)
    inits: dict[str, np.ndarray] = {}
    nodes = []

    def conv_bn(name: str, src: str, cin: int, cout: int, stride: int = 1) -> str:
        inits[f"{name}.weight"] = rng.standard_normal((cout, cin, 3, 3)) * np.sqrt(2.0 / (9 * cin))
        for stat, value in (
            ("gamma", 1.0 + rng.standard_normal(cout) * 0.1),
            ("beta", rng.standard_normal(cout) * 0.1),
            ("mean", np.zeros(cout)),
            ("var", np.ones(cout)),
        ):
            inits[f"{name}.{stat}"] = value
        nodes.append(
            helper.make_node(
                "Conv",
                [src, f"{name}.weight"],
                [f"{name}.c"],
                pads=[1, 1, 1, 1],
                strides=[stride] * 2,
            )
        )
        nodes.append(
            helper.make_node(
                "BatchNormalization",
                [f"{name}.c", *(f"{name}.{s}" for s in ("gamma", "beta", "mean", "var"))],
                [f"{name}.bn"],
            )
        )
        return f"{name}.bn"

    stem = conv_bn("stem", "x", 3, 8)
    nodes.append(helper.make_node("Relu", [stem], ["stem.relu"]))
    nodes.append(
        helper.make_node("MaxPool", ["stem.relu"], ["h0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    )
    a = conv_bn("block.a", "h0", 8, 8)
    nodes.append(helper.make_node("Relu", [a], ["block.r"]))
    bb = conv_bn("block.b", "block.r", 8, 8)
    nodes.append(helper.make_node("Add", [bb, "h0"], ["block.sum"]))
    nodes.append(helper.make_node("Relu", ["block.sum"], ["h1"]))
    down = conv_bn("down", "h1", 8, 16, stride=2)
    nodes.append(helper.make_node("Relu", [down], ["h2"]))
    nodes.append(helper.make_node("GlobalAveragePool", ["h2"], ["pooled"]))
    nodes.append(helper.make_node("Flatten", ["pooled"], ["flat"]))
    inits["fc.weight"] = rng.standard_normal((16, 10)) * 0.3
    inits["fc.bias"] = np.zeros(10)
    nodes.append(helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"]))
    graph = helper.make_graph(
        nodes,
        "resnet_style",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def test_a_resnet_style_cnn_trains_as_jax_does(tmp_path: Path) -> None:
    """Convolutions and max pooling (their VJPs), batch norms in training (four, their
    running statistics the step's state) and a residual sum, 10 AdamW steps against JAX and
    optax."""
    from flowc.compiler import TRAIN_PRE_PASSES
    from flowc.frontend import ImportOptions, load_graph
    from flowc.passes.manager import PassManager

    model = tmp_path / "resnet_style.onnx"
    _resnet_style(model)
    rng = np.random.default_rng(10)
    x = rng.standard_normal((ROWS, 3, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 10, ROWS).astype(np.int64)
    np.savez(tmp_path / "d.npz", x=x, labels=labels)
    steps = 10

    graph = PassManager(TRAIN_PRE_PASSES).run(
        load_graph(model, ImportOptions(trainable=True, batch=BATCH))
    )
    f = ir_forward(graph)
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    (want,) = sess.run(None, {"x": x[:BATCH]})
    params0 = {k: jnp.asarray(v, jnp.float64) for k, v in graph.params.items()}
    x64 = x.astype(np.float64)
    assert max_rel_error(np.asarray(f(params0, {"x": x64[:BATCH]})["logits"]), want) < 1e-5

    spec = spec_from("cross_entropy:logits,labels", "adamw:lr=0.01,eps=1e-6,weight_decay=0.01")
    step, project = compile_step(model, spec, tmp_path / "step", batch=BATCH, target="host")
    assert len(step.buffers) == 8
    project.build("host", quick=True)
    arrays = load_data(tmp_path / "d.npz", step)
    with project.load("host") as m:
        got = run_steps(m, step, arrays, steps=steps, batch=BATCH, shuffle=False)

    bns = [n for n in graph.nodes if n.op == "TrainBatchNorm"]
    names = [v.name for n in bns for v in n.inputs[3:5] if v is not None]
    trained = {k: v for k, v in params0.items() if k not in names}
    stats = {k: params0[k] for k in names}

    def loss_fn(p: Any, s: Any, xb: Any, yb: Any) -> Any:
        out = f({**p, **s}, {"x": xb, "train/step": np.asarray(0, np.int64)})
        logp = jax.nn.log_softmax(out["logits"], axis=-1)
        loss = -jnp.take_along_axis(logp, yb[:, None], axis=-1).mean()
        nexts = {}
        for n in bns:
            nexts[n.inputs[3].name] = out[n.outputs[1].name]  # type: ignore[union-attr]
            nexts[n.inputs[4].name] = out[n.outputs[2].name]  # type: ignore[union-attr]
        return loss, nexts

    rows = [np.arange(s * BATCH, (s + 1) * BATCH) % ROWS for s in range(steps)]
    batches = [(jnp.asarray(x64[r]), jnp.asarray(labels[r])) for r in rows]
    _check_against_jax(
        got,
        loss_fn,
        trained,
        stats,
        optax.adamw(0.01, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01),
        batches,
    )


def test_the_resnet_style_step_builds_for_cuda_with_cudnns_backward(tmp_path: Path) -> None:
    """The CNN's step in bf16 for the GPU: its convolutions' gradients as cuDNN's backward
    calls (a plan each, deterministic algorithms), compiled and linked by nvcc warning-free."""
    from conftest import require_cuda_build_toolchain

    from flowc.harness.build import build

    require_cuda_build_toolchain()
    model = tmp_path / "resnet_style.onnx"
    _resnet_style(model)
    spec = spec_from("cross_entropy:logits,labels", "adamw:lr=0.01")
    _, project = compile_step(
        model, spec, tmp_path / "step", batch=BATCH, target="cuda", precision="bf16"
    )
    source = (project.path / "model.cu").read_text()
    # Three data gradients (the stem's input needs none) and four filter gradients; equal
    # geometries share a plan.
    assert source.count("flowc::run_conv_backward(") == 7
    assert "flowc::ConvGrad::kData" in source and "flowc::ConvGrad::kFilter" in source
    bdir = build(project.path, "cuda", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
