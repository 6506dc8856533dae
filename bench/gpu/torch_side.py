"""The PyTorch side of `make gpu-check` / `make gpu-anchors`: PyTorch eager (and
torch.compile) latencies and PyTorch's own error in each precision, on the anchor models
that bench/gpu/anchors_gpu.py defines (its `build`, `Out` and `timed`, from the copy
bench/gpu/prepare.sh put in .gpu/).

Runs under a Python that has torch and transformers (python3 on the GPU machine; a separate
venv for the CPU dry run), in a process of its own so that the flowc side needs neither.

    torch_side.py --anchors .gpu/anchors_gpu.py --cells cells.json --out torch.json
                  [--tiny] [--iters N] [--deadline UNIX_TIME]

cells.json: [{"model", "batch", "precisions": [...], "modes": ["eager", "torch.compile",
"torch.compile reduce-overhead"], "reference": "M_bB.io.npz" or null}, ...]. For each
cell and precision: the median and min latency of each mode (anchors_gpu.timed: CUDA events
on a GPU), and the error of that precision's output against the fp32 reference (flowc's
error measure, flowc/harness/compare.py) where a reference is given. Cells not started by
the deadline are recorded as skipped.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from flowc.harness.compare import max_rel_error  # noqa: E402  (numpy only)


def load_anchors(path: Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("anchors_gpu", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--anchors", type=Path, required=True)
    ap.add_argument("--cells", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--deadline", type=float, default=0.0)
    a = ap.parse_args()
    import torch

    anchors = load_anchors(a.anchors)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtypes = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}
    dtypes["fp16"] = torch.float16
    info = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "torch": torch.__version__,
        "results": [],
    }
    for cell in json.loads(a.cells.read_text()):
        name, batch = cell["model"], int(cell["batch"])
        m, inputs, key = anchors.build(name, batch, a.tiny)
        m.eval()
        names = list(inputs)
        ref = None
        if cell.get("reference"):
            io = np.load(cell["reference"])
            # The exported inputs (the same seed gives the same ones; these are certain).
            inputs = {k: torch.from_numpy(io[f"in:{k}"]) for k in names}
            ref = io[f"out:{key}"]
        wrapped = anchors.Out(m, key, names).eval()
        args = tuple(inputs.values())
        for dt in cell["precisions"]:
            # As anchors_gpu.py: fp32 is exact fp32 (no TF32 in matmuls or convolutions).
            torch.backends.cuda.matmul.allow_tf32 = dt == "tf32"
            torch.backends.cudnn.allow_tf32 = dt == "tf32"
            # A copy per precision: Module.to() casts in place, and weights rounded to bf16
            # must not become the next precision's.
            mm = copy.deepcopy(wrapped).to(dev).to(dtypes[dt])
            dargs = tuple(
                x.to(dev, dtypes[dt]) if x.is_floating_point() else x.to(dev) for x in args
            )
            for mode in cell["modes"]:
                row = {"model": name, "batch": batch, "dtype": dt, "mode": mode}
                if a.deadline and time.time() > a.deadline:
                    row["skipped"] = "the command's time budget ran out"
                    info["results"].append(row)
                    print(f"{name:10} b{batch:<3} {dt:5} {mode:30} skipped (budget)", flush=True)
                    continue
                t0 = time.time()
                f = mm
                if mode != "eager":
                    cm = mode.removeprefix("torch.compile").strip() or None
                    f = torch.compile(mm, mode=cm)
                with torch.no_grad():
                    r = anchors.timed(lambda f=f, d=dargs: f(*d), a.iters, dev)
                    out = f(*dargs)
                row.update(r)
                row["wall_s"] = round(time.time() - t0, 1)
                if ref is not None:
                    got = out.detach().float().cpu().numpy()
                    row["error"] = max_rel_error(got, ref)
                info["results"].append(row)
                err = f"  error {row['error']:.3g}" if "error" in row else ""
                print(
                    f"{name:10} b{batch:<3} {dt:5} {mode:30} median {r['median_ms']:.3f} ms"
                    f"  min {r['min_ms']:.3f} ms{err}",
                    flush=True,
                )
            del mm
        del m, wrapped
        if dev == "cuda":
            torch.cuda.empty_cache()
    a.out.write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
