"""CUDA builds of the option matrix's all-pairs cells (tests/test_option_matrix.py): every
--precision with one device, --mesh 2, --mesh 2x2 and --mesh 2 --pipeline 2, streams
alternating; each compiled with flowc, built for CUDA (quick: nvcc's device code
optimized, host code -O1) and its build log checked for warnings. Too slow for `make test`
(which builds two of them); writes bench/results/cuda_matrix_builds.txt.

    python bench/cuda_matrix_builds.py [--jobs 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from flowc.compiler import compile_model  # noqa: E402
from flowc.errors import FlowcError, FlowcWarning  # noqa: E402
from flowc.harness.build import build  # noqa: E402
from flowc.options import CompileOptions, ModelArgs, ParallelArgs, ScheduleArgs  # noqa: E402

PRECISIONS = ["fp32", "tf32", "bf16", "fp16"]
LAYOUTS = {
    "one": ParallelArgs(),
    "mesh2": ParallelArgs(mesh="2"),
    "mesh2x2": ParallelArgs(mesh="2x2"),
    "pipeline2": ParallelArgs(mesh="2", pipeline=2, microbatches=2),
}
STREAMS: list[int | None] = [1, None]
RUN_MODEL = {("bf16", "mesh2"): "bert_tiny", ("fp16", "mesh2x2"): "bert_tiny"}


def models_dir() -> Path:
    return REPO / "tests" / "data" / "models"


def one_cell(precision: str, layout: str, streams: int | None) -> str:
    name = RUN_MODEL.get((precision, layout), "mlp")
    dims = ("batch=2", "seq=16") if name == "bert_tiny" else ()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flowc-cuda-matrix-") as tmp:
        out = Path(tmp) / "out"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FlowcWarning)
                compile_model(
                    CompileOptions(
                        ModelArgs(models_dir() / f"{name}.onnx", dims=dims),
                        ScheduleArgs(streams=streams, precision=precision),
                        LAYOUTS[layout],
                    ),
                    out,
                )
            bdir = build(out, "cuda", quick=True, jobs=1)
            log = (bdir / "flowc-build.log").read_text().lower()
            verdict = "WARNINGS" if "warning" in log else "ok"
        except FlowcError as e:
            verdict = f"FAILED: {e.message.splitlines()[0][:120]}"
    shown = "auto" if streams is None else str(streams)
    return (
        f"{name:<10} {precision:<5} {layout:<10} streams {shown:<4} "
        f"{time.perf_counter() - t0:6.1f} s  {verdict}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "cuda_matrix_builds.txt"
    )
    a = ap.parse_args()
    cells = [
        (p, lay, STREAMS[(i + j) % 2])
        for i, p in enumerate(PRECISIONS)
        for j, lay in enumerate(LAYOUTS)
    ]
    lines = [
        "# CUDA builds (quick) of the option matrix's all-pairs cells; 'ok' = built, no warning"
    ]
    print(lines[0], flush=True)
    with ThreadPoolExecutor(a.jobs) as pool:
        for line in pool.map(lambda c: one_cell(*c), cells):
            print(line, flush=True)
            lines.append(line)
    a.out.write_text("\n".join(lines) + "\n")
    bad = [ln for ln in lines[1:] if not ln.endswith("ok")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
