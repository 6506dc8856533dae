"""Element-wise kernels in the compiled host build against onnxruntime (one build for all)."""

from __future__ import annotations

import numpy as np
from opcheck import Case, check_compiled

from flowc.codegen.elementwise import broadcast_plan, divmod_magic

RNG = np.random.default_rng(7)


def rand(*shape: int, lo: float = -3, hi: float = 3) -> np.ndarray:
    return RNG.uniform(lo, hi, shape).astype(np.float32)


def test_elementwise_ops_compiled(tmp_path) -> None:  # type: ignore[no-untyped-def]
    x = rand(3, 5)
    pos = rand(3, 5, lo=0.1, hi=4)
    cases = [
        Case(op, [x])
        for op in [
            "Neg",
            "Abs",
            "Exp",
            "Erf",
            "Tanh",
            "Sigmoid",
            "Relu",
            "Softplus",
            "Softsign",
            "HardSwish",
            "Floor",
            "Ceil",
            "Round",
            "Sign",
            "Sin",
            "Cos",
            "Atan",
        ]
    ]
    cases += [Case(op, [pos]) for op in ["Sqrt", "Log", "Reciprocal"]]
    cases += [
        Case("LeakyRelu", [x], {"alpha": 0.3}),
        Case("Elu", [x], {"alpha": 0.7}),
        Case("Selu", [x]),
        Case("Celu", [x], {"alpha": 2.0}),
        Case("Gelu", [x]),
        Case("Gelu", [x], {"approximate": "tanh"}),
        Case("HardSigmoid", [x], {"alpha": 0.3, "beta": 0.4}),
        Case("ThresholdedRelu", [x], {"alpha": 0.5}),
        Case("Shrink", [x], {"lambd": 1.0, "bias": 0.5}),
        Case("Mish", [x]),
    ]
    for op in ["Add", "Sub", "Mul", "Div", "Max", "Min", "Sum", "Mean", "PRelu"]:
        cases.append(Case(op, [rand(2, 3, 4), rand(3, 1)]))
    cases.append(Case("Pow", [rand(2, 3, lo=0.5, hi=2), rand(3, lo=-2, hi=2)]))
    cases.append(Case("Sum", [rand(4, 1), rand(1, 5), rand(5)]))
    ints = RNG.integers(-20, 20, (4, 6)).astype(np.int64)
    divs = np.array([3, -3, 7, -7, 2, 5], np.int64)
    cases += [Case("Div", [ints, divs]), Case("Mod", [ints, divs]), Case("Add", [ints, divs])]
    for op in ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"]:
        cases.append(
            Case(
                op,
                [
                    RNG.integers(-2, 2, (3, 4)).astype(np.float32),
                    RNG.integers(-2, 2, (4,)).astype(np.float32),
                ],
            )
        )
    b1, b2 = RNG.random((3, 4)) < 0.5, RNG.random((4,)) < 0.5
    cases += [Case("And", [b1, b2]), Case("Or", [b1, b2]), Case("Xor", [b1, b2]), Case("Not", [b1])]
    special = np.array([np.nan, np.inf, -np.inf, 0.0, 1.5], np.float32)
    cases += [
        Case("IsNaN", [special]),
        Case("IsInf", [special]),
        Case("IsInf", [special], {"detect_negative": 0}),
    ]
    cases += [
        Case("Where", [RNG.random((3, 1)) < 0.5, rand(3, 4), rand(4)]),
        Case("Clip", [x, np.float32(-0.5), np.float32(1.0)]),
        Case("Clip", [x, None, np.float32(0.2)]),
        Case("Cast", [x], {"to": 7}),
        Case("Cast", [x], {"to": 9}),
        Case("Cast", [ints], {"to": 1}),
        Case("CastLike", [ints, np.zeros(1, np.float64)]),
    ]
    # Broadcast shapes for the runtime-size indexing and its four-wide path: a per-channel
    # operand constant along a long inner dim (vectors), one running along it (vectors at
    # its offset), a scalar, merged dims of rank 3, an inner dim that is no multiple of 4
    # (one by one), and same-shape outputs whose size leaves a tail after the vectors.
    cases += [
        Case("Mul", [rand(2, 3, 8, 4), rand(3, 1, 1)]),
        Case("Add", [rand(2, 3, 8), rand(3, 8)]),
        Case("Sub", [rand(4, 12), np.float32(1.5)]),
        Case("Div", [rand(2, 3, 4, 5), rand(3, 1, 5, lo=0.5, hi=2)]),
        Case("Max", [rand(5, 7), rand(5, 1)]),
        Case("Where", [RNG.random((2, 1, 6)) < 0.5, rand(2, 3, 6), rand(3, 1)]),
        Case("Add", [rand(4, 1, 8), rand(1, 5, 1)]),
        Case("Tanh", [rand(3, 7)]),
        Case("Mul", [rand(1, 13), rand(13)]),
    ]
    check_compiled(cases, tmp_path)


def test_fast_division_is_exact() -> None:
    # n // d for the numerators the kernels divide (below 2^31), for every small divisor,
    # powers of two and their neighbours, and random large ones, at the edges of the range.
    rng = np.random.default_rng(0)
    divisors = list(range(1, 2049))
    divisors += [v for k in range(11, 31) for v in ((1 << k) - 1, 1 << k, (1 << k) + 1)]
    divisors += [int(d) for d in rng.integers(2, 1 << 31, 2000)]
    for d in divisors:
        dd, mul, shr = divmod_magic(d)
        assert dd == d and 0 <= mul < 1 << 32
        top = (1 << 31) - 1
        ns = [0, 1, d - 1, d, d + 1, top, top - top % d, top - top % d - 1]
        ns += [int(n) for n in rng.integers(0, 1 << 31, 40)]
        for n in ns:
            if n < 0:
                continue
            got = n if d == 1 else ((n * mul) >> 32) >> shr
            assert got == n // d, (n, d)


def test_broadcast_plan_merges_dims() -> None:
    # Per-channel over N x C x H x W: H and W merge (and N stays apart from C).
    dims, strides = broadcast_plan([(2, 3, 4, 5), (3, 1, 1)], (2, 3, 4, 5))
    assert dims == [20, 3, 2] and strides == [None, [0, 1, 0]]
    # A same-shape operand with size-1 dims of its own is read at the flat index.
    dims, strides = broadcast_plan([(1, 6), (6,)], (1, 6))
    assert strides == [None, None]
    # A trailing-dims operand runs along the merged inner dim.
    dims, strides = broadcast_plan([(2, 3, 8), (3, 8)], (2, 3, 8))
    assert dims == [24, 2] and strides == [None, [1, 0]]
    # An outer product merges nothing.
    dims, strides = broadcast_plan([(4, 1), (1, 5)], (4, 5))
    assert dims == [5, 4] and strides == [[0, 1], [1, 0]]
