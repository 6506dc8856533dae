"""`flowc plan-memory` at scale: 30,000 and 100,000 buffers on four kinds of timeline, each
in a fresh process (issue 23, point 6: bounded memory, no recursion that grows with the
input, within the work limit).

Timelines (seeded, written as MiniMalloc CSVs to a temporary folder):

- model: buffer i born at step i, most living 1-8 steps, 2% to the end (one group across
  the whole timeline, about 0.01 n conflicts per buffer), sizes multiples of 256;
- uniform: starts uniform over n steps, lifetimes 1-200 steps, sizes 1-65,535;
- wide: starts uniform, ends uniform between start and n (a third of all buffers
  conflict with each one: 1.7 billion pairs at 100,000);
- chain: buffer i born at step i // 2, living 1-6 steps (few conflicts, groups the
  search can take).

Per run: the peak and lower bound `plan-memory` prints, the seconds of the whole process
(reading, placing, the checker, writing --offsets) and its peak resident memory (ru_maxrss
of that child alone, from os.wait4). Writes bench/results/placement_scale.txt.

    .venv/bin/python bench/placement_scale.py [--sizes 30000,100000] [--work-limit N]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "placement_scale.txt"


def timeline(kind: str, n: int, seed: int = 0) -> list[tuple[int, int, int, int]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        if kind == "model":
            a = i
            b = n + 1 if rng.random() < 0.02 else i + rng.randrange(1, 9)
            size = rng.randrange(1, 64) * 256
        elif kind == "uniform":
            a = rng.randrange(0, n)
            b = a + rng.randrange(1, 201)
            size = rng.randrange(1, 65536)
        elif kind == "wide":
            a = rng.randrange(0, n)
            b = rng.randrange(a + 1, n + 2)
            size = rng.randrange(1, 65536)
        else:  # chain
            a = i // 2
            b = a + rng.randrange(1, 7)
            size = rng.randrange(1, 65536)
        rows.append((i, a, b, size))
    return rows


def run(csv_path: Path, extra: list[str]) -> tuple[str, float, float]:
    """plan-memory's last line, the process's seconds and its peak RSS in MB."""
    cmd = [sys.executable, "-m", "flowc", "plan-memory", str(csv_path)]
    cmd += ["--offsets", str(csv_path.with_suffix(".out.csv")), *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    assert proc.stdout is not None
    text = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{csv_path.name}: exit {proc.returncode}\n{text}")
    return text.strip().splitlines()[-1], seconds, usage.ru_maxrss / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="30000,100000")
    ap.add_argument("--work-limit", type=int, default=None)
    args = ap.parse_args()
    extra = [] if args.work_limit is None else ["--work-limit", str(args.work_limit)]
    limit = "default" if args.work_limit is None else str(args.work_limit)
    lines = [
        f"flowc plan-memory at scale (work limit {limit}; one process each, checker and "
        "--offsets included)",
        f"{'timeline':9} {'buffers':>8} {'lower bd':>11} {'peak':>11} {'ratio':>7} "
        f"{'seconds':>7} {'peak RSS MB':>11}",
    ]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.sizes.split(",")):
            for kind in ("model", "uniform", "wide", "chain"):
                path = Path(tmp) / f"{kind}{n}.csv"
                path.write_text(
                    "id,lower,upper,size\n"
                    + "".join(f"{a},{b},{c},{d}\n" for a, b, c, d in timeline(kind, n))
                )
                last, seconds, rss = run(path, extra)
                words = last.split()  # peak P lower_bound L ratio R
                line = (
                    f"{kind:9} {n:8d} {int(words[3]):11d} {int(words[1]):11d} "
                    f"{float(words[5]):7.4f} {seconds:7.1f} {rss:11.0f}"
                )
                lines.append(line)
                print(line, flush=True)
    if args.sizes == "30000,100000" and args.work_limit is None:
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text("\n".join(lines) + "\n")
        print(f"wrote {RESULT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
