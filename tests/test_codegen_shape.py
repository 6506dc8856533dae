"""Shape and index kernels in the compiled host build against onnxruntime: one build per
family. Shape-deciding inputs (Slice's starts, Pad's pads, Resize's scales, ...) are
initializers, as flowc compiles static shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from opcheck import Case, check_compiled

from flowc.compiler import compile_graph
from flowc.errors import FlowcError
from flowc.harness.build import build, run
from flowc.harness.compare import compare
from flowc.interpreter import evaluate
from flowc.ir.builder import GraphBuilder
from flowc.ir.dtype import DType
from flowc.ir.graph import Graph
from flowc.ir.types import TensorType
from flowc.ir.verify import verify_graph

RNG = np.random.default_rng(11)
I64_MIN = -(2**63)


def rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def i64(*v: int) -> np.ndarray:
    return np.array(v, np.int64)


def f32(*v: float) -> np.ndarray:
    return np.array(v, np.float32)


def ints(*shape: int, lo: int = -50, hi: int = 50) -> np.ndarray:
    return RNG.integers(lo, hi, shape).astype(np.int64)


def _slices() -> list[Case]:
    x = rand(5, 6, 7)
    specs: list[tuple[list[int], list[int], list[int] | None, list[int] | None]] = [
        ([1], [4], None, None),
        ([0, 1], [5, -1], [1, 2], [2, 3]),
        ([-1], [I64_MIN], [0], [-1]),  # the whole axis reversed
        ([4, -2, 6], [0, -7, 1], [0, 1, 2], [-2, -1, -3]),
        ([2], [2], [1], None),  # empty
        ([-100, 3], [100, 100], [2, 0], [1, 1]),  # clamped
        ([5, 0], [-10, 6], [1, 2], [-2, 2]),
    ]
    cases = []
    for starts, ends, axes, steps in specs:
        inputs: list[Any] = [x, i64(*starts), i64(*ends)]
        inputs += [None if axes is None else i64(*axes), None if steps is None else i64(*steps)]
        cases.append(Case("Slice", inputs, const_inputs=[1, 2, 3, 4]))
    return cases


def _resizes() -> list[Case]:
    x = rand(1, 2, 4, 5)
    cases = []
    coords = [
        "half_pixel",
        "asymmetric",
        "align_corners",
        "pytorch_half_pixel",
        "half_pixel_symmetric",
    ]
    # align_corners gets scales whose resized lengths are whole (4 x 5 -> 2 x 3): with
    # fractional ones onnxruntime and ONNX's test data disagree (test_ops_shape and the
    # conformance runner check flowc follows ONNX there).
    scale_pairs = [(2.0, 3.0), (0.5, 0.6), (0.5, 0.6), (3.0, 1.5), (1.5, 2.5)]
    for coord, scales in zip(coords, scale_pairs, strict=True):
        for nearest in ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]:
            attrs = {"mode": "nearest", "coordinate_transformation_mode": coord}
            cases.append(
                Case("Resize", [x, None, f32(1, 1, *scales)], {**attrs, "nearest_mode": nearest})
            )
    for coord in [*coords, "tf_crop_and_resize"]:
        pairs = [("linear", (1.7, 0.6)), ("cubic", (2.0, 1.25))]
        if coord == "align_corners":
            pairs = [("linear", (1.5, 0.6)), ("cubic", (2.0, 1.4))]
        for mode, scales in pairs:
            roi = f32(0, 0, 0.2, 0.1, 1, 1, 0.9, 0.7) if coord == "tf_crop_and_resize" else None
            attrs = {"mode": mode, "coordinate_transformation_mode": coord}
            cases.append(
                Case(
                    "Resize",
                    [x, roi, f32(1, 1, *scales)],
                    {**attrs, "extrapolation_value": -1.0},
                    tol=1e-4,
                )
            )
    crop = f32(0, 0, -0.4, 0.3, 1, 1, 1.2, 1.5)
    for mode in ("nearest", "linear", "cubic"):
        attrs = {"mode": mode, "coordinate_transformation_mode": "tf_crop_and_resize"}
        cases.append(
            Case(
                "Resize",
                [x, crop, None, i64(1, 2, 5, 3)],
                {**attrs, "extrapolation_value": 9.0},
                tol=1e-4,
            )
        )
    cases += [
        Case(
            "Resize",
            [rand(1, 1, 4, 5), None, f32(1, 1, 1.6, 0.8)],
            {"mode": "cubic", "cubic_coeff_a": -0.5, "exclude_outside": 1},
            tol=1e-4,
        ),
        Case("Resize", [rand(2, 3, 4), None, None, i64(2, 7, 9)], {"mode": "linear"}),
        Case(
            "Resize",
            [rand(1, 2, 6, 4), None, None, i64(9, 9)],
            {"mode": "linear", "axes": [2, 3], "keep_aspect_ratio_policy": "not_larger"},
        ),
        Case(
            "Resize",
            [ints(1, 1, 3, 4).astype(np.int32), None, f32(1, 1, 2.5, 0.5)],
            {"mode": "nearest"},
        ),
        Case("Resize", [x, None, f32(1, 1, 1.2, 1.1)], {"mode": "linear"}),  # same shape: a copy
    ]
    for c in cases:
        c.const_inputs = [1, 2, 3]
    return cases


def test_shape_ops_compiled(tmp_path: Path) -> None:
    x = rand(2, 3, 4)
    cases = [
        Case("Transpose", [x], {"perm": [2, 0, 1]}),
        Case("Transpose", [x]),
        Case("Transpose", [ints(3, 4)], {"perm": [1, 0]}),
        Case("Transpose", [rand(2, 3, 1, 4, 2)], {"perm": [0, 3, 2, 4, 1]}),
        Case("Transpose", [RNG.random((2, 3, 2)) < 0.5], {"perm": [1, 2, 0]}),
        Case("Transpose", [rand(2, 3, 4)], {"perm": [0, 1, 2]}),
        Case("Concat", [x, rand(2, 1, 4), rand(2, 2, 4)], {"axis": 1}),
        Case("Concat", [x, rand(1, 3, 4)], {"axis": 0}),
        Case("Concat", [ints(2, 2), ints(2, 3), ints(2, 0)], {"axis": -1}),
        # A constant operand (all equal: held as a fill in the weights).
        Case(
            "Concat",
            [rand(1, 20), np.full((2, 20), 3.0, np.float32)],
            {"axis": 0},
            const_inputs=[1],
        ),
        Case("Split", [rand(2, 6, 3), i64(1, 2, 3)], {"axis": 1}, num_outputs=3, const_inputs=[1]),
        Case("Split", [rand(7, 2)], {"axis": 0, "num_outputs": 3}, num_outputs=3),
        Case("Split", [ints(3, 5)], {"axis": -1, "num_outputs": 2}, num_outputs=2),
        *_slices(),
        Case("Expand", [rand(3, 1), i64(2, 3, 4)], const_inputs=[1]),
        Case("Expand", [rand(1), i64(2, 2)], const_inputs=[1]),
        Case("Expand", [ints(1, 3, 1), i64(4, 1, 1, 2)], const_inputs=[1]),
        Case("Tile", [rand(2, 3), i64(2, 3)], const_inputs=[1]),
        Case("Tile", [ints(2, 1, 3), i64(1, 4, 2)], const_inputs=[1]),
        Case(
            "Pad", [rand(3, 4), i64(1, 2, 0, 3), f32(1.5)], {"mode": "constant"}, const_inputs=[1]
        ),
        Case("Pad", [rand(3, 4), i64(0, 1, 2, 0)], {"mode": "constant"}, const_inputs=[1]),
        Case("Pad", [rand(2, 3, 4), i64(0, 2, 3, 0, 1, 3)], {"mode": "reflect"}, const_inputs=[1]),
        Case("Pad", [rand(3, 4), i64(2, 3, 1, 4)], {"mode": "edge"}, const_inputs=[1]),
        Case("Pad", [rand(3, 4), i64(2, 5, 4, 9)], {"mode": "wrap"}, const_inputs=[1]),
        Case("Pad", [rand(4, 5), i64(-1, 2, 1, -2)], {"mode": "constant"}, const_inputs=[1]),
        Case("Pad", [rand(4, 5), i64(-1, 1, 1, -2)], {"mode": "reflect"}, const_inputs=[1]),
        Case(
            "Pad",
            [ints(2, 3, 4), i64(1, 2, 0, 1), i64(7), i64(1, -1)],
            {"mode": "constant"},
            const_inputs=[1, 3],
        ),
        *_resizes(),
        Case("DepthToSpace", [rand(2, 8, 3, 2)], {"blocksize": 2, "mode": "DCR"}),
        Case("DepthToSpace", [rand(1, 18, 2, 3)], {"blocksize": 3, "mode": "CRD"}),
        Case("SpaceToDepth", [rand(2, 3, 4, 6)], {"blocksize": 2}),
        # Too big to fold (over 64 KiB from a few bytes): computed at run time.
        Case("Range", [np.int64(-7), np.int64(40000), np.int64(3)], const_inputs=[0, 1, 2]),
        # onnxruntime adds delta 20000 times in float32, flowc computes start + i * delta: a
        # delta of 0.25 keeps both exact.
        Case(
            "Range",
            [np.float32(0.5), np.float32(5000.5), np.float32(0.25)],
            const_inputs=[0, 1, 2],
        ),
    ]
    check_compiled(cases, tmp_path)


def _index_cases() -> list[Case]:
    data = rand(5, 4, 3)
    scatter_data = rand(4, 5)
    cases = [
        # Case 0 also runs with an index out of range (test below): keep it first.
        Case("Gather", [data, i64(0, -1, 4, 2)], {"axis": 0}),
        Case("Gather", [data, np.array([[1, -4], [3, 0]], np.int32)], {"axis": 1}),
        Case("Gather", [data, np.int64(-2)], {"axis": -1}),
        Case("Gather", [ints(6), i64(5, 0, 0, -6)]),
        Case("Gather", [rand(10, 4), ints(3, 2, lo=-10, hi=10)], const_inputs=[0]),  # a table
        Case("GatherElements", [rand(3, 4), ints(2, 4, lo=-3, hi=3)], {"axis": 0}),
        Case("GatherElements", [rand(3, 4), ints(3, 2, lo=-4, hi=4).astype(np.int32)], {"axis": 1}),
        Case("GatherElements", [ints(2, 3, 4), ints(2, 2, 5, lo=-4, hi=4)], {"axis": 2}),
        Case("GatherND", [rand(3, 4, 5), np.array([[0, 1], [2, -1], [1, 3]], np.int64)]),
        Case("GatherND", [rand(3, 4, 5), np.array([[[1]], [[-1]]], np.int64)]),
        Case(
            "GatherND",
            [rand(2, 3, 4), np.array([[[1, 2], [0, 0]], [[2, -1], [1, 3]]], np.int64)],
            {"batch_dims": 1},
        ),
        Case("GatherND", [ints(2, 3), np.array([[0, 2], [1, -3]], np.int64)]),
    ]
    dup0 = np.array([[1, 0, 2, 3, 1], [1, -4, 0, 3, 1]], np.int64)  # repeats on axis 0
    dup1 = np.array([[0, 0, 4], [1, -1, 1], [2, 2, 2], [3, 0, 3]], np.int64)  # and on axis 1
    for reduction in ["none", "add", "mul", "max", "min"]:
        unique0 = np.array([[1, 0, 2, 3, 0], [2, 3, 0, 1, 1]], np.int64)
        cases += [
            Case(
                "ScatterElements",
                [scatter_data, unique0 if reduction == "none" else dup0, rand(2, 5)],
                {"axis": 0, "reduction": reduction},
            ),
            Case(
                "ScatterElements",
                [scatter_data, dup1, rand(4, 3)],
                {"axis": 1, "reduction": reduction},
            ),
        ]
    nd_unique = np.array([[0, 1], [3, -1], [2, 2]], np.int64)
    nd_dup = np.array([[0, 1], [3, -1], [0, 1], [3, 4]], np.int64)
    for reduction in ["none", "add", "mul", "max", "min"]:
        idx = nd_unique if reduction == "none" else nd_dup
        cases += [
            Case(
                "ScatterND",
                [scatter_data, idx, rand(len(idx))],
                {"reduction": reduction},
            ),
            Case(
                "ScatterND",
                [
                    rand(4, 3, 2),
                    np.array([[2], [0], [2]][: 2 if reduction == "none" else 3]),
                    rand(2 if reduction == "none" else 3, 3, 2),
                ],
                {"reduction": reduction},
            ),
        ]
    m = rand(2, 4, 5)
    cases += [
        Case("Trilu", [m]),
        Case("Trilu", [m, np.int64(-1)], {"upper": 0}, const_inputs=[1]),
        Case("Trilu", [m, np.int64(2)], {"upper": 1}, const_inputs=[1]),
        Case("Trilu", [ints(5, 3), np.int64(1)], {"upper": 0}),  # k computed at run time
    ]
    ties = RNG.integers(0, 4, (3, 7)).astype(np.float32)
    cases += [
        Case("TopK", [rand(3, 8), i64(3)], num_outputs=2, const_inputs=[1]),
        Case("TopK", [ties, i64(5)], {"largest": 0}, num_outputs=2, const_inputs=[1]),
        Case("TopK", [ties, i64(7)], {"largest": 1}, num_outputs=2, const_inputs=[1]),
        Case("TopK", [rand(6, 2, 3), i64(4)], {"axis": 0}, num_outputs=2, const_inputs=[1]),
        Case(
            "TopK", [ints(4, 5, lo=0, hi=3), i64(2)], {"axis": 1}, num_outputs=2, const_inputs=[1]
        ),
    ]
    on_off = f32(-1.0, 3.0)
    cases += [
        Case("OneHot", [i64(0, 2, -1, 5, 1), i64(4), on_off], const_inputs=[1]),
        Case("OneHot", [ints(2, 3, lo=-3, hi=3), i64(3), on_off], {"axis": 0}, const_inputs=[1]),
        Case("OneHot", [ints(2, 3, lo=0, hi=4), i64(4), i64(0, 7)], {"axis": 1}, const_inputs=[1]),
        Case("EyeLike", [rand(3, 5)]),
        Case("EyeLike", [rand(4, 3)], {"k": -2, "dtype": 7}),
        Case("EyeLike", [ints(4, 4)], {"k": 1}),
    ]
    return cases


def _feeds(cases: list[Case]) -> dict[str, np.ndarray]:
    """The run-time inputs of check_compiled's model, by its names."""
    return {
        f"c{k}_in{i}": np.asarray(a)
        for k, c in enumerate(cases)
        for i, a in enumerate(c.inputs)
        if a is not None and i not in c.const_inputs
    }


