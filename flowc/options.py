"""What a compile is asked to do, as plain records: the model and how to import it, how the
program is scheduled, the mesh and pipeline, and the code-generation switches. The command
line fills them (flowc.cli.options) and hands them to the driver (flowc.compiler), which is
the one place that turns them into stages; so do scripts and tests."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

from flowc.errors import InputError

if TYPE_CHECKING:
    from flowc.ir.symbolic import DimRange

# -- parsing option values ---------------------------------------------------------------------


def _shown(text: str) -> str:
    """A value as an error message quotes it: a 400-digit number is cut short."""
    return repr(text if len(text) <= 40 else text[:37] + "...")


def parse_dims(text: str, what: str) -> tuple[int, ...]:
    from flowc.ir.builder import MAX_ELEMENTS
    from flowc.ir.types import MAX_RANK

    parts = text.lower().replace(",", "x").split("x") if text else []
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        raise InputError(
            f"{what}: {_shown(text)} is not a shape", hint="write dims as 1x3x224x224"
        ) from None
    if any(d < 0 for d in dims):
        raise InputError(f"{what}: {_shown(text)} has a negative dimension")
    if len(dims) > MAX_RANK:
        raise InputError(
            f"{what}: {len(dims)} dimensions; flowc holds tensors of rank at most {MAX_RANK}"
        )
    if any(d > MAX_ELEMENTS for d in dims):
        raise InputError(
            f"{what}: {_shown(text)} has a dimension above {MAX_ELEMENTS}, more elements than "
            "flowc supports"
        )
    return dims


def parse_shapes(items: Sequence[str]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for item in items:
        name, sep, dims = item.rpartition("=")
        if not sep or not name:
            raise InputError(
                f"--shape {item!r}: expected NAME=DIMS", hint="e.g. --shape input=1x3x224x224"
            )
        shapes[name] = parse_dims(dims, f"--shape {name}")
    return shapes


def parse_dim_values(items: Sequence[str]) -> dict[str, int]:
    from flowc.ir.builder import MAX_ELEMENTS

    dims = {}
    for item in items:
        name, sep, value = item.rpartition("=")
        if not sep or not name:
            raise InputError(f"--dim {item!r}: expected SYMBOL=N", hint="e.g. --dim batch=1")
        if ".." in value:
            raise InputError(
                f"--dim {_shown(item)}: a range is for inference programs (flowc compile, "
                "run, build); this command takes one size",
                hint=f"e.g. --dim {name}={value.split('..')[-1].split('@')[0].strip() or 8}",
            )
        try:
            dims[name] = int(value)
        except ValueError:
            raise InputError(f"--dim {_shown(item)}: {_shown(value)} is not an integer") from None
        if dims[name] < 1:
            raise InputError(f"--dim {_shown(item)}: a dimension must be at least 1")
        if dims[name] > MAX_ELEMENTS:
            raise InputError(
                f"--dim {_shown(item)}: a dimension above {MAX_ELEMENTS}, more elements than "
                "flowc supports"
            )
    return dims


def parse_dim_ranges(items: Sequence[str]) -> tuple[dict[str, int], dict[str, DimRange]]:
    """``--dim`` values: the static sizes (``batch=8``) and the ranges (``batch=1..64``,
    ``batch=1..64@8``: 8 is the size costs are weighed at)."""
    from flowc.ir.builder import MAX_ELEMENTS
    from flowc.ir.symbolic import MAX_SYMBOLS, DimRange, check_symbol_name, parse_range

    static = parse_dim_values([i for i in items if ".." not in i.rpartition("=")[2]])
    ranges: dict[str, DimRange] = {}
    for item in items:
        name, sep, value = item.rpartition("=")
        if ".." not in value:
            continue
        if not sep or not name:
            raise InputError(
                f"--dim {_shown(item)}: expected SYMBOL=LO..HI", hint="e.g. --dim batch=1..64"
            )
        try:
            check_symbol_name(name, f"--dim {_shown(item)}")
            r = parse_range(value, f"--dim {_shown(item)}")
        except ValueError as e:
            raise InputError(str(e), hint="e.g. --dim batch=1..64 or --dim batch=1..64@8") from None
        assert isinstance(r, DimRange)
        if r.hi > MAX_ELEMENTS:
            raise InputError(f"--dim {_shown(item)}: a bound above {MAX_ELEMENTS}")
        if name in static or (name in ranges and ranges[name] != r):
            raise InputError(f"--dim {name} is given twice")
        ranges[name] = r
    if len(ranges) > MAX_SYMBOLS:
        raise InputError(
            f"--dim: {len(ranges)} ranges; a program has at most {MAX_SYMBOLS} symbolic dims"
        )
    return static, ranges


def parse_bounds(items: Sequence[str]) -> dict[str, int]:
    """``--bound NAME=K``: the rows the data-dependent output NAME holds (its buffer's
    bound; a run that finds more keeps K and reports it)."""
    from flowc.ir.builder import MAX_ELEMENTS

    bounds: dict[str, int] = {}
    for item in items:
        name, sep, value = item.rpartition("=")
        if not sep or not name:
            raise InputError(
                f"--bound {_shown(item)}: expected OUTPUT=K", hint="e.g. --bound selected=100"
            )
        try:
            k = int(value)
        except ValueError:
            raise InputError(f"--bound {_shown(item)}: {_shown(value)} is not an integer") from None
        if not 0 <= k <= MAX_ELEMENTS:
            raise InputError(f"--bound {_shown(item)}: a bound is 0..{MAX_ELEMENTS}")
        if name in bounds:
            raise InputError(f"--bound {name} is given twice")
        bounds[name] = k
    return bounds


def parse_shape_ranges(
    items: Sequence[str],
) -> tuple[dict[str, tuple[int, ...]], dict[tuple[str, int], DimRange]]:
    """``--shape`` values where a dim may be a range (``x=1..8x3x224x224``): the shapes with
    each range's dim at its bound, and the ranges by (input, dim)."""
    from flowc.ir.symbolic import DimRange, parse_range

    plain: list[str] = []
    ranges: dict[tuple[str, int], DimRange] = {}
    for item in items:
        name, _sep, dims = item.rpartition("=")
        if ".." not in dims:
            plain.append(item)
            continue
        parts = dims.lower().replace(",", "x").split("x")
        sizes = []
        for k, part in enumerate(parts):
            try:
                r = parse_range(part, f"--shape {_shown(item)}, dim {k}")
            except ValueError as e:
                raise InputError(str(e), hint="e.g. --shape x=1..8x3x224x224") from None
            if isinstance(r, DimRange):
                ranges[(name, k)] = r
                r = r.hi
            sizes.append(str(r))
        plain.append(f"{name}={'x'.join(sizes)}")
    return parse_shapes(plain), ranges


