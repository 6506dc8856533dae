"""The placement search: the ILP against brute force, the reductions, known optima of the
cost model (data parallel, Megatron, a mixed plan), constraints, the profile file."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from flowc.errors import InputError
from flowc.ir import DType, Graph, Mesh, NdSbp, Sbp, TensorType
from flowc.ir.builder import GraphBuilder
from flowc.ir.graph import Value, make_splat
from flowc.ir.layout import fits, nd_sbps
from flowc.parallel.boxing import BoxingStep
from flowc.parallel.cost import (
    DEFAULT_PROFILE,
    Profile,
    evaluate_plan,
    load_profile,
    node_time,
    step_time,
)
from flowc.parallel.plan import Plan
from flowc.parallel.reduce_graph import CostGraph, Fanout
from flowc.parallel.search import (
    PlacementProblem,
    broadcast_plan,
    data_parallel_plan,
    search,
    solve_cost_graph,
)
from flowc.parallel.strategies import strategies

MESH4 = Mesh("m", (4,))
B1 = NdSbp((Sbp("B"),))
P1 = NdSbp((Sbp("P"),))


def S1(axis: int) -> NdSbp:
    return NdSbp((Sbp("S", axis),))


@pytest.fixture(scope="module")
def profile() -> Profile:
    return load_profile()


# -- the ILP core on abstract cost tables -----------------------------------------------------


class RandomProblem:
    """A random min-cost problem written down independently of CostGraph: vertices with
    choices, pairwise edges along a random DAG, values read by several vertices (boxed once
    per distinct wanted layout) and memory on some vertices."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        n = int(rng.integers(2, 9))
        self.k = [int(rng.integers(1, 4 if n > 6 else 5)) for _ in range(n)]
        self.unary = [rng.integers(0, 50, k).astype(float) for k in self.k]
        self.edges = []
        for v in range(1, n):
            for u in rng.choice(v, size=min(v, int(rng.integers(1, 3))), replace=False):
                self.edges.append((int(u), v, rng.integers(0, 40, (self.k[u], self.k[v])) * 1.0))
                if rng.random() < 0.2:  # a parallel edge
                    self.edges.append((v, int(u), rng.integers(0, 9, (self.k[v], self.k[u])) * 1.0))
        self.fanouts = []
        for _ in range(int(rng.integers(0, 3))):
            if n < 3:
                break
            producer = int(rng.integers(0, n - 2))
            readers = rng.choice(np.arange(producer + 1, n), size=2, replace=False)
            layouts = 3
            cost = rng.integers(1, 30, (layouts, layouts)).astype(float)
            np.fill_diagonal(cost, 0.0)
            src = rng.integers(0, layouts, self.k[producer])
            uses = [(int(c), rng.integers(0, layouts, self.k[c])) for c in readers]
            self.fanouts.append((producer, src, uses, cost))
        self.memory = [
            rng.integers(1, 20, k).astype(float) if rng.random() < 0.4 else None for k in self.k
        ]
        least = sum(m.min() for m in self.memory if m is not None)
        most = sum(m.max() for m in self.memory if m is not None)
        self.limit = float(rng.integers(least, most + 1)) if most > 0 else None

    def cost_graph(self) -> CostGraph:
        cg = CostGraph()
        for u, m in zip(self.unary, self.memory, strict=True):
            cg.add_vertex(u, m)
        for u, v, mat in self.edges:
            cg.add_edge(u, v, mat)
        for producer, src, uses, cost in self.fanouts:
            cg.add_fanout(Fanout(producer, src, uses, cost))
        return cg

    def brute_force(self) -> float:
        """The least cost over every combination of choices within the memory limit."""
        grids = np.meshgrid(*[np.arange(k) for k in self.k], indexing="ij")
        c = [g.reshape(-1) for g in grids]
        total = sum(u[c[v]] for v, u in enumerate(self.unary))
        total = total + sum(m[c[u], c[v]] for u, v, m in self.edges)
        for producer, src, uses, cost in self.fanouts:
            a = src[c[producer]]
            for b in range(cost.shape[1]):
                needed = np.logical_or.reduce([w[c[r]] == b for r, w in uses])
                total = total + needed * cost[a, b]
        if self.limit is not None:
            mem = sum(m[c[v]] for v, m in enumerate(self.memory) if m is not None)
            total = np.where(mem <= self.limit, total, np.inf)
        return float(np.min(total))


