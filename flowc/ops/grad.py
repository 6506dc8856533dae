"""What the ops' VJP rules build their gradients with (reverse-mode autodiff, flowc/autodiff).

A VJP rule lives in its op's registry entry (OpDef.vjp), beside inference, reference and
SBP. Given the forward node, the gradient of each of its outputs (None where none flows) and
which inputs need one, it returns the gradient of each input as IR values, built through a
GradBuilder: ordinary nodes that then go through every later stage (placement, schedule,
memory, code generation), so a rule never computes anything itself. The builder is the
autodiff driver's (it sits above the op registry): rules see only this interface.

The helpers below are what many rules share: constants of an input's type, the sum of a
broadcast gradient back to its operand's shape, element-wise chains.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from flowc.ir.graph import Node, Value


class GradBuilder(Protocol):
    """The node factory a VJP rule builds with (flowc.autodiff's)."""

    def emit(
        self,
        op: str,
        inputs: Sequence[Value | None],
        attrs: dict[str, Any] | None = None,
        num_outputs: int | None = None,
    ) -> list[Value]:
        """Add ``op`` on ``inputs`` (constants may fold); its outputs."""
        ...

    def const(self, array: np.ndarray, name: str = "c") -> Value:
        """A constant value."""
        ...


# (builder, forward node, output gradients, which inputs need a gradient) -> input gradients
VjpFn = Callable[[GradBuilder, "Node", list["Value | None"], list[bool]], list["Value | None"]]


def op1(b: GradBuilder, op: str, *inputs: Value | None, **attrs: Any) -> Value:
    """The one output of ``op`` on ``inputs``."""
    return b.emit(op, list(inputs), attrs or None)[0]


def scalar(b: GradBuilder, value: float, like: Value) -> Value:
    """A rank-0 constant of ``like``'s element type (broadcasts against anything)."""
    return b.const(np.asarray(value, dtype=like.type.dtype.np), "c")


def ints(b: GradBuilder, values: Sequence[int]) -> Value:
    """A constant int64 vector (axes, shapes, perms given as inputs)."""
    return b.const(np.asarray(list(values), dtype=np.int64), "shape")


def reshape(b: GradBuilder, x: Value, shape: Sequence[int]) -> Value:
    if tuple(x.type.shape) == tuple(shape):
        return x
    return op1(b, "Reshape", x, ints(b, shape))


def reduce_sum(b: GradBuilder, x: Value, axes: Sequence[int], keepdims: bool = True) -> Value:
    if not axes:
        return x
    return op1(b, "ReduceSum", x, ints(b, axes), keepdims=int(keepdims))


def unbroadcast(b: GradBuilder, g: Value, shape: Sequence[int]) -> Value:
    """``g`` (the gradient of a broadcast result) summed back to an operand of ``shape``:
    over the leading axes the operand lacks and the axes where it has 1 (ONNX's
    multidirectional broadcasting)."""
    out = tuple(g.type.shape)
    shape = tuple(shape)
    if out == shape:
        return g
    lead = len(out) - len(shape)
    axes = [i for i in range(len(out)) if i < lead or (shape[i - lead] == 1 and out[i] != 1)]
    return reshape(b, reduce_sum(b, g, axes), shape)


def expand_to(b: GradBuilder, g: Value, shape: Sequence[int]) -> Value:
    """``g`` broadcast to ``shape`` (the gradient of a reduction, kept dims in place)."""
    if tuple(g.type.shape) == tuple(shape):
        return g
    return op1(b, "Expand", g, ints(b, shape))


def transpose_last2(b: GradBuilder, x: Value) -> Value:
    r = x.type.rank
    return op1(b, "Transpose", x, perm=[*range(r - 2), r - 1, r - 2])


def elementwise(derivative: Callable[[GradBuilder, Value, Value], Value]) -> VjpFn:
    """The VJP of a unary element-wise op y = f(x): g * f'(x), where ``derivative(b, x, y)``
    builds f'(x) from the input and the output (whichever is cheaper to hold)."""

    def vjp(
        b: GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
    ) -> list[Value | None]:
        g = gouts[0]
        x = node.inputs[0]
        if g is None or x is None or not need[0]:
            return [None]
        return [op1(b, "Mul", g, derivative(b, x, node.outputs[0]))]

    return vjp


def linear(fn: Callable[[GradBuilder, Value], Value]) -> VjpFn:
    """The VJP of a unary op linear in its input: the same op on the gradient's side is
    ``fn(b, g)`` (Neg: -g; Identity: g)."""

    def vjp(
        b: GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
    ) -> list[Value | None]:
        g = gouts[0]
        return [fn(b, g) if g is not None and need[0] else None] + [None] * (len(node.inputs) - 1)

    return vjp


def to_shape_of(
    b: GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """The VJP of an op that only re-shapes its first input (Reshape, Squeeze, Unsqueeze,
    Flatten, Identity): the gradient re-shaped back; its other inputs (shapes, axes) get
    none."""
    g, x = gouts[0], node.inputs[0]
    grads: list[Value | None] = [None] * len(node.inputs)
    if g is not None and x is not None and need[0]:
        grads[0] = reshape(b, g, x.type.shape)
    return grads


def const_int_input(node: Node, i: int, default: Sequence[int] | None = None) -> list[int] | None:
    """A constant integer input (axes, perm, shape) as a list; ``default`` when omitted."""
    if i >= len(node.inputs) or node.inputs[i] is None:
        return None if default is None else list(default)
    v = node.inputs[i]
    assert v is not None
    if v.const is None:
        return None
    return [int(a) for a in np.asarray(v.const).reshape(-1)]


def adjoint_along(b: GradBuilder, g: Value, axis: int, matrix: np.ndarray) -> Value:
    """The gradient through y = x transformed along ``axis`` by ``matrix`` (y's index o on
    that axis is sum_i matrix[o, i] x[.., i, ..]): ``g`` contracted with it, the axis moved
    last for one MatMul and back. Separable resampling and border copies (Resize, Pad's
    non-constant modes) are a product of such matrices, one per changed axis."""
    rank = g.type.rank
    axis %= rank
    m = b.const(np.ascontiguousarray(matrix, dtype=g.type.dtype.np), "adjoint")
    if axis == rank - 1:
        return op1(b, "MatMul", g, m)
    perm = [*range(axis), *range(axis + 1, rank), axis]
    moved = op1(b, "MatMul", op1(b, "Transpose", g, perm=perm), m)
    back = [*range(axis), rank - 1, *range(axis, rank - 1)]
    return op1(b, "Transpose", moved, perm=back)
