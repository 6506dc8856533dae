"""The generated project as a user meets it: deterministic, self-contained, escaped names,
a C API that links twice into one program, and builds that take new weights and inputs."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from flowc.codegen.program import layout_weights
from flowc.codegen.project import write_weights
from flowc.compiler import compile_graph
from flowc.errors import FlowcError
from flowc.frontend.onnx import import_model
from flowc.harness.build import build, build_dir, run
from flowc.harness.compare import max_rel_error
from flowc.interpreter import evaluate
from flowc.passes.manager import COMPILE_PIPELINE, PassManager

ODD = 'in"put */ \\x\nnext\t??='
ODD_OUT = 'out\\"*/'


def _model(x_name: str = "x", y_name: str = "y", scale: float = 0.5) -> onnx.ModelProto:
    w = np.linspace(-1, 1, 12).astype(np.float32).reshape(3, 4) * scale
    nodes = [
        helper.make_node("Mul", [x_name, "w"], ["m"]),
        helper.make_node("Tanh", ["m"], ["t"]),
        helper.make_node("Add", ["t", "b"], [y_name]),
    ]
    g = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info(x_name, TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info(y_name, TensorProto.FLOAT, [3, 4])],
        initializer=[
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(np.full((4,), 0.25, np.float32), "b"),
        ],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _graph(model: onnx.ModelProto):  # type: ignore[no-untyped-def]
    return PassManager(COMPILE_PIPELINE).run(import_model(model))


@pytest.fixture(scope="module")
def odd_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("odd") / "out"
    compile_graph(_graph(_model(ODD, ODD_OUT)), out, prefix="odd", poison=True)
    build(out, "host")
    return out


def test_names_are_escaped_and_returned_byte_for_byte(odd_project: Path) -> None:
    source = (odd_project / "model.cu").read_text()
    assert "*/" not in source.replace("// Generated", "")
    lib = ctypes.CDLL(str(build_dir(odd_project, "host") / "libodd_model.so"))
    lib.odd_input_name.restype = ctypes.c_char_p
    lib.odd_output_name.restype = ctypes.c_char_p
    lib.odd_input_shape.restype = ctypes.POINTER(ctypes.c_int64)
    assert lib.odd_num_inputs() == 1 and lib.odd_num_outputs() == 1
    assert lib.odd_input_name(0) == ODD.encode()
    assert lib.odd_output_name(0) == ODD_OUT.encode()
    assert lib.odd_input_rank(0) == 2 and lib.odd_input_shape(0)[1] == 4
    assert lib.odd_input_dtype(0) == TensorProto.FLOAT and lib.odd_input_name(1) is None


def test_new_inputs_and_new_weights_reuse_the_build(odd_project: Path, tmp_path: Path) -> None:
    model = _model(ODD, ODD_OUT)
    g = _graph(model)
    for seed in (1, 2):  # inputs drawn after the build
        x = np.random.default_rng(seed).standard_normal((3, 4)).astype(np.float32)
        got, _ = run(odd_project, {ODD: x})
        assert max_rel_error(got[ODD_OUT], evaluate(g, {ODD: x})[ODD_OUT]) <= 1e-6
    # Same layout, other values: the same build runs them.
    other = _graph(_model(ODD, ODD_OUT, scale=-3.0))
    wfile = tmp_path / "other.bin"
    write_weights(wfile, layout_weights(other))
    x = np.ones((3, 4), np.float32)
    got, _ = run(odd_project, {ODD: x}, weights=wfile)
    assert max_rel_error(got[ODD_OUT], evaluate(other, {ODD: x})[ODD_OUT]) <= 1e-6
    # Files that do not fit are refused with a clear message: cut short, another model.
    small = tmp_path / "small.bin"
    small.write_bytes((odd_project / "weights.bin").read_bytes()[:-256])
    with pytest.raises(FlowcError, match=r"small\.bin is truncated"):
        run(odd_project, {ODD: x}, weights=small)
    other.constants[0].name = "renamed"
    write_weights(wfile, layout_weights(other))
    with pytest.raises(FlowcError, match="written for another model"):
        run(odd_project, {ODD: x}, weights=wfile)


def test_c_api_runs_through_ctypes(odd_project: Path) -> None:
    # The GPU harness drives run() this way; on the host build device pointers are host pointers.
    lib = ctypes.CDLL(str(build_dir(odd_project, "host") / "libodd_model.so"))
    lib.odd_last_error.restype = ctypes.c_char_p
    model = ctypes.c_void_p()
    assert lib.odd_create(str(odd_project / "weights.bin").encode(), ctypes.byref(model)) == 0
    x = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    y = np.zeros((3, 4), np.float32)
    ins = (ctypes.c_void_p * 1)(x.ctypes.data)
    outs = (ctypes.c_void_p * 1)(y.ctypes.data)
    assert lib.odd_run(model, ins, outs, None) == 0
    assert lib.odd_synchronize(model) == 0
    want = evaluate(_graph(_model(ODD, ODD_OUT)), {ODD: x})[ODD_OUT]
    assert np.abs(y - want).max() <= 1e-6
    # model.h promises 16-byte alignment to the kernels' vector loads and the GEMM plans:
    # run() refuses an input 4 bytes off, saying which.
    shifted = np.zeros(13, np.float32)
    addr = shifted.ctypes.data
    addr += 4 if addr % 16 == 0 else 0
    off = (ctypes.c_void_p * 1)(addr)
    assert lib.odd_run(model, off, outs, None) != 0
    assert b"-byte aligned" in lib.odd_last_error(model)
    lib.odd_destroy(model)  # waits for the queued work
    bad = ctypes.c_void_p()
    assert lib.odd_create(b"/nonexistent/weights.bin", ctypes.byref(bad)) != 0
    assert b"cannot open" in lib.odd_last_error(None)


def test_compile_is_deterministic(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(_model(), str(path))
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / f"out{seed}"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run(
            [sys.executable, "-m", "flowc", "compile", str(path), "-o", str(out)],
            check=True,
            env=env,
            capture_output=True,
        )
        outs.append(out)
    files = sorted(p.relative_to(outs[0]) for p in outs[0].rglob("*") if p.is_file())
    assert files and files == sorted(
        p.relative_to(outs[1]) for p in outs[1].rglob("*") if p.is_file()
    )
    for f in files:
        assert (outs[0] / f).read_bytes() == (outs[1] / f).read_bytes(), f


def test_project_builds_alone_and_links_no_python(odd_project: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(odd_project, copy, ignore=shutil.ignore_patterns("build-*"))
    bdir = copy / "b"
    env = {"PATH": "/usr/bin:/bin"}
    for cmd in (
        ["cmake", "-S", str(copy), "-B", str(bdir), "-DFLOWC_TARGET=host"],
        ["cmake", "--build", str(bdir), "-j", "2"],
    ):
        r = subprocess.run(
            ["env", "-i", *(f"{k}={v}" for k, v in env.items()), *cmd],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert "warning" not in (r.stdout + r.stderr).lower()
    ldd = subprocess.run(["ldd", str(bdir / "model_main")], capture_output=True, text=True).stdout
    assert "python" not in ldd.lower()


def test_two_models_link_into_one_driver(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    compile_graph(_graph(_model(scale=1.0)), a, prefix="first")
    compile_graph(_graph(_model(scale=2.0)), b, prefix="second")
    build(a, "host")
    build(b, "host")
    driver = tmp_path / "both.cc"
    driver.write_text(
        """
