"""Per-stage placement plans in a pipeline and the N:M reshard at a cut: the pieces against
NumPy's shard of the logical tensor, the choice between a 1:1 and a reshard transfer, and
host runs under mpirun of a two-stage program on a 2x2 mesh whose stages want different
layouts, against onnxruntime, with each rank's transfers against the plan."""

from __future__ import annotations

import itertools
import os
import re
import shutil
from collections import deque
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_cli
from onnx import TensorProto, helper, numpy_helper

from flowc.compiler import (
    CompiledPipeline,
    PipelineSpec,
    StageTimes,
    build_pipeline,
    compile_pipeline,
)
from flowc.frontend import load_graph
from flowc.harness.build import build, run
from flowc.harness.compare import max_rel_error
from flowc.harness.ort import run_onnxruntime
from flowc.ir.dtype import DType
from flowc.ir.graph import Graph, Value
from flowc.ir.layout import all_coords, fits, nd_sbps, shard
from flowc.ir.types import Mesh, NdSbp, Sbp, TensorType
from flowc.parallel import ParallelOptions
from flowc.parallel.cost import DEFAULT_PROFILE, load_profile
from flowc.parallel.pipeline import (
    Reshard,
    layout_box,
    plan_reshard,
    presliced,
    reshard_pieces,
    unpartial,
)
from flowc.passes.manager import PassManager

S0, S1, B = Sbp("S", 0), Sbp("S", 1), Sbp("B")
BATCH, WIDE, HIDDEN, OUT = 8, 64, 256, 16


