"""Multi-rank programs on the host target: built with g++ against the emulator and MPI, run
under mpirun (one process per rank), compared with onnxruntime; each rank's weights file
holds exactly its planned shards, and the collectives each rank ran (FLOWC_COMM_LOG) are the
ones in the plan, in order."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import require_cuda_build_toolchain
from test_parallel_models import check_outputs, logical, reference, tensor_parallel

from flowc.codegen.program import layout_weights
from flowc.codegen.project import weights_file_name
from flowc.compiler import compile_graph, parallelize, schedule_graph
from flowc.harness.build import build, run
from flowc.ir.layout import all_coords, local_type, rank_of
from flowc.ir.types import Mesh
from flowc.ops.comm import COLLECTIVES
from flowc.parallel import Parallelized, ParallelOptions

COLLECTIVE_NAMES = {
    "AllReduce": "all-reduce",
    "AllGather": "all-gather",
    "ReduceScatter": "reduce-scatter",
    "AllToAll": "all-to-all",
}

pytestmark = pytest.mark.skipif(
    shutil.which("mpirun") is None and os.environ.get("CI") != "true",
    reason="needs Open MPI (mpirun) to start several ranks",
)


def planned_log(result: Parallelized) -> list[str]:
    """The log lines every rank must write: the collectives in the program's order."""
    sched = schedule_graph(result.physical.graph)
    steps = [sched.actors.actors[a].node for a in sched.issue]
    lines = []
    for node in steps:
        if node.op in COLLECTIVES:
            x = node.inputs[0]
            assert x is not None
            lines.append(
                f"{COLLECTIVE_NAMES[node.op]} axis={node.attrs['mesh_axis']} "
                f"bytes={x.type.nbytes} dtype={x.type.dtype.onnx}"
            )
    return lines


def build_and_run(
    name: str, result: Parallelized, out: Path, orders: tuple[str, ...] = (), poison: bool = False
) -> None:
    compile_graph(result.physical.graph, out, prefix=name, physical=result.physical, poison=poison)
    build(out, "host", quick=True)
    assert "warning" not in (out / "build-host" / "flowc-build.log").read_text().lower()
    feeds, ref = reference(name)
    log = out / "comm"
    got, _ = run(out, feeds, target="host", env={"FLOWC_COMM_LOG": str(log)})
    names = [o.name for o in logical(name).outputs]
    check_outputs(name, [got[n] for n in names], ref)
    # The emulator can run streams, blocks and threads in other orders: a missing event
    # between the compute and communication streams, or a buffer reused while the other
    # stream still reads it (poisoned with NaN once dead), changes the result.
    for order in orders:
        again, _ = run(out, feeds, target="host", env={"FLOWC_SIM_ORDER": order})
        check_outputs(name, [again[n] for n in names], ref)

    mesh = result.plan.mesh
    want = planned_log(result)
    assert any(want), f"{name}: the plan has no collectives to check"
    for c in all_coords(mesh):
        r = rank_of(mesh, c)
        lines = (out / f"comm.rank{r}").read_text().splitlines()
        assert lines == want, f"rank {r} ran other collectives than planned"

    # Each rank's weights: the planned shard of every constant, at the planned offset.
    layout = layout_weights(result.physical.graph)
    header = 64
    for c in all_coords(mesh):
        r = rank_of(mesh, c)
        data = (out / weights_file_name(r, mesh.size)).read_bytes()[header:]
        assert len(data) == layout.stored_bytes
        for v, off in layout.offsets.items():
            if v.const is None or off >= layout.stored_bytes:
                continue
            expect = result.physical.constant_for(v, c)
            piece = np.frombuffer(data, dtype=expect.dtype, count=expect.size, offset=off)
            assert np.array_equal(piece.reshape(expect.shape), expect), f"{v.name} on rank {r}"
    # Every MatMul/Gemm runs on the planned local shapes.
    for node, pnode in zip(matmuls(logical(name)), matmuls(result.physical.graph), strict=True):
        s = result.plan.node_strategy[node]
        for i, v in enumerate(node.inputs):
            pv = pnode.inputs[i]
            sbp = s.input(i)
            if v is not None and pv is not None and sbp is not None:
                assert pv.type == local_type(v.type, sbp, mesh), f"{node.name} input {i}"


def matmuls(graph):  # type: ignore[no-untyped-def]
    return [n for n in graph.nodes if n.op in ("MatMul", "Gemm")]


@pytest.mark.parametrize(
    "name,mesh",
    [
        ("mlp", (4,)),
        ("bert_tiny", (4,)),
        ("gpt2_tiny", (4,)),
        ("resnet_tiny", (4,)),
        ("vit_tiny", (4,)),
        ("mlp", (2, 2)),
        ("bert_tiny", (2, 2)),
        ("gpt2_tiny", (2, 2)),
        ("resnet_tiny", (2, 2)),
        ("vit_tiny", (2, 2)),
    ],
)
def test_tensor_parallel_program_on_host_ranks(
    name: str, mesh: tuple[int, ...], tmp_path: Path
) -> None:
    m = Mesh("gpus", mesh)
    g = logical(name)
    result = parallelize(g, ParallelOptions(m, "auto", sbp=tensor_parallel(g, m)))
    build_and_run(name, result, tmp_path / "out")


def test_auto_plan_under_memory_limit_on_host_ranks(tmp_path: Path) -> None:
    from flowc.parallel.cost import load_profile

    m = Mesh("gpus", (4,))
    g = logical("gpt2_tiny")
    # Half the unsplit program's bytes, its library workspaces left out (they would be most
    # of it: 32 MiB a stream, and under a limit they take a 16th of it).
    shipped = Path(load_profile.__code__.co_filename).parent / "profiles" / "h200-nvlink.toml"
    bare = tmp_path / "no_workspace.toml"
    bare.write_text(shipped.read_text().replace("workspace = 33554432", "workspace = 0"))
    assert load_profile(bare).workspace == 0
    limit = parallelize(g, ParallelOptions(m, "none", profile=bare)).memory.total // 2
    result = parallelize(g, ParallelOptions(m, "auto", mem_limit=limit))
    assert result.memory.total <= limit
    build_and_run(
        "gpt2_tiny", result, tmp_path / "out", orders=("reverse", "shuffle:7"), poison=True
    )


def test_cuda_build_of_a_four_rank_program_links_nccl_and_mpi(tmp_path: Path) -> None:
    require_cuda_build_toolchain()
    m = Mesh("gpus", (4,))
    g = logical("mlp")
    result = parallelize(g, ParallelOptions(m, "auto", sbp=tensor_parallel(g, m)))
    out = tmp_path / "out"
    compile_graph(result.physical.graph, out, prefix="mlp", physical=result.physical)
    bdir = build(out, "cuda", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
    undefined = subprocess.run(
        ["nm", "-D", "--undefined-only", str(bdir / "libmlp_model.so")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for sym in ("ncclAllReduce", "ncclCommSplit", "MPI_Bcast"):
        assert sym in undefined, f"{sym} is not linked"
