"""The training part of `make gpu-check`: flowc's compiled training step beside PyTorch eager.

    python3 bench/gpu/train_check.py [--dry-run] [--layers 12] [--seq 512] [--batch 8]
                                     [--steps 20] [--precisions fp32,tf32] [--budget-s S]

On a GPU (the issue's figure): GPT-2 small (12 layers, sequence 512) is built and exported
by bench/gpu/torch_train.py (under --torch-python), which also trains it with PyTorch eager
for --steps AdamW steps on the same batches, per precision (fp32: exact float32 matmuls;
tf32: TF32 tensor cores), recording each step's loss and time. flowc then compiles the
exported model's training step (`cross_entropy:logits,labels`, the last position ignored,
the same AdamW), builds it for CUDA and runs the same steps through Model.train_step, the
batches already on the device (CuPy) so a step's time is the step's. Reported per
precision: the median step time of each and their ratio, the worst relative loss
difference over the steps (correct within 2e-3 for fp32, 2e-2 for tf32: two float32
programs summing in other orders drift apart step by step), in
bench/results/gpu-train.json and .txt.

`--dry-run` (`make gpu-check DRY=1`) proves the same path without a GPU or PyTorch:
tests/data/models/gpt2_tiny.onnx (sequence 32, batch 1), flowc's host build, and JAX with
optax on the CPU as the reference (the forward translated from the graph flowc
differentiates, tests/jax_reference.py); results in bench/results/gpu-train-dryrun.*; the
timings are the host's (meaningless for the GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
if (REPO / ".gpu" / "site").is_dir():  # lark and friends on the GPU machine (gpu_check.py)
    sys.path.insert(0, str(REPO / ".gpu" / "site"))
RESULTS = REPO / "bench" / "results"
TOLERANCE = {"fp32": 2e-3, "tf32": 2e-2}
LR, EPS, DECAY = 1e-4, 1e-8, 0.01


def log(msg: str, t0: float = time.time()) -> None:
    print(f"[{time.time() - t0:6.1f} s] {msg}", flush=True)


def flowc_side(
    model: Path, data: Path, work: Path, precision: str, batch: int, steps: int, target: str
) -> dict[str, Any]:
    """flowc's step compiled, built for ``target`` and run ``steps`` times from the first
    state: its losses and per-step times."""
    from flowc.trainer import compile_step, load_data, spec_from

    spec = spec_from(
        "cross_entropy:logits,labels",
        f"adamw:lr={LR},beta1=0.9,beta2=0.999,eps={EPS},weight_decay={DECAY}",
        ignore_index=-100,
    )
    t0 = time.time()
    step, project = compile_step(
        model, spec, work / f"step_{precision}", batch=batch, target=target, precision=precision
    )
    compile_s = time.time() - t0
    project.build(target, quick=True)
    build_s = time.time() - t0 - compile_s
    arrays = load_data(data, step)
    feeds = [{n: arrays[n][s * batch : (s + 1) * batch] for n in step.batch} for s in range(steps)]
    if target == "cuda":
        import cupy  # the GPU machine has it: the batches go to the device before timing

        feeds = [{n: cupy.asarray(a) for n, a in f.items()} for f in feeds]
    losses, times = [], []
    with project.load(target) as m:
        for f in feeds:
            t = time.perf_counter()
            loss, _, _ = m.train_step(f)  # synchronizes
            times.append((time.perf_counter() - t) * 1e3)
            losses.append(loss)
    return {
        "losses": losses,
        "step_ms": times,
        "median_step_ms": statistics.median(times[3:] or times),
        "compile_s": round(compile_s, 1),
        "build_s": round(build_s, 1),
        "arena_bytes": project.info["arena_bytes"],
        "lower_bound": project.info["lower_bound"],
    }


def jax_side(model: Path, data: Path, batch: int, steps: int) -> dict[str, Any]:
    """The dry run's reference: JAX + optax on the CPU in float64 (no PyTorch here)."""
    sys.path.insert(0, str(REPO / "tests"))
    import jax
    import jax.numpy as jnp
    import optax
    from jax_reference import ir_forward

    from flowc.compiler import TRAIN_PRE_PASSES
    from flowc.frontend import ImportOptions, load_graph
    from flowc.passes.manager import PassManager

    jax.config.update("jax_enable_x64", True)
    graph = PassManager(TRAIN_PRE_PASSES).run(
        load_graph(model, ImportOptions(trainable=True, batch=batch))
    )
    f = ir_forward(graph)
    params = {k: jnp.asarray(v, jnp.float64) for k, v in graph.params.items()}
    z = np.load(data)
    ids, labels = z["input_ids"], z["labels"]

    def loss_fn(p: Any, x: Any, y: Any) -> Any:
        logp = jax.nn.log_softmax(f(p, {"input_ids": x})["logits"], axis=-1)
        keep = y != -100
        picked = jnp.take_along_axis(logp, jnp.where(keep, y, 0)[..., None], -1)[..., 0]
        return -(picked * keep).sum() / keep.sum()

    tx = optax.adamw(LR, b1=0.9, b2=0.999, eps=EPS, weight_decay=DECAY)
    state = tx.init(params)
    grad = jax.jit(jax.value_and_grad(loss_fn))
    losses, times = [], []
    for s in range(steps):
        t = time.perf_counter()
        rows = slice(s * batch, (s + 1) * batch)
        loss, g = grad(params, ids[rows], labels[rows])
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
        times.append((time.perf_counter() - t) * 1e3)
        losses.append(float(loss))
    return {"losses": losses, "step_ms": times, "median_step_ms": statistics.median(times)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--precisions", default="fp32,tf32")
    ap.add_argument("--torch-python", default=os.environ.get("TORCH_PYTHON", sys.executable))
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--budget-s", type=float, default=330.0)
    a = ap.parse_args(argv)
    deadline = time.time() + a.budget_s
    work = a.work or Path("/tmp/flowc-gpu-train" + ("-dry" if a.dry_run else ""))
    work.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"dry_run": a.dry_run, "steps": a.steps, "results": {}}
    if a.dry_run:
        model = REPO / "tests" / "data" / "models" / "gpt2_tiny.onnx"
        batch, seq, target = 1, 32, "host"
        rng = np.random.default_rng(0)
        ids = rng.integers(0, 1000, (a.steps * batch, seq + 1))
        labels = ids[:, 1:].copy()
        labels[:, -1] = -100
        data = work / "tokens.npz"
        np.savez(data, input_ids=ids[:, :-1], labels=labels)
        record.update(model="gpt2_tiny", batch=batch, seq=seq, reference="JAX + optax (CPU)")
        log("reference: JAX + optax on the CPU")
        reference = {p: jax_side(model, data, batch, a.steps) for p in ["fp32"]}
        reference = {p: reference["fp32"] for p in a.precisions.split(",")}
    else:
        batch, seq, target = a.batch, a.seq, "cuda"
        log(f"PyTorch: GPT-2 ({a.layers} layers, sequence {seq}, batch {batch}), export and train")
        r = subprocess.run(
            [a.torch_python, str(REPO / "bench" / "gpu" / "torch_train.py"),
             "--out-dir", str(work), "--layers", str(a.layers), "--seq", str(seq),
             "--batch", str(batch), "--steps", str(a.steps), "--precisions", a.precisions,
             "--lr", str(LR)],
            text=True, capture_output=True, timeout=max(60.0, deadline - time.time()),
        )  # fmt: skip
        print(r.stdout[-4000:], r.stderr[-4000:], flush=True)
        if r.returncode != 0:
            log("the PyTorch side failed: nothing to compare")
            return 1
        info = json.loads((work / "torch_train.json").read_text())
        model, data = work / "gpt2_train.onnx", work / "tokens.npz"
        record.update(
            model=f"GPT-2 ({a.layers} layers)",
            batch=batch,
            seq=seq,
            reference=f"PyTorch {info['torch']} eager",
            device=info["device"],
        )
        reference = info["results"]
    worst = 0.0
    ok = True
    for precision in a.precisions.split(","):
        if time.time() > deadline:
            record["results"][precision] = {"skipped": "out of the time budget"}
            log(f"{precision}: skipped (budget)")
            continue
        log(f"flowc {precision}: compile, build ({target}) and {a.steps} steps")
        got = flowc_side(model, data, work, precision, batch, a.steps, target)
        ref = reference[precision]
        diffs = [abs(x - y) / abs(y) for x, y in zip(got["losses"], ref["losses"], strict=True)]
        worst = max(diffs)
        passed = worst <= TOLERANCE.get(precision, 2e-2)
        ok = ok and passed
        record["results"][precision] = {
            "flowc": got,
            "reference": ref,
            "worst_loss_rel_diff": worst,
            "correct": passed,
            "flowc_over_reference_step_time": got["median_step_ms"] / ref["median_step_ms"],
        }
        log(
            f"{precision}: loss {got['losses'][0]:.5f} -> {got['losses'][-1]:.5f} (worst rel "
            f"diff {worst:.2e}: {'ok' if passed else 'WRONG'}); step {got['median_step_ms']:.2f} ms "
            f"vs {ref['median_step_ms']:.2f} ms" + (" (host/dry: meaningless)" if a.dry_run else "")
        )
    name = "gpu-train-dryrun" if a.dry_run else "gpu-train"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"# {record['model']}, batch {batch}, sequence {seq}, {a.steps} AdamW steps"]
    lines.append(
        f"# reference: {record['reference']}"
        + (f" on {record.get('device')}" if not a.dry_run else " (dry run: host timings)")
    )
    lines.append("precision  flowc ms/step  reference ms/step  ratio  worst loss diff  correct")
    for p, r in record["results"].items():
        if "skipped" in r:
            lines.append(f"{p:9}  skipped")
            continue
        lines.append(
            f"{p:9}  {r['flowc']['median_step_ms']:13.2f}  {r['reference']['median_step_ms']:17.2f}  "
            f"{r['flowc_over_reference_step_time']:5.2f}  {r['worst_loss_rel_diff']:15.2e}  {r['correct']}"
        )
    (RESULTS / f"{name}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
