"""Element-wise kernels in the compiled host build against onnxruntime (one build for all)."""

from __future__ import annotations

import numpy as np
from opcheck import Case, check_compiled

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
    check_compiled(cases, tmp_path)
