"""Softmax, LogSoftmax and Hardmax along one axis (opset 13 semantics, default axis -1).

Before opset 13 these ops coerced the input to 2-D at ``axis`` (default 1) and normalized
each row of that matrix, that is jointly over every dim from ``axis`` to the end. The import
adapter rewrites such a node as Reshape -> op along the last axis -> Reshape back; when
``axis`` is already the last dim the two semantics agree and only the axis is made explicit.

Softmax and LogSoftmax subtract the max along the axis before exponentiating, so large
logits do not overflow. An infinite logit then gives NaN for its whole row (inf - inf), as
onnxruntime does. float16 and bfloat16 are computed in float32 and rounded once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node
from flowc.ir.types import TensorType
from flowc.ops import grad
from flowc.ops import sbp_rules as sr
from flowc.ops.reduce import (
    kernel_ctype,
    launch_rows,
    launch_rows_sized,
    outer_inner,
    row_layout,
    vec_width,
)
from flowc.ops.registry import (
    EmitFn,
    InferCtx,
    SbpSignature,
    defop,
    elementwise_flops,
    first,
    get_op,
    set_vjp,
)

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.builder import AdapterNode
    from flowc.ir.graph import Value

FAMILY = "softmax"

Kernel = Callable[[np.ndarray, int], np.ndarray]


def _infer(ctx: InferCtx) -> list[TensorType]:
    t = ctx.type(0)
    if not t.dtype.is_float:
        raise ctx.fail(f"needs a floating-point input, got {t.dtype}")
    if t.rank == 0:
        raise ctx.fail("needs an input of rank >= 1, got a scalar")
    ctx.axis(int(ctx.attr("axis")), t.rank)
    return [t]


def _sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    rank = outs[0].rank
    axis = ctx.axis(int(ctx.attr("axis")), rank)
    return sr.same_axes(ctx, outs, (d for d in range(rank) if d != axis))


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return np.asarray(e / np.sum(e, axis=axis, keepdims=True))


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    return np.asarray(shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True)))


def _hardmax(x: np.ndarray, axis: int) -> np.ndarray:
    # np.argmax picks the first of tied maxima, as ONNX asks.
    out = np.zeros(x.shape, x.dtype)
    np.put_along_axis(out, np.argmax(x, axis=axis, keepdims=True), 1, axis=axis)
    return out


def _reference(kernel: Kernel) -> Callable[[list[np.ndarray | None], Attrs], np.ndarray]:
    def ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
        x = first(xs)
        axis = int(a["axis"]) % x.ndim
        if x.shape[axis] == 0:
            # Nothing to normalize (and NumPy cannot take the max of an empty axis).
            return np.zeros(x.shape, x.dtype)
        work = x.astype(np.promote_types(x.dtype, np.float32), copy=False)
        with np.errstate(all="ignore"):
            return kernel(work, axis).astype(x.dtype, copy=False)

    return ref


def _coerce_2d(n: AdapterNode) -> list[Value] | None:
    """Opsets < 13: normalize jointly over dims axis.. by flattening them into one."""
    if n.opset >= 13:
        return None
    axis = int(n.attrs.get("axis", 1))
    n.attrs["axis"] = axis
    x = n.input(0)
    if x is None or not -x.type.rank <= axis < x.type.rank:
        return None  # the canonical inference reports the problem
    shape = x.type.shape
    axis %= len(shape)
    if axis == len(shape) - 1 or x.type.numel == 0:
        # One trailing dim: both semantics agree. Empty: the output is empty either way.
        return None
    rows, cols = math.prod(shape[:axis]), math.prod(shape[axis:])
    rows_shape = n.const("rows_shape", [rows, cols], np.int64)
    (flat,) = n.emit("Reshape", [x, rows_shape], suffix="flatten")
    (y,) = n.emit(n.op_type, [flat], {**n.attrs, "axis": 1})
    return n.emit(
        "Reshape",
        [y, n.const("shape", list(shape), np.int64)],
        suffix="unflatten",
        output_names=n.output_names,
    )


def _emitter(mode: str) -> EmitFn:
    """Kernels in templates/kernels/softmax.cu.j2: block-cooperative rows when the axis is
    the innermost one (the usual case), one thread per line along the axis otherwise. Sizes
    are arguments: one kernel per mode, type and vector width."""

    def emit(prog: Program, node: Node) -> None:
        x, y = node.inputs[0], node.outputs[0]
        assert x is not None
        t = kernel_ctype(prog, x)
        if x.type.dtype not in (DType.F32, DType.F64):
            raise prog.fail(f"code generation supports float32 and float64, not {x.type.dtype}")
        if y.type.numel == 0:
            return
        attrs = node.attrs.merged(get_op(node.op).attrs)
        shape = x.type.shape
        axis = int(attrs["axis"]) % len(shape)
        outer, extent, inner = outer_inner(shape, axis)
        if prog.is_sized(node):
            t_x = x.type
            rank = len(shape)
            if prog.count(t_x, axis + 1, rank) != "1":
                # an axis before others: one thread per line, every extent the run's
                lines, length, step = prog.around(t_x, axis)
                sized_lines = {"lines": f"{lines} * {step}", "extent": length, "inner": step}
                k = prog.kernel(
                    "softmax.cu.j2", "softmax_strided", ctype=t, acc=t, mode=mode, sized=sized_lines
                )
                host_lines, _, host_step = prog.around(t_x, axis, "hdims")
                prog.launch_sized(k, f"{host_lines} * {host_step}", [prog.cptr(x), prog.ptr(y)])
                return
            sym_cols = t_x.sym is not None and t_x.sym[axis] is not None
            vec = vec_width(x.type.dtype, extent) if mode != "hardmax" and not sym_cols else 1
            sized = {"rows": prog.count(t_x, 0, axis, "sizes"), "cols": prog.dim(t_x, axis)}
            k = prog.kernel(
                "softmax.cu.j2", "softmax_rows", ctype=t, acc=t, mode=mode, vec=vec, sized=sized
            )
            lay = row_layout(outer, extent, vec)
            launch_rows_sized(prog, k, x, y, prog.count(t_x, 0, axis, "hdims"), lay)
            return
        if inner == 1:
            vec = vec_width(x.type.dtype, extent) if mode != "hardmax" else 1
            k = prog.kernel("softmax.cu.j2", "softmax_rows", ctype=t, acc=t, mode=mode, vec=vec)
            launch_rows(prog, k, x, y, outer, extent, vec)
        else:
            k = prog.kernel("softmax.cu.j2", "softmax_strided", ctype=t, acc=t, mode=mode)
            n = outer * inner
            prog.launch(
                k,
                n,
                [
                    prog.cptr(x),
                    prog.ptr(y),
                    f"(int64_t){n}",
                    f"(int64_t){extent}",
                    f"(int64_t){inner}",
                ],
            )

    return emit


def normalizer(name: str, kernel: Kernel, cost: int, mode: str) -> None:
    defop(
        name,
        FAMILY,
        infer=_infer,
        reference=_reference(kernel),
        attrs={"axis": -1},
        flops=elementwise_flops(cost),
        sbp=_sbp,
        onnx_import=_coerce_2d,
        emit=_emitter(mode),
        sized=True,
    )


# Per element: max, subtract, exp (4, as in elementwise), sum, divide (or subtract the log).
normalizer("Softmax", _softmax, cost=8, mode="softmax")
normalizer("LogSoftmax", _log_softmax, cost=8, mode="log_softmax")
# Per element: a compare for the argmax and a write of the one-hot row.
normalizer("Hardmax", _hardmax, cost=2, mode="hardmax")


# -- gradients (VJP rules: flowc/ops/grad.py) ---------------------------------------------------


def _softmax_vjp(log: bool) -> grad.VjpFn:
    """Softmax: dx = y (g - sum(g y)); LogSoftmax: dx = g - exp(y) sum(g), the sums along
    the axis (kept)."""

    def vjp(
        b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
    ) -> list[Value | None]:
        g, y = gouts[0], node.outputs[0]
        if g is None or not need[0]:
            return [None]
        axis = int(node.attrs.get("axis", -1)) % y.type.rank
        if log:
            total = grad.reduce_sum(b, g, [axis])
            return [grad.op1(b, "Sub", g, grad.op1(b, "Mul", grad.op1(b, "Exp", y), total))]
        total = grad.reduce_sum(b, grad.op1(b, "Mul", g, y), [axis])
        return [grad.op1(b, "Mul", y, grad.op1(b, "Sub", g, total))]

    return vjp


set_vjp("Softmax", _softmax_vjp(log=False))
set_vjp("LogSoftmax", _softmax_vjp(log=True))
