"""The optimizer updates of the ai.onnx.preview.training domain: Adagrad, Adam and Momentum.

Each node updates n tensors at once: inputs R (learning rate, scalar), T (update count, int64
scalar), then the n tensors X, their gradients G and their optimizer state (H; V and H; V),
each group of n in that order; outputs the new X for all n, then the new state. The rules
are element-wise, so the importer lowers every node to flowc's element-wise ops (the scalar
factors that depend on R and T are computed once and broadcast); no kernel of their own.

These ops live outside the default ONNX domain, so the registry holds them under their
qualified names (``ai.onnx.preview.training.Adam``) and the importer looks nodes of other
domains up that way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs
from flowc.ir.types import TensorType
from flowc.ops.common import NodeLowering, adapter_ctx, required_inputs
from flowc.ops.registry import (
    InferCtx,
    OnnxAdapter,
    RefFn,
    defop,
    elementwise_flops,
)

if TYPE_CHECKING:
    from flowc.ir.builder import AdapterNode
    from flowc.ir.graph import Value

FAMILY = "training"
DOMAIN = "ai.onnx.preview.training"
# Tensors one node may update: a bound for the registry's input count, far above real use.
MAX_TENSORS = 4096


@dataclass(frozen=True)
class _Rule:
    op: str
    per_tensor: int  # inputs per optimized tensor: X, G and the state tensors
    outputs_per_tensor: int  # X_new and the new state tensors
    floats: tuple[str, ...]  # float attributes


_RULES = {
    "Adagrad": _Rule("Adagrad", 3, 2, ("decay_factor", "epsilon", "norm_coefficient")),
    "Adam": _Rule(
        "Adam", 4, 3, ("alpha", "beta", "epsilon", "norm_coefficient", "norm_coefficient_post")
    ),
    "Momentum": _Rule("Momentum", 3, 2, ("alpha", "beta", "norm_coefficient")),
}


def _count(ctx: InferCtx, rule: _Rule) -> int:
    """Check a node's inputs and attributes; the number of tensors it updates."""
    rest = ctx.num_inputs - 2
    if rest < rule.per_tensor or rest % rule.per_tensor:
        raise ctx.fail(
            f"takes R, T and {rule.per_tensor} inputs per optimized tensor, got "
            f"{ctx.num_inputs} inputs"
        )
    n = rest // rule.per_tensor
    if ctx.num_outputs != rule.outputs_per_tensor * n:
        raise ctx.fail(
            f"updates {n} tensor(s), so it has {rule.outputs_per_tensor * n} outputs, got "
            f"{ctx.num_outputs}"
        )
    r, t = ctx.type(0), ctx.type(1)
    if r.dtype not in (DType.F32, DType.F64) or r.numel != 1 or r.rank > 1:
        raise ctx.fail(f"R (the learning rate) must be a float scalar, got {r}")
    if t.dtype != DType.I64 or t.numel != 1 or t.rank > 1:
        raise ctx.fail(f"T (the update count) must be an int64 scalar, got {t}")
    for j in range(n):
        x = ctx.type(2 + j)
        if x.dtype not in (DType.F32, DType.F64):
            raise ctx.fail(f"optimized tensor {j} must be float32 or float64, got {x.dtype}")
        for m in range(1, rule.per_tensor):
            other = ctx.type(2 + m * n + j)
            if other != x:
                raise ctx.fail(
                    f"input {2 + m * n + j} is {other}; it belongs to optimized tensor {j}, "
                    f"which is {x}"
                )
    for name in rule.floats:
        v = ctx.attrs.get(name)
        if v is None:
            raise ctx.fail(f"attribute {name} is required")
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise ctx.fail(f"attribute {name} must be a number, got {v!r}")
    if rule.op == "Momentum" and ctx.attrs.get("mode") not in ("standard", "nesterov"):
        raise ctx.fail(f"mode must be 'standard' or 'nesterov', got {ctx.attrs.get('mode')!r}")
    return n


