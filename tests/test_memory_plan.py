"""The memory plan (lifetimes, aliases, placement) and its independent checker."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import SHARED_MODELS
from hypothesis import given, settings
from hypothesis import strategies as st
from test_models import LIGHT_DIR, LIGHT_MODELS

from flowc.frontend.onnx import ImportOptions, import_onnx
from flowc.ir import DType, Graph, TensorType
from flowc.ir.verify import verify_graph
from flowc.memory.check import PlanError, check_memory_plan
from flowc.memory.plan import ALIGN, Order, plan_memory

MODELS = [
    SHARED_MODELS / f"{n}.onnx"
    for n in ("mlp", "bert_tiny", "gpt2_tiny", "resnet_tiny", "vit_tiny")
]
MODELS += [LIGHT_DIR / f"{n}.onnx" for n in LIGHT_MODELS]


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.stem)
def test_models_plan_checks_and_beats_naive(path) -> None:  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = import_onnx(
            path, ImportOptions(dims={"batch": 2, "seq": 32}) if "bert" in path.stem else None
        )
    plan = plan_memory(g)
    check_memory_plan(g, plan)
    assert plan.lower_bound <= plan.arena_bytes <= plan.naive_bytes
    # The placer reaches the bound of the linear order on every model here.
    assert plan.arena_bytes == plan.lower_bound
    assert all(b.offset % ALIGN == 0 for b in plan.buffers)


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.stem)
def test_compiled_models_reach_their_bound_in_either_order(path) -> None:  # type: ignore[no-untyped-def]
    """The compiled program of every model, in the latency schedule and in the memory
    order: the checker passes on the emitted stream program, the placement reaches the
    lower bound of its order (lifetimes to their joins), and the memory order's arena is
    never above the latency schedule's."""
    from flowc.compiler import generate_program
    from flowc.passes.manager import COMPILE_PIPELINE, PassManager

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = import_onnx(
            path, ImportOptions(dims={"batch": 2, "seq": 32}) if "bert" in path.stem else None
        )
    g = PassManager(COMPILE_PIPELINE).run(g)
    arenas = {}
    for schedule_for in ("latency", "memory"):
        c = generate_program(g, schedule_for=schedule_for)
        check_memory_plan(c.graph, c.memory, c.program)
        assert c.memory.arena_bytes == c.memory.lower_bound, schedule_for
        arenas[schedule_for] = c.memory.arena_bytes
    assert arenas["memory"] <= arenas["latency"]


def _chain(ops: list[str]) -> Graph:
    g = Graph("chain")
    t = TensorType((4, 64), DType.F32)
    x = g.add_input("x", t)
    v = x
    for k, op in enumerate(ops):
        if op == "Reshape":
            shape = g.add_constant(
                f"s{k}", np.array([64, 4] if v.type.shape == (4, 64) else [4, 64], np.int64)
            )
            out = TensorType((64, 4) if v.type.shape == (4, 64) else (4, 64), DType.F32)
            v = g.add_node("Reshape", [v, shape], [out], output_names=[f"v{k}"]).outputs[0]
        elif op == "Add":
            v = g.add_node(
                "Add", [v, x if v.type == t else v], [v.type], output_names=[f"v{k}"]
            ).outputs[0]
        else:
            v = g.add_node(op, [v], [v.type], output_names=[f"v{k}"]).outputs[0]
    g.outputs = [v]
    return g


def test_elementwise_chain_runs_in_place_in_one_buffer() -> None:
    g = _chain(["Relu", "Exp", "Neg", "Tanh", "Relu"])
    plan = plan_memory(g)
    check_memory_plan(g, plan)
    # v0..v3 are intermediates; v1..v3 reuse v0's bytes; v4 is the output (caller memory).
    assert plan.inplace == 3 and len(plan.buffers) == 1 and plan.arena_bytes == 4 * 64 * 4


def test_views_alias_their_base_and_inputs_are_never_written() -> None:
    g = _chain(["Relu", "Reshape", "Exp", "Reshape", "Tanh"])
    plan = plan_memory(g)
    check_memory_plan(g, plan)
    v0, v1 = g.nodes[0].outputs[0], g.nodes[1].outputs[0]
    assert plan.offset(v1) == plan.offset(v0)
    assert g.inputs[0] not in plan.value_buffer  # the graph input is the caller's, untouched


