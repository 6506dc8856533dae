"""Boxing: the collectives that turn one nd-SBP layout of a tensor into another.

A step changes the layout along one mesh axis, among the devices that differ only in that
axis's coordinate (DESIGN.md's table gives the collective and its bytes). Which steps are
sound depends on the chunk order: chunks of a tensor axis split by several mesh axes are
numbered in mixed radix, mesh axis 0 outermost, so a device's piece is a sub-chunk of the
pieces its outer axes give it. A step along mesh axis a that splits or un-splits tensor axis
d therefore works on contiguous pieces only when no mesh axis after a (an inner one) also
splits d; otherwise the pieces it would gather are strided. The search below only takes
such sound steps, and finds the cheapest sequence of them by Dijkstra over layouts (at most
(rank + 2) ** mesh.ndim states).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from flowc.errors import FlowcError
from flowc.ir.layout import fits_type, local_shape
from flowc.ir.types import Mesh, NdSbp, Sbp, TensorType

ALL_REDUCE = "all-reduce"
REDUCE_SCATTER = "reduce-scatter"
ALL_GATHER = "all-gather"
ALL_TO_ALL = "all-to-all"
LOCAL_SLICE = "local-slice"
B_TO_P = "b-to-p"
COLLECTIVES = (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL, LOCAL_SLICE, B_TO_P)


class BoxingError(FlowcError):
    pass


@dataclass(frozen=True)
class BoxingStep:
    """One collective along one mesh axis; ``src``/``dst`` are the whole layouts around it."""

    collective: str
    mesh_axis: int
    src: NdSbp
    dst: NdSbp
    group_size: int
    bytes_per_rank: int  # bytes each rank sends (0 for the local steps)

    @property
    def is_local(self) -> bool:
        return self.collective in (LOCAL_SLICE, B_TO_P)

    def __str__(self) -> str:
        return f"{self.collective} on mesh axis {self.mesh_axis}: {self.src} -> {self.dst}"


def _collective(a: Sbp, b: Sbp) -> str | None:
    if a == b:
        return None
    if a.kind == "P":
        return ALL_REDUCE if b.kind == "B" else REDUCE_SCATTER if b.kind == "S" else None
    if a.kind == "S":
        return ALL_GATHER if b.kind == "B" else ALL_TO_ALL if b.kind == "S" else None
    return LOCAL_SLICE if b.kind == "S" else B_TO_P


def _sound(state: NdSbp, axis: int, a: Sbp, b: Sbp) -> bool:
    """A step along ``axis`` touching split tensor axes is sound only if no inner mesh axis
    splits the same tensor axes (see the module docstring)."""
    touched = {p.axis for p in (a, b) if p.kind == "S"}
    return not any(p.kind == "S" and p.axis in touched for p in state.parts[axis + 1 :])


def step_bytes(ttype: TensorType, mesh: Mesh, state: NdSbp, axis: int, collective: str) -> int:
    """Per-rank bytes sent, with T the bytes the group along ``axis`` holds together."""
    local = TensorType(local_shape(ttype.shape, state, mesh), ttype.dtype).nbytes
    p = mesh.shape[axis]
    group = local * p if state.parts[axis].kind == "S" else local
    if collective == ALL_REDUCE:
        return 2 * (p - 1) * group // p
    if collective in (REDUCE_SCATTER, ALL_GATHER):
        return (p - 1) * group // p
    if collective == ALL_TO_ALL:
        return (p - 1) * group // (p * p)
    return 0


def _default_time(step: BoxingStep) -> float:
    # Without a profile: bytes, plus a tiny charge per step so fewer steps win ties.
    return step.bytes_per_rank + 1e-3


Tree = dict[NdSbp, tuple[float, "BoxingStep | None"]]


def shortest_paths(
    ttype: TensorType,
    mesh: Mesh,
    src: NdSbp,
    step_time: Callable[[BoxingStep], float] | None = None,
) -> Tree:
    """Dijkstra from ``src`` over every layout that fits: layout -> (cost, last step).
    Ties keep the first path found, so results are deterministic."""
    cost_of = step_time or _default_time
    choices = [Sbp("B"), Sbp("P"), *(Sbp("S", d) for d in range(ttype.rank))]
    tree: Tree = {src: (0.0, None)}
    heap: list[tuple[float, int, NdSbp]] = [(0.0, 0, src)]
    counter = 1
    done: set[NdSbp] = set()
    while heap:
        cost, _, state = heapq.heappop(heap)
        if state in done:
            continue
        done.add(state)
        for axis in range(mesh.ndim):
            a = state.parts[axis]
            for b in choices:
                coll = _collective(a, b)
                if coll is None or not _sound(state, axis, a, b):
                    continue
                nxt = NdSbp((*state.parts[:axis], b, *state.parts[axis + 1 :]))
                if nxt in done or not fits_type(ttype, nxt, mesh):
                    continue
                step = BoxingStep(
                    coll,
                    axis,
                    state,
                    nxt,
                    mesh.shape[axis],
                    step_bytes(ttype, mesh, state, axis, coll),
                )
                c = cost + cost_of(step)
                if c < tree.get(nxt, (float("inf"), None))[0]:
                    tree[nxt] = (c, step)
                    heapq.heappush(heap, (c, counter, nxt))
                    counter += 1
    return tree


def path_to(tree: Tree, dst: NdSbp) -> list[BoxingStep]:
    """The steps to ``dst`` in a tree from shortest_paths (KeyError if unreachable)."""
    steps: list[BoxingStep] = []
    step = tree[dst][1]
    while step is not None:
        steps.append(step)
        step = tree[step.src][1]
    return steps[::-1]


def boxing_steps(
    ttype: TensorType,
    mesh: Mesh,
    src: NdSbp,
    dst: NdSbp,
    step_time: Callable[[BoxingStep], float] | None = None,
) -> list[BoxingStep]:
    """The cheapest sound sequence of steps from ``src`` to ``dst`` (``[]`` if equal)."""
    return checked_path(ttype, mesh, src, dst, lambda: shortest_paths(ttype, mesh, src, step_time))


def checked_path(
    ttype: TensorType, mesh: Mesh, src: NdSbp, dst: NdSbp, paths: Callable[[], Tree]
) -> list[BoxingStep]:
    """The steps to ``dst`` in the tree ``paths()`` gives (called only when needed), after
    checking both layouts fit."""
    if src == dst:
        return []
    for what, s in (("source", src), ("target", dst)):
        if not fits_type(ttype, s, mesh):
            raise BoxingError(f"{what} layout {s} does not fit {ttype} on mesh {mesh}")
    tree = paths()
    if dst not in tree:
        raise BoxingError(f"no boxing from {src} to {dst} for {ttype} on mesh {mesh}")
    return path_to(tree, dst)
