"""`make gpu-check` and `make gpu-anchors`: flowc checked and timed on a GPU in one command
each (docs/performance.md, "GPU checks").

    python3 bench/gpu/gpu_check.py check   [--dry-run] [--models ...] [--batches 1,32]
                                           [--precisions fp32,tf32,bf16] [--budget-s S]
    python3 bench/gpu/gpu_check.py anchors [--dry-run] [--models ...] [--batches 1,32]
    python3 bench/gpu/gpu_check.py dynamic [--dry-run] [--budget-s S]

`check` (at most 6 minutes on one H200), in order:
  1. set-up from .gpu/ (bench/gpu/prepare.sh made it; the GPU machine fetches nothing):
     lark and PyCUDA's pure-Python needs installed from wheels into .gpu/site, PyCUDA built
     from its sdist (in the background; if it fails, this says so and the whole-program
     checks use CuPy through ctypes); flowc runs from this source tree (PYTHONPATH=.);
  2. the PyCUDA harnesses: `pytest -m gpu tests/test_gpu_harness.py`;
  3. ResNet-50, BERT-base and GPT-2 small (seq 128) exported with anchors_gpu.py (the copy
     in .gpu/), batch 1 and 32, in parallel processes (started at 1., beside the build);
  4. flowc compile and build of every model, batch and precision, in parallel (quick
     builds: nvcc's device code fully optimized, host code at -O1);
  5. PyTorch eager, every cell, in one process with the GPU otherwise idle: latency
     (anchors_gpu.timed, CUDA events) and PyTorch's own error in that precision against
     its fp32 output (the .io.npz);
  6. flowc, every cell: the driver's `--bench N` (CUDA Graph replay, median of N runs one
     at a time) and its outputs against PyTorch's fp32 output; correct when the error is
     at most 2x PyTorch's own in that precision (floor 1e-4);
  7. bench/results/gpu-check.json and .txt, and the table.
`anchors` (at most 5 minutes): torch.compile (bf16, batch 1 and 32; default mode first,
then reduce-overhead while time is left) beside eager, in bench/results/gpu-anchors.*,
with flowc's bf16 latency from gpu-check.json of the same device when there is one.

`dynamic` (at most 5 minutes; `make gpu-dynamic`): BERT-base exported with a
dynamic batch and sequence (export_dynamic.py), compiled once with --dim batch=1..32
--dim seq=1..512 and statically at (1, 128), (8, 128) and (32, 512); at each point both
programs' median latency (driver --bench), their ratio, the dynamic output against the
static one's and the static one's against onnxruntime (the small points), in
bench/results/gpu-dynamic.* (docs/dynamic.md; the dry run: bert_tiny on the host, in
bench/results/gpu-dynamic-dryrun.*).

`--dry-run` (`make gpu-check DRY=1`): the same steps on a machine without a GPU: tiny
models (`anchors_gpu.py --tiny`, torch from --torch-python), host builds (flowc's CPU
emulator) checked against PyTorch, the timing columns marked host/dry (meaningless).
Results go to bench/results/gpu-dryrun.*.

A time budget (--budget-s) bounds the command: cells not started in time are reported as
skipped, never silently dropped.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
GPU_DIR = REPO / ".gpu"
RESULTS = REPO / "bench" / "results"
MODELS = ["resnet50", "bert_base", "gpt2"]
# The order cells are timed in: when the budget runs short, the last ones are skipped.
PRECISION_PRIORITY = ["bf16", "fp32", "tf32", "fp16"]
ERROR_FLOOR = 1e-4  # fp32 round-off between summation orders (flowc's fp32 tolerance)


class Log:
    """Prints with the elapsed time, and keeps every line for the .txt result."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.lines: list[str] = []

    def __call__(self, msg: str = "") -> None:
        for line in str(msg).splitlines() or [""]:
            text = f"[{time.time() - self.t0:6.1f}s] {line}"
            print(text, flush=True)
            self.lines.append(text)

    def raw(self, text: str) -> None:
        print(text, flush=True)
        self.lines.extend(text.splitlines())

    @property
    def elapsed(self) -> float:
        return time.time() - self.t0


