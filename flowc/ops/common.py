"""Helpers several op families share, for building an InferCtx outside inference and for
lowering a node on import.

- ``array_ctx`` / ``ref_params``: a NumPy reference resolves its parameters with the very
  checks inference runs, over an InferCtx of its concrete arrays (RNN/GRU/LSTM, DFT, STFT,
  MelWeightMatrix); a failed check is the ValueError a reference raises.
- ``adapter_ctx``: the InferCtx of a node being imported (an AdapterNode), its attributes
  merged with the registered op's defaults, for adapters that check a node before lowering
  it (RNN/GRU/LSTM, DFT, STFT, the training optimizers).
- ``required_inputs``: an adapter's inputs from some position on, each one required.
- ``NodeLowering``: the base of the small emitters that lower one node into numbered helper
  nodes (Einsum, the training optimizers).

This module imports only flowc.errors, flowc.ir and the registry, like every op module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from flowc.errors import ShapeError
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs
from flowc.ir.types import TensorType
from flowc.ops.registry import InferCtx, get_op

if TYPE_CHECKING:
    from flowc.ir.builder import AdapterNode
    from flowc.ir.graph import Value

T = TypeVar("T")


def array_ctx(op: str, xs: Sequence[np.ndarray | None], attrs: Attrs) -> InferCtx:
    """An InferCtx over a reference call's concrete arrays (each input is its own constant)."""
    types = [None if a is None else TensorType(a.shape, DType.from_numpy(a.dtype)) for a in xs]
    return InferCtx(op, "", types, list(xs), attrs, 1)


def ref_params(
    parse: Callable[[InferCtx], T], op: str, xs: Sequence[np.ndarray | None], attrs: Attrs
) -> T:
    """``parse`` over ``array_ctx``: a reference's parameters resolved exactly as inference
    resolves them; a check that fails raises ValueError, as references do."""
    ctx = array_ctx(op, xs, attrs)
    try:
        return parse(ctx)
    except ShapeError as e:
        raise ValueError(e.message) from None


def adapter_ctx(
    n: AdapterNode, num_outputs: int, *, op: str = "", registered: str = ""
) -> InferCtx:
    """The InferCtx of an imported node, its attributes merged with the defaults of the
    registered op ``registered`` (default: the node's op type); ``op`` is the name errors
    give (default: the node's op type)."""
    opdef = get_op(registered or n.op_type)
    return InferCtx(
        op or n.op_type,
        n.name,
        [v.type if v is not None else None for v in n.inputs],
        [v.const if v is not None else None for v in n.inputs],
        Attrs(n.attrs).merged(opdef.attrs),
        num_outputs,
    )


def required_inputs(n: AdapterNode, start: int = 0, op: str = "") -> list[Value]:
    """The node's inputs from ``start`` on, every one required (``op``: the name the error
    gives, default the node's op type)."""
    ins: list[Value] = []
    for k, v in enumerate(n.inputs[start:], start):
        if v is None:
            raise ShapeError(f"{op or n.op_type} node {n.name!r}: input {k} is required")
        ins.append(v)
    return ins


class NodeLowering:
    """Emits the helper nodes that replace one imported node, computing in ``dtype``;
    ``step`` counts the nodes it has numbered, so each gets a distinct suffix."""

    def __init__(self, n: AdapterNode, dtype: DType) -> None:
        self.n = n
        self.dtype = dtype
        self.step = 0

    def next_step(self) -> int:
        self.step += 1
        return self.step
