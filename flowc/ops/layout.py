"""Axis permutations: Transpose, DepthToSpace and SpaceToDepth. Each output is a row-major
view of the input (the input itself for Transpose; for the depth/space ops a 6-D view that
splits the channels or the spatial axes into blocks) with its axes permuted, made contiguous:
one strided copy (``_emit_permuted`` -> movement.emit_box). Moving data is linear, so every
op here passes P through.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from flowc.errors import ShapeError
from flowc.ir.graph import Attrs, Node
from flowc.ir.types import TensorType
from flowc.ops import grad
from flowc.ops import sbp_rules as sr
from flowc.ops.movement import Fail, arg, emit_box, move_data, node_input
from flowc.ops.registry import (
    InferCtx,
    SbpSignature,
    defop,
    node_attrs,
    row_major_strides,
    set_vjp,
)

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.graph import Value

FAMILY = "shape"


def _emit_permuted(prog: Program, node: Node, view: Sequence[int], perm: Sequence[int]) -> None:
    """The output is the input seen as ``view``, transposed by ``perm``, made contiguous."""
    x, out = node_input(node, 0), node.outputs[0]
    vs = row_major_strides(view)
    ts = row_major_strides([view[p] for p in perm])
    emit_box(prog, x, 0, out, 0, [(view[p], vs[p], ts[k]) for k, p in enumerate(perm)])


# -- Transpose ---------------------------------------------------------------------------------


def _perm(fail: Fail, a: Mapping[str, Any], rank: int) -> list[int]:
    perm = a.get("perm")
    if perm is None:
        return list(range(rank))[::-1]
    perm = list(perm)
    if sorted(perm) != list(range(rank)):
        raise fail(f"perm {perm} is not a permutation of the {rank} axes")
    return perm


def _transpose_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    perm = _perm(ctx.fail, ctx.attrs, x.rank)
    return [x.with_shape([x.shape[p] for p in perm])]


def _transpose_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = arg(xs, 0)
    perm = _perm(ValueError, a, x.ndim)
    return move_data(x, [x.shape[p] for p in perm], lambda v: np.transpose(v, perm))


def _transpose_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    perm = _perm(ctx.fail, ctx.attrs, outs[0].rank)
    return [*sr.splits(ctx, outs, ((p, j) for j, p in enumerate(perm))), sr.partial(ctx, outs)]


def _transpose_emit(prog: Program, node: Node) -> None:
    x, out = node_input(node, 0), node.outputs[0]
    perm = _perm(prog.fail, node.attrs, x.type.rank)
    if not prog.is_sized(node) or prog.leading_only(node):
        _emit_permuted(prog, node, x.type.shape, perm)
        return
    # Symbolic dims moved: the run's dims and strides, read from the size table.
    strides = []
    for j in range(x.type.rank):
        inner = prog.count(x.type, j + 1, x.type.rank, "sizes")
        strides.append(inner)
    name = prog.kernel(
        "shape.cu.j2",
        "transpose_sized",
        ctype=prog.ctype(out),
        dims=[prog.dim(out.type, k) for k in range(out.type.rank)],
        strides=[strides[p] for p in perm],
    )
    prog.launch_sized(name, prog.numel(out.type), [prog.cptr(x), prog.ptr(out)])


defop(
    "Transpose",
    FAMILY,
    infer=_transpose_infer,
    reference=_transpose_ref,
    attrs={"perm": None},
    emit=_transpose_emit,
    sbp=_transpose_sbp,
    sized=True,
)
# -- DepthToSpace, SpaceToDepth ----------------------------------------------------------------


def _block(ctx: InferCtx) -> tuple[TensorType, int]:
    x = ctx.type(0)
    b = ctx.attrs.get("blocksize")
    if b is None or b < 1:
        raise ctx.fail(f"needs a positive 'blocksize' attribute, got {b}")
    if x.rank != 4:
        raise ctx.fail(f"needs a 4-D NCHW input, got shape {list(x.shape)}")
    return x, int(b)


def _block_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    """Batch, rows and columns split through both ops: an input row or column becomes
    blocksize consecutive ones (DepthToSpace), or blocksize of them one (SpaceToDepth). The
    channels split only in CRD mode, where each channel block of DepthToSpace's input becomes
    one output channel and each input channel of SpaceToDepth a run of output channels; in
    DCR the blocks interleave with the channels."""
    axes = (0, 1, 2, 3) if ctx.attr("mode") == "CRD" else (0, 2, 3)
    return [*sr.same_axes(ctx, outs, axes), sr.partial(ctx, outs)]


def _d2s_infer(ctx: InferCtx) -> list[TensorType]:
    x, b = _block(ctx)
    n, c, h, w = x.shape
    if c % (b * b):
        raise ctx.fail(f"channels {c} are not a multiple of blocksize² = {b * b}")
    if ctx.attr("mode") not in ("DCR", "CRD"):
        raise ctx.fail(f"mode {ctx.attr('mode')!r} is not DCR or CRD")
    return [x.with_shape((n, c // (b * b), h * b, w * b))]


def _d2s_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = arg(xs, 0)
    b = a["blocksize"]
    n, c, h, w = x.shape
    if a["mode"] == "DCR":
        t = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
    else:
        t = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
    return t.reshape(n, c // (b * b), h * b, w * b)


def _d2s_emit(prog: Program, node: Node) -> None:
    a = node_attrs(node)
    b = a["blocksize"]
    n, c, h, w = node_input(node, 0).type.shape
    if a["mode"] == "DCR":
        _emit_permuted(prog, node, (n, b, b, c // (b * b), h, w), (0, 3, 4, 1, 5, 2))
    else:
        _emit_permuted(prog, node, (n, c // (b * b), b, b, h, w), (0, 1, 4, 2, 5, 3))


defop(
    "DepthToSpace",
    FAMILY,
    infer=_d2s_infer,
    reference=_d2s_ref,
    attrs={"blocksize": None, "mode": "DCR"},
    emit=_d2s_emit,
    sbp=_block_sbp,
)


def _s2d_infer(ctx: InferCtx) -> list[TensorType]:
    x, b = _block(ctx)
    n, c, h, w = x.shape
    if h % b or w % b:
        raise ctx.fail(f"height {h} and width {w} must be multiples of the blocksize {b}")
    if ctx.attr("mode") not in ("DCR", "CRD"):
        raise ctx.fail(f"mode {ctx.attr('mode')!r} is not DCR or CRD")
    return [x.with_shape((n, c * b * b, h // b, w // b))]


def _s2d_perm(mode: str) -> tuple[int, ...]:
    # Of (n, c, h/b, b_h, w/b, b_w): DCR puts the block offsets before the channel, CRD after.
    return (0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4)


def _s2d_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = arg(xs, 0)
    b = a["blocksize"]
    n, c, h, w = x.shape
    t = x.reshape(n, c, h // b, b, w // b, b).transpose(_s2d_perm(a["mode"]))
    return t.reshape(n, c * b * b, h // b, w // b)


def _s2d_emit(prog: Program, node: Node) -> None:
    a = node_attrs(node)
    b = a["blocksize"]
    n, c, h, w = node_input(node, 0).type.shape
    _emit_permuted(prog, node, (n, c, h // b, b, w // b, b), _s2d_perm(a["mode"]))


defop(
    "SpaceToDepth",
    FAMILY,
    infer=_s2d_infer,
    reference=_s2d_ref,
    attrs={"blocksize": None, "mode": "DCR"},
    emit=_s2d_emit,
    sbp=_block_sbp,
)


# -- gradients (VJP rules: flowc/ops/grad.py) ---------------------------------------------------


def _transpose_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    g, x = gouts[0], node.inputs[0]
    if g is None or x is None or not need[0]:
        return [None]
    perm = _perm(ShapeError, node.attrs, x.type.rank)
    inverse = [0] * len(perm)
    for j, p in enumerate(perm):
        inverse[p] = j
    return [grad.op1(b, "Transpose", g, perm=inverse)]


set_vjp("Transpose", _transpose_vjp)
