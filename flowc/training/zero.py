"""ZeRO as layouts (OneFlow's ZeRO is this and nothing more): the state a training step keeps
split S(0) over every device of the mesh instead of whole on each. The collectives follow from
ordinary boxing: the update runs on the shards (its gradient reduce-scattered, not
all-reduced), a split parameter is all-gathered before its use in the forward and the
backward, and the next parameter leaves the step as it entered it.

- stage 1: each trained parameter's optimizer state (Adam's moments, SGD's momentum);
- stage 2: the same layouts: a step keeps no gradient between steps (it lives from its
  product to its reduce-scatter, in the arena), so the gradient a stage-2 update reads is
  the reduce-scatter's shard either way;
- stage 3: the parameters too.

A tensor whose axis 0 does not divide by the mesh's size stays whole (listed).
"""

from __future__ import annotations

from collections.abc import Mapping

from flowc.ir.graph import Graph
from flowc.ir.layout import fits
from flowc.ir.types import Mesh, NdSbp, Sbp
from flowc.training.step import TrainingStep

STAGES = (1, 2, 3)


def zero_layouts(step: TrainingStep, mesh: Mesh, stage: int) -> tuple[dict[str, NdSbp], list[str]]:
    """(state name -> layout, the names that stay whole because their axis 0 does not split
    evenly)."""
    split = NdSbp(tuple(Sbp("S", 0) for _ in mesh.shape))
    names = [n for p in step.params for n in step.optimizer_state.get(p, [])]
    if stage >= 3:
        names += step.params
    shapes = {v.name: v.type.shape for v in step.graph.inputs}
    layouts: dict[str, NdSbp] = {}
    whole: list[str] = []
    for name in names:
        shape = shapes[name]
        if shape and fits(shape, split, mesh):
            layouts[name] = split
        else:
            whole.append(name)
    return layouts, whole


def rank_state_bytes(rank_graph: Graph, step: TrainingStep) -> tuple[int, int]:
    """One rank's bytes of the trained parameters and of their optimizer state (its shards of
    split ones) in a placed step's rank graph."""
    local = {v.name: v.type.nbytes for v in rank_graph.inputs}
    params = sum(local[p] for p in step.params)
    moments = sum(local[n] for p in step.params for n in step.optimizer_state.get(p, []))
    return params, moments


def zero_formula(param_bytes: int, moment_bytes: int, ranks: int, stage: int) -> int:
    """ZeRO's per-rank bytes of parameters, gradients and optimizer state as its paper counts
    them (the gradients kept beside the parameters, as large): fp32 AdamW's 16 bytes per
    parameter become 8 + 8/N at stage 1, 4 + 12/N at stage 2 and 16/N at stage 3."""
    grads = param_bytes
    if stage == 0:
        return param_bytes + grads + moment_bytes
    if stage == 1:
        return param_bytes + grads + moment_bytes // ranks
    if stage == 2:
        return param_bytes + (grads + moment_bytes) // ranks
    return (param_bytes + grads + moment_bytes) // ranks


def state_choices(
    step: TrainingStep, layouts: Mapping[str, NdSbp], used_whole: set[str]
) -> list[str]:
    """What a plan did with each trained parameter and its optimizer state, grouped: ZeRO's
    stages (the state split, the parameter gathered for its uses where ``used_whole`` names
    it), tensor parallelism (a split parameter its readers use split), or whole. Lines to
    print, one per group, each listing its parameters."""
    groups: dict[str, list[str]] = {}
    for p in step.params:
        mine = layouts.get(p)
        moments = [layouts.get(n) for n in step.optimizer_state.get(p, [])]
        split = mine is not None and any(q.kind == "S" for q in mine.parts)
        moments_split = any(m is not None and any(q.kind == "S" for q in m.parts) for m in moments)
        if split and p in used_whole:
            kind = f"ZeRO stage 3 (parameter and optimizer state {mine}, gathered for use)"
        elif split:
            kind = f"tensor parallel (parameter {mine}, used split)"
        elif moments_split:
            kind = "ZeRO stage 1/2 (optimizer state split, parameter whole)"
        else:
            kind = "whole"
        groups.setdefault(kind, []).append(p)
    return [f"{kind}: {', '.join(names)}" for kind, names in sorted(groups.items())]
