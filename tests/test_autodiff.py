"""Reverse-mode autodiff (flowc/autodiff, the VJP rules in the op registry): every rule against
float64 central finite differences of the op's own NumPy reference, over its attributes; and
the backward graph of a small network compiled for the host against the float64 evaluation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flowc.autodiff import GradientError, gradients
from flowc.interpreter import evaluate
from flowc.ir.builder import GraphBuilder
from flowc.ir.dtype import DType
from flowc.ir.graph import Graph, Value
from flowc.ir.types import TensorType
from flowc.ops.registry import get_op

EPS = 1e-6


def _graph_of(
    op: str,
    inputs: Sequence[np.ndarray | None],
    attrs: dict[str, Any],
    trained: Sequence[int],
    consts: dict[int, np.ndarray],
    num_outputs: int,
) -> tuple[Graph, list[Value], list[Value]]:
    g = Graph("t")
    b = GraphBuilder(g, fold=False)
    vals: list[Value | None] = []
    ins: list[Value] = []
    for k, a in enumerate(inputs):
        if a is None:  # an optional input left out
            vals.append(None)
        elif k in consts:
            vals.append(b.constant(f"c{k}", consts[k]))
        else:
            v = g.add_input(f"x{k}", TensorType(a.shape, DType.from_numpy(a.dtype)))
            vals.append(v)
            ins.append(v)
    outs = b.emit(op, vals, attrs, name="n", num_outputs=num_outputs)
    return g, ins, outs


def check_vjp(
    op: str,
    inputs: Sequence[np.ndarray | None],
    attrs: dict[str, Any] | None = None,
    *,
    consts: dict[int, np.ndarray] | None = None,
    num_outputs: int = 1,
    seed: int = 0,
    rtol: float = 1e-5,
) -> None:
    """loss = sum_k sum(out_k * w_k) with random w: flowc's gradient of every non-constant
    float input against central differences of the op's reference, all in float64."""
    attrs = attrs or {}
    consts = consts or {}
    rng = np.random.default_rng(seed)
    g, ins, outs = _graph_of(op, inputs, attrs, [], consts, num_outputs)
    float_outs = [o for o in outs if o.type.dtype.is_float]
    weights = [rng.standard_normal(o.type.shape) for o in float_outs]
    b = GraphBuilder(g, fold=False)
    total: Value | None = None
    for o, w in zip(float_outs, weights, strict=True):
        prod = b.emit("Mul", [o, b.constant("w", w)])[0]
        s = b.emit("ReduceSum", [prod], {"keepdims": 0})[0]
        total = s if total is None else b.emit("Add", [total, s])[0]
    assert total is not None
    trained = [v for v in ins if v.type.dtype.is_float]
    grads = gradients(g, total, trained)
    g.outputs = [total, *(grads[v] for v in trained if grads[v] is not None)]
    feeds = {f"x{k}": a for k, a in enumerate(inputs) if k not in consts and a is not None}
    got = evaluate(g, feeds)
    opdef = get_op(op)
    merged = g.nodes[0].attrs

    def loss(arrays: list[np.ndarray | None]) -> float:
        full = [consts.get(k, arrays[k]) for k in range(len(arrays))]
        res = opdef.evaluate(list(full), merged)[: len(outs)]
        fl = [r for r in res if r.dtype.kind == "f"]
        return float(sum(np.sum(r * w) for r, w in zip(fl, weights, strict=True)))

    base = [None if a is None else np.array(a, copy=True) for a in inputs]
    for v in trained:
        k = int(v.name[1:])
        grad_v = grads[v]
        assert grad_v is not None, f"no gradient for input {k} of {op}"
        flowc_grad = got[grad_v.name]
        at = base[k]
        assert at is not None
        numeric = np.zeros_like(at)
        it = np.nditer(at, flags=["multi_index"])
        for _ in it:
            idx = it.multi_index
            plus = [None if a is None else a.copy() for a in base]
            minus = [None if a is None else a.copy() for a in base]
            plus[k][idx] += EPS  # type: ignore[index]
            minus[k][idx] -= EPS  # type: ignore[index]
            numeric[idx] = (loss(plus) - loss(minus)) / (2 * EPS)
        scale = max(1.0, float(np.max(np.abs(numeric))))
        err = float(np.max(np.abs(flowc_grad - numeric))) / scale if numeric.size else 0.0
        assert err < rtol, f"{op} {attrs} input {k}: error {err:.2e}"


