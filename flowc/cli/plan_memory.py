"""`flowc plan-memory`: the static memory placer on a MiniMalloc CSV of buffer lifetimes."""

from __future__ import annotations

import time
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from flowc.cli.common import out
from flowc.cli.options import parse_bytes, path_option
from flowc.errors import FlowcError, InputError
from flowc.formatting import human_bytes


@click.command(
    name="plan-memory", short_help="Place the buffers of a MiniMalloc CSV at static offsets."
)
@click.argument("csv_file", metavar="FILE.csv", type=click.Path(dir_okay=False, path_type=Path))
@path_option("--offsets", "offsets_path", help="Write id,lower,upper,size,offset here.")
@click.option(
    "--capacity", default=None, metavar="BYTES", help="Look for a placement within BYTES."
)
@click.option(
    "--work-limit",
    default=None,
    type=int,
    help="Search nodes for the exact search (default: the placer's; 0: greedy only).",
)
def plan_memory_cmd(
    csv_file: Path, offsets_path: Path | None, capacity: str | None, work_limit: int | None
) -> None:
    """Place the buffers of a MiniMalloc CSV (id,lower,upper,size; live on [lower, upper))
    at static offsets: prints the peak, the lower bound and their ratio."""
    from flowc.memory import placement

    cap = parse_bytes(capacity, "--capacity") if capacity is not None else None
    limit = placement.DEFAULT_WORK_LIMIT if work_limit is None else work_limit
    if limit < 0:
        raise InputError(f"--work-limit {limit}: expected 0 or more search nodes")
    try:
        intervals = placement.read_csv(csv_file)
    except placement.PlacementError as e:
        raise InputError(str(e), hint="rows are id,lower,upper,size with lower < upper") from None
    t0 = time.perf_counter()
    result = placement.place(intervals, capacity=cap, work_limit=limit, exact=limit > 0)
    seconds = time.perf_counter() - t0
    # The placer's output goes through the independent checker before anyone uses it.
    placement.check_placement(intervals, result.offsets)
    ratio = result.peak / result.lower_bound if result.lower_bound else 1.0
    table = Table(show_header=False, show_edge=False)
    table.add_column()
    table.add_column(justify="right")
    table.add_row("buffers", str(len(intervals)))
    table.add_row("lower bound", f"{result.lower_bound} ({human_bytes(result.lower_bound)})")
    table.add_row("peak", f"{result.peak} ({human_bytes(result.peak)})")
    if cap is not None:
        table.add_row("capacity", f"{cap} ({'fits' if result.peak <= cap else 'does not fit'})")
    table.add_row("strategy", result.strategy + (", optimal" if result.optimal else ""))
    table.add_row("time", f"{seconds:.2f} s")
    out.print(table)
    if offsets_path is not None:
        try:
            placement.write_offsets_csv(offsets_path, intervals, result.offsets)
        except OSError as e:
            raise InputError(
                f"--offsets {offsets_path}: cannot write ({e.strerror or e})"
            ) from None
        out.print(f"wrote {escape(str(offsets_path))}")
    out.print(f"peak {result.peak} lower_bound {result.lower_bound} ratio {ratio:.4f}")
    if cap is not None and result.peak > cap:
        unmet = FlowcError(
            f"{csv_file.name}: no placement within {cap} bytes found; the best peak is "
            f"{result.peak} ({result.peak - cap} bytes over)",
            hint="raise --work-limit to search longer, or --capacity",
        )
        unmet.exit_code = 1  # not an input error: the search fell short
        raise unmet