def test_index_ops_compiled_and_out_of_range_indices(tmp_path: Path) -> None:
    cases = _index_cases()
    check_compiled(cases, tmp_path)
    # The same program with an index past the end: the run fails with the error flag's
    # message; it neither crashes nor touches memory out of bounds.
    good = _feeds(cases)
    bad = dict(good)
    bad["c0_in1"] = i64(0, 1, 5, 2)
    with pytest.raises(FlowcError, match="index was out of range"):
        run(tmp_path / "project", bad)
    # Every other kernel that checks indices: its first case with one index far too large.
    ops = ["GatherElements", "GatherND", "ScatterElements", "ScatterND"]
    for op in ops:
        k = next(k for k, c in enumerate(cases) if c.op_type == op)
        bad = dict(good)
        idx = np.array(good[f"c{k}_in1"])
        idx.reshape(-1)[-1] = 1000
        bad[f"c{k}_in1"] = idx
        with pytest.raises(FlowcError, match="index was out of range"):
            run(tmp_path / "project", bad)


def test_ops_that_normally_fold_compiled(tmp_path: Path) -> None:
    """ConstantOfShape always folds when imported and Upsample imports as Resize, so their
    emitters are checked on a graph built without folding, against the NumPy reference."""
    g = Graph("nofold")
    b = GraphBuilder(g, fold=False)
    x = g.add_input("x", TensorType((1, 2, 3, 4), DType.F32))
    shape = b.constant("shape", i64(3, 4))
    outs = [
        *b.emit("ConstantOfShape", [shape], {"value": f32(2.5)}, name="fill_f"),
        *b.emit("ConstantOfShape", [shape], {"value": i64(-3)}, name="fill_i"),
        *b.emit("Upsample", [x, b.constant("s1", f32(1, 1, 2, 3))], {"mode": "nearest"}),
        *b.emit("Upsample", [x, b.constant("s2", f32(1, 1, 1.5, 2))], {"mode": "linear"}),
        *b.emit(
            "Range",
            [
                b.constant("a", np.float32(1)),
                b.constant("z", np.float32(9)),
                b.constant("d", np.float32(0.5)),
            ],
        ),
        *b.emit("Split", [x], {"axis": 3, "num_outputs": 2}, num_outputs=2),
    ]

    # A chain: a view (Reshape) feeds kernels whose results live in the arena.
    def c(name: str, a: np.ndarray) -> Any:
        return b.constant(name, a)

    (v,) = b.emit("Reshape", [x, c("shape3", i64(6, 4))])
    (rev,) = b.emit("Slice", [v, c("s0", i64(-1)), c("e0", i64(I64_MIN)), None, c("st", i64(-2))])
    (tiled,) = b.emit("Tile", [v, c("reps", i64(1, 2))])
    (t,) = b.emit("Transpose", [tiled], {"perm": [1, 0]})
    (top,) = b.emit("Slice", [t, c("s1", i64(0)), c("e1", i64(3))])
    (cat,) = b.emit("Concat", [rev, top], {"axis": 1})
    outs += b.emit("TopK", [cat, c("k", i64(2))], {"axis": 0}, num_outputs=2)
    g.outputs = outs
    verify_graph(g)
    feeds = {"x": rand(1, 2, 3, 4)}
    want = evaluate(g, feeds)
    compile_graph(g, tmp_path / "project")
    build(tmp_path / "project")
    got, _ = run(tmp_path / "project", feeds)
    for name, ref in want.items():
        c = compare(name, got[name], np.asarray(ref), 1e-5)
        assert c.ok, f"{name}: {c.reason or c.error}"
