"""`flowc verify`: compile, build and run MODEL, and compare every output with an
independent reference (onnxruntime; the NumPy reference for a .flow program)."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import click
import numpy as np
from rich.markup import escape
from rich.table import Table

from flowc.cli.common import choose_target, out, progress, read_graph_inputs, require_gpu
from flowc.cli.compile import compile_model
from flowc.cli.loading import load_model, parallel_settings
from flowc.cli.options import (
    GroupedCommand,
    ModelArgs,
    ParallelArgs,
    ScheduleArgs,
    input_option,
    model_options,
    output_option,
    parallel_options,
    schedule_options,
    seed_option,
    target_option,
)
from flowc.errors import FlowcError, InputError
from flowc.harness.compare import max_rel_error

# flowc verify's default tolerance per --precision (max|got-ref| / max|ref| against the
# float32 reference): the error of the precision's rounding on the shared models, with room
# (docs/performance.md gives the measured figures).
VERIFY_TOLERANCE = {"fp32": 1e-4, "tf32": 1e-2, "fp16": 1e-2, "bf16": 5e-2}


@click.command(
    name="verify",
    cls=GroupedCommand,
    short_help="Compile, build and run MODEL; compare with a reference.",
    examples=[
        "flowc verify model.onnx",
        "flowc verify model.onnx --precision bf16 --mesh 2 --input x=x.npy -o out/",
    ],
)
@model_options
@target_option(["host", "cuda"], "Default: cuda where a GPU is present, else host.")
@input_option("An input array (others: seeded random).")
@seed_option("Seed for the random inputs.")
@click.option(
    "--tol",
    type=float,
    default=None,
    help="Largest error allowed: max|got-ref| / max|ref| (default: by --precision, "
    "fp32 1e-4, tf32 1e-2, fp16 1e-2, bf16 5e-2).",
)
@output_option("out_dir", "Keep the project here (default: a temporary directory).", directory=True)
@schedule_options
@parallel_options
def verify(
    model: ModelArgs,
    target: str | None,
    inputs: tuple[str, ...],
    seed: int,
    tol: float | None,
    out_dir: Path | None,
    schedule: ScheduleArgs,
    parallel: ParallelArgs,
) -> None:
    """Compile MODEL, build, run, and compare every output with onnxruntime (the NumPy
    reference for a .flow program)."""
    from flowc.harness.build import build, run
    from flowc.harness.compare import compare
    from flowc.harness.ort import run_onnxruntime

    path = model.path
    if tol is not None and not 0 <= tol < math.inf:  # nan too
        raise InputError(
            f"--tol {tol}: expected an error bound of 0 or more",
            hint="e.g. --tol 1e-4 (max|got-ref| / max|ref|)",
        )
    if path.suffix.lower() not in (".onnx", ".flow"):
        raise InputError(f"{path}: verify takes an .onnx model or a .flow program")
    if path.suffix.lower() == ".onnx":
        # The reference first: no half-minute build before finding it missing.
        try:
            import onnxruntime  # noqa: F401
        except ImportError as e:
            raise FlowcError(
                f"verify compares with onnxruntime, which cannot be imported ({e})",
                hint="pip install onnxruntime (or pip install 'flowc[test]')",
            ) from None
    target = choose_target(target)
    if target == "cuda":
        require_gpu(f"flowc verify {path.name}")
    popts = parallel_settings(model, parallel)
    graph = load_model(model)
    feeds = read_graph_inputs(inputs, graph, random_seed=seed)
    # Symbolic dims (an ONNX model, random inputs): one build checked at both ends of the
    # ranges and between them, the inputs cut from the bound's.
    given = {k: r for k, r in graph.symbols.items() if not r.computed}
    points: list[dict[str, int]] = [{}]
    if given and not inputs and path.suffix.lower() == ".onnx":
        points = []
        for pick in ("lo", "mid", "hi"):
            at = {
                k: r.lo if pick == "lo" else r.hi if pick == "hi" else (r.lo + r.hi) // 2
                for k, r in given.items()
            }
            if at not in points:
                points.append(at)
    runs: list[tuple[dict[str, int], dict[str, Any], dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="flowc-verify-") as tmp:
        project = out_dir or Path(tmp) / "out"
        progress(f"compiling {path.name}")
        compile_model(model, project, popts, schedule)
        build(project, target, progress=progress)
        for at in points:
            cut = {v.name: feeds[v.name][_cut(v.type, at)] for v in graph.inputs} if at else feeds
            progress("running" + (f" at {_sizes_text(at)}" if at else ""))
            got, _ = run(project, cut, target=target)
            runs.append((at, cut, got))
    if len(runs) > 1:
        _compare_sizes(path, runs, tol, schedule.precision)
        return
    narrow = schedule.precision in ("bf16", "fp16")
    rounded: dict[str, Any] = {}
    if path.suffix.lower() == ".flow":
        # A DSL program has no onnxruntime counterpart: flowc's NumPy reference is the judge.
        from flowc.interpreter import evaluate

        reference = "the NumPy reference"
        ref = evaluate(graph, feeds)
        if narrow:
            from flowc.harness.ort import round_to

            for c in graph.constants:
                assert c.const is not None
                c.const = round_to(c.const, schedule.precision)
            rounded = evaluate(
                graph, {k: round_to(v, schedule.precision) for k, v in feeds.items()}
            )
    else:
        import onnx

        from flowc.harness.ort import inference_mode, round_to, rounded_model

        reference = "onnxruntime"
        model_proto = inference_mode(onnx.load(str(path)))
        ref = run_onnxruntime(model_proto, feeds)
        if narrow:
            # What storing the weights and inputs in the narrow type costs by itself, with
            # float32 arithmetic: a correct narrow program is judged against that.
            rounded = run_onnxruntime(
                rounded_model(model_proto, schedule.precision),
                {k: round_to(v, schedule.precision) for k, v in feeds.items()},
            )
    if tol is None:
        tol = VERIFY_TOLERANCE[schedule.precision]
    table = Table(show_edge=False)
    columns = ["output", "shape", "error"]
    if narrow:
        columns.append(f"rounding to {schedule.precision} alone")
    for col in (*columns, "result"):
        table.add_column(col)
    ok = True
    for name, r in ref.items():
        c = compare(name, got[name], r, tol)
        row = [escape(name), str(list(c.shape)), f"{c.error:.2e}"]
        passed = c.ok
        if narrow:
            base = max_rel_error(np.asarray(rounded[name]), np.asarray(r))
            row.append(f"{base:.2e}")
            # Within twice what the rounding alone costs, or under the fixed tolerance.
            passed = c.ok or (c.reason == "" and c.error <= 2 * base)
        ok &= passed
        table.add_row(*row, "PASS" if passed else f"FAIL {escape(c.reason)}".rstrip())
    out.print(table)
    if narrow:
        out.print(
            f"--precision {schedule.precision}: an output passes within {tol:g} or within twice "
            "the error of rounding the weights and inputs alone (onnxruntime/NumPy in float32)",
            markup=False,
        )
    if not ok:
        raise FlowcError(
            f"{path.name}: some outputs differ from {reference} by more than {tol}"
            + (" and more than twice the rounding baseline" if narrow else "")
        )


def _cut(t: Any, at: dict[str, int]) -> tuple[slice, ...]:
    """The slice of an input made at the bound that has the sizes ``at``."""
    return tuple(slice(0, n) for n in t.shape_at(at))


def _sizes_text(at: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in at.items())


def _compare_sizes(
    path: Path,
    runs: list[tuple[dict[str, int], dict[str, Any], dict[str, Any]]],
    tol: float | None,
    precision: str,
) -> None:
    """verify's table for a program with symbolic dims: every output at every size, against
    onnxruntime run at that size."""
    import onnx

    from flowc.harness.compare import compare
    from flowc.harness.ort import inference_mode, run_onnxruntime

    if precision != "fp32":
        raise InputError(
            "verify checks a program with symbolic dims in fp32 only for now",
            hint="leave out --precision, or fix the dims with --dim NAME=N",
        )
    bound = VERIFY_TOLERANCE[precision] if tol is None else tol
    proto = inference_mode(onnx.load(str(path)))
    table = Table(show_edge=False)
    for col in ("sizes", "output", "shape", "error", "result"):
        table.add_column(col)
    ok = True
    for at, feeds, got in runs:
        ref = run_onnxruntime(proto, feeds)
        for name, r in ref.items():
            c = compare(name, got[name], r, bound)
            ok &= c.ok
            table.add_row(
                escape(_sizes_text(at)),
                escape(name),
                str(list(c.shape)),
                f"{c.error:.2e}",
                "PASS" if c.ok else f"FAIL {escape(c.reason)}".rstrip(),
            )
    out.print(table)
    if not ok:
        raise FlowcError(f"{path.name}: some outputs differ from onnxruntime by more than {bound}")
