"""Pipeline training (issue 30, item 4): per plan, on the host target under mpirun, the
host's steps per second, the bytes each rank sends per step (the stage programs' exchanges
and collectives beside what the ranks logged, FLOWC_COMM_LOG), the modeled bubble under the
H200 profile beside (P-1)/(M+P-1) and the bubble measured in the host trace (FLOWC_TRACE:
the share of each rank's step spent in its exchanges, which on the host is waiting for its
neighbour), each stage's arena, and the worst difference from one device accumulating the
same micro-batches.

    python bench/train_pipeline.py [--steps 20] [--out bench/results/train_pipeline.txt]

Figures, not pass/fail: tests/test_train_pipeline.py and tests/test_distributed_training.py
hold the checks. Host times on a 2-core machine: 2 ranks have a core each, 4 share them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from flowc.harness.build import build, launcher  # noqa: E402
from flowc.trainer import compile_step, spec_from  # noqa: E402

MLP = ROOT / "tests" / "data" / "models" / "mlp.onnx"
BERT = ROOT / "tests" / "data" / "models" / "bert_tiny.onnx"
RESNET = ROOT / "tests" / "data" / "models" / "resnet_tiny.onnx"
# name, model, mesh, stages, micro-batches, schedule
PLANS = [
    ("mlp 1f1b P2 M4", "mlp", "2", 2, 4, "1f1b"),
    ("mlp gpipe P2 M4", "mlp", "2", 2, 4, "gpipe"),
    ("mlp 1f1b P2 M8", "mlp", "2", 2, 8, "1f1b"),
    ("mlp gpipe P2 M8", "mlp", "2", 2, 8, "gpipe"),
    ("mlp 1f1b 2x2 M4", "mlp", "2x2", 2, 4, "1f1b"),
    ("bert 1f1b P2 M2", "bert", "2", 2, 2, "1f1b"),
    ("bert gpipe P2 M4", "bert", "2", 2, 4, "gpipe"),
    ("resnet 1f1b P2 M2", "resnet", "2", 2, 2, "1f1b"),
]
MODELS = {
    "mlp": (MLP, "cross_entropy:/m/m.2/Gemm_output_0,labels", "adamw:lr=0.01", 8, ()),
    "bert": (BERT, "mse:pooler_output,target", "adamw:lr=0.001,eps=1e-6", 8, ("seq=16",)),
    "resnet": (RESNET, "mse:pooler_output,target", "adamw:lr=0.001", 4, ()),
}


def _data(tmp: Path, model: str) -> dict[str, Path]:
    rng = np.random.default_rng(3)
    if model == "mlp":
        x = rng.standard_normal((40, 64)).astype(np.float32)
        arrays = {"x": x, "labels": (x @ rng.standard_normal((64, 10))).argmax(1).astype(np.int64)}
    elif model == "resnet":
        arrays = {
            "pixel_values": rng.standard_normal((16, 3, 64, 64)).astype(np.float32),
            "target": rng.standard_normal((16, 128, 1, 1)).astype(np.float32),
        }
    else:
        mask = np.ones((16, 16), np.int64)
        mask[:, 11:] = 0
        arrays = {
            "input_ids": rng.integers(0, 1000, (16, 16)).astype(np.int64),
            "attention_mask": mask,
            "target": rng.standard_normal((16, 128)).astype(np.float32),
        }
    out = {}
    for name, a in arrays.items():
        out[name] = tmp / f"{model}.{name}.npy"
        np.save(out[name], a)
    return out


def _run(out: Path, ranks: int, data: dict[str, Path], steps: int, batch: int, tmp: Path):
    bdir = build(out, "host", quick=True)
    cmd, env = launcher(ranks, "host")
    log, trace = tmp / f"{out.name}.comm", tmp / f"{out.name}.trace.jsonl"
    flags = [a for n, p in data.items() for a in ("--data", f"{n}={p}")]
    t0 = time.perf_counter()
    r = subprocess.run(
        [*cmd, str(bdir / "model_main"), "train", "--weights", str(out / "weights.bin"), *flags,
         "--steps", str(steps), "--batch", str(batch), "--save", str(out / "s.bin")],
        env={**os.environ, **env, "FLOWC_COMM_LOG": str(log), "FLOWC_TRACE": str(trace)},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    rate = re.findall(r"([\d.]+) examples/s", r.stderr)
    steps_s = float(rate[-1]) / batch if rate else steps / (time.perf_counter() - t0)
    return np.frombuffer((out / "s.bin").read_bytes(), np.uint8), steps_s, log, trace


def _logged(log: Path, ranks: int, k: int, steps: int) -> float:
    """Bytes each rank sent per step, from the ranks' communication logs (mean over ranks):
    its sends, and a ring all-reduce's 2(k-1)/k of its buffer over a stage's k ranks."""
    total = 0.0
    for r in range(ranks):
        for line in Path(f"{log}.rank{r}").read_text().splitlines():
            m = re.match(r"([a-z-]+) .*bytes=(\d+)", line)
            if m and m.group(1) == "send":
                total += int(m.group(2))
            elif m and m.group(1) == "all-reduce":
                total += 2 * (k - 1) / k * int(m.group(2))
    return total / ranks / steps


def _measured_bubble(trace: Path, ranks: int) -> float:
    """The share of the last traced step each rank spent in its exchanges, mean over ranks."""
    shares = []
    for r in range(ranks):
        lines = [
            json.loads(x)
            for x in Path(f"{trace.with_suffix('')}.rank{r}.jsonl").read_text().splitlines()
        ]
        last = max(x["run"] for x in lines)
        run = [x for x in lines if x["run"] == last]
        span = max(x["end_us"] for x in run) - min(x["start_us"] for x in run)
        waiting = sum(x["end_us"] - x["start_us"] for x in run if x["name"].startswith("exchange"))
        shares.append(waiting / span if span > 0 else 0.0)
    return float(np.mean(shares))


def _diff(a: np.ndarray, b: np.ndarray) -> float:
    n = min(a.size, b.size) // 4 * 4
    fa = np.frombuffer(a[256:n].tobytes(), np.float32).astype(np.float64)
    fb = np.frombuffer(b[256:n].tobytes(), np.float32).astype(np.float64)
    ok = np.isfinite(fa) & np.isfinite(fb) & (np.abs(fa) < 1e6)
    return float(np.abs(fa[ok] - fb[ok]).max()) if ok.any() else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "train_pipeline.txt")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    t_start = time.time()
    lines = [
        f"# bench/train_pipeline.py ({time.strftime('%Y-%m-%d')}): AdamW, {args.steps} steps, "
        "host target (2 cores); the reference: one device accumulating the same micro-batches",
        "  plan               sent B/rank/step (planned, logged)  bubble modeled / formula / "
        "host-measured  in flight  arena B per stage  host steps/s  worst diff",
    ]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        refs: dict[tuple[str, int], np.ndarray] = {}
        for name, model, mesh, stages, micro, schedule in PLANS:
            path, loss, opt, batch, dims = MODELS[model]
            data = _data(tmp, model)
            if (model, micro) not in refs:
                ref = tmp / f"ref_{model}_{micro}"
                spec = spec_from(loss, opt, accumulate=micro)
                compile_step(path, spec, ref, batch=batch // micro, target="host", dim=list(dims))
                refs[(model, micro)] = _run(ref, 1, data, args.steps, batch, tmp)[0]
            out = tmp / re.sub(r"\W+", "_", name)
            said: list[str] = []
            compile_step(
                path, spec_from(loss, opt), out, batch=batch, target="host", progress=said.append,
                pipeline=stages, microbatches=micro, mesh=mesh, pipeline_schedule=schedule,
                dim=list(dims),
            )  # fmt: skip
            text = "\n".join(said)
            sent = sum(int(x.replace(",", "")) for x in re.findall(r"sending ([\d,]+) B", text))
            ranks = int(np.prod([int(d) for d in mesh.split("x")]))
            k = ranks // stages
            bubble = re.search(r"bubble \(.*?\): ([\d.]+) \(the formula .*?: ([\d.]+)\)", text)
            flight = re.search(r"in flight per stage: (\[[\d, ]+\])", text)
            arena = re.search(r"arena per stage: ([\d, ]+) B", text)
            state, steps_s, log, trace = _run(out, ranks, data, args.steps, batch, tmp)
            logged = _logged(log, ranks, k, args.steps)
            measured = _measured_bubble(trace, ranks)
            diff = _diff(refs[(model, micro)], state)
            assert bubble and flight and arena
            lines.append(
                f"  {name:<18} {sent / stages / k:>9,.0f} {logged:>9,.0f}   "
                f"{bubble.group(1)} / {bubble.group(2)} / {measured:.3f}   {flight.group(1):<8} "
                f"{arena.group(1):<22} {steps_s:9.1f}  {diff:.1e}"
            )
            print(lines[-1], flush=True)
    lines.append(f"# {time.time() - t_start:.0f} s")
    lines.append(
        "# sent: the stage programs' exchanges per step, mean over ranks (pipeline x data also "
        "all-reduces each stage's gradients, which the planned column leaves out); logged: the "
        "ranks' FLOWC_COMM_LOG sends plus 2(k-1)/k of each all-reduce's bytes. measured bubble: "
        "the share of each rank's last step spent in exchanges (on the host, waiting for the "
        "neighbour stage), mean over ranks."
    )
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
