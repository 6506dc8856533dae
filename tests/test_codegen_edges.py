"""Edge cases of generated programs found in review: mixed-type Pow, CastLike, models with
no inputs, zero-size tensors, integer fills at the type's limits, per-run error status, and
the driver's argument checks."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from opcheck import Case, check_compiled

from flowc.compiler import compile_graph
from flowc.errors import InputError
from flowc.frontend.onnx import import_model
from flowc.harness.build import build, build_dir, run
from flowc.passes.manager import COMPILE_PIPELINE, PassManager


def _model(nodes, inputs, outputs, inits=()):  # type: ignore[no-untyped-def]
    g = helper.make_graph(nodes, "edge", inputs, outputs, initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _build(model: onnx.ModelProto, out: Path) -> Path:
    compile_graph(PassManager(COMPILE_PIPELINE).run(import_model(model)), out, poison=True)
    bdir = build(out, "host", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
    return out


def test_mixed_types_castlike_and_zero_size(tmp_path: Path) -> None:
    x = np.arange(1, 5, dtype=np.int32)
    cases = [
        Case("Pow", [x, np.array([0.5], np.float32)]),
        Case("Pow", [np.linspace(0.5, 2, 6).astype(np.float32), np.array(3, np.int64)]),
        Case("CastLike", [np.linspace(-2, 2, 3).astype(np.float32), np.zeros((2, 2), np.float64)]),
        Case("Relu", [np.zeros((0, 3), np.float32)]),
        Case("Add", [np.zeros((0, 3), np.float32), np.ones(3, np.float32)]),
    ]
    check_compiled(cases, tmp_path)


def test_constant_only_model_and_integer_limits(tmp_path: Path) -> None:
    nodes = [
        helper.make_node(
            "ConstantOfShape",
            ["shape"],
            ["lo"],
            value=numpy_helper.from_array(np.array([-(2**63)], np.int64)),
        ),
        helper.make_node(
            "ConstantOfShape",
            ["shape"],
            ["hi"],
            value=numpy_helper.from_array(np.array([2**64 - 1], np.uint64)),
        ),
    ]
    inits = [numpy_helper.from_array(np.array([64], np.int64), "shape")]
    outs = [
        helper.make_tensor_value_info("lo", TensorProto.INT64, [64]),
        helper.make_tensor_value_info("hi", TensorProto.UINT64, [64]),
    ]
    out = _build(_model(nodes, [], outs, inits), tmp_path / "out")
    got, _ = run(out, {})
    assert (got["lo"] == -(2**63)).all() and (got["hi"] == 2**64 - 1).all()


def test_errors_do_not_outlive_their_run(tmp_path: Path) -> None:
    table = np.arange(10, dtype=np.float32)
    nodes = [helper.make_node("Gather", ["table", "idx"], ["y"], axis=0)]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("idx", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        [numpy_helper.from_array(table, "table")],
    )
    out = _build(model, tmp_path / "out")
    lib = ctypes.CDLL(str(build_dir(out, "host") / "libedge_model.so"))
    lib.edge_last_error.restype = ctypes.c_char_p
    m = ctypes.c_void_p()
    assert lib.edge_create(str(out / "weights.bin").encode(), ctypes.byref(m)) == 0
    y = np.zeros(3, np.float32)
    for idx, bad in (([1, 99, 2], True), ([1, -1, 2], False), ([0, 0, 0], False)):
        i = np.array(idx, np.int64)
        assert (
            lib.edge_run(
                m, (ctypes.c_void_p * 1)(i.ctypes.data), (ctypes.c_void_p * 1)(y.ctypes.data), None
            )
            == 0
        )
        # The run's status is known once it has ended (model.h): synchronize says it, and
        # last_error then reads it without a CUDA call of its own.
        assert (lib.edge_synchronize(m) != 0) == bad, idx
        message = lib.edge_last_error(m)
        assert (b"out of range" in message) == bad, (idx, message)
        if not bad:
            assert np.array_equal(y, table[i])
    lib.edge_destroy(m)


def test_driver_and_harness_check_their_arguments(tmp_path: Path) -> None:
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    out = _build(model, tmp_path / "out")
    x = np.asfortranarray(np.arange(6, dtype=">f4").reshape(2, 3))  # converted for the driver
    got, _ = run(out, {"x": x})
    assert np.array_equal(got["y"], np.maximum(np.asarray(x, np.float32), 0))
    with pytest.raises(InputError, match=r"input 'x': expected f32\[2, 3\], got float64\[2, 3\]"):
        run(out, {"x": np.zeros((2, 3))})
    exe = str(build_dir(out, "host") / "model_main")
    np.save(tmp_path / "x.npy", np.zeros((2, 3), np.float32))
    base = [exe, "--weights", str(out / "weights.bin"), "--out-dir", str(tmp_path)]
    for extra, message in (
        (["--input", f"x={tmp_path / 'x.npy'}", "--bench", "abc"], "--bench abc"),
        (
            ["--input", f"x={tmp_path / 'x.npy'}", "--input", f"x={tmp_path / 'x.npy'}"],
            "given twice",
        ),
    ):
        r = subprocess.run(base + extra, capture_output=True, text=True)
        assert r.returncode == 2 and message in r.stderr, r.stderr
    r = subprocess.run(
        [*base, "--input", f"x={tmp_path / 'x.npy'}", "--bench", "3"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "bench: 3 runs, median" in r.stdout
