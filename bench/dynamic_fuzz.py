"""Differential fuzzing of programs with symbolic dims (docs/dynamic.md): random ONNX graphs
of the size-generic ops over x [b, s, 6, 5] (reductions and arg reductions over random axes,
slices with random starts, ends and steps, products of matrices whose sizes change, softmax
over any axis, concatenation, element-wise broadcasting, CumSum, Trilu, Pad, TopK with a k
of run time), each compiled once with --dim b=1..4 --dim s=2..9, built for the host and run at
sizes spread over the range against onnxruntime at each.

    python bench/dynamic_fuzz.py --seeds 1-8 [--keep DIR]

Prints one line per seed (the ops, the outputs that disagreed) and exits 1 when any did;
bench/results/dynamic_fuzz.txt keeps the latest run's lines.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flowc.api import Project  # noqa: E402
from flowc.compiler import compile_graph, load_model  # noqa: E402
from flowc.harness.build import build  # noqa: E402
from flowc.harness.compare import max_rel_error  # noqa: E402
from flowc.harness.ort import run_onnxruntime  # noqa: E402
from flowc.options import ModelArgs  # noqa: E402

DIMS = ("b=1..4", "s=2..9")
SIZES = [(1, 2), (3, 7), (4, 9), (2, 2), (1, 9), (4, 3)]
REDUCTIONS = [
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceL2",
    "ReduceLogSumExp",
    "ReduceProd",
]


class Graph:
    """The nodes, constants and outputs of one random model."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.outputs: list[tuple[str, int]] = []
        self.k = 0

    def name(self, stem: str) -> str:
        self.k += 1
        return f"{stem}{self.k}"

    def const(self, values: object, dtype: type = np.int64) -> str:
        name = self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(values, dtype), name))
        return name

    def node(self, op: str, inputs: list[str], out: bool = True, **attrs: object) -> str:
        y = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [y], **attrs))
        if out:
            self.outputs.append(
                (y, TensorProto.INT64 if op.startswith("Arg") else TensorProto.FLOAT)
            )
        return y


