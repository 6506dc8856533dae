"""Choosing a parallel plan: an exact integer program over the cost model, as Alpa does.

Every node picks one of its strategies, every graph input and constant one layout (one-hot
binaries x); the cost is the sum of node times plus the boxing time on every edge where a
producer's layout differs from what a consumer's strategy wants, plus making the graph
outputs whole (B). An edge's cost depends on the choices at both ends, so it gets
continuous variables e for pairs of choices whose rows and columns add up to the two ends'
x (the local-consistency form of the product, integral once x is). A value read by several
nodes is boxed once per distinct wanted layout: z >= e of every reader carries that cost.
A limit on the parameter bytes each rank keeps is one linear constraint over the stored
values' x (the constants, and a training step's state: ZeRO's choice, made per tensor). Before solving, ``reduce_graph`` prunes dominated choices and removes chains and leaves
exactly, as OneFlow does; what is left is eliminated exactly when its tables stay small, and
goes to the program otherwise. The solver runs on one thread with a fixed seed and stops at
a node limit, never at a clock (but for a flagged backstop), so a plan is reproducible; one
not proven optimal carries its gap and is never worse than the uniform plans.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from flowc.errors import InputError
from flowc.ir.graph import Graph, Node, Value
from flowc.ir.layout import broadcast, fits, fits_type, local_type, nd_sbps
from flowc.ir.types import Mesh, NdSbp, Sbp
from flowc.parallel.cost import Profile, boxing_time, node_time, stored
from flowc.parallel.plan import Plan
from flowc.parallel.reduce_graph import (
    CostGraph,
    Fanout,
    Reduction,
    eliminate_all,
    prune_dominated,
    reduce,
    simplify_fanouts,
)
from flowc.parallel.strategies import Strategy, all_broadcast_signature, strategies

# Modeled times are compared at nanosecond resolution: closer plans are ties, broken
# towards earlier choices (the all-B strategy first).
RESOLUTION_S = 1e-9
# Branch and bound stops after this many nodes: a limit on work, not on time, so the same
# input gives the same plan on any machine and under any load (HiGHS runs on one thread
# with a fixed seed). A plan the limit stops short of proving says so, with its gap.
NODE_LIMIT = 2000
# A wall-clock backstop far beyond what the node limit normally takes; should it trip, the
# plan depends on the machine's speed, and the printout says it is not reproducible.
BACKSTOP_TIME_S = 600.0
# Above this many variables a program with a memory limit is solved by pricing memory
# (see _lagrangian) rather than by branch and bound on the limit.
EXACT_LIMITED_VARIABLES = 8000
LAGRANGIAN_STEPS = 12
# The priced search stops bisecting once its plan is proven this close to the optimum.
LAGRANGIAN_GAP = 1e-3


@dataclass
class Solution:
    choice: list[int]  # one choice index per vertex of the cost graph
    objective: float  # the cost graph's total for ``choice``, in its own units
    stats: dict[str, float]
    # No choice within the limits costs less than this (the objective when proven optimal).
    bound: float = -math.inf


@dataclass
class _Outcome:
    """What the solver says about the program: the choices (None: it found none), whether
    they are proven optimal, the best bound (program units), and how it stopped."""

    choice: dict[int, int] | None
    optimal: bool
    bound: float
    nodes: int
    timed_out: bool
    message: str


class _Program:
    """The integer program of a reduced cost graph, assembled column by column."""

    def __init__(self, red: Reduction, memory_limit: float | None) -> None:
        self.cost: list[float] = []
        self.upper: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[list[int], list[float], float, float]] = []
        cg = red.graph
        unary = {v: cg.unary[v] for v in range(cg.num_vertices) if red.alive[v]}
        # An edge whose cost depends on one end only is that end's cost: folded in first.
        pairs = []
        for (u, v), m in red.edges.items():
            rows, row_of = _classes(m, 0)
            cols, col_of = _classes(rows, 1)
            if len(rows) == 1:
                unary[v] = unary[v] + rows[0]
            elif cols.shape[1] == 1:
                unary[u] = unary[u] + m[:, 0]
            else:
                pairs.append((u, v, cols, row_of, col_of))
        self.x = {v: [self.var(c, True) for c in cost] for v, cost in unary.items()}
        for cols_x in self.x.values():
            self.row(cols_x, [1.0] * len(cols_x), 1.0, 1.0)
        for u, v, table, row_of, col_of in pairs:
            self.pair(u, v, table, row_of, col_of, charge=True)
        for f in cg.fanouts:
            self.fanout(f)
        if memory_limit is not None:
            # Bytes in units of their greatest common divisor: whole numbers, so the solver's
            # feasibility tolerance cannot let a plan a few bytes over the limit through, and
            # small ones (raw bytes make HiGHS's LPs several times slower).
            mem = {v: m for v, m in enumerate(cg.memory) if m is not None and red.alive[v]}
            unit = math.gcd(*(int(b) for m in mem.values() for b in m)) or 1
            mem_cols = [c for v in mem for c in self.x[v]]
            units = [float(int(b) // unit) for m in mem.values() for b in m]
            self.row(mem_cols, units, -np.inf, float(int(memory_limit) // unit))

    def var(self, cost: float, integer: bool) -> int:
        # An infinite cost marks a forbidden combination: its variable is held at 0.
        allowed = bool(np.isfinite(cost))
        self.cost.append(float(cost) if allowed else 0.0)
        self.upper.append(1.0 if allowed else 0.0)
        self.integer.append(int(integer))
        return len(self.cost) - 1

    def row(self, cols: list[int], coefs: list[float], lo: float, hi: float) -> None:
        self.rows.append((cols, coefs, lo, hi))

    def marginal(self, cols: Iterable[int], x_cols: Iterable[int]) -> None:
        """sum(cols) = sum(x_cols)"""
        a, b = [int(c) for c in cols], list(x_cols)
        self.row(a + b, [1.0] * len(a) + [-1.0] * len(b), 0.0, 0.0)

    def pair(
        self,
        u: int,
        v: int,
        table: np.ndarray,
        row_of: np.ndarray,
        col_of: np.ndarray,
        charge: bool,
    ) -> np.ndarray:
        """Variables e[r, c] for the classes of u's and v's choices (u's choice i is in class
        row_of[i]), whose row r sums to x of u's choices in class r and column c to x of v's
        in class c; ``charge`` puts table's costs on them (else they only forbid inf)."""
        e = np.zeros(table.shape, dtype=np.int64)
        for (r, c), t in np.ndenumerate(table):
            e[r, c] = self.var(t if charge or not np.isfinite(t) else 0.0, False)
        for r in range(table.shape[0]):
            self.marginal(e[r], (self.x[u][i] for i in np.flatnonzero(row_of == r)))
        for c in range(table.shape[1]):
            self.marginal(e[:, c], (self.x[v][j] for j in np.flatnonzero(col_of == c)))
        return e

    def fanout(self, f: Fanout) -> None:
        """Each reader gets its own e[a, b] (producer layout a, wanted layout b); z[a, b] >=
        every reader's e[a, b] is 1 when anyone needs a boxed to b and is charged once."""
        src_ids = sorted({int(a) for a in f.src})
        src_class = np.searchsorted(src_ids, f.src)
        z: dict[tuple[int, int], int] = {}
        for c, wanted in f.uses:
            dst_ids = sorted({int(b) for b in wanted})
            table = f.cost[np.ix_(src_ids, dst_ids)]
            if not table.any():
                continue
            e = self.pair(
                f.producer, c, table, src_class, np.searchsorted(dst_ids, wanted), charge=False
            )
            for (r, k), t in np.ndenumerate(table):
                if 0 < t < np.inf:
                    key = (src_ids[r], dst_ids[k])
                    if key not in z:
                        z[key] = self.var(float(t), False)
                    self.row([z[key], int(e[r, k])], [1.0, -1.0], 0.0, np.inf)

    def solve(self, node_limit: int, time_limit: float) -> _Outcome:
        """Branch and bound on one thread with a fixed seed, stopped by ``node_limit``
        (deterministic) or, as a backstop only, by ``time_limit``."""
        n = len(self.cost)
        r: list[int] = []
        c: list[int] = []
        d: list[float] = []
        for k, (cols, coefs, _, _) in enumerate(self.rows):
            r.extend([k] * len(cols))
            c.extend(cols)
            d.extend(coefs)
        matrix = coo_array((d, (r, c)), shape=(len(self.rows), n)).tocsr()
        with warnings.catch_warnings():
            # scipy passes options it does not list (threads, random_seed) on to HiGHS as
            # they are, and says so in a warning.
            warnings.simplefilter("ignore", RuntimeWarning)
            res = milp(
                np.array(self.cost),
                integrality=np.array(self.integer),
                bounds=Bounds(np.zeros(n), np.array(self.upper)),
                constraints=LinearConstraint(
                    matrix, [row[2] for row in self.rows], [row[3] for row in self.rows]
                ),
                options={
                    "node_limit": node_limit,
                    "time_limit": time_limit,
                    "mip_rel_gap": 0.0,
                    "threads": 1,
                    "random_seed": 0,
                },
            )
        optimal = res.status == 0
        timed_out = "Time limit" in str(res.message)
        bound = res.get("mip_dual_bound")
        if bound is None or not np.isfinite(bound):
            bound = -math.inf
        choice = None
        if res.x is not None:
            choice = {v: int(np.argmax(res.x[cols])) for v, cols in self.x.items()}
            if optimal:
                bound = float(res.fun)
        elif res.status in (2, 3):
            raise InputError(
                f"the placement search found no plan ({res.message}; {n} variables, "
                f"{len(self.rows)} constraints)",
                hint="use data parallelism, or fix some placements to make the search smaller",
            )
        nodes = int(res.get("mip_node_count") or 0)
        return _Outcome(choice, optimal, float(bound), nodes, timed_out, str(res.message))


