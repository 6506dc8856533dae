"""The command line's side of loading: the driver (flowc.compiler) does the work; this
prints what it reports (progress, --dump-after, --print-pass-times)."""

from __future__ import annotations

import sys
from typing import Any

from flowc.cli.common import err, progress
from flowc.options import ModelArgs, ParallelArgs


def dump_ir(name: str, text: str) -> None:
    sys.stderr.write(f"# IR after {name}\n{text}")


def print_stage_times(times: Any, title: str = "stage times:") -> None:
    err.print(title, markup=False)
    for line in times.lines():
        err.print(line, markup=False)


def load_model(
    model: ModelArgs,
    *,
    for_compile: bool = False,
    times: Any = None,
    precision: str = "fp32",
    placed: bool = False,
) -> Any:
    """MODEL through the driver's pass list (``for_compile``: the whole list, as compile
    runs it; otherwise the import clean-up alone). Without ``times`` the import and pass
    times are printed here under --print-pass-times; with it, the caller prints them with
    the later stages."""
    from flowc.compiler import StageTimes
    from flowc.compiler import load_model as driver_load

    own = times is None
    times = StageTimes() if own else times
    graph = driver_load(
        model, compiled=for_compile, precision=precision, placed=placed, times=times, dump=dump_ir
    )
    if own and model.print_times:
        seconds = dict(times.stages)
        err.print(f"pass times: import {seconds.get('import', 0.0) * 1e3:.1f} ms", markup=False)
        for name, s in times.stages:
            if name.startswith("pass "):
                err.print(f"  {name[5:]}: {s * 1e3:.1f} ms", markup=False)
    return graph


def parallel_settings(model: ModelArgs, par: ParallelArgs) -> Any:
    """The driver's placement target for the command line's options (None: one device)."""
    from flowc.compiler import placement_target

    return placement_target(model, par)


def load_parallel(
    model: ModelArgs, popts: Any, times: Any = None, precision: str = "fp32"
) -> tuple[Any, Any]:
    """The graph after the pass list and its placement (plan, rank graph, cost, memory)."""
    from flowc.compiler import place

    graph = load_model(model, for_compile=True, times=times, precision=precision, placed=True)
    return graph, place(graph, popts, times, progress)
