"""What symbolic dims cost (issue 31, item 5): bert_tiny compiled once with batch=1..B and
seq=1..S, and resnet_tiny with batch=1..B, run at several sizes beside a static program
compiled for each size, on the host target: the median latency of each (model_main --bench
N), their ratio, the launches per run (FLOWC_STATS), the modeled GPU time of each (the
schedule's makespan under the H200 profile: the dynamic program's schedule costed at that
size, --dim batch=1..B@b), and the arena of the dynamic program beside the static one's at
the bound.

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "data" / "models"

import onnx  # noqa: E402

from flowc.compiler import compile_graph, load_model  # noqa: E402
from flowc.harness.build import bench_figures, build, run  # noqa: E402
from flowc.options import ModelArgs  # noqa: E402

# Alternating rounds of --bench N per program and size: the best median of each.
ROUNDS = 3


@dataclass(frozen=True)
class Case:
    """A model compiled once over ``bound`` (symbol -> max, each from 1) and run at
    ``sizes`` (the power-of-two ones are the goal's; the rest are between buckets)."""

    title: str
    model: Callable[[Path], Path]  # the ONNX file (written into the folder given)
    bound: dict[str, int]
    sizes: list[tuple[int, ...]]
    feeds: Callable[[tuple[int, ...]], dict[str, np.ndarray]]


def _bert_feeds(size: tuple[int, ...]) -> dict[str, np.ndarray]:
    b, s = size
    rng = np.random.default_rng(b * 1000 + s)
    mask = np.ones((b, s), np.int64)
    mask[0, s // 2 :] = 0
    return {"input_ids": rng.integers(0, 1000, (b, s)).astype(np.int64), "attention_mask": mask}


def _resnet(folder: Path) -> Path:
    """The shared resnet_tiny with its batch dim renamed to a symbol."""
    m = onnx.load(str(MODELS / "resnet_tiny.onnx"))
    for vi in (*m.graph.input, *m.graph.output):
        vi.type.tensor_type.shape.dim[0].dim_param = "batch"
    path = folder / "resnet_tiny_batch.onnx"
    onnx.save(m, str(path))
    return path


def _images(size: tuple[int, ...]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(size[0])
    return {"pixel_values": rng.standard_normal((size[0], 3, 64, 64)).astype(np.float32)}


CASES = [
    Case(
        "bert_tiny",
        lambda _: MODELS / "bert_tiny.onnx",
        {"batch": 8, "seq": 64},
        [(1, 8), (2, 16), (4, 32), (8, 64), (1, 1), (3, 24), (5, 40)],
        _bert_feeds,
    ),
    Case(
        "resnet_tiny (a symbolic batch)",
        _resnet,
        {"batch": 8},
        [(1,), (2,), (4,), (8,), (3,), (5,)],
        _images,
    ),
]


def _project(model: Path, dims: tuple[str, ...], out: Path, built: bool = True) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = load_model(ModelArgs(path=model, dims=dims))
    compile_graph(graph, out, source=model.name, build_target="host")
    if built:
        build(out, "host")
    return out


def _makespan(out: Path) -> float:
    return float(json.loads((out / "schedule.json").read_text())["ranks"][0]["makespan_us"])


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


def _case(case: Case, tmp: Path, runs: int) -> tuple[list[str], float]:
    """The table of one case, and its worst ratio at the power-of-two sizes."""
    names = list(case.bound)
    ranges = ", ".join(f"{n}=1..{hi}" for n, hi in case.bound.items())
    lines = [
        f"{case.title}, one program for {ranges}, beside a static program per size",
        "",
        f"{' x '.join(names):>12} {'dynamic ms':>11} {'static ms':>10} {'ratio':>6} "
        f"{'launches dyn/static':>20} {'modeled us dyn/static':>22}",
    ]
    model = case.model(tmp)
    dyn = _project(model, tuple(f"{n}=1..{hi}" for n, hi in case.bound.items()), tmp / "dynamic")
    ratios = []
    arena = {"dynamic": json.loads((dyn / "flowc_model.json").read_text())["arena_bytes"]}
    for size in case.sizes:
        tag = "_".join(map(str, size))
        at = dict(zip(names, size, strict=True))
        static = _project(model, tuple(f"{n}={v}" for n, v in at.items()), tmp / f"static_{tag}")
        d_ms, d_l, s_ms, s_l = _pair(dyn, static, case.feeds(size), runs)
        ratio = d_ms / s_ms
        typical = tuple(f"{n}=1..{case.bound[n]}@{v}" for n, v in at.items())
        modeled = _makespan(_project(model, typical, tmp / f"typical_{tag}", built=False))
        model_text = f"{modeled:.1f}/{_makespan(static):.1f}"
        pow2 = all(v & (v - 1) == 0 for v in size)
        if pow2:
            ratios.append(ratio)
        lines.append(
            f"{' x '.join(map(str, size)):>12} {d_ms:>11.3f} {s_ms:>10.3f} {ratio:>6.2f} "
            f"{f'{d_l:g}/{s_l:g}':>20} {model_text:>22}{'' if pow2 else '  (between buckets)'}"
        )
        if at == case.bound:
            arena["static"] = json.loads((static / "flowc_model.json").read_text())["arena_bytes"]
    lines += [
        "",
        f"worst ratio at the power-of-two sizes: {max(ratios):.2f} (goal: at most 1.10)",
        f"arena: dynamic {arena['dynamic']} bytes, static at the bound {arena['static']} bytes",
    ]
    return lines, max(ratios)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "dynamic_cost.txt")
    args = ap.parse_args()
    t0 = time.time()
    lines = [
        f"host target, {os.cpu_count()} cores; the best of {ROUNDS} alternating medians of "
        f"{args.runs} runs (model_main --bench); the dynamic programs run through one CUDA "
        "Graph per size bucket (the emulator's), as the static ones through theirs",
        "",
    ]
    worst = []
    for case in CASES:
        with tempfile.TemporaryDirectory(prefix="flowc-dyn-bench-") as tmp:
            table, ratio = _case(case, Path(tmp), args.runs)
        lines += [*table, ""]
        worst.append(ratio)
        print("\n".join(table), flush=True)
    lines += [
        f"worst ratio at the power-of-two sizes, all models: {max(worst):.2f} (goal: at most 1.10)",
        f"({time.time() - t0:.0f} s)",
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    args.out.write_text(text)


if __name__ == "__main__":
    main()
