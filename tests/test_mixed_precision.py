"""Mixed-precision training (--precision bf16|fp16): the model's values and their gradients
narrow, master weights, optimizer state, gradient sums and the loss float32; fp16 with dynamic
loss scaling. bf16 against JAX: flowc's bf16 loss curve is within twice what JAX's own bf16
run (the same storage graph, translated) differs from JAX's float32 run; fp16's scaling
skips a step whose gradients overflow, halves the scale and leaves the state untouched."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import SHARED_MODELS

from flowc.ir.dtype import DType
from flowc.trainer import compile_step, load_data, run_steps, spec_from
from flowc.training.spec import LossScaling

BERT = SHARED_MODELS / "bert_tiny.onnx"
STEPS = 50
OPT = "adamw:lr=0.001,eps=1e-6"


def _bert_data(tmp_path: Path) -> Path:
    rng = np.random.default_rng(8)
    ids = rng.integers(0, 1000, (4, 16)).astype(np.int64)
    mask = np.ones((4, 16), np.int64)
    mask[:, 11:] = 0  # padding
    target = rng.standard_normal((4, 128)).astype(np.float32)
    np.savez(tmp_path / "d.npz", input_ids=ids, attention_mask=mask, target=target)
    return tmp_path / "d.npz"


def _jax_losses(graph: Any, arrays: dict[str, np.ndarray], steps: int) -> list[float]:
    """AdamW (optax) over ``graph`` translated to JAX, parameters float32 (the master
    weights; a storage graph casts them to bfloat16 at their use), the loss in float32."""
    from jax_reference import ir_forward

    f = ir_forward(graph)
    params = {k: jnp.asarray(v, jnp.float32) for k, v in graph.params.items()}

    def loss_fn(p: Any, b: dict[str, Any]) -> Any:
        out = f(p, {k: b[k] for k in ("input_ids", "attention_mask")})["pooler_output"]
        return ((out.astype(jnp.float32) - b["target"]) ** 2).mean()

    tx = optax.adamw(0.001, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01)
    state, losses = tx.init(params), []
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    for s in range(steps):
        idx = np.arange(s * 2, s * 2 + 2) % 4
        loss, g = grad_fn(params, {k: jnp.asarray(v[idx]) for k, v in arrays.items()})
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return losses


def test_bf16_trains_bert_tiny_as_close_to_float32_as_jax_bf16_does(tmp_path: Path) -> None:
    from flowc.compiler import TRAIN_PRE_PASSES
    from flowc.frontend import ImportOptions, load_graph
    from flowc.passes.manager import PassManager

    data = _bert_data(tmp_path)
    spec = spec_from("mse:pooler_output,target", OPT)
    step, project = compile_step(
        BERT, spec, tmp_path / "step", batch=2, dim=["seq=16"], target="host", precision="bf16"
    )
    # The step computes in bfloat16: every GEMM's operands and the activations.
    matmuls = [n for n in step.graph.nodes if n.op in ("MatMul", "Gemm")]
    assert matmuls and all(n.inputs[0].type.dtype == DType.BF16 for n in matmuls)
    # The state stays float32: master weights and optimizer state.
    assert all(v.type.dtype != DType.BF16 for v in step.graph.inputs)
    project.build("host", quick=True)
    arrays = load_data(data, step)
    with project.load("host") as model:
        got = run_steps(model, step, arrays, steps=STEPS, batch=2, shuffle=False)

    opts = ImportOptions(trainable=True, batch=2, dims={"seq": 16})
    graph = PassManager(TRAIN_PRE_PASSES).run(load_graph(BERT, opts))
    fp32 = _jax_losses(graph, arrays, STEPS)
    bf16 = _jax_losses(PassManager(["store_bf16"]).run(graph.copy()), arrays, STEPS)
    jax_gap = max(abs(a - b) for a, b in zip(bf16, fp32, strict=True))
    flowc_gap = max(abs(a - b) for a, b in zip(got.losses, fp32, strict=True))
    assert jax_gap > 0
    assert flowc_gap <= 2 * jax_gap, (flowc_gap, jax_gap)
    assert got.losses[-1] < 0.5 * got.losses[0]  # it learns


def test_fp16_skips_overflowing_steps_and_scales_as_grad_scaler(tmp_path: Path) -> None:
    data = _bert_data(tmp_path)
    # Growth every 4 finite steps (PyTorch's default is 2000) so that a short run doubles too.
    spec = spec_from("mse:pooler_output,target", OPT, scaling=LossScaling(interval=4))
    step, project = compile_step(
        BERT, spec, tmp_path / "step", batch=2, dim=["seq=16"], target="host", precision="fp16"
    )
    assert step.loss_scaled
    project.build("host", quick=True)
    arrays = load_data(data, step)
    records: list[dict[str, Any]] = []
    with project.load("host") as model:
        # A scale of 2^40 overflows float16 (65504) in the first backward: skipped.
        start = {**step.initial, "train/loss_scale": np.asarray(2.0**40, np.float32)}
        first = run_steps(model, step, arrays, steps=1, batch=2, shuffle=False, state=start)
        assert first.skipped == [True] and first.scales == [2.0**40]
        after = model.read_state()
        for name in step.params:
            assert np.array_equal(after[name], step.initial[name]), name
        assert int(after["train/step"]) == 0  # Adam's count did not advance
        assert float(after["train/loss_scale"]) == 2.0**39
        rest = run_steps(
            model, step, arrays, steps=40, batch=2, shuffle=False, first=1, log=records.append
        )
    # GradScaler's rule, step by step: halve on a skip, double after 4 finite steps in a row.
    scale, run = 2.0**39, 0
    for used, skipped in zip(rest.scales, rest.skipped, strict=True):
        assert used == scale
        if skipped:
            scale, run = scale / 2, 0
        else:
            run += 1
            if run == 4:
                scale, run = scale * 2, 0
    skips = 1 + sum(rest.skipped)
    assert 10 < skips < 30 and not all(rest.skipped[10:])  # down from 2^40, then it trains
    assert int(rest.state["train/step"]) == 41 - skips
    assert all({"loss_scale", "skipped"} <= set(r) for r in records)
    assert json.dumps(records)  # the log's records are JSON
    finite = [loss for loss, s in zip(rest.losses, rest.skipped, strict=True) if not s]
    assert finite[-1] < finite[0]


def test_inspect_says_how_a_mixed_precision_step_trains() -> None:
    import subprocess
    import sys

    model = SHARED_MODELS / "mlp.onnx"
    r = subprocess.run(
        [sys.executable, "-m", "flowc", "inspect", str(model), "--train", "--loss",
         "cross_entropy:y,labels", "--optimizer", "adamw:lr=0.01", "--precision", "fp16"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "fp16 mixed precision: activations and their gradients fp16" in r.stdout
    assert "dynamic loss scaling from 65536 (x2 after 2000 finite steps" in r.stdout
