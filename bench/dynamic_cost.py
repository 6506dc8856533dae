"""What symbolic dims cost (issue 31, item 5): bert_tiny compiled once with batch=1..B and
seq=1..S, run at several sizes beside a static program compiled for each size, on the host
target: the median latency of each (model_main --bench N), their ratio, the launches per run
(FLOWC_STATS), the modeled GPU time of each (the schedule's makespan under the H200
profile: the dynamic program's schedule costed at that size, --dim batch=1..B@b), and the
arena of the dynamic program beside the static one's at the bound.

    python bench/dynamic_cost.py [--runs 30] [--out bench/results/dynamic_cost.txt]

The goal is a ratio of at most 1.10 at the power-of-two sizes; between them the figure is
reported, not bounded. Figures, not pass/fail (tests/test_dynamic.py holds the checks). Host
times on a 2-core machine: the emulator's, not a GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "data" / "models" / "bert_tiny.onnx"

from flowc.compiler import compile_graph, load_model  # noqa: E402
from flowc.harness.build import bench_figures, build, run  # noqa: E402
from flowc.options import ModelArgs  # noqa: E402

BOUND = (8, 64)
# Alternating rounds of --bench N per program and size: the best median of each.
ROUNDS = 3
# (batch, seq): the power-of-two sizes (the goal), then sizes between them
SIZES = [(1, 8), (2, 16), (4, 32), (8, 64), (3, 24), (5, 40), (1, 1)]


def _project(dims: tuple[str, ...], out: Path, built: bool = True) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = load_model(ModelArgs(path=MODEL, dims=dims))
    compile_graph(graph, out, source=MODEL.name, build_target="host")
    if built:
        build(out, "host")
    return out


def _makespan(out: Path) -> float:
    return float(json.loads((out / "schedule.json").read_text())["ranks"][0]["makespan_us"])


def _feeds(b: int, s: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(b * 1000 + s)
    mask = np.ones((b, s), np.int64)
    mask[0, s // 2 :] = 0
    return {"input_ids": rng.integers(0, 1000, (b, s)).astype(np.int64), "attention_mask": mask}


def _measure(out: Path, feeds: dict[str, np.ndarray], runs: int) -> tuple[float, float]:
    _, stdout = run(out, feeds, bench=runs, env={"FLOWC_STATS": "1"})
    median = float(bench_figures(stdout)["latency_ms"]["median"])
    launches = next(
        float(line.split(":")[1].split("(")[0])
        for line in stdout.splitlines()
        if line.startswith("launches per run")
    )
    return median, launches


def _pair(
    dyn: Path, static: Path, feeds: dict[str, np.ndarray], runs: int
) -> tuple[float, float, float, float]:
    """Both programs in ROUNDS alternating rounds; each one's best median (the host's noise
    only ever adds time)."""
    d, s = [], []
    for _ in range(ROUNDS):
        d.append(_measure(dyn, feeds, runs))
        s.append(_measure(static, feeds, runs))
    return min(x[0] for x in d), d[0][1], min(x[0] for x in s), s[0][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "dynamic_cost.txt")
    args = ap.parse_args()
    t0 = time.time()
    lines = [
        f"bert_tiny, one program for batch=1..{BOUND[0]}, seq=1..{BOUND[1]}, beside a static "
        f"program per size; host target, {os.cpu_count()} cores; the best of {ROUNDS} "
        f"alternating medians of {args.runs} runs (model_main --bench)",
        "",
        f"{'batch x seq':>12} {'dynamic ms':>11} {'static ms':>10} {'ratio':>6} "
        f"{'launches dyn/static':>20} {'modeled us dyn/static':>22}",
    ]
    with tempfile.TemporaryDirectory(prefix="flowc-dyn-bench-") as tmp:
        dyn = _project((f"batch=1..{BOUND[0]}", f"seq=1..{BOUND[1]}"), Path(tmp) / "dynamic")
        arena = {}
        ratios = []
        for b, s in SIZES:
            static = _project((f"batch={b}", f"seq={s}"), Path(tmp) / f"static_{b}_{s}")
            feeds = _feeds(b, s)
            d_ms, d_l, s_ms, s_l = _pair(dyn, static, feeds, args.runs)
            ratio = d_ms / s_ms
            at = (f"batch=1..{BOUND[0]}@{b}", f"seq=1..{BOUND[1]}@{s}")
            modeled = _makespan(_project(at, Path(tmp) / f"typical_{b}_{s}", built=False))
            model_text = f"{modeled:.1f}/{_makespan(static):.1f}"
            pow2 = b & (b - 1) == 0 and s & (s - 1) == 0 and (b, s) != (1, 1)
            if pow2:
                ratios.append(ratio)
            mark = "" if pow2 else "  (between sizes)"
            lines.append(
                f"{f'{b} x {s}':>12} {d_ms:>11.3f} {s_ms:>10.3f} {ratio:>6.2f} "
                f"{f'{d_l:g}/{s_l:g}':>20} {model_text:>22}{mark}"
            )
            if (b, s) == BOUND:
                arena["static"] = json.loads((static / "flowc_model.json").read_text())[
                    "arena_bytes"
                ]
        arena["dynamic"] = json.loads((dyn / "flowc_model.json").read_text())["arena_bytes"]
    lines += [
        "",
        f"worst ratio at the power-of-two sizes: {max(ratios):.2f} (goal: at most 1.10)",
        f"arena: dynamic {arena['dynamic']} bytes, static at the bound {arena['static']} bytes",
        f"({time.time() - t0:.0f} s)",
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    args.out.write_text(text)


if __name__ == "__main__":
    main()
