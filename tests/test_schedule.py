"""The static schedule (flowc/schedule): streams, issue order, events and the simulator's
device sharing on a multi-branch DSL program and on Inception v1/v2; the memory plan along
its happens-before order, checked on the emitted program; determinism; the CUDA build of a
multi-stream program; and `flowc inspect --schedule`."""

from __future__ import annotations

import itertools
import json
import os
import re
from functools import cache
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_cli
from test_models import LIGHT_DIR
from test_streams_host import BRANCHES, branches_weights

from flowc.compiler import Compiled, compile_graph, generate_program, schedule_graph
from flowc.frontend.dsl import parse_program
from flowc.frontend.onnx import import_model
from flowc.ir.graph import Graph, Node
from flowc.memory.check import PlanError, check_memory_plan
from flowc.memory.plan import Order, plan_memory
from flowc.passes.manager import COMPILE_PIPELINE, PassManager
from flowc.schedule.labels import node_labels
from flowc.schedule.program import Schedule, StreamOp

MODELS = ["branches", "light_inception_v1", "light_inception_v2"]


def load_model(name: str, tmp: Path) -> Graph:
    """A fresh import (compiled pipeline) of one of MODELS."""
    if name == "branches":
        wpath, _ = branches_weights(tmp)
        return PassManager(COMPILE_PIPELINE).run(parse_program(BRANCHES, weights=wpath))
    return PassManager(COMPILE_PIPELINE).run(
        import_model(onnx.load(str(LIGHT_DIR / f"{name}.onnx")))
    )


@cache
def model(name: str) -> Graph:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return load_model(name, Path(tmp))


@cache
def program(name: str, streams: int | None) -> Compiled:
    return generate_program(model(name), streams=streams, poison=True)


@pytest.mark.parametrize("name", MODELS)
def test_two_streams_shorten_the_modeled_makespan(name: str) -> None:
    one = schedule_graph(model(name), streams=1)
    two = schedule_graph(model(name), streams=2)
    auto = schedule_graph(model(name))
    assert one.num_streams == 1 and not one.events
    assert two.num_compute == 2
    # Independent branches overlap: a clear gain, not just the noise of event costs.
    assert two.makespan_s < 0.9 * one.makespan_s
    assert auto.makespan_s <= two.makespan_s
    # One stream: the makespan is the sum of the actors' solo times (nothing overlaps).
    assert one.makespan_s == pytest.approx(sum(a.time_s for a in one.actors.actors))


@pytest.mark.parametrize("streams", [2, None])
@pytest.mark.parametrize("name", MODELS)
def test_schedule_structure(name: str, streams: int | None) -> None:
    s = program(name, streams).schedule
    ag = s.actors
    n = len(ag.actors)
    # Every actor on exactly one stream, once, and stream_of agrees.
    placed = [a for order in s.streams for a in order]
    assert sorted(placed) == list(range(n))
    for k, order in enumerate(s.streams):
        assert all(s.stream_of[a] == k for a in order)
    # The issue order is a topological order that keeps each stream's order.
    at = {a: t for t, a in enumerate(s.issue)}
    assert sorted(at) == list(range(n))
    for a in ag.actors:
        assert all(at[d] < at[a.id] for d in a.deps), a.name
    for order in s.streams:
        assert [at[a] for a in order] == sorted(at[a] for a in order)
    # Modeled times: each actor after its inputs and its stream predecessor.
    for order in s.streams:
        for p, q in itertools.pairwise(order):
            assert s.start_s[q] >= s.end_s[p] - 1e-12
    for a in ag.actors:
        assert all(s.start_s[a.id] >= s.end_s[d] - 1e-12 for d in a.deps)
    assert s.makespan_s == pytest.approx(max(s.end_s))
    # Events only for a cross-stream input, each needed: its reader's clock would not
    # cover the writer without it (removing it makes the checker object, below).
    for e in s.events:
        assert e.record_after in ag.actors[e.wait_before].deps
        assert s.stream_of[e.record_after] != s.stream_of[e.wait_before]
    # Every cross-stream input is ordered by the events.
    for a in ag.actors:
        assert all(s.hb(d, a.id) for d in a.deps)
    # The critical path is a chain of dependences or stream neighbours ending at the makespan.
    path = s.critical_path
    assert s.end_s[path[-1]] == pytest.approx(s.makespan_s)
    for p, q in itertools.pairwise(path):
        same_stream = s.stream_of[p] == s.stream_of[q] and s.pos[q] == s.pos[p] + 1
        assert p in ag.actors[q].deps or same_stream