def child_env(extra_paths: list[Path]) -> dict[str, str]:
    """The environment of the commands this runs: flowc from this tree, the carried site."""
    env = dict(os.environ)
    paths = [str(REPO), *map(str, extra_paths)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if shutil.which("nvcc", path=env.get("PATH")) is None:
        # nvcc off PATH: the system toolkit's, or the one NVIDIA's wheels put beside Python.
        import site

        candidates = [Path("/usr/local/cuda/bin/nvcc")] + [
            Path(p) / "nvidia" / sub / "bin" / "nvcc"
            for p in site.getsitepackages()
            for sub in ("cu13", "cuda_nvcc")
        ]
        found = next((c for c in candidates if c.is_file()), None)
        if found is not None:
            env["PATH"] = f"{found.parent}{os.pathsep}{env.get('PATH', '')}"
    return env


# -- 1. set-up ------------------------------------------------------------------------------


def install_wheels(log: Log) -> Path | None:
    """The carried wheels (lark, pytools, ...) into .gpu/site; None when none are carried."""
    wheels = sorted(glob.glob(str(GPU_DIR / "wheels" / "*.whl")))
    if not wheels:
        log("no wheels in .gpu/wheels (run `make gpu-prepare` where PyPI is reachable)")
        return None
    site = GPU_DIR / "site"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            str(site),
            *wheels,
        ],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        log(f"installing the carried wheels failed:\n{r.stderr.strip()[-2000:]}")
        return None
    log(f"installed {', '.join(Path(w).name.split('-')[0] for w in wheels)} into {site}")
    return site


def start_pycuda_build(log: Log, env: dict[str, str]) -> tuple[subprocess.Popen[str], Path] | None:
    """PyCUDA from the carried sdist, built in place (setup.py build_ext -j CPUs --inplace)
    in the background; None when there is no sdist."""
    sdists = sorted(glob.glob(str(GPU_DIR / "sdist" / "pycuda-*.tar.gz")))
    if not sdists:
        log("no PyCUDA sdist in .gpu/sdist: the whole-program checks use CuPy")
        return None
    build_root = Path("/tmp/flowc-pycuda")
    with tarfile.open(sdists[-1]) as tar:
        top = tar.getnames()[0].split("/")[0]
        if not (build_root / top).is_dir():
            tar.extractall(build_root, filter="data")
    src = build_root / top
    logf = (GPU_DIR / "pycuda-build.log").open("w")
    cmd = [sys.executable, "setup.py", "build_ext", "-j", str(os.cpu_count() or 4), "--inplace"]
    log(f"building {top} from its sdist in the background ({' '.join(cmd[1:])})")
    proc = subprocess.Popen(cmd, cwd=src, env=env, stdout=logf, stderr=subprocess.STDOUT, text=True)
    return proc, src


def finish_pycuda(
    log: Log,
    started: tuple[subprocess.Popen[str], Path] | None,
    env: dict[str, str],
    timeout: float,
) -> tuple[str, Path | None]:
    """Waits for the PyCUDA build; returns what became of it and the folder to import from."""
    if started is None:
        return "no sdist carried", None
    proc, src = started
    try:
        rc = proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        log("PyCUDA's build did not finish in time: the whole-program checks use CuPy")
        return "build timed out", None
    if rc != 0:
        tail = (GPU_DIR / "pycuda-build.log").read_text(errors="replace").strip()[-1500:]
        log(f"PyCUDA's build FAILED (exit {rc}); the whole-program checks use CuPy:\n{tail}")
        return f"build failed (exit {rc})", None
    probe = subprocess.run(
        [sys.executable, "-c", "import pycuda.driver as d; d.init(); print(d.get_version())"],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": f"{src}{os.pathsep}{env['PYTHONPATH']}"},
    )
    if probe.returncode != 0:
        log(f"PyCUDA built but does not load: {probe.stderr.strip()[-800:]}; using CuPy")
        return "built, does not load", None
    log(f"PyCUDA built and loads (CUDA {probe.stdout.strip()})")
    return "built", src


# -- 3. exports -----------------------------------------------------------------------------


