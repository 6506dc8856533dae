"""MiniMalloc's 11 challenging instances through flowc's placer (flowc/memory/placement.py).

Per instance: buffers, lower bound (the most bytes live at once), the greedy stage's peak, the
final peak after the canonical search, their ratio to the lower bound, whether the placement
fits the instance's capacity (1,048,576 bytes, in the file name) and the seconds taken; then
the summary against the goals of issue 15 (every ratio <= 1.10 in under 10 s, the average
<= 1.03, as many fitting as MiniMalloc: 11 of 11). Every placement goes through the
independent checker. Prints the table and writes bench/results/minimalloc.txt.

    .venv/bin/python bench/minimalloc_bench.py [--work-limit N] [INSTANCE.csv ...]

The data lives in ../shared/data/minimalloc beside the repository (README.md there says
where it comes from).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flowc.memory import placement  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "minimalloc"
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
        f"{'inst':5} {'buffers':>7} {'lower bd':>9} {'greedy':>9} {'peak':>9} "
        f"{'greedy/lb':>9} {'ratio':>7} {'fits':>5} {'seconds':>7}",
    ]
    print("\n".join(lines), flush=True)
    ratios: list[float] = []
    times: list[float] = []
    fits = 0
    for f in files:
        capacity = int(f.stem.split(".")[-1]) if f.stem.split(".")[-1].isdigit() else None
        ivs = placement.read_csv(f)
        t0 = time.perf_counter()
        greedy = placement.place(ivs, exact=False)
        result = placement.place(ivs, capacity=capacity, work_limit=args.work_limit)
        seconds = time.perf_counter() - t0
        placement.check_placement(ivs, result.offsets)
        lb = result.lower_bound
        ratio = result.peak / lb
        ok = capacity is None or result.peak <= capacity
        fits += ok
        ratios.append(ratio)
        times.append(seconds)
        line = (
            f"{f.stem.split('.')[0]:5} {len(ivs):7d} {lb:9d} {greedy.peak:9d} {result.peak:9d} "
            f"{greedy.peak / lb:9.4f} {ratio:7.4f} {'yes' if ok else 'no':>5} {seconds:7.2f}"
        )
        lines.append(line)
        print(line, flush=True)
    n = len(files)
    avg = sum(ratios) / n
    summary = [
        f"average ratio {avg:.4f} (goal <= 1.03), worst {max(ratios):.4f} (goal <= 1.10), "
        f"slowest {max(times):.2f} s (goal < 10 s)",
        f"fits its capacity: {fits} of {n} (MiniMalloc: 11 of 11)",
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
