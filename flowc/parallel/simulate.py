"""The NumPy multi-rank simulator: every rank's physical graph, with simulated collectives.

It is the check that a plan is right: the physical program, run on every rank of the mesh
with the same inputs, must compute the logical graph's outputs. Local ops run through the
op registry's NumPy references (ops with a ``mesh`` attribute also see the rank's
coordinates); the four collectives run over each group of devices along their mesh axis.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from flowc.errors import InputError
from flowc.ir.builder import evaluate_node
from flowc.ir.graph import Attrs, Node, Value
from flowc.ir.layout import Coords, all_coords, group_of
from flowc.ops.comm import COLLECTIVES
from flowc.ops.registry import get_op
from flowc.parallel.lower import Physical

Env = dict[Coords, dict[Value, np.ndarray]]


def _sum(xs: list[np.ndarray]) -> np.ndarray:
    # Every member adds in the same order, so all members get bit-identical results (as a
    # deterministic collective would); bool is summed as "or", integers wrap like C.
    out = xs[0].copy()
    for x in xs[1:]:
        out = (out | x) if out.dtype == np.bool_ else (out + x).astype(out.dtype)
    return out


def run_collective(
    node: Node, ins: dict[Coords, np.ndarray], coords: list[Coords]
) -> dict[Coords, np.ndarray]:
    """One collective node over every group; ``ins`` holds each device's input."""
    mesh = tuple(node.attrs["mesh"])
    axis = int(node.attrs["mesh_axis"])
    out: dict[Coords, np.ndarray] = {}
    from flowc.ir.types import Mesh

    m = Mesh("sim", mesh)
    for c in coords:
        group = group_of(m, c, axis)
        members = [ins[g] for g in group]
        k = c[axis]
        if node.op == "AllReduce":
            out[c] = _sum(members)
        elif node.op == "AllGather":
            out[c] = np.stack(members)
        elif node.op == "ReduceScatter":
            out[c] = np.array(_sum([x[k] for x in members]), order="C")
        elif node.op == "AllToAll":
            out[c] = np.stack([x[k] for x in members])
        else:
            raise ValueError(f"{node.op} is not a collective")
    return out


def run_physical(phys: Physical, feeds: Mapping[Value, Mapping[Coords, np.ndarray]]) -> Env:
    """Run the physical graph; ``feeds`` gives each graph input's data per device."""
    mesh = phys.mesh
    coords = all_coords(mesh)
    env: Env = {c: {} for c in coords}
    for c in coords:
        for v in phys.graph.inputs:
            env[c][v] = feeds[v][c]
        for k in phys.graph.constants:
            env[c][k] = phys.constant_for(k, c)
    for node in phys.graph.nodes:
        if node.op in COLLECTIVES:
            # Each part of a bucket (an AllReduce of several inputs) on its own.
            for x, y in zip(node.inputs, node.outputs, strict=True):
                assert x is not None
                res = run_collective(node, {c: env[c][x] for c in coords}, coords)
                for c in coords:
                    env[c][y] = res[c]
            continue
        opdef = get_op(node.op)
        for c in coords:
            attrs = node.attrs
            if "mesh" in attrs:
                attrs = Attrs({**attrs, "coords": c})
            args = [None if i is None else env[c][i] for i in node.inputs]
            types = [o.type for o in node.outputs]
            outs = evaluate_node(opdef, args, attrs, types, f"{node.op} node {node.name!r}")
            # Ops may compute optional outputs the node does not have (LayerNorm's mean).
            for o, r in zip(node.outputs, outs, strict=False):
                env[c][o] = r
    return env


def simulate(phys: Physical, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """The outputs rank 0 writes, after checking every rank holds the same whole outputs."""
    coords = all_coords(phys.mesh)
    by_value: dict[Value, dict[Coords, np.ndarray]] = {}
    for v in phys.graph.inputs:
        if v.name not in feeds:
            raise InputError(f"no data for input {v.name!r}")
        by_value[v] = {c: np.asarray(feeds[v.name]) for c in coords}
    env = run_physical(phys, by_value)
    outs = []
    for o in phys.graph.outputs:
        first = env[coords[0]][o]
        for c in coords[1:]:
            if not np.array_equal(env[c][o], first, equal_nan=first.dtype.kind == "f"):
                raise AssertionError(f"ranks {coords[0]} and {c} disagree on output {o.name!r}")
        outs.append(first)
    return outs
