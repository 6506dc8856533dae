"""`flowc verify`: compile, build and run MODEL, and compare every output with an
independent reference (onnxruntime; the NumPy reference for a .flow program)."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from flowc.cli.common import choose_target, out, progress, read_graph_inputs, require_gpu
from flowc.cli.compile import compile_model
from flowc.cli.loading import load_model, parallel_settings
from flowc.cli.options import (
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

# flowc verify's default tolerance per --precision (max|got-ref| / max|ref| against the
# float32 reference): the error of the precision's rounding on the shared models, with room
# (docs/performance.md gives the measured figures).
VERIFY_TOLERANCE = {"fp32": 1e-4, "tf32": 1e-2, "fp16": 1e-2, "bf16": 5e-2}


@click.command(name="verify", short_help="Compile, build and run MODEL; compare with a reference.")
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
    target = choose_target(target, "run")
    if target == "cuda":
        require_gpu(f"flowc verify {path.name}")
    popts = parallel_settings(model, parallel)
    graph = load_model(model)
    feeds = read_graph_inputs(inputs, graph, random_seed=seed)
    with tempfile.TemporaryDirectory(prefix="flowc-verify-") as tmp:
        project = out_dir or Path(tmp) / "out"
        progress(f"compiling {path.name}")
        compile_model(model, project, popts, schedule)
        build(project, target, progress=progress)
        progress("running")
        got, _ = run(project, feeds, target=target)
    if path.suffix.lower() == ".flow":
        # A DSL program has no onnxruntime counterpart: flowc's NumPy reference is the judge.
        from flowc.interpreter import evaluate

        reference = "the NumPy reference"
        ref = evaluate(graph, feeds)
    else:
        import onnx

        from flowc.harness.ort import inference_mode

        reference = "onnxruntime"
        ref = run_onnxruntime(inference_mode(onnx.load(str(path))), feeds)
    if tol is None:
        tol = VERIFY_TOLERANCE[schedule.precision]
    table = Table(show_edge=False)
    for col in ("output", "shape", "error", "result"):
        table.add_column(col)
    ok = True
    for name, r in ref.items():
        c = compare(name, got[name], r, tol)
        ok &= c.ok
        table.add_row(
            escape(name),
            str(list(c.shape)),
            f"{c.error:.2e}",
            "PASS" if c.ok else f"FAIL {escape(c.reason)}",
        )
    out.print(table)
    if not ok:
        raise FlowcError(f"{path.name}: some outputs differ from {reference} by more than {tol}")
