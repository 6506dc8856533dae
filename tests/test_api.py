"""The Python API (flowc.compile, Project, Model), and a project's life as the command line
sees it: which target, a build older than its project, a build interrupted (issue 27)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import SHARED_MODELS

import flowc
from flowc.api import _aligned_empty

MODEL = SHARED_MODELS / "mlp.onnx"


def io() -> tuple[np.ndarray, np.ndarray]:
    """mlp.onnx's input and the output its exporter recorded (tests/data/models)."""
    data = np.load(SHARED_MODELS / "mlp.io.npz")
    return data["in:x"], data["out:y"]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flowc", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> flowc.Project:
    out = tmp_path_factory.mktemp("api") / "out"
    p = flowc.compile(str(MODEL), out, target="host", prefix="mlp")
    p.build(quick=True)
    return p


def test_import_flowc_is_light_and_names_the_api_lazily() -> None:
    code = (
        "import sys, flowc\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('numpy', 'onnx', 'click', 'rich', 'jinja2', 'lark', 'flowc') and m != 'flowc' "
        "and m != 'flowc.version')\n"
        "assert not heavy, heavy\n"
        "assert callable(flowc.compile) and flowc.Project.__name__ == 'Project'\n"
        "assert issubclass(flowc.InputError, flowc.FlowcError)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_compile_load_run_matches_the_exporters_outputs(project: flowc.Project) -> None:
    x, expected = io()
    assert [s.name for s in project.inputs] == ["x"] and project.target == "host"
    with project.load() as model:
        got = model.run({"x": x})
        assert set(got) == {"y"} and got["y"].dtype == np.float32
        np.testing.assert_allclose(got["y"], expected, rtol=1e-5, atol=1e-5)
        # The driver program (what `flowc run` runs) gives the same bytes.
        by_driver = project.run({"x": x})
        np.testing.assert_array_equal(by_driver["y"], got["y"])


class CudaArray:
    """An array in the device's memory as CuPy or PyTorch hand it over: on the host target
    device memory is host memory, so a NumPy buffer behind the interface is one."""

    def __init__(self, a: np.ndarray, readonly: bool = False) -> None:
        self.a, self.readonly = a, readonly

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "data": (self.a.ctypes.data, self.readonly),
            "shape": self.a.shape,
            "typestr": self.a.dtype.str,
            "strides": None if self.a.flags.c_contiguous else self.a.strides,
            "version": 3,
        }


class DLPackArray:
    """An array handed over through DLPack only (a CPU tensor: host-target device memory)."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def __dlpack__(self, **kw: Any) -> Any:
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.a.__dlpack_device__()


def test_device_arrays_are_used_in_place(project: flowc.Project) -> None:
    x, expected = io()
    with project.load() as model:
        xs = _aligned_empty(model.inputs[0])
        xs[...] = x
        ys = _aligned_empty(model.outputs[0])
        got = model.run({"x": CudaArray(xs)}, outputs={"y": CudaArray(ys)})
        assert isinstance(got["y"], CudaArray)
        np.testing.assert_allclose(ys, expected, rtol=1e-5, atol=1e-5)
        via_dlpack = model.run({"x": DLPackArray(xs)})
        np.testing.assert_array_equal(via_dlpack["y"], ys)
        # A device pointer off the 256-byte alignment run() requires, a layout not dense in
        # C order, a read-only output: each an InputError saying which.
        raw = np.empty(x.nbytes + 512, np.uint8)
        off = raw[(-raw.ctypes.data % 256) + 4 :][: x.nbytes].view(np.float32).reshape(x.shape)
        with pytest.raises(flowc.InputError, match="256-byte"):
            model.run({"x": CudaArray(off)})
        with pytest.raises(flowc.InputError, match="not dense in C order"):
            model.run({"x": CudaArray(np.asfortranarray(x))})
        with pytest.raises(flowc.InputError, match="read-only"):
            model.run({"x": x}, outputs={"y": CudaArray(ys, readonly=True)})


def test_errors_are_input_errors_with_the_command_lines_messages(
    project: flowc.Project, tmp_path: Path
) -> None:
    x, _ = io()
    with project.load() as model:
        with pytest.raises(flowc.InputError) as api_error:
            model.run({"x": x[:3]})
        with pytest.raises(flowc.InputError, match="no input named 'z'"):
            model.run({"x": x, "z": x})
        with pytest.raises(flowc.InputError, match="input 'x' is not given"):
            model.run({})
    np.save(tmp_path / "x.npy", x[:3])
    r = cli("run", str(project.path), "--input", f"x={tmp_path / 'x.npy'}", "-o", "/dev/null")
    assert r.returncode == 2
    assert f"error: {api_error.value.message}" in r.stderr
    assert api_error.value.message == "input 'x': expected f32[8, 64], got float32[3, 64]"
    with pytest.raises(flowc.InputError, match="--precision 'fp8': expected one of"):
        flowc.compile(MODEL, tmp_path / "p", precision="fp8")
    with pytest.raises(flowc.InputError, match="no option 'precison'"):
        flowc.compile(MODEL, tmp_path / "p", precison="bf16")
    with pytest.raises(flowc.InputError, match="--arch sm_5"):
        flowc.compile(MODEL, tmp_path / "p", arch="sm_5")
    assert not (tmp_path / "p").exists()
    with pytest.raises(flowc.InputError, match="not a flowc project"):
        flowc.Project(tmp_path)


def test_a_project_changed_since_its_build_says_so(tmp_path: Path) -> None:
    x, expected = io()
    out = tmp_path / "out"
    p = flowc.compile(MODEL, out, target="host")
    p.build(quick=True)
    np.save(tmp_path / "x.npy", x)
    run = ("run", str(out), "--input", f"x={tmp_path / 'x.npy'}", "-o", str(tmp_path / "y.npz"))
    assert cli(*run).returncode == 0
    # A recompile that changes the program, without a rebuild.
    flowc.compile(MODEL, out, target="host", no_cuda_graph=True)
    r = cli(*run)
    assert r.returncode == 2, r.stderr
    assert f"error: {out} changed since its host build (recompiled or edited)" in r.stderr
    assert f"rebuild it: flowc build {out} --target host (or run with --rebuild)" in r.stderr
    assert "flowc-run-" not in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(flowc.InputError, match="changed since its host build"):
        p.load()
    r = cli(*run, "--rebuild")
    assert r.returncode == 0, r.stderr
    assert "changed since its host build: rebuilding" in r.stderr
    np.testing.assert_allclose(np.load(tmp_path / "y.npz")["y"], expected, rtol=1e-5, atol=1e-5)
    # A hand edit of a generated file counts too; the weights (read at start) do not.
    with open(out / "model.cu", "a") as f:
        f.write("// edited\n")
    with pytest.raises(flowc.InputError, match="changed since its host build"):
        p.run({"x": x})
    np.testing.assert_allclose(p.run({"x": x}, rebuild=True)["y"], expected, rtol=1e-5, atol=1e-5)
    # The other target was never built: run says what there is.
    r = cli(*run, "--target", "cuda", env={"FLOWC_GPU_COUNT": "1"})
    assert f"error: {out} is built for host only, not for cuda" in r.stderr


def _processes_naming(text: str) -> list[str]:
    """Live processes whose command line contains ``text`` (zombies excluded)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(cmdline)
    return found


