"""Normalizations against onnxruntime: BatchNormalization (inference, every opset spelling),
LayerNormalization with its statistics outputs, InstanceNormalization, GroupNormalization
(opset 18 per-group and 21 per-channel affine), LRN, MeanVarianceNormalization and
LpNormalization."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import helper
from opcheck import Case, check_compiled, check_op, make_op_model

from flowc.errors import ShapeError
from flowc.frontend.onnx import import_model
from flowc.interpreter import evaluate
from flowc.ir.graph import Attrs
from flowc.ops.registry import get_op

rng = np.random.default_rng(5)


def rand(*shape: int, dtype: type = np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def positive(*shape: int) -> np.ndarray:
    return (rng.random(shape) + 0.5).astype(np.float32)


def bn_inputs(shape: tuple[int, ...], dtype: type = np.float32) -> list[np.ndarray]:
    c = shape[1]
    return [a.astype(dtype) for a in (rand(*shape), rand(c), rand(c), rand(c), positive(c))]


def flowc_outputs(
    op: str, inputs: list[np.ndarray], attrs: dict[str, Any], opset: int, num_outputs: int = 1
) -> dict[str, np.ndarray]:
    model, feeds = make_op_model(op, inputs, attrs, opset=opset, num_outputs=num_outputs)
    return evaluate(import_model(model), feeds)


# -- BatchNormalization ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 5), (2, 3, 4, 5), (1, 3, 2, 3, 4)])
@pytest.mark.parametrize("opset", [9, 14, 15, 21])
def test_batchnorm(shape: tuple[int, ...], opset: int) -> None:
    check_op("BatchNormalization", bn_inputs(shape), opset=opset)
    check_op(
        "BatchNormalization", bn_inputs(shape), {"epsilon": 1e-2, "momentum": 0.5}, opset=opset
    )


def test_batchnorm_large_mean_and_float64() -> None:
    x, s, b, _, v = bn_inputs((2, 3, 4, 5))
    mean = np.full(3, 100.0, np.float32)
    check_op("BatchNormalization", [x + 100, s, b, mean, v], opset=15, const_inputs=(1, 2, 3, 4))
    check_op("BatchNormalization", bn_inputs((2, 3, 4), np.float64), {"training_mode": 0}, opset=15)


@pytest.mark.parametrize(
    ("opset", "attrs"),
    [
        (7, {"spatial": 1}),
        (6, {"is_test": 1, "spatial": 1}),
        (1, {"is_test": 1, "consumed_inputs": [0, 0, 0, 1, 1]}),
    ],
)
def test_batchnorm_old_attributes_are_dropped(opset: int, attrs: dict[str, Any]) -> None:
    ins = bn_inputs((2, 3, 4, 5))
    ref = check_op("BatchNormalization", ins, opset=9)["out0"]
    # onnxruntime has no kernels for opsets 1 and 6; the result must equal opset 9's.
    model, feeds = make_op_model("BatchNormalization", ins, attrs, opset=opset)
    graph = import_model(model)
    (node,) = graph.nodes
    assert set(node.attrs) <= {"epsilon", "momentum"}
    np.testing.assert_allclose(evaluate(graph, feeds)["out0"], ref, rtol=1e-6, atol=1e-6)


def test_batchnorm_empty_extra_outputs_are_dropped() -> None:
    ins = bn_inputs((2, 3, 4))
    node = helper.make_node(
        "BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "", ""], name="bn", epsilon=1e-3
    )
    vis = [helper.make_tensor_value_info(n, 1, a.shape) for n, a in zip("xsbmv", ins, strict=True)]
    out = helper.make_tensor_value_info("y", 1, ins[0].shape)
    model = helper.make_model(
        helper.make_graph([node], "g", vis, [out]), opset_imports=[helper.make_opsetid("", 15)]
    )
    got = evaluate(import_model(model), dict(zip("xsbmv", ins, strict=True)))["y"]
    x, s, b, m, v = (a.astype(np.float64) for a in ins)
    want = (x - m[:, None]) / np.sqrt(v[:, None] + 1e-3) * s[:, None] + b[:, None]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 4), (2, 3, 4, 5)])
def test_batchnorm_training_mode(shape: tuple[int, ...]) -> None:
    # Batch statistics and the running-statistics update, as onnxruntime computes them
    # (onnxruntime insists on all three outputs in training mode).
    check_op(
        "BatchNormalization",
        bn_inputs(shape),
        {"training_mode": 1, "momentum": 0.7, "epsilon": 1e-3},
        opset=15,
        num_outputs=3,
        tol=1e-5,
    )


def test_batchnorm_training_mode_compiles(tmp_path) -> None:  # type: ignore[no-untyped-def]
    x = bn_inputs((2, 3, 4, 5))
    check_compiled(
        [Case("BatchNormalization", x, {"training_mode": 1}, num_outputs=3, tol=1e-5)],
        tmp_path,
        opset=15,
    )


def test_batchnorm_old_training_outputs_are_rejected() -> None:
    # Opsets before 14 name training outputs (saved mean/var, ...) without a training_mode.
    model, _ = make_op_model("BatchNormalization", bn_inputs((2, 3, 4)), opset=9, num_outputs=5)
    with pytest.raises(ShapeError, match="training-mode statistics"):
        import_model(model)


# -- LayerNormalization ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "axis"),
    [((2, 3, 4), -1), ((2, 3, 4), 1), ((2, 3, 4), 0), ((5,), 0), ((2, 3, 4, 5), -2)],
)
def test_layernorm(shape: tuple[int, ...], axis: int) -> None:
    norm = shape[axis % len(shape) :]
    got = check_op(
        "LayerNormalization",
        [rand(*shape), rand(*norm), rand(*norm)],
        {"axis": axis},
        opset=17,
        num_outputs=3,
    )
    stats = (*shape[: axis % len(shape)], *([1] * len(norm)))
    assert got["out1"].shape == stats and got["out2"].dtype == np.float32
    check_op(
        "LayerNormalization", [rand(*shape), rand(*norm)], {"axis": axis, "epsilon": 1e-3}, opset=17
    )
    check_op(
        "LayerNormalization",
        [rand(*shape), rand(norm[-1])],
        {"axis": axis},
        opset=17,
        num_outputs=2,
    )


def test_layernorm_default_axis_and_float16() -> None:
    f16 = np.float16
    got = check_op(
        "LayerNormalization",
        [rand(2, 3, 8, dtype=f16), rand(8, dtype=f16), rand(8, dtype=f16)],
        opset=17,
        num_outputs=3,
        tol=2e-3,
    )
    assert got["out0"].dtype == f16 and got["out1"].dtype == np.float32


# -- InstanceNormalization, GroupNormalization ----------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 3, 4, 5), (1, 2, 2, 3, 4)])
@pytest.mark.parametrize("opset", [6, 21])
def test_instancenorm(shape: tuple[int, ...], opset: int) -> None:
    c = shape[1]
    check_op("InstanceNormalization", [rand(*shape), rand(c), rand(c)], opset=opset)
    check_op(
        "InstanceNormalization",
        [rand(*shape) * 10, rand(c), rand(c)],
        {"epsilon": 0.1},
        opset=opset,
    )


GROUP_CASES = [((2, 6, 5), 3), ((2, 4, 3, 3), 2), ((1, 4, 2, 2, 2), 4), ((2, 4, 3), 1)]


@pytest.mark.parametrize(("shape", "groups"), GROUP_CASES)
def test_groupnorm(shape: tuple[int, ...], groups: int) -> None:
    c = shape[1]
    check_op(
        "GroupNormalization", [rand(*shape), rand(c), rand(c)], {"num_groups": groups}, opset=21
    )
    attrs = {"num_groups": groups, "epsilon": 0.01}
    check_op(
        "GroupNormalization",
        [rand(*shape), rand(groups), rand(groups)],
        attrs,
        opset=18,
        const_inputs=(1, 2),
    )


def test_groupnorm_opset18_runtime_scale() -> None:
    # A scale known only at run time is expanded to channels by a Gather node.
    attrs = {"num_groups": 2}
    check_op("GroupNormalization", [rand(2, 4, 3, 3), rand(2), rand(2)], attrs, opset=18)


# -- LRN, MeanVarianceNormalization ---------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 3, 5])
@pytest.mark.parametrize("opset", [1, 13])
def test_lrn(size: int, opset: int) -> None:
    check_op("LRN", [rand(2, 7, 4, 5)], {"size": size}, opset=opset)
    check_op(
        "LRN",
        [rand(2, 7, 4, 5)],
        {"size": size, "alpha": 0.01, "beta": 0.5, "bias": 2.0},
        opset=opset,
    )


@pytest.mark.parametrize(("shape", "size"), [((1, 5, 3), 2), ((1, 6, 2, 2, 2), 4), ((2, 4, 3), 3)])
def test_lrn_even_size_and_other_ranks(shape: tuple[int, ...], size: int) -> None:
    # onnxruntime only runs 4-D inputs with odd sizes; check the ONNX formula directly.
    x = rand(*shape)
    a = Attrs({"size": size, "alpha": 0.3, "beta": 0.6, "bias": 1.5})
    got = get_op("LRN").evaluate([x], a.merged(get_op("LRN").attrs))[0]
    want = np.empty_like(x)
    c = shape[1]
    for ch in range(c):
        lo, hi = max(0, ch - (size - 1) // 2), min(c - 1, ch + (size - 1) - (size - 1) // 2)
        square_sum = (x[:, lo : hi + 1].astype(np.float64) ** 2).sum(axis=1)
        want[:, ch] = x[:, ch] / (1.5 + 0.3 / size * square_sum) ** 0.6
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize(
    ("shape", "axes"),
    [((2, 3, 4, 5), None), ((2, 3, 4, 5), [1]), ((2, 3, 4, 5), [-1, -2]), ((3, 4), [0])],
)
@pytest.mark.parametrize("opset", [9, 13])
def test_mvn(shape: tuple[int, ...], axes: list[int] | None, opset: int) -> None:
    check_op(
        "MeanVarianceNormalization",
        [rand(*shape)],
        {} if axes is None else {"axes": axes},
        opset=opset,
    )


# -- LpNormalization -----------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize(("shape", "axis"), [((5,), 0), ((3, 4), 0), ((3, 4), -1), ((2, 3, 4), 1)])
@pytest.mark.parametrize("opset", [1, 22])
def test_lp_normalization(p: int, shape: tuple[int, ...], axis: int, opset: int) -> None:
    x = rand(*shape)
    got = check_op("LpNormalization", [x], {"p": p, "axis": axis}, opset=opset)["out0"]
    norms = np.linalg.norm(got.astype(np.float64), ord=p, axis=axis)
    np.testing.assert_allclose(norms, 1.0, rtol=1e-5)


def test_lp_normalization_defaults_zeros_and_float64() -> None:
    x = rand(3, 4)
    x[1] = 0.0  # a zero norm gives zeros, not NaN
    got = check_op("LpNormalization", [x], {}, opset=22)["out0"]
    np.testing.assert_array_equal(got[1], 0.0)
    got = check_op("LpNormalization", [rand(4, 5, dtype=np.float64)], {"p": 1}, opset=22)
    assert got["out0"].dtype == np.float64


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "inputs", "attrs", "opset", "message"),
    [
        (
            "BatchNormalization",
            [rand(2, 3, 4), rand(4), rand(3), rand(3), positive(3)],
            {},
            15,
            "scale must have shape",
        ),
        (
            "BatchNormalization",
            [rand(3), rand(3), rand(3), rand(3), positive(3)],
            {},
            15,
            "input must be N x C",
        ),
        ("LayerNormalization", [rand(2, 3), rand(3)], {"axis": 2}, 17, "axis 2 is out of range"),
        (
            "LayerNormalization",
            [rand(2, 3), rand(4)],
            {},
            17,
            "does not broadcast to the normalized",
        ),
        ("InstanceNormalization", [rand(2, 3), rand(3), rand(3)], {}, 21, "N x C x spatial"),
        (
            "GroupNormalization",
            [rand(2, 6, 3), rand(6), rand(6)],
            {"num_groups": 4},
            21,
            "must divide",
        ),
        (
            "GroupNormalization",
            [rand(2, 6, 3), rand(6), rand(6)],
            {"num_groups": 3},
            18,
            "one per group",
        ),
        (
            "GroupNormalization",
            [rand(2, 6, 3), rand(6), rand(6)],
            {"num_groups": 4},
            18,
            "must divide",
        ),
        ("LRN", [rand(2, 3, 4, 4)], {"size": 0}, 13, "size must be positive"),
        (
            "MeanVarianceNormalization",
            [rand(2, 3, 4)],
            {"axes": [0, 3]},
            13,
            "axes entry 3 is out of range",
        ),
        ("MeanVarianceNormalization", [rand(2, 3, 4)], {"axes": [1, -2]}, 13, "repeat an axis"),
        ("LpNormalization", [rand(2, 3)], {"p": 3}, 22, "p must be 1 or 2"),
        ("LpNormalization", [rand(2, 3)], {"axis": 2}, 22, "axis 2 is out of range"),
        ("LpNormalization", [np.ones((2, 3), np.int32)], {}, 22, "floating-point"),
    ],
)
def test_errors(
    op: str, inputs: list[np.ndarray], attrs: dict[str, Any], opset: int, message: str
) -> None:
    model, _ = make_op_model(op, inputs, attrs, opset=opset)
    with pytest.raises(ShapeError, match=message) as e:
        import_model(model)
    assert f"{op.lower()}_0" in str(e.value)


def test_flops_are_declared() -> None:
    for name in (
        "BatchNormalization",
        "LayerNormalization",
        "InstanceNormalization",
        "GroupNormalization",
        "LRN",
        "MeanVarianceNormalization",
        "LpNormalization",
    ):
        assert get_op(name).flops is not None
    assert flowc_outputs("LRN", [rand(1, 3, 2, 2)], {"size": 3}, 13)["out0"].shape == (1, 3, 2, 2)