def host_matches_float64(
    g32: Graph, g64: Graph, feeds: dict[str, np.ndarray], out: Path, tol: float = 1e-4
) -> None:
    """A backward compiled for the host (``g32``, float32) against the NumPy evaluation of
    the same graph in float64 (``g64``): every output within ``tol`` relative error."""
    from flowc.compiler import compile_graph
    from flowc.harness.build import build, run
    from flowc.harness.compare import max_rel_error

    want = evaluate(g64, feeds)
    compile_graph(g32, out, poison=True)
    build(out, "host", quick=True)
    got, _ = run(out, {k: v.astype(np.float32) for k, v in feeds.items()}, target="host")
    for o32, o64 in zip(g32.outputs, g64.outputs, strict=True):
        assert max_rel_error(got[o32.name], want[o64.name]) < tol, o32.name


R = np.random.default_rng(42)


def r(*shape: int, positive: bool = False, away: float = 0.0) -> np.ndarray:
    a = R.standard_normal(shape)
    if positive:
        a = np.abs(a) + 0.5
    if away:  # keep clear of a kink (Relu at 0, Abs at 0)
        a = np.where(np.abs(a) < away, a + np.sign(a + 1e-12) * away, a)
    return a


UNARY: list[tuple[str, dict[str, Any], Callable[[], np.ndarray]]] = [
    ("Neg", {}, lambda: r(3, 4)),
    ("Abs", {}, lambda: r(3, 4, away=0.1)),
    ("Sqrt", {}, lambda: r(3, 4, positive=True)),
    ("Reciprocal", {}, lambda: r(3, 4, positive=True)),
    ("Exp", {}, lambda: r(3, 4)),
    ("Log", {}, lambda: r(3, 4, positive=True)),
    ("Erf", {}, lambda: r(3, 4)),
    ("Tanh", {}, lambda: r(3, 4)),
    ("Sigmoid", {}, lambda: r(3, 4)),
    ("Relu", {}, lambda: r(3, 4, away=0.1)),
    ("LeakyRelu", {"alpha": 0.2}, lambda: r(3, 4, away=0.1)),
    ("Gelu", {"approximate": "none"}, lambda: r(3, 4)),
    ("Gelu", {"approximate": "tanh"}, lambda: r(3, 4)),
    ("Softplus", {}, lambda: r(3, 4)),
    ("Sin", {}, lambda: r(3, 4)),
    ("Cos", {}, lambda: r(3, 4)),
    ("Elu", {"alpha": 0.7}, lambda: r(3, 4, away=0.1)),
    ("Selu", {}, lambda: r(3, 4, away=0.1)),
    ("Celu", {"alpha": 1.5}, lambda: r(3, 4, away=0.1)),
    ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}, lambda: r(3, 4) * 2),
    ("HardSwish", {}, lambda: r(4, 5) * 3),
    ("Softsign", {}, lambda: r(3, 4, away=0.1)),
    ("Mish", {}, lambda: r(3, 4)),
    ("ThresholdedRelu", {"alpha": 0.5}, lambda: r(3, 4) + 0.03),
    ("Tan", {}, lambda: r(3, 4) * 0.5),
    ("Asin", {}, lambda: np.tanh(r(3, 4)) * 0.9),
    ("Acos", {}, lambda: np.tanh(r(3, 4)) * 0.9),
    ("Atan", {}, lambda: r(3, 4)),
    ("Sinh", {}, lambda: r(3, 4)),
    ("Cosh", {}, lambda: r(3, 4)),
    ("Asinh", {}, lambda: r(3, 4)),
    ("Acosh", {}, lambda: r(3, 4, positive=True) + 1.0),
    ("Atanh", {}, lambda: np.tanh(r(3, 4)) * 0.9),
]


@pytest.mark.parametrize(
    ("op", "attrs", "make"), UNARY, ids=lambda p: str(p) if isinstance(p, str) else ""
)
def test_unary_vjp(op: str, attrs: dict[str, Any], make: Callable[[], np.ndarray]) -> None:
    check_vjp(op, [make()], attrs)


BROADCASTS = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 1), (1, 4)), ((1,), (2, 3)), ((), (3,))]


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow"])
@pytest.mark.parametrize(("sa", "sb"), BROADCASTS)
def test_binary_vjp_sums_broadcast_axes(op: str, sa: tuple[int, ...], sb: tuple[int, ...]) -> None:
    a = r(*sa, positive=op == "Pow")
    b_ = r(*sb, positive=op in ("Div",)) if op != "Pow" else r(*sb)
    check_vjp(op, [np.asarray(a), np.asarray(b_)])


@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
def test_variadic_vjp(op: str) -> None:
    check_vjp(op, [r(3, 4), r(4), r(3, 1)])


