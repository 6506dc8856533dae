"""Building blocks for the ops' SBP signatures (one mesh axis each; see DESIGN.md, "SBP").

Each op family declares its signatures next to its shape inference as a short list built
from these helpers. Conventions shared by all of them: an omitted optional input is None in
every signature; an input a helper is not told to lay out otherwise (a shape, axes, pads, a
scalar bound, an operand that broadcasts) is B; the all-B signature is implied and never
listed. Splits are listed whatever the
sizes: flowc.parallel.strategies drops the ones that do not divide evenly on a mesh.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from flowc.ir.graph import Node
from flowc.ir.types import BROADCAST, PARTIAL, Sbp, TensorType
from flowc.ops.registry import InferCtx, LocalizeFn, SbpSignature

B = BROADCAST
P = PARTIAL
S = Sbp.split


def inputs(ctx: InferCtx, given: Mapping[int, Sbp]) -> tuple[Sbp | None, ...]:
    """One Sbp per input: ``given`` where stated, B for the other present ones, None for
    omitted ones."""
    return tuple(None if not ctx.has(i) else given.get(i, B) for i in range(ctx.num_inputs))


def sig(
    ctx: InferCtx,
    given: Mapping[int, Sbp],
    outputs: Sbp | Sequence[Sbp],
    n_out: int,
    physical: str | None = None,
) -> SbpSignature:
    """A signature; ``outputs`` is one Sbp for every output or one per output."""
    outs = tuple(outputs) if isinstance(outputs, Sequence) else (outputs,) * n_out
    return SbpSignature(inputs(ctx, given), outs, physical)


def splits(
    ctx: InferCtx,
    outs: Sequence[TensorType],
    pairs: Iterable[tuple[int, int]],
    data: int = 0,
) -> list[SbpSignature]:
    """For each (i, j): input ``data`` S(i), every other input B, every output S(j)."""
    return [sig(ctx, {data: S(i)}, S(j), len(outs)) for i, j in pairs]


def same_axes(
    ctx: InferCtx, outs: Sequence[TensorType], axes: Iterable[int], data: int = 0
) -> list[SbpSignature]:
    """S(i) -> S(i) for each of ``axes``: ops that work independently along them."""
    return splits(ctx, outs, ((i, i) for i in axes), data)


def partial(ctx: InferCtx, outs: Sequence[TensorType], data: Iterable[int] = (0,)) -> SbpSignature:
    """Inputs ``data`` P, the others B, every output P: for ops linear in those inputs
    jointly (the sum over devices of f(parts) is f(sum of parts))."""
    return sig(ctx, dict.fromkeys(data, P), P, len(outs))


def aligned(shape: tuple[int, ...], out_rank: int, j: int) -> Sbp:
    """How an input that broadcasts (aligned from the right) must be laid out when the
    output is S(j): split on the matching axis, or B where it has no such axis or size 1."""
    a = j - (out_rank - len(shape))
    return B if a < 0 or shape[a] == 1 else S(a)


def broadcast_splits(
    ctx: InferCtx, outs: Sequence[TensorType], data: Iterable[int] | None = None
) -> list[SbpSignature]:
    """Every output S(j) (outputs share one shape) with each data input (all present ones
    by default) split on its aligned axis, or B where it broadcasts along j."""
    out = outs[0].shape
    idx = [i for i in (range(ctx.num_inputs) if data is None else data) if ctx.has(i)]
    return [
        sig(ctx, {i: aligned(ctx.shape(i), len(out), j) for i in idx}, S(j), len(outs))
        for j, d in enumerate(out)
        if d != 1
    ]


def kept_axes(rank: int, dropped: Iterable[int], keepdims: bool) -> list[tuple[int, int]]:
    """(input axis, output axis) for the axes a reduction keeps; with ``keepdims`` the
    reduced axes stay as size 1 and the others keep their place."""
    gone = set(dropped)
    pairs = []
    at = 0
    for i in range(rank):
        if i not in gone:
            pairs.append((i, i if keepdims else at))
            at += 1
    return pairs


def reshape_pairs(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, int]]:
    """(input axis, output axis) pairs a row-major reshape maps a split through.

    The axes of both shapes fall into groups with equal products (size-1 axes belong to
    none). Splitting the outermost axis of an input group in f chunks cuts every group
    element range in f contiguous pieces, which is exactly splitting the outermost axis of
    the output group in f; whether f divides both axes is for the caller's fits check.
    Inner axes of a group have no such image. Empty tensors map nothing.
    """
    if 0 in src or 0 in dst:
        return []
    a = [k for k, d in enumerate(src) if d != 1]
    b = [k for k, d in enumerate(dst) if d != 1]
    pairs = []
    i = j = 0
    while i < len(a) and j < len(b):
        lead = (a[i], b[j])
        pa, pb = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa *= src[a[i]]
                i += 1
            else:
                pb *= dst[b[j]]
                j += 1
        pairs.append(lead)
    return pairs


def local_shape_input(position: int, output: int = 0) -> LocalizeFn:
    """A localize hook for ops whose constant input ``position`` spells the output shape
    (Reshape, Expand): each rank gets its own output shape there."""

    def localize(
        node: Node, ins: Sequence[TensorType | None], outs: Sequence[TensorType]
    ) -> dict[int, np.ndarray]:
        # Unsplit, the node keeps its own constant (whose zeros may mean "copy the input's
        # dimension", which a spelled-out empty shape would not).
        if outs[output].shape == node.outputs[output].type.shape:
            return {}
        v = node.inputs[position]
        dtype = v.const.dtype if v is not None and v.const is not None else np.dtype(np.int64)
        return {position: np.asarray(outs[output].shape, dtype=dtype)}

    return localize
