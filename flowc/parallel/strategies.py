"""A node's parallel strategies: its nd signatures on a mesh.

An op declares 1-D signatures (flowc.ops.registry.SbpSignature, one mesh axis); on an
n-D mesh a strategy picks one per mesh axis, as OneFlow composes nd-SBP signatures. A
combination is kept only when every split divides its axis evenly (flowc splits evenly, so
all ranks run one program on equal shapes).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from flowc.ir.dtype import DType
from flowc.ir.graph import Node
from flowc.ir.layout import fits_type, has_partial
from flowc.ir.types import BROADCAST, Mesh, NdSbp
from flowc.ops.registry import SbpSignature, get_op


@dataclass(frozen=True)
class Strategy:
    """One nd signature: a 1-D signature per mesh axis."""

    axes: tuple[SbpSignature, ...]

    def input(self, i: int) -> NdSbp | None:
        parts = [sig.inputs[i] for sig in self.axes]
        if any(p is None for p in parts):
            return None
        return NdSbp(tuple(p for p in parts if p is not None))

    def output(self, j: int) -> NdSbp:
        return NdSbp(tuple(sig.outputs[j] for sig in self.axes))

    @property
    def physical(self) -> str | None:
        names = {sig.physical for sig in self.axes if sig.physical}
        return names.pop() if names else None

    def __str__(self) -> str:
        if len(self.axes) == 1:
            return str(self.axes[0])
        return " x ".join(str(a) for a in self.axes)


def all_broadcast_signature(node: Node) -> SbpSignature:
    return SbpSignature(
        tuple(None if i is None else BROADCAST for i in node.inputs),
        tuple(BROADCAST for _ in node.outputs),
    )


def signatures_1d(node: Node) -> list[SbpSignature]:
    """The op's declared 1-D signatures (all-B first), without duplicates, in a fixed order."""
    opdef = get_op(node.op)
    sigs = [all_broadcast_signature(node)]
    if opdef.sbp is not None:
        ctx = opdef.ctx(node)
        for sig in opdef.sbp(ctx, [o.type for o in node.outputs]):
            if len(sig.inputs) != len(node.inputs) or len(sig.outputs) != len(node.outputs):
                raise AssertionError(
                    f"{node.op}: signature {sig} does not match the node's "
                    f"{len(node.inputs)} inputs and {len(node.outputs)} outputs"
                )
            fixed = SbpSignature(
                tuple(None if node.inputs[i] is None else s for i, s in enumerate(sig.inputs)),
                sig.outputs,
                sig.physical,
            )
            if fixed not in sigs:
                sigs.append(fixed)
    return sigs


def strategies(node: Node, mesh: Mesh) -> list[Strategy]:
    """Every valid nd strategy of ``node`` on ``mesh``; the all-B one first."""
    one = signatures_1d(node)
    out = []
    for combo in itertools.product(one, repeat=mesh.ndim):
        s = Strategy(tuple(combo))
        if len({sig.physical for sig in combo if sig.physical}) > 1:
            continue
        ok = True
        for i, v in enumerate(node.inputs):
            sbp = s.input(i)
            if v is not None and sbp is not None and not fits_type(v.type, sbp, mesh):
                ok = False
                break
        if ok:
            for j, o in enumerate(node.outputs):
                if not fits_type(o.type, s.output(j), mesh):
                    ok = False
                    break
        # A partial sum of booleans has no sum to reduce to (a mask made from a partial
        # value, read partial by a view): such a value is made whole, never P.
        if ok:
            held = [(v, s.input(i)) for i, v in enumerate(node.inputs)]
            held += [(o, s.output(j)) for j, o in enumerate(node.outputs)]
            ok = not any(
                v is not None
                and sbp is not None
                and v.type.dtype == DType.BOOL
                and has_partial(sbp)
                for v, sbp in held
            )
        if ok:
            out.append(s)
    return out
