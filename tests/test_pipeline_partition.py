"""Pipeline stage partition (flowc/schedule/partition.py): the dynamic program against brute
force over every cut on small random chains and DAGs (with and without a memory limit), the
values sent over each cut (skip connections relayed), manual boundaries and their errors, and
the balance on the GPT-2-small-size generator graph."""

from __future__ import annotations

import dataclasses
import itertools
import random
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import REPO

from flowc.errors import FlowcWarning, InputError
from flowc.frontend import load_graph
from flowc.ir.dtype import DType
from flowc.ir.graph import Graph, Node, Value
from flowc.ir.types import TensorType
from flowc.parallel.cost import Link, load_profile
from flowc.passes.manager import PassManager
from flowc.schedule.partition import parse_stage_boundaries, partition, single_device_time

PROFILE = load_profile()
LINK: Link = PROFILE.axis_link(0)


def f32(n: int) -> TensorType:
    return TensorType((n,), DType.F32)


def random_graph(rng: random.Random, chain: bool) -> tuple[Graph, dict[Node, float]]:
    """A graph of 4..9 nodes (Relu, Add, Reshape views) over 1-2 inputs and a few constants,
    with a random time per node. ``chain``: every node reads the node before it (and maybe a
    constant); otherwise any earlier value, so skip connections cross several cuts."""
    g = Graph("random")
    made: list[Value] = [
        g.add_input(f"x{i}", f32(rng.randint(1, 64))) for i in range(rng.randint(1, 2))
    ]
    consts = [
        g.add_constant(f"w{i}", np.zeros(rng.randint(1, 256), np.float32))
        for i in range(rng.randint(1, 3))
    ]
    times: dict[Node, float] = {}
    for k in range(rng.randint(4, 9)):
        last = made[-1]
        op = rng.choice(["Relu", "Add", "Add", "Reshape"])
        first = last if chain or k == 0 else rng.choice(made)
        if op == "Relu":
            ins = [first]
        elif op == "Add":
            other = rng.choice(consts) if chain or rng.random() < 0.3 else rng.choice(made)
            ins = [first, other]
        else:
            ins = [first, rng.choice(consts)]
        size = first.type.shape[0] if op == "Reshape" else rng.randint(1, 64)
        node = g.add_node(op, list(ins), [f32(size)], name=f"n{k}", output_names=[f"v{k}"])
        times[node] = rng.uniform(1e-6, 2e-5)
        made.append(node.outputs[0])
    outs = [made[-1]]
    if rng.random() < 0.5:
        outs.append(rng.choice(made[len(g.inputs) : -1]))
    g.outputs = outs
    return g, times


def _buffers(g: Graph) -> list[tuple[int, int, bool, int]]:
    """Per buffer (a value and its views): made at, last node reader, a graph output, bytes."""
    groups: dict[Value, list[Value]] = {}
    root: dict[Value, Value] = {}
    made: dict[Value, int] = {v: -1 for v in g.inputs}
    for k, node in enumerate(g.nodes):
        o = node.outputs[0]
        made[o] = k
        src = node.inputs[0]
        if node.op == "Reshape" and o not in g.outputs and src is not None and not src.is_const:
            root[o] = root.get(src, src)
    for v in made:
        groups.setdefault(root.get(v, v), []).append(v)
    out = []
    for r, members in groups.items():
        readers = [k for k, n in enumerate(g.nodes) for m in members if m in n.inputs]
        last = max([made[m] for m in members] + readers)
        out.append((made[r], last, any(m in g.outputs for m in members), r.type.nbytes))
    return out


def brute_stage_costs(
    g: Graph, times: dict[Node, float], starts: list[int]
) -> tuple[list[float], list[float]]:
    """Per stage: time (compute + sends and receives), memory (params + peak activations),
    straight from the definitions."""
    nodes = g.nodes
    n = len(nodes)
    ends = [*starts[1:], n]

    def cut_time(c: int) -> float:
        t = 0.0
        for node in nodes[:c]:
            for o in node.outputs:
                if any(o in later.inputs for later in nodes[c:]):
                    t += LINK.alpha + o.type.nbytes / LINK.bandwidth
        return t

    bufs = _buffers(g)
    stage_t, stage_m = [], []
    for b, e in zip(starts, ends, strict=True):
        t = sum(times[nd] for nd in nodes[b:e])
        t += (cut_time(b) if b > 0 else 0.0) + (cut_time(e) if e < n else 0.0)
        params = sum(
            {
                c.name: c.type.nbytes
                for nd in nodes[b:e]
                for c in nd.inputs
                if c is not None and c.is_const
            }.values()
        )
        peak = 0
        for step in range(b, e):
            live = sum(
                nb
                for p, last, is_out, nb in bufs
                if max(p, b) <= step and (step <= last or (is_out and p >= b))
            )
            peak = max(peak, live)
        stage_t.append(t)
        stage_m.append(params + peak)
    return stage_t, stage_m


