"""Host builds under AddressSanitizer + UBSan (`flowc build --sanitize address,undefined`):
the shared models run clean and leak-free and match their PyTorch outputs, the driver's error
paths exit with their codes and no report, and the emulator's fibers are annotated for ASan
(an exception thrown across a barrier is a false stack-buffer-underflow otherwise).

A sanitized build costs about 20 s of one core per model (main.cu 7.5 s, model.cu 7-15 s), so
these tests build the smallest set of shared models whose kernels cover all five: bert_tiny
(broadcast_copy, elementwise, fill, fused, gather, normalize, softmax_rows, strided_copy,
cuBLAS-style gemm; barriers in softmax and layer norm) and resnet_tiny (bias_add, global_pool,
max_pool, convolutions). mlp, gpt2_tiny and vit_tiny use no kernel kind outside these."""

from __future__ import annotations

import json
import os
import re
import subprocess
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, SHARED_MODELS
from test_models import _shared_io

from flowc.cli import main as cli_main
from flowc.compiler import compile_graph
from flowc.errors import InputError
from flowc.frontend.onnx import ImportOptions, import_onnx
from flowc.harness.build import build, build_dir, parse_sanitize, sanitizer_env
from flowc.harness.compare import max_rel_error
from flowc.passes.manager import COMPILE_PIPELINE, PassManager
from flowc.toolchain import host_compile_command

SAN = "address,undefined"
MODELS = ["bert_tiny", "resnet_tiny"]
TOL = 1e-4
# Any line a sanitizer prints: reports ("==123==ERROR: AddressSanitizer", "LeakSanitizer"),
# UBSan's "file:line: runtime error: ..." and ASan's warnings ("==123==WARNING: ...").
REPORT = re.compile(r"Sanitizer|runtime error:|==\d+==")