def _infer(rule: _Rule) -> Callable[[InferCtx], list[TensorType]]:
    def infer(ctx: InferCtx) -> list[TensorType]:
        n = _count(ctx, rule)
        xs = [ctx.type(2 + j) for j in range(n)]
        return xs * rule.outputs_per_tensor

    return infer


# -- the update rules in NumPy ----------------------------------------------------------------


def _groups(xs: Sequence[np.ndarray | None], per: int) -> list[list[np.ndarray]]:
    arrays = [np.asarray(a) for a in xs[2:] if a is not None]
    n = len(arrays) // per
    return [[arrays[m * n + j] for m in range(per)] for j in range(n)]


def _scalars(xs: Sequence[np.ndarray | None]) -> tuple[float, int]:
    r, t = xs[0], xs[1]
    assert r is not None and t is not None
    return float(np.asarray(r).reshape(-1)[0]), int(np.asarray(t).reshape(-1)[0])


def _regularized(x: np.ndarray, g: np.ndarray, a: Attrs) -> np.ndarray:
    return float(a["norm_coefficient"]) * x + g


def _adagrad_ref(xs: list[np.ndarray | None], a: Attrs) -> list[np.ndarray]:
    r, t = _scalars(xs)
    rate = r / (1.0 + t * float(a["decay_factor"]))
    new_x, new_h = [], []
    for x, g, h in _groups(xs, 3):
        x64 = x.astype(np.float64)
        gr = _regularized(x64, g.astype(np.float64), a)
        h2 = h.astype(np.float64) + gr * gr
        new_x.append((x64 - rate * gr / (np.sqrt(h2) + float(a["epsilon"]))).astype(x.dtype))
        new_h.append(h2.astype(h.dtype))
    return new_x + new_h


def _adam_ref(xs: list[np.ndarray | None], a: Attrs) -> list[np.ndarray]:
    r, t = _scalars(xs)
    alpha, beta = float(a["alpha"]), float(a["beta"])
    rate = r * np.sqrt(1.0 - beta**t) / (1.0 - alpha**t) if t > 0 else r
    new_x, new_v, new_h = [], [], []
    for x, g, v, h in _groups(xs, 4):
        x64 = x.astype(np.float64)
        gr = _regularized(x64, g.astype(np.float64), a)
        v2 = alpha * v.astype(np.float64) + (1.0 - alpha) * gr
        h2 = beta * h.astype(np.float64) + (1.0 - beta) * gr * gr
        x2 = x64 - rate * (v2 / (np.sqrt(h2) + float(a["epsilon"])))
        new_x.append(((1.0 - float(a["norm_coefficient_post"])) * x2).astype(x.dtype))
        new_v.append(v2.astype(v.dtype))
        new_h.append(h2.astype(h.dtype))
    return new_x + new_v + new_h


def _momentum_ref(xs: list[np.ndarray | None], a: Attrs) -> list[np.ndarray]:
    r, t = _scalars(xs)
    alpha = float(a["alpha"])
    beta = float(a["beta"]) if t > 0 else 1.0
    new_x, new_v = [], []
    for x, g, v in _groups(xs, 3):
        x64 = x.astype(np.float64)
        gr = _regularized(x64, g.astype(np.float64), a)
        v2 = alpha * v.astype(np.float64) + beta * gr
        step = gr + alpha * v2 if a["mode"] == "nesterov" else v2
        new_x.append((x64 - r * step).astype(x.dtype))
        new_v.append(v2.astype(v.dtype))
    return new_x + new_v


# -- lowering to element-wise ops -------------------------------------------------------------