def waits_removed(ops: list[StreamOp], event: int) -> list[StreamOp]:
    return [op for op in ops if not (op.kind == "wait" and op.event == event)]


@pytest.mark.parametrize("streams", [1, 2, None])
@pytest.mark.parametrize("name", MODELS)
def test_memory_plan_checks_on_the_emitted_program(name: str, streams: int | None) -> None:
    c = program(name, streams)
    check_memory_plan(c.graph, c.memory, c.program)
    # Each of the schedule's events is needed: without its wait, a read is no longer
    # ordered after its write, or (an event that also joins its stream back) a stream is
    # left unjoined -- the checker's own clocks say so.
    for e in c.schedule.events:
        with pytest.raises(PlanError, match=r"may read|not joined into stream 0"):
            check_memory_plan(c.graph, c.memory, waits_removed(c.program, e.id))


def cross_stream_shared_pairs(c: Compiled) -> int:
    """How many pairs of buffers share bytes while accessed on different streams; asserts
    each pair is ordered along happens-before (every access of one before the other's first
    write)."""
    order = c.memory.order
    access: dict[int, list[int]] = {b.id: [b.writer] for b in c.memory.buffers}
    for t, node in enumerate(order.steps):
        for v in node.inputs:
            if v is not None and v in c.memory.value_buffer:
                access[c.memory.value_buffer[v]].append(t)
    count = 0
    bufs = c.memory.buffers
    for i, p in enumerate(bufs):
        for q in bufs[i + 1 :]:
            if p.offset >= q.offset + q.size or q.offset >= p.offset + p.size:
                continue
            if (
                {order.stream[t] for t in access[p.id]}
                == {order.stream[t] for t in access[q.id]}
                == {order.stream[access[p.id][0]]}
            ):
                continue  # one stream: ordered by the stream itself
            first, second = (p, q) if p.writer < q.writer else (q, p)
            assert all(order.hb(t, second.writer) for t in access[first.id]), (p.id, q.id)
            count += 1
    return count


@pytest.mark.parametrize("name", ["light_inception_v1", "light_inception_v2"])
def test_cross_stream_reuse_follows_happens_before(name: str) -> None:
    c = program(name, 2)
    # Reuse across streams does happen (the arena is no bigger than the sum of live
    # buffers would force), and only along events.
    assert cross_stream_shared_pairs(c) > 0
    assert c.memory.arena_bytes < c.memory.naive_bytes


def _node(graph: Graph, out: str) -> Node:
    return next(n for n in graph.nodes if n.outputs[0].name == out)


def _replay(ops: list[StreamOp]) -> Order:
    """The Order (streams, positions, vector clocks) of a hand-written stream program."""
    ns = 1 + max(op.stream for op in ops)
    clock = [[0] * ns for _ in range(ns)]
    recorded: dict[int, list[int]] = {}
    steps, stream, pos, clocks = [], [], [], []
    for op in ops:
        s = op.stream
        if op.kind == "record":
            recorded[op.event] = list(clock[s])
        elif op.kind == "wait":
            clock[s] = [max(x, y) for x, y in zip(clock[s], recorded[op.event], strict=True)]
        else:
            assert op.node is not None
            clock[s][s] += 1
            steps.append(op.node)
            stream.append(s)
            pos.append(clock[s][s])
            clocks.append(tuple(clock[s]))
    return Order(steps, stream, pos, clocks)


CHAINS = """graph g(x: f32[16, 16]) -> (y: f32[16, 16]) {
    param wa: f32[16, 16] = normal(0.0, 0.1)
    param wb: f32[16, 16] = normal(0.0, 0.1)
    a1 = x @ wa
    a2 = a1 @ wa
    b1 = x @ wb
    b2 = b1 @ wb
    y = a2 + b2
    return y
}
"""


