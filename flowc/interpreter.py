"""Evaluate a Graph with every op's NumPy reference: flowc's ground truth on the host."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from flowc.errors import InputError
from flowc.ir.builder import evaluate_node
from flowc.ir.graph import Graph, Value
from flowc.ops.registry import get_op


def check_feeds(graph: Graph, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Match user arrays to graph inputs by name, shape and dtype; clear errors otherwise."""
    names = [v.name for v in graph.inputs]
    unknown = sorted(set(feeds) - set(names))
    if unknown:
        raise InputError(
            f"unknown input(s) {', '.join(map(repr, unknown))}",
            hint="the model's inputs are: " + ", ".join(map(repr, names)),
        )
    out = {}
    for v in graph.inputs:
        if v.name not in feeds:
            raise InputError(
                f"input {v.name!r} ({v.type}) is not given",
                hint=f"pass --input {v.name}=PATH.npy, or --random-inputs",
            )
        a = np.asarray(feeds[v.name])
        if tuple(a.shape) != v.type.shape:
            raise InputError(
                f"input {v.name!r}: expected shape {list(v.type.shape)}, got {list(a.shape)}",
                hint="the model's dynamic dims are fixed by --shape/--dim; give matching values",
            )
        if a.dtype != v.type.dtype.np:
            raise InputError(
                f"input {v.name!r}: expected dtype {v.type.dtype}, got {a.dtype}",
                hint=f"save the array as {v.type.dtype.np} (numpy: a.astype(np.{v.type.dtype.np.name}))",
            )
        out[v.name] = a
    return out


# The most bytes --random-inputs makes, all inputs together: a model whose inputs are larger
# needs its inputs given as files (or smaller --shape/--dim values).
MAX_RANDOM_INPUT_BYTES = 4 << 30


def random_inputs(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs: floats ~ N(0, 1); integers in [0, 8), small enough to index any table."""
    total = sum(v.type.nbytes for v in graph.inputs)
    if total > MAX_RANDOM_INPUT_BYTES:
        big = max(graph.inputs, key=lambda v: v.type.nbytes)
        raise InputError(
            f"random inputs would take {_human(total)}; the largest, input {big.name!r} "
            f"({big.type}), takes {_human(big.type.nbytes)}, more than the "
            f"{_human(MAX_RANDOM_INPUT_BYTES)} flowc generates",
            hint="give smaller --shape/--dim values, or pass the inputs as --input NAME=PATH.npy",
        )
    rng = np.random.default_rng(seed)
    feeds = {}
    for v in graph.inputs:
        t = v.type
        if t.dtype.is_float or t.dtype.is_complex:
            a = rng.standard_normal(t.shape).astype(t.dtype.np)
        elif t.dtype.np == np.bool_:
            a = rng.random(t.shape) < 0.5
        else:
            a = rng.integers(0, 8, size=t.shape).astype(t.dtype.np)
        feeds[v.name] = a
    return feeds


def _human(n: int) -> str:
    if n < 1024:
        return f"{n} bytes"
    x = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        x /= 1024
        if x < 1024 or unit == "PiB":
            break
    return f"{x:.2f} {unit}"


def evaluate(
    graph: Graph,
    feeds: Mapping[str, np.ndarray],
    *,
    on_node: Callable[[int, int], None] | None = None,
) -> dict[str, np.ndarray]:
    """Run the graph; returns the outputs keyed by output name."""
    env: dict[Value, np.ndarray] = {}
    checked = check_feeds(graph, feeds)
    for v in graph.inputs:
        env[v] = checked[v.name]
    for c in graph.constants:
        assert c.const is not None
        env[c] = c.const
    users = graph.users()
    remaining = {v: len(u) for v, u in users.items()}
    keep = set(graph.outputs)
    for k, node in enumerate(graph.nodes):
        opdef = get_op(node.op)
        args = [env[i] if i is not None else None for i in node.inputs]
        where = f"{node.op} node {node.name!r}"
        outs = evaluate_node(opdef, args, node.attrs, [o.type for o in node.outputs], where)
        for o, a in zip(node.outputs, outs, strict=False):
            env[o] = a
        # Free intermediates as soon as their last reader ran: big models stay small.
        for i in node.inputs:
            if i is not None and i in remaining:
                remaining[i] -= 1
                if remaining[i] == 0 and i not in keep and i.const is None:
                    env.pop(i, None)
        if on_node is not None:
            on_node(k + 1, len(graph.nodes))
    return {v.name: env[v] for v in graph.outputs}
