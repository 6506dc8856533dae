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

import json
from collections.abc import Callable, Mapping
from itertools import product
from typing import Any

import numpy as np

from flowc.errors import ShapeError
from flowc.ir.graph import Attrs, Graph, Node, Value, is_splat, make_splat
from flowc.ir.symbolic import DimRange, SymDim, evaluate, fit, probe_points
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


def _fit_attrs(
    graph: Graph,
    names: list[str],
    points: list[dict[str, int]],
    probes: list[Graph],
    bound: Mapping[str, int],
) -> None:
    """Integer attributes that change with the sizes (what an op's ``sizeless`` leaves out,
    FusedAttention's letter sizes): each element fitted as a polynomial of the symbols, for
    the emitter to compute at run time (Node.sym_attrs)."""
    for k, n in enumerate(graph.nodes):
        for key, value in n.attrs.items():
            seen = [g.nodes[k].attrs.get(key) for g in probes]
            if all(_same_attr(value, o) for o in seen):
                continue
            flat = value if isinstance(value, tuple) else (value,)
            if not all(isinstance(x, int) for x in flat):
                continue  # a size-free spelling differs (the op's sizeless took it out)
            fitted: list[SymDim | int] = []
            for j, x in enumerate(flat):
                sizes = [int((o if isinstance(o, tuple) else (o,))[j]) for o in seen]
                f = fit(names, points, sizes)
                at_bound = f.evaluate(bound) if isinstance(f, SymDim) else f
                if f is None or at_bound != x:
                    raise ShapeError(
                        f"{n.op} node {n.name or n.outputs[0].name!r}: its attribute {key!r} "
                        "spells a size that is no polynomial of the symbols",
                        hint="fix the dim with --dim NAME=N",
                    )
                fitted.append(f)
            n.sym_attrs[key] = tuple(fitted)


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
    graph: Graph,
    c: Value,
    probes: list[tuple[dict[str, int], Value]],
    readers: list[tuple[Node, int]],
) -> None:
    """A constant whose data changes with the sizes: a prefix of its data at the bound (a
    table read up to a symbolic length: position ids), the same along every symbolic dim (a
    folded row broadcast over batch and sequence: it becomes an Expand of that row), or
    sizes only a shape reads."""
    assert c.const is not None
    full = np.asarray(c.const)
    ttype = c.type
    if ttype.sym is not None:
        # read as it is (no kernel) where a run reads a prefix of its bytes
        lead = next((k for k, d in enumerate(ttype.shape) if d != 1), None)
        outermost = not any(s is not None for s in ttype.sym[(lead or 0) + 1 :])
        prefix = outermost and all(
            np.array_equal(
                full[tuple(slice(0, n) for n in p.type.shape)],
                np.asarray(p.const),
                equal_nan=full.dtype.kind in "fc",
            )
            for _, p in probes
        )
        if prefix:
            return
        sym_axes = [k for k, d in enumerate(ttype.sym) if d is not None]
        one = full[tuple(slice(0, 1) if k in sym_axes else slice(None) for k in range(full.ndim))]
        if np.array_equal(
            np.broadcast_to(one, full.shape), full, equal_nan=full.dtype.kind in "fc"
        ):
            _expand_constant(graph, c, one)
            return
        if _polynomial(graph, c, probes):
            return
        raise ShapeError(
            f"{_where(c)} of symbolic type {ttype} changes with the sizes in a way no one "
            "program serves: neither the start of its data at the bound along its outermost "
            "dim, nor the same along its symbolic dims, nor integers that are a polynomial of "
            "their coordinates and the sizes",
            hint="fix the dim with --dim NAME=N",
        )
    varies = any(
        not np.array_equal(full, np.asarray(p.const), equal_nan=full.dtype.kind in "fc")
        for _, p in probes
    )
    if not varies or all((n.op, k) in SHAPE_ONLY_INPUTS for n, k in readers):
        return
    if _polynomial(graph, c, probes):
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


# The most coordinates and symbols a size-computed constant's polynomial may take (its
# multilinear terms number 2^n).
MAX_POLY_VARIABLES = 8


