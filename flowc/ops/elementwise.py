"""Element-wise ops: unary math and activations, broadcasting binary and variadic ops,
comparisons and logic, Where, Clip, Cast.

All binary ops use ONNX multidirectional broadcasting. Integer division truncates toward
zero, as C (and onnxruntime) does; NumPy's ``//`` floors, so it is not used directly.

One idea: the element-wise family beside elementwise.cu.j2 (each op a C expression the
fused kernels reuse); kept whole because an op family is one module.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx.numpy_helper

from flowc.codegen.cpp import c_float
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs
from flowc.ir.types import TensorType
from flowc.ops import grad
from flowc.ops import sbp_rules as sr
from flowc.ops.grad import GradBuilder, VjpFn, op1, scalar
from flowc.ops.registry import (
    CExprFn,
    InferCtx,
    SbpFn,
    SbpSignature,
    broadcast_shapes,
    defop,
    elementwise_flops,
    first,
    get_op,
    same_as_input,
    set_vjp,
)

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.builder import AdapterNode
    from flowc.ir.graph import Node, Value

FAMILY = "elementwise"

_erf = np.frompyfunc(math.erf, 1, 1)


def erf(x: np.ndarray) -> np.ndarray:
    return np.asarray(_erf(x.astype(np.float64)), dtype=np.float64).astype(x.dtype)


# -- code generation: each op's scalar C++ expression ----------------------------------------------
# $0, $1, ...: operands; $T: the result's C++ type; $I: the first operand's. Helpers are in
# runtime_cpp/flowc/elementwise.h.


def _lit(x: float) -> str:
    return c_float(float(x), "$T")


def _fixed(text: str) -> CExprFn:
    return lambda a, present: text


def _chain(fn: str, n: int) -> str:
    expr = "$0"
    for k in range(1, n):
        expr = f"flowc::ew::{fn}({expr}, ${k})"
    return expr


def _clip_expr(a: Attrs, present: tuple[bool, ...]) -> str:
    lo = len(present) > 1 and present[1]
    hi = len(present) > 2 and present[2]
    if lo and hi:
        return "flowc::ew::clip($0, static_cast<$T>($1), static_cast<$T>($2))"
    if lo:
        return "flowc::ew::max_($0, static_cast<$T>($1))"
    if hi:
        return "flowc::ew::min_($0, static_cast<$T>($2))"
    return "$0"


_E8M0_ROUND = {"up": "kUp", "nearest": "kNearest", "down": "kDown"}


def _cast_expr(a: Attrs, present: tuple[bool, ...]) -> str:
    to = DType.from_onnx(int(a.get("to", 0)))
    sat = "true" if int(a.get("saturate", 1)) else "false"
    if to == DType.BOOL:
        return "($0 != 0)"
    if to == DType.F8E8M0:
        mode = _E8M0_ROUND.get(str(a.get("round_mode", "up")), "kUp")
        return f"flowc::e8m0_cast($0, {sat}, flowc::narrow::E8M0Round::{mode})"
    if to.storage_only and to.is_float and to.itemsize == 1:
        return f"flowc::saturate_cast<$T>($0, {sat})"
    if to.is_int:
        return "flowc::ew::cast<$T>($0)"  # float -> int: truncated, saturated, NaN -> 0
    return "static_cast<$T>($0)"


def _castlike_import(n: AdapterNode) -> list[Value]:
    """CastLike is Cast to the second input's type: import it as that, so kernels never read
    the second input (it gives a type, not data)."""
    x, like = n.input(0), n.input(1)
    assert x is not None and like is not None
    attrs = {
        "to": like.type.dtype.onnx,
        "saturate": n.attrs.get("saturate", 1),
        "round_mode": n.attrs.get("round_mode", "up"),
    }
    return n.emit("Cast", [x], attrs, output_names=n.output_names)


CEXPR: dict[str, CExprFn] = {
    "Neg": _fixed("(-$0)"),
    "Abs": _fixed("flowc::ew::abs_($0)"),
    "Sqrt": _fixed("flowc::ew::sqrt_($0)"),
    "Reciprocal": _fixed("($T(1) / $0)"),
    "Exp": _fixed("flowc::ew::exp_($0)"),
    "Log": _fixed("flowc::ew::log_($0)"),
    "Erf": _fixed("flowc::ew::erf_($0)"),
    "Tanh": _fixed("flowc::ew::tanh_($0)"),
    "Sigmoid": _fixed("flowc::ew::sigmoid($0)"),
    "Relu": _fixed("flowc::ew::relu($0)"),
    "LeakyRelu": lambda a, p: f"($0 >= $T(0) ? $0 : $0 * {_lit(a['alpha'])})",
    "Elu": lambda a, p: f"($0 > $T(0) ? $0 : {_lit(a['alpha'])} * (flowc::ew::exp_($0) - $T(1)))",
    "Selu": lambda a, p: (
        f"{_lit(a['gamma'])} * ($0 > $T(0) ? $0 : {_lit(a['alpha'])} * flowc::ew::exp_($0) - {_lit(a['alpha'])})"
    ),
    "Celu": lambda a, p: (
        f"(flowc::ew::max_($T(0), $0) + flowc::ew::min_($T(0), {_lit(a['alpha'])} * "
        f"(flowc::ew::exp_($0 / {_lit(a['alpha'])}) - $T(1))))"
    ),
    "Gelu": lambda a, p: (
        "flowc::ew::gelu_tanh($0)" if a["approximate"] == "tanh" else "flowc::ew::gelu($0)"
    ),
    "HardSigmoid": lambda a, p: (
        f"flowc::ew::clip({_lit(a['alpha'])} * $0 + {_lit(a['beta'])}, $T(0), $T(1))"
    ),
    "HardSwish": _fixed("($0 * flowc::ew::clip($0 / $T(6) + $T(0.5), $T(0), $T(1)))"),
    "Softplus": _fixed("flowc::ew::softplus($0)"),
    "Softsign": _fixed("($0 / ($T(1) + flowc::ew::abs_($0)))"),
    "Mish": _fixed("($0 * flowc::ew::tanh_(flowc::ew::softplus($0)))"),
    "ThresholdedRelu": lambda a, p: f"($0 > {_lit(a['alpha'])} ? $0 : $T(0))",
    "Shrink": lambda a, p: (
        f"($0 < -{_lit(a['lambd'])} ? $0 + {_lit(a['bias'])} : "
        f"($0 > {_lit(a['lambd'])} ? $0 - {_lit(a['bias'])} : $T(0)))"
    ),
    "Floor": _fixed("flowc::ew::floor_($0)"),
    "Ceil": _fixed("flowc::ew::ceil_($0)"),
    "Round": _fixed("flowc::ew::rint_($0)"),
    "Sign": _fixed("flowc::ew::sign_($0)"),
    **{
        n: _fixed(f"flowc::ew::{n.lower()}_($0)")
        for n in (
            "Sin",
            "Cos",
            "Tan",
            "Asin",
            "Acos",
            "Atan",
            "Sinh",
            "Cosh",
            "Asinh",
            "Acosh",
            "Atanh",
        )
    },
    "Add": _fixed("($0 + $1)"),
    "Sub": _fixed("($0 - $1)"),
    "Mul": _fixed("($0 * $1)"),
    "Div": _fixed("flowc::ew::div_($0, $1)"),
    "Pow": _fixed("flowc::ew::pow2_($0, $1)"),
    "PRelu": _fixed("($0 < $T(0) ? $0 * $1 : $0)"),
    "Equal": _fixed("($0 == $1)"),
    "Less": _fixed("($0 < $1)"),
    "Greater": _fixed("($0 > $1)"),
    "LessOrEqual": _fixed("($0 <= $1)"),
    "GreaterOrEqual": _fixed("($0 >= $1)"),
    "And": _fixed("($0 && $1)"),
    "Or": _fixed("($0 || $1)"),
    "Xor": _fixed("($0 != $1)"),
    "BitwiseAnd": _fixed("($0 & $1)"),
    "BitwiseOr": _fixed("($0 | $1)"),
    "BitwiseXor": _fixed("($0 ^ $1)"),
    "BitwiseNot": _fixed("(~$0)"),
    "Mod": lambda a, p: "flowc::ew::fmod_($0, $1)" if a["fmod"] else "flowc::ew::mod_($0, $1)",
    "BitShift": lambda a, p: (
        "flowc::ew::shl_($0, $1)" if a["direction"] == "LEFT" else "flowc::ew::shr_($0, $1)"
    ),
    "Sum": lambda a, p: "(" + " + ".join(f"${k}" for k in range(len(p))) + ")",
    "Max": lambda a, p: _chain("max_", len(p)),
    "Min": lambda a, p: _chain("min_", len(p)),
    "Mean": lambda a, p: "((" + " + ".join(f"${k}" for k in range(len(p))) + f") / $T({len(p)}))",
    "Not": _fixed("(!$0)"),
    "IsNaN": _fixed("flowc::ew::isnan_($0)"),
    "IsInf": lambda a, p: (
        f"flowc::ew::isinf_($0, {str(bool(a['detect_positive'])).lower()}, {str(bool(a['detect_negative'])).lower()})"
    ),
    "Where": _fixed("($0 ? $1 : $2)"),
    "Clip": _clip_expr,
    "Cast": _cast_expr,
}


def emit_elementwise(prog: Program, node: Node) -> None:
    """The op's cexpr as one broadcasting kernel (the code generator's shared emitter)."""
    prog.elementwise(node)


def emit_fused(prog: Program, node: Node) -> None:
    """A FusedElementwise chain as one kernel, each step a local variable."""
    prog.fused(node)


def codegen(name: str) -> dict[str, Any]:
    """The defop arguments that give an op its element-wise kernel, when it has an expression."""
    if name in CEXPR:
        return {"cexpr": CEXPR[name], "emit": emit_elementwise, "sized": True}
    return {}


# -- SBP ----------------------------------------------------------------------------------------
# Every element-wise op splits along any output axis (inputs split on their aligned axis, B
# where they broadcast). P passes only through ops linear in the P operands: ``linear`` lists
# the sets of inputs that may be P together, the rest staying B (None: every input). Integer
# sums wrap exactly, but integer division truncates each part: ``float_linear`` ops (Div,
# Mean) are linear only on floats.


def ew_sbp(*linear: Sequence[int] | None, float_linear: bool = False) -> SbpFn:
    def sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
        sigs = sr.broadcast_splits(ctx, outs)
        if float_linear and not outs[0].dtype.is_float:
            return sigs
        every = range(ctx.num_inputs)
        return [*sigs, *(sr.partial(ctx, outs, every if p is None else p) for p in linear)]

    return sbp


def _cast_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    # A cast between float types is linear up to rounding; CastLike's second input only
    # names the type, so it stays B.
    sigs = sr.broadcast_splits(ctx, outs, data=(0,))
    if ctx.dtype(0).is_float and outs[0].dtype.is_float:
        sigs.append(sr.partial(ctx, outs))
    return sigs


# -- unary ------------------------------------------------------------------------------------


def unary(
    name: str,
    fn: Callable[[np.ndarray, Attrs], np.ndarray],
    attrs: dict[str, object] | None = None,
    cost: int = 1,
    float_only: bool = False,
    linear: bool = False,
    vjp: VjpFn | None = None,
) -> None:
    def infer(ctx: InferCtx) -> list[TensorType]:
        t = ctx.type(0)
        if float_only and not t.dtype.is_float:
            raise ctx.fail(f"needs a floating-point input, got {t.dtype}")
        return [t]

    def ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
        x = xs[0]
        assert x is not None
        with np.errstate(all="ignore"):
            return np.asarray(fn(x, a)).astype(x.dtype, copy=False)

    defop(
        name,
        FAMILY,
        infer=infer,
        reference=ref,
        attrs=attrs,
        flops=elementwise_flops(cost),
        sbp=ew_sbp((0,)) if linear else ew_sbp(),
        vjp=vjp,
        **codegen(name),
    )


def _f(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray, Attrs], np.ndarray]:
    return lambda x, a: fn(x)


def _sel(x: np.ndarray, cond: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(cond, a, b).astype(x.dtype)


# -- gradients (VJP rules: flowc/ops/grad.py) ---------------------------------------------------
# f'(x) of each differentiable unary op, built from the input x and the output y.


def _relu_grad(b: GradBuilder, x: Value, y: Value) -> Value:
    return op1(b, "Cast", op1(b, "Greater", x, scalar(b, 0.0, x)), to=x.type.dtype.onnx)


def _erf_grad(b: GradBuilder, x: Value, y: Value) -> Value:
    # 2/sqrt(pi) * exp(-x^2)
    e = op1(b, "Exp", op1(b, "Neg", op1(b, "Mul", x, x)))
    return op1(b, "Mul", e, scalar(b, 2 / math.sqrt(math.pi), x))


def _gelu_grad(b: GradBuilder, x: Value, y: Value, approximate: str) -> Value:
    half, one = scalar(b, 0.5, x), scalar(b, 1.0, x)
    if approximate == "tanh":
        # u = c (x + k x^3), t = tanh u: 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 k x^2)
        c, k = math.sqrt(2 / math.pi), 0.044715
        x2 = op1(b, "Mul", x, x)
        inner = op1(b, "Add", x, op1(b, "Mul", op1(b, "Mul", x2, x), scalar(b, k, x)))
        t = op1(b, "Tanh", op1(b, "Mul", inner, scalar(b, c, x)))
        dt = op1(b, "Sub", one, op1(b, "Mul", t, t))
        du = op1(
            b, "Mul", op1(b, "Add", one, op1(b, "Mul", x2, scalar(b, 3 * k, x))), scalar(b, c, x)
        )
        left = op1(b, "Mul", half, op1(b, "Add", one, t))
        return op1(b, "Add", left, op1(b, "Mul", op1(b, "Mul", half, x), op1(b, "Mul", dt, du)))
    # 0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) / sqrt(2 pi)
    cdf = op1(
        b,
        "Mul",
        half,
        op1(b, "Add", one, op1(b, "Erf", op1(b, "Mul", x, scalar(b, 1 / math.sqrt(2), x)))),
    )
    pdf = op1(b, "Exp", op1(b, "Mul", op1(b, "Mul", x, x), scalar(b, -0.5, x)))
    return op1(
        b,
        "Add",
        cdf,
        op1(b, "Mul", x, op1(b, "Mul", pdf, scalar(b, 1 / math.sqrt(2 * math.pi), x))),
    )


def _gelu_vjp(
    b: GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    approximate = str(node.attrs.get("approximate", "none"))
    return grad.elementwise(lambda b_, x, y: _gelu_grad(b_, x, y, approximate))(
        b, node, gouts, need
    )


def _leaky_relu_vjp(
    b: GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    alpha = float(node.attrs.get("alpha", 0.01))

    def slope(b_: GradBuilder, x: Value, y: Value) -> Value:
        return op1(
            b_,
            "Where",
            op1(b_, "GreaterOrEqual", x, scalar(b_, 0.0, x)),
            scalar(b_, 1.0, x),
            scalar(b_, alpha, x),
        )

    return grad.elementwise(slope)(b, node, gouts, need)


_SQRT_GRAD = grad.elementwise(
    lambda b, x, y: op1(b, "Reciprocal", op1(b, "Mul", y, scalar(b, 2.0, y)))
)
_UNARY_VJP: dict[str, VjpFn] = {
    "Neg": grad.linear(lambda b, g: op1(b, "Neg", g)),
    "Abs": grad.elementwise(lambda b, x, y: op1(b, "Sign", x)),
    "Sqrt": _SQRT_GRAD,
    "Reciprocal": grad.elementwise(lambda b, x, y: op1(b, "Neg", op1(b, "Mul", y, y))),
    "Exp": grad.elementwise(lambda b, x, y: y),
    "Log": grad.elementwise(lambda b, x, y: op1(b, "Reciprocal", x)),
    "Erf": grad.elementwise(_erf_grad),
    "Tanh": grad.elementwise(lambda b, x, y: op1(b, "Sub", scalar(b, 1.0, y), op1(b, "Mul", y, y))),
    "Sigmoid": grad.elementwise(
        lambda b, x, y: op1(b, "Mul", y, op1(b, "Sub", scalar(b, 1.0, y), y))
    ),
    "Relu": grad.elementwise(_relu_grad),
    "LeakyRelu": _leaky_relu_vjp,
    "Gelu": _gelu_vjp,
    "Softplus": grad.elementwise(lambda b, x, y: op1(b, "Sigmoid", x)),
    "Sin": grad.elementwise(lambda b, x, y: op1(b, "Cos", x)),
    "Cos": grad.elementwise(lambda b, x, y: op1(b, "Neg", op1(b, "Sin", x))),
}


def _binary_grads(
    b: GradBuilder, node: Node, need: list[bool], da: Callable[[], Value], db: Callable[[], Value]
) -> list[Value | None]:
    """The gradients of a broadcasting binary op's operands, each summed back to its shape."""
    a, c = node.inputs[0], node.inputs[1]
    assert a is not None and c is not None
    return [
        grad.unbroadcast(b, da(), a.type.shape) if need[0] else None,
        grad.unbroadcast(b, db(), c.type.shape) if need[1] else None,
    ]


