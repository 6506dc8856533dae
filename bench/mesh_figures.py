"""One device against --mesh 2 for each shared model, through the one compile path: kernel
launches per run of rank 0 (the host emulator's FLOWC_STATS count), the modeled time of the
rank program's schedule, and, in fp32 and bf16, the error against onnxruntime beside what
rounding the weights and inputs to bf16 alone costs (onnxruntime in float32 on the rounded
model). Builds every program on the host target: minutes on 2 cores.

    python bench/mesh_figures.py [--models mlp,bert_tiny,...] [--out bench/results/mesh_figures.txt]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flowc.compiler import Compiled, compile_model, load_model  # noqa: E402
from flowc.errors import FlowcWarning  # noqa: E402
from flowc.harness.build import build, run  # noqa: E402
from flowc.harness.compare import max_rel_error  # noqa: E402
from flowc.harness.ort import (  # noqa: E402
    inference_mode,
    round_to,
    rounded_model,
    run_onnxruntime,
)
from flowc.interpreter import random_inputs  # noqa: E402
from flowc.options import CompileOptions, ModelArgs, ParallelArgs, ScheduleArgs  # noqa: E402

MODELS = ["mlp", "bert_tiny", "gpt2_tiny", "resnet_tiny", "vit_tiny"]


def models_dir() -> Path:
    return ROOT / "tests" / "data" / "models"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    warnings.simplefilter("ignore", FlowcWarning)
    mdir = models_dir()
    lines = [
        f"{'model':<12} {'precision':<9} {'layout':<8} {'launches/run':>12} "
        f"{'modeled us':>10} {'error':>9} {'bf16 rounding alone':>19}"
    ]
    print(lines[0], flush=True)
    t_start = time.perf_counter()
    for name in args.models.split(","):
        path = mdir / f"{name}.onnx"
        model = ModelArgs(path, dims=("batch=2", "seq=16") if name == "bert_tiny" else ())
        graph = load_model(model, compiled=False)
        feeds = random_inputs(graph, seed=11)
        proto = inference_mode(onnx.load(str(path)))
        ref = run_onnxruntime(proto, feeds)
        rounded = run_onnxruntime(
            rounded_model(proto, "bf16"), {k: round_to(v, "bf16") for k, v in feeds.items()}
        )
        base = max(max_rel_error(rounded[k], r) for k, r in ref.items())
        for precision in ("fp32", "bf16"):
            for layout, par in (("one", ParallelArgs()), ("mesh 2", ParallelArgs(mesh="2"))):
                with tempfile.TemporaryDirectory(prefix="flowc-mesh-fig-") as tmp:
                    out = Path(tmp) / "out"
                    c = compile_model(
                        CompileOptions(model, ScheduleArgs(precision=precision), par), out
                    )
                    assert isinstance(c, Compiled)
                    build(out, "host", quick=True)
                    got, stdout = run(out, feeds, target="host", env={"FLOWC_STATS": "1"})
                m = re.search(r"launches per run[^:]*: ([0-9.]+)", stdout)
                launches = m.group(1) if m else "?"
                err = max(max_rel_error(got[k], r) for k, r in ref.items())
                line = (
                    f"{name:<12} {precision:<9} {layout:<8} {launches:>12} "
                    f"{c.schedule.makespan_s * 1e6:>10.1f} {err:>9.2e} "
                    f"{base if precision == 'bf16' else float('nan'):>19.2e}"
                )
                lines.append(line)
                print(line, flush=True)
    lines.append(f"({time.perf_counter() - t_start:.0f} s)")
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
