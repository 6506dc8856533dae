"""The placement search is reproducible and honest: the same graph gives the same plan in
any process and environment (a node limit, never a wall clock, stops the solver), a plan
the solver could not prove optimal says how far off it may be, and it is never worse than
the uniform plans. Graphs come from bench/gpt2_graph.py."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import warnings
from pathlib import Path

import onnx
import pytest
from rich.console import Console

from flowc.compiler import parallelize
from flowc.errors import FlowcWarning
from flowc.frontend import load_graph
from flowc.ir.graph import Graph
from flowc.ir.types import Mesh
from flowc.parallel import ParallelOptions
from flowc.parallel.cost import Profile, evaluate_plan, load_profile
from flowc.parallel.plan import Plan
from flowc.parallel.search import (
    PlacementProblem,
    broadcast_plan,
    data_parallel_plan,
    search,
    solve_cost_graph,
)
from flowc.passes.manager import PassManager
from flowc.report.plan import print_plan

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
from gpt2_graph import gpt2_model  # noqa: E402

MESH = Mesh("gpus", (2, 2))


@functools.cache
def gpt2(layers: int, hidden: int, heads: int, seq: int, batch: int, vocab: int) -> Graph:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt2.onnx"
        onnx.save(gpt2_model(layers, hidden, heads, seq, batch, vocab, weights="fill"), str(path))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FlowcWarning)
            g = load_graph(path)
    return PassManager(("fold_constants", "simplify", "split_projections")).run(g)


# One small GPT-2 block with embeddings and head; batch 4, so that data parallelism is
# possible on 4 devices.
SMALL = (1, 64, 4, 16, 4, 128)


@pytest.fixture(scope="module")
def profile() -> Profile:
    return load_profile()


def serialized(graph: Graph, plan: Plan) -> str:
    """Every layout and strategy of a plan, one line each, in graph order."""
    lines = [f"{v.name} {plan.value_sbp[v]}" for v in [*graph.inputs, *graph.constants]]
    for node in graph.nodes:
        lines.append(f"{node.name} {plan.node_strategy[node]}")
        lines.extend(f"  {o.name} {plan.value_sbp[o]}" for o in node.outputs)
    return "\n".join(lines) + "\n"


CHILD = """
import os, sys
sys.path.insert(0, {bench!r})
sys.path.insert(0, {tests!r})
os.sched_setaffinity(0, {{min(os.sched_getaffinity(0))}})  # one CPU for this process
import test_search_determinism as t
from flowc.parallel.cost import load_profile
from flowc.parallel.search import search
g = t.gpt2(*t.SMALL)
sys.stdout.write(t.serialized(g, search(g, t.MESH, load_profile())))
"""


def test_same_graph_same_plan_in_any_process(profile: Profile) -> None:
    g = gpt2(*SMALL)
    first = search(g, MESH, profile)
    assert first.stats["optimal"] == 1.0 and first.stats["reproducible"] == 1.0
    text = serialized(g, first)
    assert serialized(g, search(g, MESH, profile)) == text
    # Another process on one CPU, another hash seed, one OpenMP/BLAS thread: byte-identical.
    env = {**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1"}
    env["OPENBLAS_NUM_THREADS"] = "1"
    script = CHILD.format(bench=str(BENCH), tests=str(Path(__file__).parent))
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == text


def test_small_gpt2_from_the_generator_is_proven_optimal(profile: Profile) -> None:
    # One GPT-2-small block (hidden 768, 12 heads, seq 128) on 2x2.
    g = gpt2(1, 768, 12, 128, 1, 0)
    plan = search(g, MESH, profile)
    assert plan.stats["optimal"] == 1.0 and plan.stats["gap"] == 0.0
    auto = evaluate_plan(g, plan, profile).total_s
    assert plan.stats["objective_s"] == pytest.approx(auto, rel=1e-12)
    assert auto < evaluate_plan(g, broadcast_plan(g, MESH), profile).total_s


def test_an_unproven_search_is_never_worse_than_a_uniform_plan(profile: Profile) -> None:
    g = gpt2(*SMALL)
    uniform = {
        "data": evaluate_plan(g, data_parallel_plan(g, MESH, profile), profile).total_s,
        "none": evaluate_plan(g, broadcast_plan(g, MESH), profile).total_s,
        "data on axis 1": evaluate_plan(
            g, data_parallel_plan(g, MESH, profile, axes=(1,)), profile
        ).total_s,
    }
    best = search(g, MESH, profile).stats["objective_s"]
    for nodes in (0, 1):
        # No branch and bound at all (0), or the root only (1): whatever the solver has then.
        plan = search(g, MESH, profile, node_limit=nodes)
        plan.check(g)
        got = evaluate_plan(g, plan, profile).total_s
        for name, t in uniform.items():
            assert got <= t * (1 + 1e-12), (nodes, name)
        if not plan.stats["optimal"]:
            # The bound holds: the proven optimum is no cheaper than objective - gap.
            assert got - plan.stats["gap_s"] <= best + 1e-12
            assert plan.stats["gap"] == pytest.approx(plan.stats["gap_s"] / got)
    assert search(g, MESH, profile, node_limit=0).stats["optimal"] == 0.0


def printed(result: object, graph: Graph) -> str:
    console = Console(record=True, width=200, file=open(os.devnull, "w"))  # noqa: SIM115
    print_plan(console, graph, result, [], None)  # type: ignore[arg-type]
    return console.export_text()


def test_the_printout_says_when_a_plan_is_unproven_or_not_reproducible(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import flowc.parallel.search as search_mod

    g = gpt2(*SMALL)
    proven = parallelize(g, ParallelOptions(MESH, "auto"))
    text = printed(proven, g)
    assert "proven optimal" in text and "NOT PROVEN" not in text
    assert proven.proven_optimal and proven.gap == 0.0 and proven.reproducible

    unproven = parallelize(g, ParallelOptions(MESH, "auto", node_limit=0))
    assert not unproven.proven_optimal and 0 < unproven.gap < float("inf")
    text = printed(unproven, g)
    line = next(x for x in text.splitlines() if "NOT PROVEN OPTIMAL" in x)
    assert f"within {unproven.gap * 100:.2f}% (" in line and "node limit 0 reached" in line
    assert "NOT REPRODUCIBLE" not in text

    # A wall-clock stop (here: no time at all) makes the plan depend on the machine.
    monkeypatch.setattr(search_mod, "BACKSTOP_TIME_S", 0.0)
    timed = parallelize(g, ParallelOptions(MESH, "auto"))
    assert not timed.reproducible
    assert "NOT REPRODUCIBLE" in printed(timed, g)


def test_elimination_and_the_ilp_agree(profile: Profile) -> None:
    # On a 1-D mesh the reduced GPT-2 graph is solved by exact elimination; the plain ILP
    # on the unreduced program finds the same optimum.
    g = gpt2(*SMALL)
    problem = PlacementProblem(g, Mesh("gpus", (4,)), profile)
    fast = solve_cost_graph(problem.cg, resolution=1e-9)
    assert fast.stats.get("eliminated", 0) > 0 and fast.stats["optimal"] == 1.0
    ilp = solve_cost_graph(problem.cg, resolution=1e-9, reduce_first=False)
    assert ilp.stats["optimal"] == 1.0
    assert fast.objective == pytest.approx(ilp.objective, abs=1e-9)