def all_partitions(n: int, stages: int) -> list[list[int]]:
    return [[0, *cuts] for cuts in itertools.combinations(range(1, n), stages - 1)]


@pytest.mark.parametrize("seed", range(40))
def test_dp_is_optimal_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    g, times = random_graph(rng, chain=seed % 2 == 0)
    n = len(g.nodes)
    stages = rng.randint(1, min(4, n))
    table = {tuple(s): brute_stage_costs(g, times, s) for s in all_partitions(n, stages)}
    best = min(max(t) for t, _ in table.values())
    got = partition(g, stages, PROFILE, node_time_fn=times.__getitem__)
    assert got.max_s == pytest.approx(best, rel=1e-9)
    # The reported figures are the partition's own, recomputed here.
    want_t, want_m = table[tuple(got.starts)]
    assert got.stage_s == pytest.approx(want_t, rel=1e-9)
    assert got.memory_bytes() == want_m
    assert got.node_stage == sorted(got.node_stage) and len(got.node_stage) == n
    # Under a memory limit: the best of the partitions that fit, or a clear error when none.
    mems = sorted({max(m) for _, m in table.values()})
    limit = mems[len(mems) // 2]
    fits = [max(t) for t, m in table.values() if max(m) <= limit]
    got = partition(g, stages, PROFILE, mem_limit=limit, node_time_fn=times.__getitem__)
    assert got.max_s == pytest.approx(min(fits), rel=1e-9)
    assert max(got.memory_bytes()) <= limit
    if mems[0] > 1:
        with pytest.raises(InputError, match="no partition of the graph into") as e:
            partition(g, stages, PROFILE, mem_limit=mems[0] - 1, node_time_fn=times.__getitem__)
        assert e.value.hint is not None and f"at least {mems[0]} bytes" in e.value.hint


def skip_graph() -> Graph:
    """v0 = relu(x); v1 = relu(v0); v2 = relu(v1) + w; v3 = v2 + v0 (the skip)."""
    g = Graph("skip")
    x = g.add_input("x", f32(1000))
    w = g.add_constant("w", np.ones(1000, np.float32))
    v0 = g.add_node("Relu", [x], [f32(1000)], name="a", output_names=["v0"]).outputs[0]
    v1 = g.add_node("Relu", [v0], [f32(1000)], name="b", output_names=["v1"]).outputs[0]
    v2 = g.add_node("Add", [v1, w], [f32(1000)], name="c", output_names=["v2"]).outputs[0]
    v3 = g.add_node("Add", [v2, v0], [f32(1000)], name="d", output_names=["v3"]).outputs[0]
    g.outputs = [v3]
    return g


def test_skip_connections_are_relayed_over_every_cut() -> None:
    g = skip_graph()
    p = partition(g, 3, PROFILE, boundaries=["v0", "v1"])
    assert p.manual and p.starts == [0, 1, 2] and p.node_stage == [0, 1, 2, 2]
    sent = [[(b.value, b.src, b.dst, b.nbytes) for b in cut] for cut in p.boundaries]
    assert sent == [[("v0", 0, 1, 4000)], [("v0", 1, 2, 4000), ("v1", 1, 2, 4000)]]
    one = LINK.alpha + 4000 / LINK.bandwidth
    assert p.cut_s == pytest.approx([one, 2 * one])
    node_s = [single_device_time(n, PROFILE) for n in g.nodes]
    assert p.compute_s == pytest.approx([node_s[0], node_s[1], node_s[2] + node_s[3]])
    assert p.stage_s == pytest.approx(
        [node_s[0] + one, node_s[1] + 3 * one, node_s[2] + node_s[3] + 2 * one]
    )
    # Stage 0: x and v0 (sent on); stage 1: v0 (relayed) and v1; stage 2 holds w, and while c
    # runs v0 and v1 (received) and v2, then v0, v2 and v3: 3 buffers of 4000 bytes.
    assert p.param_bytes == [0, 0, 4000]
    assert p.activation_bytes == [8000, 8000, 12000]
    assert p.ratio == pytest.approx(max(p.stage_s) / (sum(p.stage_s) / 3))


def test_single_device_time_is_the_cost_model_on_one_device() -> None:
    g = Graph("mm")
    a = g.add_input("a", TensorType((64, 128), DType.F32))
    b = g.add_input("b", TensorType((128, 256), DType.F32))
    node = g.add_node("MatMul", [a, b], [TensorType((64, 256), DType.F32)])
    flops = 2 * 64 * 128 * 256
    nbytes = 4 * (64 * 128 + 128 * 256 + 64 * 256)
    want = max(flops / PROFILE.flop_rate("f32", True), nbytes / PROFILE.memory_bandwidth)
    assert single_device_time(node, PROFILE) == pytest.approx(want + PROFILE.launch_overhead)


def test_a_slow_link_moves_the_cut_to_the_narrow_value() -> None:
    # Equal nodes; the cut after node 1 sends v0 and v1 (the skip), after node 2 only v2 and
    # v0; with a slow link the cheapest crossing wins over the balance.
    g = skip_graph()
    slow = dataclasses.replace(PROFILE, link=Link(1e-3, 1e9), mesh_axis={})
    p = partition(g, 2, slow, node_time_fn=lambda n: 1e-5)
    assert p.starts == [0, 1]  # only v0 crosses cut 1
    assert [b.value for b in p.boundaries[0]] == ["v0"]


def test_manual_boundary_errors() -> None:
    g = skip_graph()
    with pytest.raises(
        InputError, match=r"names 1 value\(s\) for 3 pipeline stages; 3 stages need 2"
    ):
        partition(g, 3, PROFILE, boundaries=["v0"])
    with pytest.raises(InputError, match="'v00': the graph has no value of that name") as e:
        partition(g, 2, PROFILE, boundaries=["v00"])
    assert e.value.hint is not None and "'v0'" in e.value.hint
    with pytest.raises(InputError, match="'x' is a graph input or a constant"):
        partition(g, 2, PROFILE, boundaries=["x"])
    with pytest.raises(
        InputError, match=r"'v0' .* is made at or before 'v1'.*in the graph's order"
    ):
        partition(g, 3, PROFILE, boundaries=["v1", "v0"])
    with pytest.raises(InputError, match="is made at or before 'v1'"):
        partition(g, 3, PROFILE, boundaries=["v1", "v1"])
    with pytest.raises(InputError, match="'v3' is made by the graph's last node"):
        partition(g, 2, PROFILE, boundaries=["v3"])
    with pytest.raises(InputError, match="every stage needs at least one node"):
        partition(g, 5, PROFILE)
    with pytest.raises(InputError, match="stage 2 of --stage-boundary needs"):
        partition(g, 3, PROFILE, boundaries=["v0", "v1"], mem_limit=10000)
    assert parse_stage_boundaries(" v0, v1 ") == ["v0", "v1"]
    with pytest.raises(InputError, match="expected value names separated by commas"):
        parse_stage_boundaries("v0,,v1")


def gpt2_small(tmp: Path) -> Graph:
    """The generator's GPT-2 small (fill weights) as flowc reads it for placement."""
    sys.path.insert(0, str(REPO / "bench"))
    from gpt2_graph import gpt2_model

    model = gpt2_model(12, 768, 12, 128, 1, 50257, weights="fill")
    path = tmp / "gpt2_small_fill.onnx"
    onnx.save(model, str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlowcWarning)
        g = load_graph(path)
    return PassManager(("fold_constants", "simplify", "split_projections")).run(g)


def test_gpt2_small_partition_is_balanced(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    g = gpt2_small(tmp_path)
    assert time.perf_counter() - t0 < 5
    for stages in (2, 4):
        p = partition(g, stages, PROFILE)
        assert p.ratio <= 1.05, p.summary()
        # Between blocks the residual stream alone crosses: [1, 128, 768] f32 each.
        assert all(cut for cut in p.boundaries)


STAGED = """graph mlp(x: f32[8, 64]) -> (y: f32[8, 10]) {
    param w1: f32[64, 256] = normal(0.0, 0.125)
    param w2: f32[256, 10] = normal(0.0, 0.0625)
    stage {a} {
        h = relu(x @ w1)
    }
    stage {b} {
        y = softmax(h @ w2, axis=-1)
    }
    return y
}
"""


def staged(tmp_path: Path, a: int, b: int) -> Graph:
    path = tmp_path / f"staged_{a}_{b}.flow"
    path.write_text(STAGED.replace("{a}", str(a)).replace("{b}", str(b)))
    return load_graph(path)


def test_dsl_stage_blocks_give_the_partition(tmp_path: Path) -> None:
    g = staged(tmp_path, 0, 1)
    p = partition(g, 2, PROFILE, node_stages=True)
    assert p.manual
    assert [n.stage for n in g.nodes] == p.node_stage
    # Stage 0 ends with relu, whose output h is all that crosses (x and the weights do not).
    assert [b.value for b in p.boundaries[0]] == [g.nodes[p.starts[1] - 1].outputs[0].name]
    assert p.boundaries[0][0].nbytes == 8 * 256 * 4
    with pytest.raises(InputError, match="numbered 0, 1, but the pipeline has 3 stages"):
        partition(g, 3, PROFILE, node_stages=True)
    with pytest.raises(InputError, match="cannot be combined"):
        partition(g, 2, PROFILE, node_stages=True, boundaries=["x"])
    with pytest.raises(InputError, match="stage blocks out of order"):
        partition(staged(tmp_path, 1, 0), 2, PROFILE, node_stages=True)
    with pytest.raises(InputError, match="numbered 0, 2"):
        partition(staged(tmp_path, 0, 2), 2, PROFILE, node_stages=True)
    with pytest.raises(InputError, match="no stage blocks"):
        partition(skip_graph(), 2, PROFILE, node_stages=True)
