"""Pipelined programs on host ranks (one MPI rank per device): outputs against onnxruntime,
and each rank's log of transfers and collectives against the plan."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_parallel_models import check_outputs, logical, reference

from flowc.compiler import CompiledPipeline, PipelineSpec, compile_pipeline
from flowc.harness.build import build, run
from flowc.ir.types import Mesh
from flowc.ops.comm import COLLECTIVES
from flowc.parallel import ParallelOptions
from flowc.passes.manager import PassManager
from flowc.toolchain import find_cuda

pytestmark = pytest.mark.skipif(
    shutil.which("mpirun") is None and os.environ.get("CI") != "true",
    reason="needs Open MPI (mpirun) to start several ranks",
)

COLLECTIVE_NAMES = {
    "AllReduce": "all-reduce",
    "AllGather": "all-gather",
    "ReduceScatter": "reduce-scatter",
    "AllToAll": "all-to-all",
}


def compiled(
    name: str, out: Path, mesh: tuple[int, ...], stages: int, micro: int, batch: int = 2
) -> CompiledPipeline:
    g = PassManager(("lower_ops", "widen_types", "fuse_elementwise")).run(logical(name, batch))
    m = Mesh("gpus", mesh)
    sub = Mesh("stage", mesh[1:]) if len(mesh) > 1 and mesh[1] > 1 else None
    spec = PipelineSpec(
        stages, m, microbatches=micro, stage_options=ParallelOptions(sub) if sub else None
    )
    return compile_pipeline(g, out, spec, prefix=name)


def planned_log(c: CompiledPipeline, rank: int) -> list[str]:
    """What rank ``rank`` must log: its stage's communication in the order of its
    communication stream (the stage's program holds every micro-batch)."""
    k = c.pipeline.ranks_per_stage
    stage = rank // k
    sched = c.schedules[stage]
    lines: list[str] = []
    comm = sched.streams[-1] if sched.num_streams > sched.num_compute else []
    for a in comm:
        node = sched.actors.actors[a].node
        if node.op in COLLECTIVES:
            x = node.inputs[0]
            assert x is not None
            lines.append(
                f"{COLLECTIVE_NAMES[node.op]} axis={node.attrs['mesh_axis']} "
                f"bytes={x.type.nbytes} dtype={x.type.dtype.onnx}"
            )
        elif node.op in ("Send", "Recv"):
            peer = rank + int(node.attrs["peer"])
            values = node.inputs if node.op == "Send" else node.outputs
            for v in values:
                assert v is not None
                lines.append(
                    f"{node.op.lower()} peer={peer} bytes={v.type.nbytes} dtype={v.type.dtype.onnx}"
                )
    return lines


def build_and_check(
    name: str, out: Path, mesh: tuple[int, ...], stages: int, micro: int, batch: int = 2
) -> CompiledPipeline:
    c = compiled(name, out, mesh, stages, micro, batch)
    build(out, "host", quick=True)
    assert "warning" not in (out / "build-host" / "flowc-build.log").read_text().lower()
    feeds, ref = reference(name, batch)
    got, _ = run(out, feeds, target="host", env={"FLOWC_COMM_LOG": str(out / "comm")})
    names = [o.name for o in logical(name, batch).outputs]
    check_outputs(name, [got[n] for n in names], ref, batch)
    sends = 0
    for r in range(Mesh("m", mesh).size):
        lines = (out / f"comm.rank{r}").read_text().splitlines()
        assert lines == planned_log(c, r), f"rank {r} communicated other than planned"
        sends += sum(line.startswith("send") for line in lines)
    assert sends >= micro * (stages - 1), "every cut carries something per micro-batch"
    if micro > 1:
        check_stages_overlap(c, out, feeds)
    return c


def check_stages_overlap(c: CompiledPipeline, out: Path, feeds: dict[str, np.ndarray]) -> None:
    """FLOWC_TRACE: stage 0 works on micro-batch 1 while stage 1 works on micro-batch 0.

    The two ranks' clocks start at their own run's start, so they are aligned at the one
    moment both see: the end of micro-batch 0's transfer over the cut (the send and the
    receive of one exchange complete together)."""
    trace = out / "trace.jsonl"
    run(out, feeds, target="host", env={"FLOWC_TRACE": str(trace)})
    k = c.pipeline.ranks_per_stage

    def spans(stage: int) -> dict[tuple[int, str], tuple[float, float]]:
        actors = c.schedules[stage].actors.actors
        lines = (out / f"trace.rank{stage * k}.jsonl").read_text().splitlines()
        got: dict[tuple[int, str], tuple[float, float]] = {}
        for rec in map(json.loads, lines):
            a = actors[int(rec["actor"])]
            mb = a.microbatch
            kind = "compute" if a.kind in ("node", "copy", "collective") else a.kind
            lo, hi = got.get((mb, kind), (math.inf, -math.inf))
            got[(mb, kind)] = (min(lo, rec["start_us"]), max(hi, rec["end_us"]))
        return got

    first, second = spans(0), spans(1)
    shift = first[(0, "send")][1] - second[(0, "recv")][1]
    ahead = first[(1, "compute")]
    behind = tuple(t + shift for t in second[(0, "compute")])
    assert ahead[0] < behind[1] and behind[0] < ahead[1], (
        f"stage 0 on micro-batch 1 {ahead} does not overlap stage 1 on micro-batch 0 {behind}"
    )


@pytest.mark.parametrize(
    ("name", "mesh", "stages", "micro", "batch"),
    [
        ("mlp", (2,), 2, 2, 2),
        ("bert_tiny", (2,), 2, 2, 4),
        ("resnet_tiny", (4,), 4, 1, 2),
        ("mlp", (2, 2), 2, 1, 2),
    ],
)
def test_pipelined_program_matches_onnxruntime(
    name: str, mesh: tuple[int, ...], stages: int, micro: int, batch: int, tmp_path: Path
) -> None:
    c = build_and_check(name, tmp_path / "out", mesh, stages, micro, batch)
    # Every stage has work, and values cross every cut.
    assert all(s.graph.nodes for s in c.pipeline.stages)
    assert all(s.send for s in c.pipeline.stages[:-1])


@pytest.mark.skipif(
    find_cuda() is None and os.environ.get("CI") != "true",
    reason="needs the CUDA toolkit (nvcc); CI has it, so there it fails instead",
)
def test_cuda_build_of_a_pipeline_compiles_and_links(tmp_path: Path) -> None:
    out = tmp_path / "out"
    compiled("mlp", out, (2,), 2, 2)
    build(out, "cuda", quick=True)
    assert "warning" not in (out / "build-cuda" / "flowc-build.log").read_text().lower()


def test_microbatch_slices_off_16_bytes_keep_the_gemm_alignment_honest(tmp_path: Path) -> None:
    """Rows of 3 and 5 floats: micro-batch m's slice of x starts 12 m bytes into the caller's
    buffer, and of y 20 m bytes. The GEMMs reading x and writing y must declare the alignment
    those slices have to cuBLASLt, which the emulator checks at each call."""
    from onnx import TensorProto, helper, numpy_helper

    from flowc import cli

    rng = np.random.default_rng(3)
    w1 = rng.standard_normal((3, 8)).astype(np.float32)
    w2 = rng.standard_normal((8, 5)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="up"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("MatMul", ["r", "w2"], ["y"], name="down"),
        ],
        "narrow_rows",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 5])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = tmp_path / "narrow_rows.onnx"
    model.write_bytes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    )
    out = tmp_path / "out"
    cli.main(
        [
            "compile",
            str(model),
            "-o",
            str(out),
            "--target",
            "host",
            "--pipeline",
            "2",
            "--microbatches",
            "4",
        ]
    )
    text = (out / "model.cu").read_text()
    assert "kInputStride[] = {12ULL }" in text and "kOutputStride[] = {20ULL }" in text
    build(out, "host", quick=True)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    got, _ = run(out, {"x": x}, target="host")
    want = np.maximum(x @ w1, 0) @ w2
    assert np.allclose(got["y"], want, rtol=1e-5, atol=1e-5)