def test_an_output_that_would_alias_an_input_is_copied() -> None:
    g = Graph("g")
    x = g.add_input("x", TensorType((3,), DType.F32))
    w = g.add_constant("w", np.ones(3, np.float32))
    y = g.add_node("Identity", [x], [x.type], output_names=["y"]).outputs[0]
    g.outputs = [y, x, w, y]
    plan = plan_memory(g)
    # The Identity that produces an output is a copy, not a view; x, w and the repeated y
    # must be copied into their output buffers.
    assert plan.output_copies == [x, w, y]
    assert y not in plan.value_buffer


def test_the_checker_catches_overlaps_and_bad_bounds() -> None:
    g = _chain(["Relu", "Exp", "Add", "Sigmoid"])  # Add reads v1 and x: v1 dies there
    plan = plan_memory(g)
    check_memory_plan(g, plan)
    g2 = Graph("fork")
    x = g2.add_input("x", TensorType((256,), DType.F32))
    a = g2.add_node("Relu", [x], [x.type], output_names=["a"]).outputs[0]
    b = g2.add_node("Exp", [x], [x.type], output_names=["b"]).outputs[0]
    c = g2.add_node("Add", [a, b], [x.type], output_names=["c"]).outputs[0]
    g2.outputs = [c]
    plan2 = plan_memory(g2)
    check_memory_plan(g2, plan2)
    assert plan2.offset(a) != plan2.offset(b)
    plan2.buffers[plan2.value_buffer[b]].offset = plan2.offset(a)  # both live at the Add
    with pytest.raises(PlanError, match="overwrites 'a'"):
        check_memory_plan(g2, plan2)
    plan3 = plan_memory(g2)
    plan3.lower_bound -= ALIGN
    with pytest.raises(PlanError, match="lower bound"):
        check_memory_plan(g2, plan3)
    plan4 = plan_memory(g2)
    plan4.buffers[0].offset += 4
    with pytest.raises(PlanError, match="aligned"):
        check_memory_plan(g2, plan4)


UNARY = ["Relu", "Exp", "Neg", "Tanh", "Sigmoid"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([*UNARY, "Add", "Mul", "Reshape", "MatMul"]),
            st.integers(0, 50),
            st.integers(0, 50),
        ),
        min_size=1,
        max_size=25,
    ),
    st.integers(1, 3),
)
def test_random_dags_plan_and_check(spec: list[tuple[str, int, int]], n_outputs: int) -> None:
    g = Graph("dag")
    t = TensorType((8, 8), DType.F32)
    vals = [g.add_input("x", t), g.add_constant("w", np.ones((8, 8), np.float32))]
    shape = g.add_constant("shape", np.array([8, 8], np.int64))
    for k, (op, i, j) in enumerate(spec):
        a, b = vals[i % len(vals)], vals[j % len(vals)]
        if op in UNARY:
            ins = [a]
        elif op == "Reshape":
            ins = [a, shape]
        else:
            ins = [a, b]
        vals.append(g.add_node(op, ins, [t], output_names=[f"v{k}"]).outputs[0])
    g.outputs = list(dict.fromkeys(vals[-n_outputs:]))
    verify_graph(g)
    plan = plan_memory(g)
    check_memory_plan(g, plan)
    assert plan.lower_bound <= plan.arena_bytes <= max(plan.naive_bytes, 0)


# -- In place: Concat inputs in their slice, Split/Slice views ----------------------------------


