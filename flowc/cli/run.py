"""`flowc run`: run a built project on .npy inputs, time it, count its launches."""

from __future__ import annotations

import os
from pathlib import Path

import click
from rich.markup import escape

from flowc.cli.common import (
    check_output_path,
    choose_target,
    err,
    out,
    progress,
    read_inputs,
    require_gpu,
    write_npz_atomic,
)
from flowc.cli.options import (
    flag_option,
    input_option,
    output_option,
    path_option,
    project_argument,
    sanitize_option,
    target_option,
)
from flowc.errors import InputError


@click.command(name="run", short_help="Run a built project on .npy inputs; time it with --bench.")
@project_argument
@input_option()
@path_option("--weights", help="Another weights file of the same layout.")
@target_option(
    ["cuda", "host"],
    "Default: the project's recorded target (compile --target), else cuda where a GPU is "
    "present, else host.",
)
@output_option("output", "OUT.npz, keyed by output name (optional with --bench).")
@sanitize_option("Run the build made by `flowc build --sanitize` with the same value (host only).")
@click.option(
    "--bench",
    type=int,
    default=None,
    metavar="N",
    help="Also time the model: N runs queued back to back (throughput), N one at a time "
    "(latency median and p90), after a few warm-up runs.",
)
@flag_option(
    "--rebuild",
    "Build the project first if it changed since its build (instead of refusing to run).",
)
@flag_option(
    "--stats",
    "Print the launches per run (kernels + library calls) and the copies, as the host "
    "emulator counts them (FLOWC_STATS=1 in the environment does the same).",
)
def run_cmd(
    project: Path,
    inputs: tuple[str, ...],
    weights: Path | None,
    target: str | None,
    output: Path | None,
    sanitize: str | None,
    bench: int | None,
    rebuild: bool,
    stats: bool,
) -> None:
    """Run a built project on .npy inputs; write its outputs to OUT.npz and, with --bench N,
    print its latency and throughput; with --stats, its launches per run."""
    from flowc.harness.build import StaleBuild, bench_figures, check_built, project_info, run

    if bench is not None and not 1 <= bench <= 1_000_000:
        raise InputError(
            f"--bench {bench}: expected a number of runs from 1 to 1000000",
            hint="for example --bench 100",
        )
    if output is None and bench is None and not stats:
        raise InputError(
            "flowc run needs -o OUT.npz for the outputs (or --bench N to time the model, "
            "--stats to count its launches)"
        )
    if output is not None:
        output = check_output_path(output)
    info = project_info(project)
    if weights is not None and not weights.is_file():
        # Not only missing: a FIFO or a device would hang the driver or never end.
        what = "no such file" if not weights.exists() else "not a regular file"
        raise InputError(f"--weights {weights}: {what}", hint="give a weights file flowc wrote")
    target = choose_target(target, project, sanitize=bool(sanitize))
    if target == "cuda":
        require_gpu(f"flowc run {project}")
    # The build before the inputs: a project not built (or changed since) is the news.
    try:
        check_built(project, target, sanitize)
    except StaleBuild:
        if not rebuild:
            raise
    specs = info["inputs"]
    assert isinstance(specs, list)
    feeds = read_inputs(inputs, specs)
    env: dict[str, str] = {}
    if stats:
        env["FLOWC_STATS"] = "1"
    if target == "host" and "OMP_WAIT_POLICY" not in os.environ:
        # libgomp reads it before main; its default spin-wait takes the cores from OpenBLAS's
        # threads (the driver would restart itself with it; set here, it need not).
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    results, stdout = run(
        project,
        feeds,
        target=target,
        weights=weights,
        sanitize=sanitize,
        bench=bench or 0,
        env=env,
        rebuild=rebuild,
        progress=progress,
    )
    if output is not None:
        write_npz_atomic(output, results)
        out.print(f"wrote {escape(str(output))}")
    # The driver's FLOWC_STATS lines (asked for by --stats or by the inherited environment).
    counted = [
        line
        for line in stdout.splitlines()
        if line.startswith(("launches per run", "copies per run"))
    ]
    for line in counted:
        out.print(escape(line))
    if (stats or os.environ.get("FLOWC_STATS", "") == "1") and not counted:
        if target == "host":
            err.print(
                "[yellow]note:[/] the driver printed no launch counts; a project built by an "
                "older flowc prints none: rebuild it with `flowc build`"
            )
        else:
            err.print(
                "[yellow]note:[/] launches are counted by the host emulator only (this was a "
                f"{target} run); build and run the project with --target host to count them"
            )
    if bench is not None:
        f = bench_figures(stdout)
        lat = f["latency_ms"]
        ranks = f"{f['ranks']} rank" + ("s" if f["ranks"] != 1 else "")
        out.print(
            f"latency: median {lat['median']:.3f} ms, p90 {lat['p90']:.3f} ms, "
            f"min {lat['min']:.3f} ms ({f['runs']} runs, each synchronized)"
        )
        out.print(
            f"throughput: {f['throughput_runs_per_s']:.1f} runs/s ({f['runs']} runs queued "
            f"back to back; {f['warmup']} warm-up runs first; {f['target']}, {ranks})"
        )
