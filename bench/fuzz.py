"""Fuzz flowc's front ends: ONNX model mutants and DSL program mutants (tests/fuzzing.py,
the generators the test suite runs a bounded share of), each case in a forked child under a
4 GiB address-space limit and a per-case timeout.

    python bench/fuzz.py --count 20000 -j 2 --save /tmp/fuzz-found
    python bench/fuzz.py --seconds 600 --gen onnx --start 100000

Prints the count of each outcome: accepted (imported, compiled, code generated), rejected
(a FlowcError, exit 2), internal error, crash, hang, memory. The first reproducer of each
distinct internal error (by the last frame of its traceback) is saved to the --save folder
with its traceback beside it. Exit status 1 when any case ended in anything but accepted or
rejected.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import fuzzing


def signature(message: str) -> str:
    """What tells two internal errors apart: the innermost flowc frame and the exception."""
    frames = re.findall(r'File "([^"]*flowc[^"]*)", line (\d+), in (\w+)', message)
    last = message.strip().splitlines()[-1] if message.strip() else ""
    exc = last.split(":")[0]
    if frames:
        f, line, fn = frames[-1]
        return f"{Path(f).name}:{line} {fn} {exc}"
    return last[:120]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--count", type=int, default=None, help="cases to run")
    ap.add_argument("--seconds", type=float, default=None, help="run for this long instead")
    ap.add_argument("--gen", choices=["all", *fuzzing.GENERATORS], default="all")
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=fuzzing.CASE_TIMEOUT, help="per case, s")
    ap.add_argument("--save", type=Path, default=None, help="folder for reproducers")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every failure")
    args = ap.parse_args()
    if args.count is None and args.seconds is None:
        args.count = 1000
    gens = list(fuzzing.GENERATORS) if args.gen == "all" else [args.gen]
    # ONNX mutants three to one: the ONNX importer has by far the larger surface
    weights = {"onnx": 3, "dsl": 1}
    order = [g for g in gens for _ in range(weights[g])]
    seeds = itertools.count(args.start)
    cases = ((order[k % len(order)], next(seeds)) for k in itertools.count())
    if args.count is not None:
        cases = itertools.islice(cases, args.count)
    t0 = time.monotonic()
    deadline = t0 + args.seconds if args.seconds is not None else None
    fuzzing.onnx_seeds()  # load once, before forking
    counts: Counter[str] = Counter()
    per_gen: Counter[tuple[str, str]] = Counter()
    found: dict[str, fuzzing.Result] = {}
    slowest: list[tuple[float, str, int]] = []
    for n, r in enumerate(fuzzing.run_cases(cases, args.jobs, args.timeout, deadline), 1):
        counts[r.outcome] += 1
        per_gen[(r.gen, r.outcome)] += 1
        slowest = sorted([*slowest, (r.seconds, r.gen, r.seed)], reverse=True)[:3]
        if r.outcome not in fuzzing.GOOD:
            sig = f"{r.outcome}: {signature(r.message)}"
            if args.verbose:
                print(f"{r.gen} {r.seed} {sig}", flush=True)
            if sig not in found:
                found[sig] = r
                if args.save is not None:
                    args.save.mkdir(parents=True, exist_ok=True)
                    case = fuzzing.make_case(r.gen, r.seed)
                    stem = f"{r.gen}-{r.seed}"
                    (args.save / f"{stem}{case.suffix}").write_bytes(case.data)
                    (args.save / f"{stem}.txt").write_text(
                        f"{case.name}\nshapes: {case.shapes}\n{r.outcome}\n{r.message}\n"
                    )
        if n % 1000 == 0:
            print(f"... {n} cases, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    total = sum(counts.values())
    elapsed = time.monotonic() - t0
    print(f"{total} cases in {elapsed:.0f} s ({args.jobs} jobs), seeds from {args.start}")
    labels = {
        "accepted": "accepted",
        "rejected": "rejected (exit 2)",
        "internal": "internal error",
        "crash": "crash",
        "hang": "hang",
        "memory": "memory",
    }
    for o in fuzzing.OUTCOMES:
        by = ", ".join(f"{g} {per_gen[(g, o)]}" for g in gens)
        print(f"  {labels[o]:<18} {counts[o]:>7}   ({by})")
    print("  slowest cases: " + ", ".join(f"{g} {k} {t:.1f} s" for t, g, k in slowest))
    for sig, r in sorted(found.items()):
        print(f"  first {r.gen} {r.seed}: {sig}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