def _polynomial(graph: Graph, c: Value, probes: list[tuple[dict[str, int], Value]]) -> bool:
    """Replace integer constant ``c``, which the sizes change, by a SizePolynomial node when
    each element is an integer multilinear polynomial of its coordinates and the symbols
    (b * seq + s, the row offsets of a flattened mask); False when it is not."""
    assert c.const is not None
    full = np.asarray(c.const)
    if full.dtype.kind not in "iu" or full.size == 0:
        return False
    names = sorted(graph.symbols or {s for p, _ in probes for s in p})
    bound = {s: int(r.hi) for s, r in graph.symbols.items()} if graph.symbols else None
    axes = [k for k, d in enumerate(full.shape) if d > 1]
    variables = [("c", k) for k in axes] + [("s", n) for n in names]
    if len(variables) > MAX_POLY_VARIABLES:
        return False
    monomials = [
        [v for v, on in zip(variables, pick, strict=True) if on]
        for pick in product((0, 1), repeat=len(variables))
    ]

    def design(data: np.ndarray, at: Mapping[str, int]) -> tuple[np.ndarray, np.ndarray]:
        coords = np.indices(data.shape, dtype=np.int64).reshape(data.ndim, -1)
        cols = []
        for mono in monomials:
            col = np.ones(data.size, dtype=np.float64)
            for kind, key in mono:
                col = col * (coords[int(key)] if kind == "c" else at[str(key)])
            cols.append(col)
        return np.stack(cols, axis=1), data.reshape(-1).astype(np.float64)

    samples = [(dict(p), np.asarray(v.const)) for p, v in probes]
    if bound is not None:
        samples.append((bound, full))
    mats = [design(d, at) for at, d in samples if d.size]
    a = np.concatenate([m for m, _ in mats])
    b = np.concatenate([y for _, y in mats])
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    ints = np.rint(coef).astype(np.int64)
    if not all(np.array_equal(m @ ints.astype(np.float64), y) for m, y in mats):
        return False
    terms = [
        {
            "c": int(k),
            "axes": [int(key) for kind, key in mono if kind == "c"],
            "syms": [str(key) for kind, key in mono if kind == "s"],
        }
        for mono, k in zip(monomials, ints, strict=True)
        if k
    ]
    node = graph.add_node(
        "SizePolynomial",
        [],
        [c.type],
        attrs={
            "shape": tuple(c.type.shape),
            "dtype": c.type.dtype.onnx,
            "terms": json.dumps(terms, sort_keys=True),
            "at": json.dumps(bound or {}, sort_keys=True),
        },
        name=f"{c.name}/sizes",
    )
    graph.nodes.insert(0, graph.nodes.pop())
    name = c.name
    graph.constants.remove(c)
    graph.rename(c, graph.unique_name(f"{name}/folded"))
    graph.rename(node.outputs[0], name)
    graph.replace_uses(c, node.outputs[0])
    return True


def _expand_constant(graph: Graph, c: Value, one: np.ndarray) -> None:
    """Replace constant ``c`` (the same along its symbolic dims) by ``one``, its slice of
    size 1 along them: read as it is by the element-wise nodes that broadcast it anyway (their
    result keeps its type), through an Expand to ``c``'s symbolic type by the others (the
    Expand's output takes ``c``'s name)."""
    row = graph.add_constant(f"{c.name}/row", one)
    rest: list[Node] = []
    for n in graph.users().get(c, []):
        opdef = get_op(n.op)
        if opdef.cexpr is not None or n.op == "FusedElementwise":
            ins = [row if i is c else i for i in n.inputs]
            probe = Node(n.op, ins, [], n.attrs, n.name)
            same = [t.shape for t in opdef.infer_types(probe)] == [o.type.shape for o in n.outputs]
            if same:
                n.inputs = ins
                continue
        rest.append(n)
    graph.constants.remove(c)
    name = c.name
    graph.rename(c, graph.unique_name(f"{name}/folded"))
    if not rest and c not in graph.outputs:
        return
    shape = graph.add_constant(f"{name}/shape", np.asarray(c.type.shape, dtype=np.int64))
    node = graph.add_node("Expand", [row, shape], [c.type], name=f"{name}/expand")
    graph.nodes.insert(0, graph.nodes.pop())
    graph.rename(node.outputs[0], name)
    graph.replace_uses(c, node.outputs[0])


def _simplify_broadcasts(graph: Graph) -> None:
    """The Expands that constants of repeated rows became (above), carried to where they cost
    nothing: a Gather of a constant table by an Expand of a constant row is the Expand of the
    rows it gathers, folded; an Expand of a constant read only by element-wise nodes that
    broadcast it anyway (their results keep their types) is the constant itself. What the
    program then launches for them: nothing, as when the sizes were fixed."""
    from flowc.ir.graph import Attrs

    changed = True
    while changed:
        changed = False
        users = graph.users()
        for n in list(graph.nodes):
            if n.op == "Gather" and n.inputs[0] is not None and n.inputs[0].const is not None:
                idx = n.inputs[1]
                e = idx.producer if idx is not None else None
                row = e.inputs[0] if e is not None and e.op == "Expand" else None
                if idx is None or row is None or row.const is None:
                    continue
                lift = (1,) * (idx.type.rank - row.type.rank) + row.type.shape
                opdef = get_op("Gather")
                (rows,) = opdef.evaluate(
                    [n.inputs[0].const, np.asarray(row.const).reshape(lift)], n.attrs
                )
                out = n.outputs[0]
                folded = graph.add_constant(f"{out.name}/rows", rows)
                shape = graph.add_constant(
                    f"{out.name}/shape", np.asarray(out.type.shape, dtype=np.int64)
                )
                n.op, n.inputs, n.attrs = "Expand", [folded, shape], Attrs({})
                changed = True
            elif n.op == "Expand" and n.inputs[0] is not None and n.inputs[0].const is not None:
                src, out = n.inputs[0], n.outputs[0]
                readers = users.get(out, [])
                if not readers or out in graph.outputs:
                    continue
                swapped = []
                for r in readers:
                    opdef = get_op(r.op)
                    if opdef.cexpr is None and r.op != "FusedElementwise":
                        break
                    ins = [src if i is out else i for i in r.inputs]
                    types = opdef.infer_types(Node(r.op, ins, [], r.attrs, r.name))
                    if [t.shape for t in types] != [o.type.shape for o in r.outputs]:
                        break
                    swapped.append((r, ins))
                else:
                    for r, ins in swapped:
                        r.inputs = ins
                    changed = True
        graph.remove_unused()


