"""The placement problem as cost tables, and its exact reductions (as OneFlow does).

A ``CostGraph`` has one vertex per choice-making thing (a node picking a strategy, a graph
input or constant picking a layout), each with a cost per choice; a pairwise edge holds a
matrix of costs for each pair of choices of its two ends; a ``Fanout`` is one value read by
several vertices, whose boxing to each distinct wanted layout is paid once whoever wants it.

``reduce`` removes vertices without changing the optimum: a vertex with one neighbour folds
into that neighbour's costs (min over its own choices for each of the neighbour's), a vertex
with two neighbours becomes a new edge between them, parallel edges add up. Each removal
records the argmin, so ``Reduction.recover`` puts the removed choices back exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# A chain elimination builds a k_u x k_v x k_w table; past this many entries the vertex stays
# for the ILP instead (still exact, only less reduced).
MAX_CHAIN_TABLE = 1 << 22


@dataclass
class Fanout:
    """One value produced by vertex ``producer`` and read through ``uses``.

    ``src[i]`` is the layout (an id) the producer's choice i gives it; each use is a reading
    vertex with ``wanted[j]``, the layout its choice j needs; ``cost[a, b]`` is the boxing
    cost from layout a to layout b (0 on the diagonal). Boxing to one layout is paid once.
    """

    producer: int
    src: np.ndarray
    uses: list[tuple[int, np.ndarray]]
    cost: np.ndarray

    def evaluate(self, choice: Sequence[int]) -> float:
        a = int(self.src[choice[self.producer]])
        wanted = {int(w[choice[c]]) for c, w in self.uses}
        return float(sum(self.cost[a, b] for b in sorted(wanted)))


@dataclass
class CostGraph:
    """Vertices (a cost per choice), pairwise edges and fanouts; see the module docstring."""

    unary: list[np.ndarray] = field(default_factory=list)
    # Whole bytes each choice keeps per rank (constants), for the memory limit; None: none.
    memory: list[np.ndarray | None] = field(default_factory=list)
    # (u, v, matrix[choice of u, choice of v]); several edges may join one pair.
    edges: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    fanouts: list[Fanout] = field(default_factory=list)

    def add_vertex(self, cost: Sequence[float], memory: Sequence[float] | None = None) -> int:
        self.unary.append(np.asarray(cost, dtype=np.float64))
        self.memory.append(None if memory is None else np.asarray(memory, dtype=np.float64))
        return len(self.unary) - 1

    def add_edge(self, u: int, v: int, matrix: np.ndarray) -> None:
        m = np.asarray(matrix, dtype=np.float64)
        if m.shape != (len(self.unary[u]), len(self.unary[v])) or u == v:
            raise ValueError(f"edge {u}-{v}: a {m.shape} matrix does not fit its vertices")
        self.edges.append((u, v, m))

    def add_fanout(self, fanout: Fanout) -> None:
        self.fanouts.append(fanout)

    @property
    def num_vertices(self) -> int:
        return len(self.unary)

    def evaluate(self, choice: Sequence[int]) -> float:
        """The total cost of one choice per vertex."""
        total = sum(float(self.unary[v][c]) for v, c in enumerate(choice))
        total += sum(float(m[choice[u], choice[v]]) for u, v, m in self.edges)
        return total + sum(f.evaluate(choice) for f in self.fanouts)

    def memory_of(self, choice: Sequence[int]) -> float:
        return sum(float(m[choice[v]]) for v, m in enumerate(self.memory) if m is not None)

    def rounded(self, resolution: float) -> CostGraph:
        """Costs in whole units of ``resolution``, plus a tie-break below one unit in total
        that prefers earlier choices (choice 0 first), so equal plans resolve the same way
        however the solver explores them."""
        count = 1 + sum(len(u) - 1 for u in self.unary)
        return CostGraph(
            [np.round(u / resolution) + np.arange(len(u)) / count for u in self.unary],
            list(self.memory),
            [(u, v, np.round(m / resolution)) for u, v, m in self.edges],
            [
                Fanout(f.producer, f.src, f.uses, np.round(f.cost / resolution))
                for f in self.fanouts
            ],
        )


@dataclass(frozen=True)
class Removed:
    """A vertex taken out by ``reduce``: its best choice for each choice of its neighbours
    (none: a fixed choice; one: a leaf; two: the ends of the new edge it became)."""

    vertex: int
    neighbours: tuple[int, ...]
    best: np.ndarray  # indexed by the neighbours' choices, in order


@dataclass
class Reduction:
    """What ``reduce`` left: the vertices still to choose (``alive``), their costs and edges
    (one matrix per pair, keyed (u, v) with u < v), and how to recover the others."""

    graph: CostGraph
    alive: list[bool]
    edges: dict[tuple[int, int], np.ndarray]
    removed: list[Removed]  # in elimination order
    counts: dict[str, int]

    def recover(self, choice: dict[int, int]) -> list[int]:
        """Every vertex's choice, given those of the vertices left alive."""
        out = dict(choice)
        for r in reversed(self.removed):
            out[r.vertex] = int(r.best[tuple(out[w] for w in r.neighbours)])
        return [out[v] for v in range(self.graph.num_vertices)]


