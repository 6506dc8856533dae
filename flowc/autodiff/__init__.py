"""Reverse-mode automatic differentiation over flowc's IR.

``gradients(graph, loss, wrt)`` appends to ``graph`` the nodes that compute the gradient of
the scalar ``loss`` with respect to each value of ``wrt`` and returns them. The nodes are
ordinary IR, built by each op's VJP rule (OpDef.vjp, flowc/ops/grad.py), so everything after
this (fusion, placement, schedule, memory, code generation) treats them like the forward
nodes: there is one autodiff, and later parallel training adds SBP rules, not a second one.

Gradients flow only through float values that depend on ``wrt``: integer paths (indices,
shapes) and comparisons carry none. A value whose gradient must flow through an op without a
rule is an error naming the op and the node. Several contributions to one value's gradient
are added in a fixed order (the reverse of the graph's), so the graph built is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from flowc.errors import InputError
from flowc.ir.builder import GraphBuilder
from flowc.ir.graph import Graph, Node, Value
from flowc.ops.registry import get_op

__all__ = ["GradientError", "gradients"]


class GradientError(InputError):
    """A gradient cannot be built: an op without a VJP rule on the path, a loss that is not
    a scalar, a value asked for that is not in the graph."""


class _Builder:
    """The GradBuilder the VJP rules see: nodes named after the forward node they
    differentiate, ``<node>/grad/<op>``."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.builder = GraphBuilder(graph, fold=True)
        self.base = "grad"

    def emit(
        self,
        op: str,
        inputs: Sequence[Value | None],
        attrs: dict[str, Any] | None = None,
        num_outputs: int | None = None,
    ) -> list[Value]:
        return self.builder.emit(
            op, inputs, attrs, name=f"{self.base}/{op}", num_outputs=num_outputs
        )

    def const(self, array: np.ndarray, name: str = "c") -> Value:
        return self.builder.constant(f"{self.base}/{name}", np.asarray(array))


def _depends_on(graph: Graph, wrt: Sequence[Value]) -> set[Value]:
    """The float values computed from ``wrt`` (those included): where gradients flow."""
    active = {v for v in wrt}
    for node in graph.nodes:
        if any(i in active for i in node.inputs if i is not None):
            active.update(o for o in node.outputs if o.type.dtype.is_float)
    return active


def gradients(graph: Graph, loss: Value, wrt: Sequence[Value]) -> dict[Value, Value | None]:
    """The gradient of ``loss`` (one element) with respect to each of ``wrt``, as values of
    ``graph`` (None for a value the loss does not depend on). Adds the nodes to ``graph``."""
    if loss.type.numel != 1:
        raise GradientError(
            f"the loss {loss.name!r} has shape {list(loss.type.shape)}: a gradient needs a "
            "loss of one element",
            hint="reduce it to a scalar (a sum or a mean) first",
        )
    if not loss.type.dtype.is_float:
        raise GradientError(f"the loss {loss.name!r} is {loss.type.dtype}, not a float")
    known = set(graph.values())
    for v in wrt:
        if v not in known:
            raise GradientError(f"{v.name!r} is not a value of graph {graph.name!r}")
    active = _depends_on(graph, wrt)
    b = _Builder(graph)
    contributions: dict[Value, list[Value]] = {}
    if loss in active:
        contributions[loss] = [b.const(np.ones(loss.type.shape, loss.type.dtype.np), "seed")]
    forward = list(graph.nodes)  # the nodes the rules add come after, and are not walked
    for node in reversed(forward):
        gouts = [_total(b, node, o, contributions) for o in node.outputs]
        if all(g is None for g in gouts):
            continue
        need = [i is not None and i in active for i in node.inputs]
        if not any(need):
            continue
        opdef = get_op(node.op)
        if opdef.vjp is None:
            raise GradientError(
                f"no gradient rule for {node.op} (node {node.name!r}): the loss's gradient "
                "flows through it to " + _names(node, active),
                hint="freeze the parameters behind this node, or compute the loss without it",
            )
        b.base = f"{node.name or node.op}/grad"
        grads = opdef.vjp(b, node, gouts, need)
        if len(grads) != len(node.inputs):
            raise AssertionError(f"{node.op}'s VJP returned {len(grads)} gradients")
        for value, g, wanted in zip(node.inputs, grads, need, strict=True):
            if value is None or g is None or not wanted:
                continue
            if tuple(g.type.shape) != tuple(value.type.shape):
                raise AssertionError(
                    f"{node.op}'s VJP gave {value.name!r} a gradient of shape "
                    f"{list(g.type.shape)}, not {list(value.type.shape)}"
                )
            contributions.setdefault(value, []).append(g)
    b.base = "grad"
    result: dict[Value, Value | None] = {}
    for v in wrt:
        result[v] = _sum(b, contributions.get(v, []))
    return result


def _total(
    b: _Builder, node: Node, v: Value, contributions: dict[Value, list[Value]]
) -> Value | None:
    parts = contributions.get(v)
    if not parts:
        return None
    b.base = f"{node.name or node.op}/grad"
    total = _sum(b, parts)
    contributions[v] = [total] if total is not None else []
    return total


def _sum(b: _Builder, parts: list[Value]) -> Value | None:
    if not parts:
        return None
    total = parts[0]
    for p in parts[1:]:
        total = b.emit("Add", [total, p])[0]
    return total


def _names(node: Node, active: set[Value]) -> str:
    names = [i.name for i in node.inputs if i is not None and i in active]
    return ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
