"""The host target beside onnxruntime at equal threads: per model, flowc's host build
(`model_main --bench N`: the median of N synchronized runs) and onnxruntime's CPU session
(the median of N `run` calls) with as many threads (flowc: OpenMP for the emulator's blocks
and OpenBLAS for GEMMs and convolutions; onnxruntime: intra_op_num_threads, one inter-op
thread), the ratio flowc / onnxruntime (below 1: flowc is faster), flowc's launches per run
(FLOWC_STATS=1) and the largest difference of their outputs. Prints the table and writes it
to bench/results/host_vs_ort.txt.

Models: tests/data/models/*.onnx (inputs from NAME.io.npz) and the onnx package's light
ResNet-50 (a seeded random input). Projects live in build/host_vs_ort/ (Release flags),
compiled every run and rebuilt where files changed; --rebuild builds from scratch. Only a run
of every model at the default precision replaces the results file; --models and --precision
runs just print.

    python bench/host_vs_ort.py [--threads 2] [--runs 20] [--models mlp,light_resnet50]
                                [--precision bf16]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from flowc.errors import FlowcError
from flowc.harness.build import bench_figures, build, run
from flowc.harness.compare import max_rel_error

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SHARED_MODELS = REPO / "tests" / "data" / "models"
LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
LAUNCHES = re.compile(r"^launches per run: (\d+)", re.M)


@dataclass
class Model:
    name: str
    path: Path
    feeds: dict[str, np.ndarray]


def models(selected: set[str] | None) -> list[Model]:
    found = []
    for path in sorted(SHARED_MODELS.glob("*.onnx")):
        io = np.load(path.with_suffix(".io.npz"))
        feeds = {k[3:]: io[k] for k in io.files if k.startswith("in:")}
        found.append(Model(path.stem, path, feeds))
    light = LIGHT_DIR / "light_resnet50.onnx"
    proto = onnx.load(str(light), load_external_data=False)
    inits = {t.name for t in proto.graph.initializer}
    rng = np.random.default_rng(0)
    feeds = {
        i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(
            np.float32
        )
        for i in proto.graph.input
        if i.name not in inits
    }
    found.append(Model("light_resnet50", light, feeds))
    if selected is not None:
        unknown = selected - {m.name for m in found}
        if unknown:
            raise SystemExit(f"unknown models {sorted(unknown)}; known: {[m.name for m in found]}")
        found = [m for m in found if m.name in selected]
    return found


def flowc_project(m: Model, work: Path, rebuild: bool, precision: str | None) -> Path:
    """The model compiled and built for the host (Release). Compiled every time (a few
    seconds): flowc compile leaves unchanged files alone, mtime too, so the build that follows
    only redoes what changed and never times a stale program."""
    project = work / (m.name if precision is None else f"{m.name}-{precision}")
    if rebuild:
        shutil.rmtree(project, ignore_errors=True)
    shapes = [f"--shape={k}={'x'.join(map(str, a.shape))}" for k, a in m.feeds.items()]
    cmd = [sys.executable, "-m", "flowc", "compile", str(m.path), "-o", str(project)]
    cmd += ["--target", "host", "--force", *shapes]
    if precision is not None:
        cmd += ["--precision", precision]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise FlowcError(f"flowc compile failed: {r.stderr.strip().splitlines()[-2:]}")
    build(project, "host", jobs=os.cpu_count() or 2)
    return project


def time_flowc(
    project: Path, m: Model, threads: int, runs: int
) -> tuple[float, int, dict[str, np.ndarray]]:
    env = {
        "OMP_NUM_THREADS": str(threads),
        "OPENBLAS_NUM_THREADS": str(threads),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
        "FLOWC_STATS": "1",
    }
    results, stdout = run(project, m.feeds, target="host", env=env, bench=runs)
    launches = LAUNCHES.search(stdout)
    if launches is None:
        raise FlowcError(f"{m.name}: the driver printed no launch count:\n{stdout}")
    return float(bench_figures(stdout)["latency_ms"]["median"]), int(launches[1]), results


def time_onnxruntime(m: Model, threads: int, runs: int) -> tuple[float, dict[str, np.ndarray]]:
    import onnxruntime as ort

    from flowc.harness.ort import inference_mode

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3  # not the notes on unused initializers
    proto = inference_mode(onnx.load(str(m.path)))
    sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    for _ in range(3):  # warm-up, as the driver does
        got = sess.run(names, m.feeds)
    ms = []
    for _ in range(runs):
        t = time.perf_counter()
        got = sess.run(names, m.feeds)
        ms.append((time.perf_counter() - t) * 1000)
    return statistics.median(ms), dict(zip(names, got, strict=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="threads for both (default 2)")
    ap.add_argument("--runs", type=int, default=20, help="timed runs per model (default 20)")
    ap.add_argument("--models", default=None, help="comma-separated subset (default: all)")
    ap.add_argument("--work", type=Path, default=REPO / "build" / "host_vs_ort")
    ap.add_argument("--rebuild", action="store_true", help="build from scratch")
    ap.add_argument(
        "--precision", default=None, help="flowc compile --precision (default: flowc's default)"
    )
    ap.add_argument("--out", type=Path, default=HERE / "results" / "host_vs_ort.txt")
    args = ap.parse_args(argv)
    selected = set(args.models.split(",")) if args.models else None
    rows: list[tuple[str, float, float, float, int, float]] = []
    failed: list[tuple[str, str]] = []
    for m in models(selected):
        print(f"{m.name}: building", file=sys.stderr, flush=True)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # gpt2_tiny's training-mode Dropout, known
                project = flowc_project(m, args.work, args.rebuild, args.precision)
            print(f"{m.name}: timing", file=sys.stderr, flush=True)
            f_ms, launches, f_out = time_flowc(project, m, args.threads, args.runs)
        except FlowcError as e:  # the other models' figures still count
            print(f"{m.name}: {e.message}", file=sys.stderr)
            failed.append((m.name, e.message.splitlines()[0]))
            continue
        o_ms, o_out = time_onnxruntime(m, args.threads, args.runs)
        err = max(max_rel_error(f_out[k], o_out[k]) for k in o_out)
        rows.append((m.name, f_ms, o_ms, f_ms / o_ms, launches, err))

    import onnxruntime as ort

    rev = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        f"# flowc host target vs onnxruntime {ort.__version__} (CPUExecutionProvider), "
        f"{args.threads} threads each, median of {args.runs} synchronized runs",
        f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, flowc {rev or '?'}, "
        f"{platform.machine()} {os.cpu_count()} cores, load average {load}; "
        f"flowc: OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'PASSIVE')}, "
        f"{'precision ' + args.precision if args.precision else 'default precision'}",
        "# ratio = flowc / onnxruntime (below 1: flowc faster); launches = kernels + library "
        "calls per run (FLOWC_STATS=1); err = max|flowc-ort| / max|ort|",
        f"{'model':<16} {'flowc ms':>10} {'ort ms':>10} {'ratio':>7} {'launches':>9} {'err':>9}",
    ]
    for name, f_ms, o_ms, ratio, launches, err in rows:
        lines.append(
            f"{name:<16} {f_ms:>10.3f} {o_ms:>10.3f} {ratio:>7.2f} {launches:>9d} {err:>9.1e}"
        )
    lines += [f"{name:<16} failed: {why}" for name, why in failed]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if selected is None and args.precision is None:  # only the full default table is kept
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