def _classes(matrix: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows (axis 0) or columns (axis 1) of ``matrix``, and which is whose."""
    uniq, inverse = np.unique(matrix, axis=axis, return_inverse=True)
    return uniq, np.asarray(inverse).reshape(-1)


def solve_cost_graph(
    cg: CostGraph,
    *,
    memory_limit: float | None = None,
    resolution: float = 1.0,
    reduce_first: bool = True,
    node_limit: int | None = None,
    time_limit: float | None = None,
    candidates: Callable[[], Sequence[Sequence[int]]] | None = None,
) -> Solution:
    """The choice per vertex of least total cost, with memory at most ``memory_limit``.

    Costs are compared in whole units of ``resolution``. The caller checks that the limit
    can be met at all (the vertices' smallest memories add up to at most the limit).
    Dominated choices are pruned and the graph reduced (exactly); what is left is solved by
    elimination when its tables stay small, else by the integer program. When that stops
    at ``node_limit`` before proving its plan optimal, ``candidates`` (full choice vectors,
    e.g. the uniform plans) are evaluated too and the cheapest that fits is returned; the
    stats then hold the gap to the best bound.
    """
    start = time.perf_counter()
    # Read when called, so that a caller (or a test) may change the module's limits.
    node_limit = NODE_LIMIT if node_limit is None else node_limit
    time_limit = BACKSTOP_TIME_S if time_limit is None else time_limit
    rounded = cg.rounded(resolution)
    limited = memory_limit is not None
    pruned = None
    work = rounded
    if reduce_first:
        pruned = prune_dominated(rounded, use_memory=limited)
        work = simplify_fanouts(pruned.graph)
    pinned = {v for v, m in enumerate(work.memory) if m is not None} if limited else set()
    red = reduce(work, pinned, eliminate=reduce_first)
    alive_vertices = [v for v in range(work.num_vertices) if red.alive[v]]
    stats: dict[str, float] = {
        "nodes_before": float(cg.num_vertices),
        "nodes_after": float(len(alive_vertices)),
        "pruned_choices": float(pruned.removed if pruned is not None else 0),
        **{k: float(n) for k, n in red.counts.items()},
    }
    outcome: _Outcome | None = None
    if not limited and reduce_first and alive_vertices:
        got = eliminate_all(red.graph.unary, red.edges, red.graph.fanouts, alive_vertices)
        if got is not None:
            outcome = _Outcome(got[0], True, -math.inf, 0, False, "eliminated")
            stats.update(variables=0.0, constraints=0.0, eliminated=float(len(alive_vertices)))
            stats["largest_table"] = float(got[1])
    if outcome is None:
        prog = _Program(red, memory_limit)
        if limited and len(prog.cost) > EXACT_LIMITED_VARIABLES:
            return _lagrangian(
                cg,
                float(memory_limit or 0),
                resolution,
                reduce_first,
                node_limit,
                time_limit,
                candidates,
            )
        stats.update(variables=float(len(prog.cost)), constraints=float(len(prog.rows)))
        if prog.x:
            outcome = prog.solve(node_limit, time_limit)
            stats["bb_nodes"] = float(outcome.nodes)
        else:
            outcome = _Outcome({}, True, -math.inf, 0, False, "nothing left to choose")
    best: list[int] | None = None
    if outcome.choice is not None:
        best = red.recover(outcome.choice)
        if pruned is not None:
            best = pruned.expand(best)
    objective = math.inf if best is None else cg.evaluate(best)
    if outcome.optimal:
        bound = objective
    else:
        # The program's bound is on rounded costs, which may undercount by a unit in all
        # (the tie-break); the rounding of each term is within the stated resolution.
        bound = (max(outcome.bound, _simple_bound(red)) - 1.0) * resolution
        for cand in candidates() if candidates is not None else ():
            full = list(cand)
            if limited and cg.memory_of(full) > float(memory_limit or 0):
                continue
            cost = cg.evaluate(full)
            if cost < objective:
                best, objective = full, cost
                stats["fallback"] = 1.0
    if best is None:
        raise InputError(
            f"the placement search found no plan within its node limit ({outcome.message}; "
            f"{node_limit} nodes)",
            hint="use data parallelism, or fix some placements to make the search smaller",
        )
    _gap_stats(stats, objective, bound, resolution)
    stats["optimal"] = float(outcome.optimal or stats["gap_s"] <= resolution)
    if stats["optimal"]:
        del stats["gap_s"]
    stats["reproducible"] = float(not outcome.timed_out)
    stats["node_limit"] = float(node_limit)
    stats["solve_s"] = time.perf_counter() - start
    return Solution(best, objective, stats, min(bound, objective))


def _simple_bound(red: Reduction) -> float:
    """A lower bound that needs no solver: every vertex and edge at its own cheapest
    (boxing costs are never negative), over the reduced graph (whose optimum is exact)."""
    total = sum(float(np.min(red.graph.unary[v])) for v, a in enumerate(red.alive) if a)
    return total + sum(float(np.min(m)) for m in red.edges.values())


def _gap_stats(stats: dict[str, float], objective: float, bound: float, resolution: float) -> None:
    """``gap_s``: how much cheaper than ``objective`` a plan could still be; ``gap``: that
    as a fraction of the objective (0 when proven optimal)."""
    gap = max(0.0, objective - bound) if math.isfinite(bound) else math.inf
    if gap <= resolution:
        gap = 0.0
    stats["gap_s"] = gap
    stats["gap"] = gap / objective if objective > 0 else (0.0 if gap == 0 else math.inf)


def _priced(cg: CostGraph, lam: float) -> CostGraph:
    """The cost graph with memory priced at ``lam`` per byte and no limit."""
    unary = [u if m is None else u + lam * m for u, m in zip(cg.unary, cg.memory, strict=True)]
    return CostGraph(unary, [None] * cg.num_vertices, list(cg.edges), list(cg.fanouts))


def _lagrangian(
    cg: CostGraph,
    limit: float,
    resolution: float,
    reduce_first: bool,
    node_limit: int,
    time_limit: float,
    candidates: Callable[[], Sequence[Sequence[int]]] | None,
) -> Solution:
    """Large programs under a memory limit: the limit makes branch and bound slow (its LP
    relaxation splits constants fractionally), while without it the programs solve at once.
    So price memory instead (Lagrangian relaxation): bisect the price per byte for the
    cheapest plan within the limit. The result fits the limit and is deterministic; its
    distance from the optimum is bounded by the dual (``gap_s`` in the stats)."""
    start = time.perf_counter()
    solves = 0
    reproducible = True

    def solve(lam: float) -> Solution:
        nonlocal solves, reproducible
        solves += 1
        sol = solve_cost_graph(
            _priced(cg, lam),
            resolution=resolution,
            reduce_first=reduce_first,
            node_limit=node_limit,
            time_limit=time_limit,
        )
        reproducible = reproducible and bool(sol.stats["reproducible"])
        return sol

    best: Solution | None = None
    best_cost = math.inf
    bound = -math.inf

    def consider(lam: float, sol: Solution) -> bool:
        nonlocal best, best_cost, bound
        mem = cg.memory_of(sol.choice)
        # For every plan within the limit: cost >= priced cost - lam * limit >= the priced
        # program's bound - lam * limit.
        bound = max(bound, sol.bound - lam * limit)
        if mem <= limit:
            cost = cg.evaluate(sol.choice)
            if cost < best_cost:
                best, best_cost = sol, cost
            return True
        return False

    def close_enough() -> bool:
        return best_cost - bound <= max(resolution, LAGRANGIAN_GAP * abs(best_cost))

    first = solve(0.0)
    if not consider(0.0, first):
        # Prices grow until the cheapest priced plan fits (at a high enough price it is the
        # plan of least memory, which fits: the caller checked that).
        scale = max(abs(float(np.sum([u.max() for u in cg.unary]))), resolution)
        lo, hi = 0.0, scale / max(limit, 1.0)
        low_plan = first.choice
        high = solve(hi)
        for _ in range(64):
            if consider(hi, high):
                break
            lo, hi, low_plan = hi, hi * 4, high.choice
            high = solve(hi)
        high_plan = high.choice
        # Then the price where the cheapest plan over the limit and the cheapest within it
        # cost the same (the dual's breakpoint, as Kelley's cutting planes find it): a plan
        # cheaper there replaces one of the two, else that price maximizes the dual bound.
        for _ in range(LAGRANGIAN_STEPS):
            if close_enough():
                break
            c_lo, m_lo = cg.evaluate(low_plan), cg.memory_of(low_plan)
            c_hi, m_hi = cg.evaluate(high_plan), cg.memory_of(high_plan)
            lam = (c_hi - c_lo) / (m_lo - m_hi) if m_lo > m_hi else (lo + hi) / 2
            if not lo < lam < hi:
                lam = (lo + hi) / 2
            sol = solve(lam)
            priced = cg.evaluate(sol.choice) + lam * cg.memory_of(sol.choice)
            meet = min(c_lo + lam * m_lo, c_hi + lam * m_hi)
            fits = consider(lam, sol)
            if priced >= meet - resolution:
                break
            if fits:
                hi, high_plan = lam, sol.choice
            else:
                lo, low_plan = lam, sol.choice
    assert best is not None
    choice, cost = best.choice, best_cost
    stats = dict(best.stats)
    stats.pop("fallback", None)
    if cost - bound > resolution and candidates is not None:
        for cand in candidates():
            full = list(cand)
            if cg.memory_of(full) <= limit and cg.evaluate(full) < cost:
                choice, cost = full, cg.evaluate(full)
                stats["fallback"] = 1.0
    _gap_stats(stats, cost, bound, resolution)
    stats["optimal"] = float(stats["gap_s"] == 0.0)
    stats.update(
        solve_s=time.perf_counter() - start,
        lagrangian_solves=float(solves),
        reproducible=float(reproducible),
    )
    return Solution(choice, cost, stats, min(bound, cost))


# -- from a graph to a cost graph ------------------------------------------------------------


class PlacementProblem:
    """The cost graph of placing ``graph`` on ``mesh``: one vertex per graph input and
    constant (choosing a layout) and per node (choosing a strategy)."""

    def __init__(
        self,
        graph: Graph,
        mesh: Mesh,
        profile: Profile,
        fixed: Mapping[Value, NdSbp] | None = None,
    ) -> None:
        self.graph = graph
        self.mesh = mesh
        self.profile = profile
        self.cg = CostGraph()
        fixed = dict(fixed or {})
        self._check_fixed(fixed)
        self.vertex: dict[Value | Node, int] = {}
        self.layouts: dict[Value, list[NdSbp]] = {}
        self.strategies: dict[Node, list[Strategy]] = {}
        readers: dict[Value, list[tuple[Node, int]]] = {}
        for node in graph.nodes:
            for i, read in enumerate(node.inputs):
                if read is not None:
                    readers.setdefault(read, []).append((node, i))
        for node in graph.nodes:
            self.strategies[node] = self._node_strategies(node, fixed)
        outputs = set(graph.outputs)
        kept = set(stored(graph))
        for v in [*graph.inputs, *graph.constants]:
            self.layouts[v] = self._source_layouts(v, fixed.get(v))
            memory = None
            if v in kept:
                memory = [local_type(v.type, s, mesh).nbytes for s in self.layouts[v]]
            self.vertex[v] = self.cg.add_vertex([0.0] * len(self.layouts[v]), memory)
        for node in graph.nodes:
            times = [node_time(node, s, mesh, profile) for s in self.strategies[node]]
            self.vertex[node] = self.cg.add_vertex(times)
        for v in [*graph.inputs, *graph.constants]:
            self._add_value(v, self.vertex[v], self.layouts[v], readers.get(v, []), v in outputs)
        # A state's next value leaves the step as its state entered (Plan.leaves_as): an edge
        # from the value's producer to the state input, priced by the boxing between them.
        by_name = {v.name: v for v in graph.inputs}
        next_of = {
            o: by_name[name]
            for name, written in graph.state.items()
            for o in graph.outputs
            if written is not None and o.name == written and name in by_name
        }
        for node in graph.nodes:
            for j, o in enumerate(node.outputs):
                made = [s.output(j) for s in self.strategies[node]]
                state = next_of.get(o)
                self._add_value(
                    o, self.vertex[node], made, readers.get(o, []), o in outputs and state is None
                )
                if state is not None:
                    m = np.array(
                        [
                            [
                                0.0 if a == b else boxing_time(o.type, mesh, a, b, profile)
                                for b in self.layouts[state]
                            ]
                            for a in made
                        ]
                    )
                    if m.any():
                        self.cg.add_edge(self.vertex[node], self.vertex[state], m)

    def _check_fixed(self, fixed: dict[Value, NdSbp]) -> None:
        known = {*self.graph.inputs, *self.graph.constants}
        known.update(o for n in self.graph.nodes for o in n.outputs)
        for v, sbp in fixed.items():
            if v not in known:
                raise InputError(f"a placement is given for {v.name!r}, which is not in the graph")
            if len(sbp.parts) != self.mesh.ndim:
                raise InputError(
                    f"placement {sbp} of {v.name!r} has {len(sbp.parts)} entries but mesh "
                    f"{self.mesh} has {self.mesh.ndim} axes"
                )
            if not fits(v.type.shape, sbp, self.mesh):
                raise InputError(
                    f"placement {sbp} does not split {v.name!r} ({v.type}) evenly on mesh "
                    f"{self.mesh}",
                    hint="flowc splits only evenly; choose a placement whose split axes divide",
                )

    def _source_layouts(self, v: Value, fixed: NdSbp | None) -> list[NdSbp]:
        # Every rank reads a whole input (or constant) and keeps its shard, so any layout
        # without P costs nothing to make; B -> P is free to reach later anyway.
        if fixed is not None:
            if any(p.kind == "P" for p in fixed.parts):
                what = "constant" if v.is_const else "graph input"
                raise InputError(f"{what} {v.name!r} cannot be placed as {fixed}: it is never P")
            return [fixed]
        if v.is_const and not v.type.dtype.is_float and v.type.nbytes <= SMALL_CONSTANT:
            # A small integer constant is what an op reads at compile time (a Reshape's
            # shape, axes), which must stay a whole constant; splitting it saves nothing.
            return [broadcast(self.mesh)]
        state = v.name in self.graph.state and not v.is_const
        return [
            s
            for s in nd_sbps(v.type.rank, self.mesh, partial=False)
            if fits_type(v.type, s, self.mesh)
            # A training step's state splits on one tensor axis (its shards are read,
            # written and saved as chunks of that axis).
            and (not state or len({p.axis for p in s.parts if p.kind == "S"}) <= 1)
        ]

    def _node_strategies(self, node: Node, fixed: dict[Value, NdSbp]) -> list[Strategy]:
        out = strategies(node, self.mesh)
        for j, o in enumerate(node.outputs):
            if o in fixed:
                want = fixed[o]
                made = sorted({str(s.output(j)) for s in out})
                out = [s for s in out if s.output(j) == want]
                if not out:
                    raise InputError(
                        f"{node.op} node {node.name!r} cannot produce {o.name!r} as {want} on "
                        f"mesh {self.mesh}; it can produce {', '.join(made)}"
                    )
        return out

    def _add_value(
        self,
        v: Value,
        producer: int,
        made: list[NdSbp],
        readers: list[tuple[Node, int]],
        is_output: bool,
    ) -> None:
        """The boxing costs of value ``v``: made in layout made[i] by the producer's choice i,
        read by ``readers`` (node, input slot), made whole when it is a graph output."""
        ids: dict[NdSbp, int] = {}
        for s in made:
            ids.setdefault(s, len(ids))
        wanted: list[tuple[int, np.ndarray]] = []
        for node, slot in readers:
            want = []
            for strategy in self.strategies[node]:
                sbp = strategy.input(slot)
                assert sbp is not None
                want.append(ids.setdefault(sbp, len(ids)))
            wanted.append((self.vertex[node], np.array(want)))
        whole = ids.setdefault(broadcast(self.mesh), len(ids))
        layout = list(ids)
        src = np.array([ids[s] for s in made])
        cost = np.zeros((len(ids), len(ids)))
        dst_ids = {int(b) for _, w in wanted for b in w} | ({whole} if is_output else set())
        for a in sorted(set(src.tolist())):
            for b in sorted(dst_ids - {a}):
                cost[a, b] = boxing_time(v.type, self.mesh, layout[a], layout[b], self.profile)
        if is_output:
            # Paid whatever the readers do; a reader wanting B then shares it for free.
            self.cg.unary[producer] = self.cg.unary[producer] + cost[src, whole]
            cost[:, whole] = 0.0
        consumers = sorted({c for c, _ in wanted})
        if len(consumers) == 1:
            # One reader, perhaps through several inputs: a pairwise edge, each distinct
            # wanted layout counted once.
            c = consumers[0]
            m = np.zeros((len(made), len(self.cg.unary[c])))
            for j in range(m.shape[1]):
                for b in sorted({int(w[j]) for _, w in wanted}):
                    m[:, j] += cost[src, b]
            if m.any():
                self.cg.add_edge(producer, c, m)
        elif consumers:
            self.cg.add_fanout(Fanout(producer, src, wanted, cost))

    def min_param_bytes(self) -> int:
        return sum(int(min(m)) for m in self.cg.memory if m is not None)

    def choice_of(self, plan: Plan) -> list[int] | None:
        """``plan`` as one choice per vertex, None when it uses a layout or strategy this
        problem does not offer (e.g. one that a fixed placement rules out)."""
        choice = [0] * self.cg.num_vertices
        for v, layouts in self.layouts.items():
            if plan.value_sbp.get(v) not in layouts:
                return None
            choice[self.vertex[v]] = layouts.index(plan.value_sbp[v])
        for node, options in self.strategies.items():
            s = plan.node_strategy.get(node)
            if s not in options:
                return None
            choice[self.vertex[node]] = options.index(s)
        return choice

    def plan(self, choice: list[int], method: str) -> Plan:
        value_sbp: dict[Value, NdSbp] = {}
        node_strategy: dict[Node, Strategy] = {}
        for v, layouts in self.layouts.items():
            value_sbp[v] = layouts[choice[self.vertex[v]]]
        for node, options in self.strategies.items():
            s = options[choice[self.vertex[node]]]
            node_strategy[node] = s
            for j, o in enumerate(node.outputs):
                value_sbp[o] = s.output(j)
        return Plan(self.mesh, node_strategy, value_sbp, method)


# Integer constants of at most this many bytes stay whole (B) on every device.
SMALL_CONSTANT = 1024


class ParamLimitError(InputError):
    """No plan keeps the stored bytes within the limit; ``least`` is the fewest any can."""

    def __init__(self, message: str, least: int) -> None:
        super().__init__(
            message,
            hint="allow more parameter memory, use a larger mesh, or fix fewer placements",
        )
        self.least = least


def search(
    graph: Graph,
    mesh: Mesh,
    profile: Profile,
    *,
    fixed: Mapping[Value, NdSbp] | None = None,
    param_limit: int | None = None,
    node_limit: int | None = None,
    time_limit: float | None = None,
    method: str = "auto",
    baselines: bool = True,
) -> Plan:
    """The plan of least modeled time whose layouts agree with ``fixed`` and whose
    constants take at most ``param_limit`` bytes per rank. Should the search stop at
    ``node_limit`` unproven, it is never worse than the uniform plans (data parallel on
    all or one mesh axis, all-broadcast) that keep ``fixed`` and fit (with ``baselines``)."""
    problem = PlacementProblem(graph, mesh, profile, fixed)
    if param_limit is not None:
        least = problem.min_param_bytes()
        if least > param_limit:
            raise ParamLimitError(
                f"no placement on mesh {mesh} keeps the parameters within {param_limit} bytes "
                f"per rank: the smallest possible is {least} bytes",
                least,
            )

    def uniform() -> list[list[int]]:
        out = []
        # The baselines get the usual node limit, whatever this search was given: they are
        # what an unproven plan is measured against.
        for plan in uniform_plans(graph, mesh, profile, fixed, time_limit=time_limit):
            choice = problem.choice_of(plan)
            if choice is not None:
                out.append(choice)
        return out

    sol = solve_cost_graph(
        problem.cg,
        memory_limit=param_limit,
        resolution=RESOLUTION_S,
        node_limit=node_limit,
        time_limit=time_limit,
        candidates=uniform if baselines else None,
    )
    plan = problem.plan(sol.choice, method)
    plan.stats = {**sol.stats, "objective_s": sol.objective, "bound_s": sol.bound}
    return plan


def uniform_plans(
    graph: Graph,
    mesh: Mesh,
    profile: Profile,
    fixed: Mapping[Value, NdSbp] | None = None,
    node_limit: int | None = None,
    time_limit: float | None = None,
) -> list[Plan]:
    """The plans of one rule for the whole graph that can be made: all-broadcast (when
    nothing is fixed), and data parallel over all mesh axes and over each one alone."""
    out = [] if fixed else [broadcast_plan(graph, mesh)]
    axes_sets = [tuple(range(mesh.ndim))]
    if mesh.ndim > 1:
        axes_sets += [(a,) for a in range(mesh.ndim)]
    for axes in axes_sets:
        try:
            out.append(
                data_parallel_plan(
                    graph, mesh, profile, fixed, axes, node_limit=node_limit, time_limit=time_limit
                )
            )
        except InputError:
            continue
    return out


def data_parallel_plan(
    graph: Graph,
    mesh: Mesh,
    profile: Profile,
    fixed: Mapping[Value, NdSbp] | None = None,
    axes: tuple[int, ...] | None = None,
    *,
    node_limit: int | None = None,
    time_limit: float | None = None,
) -> Plan:
    """Every graph input split on its batch axis (0) over the mesh ``axes`` (default: all
    devices), every constant whole on every device, each node's strategy the best under
    those (the search again)."""
    given = dict(fixed or {})
    axes = tuple(range(mesh.ndim)) if axes is None else axes
    split = NdSbp(tuple(Sbp("S", 0) if a in axes else Sbp("B") for a in range(mesh.ndim)))
    ways = math.prod(mesh.shape[a] for a in axes)
    want: dict[Value, NdSbp] = {}
    for v in graph.inputs:
        if v in given:
            continue
        if v.type.sym is not None and v.type.sym[0] is not None:
            raise InputError(
                f"data parallelism splits input {v.name!r} ({v.type}) on axis 0, a symbolic "
                "dim: symbolic dims are never split (a rank's chunk would be no fixed size)",
                hint="fix the dim with --dim NAME=N for data parallelism, or let the search "
                "choose (--parallel auto splits other axes)",
            )
        if v.type.rank == 0 or v.type.shape[0] % ways:
            batch = "none (it is a scalar)" if v.type.rank == 0 else str(v.type.shape[0])
            over = f"all {ways} devices" if len(axes) == mesh.ndim else f"{ways} devices"
            raise InputError(
                f"data parallelism splits input {v.name!r} ({v.type}) on axis 0 over "
                f"{over} of mesh {mesh}, but its batch is {batch}",
                hint=f"use a batch that divides by {ways}, give {v.name!r} a placement "
                "(e.g. B), or let the search choose",
            )
        want[v] = split
    for c in graph.constants:
        want.setdefault(c, broadcast(mesh))
    want.update(given)
    return search(
        graph,
        mesh,
        profile,
        fixed=want,
        method="data",
        node_limit=node_limit,
        time_limit=time_limit,
        baselines=False,
    )


def broadcast_plan(graph: Graph, mesh: Mesh) -> Plan:
    """Every value whole on every device; every node runs all of its work everywhere."""
    whole = broadcast(mesh)
    value_sbp = {v: whole for v in [*graph.inputs, *graph.constants]}
    node_strategy = {}
    for node in graph.nodes:
        node_strategy[node] = Strategy(tuple(all_broadcast_signature(node) for _ in mesh.shape))
        value_sbp.update((o, whole) for o in node.outputs)
    return Plan(mesh, node_strategy, value_sbp, "none")
