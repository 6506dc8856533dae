"""How much memory and time `flowc compile` takes on big weights (issue 15, point 5).

    .venv/bin/python bench/lean_compile.py                   # both cases, cache in /tmp
    .venv/bin/python bench/lean_compile.py --cases small     # the 12-layer one only
    .venv/bin/python bench/lean_compile.py --keep            # keep the generated models

Cases (bench/gpt2_graph.py, ``--vocab 0``: the blocks only, hidden 768, 12 heads, seq 128):
(a) ``small``, 12 layers with the weights embedded in the .onnx file (about 340 MB); (b)
``large``, 48 layers with the weights in one external data file (about 1.36 GB), and, for
reference, ``onnx.load`` of (b) with its external data. Each measurement runs in a fresh
subprocess (``--repeat`` times, the fastest kept): peak RSS is that process's VmHWM from
/proc/self/status (mapped file pages count), the time is the call alone (not the
interpreter's start, nor the imports of onnx and of flowc's modules, done before the clock
starts). The compile is `flowc compile MODEL -o OUT --target host` through the CLI's entry.

Goals: peak RSS at most 1.3 x weight bytes + 300 MB on both cases (``goal`` column: RSS /
that bound, <= 1 passes) and the 48-layer compile at most 1.5 x ``onnx.load``. The models
are generated once into ``--cache`` (deleted after unless ``--keep``); the results go to
bench/results/lean_compile.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "lean_compile.txt"
MB = 1e6

CASES = {
    "small": {"layers": 12, "external": False},
    "large": {"layers": 48, "external": True},
}


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _cpu_seconds() -> float:
    """User + system time of this process, all its threads (the CRC thread included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _child(kind: str, model: str, out: str) -> None:
    """One measurement in this (fresh) process; prints a JSON line."""
    if kind == "compile":
        # flowc's modules (and ml_dtypes, jinja2, ...) are imported before the clock starts,
        # as onnx is for onnx.load: the figures compare work on the model, not imports.
        import flowc.compiler
        import flowc.frontend.onnx
        import flowc.passes.manager  # noqa: F401
        from flowc.cli import main

        base = _hwm_bytes()
        c0 = _cpu_seconds()
        t0 = time.perf_counter()
        try:
            main(["compile", model, "-o", out, "--target", "host"])
        except SystemExit as e:
            if e.code not in (0, None):
                raise
    else:
        import onnx

        base = _hwm_bytes()
        c0 = _cpu_seconds()
        t0 = time.perf_counter()
        m = onnx.load(model)  # external data loaded too (the default)
        assert m.graph.node
    seconds = time.perf_counter() - t0
    cpu = _cpu_seconds() - c0
    print(json.dumps({"seconds": seconds, "cpu": cpu, "peak": _hwm_bytes(), "base": base}))


def _measure(kind: str, model: Path, out: Path, repeat: int) -> dict[str, float]:
    """The fastest of ``repeat`` runs, each in a fresh process into an empty OUT/, after
    the dirty pages of the run before are written back (so no run pays for another's); the
    peak is the highest of them."""
    runs = []
    for _ in range(repeat):
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
        r = subprocess.run(
            [sys.executable, __file__, "--child", kind, str(model), str(out)],
            capture_output=True,
            text=True,
            check=False,
        )
        if r.returncode != 0:
            raise SystemExit(f"{kind} of {model} failed:\n{r.stdout}\n{r.stderr}")
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    best = dict(min(runs, key=lambda x: x["seconds"]))
    best["peak"] = max(x["peak"] for x in runs)
    return best


def _generate(cache: Path, name: str, layers: int, external: bool) -> Path:
    path = cache / f"gpt2_l{layers}{'_ext' if external else ''}.onnx"
    if path.exists() and (not external or path.with_name(path.name + ".data").exists()):
        return path
    cmd = [sys.executable, str(HERE / "gpt2_graph.py"), "--layers", str(layers), "--vocab", "0"]
    cmd += ["-o", str(path)] + (["--external-data"] if external else [])
    print(f"generating {name}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True)
    return path


def _weight_bytes(path: Path) -> int:
    """Bytes of the model's initializers (the model file's, embedded or external)."""
    ext = path.with_name(path.name + ".data")
    return ext.stat().st_size if ext.exists() else path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["small", "large"])
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "flowc-lean")
    ap.add_argument("--keep", action="store_true", help="keep the generated models")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement (the fastest)")
    ap.add_argument("--label", default="", help="a note for the results' heading")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--child", nargs=3, metavar=("KIND", "MODEL", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _child(*a.child)
        return 0
    a.cache.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# bench/lean_compile.py {a.label}".rstrip(),
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f} at the start (the machine is shared)",
        "# seconds: wall time, the fastest of --repeat runs; cpu: user + system seconds of it",
        "# peak = VmHWM of a fresh process; goal = peak / (1.3 x weights + 300 MB), <= 1 passes",
        f"{'case':<28} {'weights MB':>10} {'peak MB':>8} {'base MB':>8} {'goal':>6} "
        f"{'seconds':>8} {'/ load':>7} {'cpu s':>6} {'/ load':>7}",
    ]
    print("\n".join(lines), flush=True)
    try:
        for name in a.cases:
            spec = CASES[name]
            model = _generate(a.cache, name, int(spec["layers"]), bool(spec["external"]))
            weights = _weight_bytes(model)
            out = a.cache / f"out_{name}"
            shutil.rmtree(out, ignore_errors=True)
            rows = [("compile", _measure("compile", model, out, a.repeat))]
            if spec["external"]:
                rows.append(("onnx.load", _measure("load", model, out, a.repeat)))
            shutil.rmtree(out, ignore_errors=True)
            load_s = dict(rows).get("onnx.load", {}).get("seconds")
            load_cpu = dict(rows).get("onnx.load", {}).get("cpu")
            for kind, r in rows:
                bound = 1.3 * weights + 300 * MB
                is_compile = bool(load_s and load_cpu and kind == "compile")
                ratio = f"{r['seconds'] / load_s:7.2f}" if is_compile and load_s else ""
                cpu_ratio = f"{r['cpu'] / load_cpu:7.2f}" if is_compile and load_cpu else ""
                label = f"{name} L{spec['layers']} {kind}"
                line = (
                    f"{label:<28} {weights / MB:>10.0f} "
                    f"{r['peak'] / MB:>8.0f} {r['base'] / MB:>8.0f} {r['peak'] / bound:>6.2f} "
                    f"{r['seconds']:>8.2f} {ratio:>7} {r['cpu']:>6.2f} {cpu_ratio:>7}"
                ).rstrip()
                lines.append(line)
                print(line, flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(a.cache, ignore_errors=True)
    if not a.no_write:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text("\n".join(lines) + "\n")
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
