"""Training figures per test model (issue 28): host steps per second, the step's arena and its
saved activations against the memory plan's lower bound, launches per step, and the worst
loss and parameter differences against JAX + optax (float64) over 50 steps.

    python bench/train_vs_jax.py [--steps 50] [--out bench/results/train_vs_jax.txt]

Figures, not pass/fail: the tests (tests/test_training.py) hold the tolerances.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax_reference import ir_forward  # noqa: E402

from flowc.compiler import TRAIN_PRE_PASSES  # noqa: E402
from flowc.frontend import ImportOptions, load_graph  # noqa: E402
from flowc.harness.build import build_dir  # noqa: E402
from flowc.harness.compare import max_rel_error  # noqa: E402
from flowc.passes.manager import PassManager  # noqa: E402
from flowc.trainer import compile_step, load_data, run_steps, spec_from  # noqa: E402

MODELS = ROOT / "tests" / "data" / "models"


def case(
    name: str,
    model: Path,
    loss: str,
    data: dict[str, np.ndarray],
    batch: int,
    steps: int,
    jax_loss,
    tmp: Path,
) -> dict[str, object]:  # type: ignore[no-untyped-def]
    np.savez(tmp / f"{name}.npz", **data)
    opt = "adamw:lr=0.001,beta1=0.9,beta2=0.999,eps=1e-6,weight_decay=0.01"
    spec = spec_from(loss, opt, ignore_index=-100 if "labels" in data else None)
    step, project = compile_step(model, spec, tmp / name, batch=batch, target="host")
    project.build("host")
    arrays = load_data(tmp / f"{name}.npz", step)
    with project.load("host") as compiled:
        run_steps(compiled, step, arrays, steps=2, batch=batch, shuffle=False)  # warm-up
        # From the first state again (the model keeps what the warm-up left).
        got = run_steps(
            compiled, step, arrays, steps=steps, batch=batch, shuffle=False, state=step.initial
        )
    # The step's launches: the driver's `train` for one step (its run() is inference).
    for n in step.batch:
        np.save(tmp / f"{name}.{n.replace('/', '_')}.npy", arrays[n])
    exe = build_dir(project.path, "host") / "model_main"
    data = []
    for n in step.batch:
        data += ["--data", f"{n}={tmp / (name + '.' + n.replace('/', '_') + '.npy')}"]
    r = subprocess.run(
        [str(exe), "train", "--weights", str(project.path / "weights.bin"), *data,
         "--steps", "1", "--batch", str(batch)],
        capture_output=True, text=True, env={**os.environ, "FLOWC_STATS": "1"}, check=True,
    )  # fmt: skip
    launches = next(
        (line for line in r.stdout.splitlines() if line.startswith("launches per run")), ""
    )
    info = json.loads((project.path / "flowc_model.json").read_text())

    graph = PassManager(TRAIN_PRE_PASSES).run(
        load_graph(model, ImportOptions(trainable=True, batch=batch))
    )
    f = ir_forward(graph)
    params = {k: jnp.asarray(v, jnp.float64) for k, v in graph.params.items()}
    tx = optax.adamw(0.001, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01)
    state = tx.init(params)
    grad_fn = jax.value_and_grad(lambda p, b: jax_loss(f(p, b), b))
    rows = next(iter(arrays.values())).shape[0]
    losses = []
    for s in range(steps):
        idx = np.arange(s * batch, (s + 1) * batch) % rows
        # The step number keys the dropouts (flowc's masks, injected: gpt2_tiny has five).
        feeds = {k: jnp.asarray(v[idx]) for k, v in arrays.items()}
        value, g = grad_fn(params, {**feeds, "train/step": np.asarray(s, np.int64)})
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(value))
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(got.losses, losses, strict=True))
    worst_param = max(max_rel_error(got.params[k], np.asarray(v)) for k, v in params.items())
    return {
        "model": name,
        "steps_per_s_host": round(got.steps_per_s, 2),
        "arena_bytes": info["arena_bytes"],
        "lower_bound": info["lower_bound"],
        "saved_activation_bytes": step.saved_activation_bytes(),
        "launches": launches.split(":", 1)[-1].strip(),
        "worst_loss_rel_diff": f"{worst_loss:.2e}",
        "worst_param_diff": f"{worst_param:.2e}",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 64)).astype(np.float32)
    y = (x @ rng.standard_normal((64, 10))).argmax(1).astype(np.int64)

    def mlp_loss(out, b):  # type: ignore[no-untyped-def]
        logp = jax.nn.log_softmax(out["/m/m.2/Gemm_output_0"], axis=-1)
        return -jnp.take_along_axis(logp, b["labels"][:, None], axis=-1).mean()

    ids = rng.integers(0, 1000, (6, 32)).astype(np.int64)
    labels = np.concatenate([ids[:, 1:], np.full((6, 1), -100)], axis=1)

    def lm_loss(out, b):  # type: ignore[no-untyped-def]
        logp = jax.nn.log_softmax(out["logits"], axis=-1)
        mask = b["labels"] != -100
        picked = jnp.take_along_axis(logp, jnp.where(mask, b["labels"], 0)[..., None], axis=-1)[
            ..., 0
        ]
        return -(picked * mask).sum() / mask.sum()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        rows.append(
            case(
                "mlp",
                MODELS / "mlp.onnx",
                "cross_entropy:/m/m.2/Gemm_output_0,labels",
                {"x": x, "labels": y},
                8,
                args.steps,
                mlp_loss,
                Path(tmp),
            )
        )
        rows.append(
            case(
                "gpt2_tiny",
                MODELS / "gpt2_tiny.onnx",
                "cross_entropy:logits,labels",
                {"input_ids": ids, "labels": labels},
                1,
                args.steps,
                lm_loss,
                Path(tmp),
            )
        )
        took = time.perf_counter() - t0
    text = (
        "\n".join(json.dumps(r) for r in rows)
        + f"\n# {args.steps} steps each, AdamW, host target; {took:.0f} s\n"
    )
    print(text, end="")
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
