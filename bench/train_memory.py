"""Training II's figures (issue 29): per model and --recompute mode (none / auto / all) the
saved activations, the compiled arena, the FLOPs recomputation adds, the host's step time and
the modeled H200 step time (the schedule simulated under the shipped cost profile); then the
loss curves of fp32, bf16 and fp16 training beside JAX's float32 and bfloat16 runs of the same
model (bert_tiny, 50 AdamW steps).

    python bench/train_memory.py [--steps 20] [--out bench/results/train_memory.txt]

Figures, not pass/fail: tests/test_recompute.py and tests/test_mixed_precision.py hold the
checks. Host times are medians of steps after a warm-up, on whatever else the machine runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from flowc.compiler import plan_schedule, schedule_graph  # noqa: E402
from flowc.trainer import compile_step, load_data, run_steps, spec_from  # noqa: E402

MODELS = ROOT / "tests" / "data" / "models"
OPT = "adamw:lr=0.001,eps=1e-6"


def _bert_data(path: Path, rows: int, seq: int) -> None:
    rng = np.random.default_rng(8)
    ids = rng.integers(0, 1000, (rows, seq)).astype(np.int64)
    mask = np.ones((rows, seq), np.int64)
    mask[:, seq * 3 // 4 :] = 0
    target = rng.standard_normal((rows, 128)).astype(np.float32)
    np.savez(path, input_ids=ids, attention_mask=mask, target=target)


def _gpt2_data(path: Path) -> None:
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 1000, (6, 32)).astype(np.int64)
    labels = np.concatenate([ids[:, 1:], np.full((6, 1), -100)], axis=1)
    np.savez(path, input_ids=ids, labels=labels)


def one(
    model: Path, loss: str, data: Path, batch: int, dims: list[str], mode: str, limit: int | None,
    steps: int, tmp: Path, precision: str = "fp32", ignore: int | None = None,
) -> dict[str, object]:  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = spec_from(loss, OPT, recompute=mode, mem_limit=limit, ignore_index=ignore)
        t0 = time.perf_counter()
        step, project = compile_step(
            model, spec, tmp / f"{model.stem}-b{batch}-{mode}-{precision}", batch=batch, dim=dims,
            target="host", precision=precision, force=True,
        )  # fmt: skip
        compile_s = time.perf_counter() - t0
    sched = schedule_graph(step.graph, schedule_for="memory")
    plan = plan_schedule(sched)
    project.build("host")
    arrays = load_data(data, step)
    with project.load("host") as m:
        run_steps(m, step, arrays, steps=2, batch=batch, shuffle=False)  # warm-up
        times, losses = [], []
        for k in range(steps):
            # From the first state again after the warm-up: the curves start at step 1.
            state = step.initial if k == 0 else None
            t = time.perf_counter()
            r = run_steps(
                m, step, arrays, steps=1, batch=batch, shuffle=False, first=k, state=state
            )
            times.append(time.perf_counter() - t)
            losses += r.losses
    rep = step.recompute
    state = sum(v.type.nbytes for v in step.graph.inputs) + sum(
        c.type.nbytes for c in step.graph.constants
    )
    return {
        "mode": mode,
        "saved": step.saved_activation_bytes(),
        "arena": plan.arena_bytes,
        "state": state,
        "flops_added": rep.flops_added if rep else 0,
        "forward_flops": rep.forward_flops if rep else 0,
        "recomputed": len(rep.recomputed) if rep else 0,
        "host_ms": 1e3 * statistics.median(times),
        "h200_us": 1e6 * sched.makespan_s,
        "compile_s": compile_s,
        "losses": losses,
    }


def recompute_table(steps: int, tmp: Path) -> list[str]:
    lines = ["## --recompute (host; modeled H200 from the shipped profile)", ""]
    cases = [
        ("bert_tiny b8 s64 mse", MODELS / "bert_tiny.onnx", "mse:pooler_output,target", 8,
         ["seq=64"], "bert", None),
        ("gpt2_tiny b1 s32 next-token", MODELS / "gpt2_tiny.onnx", "cross_entropy:logits,labels", 1,
         [], "gpt2", -100),
    ]  # fmt: skip
    for title, model, loss, batch, dims, kind, ignore in cases:
        data = tmp / f"{kind}.npz"
        if kind == "bert":
            _bert_data(data, 16, 64)
        else:
            _gpt2_data(data)
        rows = {}
        for mode in ("none", "all"):
            rows[mode] = one(model, loss, data, batch, dims, mode, None, steps, tmp, ignore=ignore)
        # auto, given the limit half way between none's and all's arenas.
        limit = rows["none"]["state"] + (rows["none"]["arena"] + rows["all"]["arena"]) // 2
        rows["auto"] = one(model, loss, data, batch, dims, "auto", limit, steps, tmp, ignore=ignore)
        assert rows["all"]["losses"] == rows["none"]["losses"] == rows["auto"]["losses"]
        lines.append(f"{title} (auto's --mem-limit {limit:,} B: state + half way)")
        lines.append(
            "  mode   saved act. B    arena B       +FLOPs (of fwd)      recomputed  "
            "host ms/step  H200 us/step (modeled)"
        )
        for mode in ("none", "auto", "all"):
            r = rows[mode]
            pct = 100.0 * r["flops_added"] / r["forward_flops"] if r["forward_flops"] else 0.0
            lines.append(
                f"  {mode:5}  {r['saved']:>12,}  {r['arena']:>10,}  {r['flops_added']:>13,} "
                f"({pct:4.1f}%)  {r['recomputed']:>10}  {r['host_ms']:>12.2f}  {r['h200_us']:>10.1f}"
            )
        lines.append("  losses equal bit for bit across the three modes")
        lines.append("")
    return lines


def precision_curves(steps: int, tmp: Path) -> list[str]:
    import jax.numpy as jnp  # noqa: F401
    from test_mixed_precision import _jax_losses

    from flowc.compiler import TRAIN_PRE_PASSES
    from flowc.frontend import ImportOptions, load_graph
    from flowc.passes.manager import PassManager

    data = tmp / "bert16.npz"
    rng = np.random.default_rng(8)
    ids = rng.integers(0, 1000, (4, 16)).astype(np.int64)
    mask = np.ones((4, 16), np.int64)
    mask[:, 11:] = 0
    np.savez(data, input_ids=ids, attention_mask=mask,
             target=rng.standard_normal((4, 128)).astype(np.float32))  # fmt: skip
    model = MODELS / "bert_tiny.onnx"
    curves = {}
    for p in ("fp32", "bf16", "fp16"):
        r = one(model, "mse:pooler_output,target", data, 2, ["seq=16"], "none", None, steps, tmp, p)
        curves[f"flowc {p}"] = r["losses"]
    opts = ImportOptions(trainable=True, batch=2, dims={"seq": 16})
    graph = PassManager(TRAIN_PRE_PASSES).run(load_graph(model, opts))
    arrays = dict(np.load(data))
    curves["jax fp32"] = _jax_losses(graph, arrays, steps)
    curves["jax bf16"] = _jax_losses(PassManager(["store_bf16"]).run(graph.copy()), arrays, steps)
    ref = curves["jax fp32"]
    lines = [f"## Loss curves, bert_tiny b2 s16, MSE on the pooled output, {steps} AdamW steps", ""]
    lines.append("  run        max |loss - jax fp32|   loss at step 1, 10, 25, last")
    for name, c in curves.items():
        gap = max(abs(a - b) for a, b in zip(c, ref, strict=True))
        marks = [c[0], c[min(9, len(c) - 1)], c[min(24, len(c) - 1)], c[-1]]
        lines.append(f"  {name:9}  {gap:20.3e}   " + ", ".join(f"{x:.5f}" for x in marks))
    return [*lines, ""]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--curve-steps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "train_memory.txt")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        lines = [f"# bench/train_memory.py ({time.strftime('%Y-%m-%d')})", ""]
        lines += recompute_table(args.steps, tmp)
        lines += precision_curves(args.curve_steps, tmp)
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