@pytest.mark.parametrize("bounds", ["both", "min", "arrays"])
def test_clip_vjp_sends_the_gradient_to_what_the_output_came_from(bounds: str) -> None:
    x = r(3, 4, away=0.05)
    if bounds == "arrays":
        # Bounds as inputs of their own: each gets the gradient where it clipped.
        lo, hi = np.full((), -0.5) + 0.013, np.full((), 0.6) + 0.017
        check_vjp("Clip", [x, lo, hi])
    elif bounds == "min":
        check_vjp("Clip", [x, np.asarray(-0.3)], consts={1: np.asarray(-0.3)})
    else:
        check_vjp(
            "Clip", [x, np.asarray(-0.4), np.asarray(0.5)],
            consts={1: np.asarray(-0.4), 2: np.asarray(0.5)},
        )  # fmt: skip


@pytest.mark.parametrize("op", ["Floor", "Sign"])
def test_piecewise_constant_ops_pass_no_gradient(op: str) -> None:
    g = Graph("t")
    b = GraphBuilder(g, fold=False)
    x = g.add_input("x", TensorType((3,), DType.F64))
    y = b.emit("Add", [b.emit(op, [x])[0], x])[0]
    loss = b.emit("ReduceSum", [y], {"keepdims": 0})[0]
    grads = gradients(g, loss, [x])
    g.outputs = [grads[x]]  # type: ignore[list-item]
    got = evaluate(g, {"x": np.asarray([0.3, -1.7, 2.2])})
    np.testing.assert_array_equal(got[g.outputs[0].name], np.ones(3))  # only the Add's


def test_where_passes_the_gradient_to_the_chosen_branch() -> None:
    cond = R.standard_normal((3, 4)) > 0
    check_vjp("Where", [cond, r(3, 4), r(4)])


def test_cast_between_floats_carries_the_gradient_back() -> None:
    check_vjp("Cast", [r(3, 4)], {"to": DType.F64.onnx})


@pytest.mark.parametrize(
    ("sa", "sb"),
    [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)), ((4,), (4, 5)),
     ((3, 4), (4,)), ((4,), (4,)), ((2, 1, 3, 4), (5, 4, 2))],
)  # fmt: skip
def test_matmul_vjp(sa: tuple[int, ...], sb: tuple[int, ...]) -> None:
    check_vjp("MatMul", [r(*sa), r(*sb)])


@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("c_shape", [None, (5,), (3, 1), (3, 5)])
def test_gemm_vjp(trans_a: int, trans_b: int, c_shape: tuple[int, ...] | None) -> None:
    a = r(4, 3) if trans_a else r(3, 4)
    b_ = r(5, 4) if trans_b else r(4, 5)
    ins = [a, b_] + ([r(*c_shape)] if c_shape else [])
    check_vjp("Gemm", ins, {"transA": trans_a, "transB": trans_b, "alpha": 0.7, "beta": 1.3})


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceSumSquare"])
@pytest.mark.parametrize(("axes", "keepdims"), [([1], 1), ([0, 2], 0), ([-1], 0), ([], 1)])
def test_reduction_vjp(op: str, axes: list[int], keepdims: int) -> None:
    x = r(2, 3, 4)
    check_vjp(op, [x, np.asarray(axes, np.int64)], {"keepdims": keepdims},
              consts={1: np.asarray(axes, np.int64)})  # fmt: skip


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_vjp(op: str, axis: int) -> None:
    check_vjp(op, [r(2, 3, 4)], {"axis": axis})


@pytest.mark.parametrize("axis", [-1, 1])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_vjp(axis: int, bias: bool) -> None:
    x = r(2, 3, 4)
    normalized = x.shape[axis % 3 :]
    ins = [x, r(*normalized)] + ([r(*normalized)] if bias else [])
    check_vjp("LayerNormalization", ins, {"axis": axis, "epsilon": 1e-5}, rtol=2e-5)


def test_shape_ops_vjp() -> None:
    x = r(2, 3, 4)
    check_vjp("Transpose", [x], {"perm": [2, 0, 1]})
    check_vjp("Transpose", [x])
    shape = np.asarray([4, 6], np.int64)
    check_vjp("Reshape", [x, shape], consts={1: shape})
    axes = np.asarray([0, 3], np.int64)
    check_vjp("Unsqueeze", [x, axes], consts={1: axes})
    one = r(2, 1, 4)
    ax1 = np.asarray([1], np.int64)
    check_vjp("Squeeze", [one, ax1], consts={1: ax1})
    check_vjp("Flatten", [x], {"axis": 2})
    check_vjp("Identity", [x])
    target = np.asarray([3, 2, 3, 4], np.int64)
    check_vjp("Expand", [r(2, 1, 4), target], consts={1: target})


