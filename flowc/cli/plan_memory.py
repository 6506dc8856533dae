"""`flowc plan-memory`: the static memory placer on a MiniMalloc CSV of buffer lifetimes."""

from __future__ import annotations

import re
import time
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from flowc.cli.common import out
from flowc.cli.options import parse_bytes, path_option
from flowc.errors import FlowcError, InputError
from flowc.formatting import human_bytes

# The largest --capacity: the CSV's own integer range (int64), far above any arena.
MAX_CAPACITY = 2**63 - 1
# The largest --work-limit: 250 times the placer's default (40,000), some twenty minutes
# of search on one of MiniMalloc's 400-buffer instances here.
MAX_WORK_LIMIT = 10_000_000


def _shown(text: str) -> str:
    """``text`` for a message: a runaway argument is cut, with its length."""
    return text if len(text) <= 24 else f"{text[:16]}... ({len(text)} characters)"


def parse_capacity(text: str) -> int:
    """--capacity as bytes, at most MAX_CAPACITY. A plain integer is read exactly (no
    float on the way: 2^53 + 1 stays itself); one with a unit (64MiB, 1.5GB) goes through
    parse_bytes once its integer part is known to be of sane length."""
    plain = text.strip()
    too_big = InputError(
        f"--capacity {_shown(text)}: at most {MAX_CAPACITY} bytes "
        "(2^63-1, the range of the CSV's integers)",
        hint="give the arena size in bytes, like 1048576 or 64MiB",
    )
    if re.fullmatch(r"[0-9]+", plain):
        if len(plain.lstrip("0")) > 19 or int(plain) > MAX_CAPACITY:
            raise too_big
        return int(plain)
    whole = re.match(r"\s*([0-9]*)", text)
    if whole is not None and len(whole.group(1).lstrip("0")) > 19:
        raise too_big
    value = parse_bytes(text, "--capacity")
    if value > MAX_CAPACITY:
        raise too_big
    return value


def parse_work_limit(text: str) -> int:
    """--work-limit as search nodes: a whole number from 0 to MAX_WORK_LIMIT."""
    plain = text.strip()
    if not re.fullmatch(r"[0-9]+", plain):
        raise InputError(
            f"--work-limit {_shown(text)!r}: expected a whole number of search nodes, "
            f"0 to {MAX_WORK_LIMIT}"
        )
    if len(plain.lstrip("0")) > len(str(MAX_WORK_LIMIT)) or int(plain) > MAX_WORK_LIMIT:
        raise InputError(
            f"--work-limit {_shown(text)}: at most {MAX_WORK_LIMIT} search nodes "
            "(250 times the default)"
        )
    return int(plain)


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
    metavar="N",
    help=(
        "Search nodes for the exact search (default: the placer's; 0: greedy only; "
        f"at most {MAX_WORK_LIMIT})."
    ),
)
def plan_memory_cmd(
    csv_file: Path, offsets_path: Path | None, capacity: str | None, work_limit: str | None
) -> None:
    """Place the buffers of a MiniMalloc CSV (id,lower,upper,size; live on [lower, upper))
    at static offsets: prints the peak, the lower bound and their ratio."""
    from flowc.memory import placement

    cap = parse_capacity(capacity) if capacity is not None else None
    limit = placement.DEFAULT_WORK_LIMIT if work_limit is None else parse_work_limit(work_limit)
    try:
        intervals = placement.read_csv(csv_file)
    except placement.PlacementError as e:
        raise InputError(str(e), hint="rows are id,lower,upper,size with lower < upper") from None
    t0 = time.perf_counter()
    try:
        result = placement.place(intervals, capacity=cap, work_limit=limit, exact=limit > 0)
    except placement.PlacementError as e:
        raise InputError(f"{csv_file}: {e}") from None
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
        placement.write_offsets_csv(
            offsets_path,
            intervals,
            result.offsets,
            cannot_open=lambda e: InputError(
                f"--offsets {offsets_path}: cannot write there ({e.strerror or e})"
            ),
            cannot_write=lambda e: InputError(
                f"--offsets {offsets_path}: writing failed ({e.strerror or e})"
            ),
        )
        out.print(f"wrote {escape(str(offsets_path))}")
    out.print(f"peak {result.peak} lower_bound {result.lower_bound} ratio {ratio:.4f}")
    if cap is not None and cap < result.lower_bound:
        # No search can help: at some step the live buffers alone need more.
        unmet = FlowcError(
            f"{csv_file.name}: capacity {cap} is below the lower bound {result.lower_bound} "
            f"(the most bytes live at once); no placement fits",
            hint=f"give --capacity at least {result.lower_bound}",
        )
        unmet.exit_code = 1
        raise unmet
    if cap is not None and result.peak > cap:
        unmet = FlowcError(
            f"{csv_file.name}: no placement within {cap} bytes found; the best peak is "
            f"{result.peak} ({result.peak - cap} bytes over)",
            hint="raise --work-limit to search longer, or --capacity",
        )
        unmet.exit_code = 1  # not an input error: the search fell short
        raise unmet