def _oriented(edges: dict[tuple[int, int], np.ndarray], a: int, b: int) -> np.ndarray:
    """The matrix of edge a-b indexed [choice of a, choice of b]."""
    return edges[(a, b)] if a < b else edges[(b, a)].T


def merge_edges(
    edge_list: Sequence[tuple[int, int, np.ndarray]],
) -> tuple[dict[tuple[int, int], np.ndarray], int]:
    """One matrix per vertex pair (parallel edges summed), and how many edges merged away."""
    edges: dict[tuple[int, int], np.ndarray] = {}
    merged = 0
    for u, v, m in edge_list:
        key, mat = ((u, v), m) if u < v else ((v, u), m.T)
        if key in edges:
            edges[key] = edges[key] + mat
            merged += 1
        else:
            edges[key] = mat.copy()
    return edges, merged


def reduce(cg: CostGraph, pinned: set[int] | None = None, eliminate: bool = True) -> Reduction:
    """Eliminate every vertex that is not ``pinned`` (e.g. one the memory constraint sums
    over) nor part of a fanout, and has at most two neighbours, until none is left. With
    ``eliminate`` false only parallel edges merge."""
    n = cg.num_vertices
    unary = [u.copy() for u in cg.unary]
    edges, merged = merge_edges(cg.edges)
    keep = set(pinned or ())
    for f in cg.fanouts:
        keep.add(f.producer)
        keep.update(c for c, _ in f.uses)
    nbrs: list[set[int]] = [set() for _ in range(n)]
    for u, v in edges:
        nbrs[u].add(v)
        nbrs[v].add(u)
    alive = [True] * n
    removed: list[Removed] = []
    counts = {"leaves": 0, "chains": 0, "isolated": 0}

    def drop(v: int) -> None:
        alive[v] = False
        for w in nbrs[v]:
            nbrs[w].discard(v)
            edges.pop((min(v, w), max(v, w)))
        nbrs[v].clear()

    changed = eliminate
    while changed:
        changed = False
        for v in range(n):
            if not alive[v] or v in keep:
                continue
            near = sorted(nbrs[v])
            if not near:
                removed.append(Removed(v, (), np.asarray(np.argmin(unary[v]))))
                counts["isolated"] += 1
            elif len(near) == 1:
                w = near[0]
                total = unary[v][:, None] + _oriented(edges, v, w)
                removed.append(Removed(v, (w,), np.argmin(total, axis=0)))
                unary[w] = unary[w] + total.min(axis=0)
                counts["leaves"] += 1
            elif len(near) == 2:
                u, w = near
                if len(unary[u]) * len(unary[v]) * len(unary[w]) > MAX_CHAIN_TABLE:
                    continue
                total = (
                    _oriented(edges, u, v)[:, :, None]
                    + unary[v][None, :, None]
                    + _oriented(edges, v, w)[None, :, :]
                )
                removed.append(Removed(v, (u, w), np.argmin(total, axis=1)))
                new = total.min(axis=1)
                if (u, w) in edges:
                    edges[(u, w)] = edges[(u, w)] + new
                    merged += 1
                else:
                    edges[(u, w)] = new
                    nbrs[u].add(w)
                    nbrs[w].add(u)
                counts["chains"] += 1
            else:
                continue
            drop(v)
            changed = True
    counts["merged_edges"] = merged
    reduced = CostGraph(unary, list(cg.memory), [], list(cg.fanouts))
    return Reduction(reduced, alive, edges, removed, counts)


@dataclass
class Pruned:
    """A cost graph with dominated choices removed; ``keep[v][i]`` is the original index of
    the pruned graph's choice i of vertex v."""

    graph: CostGraph
    keep: list[np.ndarray]
    removed: int

    def expand(self, choice: Sequence[int]) -> list[int]:
        return [int(self.keep[v][c]) for v, c in enumerate(choice)]


