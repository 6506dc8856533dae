"""The graph IR: SSA values with static types, nodes with frozen attributes, one Graph.

Constants are Values with a NumPy array attached and no producer. A constant whose elements
are all equal may be held as a *splat*: a zero-stride broadcast view of one element, so a
model whose weights are fills (ConstantOfShape) never materializes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from flowc.ir.dtype import DType
from flowc.ir.symbolic import COUNT, DimRange, SymDim
from flowc.ir.types import Mesh, NdSbp, TensorType

# An attribute value: int, float, str, a tuple of those, or a NumPy array (tensor attribute).
AttrValue = Any


def _freeze(v: Any) -> AttrValue:
    if isinstance(v, np.ndarray):
        a = np.array(v, copy=True)
        a.setflags(write=False)
        return a
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, (bool, np.bool_)):
        return int(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v)
    if isinstance(v, (str, bytes)):
        return v.decode() if isinstance(v, bytes) else v
    raise TypeError(f"unsupported attribute value {v!r} of type {type(v).__name__}")


class Attrs(Mapping[str, AttrValue]):
    """An immutable attribute mapping, iterated in sorted key order (deterministic output)."""

    __slots__ = ("_d",)

    def __init__(self, items: Mapping[str, Any] | Iterable[tuple[str, Any]] = ()) -> None:
        d = dict(items)
        self._d: dict[str, AttrValue] = {k: _freeze(d[k]) for k in sorted(d)}

    def __getitem__(self, key: str) -> AttrValue:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __repr__(self) -> str:
        return f"Attrs({self._d!r})"

    def merged(self, defaults: Mapping[str, Any]) -> Attrs:
        """These attributes with ``defaults`` filling the ones not given."""
        d = {k: v for k, v in defaults.items() if v is not None}
        d.update(self._d)
        return Attrs(d)


def is_splat(a: np.ndarray) -> bool:
    """True for an array held as one broadcast element (all strides zero)."""
    return a.size > 1 and all(s == 0 for s in a.strides)


def make_splat(value: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A read-only zero-stride array of ``shape`` filled with ``value``."""
    return np.broadcast_to(np.asarray(value, dtype=dtype).reshape(()), shape)


def compact_constant(a: np.ndarray) -> np.ndarray:
    """Hold an all-equal array as a splat when it is large enough for that to matter."""
    if a.size > 16 and not is_splat(a):
        flat = a.reshape(-1)
        first = flat[0]
        # A look at the first elements settles most weights without reading (for a
        # memory-mapped model: paging in) the whole array.
        if (flat[:64] != first).any():
            return a
        if (flat == first).all() and not (a.dtype.kind == "f" and np.isnan(first)):
            return make_splat(first, a.shape, a.dtype)
    return a


def _immutable_view(a: np.ndarray) -> bool:
    """True for a read-only C-contiguous array over memory nothing can write: ``bytes`` or a
    read-only mapping, not another array (whose owner may make it writable again)."""
    if a.flags.writeable or not a.flags.c_contiguous:
        return False
    root: object = a
    while isinstance(root, np.ndarray) and root.base is not None:
        root = root.base
    if isinstance(root, np.ndarray):
        return False
    try:
        return memoryview(root).readonly  # type: ignore[arg-type]
    except TypeError:
        return False


class Value:
    """An SSA value: a graph input, a constant, or a node's output."""

    __slots__ = ("const", "name", "producer", "sbp", "type")

    def __init__(
        self,
        name: str,
        type: TensorType,
        producer: Node | None = None,
        const: np.ndarray | None = None,
        sbp: NdSbp | None = None,
    ) -> None:
        self.name = name
        self.type = type
        self.producer = producer
        self.const = const
        self.sbp = sbp

    @property
    def is_const(self) -> bool:
        return self.const is not None

    def __repr__(self) -> str:
        return f"Value({self.name!r}: {self.type})"