def test_concat_split_slice_vjp() -> None:
    check_vjp("Concat", [r(2, 3), r(2, 1), r(2, 4)], {"axis": 1})
    sizes = np.asarray([1, 3], np.int64)
    check_vjp("Split", [r(4, 3), sizes], {"axis": 0}, consts={1: sizes}, num_outputs=2)
    starts, ends = np.asarray([1, -3], np.int64), np.asarray([3, 100], np.int64)
    axes = np.asarray([0, 2], np.int64)
    check_vjp("Slice", [r(4, 3, 5), starts, ends, axes],
              consts={1: starts, 2: ends, 3: axes})  # fmt: skip


@pytest.mark.parametrize(
    ("starts", "ends", "axes", "steps"),
    [([0], [7], [1], [2]), ([1, 6], [100, 0], [0, 1], [3, -2]), ([-1], [-100], [2], [-1]),
     ([2, 0], [9, 4], [1, 2], [4, 5]), ([0, -2], [5, -9], [0, 1], [1, -3])],
)  # fmt: skip
def test_strided_slice_vjp(
    starts: list[int], ends: list[int], axes: list[int], steps: list[int]
) -> None:
    ins = [np.asarray(v, np.int64) for v in (starts, ends, axes, steps)]
    check_vjp("Slice", [r(5, 9, 4), *ins], consts={k + 1: a for k, a in enumerate(ins)})


def test_integer_paths_and_missing_rules() -> None:
    g = Graph("t")
    b = GraphBuilder(g, fold=False)
    x = g.add_input("x", TensorType((3, 4), DType.F32))
    # ArgMax's output is an integer: no gradient flows back through it, and no error.
    idx = b.emit("ArgMax", [x], {"axis": 1, "keepdims": 0})[0]
    f = b.emit("Cast", [idx], {"to": DType.F32.onnx})[0]
    s = b.emit("ReduceSum", [b.emit("Mul", [f, f])[0]], {"keepdims": 0})[0]
    assert gradients(g, s, [x]) == {x: None}
    # A float path through an op with no rule is an error naming it.
    h = b.emit("Hardmax", [x], name="the_hardmax")[0]
    t = b.emit("ReduceSum", [h], {"keepdims": 0})[0]
    with pytest.raises(GradientError, match=r"no gradient rule for Hardmax \(node 'the_hardmax'\)"):
        gradients(g, t, [x])
    with pytest.raises(GradientError, match="a loss of one element"):
        gradients(g, h, [x])


def test_shared_values_sum_their_gradients() -> None:
    # y = x * x + x: dy/dx = 2x + 1, with x used three times.
    g = Graph("t")
    b = GraphBuilder(g, fold=False)
    x = g.add_input("x", TensorType((5,), DType.F64))
    y = b.emit("Add", [b.emit("Mul", [x, x])[0], x])[0]
    s = b.emit("ReduceSum", [y], {"keepdims": 0})[0]
    gx = gradients(g, s, [x])[x]
    assert gx is not None
    g.outputs = [gx]
    xv = np.arange(5.0)
    np.testing.assert_allclose(evaluate(g, {"x": xv})[gx.name], 2 * xv + 1)


def _mlp_backward(dtype: DType) -> tuple[Graph, list[str]]:
    """A two-layer network with an embedding, a layer norm and a log-softmax loss (cross-entropy against
    a constant one-hot target), and the gradients of every parameter as outputs: the forward
    and backward graph, in ``dtype``."""
    rng = np.random.default_rng(7)
    g = Graph("mlp_grad")
    b = GraphBuilder(g, fold=False)

    def inp(name: str, *shape: int) -> Value:
        return g.add_input(name, TensorType(shape, dtype))

    x = inp("x", 6, 8)
    params = [
        inp("w1", 8, 16),
        inp("b1", 16),
        inp("gain", 16),
        inp("shift", 16),
        inp("w2", 16, 5),
        inp("emb", 4, 16),
    ]
    w1, b1, gain, shift, w2, emb = params
    h = b.emit("Add", [b.emit("MatMul", [x, w1])[0], b1])[0]
    # An embedding lookup with repeated rows: its gradient is a ScatterND (add).
    tokens = b.constant("tokens", np.asarray([3, 0, 3, 1, 3, 0], np.int64))
    h = b.emit("Add", [h, b.emit("Gather", [emb, tokens], {"axis": 0})[0]])[0]
    h = b.emit("Gelu", [h], {"approximate": "tanh"})[0]
    h = b.emit("LayerNormalization", [h, gain, shift], {"axis": -1, "epsilon": 1e-5})[0]
    logits = b.emit("Gemm", [h, w2], {"alpha": 1.0})[0]
    logp = b.emit("LogSoftmax", [logits], {"axis": -1})[0]
    target = np.eye(5)[rng.integers(0, 5, 6)].astype(dtype.np)
    picked = b.emit("Mul", [logp, b.constant("onehot", target)])[0]
    loss = b.emit("Neg", [b.emit("ReduceMean", [picked], {"keepdims": 0})[0]])[0]
    grads = gradients(g, loss, params)
    g.outputs = [loss, *(grads[p] for p in params)]  # type: ignore[list-item]
    return g, ["loss", *(p.name for p in params)]