def random_model(seed: int, path: Path) -> list[str]:
    rng = np.random.default_rng(seed)
    g = Graph()
    for _ in range(6):
        axes = sorted(rng.choice(4, size=int(rng.integers(1, 5)), replace=False).tolist())
        op = str(rng.choice(REDUCTIONS))
        g.node(op, ["x", g.const(axes)], keepdims=int(rng.integers(0, 2)))
    for axis in rng.choice(4, size=2, replace=False).tolist():
        op = str(rng.choice(["ArgMax", "ArgMin"]))
        g.node(op, ["x"], axis=int(axis), keepdims=int(rng.integers(0, 2)))
    for _ in range(5):
        axes = sorted(rng.choice(4, size=int(rng.integers(1, 4)), replace=False).tolist())
        starts, ends, steps = [], [], []
        for a in axes:
            step = int(rng.choice([1, 1, 2, -1])) if a >= 2 else int(rng.choice([1, -1]))
            if step > 0:
                starts.append(int(rng.choice([0, 1, -1, -2]) if a >= 2 else rng.choice([0, -1])))
                ends.append(1 << 40 if a < 2 else int(rng.choice([1 << 40, -1, 3])))
            else:
                starts.append(int(rng.choice([-1, 1 << 40])))
                ends.append(-(1 << 40))
            steps.append(step)
        g.node("Slice", ["x", g.const(starts), g.const(ends), g.const(axes), g.const(steps)])
    xs = g.node("Transpose", ["x"], out=False, perm=[0, 2, 1, 3])  # [b, 6, s, 5]
    xt = g.node("Transpose", ["x"], out=False, perm=[0, 2, 3, 1])  # [b, 6, 5, s]
    scores = g.node("MatMul", [xs, xt])  # [b, 6, s, s]
    probs = g.node("Softmax", [scores], axis=-1)
    g.node("MatMul", [probs, xs])  # contracts over s
    mean = g.node("ReduceMean", [xs, g.const([0])], out=False, keepdims=1)  # [1, 6, s, 5]
    g.node("MatMul", [mean, xt])  # A broadcast along b
    g.node("Concat", ["x", g.node("Relu", ["x"], out=False)], axis=int(rng.integers(0, 4)))
    g.node(
        str(rng.choice(["Softmax", "LogSoftmax", "Hardmax"])), ["x"], axis=int(rng.integers(0, 4))
    )
    pads = [int(v) for v in rng.integers(-1, 3, 8)]
    pads[0], pads[4] = max(pads[0], 0), max(pads[4], 0)  # (a negative pad empties a batch of 1)
    pads[1], pads[5] = max(pads[1], 0), max(pads[5], 0)  # ... or a sequence of 2
    fill = g.const(np.float32(rng.standard_normal()), np.float32)
    g.node("Pad", ["x", g.const(pads), fill])
    edges = [int(v) for v in rng.integers(0, 3, 4)]
    fixed = [0, 0, *edges[:2], 0, 0, *edges[2:]]  # reflect, edge and wrap: fixed axes only
    g.node("Pad", ["x", g.const(fixed)], mode=str(rng.choice(["reflect", "edge", "wrap"])))
    for _ in range(2):
        axis = int(rng.integers(0, 4))
        rev, excl = (int(v) for v in rng.integers(0, 2, 2))
        g.node("CumSum", ["x", g.const(axis)], reverse=rev, exclusive=excl)
    g.node("Trilu", [scores, g.const([int(rng.integers(-2, 3))])], upper=int(rng.integers(0, 2)))
    peak = g.node("ReduceMax", ["x", g.const([1])], out=False, keepdims=1)  # [b, 1, 6, 5]
    g.node("Sub", ["x", peak])  # broadcast along s
    top = g.name("top")
    g.nodes.append(
        helper.make_node("TopK", ["x", "k"], [top, g.name("idx")], axis=int(rng.integers(2, 4)))
    )
    g.outputs.append((top, TensorProto.FLOAT))
    vi = helper.make_tensor_value_info
    inputs = [vi("x", TensorProto.FLOAT, ["b", "s", 6, 5]), vi("k", TensorProto.INT64, [1])]
    model = helper.make_graph(
        g.nodes, f"fuzz{seed}", inputs, [vi(n, t, None) for n, t in g.outputs], g.inits
    )
    m = helper.make_model(model, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return sorted({n.op_type for n in g.nodes})


def check(seed: int, work: Path) -> tuple[list[str], list[str]]:
    model = work / f"fuzz{seed}.onnx"
    ops = random_model(seed, model)
    out = work / f"fuzz{seed}"
    compile_graph(load_model(ModelArgs(path=model, dims=DIMS)), out)
    build(out, "host", quick=True)
    proto = onnx.load(str(model))
    rng = np.random.default_rng(seed)
    bad: list[str] = []
    with Project(out).load("host") as m:
        for b, s in SIZES:
            feeds = {
                "x": rng.standard_normal((b, s, 6, 5)).astype(np.float32),
                "k": np.array([int(rng.integers(0, 5))], np.int64),
            }
            ref, got = run_onnxruntime(proto, feeds), m.run(feeds)
            for name, want in ref.items():
                have = got[name]
                same = have.shape == want.shape and (
                    want.size == 0
                    or max_rel_error(have.astype(np.float64), want.astype(np.float64)) <= 1e-4
                )
                if not same:
                    bad.append(f"{name} at b={b}, s={s}: {have.shape} vs {want.shape}")
    return ops, bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1-4", help="a range A-B or a list 1,5,9")
    ap.add_argument("--keep", type=Path, default=None, help="keep the models and projects here")
    a = ap.parse_args()
    if "-" in a.seeds:
        lo, hi = (int(v) for v in a.seeds.split("-"))
        seeds = list(range(lo, hi + 1))
    else:
        seeds = [int(v) for v in a.seeds.split(",")]
    lines = [f"dynamic fuzz: dims {' '.join(DIMS)}, sizes {SIZES}, against onnxruntime"]
    print(lines[0], flush=True)
    failed = 0
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="flowc-dynfuzz-") as tmp:
        work = a.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for seed in seeds:
            try:
                ops, bad = check(seed, work)
            except Exception as e:  # a compile or run failure is a finding
                ops, bad = [], [f"{type(e).__name__}: {str(e).strip()[-300:]}"]
            failed += bool(bad)
            line = f"seed {seed}: " + ("ok" if not bad else "DIFFERS: " + "; ".join(bad[:4]))
            if ops:
                line += f" ({len(ops)} op types)"
            print(line, flush=True)
            lines.append(line)
    lines.append(f"{len(seeds) - failed} of {len(seeds)} seeds agree ({time.time() - t0:.0f} s)")
    print(lines[-1])
    (ROOT / "bench" / "results" / "dynamic_fuzz.txt").write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