class _Lowering(NodeLowering):
    """Emits one node's update as element-wise ops in the optimized tensors' type."""

    def __init__(self, n: AdapterNode, dtype: DType) -> None:
        super().__init__(n, dtype)
        r, t = n.inputs[0], n.inputs[1]
        assert r is not None and t is not None
        count = self.scalar(t, "T")
        self.r = self.cast(self.scalar(r, "R"), "R")
        self.t = self.cast(count, "T")
        # T > 0: Adam's bias correction and Momentum's beta apply from the second update.
        self.started = self.op(
            "Greater", count, self.n.const("zero_count", 0, np.int64), suffix="started"
        )

    def scalar(self, v: Value, what: str) -> Value:
        """R or T as a rank-0 tensor (a one-element vector would broadcast a scalar X up)."""
        if v.type.rank == 0:
            return v
        shape = self.n.const(f"{what}_scalar_shape", np.zeros(0, np.int64))
        return self.n.emit("Reshape", [v, shape], suffix=f"{what}_scalar")[0]

    def const(self, value: float, what: str) -> Value:
        return self.n.const(what, value, self.dtype.np)

    def cast(self, v: Value, what: str) -> Value:
        if v.type.dtype == self.dtype:
            return v
        return self.n.emit("Cast", [v], {"to": self.dtype.onnx}, suffix=f"{what}_{self.dtype}")[0]

    def op(self, op: str, *ins: Value, suffix: str = "", out: str | None = None) -> Value:
        step = self.next_step()  # counted even when a suffix is given
        names = [out] if out else None
        (v,) = self.n.emit(op, list(ins), suffix=suffix or f"step{step}", output_names=names)
        return v

    def scale(self, c: float, v: Value, what: str) -> Value:
        """c * v, with no node for c == 1."""
        return v if c == 1.0 else self.op("Mul", self.const(c, what), v)

    def regularized(self, x: Value, g: Value, norm: float) -> Value:
        """norm_coefficient * X + G (just G when the coefficient is 0)."""
        return g if norm == 0.0 else self.op("Add", self.scale(norm, x, "norm_coefficient"), g)

    def when_started(self, then: Value, otherwise: Value, what: str) -> Value:
        return self.op("Where", self.started, then, otherwise, suffix=what)


def _name(n: AdapterNode, k: int) -> str | None:
    return n.output_names[k] if k < len(n.output_names) and n.output_names[k] else None


def _prepare(n: AdapterNode, rule: _Rule) -> tuple[_Lowering, list[list[Value]], Attrs]:
    ctx = adapter_ctx(n, len(n.output_names), op=rule.op, registered=f"{DOMAIN}.{rule.op}")
    count = _count(ctx, rule)
    ins = required_inputs(n, 2, rule.op)
    groups = [[ins[m * count + j] for m in range(rule.per_tensor)] for j in range(count)]
    low = _Lowering(n, groups[0][0].type.dtype)
    return low, groups, ctx.attrs


def _adagrad_import(n: AdapterNode) -> list[Value]:
    rule = _RULES["Adagrad"]
    low, groups, a = _prepare(n, rule)
    count = len(groups)
    # r = R / (1 + T * decay_factor)
    decay = low.scale(float(a["decay_factor"]), low.t, "decay_factor")
    rate = low.op("Div", low.r, low.op("Add", low.const(1.0, "one"), decay), suffix="rate")
    eps = low.const(float(a["epsilon"]), "epsilon")
    new_x, new_h = [], []
    for j, (x, g, h) in enumerate(groups):
        gr = low.regularized(x, g, float(a["norm_coefficient"]))
        h2 = low.op("Add", h, low.op("Mul", gr, gr), out=_name(n, count + j))
        denom = low.op("Add", low.op("Sqrt", h2), eps)
        step = low.op("Div", low.op("Mul", rate, gr), denom)
        new_x.append(low.op("Sub", x, step, out=_name(n, j)))
        new_h.append(h2)
    return new_x + new_h