def _chains() -> tuple[Graph, list[StreamOp], list[StreamOp]]:
    """CHAINS, with a on stream 0 and b on stream 1, issued a1, a2, b1, b2, y: without an
    event between the chains, and with one ordering a2 before b1."""
    graph = parse_program(CHAINS)
    a1, a2, b1, b2, y = (_node(graph, v) for v in ("a1", "a2", "b1", "b2", "y"))
    join = [StreamOp("record", 1, event=0), StreamOp("wait", 0, event=0), StreamOp("run", 0, y)]
    unordered = [StreamOp("run", 0, a1), StreamOp("run", 0, a2)]
    unordered += [StreamOp("run", 1, b1), StreamOp("run", 1, b2), *join]
    ordered = [StreamOp("run", 0, a1), StreamOp("run", 0, a2)]
    ordered += [StreamOp("record", 0, event=1), StreamOp("wait", 1, event=1)]
    ordered += [StreamOp("run", 1, b1), StreamOp("run", 1, b2), *join]
    return graph, unordered, ordered


def test_reuse_across_streams_only_along_happens_before() -> None:
    # One stream could give b1 the bytes of a1 (dead after a2); two streams may do so only
    # when an event orders a2 before b1.
    graph, unordered, ordered = _chains()
    a1, a2, b1, b2, y = (_node(graph, v) for v in ("a1", "a2", "b1", "b2", "y"))

    def offset(plan, name: str) -> int:  # type: ignore[no-untyped-def]
        return int(plan.offset(_node(graph, name).outputs[0]))

    kb = 16 * 16 * 4
    linear = plan_memory(graph, Order.linear(graph, [a1, a2, b1, b2, y]))
    assert offset(linear, "a1") == offset(linear, "b1") and linear.arena_bytes == 3 * kb
    apart = plan_memory(graph, _replay(unordered))
    # Nothing of stream 0 is ordered before anything of stream 1: four separate buffers.
    assert apart.arena_bytes == 4 * kb
    check_memory_plan(graph, apart, unordered)
    along = plan_memory(graph, _replay(ordered))
    assert offset(along, "a1") == offset(along, "b1") and along.arena_bytes == 3 * kb
    check_memory_plan(graph, along, ordered)
    # The checker's own clocks: that reuse without the event is a race.
    with pytest.raises(PlanError, match=r"overwrites '(a1|b1)'"):
        check_memory_plan(graph, along, unordered)


def test_each_library_stream_has_a_planned_workspace() -> None:
    # Every matmul calls cuBLASLt: each stream gets one workspace buffer, on top of the
    # values (the host target allocates only below it), one per stream, never shared.
    graph, unordered, ordered = _chains()
    ws = 8192  # the cap: these 16x16x16 products could use 64 KiB of library scratch
    for order in (unordered, ordered):
        plan = plan_memory(graph, _replay(order), workspace_bytes=ws)
        assert sorted(plan.workspaces) == [0, 1]
        assert plan.workspace_size(0) == plan.workspace_size(1) == ws
        spans = sorted((plan.workspace_offset(s), plan.workspace_offset(s) + ws) for s in (0, 1))
        assert spans[0][0] >= plan.host_arena_bytes and spans[0][1] <= spans[1][0]
        assert plan.arena_bytes == plan.host_arena_bytes + 2 * ws
        check_memory_plan(graph, plan, order)
    # Four matmul results live at once without the event, three with it.
    assert plan_memory(graph, _replay(unordered), workspace_bytes=ws).host_arena_bytes == 4 * 1024
    assert plan_memory(graph, _replay(ordered), workspace_bytes=ws).host_arena_bytes == 3 * 1024
    # A workspace over a value is caught.
    bad = plan_memory(graph, _replay(ordered), workspace_bytes=ws)
    bad.buffers[bad.workspaces[0]].offset = bad.offset(_node(graph, "a2").outputs[0])
    with pytest.raises(PlanError, match="workspace"):
        check_memory_plan(graph, bad, ordered)


