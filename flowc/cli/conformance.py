"""`flowc conformance`: the ONNX node test cases of the installed onnx package through flowc."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import click
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flowc.cli.common import err, out, progress
from flowc.cli.options import path_option, target_option
from flowc.errors import FlowcError, InputError

# The most worker processes --jobs starts (all of them at once: the pool forks them up
# front), far more than the cases' builds could use.
MAX_JOBS = 256


@click.command(
    name="conformance", short_help="Run the ONNX node test cases through flowc (ref or host)."
)
@target_option(["ref", "host"], None, default="ref")
@click.option(
    "--filter", "pattern", default=None, metavar="REGEX", help="Only cases whose name matches."
)
@click.option("--jobs", "-j", default=os.cpu_count() or 1, show_default="CPUs", help="Processes.")
@click.option(
    "--group-size",
    default=120,
    show_default=True,
    help="host: cases compiled side by side into one build.",
)
@path_option(
    "--json",
    "json_path",
    help="Write the per-case results here (default for a full run: the cache's "
    "results-TARGET.json).",
)
@path_option(
    "--write-table",
    help="Write the support table (e.g. docs/ONNX_SUPPORT.md) from the full ref and host results.",
)
@path_option(
    "--expected-failures",
    help="Fail (exit 1) when a case not listed fails or a listed case passes.",
)
@path_option("--update-expected", help="Write the list of failing cases here.")
def conformance(
    target: str,
    pattern: str | None,
    jobs: int,
    group_size: int,
    json_path: Path | None,
    write_table: Path | None,
    expected_failures: Path | None,
    update_expected: Path | None,
) -> None:
    """Run the ONNX node test cases of the installed onnx package through flowc: `ref`
    evaluates flowc's NumPy reference, `host` compiles, builds and runs on the host."""
    from flowc import conformance as conf

    if not 1 <= jobs <= MAX_JOBS:
        shown = str(jobs) if abs(jobs) < 10**12 else f"{str(jobs)[:12]}..."
        raise InputError(
            f"--jobs {shown}: expected a number of processes from 1 to {MAX_JOBS}",
            hint=f"this machine has {os.cpu_count() or 1} CPUs",
        )
    if group_size < 1:
        raise InputError(f"--group-size {group_size}: expected at least 1")
    full = pattern is None
    if not full and (write_table or update_expected):
        raise InputError(
            "--write-table and --update-expected need a run of every case (no --filter)"
        )
    expected = conf.read_expected_failures(expected_failures) if expected_failures else None
    root, cases = conf.materialize(progress=progress)
    chosen = conf.select(cases, pattern)
    progress(f"running {len(chosen)} cases on {target} with {jobs} process(es)")
    t0 = time.perf_counter()
    with Progress(
        TextColumn(f"conformance ({target})"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("[green]{task.fields[passed]} passed"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as bar:
        task = bar.add_task("run", total=len(chosen), passed=0)
        passed = 0

        def advance(r: Any) -> None:
            nonlocal passed
            passed += r.status == "pass"
            bar.update(task, advance=1, passed=passed)

        results = conf.run_cases(
            root, chosen, target, jobs=jobs, on_result=advance, group_size=group_size
        )
    seconds = time.perf_counter() - t0
    s = conf.summarize(results)
    table = Table(title=f"onnx {conf.onnx_version()} node cases, {target}", show_edge=False)
    table.add_column("result")
    table.add_column("cases", justify="right")
    table.add_row("passed", str(s.passed))
    table.add_row("  by folding to constants", str(s.folded))
    table.add_row("mismatch", str(s.counts["mismatch"]))
    table.add_row("unsupported op", str(s.counts["unsupported"]))
    table.add_row("other error", str(s.counts["error"]))
    table.add_row("total", str(s.total))
    out.print(table)
    out.print(
        f"{target}: {s.passed} / {s.total} passed in {seconds:.1f} s; {s.frozen} cases had inputs bound to their test values"
    )
    for reason, count in conf.failure_categories(results, 10):
        out.print(f"  {count:5d}  {escape(reason)}")
    if json_path is None and full:
        json_path = root / f"results-{target}.json"
    if json_path is not None:
        conf.write_results(json_path, target, results, full=full)
        out.print(f"wrote {escape(str(json_path))}")
    if update_expected is not None:
        conf.write_expected_failures(update_expected, target, results)
        out.print(f"wrote {escape(str(update_expected))}")
    if write_table is not None:
        others = {t: conf.read_results(root / f"results-{t}.json") for t in conf.TARGETS}
        others[target] = results
        conf.write_support_table(write_table, cases, others["ref"], others["host"])
        out.print(f"wrote {escape(str(write_table))}")
    if expected is not None:
        new, fixed = conf.check_expected(expected, results, full=full)
        for name in new:
            r = next(r for r in results if r.name == name)
            err.print(f"unexpected failure: {name}: {r.status}: {escape(r.message)}")
        for name in fixed:
            err.print(f"listed as failing, but passes (or is no case): {name}")
        if new or fixed:
            raise FlowcError(
                f"{len(new)} unexpected failure(s), {len(fixed)} listed case(s) passing",
                hint=f"fix them, or update the list: flowc conformance --target {target} "
                f"--update-expected {expected_failures}",
            )
