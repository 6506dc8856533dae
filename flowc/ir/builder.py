"""GraphBuilder: adds nodes with inferred types, folding constant ones as it goes.

Front ends build through it, so shape computations (Shape -> Gather -> Concat -> Reshape)
collapse to constants the moment their inputs are known, and the types of everything after
them are static.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flowc.errors import FlowcWarning, InputError, ShapeError
from flowc.ir.graph import Attrs, Graph, Value, compact_constant, is_splat, make_splat
from flowc.ir.types import MAX_RANK, TensorType
from flowc.ops.registry import InferCtx, OpDef, get_op


def fold_inputs(opdef: OpDef, inputs: list[Value | None]) -> list[np.ndarray | None] | None:
    """The arrays to evaluate a node at compile time, or None when it cannot fold."""
    arrays: list[np.ndarray | None] = []
    for v in inputs:
        if v is None:
            arrays.append(None)
        elif v.const is not None:
            arrays.append(v.const)
        elif opdef.shape_only:
            # Shape and Size read only the shape: a zero-stride stand-in costs nothing.
            arrays.append(make_splat(0, v.type.shape, v.type.dtype.np))
        else:
            return None
    return arrays


# Folding may turn a few bytes into many (Expand, Tile, a Gather that repeats a table row per
# token): past this size a folded result must not be much bigger than what it came from, or
# the weights file grows for no gain; the node stays and computes it at run time.
FOLD_GROWTH_FREE_BYTES = 64 * 1024


# The most bytes one folded node may produce beyond the bytes its inputs already hold.
# Folding evaluates the node with NumPy, which materializes every output in full (even one
# that would then compact back to a splat): a result past this size, and more than twice
# the bytes its inputs really hold, stays a run-time op, so a program whose constants are
# fills of many gigabytes compiles without the compiler allocating them, while a big stored
# weight is still transposed or reshaped at compile time (its bytes are there already).
MAX_FOLD_BYTES = 64 << 20

# The most elements any value may have: beyond any device's memory, yet small enough that
# element counts, byte sizes and offsets stay exact in an int64 (and in NumPy's intp).
MAX_ELEMENTS = 1 << 48


# Ops whose references turn splat inputs into a zero-stride splat result without
# materializing it (flowc/ops/movement.py: move_data; ConstantOfShape), besides views.
SPLAT_PRESERVING_OPS = frozenset({"ConstantOfShape", "Expand", "Transpose", "Tile"})


def small_enough_to_fold(
    types: Sequence[TensorType], inputs: Sequence[np.ndarray | None] = (), opdef: Any = None
) -> bool:
    """Whether evaluating a node with these output types (and these known inputs) at
    compile time is affordable; see MAX_FOLD_BYTES."""
    known = [a for a in inputs if a is not None]
    if (
        opdef is not None
        and (opdef.view or opdef.name in SPLAT_PRESERVING_OPS)
        and all(is_splat(a) or a.size <= 16 for a in known)
    ):
        return True  # the result is a splat: nothing is materialized
    held = sum(held_bytes(a) for a in known)
    return sum(t.nbytes for t in types) <= max(MAX_FOLD_BYTES, 2 * held)


def fold_forced(graph: Graph, key: str) -> bool | None:
    """Whether the node ``key`` (op and first output) must fold (True) or stay (False) in
    this build, or None: as the size rules decide. A graph built at another size of its
    symbols (ir/fit_dims.py) folds exactly what the build at the bound folded, whatever the
    sizes say, so the builds have the same nodes."""
    if graph.fold_as is None:
        return None
    return graph.fold_as.get(key)


def held_bytes(a: np.ndarray) -> int:
    """Bytes an array really holds: one element for a splat."""
    return a.itemsize if is_splat(a) else a.nbytes


def worth_folding(inputs: Sequence[np.ndarray | None], outputs: Sequence[np.ndarray]) -> bool:
    out_bytes = sum(held_bytes(compact_constant(o)) for o in outputs)
    in_bytes = sum(held_bytes(i) for i in inputs if i is not None)
    return out_bytes <= max(FOLD_GROWTH_FREE_BYTES, 2 * in_bytes)


# What a reference raises when the data does not fit the op (an index out of range, ...).
DATA_ERRORS = (ValueError, IndexError, TypeError, ZeroDivisionError, OverflowError)


def evaluate_node(
    opdef: OpDef, arrays: list[np.ndarray | None], attrs: Attrs, types: list[TensorType], where: str
) -> list[np.ndarray]:
    """Run the reference and check it produced the inferred types."""
    try:
        outs = opdef.evaluate(arrays, attrs)
    except DATA_ERRORS as e:
        raise InputError(f"{where}: {e}", hint="check the input data given to the model") from None
    if len(outs) < len(types):
        raise ShapeError(f"{where}: reference gave {len(outs)} outputs, expected {len(types)}")
    result = []
    for o, t in zip(outs, types, strict=False):
        # a symbolic dim (a count the data decides, a run's size) holds at most its bound
        sym = t.sym if t.sym is not None else (None,) * t.rank
        fits = o.ndim == t.rank and all(
            g == d if s is None else g <= d for g, d, s in zip(o.shape, t.shape, sym, strict=True)
        )
        if not fits:
            raise ShapeError(
                f"{where}: internal error: reference output shape {list(o.shape)} differs from "
                f"the inferred {list(t.shape)}"
            )
        result.append(o if o.dtype == t.dtype.np else o.astype(t.dtype.np))
    return result


class GraphBuilder:
    def __init__(self, graph: Graph, fold: bool = True) -> None:
        self.graph = graph
        self.fold = fold
        # Importing a model to train it (ImportOptions.trainable): ops that act differently in
        # training (Dropout with training_mode on) import as they train.
        self.training = False
        # message -> names of the nodes it concerns; reported once per message by flush_warnings
        self._warnings: dict[str, list[str]] = {}
        # --bound NAME=K: the rows a data-dependent output (NonZero, NonMaxSuppression, ...)
        # named NAME holds; its op's adapter reads it.
        self.bounds: dict[str, int] = {}

    def warn(self, message: str, node_name: str) -> None:
        """Note a FlowcWarning about a node; the same message for many nodes prints once."""
        self._warnings.setdefault(message, []).append(node_name)

    def flush_warnings(self) -> None:
        for message, nodes in self._warnings.items():
            where = f"{len(nodes)} node(s), first: {nodes[0]!r}"
            warnings.warn(FlowcWarning(f"{message} ({where})"), stacklevel=2)
        self._warnings.clear()

    def constant(self, name: str, array: np.ndarray) -> Value:
        return self.graph.add_constant(name, compact_constant(np.asarray(array)))

    def infer(
        self, op: str, inputs: list[Value | None], attrs: Attrs, num_outputs: int, name: str
    ) -> list[TensorType]:
        opdef = get_op(op)
        ctx = InferCtx(
            op,
            name,
            [i.type if i is not None else None for i in inputs],
            [i.const if i is not None else None for i in inputs],
            attrs.merged(opdef.attrs),
            num_outputs,
        )
        return opdef.infer(ctx)

    def emit(
        self,
        op: str,
        inputs: Sequence[Value | None],
        attrs: Mapping[str, Any] | None = None,
        *,
        name: str = "",
        output_names: list[str] | None = None,
        num_outputs: int | None = None,
    ) -> list[Value]:
        """Add ``op`` (or its folded constants) and return its output values."""
        opdef = get_op(op)
        frozen = attrs if isinstance(attrs, Attrs) else Attrs(attrs or {})
        # Trailing omitted optional inputs carry no meaning; dropping them keeps the IR tidy.
        ins = list(inputs)
        while ins and ins[-1] is None:
            ins.pop()
        lo, hi = opdef.inputs
        where = f"{op} node {name!r}" if name else f"{op} node"
        if not lo <= len(ins) <= hi:
            raise ShapeError(f"{where}: takes {lo}..{hi} inputs, got {len(ins)}")
        n_out = (
            num_outputs if num_outputs is not None else len(output_names or []) or opdef.outputs[0]
        )
        olo, ohi = opdef.outputs
        if not olo <= n_out <= ohi:
            raise ShapeError(f"{where}: has {olo}..{ohi} outputs, got {n_out}")
        types = self.infer(op, ins, frozen, n_out, name)
        for k, t in enumerate(types):
            if t.rank > MAX_RANK:
                raise ShapeError(
                    f"{where}: output {k} would have rank {t.rank}; flowc holds tensors of rank "
                    f"at most {MAX_RANK}",
                    hint="check the shapes and the shape inputs the model gives this node",
                )
            if t.numel > MAX_ELEMENTS or any(d > MAX_ELEMENTS for d in t.shape):
                raise ShapeError(
                    f"{where}: output {k} would have shape {list(t.shape)} ({t.numel} elements), "
                    f"more than flowc supports ({MAX_ELEMENTS})",
                    hint="check the shapes and the shape inputs the model gives this node",
                )
        names = output_names or [f"{name or op}:{i}" for i in range(len(types))]
        arrays = fold_inputs(opdef, ins) if self.fold else None
        key = f"{op}:{names[0]}" if names else op
        forced = fold_forced(self.graph, key)
        if (
            arrays is not None
            and forced is not False
            and (forced or small_enough_to_fold(types, arrays, opdef))
        ):
            try:
                outs = evaluate_node(opdef, arrays, frozen, types, where)
            except InputError as e:
                # Constants are the model's own data: a failure here is the model's fault.
                raise ShapeError(f"constant folding failed: {e.message}") from None
            if forced or worth_folding(arrays, outs):
                self.graph.fold_decisions[key] = True
                return [self.constant(n, a) for n, a in zip(names, outs, strict=False)]
        if arrays is not None:
            self.graph.fold_decisions[key] = False
        node = self.graph.add_node(op, ins, types, frozen, name=name, output_names=names)
        return node.outputs


@dataclass(eq=False)
class AdapterNode:
    """One node as its op's adapter sees it (an ONNX node being imported, or a node the
    lower_ops pass rewrites): the adapter may edit inputs and attrs, and add helper nodes
    through the builder."""

    builder: GraphBuilder
    op_type: str
    opset: int
    name: str
    inputs: list[Value | None]
    attrs: dict[str, Any]
    output_names: list[str]

    def input(self, i: int) -> Value | None:
        return self.inputs[i] if i < len(self.inputs) else None

    def set_input(self, i: int, v: Value | None) -> None:
        while len(self.inputs) <= i:
            self.inputs.append(None)
        self.inputs[i] = v

    def const(self, suffix: str, array: Any, dtype: Any = None) -> Value:
        """A new constant value named after this node."""
        return self.builder.constant(
            f"{self.name or self.op_type}/{suffix}", np.asarray(array, dtype=dtype)
        )

    def attr_to_input(self, attr: str, index: int, dtype: Any = np.int64) -> None:
        """Move a list attribute of an old opset into input ``index`` (the newer form)."""
        if attr in self.attrs:
            self.set_input(index, self.const(attr, self.attrs.pop(attr), dtype))

    def emit(
        self,
        op: str,
        inputs: Sequence[Value | None],
        attrs: Mapping[str, Any] | None = None,
        suffix: str = "",
        output_names: list[str] | None = None,
        num_outputs: int | None = None,
    ) -> list[Value]:
        """Add a helper node (folded when its inputs are constant)."""
        base = self.name or self.op_type
        name = f"{base}/{suffix}" if suffix else base
        return self.builder.emit(
            op, inputs, attrs, name=name, output_names=output_names, num_outputs=num_outputs
        )