def test_a_workspace_is_what_its_calls_can_use_not_the_cap() -> None:
    from flowc.ops.matmul import GEMM_MAX_SPLITS, GEMM_MIN_SPLIT_K, gemm_workspace
    from flowc.ops.registry import LIBRARY_SCRATCH

    graph, _, ordered = _chains()
    cap = 32 << 20
    plan = plan_memory(graph, _replay(ordered), workspace_bytes=cap)
    # 16x16 outputs with K = 16: no split is worth it, the library's scratch alone.
    assert plan.workspace_size(0) == plan.workspace_size(1) == LIBRARY_SCRATCH
    assert plan.arena_bytes == 3 * 1024 + 2 * LIBRARY_SCRATCH
    # The bound grows with K's splits, up to GEMM_MAX_SPLITS copies of the float32 output.
    assert gemm_workspace(100, GEMM_MIN_SPLIT_K) == LIBRARY_SCRATCH
    assert gemm_workspace(100, 3 * GEMM_MIN_SPLIT_K) == LIBRARY_SCRATCH + 4 * 100 * 3
    assert gemm_workspace(100, 10**6) == LIBRARY_SCRATCH + 4 * 100 * GEMM_MAX_SPLITS


def test_generated_handles_use_the_planned_workspaces() -> None:
    import dataclasses

    from flowc.parallel.cost import load_profile

    graph = parse_program(CHAINS)
    c = generate_program(graph, streams=2)
    assert sorted(c.memory.workspaces) == [0, 1]
    text = c.files["model.cu"]
    for s in (0, 1):
        # The host's handle gets no memory, only the size its plans check calls against.
        call = (
            f"flowc::create_blas(&m->blas[{s}], flowc::kHostTarget ? nullptr : m->arena + "
            f"{c.memory.workspace_offset(s)}, {c.memory.workspace_size(s)}u)"
        )
        assert call in text
        assert c.memory.workspace_size(s) < 32 << 20  # what the calls can use, under the cap
    assert c.memory.arena_bytes == c.memory.host_arena_bytes + c.memory.workspace_total()
    assert f"kCudaArenaBytes = {c.memory.arena_bytes}ULL;" in text
    assert f"kHostArenaBytes = {c.memory.host_arena_bytes}ULL;" in text
    assert "d.workspace = " in text
    # A profile without a workspace: the handles get none, the arena holds only values.
    none = dataclasses.replace(load_profile(), workspace=0)
    c0 = generate_program(parse_program(CHAINS), streams=2, profile=none)
    assert not c0.memory.workspaces and c0.memory.arena_bytes < 32 << 20
    assert "flowc::create_blas(&m->blas[1], nullptr, 0u)" in c0.files["model.cu"]


def test_profile_sets_the_workspace_and_a_memory_limit_caps_it(tmp_path: Path) -> None:
    from flowc.errors import InputError
    from flowc.parallel import workspace_within
    from flowc.parallel.cost import load_profile

    shipped = Path(load_profile.__code__.co_filename).parent / "profiles" / "h200-nvlink.toml"
    text = shipped.read_text()
    assert "workspace = 33554432" in text
    for value, expect in (("0", 0), ("4194304", 4 << 20)):
        f = tmp_path / f"w{value}.toml"
        f.write_text(text.replace("workspace = 33554432", f"workspace = {value}"))
        assert load_profile(f).workspace == expect
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("workspace = 33554432", "workspace = -1"))
    with pytest.raises(InputError, match="workspace must be a whole number of bytes"):
        load_profile(bad)
    p = load_profile()
    assert workspace_within(p, None) is p and workspace_within(p, 1 << 40) is p
    assert workspace_within(p, 1_000_000).workspace == 62464  # a 16th, 256-byte aligned


def _two_branches(n: int) -> Graph:
    """Two independent matrix products of [n, n], summed: their kernels may overlap."""
    return PassManager(COMPILE_PIPELINE).run(
        parse_program(
            f"""graph g(x: f32[{n}, {n}]) -> (y: f32[{n}, {n}]) {{
    param wa: f32[{n}, {n}] = zeros
    param wb: f32[{n}, {n}] = zeros
    y = softmax(x @ wa, axis=-1) + softmax(x @ wb, axis=-1)
    return y
}}
"""
        )
    )


