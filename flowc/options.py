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

from flowc.errors import InputError

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