def annotate_symbols(
    graph: Graph, ranges: Mapping[str, DimRange], build: Callable[[dict[str, int]], Graph]
) -> Graph:
    """``graph`` (built with every symbol at its bound) with symbolic types: ``build`` makes
    the same graph with the symbols at the given sizes. ``ranges`` may hold the graph's
    computed counts (n0, ...): a build gives such a count's output that many rows, so what
    its consumers make of it is fitted like any size."""
    names = list(ranges)
    bound = {s: r.hi for s, r in ranges.items()}
    points = probe_points(ranges)
    computed = {s: r for s, r in graph.symbols.items() if r.computed}
    graph.symbols = {**ranges, **computed}
    probes = [build(dict(p)) for p in points]
    for p, g in zip(points, probes, strict=True):
        _check_structure(graph, g, p)
        for name, r in computed.items():
            if g.symbols.get(name) != r:
                raise ShapeError(
                    f"the bound of the computed count {name} is {r.hi} at the bound but "
                    f"{g.symbols[name].hi if name in g.symbols else 'missing'} at "
                    f"{_size_text(p)}: flowc bounds a data-dependent size by a fixed size",
                    hint="fix the dims with --dim NAME=N, or give the bound: --bound NAME=K",
                )
    _fit_attrs(graph, names, points, probes, bound)
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
            _check_constant(graph, v, list(zip(points, others, strict=True)), readers.get(v, []))
    graph.symbols = {**ranges, **computed}
    _simplify_broadcasts(graph)
    return graph


def at_sizes(graph: Graph, sizes: Mapping[str, int]) -> Graph:
    """A copy of ``graph`` (with symbolic types) at the given sizes: every type static at
    them, each size attribute (Node.sym_attrs) evaluated, a constant of symbolic shape cut
    to its prefix (annotate_symbols kept only those). What a stage after this one (the
    placement's lowering) builds from it is the graph the model would give at the sizes."""
    g = graph.copy()
    # The shape inputs of Reshape, Expand and ConstantOfShape hold sizes (annotate_symbols
    # keeps them constants): at these sizes, the shape each such node makes.
    shapes: dict[str, tuple[int, ...]] = {}
    for n in g.nodes:
        for k, x in enumerate(n.inputs):
            out = n.outputs[0].type
            if (n.op, k) in SHAPE_ONLY_INPUTS and x is not None and x.const is not None:
                if out.sym is None:
                    continue
                made = out.shape_at(sizes)
                if shapes.setdefault(x.name, made) != made:
                    raise ShapeError(
                        f"constant {x.name!r} gives two shapes at {_size_text(sizes)}: "
                        f"{list(shapes[x.name])} and {list(made)}",
                        hint="fix the dims with --dim NAME=N",
                    )
                x.const = np.array(made, np.int64)
    for v in g.values():
        if v.type.sym is None:
            continue
        shape = v.type.shape_at(sizes)
        if v.const is not None:
            a = v.const
            if is_splat(a):
                v.const = make_splat(a.reshape(-1)[0], shape, a.dtype)
            else:
                count = int(np.prod(shape))
                v.const = np.ascontiguousarray(a.reshape(-1)[:count]).reshape(shape)
        v.type = TensorType(shape, v.type.dtype)
    for n in g.nodes:
        if n.op == "SizePolynomial":
            # (its attributes give its shape and the sizes its reference evaluates at)
            at = {k: int(x) for k, x in json.loads(str(n.attrs["at"])).items()}
            n.attrs = Attrs(
                {
                    **n.attrs,
                    "shape": tuple(n.outputs[0].type.shape),
                    "at": json.dumps(
                        {k: int(sizes.get(k, x)) for k, x in at.items()}, sort_keys=True
                    ),
                }
            )
        if n.sym_attrs:
            n.attrs = Attrs(
                {
                    **n.attrs,
                    **{k: tuple(evaluate(x, sizes) for x in f) for k, f in n.sym_attrs.items()},
                }
            )
            n.sym_attrs = {}
    g.symbols = {}
    return g
