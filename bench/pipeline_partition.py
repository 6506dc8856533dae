"""Pipeline stage partition on the GPT-2 generator graph: the balance of the automatic
partition (slowest stage over the mean, the issue's goal <= 1.05 at P = 2 and 4), what crosses
each cut, the partition's own run time, a memory-limited case, and the micro-batch schedules
simulated on the stage times.

    .venv/bin/python bench/pipeline_partition.py                 # GPT-2 small, P = 1, 2, 4, 8
    .venv/bin/python bench/pipeline_partition.py --layers 24 --hidden 1024 --heads 16

Stage times come from the cost model (flowc/parallel/profiles/h200-nvlink.toml): each node's
single-device time, plus alpha + bytes / bandwidth for every value sent over a cut, on both
sides. The schedules use one micro-batch per batch of the graph (its stage times as F, twice
that as a synthetic B for 1F1B) and the largest cut's transfer time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt2_graph import gpt2_model

from flowc.errors import FlowcWarning, InputError
from flowc.frontend import load_graph
from flowc.ir.graph import Graph
from flowc.parallel.cost import load_profile
from flowc.passes.manager import PassManager
from flowc.schedule.partition import partition
from flowc.schedule.pipeline import gpipe, one_f_one_b, simulate


def gpt2_graph(layers: int, hidden: int, heads: int, seq: int, batch: int, vocab: int) -> Graph:
    """The generator's model (fill weights) read as flowc reads a model for placement."""
    model = gpt2_model(layers, hidden, heads, seq, batch, vocab, weights="fill")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt2.onnx"
        onnx.save(model, str(path))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FlowcWarning)
            g = load_graph(path)
    return PassManager(("fold_constants", "simplify", "split_projections")).run(g)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--stages", default="1,2,4,8")
    ap.add_argument("--microbatches", type=int, default=8)
    a = ap.parse_args(argv)
    profile = load_profile()
    t0 = time.perf_counter()
    g = gpt2_graph(a.layers, a.hidden, a.heads, a.seq, a.batch, a.vocab)
    build_s = time.perf_counter() - t0
    link = profile.axis_link(0)
    print(
        f"# GPT-2 {a.layers} layers, hidden {a.hidden}, {a.heads} heads, seq {a.seq}, batch "
        f"{a.batch}, vocab {a.vocab}: {len(g.nodes)} nodes, graph built in {build_s:.2f} s"
    )
    print(
        f"# profile {profile.name}; pipeline link alpha {link.alpha * 1e6:.1f} us, "
        f"{link.bandwidth / 1e9:.0f} GB/s"
    )
    print(
        f"{'P':>2} {'max us':>8} {'mean us':>8} {'max/mean':>8} {'cut values':>10} "
        f"{'cut KiB':>8} {'DP s':>6}  stage times (us)"
    )
    one_stage = 0.0
    results = {}
    for p in (int(s) for s in a.stages.split(",")):
        t0 = time.perf_counter()
        part = partition(g, p, profile)
        dp_s = time.perf_counter() - t0
        results[p] = part
        if p == 1:
            one_stage = part.max_s
        values = sum(len(c) for c in part.boundaries)
        kib = sum(b.nbytes for c in part.boundaries for b in c) / 1024
        times = " ".join(f"{t * 1e6:.1f}" for t in part.stage_s)
        print(
            f"{p:>2} {part.max_s * 1e6:>8.1f} {part.mean_s * 1e6:>8.1f} {part.ratio:>8.3f} "
            f"{values:>10} {kib:>8.0f} {dp_s:>6.2f}  {times}"
        )
    for p, part in results.items():
        if p > 1:
            print(f"\n# P = {p}: what crosses each cut")
            for c, cut in enumerate(part.boundaries):
                names = ", ".join(f"{b.value} ({b.nbytes // 1024} KiB)" for b in cut)
                print(f"  cut {c} -> {c + 1} after node {part.starts[c + 1] - 1}: {names}")

    p4 = results.get(4)
    if p4 is not None:
        fullest = max(p4.memory_bytes())
        limit = int(fullest * 0.8)
        print(f"\n# P = 4 under a memory limit of {limit / 2**20:.1f} MiB per device")
        print(
            f"  unlimited: fullest device {fullest / 2**20:.1f} MiB, max/mean {p4.ratio:.3f}, "
            f"max {p4.max_s * 1e6:.1f} us"
        )
        try:
            lim = partition(g, 4, profile, mem_limit=limit)
            print(
                f"  limited:   fullest device {max(lim.memory_bytes()) / 2**20:.1f} MiB, "
                f"max/mean {lim.ratio:.3f}, max {lim.max_s * 1e6:.1f} us"
            )
        except InputError as e:
            print(f"  limited:   {e}")

    m = a.microbatches
    print(f"\n# schedules on the stage times, M = {m} micro-batches")
    print(
        f"{'P':>2} {'schedule':>8} {'makespan us':>11} {'bubble':>7} {'(P-1)/(M+P-1)':>13} "
        f"{'speed-up':>8} {'in flight per stage':>20}"
    )
    for p, part in results.items():
        f_s = part.compute_s
        x_s = part.cut_s
        ideal = (p - 1) / (m + p - 1)
        inf = simulate(gpipe(p, m), m, f_s, 0.0, x_s)
        speed = m * one_stage / inf.makespan if one_stage else 0.0
        print(
            f"{p:>2} {'GPipe':>8} {inf.makespan * 1e6:>11.1f} {inf.bubble:>7.3f} {ideal:>13.3f} "
            f"{speed:>8.2f} {inf.max_in_flight!s:>20}"
        )
        tr = simulate(one_f_one_b(p, m), m, f_s, [2 * t for t in f_s], x_s)
        print(
            f"{p:>2} {'1F1B':>8} {tr.makespan * 1e6:>11.1f} {tr.bubble:>7.3f} {ideal:>13.3f} "
            f"{3 * m * one_stage / tr.makespan if one_stage else 0.0:>8.2f} "
            f"{tr.max_in_flight!s:>20}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