def start_exports(
    log: Log, pairs: list[tuple[str, int]], work: Path, torch_python: str, tiny: bool
) -> dict[tuple[str, int], subprocess.Popen[str] | None]:
    """anchors_gpu.py once per (model, batch), in parallel processes. Each also times eager
    once (its own script's doing; those figures are not used: step 5 times eager alone)."""
    procs: dict[tuple[str, int], subprocess.Popen[str] | None] = {}
    threads = max(1, (os.cpu_count() or 2) // max(1, len(pairs)))
    for model, batch in pairs:
        d = work / "export" / f"{model}_b{batch}"
        stem = d / f"{model}_b{batch}"
        if stem.with_suffix(".onnx").is_file() and Path(f"{stem}.io.npz").is_file():
            procs[(model, batch)] = None  # exported by an earlier run on this machine
            continue
        d.mkdir(parents=True, exist_ok=True)
        cmd = [
            torch_python,
            str(GPU_DIR / "anchors_gpu.py"),
            str(d),
            "--models",
            model,
            "--batches",
            str(batch),
            "--dtypes",
            "fp32",
            "--iters",
            "1",
        ]
        if tiny:
            cmd.append("--tiny")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        logf = (d / "export.log").open("w")
        procs[(model, batch)] = subprocess.Popen(
            cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, text=True
        )
    started = [f"{m} b{b}" for (m, b), p in procs.items() if p is not None]
    reused = [f"{m} b{b}" for (m, b), p in procs.items() if p is None]
    if started:
        log(f"exporting {', '.join(started)} with anchors_gpu.py (in parallel)")
    if reused:
        log(f"reusing the exports of {', '.join(reused)} from {work / 'export'}")
    return procs


def finish_exports(
    log: Log,
    procs: dict[tuple[str, int], subprocess.Popen[str] | None],
    work: Path,
    deadline: float,
) -> Iterator[tuple[tuple[str, int], Path]]:
    """Each export as it ends (in the order started), until ``deadline``."""
    done = 0
    end = deadline
    for (model, batch), p in procs.items():
        d = work / "export" / f"{model}_b{batch}"
        if p is not None:
            try:
                rc = p.wait(timeout=max(end - time.time(), 1))
            except subprocess.TimeoutExpired:
                p.kill()
                log(f"export of {model} b{batch} did not finish in time")
                continue
            if rc != 0:
                tail = (d / "export.log").read_text(errors="replace").strip()[-1500:]
                log(f"export of {model} b{batch} FAILED (exit {rc}):\n{tail}")
                continue
        done += 1
        log(f"exported {model} b{batch}")
        yield (model, batch), d / f"{model}_b{batch}"
    log(f"exported {done} of {len(procs)} models")


# -- 2. the PyCUDA harnesses ----------------------------------------------------------------


def gpu_tests(log: Log, env: dict[str, str], timeout: float) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu",
        "-rs",
        "-p",
        "no:cacheprovider",
        "tests/test_gpu_harness.py",
    ]
    if _has_xdist():
        cmd += ["-n", "3"]
    log(f"PyCUDA harnesses: {' '.join(cmd[2:])}")
    try:
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = str(e.stdout or "") + "\n(timed out)", 124
    tail = [ln for ln in out.strip().splitlines() if ln.strip()][-25:]
    for line in tail:
        log(f"  | {line}")
    summary = tail[-1] if tail else ""
    return {"exit": rc, "summary": summary, "ok": rc in (0, 5)}


def _has_xdist() -> bool:
    import importlib.util

    return importlib.util.find_spec("xdist") is not None


# -- 4. flowc compile and build -------------------------------------------------------------


def flowc_has_precision(env: dict[str, str]) -> bool:
    r = subprocess.run(
        [sys.executable, "-m", "flowc", "compile", "--help"],
        capture_output=True,
        text=True,
        env=env,
    )
    return "--precision" in r.stdout


def run_limited(cmd: list[str], env: dict[str, str], deadline: float) -> tuple[int, str]:
    """``cmd`` in a process group of its own, all of it killed at ``deadline`` (a build's
    cmake, make and nvcc too); returns the exit status (124: killed) and the output."""
    p = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = p.communicate(timeout=max(deadline - time.time(), 1))
        return p.returncode, out
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, 9)
        out, _ = p.communicate()
        return 124, out + "\n(stopped: the time budget ran out)"


def compile_and_build(
    cell: dict[str, Any], target: str, env: dict[str, str], precision_flag: bool, deadline: float
) -> dict[str, Any]:
    """One cell's `flowc compile` and quick build (in a worker thread)."""
    extra = ["--precision", cell["precision"]] if precision_flag else []
    return compile_build(
        Path(f"{cell['stem']}.onnx"), extra, Path(cell["project"]), target, env, deadline
    )


def compile_build(
    model: Path, extra: list[str], proj: Path, target: str, env: dict[str, str], deadline: float
) -> dict[str, Any]:
    """`flowc compile MODEL -o PROJ --target T EXTRA...` and a quick build, each a process of
    its own, both stopped at ``deadline``."""
    t0 = time.time()
    cmd = [sys.executable, "-m", "flowc", "compile", str(model), "-o", str(proj),
           "--target", target, *extra]  # fmt: skip
    rc, out = run_limited(cmd, env, deadline)
    if rc != 0:
        return {"built": False, "why": "compile failed: " + out.strip()[-1200:]}
    t1 = time.time()
    rc, out = run_limited(
        [sys.executable, str(Path(__file__).resolve()), "_build", str(proj), target], env, deadline
    )
    if rc != 0:
        return {"built": False, "why": "build failed: " + out.strip()[-1500:]}
    return {"built": True, "compile_s": round(t1 - t0, 1), "build_s": round(time.time() - t1, 1)}


def _build_main(proj: str, target: str) -> int:
    from flowc.harness.build import build

    bdir = build(Path(proj), target, quick=True)
    log = (bdir / "flowc-build.log").read_text(errors="replace").lower()
    if "warning" in log:
        print("the build printed warnings (see flowc-build.log)")
    return 0


