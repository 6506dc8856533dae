"""Element-wise ops against onnxruntime: shapes, broadcasting, attributes, dtypes, opsets."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opcheck import check_op

from flowc.errors import ShapeError
from flowc.frontend.onnx import import_model

RNG = np.random.default_rng(1234)
SHAPES = [(), (7,), (3, 5), (2, 3, 4)]


def rand(
    shape: tuple[int, ...], dtype: Any = np.float32, lo: float = -3, hi: float = 3
) -> np.ndarray:
    return RNG.uniform(lo, hi, shape).astype(dtype)


UNARY: list[tuple[str, dict[str, Any], int, tuple[float, float]]] = [
    ("Neg", {}, 13, (-3, 3)),
    ("Abs", {}, 13, (-3, 3)),
    ("Sqrt", {}, 13, (0.01, 9)),
    ("Reciprocal", {}, 13, (0.5, 3)),
    ("Exp", {}, 13, (-5, 5)),
    ("Log", {}, 13, (0.01, 9)),
    ("Erf", {}, 13, (-3, 3)),
    ("Tanh", {}, 13, (-3, 3)),
    ("Sigmoid", {}, 13, (-6, 6)),
    ("Relu", {}, 14, (-3, 3)),
    ("LeakyRelu", {}, 16, (-3, 3)),
    ("LeakyRelu", {"alpha": 0.3}, 9, (-3, 3)),
    ("Elu", {"alpha": 0.7}, 9, (-3, 3)),
    ("Selu", {}, 9, (-3, 3)),
    ("Selu", {"alpha": 1.5, "gamma": 2.0}, 9, (-3, 3)),
    ("Celu", {"alpha": 2.0}, 12, (-3, 3)),
    ("Gelu", {}, 20, (-4, 4)),
    ("Gelu", {"approximate": "tanh"}, 20, (-4, 4)),
    ("HardSigmoid", {}, 9, (-4, 4)),
    ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}, 9, (-4, 4)),
    ("HardSwish", {}, 14, (-5, 5)),
    ("Softplus", {}, 9, (-20, 20)),
    ("Softsign", {}, 9, (-3, 3)),
    ("Mish", {}, 18, (-5, 5)),
    ("ThresholdedRelu", {"alpha": 0.5}, 10, (-3, 3)),
    ("Shrink", {"lambd": 1.0, "bias": 0.5}, 9, (-3, 3)),
    ("Floor", {}, 13, (-3, 3)),
    ("Ceil", {}, 13, (-3, 3)),
    ("Round", {}, 11, (-3, 3)),
    ("Sign", {}, 13, (-3, 3)),
    ("Sin", {}, 9, (-3, 3)),
    ("Cos", {}, 9, (-3, 3)),
    ("Tan", {}, 9, (-1, 1)),
    ("Asin", {}, 9, (-0.9, 0.9)),
    ("Acos", {}, 9, (-0.9, 0.9)),
    ("Atan", {}, 9, (-3, 3)),
    ("Sinh", {}, 9, (-3, 3)),
    ("Cosh", {}, 9, (-3, 3)),
    ("Asinh", {}, 9, (-3, 3)),
    ("Acosh", {}, 9, (1.1, 4)),
    ("Atanh", {}, 9, (-0.9, 0.9)),
]


@pytest.mark.parametrize(
    ("op", "attrs", "opset", "rng"), UNARY, ids=[f"{u[0]}-{u[2]}-{i}" for i, u in enumerate(UNARY)]
)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_unary(
    op: str, attrs: dict[str, Any], opset: int, rng: tuple[float, float], shape: tuple[int, ...]
) -> None:
    check_op(op, [rand(shape, lo=rng[0], hi=rng[1])], attrs, opset=opset)


def test_unary_float64_and_special_values() -> None:
    check_op("Exp", [rand((4, 3), np.float64)])
    check_op("Relu", [np.array([-np.inf, -0.0, np.nan, np.inf], np.float32)])
    check_op("Abs", [np.array([-5, 3, -128], np.int32)])
    check_op("Neg", [np.array([-5, 3, 7], np.int64)])


BROADCASTS = [
    ((3, 4), (3, 4)),
    ((3, 4), (4,)),
    ((2, 1, 4), (3, 1)),
    ((), (2, 3)),
    ((1,), (5, 1, 1)),
    ((2, 3, 1), (1, 1, 4)),
]


@pytest.mark.parametrize(
    "op", ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "PRelu"]
)
@pytest.mark.parametrize(("sa", "sb"), BROADCASTS, ids=str)
def test_binary_broadcasting(op: str, sa: tuple[int, ...], sb: tuple[int, ...]) -> None:
    if op == "PRelu" and len(sb) > len(sa):
        sa, sb = sb, sa  # PRelu's slope broadcasts to X, not the other way round
    a = rand(sa, lo=0.5, hi=2) if op == "Pow" else rand(sa)
    b = rand(sb, lo=0.5, hi=2) if op in ("Div", "Pow") else rand(sb)
    check_op(op, [a, b])


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_arithmetic(dtype: Any) -> None:
    a = RNG.integers(-50 if np.dtype(dtype).kind == "i" else 0, 50, (4, 6)).astype(dtype)
    b = RNG.integers(1, 9, (6,)).astype(dtype)
    if np.dtype(dtype).kind == "i":
        b[::2] *= -1  # C division truncates toward zero for mixed signs
    for op in ("Add", "Sub", "Mul", "Div", "Max", "Min"):
        check_op(op, [a, b], opset=13)


def test_mod_and_pow_mixed_types() -> None:
    a = RNG.integers(-20, 20, (10,)).astype(np.int64)
    b = np.array([3, -3, 7, -7, 2, 5, -5, 4, 9, -2], np.int64)
    check_op("Mod", [a, b])
    check_op("Mod", [rand((10,)), rand((10,), lo=0.5, hi=2)], {"fmod": 1})
    check_op("Pow", [rand((3, 4), lo=0.5, hi=2), np.array(2, np.int64)], opset=15)


@pytest.mark.parametrize("op", ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"])
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_comparisons(op: str, dtype: Any) -> None:
    a = RNG.integers(-3, 3, (3, 4)).astype(dtype)
    b = RNG.integers(-3, 3, (4,)).astype(dtype)
    check_op(op, [a, b], opset=16)


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logic(op: str) -> None:
    check_op(op, [RNG.random((2, 3, 4)) < 0.5, RNG.random((3, 1)) < 0.5])
    check_op("Not", [RNG.random((5, 2)) < 0.5])


def test_bitwise() -> None:
    a = RNG.integers(0, 255, (4, 5)).astype(np.uint8)
    b = RNG.integers(0, 255, (5,)).astype(np.uint8)
    for op in ("BitwiseAnd", "BitwiseOr", "BitwiseXor"):
        check_op(op, [a, b], opset=18)
    check_op("BitwiseNot", [a], opset=18)
    check_op("BitShift", [a, np.array([1, 2, 3, 0, 4], np.uint8)], {"direction": "LEFT"})
    check_op("BitShift", [a, np.array([1, 2, 3, 0, 4], np.uint8)], {"direction": "RIGHT"})


def test_isnan_isinf() -> None:
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -1.5, np.nan], np.float32)
    check_op("IsNaN", [x], opset=13)
    check_op("IsInf", [x])
    check_op("IsInf", [x], {"detect_negative": 0})
    check_op("IsInf", [x], {"detect_positive": 0})


def test_where() -> None:
    check_op("Where", [RNG.random((3, 1)) < 0.5, rand((3, 4)), rand((4,))])
    check_op(
        "Where",
        [
            RNG.random((2, 3)) < 0.5,
            np.arange(6, dtype=np.int64).reshape(2, 3),
            np.array(-1, np.int64),
        ],
        opset=9,
    )


@pytest.mark.parametrize("opset", [9, 11, 12, 13])
def test_clip_every_spelling(opset: int) -> None:
    x = rand((4, 5))
    if opset < 11:
        check_op("Clip", [x], {"min": -0.5, "max": 1.0}, opset=opset)
        check_op("Clip", [x], {"max": 1.0}, opset=opset)
        check_op("Clip", [x], opset=opset)
    else:
        check_op("Clip", [x, np.float32(-0.5), np.float32(1.0)], opset=opset)
        check_op("Clip", [x, None, np.float32(0.2)], opset=opset)
        check_op("Clip", [x, np.float32(-0.2)], opset=opset, const_inputs=[1])
    if opset >= 12:
        check_op("Clip", [np.arange(-5, 5, dtype=np.int64), np.int64(-2), np.int64(3)], opset=opset)


CASTS = [
    (np.float32, 7), (np.float32, 6), (np.float32, 9), (np.float32, 10), (np.float32, 11),
    (np.int64, 1), (np.int32, 7), (np.bool_, 1), (np.float64, 1), (np.float32, 2),
]  # fmt: skip


@pytest.mark.parametrize(("src", "to"), CASTS, ids=str)
def test_cast(src: Any, to: int) -> None:
    if src is np.bool_:
        x = RNG.random((3, 4)) < 0.5
    elif np.dtype(src).kind == "f":
        lo = 0 if to == 2 else -100  # float -> uint8 outside [0, 255] is undefined in ONNX
        x = rand((3, 4), src, lo=lo, hi=100)
    else:
        x = RNG.integers(-100, 100, (3, 4)).astype(src)
    check_op("Cast", [x], {"to": to}, opset=13)
    check_op("CastLike", [x, np.zeros((1,), np.float32)], opset=15)


def test_cast_to_bfloat16_rounds_like_ml_dtypes() -> None:
    # onnxruntime cannot hand bfloat16 arrays to NumPy, so ml_dtypes is the reference here.
    import ml_dtypes

    from flowc.ir.graph import Attrs
    from flowc.ops.registry import get_op

    x = rand((64,), lo=-1e3, hi=1e3)
    (y,) = get_op("Cast").evaluate([x], Attrs({"to": 16}))
    assert y.dtype == ml_dtypes.bfloat16
    assert np.array_equal(y.astype(np.float32), x.astype(ml_dtypes.bfloat16).astype(np.float32))


@settings(max_examples=25, deadline=None)
@given(
    sa=st.lists(st.integers(1, 4), min_size=0, max_size=4),
    drop=st.integers(0, 4),
    ones=st.lists(st.booleans(), min_size=4, max_size=4),
    op=st.sampled_from(["Add", "Mul", "Sub", "Max", "Where"]),
)
def test_broadcasting_property(sa: list[int], drop: int, ones: list[bool], op: str) -> None:
    sb = [1 if one else d for d, one in zip(sa[drop:], ones, strict=False)]
    a, b = rand(tuple(sa)), rand(tuple(sb))
    if op == "Where":
        check_op(op, [a > 0, a, b])
    else:
        check_op(op, [a, b])


def test_errors_name_the_node() -> None:
    from opcheck import make_op_model

    m, _ = make_op_model("Add", [rand((3, 4)), rand((3, 4))])
    m.graph.input[1].type.tensor_type.shape.dim[1].dim_value = 5
    with pytest.raises(
        ShapeError, match=r"Add node 'add_0': shapes \[3, 4\], \[3, 5\] do not broadcast"
    ):
        import_model(m)
    m, _ = make_op_model("Add", [rand((3, 4)), rand((3, 4))])
    m.graph.input[1].type.tensor_type.elem_type = 7
    with pytest.raises(
        ShapeError, match="Add node 'add_0': operands have different element types: f32 and i64"
    ):
        import_model(m)
    m, _ = make_op_model("Sqrt", [rand((2,))])
    m.graph.input[0].type.tensor_type.elem_type = 7
    m.graph.output[0].type.tensor_type.ClearField("elem_type")
    with pytest.raises(
        ShapeError, match="Sqrt node 'sqrt_0': needs a floating-point input, got i64"
    ):
        import_model(m)


def test_saturating_float8_casts() -> None:
    # onnxruntime cannot hand float8 arrays to NumPy; the spec's saturation rule is the reference:
    # out-of-range values, infinities included, clip to the largest finite value: ONNX's
    # table, E5M2 too although it has infinities (saturate=0 keeps them).
    import ml_dtypes

    from flowc.ir.graph import Attrs
    from flowc.ops.registry import get_op

    x = np.array([np.inf, -np.inf, 1e6, -1e6, 1.5, np.nan], np.float32)
    for code, dt in [
        (17, ml_dtypes.float8_e4m3fn),
        (18, ml_dtypes.float8_e4m3fnuz),
        (19, ml_dtypes.float8_e5m2),
        (20, ml_dtypes.float8_e5m2fnuz),
    ]:
        (y,) = get_op("Cast").evaluate([x], Attrs({"to": code}))
        big = float(ml_dtypes.finfo(dt).max)
        assert y.dtype == dt
        assert y.astype(np.float32)[:5].tolist() == [big, -big, big, -big, 1.5]
        assert np.isnan(y.astype(np.float32)[5])


# float -> integer Cast outside the type's range, and of NaN, is undefined in ONNX (onnxruntime
# gives whatever its C++ compiler does); flowc's one rule on both targets: truncate toward
# zero, saturate to the type's range (the GPU's cvt.rzi.sat), NaN -> 0.
SPECIAL = [np.nan, np.inf, -np.inf, 1e30, -1e30, 3e9, -3e9, 7e4, -7e4, 300.7, -300.7, 2.9, -2.9,
           -0.5, 0.0, 255.9, 256.0, 127.5, -128.9, 65535.5]  # fmt: skip
INT_TARGETS = [(3, np.int8), (2, np.uint8), (5, np.int16), (4, np.uint16), (6, np.int32),
               (12, np.uint32), (7, np.int64), (13, np.uint64)]  # fmt: skip


def _saturating_rule(values: list[float], dtype: Any) -> np.ndarray:
    info = np.iinfo(dtype)
    out = []
    for v in values:
        if v != v:
            out.append(0)
        elif v >= float(info.max):
            out.append(int(info.max))
        elif v <= float(info.min):
            out.append(int(info.min))
        else:
            out.append(int(v))  # int() truncates toward zero
    return np.array(out, dtype=dtype)


def test_float_to_int_cast_saturates_and_maps_nan_to_zero(tmp_path: Any) -> None:
    from onnx import TensorProto, helper

    from flowc.compiler import compile_graph
    from flowc.harness.build import build, run
    from flowc.ir.graph import Attrs
    from flowc.ops.registry import get_op
    from flowc.passes.manager import COMPILE_PIPELINE, PassManager

    srcs = [("f32", np.float32, TensorProto.FLOAT), ("f64", np.float64, TensorProto.DOUBLE),
            ("f16", np.float16, TensorProto.FLOAT16)]  # fmt: skip
    nodes, ins, outs, feeds, want = [], [], [], {}, {}
    for name, np_t, onnx_t in srcs:
        with np.errstate(over="ignore"):
            x = np.array(SPECIAL, dtype=np_t)  # float16 holds 3e9 and 1e30 as inf
        feeds[name] = x
        ins.append(helper.make_tensor_value_info(name, onnx_t, [len(SPECIAL)]))
        for to, dt in INT_TARGETS:
            out = f"{name}_to_{np.dtype(dt).name}"
            nodes.append(helper.make_node("Cast", [name], [out], to=to, name=out))
            outs.append(helper.make_tensor_value_info(out, to, [len(SPECIAL)]))
            # The values the source type holds (float16 rounds 3e9 to inf, 300.7 to 300.75).
            want[out] = _saturating_rule([float(v) for v in x], dt)
            (ref,) = get_op("Cast").evaluate(
                [x], Attrs({"to": to, "saturate": 1, "round_mode": "up"})
            )
            assert np.array_equal(ref, want[out]), (out, ref, want[out])
    model = helper.make_model(
        helper.make_graph(nodes, "casts", ins, outs), opset_imports=[helper.make_opsetid("", 17)]
    )
    g = PassManager(COMPILE_PIPELINE).run(import_model(model))
    project = tmp_path / "project"
    compile_graph(g, project)
    build(project, "host", quick=True)
    got, _ = run(project, feeds, target="host")
    for out, w in want.items():
        assert got[out].dtype == w.dtype and np.array_equal(got[out], w), (out, got[out], w)
