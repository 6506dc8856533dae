"""The memory-aware node order (flowc.schedule.memory_order, ``--schedule-for memory``)
against brute force: every topological order of small random graphs, each measured by the
memory plan itself (plan_memory's lower bound), so the search's own cost model is checked
too."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import numpy as np
import onnx
from conftest import SHARED_MODELS
from test_models import _shared_io

from flowc.compiler import compile_graph, generate_program, plan_schedule, schedule_graph
from flowc.frontend.onnx import ImportOptions, import_onnx
from flowc.harness.build import build, run
from flowc.harness.compare import max_rel_error
from flowc.harness.ort import inference_mode, run_onnxruntime
from flowc.ir import DType, Graph, TensorType
from flowc.ir.graph import Node, Value
from flowc.memory.check import check_memory_plan
from flowc.memory.plan import Order, _plan, plan_memory
from flowc.passes.manager import COMPILE_PIPELINE, PassManager
from flowc.schedule.memory_order import memory_order, order_peak

F32 = DType.F32


def random_graph(rng: random.Random, n_nodes: int) -> Graph:
    """A random DAG of element-wise nodes (in-place candidates, with and without equal
    element counts and widths), views, copies (Concat), a two-output Split and a library
    call (MatMul); unread values become outputs or stay dead."""
    g = Graph("random")
    vals: list[Value] = [g.add_input("x", TensorType((rng.randint(1, 4), 64), F32))]
    if rng.random() < 0.5:
        vals.append(g.add_input("y", TensorType((rng.randint(1, 4), 64), F32)))
    cols = (16, 64, 100)
    for k in range(n_nodes):
        v = rng.choice(vals)
        w = rng.choice(vals)
        kind = rng.choice(["unary", "unary", "add", "add", "view", "concat", "split", "cast", "mm"])
        rows = v.type.shape[0]
        if kind == "unary":
            outs = [v.type]
            node = g.add_node(rng.choice(["Relu", "Exp", "Neg"]), [v], outs, output_names=[f"v{k}"])
        elif kind == "add":
            out = v.type if v.type.numel >= w.type.numel else w.type
            node = g.add_node("Add", [v, w], [out], output_names=[f"v{k}"])
        elif kind == "cast":
            node = g.add_node(
                "Cast",
                [v],
                [TensorType(v.type.shape, DType.F16)],
                {"to": 10},
                output_names=[f"v{k}"],
            )
        elif kind == "view":
            shape = g.add_constant(f"s{k}", np.array([v.type.numel], np.int64))
            node = g.add_node(
                "Reshape",
                [v, shape],
                [TensorType((v.type.numel,), v.type.dtype)],
                output_names=[f"v{k}"],
            )
        elif kind == "concat":
            out = TensorType((rows + rng.randint(1, 3), rng.choice(cols)), F32)
            node = g.add_node("Concat", [v, w], [out], {"axis": 0}, output_names=[f"v{k}"])
        elif kind == "split":
            half = TensorType((rng.randint(1, 3), rng.choice(cols)), F32)
            node = g.add_node(
                "Split", [v], [half, half], {"axis": 0}, output_names=[f"v{k}a", f"v{k}b"]
            )
        else:
            out = TensorType((rng.randint(1, 5), rng.choice(cols)), F32)
            node = g.add_node("MatMul", [v, w], [out], output_names=[f"v{k}"])
        vals.extend(node.outputs)
    read = {i for n in g.nodes for i in n.inputs if i is not None}
    sinks = [v for n in g.nodes for v in n.outputs if v not in read]
    g.outputs = [v for v in sinks if rng.random() < 0.8] or [g.nodes[-1].outputs[0]]
    return g


def topological_orders(g: Graph) -> list[list[Node]]:
    """Every order of all of g's nodes (views too) that defines each input before use."""
    made = {v: n for n in g.nodes for v in n.outputs}
    needs = {id(n): {id(made[i]) for i in n.inputs if i is not None and i in made} for n in g.nodes}
    out: list[list[Node]] = []

    def walk(prefix: list[Node], done: set[int]) -> None:
        if len(prefix) == len(g.nodes):
            out.append(list(prefix))
            return
        for n in g.nodes:
            if id(n) not in done and needs[id(n)] <= done:
                prefix.append(n)
                done.add(id(n))
                walk(prefix, done)
                done.discard(id(n))
                prefix.pop()

    walk([], set())
    return out


