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