# -- 5./6. timings ----------------------------------------------------------------------------


def run_torch_side(
    log: Log,
    torch_python: str,
    cells: list[dict[str, Any]],
    work: Path,
    tiny: bool,
    iters: int,
    deadline: float,
    timeout: float,
) -> list[dict[str, Any]]:
    spec = work / f"torch_cells_{int(time.time())}.json"
    out = spec.with_suffix(".out.json")
    spec.write_text(json.dumps(cells))
    cmd = [
        torch_python,
        str(REPO / "bench" / "gpu" / "torch_side.py"),
        "--anchors",
        str(GPU_DIR / "anchors_gpu.py"),
        "--cells",
        str(spec),
        "--out",
        str(out),
        "--iters",
        str(iters),
        "--deadline",
        str(deadline),
    ]
    if tiny:
        cmd.append("--tiny")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=max(timeout, 1))
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = str(e.stdout or ""), 124
    for line in text.strip().splitlines():
        if not line.startswith(("[torch.onnx]", "W1", "I1")) and line.strip():
            log(f"  torch | {line}")
    if rc != 0 or not out.is_file():
        log(f"the PyTorch side failed (exit {rc})")
        return []
    return list(json.loads(out.read_text())["results"])


def flowc_run(cell: dict[str, Any], target: str, runs: int) -> dict[str, Any]:
    from flowc.harness.build import bench_figures, run
    from flowc.harness.compare import max_rel_error

    io = np.load(f"{cell['stem']}.io.npz")
    feeds = {k[3:]: io[k] for k in io.files if k.startswith("in:")}
    refs = {k[4:]: io[k] for k in io.files if k.startswith("out:")}
    outs, stdout = run(Path(cell["project"]), feeds, target=target, bench=runs)
    figures = bench_figures(stdout)
    errors = {k: max_rel_error(outs[k].astype(np.float32), refs[k]) for k in refs if k in outs}
    return {
        "flowc_ms": figures["latency_ms"]["median"],
        "flowc_min_ms": figures["latency_ms"]["min"],
        "flowc_runs": figures["runs"],
        "throughput_runs_per_s": figures["throughput_runs_per_s"],
        "flowc_error": max(errors.values()) if errors else float("nan"),
    }


# -- 7. the table ---------------------------------------------------------------------------


def fmt(v: Any, spec: str = ".3f") -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return "-"
    return format(v, spec) if isinstance(v, int | float) else str(v)


def check_table(rows: list[dict[str, Any]], dry: bool) -> str:
    unit = "host/dry ms" if dry else "ms"
    head = [
        "model",
        "batch",
        "prec",
        f"flowc {unit}",
        f"eager {unit}",
        "eager/flowc",
        "flowc err",
        "torch err",
        "limit",
        "correct",
    ]
    body = []
    for r in rows:
        ratio = r["eager_ms"] / r["flowc_ms"] if r.get("eager_ms") and r.get("flowc_ms") else None
        body.append(
            [
                r["model"],
                str(r["batch"]),
                r["precision"],
                fmt(r.get("flowc_ms")),
                fmt(r.get("eager_ms")),
                fmt(ratio, ".2f"),
                fmt(r.get("flowc_error"), ".2e"),
                fmt(r.get("torch_error"), ".2e"),
                fmt(r.get("limit"), ".1e"),
                r.get("status", "-"),
            ]
        )
    return _table(head, body)


def _table(head: list[str], body: list[list[str]]) -> str:
    widths = [max([len(h), *(len(b[k]) for b in body)]) for k, h in enumerate(head)]

    def line(cols: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), rule, *(line(b) for b in body)])


def write_results(name: str, record: dict[str, Any], log: Log) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    (RESULTS / f"{name}.txt").write_text("\n".join(log.lines) + "\n")
    # The device tool brings back only what is under $OUT.
    out = os.environ.get("OUT")
    if out and Path(out).is_dir():
        for ext in ("json", "txt"):
            shutil.copy(RESULTS / f"{name}.{ext}", Path(out) / f"{name}.{ext}")


def device_name(env: dict[str, str]) -> str:
    r = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        if shutil.which("nvidia-smi")
        else None
    )
    return r.stdout.strip() if r is not None and r.returncode == 0 else "no GPU (CPU dry run)"


# -- the commands ---------------------------------------------------------------------------