#include <cstdio>
#include "a/model.h"
#include "b/model.h"
int main() {
  first_model* m1 = nullptr;
  second_model* m2 = nullptr;
  if (first_create("a/weights.bin", &m1) || second_create("b/weights.bin", &m2)) {
    std::printf("create failed: %s\\n", first_last_error(nullptr));
    return 1;
  }
  // On the host build, device pointers are host pointers.
  float x[12], y1[12], y2[12];
  for (int i = 0; i < 12; ++i) x[i] = 0.1f * (float)i;
  const void* in[] = {x};
  void* out1[] = {y1};
  void* out2[] = {y2};
  if (first_run(m1, in, out1, nullptr) || second_run(m2, in, out2, nullptr)) return 1;
  first_destroy(m1);  // synchronizes
  second_destroy(m2);
  std::printf("%s %s", first_input_name(0), second_output_name(0));
  for (int i = 0; i < 12; ++i) std::printf(" %.6f %.6f", y1[i], y2[i]);
  std::printf("\\n");
  return 0;
}
"""
    )
    exe = tmp_path / "both"
    la, lb = build_dir(a, "host"), build_dir(b, "host")
    subprocess.run(
        ["g++", "-std=c++17", str(driver), "-o", str(exe), f"-L{la}", f"-L{lb}", "-lfirst_model", "-lsecond_model",
         f"-Wl,-rpath,{la}:{lb}"],
        check=True, cwd=tmp_path,
    )  # fmt: skip
    r = subprocess.run([str(exe)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    words = r.stdout.split()
    assert words[:2] == ["x", "y"]
    got = np.array(words[2:], np.float64).reshape(12, 2)
    x = (0.1 * np.arange(12, dtype=np.float32)).reshape(3, 4)
    for k, scale in enumerate((1.0, 2.0)):
        want = evaluate(_graph(_model(scale=scale)), {"x": x})["y"].reshape(-1)
        assert np.abs(got[:, k] - want).max() <= 1e-5