@pytest.mark.parametrize("seed", range(60))
def test_ilp_matches_brute_force_on_random_tables(seed: int) -> None:
    prob = RandomProblem(seed)
    want = prob.brute_force()
    cg = prob.cost_graph()
    for reduce_first in (False, True):
        sol = solve_cost_graph(cg, memory_limit=prob.limit, reduce_first=reduce_first)
        assert sol.objective == want, (seed, reduce_first)
        assert prob.limit is None or cg.memory_of(sol.choice) <= prob.limit
        assert sol.stats["optimal"] == 1.0


def test_reductions_remove_chains_leaves_and_parallel_edges() -> None:
    # A path 0-1-2-3 with a parallel edge on 0-1 and a leaf 4 on 2: nothing is left.
    rng = np.random.default_rng(7)
    cg = CostGraph()
    for _ in range(5):
        cg.add_vertex(rng.integers(0, 9, 3).astype(float))
    for u, v in [(0, 1), (1, 0), (1, 2), (2, 3), (4, 2)]:
        cg.add_edge(u, v, rng.integers(0, 9, (3, 3)).astype(float))
    sol = solve_cost_graph(cg)
    assert sol.stats["nodes_after"] == 0 and sol.stats["variables"] == 0
    assert sol.stats["merged_edges"] >= 1 and sol.stats["leaves"] >= 1
    full = solve_cost_graph(cg, reduce_first=False)
    assert sol.objective == full.objective
    best = min(cg.evaluate(list(c)) for c in itertools.product(range(3), repeat=cg.num_vertices))
    assert sol.objective == best


def test_ties_go_to_the_first_choice() -> None:
    cg = CostGraph()
    a = cg.add_vertex([5.0, 5.0, 5.0])
    b = cg.add_vertex([1.0, 0.0, 0.0])
    cg.add_edge(a, b, np.zeros((3, 3)))
    c = cg.add_vertex([2.0, 2.0], memory=[4.0, 4.0])
    d = cg.add_vertex([2.0, 2.0, 1.0])
    cg.add_fanout(
        Fanout(
            c,
            np.array([0, 1]),
            [(a, np.array([0, 0, 0])), (d, np.array([1, 1, 0]))],
            np.zeros((2, 2)),
        )
    )
    # a: all equal, b: 1 and 2 equal, c: equal under the limit, d: 2 is cheapest.
    want = [0, 1, 0, 2]
    for reduce_first in (False, True):
        assert solve_cost_graph(cg, memory_limit=8.0, reduce_first=reduce_first).choice == want


def test_memory_limit_is_exact_to_the_byte() -> None:
    # Two choices a byte apart around a limit of 2e12 bytes: far below the solver's
    # relative tolerance, still told apart.
    for limit, want in [(2 * 10**12 + 1, [0, 1]), (2 * 10**12 + 2, [0, 0])]:
        cg = CostGraph()
        for _ in range(2):
            cg.add_vertex([0.0, 10.0], memory=[10**12 + 1, 10**12])
        sol = solve_cost_graph(cg, memory_limit=limit)
        assert sol.choice == want and cg.memory_of(sol.choice) <= limit


# -- real graphs ------------------------------------------------------------------------------


def mlp(batch: int, d: int, hidden: int, name: str = "") -> tuple[Graph, list[Value]]:
    """y = relu(x @ w1) @ w2 with x [batch, d], w1 [d, hidden], w2 [hidden, d]."""
    g = Graph("mlp")
    b = GraphBuilder(g, fold=False)
    x = g.add_input(f"{name}x", TensorType((batch, d), DType.F32))
    # Fills are held as splats: the search only looks at types, and big weights stay cheap.
    w1 = b.constant(f"{name}w1", make_splat(0.5, (d, hidden), np.dtype(np.float32)))
    w2 = b.constant(f"{name}w2", make_splat(0.25, (hidden, d), np.dtype(np.float32)))
    (h,) = b.emit("MatMul", [x, w1], name=f"{name}mm1")
    (r,) = b.emit("Relu", [h], name=f"{name}relu")
    (y,) = b.emit("MatMul", [r, w2], name=f"{name}mm2")
    g.outputs = [y]
    return g, [x, w1, w2]


def residual(n: int = 8) -> Graph:
    """y = relu(x @ w) + (x @ w): a value read by two nodes."""
    g = Graph("res")
    b = GraphBuilder(g, fold=False)
    x = g.add_input("x", TensorType((n, n), DType.F32))
    w = b.constant("w", np.random.default_rng(1).standard_normal((n, n), np.float32))
    (h,) = b.emit("MatMul", [x, w], name="mm")
    (r,) = b.emit("Relu", [h], name="relu")
    (y,) = b.emit("Add", [r, h], name="add")
    g.outputs = [y, h]
    return g


