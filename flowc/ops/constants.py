"""Ops whose output does not read the input's values: Shape and Size (the input's shape,
known at compile time: they fold), ConstantOfShape, Constant and Range (constants, folded
unless a result is large; then ConstantOfShape fills and Range counts on the device).
ConstantOfShape's shape and Range's start, limit and delta must be compile-time constants.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from flowc.codegen.cpp import c_float, c_literal
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node, make_splat
from flowc.ir.types import TensorType
from flowc.ops.movement import Fail, arg, const_input, const_ints, launch_over
from flowc.ops.registry import InferCtx, defop, ints

if TYPE_CHECKING:
    from flowc.codegen.program import Program

FAMILY = "shape"


# -- Shape, Size, ConstantOfShape, Constant, Range -------------------------------------------


def _shape_dims(shape: tuple[int, ...], a: Mapping[str, Any]) -> list[int]:
    # ONNX clamps start/end into [0, rank] after adding rank to negatives: Python slicing.
    return list(shape[a["start"] : a.get("end")])


defop(
    "Shape",
    FAMILY,
    infer=lambda ctx: [TensorType((len(_shape_dims(ctx.shape(0), ctx.attrs)),), DType.I64)],
    reference=lambda xs, a: np.array(_shape_dims(arg(xs, 0).shape, a), dtype=np.int64),
    attrs={"start": 0, "end": None},
    shape_only=True,
)
defop(
    "Size",
    FAMILY,
    infer=lambda ctx: [TensorType((), DType.I64)],
    reference=lambda xs, a: np.array(arg(xs, 0).size, dtype=np.int64),
    shape_only=True,
)


def _fill_value(a: Mapping[str, Any]) -> np.ndarray:
    v = a.get("value")
    return np.zeros(1, np.float32) if v is None else np.asarray(v)


def _dtype(ctx: InferCtx, dt: np.dtype) -> DType:
    return ctx.check(DType.from_numpy, dt)


def _const_of_shape_infer(ctx: InferCtx) -> list[TensorType]:
    shape = const_ints(ctx, 0, "shape")
    if any(d < 0 for d in shape):
        raise ctx.fail(f"shape {shape} has a negative dimension")
    value = _fill_value(ctx.attrs)
    if value.size != 1:
        raise ctx.fail(f"'value' must hold one element, got shape {list(value.shape)}")
    return [TensorType(tuple(shape), _dtype(ctx, value.dtype))]


def _const_of_shape_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    value = _fill_value(a)
    return make_splat(value.reshape(-1)[0], tuple(ints(arg(xs, 0))), value.dtype)


def _const_of_shape_emit(prog: Program, node: Node) -> None:
    # Folding normally turns this node into a splat constant; this is the fallback.
    out = node.outputs[0]
    t = prog.ctype(out)
    value = c_literal(_fill_value(node.attrs).reshape(-1)[0], out.type.dtype, t)
    name = prog.kernel("common.cu.j2", "fill", ctype=t)
    n = out.type.numel
    prog.launch(name, n, [prog.ptr(out), value, f"(int64_t){n}"])


defop(
    "ConstantOfShape",
    FAMILY,
    infer=_const_of_shape_infer,
    reference=_const_of_shape_ref,
    attrs={"value": None},
    emit=_const_of_shape_emit,
)

_CONSTANT_ATTRS: dict[str, Callable[[Any], np.ndarray]] = {
    "value": np.asarray,
    "sparse_value": np.asarray,  # the importer has already made it dense
    "value_float": lambda v: np.array(v, np.float32),
    "value_floats": lambda v: np.array(v, np.float32).reshape(-1),
    "value_int": lambda v: np.array(v, np.int64),
    "value_ints": lambda v: np.array(v, np.int64).reshape(-1),
}


def _constant_value(fail: Fail, a: Mapping[str, Any]) -> np.ndarray:
    given = [k for k in a if k.startswith(("value", "sparse_value"))]
    if len(given) != 1:
        raise fail(f"needs exactly one value attribute, got {given or 'none'}")
    key = given[0]
    if key not in _CONSTANT_ATTRS:
        raise fail(f"'{key}' constants are not supported (strings are not a tensor type here)")
    return _CONSTANT_ATTRS[key](a[key])


def _constant_infer(ctx: InferCtx) -> list[TensorType]:
    v = _constant_value(ctx.fail, ctx.attrs)
    return [TensorType(v.shape, _dtype(ctx, v.dtype))]


defop(
    "Constant",
    FAMILY,
    infer=_constant_infer,
    reference=lambda xs, a: _constant_value(ValueError, a),
    inputs=0,
)


def _range_count(start: np.ndarray, limit: np.ndarray, delta: np.ndarray) -> int:
    if start.dtype.kind in "iu":
        s, lim, d = int(start), int(limit), int(delta)
        return max(0, -(-(lim - s) // d))
    # onnxruntime subtracts in the element type, then divides in double.
    diff = np.asarray(limit - start, start.dtype)
    return max(0, math.ceil(float(diff) / float(delta)))


def _range_infer(ctx: InferCtx) -> list[TensorType]:
    names = ("start", "limit", "delta")
    dt = ctx.dtype(0)
    vals = []
    for i, what in enumerate(names):
        if ctx.dtype(i) != dt:
            raise ctx.fail(
                f"start, limit and delta must share one type; {what} is {ctx.dtype(i)}, start is {dt}"
            )
        c = ctx.const(i, what)
        if c.size != 1:
            raise ctx.fail(f"{what} must be a scalar, got shape {list(c.shape)}")
        vals.append(c.reshape(()))
    if not (dt.is_int or dt.is_float):
        raise ctx.fail(f"needs numeric inputs, got {dt}")
    if float(vals[2]) == 0:
        raise ctx.fail("delta is 0")
    return [TensorType((_range_count(*vals),), dt)]


def _range_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    start, limit, delta = (arg(xs, i).reshape(()) for i in range(3))
    n = _range_count(start, limit, delta)
    if start.dtype.kind in "iu":
        return (int(start) + int(delta) * np.arange(n, dtype=np.int64)).astype(start.dtype)
    steps = np.arange(n, dtype=np.float64) * float(delta)
    return (float(start) + steps).astype(start.dtype)


def _range_emit(prog: Program, node: Node) -> None:
    # Runs when folding declined (a large result); start and delta are constants.
    out = node.outputs[0]
    start, delta = const_input(node, 0), const_input(node, 2)
    assert start is not None and delta is not None
    s, d = start.reshape(()), delta.reshape(())
    is_float = out.type.dtype.is_float
    if is_float:
        lits = [c_float(float(s), "double"), c_float(float(d), "double")]
    else:
        # uint64 arithmetic wraps where the int64 of the reference would overflow.
        lits = [f"{int(s) % (1 << 64)}ULL", f"{int(d) % (1 << 64)}ULL"]
    name = prog.kernel(
        "shape.cu.j2",
        "range_fill",
        ctype=prog.ctype(out),
        start=lits[0],
        delta=lits[1],
        is_float=is_float,
    )
    launch_over(prog, name, out)


defop("Range", FAMILY, infer=_range_infer, reference=_range_ref, inputs=3, emit=_range_emit)


# -- SizePolynomial: a constant computed from the run's sizes -----------------------------------
# A program with symbolic dims folds what an exporter computes from input shapes (row offsets
# b * seq + s into a flattened mask, say) at each size it is built at; such a constant differs
# from size to size, and ir/fit_dims.py replaces it by this node: each element an integer
# polynomial of its own coordinates and the symbols, computed on the device every run.


def _poly_terms(a: Mapping[str, Any]) -> list[dict[str, Any]]:
    terms = json.loads(str(a["terms"]))
    assert isinstance(terms, list)
    return terms


def _poly_infer(ctx: InferCtx) -> list[TensorType]:
    missing = [k for k in ("shape", "dtype", "terms", "at") if k not in ctx.attrs]
    if missing:
        raise ctx.fail(
            f"needs the attributes {', '.join(missing)} (flowc makes this node for a constant "
            "computed from symbolic sizes)"
        )
    shape = tuple(int(d) for d in ctx.attr("shape"))
    return [TensorType(shape, DType.from_onnx(int(ctx.attr("dtype"))))]


def _poly_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    """The constant at the bound (the symbols at the sizes ``at`` names)."""
    shape = tuple(int(d) for d in a["shape"])
    at = json.loads(str(a["at"]))
    coords = np.indices(shape, dtype=np.int64) if shape else np.zeros((0,), np.int64)
    out = np.zeros(shape, dtype=np.int64)
    for t in _poly_terms(a):
        term = np.full(shape, int(t["c"]) * math.prod(int(at[s]) for s in t["syms"]), np.int64)
        for k in t["axes"]:
            term = term * coords[int(k)]
        out += term
    return out.astype(DType.from_onnx(int(a["dtype"])).np)


def _poly_emit(prog: Program, node: Node) -> None:
    out = node.outputs[0]
    t = out.type
    terms = []
    for term in _poly_terms(node.attrs):
        factors = [f"c{int(k)}" for k in term["axes"]]
        factors += [f"sizes[{prog.slots[s]}]" for s in term["syms"]]
        terms.append(" * ".join([f"INT64_C({int(term['c'])})", *factors]))
    dims = [{"axis": a, "size": prog.dim(t, a)} for a in range(t.rank)]
    name = prog.kernel(
        "shape.cu.j2",
        "size_polynomial",
        ctype=prog.ctype(out),
        dims=dims,
        value=" + ".join(terms) or "0",
    )
    prog.launch_sized(name, prog.numel(t), [prog.ptr(out)])


defop(
    "SizePolynomial",
    FAMILY,
    infer=_poly_infer,
    reference=_poly_ref,
    attrs={"shape": None, "dtype": None, "terms": None, "at": None},
    inputs=0,
    emit=_poly_emit,
    sized=True,
    sizeless=lambda a: Attrs({k: v for k, v in a.items() if k not in ("shape", "at")}),
)
