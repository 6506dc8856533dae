"""MiniMalloc's 11 challenging instances through flowc's placer (flowc/memory/placement.py).

Per instance: buffers, lower bound (the most bytes live at once), the greedy stage's peak;
then the placement without a capacity (the default mode of `flowc plan-memory`: peak, ratio
to the lower bound, seconds) and with the instance's capacity (1,048,576 bytes, in the file
name: peak, ratio, whether it fits, seconds); then the summary against the goals (issue 15:
with the capacity every ratio <= 1.10 in under 10 s, the average <= 1.03, as many fitting
as MiniMalloc, 11 of 11; issue 23: without a capacity every ratio <= 1.10 too). Every
placement goes through the independent checker. Prints the table and writes
bench/results/minimalloc.txt.

    .venv/bin/python bench/minimalloc_bench.py [--work-limit N] [INSTANCE.csv ...]

The data lives in tests/data/minimalloc (README.md there says where it comes from).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flowc.memory import placement  # noqa: E402

DATA = ROOT / "tests" / "data" / "minimalloc"
RESULT = ROOT / "bench" / "results" / "minimalloc.txt"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path, help="instances (default: all of them)")
    ap.add_argument("--work-limit", type=int, default=placement.DEFAULT_WORK_LIMIT)
    args = ap.parse_args()
    files = args.files or sorted(DATA.glob("*.csv"))
    if not files:
        print(
            f"error: no MiniMalloc instances in {DATA} (expected A.1048576.csv ... "
            "K.1048576.csv from google/minimalloc's benchmarks/challenging)",
            file=sys.stderr,
        )
        return 2
    lines = [
        f"MiniMalloc challenging instances, work limit {args.work_limit} search nodes",
        f"{'':31} {'--- no capacity ---':>25}   {'----- with the capacity -----':>31}",
        f"{'inst':5} {'buffers':>7} {'lower bd':>9} {'greedy/lb':>9} "
        f"{'peak':>9} {'ratio':>7} {'seconds':>7}   "
        f"{'peak':>9} {'ratio':>7} {'fits':>5} {'seconds':>7}",
    ]
    print("\n".join(lines), flush=True)
    free: list[float] = []
    capped: list[float] = []
    times: list[float] = []
    fits = 0
    for f in files:
        capacity = int(f.stem.split(".")[-1]) if f.stem.split(".")[-1].isdigit() else None
        ivs = placement.read_csv(f)
        greedy = placement.place(ivs, exact=False)
        t0 = time.perf_counter()
        default = placement.place(ivs, work_limit=args.work_limit)
        t1 = time.perf_counter()
        result = placement.place(ivs, capacity=capacity, work_limit=args.work_limit)
        t2 = time.perf_counter()
        placement.check_placement(ivs, default.offsets)
        placement.check_placement(ivs, result.offsets)
        lb = result.lower_bound
        ok = capacity is None or result.peak <= capacity
        fits += ok
        free.append(default.peak / lb)
        capped.append(result.peak / lb)
        times += [t1 - t0, t2 - t1]
        line = (
            f"{f.stem.split('.')[0]:5} {len(ivs):7d} {lb:9d} {greedy.peak / lb:9.4f} "
            f"{default.peak:9d} {default.peak / lb:7.4f} {t1 - t0:7.2f}   "
            f"{result.peak:9d} {result.peak / lb:7.4f} {'yes' if ok else 'no':>5} {t2 - t1:7.2f}"
        )
        lines.append(line)
        print(line, flush=True)
    n = len(files)
    summary = [
        f"no capacity: average ratio {sum(free) / n:.4f}, worst {max(free):.4f} (goal <= 1.10)",
        f"with the capacity: average ratio {sum(capped) / n:.4f} (goal <= 1.03), "
        f"worst {max(capped):.4f} (goal <= 1.10), fits {fits} of {n} (MiniMalloc: 11 of 11)",
        f"slowest {max(times):.2f} s (goal < 10 s)",
    ]
    lines += summary
    print("\n".join(summary))
    if not args.files:
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text("\n".join(lines) + "\n")
        print(f"wrote {RESULT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
