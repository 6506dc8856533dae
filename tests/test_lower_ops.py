"""lower_ops: ops that compile through their import adapter (LSTM, Einsum, DFT, Compress, ...)
compile from a DSL program too, where no ONNX import ran: compiled on the host, they give
what flowc's NumPy reference gives for the same program."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from flowc.compiler import compile_graph
from flowc.frontend.dsl import parse_program
from flowc.harness.build import build, run
from flowc.interpreter import evaluate
from flowc.passes.manager import COMPILE_PIPELINE, PassManager

PROGRAM = """
graph lowered(x: f32[5, 2, 3], a: f32[4, 6], b: f32[6, 3], s: f32[2, 8]) -> (y: f32[5, 1, 2, 4], yh: f32[1, 2, 4], e: f32[4, 3], d: f32[2, 5, 2], c: f32[4, 2]) {
    param w: f32[1, 16, 3] = normal(0.0, 0.3)
    param r: f32[1, 16, 4] = normal(0.0, 0.3)
    y, yh = lstm(x, w, r, hidden_size=4)
    e = einsum(a, b, equation="ij,jk->ik")
    d = dft(unsqueeze(s, [2]), _, 1, onesided=1)
    const keep: bool[6] = [true, false, true, false, false, false]
    c = compress(a, keep, axis=1)
    return y, yh, e, d, c
}
"""


def test_import_lowered_ops_compile_from_the_dsl(tmp_path: Path) -> None:
    graph = parse_program(PROGRAM)
    rng = np.random.default_rng(4)
    feeds = {v.name: rng.standard_normal(v.type.shape).astype(np.float32) for v in graph.inputs}
    want = evaluate(graph, feeds)
    compiled = PassManager(COMPILE_PIPELINE).run(parse_program(PROGRAM))
    ops = compiled.op_counts()
    for op in ("LSTM", "Einsum", "DFT", "Compress"):
        assert op not in ops, ops
    compile_graph(compiled, tmp_path / "out", poison=True)
    build(tmp_path / "out", "host", quick=True)
    got, _ = run(tmp_path / "out", feeds, target="host")
    assert set(got) == set(want)
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=1e-5, err_msg=name)