def test_simulator_shares_the_device() -> None:
    # Kernels that each fill the device gain nothing from a second stream (they share the
    # SMs), so the default keeps one; small kernels overlap.
    big = _two_branches(1024)
    assert all(a.share == 1.0 for a in schedule_graph(big).actors.actors)
    one, two = schedule_graph(big, streams=1), schedule_graph(big, streams=2)
    assert two.num_compute == 2
    assert two.makespan_s >= one.makespan_s - 1e-12
    assert schedule_graph(big).num_streams == 1
    small = _two_branches(16)
    assert all(a.share < 0.1 for a in schedule_graph(small).actors.actors)
    one, two = schedule_graph(small, streams=1), schedule_graph(small, streams=2)
    assert two.makespan_s < 0.8 * one.makespan_s
    assert schedule_graph(small).num_compute == 2


@pytest.mark.parametrize("name", ["branches", "light_inception_v1"])
def test_schedule_and_code_are_deterministic(name: str, tmp_path: Path) -> None:
    # Two imports of the same input (fresh objects, fresh value ids) give the same bytes.
    a = generate_program(load_model(name, tmp_path), streams=2)
    b = generate_program(load_model(name, tmp_path), streams=2)
    for f in ("schedule.json", "model.cu"):
        assert a.files[f] == b.files[f], f
    sched = json.loads(a.files["schedule.json"])
    assert sched["ranks"][0] == json.loads(json.dumps(a.schedule.to_json()))
    assert len(sched["ranks"][0]["events"]) == len(a.schedule.events) > 0