def cmd_check(a: argparse.Namespace) -> int:
    log = Log()
    dry = a.dry_run
    end = log.t0 + a.budget_s
    target = "host" if dry else "cuda"
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    models, batches = a.models.split(","), [int(b) for b in a.batches.split(",")]
    precisions = a.precisions.split(",")
    record: dict[str, Any] = {"command": "gpu-check", "dry_run": dry, "target": target}
    log(
        f"gpu-check{' --dry-run' if dry else ''}: models {models}, batches {batches}, "
        f"precisions {precisions}, budget {a.budget_s:.0f} s, work in {work}"
    )
    if not (GPU_DIR / "anchors_gpu.py").is_file():
        log("error: .gpu/anchors_gpu.py is missing: run `make gpu-prepare` first")
        return 2
    # 1. set-up
    site = None if dry else install_wheels(log)
    env = child_env([site] if site else [])
    # flowc from this tree in this process too (step 6 runs the drivers through it).
    sys.path[:0] = [str(REPO), *([str(site)] if site else [])]
    record["device"] = device_name(env)
    log(f"device: {record['device']}")
    pycuda = None if dry else start_pycuda_build(log, env)
    pairs = [(m, b) for m in models for b in batches]
    exports = start_exports(log, pairs, work, a.torch_python, tiny=dry)
    # 4. compile and build, in parallel: each model's cells as soon as its export is there
    # (beside the PyCUDA build and the harnesses; the timings wait for all of it).
    has_flag = flowc_has_precision(env)
    if not has_flag:
        log(
            "flowc compile has no --precision here: compiling fp32 only (the other "
            "precisions are timed for PyTorch alone)"
        )
    cells = [
        {
            "model": model,
            "batch": batch,
            "precision": p,
            "stem": str(work / "export" / f"{model}_b{batch}" / f"{model}_b{batch}"),
            "project": str(work / "proj" / f"{model}_b{batch}_{p}"),
            "compiled": has_flag or p == "fp32",
        }
        for model, batch in pairs
        for p in precisions
    ]
    # Two compiler processes per build (model.cu and main.cu side by side).
    workers = max(1, min(len(cells), (os.cpu_count() or 2) // 2))
    log(
        f"flowc compile + build ({target}) of {sum(c['compiled'] for c in cells)} projects, "
        f"{workers} at a time, each as soon as its model is exported"
    )
    build_pool = concurrent.futures.ThreadPoolExecutor(workers)
    exported: dict[tuple[str, int], Path] = {}
    futures: dict[concurrent.futures.Future[dict[str, Any]], dict[str, Any]] = {}

    def after_export() -> None:
        for pair, stem in finish_exports(log, exports, work, deadline=end - 60):
            exported[pair] = stem
            for c in cells:
                if (c["model"], c["batch"]) == pair and c["compiled"]:
                    fut = build_pool.submit(compile_and_build, c, target, env, has_flag, end - 45)
                    futures[fut] = c

    feeder = concurrent.futures.ThreadPoolExecutor(1)
    fed = feeder.submit(after_export)
    # 2. the PyCUDA harnesses
    state, src = (
        ("not built (dry run: no GPU)", None)
        if dry
        else finish_pycuda(log, pycuda, env, timeout=min(240, end - time.time() - 150))
    )
    record["pycuda"] = state
    test_env = child_env([p for p in (site, src) if p])
    record["gpu_tests"] = gpu_tests(
        log, test_env, timeout=max(30, min(200, end - time.time() - 120))
    )
    # 3. the exports, then 4. the builds they started
    fed.result()
    feeder.shutdown()

    def built(c: dict[str, Any]) -> str:
        if c.get("built"):
            return f"built (compile {c['compile_s']} s, build {c['build_s']} s)"
        return f"NOT BUILT: {c.get('why', 'its model was not exported')}"

    for f in concurrent.futures.as_completed(futures):
        c = futures[f]
        c.update(f.result())
        log(f"  {c['model']} b{c['batch']} {c['precision']}: {built(c)}")
    build_pool.shutdown()
    for c in cells:
        if c["compiled"] and "built" not in c:
            log(f"  {c['model']} b{c['batch']} {c['precision']}: {built(c)}")
    # 5. PyTorch eager, alone on the GPU
    torch_cells = [
        {
            "model": m,
            "batch": b,
            "precisions": precisions,
            "modes": ["eager"],
            "reference": f"{stem}.io.npz",
        }
        for (m, b), stem in sorted(exported.items(), key=lambda kv: pairs.index(kv[0]))
    ]
    log("PyTorch eager (one process, the GPU otherwise idle)")
    torch_rows = run_torch_side(
        log,
        a.torch_python,
        torch_cells,
        work,
        dry,
        a.eager_iters,
        deadline=end - 40,
        timeout=end - time.time() - 20,
    )
    eager = {(r["model"], r["batch"], r["dtype"]): r for r in torch_rows if "median_ms" in r}
    # 6. flowc: correctness and latency, by priority
    order = sorted(cells, key=lambda c: (PRECISION_PRIORITY.index(c["precision"]), c["batch"]))
    for c in order:
        row = eager.get((c["model"], c["batch"], c["precision"]), {})
        c["eager_ms"] = row.get("median_ms")
        c["torch_error"] = row.get("error")
        if not c.get("built"):
            c["status"] = "no flowc build" if c["compiled"] else "no --precision"
            continue
        if time.time() > end - 10:
            c["status"] = "skipped (budget)"
            continue
        try:
            c.update(flowc_run(c, target, a.runs))
        except Exception as e:  # a failed run is a result, not the end of the command
            c["status"] = f"RUN FAILED: {str(e).strip()[-300:]}"
            continue
        torch_err = c["torch_error"] or 0.0
        c["limit"] = max(2 * torch_err, ERROR_FLOOR)
        if dry and c["precision"] == "tf32":
            # PyTorch has no TF32 on a CPU (its error is fp32's): flowc verify's own bound.
            from flowc.cli.verify import VERIFY_TOLERANCE

            c["limit"] = max(c["limit"], VERIFY_TOLERANCE["tf32"])
        c["status"] = "ok" if c["flowc_error"] <= c["limit"] else "WRONG"
        log(
            f"  {c['model']} b{c['batch']} {c['precision']}: flowc {c['flowc_ms']:.3f} ms, "
            f"error {c['flowc_error']:.2e} (limit {c['limit']:.1e}) {c['status']}"
        )
    rows = sorted(
        cells,
        key=lambda c: (models.index(c["model"]), c["batch"], precisions.index(c["precision"])),
    )
    record["cells"] = rows
    record["torch"] = torch_rows
    record["wall_s"] = round(log.elapsed, 1)
    log("")
    note = (
        "timings: host/dry — flowc's CPU emulator and PyTorch on a CPU, tiny models; "
        "meaningless as speed"
        if dry
        else "timings: median latency, flowc's driver "
        "(--bench, CUDA Graph replay) and PyTorch eager (CUDA events), same run"
    )
    log(note)
    log.raw(check_table(rows, dry))
    harness = record["gpu_tests"]
    log(f"PyCUDA harnesses: {harness['summary']} (PyCUDA: {state})")
    bad = [c for c in rows if c.get("status") not in ("ok", "no --precision")]
    log(f"{len(rows) - len(bad)} of {len(rows)} cells correct and timed; wall {log.elapsed:.0f} s")
    write_results("gpu-dryrun" if dry else "gpu-check", record, log)
    return 0 if not bad and harness["ok"] else 1


def cmd_anchors(a: argparse.Namespace) -> int:
    log = Log()
    dry = a.dry_run
    end = log.t0 + a.budget_s
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    models, batches = a.models.split(","), [int(b) for b in a.batches.split(",")]
    if not (GPU_DIR / "anchors_gpu.py").is_file():
        log("error: .gpu/anchors_gpu.py is missing: run `make gpu-prepare` first")
        return 2
    record: dict[str, Any] = {"command": "gpu-anchors", "dry_run": dry, "device": device_name({})}
    log(
        f"gpu-anchors{' --dry-run' if dry else ''}: torch.compile bf16, models {models}, "
        f"batches {batches}, budget {a.budget_s:.0f} s; device {record['device']}"
    )
    # Default mode everywhere first, then reduce-overhead (CUDA graphs, as flowc replays).
    cells = [
        {"model": m, "batch": b, "precisions": ["bf16"], "modes": ["eager", "torch.compile"]}
        for m in models
        for b in batches
    ]
    cells += [
        {"model": m, "batch": b, "precisions": ["bf16"], "modes": ["torch.compile reduce-overhead"]}
        for m in models
        for b in batches
    ]
    # A compile takes about a minute on the H200: none starts that cannot end in time.
    rows = run_torch_side(
        log,
        a.torch_python,
        cells,
        work,
        dry,
        a.eager_iters,
        deadline=end - a.compile_margin_s,
        timeout=end - time.time() - 5,
    )
    flowc = {}
    check = RESULTS / "gpu-check.json"
    if check.is_file() and not dry:
        prior = json.loads(check.read_text())
        if prior.get("device") == record["device"]:
            flowc = {
                (c["model"], c["batch"]): c.get("flowc_ms")
                for c in prior.get("cells", [])
                if c.get("precision") == "bf16"
            }
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["batch"]), {})[r["mode"]] = r
    head = [
        "model",
        "batch",
        "eager bf16",
        "torch.compile",
        "compile reduce-overhead",
        "flowc bf16 (gpu-check)",
        "flowc / best compile",
    ]
    body = []
    for m in models:
        for b in batches:
            modes = by.get((m, b), {})
            ms = {k: v.get("median_ms") for k, v in modes.items()}
            best = min([v for k, v in ms.items() if k != "eager" and v], default=None)
            fl = flowc.get((m, b))
            body.append(
                [
                    m,
                    str(b),
                    fmt(ms.get("eager")),
                    fmt(ms.get("torch.compile")),
                    fmt(ms.get("torch.compile reduce-overhead")),
                    fmt(fl),
                    fmt(fl / best if fl and best else None, ".2f"),
                ]
            )
    record["results"] = rows
    record["wall_s"] = round(log.elapsed, 1)
    log("")
    log("median latency in ms" + (" (host/dry: PyTorch on a CPU, tiny models)" if dry else ""))
    log.raw(_table(head, body))
    skipped = [r for r in rows if "skipped" in r]
    log(f"{len(rows) - len(skipped)} of {len(rows)} timings done; wall {log.elapsed:.0f} s")
    write_results("gpu-anchors-dryrun" if dry else "gpu-anchors", record, log)
    return 0 if rows else 1