def _dominated(features: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Which rows are dominated: some other row is <= in every feature, has the same keys,
    and differs (a strict partial order once the unary costs are all distinct)."""
    k = features.shape[0]
    le = np.ones((k, k), dtype=bool)  # le[i, j]: row i <= row j everywhere
    for start in range(0, features.shape[1], 256):
        f = features[:, start : start + 256]
        le &= np.all(f[:, None, :] <= f[None, :, :], axis=2)
    if keys.shape[1]:
        le &= np.all(keys[:, None, :] == keys[None, :, :], axis=2)
    np.fill_diagonal(le, False)
    return np.asarray(le.any(axis=0))


def prune_dominated(cg: CostGraph, use_memory: bool) -> Pruned:
    """Remove every choice that another choice of the same vertex dominates: no more costly
    alone, no more costly on any pairwise edge for every choice of the neighbour, boxing
    from its layout never dearer in any fanout it produces, the same wanted layouts in the
    fanouts it reads, and (with ``use_memory``) no more memory. Some optimum never uses a
    dominated choice, and with distinct unary costs (``CostGraph.rounded``'s tie-break) the
    optimum is unique in the choices it keeps, so the result is the same plan.
    Repeated until nothing changes: a removal narrows the neighbours' rows."""
    n = cg.num_vertices
    keep = [np.arange(len(u)) for u in cg.unary]
    removed = 0
    changed = True
    while changed:
        changed = False
        for v in range(n):
            if len(keep[v]) < 2:
                continue
            kv = keep[v]
            feats: list[np.ndarray] = [cg.unary[v][kv][:, None]]
            keys: list[np.ndarray] = []
            mem = cg.memory[v]
            if use_memory and mem is not None:
                feats.append(mem[kv][:, None])
            for a, b, m in cg.edges:
                if a == v:
                    feats.append(m[np.ix_(kv, keep[b])])
                elif b == v:
                    feats.append(m[np.ix_(keep[a], kv)].T)
            for f in cg.fanouts:
                if f.producer == v:
                    feats.append(f.cost[f.src[kv]])
                for c, wanted in f.uses:
                    if c == v:
                        keys.append(wanted[kv][:, None])
            dom = _dominated(
                np.concatenate(feats, axis=1),
                np.concatenate(keys, axis=1) if keys else np.zeros((len(kv), 0)),
            )
            if dom.any():
                keep[v] = kv[~dom]
                removed += int(dom.sum())
                changed = True
    graph = CostGraph(
        [u[k] for u, k in zip(cg.unary, keep, strict=True)],
        [None if m is None else m[k] for m, k in zip(cg.memory, keep, strict=True)],
        [(a, b, m[np.ix_(keep[a], keep[b])]) for a, b, m in cg.edges],
        [
            Fanout(
                f.producer, f.src[keep[f.producer]], [(c, w[keep[c]]) for c, w in f.uses], f.cost
            )
            for f in cg.fanouts
        ],
    )
    return Pruned(graph, keep, removed)


def simplify_fanouts(cg: CostGraph) -> CostGraph:
    """Fanouts with fewer real choices: a reader that always wants one layout makes that
    boxing a fixed charge on the producer's choice (and free for the others), so it leaves
    the fanout; a fanout left with no varying reader is the producer's own cost, and one
    left with one varying reader is a pairwise edge. Exact; it frees vertices for
    ``reduce``."""
    unary = [u.copy() for u in cg.unary]
    edges = list(cg.edges)
    fanouts: list[Fanout] = []
    for f in cg.fanouts:
        fixed = sorted({int(w[0]) for _, w in f.uses if len(set(w.tolist())) == 1})
        varying = [(c, w) for c, w in f.uses if len(set(w.tolist())) > 1]
        cost = f.cost.copy()
        if fixed:
            unary[f.producer] = unary[f.producer] + cost[np.ix_(f.src, np.array(fixed))].sum(axis=1)
            cost[:, fixed] = 0.0
        readers = sorted({c for c, _ in varying})
        if len(readers) == 1:
            c = readers[0]
            m = np.zeros((len(f.src), len(unary[c])))
            for j in range(m.shape[1]):
                for b in sorted({int(w[j]) for _, w in varying}):
                    m[:, j] += cost[f.src, b]
            edges.append((f.producer, c, m))
        elif readers:
            fanouts.append(Fanout(f.producer, f.src, varying, cost))
    return CostGraph(unary, list(cg.memory), edges, fanouts)


# -- exact elimination (dynamic programming over the graph) ----------------------------------

# The largest table (entries) one elimination step may build; past it ``eliminate_all`` gives
# up and the integer program solves the graph instead.
MAX_ELIMINATION_TABLE = 1 << 22
# And the argmin tables kept for recovering the choices, all together (int16 entries).
MAX_ELIMINATION_KEPT = 1 << 25


@dataclass
class _Factor:
    scope: tuple[int, ...]  # vertices, ascending; table axes in this order
    table: np.ndarray


def _fanout_table(f: Fanout, sizes: Sequence[int], limit: int) -> _Factor | None:
    """A fanout as one table over its producer and readers: the boxing to each distinct
    wanted layout, paid once."""
    # A vertex of one choice is no axis (a value read by every update, like the step
    # counter, has that many readers, most of them left with one choice).
    scope = tuple(sorted(v for v in {f.producer, *(c for c, _ in f.uses)} if sizes[v] > 1))
    if math.prod(sizes[v] for v in scope) > limit:
        return None
    axis = {v: i for i, v in enumerate(scope)}

    def along(v: int, arr: np.ndarray) -> np.ndarray:
        shape = [1] * len(scope)
        if v in axis:
            shape[axis[v]] = len(arr)
        return arr.reshape(shape)

    table = np.zeros([sizes[v] for v in scope])
    src = along(f.producer, f.src)
    for b in range(f.cost.shape[1]):
        column = f.cost[:, b]
        if not column.any():
            continue
        needed = np.zeros([1] * len(scope), dtype=bool)
        for c, w in f.uses:
            needed = needed | along(c, w == b)
        if needed.any():
            table = table + np.where(needed, column[src], 0.0)
    return _Factor(scope, np.broadcast_to(table, [sizes[v] for v in scope]).copy())


def _expand(f: _Factor, scope: tuple[int, ...]) -> np.ndarray:
    """``f``'s table broadcastable over ``scope`` (a superset, ascending)."""
    shape = [1] * len(scope)
    pos = {v: i for i, v in enumerate(scope)}
    for v, n in zip(f.scope, f.table.shape, strict=True):
        shape[pos[v]] = n
    return f.table.reshape(shape)


def eliminate_all(
    unary: Sequence[np.ndarray],
    edges: dict[tuple[int, int], np.ndarray],
    fanouts: Sequence[Fanout],
    vertices: Sequence[int],
    limit: int = MAX_ELIMINATION_TABLE,
) -> tuple[dict[int, int], int] | None:
    """The exact minimum over ``vertices`` by variable elimination (bucket elimination):
    repeatedly take the vertex whose elimination builds the smallest table (ties: the
    lowest id), add up the tables that hold it, and keep the minimum over its choices for
    each choice of the rest, remembering the argmin. Deterministic: no solver, no limits
    that depend on time. None when some step would exceed ``limit`` entries (or all the
    argmin tables ``MAX_ELIMINATION_KEPT``); else each vertex's choice and the largest table
    built."""
    size_list = [len(u) for u in unary]
    # Vertices of one choice take it: the tables only ever hold the others' axes.
    single = [v for v in vertices if size_list[v] == 1]
    vertices = [v for v in vertices if size_list[v] > 1]
    sizes = {v: len(unary[v]) for v in vertices}
    factors: dict[int, _Factor] = {}
    for v in vertices:
        factors[len(factors)] = _Factor((v,), np.asarray(unary[v], dtype=np.float64))
    for (a, b), m in edges.items():
        if a in sizes and b in sizes:
            factors[len(factors)] = _Factor((a, b), m)
        elif a in sizes:
            factors[len(factors)] = _Factor((a,), np.asarray(m)[:, 0])
        elif b in sizes:
            factors[len(factors)] = _Factor((b,), np.asarray(m)[0, :])
    for fan in fanouts:
        ft = _fanout_table(fan, size_list, limit)
        if ft is None:
            return None
        if ft.scope:
            factors[len(factors)] = ft
    holding: dict[int, set[int]] = {v: set() for v in vertices}
    for k, factor in factors.items():
        for v in factor.scope:
            holding[v].add(k)
    next_id = len(factors)

    def joint_scope(v: int) -> tuple[int, ...]:
        return tuple(sorted({w for k in holding[v] for w in factors[k].scope}))

    def score(v: int) -> int:
        return math.prod(sizes[w] for w in joint_scope(v))

    scores = {v: score(v) for v in vertices}
    steps: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    largest = 0
    kept = 0
    left = set(vertices)
    while left:
        v = min(left, key=lambda u: (scores[u], u))
        if scores[v] > limit:
            return None
        scope = joint_scope(v)
        largest = max(largest, scores[v])
        total = np.zeros([1] * len(scope))
        for k in sorted(holding[v]):
            total = total + _expand(factors[k], scope)
        total = np.broadcast_to(total, [sizes[w] for w in scope])
        ax = scope.index(v)
        rest = scope[:ax] + scope[ax + 1 :]
        kept += scores[v] // sizes[v]
        if kept > MAX_ELIMINATION_KEPT:
            return None
        steps.append((v, rest, np.argmin(total, axis=ax).astype(np.int16)))
        new = _Factor(rest, total.min(axis=ax))
        for k in list(holding[v]):
            for w in factors[k].scope:
                if w != v:
                    holding[w].discard(k)
            del factors[k]
        factors[next_id] = new
        for w in rest:
            holding[w].add(next_id)
        next_id += 1
        left.discard(v)
        del holding[v]
        for w in rest:
            scores[w] = score(w)
    choice: dict[int, int] = dict.fromkeys(single, 0)
    for v, rest, best in reversed(steps):
        choice[v] = int(best[tuple(choice[w] for w in rest)])
    return choice, largest