def _adam_import(n: AdapterNode) -> list[Value]:
    rule = _RULES["Adam"]
    low, groups, a = _prepare(n, rule)
    count = len(groups)
    alpha, beta = float(a["alpha"]), float(a["beta"])
    one = low.const(1.0, "one")
    # R * sqrt(1 - beta^T) / (1 - alpha^T) once T > 0, else R; both factors are 1 before,
    # so T = 0 never divides by zero.
    alpha_t = low.op("Pow", low.const(alpha, "alpha"), low.t)
    beta_t = low.op("Pow", low.const(beta, "beta"), low.t)
    num = low.when_started(low.op("Sqrt", low.op("Sub", one, beta_t)), one, "bias_h")
    den = low.when_started(low.op("Sub", one, alpha_t), one, "bias_v")
    rate = low.op("Div", low.op("Mul", low.r, num), den, suffix="rate")
    eps = low.const(float(a["epsilon"]), "epsilon")
    post = 1.0 - float(a["norm_coefficient_post"])
    new_x, new_v, new_h = [], [], []
    for j, (x, g, v, h) in enumerate(groups):
        gr = low.regularized(x, g, float(a["norm_coefficient"]))
        v2 = low.op(
            "Add",
            low.scale(alpha, v, "alpha"),
            low.scale(1.0 - alpha, gr, "one_minus_alpha"),
            out=_name(n, count + j),
        )
        h2 = low.op(
            "Add",
            low.scale(beta, h, "beta"),
            low.scale(1.0 - beta, low.op("Mul", gr, gr), "one_minus_beta"),
            out=_name(n, 2 * count + j),
        )
        denom = low.op("Add", low.op("Sqrt", h2), eps)
        step = low.op("Mul", rate, low.op("Div", v2, denom))
        if post == 1.0:
            x2 = low.op("Sub", x, step, out=_name(n, j))
        else:
            x2 = low.op("Mul", low.const(post, "post"), low.op("Sub", x, step), out=_name(n, j))
        new_x.append(x2)
        new_v.append(v2)
        new_h.append(h2)
    return new_x + new_v + new_h


def _momentum_import(n: AdapterNode) -> list[Value]:
    rule = _RULES["Momentum"]
    low, groups, a = _prepare(n, rule)
    count = len(groups)
    alpha = float(a["alpha"])
    beta = low.when_started(low.const(float(a["beta"]), "beta"), low.const(1.0, "one"), "beta")
    nesterov = a["mode"] == "nesterov"
    new_x, new_v = [], []
    for j, (x, g, v) in enumerate(groups):
        gr = low.regularized(x, g, float(a["norm_coefficient"]))
        v2 = low.op(
            "Add", low.scale(alpha, v, "alpha"), low.op("Mul", beta, gr), out=_name(n, count + j)
        )
        direction = low.op("Add", gr, low.scale(alpha, v2, "alpha")) if nesterov else v2
        new_x.append(low.op("Sub", x, low.op("Mul", low.r, direction), out=_name(n, j)))
        new_v.append(v2)
    return new_x + new_v


def _register(
    rule: _Rule, reference: RefFn, onnx_import: OnnxAdapter, attrs: dict[str, object]
) -> None:
    defop(
        f"{DOMAIN}.{rule.op}",
        FAMILY,
        infer=_infer(rule),
        reference=reference,
        attrs=attrs,
        inputs=(2 + rule.per_tensor, 2 + rule.per_tensor * MAX_TENSORS),
        outputs=(rule.outputs_per_tensor, rule.outputs_per_tensor * MAX_TENSORS),
        flops=elementwise_flops(8),
        onnx_import=onnx_import,
        dsl_name=rule.op.lower(),
    )


_register(
    _RULES["Adagrad"],
    _adagrad_ref,
    _adagrad_import,
    {"decay_factor": 0.0, "epsilon": 1e-6, "norm_coefficient": 0.0},
)
_register(
    _RULES["Adam"],
    _adam_ref,
    _adam_import,
    {
        "alpha": 0.9,
        "beta": 0.999,
        "epsilon": 1e-6,
        "norm_coefficient": 0.0,
        "norm_coefficient_post": 0.0,
    },
)
_register(
    _RULES["Momentum"],
    _momentum_ref,
    _momentum_import,
    {"alpha": None, "beta": None, "mode": None, "norm_coefficient": None},
)