def test_cuda_build_of_two_streams_compiles_and_links(tmp_path: Path) -> None:
    import subprocess

    from test_runtime import CUDA

    from flowc.harness.build import build

    missing = CUDA.missing(["cublasLt", "cudnn"])
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"missing {', '.join(missing)} (CI must have them)")
        pytest.skip(f"no {', '.join(missing)} here: the CUDA build is not checked")
    out = tmp_path / "out"
    compiled = compile_graph(model("branches"), out, streams=2)
    assert compiled.schedule.num_streams == 2
    code = (out / "model.cu").read_text()
    assert "cudaStreamWaitEvent(streams[1]" in code and "cudaStreamWaitEvent(streams[0]" in code
    bdir = build(out, "cuda", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
    undefined = subprocess.run(
        ["nm", "-D", "--undefined-only", str(bdir / "libbranches_model.so")],
        capture_output=True,
        text=True,
    ).stdout
    assert "cublasLtMatmul" in undefined and "cudaStreamWaitEvent" in undefined


# -- flowc inspect --schedule -------------------------------------------------------------------


def _flow_file(tmp_path: Path) -> tuple[Path, Path]:
    path = tmp_path / "branches.flow"
    path.write_text(BRANCHES)
    wpath, _ = branches_weights(tmp_path)
    return path, wpath


def _check_printed(text: str, s: Schedule) -> None:
    ag = s.actors
    labels = node_labels([a.node for a in ag.actors])
    assert f"{len(ag.actors)} actors on {s.num_streams} stream(s)" in text
    assert f"{len(s.events)} event(s), modeled makespan {s.makespan_s * 1e6:.3f} us" in text
    for k, order in enumerate(s.streams):
        assert f"stream {k} {s.stream_name(k)}" in text
        # Each stream's firing order, with the modeled start and end of each actor.
        rows = [
            f"{p + 1:>4} {a:>5}  {s.start_s[a] * 1e6:>10.3f} {s.end_s[a] * 1e6:>10.3f}  "
            f"{labels[ag.actors[a].node]} [{ag.actors[a].op}]"
            for p, a in enumerate(order)
        ]
        found = [text.index(r) for r in rows]
        assert found == sorted(found)
    for e in s.events:
        assert re.search(rf"e{e.id} \[raw\]: recorded after {e.record_after} '", text)
        assert f"wait e{e.id}" in text and f"record e{e.id}" in text
    assert f"critical path ({len(s.critical_path)} actors" in text


def test_inspect_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, wpath = _flow_file(tmp_path)
    for streams in (1, 2, None):
        args = ["inspect", str(path), "--weights", str(wpath), "--schedule"]
        code, text = run_cli(args + ([f"--streams={streams}"] if streams else []), capsys)
        assert code == 0, text
        assert "schedule of rank 0 (one device)" in text
        _check_printed(text, schedule_graph(model("branches"), streams=streams))
    code, text = run_cli(["inspect", str(path), "--weights", str(wpath), "--streams", "2"], capsys)
    assert code == 2 and "--streams needs --schedule" in text


def test_inspect_schedule_on_a_mesh_prints_it_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flow = Path(__file__).parent.parent / "examples" / "mlp_mesh4.flow"
    code, text = run_cli(["inspect", str(flow), "--schedule"], capsys)
    assert code == 0, text
    assert text.count("schedule of rank") == 1
    assert (
        "(mesh 4: all 4 ranks run the same rank graph, so the same schedule; printed once)" in text
    )
    assert "comm" in text and "AllReduce" in text


def test_inspect_gantt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, wpath = _flow_file(tmp_path)
    png = tmp_path / "s.png"
    code, text = run_cli(
        ["inspect", str(path), "--weights", str(wpath), "--gantt", str(png), "--streams", "2"],
        capsys,
    )
    assert code == 0, text
    assert f"wrote {png}" in text and "stream 1 compute1" in text
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(png) as im:
        pixels = np.asarray(im.convert("RGB"))
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 8  # bars, not a blank page
    code, text = run_cli(
        ["inspect", str(path), "--weights", str(wpath), "--gantt", str(tmp_path / "s.svg")],
        capsys,
    )
    assert code == 2 and "PNG" in text


# -- labels: the model's names, as every view shows them ----------------------------------------

LONG = "/model/layers.0/" + "a_very_long_module_name/" * 3 + "out_proj/Softmax"
HOSTILE = "$cost$ [bold]x[/bold] <b>&amp;</b> :smile:"


def labelled_model(path: Path) -> Path:
    """A chain of nodes named as exporters name them, and worse: scoped paths, markup, a `$`
    pair, an emoji code, a long path twice (its labels collide), index-only names whose
    output or weight has the real name, and no name at all. Softmax and MatMul on a weight:
    nothing fuses, so every node is an actor."""
    from onnx import TensorProto, helper, numpy_helper

    nodes, weights = [], []
    chain = [
        ("/model/layers.0/self_attn/q_proj/MatMul", "MatMul", "q", "w0"),
        (HOSTILE, "Softmax", "s1", None),
        ("/model/layers.0/self_attn/k_proj/Softmax", "Softmax", "k", None),
        (LONG, "Softmax", "s2", None),
        ("n7", "Softmax", "attn/out", None),
        (LONG, "Softmax", "s3", None),
        ("", "Softmax", "pre", None),
        ("n9", "MatMul", "r9", "/model/layers.9/mlp/fc1.weight"),
        ("n10", "Softmax", "r10", None),
    ]
    prev = "x"
    for k, (name, op, out, w) in enumerate(chain):
        inputs = [prev]
        if w is not None:
            a = np.arange(64, dtype=np.float32).reshape(8, 8) / (64 + k)
            weights.append(numpy_helper.from_array(a, w))
            inputs.append(w)
        attrs = {"axis": -1} if op == "Softmax" else {}
        nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        prev = out
    g = helper.make_graph(
        nodes,
        "labels",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [4, 8])],
        weights,
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


# What each of labelled_model's actors reads, in order (a text view: at most 56 characters).
LABELS = [
    "model/layers.0/self_attn/q_proj/MatMul",
    HOSTILE,
    "model/layers.0/self_attn/k_proj/Softmax",
    "…/a_very_long_module_name/out_proj/Softmax #3",  # collides with #5: the ids tell
    "attn/out",  # "n7" is an index: its output's name
    "…/a_very_long_module_name/out_proj/Softmax #5",
    "pre",  # no name: its output's
    "model/layers.9/mlp/fc1",  # "n9" and "r9" are indices: the layer its weight names
    "n10",  # nothing better: the model's own name
]


