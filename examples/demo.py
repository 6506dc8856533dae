"""`make demo`: import a bundled model and print its summary; evaluate it with flowc's NumPy
reference and compare with onnxruntime; then compile it to a standalone C++ program, build
it for the host target (the SIMT emulator), run it and print the verification table; last,
train an MLP on the handwritten digits with `flowc train` and print its held-out accuracy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from flowc.harness.compare import compare
from flowc.harness.ort import run_onnxruntime

# Two devices with less memory each than the bundled model needs whole (parameters, arena,
# library workspaces): the search splits the parameters, and the program runs as two MPI
# ranks on the host target. tests/test_cli.py checks that this limit still splits.
MESH_LIMIT = ["--mesh", "2", "--mem-limit", "230KB"]


def main(model: Path) -> int:
    console = Console(highlight=False)
    flowc = [sys.executable, "-m", "flowc"]
    work = Path("demo_out")
    work.mkdir(exist_ok=True)

    console.rule(f"flowc inspect {model}")
    subprocess.run([*flowc, "inspect", str(model)], check=True)

    io_file = model.with_name(model.stem + ".io.npz")
    args = []
    feeds = {}
    if io_file.exists():
        io = np.load(io_file)
        for key in io.files:
            if key.startswith("in:"):
                name = key[3:]
                path = work / f"{name}.npy"
                np.save(path, io[key])
                feeds[name] = io[key]
                args += ["--input", f"{name}={path}"]
    out = work / "outputs.npz"
    console.rule(f"flowc eval {model}")
    cmd = [*flowc, "eval", str(model), *args, "-o", str(out)]
    if not feeds:
        cmd.append("--random-inputs")
    subprocess.run(cmd, check=True)

    console.rule("flowc vs onnxruntime")
    got = np.load(out)
    if not feeds:
        raise SystemExit("the demo model needs an .io.npz with its inputs beside it")
    ref = run_onnxruntime(str(model), feeds)
    table = Table(show_edge=False)
    for col in ("output", "shape", "error", "result"):
        table.add_column(col)
    ok = True
    for name, r in ref.items():
        c = compare(name, got[name], r, tol=1e-4)
        ok &= c.ok
        table.add_row(
            name, str(list(c.shape)), f"{c.error:.2e}", "PASS" if c.ok else f"FAIL {c.reason}"
        )
    console.print(table)
    console.print("error = max|flowc - onnxruntime| / max|onnxruntime|, must be <= 1e-4")

    console.rule(f"flowc verify {model} --target host (compile, build, run)")
    project = work / "project"
    verify = subprocess.run(
        [*flowc, "verify", str(model), "--target", "host", *args, "-o", str(project)]
    )
    console.print(
        f"the generated project is in {project}/ (model.cu, model.h, main.cu, weights.bin, CMakeLists.txt)"
    )

    limit = MESH_LIMIT
    console.rule(f"flowc inspect {model} {' '.join(limit)} (the parallel plan)")
    subprocess.run([*flowc, "inspect", str(model), *limit], check=True)
    console.rule(f"flowc verify {model} {' '.join(limit)} --target host (2 MPI ranks)")
    parallel = subprocess.run(
        [*flowc, "verify", str(model), *limit, "--target", "host", *args, "-o", str(work / "mesh2")]
    )
    console.rule("flowc train: an MLP learns the handwritten digits (examples/digits.py)")
    digits = work / "digits"
    here = Path(__file__).resolve().parent
    subprocess.run([sys.executable, str(here / "digits.py"), "prepare", str(digits)], check=True)
    trained = subprocess.run(
        [*flowc, "train", str(digits / "digits_mlp.onnx"),
         "--loss", "cross_entropy:logits,labels",
         "--optimizer", "adamw:lr=0.01,weight_decay=0.0001",
         "--data", str(digits / "digits_train.npz"), "--steps", "300", "--batch", "64",
         "--export", str(digits / "digits_mlp_trained.onnx"), "--target", "host"]
    )  # fmt: skip
    if trained.returncode == 0:
        trained = subprocess.run([sys.executable, str(here / "digits.py"), "evaluate", str(digits)])
    ok = ok and trained.returncode == 0
    return 0 if ok and verify.returncode == 0 and parallel.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/models/resnet_tiny.onnx")))