def test_backward_kernels_compiled_for_the_host_match_float64(tmp_path: Path) -> None:
    from flowc.compiler import compile_graph
    from flowc.harness.build import build, run
    from flowc.harness.compare import max_rel_error

    g32, names = _mlp_backward(DType.F32)
    g64, _ = _mlp_backward(DType.F64)
    rng = np.random.default_rng(1)
    feeds64 = {v.name: rng.standard_normal(v.type.shape) * 0.5 for v in g64.inputs}
    want = evaluate(g64, feeds64)
    out = tmp_path / "out"
    compile_graph(g32, out, poison=True)
    build(out, "host", quick=True)
    got, _ = run(out, {k: v.astype(np.float32) for k, v in feeds64.items()}, target="host")
    for o32, o64, name in zip(g32.outputs, g64.outputs, names, strict=True):
        err = max_rel_error(got[o32.name], want[o64.name])
        assert err < 1e-4, f"{name}: {err:.2e}"


@pytest.mark.parametrize(
    ("shape", "axis", "indices"),
    [
        ((6, 3), 0, [[1, 4, 1], [0, -1, 1]]),  # an embedding table, rows repeated and from the end
        ((2, 5, 3), 1, [4, 0, 4, 2]),
        ((4, 3), 1, 2),  # a scalar index drops the axis
    ],
)
def test_gather_vjp_adds_repeated_rows(shape: tuple[int, ...], axis: int, indices: Any) -> None:
    idx = np.asarray(indices, np.int64)
    check_vjp("Gather", [r(*shape), idx], {"axis": axis}, consts={1: idx})


@pytest.mark.parametrize(
    ("attrs", "shape"),
    [({}, (6, 5)), ({"has_ignore": 1, "ignore_index": -1}, (2, 3, 7)),
     ({"label_smoothing": 0.1}, (4, 3)), ({"has_ignore": 1, "ignore_index": 2, "label_smoothing": 0.2}, (5, 4))],
)  # fmt: skip
def test_softmax_cross_entropy_vjp_and_its_lowering(
    attrs: dict[str, Any], shape: tuple[int, ...]
) -> None:
    """The fused loss: its gradient against finite differences of its reference; and the
    ops lower_ops turns it into against that reference (NumPy: log-softmax, picked)."""
    from flowc.passes.lower_ops import lower_ops

    labels = R.integers(0, shape[-1], shape[:-1])
    if attrs.get("has_ignore"):
        labels.flat[::3] = attrs["ignore_index"]
    x = r(*shape) * 3
    check_vjp("SoftmaxCrossEntropy", [x, labels], attrs, num_outputs=2)
    g = Graph("t")
    b = GraphBuilder(g, fold=False)
    xv = g.add_input("x", TensorType(shape, DType.F64))
    lv = g.add_input("labels", TensorType(shape[:-1], DType.I64))
    g.outputs = b.emit("SoftmaxCrossEntropy", [xv, lv], attrs, num_outputs=2)
    lower_ops(g)
    assert "SoftmaxCrossEntropy" not in g.op_counts()
    got = evaluate(g, {"x": x, "labels": labels})
    logp = x - x.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    eps = attrs.get("label_smoothing", 0.0)
    safe = np.where(labels < 0, 0, labels) if attrs.get("has_ignore") else labels
    want = -(1 - eps) * np.take_along_axis(logp, safe[..., None], -1)[..., 0]
    want -= eps * logp.mean(-1)
    if attrs.get("has_ignore"):
        want = np.where(labels == attrs["ignore_index"], 0.0, want)
    np.testing.assert_allclose(got[g.outputs[0].name], want, rtol=1e-12, atol=1e-12)