def all_plans(graph: Graph, mesh: Mesh) -> list[Plan]:
    """Every plan: each input and constant in each layout without P that fits, each node in
    each of its strategies."""
    sources = [*graph.inputs, *graph.constants]
    layouts = [
        [s for s in nd_sbps(v.type.rank, mesh, partial=False) if fits(v.type.shape, s, mesh)]
        for v in sources
    ]
    options = [strategies(n, mesh) for n in graph.nodes]
    plans = []
    for ls in itertools.product(*layouts):
        for ss in itertools.product(*options):
            value_sbp = dict(zip(sources, ls, strict=True))
            for node, s in zip(graph.nodes, ss, strict=True):
                value_sbp.update((o, s.output(j)) for j, o in enumerate(node.outputs))
            plans.append(Plan(mesh, dict(zip(graph.nodes, ss, strict=True)), value_sbp))
    return plans


@pytest.mark.parametrize(
    ("graph", "mesh", "limit"),
    [
        (residual(8), Mesh("m", (2,)), None),
        (residual(8), MESH4, 200),
        (mlp(8, 4, 8)[0], Mesh("m", (2,)), None),
        (mlp(64, 512, 2048)[0], MESH4, 3 * 2**20),
    ],
    ids=["residual-2", "residual-4-limit", "mlp-2", "mlp-4-limit"],
)
def test_search_matches_brute_force_on_real_graphs(
    graph: Graph, mesh: Mesh, limit: int | None, profile: Profile
) -> None:
    costs = [evaluate_plan(graph, p, profile) for p in all_plans(graph, mesh)]
    best = min(c.total_s for c in costs if limit is None or c.param_bytes <= limit)
    plan = search(graph, mesh, profile, param_limit=limit)
    plan.check(graph)
    got = evaluate_plan(graph, plan, profile)
    # Plans are compared at 1 ns resolution.
    assert got.total_s == pytest.approx(best, abs=1e-8)
    assert limit is None or got.param_bytes <= limit
    assert plan.stats["objective_s"] == pytest.approx(got.total_s, rel=1e-12)
    problem = PlacementProblem(graph, mesh, profile)
    full = solve_cost_graph(problem.cg, memory_limit=limit, resolution=1e-9, reduce_first=False)
    assert full.objective == pytest.approx(got.total_s, abs=1e-8)


def test_data_parallel_when_the_batch_is_large(profile: Profile) -> None:
    # With a 1024-wide hidden layer each rank saves 3/4 of ~40 us of work for one 1.5 MB
    # all-gather of the output. (A 128-wide hidden layer does too little work for that;
    # see the next test.)
    g, (x, w1, w2) = mlp(4096, 128, 1024)
    plan = search(g, MESH4, profile)
    assert plan.value_sbp[x] == S1(0)
    assert plan.value_sbp[w1] == B1 and plan.value_sbp[w2] == B1
    steps = evaluate_plan(g, plan, profile).boxing
    assert [(v, who, s.collective) for v, who, s in steps] == [(g.outputs[0], None, "all-gather")]
    dp = data_parallel_plan(g, MESH4, profile)
    assert dp.value_sbp == plan.value_sbp and dp.method == "data"
    auto_s = evaluate_plan(g, plan, profile).total_s
    assert auto_s < evaluate_plan(g, broadcast_plan(g, MESH4), profile).total_s


def test_small_mlp_stays_whole(profile: Profile) -> None:
    # batch 1024, hidden 128: each matmul is ~0.5 us of work, less than the launch overhead
    # and the alpha of the all-gather splitting would need, so every rank computes it all.
    g, _ = mlp(1024, 128, 128)
    plan = search(g, MESH4, profile)
    assert set(plan.value_sbp.values()) == {B1}
    auto_s = evaluate_plan(g, plan, profile).total_s
    assert auto_s < evaluate_plan(g, data_parallel_plan(g, MESH4, profile), profile).total_s
    assert auto_s == evaluate_plan(g, broadcast_plan(g, MESH4), profile).total_s