def _compile_model(name: str, out: Path) -> Path:
    feeds, _ = _shared_io(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gpt2's training-mode Dropout (tested elsewhere)
        graph = import_onnx(
            SHARED_MODELS / f"{name}.onnx",
            ImportOptions(shapes={k: v.shape for k, v in feeds.items()}),
        )
    compile_graph(PassManager(COMPILE_PIPELINE).run(graph), out, poison=True)
    return out


def _compile_fibers_program(exe: Path) -> Path:
    # The emulator's own build line, with what flowc.cmake adds for FLOWC_SANITIZE.
    cmd = host_compile_command([REPO / "tests" / "runtime" / "sanitize_fibers.cu"], exe)
    cmd[1:1] = ["-fsanitize=" + SAN, "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
    cmd = [a if a != "-O2" else "-O1" for a in cmd]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    return exe


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """MODELS and the fiber program, sanitized. The two cores each take one build at a time
    (-j1), which keeps both busy; Python compiles the next model while g++ builds."""
    root = tmp_path_factory.mktemp("sanitize")
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs: dict[str, Future[Path]] = {
            "fibers": pool.submit(_compile_fibers_program, root / "sanitize_fibers")
        }
        for name in MODELS:
            out = _compile_model(name, root / name)
            jobs[name] = pool.submit(build, out, "host", None, 1, False, SAN)
        built = {name: job.result() for name, job in jobs.items()}
    for name in MODELS:
        log = (built[name] / "flowc-build.log").read_text().lower()
        assert "warning" not in log, (name, log)
        built[name] = root / name  # the project; build_dir finds the build
    return built


def _driver(
    out: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    exe = build_dir(out, "host", SAN) / "model_main"
    return subprocess.run(
        [str(exe), *args],
        capture_output=True,
        text=True,
        env=sanitizer_env(SAN, {**os.environ, **(env or {})}),
        timeout=300,
    )


def test_sanitize_values_and_build_dirs(tmp_path: Path) -> None:
    assert parse_sanitize("undefined,address") == ("address", "undefined")
    assert parse_sanitize(None) == parse_sanitize("") == ()
    assert build_dir(tmp_path, "host") == tmp_path / "build-host"
    assert build_dir(tmp_path, "host", "address") == tmp_path / "build-host-asan"
    assert build_dir(tmp_path, "host", "undefined") == tmp_path / "build-host-ubsan"
    assert build_dir(tmp_path, "host", SAN) == tmp_path / "build-host-asan-ubsan"
    with pytest.raises(InputError, match="unknown sanitizer 'thread'"):
        parse_sanitize("address,thread")


def test_user_sanitizer_options_win(tmp_path: Path) -> None:
    env = sanitizer_env(SAN, {"ASAN_OPTIONS": "detect_leaks=0"})
    # Sanitizers read their options left to right: the user's come last.
    assert env["ASAN_OPTIONS"].startswith("halt_on_error=1:detect_leaks=1")
    assert env["ASAN_OPTIONS"].endswith(":detect_leaks=0")
    assert "halt_on_error=1" in env["UBSAN_OPTIONS"]
    assert sanitizer_env(None, {"X": "1"}) == {"X": "1"}


@pytest.mark.parametrize("name", MODELS)
def test_shared_model_is_clean_and_leak_free(builds: dict[str, Path], name: str) -> None:
    out = builds[name]
    feeds, expected = _shared_io(name)
    # The driver itself, to see that nothing at all is printed (an ASan warning does not fail
    # a run); the harness's run() is exercised by test_cli_sanitize.
    args = ["--weights", str(out / "weights.bin"), "--out-dir", str(out / "result")]
    for k, (input_name, a) in enumerate(feeds.items()):
        np.save(out / f"in{k}.npy", a)
        args += ["--input", f"{input_name}={out / f'in{k}.npy'}"]
    r = _driver(out, *args, env={"FLOWC_SIM_ORDER": "shuffle:3"})
    assert r.returncode == 0 and not REPORT.search(r.stderr), r.stderr
    listing = json.loads((out / "result" / "outputs.json").read_text())["outputs"]
    got = {o["name"]: np.load(out / "result" / o["file"]) for o in listing}
    assert set(got) == set(expected)
    for k in expected:
        assert max_rel_error(got[k], expected[k]) <= TOL, k


def test_driver_error_paths_exit_with_their_codes_and_no_report(
    builds: dict[str, Path], tmp_path: Path
) -> None:
    out = builds["resnet_tiny"]
    x = _shared_io("resnet_tiny")[0]["pixel_values"]
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "wide.npy", np.zeros((1, 3, 64, 65), np.float32))
    np.save(tmp_path / "f64.npy", x.astype(np.float64))
    (tmp_path / "garbage.npy").write_bytes(b"\x93NUMPY garbage")
    weights = (out / "weights.bin").read_bytes()
    (tmp_path / "short.bin").write_bytes(weights[: len(weights) // 2])
    (tmp_path / "a_file").write_text("")
    w = ["--weights", str(out / "weights.bin")]
    o = str(tmp_path / "o")  # never written: every case fails before
    ok_input = ["--input", f"pixel_values={tmp_path / 'x.npy'}"]
    cases: list[tuple[str, int, list[str]]] = [
        ("no arguments", 2, []),
        ("missing input", 2, [*w, "--out-dir", str(tmp_path / "o1")]),
        ("unknown input", 2, [*w, *ok_input, "--input", "nope=1.npy", "--out-dir", o]),
        ("input twice", 2, [*w, *ok_input, *ok_input, "--out-dir", str(tmp_path / "o2")]),
        (
            "wrong shape",
            2,
            [*w, "--input", f"pixel_values={tmp_path / 'wide.npy'}", "--out-dir", o],
        ),
        (
            "wrong dtype",
            2,
            [*w, "--input", f"pixel_values={tmp_path / 'f64.npy'}", "--out-dir", o],
        ),
        (
            "bad npy",
            2,
            [*w, "--input", f"pixel_values={tmp_path / 'garbage.npy'}", "--out-dir", o],
        ),
        (
            "no such input file",
            2,
            [*w, "--input", f"pixel_values={tmp_path / 'none.npy'}", "--out-dir", o],
        ),
        ("bad --bench", 2, [*w, *ok_input, "--out-dir", o, "--bench", "0"]),
        (
            "missing weights",
            1,
            ["--weights", str(tmp_path / "none.bin"), *ok_input, "--out-dir", o],
        ),
        (
            "truncated weights",
            1,
            ["--weights", str(tmp_path / "short.bin"), *ok_input, "--out-dir", o],
        ),
        ("out dir under a file", 1, [*w, *ok_input, "--out-dir", str(tmp_path / "a_file" / "o")]),
    ]
    for what, code, args in cases:
        r = _driver(out, *args)
        assert r.returncode == code, (what, r.returncode, r.stderr)
        assert "error" in r.stderr or "usage" in r.stderr, (what, r.stderr)
        assert not REPORT.search(r.stderr), (what, r.stderr)
    # A nonexistent out dir is made, parents included; --bench reruns the model.
    r = _driver(out, *w, *ok_input, "--out-dir", str(tmp_path / "new" / "dir"), "--bench", "2")
    assert r.returncode == 0 and not REPORT.search(r.stderr), r.stderr
    assert (tmp_path / "new" / "dir" / "outputs.json").is_file()


def test_fibers_are_annotated_for_asan(builds: dict[str, Path]) -> None:
    # Unannotated, this program is reported as a stack-buffer-underflow (see its header).
    for order in ("forward", "shuffle:5"):
        r = subprocess.run(
            [str(builds["fibers"])],
            capture_output=True,
            text=True,
            env=sanitizer_env(
                SAN, {**os.environ, "OMP_NUM_THREADS": "2", "FLOWC_SIM_ORDER": order}
            ),
            timeout=300,
        )
        assert r.returncode == 0 and not REPORT.search(r.stderr), r.stderr
        assert "PASS fiber_exceptions" in r.stdout


def test_sanitizers_are_really_on(builds: dict[str, Path]) -> None:
    # A real heap overflow in a kernel on fibers is reported, and the report is fatal.
    r = subprocess.run(
        [str(builds["fibers"]), "overflow"],
        capture_output=True,
        text=True,
        env=sanitizer_env(SAN, {**os.environ, "OMP_NUM_THREADS": "1"}),
        timeout=300,
    )
    assert r.returncode != 0 and "heap-buffer-overflow" in r.stderr, r.stderr
    assert "out_of_bounds_after_barrier" in r.stderr  # the stack names the kernel
    # The model drivers link the runtimes (their reports were checked above to be absent).
    for name in MODELS:
        exe = build_dir(builds[name], "host", SAN) / "model_main"
        libs = subprocess.run(["ldd", str(exe)], capture_output=True, text=True).stdout
        assert "libasan" in libs and "libubsan" in libs, (name, libs)


def test_cli_sanitize(
    builds: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = builds["resnet_tiny"]
    for args, message in [
        (["--target", "cuda", "--sanitize", "address"], "host target only"),
        (["--target", "host", "--sanitize", "address,memory"], "unknown sanitizer 'memory'"),
    ]:
        with pytest.raises(SystemExit) as e:
            cli_main(["build", str(out), *args])
        assert e.value.code == 2
        assert message in capsys.readouterr().err
    x = tmp_path / "x.npy"
    feeds, expected = _shared_io("resnet_tiny")
    np.save(x, feeds["pixel_values"])
    cli_main(
        [
            "run",
            str(out),
            "--sanitize",
            SAN,
            "--input",
            f"pixel_values={x}",
            "-o",
            str(tmp_path / "y.npz"),
        ]
    )
    got = np.load(tmp_path / "y.npz")
    for k in expected:
        assert max_rel_error(got[k], expected[k]) <= TOL, k
