"""The CLI's smaller robustness defects (issue 12, items 6 and 12): run on folders that are no
project, CUDA runs without a GPU, verify without its reference, Ctrl-C at start-up, which
passes the op tables count, the --dim hint, raw-byte (bfloat16) .npy inputs, and the
target each command chooses and prints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from conftest import SHARED_MODELS
from onnx import TensorProto, helper

from flowc.harness.build import build


def flowc(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flowc", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def assert_clean_error(r: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    for f in fragments:
        assert f in r.stderr, f"{f!r} not in {r.stderr!r}"


def _bf16_model(path: Path) -> Path:
    """y = float32(x) + z with x a bfloat16 input: the .npy of x saves as raw bytes (|V2)."""
    g = helper.make_graph(
        [
            helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
            helper.make_node("Add", ["xf", "z"], ["y"]),
        ],
        "bf16_in",
        [
            helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 3]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path


@pytest.fixture(scope="module")
def bf16_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bf16")
    out = root / "out"
    r = flowc("compile", str(_bf16_model(root / "m.onnx")), "-o", str(out), "--target", "host")
    assert r.returncode == 0, r.stderr
    build(out, "host")
    return out


def test_run_takes_bfloat16_npy_by_the_declared_type(bf16_project: Path, tmp_path: Path) -> None:
    x = np.array([[1.5, -2.25, 3.0], [0.0, 1e3, -7.5]], dtype=ml_dtypes.bfloat16)
    z = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "z.npy", z)
    assert np.load(tmp_path / "x.npy").dtype == np.dtype("V2")  # what NumPy gives back
    out = tmp_path / "y.npz"
    r = flowc(
        "run", str(bf16_project), "--input", f"x={tmp_path / 'x.npy'}",
        "--input", f"z={tmp_path / 'z.npy'}", "-o", str(out), "--target", "host",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(np.load(out)["y"], x.astype(np.float32) + z)
    # A raw item of the wrong size is refused by name.
    np.save(tmp_path / "bad.npy", np.zeros((2, 3), dtype="V4"))
    r = flowc(
        "run", str(bf16_project), "--input", f"x={tmp_path / 'bad.npy'}",
        "--input", f"z={tmp_path / 'z.npy'}", "-o", str(out), "--target", "host",
    )  # fmt: skip
    assert_clean_error(r, "--input x", "bf16")


def test_eval_takes_bfloat16_npy(tmp_path: Path) -> None:
    x = np.array([[1.5, -2.25, 3.0], [0.0, 1e3, -7.5]], dtype=ml_dtypes.bfloat16)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "z.npy", np.ones((2, 3), np.float32))
    r = flowc(
        "eval", str(_bf16_model(tmp_path / "m.onnx")), "--input", f"x={tmp_path / 'x.npy'}",
        "--input", f"z={tmp_path / 'z.npy'}", "-o", str(tmp_path / "y.npz"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "y.npz")["y"], x.astype(np.float32) + 1)
    # Raw bytes for a type NumPy names (float32 is '<f4') are refused, as the driver does;
    # they used to be read as float32 bytes.
    np.save(tmp_path / "raw.npy", np.ones((2, 3), np.float32).view("V4"))
    r = flowc(
        "eval", str(tmp_path / "m.onnx"), "--input", f"x={tmp_path / 'x.npy'}",
        "--input", f"z={tmp_path / 'raw.npy'}", "-o", str(tmp_path / "y.npz"),
    )  # fmt: skip
    assert_clean_error(r, "--input z", "(|V4) are not f32")


def test_run_on_a_missing_or_foreign_folder(tmp_path: Path) -> None:
    out = str(tmp_path / "y.npz")
    assert_clean_error(flowc("run", str(tmp_path / "nowhere"), "-o", out), "no such project folder")
    (tmp_path / "notes.txt").write_text("not a project")
    assert_clean_error(flowc("run", str(tmp_path), "-o", out), "not a flowc project")
    (tmp_path / "flowc_model.json").write_text("{broken")
    assert_clean_error(flowc("run", str(tmp_path), "-o", out), "flowc_model.json: unreadable")


def test_cuda_run_and_verify_without_a_gpu_say_so(bf16_project: Path, tmp_path: Path) -> None:
    no_gpu = {"FLOWC_GPU_COUNT": "0"}
    r = flowc(
        "run", str(bf16_project), "--target", "cuda", "-o", str(tmp_path / "y.npz"), env=no_gpu
    )
    assert_clean_error(r, "no GPU")
    assert "memory" not in r.stderr
    r = flowc("verify", str(SHARED_MODELS / "mlp.onnx"), "--target", "cuda", env=no_gpu)
    assert_clean_error(r, "no GPU")
    assert "configure" not in r.stderr  # refused before any build


def test_verify_without_onnxruntime_fails_before_building(tmp_path: Path) -> None:
    # An onnxruntime that cannot be imported, first on the path: as if it were not installed.
    (tmp_path / "onnxruntime").mkdir()
    (tmp_path / "onnxruntime" / "__init__.py").write_text("raise ImportError('blocked')\n")
    t0 = time.perf_counter()
    r = flowc(
        "verify", str(SHARED_MODELS / "mlp.onnx"), "--target", "host",
        env={"PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert_clean_error(r, "onnxruntime", "pip install")
    assert "configure" not in r.stderr and "compiling" not in r.stderr
    assert time.perf_counter() - t0 < 20


def test_ctrl_c_during_start_up_prints_no_traceback() -> None:
    # Interrupts at several moments of start-up (imports, model loading): each ends quietly.
    # flowc can act on a signal only once its first line runs (flowc/__main__.py), after the
    # interpreter's own start-up, whose time on this machine, now, the delays start from.
    starts = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import flowc.entry"], check=True)
        starts.append(time.perf_counter() - t0)
    ready = 1.5 * max(starts)
    for delay in (ready + d for d in (0.0, 0.1, 0.25, 0.45, 0.75)):
        p = subprocess.Popen(
            [sys.executable, "-m", "flowc", "inspect", str(SHARED_MODELS / "gpt2_tiny.onnx")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=60)
        assert "Traceback" not in stderr + stdout, (delay, stderr)
        assert p.returncode in (0, 130), (delay, p.returncode, stderr)
        if p.returncode == 130:
            assert "interrupted" in stderr


def test_inspect_tables_say_which_passes_ran() -> None:
    model = str(SHARED_MODELS / "gpt2_tiny.onnx")
    plain, memory = flowc("inspect", model), flowc("inspect", model, "--memory")
    assert plain.returncode == 0 and memory.returncode == 0, plain.stderr + memory.stderr
    assert "nodes after fold_constants, simplify)" in plain.stdout
    from flowc.passes.manager import COMPILE_PIPELINE

    # The compile pipeline, spelled out: the passes themselves are the manager's list.
    assert COMPILE_PIPELINE[:3] == ("fold_constants", "simplify", "lower_ops")
    assert f"nodes after {', '.join(COMPILE_PIPELINE)})" in memory.stdout


def test_dim_hint_for_a_symbol_named_n(tmp_path: Path) -> None:
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "dyn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
    )
    path = tmp_path / "dyn.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    r = flowc("inspect", str(path))
    assert_clean_error(r, "--dim N=<size>")
    assert "N=N" not in r.stderr


def test_commands_print_the_target_they_chose(bf16_project: Path, tmp_path: Path) -> None:
    # One rule for compile, build, run and verify (issue 27): the project's recorded target,
    # else cuda where a GPU is present, else host -- nvcc alone does not make it cuda.
    model = _bf16_model(tmp_path / "m.onnx")
    out = tmp_path / "out"
    r = flowc("compile", str(model), "-o", str(out), env={"FLOWC_GPU_COUNT": "0"})
    assert r.returncode == 0, r.stderr
    assert "target host (no GPU found; --target to choose)" in r.stderr
    assert r.stdout.strip().endswith(f"build it with: flowc build {out}"), r.stdout
    r = flowc("compile", str(model), "-o", str(out), env={"FLOWC_GPU_COUNT": "1"})
    assert "target cuda (a GPU is present" in r.stderr and f"{out} --target cuda" in r.stdout
    # A recorded target wins over the machine's: build, run and verify all read it.
    r = flowc("compile", str(model), "-o", str(out), "--target", "host",
              env={"FLOWC_GPU_COUNT": "1"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "flowc_model.json").read_text())["target"] == "host"
    from flowc.api import resolve_target

    os.environ["FLOWC_GPU_COUNT"] = "1"
    try:
        assert resolve_target(None, out)[0] == "host"
        assert "compiled with --target host" in resolve_target(None, out)[1]
        assert resolve_target(None, tmp_path)[0] == "cuda"  # no project there
        assert resolve_target("cuda", out)[0] == "cuda"
    finally:
        del os.environ["FLOWC_GPU_COUNT"]
    # The fixture's project was compiled with --target host: run keeps to it.
    np.save(tmp_path / "x.npy", np.zeros((2, 3), ml_dtypes.bfloat16))
    np.save(tmp_path / "z.npy", np.zeros((2, 3), np.float32))
    r = flowc(
        "run", str(bf16_project), "--input", f"x={tmp_path / 'x.npy'}",
        "--input", f"z={tmp_path / 'z.npy'}", "-o", str(tmp_path / "y.npz"),
        env={"FLOWC_GPU_COUNT": "0"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "target host (the project was compiled with --target host" in r.stderr
    # Asked for the target it was not built for, run says what it was built for.
    r = flowc(
        "run", str(bf16_project), "--input", f"x={tmp_path / 'x.npy'}",
        "--input", f"z={tmp_path / 'z.npy'}", "-o", str(tmp_path / "y.npz"), "--target",
        "cuda", env={"FLOWC_GPU_COUNT": "1"},
    )  # fmt: skip
    assert_clean_error(r, "is built for host only, not for cuda")
    assert "--target host" in r.stderr
    r = flowc("build", str(bf16_project), "--target", "host")
    assert r.returncode == 0, r.stderr
    assert "target host (given by --target)" in r.stderr


def test_search_nodes_is_a_work_limit_the_printout_reports() -> None:
    # vit_tiny's fused graph on 2x2 needs the ILP (gpt2_tiny's is solved by elimination).
    model = str(SHARED_MODELS / "vit_tiny.onnx")
    r = flowc("inspect", model, "--mesh", "2x2", "--search-nodes", "0")
    assert r.returncode == 0, r.stderr
    assert "NOT PROVEN OPTIMAL" in r.stdout and "node limit 0 reached" in r.stdout
    assert_clean_error(flowc("inspect", model, "--search-nodes", "5"), "--search-nodes need")


def test_input_npy_headers_are_checked_before_numpy_reads_them(tmp_path: Path) -> None:
    """A dimension past int64 was an internal error (OverflowError), a call in the header
    said "<ast.Call object at 0x...>"; both now say what the header holds."""
    np.save(tmp_path / "ok.npy", np.ones((2, 3), np.float32))
    header = (tmp_path / "ok.npy").read_bytes()
    model = str(_bf16_model(tmp_path / "m.onnx"))
    for name, shape, fragment in (
        ("big", b"(99999999999999999999, 3)", "outside 0 to 9223372036854775807"),
        ("call", b"(os.system('x'), 3)", "os.system('x')"),
    ):
        (tmp_path / f"{name}.npy").write_bytes(header.replace(b"(2, 3)", shape))
        r = flowc(
            "eval", model, "--input", f"z={tmp_path / f'{name}.npy'}", "--random-inputs",
            "-o", str(tmp_path / "y.npz"),
        )  # fmt: skip
        assert_clean_error(r, "--input z", fragment)