def test_labels_shorten_sensibly_and_stay_unique() -> None:
    from flowc.schedule.labels import model_name, short_name, unique_labels

    q = "/model/layers.0/self_attn/q_proj/MatMul"
    assert short_name(q) == "model/layers.0/self_attn/q_proj/MatMul"  # the root "/" goes
    # Too long: whole components go, leftmost first, never the op; a run of them is one "…".
    assert short_name(q, 30) == "…/self_attn/q_proj/MatMul"
    assert short_name(q, 12) == "…/MatMul"
    # ... the most common in the view first: the layer and the projection tell nodes apart.
    common = {"model": 90, "layers.0": 15, "self_attn": 64, "q_proj": 8}
    assert short_name(q, 30, common) == "…/layers.0/…/q_proj/MatMul"
    # One long component: its middle goes, the tail keeps the larger part.
    assert short_name("x" * 20 + "y" * 40, 30) == "x" * 9 + "…" + "y" * 20
    assert short_name("$a$\n[b]") == "$a$\ufffd[b]"  # one line, otherwise as it is
    for blank in ("", "   "):
        assert short_name(blank) == "(unnamed)"
    # A view drops the scope its path-like names share, and tells collisions apart by id.
    view = unique_labels(
        {
            0: "/m/encoder/stages.0/layers.0/layer/layer.0/convolution/Conv",
            1: "/m/encoder/stages.1/layers.0/layer/layer.0/convolution/Conv",
            2: "/m/pooler/GlobalAveragePool",
            7: "/m/pooler/GlobalAveragePool",
            8: "",
        },
        40,
    )
    assert view == {
        0: "…/stages.0/…/layer.0/convolution/Conv",
        1: "…/stages.1/…/layer.0/convolution/Conv",
        2: "pooler/GlobalAveragePool #2",
        7: "pooler/GlobalAveragePool #7",
        8: "(unnamed)",
    }
    assert all(len(v) <= 40 for v in view.values())
    # Which name: the node's, else its output's, else its weight's layer, else its own or op.
    assert model_name("n0", ["r0"], "Conv", ["conv1/7x7_s2_w_0"]).text == "conv1/7x7_s2"
    assert model_name("_t5", ["h"], "MatMul").text == "h"
    assert model_name("_t5", ["_t5"], "MatMul", ["w1"]).text == "MatMul"
    assert model_name("Conv_3", ["123"], "Conv", ["layer1.0.conv1.weight"]).text == (
        "layer1.0.conv1"
    )
    box = model_name("box/p/0", ["box/p/0:0"], "AllReduce")
    assert (box.before, box.text, box.after) == ("AllReduce(", "p", ")")
    assert unique_labels({0: model_name("n3@mb1", ["conv1/x@mb1"], "Conv")}) == {0: "conv1/x@mb1"}


def test_inspect_schedule_and_pipeline_show_the_labels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = labelled_model(tmp_path / "labels.onnx")
    code, text = run_cli(["inspect", str(path), "--schedule", "--streams", "1"], capsys)
    assert code == 0, text
    rows = re.findall(r"^ +\d+ +\d+ +[\d.]+ +[\d.]+  (.*) \[(\w+)\]$", text, re.M)
    assert [r[0] for r in rows] == LABELS, text
    assert len(set(LABELS)) == len(LABELS) and all(len(x) <= 56 for x in LABELS)
    # Printed as they are: no markup applied, no emoji, no index ids for names.
    assert f"1 '{HOSTILE}' (Softmax, compute0)" in text and "\U0001f604" not in text
    assert not re.search(r"'n7'|'n9'|'_t\d+'", text)
    code, text = run_cli(["inspect", str(path), "--mesh", "2", "--pipeline", "2"], capsys)
    assert code == 0, text
    assert re.search(rf"stage 0: nodes 0\.\.\d+ \({re.escape(LABELS[0])} \.\. ", text), text
    assert re.search(rf"stage 1: nodes \d+\.\.8 \(.* \.\. {LABELS[-1]}\)", text), text