def _add_vjp(
    b: GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    g = gouts[0]
    if g is None:
        return [None, None]
    return _binary_grads(b, node, need, lambda: g, lambda: g)


def _sub_vjp(
    b: GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    g = gouts[0]
    if g is None:
        return [None, None]
    return _binary_grads(b, node, need, lambda: g, lambda: op1(b, "Neg", g))


def _mul_vjp(
    b: GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    g, (x, y) = gouts[0], node.inputs[:2]
    if g is None:
        return [None, None]
    return _binary_grads(b, node, need, lambda: op1(b, "Mul", g, y), lambda: op1(b, "Mul", g, x))


def _div_vjp(
    b: GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    # z = x / y: dx = g / y, dy = -g z / y
    g, y, z = gouts[0], node.inputs[1], node.outputs[0]
    if g is None or not z.type.dtype.is_float:
        return [None, None]
    return _binary_grads(
        b,
        node,
        need,
        lambda: op1(b, "Div", g, y),
        lambda: op1(b, "Neg", op1(b, "Div", op1(b, "Mul", g, z), y)),
    )


def _pow_vjp(
    b: GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    # z = x ** y: dx = g y x^(y-1), dy = g z log x (the exponent only when it is trained)
    g, (x, y), z = gouts[0], node.inputs[:2], node.outputs[0]
    if g is None or x is None or y is None or not z.type.dtype.is_float:
        return [None, None]
    yx = op1(b, "Cast", y, to=x.type.dtype.onnx) if y.type.dtype != x.type.dtype else y
    return _binary_grads(
        b,
        node,
        [need[0], need[1] and y.type.dtype.is_float],
        lambda: op1(
            b, "Mul", g, op1(b, "Mul", yx, op1(b, "Pow", x, op1(b, "Sub", yx, scalar(b, 1.0, x))))
        ),
        lambda: op1(b, "Mul", g, op1(b, "Mul", z, op1(b, "Log", x))),
    )


unary("Neg", _f(np.negative), linear=True)
unary("Abs", _f(np.abs))
unary("Sqrt", _f(np.sqrt), float_only=True)
unary("Reciprocal", _f(np.reciprocal), float_only=True)
unary("Exp", _f(np.exp), float_only=True, cost=4)
unary("Log", _f(np.log), float_only=True, cost=4)
unary("Erf", _f(erf), float_only=True, cost=8)
unary("Tanh", _f(np.tanh), float_only=True, cost=4)
unary("Sigmoid", _f(lambda x: 1 / (1 + np.exp(-x))), float_only=True, cost=4)
unary("Relu", _f(lambda x: np.maximum(x, np.zeros((), x.dtype))))
unary(
    "LeakyRelu", lambda x, a: _sel(x, x >= 0, x, x * a["alpha"]), {"alpha": 0.01}, float_only=True
)
unary(
    "Elu",
    lambda x, a: _sel(x, x > 0, x, a["alpha"] * (np.exp(x) - 1)),
    {"alpha": 1.0},
    float_only=True,
    cost=4,
)
unary(
    "Selu",
    lambda x, a: _sel(x, x > 0, a["gamma"] * x, a["gamma"] * (a["alpha"] * np.exp(x) - a["alpha"])),
    {"alpha": 1.67326319217681884765625, "gamma": 1.05070102214813232421875},
    float_only=True,
    cost=4,
)


def _celu(x: np.ndarray, a: Attrs) -> np.ndarray:
    # Storage-only types (bfloat16, ...) in float32, rounded once, as the compiled code does
    # (widen_types) and ONNX's expected values are: ml_dtypes 0.7 has bfloat16 loops of its
    # own for exp, which round every step and end an ulp away.
    w = x.astype(DType.from_numpy(x.dtype).compute_type.np)
    y = np.maximum(0, w) + np.minimum(0, a["alpha"] * (np.exp(w / a["alpha"]) - 1))
    return y.astype(x.dtype)


unary(
    "Celu",
    _celu,
    {"alpha": 1.0},
    float_only=True,
    cost=4,
)


def _gelu(x: np.ndarray, a: Attrs) -> np.ndarray:
    if a["approximate"] == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + erf(x / np.asarray(math.sqrt(2), x.dtype)))


unary("Gelu", _gelu, {"approximate": "none"}, float_only=True, cost=8)
unary(
    "HardSigmoid",
    lambda x, a: np.clip(a["alpha"] * x + a["beta"], 0, 1),
    {"alpha": 0.2, "beta": 0.5},
    float_only=True,
)
unary("HardSwish", _f(lambda x: x * np.clip(x / 6 + 0.5, 0, 1)), float_only=True)
unary("Softplus", _f(lambda x: np.logaddexp(np.zeros((), x.dtype), x)), float_only=True, cost=4)
unary("Softsign", _f(lambda x: x / (1 + np.abs(x))), float_only=True)
unary(
    "Mish",
    _f(lambda x: x * np.tanh(np.logaddexp(np.zeros((), x.dtype), x))),
    float_only=True,
    cost=8,
)
unary(
    "ThresholdedRelu",
    lambda x, a: _sel(x, x > a["alpha"], x, np.zeros_like(x)),
    {"alpha": 1.0},
    float_only=True,
)
unary(
    "Shrink",
    lambda x, a: _sel(
        x,
        x < -a["lambd"],
        x + a["bias"],
        np.where(x > a["lambd"], x - a["bias"], 0),
    ),
    {"bias": 0.0, "lambd": 0.5},
)
unary("Floor", _f(np.floor), float_only=True)
unary("Ceil", _f(np.ceil), float_only=True)
unary("Round", _f(np.round), float_only=True)  # NumPy rounds half to even, as ONNX asks
unary("Sign", _f(np.sign))
for _name, _fn in [
    ("Sin", np.sin),
    ("Cos", np.cos),
    ("Tan", np.tan),
    ("Asin", np.arcsin),
    ("Acos", np.arccos),
    ("Atan", np.arctan),
    ("Sinh", np.sinh),
    ("Cosh", np.cosh),
    ("Asinh", np.arcsinh),
    ("Acosh", np.arccosh),
    ("Atanh", np.arctanh),
]:
    unary(_name, _f(_fn), float_only=True, cost=4)


def _with_attrs(
    derivative: Callable[[GradBuilder, Value, Value, Callable[[str, float], float]], Value],
) -> VjpFn:
    """grad.elementwise for a derivative that reads the node's float attributes (``at(name,
    default)``)."""

    def vjp(
        b: GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
    ) -> list[Value | None]:
        def at(key: str, default: float) -> float:
            return float(node.attrs.get(key, default))

        return grad.elementwise(lambda b_, x, y: derivative(b_, x, y, at))(b, node, gouts, need)

    return vjp


def _where(b: GradBuilder, cond: Value, a: Value, c: Value) -> Value:
    return op1(b, "Where", cond, a, c)


def _positive(b: GradBuilder, x: Value) -> Value:
    return op1(b, "Greater", x, scalar(b, 0.0, x))


def _recip_sqrt(b: GradBuilder, v: Value) -> Value:
    return op1(b, "Reciprocal", op1(b, "Sqrt", v))


def _square(b: GradBuilder, x: Value) -> Value:
    return op1(b, "Mul", x, x)


def _one_minus_x2(b: GradBuilder, x: Value) -> Value:
    return op1(b, "Sub", scalar(b, 1.0, x), _square(b, x))


def _between(b: GradBuilder, x: Value, lo: float, hi: float) -> Value:
    """1 where lo < x < hi, else 0 (a clamp's slope)."""
    inside = op1(
        b,
        "And",
        op1(b, "Greater", x, scalar(b, lo, x)),
        op1(b, "Less", x, scalar(b, hi, x)),
    )
    return op1(b, "Cast", inside, to=x.type.dtype.onnx)


def _mish_grad(b: GradBuilder, x: Value, y: Value) -> Value:
    # y = x tanh(sp(x)): tanh(sp) + x (1 - tanh(sp)^2) sigmoid(x)
    t = op1(b, "Tanh", op1(b, "Softplus", x))
    return op1(
        b, "Add", t, op1(b, "Mul", op1(b, "Mul", x, _one_minus_x2(b, t)), op1(b, "Sigmoid", x))
    )


_UNARY_VJP.update(
    {
        "Elu": _with_attrs(
            lambda b, x, y, at: _where(
                b,
                _positive(b, x),
                scalar(b, 1.0, x),
                op1(b, "Add", y, scalar(b, at("alpha", 1.0), y)),
            )
        ),
        "Selu": _with_attrs(
            lambda b, x, y, at: _where(
                b,
                _positive(b, x),
                scalar(b, at("gamma", 1.05070102214813232421875), x),
                op1(
                    b,
                    "Mul",
                    op1(b, "Exp", x),
                    scalar(
                        b,
                        at("gamma", 1.05070102214813232421875)
                        * at("alpha", 1.67326319217681884765625),
                        x,
                    ),
                ),
            )
        ),
        "Celu": _with_attrs(
            lambda b, x, y, at: _where(
                b,
                _positive(b, x),
                scalar(b, 1.0, x),
                op1(b, "Exp", op1(b, "Div", x, scalar(b, at("alpha", 1.0), x))),
            )
        ),
        "HardSigmoid": _with_attrs(
            lambda b, x, y, at: op1(
                b,
                "Mul",
                _between(
                    b,
                    op1(
                        b,
                        "Add",
                        op1(b, "Mul", x, scalar(b, at("alpha", 0.2), x)),
                        scalar(b, at("beta", 0.5), x),
                    ),
                    0.0,
                    1.0,
                ),
                scalar(b, at("alpha", 0.2), x),
            )
        ),
        # x (x/6 + 1/2) inside (-3, 3): x/3 + 1/2; 1 above 3; 0 below -3
        "HardSwish": grad.elementwise(
            lambda b, x, y: op1(
                b,
                "Add",
                op1(
                    b,
                    "Mul",
                    _between(b, x, -3.0, 3.0),
                    op1(b, "Add", op1(b, "Div", x, scalar(b, 3.0, x)), scalar(b, 0.5, x)),
                ),
                op1(
                    b, "Cast", op1(b, "GreaterOrEqual", x, scalar(b, 3.0, x)), to=x.type.dtype.onnx
                ),
            )
        ),
        "Softsign": grad.elementwise(
            lambda b, x, y: op1(
                b, "Reciprocal", _square(b, op1(b, "Add", scalar(b, 1.0, x), op1(b, "Abs", x)))
            )
        ),
        "Mish": grad.elementwise(_mish_grad),
        "ThresholdedRelu": _with_attrs(
            lambda b, x, y, at: op1(
                b,
                "Cast",
                op1(b, "Greater", x, scalar(b, at("alpha", 1.0), x)),
                to=x.type.dtype.onnx,
            )
        ),
        "Tan": grad.elementwise(lambda b, x, y: op1(b, "Add", scalar(b, 1.0, y), _square(b, y))),
        "Asin": grad.elementwise(lambda b, x, y: _recip_sqrt(b, _one_minus_x2(b, x))),
        "Acos": grad.elementwise(
            lambda b, x, y: op1(b, "Neg", _recip_sqrt(b, _one_minus_x2(b, x)))
        ),
        "Atan": grad.elementwise(
            lambda b, x, y: op1(b, "Reciprocal", op1(b, "Add", scalar(b, 1.0, x), _square(b, x)))
        ),
        "Sinh": grad.elementwise(lambda b, x, y: op1(b, "Cosh", x)),
        "Cosh": grad.elementwise(lambda b, x, y: op1(b, "Sinh", x)),
        "Asinh": grad.elementwise(
            lambda b, x, y: _recip_sqrt(b, op1(b, "Add", _square(b, x), scalar(b, 1.0, x)))
        ),
        "Acosh": grad.elementwise(
            lambda b, x, y: _recip_sqrt(b, op1(b, "Sub", _square(b, x), scalar(b, 1.0, x)))
        ),
        "Atanh": grad.elementwise(lambda b, x, y: op1(b, "Reciprocal", _one_minus_x2(b, x))),
    }
)


def _no_gradient(
    b: GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """Piecewise constant ops: their derivative is zero wherever it exists."""
    return [None] * len(node.inputs)


for _name in ("Floor", "Ceil", "Round", "Sign"):
    _UNARY_VJP[_name] = _no_gradient

for _name, _rule in _UNARY_VJP.items():
    set_vjp(_name, _rule)


# -- binary and variadic with broadcasting -------------------------------------------------------


def _binary_infer(
    out_bool: bool = False, same_dtype: bool = True
) -> Callable[[InferCtx], list[TensorType]]:
    def infer(ctx: InferCtx) -> list[TensorType]:
        a, b = ctx.type(0), ctx.type(1)
        if same_dtype and a.dtype != b.dtype:
            raise ctx.fail(f"operands have different element types: {a.dtype} and {b.dtype}")
        shape = broadcast_shapes(ctx, a.shape, b.shape)
        return [TensorType(shape, DType.BOOL if out_bool else a.dtype)]

    return infer


def binary(
    name: str,
    fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
    *,
    out_bool: bool = False,
    same_dtype: bool = True,
    attrs: dict[str, object] | None = None,
    fn_attrs: Callable[[np.ndarray, np.ndarray, Attrs], np.ndarray] | None = None,
    linear: Sequence[Sequence[int]] = (),
    float_linear: bool = False,
    vjp: VjpFn | None = None,
) -> None:
    def ref(xs: list[np.ndarray | None], at: Attrs) -> np.ndarray:
        a, b = xs[0], xs[1]
        assert a is not None and b is not None
        with np.errstate(all="ignore"):
            r = fn_attrs(a, b, at) if fn_attrs is not None else fn(a, b)
        return np.asarray(r).astype(np.bool_ if out_bool else a.dtype, copy=False)

    defop(
        name,
        FAMILY,
        infer=_binary_infer(out_bool, same_dtype),
        reference=ref,
        inputs=2,
        attrs=attrs,
        flops=elementwise_flops(1),
        sbp=ew_sbp(*linear, float_linear=float_linear),
        vjp=vjp,
        **codegen(name),
    )


def _int_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype.kind in "iu":
        safe = np.where(b == 0, 1, b)
        q = a // safe
        # // floors; C division truncates toward zero.
        fix = (a % safe != 0) & ((a < 0) != (safe < 0))
        return np.where(fix, q + 1, q)
    return a / b


def _pow(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype.kind in "iu":
        return np.power(a.astype(np.float64), b.astype(np.float64)).astype(a.dtype)
    return np.power(a, b.astype(a.dtype))


def _mod(a: np.ndarray, b: np.ndarray, at: Attrs) -> np.ndarray:
    if at["fmod"]:
        return np.fmod(a, b)
    if a.dtype.kind == "f":  # Python's modulo: the result takes the divisor's sign
        with np.errstate(all="ignore"):
            return np.mod(a, b)
    return np.mod(a, np.where(b == 0, 1, b))


binary("Add", np.add, linear=[(0, 1)], vjp=_add_vjp)
binary("Sub", np.subtract, linear=[(0, 1)], vjp=_sub_vjp)
binary("Mul", np.multiply, linear=[(0,), (1,)], vjp=_mul_vjp)
binary("Div", _int_div, linear=[(0,)], float_linear=True, vjp=_div_vjp)
binary("Pow", _pow, same_dtype=False, vjp=_pow_vjp)
binary("Mod", np.mod, attrs={"fmod": 0}, fn_attrs=_mod)
binary("PRelu", lambda x, s: np.where(x < 0, x * s, x))
binary("Equal", np.equal, out_bool=True)
binary("Less", np.less, out_bool=True)
binary("Greater", np.greater, out_bool=True)
binary("LessOrEqual", np.less_equal, out_bool=True)
binary("GreaterOrEqual", np.greater_equal, out_bool=True)
binary("And", np.logical_and, out_bool=True)
binary("Or", np.logical_or, out_bool=True)
binary("Xor", np.logical_xor, out_bool=True)
binary("BitwiseAnd", np.bitwise_and)
binary("BitwiseOr", np.bitwise_or)
binary("BitwiseXor", np.bitwise_xor)
binary(
    "BitShift",
    np.left_shift,
    attrs={"direction": "LEFT"},
    fn_attrs=lambda a, b, at: (
        np.left_shift(a, b) if at["direction"] == "LEFT" else np.right_shift(a, b)
    ),
)
unary("BitwiseNot", _f(np.invert))


def _variadic_infer(ctx: InferCtx) -> list[TensorType]:
    if ctx.num_inputs == 0:
        raise ctx.fail("needs at least one input")
    dt = ctx.dtype(0)
    for i in range(ctx.num_inputs):
        if ctx.dtype(i) != dt:
            raise ctx.fail(f"inputs have different element types: {dt} and {ctx.dtype(i)}")
    return [TensorType(broadcast_shapes(ctx, *(ctx.shape(i) for i in range(ctx.num_inputs))), dt)]


def variadic(
    name: str,
    fn: Callable[[Sequence[np.ndarray]], np.ndarray],
    linear: bool = False,
    float_linear: bool = False,
) -> None:
    def ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
        arrays = [x for x in xs if x is not None]
        with np.errstate(all="ignore"):
            return np.asarray(fn(arrays)).astype(arrays[0].dtype, copy=False)

    defop(
        name,
        FAMILY,
        infer=_variadic_infer,
        reference=ref,
        inputs=(1, 1 << 30),
        flops=elementwise_flops(1),
        sbp=ew_sbp(None, float_linear=float_linear) if linear else ew_sbp(),
        **codegen(name),
    )


def _fold(
    fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> Callable[[Sequence[np.ndarray]], np.ndarray]:
    def run(xs: Sequence[np.ndarray]) -> np.ndarray:
        acc = xs[0]
        for x in xs[1:]:
            acc = fn(acc, x)
        return np.broadcast_to(acc, np.broadcast_shapes(*(x.shape for x in xs)))

    return run


variadic("Sum", _fold(np.add), linear=True)
variadic("Max", _fold(np.maximum))
variadic("Min", _fold(np.minimum))
variadic(
    "Mean",
    lambda xs: _fold(np.add)(xs) / np.asarray(len(xs), xs[0].dtype),
    linear=True,
    float_linear=True,
)


# -- logic and tests ----------------------------------------------------------------------------


def _bool_out(ctx: InferCtx) -> list[TensorType]:
    return [ctx.type(0).with_dtype(DType.BOOL)]


def _not_infer(ctx: InferCtx) -> list[TensorType]:
    if ctx.dtype(0) != DType.BOOL:
        raise ctx.fail(f"needs a bool input, got {ctx.dtype(0)}")
    return [ctx.type(0)]


defop(
    "Not",
    FAMILY,
    infer=_not_infer,
    reference=lambda xs, a: np.logical_not(first(xs)),
    flops=elementwise_flops(1),
    sbp=ew_sbp(),
    **codegen("Not"),
)
defop(
    "IsNaN",
    FAMILY,
    infer=_bool_out,
    reference=lambda xs, a: np.isnan(first(xs)),
    flops=elementwise_flops(1),
    sbp=ew_sbp(),
    **codegen("IsNaN"),
)


def _isinf(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = xs[0]
    assert x is not None
    pos = np.isposinf(x) if a["detect_positive"] else np.zeros(x.shape, bool)
    neg = np.isneginf(x) if a["detect_negative"] else np.zeros(x.shape, bool)
    return pos | neg


defop(
    "IsInf",
    FAMILY,
    infer=_bool_out,
    reference=_isinf,
    attrs={"detect_negative": 1, "detect_positive": 1},
    flops=elementwise_flops(1),
    sbp=ew_sbp(),
    **codegen("IsInf"),
)


def _where_infer(ctx: InferCtx) -> list[TensorType]:
    if ctx.dtype(0) != DType.BOOL:
        raise ctx.fail(f"condition must be bool, got {ctx.dtype(0)}")
    if ctx.dtype(1) != ctx.dtype(2):
        raise ctx.fail(f"branches have different element types: {ctx.dtype(1)} and {ctx.dtype(2)}")
    return [
        TensorType(broadcast_shapes(ctx, ctx.shape(0), ctx.shape(1), ctx.shape(2)), ctx.dtype(1))
    ]


def _where_vjp(
    b: GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    g, (c, x, y) = gouts[0], node.inputs[:3]
    if g is None or c is None or x is None or y is None:
        return [None, None, None]
    zero = scalar(b, 0.0, g)
    return [
        None,
        grad.unbroadcast(b, op1(b, "Where", c, g, zero), x.type.shape) if need[1] else None,
        grad.unbroadcast(b, op1(b, "Where", c, zero, g), y.type.shape) if need[2] else None,
    ]


defop(
    "Where",
    FAMILY,
    infer=_where_infer,
    reference=lambda xs, a: np.where(xs[0], xs[1], xs[2]),  # type: ignore[arg-type]
    inputs=3,
    flops=elementwise_flops(1),
    sbp=ew_sbp(),
    vjp=_where_vjp,
    **codegen("Where"),
)


# -- Clip ---------------------------------------------------------------------------------------


def _clip_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = xs[0]
    assert x is not None
    lo = xs[1] if len(xs) > 1 else None
    hi = xs[2] if len(xs) > 2 else None
    r = x
    if lo is not None:
        r = np.maximum(r, lo.astype(x.dtype))
    if hi is not None:
        r = np.minimum(r, hi.astype(x.dtype))
    return np.asarray(r, dtype=x.dtype)


def _clip_import(n: AdapterNode) -> None:
    if n.opset < 11:
        # Opsets 6..10 give the bounds as attributes; the default is the full float range.
        x = n.input(0)
        assert x is not None
        dt = x.type.dtype.np
        lo = n.attrs.pop("min", None)
        hi = n.attrs.pop("max", None)
        n.set_input(1, n.const("min", lo, dt) if lo is not None else None)
        n.set_input(2, n.const("max", hi, dt) if hi is not None else None)


def _clip_infer(ctx: InferCtx) -> list[TensorType]:
    for i in (1, 2):
        if ctx.has(i) and ctx.shape(i) not in ((), (1,)):
            raise ctx.fail(f"bound {i} must be a scalar, got shape {list(ctx.shape(i))}")
    return same_as_input(ctx)


defop(
    "Clip",
    FAMILY,
    infer=_clip_infer,
    reference=_clip_ref,
    inputs=(1, 3),
    flops=elementwise_flops(2),
    sbp=ew_sbp(),
    onnx_import=_clip_import,
    **codegen("Clip"),
)


def _clip_vjp(
    b: GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """The gradient goes to x where the output is x (within [min, max]), else to the bound
    the output equals (the one that clipped it), summed back to the bound's shape."""
    g, y = gouts[0], node.outputs[0]
    x = node.inputs[0]
    grads: list[Value | None] = [None] * len(node.inputs)
    if g is None or x is None:
        return grads
    zero = scalar(b, 0.0, g)
    # The output came from whichever input it equals; x first (a bound equal to x is x).
    from_x = op1(b, "Equal", y, x)
    if need[0]:
        grads[0] = _where(b, from_x, g, zero)
    for k in (1, 2):
        bound = node.inputs[k] if k < len(node.inputs) else None
        if bound is not None and need[k]:
            took = op1(b, "And", op1(b, "Not", from_x), op1(b, "Equal", y, bound))
            grads[k] = grad.unbroadcast(b, _where(b, took, g, zero), bound.type.shape)
    return grads


set_vjp("Clip", _clip_vjp)


def _variadic_vjp(kind: str) -> VjpFn:
    """Sum: the gradient to every operand; Mean: divided by their count; Max and Min: to the
    operand the result came from (the first of equal ones), each summed back to its shape."""

    def vjp(
        b: GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
    ) -> list[Value | None]:
        g, y = gouts[0], node.outputs[0]
        grads: list[Value | None] = [None] * len(node.inputs)
        if g is None:
            return grads
        if kind == "Mean":
            g = op1(b, "Div", g, scalar(b, float(len(node.inputs)), g))
        taken: Value | None = None  # Max/Min: an earlier operand already gave the result
        for k, x in enumerate(node.inputs):
            if x is None:
                continue
            gk = g
            if kind in ("Max", "Min"):
                mine = op1(b, "Equal", y, x)
                if taken is not None:
                    mine = op1(b, "And", mine, op1(b, "Not", taken))
                taken = mine if taken is None else op1(b, "Or", taken, mine)
                gk = _where(b, mine, g, scalar(b, 0.0, g))
            if need[k]:
                grads[k] = grad.unbroadcast(b, gk, x.type.shape)
        return grads

    return vjp


for _name in ("Sum", "Mean", "Max", "Min"):
    set_vjp(_name, _variadic_vjp(_name))


# -- Cast ---------------------------------------------------------------------------------------


_NARROW_INTS = {DType.I4: (-8, 7), DType.U4: (0, 15), DType.I2: (-2, 1), DType.U2: (0, 3)}


def _cast_to(x: np.ndarray, dt: DType, saturate: int = 1, round_mode: str = "up") -> np.ndarray:
    if dt == DType.BOOL:
        return x != 0
    if dt in _NARROW_INTS and DType.from_numpy(x.dtype).is_float:
        # Truncated; out of the type's range (NaN, infinities) 0, as ONNX's test data has it
        # (ml_dtypes' own astype wrapped before 0.7).
        lo, hi = _NARROW_INTS[dt]
        with np.errstate(invalid="ignore"):
            t = np.trunc(x.astype(np.float64))
            return np.where((t >= lo) & (t <= hi), t, 0).astype(np.int64).astype(dt.np)
    if DType.from_numpy(x.dtype).is_float and dt.is_int:
        # Out-of-range float->int is undefined in ONNX; flowc's rule, on both targets
        # (flowc::ew::cast): truncated toward zero, saturated to the type's range, NaN -> 0.
        info = np.iinfo(dt.np)
        t = np.trunc(x.astype(np.float64))
        with np.errstate(invalid="ignore"):
            fits = (t > float(info.min) - 1) & (t < float(info.max))
            out = np.where(fits, t, 0).astype(dt.np)
            out[t >= float(info.max)] = info.max
            out[t <= float(info.min)] = info.min
        return out
    with np.errstate(all="ignore"):
        if dt == DType.F8E8M0:
            return onnx.numpy_helper.to_float8e8m0(x.astype(np.float32), bool(saturate), round_mode)
        if saturate and dt.is_float and dt.itemsize == 1:
            # Saturating casts clip to the type's range, infinities included (ONNX's table).
            return onnx.numpy_helper.saturate_cast(x.astype(np.float32), dt.np)
        return x.astype(dt.np)


def _cast_infer(ctx: InferCtx) -> list[TensorType]:
    try:
        dt = DType.from_onnx(int(ctx.attr("to")))
    except (KeyError, ValueError) as e:
        raise ctx.fail(f"bad 'to' attribute: {e}") from None
    return [ctx.type(0).with_dtype(dt)]


def _cast_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    assert xs[0] is not None
    return _cast_to(xs[0], DType.from_onnx(int(a["to"])), a["saturate"], a["round_mode"])


def _castlike_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    assert xs[0] is not None and xs[1] is not None
    return _cast_to(xs[0], DType.from_numpy(xs[1].dtype), a["saturate"], a["round_mode"])


def _cast_vjp(
    b: GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    # Between float types the gradient is cast back; to or from an integer type none flows.
    g, x = gouts[0], node.inputs[0]
    if (
        g is None
        or x is None
        or not need[0]
        or not x.type.dtype.is_float
        or not g.type.dtype.is_float
    ):
        return [None] * len(node.inputs)
    back = g if g.type.dtype == x.type.dtype else op1(b, "Cast", g, to=x.type.dtype.onnx)
    return [back] + [None] * (len(node.inputs) - 1)


defop(
    "Cast",
    FAMILY,
    infer=_cast_infer,
    reference=_cast_ref,
    attrs={"saturate": 1, "round_mode": "up"},
    flops=elementwise_flops(1),
    sbp=_cast_sbp,
    vjp=_cast_vjp,
    **codegen("Cast"),
)
defop(
    "CastLike",
    FAMILY,
    infer=lambda ctx: [ctx.type(0).with_dtype(ctx.dtype(1))],
    reference=_castlike_ref,
    attrs={"saturate": 1, "round_mode": "up"},
    inputs=2,
    flops=elementwise_flops(1),
    sbp=_cast_sbp,
    onnx_import=_castlike_import,
    **codegen("CastLike"),
)


# -- FusedElementwise: a chain of the ops above, made by the fuse_elementwise pass -------------


def _program(a: Attrs) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = json.loads(a["program"])
    return steps


def _fused_infer(ctx: InferCtx) -> list[TensorType]:
    # Re-run every step's own inference, so the verifier checks the whole chain.
    results: list[TensorType] = []
    for k, step in enumerate(_program(ctx.attrs)):
        opdef = get_op(step["op"])
        types: list[TensorType | None] = []
        for arg in step["args"]:
            if arg is None:
                types.append(None)
            elif arg >= 0:
                types.append(ctx.type(arg))
            else:
                types.append(results[-arg - 1])
        sub = InferCtx(
            step["op"],
            f"{ctx.node_name}/{k}",
            types,
            [None] * len(types),
            Attrs(step["attrs"]).merged(opdef.attrs),
            1,
        )
        results.append(opdef.infer(sub)[0])
    return [results[-1]]


def _fused_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    results: list[np.ndarray] = []
    for step in _program(a):
        args = [None if g is None else (xs[g] if g >= 0 else results[-g - 1]) for g in step["args"]]
        out = get_op(step["op"]).evaluate(args, Attrs(step["attrs"]))[0]
        results.append(out.astype(DType.from_short(step["dtype"]).np, copy=False))
    return results[-1]


def _fused_flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    return sum(math.prod(s["shape"]) for s in _program(a))


# How a fused chain's steps pass partial sums: linear in the P operands (as the ops' own
# ``linear`` sets say), or not at all. A step is "lin" (linear in the chosen inputs), "const"
# (reads none of them) or neither.
_LINEAR_BOTH = frozenset({"Add", "Sub"})  # lin op lin -> lin; const op const -> const
_LINEAR_ONE = frozenset({"Mul"})  # lin * const, const * lin -> lin
_LINEAR_UNARY = frozenset({"Neg", "Identity"})


def _fused_linear(program: list[dict[str, Any]], chosen: set[int]) -> bool:
    """Whether the chain's result is linear in the inputs ``chosen`` jointly."""
    kinds: list[str] = []
    for step in program:
        args = [
            None if g is None else ("lin" if g in chosen else "const") if g >= 0 else kinds[-g - 1]
            for g in step["args"]
        ]
        present = [a for a in args if a is not None]
        op, is_float = step["op"], DType.from_short(step["dtype"]).is_float
        linear = (
            (op in _LINEAR_BOTH and all(a == "lin" for a in present))
            or (op in _LINEAR_ONE and sorted(present) == ["const", "lin"])
            or (op == "Div" and is_float and present == ["lin", "const"])
            or ((op in _LINEAR_UNARY or (op == "Cast" and is_float)) and present == ["lin"])
        )
        if all(a == "const" for a in present):
            kinds.append("const")
        else:
            kinds.append("lin" if linear else "other")
    return bool(kinds) and kinds[-1] == "lin"


def _fused_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    """The chain's splits, and partial sums through it where it is linear in them: every
    input (a gradient accumulation's sum of micro-batches' partial gradients stays a
    partial sum, reduced once), or one input (a gradient scaled by a whole factor)."""
    sigs = sr.broadcast_splits(ctx, outs)
    program = _program(ctx.attrs)
    present = [i for i in range(ctx.num_inputs) if ctx.has(i)]
    candidates = [present, *([i] for i in present)] if len(present) > 1 else [present]
    seen: set[tuple[int, ...]] = set()
    for chosen in candidates:
        key = tuple(chosen)
        if key in seen or not _fused_linear(program, set(chosen)):
            continue
        seen.add(key)
        sigs.append(sr.partial(ctx, outs, chosen))
    return sigs


def _fused_sizeless(a: Attrs) -> Attrs:
    """The chain without its steps' shapes (which only count FLOPs)."""
    steps = [{k: v for k, v in step.items() if k != "shape"} for step in _program(a)]
    return Attrs({**a, "program": json.dumps(steps, sort_keys=True)})


defop(
    "FusedElementwise",
    FAMILY,
    infer=_fused_infer,
    reference=_fused_ref,
    inputs=(1, 1 << 30),
    flops=_fused_flops,
    sbp=_fused_sbp,
    emit=emit_fused,
    sized=True,
    sizeless=_fused_sizeless,
)
