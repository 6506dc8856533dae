"""Reduction, ArgMax/ArgMin, CumSum and softmax kernels in the compiled host build against
onnxruntime (one build for all cases).

Rows longer than a block (256 threads) make the threads of a row loop before the shuffles;
short rows share a block (and a warp); rows wider than a warp add the cross-warp step;
float rows of a multiple of 4 elements are read four at a time; reductions over
non-innermost axes take the strided kernels."""

from __future__ import annotations

import numpy as np
from opcheck import Case, check_compiled

RNG = np.random.default_rng(11)

REDUCE_OPS = [
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceSumSquare",
]


def rand(*shape: int, lo: float = -3, hi: float = 3, dtype: type = np.float32) -> np.ndarray:
    return RNG.uniform(lo, hi, shape).astype(dtype)


def axes(*a: int) -> np.ndarray:
    return np.array(a, np.int64)


def reduce_case(op: str, x: np.ndarray, ax: np.ndarray | None, keepdims: int = 1) -> Case:
    attrs = {"keepdims": keepdims}
    if ax is None:
        return Case(op, [x], attrs)
    return Case(op, [x, ax], attrs, const_inputs=[1])


def reduce_cases() -> list[Case]:
    cases = []
    for op in REDUCE_OPS:
        # LogSum needs a positive sum; Prod stays moderate with factors near 1.
        lo, hi = {"ReduceLogSum": (0.1, 2.0), "ReduceProd": (0.6, 1.5)}.get(op, (-3, 3))
        x = rand(3, 4, 5, lo=lo, hi=hi)
        cases += [
            reduce_case(op, x, axes(-1)),  # rows shorter than a block, several per block
            reduce_case(op, x, axes(1), keepdims=0),  # strided: one middle axis
            reduce_case(op, x, axes(0, -1)),  # strided: two separate axes
            reduce_case(op, x, axes(2, 1), keepdims=0),  # rows: merged trailing axes
            reduce_case(op, x, None, keepdims=0),  # everything, one row
            reduce_case(op, rand(5, 600, lo=lo, hi=hi), axes(1)),  # rows longer than a block
        ]
    long = rand(3, 2000)
    cases += [
        reduce_case("ReduceSum", long, axes(-1)),
        reduce_case("ReduceMean", long, None),
        reduce_case("ReduceLogSumExp", long * 30, axes(1)),  # the shift matters here
        reduce_case("ReduceMax", rand(300, 7), axes(1), keepdims=0),  # many rows, few blocks
        reduce_case("ReduceSum", rand(6, 1, 40, 1), axes(2)),  # size-1 axes ignored: rows
        reduce_case("ReduceSum", rand(4, 300, 3), axes(1)),  # strided, long
        reduce_case("ReduceMax", rand(2, 3), axes(0, 1, -1)),  # repeated axes
        # Empty axes: reduce all, or with noop_with_empty_axes each element alone.
        Case("ReduceSum", [rand(3, 4), axes()], const_inputs=[1]),
        Case("ReduceL1", [rand(3, 4), axes()], {"noop_with_empty_axes": 1}, const_inputs=[1]),
        Case(
            "ReduceSumSquare", [rand(3, 4), axes()], {"noop_with_empty_axes": 1}, const_inputs=[1]
        ),
        reduce_case("ReduceSum", rand(3, 5, dtype=np.float64), axes(1)),
        reduce_case("ReduceLogSumExp", rand(3, 5, dtype=np.float64), axes(0)),
    ]
    i64 = RNG.integers(-1000, 1000, (4, 300)).astype(np.int64)
    i32 = RNG.integers(-1000, 1000, (4, 6)).astype(np.int32)
    cases += [
        reduce_case("ReduceSum", i64, axes(-1)),
        reduce_case("ReduceSum", i64, axes(0), keepdims=0),
        reduce_case("ReduceMax", i64, axes(-1)),
        reduce_case("ReduceMax", i64, axes(0)),
        reduce_case("ReduceMin", i64, None),
        reduce_case("ReduceMean", i64, axes(1)),
        reduce_case("ReduceSum", i32, axes(1)),
        reduce_case("ReduceProd", RNG.integers(-3, 4, (3, 5)).astype(np.int64), axes(1)),
        reduce_case("ReduceMax", RNG.integers(0, 255, (3, 5)).astype(np.uint8), axes(0)),
        reduce_case("ReduceMin", RNG.random((3, 5)) < 0.7, axes(1)),
    ]
    # Integer results through float64: truncated, and log of a non-positive sum (NaN, -inf)
    # gives the type's minimum, as onnxruntime's C cast does.
    small = np.array([[-5, 2, 1], [3, 4, 5], [0, 0, 0], [7, 7, 1]], np.int32)
    for op in ["ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]:
        cases += [reduce_case(op, small, axes(1)), reduce_case(op, small.astype(np.int64), None)]
    mean = np.array([[-7, 2], [7, -2], [-3, 0]], np.int32)  # C division truncates toward 0
    cases += [
        reduce_case("ReduceMean", mean, axes(1)),
        # An empty reduced axis gives the identities; a scalar reduces to itself.
        reduce_case("ReduceSum", np.zeros((3, 0), np.float32), axes(1)),
        reduce_case("ReduceMax", np.zeros((3, 0), np.float32), axes(1)),
        reduce_case("ReduceSum", np.array(2.5, np.float32), None),
    ]
    return cases


def arg_cases() -> list[Case]:
    cases = []
    # Few distinct values: many ties, decided by select_last_index (across the tree too).
    for x in [
        RNG.integers(0, 4, (3, 4, 5)).astype(np.float32),
        RNG.integers(0, 6, (4, 1000)).astype(np.float32),
        RNG.integers(-5, 5, (5, 700)).astype(np.int64),
    ]:
        for op in ["ArgMax", "ArgMin"]:
            for last in [0, 1]:
                cases += [
                    Case(op, [x], {"axis": -1, "select_last_index": last}),
                    Case(op, [x], {"axis": 0, "keepdims": 0, "select_last_index": last}),
                ]
    x = rand(3, 4, 5)
    cases += [
        Case("ArgMax", [x], {"axis": 1}),
        Case("ArgMin", [x], {"axis": -2, "keepdims": 0}),
        Case("ArgMax", [RNG.integers(0, 9, (4, 5)).astype(np.int32)], {"axis": 1}),
        Case("ArgMin", [rand(3, 4, dtype=np.float64)], {"axis": 0}),
    ]
    return cases


def cumsum_cases() -> list[Case]:
    cases = []
    x = rand(3, 4, 5)
    for axis in [0, 1, -1]:
        for exclusive in [0, 1]:
            for reverse in [0, 1]:
                cases.append(
                    Case(
                        "CumSum",
                        [x, np.array(axis, np.int64)],
                        {"exclusive": exclusive, "reverse": reverse},
                        const_inputs=[1],
                    )
                )
    ints = RNG.integers(-100, 100, (4, 7)).astype(np.int64)
    cases += [
        Case("CumSum", [ints, np.array([1], np.int64)], const_inputs=[1]),
        Case("CumSum", [ints, np.array(0, np.int32)], {"reverse": 1}, const_inputs=[1]),
        Case(
            "CumSum",
            [ints.astype(np.int32), np.array(1, np.int64)],
            {"exclusive": 1, "reverse": 1},
            const_inputs=[1],
        ),
        Case("CumSum", [rand(3, 4, dtype=np.float64), np.array(0, np.int64)], const_inputs=[1]),
        Case("CumSum", [rand(2, 500), np.array(-1, np.int64)], {"exclusive": 1}, const_inputs=[1]),
    ]
    return cases


def softmax_cases() -> list[Case]:
    cases = []
    for op in ["Softmax", "LogSoftmax", "Hardmax"]:
        cases += [
            Case(op, [rand(3, 4, 10)]),  # short rows, several per block
            Case(op, [rand(3, 1000)], {"axis": 1}),  # rows longer than a block
            Case(op, [rand(3, 4, 5)], {"axis": 1}),  # strided
            Case(op, [rand(3, 4, 5)], {"axis": -3}),
            Case(op, [rand(40, 3000, lo=-1000, hi=1000)]),  # large logits
        ]
        if op != "Hardmax":  # onnxruntime has no float64 Hardmax
            cases.append(Case(op, [rand(4, 6, dtype=np.float64)]))
    ties = RNG.integers(0, 3, (6, 300)).astype(np.float32)
    cases += [Case("Hardmax", [ties]), Case("Hardmax", [ties], {"axis": 0})]
    # Infinite logits through the online sum (NaN rows for +inf and all -inf, as
    # onnxruntime gives), in rows read four at a time (8, 200 wide: several threads and
    # several warps per row) and one by one (7).
    for cols in (7, 8, 200):
        x = rand(5, cols)
        x[0, cols // 2] = np.inf
        x[1, :] = -np.inf
        x[2, 1 : cols - 1] = -np.inf
        x[3, cols - 1] = -np.inf
        cases += [Case("Softmax", [x]), Case("LogSoftmax", [x])]
    cases += [Case("Softmax", [rand(7, 8)]), Case("LogSoftmax", [rand(3, 4, 12)], {"axis": 1})]
    return cases


def test_reduce_softmax_compiled(tmp_path) -> None:  # type: ignore[no-untyped-def]
    check_compiled(reduce_cases() + arg_cases() + cumsum_cases() + softmax_cases(), tmp_path)
