"""Training on a mesh (issue 30): per plan, on the host target under mpirun, the host's
steps per second, the bytes each rank sends per step (the plan's count beside what the ranks
logged, FLOWC_COMM_LOG), the modeled step time under the H200 profile with its compute /
communication split, each rank's parameter and optimizer-state bytes beside ZeRO's count,
the arena, and the worst difference from the one-device run's state after the steps.

    python bench/train_mesh.py [--steps 20] [--out bench/results/train_mesh.txt]

Figures, not pass/fail: tests/test_distributed_training.py holds the checks. Host times on a
2-core machine running 2 or 4 ranks are oversubscribed: they show the program runs, not how
fast a mesh is.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from flowc.compiler import (  # noqa: E402
    bucket_gradients,
    compile_graph,
    load_training,
    parallelize,
)
from flowc.harness.build import build, launcher  # noqa: E402
from flowc.options import ModelArgs  # noqa: E402
from flowc.parallel import ParallelOptions, parse_mesh, parse_sbp  # noqa: E402
from flowc.trainer import mesh_spec, spec_from  # noqa: E402
from flowc.training.zero import rank_state_bytes, zero_formula, zero_layouts  # noqa: E402

MLP = ROOT / "tests" / "data" / "models" / "mlp.onnx"
LOSS = "cross_entropy:/m/m.2/Gemm_output_0,labels"
# name, mesh, --parallel, --zero, --sbp, --mem-limit
PLANS = [
    ("one device", "1", "none", 0, [], None),
    ("data 2", "2", "data", 0, [], None),
    ("data 4", "4", "data", 0, [], None),
    ("zero-1 on 4", "4", "data", 1, [], None),
    ("zero-2 on 4", "4", "data", 2, [], None),
    ("zero-3 on 4", "4", "data", 3, [], None),
    ("tensor 2 (--sbp)", "2", "auto", 0, ["m.0.weight=S0", "m.0.bias=S0", "m.2.weight=S1"], None),
    ("data x tensor 2x2", "2x2", "auto", 0,
     ["m.0.weight=B,S0", "m.0.bias=B,S0", "m.2.weight=B,S1", "x=S0,B", "labels=S0,B"], None),
    ("auto 2, 300 KB", "2", "auto", 0, [], 300_000),
]  # fmt: skip
NOTE = (
    "# host steps/s: 2 and 4 ranks share this machine's 2 cores (4 ranks oversubscribed, each "
    "spinning in MPI while it waits): they show the programs run, not a mesh's speed. sent "
    "B/rank/step: the plan's boxing (2(p-1)/p T per all-reduce, ...) and the same formula over "
    "what rank 0 logged (FLOWC_COMM_LOG); calls: collective calls per step (a bucket of "
    "gradients is one). ZeRO count: its paper's bytes of parameters, gradients (kept) and "
    "moments for the whole model at that stage; flowc keeps parameters + moments (the columns "
    "before) and the gradients only in the arena. m.2 (10 rows) does not split by 4 and stays "
    "whole under ZeRO. auto 2, 300 KB: the search placing the state under --mem-limit."
)
SENT = {  # bytes a rank sends for a logged payload of T bytes over p ranks
    "all-reduce": lambda t, p: 2 * (p - 1) * t // p,
    "all-gather": lambda t, p: (p - 1) * t,
    "reduce-scatter": lambda t, p: (p - 1) * t // p,
    "all-to-all": lambda t, p: (p - 1) * t // p,
}


def _logged_sent(prefix: Path, mesh: tuple[int, ...], steps: int) -> float:
    total = 0
    for line in Path(f"{prefix}.rank0").read_text().splitlines():
        m = re.fullmatch(r"([a-z-]+) axis=(\d+) bytes=(\d+) dtype=\d+", line)
        if m and m.group(1) in SENT:
            total += SENT[m.group(1)](int(m.group(3)), mesh[int(m.group(2))])
    return total / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "train_mesh.txt")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    t_start = time.time()
    spec = spec_from(LOSS, "adamw:lr=0.01")
    lines = [
        f"# bench/train_mesh.py ({time.strftime('%Y-%m-%d')}): MLP 64-256-10, batch 8, "
        f"AdamW, {args.steps} steps, host target (2 cores)",
        "  plan                 sent B/rank/step   modeled us (compute + comm)   "
        "(logged, collective calls per step)  params B  moments B  arena B  ZeRO count B  "
        "host steps/s  worst diff",
    ]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        rng = np.random.default_rng(3)
        x = rng.standard_normal((40, 64)).astype(np.float32)
        labels = (x @ rng.standard_normal((64, 10))).argmax(1).astype(np.int64)
        np.save(tmp / "x.npy", x)
        np.save(tmp / "labels.npy", labels)
        base: np.ndarray | None = None
        for name, mesh_text, method, zero, sbps, limit in PLANS:
            mesh = parse_mesh(mesh_text)
            step = load_training(ModelArgs(MLP), mesh_spec(spec, mesh.size), batch=8)
            out = tmp / re.sub(r"\W+", "_", name)
            planned = ""
            params = moments = arena = formula = 0
            if mesh.size > 1:
                fixed = dict(parse_sbp(t, mesh) for t in sbps)
                if zero:
                    fixed = {**zero_layouts(step, mesh, zero)[0], **fixed}
                opts = ParallelOptions(mesh, method, fixed, streams=1, mem_limit=limit)
                placed = parallelize(step.graph, opts)
                # As compile_step: the gradients' all-reduces bucketed before scheduling.
                bucket_gradients(placed.physical.graph, streams=1, schedule_for="memory")
                compile_graph(
                    placed.physical.graph, out, physical=placed.physical, schedule_for="memory"
                )
                sent = sum(st.bytes_per_rank for _, _, st in placed.physical.boxing)
                c = placed.cost
                planned = (
                    f"{sent:>8,}  {1e6 * c.total_s:8.1f} ({1e6 * c.compute_s:.1f} + "
                    f"{1e6 * c.comm_s:.1f})"
                )
                params, moments = rank_state_bytes(placed.physical.graph, step)
                whole = rank_state_bytes(step.graph, step)
                formula = zero_formula(*whole, mesh.size, zero)
                arena = placed.memory.arena
            else:
                compile_graph(step.graph, out, schedule_for="memory")
                params, moments = rank_state_bytes(step.graph, step)
                formula = zero_formula(params, moments, 1, 0)
            bdir = build(out, "host", quick=True)
            cmd, env = launcher(mesh.size, "host")
            log = tmp / f"{out.name}.comm"
            t0 = time.perf_counter()
            r = subprocess.run(
                [*cmd, str(bdir / "model_main"), "train", "--weights", str(out / "weights.bin"),
                 "--data", f"x={tmp / 'x.npy'}", "--data", f"labels={tmp / 'labels.npy'}",
                 "--steps", str(args.steps), "--batch", "8", "--save", str(out / "s.bin")],
                env={**os.environ, **env, "FLOWC_COMM_LOG": str(log)},
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            rate = re.findall(r"([\d.]+) examples/s", r.stderr)
            steps_s = float(rate[-1]) / 8 if rate else args.steps / (time.perf_counter() - t0)
            state = np.frombuffer((out / "s.bin").read_bytes(), np.uint8)
            if base is None:
                base = state
            diff = _state_diff(base, state)
            logged = _logged_sent(log, mesh.shape, args.steps) if mesh.size > 1 else 0.0
            calls = (
                len(Path(f"{log}.rank0").read_text().splitlines()) / args.steps
                if mesh.size > 1
                else 0.0
            )
            lines.append(
                f"  {name:<20} {planned or '-':<44} logged {logged:>8,.0f} ({calls:.0f} calls)  "
                f"{params:>8,} {moments:>9,} {arena:>8,} {formula:>12,}  {steps_s:10.1f}  {diff:.1e}"
            )
            print(lines[-1], flush=True)
    lines.append(f"# {time.time() - t_start:.0f} s")
    lines.append(NOTE)
    args.out.write_text("\n".join(lines) + "\n")


def _state_diff(a: np.ndarray, b: np.ndarray) -> float:
    """The largest difference between two checkpoints' float32 words past the header (the
    same layout: whole tensors, whatever the mesh)."""
    n = min(a.size, b.size) // 4 * 4
    fa = np.frombuffer(a[256:n].tobytes(), np.float32).astype(np.float64)
    fb = np.frombuffer(b[256:n].tobytes(), np.float32).astype(np.float64)
    ok = np.isfinite(fa) & np.isfinite(fb) & (np.abs(fa) < 1e6)
    return float(np.abs(fa[ok] - fb[ok]).max()) if ok.any() else float("nan")


if __name__ == "__main__":
    main()