def _local(box: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def _exchange(x: np.ndarray, r: Reshard, mesh: Mesh) -> dict[tuple[int, ...], np.ndarray]:
    """Run ``r``'s slots as the two stages' programs would: every sending rank issues its
    slots in order (the piece of its own shard to the partner its row names), every
    receiving rank takes its slots in order from the partner named, messages between a pair
    matched first in, first out (MPI's rule); returns each receiver's assembled shard."""
    coords = all_coords(mesh)
    wire: dict[tuple[int, int], deque[np.ndarray]] = {}
    for c, cc in enumerate(coords):
        mine = shard(x, r.src, mesh, cc)
        for slot in r.send_slots:
            wire.setdefault((c, slot.peers[c]), deque()).append(mine[_local(slot.box)].copy())
    got = {}
    for k, rc in enumerate(coords):
        want = shard(x, r.dst, mesh, rc)
        out = np.full(want.shape, np.nan, dtype=x.dtype)
        for slot in r.recv_slots:
            piece = wire[(slot.peers[k], k)].popleft()
            assert piece.shape == out[_local(slot.box)].shape
            assert np.isnan(out[_local(slot.box)]).all(), "two pieces write the same elements"
            out[_local(slot.box)] = piece
        got[rc] = out
    assert all(not q for q in wire.values()), "a piece was sent that nobody receives"
    return got


@pytest.mark.parametrize("shape", [(4, 8, 6), (8, 4)])
@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)])
def test_pieces_tile_every_receivers_shard(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> None:
    mesh = Mesh("stage", mesh_shape)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    layouts = [s for s in nd_sbps(len(shape), mesh, partial=False) if fits(shape, s, mesh)]
    done = 0
    for src, dst in itertools.product(layouts, layouts):
        pieces = reshard_pieces(shape, src, dst, mesh)
        coords = all_coords(mesh)
        for k, rc in enumerate(coords):
            # Each receiver's pieces come from senders holding them and cover its box once.
            want = layout_box(shape, dst, mesh, rc)
            cover = np.zeros(shape, dtype=np.int64)
            for p in (p for p in pieces if p.dst == k):
                held = layout_box(shape, src, mesh, coords[p.src])
                assert all(
                    h0 <= lo and hi <= h1 for (lo, hi), (h0, h1) in zip(p.box, held, strict=True)
                )
                cover[_local(p.box)] += 1
            inside = np.zeros(shape, dtype=bool)
            inside[_local(want)] = True
            assert (cover[inside] == 1).all() and (cover[~inside] == 0).all(), (src, dst, rc)
        if src == dst:
            assert all(p.src == p.dst for p in pieces), "equal layouts must be 1:1"
        # As a cut does it: a sender holding B on a mesh axis the receiver splits slices first.
        t = TensorType(shape, DType.F32)
        r = plan_reshard(Value("x", t), presliced(t, src, dst, mesh), dst, mesh)
        if r is None:
            # Only on a mesh of several axes, for a tensor axis that splits over one mesh axis
            # but not over all (then a sender's piece would sit at a rank-dependent offset):
            # such a value keeps the sender's layout instead.
            assert len(mesh_shape) > 1 and any(d % mesh.size for d in shape), (src, dst)
            continue
        got = _exchange(x, r, mesh)
        for rc in all_coords(mesh):
            np.testing.assert_array_equal(got[rc], shard(x, dst, mesh, rc))
        done += 1
    assert done >= len(layouts) ** 2 - 4, "every S/B pair but a few has one SPMD form"


def test_replicated_senders_spread_the_load_and_b_to_s_is_sliced_first() -> None:
    mesh = Mesh("stage", (4,))
    t = TensorType((8, 8), DType.F32)
    # B -> S(1): the sender keeps only the receiver's columns before sending (1:1 after).
    assert presliced(t, NdSbp((B,)), NdSbp((S1,)), mesh) == NdSbp((S1,))
    # Each receiver of a B value whose own index holds it takes it from that one; across
    # an S(0) -> B reshard every sender serves every receiver once.
    pieces = reshard_pieces((8, 8), NdSbp((S0,)), NdSbp((B,)), mesh)
    assert sorted((p.src, p.dst) for p in pieces) == sorted(itertools.product(range(4), range(4)))
    # Over a 2x2 mesh, (B, S(2)) -> (S(2), B) of a [4, 8, 6] tensor: the nearest copy of each
    # column block would load two senders with two pieces each and leave two idle, which
    # one program for all ranks cannot issue; the balanced choice has every sender send one.
    m2 = Mesh("stage", (2, 2))
    shape = (4, 8, 6)
    src, dst = NdSbp((B, Sbp("S", 2))), NdSbp((Sbp("S", 2), B))
    near = reshard_pieces(shape, src, dst, m2, "nearest")
    assert sorted(np.bincount([p.src for p in near], minlength=4)) == [0, 0, 2, 2]
    r = plan_reshard(Value("x", TensorType(shape, DType.F32)), src, dst, m2)
    assert r is not None
    assert sorted(p.src for p in r.pieces) == [0, 1, 2, 3]


def test_a_partial_sum_is_reduced_before_it_crosses() -> None:
    mesh = Mesh("stage", (2,))
    t = TensorType((8, 64), DType.F32)
    sent = unpartial(t, NdSbp((Sbp("P"),)), mesh, load_profile())
    assert all(p.kind != "P" for p in sent.parts)
    # Reduce-scatter moves half what an all-reduce does: the cheaper reduction is chosen.
    assert sent.parts[0].kind == "S"


# -- a model whose two stages want different layouts ------------------------------------------


def _model(path: Path, with_matmul_cut: bool = False) -> Path:
    """x[8, 64] -> MatMul w1[64, 256] (a) -> Relu (h) | Softmax over axis 1 (p) -> MatMul
    w2[256, 16] (y). Stage 0 is the wide matmul: its weights split by columns (S(1)), so h
    is made S(1); stage 1's softmax needs whole rows."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((WIDE, HIDDEN)) / 8).astype(np.float32)
    w2 = (rng.standard_normal((HIDDEN, OUT)) / 16).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["a"]),
        helper.make_node("Relu", ["a"], ["h"]),
        helper.make_node("Softmax", ["h"], ["p"], axis=1),
        helper.make_node("MatMul", ["p", "w2"], ["y"]),
    ]
    g = helper.make_graph(
        nodes,
        "reshard",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, WIDE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, OUT])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path))
    return path


def _fast_link_profile(path: Path) -> Path:
    """The shipped profile with a pipeline link (mesh axis 0) of almost no latency: a transfer
    in several pieces then costs what its bytes cost, and the reshard pays off."""
    text = DEFAULT_PROFILE.read_text()
    assert "\n[mesh_axis.0]" not in text
    text += "\n[mesh_axis.0]\nalpha = 1e-7\nbandwidth = 450e9\n"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("reshard")
    return {"model": _model(d / "reshard.onnx"), "profile": _fast_link_profile(d / "fast.toml")}


def _graph(model: Path) -> Graph:
    return PassManager(("lower_ops", "widen_types", "fuse_elementwise")).run(load_graph(model))


def _spec(
    profile: Path | None, sbp: dict[str, NdSbp] | None = None, cut: str = "h"
) -> PipelineSpec:
    opts = ParallelOptions(Mesh("stage", (2,)), sbp=sbp or {}, profile=profile)
    return PipelineSpec(2, Mesh("gpus", (2, 2)), boundaries=[cut], stage_options=opts)


CASES = {
    # The search's own choice under the fast link: stage 1 takes h whole, from both halves.
    "natural": (True, {}, "h", NdSbp((S1,)), NdSbp((B,))),
    # Stage 1's softmax pinned row-split: h arrives S(0), each sender slicing its columns.
    "pinned": (False, {"p": NdSbp((S0,))}, "h", NdSbp((S1,)), NdSbp((S0,))),
    # Stage 0 pinned to split the contraction: its cut value a is a partial sum, reduced
    # (reduce-scatter to S(0)) before it crosses, then gathered whole by stage 1's ranks.
    "partial": (True, {"w1": NdSbp((S0,)), "x": NdSbp((S1,))}, "a", NdSbp((S0,)), NdSbp((B,))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_stage_has_its_own_plan_and_the_cut_reshards(
    case: str, files: dict[str, Path]
) -> None:
    fast, sbp, cut, src, dst = CASES[case]
    profile = files["profile"] if fast else None
    spec = _spec(profile, sbp, cut)
    pipe, _ = build_pipeline(_graph(files["model"]), spec, load_profile(profile), StageTimes())
    first, second = pipe.placements
    made = {v.name: str(s) for v, s in first.plan.value_sbp.items()}
    if cut == "h":
        # The wide matmul splits its weights by columns, so h is made S(1).
        assert (made["w1"], made["h"]) == ("S(1)", "S(1)")
    else:
        assert made["a"] == "P"
    assert second.choice == "N:M" and second.free_s < second.pinned_s
    (r,) = pipe.cuts[0]
    assert (r.value, r.src, r.dst) == (cut, src, dst)
    # Stage 1's weights come from its own plan: whole w2 under B.
    stage = pipe.stages[1]
    w2 = next(c for c in stage.graph.constants if c.name == "w2")
    for coords in all_coords(pipe.mesh)[2:]:
        data = pipe.constant_data(stage, coords)(w2)
        assert data.shape == (HIDDEN, OUT)
    # Without the fast link the same stages keep 1:1 (the pieces' latency outweighs).
    if fast:
        plain, _ = build_pipeline(
            _graph(files["model"]), _spec(None, sbp, cut), load_profile(), StageTimes()
        )
        assert plain.placements[1].choice == "1:1"
        assert all(x.one_to_one for x in plain.cuts[0])


def test_inspect_says_each_stage_plan_and_the_cut(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "inspect",
        str(files["model"]),
        "--mesh",
        "2x2",
        "--pipeline",
        "2",
        "--stage-boundary",
        "h",
    ]
    code, text = run_cli([*args, "--cost-profile", str(files["profile"])], capsys)
    assert code == 0, text
    assert re.search(r"stage 0: modeled [0-9.]+ us per micro-batch; parameters: w1 S\(1\)", text), (
        text
    )
    assert re.search(r"stage 1: modeled .*parameters: w2 B", text), text
    assert "receives N:M" in text
    # h is 8x256 f32: each of the 2 receivers gets both halves, 16 KiB total each.
    assert "cut 0 -> 1: N:M reshard, 16384 B moved: h S(1) -> B (4 pieces)" in text, text
    code, text = run_cli(args, capsys)
    assert code == 0, text
    assert "cut 0 -> 1: 1:1, 8192 B moved: h S(1) -> S(1)" in text, text


# -- host runs -----------------------------------------------------------------------------


def _planned_log(c: CompiledPipeline, rank: int) -> list[str]:
    """Rank ``rank``'s transfers in its exchange's order, from its stage's Send/Recv nodes:
    the partner from the per-rank table when the cut reshards, else the fixed offset."""
    k = c.pipeline.ranks_per_stage
    stage = c.pipeline.stages[rank // k]
    lines = []
    for node in stage.graph.nodes:
        if node.op not in ("Send", "Recv"):
            continue
        values = node.inputs if node.op == "Send" else node.outputs
        peers = node.attrs.get("peers")
        for j, v in enumerate(values):
            assert v is not None
            peer = (
                int(peers[j][rank - stage.index * k]) if peers else rank + int(node.attrs["peer"])
            )
            lines.append(
                f"{node.op.lower()} peer={peer} bytes={v.type.nbytes} dtype={v.type.dtype.onnx}"
            )
    return lines


@pytest.mark.skipif(
    shutil.which("mpirun") is None and os.environ.get("CI") != "true",
    reason="needs Open MPI (mpirun) to start several ranks",
)
@pytest.mark.parametrize("case", list(CASES))
def test_resharded_pipeline_matches_onnxruntime(
    case: str, files: dict[str, Path], tmp_path: Path
) -> None:
    fast, sbp, cut, src, dst = CASES[case]
    out = tmp_path / "out"
    c = compile_pipeline(
        _graph(files["model"]),
        out,
        _spec(files["profile"] if fast else None, sbp, cut),
        prefix="reshard",
    )
    (r,) = c.pipeline.cuts[0]
    assert (r.src, r.dst) == (src, dst)
    build(out, "host", quick=True)
    assert "warning" not in (out / "build-host" / "flowc-build.log").read_text().lower()
    x = np.random.default_rng(1).standard_normal((BATCH, WIDE)).astype(np.float32)
    ref = run_onnxruntime(onnx.load(str(files["model"])), {"x": x})
    got, _ = run(out, {"x": x}, target="host", env={"FLOWC_COMM_LOG": str(out / "comm")})
    assert max_rel_error(got["y"], ref["y"]) < 1e-5
    for rank in range(4):
        lines = [
            line
            for line in (out / f"comm.rank{rank}").read_text().splitlines()
            if line.startswith(("send", "recv"))
        ]
        assert lines == _planned_log(c, rank), f"rank {rank} transferred other than planned"
    # Every receiver got two pieces, one from each sender.
    for rank in (2, 3):
        peers = {
            line.split()[1]
            for line in (out / f"comm.rank{rank}").read_text().splitlines()
            if line.startswith("recv")
        }
        assert peers == {"peer=0", "peer=1"}, peers
    if cut == "a":
        # The partial sum was reduced on stage 0's ranks before anything was sent.
        log = (out / "comm.rank0").read_text().splitlines()
        first_send = next(i for i, line in enumerate(log) if line.startswith("send"))
        assert any(line.startswith("reduce-scatter") for line in log[:first_send]), log
