"""The arena each target allocates, per model: the program as `flowc compile` makes it (fp32,
the default schedule), its memory plan's arena on the cuda target (values and each
library-calling stream's cuBLASLt/cuDNN workspace) and on the host target (the values alone:
the host's library calls need no workspace), with the workspaces' sizes.

Run on two trees to compare them (an older tree has no per-target split: its host arena is its
arena):

    .venv/bin/python bench/arena_by_target.py [--label after] [-o bench/results/arena_by_target.txt]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import warnings
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowc.compiler import plan_schedule, schedule_graph  # noqa: E402
from flowc.frontend.onnx import ImportOptions, import_onnx  # noqa: E402
from flowc.passes.manager import PassManager, compile_pipeline  # noqa: E402

SHARED = ROOT / "tests" / "data" / "models"
LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / "light_resnet50.onnx"
MODELS = ["mlp", "bert_tiny", "gpt2_tiny", "resnet_tiny", "vit_tiny"]


def kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.2f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="")
    ap.add_argument("-o", "--output", type=Path, default=None)
    a = ap.parse_args(argv)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    lines = [f"# arena by target ({a.label or 'this tree'}, commit {commit}), bytes"]
    lines.append(f"{'model':16} {'cuda arena':>12} {'host arena':>12}  workspaces (stream: bytes)")
    paths = [(n, SHARED / f"{n}.onnx") for n in MODELS] + [("light_resnet50", LIGHT)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, path in paths:
            dims = {"batch": 2, "seq": 32} if name == "bert_tiny" else {}
            graph = PassManager(compile_pipeline("fp32")).run(
                import_onnx(path, ImportOptions(dims=dims))
            )
            plan = plan_schedule(schedule_graph(graph))
            host = getattr(plan, "host_arena_bytes", plan.arena_bytes)
            if hasattr(plan, "workspace_size"):
                ws = {s: plan.workspace_size(s) for s in sorted(plan.workspaces)}
            else:
                ws = {s: plan.workspace_bytes for s in sorted(plan.workspaces)}
            spaces = ", ".join(f"{s}: {kib(b)}" for s, b in ws.items()) or "none"
            lines.append(f"{name:16} {plan.arena_bytes:12} {host:12}  {spaces}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if a.output is not None:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        with a.output.open("a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
