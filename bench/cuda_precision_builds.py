"""CUDA builds of every shared model in every --precision: compile with flowc, build for
CUDA (quick: nvcc's device code optimized, host code -O1), and check that the build log has
no warning. Too slow for `make test` (which builds each model at fp32 and two narrow ones);
writes bench/results/cuda_precision_builds.txt.

    python bench/cuda_precision_builds.py [--models mlp,bert_tiny] [--precisions bf16,fp16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "tests" / "data" / "models"


def main() -> int:
    from flowc.compiler import compile_graph
    from flowc.frontend import ImportOptions, load_graph
    from flowc.harness.build import build
    from flowc.passes.manager import PassManager, compile_pipeline

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,resnet_tiny,bert_tiny,gpt2_tiny,vit_tiny")
    ap.add_argument("--precisions", default="fp32,tf32,bf16,fp16")
    args = ap.parse_args()
    rows = []
    ok = True
    for name in args.models.split(","):
        io = np.load(MODELS / f"{name}.io.npz")
        shapes = {k[3:]: io[k].shape for k in io.files if k.startswith("in:")}
        for precision in args.precisions.split(","):
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="flowc-cuda-") as tmp:
                out = Path(tmp) / "out"
                try:
                    graph = load_graph(MODELS / f"{name}.onnx", ImportOptions(shapes=shapes))
                    graph = PassManager(compile_pipeline(precision)).run(graph)
                    compile_graph(graph, out, prefix=name, precision=precision)
                    bdir = build(out, "cuda", quick=True)
                    log = (bdir / "flowc-build.log").read_text().lower()
                    result = "ok" if "warning" not in log else "WARNINGS"
                except Exception as e:  # a failed build is a row of the table
                    result = f"FAILED: {str(e).splitlines()[0][:100]}"
            ok &= result == "ok"
            row = f"{name:12} {precision:5} {time.perf_counter() - t0:7.1f} s  {result}"
            print(row, flush=True)
            rows.append(row)
    text = "# CUDA builds (quick) per shared model and --precision; 'ok' = built, no warning\n"
    (REPO / "bench" / "results" / "cuda_precision_builds.txt").write_text(
        text + "\n".join(rows) + "\n"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