def _interrupt_build(out: Path, whole_group: bool) -> subprocess.CompletedProcess[str]:
    """`flowc build OUT` stopped by SIGINT once a compiler runs: sent to flowc's process
    group as a terminal's Ctrl-C does, or to flowc alone as `kill -INT` does."""
    p = subprocess.Popen(
        [sys.executable, "-m", "flowc", "build", str(out), "--target", "host"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not any("cc1plus" in c for c in _processes_naming(str(out))):
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, "no compiler started"
        time.sleep(0.05)
    if whole_group:
        os.killpg(p.pid, signal.SIGINT)
    else:
        p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=60)
    return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)


def test_ctrl_c_ends_the_build_and_every_compiler_and_a_rerun_works(tmp_path: Path) -> None:
    x, expected = io()
    out = tmp_path / "out"
    flowc.compile(MODEL, out, target="host")
    bdir = out / "build-host"
    for whole_group in (True, False):
        r = _interrupt_build(out, whole_group)
        assert r.returncode == 130, (r.returncode, r.stderr)
        assert r.stderr.strip().endswith("interrupted"), r.stderr
        assert "Interrupt" not in r.stderr and "Traceback" not in r.stderr
        assert _processes_naming(str(out)) == []  # no compiler left writing objects
        if whole_group:
            assert not bdir.exists()  # the build made the folder: all of it goes
        else:
            # A folder an earlier build made stays, without a finished build in it.
            assert not list(bdir.rglob("*.o")) and not (bdir / "model_main").exists()
        r = cli("run", str(out), "--input", "x=x.npy", "-o", "y.npz")
        assert r.returncode == 2 and f"{out} is not built for host" in r.stderr, r.stderr
        if whole_group:
            # Leave a configured folder behind for the second round.
            subprocess.run(["cmake", "-S", str(out), "-B", str(bdir)], capture_output=True)
    project = flowc.Project(out)
    project.build()
    np.testing.assert_allclose(project.run({"x": x})["y"], expected, rtol=1e-5, atol=1e-5)


def test_a_project_rebuilt_in_place_loads_its_new_code_in_the_same_process(
    tmp_path: Path,
) -> None:
    """The dynamic loader keys loaded libraries by path: a project recompiled (here for
    another batch) and rebuilt where it was must not run the code loaded before it."""
    import onnx
    import onnxruntime as ort
    from test_recompute import _blocks

    from flowc.harness.ort import inference_mode

    model = _blocks(tmp_path / "tower.onnx", blocks=1)
    plain = inference_mode(onnx.load(str(model))).SerializeToString()  # dropout off
    sess = ort.InferenceSession(plain, providers=["CPUExecutionProvider"])
    out = tmp_path / "p"
    rng = np.random.default_rng(0)
    for batch in (2, 5):
        x = rng.standard_normal((batch, 8, 32)).astype(np.float32)
        p = flowc.compile(model, out, target="host", dim=[f"batch={batch}"], force=True)
        p.build(quick=True)
        with p.load() as m:
            got = m.run({"x": x})["y"]
        (want,) = sess.run(None, {"x": x})
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