def _conv(nodes: list, inits: list, rng, x: str, cin: int, cout: int, name: str, k: int = 1) -> str:  # type: ignore[no-untyped-def]
    from onnx import helper, numpy_helper

    w = rng.standard_normal((cout, cin, k, k)).astype(np.float32) * 0.3
    inits.append(numpy_helper.from_array(w, f"{name}_w"))
    nodes.append(
        helper.make_node("Conv", [x, f"{name}_w"], [f"{name}_c"], pads=[k // 2] * 4, name=name)
    )
    nodes.append(helper.make_node("Relu", [f"{name}_c"], [name], name=f"{name}_relu"))
    return name


def _inplace_model():  # type: ignore[no-untyped-def]
    """DenseNet-style (each layer's output concatenated with what came before) and
    Inception-style (four branches into one Concat) blocks, a Split and a Slice of channels,
    and a Concat whose slices are not 256-byte aligned (it stays a copy)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes: list = []
    inits: list = []
    c = 8  # 8x8 float32 channels: 256 bytes each, every channel offset aligned
    c1 = _conv(nodes, inits, rng, "x", c, c, "d1")
    nodes.append(helper.make_node("Concat", ["x", c1], ["cat1"], axis=1, name="cat1"))
    c2 = _conv(nodes, inits, rng, "cat1", 2 * c, c, "d2")
    nodes.append(helper.make_node("Concat", ["cat1", c2], ["cat2"], axis=1, name="cat2"))
    c3 = _conv(nodes, inits, rng, "cat2", 3 * c, c, "d3")
    nodes.append(helper.make_node("Concat", [c1, c2, c3], ["dense"], axis=1, name="cat3"))
    b1 = _conv(nodes, inits, rng, "dense", 3 * c, c, "i1")
    b2 = _conv(nodes, inits, rng, _conv(nodes, inits, rng, "dense", 3 * c, c, "i2a"), c, c, "i2", 3)
    nodes.append(
        helper.make_node("MaxPool", ["dense"], ["pool"], kernel_shape=[3, 3], pads=[1] * 4)
    )
    b3 = _conv(nodes, inits, rng, "pool", 3 * c, c, "i3")
    b4 = _conv(nodes, inits, rng, "dense", 3 * c, 2 * c, "i4", 3)
    nodes.append(helper.make_node("Concat", [b1, b2, b3, b4], ["inc"], axis=1, name="inc"))
    inits.append(numpy_helper.from_array(np.array([c, 4 * c], np.int64), "split"))
    nodes.append(helper.make_node("Split", ["inc", "split"], ["s1", "s2"], axis=1, name="split"))
    nodes.append(helper.make_node("Sigmoid", ["s1"], ["y1"], name="sig"))
    _conv(nodes, inits, rng, "s2", 4 * c, c, "y2")
    for n, v in (("st", [4]), ("en", [12]), ("ax", [1])):
        inits.append(numpy_helper.from_array(np.array(v, np.int64), n))
    nodes.append(helper.make_node("Slice", ["dense", "st", "en", "ax"], ["sl"], name="slice"))
    nodes.append(helper.make_node("Tanh", ["sl"], ["y3"], name="tanh"))
    # 2x2 channels of 16 bytes: the second input's slice starts at byte 128.
    nodes.append(
        helper.make_node("AveragePool", ["y2"], ["p1"], kernel_shape=[4, 4], strides=[4, 4])
    )
    nodes.append(
        helper.make_node("AveragePool", ["i2a"], ["p2"], kernel_shape=[4, 4], strides=[4, 4])
    )
    nodes.append(helper.make_node("Neg", ["p1"], ["p1n"], name="neg"))
    nodes.append(helper.make_node("Concat", ["p1n", "p2"], ["odd"], axis=1, name="odd"))
    nodes.append(helper.make_node("Exp", ["odd"], ["y4"], name="exp"))
    graph = helper.make_graph(
        nodes,
        "inplace",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 8, 8])],
        [helper.make_empty_tensor_value_info(n) for n in ("y1", "y2", "y3", "y4")],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    inferred = onnx.shape_inference.infer_shapes(model)
    del model.graph.output[:]
    model.graph.output.extend(inferred.graph.output)
    return model


def test_concat_split_slice_in_place_match_onnxruntime(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from flowc.codegen.program import generate
    from flowc.codegen.project import write_project
    from flowc.compiler import schedule_graph
    from flowc.frontend.onnx import import_model
    from flowc.harness.build import build, run
    from flowc.harness.compare import compare
    from flowc.harness.ort import run_onnxruntime
    from flowc.passes.manager import COMPILE_PIPELINE, PassManager

    model = _inplace_model()
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 8, 8, 8)).astype(np.float32)}
    ref = run_onnxruntime(model, feeds)
    g = PassManager(COMPILE_PIPELINE).run(import_model(model))
    plan_alone = plan_memory(g, alias=True)
    check_memory_plan(g, plan_alone)
    check_memory_plan(g, plan_memory(g))  # the default: the smaller of the two
    copied = plan_memory(g, alias=False)
    check_memory_plan(g, copied)
    # Two streams when the simulator wants them (Inception's branches): the plan follows
    # the schedule's happens-before order, the checker replays the emitted program.
    # Aliases forced (the default keeps them only where the arena does not grow): the
    # build runs every in-place path.
    sched = schedule_graph(g, streams=2)
    plan = plan_memory(g, Order.of(sched), sched.workspace_bytes, alias=True)
    files, weights, program, _ = generate(g, sched, plan, poison=True)
    write_project(tmp_path / "project", files, weights)
    check_memory_plan(g, plan, program)
    by_name = {n.name: n for n in g.nodes}
    # A value joins a Concat only where that Concat is its last reader: d1 and d2 are read
    # again by cat3, which holds d1, d2, d3 in place and runs nothing; inc holds its four
    # branches; cat2 holds cat1 (written by cat1's copies); odd only its first input (at
    # byte 0), not the second (at byte 128).
    assert by_name["inc"] in plan.elided and by_name["cat3"] in plan.elided
    assert by_name["cat1"] not in plan.elided and by_name["cat2"] not in plan.elided
    assert by_name["split"] in plan.elided and by_name["slice"] in plan.elided
    assert by_name["odd"] not in plan.elided
    assert plan.views_inplace == 3 and plan.concat_inplace == 9
    assert plan.writes_in_place(by_name["odd"], 0) and not plan.writes_in_place(by_name["odd"], 1)
    for v in (by_name["split"].outputs[0], by_name["slice"].outputs[0]):
        assert plan.offset(v) % ALIGN == 0
    same = plan_memory(g, plan.order, sched.workspace_bytes, alias=False)
    check_memory_plan(g, same, program)
    assert plan.naive_bytes < same.naive_bytes
    assert plan_memory(g).arena_bytes == min(plan_alone.arena_bytes, copied.arena_bytes)
    build(tmp_path / "project", "host", quick=True)
    got, _ = run(tmp_path / "project", feeds, target="host")
    for name, r in ref.items():
        c = compare(name, got[name], r, 1e-4)
        assert c.ok, f"{name}: {c.reason or c.error}"


def _two_concats() -> Graph:
    """a, b -> Concat -> c (both in place); d, e -> Concat -> f (both in place); c + f."""
    g = Graph("cats")
    t = TensorType((1, 4, 8, 8), DType.F32)
    x = g.add_input("x", t)
    vals = [
        g.add_node(op, [x], [t], output_names=[n]).outputs[0]
        for op, n in (("Relu", "a"), ("Exp", "b"), ("Tanh", "d"), ("Neg", "e"))
    ]
    ct = TensorType((1, 8, 8, 8), DType.F32)
    c = g.add_node("Concat", vals[:2], [ct], {"axis": 1}, output_names=["c"]).outputs[0]
    f = g.add_node("Concat", vals[2:], [ct], {"axis": 1}, output_names=["f"]).outputs[0]
    g.outputs = [g.add_node("Add", [c, f], [ct], output_names=["y"]).outputs[0]]
    return g


def test_the_checker_catches_broken_aliases() -> None:
    g = _two_concats()
    plan = plan_memory(g, alias=True)
    check_memory_plan(g, plan)
    a, b, d = (next(n.outputs[0] for n in g.nodes if n.outputs[0].name == k) for k in "abd")
    assert plan.concat_inplace == 4 and len(plan.elided) == 2
    assert plan.offset(b) == plan.offset(a) + 4 * 64 * 4
    # An alias outside its base: b moved past the end of c's bytes.
    bad = plan_memory(g, alias=True)
    bad.value_offset[b] = 8 * 64 * 4
    with pytest.raises(PlanError, match="'b' is at offset"):
        check_memory_plan(g, bad)
    # An alias at the wrong slice: a and b swapped.
    bad = plan_memory(g, alias=True)
    bad.value_offset[a], bad.value_offset[b] = 4 * 64 * 4, 0
    with pytest.raises(PlanError, match="where the op puts it"):
        check_memory_plan(g, bad)
    # Two families live together in the same bytes: c's and f's buffers at one offset.
    bad = plan_memory(g, alias=True)
    bad.buffers[bad.value_buffer[d]].offset = bad.offset(a)
    with pytest.raises(PlanError, match="overwrites"):
        check_memory_plan(g, bad)
    # Aliasing claimed for a node that cannot alias.
    bad = plan_memory(g, alias=True)
    bad.elided.add(g.nodes[-1])
    with pytest.raises(PlanError, match="only Concat, Split and Slice"):
        check_memory_plan(g, bad)
    # Without aliases the same graph needs more bytes (c and f copy a, b, d, e).
    assert plan_memory(g, alias=False).naive_bytes > plan.naive_bytes


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["Relu", "Exp", "Add", "Concat", "Split", "Slice"]),
            st.integers(0, 50),
            st.integers(0, 50),
        ),
        min_size=1,
        max_size=20,
    )
)
def test_random_aliasing_dags_check(spec: list[tuple[str, int, int]]) -> None:
    # Channel concats, splits and slices of (1, C, 64) values (256 bytes a channel) among
    # element-wise nodes: every plan, aliases included, passes the checker.
    g = Graph("alias")
    vals = [g.add_input("x", TensorType((1, 2, 64), DType.F32))]
    for k, (op, i, j) in enumerate(spec):
        a, b = vals[i % len(vals)], vals[j % len(vals)]
        ch = a.type.shape[1]
        if op in ("Relu", "Exp"):
            vals.append(g.add_node(op, [a], [a.type], output_names=[f"v{k}"]).outputs[0])
        elif op == "Add" and a.type == b.type:
            vals.append(g.add_node(op, [a, b], [a.type], output_names=[f"v{k}"]).outputs[0])
        elif op == "Concat" and ch + b.type.shape[1] <= 16:
            t = TensorType((1, ch + b.type.shape[1], 64), DType.F32)
            node = g.add_node("Concat", [a, b], [t], {"axis": 1}, output_names=[f"v{k}"])
            vals.append(node.outputs[0])
        elif op == "Split" and ch >= 2:
            t = [TensorType((1, n, 64), DType.F32) for n in (1, ch - 1)]
            split = g.add_constant(f"sp{k}", np.array([1, ch - 1], np.int64))
            node = g.add_node(
                "Split", [a, split], t, {"axis": 1}, output_names=[f"v{k}a", f"v{k}b"]
            )
            vals += node.outputs
        elif op == "Slice" and ch >= 2:
            cs = [
                g.add_constant(f"s{k}{n}", np.array([v], np.int64))
                for n, v in (("s", 1), ("e", ch), ("a", 1))
            ]
            t = TensorType((1, ch - 1, 64), DType.F32)
            vals.append(g.add_node("Slice", [a, *cs], [t], output_names=[f"v{k}"]).outputs[0])
    g.outputs = [vals[-1]]
    verify_graph(g)
    check_memory_plan(g, plan_memory(g))
    plan = plan_memory(g, alias=True)
    check_memory_plan(g, plan)
    assert plan.lower_bound <= plan.arena_bytes
    # A two-stream replay of the same plan's order: even steps on stream 0, odd on 1, each
    # step waiting for the one before (so the order is total but crosses streams).
    from flowc.schedule.program import StreamOp

    ops: list[StreamOp] = []
    for t, node in enumerate(plan.steps):
        if t:
            ops += [StreamOp("record", (t - 1) % 2, event=t), StreamOp("wait", t % 2, event=t)]
        ops.append(StreamOp("run", t % 2, node))
    if len(plan.steps) % 2 == 0 and plan.steps:
        ops += [StreamOp("record", 1, event=0), StreamOp("wait", 0, event=0)]
    check_memory_plan(g, plan, ops)


def test_lifetimes_end_at_the_join_across_streams() -> None:
    # a1 is read by a2 on stream 0, but stream 1 runs b1, b2 unordered with it: a1 lives
    # until y, whose wait joins stream 1 -- the interval the placement and the bound use.
    from test_schedule import _chains, _node, _replay

    graph, unordered, ordered = _chains()
    kb = 16 * 16 * 4
    apart = plan_memory(graph, _replay(unordered))
    check_memory_plan(graph, apart, unordered)
    a1 = apart.buffers[apart.value_buffer[_node(graph, "a1").outputs[0]]]
    assert (a1.start, a1.end, a1.join) == (0, 1, 4)
    assert apart.lower_bound == apart.arena_bytes == 4 * kb
    # With the event ordering a2 before b1, every later step follows a1's last access.
    along = plan_memory(graph, _replay(ordered))
    a1 = along.buffers[along.value_buffer[_node(graph, "a1").outputs[0]]]
    assert (a1.start, a1.end, a1.join) == (0, 1, 2)
    assert along.lower_bound == along.arena_bytes == 3 * kb
    # The checker replays the bound with its own clocks: a bound without the join is wrong.
    apart.lower_bound = 3 * kb
    with pytest.raises(PlanError, match="lower bound"):
        check_memory_plan(graph, apart, unordered)
