"""verify_graph: SSA form, types, topological order, dangling uses, placements."""

from __future__ import annotations

from flowc.errors import FlowcError, VerifyError
from flowc.ir.graph import Graph, Value
from flowc.ir.symbolic import COUNT
from flowc.ir.types import TensorType


def _where(node_desc: str) -> str:
    return f"node {node_desc}"


def verify_graph(g: Graph) -> None:
    """Raise VerifyError naming the first offending node or value."""
    from flowc.ops.registry import get_op

    defined: set[Value] = set()
    names: dict[str, Value] = {}

    def define(v: Value, where: str) -> None:
        if v in defined:
            raise VerifyError(f"{where}: value {v.name!r} is defined twice (SSA violated)")
        if v.name in names:
            raise VerifyError(f"{where}: two values are named {v.name!r}")
        if not isinstance(v.type, TensorType):
            raise VerifyError(f"{where}: value {v.name!r} has no tensor type")
        if v.sbp is not None:
            if g.mesh is None:
                raise VerifyError(
                    f"{where}: value {v.name!r} has placement {v.sbp} but the graph has no mesh"
                )
            try:
                v.sbp.check(v.type, g.mesh)
            except ValueError as e:
                raise VerifyError(f"{where}: value {v.name!r}: {e}") from None
        defined.add(v)
        names[v.name] = v

    for v in g.inputs:
        if v.producer is not None or v.const is not None:
            raise VerifyError(f"graph input {v.name!r} must not have a producer or constant data")
        define(v, f"graph input {v.name!r}")
    for c in g.constants:
        if c.const is None:
            raise VerifyError(f"constant {c.name!r} carries no data")
        if tuple(c.const.shape) != c.type.shape or c.const.dtype != c.type.dtype.np:
            raise VerifyError(
                f"constant {c.name!r}: data is {c.const.dtype}{list(c.const.shape)} but its type says {c.type}"
            )
        define(c, f"constant {c.name!r}")

    for idx, n in enumerate(g.nodes):
        desc = f"#{idx} {n.op} {n.name!r}" if n.name else f"#{idx} {n.op}"
        where = _where(desc)
        try:
            opdef = get_op(n.op)
        except KeyError:
            raise VerifyError(f"{where}: unknown op {n.op!r}") from None
        for j, i in enumerate(n.inputs):
            if i is None:
                continue
            if i not in defined:
                raise VerifyError(
                    f"{where}: input {j} ({i.name!r}) is used before it is defined "
                    "(nodes are not in topological order, or the value is dangling)"
                )
        for o in n.outputs:
            if o.producer is not n:
                raise VerifyError(f"{where}: output {o.name!r} does not point back to its node")
            define(o, where)
        try:
            expected = opdef.infer_types(n)
        except (FlowcError, ValueError, KeyError, IndexError, TypeError) as e:
            raise VerifyError(f"{where}: type inference fails: {e}") from None
        for o, t in zip(n.outputs, expected, strict=False):
            # (symbolic dims are found by reading the graph at several sizes, not by an op's
            # inference: the type at the bound is what inference checks)
            if not _same_type(o.type, t):
                raise VerifyError(
                    f"{where}: output {o.name!r} has type {o.type} but the op gives {t}"
                )
        if len(expected) != len(n.outputs):
            raise VerifyError(
                f"{where}: has {len(n.outputs)} outputs, the op gives {len(expected)}"
            )

    for o in g.outputs:
        if o not in defined:
            raise VerifyError(f"graph output {o.name!r} is never defined")
    _verify_state(g)


def _verify_state(g: Graph) -> None:
    """Each state pair: an input with its first value in ``params`` and an output of the same
    type written by a node of its own (so it can be written over the input), once each."""
    inputs = {v.name: v for v in g.inputs}
    outputs: dict[str, list[Value]] = {}
    for o in g.outputs:
        outputs.setdefault(o.name, []).append(o)
    seen: set[str] = set()
    for i, o_name in g.state.items():
        where = f"state {i!r} -> {o_name!r}"
        if i not in inputs or i not in g.params:
            raise VerifyError(f"{where}: {i!r} is no graph input with a first value")
        if o_name is None:
            continue
        if len(outputs.get(o_name, [])) != 1:
            raise VerifyError(f"{where}: {o_name!r} is not exactly one of the graph's outputs")
        out = outputs[o_name][0]
        if out.producer is None or out.type != inputs[i].type:
            raise VerifyError(
                f"{where}: {o_name!r} must be a node's output of type {inputs[i].type}"
            )
        if o_name in seen:
            raise VerifyError(f"{where}: {o_name!r} is the next value of two state inputs")
        seen.add(o_name)


def _same_type(have: TensorType, inferred: TensorType) -> bool:
    """A value's type against its op's inference: the same at the bound (symbolic dims are
    found by building the graph at several sizes, not by an op's inference), but for a
    data-dependent dim, whose rows a probe build sets (ir/fit_dims.py)."""
    if have.dtype != inferred.dtype or have.rank != inferred.rank:
        return False
    counts = inferred.sym or (None,) * inferred.rank
    return all(
        a == b or (c is not None and COUNT in c.symbols)
        for a, b, c in zip(have.shape, inferred.shape, counts, strict=True)
    )