# The largest byte count an option takes: what an int64 (the generated program's sizes and
# offsets) holds.
MAX_BYTES = (1 << 63) - 1


def parse_bytes(text: str, what: str) -> int:
    """``1000000``, ``64MiB``, ``1.5GB``, ``512k`` -> bytes (exactly: no float rounding),
    at most MAX_BYTES."""
    m = re.fullmatch(r"\s*([0-9]{1,4000}(?:\.[0-9]{1,4000})?)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if m is None:
        raise InputError(
            f"{what} {_shown(text)}: expected a byte count like 1000000, 64MiB or 1.5GB"
        )
    scale = (1024 if m.group(3) else 1000) ** "_kmgt".index(m.group(2) or "_")
    count = int(Fraction(m.group(1)) * scale)
    if count > MAX_BYTES:
        raise InputError(
            f"{what} {_shown(text)}: more than {MAX_BYTES} bytes (8 EiB), the most flowc "
            "can address"
        )
    return count


# -- option groups: what the command line (or a script) gives -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelArgs:
    """MODEL and how to import it: --shape, --dim, --weights and the pass-manager switches."""

    path: Path
    shapes: tuple[str, ...] = ()
    dims: tuple[str, ...] = ()
    weights: str | None = None
    # --bound NAME=K: the rows a data-dependent output (NonZero, NonMaxSuppression) holds
    bounds: tuple[str, ...] = ()
    dump_after: tuple[str, ...] = ()
    print_times: bool = False


@dataclass(frozen=True)
class ScheduleArgs:
    """How the compiled program runs: streams, CUDA Graph, schedule objective, precision."""

    streams: int | None = None
    no_cuda_graph: bool = False
    schedule_for: str = "latency"
    precision: str = "fp32"


@dataclass(frozen=True)
class ParallelArgs:
    """The mesh, the placement search and the pipeline, as given on the command line."""

    mesh: str | None = None
    parallel: str = "auto"
    sbps: tuple[str, ...] = ()
    mem_limit: str | None = None
    cost_profile: Path | None = None
    search_nodes: int | None = None
    pipeline: int | None = None
    microbatches: int = 1
    stage_boundary: str | None = None
    # The micro-batches' order on the stages: 1f1b or gpipe (None: not given; a training
    # pipeline runs 1f1b).
    pipeline_schedule: str | None = None
    # A training step's ZeRO stage (flowc.training.zero): its state split over the mesh.
    zero: int | None = None


@dataclass(frozen=True)
class TrainArgs:
    """What makes a training step of a model (`flowc train`, `flowc compile --train`): the
    loss, the optimizer, the batch and the update's switches, as the command line spells
    them (flowc.training.spec parses them)."""

    loss: str | None = None
    optimizer: str | None = None
    batch: int | None = None
    lr_schedule: str | None = None
    clip_norm: float | None = None
    freeze: str | None = None
    no_decay: str | None = None
    untie: str | None = None
    ignore_index: int | None = None
    label_smoothing: float = 0.0
    accumulate: int = 1
    # Activation recomputation (flowc.training.recompute) and what the step must fit: state,
    # constants and arena, in bytes as --mem-limit spells them.
    recompute: str = "none"
    mem_limit: str | None = None


@dataclass(frozen=True)
class CompileOptions:
    """Everything `flowc compile` is asked: the option groups and the code-generation
    switches (``arch``: the CUDA architecture's number, "90" for sm_90)."""

    model: ModelArgs
    schedule: ScheduleArgs = field(default_factory=ScheduleArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    prefix: str | None = None
    arch: str = "90"
    force: bool = False
    # `--target` as given (None: not given), recorded in the project for build and run.
    target: str | None = None
