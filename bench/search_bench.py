"""The placement search on GPT-2 graphs of depth 1..N: time, ILP size, status, gap, and
the plan's modeled time against the uniform plans.

    .venv/bin/python bench/search_bench.py                      # GPT-2 small on 2x2, depths 1..12
    .venv/bin/python bench/search_bench.py --max-layers 4 --param-limit 0.5
    .venv/bin/python bench/search_bench.py --passes logical    # the unfused graph, to compare

Per depth: the search's wall time (cost graph, reductions, solve; not lowering; the cost
model's caches are shared between depths, as within one process), the ILP
variables of the unreduced program and of the one left after the reductions (0 when exact
elimination solved what was left), whether the plan is proven optimal, its gap to the best
bound, and the modeled time of the plan, of the data-parallel plan (when the batch divides)
and of the all-broadcast plan. ``--param-limit F`` caps parameter bytes per rank at F times
all the weights (the search's own limit; `flowc --mem-limit` adds the arena on top).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt2_graph import gpt2_model

from flowc.compiler import pass_list
from flowc.errors import FlowcWarning, InputError
from flowc.frontend import load_graph
from flowc.ir.graph import Graph
from flowc.parallel import parse_mesh
from flowc.parallel.cost import evaluate_plan, load_profile
from flowc.parallel.reduce_graph import reduce
from flowc.parallel.search import (
    RESOLUTION_S,
    PlacementProblem,
    _Program,
    broadcast_plan,
    data_parallel_plan,
    search,
)
from flowc.passes.manager import PassManager


def gpt2_graph(
    layers: int, hidden: int, heads: int, seq: int, batch: int, vocab: int, passes: str = "compile"
) -> Graph:
    """The generator's model (fill weights) read as flowc reads a model for placement:
    ``passes="compile"`` the driver's pass list for a placed graph (the fused graph every
    compile places); ``"logical"`` the unfused graph (fold, simplify, split_projections)
    that placement saw before the one compile path, for comparison."""
    model = gpt2_model(layers, hidden, heads, seq, batch, vocab, weights="fill")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt2.onnx"
        onnx.save(model, str(path))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FlowcWarning)
            g = load_graph(path)
    if passes == "compile":
        return PassManager(pass_list(placed=True)).run(g)
    return PassManager(("fold_constants", "simplify", "split_projections")).run(g)


def unreduced_variables(problem: PlacementProblem, limit: int | None) -> int:
    cg = problem.cg.rounded(RESOLUTION_S)
    pinned = {v for v, m in enumerate(cg.memory) if m is not None} if limit else set()
    return len(_Program(reduce(cg, pinned, eliminate=False), limit).cost)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--min-layers", type=int, default=1)
    ap.add_argument("--max-layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--mesh", default="2x2")
    ap.add_argument("--param-limit", type=float, default=None, help="fraction of all weights")
    ap.add_argument(
        "--passes",
        choices=["compile", "logical"],
        default="compile",
        help="the graph placed: compile's (fused, the default) or the unfused one",
    )
    a = ap.parse_args(argv)
    mesh = parse_mesh(a.mesh)
    profile = load_profile()
    print(
        f"# GPT-2 hidden {a.hidden}, {a.heads} heads, seq {a.seq}, batch {a.batch}, vocab "
        f"{a.vocab}; mesh {a.mesh}; profile {profile.name}; {a.passes} graph"
        + (f"; parameters <= {a.param_limit:g} x weights per rank" if a.param_limit else "")
    )
    print(
        f"{'layers':>6} {'search s':>9} {'vars':>8} {'reduced':>8} {'status':>10} {'gap':>7} "
        f"{'auto us':>9} {'data us':>9} {'none us':>9} {'auto/best uniform':>18}"
    )
    for layers in range(a.min_layers, a.max_layers + 1):
        g = gpt2_graph(layers, a.hidden, a.heads, a.seq, a.batch, a.vocab, a.passes)
        weights = sum(c.type.nbytes for c in g.constants)
        limit = int(weights * a.param_limit) if a.param_limit else None
        t0 = time.perf_counter()
        plan = search(g, mesh, profile, param_limit=limit)
        seconds = time.perf_counter() - t0
        before = unreduced_variables(PlacementProblem(g, mesh, profile), limit)
        st = plan.stats
        auto = evaluate_plan(g, plan, profile).total_s
        uniform = {}
        none = evaluate_plan(g, broadcast_plan(g, mesh), profile)
        if limit is None or none.param_bytes <= limit:
            uniform["none"] = none.total_s
        try:
            data = evaluate_plan(g, data_parallel_plan(g, mesh, profile), profile)
            if limit is None or data.param_bytes <= limit:
                uniform["data"] = data.total_s
        except InputError:
            pass
        status = "optimal" if st["optimal"] else "unproven"
        if not st.get("reproducible", 1.0):
            status = "TIMED OUT"
        best = min(uniform.values()) if uniform else None

        def us(t: float | None) -> str:
            return "n/a" if t is None else f"{t * 1e6:.1f}"

        ratio = "n/a (none fits)" if best is None else f"{auto / best:.4f}"
        print(
            f"{layers:>6} {seconds:>9.2f} {before:>8} {int(st.get('variables', 0)):>8} "
            f"{status:>10} {st.get('gap', 0.0) * 100:>6.2f}% {us(auto):>9} "
            f"{us(uniform.get('data')):>9} {us(none.total_s):>9} {ratio:>18}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