class Node:
    """One operation. ``inputs`` may hold None for an omitted optional input."""

    __slots__ = ("attrs", "inputs", "name", "op", "outputs", "stage", "sym_attrs")

    def __init__(
        self,
        op: str,
        inputs: list[Value | None],
        outputs: list[Value],
        attrs: Attrs | Mapping[str, Any] | None = None,
        name: str = "",
    ) -> None:
        self.op = op
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.attrs = attrs if isinstance(attrs, Attrs) else Attrs(attrs or {})
        self.name = name
        self.stage: int | None = None
        # Symbolic dims: the integer attributes that spell sizes (FusedAttention's sizes),
        # each element as its polynomial of the symbols (ir/fit_dims.py); empty otherwise.
        self.sym_attrs: dict[str, tuple[SymDim | int, ...]] = {}
        for o in self.outputs:
            o.producer = self

    def __repr__(self) -> str:
        return f"Node({self.op} {self.name!r})"


def keep_counts(t: TensorType, like: TensorType) -> TensorType:
    """``t``, re-inferred for a value whose type was ``like``, with the data-dependent dims
    ``like`` has named (an op's inference leaves them unnamed: ir/symbolic.py COUNT)."""
    if t.sym is None or like.sym is None or t.rank != like.rank:
        return t
    sym = tuple(b if _counts(a) else a for a, b in zip(t.sym, like.sym, strict=True))
    return TensorType(t.shape, t.dtype, sym)


def _counts(d: SymDim | None) -> bool:
    """Whether ``d`` is a data-dependent dim an op's inference left for the graph to name."""
    return d is not None and COUNT in d.symbols


