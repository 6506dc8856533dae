"""Kernels take their sizes as arguments, so a model gets one kernel per op kind, type and
vector width, not one per shape: DenseNet-121 (the onnx package's light model), whose 65
BatchNormalizations and 65 scale-and-ReLU chains once became 65 kernels each, compiles to a
handful. Only the generated source is read (no build)."""

from __future__ import annotations

import collections
import re
import warnings
from pathlib import Path

import onnx
from test_models import LIGHT_DIR

from flowc.compiler import compile_graph
from flowc.frontend.onnx import import_model
from flowc.passes.manager import COMPILE_PIPELINE, PassManager


def test_densenet_gets_one_kernel_per_kind(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = import_model(onnx.load(str(LIGHT_DIR / "light_densenet121.onnx")))
    graph = PassManager(COMPILE_PIPELINE).run(graph)
    ops = graph.op_counts()
    assert ops.get("BatchNormalization", 0) >= 60, ops
    assert ops.get("FusedElementwise", 0) >= 60, ops
    compile_graph(graph, tmp_path / "out", prefix="densenet")
    source = (tmp_path / "out" / "model.cu").read_text()
    kinds = collections.Counter(re.findall(r"static __global__ void k\d+_(\w+)\(", source))
    launches = collections.Counter(re.findall(r"FLOWC_LAUNCH\(k\d+_(\w+),", source))
    # Planes of a multiple of 4 elements and the others (7 x 7): two BatchNorm kernels.
    assert launches["batch_norm"] >= 60 and kinds["batch_norm"] <= 2, kinds
    # The BatchNorm scale chains (Mul, Add, Relu per channel) at every resolution: one kernel
    # per vector width at most.
    assert launches["fused"] >= 60 and kinds["fused"] <= 2, kinds