def plan_bound(g: Graph, nodes: list[Node], workspace: int = 0) -> int:
    """The memory plan's lower bound for one-stream order ``nodes``, without Concat/Split/
    Slice aliases (the order's cost model counts none); the plan's own bound computation,
    without placing offsets (the placement search would make brute force slow)."""
    return _plan(g, Order.linear(g, nodes), workspace, set(), place=False).lower_bound


def _random_cases(count: int, seed: int) -> list[tuple[Graph, int]]:
    rng = random.Random(seed)
    return [(random_graph(rng, rng.randint(2, 8)), rng.choice([0, 0, 4096])) for _ in range(count)]


def test_search_finds_the_brute_force_optimum_on_random_graphs() -> None:
    improved = 0
    for g, workspace in _random_cases(150, seed=1):
        orders = topological_orders(g)
        best = min(plan_bound(g, o, workspace) for o in orders)
        mo = memory_order(g, workspace_bytes=workspace)
        assert mo.exact
        # A valid order of every node (Order.linear verifies it), whose plan has the
        # optimum's bound and the peak the search claims.
        assert sorted(map(id, mo.nodes)) == sorted(map(id, g.nodes))
        assert plan_bound(g, mo.nodes, workspace) == mo.peak == best, g
        assert order_peak(g, mo.nodes, workspace) == mo.peak
        assert mo.exporter_peak == plan_bound(g, list(g.nodes), workspace)
        plan = plan_memory(g, Order.linear(g, mo.nodes), workspace_bytes=workspace, alias=False)
        assert plan.lower_bound == mo.peak
        check_memory_plan(g, plan)
        improved += mo.peak < mo.exporter_peak
    # The cases exercise the search, not only the exporter's order.
    assert improved >= 10, improved


def test_beam_search_past_the_state_bound_is_valid_and_no_worse_than_the_exporter() -> None:
    truncated = 0
    for g, workspace in _random_cases(60, seed=2):
        mo = memory_order(g, workspace_bytes=workspace, max_states=1, beam=1)
        best = min(plan_bound(g, o, workspace) for o in topological_orders(g))
        assert best <= plan_bound(g, mo.nodes, workspace) == mo.peak <= mo.exporter_peak
        truncated += not mo.exact
    assert truncated >= 1


def test_blocks_split_at_cut_points_and_the_order_is_deterministic() -> None:
    # Eight blocks of two branches: one whose result is big, one with a big temporary and a
    # small result. The exporter runs the big result first and holds it through the other
    # branch's temporary; the better order runs the temporary first.
    g = Graph("blocks")
    v = g.add_input("x", TensorType((8, 64), F32))
    for b in range(8):
        big = g.add_node(
            "MatMul", [v, v], [TensorType((32, 64), F32)], output_names=[f"big{b}"]
        ).outputs[0]
        tmp = g.add_node(
            "MatMul", [v, v], [TensorType((64, 64), F32)], output_names=[f"tmp{b}"]
        ).outputs[0]
        small = g.add_node(
            "ReduceSum", [tmp], [TensorType((1, 64), F32)], output_names=[f"small{b}"]
        ).outputs[0]
        v = g.add_node(
            "Concat", [big, small], [TensorType((8, 64), F32)], output_names=[f"c{b}"]
        ).outputs[0]
    g.outputs = [v]
    first = memory_order(g)
    again = memory_order(g)
    names = [n.outputs[0].name for n in first.nodes]
    assert names == [n.outputs[0].name for n in again.nodes]
    assert first.exact and first.segments == 16 and first.largest_segment == 3
    assert names[:4] == ["tmp0", "small0", "big0", "c0"]
    assert first.peak == plan_bound(g, first.nodes) < first.exporter_peak
    assert first.exporter_peak == plan_bound(g, list(g.nodes))