def test_megatron_under_a_parameter_limit(profile: Profile) -> None:
    g, (_, w1, w2) = mlp(1, 8192, 8192)
    weights = w1.type.nbytes + w2.type.nbytes
    plan = search(g, MESH4, profile, param_limit=weights // 2)
    assert plan.value_sbp[w1] == S1(1) and plan.value_sbp[w2] == S1(0)
    cost = evaluate_plan(g, plan, profile)
    assert cost.param_bytes == weights // 4
    # The only collective: the output's all-reduce of 1 x 8192 f32 (2(p-1)/p of it per rank).
    assert [(s.collective, s.bytes_per_rank) for _, _, s in cost.boxing] == [
        ("all-reduce", 2 * 3 * 8192 * 4 // 4)
    ]
    assert cost.total_s < evaluate_plan(g, broadcast_plan(g, MESH4), profile).total_s
    with pytest.raises(InputError, match=r"input 'x' \(f32\[1, 8192\]\).*its batch is 1"):
        data_parallel_plan(g, MESH4, profile)


def test_mixed_plan_beats_every_uniform_plan(profile: Profile) -> None:
    """Two MLPs side by side: a wide batch with small weights (data parallel wins) and a
    small batch with large weights (tensor parallel wins). Only a mixed plan gets both."""
    ga, (xa, a1, a2) = mlp(4096, 128, 1024, "a")
    gb, (xb, b1, b2) = mlp(8, 8192, 8192, "b")
    g = Graph("mixed")
    g.inputs = [xa, xb]
    g.constants = [*ga.constants, *gb.constants]
    g.nodes = [*ga.nodes, *gb.nodes]
    g.outputs = [*ga.outputs, *gb.outputs]
    auto = search(g, MESH4, profile)
    assert auto.value_sbp[xa] == S1(0) and auto.value_sbp[a1] == B1
    assert auto.value_sbp[b1] == S1(1) and auto.value_sbp[b2] == S1(0)
    megatron = {a1: S1(1), a2: S1(0), b1: S1(1), b2: S1(0)}
    others = {
        "data": data_parallel_plan(g, MESH4, profile),
        "broadcast": broadcast_plan(g, MESH4),
        "tensor": search(g, MESH4, profile, fixed=megatron),
    }
    auto_s = evaluate_plan(g, auto, profile).total_s
    for name, plan in others.items():
        assert auto_s < evaluate_plan(g, plan, profile).total_s - 1e-6, name


def test_two_dimensional_mesh(profile: Profile) -> None:
    mesh = Mesh("m", (2, 2))
    g, (x, _, _) = mlp(4096, 128, 1024)
    dp = data_parallel_plan(g, mesh, profile)
    assert dp.value_sbp[x] == NdSbp((Sbp("S", 0), Sbp("S", 0)))
    auto = search(g, mesh, profile)
    auto.check(g)
    auto_s = evaluate_plan(g, auto, profile).total_s
    assert auto_s <= evaluate_plan(g, dp, profile).total_s
    assert auto_s <= evaluate_plan(g, broadcast_plan(g, mesh), profile).total_s
    again = search(g, mesh, profile)
    assert [str(s) for s in again.node_strategy.values()] == [
        str(s) for s in auto.node_strategy.values()
    ]
    assert again.value_sbp == auto.value_sbp


def test_fixed_placements_are_kept(profile: Profile) -> None:
    g, (x, w1, _) = mlp(4096, 128, 1024)
    h = g.nodes[0].outputs[0]
    plan = search(g, MESH4, profile, fixed={w1: S1(1), h: S1(1)})
    assert plan.value_sbp[w1] == S1(1) and plan.value_sbp[h] == S1(1)
    plan.check(g)
    dp = data_parallel_plan(g, MESH4, profile, fixed={x: B1})
    assert dp.value_sbp[x] == B1
    relu = g.nodes[1].outputs[0]
    with pytest.raises(InputError, match="Relu node 'relu' cannot produce 'relu:0' as P"):
        search(g, MESH4, profile, fixed={relu: P1})
    with pytest.raises(InputError, match="graph input 'x' cannot be placed as P"):
        search(g, MESH4, profile, fixed={x: P1})
    with pytest.raises(InputError, match="has 2 entries but mesh"):
        search(g, MESH4, profile, fixed={x: NdSbp((Sbp("B"), Sbp("B")))})


def test_unreachable_parameter_limit(profile: Profile) -> None:
    g, (_, w1, w2) = mlp(8, 64, 64)
    least = (w1.type.nbytes + w2.type.nbytes) // 4
    with pytest.raises(InputError, match=f"within {least - 1} bytes.*smallest possible is {least}"):
        search(g, MESH4, profile, param_limit=least - 1)
    plan = search(g, MESH4, profile, param_limit=least)
    assert evaluate_plan(g, plan, profile).param_bytes == least


# -- the cost model ---------------------------------------------------------------------------


def test_node_time_divides_the_work(profile: Profile) -> None:
    g, _ = mlp(1024, 1024, 1024)
    mm = g.nodes[0]
    by_sig = {str(s): node_time(mm, s, MESH4, profile) for s in strategies(mm, MESH4)}
    n = 1024
    whole = max(2 * n**3 / 67e12, 3 * n * n * 4 / 4.3e12) + 3e-6
    assert by_sig["(B, B) -> (B)"] == pytest.approx(whole)
    # Splitting the contraction: a quarter of the FLOPs on [n, n/4] x [n/4, n] -> [n, n] P.
    k_split = max(2 * n**3 / 4 / 67e12, (2 * n * n // 4 + n * n) * 4 / 4.3e12) + 3e-6
    assert by_sig["(S(1), S(0)) -> (P)"] == pytest.approx(k_split)
    # A partial operand is full-shape: all of the work.
    assert by_sig["(P, B) -> (P)"] == pytest.approx(whole)


def test_step_time_and_axis_overrides(tmp_path: Path, profile: Profile) -> None:
    t = TensorType((1024, 1024), DType.F32)
    mesh = Mesh("m", (2, 4))
    gather = BoxingStep(
        "all-gather", 0, NdSbp((Sbp("S", 0), Sbp("B"))), NdSbp((Sbp("B"), Sbp("B"))), 2, 2**21
    )
    assert step_time(gather, profile, t, mesh) == pytest.approx(5e-6 + 2**21 / 450e9)
    text = DEFAULT_PROFILE.read_text() + "\n[mesh_axis.0]\nalpha = 20e-6\nbandwidth = 50e9\n"
    (tmp_path / "ib.toml").write_text(text)
    ib = load_profile(tmp_path / "ib.toml")
    assert step_time(gather, ib, t, mesh) == pytest.approx(20e-6 + 2**21 / 50e9)
    on_axis1 = BoxingStep("all-gather", 1, gather.src, gather.src, 4, 2**20)
    assert step_time(on_axis1, ib, t, mesh) == pytest.approx(5e-6 + 2**20 / 450e9)
    slice_ = BoxingStep("local-slice", 1, gather.dst, NdSbp((Sbp("B"), Sbp("S", 1))), 4, 0)
    assert step_time(slice_, ib, t, mesh) == pytest.approx(3e-6 + 2 * 2**20 / 4.3e12)


def test_default_profile_numbers(profile: Profile) -> None:
    assert profile.name == "h200-nvlink"
    assert profile.flop_rate("f32", matmul=False) == 67e12
    assert profile.flop_rate("f32", matmul=True) == 67e12
    assert profile.flop_rate("bf16", matmul=True) == 780e12
    assert profile.flop_rate("i32", matmul=False) == 67e12
    assert profile.memory_bandwidth == 4.3e12
    assert profile.axis_link(0).bandwidth == 450e9 and profile.axis_link(3).alpha == 5e-6


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name = 'x'\n[memory\n", "not valid TOML"),
        ("[compute]\ndefault = 1e12\n", r"missing table \[matmul\]"),
        (None, r"\[collective\] needs a number 'alpha'"),
        (None, r"\[memory\] bandwidth must be a number from 1 to 1e\+21, got -1"),
        ("[mesh_axis.first]\nalpha = 1\nbandwidth = 1\n", "named by a mesh axis number"),
    ],
)
def test_malformed_profiles(tmp_path: Path, text: str | None, message: str) -> None:
    base = DEFAULT_PROFILE.read_text()
    if text is None:
        text = (
            base.replace("alpha = 5e-6", "")
            if "alpha" in message
            else base.replace("bandwidth = 4.3e12", "bandwidth = -1")
        )
    elif not text.startswith("name") and "mesh_axis" in text:
        text = base + text
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(InputError, match=message) as info:
        load_profile(path)
    assert "shipped profile" in str(info.value)
    with pytest.raises(InputError, match="cannot read cost profile"):
        load_profile(tmp_path / "missing.toml")


def deep_mlp(layers: int, d: int) -> Graph:
    """x -> (relu(h @ w_k)) repeated: many constants competing for one memory budget."""
    g = Graph("deep")
    b = GraphBuilder(g, fold=False)
    h = g.add_input("x", TensorType((4, d), DType.F32))
    rng = np.random.default_rng(3)
    for k in range(layers):
        w = b.constant(f"w{k}", rng.standard_normal((d, d), np.float32))
        (h,) = b.emit("MatMul", [h, w], name=f"mm{k}")
        (h,) = b.emit("Relu", [h], name=f"relu{k}")
    g.outputs = [h]
    return g


def test_priced_memory_search_fits_and_stays_near_the_optimum(
    profile: Profile, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flowc.parallel.search as search_mod

    mesh = Mesh("m", (2, 2))
    g = deep_mlp(6, 64)
    weights = sum(c.type.nbytes for c in g.constants)
    limit = weights // 3
    exact = search(g, mesh, profile, param_limit=limit)
    assert exact.stats["optimal"] == 1.0 and "gap_s" not in exact.stats
    monkeypatch.setattr(search_mod, "EXACT_LIMITED_VARIABLES", 0)
    priced = search(g, mesh, profile, param_limit=limit)
    again = search(g, mesh, profile, param_limit=limit)
    assert priced.value_sbp == again.value_sbp  # deterministic
    best = evaluate_plan(g, exact, profile)
    got = evaluate_plan(g, priced, profile)
    assert got.param_bytes <= limit
    assert best.total_s <= got.total_s + 1e-12
    # The dual bound: no plan within the limit is cheaper than cost - gap.
    assert got.total_s - priced.stats["gap_s"] <= best.total_s + 1e-9


def test_issue_sizes_choose_data_parallel_on_a_slower_device(tmp_path: Path) -> None:
    # batch 1024, hidden 128 on a device 30x slower than an H200 (a profile like a CPU or
    # a small GPU would have): the work now outweighs one all-gather, so auto is data
    # parallel and gathering the output is the only communication.
    from flowc.parallel.cost import DEFAULT_PROFILE

    text = DEFAULT_PROFILE.read_text().replace("67e12", "2e12").replace("4.3e12", "0.15e12")
    slow = tmp_path / "slow.toml"
    slow.write_text(text)
    prof = load_profile(slow)
    g, (x, w1, w2) = mlp(1024, 128, 128)
    plan = search(g, MESH4, prof)
    assert plan.value_sbp[x] == S1(0)
    assert plan.value_sbp[w1] == B1 and plan.value_sbp[w2] == B1
    steps = evaluate_plan(g, plan, prof).boxing
    assert [(who, s.collective) for _, who, s in steps] == [(None, "all-gather")]


def test_elimination_takes_a_value_read_by_a_hundred_single_choice_nodes() -> None:
    """A training step's step counter is read by every parameter's update, most of them
    left with one choice: elimination's tables hold only vertices with a choice to make
    (a table over 100 axes of size 1 is past NumPy's 64 dimensions)."""
    from flowc.parallel.reduce_graph import eliminate_all

    readers = 100
    unary = [np.array([0.0, 1.0]), *([np.array([0.5])] * readers), np.array([0.2, 0.0])]
    last = readers + 1
    # Layout 0 or 1 from the producer; every reader wants layout 1 (boxing 0 -> 1 costs 3).
    fan = Fanout(0, np.array([0, 1]), [(r, np.array([1])) for r in range(1, readers + 1)],
                 np.array([[0.0, 3.0], [3.0, 0.0]]))  # fmt: skip
    edges = {(0, last): np.array([[0.0, 2.0], [2.0, 0.0]])}
    got = eliminate_all(unary, edges, [fan], list(range(readers + 2)))
    assert got is not None
    choice, _ = got
    # Producer 1 (cost 1, no boxing) and the last vertex 1 (0 + edge 0) beat 0 (3 + 0.2).
    assert choice[0] == 1 and choice[last] == 1
    assert all(choice[r] == 0 for r in range(1, readers + 1))


def test_elimination_gives_up_on_a_fanout_too_wide_to_tabulate() -> None:
    """70 readers of two choices each: 2**70 entries (past int64, where a NumPy product
    wraps to 0) is past the table limit, so elimination declines and the ILP solves it."""
    from flowc.parallel.reduce_graph import eliminate_all

    readers = 70
    unary = [np.array([0.0, 1.0]), *([np.array([0.0, 0.5])] * readers)]
    fan = Fanout(0, np.array([0, 1]), [(r, np.array([0, 1])) for r in range(1, readers + 1)],
                 np.array([[0.0, 3.0], [3.0, 0.0]]))  # fmt: skip
    assert eliminate_all(unary, {}, [fan], list(range(readers + 1))) is None