class Graph:
    """A graph: inputs, constants, nodes in topological order, outputs; optionally a mesh."""

    def __init__(self, name: str = "main") -> None:
        self.name = name
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.constants: list[Value] = []
        self.nodes: list[Node] = []
        self.mesh: Mesh | None = None
        # Provenance shown by `flowc inspect` (source format, opset, producer); not semantics.
        self.meta: dict[str, str] = {}
        # Training: the inputs that are parameters (trained weights), by name, with their
        # initial data. A parameter is an input, never a constant, so nothing folds it; its
        # name is the model's initializer's, which export and checkpoints map back to.
        self.params: dict[str, np.ndarray] = {}
        # Training: the state the program keeps between runs, input name -> output name:
        # the output is the input's next value, written over the input's bytes (in place)
        # once every reader of the input has run (None: the step only reads it, as the base
        # learning rate). State inputs live in the model's memory, not the caller's (their
        # first value in ``params``), and state outputs are not returned; see state_pairs().
        self.state: dict[str, str | None] = {}
        # A .flow program's train block: how to train it, as the command line spells the
        # training options (--loss "cross_entropy:z,labels", --optimizer "adamw:lr=0.01").
        self.train: dict[str, str] = {}
        # The symbols of the graph's symbolic dims (ir/symbolic.py) and their ranges, in the
        # order of the generated program's size table; empty for a static graph.
        self.symbols: dict[str, DimRange] = {}
        # A build at probe sizes (ir/fit_dims.py): the rows each computed count has here,
        # and its bound in the build at the bound (a count whose op bounds it by a size that
        # changes, NonZero of a [batch, 4] input, keeps the bound's buffer at every size).
        self.count_sizes: dict[str, int] = {}
        self.count_bounds: dict[str, int] = {}
        # Constant folding's choices, by op and first output (True: folded), and, in a build
        # at probe sizes, the bound's choices to repeat (ir/builder.py: fold_forced).
        self.fold_decisions: dict[str, bool] = {}
        self.fold_as: dict[str, bool] | None = None
        self._names: set[str] = set()

    # -- construction -----------------------------------------------------------------------

    def unique_name(self, base: str) -> str:
        """``base`` if no value has that name yet, else ``base.1``, ``base.2``, ..."""
        if base and base not in self._names:
            return base
        stem = base or "v"
        i = 1
        while f"{stem}.{i}" in self._names:
            i += 1
        return f"{stem}.{i}"

    def _claim(self, name: str) -> None:
        if name in self._names:
            raise ValueError(f"value name {name!r} is already defined")
        self._names.add(name)

    def has_name(self, name: str) -> bool:
        return name in self._names

    def claim_name(self, base: str) -> str:
        """A fresh name from ``base`` (see unique_name), reserved for a value being made."""
        name = self.unique_name(base)
        self._claim(name)
        return name

    def rename(self, v: Value, name: str) -> None:
        """Give ``v`` (a value of this graph) a name no other value has."""
        if name == v.name:
            return
        if name in self._names:
            raise ValueError(f"value name {name!r} is already defined")
        self._names.discard(v.name)
        v.name = name
        self._names.add(name)

    def add_input(self, name: str, type: TensorType) -> Value:
        self._claim(name)
        v = Value(name, type)
        self.inputs.append(v)
        return v

    def add_constant(self, name: str, array: np.ndarray) -> Value:
        name = self.unique_name(name)
        self._claim(name)
        # Constants are immutable: splats stay views, and so do read-only C-contiguous views
        # of immutable memory (a model file's weights, memory-mapped, are not copied);
        # anything else is owned and frozen.
        if is_splat(array) or _immutable_view(array):
            a = array.view()
        else:
            a = np.array(array, order="C", copy=True)
        a.setflags(write=False)
        v = Value(name, TensorType(a.shape, DType.from_numpy(a.dtype)), const=a)
        self.constants.append(v)
        return v

    def add_node(
        self,
        op: str,
        inputs: list[Value | None],
        output_types: list[TensorType],
        attrs: Mapping[str, Any] | None = None,
        name: str = "",
        output_names: list[str] | None = None,
    ) -> Node:
        names = output_names or [f"{name or op}:{i}" for i in range(len(output_types))]
        outs = []
        for n, t in zip(names, output_types, strict=True):
            n = self.unique_name(n)
            self._claim(n)
            outs.append(Value(n, t))
        node = Node(op, inputs, outs, attrs, name)
        # One count per node (n0, n1, ...: _name_counts): Unique's values, first indices and
        # counts share theirs.
        counted = [
            o for o in outs if o.type.sym is not None and any(_counts(d) for d in o.type.sym)
        ]
        if counted:
            at = next(k for k, d in enumerate(counted[0].type.sym or ()) if _counts(d))
            named = (self._name_counts(counted[0]).sym or ())[at]
            assert named is not None and named.name is not None
            # a build at a probe size of the count (ir/fit_dims.py) gives it that many rows
            rows = self.count_sizes.get(named.name, self.symbols[named.name].hi)
            for o in counted:
                sym = tuple(named if _counts(d) else d for d in o.type.sym or ())
                shape = tuple(
                    rows if rows is not None and _counts(d) else n
                    for n, d in zip(o.type.shape, o.type.sym or (), strict=True)
                )
                o.type = TensorType(shape, o.type.dtype, sym)
        self.nodes.append(node)
        return node

    def _name_counts(self, v: Value) -> TensorType:
        """``v``'s type with each data-dependent dim (ir/symbolic.py: COUNT) a symbol of its
        own, registered with the range 0..its bound."""
        assert v.type.sym is not None
        sym: list[SymDim | None] = []
        for d, s in zip(v.type.shape, v.type.sym, strict=True):
            if s is None or COUNT not in s.symbols:
                sym.append(s)
                continue
            used = {
                x
                for w in self.values()
                if w.type.sym is not None
                for e in w.type.sym
                if e is not None
                for x in e.symbols
            }
            # n0, n1, ... in the order the nodes are made: the same names however the values
            # are named or renamed (a printed program declares its counts before the graph,
            # and reading it back reuses each unused declaration of the same range).
            k = 0
            while f"n{k}" in used or (
                f"n{k}" in self.symbols
                and self.symbols[f"n{k}"]
                != DimRange(0, self.count_bounds.get(f"n{k}", d), computed=True)
            ):
                k += 1
            name = f"n{k}"
            self.symbols[name] = DimRange(0, self.count_bounds.get(name, d), computed=True)
            sym.append(SymDim.of(name))
        return TensorType(v.type.shape, v.type.dtype, tuple(sym))

    # -- queries ----------------------------------------------------------------------------

    def values(self) -> Iterator[Value]:
        yield from self.inputs
        yield from self.constants
        for n in self.nodes:
            yield from n.outputs

    def kept(self) -> set[Value]:
        """The values a rewrite must keep as they are: the graph's outputs, and the values a
        program placed (``Value.sbp``: a layout the placement search is bound to, so a
        fusion does not absorb them)."""
        return set(self.outputs) | {v for v in self.values() if v.sbp is not None}

    def state_pairs(self) -> list[tuple[Value, Value]]:
        """``state`` as values: (the input, the output written over it)."""
        inputs = {v.name: v for v in self.inputs}
        outputs = {v.name: v for v in self.outputs}
        return [(inputs[i], outputs[o]) for i, o in self.state.items() if o is not None]

    def users(self) -> dict[Value, list[Node]]:
        uses: dict[Value, list[Node]] = {v: [] for v in self.values()}
        for n in self.nodes:
            for i in n.inputs:
                if i is not None:
                    uses.setdefault(i, []).append(n)
        return uses

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return dict(sorted(counts.items()))

    # -- rewriting --------------------------------------------------------------------------

    def replace_uses(self, old: Value, new: Value) -> None:
        """Make every use of ``old`` (node inputs, graph outputs) a use of ``new``."""
        for n in self.nodes:
            n.inputs = [new if i is old else i for i in n.inputs]
        self.outputs = [new if o is old else o for o in self.outputs]

    def sort_topologically(self) -> None:
        """Reorder ``nodes`` so that each comes after the producers of its inputs, moving as
        little as it can: of the nodes ready at each point, the earliest in the current order
        goes first (for a rewrite that defined a value later than one of its readers)."""
        import heapq

        position = {n: k for k, n in enumerate(self.nodes)}
        waiting: dict[Node, int] = {}
        readers: dict[Node, list[Node]] = {}
        for n in self.nodes:
            producers = {i.producer for i in n.inputs if i is not None and i.producer in position}
            waiting[n] = len(producers)
            for p in producers:
                readers.setdefault(p, []).append(n)
        ready = [position[n] for n in self.nodes if waiting[n] == 0]
        heapq.heapify(ready)
        order: list[Node] = []
        while ready:
            n = self.nodes[heapq.heappop(ready)]
            order.append(n)
            for r in readers.get(n, []):
                waiting[r] -= 1
                if waiting[r] == 0:
                    heapq.heappush(ready, position[r])
        if len(order) != len(self.nodes):
            raise ValueError(f"graph {self.name!r} has a cycle")
        self.nodes = order

    def remove_unused(self) -> int:
        """Drop nodes none of whose outputs are used and constants nobody reads; return count."""
        live: set[Value] = set(self.outputs)
        kept: list[Node] = []
        for n in reversed(self.nodes):
            if any(o in live for o in n.outputs):
                kept.append(n)
                live.update(i for i in n.inputs if i is not None)
        removed = len(self.nodes) - len(kept)
        self.nodes = kept[::-1]
        self.constants = [c for c in self.constants if c in live]
        self._names = {v.name for v in self.values()}
        return removed

    def copy(self) -> Graph:
        """An independent copy: new values and nodes under the same names (a rewrite of one
        leaves the other as it is); constants' arrays, immutable, are shared."""
        g = Graph(self.name)
        g.mesh = self.mesh
        g.meta = dict(self.meta)
        g.params = dict(self.params)
        g.state = dict(self.state)
        g.train = dict(self.train)
        g.symbols = dict(self.symbols)
        g.count_sizes = dict(self.count_sizes)
        g.count_bounds = dict(self.count_bounds)
        g.fold_decisions = dict(self.fold_decisions)
        g.fold_as = self.fold_as
        vmap: dict[Value, Value] = {}
        for v in self.inputs:
            vmap[v] = g.add_input(v.name, v.type)
        for c in self.constants:
            g._claim(c.name)
            vmap[c] = Value(c.name, c.type, const=c.const)
            g.constants.append(vmap[c])
        for n in self.nodes:
            copy = Node(
                n.op,
                [vmap[i] if i is not None else None for i in n.inputs],
                [Value(o.name, o.type) for o in n.outputs],
                n.attrs,
                n.name,
            )
            copy.stage = n.stage
            copy.sym_attrs = dict(n.sym_attrs)
            for o, c in zip(n.outputs, copy.outputs, strict=True):
                g._claim(o.name)
                vmap[o] = c
            g.nodes.append(copy)
        for v, c in vmap.items():
            c.sbp = v.sbp
        g.outputs = [vmap[o] for o in self.outputs]
        return g