def test_schedule_for_memory_compiles_and_matches_onnxruntime_on_the_host(tmp_path: Path) -> None:
    name = "resnet_tiny"
    feeds, expected = _shared_io(name)
    path = SHARED_MODELS / f"{name}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = import_onnx(path, ImportOptions(shapes={k: v.shape for k, v in feeds.items()}))
    graph = PassManager(COMPILE_PIPELINE).run(graph)
    # The schedule runs the memory order on one stream: its plan's bound is the order's.
    sched = schedule_graph(graph, schedule_for="memory")
    mo = memory_order(graph, workspace_bytes=sched.workspace_bytes)
    assert [sched.actors.actors[a].node for a in sched.issue] == [
        n for n in mo.nodes if any(n is a.node for a in sched.actors.actors)
    ]
    ws = sched.workspace_bytes
    assert plan_memory(graph, Order.of(sched), ws, alias=False).lower_bound == mo.peak
    # The plan (aliases where free) needs no more than the exporter's order on one stream.
    assert (
        plan_schedule(sched).arena_bytes <= plan_memory(graph, Order.linear(graph), ws).arena_bytes
    )
    out = tmp_path / "out"
    compiled = compile_graph(graph, out, poison=True, schedule_for="memory")
    check_memory_plan(graph, compiled.memory, compiled.program)
    build(out, "host", quick=True)
    ref = run_onnxruntime(inference_mode(onnx.load(str(path))), feeds)
    got, _ = run(out, feeds)
    for k in expected:
        assert max_rel_error(got[k], ref[k]) <= 1e-4, k


def test_schedule_for_memory_on_two_streams_passes_the_checker() -> None:
    # Four independent branches: the list scheduler, given the memory order as its
    # priority, spreads them over both streams; the plan must follow the events.
    g = Graph("wide")
    x = g.add_input("x", TensorType((16, 64), F32))
    outs = []
    for k in range(4):
        w = g.add_constant(f"w{k}", np.full((64, 64 * (k + 1)), 0.01, np.float32))
        t = g.add_node(
            "MatMul", [x, w], [TensorType((16, 64 * (k + 1)), F32)], output_names=[f"m{k}"]
        )
        r = g.add_node("Relu", [t.outputs[0]], [t.outputs[0].type], output_names=[f"r{k}"])
        outs.append(g.add_node("Sigmoid", r.outputs, [r.outputs[0].type]).outputs[0])
    cat = TensorType((16, 640), F32)
    g.outputs = [g.add_node("Concat", outs, [cat], {"axis": 1}, output_names=["y"]).outputs[0]]
    one = generate_program(g, schedule_for="memory")
    assert one.schedule.num_compute == 1
    two = generate_program(g, streams=2, schedule_for="memory")
    assert two.schedule.num_compute == 2
    for c in (one, two):
        check_memory_plan(g, c.memory, c.program)
    ws = one.schedule.workspace_bytes
    bound = plan_memory(g, Order.of(one.schedule), ws, alias=False).lower_bound
    assert bound == memory_order(g, workspace_bytes=ws).peak


def test_cli_schedule_for_memory(tmp_path: Path) -> None:
    from test_cli import assert_clean_error, flowc

    model = str(SHARED_MODELS / "resnet_tiny.onnx")
    r = flowc("inspect", model, "--schedule", "--schedule-for", "memory")
    assert r.returncode == 0, r.stderr
    assert "on 1 stream(s)" in r.stdout and "least peak memory" in r.stdout
    r = flowc(
        "compile", model, "-o", str(tmp_path / "p"), "--pipeline", "2", "--schedule-for", "memory"
    )
    assert_clean_error(r, "--schedule-for memory with --pipeline")
