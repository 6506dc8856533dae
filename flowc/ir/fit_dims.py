"""Symbolic types by reading a graph at several sizes.

A program with symbolic dims (``--dim batch=1..64``, a .flow ``dim`` declaration) is built
-- imported and put through the passes -- with every symbol at its bound, which is the graph
flowc compiles, and at 2^n probe sizes (each of n symbols at two sizes below the bound).
Every value is matched by name across the builds, and each of its dims whose size changes
is fitted by the multilinear integer polynomial of the symbols through the probes
(ir/symbolic.py), then checked at the bound. So every op's shape inference, the exporters'
shape arithmetic (Shape -> Gather -> Concat -> Reshape, Range, Expand, -1 in a Reshape) and
every pass work over symbols without a symbolic rule of their own.

What the generated program could not do at every size in range is refused here, naming the
node: a graph whose structure or attributes change with the sizes, a dim that is no such
polynomial (``seq/2``), a constant computed from the sizes that a kernel would read, a
constant whose symbolic shape is not a prefix of its bound's memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from flowc.errors import ShapeError
from flowc.ir.graph import Graph, Node, Value
from flowc.ir.symbolic import DimRange, SymDim, fit, probe_points
from flowc.ir.types import TensorType
from flowc.ops.registry import get_op

# The inputs that only give their node's output shape (the kernel never reads them): a
# constant there may hold sizes computed from the symbols.
SHAPE_ONLY_INPUTS = frozenset({("Reshape", 1), ("Expand", 1), ("ConstantOfShape", 0)})


def _where(v: Value) -> str:
    n = v.producer
    if n is None:
        return f"constant {v.name!r}" if v.const is not None else f"input {v.name!r}"
    return f"{n.op} node {n.name or v.name!r} (value {v.name!r})"


def _same_attr(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
        )
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_attr(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _size_text(point: Mapping[str, int]) -> str:
    return ", ".join(f"{s}={k}" for s, k in point.items())


def _check_structure(graph: Graph, probe: Graph, point: Mapping[str, int]) -> None:
    for k, n in enumerate(graph.nodes):
        m = probe.nodes[k] if k < len(probe.nodes) else None
        if m is None or m.op != n.op or [o.name for o in m.outputs] != [o.name for o in n.outputs]:
            raise ShapeError(
                f"{n.op} node {n.name or n.outputs[0].name!r}: the graph is not the same at "
                f"{_size_text(point)} as at the bound (here it has "
                f"{'nothing' if m is None else m.op + ' node ' + repr(m.name)})",
                hint="a graph whose ops depend on the sizes cannot be one program for the "
                "range; narrow the range or fix the dim with --dim NAME=N",
            )
        sizeless = get_op(n.op).sizeless
        mine, theirs = (sizeless(n.attrs), sizeless(m.attrs)) if sizeless else (n.attrs, m.attrs)
        for key in sorted(set(mine) | set(theirs)):
            if key not in mine or key not in theirs or not _same_attr(mine[key], theirs[key]):
                raise ShapeError(
                    f"{n.op} node {n.name or n.outputs[0].name!r}: its attribute {key!r} "
                    f"depends on the sizes ({_attr_text(m.attrs.get(key))} at "
                    f"{_size_text(point)}, {_attr_text(n.attrs.get(key))} at the bound)",
                    hint="flowc takes such a node at one size only; fix the dim with --dim NAME=N",
                )
    if len(probe.nodes) != len(graph.nodes):
        extra = probe.nodes[len(graph.nodes)]
        raise ShapeError(
            f"{extra.op} node {extra.name!r}: the graph is not the same at {_size_text(point)} "
            "as at the bound (it has more nodes there)",
            hint="fix the dim with --dim NAME=N",
        )


def _attr_text(a: Any) -> str:
    text = repr(a.tolist()) if isinstance(a, np.ndarray) else repr(a)
    return text if len(text) <= 40 else text[:37] + "..."


def _fit_type(
    v: Value,
    names: list[str],
    points: list[dict[str, int]],
    others: list[Value],
    bound: Mapping[str, int],
) -> TensorType:
    sym: list[SymDim | None] = []
    for k, d in enumerate(v.type.shape):
        sizes = [o.type.shape[k] for o in others]
        if all(s == d for s in sizes):
            sym.append(None)
            continue
        f = fit(names, points, sizes)
        at_bound = f.evaluate(bound) if isinstance(f, SymDim) else f
        if f is None or at_bound != d:
            seen = ", ".join(f"{s} at {_size_text(p)}" for s, p in zip(sizes, points, strict=True))
            raise ShapeError(
                f"{_where(v)}: dim {k} is {seen}, {d} at the bound: not a polynomial of "
                f"{', '.join(names)} with integer coefficients (as batch, 2*seq, batch*seq)",
                hint="flowc sizes such a dim at run time only when it is one; fix the dim "
                "with --dim NAME=N",
            )
        sym.append(f if isinstance(f, SymDim) else None)
    return TensorType(v.type.shape, v.type.dtype, tuple(sym))


def _check_constant(
    c: Value, probes: list[tuple[dict[str, int], Value]], readers: list[tuple[Node, int]]
) -> None:
    """A constant whose data changes with the sizes: either a prefix of its data at the bound
    (a table read up to a symbolic length: position ids) or sizes only a shape reads."""
    assert c.const is not None
    full = np.asarray(c.const)
    ttype = c.type
    if ttype.sym is not None:
        lead = next((k for k, d in enumerate(ttype.shape) if d != 1), None)
        if any(s is not None for s in ttype.sym[(lead or 0) + 1 :]):
            raise ShapeError(
                f"{_where(c)} has the symbolic type {ttype}: a constant may change size along "
                "its outermost dim only",
                hint="fix the dim with --dim NAME=N",
            )
        for point, p in probes:
            part = full[tuple(slice(0, n) for n in p.type.shape)]
            if not np.array_equal(part, np.asarray(p.const), equal_nan=full.dtype.kind in "fc"):
                raise ShapeError(
                    f"{_where(c)}: its data at {_size_text(point)} is not the start of its "
                    "data at the bound, so no one constant serves every size",
                    hint="fix the dim with --dim NAME=N",
                )
        return
    varies = any(
        not np.array_equal(full, np.asarray(p.const), equal_nan=full.dtype.kind in "fc")
        for _, p in probes
    )
    if not varies:
        return
    for n, k in readers:
        if (n.op, k) not in SHAPE_ONLY_INPUTS:
            point, p = next(
                (pt, p) for pt, p in probes if not np.array_equal(full, np.asarray(p.const))
            )
            raise ShapeError(
                f"{n.op} node {n.name or n.outputs[0].name!r} reads {c.name!r} (input {k}), "
                f"computed from the sizes ({_attr_text(np.asarray(p.const))} at "
                f"{_size_text(point)}, {_attr_text(full)} at the bound): the program would "
                "need it at run time",
                hint="flowc computes sizes at run time only for the shapes of Reshape and "
                "Expand for now; fix the dim with --dim NAME=N",
            )


def annotate_symbols(
    graph: Graph, ranges: Mapping[str, DimRange], build: Callable[[dict[str, int]], Graph]
) -> Graph:
    """``graph`` (built with every symbol at its bound) with symbolic types: ``build`` makes
    the same graph with the symbols at the given sizes."""
    names = list(ranges)
    bound = {s: r.hi for s, r in ranges.items()}
    points = probe_points(ranges)
    probes = [build(dict(p)) for p in points]
    for p, g in zip(points, probes, strict=True):
        _check_structure(graph, g, p)
    tables = [{v.name: v for v in g.values()} for g in probes]
    readers: dict[Value, list[tuple[Node, int]]] = {}
    for n in graph.nodes:
        for k, i in enumerate(n.inputs):
            if i is not None:
                readers.setdefault(i, []).append((n, k))
    for v in list(graph.values()):
        others = []
        for p, table in zip(points, tables, strict=True):
            o = table.get(v.name)
            if o is None or o.type.rank != v.type.rank or o.type.dtype != v.type.dtype:
                raise ShapeError(
                    f"{_where(v)}: the graph is not the same at {_size_text(p)} as at the "
                    f"bound ({'no such value' if o is None else 'of type ' + str(o.type)} "
                    f"there, {v.type} at the bound)",
                    hint="fix the dim with --dim NAME=N",
                )
            others.append(o)
        v.type = _fit_type(v, names, points, others, bound)
        if v.const is not None:
            _check_constant(v, list(zip(points, others, strict=True)), readers.get(v, []))
    graph.symbols = dict(ranges)
    return graph