# -- dynamic: one program over a range beside static programs -------------------------------

# (batch, seq) where the dynamic BERT-base is timed beside a static build (the issue's).
DYNAMIC_POINTS = [(1, 128), (8, 128), (32, 512)]
DYNAMIC_RANGE = (32, 512)
# The dry run: bert_tiny (the repository's copy) over smaller sizes on the host.
DRY_POINTS = [(1, 16), (2, 16), (4, 32)]
DRY_RANGE = (4, 32)


def _bert_feeds(batch: int, seq: int) -> dict[str, np.ndarray]:
    """Token ids below 100 (every BERT's vocabulary has them); the last quarter of the second
    sequence padded (mask 0), as a served batch is."""
    rng = np.random.default_rng(batch * 1000 + seq)
    mask = np.ones((batch, seq), np.int64)
    if batch > 1:
        mask[1, seq - seq // 4 :] = 0
    return {
        "input_ids": rng.integers(0, 100, (batch, seq)).astype(np.int64),
        "attention_mask": mask,
    }


def cmd_dynamic(a: argparse.Namespace) -> int:
    """BERT-base compiled once with --dim batch=1..32 --dim seq=1..512, beside a static
    build at each of DYNAMIC_POINTS: at each point both programs' outputs (the dynamic
    one's against the static one's, and the static one's against onnxruntime) and their
    median latency (the driver's --bench, CUDA Graph replay), their ratio (the issue's goal:
    at most 1.10 at a size bucket's end) into bench/results/gpu-dynamic.json."""
    from flowc.harness.build import bench_figures, run
    from flowc.harness.compare import max_rel_error

    log = Log()
    dry = a.dry_run
    end = log.t0 + a.budget_s
    target = "host" if dry else "cuda"
    work = Path(a.work) / "dynamic"
    work.mkdir(parents=True, exist_ok=True)
    points, (top_b, top_s) = (DRY_POINTS, DRY_RANGE) if dry else (DYNAMIC_POINTS, DYNAMIC_RANGE)
    record: dict[str, Any] = {"command": "gpu-dynamic", "dry_run": dry, "target": target}
    site = None if dry else install_wheels(log)
    env = child_env([site] if site else [])
    sys.path[:0] = [str(REPO), *([str(site)] if site else [])]
    record["device"] = device_name(env)
    log(f"gpu-dynamic{' --dry-run' if dry else ''}: device {record['device']}, points {points}")
    model = work / "bert_dynamic.onnx"
    if dry:
        shutil.copy(REPO / "tests" / "data" / "models" / "bert_tiny.onnx", model)
        log("model: bert_tiny (tests/data/models), dynamic batch and seq")
    else:
        cmd = [a.torch_python, str(REPO / "bench" / "gpu" / "export_dynamic.py"), str(model)]
        rc, out = run_limited(cmd, {**os.environ, "PYTHONUNBUFFERED": "1"}, end - 200)
        log(out.strip()[-600:])
        if rc != 0:
            log(f"error: the export failed (exit {rc})")
            return 1
    dyn_dims = [f"batch=1..{top_b}", f"seq=1..{top_s}"]
    jobs = {"dynamic": (dyn_dims, work / "proj_dynamic")}
    for b, t in points:
        jobs[f"static {b}x{t}"] = ([f"batch={b}", f"seq={t}"], work / f"proj_static_{b}x{t}")
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) // 2))
    log(f"flowc compile + build ({target}) of {len(jobs)} projects, {workers} at a time")
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futs = {
            name: pool.submit(
                compile_build,
                model,
                [arg for d in dims for arg in ("--dim", d)],
                proj,
                target,
                env,
                end - 60,
            )
            for name, (dims, proj) in jobs.items()
        }
        builds = {name: f.result() for name, f in futs.items()}
    for name, r in builds.items():
        log(
            f"  {name}: "
            + (f"built ({r['compile_s']} s + {r['build_s']} s)" if r["built"] else r["why"])
        )
    record["builds"] = builds
    rows = []
    for b, t in points:
        row: dict[str, Any] = {"batch": b, "seq": t}
        rows.append(row)
        static = f"static {b}x{t}"
        if not (builds["dynamic"]["built"] and builds[static]["built"]):
            row["status"] = "not built"
            continue
        if time.time() > end - 20:
            row["status"] = "skipped (budget)"
            continue
        feeds = _bert_feeds(b, t)
        try:
            got_s, out_s = run(jobs[static][1], feeds, target=target, bench=a.runs)
            got_d, out_d = run(jobs["dynamic"][1], feeds, target=target, bench=a.runs)
        except Exception as e:  # a failed run is a result
            row["status"] = f"RUN FAILED: {str(e).strip()[-300:]}"
            continue
        key = "last_hidden_state" if "last_hidden_state" in got_s else next(iter(got_s))
        fs, fd = bench_figures(out_s), bench_figures(out_d)
        row.update(
            static_ms=fs["latency_ms"]["median"],
            dynamic_ms=fd["latency_ms"]["median"],
            dynamic_vs_static_error=max_rel_error(got_d[key], got_s[key]),
        )
        row["ratio"] = row["dynamic_ms"] / row["static_ms"]
        if b * t <= 8 * 128:  # onnxruntime on the CPU: the small points
            import onnxruntime as ort

            sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
            ref = sess.run([key], feeds)[0]
            row["static_vs_onnxruntime_error"] = max_rel_error(got_s[key], ref)
        worst = max(row["dynamic_vs_static_error"], row.get("static_vs_onnxruntime_error", 0.0))
        row["status"] = "ok" if worst <= 1e-3 else "WRONG"
        log(
            f"  {b} x {t}: dynamic {row['dynamic_ms']:.3f} ms, static {row['static_ms']:.3f} ms, "
            f"ratio {row['ratio']:.2f}, error {worst:.1e} {row['status']}"
        )
    record["rows"] = rows
    record["wall_s"] = round(log.elapsed, 1)
    unit = "host/dry ms" if dry else "ms"
    head = [
        "batch x seq",
        f"dynamic {unit}",
        f"static {unit}",
        "ratio",
        "dyn vs static",
        "static vs ort",
        "status",
    ]
    body = [
        [
            f"{r['batch']} x {r['seq']}",
            fmt(r.get("dynamic_ms")),
            fmt(r.get("static_ms")),
            fmt(r.get("ratio"), ".2f"),
            fmt(r.get("dynamic_vs_static_error"), ".1e"),
            fmt(r.get("static_vs_onnxruntime_error"), ".1e"),
            r.get("status", "-"),
        ]
        for r in rows
    ]
    log("")
    log(
        f"one program for batch=1..{top_b}, seq=1..{top_s} beside a static program per size; "
        "median latency (driver --bench)" + (" -- host/dry: meaningless as speed" if dry else "")
    )
    log.raw(_table(head, body))
    write_results("gpu-dynamic-dryrun" if dry else "gpu-dynamic", record, log)
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["_build"]:
        return _build_main(argv[1], argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["check", "anchors", "dynamic"])
    ap.add_argument("--dry-run", action="store_true", help="no GPU: tiny models, host builds")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default=None, help="default 1,32 (dry run: 1)")
    ap.add_argument("--precisions", default="fp32,tf32,bf16")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="default 345 (anchors: 290, dynamic: 300; dry run: 1800)",
    )
    ap.add_argument("--runs", type=int, default=None, help="flowc --bench runs (default 50; dry 3)")
    ap.add_argument("--eager-iters", type=int, default=None, help="default 50 (dry run: 3)")
    ap.add_argument("--compile-margin-s", type=float, default=75.0)
    ap.add_argument("--torch-python", default=os.environ.get("TORCH_PYTHON", sys.executable))
    ap.add_argument("--work", default=None, help="default /tmp/flowc-gpu (dry: /tmp/flowc-gpu-dry)")
    a = ap.parse_args(argv)
    a.batches = a.batches or ("1" if a.dry_run else "1,32")
    # A dry run on two shared cores has no budget to speak of.
    budgets = {"check": 345.0, "anchors": 290.0, "dynamic": 300.0}
    a.budget_s = a.budget_s or (1800.0 if a.dry_run else budgets[a.command])
    a.runs = a.runs or (3 if a.dry_run else 50)
    a.eager_iters = a.eager_iters or (3 if a.dry_run else 50)
    a.work = a.work or ("/tmp/flowc-gpu-dry" if a.dry_run else "/tmp/flowc-gpu")
    with contextlib.suppress(KeyboardInterrupt):
        commands = {"check": cmd_check, "anchors": cmd_anchors, "dynamic": cmd_dynamic}
        return commands[a.command](a)
    return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
