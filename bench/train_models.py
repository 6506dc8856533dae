"""The issue's verification matrix beyond the MLP (issue 30): resnet_tiny and bert_tiny
trained on each plan with `flowc train` on the host target (mpirun started by flowc), 20
AdamW steps, the checkpoint's every float tensor against the one-device run's, and one plan
run twice for the same bits.

    python bench/train_models.py [--steps 20] [--models resnet,bert]
        [--out bench/results/train_models.txt]

Pipelines are compared with one device accumulating the same micro-batches (their batch
statistics and dropout masks are per micro-batch; these models have neither in training
mode, so the plain run agrees to rounding too). Figures, not pass/fail.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = ROOT / "tests" / "data" / "models"

from flowc import checkpoint  # noqa: E402

MODELS = {
    "resnet": (
        MODELS_DIR / "resnet_tiny.onnx",
        ["--loss", "mse:pooler_output,target", "--optimizer", "adamw:lr=0.001", "--batch", "8"],
    ),
    "bert": (
        MODELS_DIR / "bert_tiny.onnx",
        ["--loss", "mse:pooler_output,target", "--optimizer", "adamw:lr=0.001,eps=1e-6",
         "--batch", "8", "--dim", "seq=16"],
    ),
}  # fmt: skip
PLANS = [
    ("data 2", ["--mesh", "2"]),
    ("data 4", ["--mesh", "4"]),
    ("zero-1 on 4", ["--mesh", "4", "--zero", "1"]),
    ("zero-2 on 4", ["--mesh", "4", "--zero", "2"]),
    ("zero-3 on 4", ["--mesh", "4", "--zero", "3"]),
    ("pipeline 2, 4 mb, 1f1b", ["--pipeline", "2", "--microbatches", "4"]),
    ("pipeline 2, 4 mb, gpipe", ["--pipeline", "2", "--microbatches", "4",
                                 "--pipeline-schedule", "gpipe"]),
    ("pipeline x data 2x2, 2 mb", ["--pipeline", "2", "--microbatches", "2", "--mesh", "2x2"]),
]  # fmt: skip


def _data(tmp: Path, model: str) -> Path:
    rng = np.random.default_rng(5)
    path = tmp / f"{model}.npz"
    if model == "resnet":
        np.savez(
            path,
            pixel_values=rng.standard_normal((32, 3, 64, 64)).astype(np.float32),
            target=rng.standard_normal((32, 128, 1, 1)).astype(np.float32),
        )
    else:
        mask = np.ones((32, 16), np.int64)
        mask[:, 11:] = 0
        np.savez(
            path,
            input_ids=rng.integers(0, 1000, (32, 16)).astype(np.int64),
            attention_mask=mask,
            target=rng.standard_normal((32, 128)).astype(np.float32),
        )
    return path


def _train(model: str, data: Path, folder: Path, steps: int, extra: list[str]) -> float:
    path, args = MODELS[model]
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "flowc", "train", str(path), *args, "--data", str(data),
         "--steps", str(steps), "--target", "host", "--checkpoint-dir", str(folder), *extra],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return time.perf_counter() - t0


def _state(folder: Path) -> dict[str, np.ndarray]:
    return checkpoint.load_whole(checkpoint.read(folder))


def _worst(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return max(
        float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a if a[k].dtype.kind == "f"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--models", default="resnet,bert")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "train_models.txt")
    args = ap.parse_args()
    t_start = time.time()
    lines = [
        f"# bench/train_models.py ({time.strftime('%Y-%m-%d')}): {args.steps} AdamW steps, "
        "global batch 8, host target (2 cores), `flowc train` (compile, build, run)",
        "  model   plan                          worst diff from one device  "
        "(accumulating reference)  wall s",
    ]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for model in args.models.split(","):
            data = _data(tmp, model)
            _train(model, data, tmp / f"{model}-one", args.steps, [])
            one = _state(tmp / f"{model}-one")
            refs: dict[int, dict[str, np.ndarray]] = {}
            for k, (name, extra) in enumerate(PLANS):
                folder = tmp / f"{model}-plan{k}"
                wall = _train(model, data, folder, args.steps, extra)
                got = _state(folder)
                acc = "-"
                if "--microbatches" in extra:
                    m = int(extra[extra.index("--microbatches") + 1])
                    if m not in refs:
                        acc_run = ["--batch", str(8 // m), "--accumulate", str(m)]
                        _train(model, data, tmp / f"{model}-acc{m}", args.steps, acc_run)
                        refs[m] = _state(tmp / f"{model}-acc{m}")
                    acc = f"{_worst(refs[m], got):.1e}"
                lines.append(
                    f"  {model:<7} {name:<29} {_worst(one, got):.1e}{'':>19} {acc:>8}  {wall:7.1f}"
                )
                print(lines[-1], flush=True)
            # The same bits run to run: the first plan again.
            name, extra = PLANS[0]
            _train(model, data, tmp / f"{model}-again", args.steps, extra)
            first, again = _state(tmp / f"{model}-plan0"), _state(tmp / f"{model}-again")
            same = all(np.array_equal(first[k], v) for k, v in again.items())
            lines.append(
                f"  {model:<7} {name} run twice: {'the same bits' if same else 'DIFFERENT'}"
            )
            print(lines[-1], flush=True)
    lines.append(f"# {time.time() - t_start:.0f} s")
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
