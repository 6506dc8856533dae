"""The C++ runtime: every test program in tests/runtime/ built for the host (g++ + the SIMT
emulator) and run, and built with nvcc for sm_90 (compile and link; nothing runs a GPU here)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

from flowc.toolchain import cuda_compile_command, find_cuda, host_compile_command

SOURCES = REPO / "tests" / "runtime"
PROGRAMS = ["kernels", "streams", "races", "libs"]
CUDA_LIBS = {"libs": ["cublasLt", "cudnn"]}


def run(
    cmd: list[str], env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "2", **(env or {})}
    r = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=600)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


@pytest.fixture(scope="session")
def host_bin(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("host")
    bins = {}
    for name in PROGRAMS:
        exe = out / name
        r = run(host_compile_command([SOURCES / f"{name}.cu"], exe), check=False)
        assert r.returncode == 0, r.stderr
        assert "warning" not in r.stderr, r.stderr  # generated and runtime code builds warning-free
        bins[name] = exe
    return bins


def test_kernels_on_the_host(host_bin: dict[str, Path]) -> None:
    for order in ("forward", "reverse", "shuffle:11"):
        r = run([str(host_bin["kernels"])], {"FLOWC_SIM_ORDER": order})
        assert "9 passed, 0 failed" in r.stdout, (order, r.stdout)


def test_sim_stats_count_paths_and_barriers(host_bin: dict[str, Path]) -> None:
    r = run(
        [str(host_bin["kernels"]), "vector_add", "block_reduction", "warp_reduction"],
        {"FLOWC_SIM_STATS": "1"},
    )
    rows = {line.split()[0]: line.split()[1:] for line in r.stderr.splitlines()[2:] if line.strip()}
    # columns: plain launches, fiber launches, blocks, blocks on fibers, barriers, warp syncs
    assert [int(v) for v in rows["vector_add"]] == [1, 0, 391, 1, 0, 0]
    # 37 full blocks + 1 partial, each: one barrier after the load and 8 tree levels.
    assert [int(v) for v in rows["block_sum"]] == [0, 1, 38, 38, 38 * 9, 0]
    assert int(rows["warp_shuffle_sum"][5]) > 0


def _race_results(exe: Path, which: str, order: str) -> dict[str, str]:
    r = run([str(exe), which], {"FLOWC_SIM_ORDER": order})
    return {line.split()[1]: line.split()[0] for line in r.stdout.splitlines()}


def test_a_missing_barrier_gives_wrong_results(host_bin: dict[str, Path]) -> None:
    for seed in range(1, 11):
        res = _race_results(host_bin["races"], "barrier", f"shuffle:{seed}")
        assert res == {"missing_barrier": "WRONG", "with_barrier": "CORRECT"}, (seed, res)
    # This reduction reads higher lanes, so issue order exposes it too; reverse hides it.
    assert _race_results(host_bin["races"], "barrier", "forward")["missing_barrier"] == "WRONG"


def test_a_missing_event_gives_wrong_results(host_bin: dict[str, Path]) -> None:
    for order in ["reverse"] * 10 + [f"shuffle:{seed}" for seed in range(1, 11)]:
        res = _race_results(host_bin["races"], "event", order)
        assert res == {"missing_event": "WRONG", "with_event": "CORRECT"}, (order, res)
    # Issue order alone would hide it, which is why the other orders exist.
    assert _race_results(host_bin["races"], "event", "forward")["missing_event"] == "CORRECT"


def test_stream_semantics_and_launch_limits(host_bin: dict[str, Path]) -> None:
    for order in ("forward", "reverse", "shuffle:5"):
        r = run([str(host_bin["streams"])], {"FLOWC_SIM_ORDER": order})
        assert "0 failures" in r.stdout and "FAIL" not in r.stdout, (order, r.stdout)
    assert "PASS 1025 threads: invalid configuration argument" in r.stdout


def test_flowc_check_reports_file_line_and_exits(host_bin: dict[str, Path]) -> None:
    r = run([str(host_bin["streams"]), "check-fails"], check=False)
    assert r.returncode == 1
    assert re.search(
        r"streams\.cu:\d+: cudaMemcpy\(p, p, 16, .*\) failed: invalid copy direction for memcpy",
        r.stderr,
    )


def test_barrier_on_the_plain_path_is_reported(host_bin: dict[str, Path]) -> None:
    r = run([str(host_bin["streams"]), "plain-sync"], check=False)
    assert r.returncode != 0
    assert "kernel 'late_barrier' called __syncthreads() in a block run as a plain loop" in r.stderr
    assert run([str(host_bin["streams"]), "plain-sync"], {"FLOWC_SIM_FIBERS": "1"}).returncode == 0


def test_bad_order_setting_is_reported(host_bin: dict[str, Path]) -> None:
    r = run([str(host_bin["kernels"]), "vector_add"], {"FLOWC_SIM_ORDER": "sideways"}, check=False)
    assert r.returncode == 2
    assert (
        "error: FLOWC_SIM_ORDER='sideways': expected forward, reverse or shuffle:SEED" in r.stderr
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        # Overflowed into a huge stack size: SIGSEGV with no message.
        ("FLOWC_SIM_STACK_KB", "99999999999999999999"),
        ("FLOWC_SIM_STACK_KB", " 128"),
        ("FLOWC_SIM_ORDER", "shuffle: 3"),
        ("FLOWC_SIM_FIBERS", "yes"),
    ],
)
def test_bad_sim_settings_end_the_program_cleanly(
    host_bin: dict[str, Path], name: str, value: str
) -> None:
    """The emulator reads its FLOWC_SIM_* variables at the first launch, where no caller can
    take an error: a value it does not take ends the program with the variable's range and
    exit code 2, never a crash (a generated model's create() refuses it before that)."""
    r = run([str(host_bin["kernels"]), "vector_add"], {name: value}, check=False)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert f"error: {name}='{value}': expected " in r.stderr, r.stderr


def test_gemm_and_conv_wrappers_on_the_host(host_bin: dict[str, Path]) -> None:
    r = run([str(host_bin["libs"])])
    assert "0 failures" in r.stdout
    assert r.stdout.count("PASS gemm") == 40 and r.stdout.count("PASS conv") == 7


def test_the_emulator_enforces_the_libraries_contracts(host_bin: dict[str, Path]) -> None:
    """Each rule of docs/runtime.md's "What the emulator enforces" for cuBLASLt and cuDNN
    fires (libs.cu's check_contracts), and the results the rules protect come out right."""
    out = run([str(host_bin["libs"])]).stdout
    for line in [
        "gemm refuses A below its declared alignment: gemm: operand A is only 4-byte aligned",
        "gemm takes A at its declared 4-byte alignment",
        "gemm refuses a batch stride that breaks the alignment",
        "gemm refuses an alignment that is no power of two",
        "gemm refuses tf32 with narrow operands",
        "create_blas refuses a workspace that is not 256-byte aligned",
        "gemm refuses a handle with less workspace than the call's",
        "narrow plans reduce split-K in the compute type",
        "bf16 gemm k=1024 is rounded once (0 elements off by more than an ulp)",
        "exact fp32 convolutions exclude FFT and Winograd",
        "tf32 and narrow convolutions may use them",
        "conv refuses a handle with less workspace than the call's",
        "the fused identity convolution forces IMPLICIT_PRECOMP_GEMM",
        "refused, the fused identity convolution falls back with the plain algorithm",
        "a NaN stays NaN through the fused ReLU",
        "gemm refuses a GELU input whose leading dimension is no multiple of 8",
        "gemm refuses a backward epilogue with beta",
        "gemm refuses a GELU gradient without the GELU's input",
    ]:
        assert f"PASS {line}" in out, line


def test_a_cudnn_handle_outliving_its_stream_is_reported(host_bin: dict[str, Path]) -> None:
    r = run([str(host_bin["libs"]), "destroy-order"], check=False)
    assert r.returncode != 0 and "destroyed" not in r.stdout, r.stdout
    assert "cudnnDestroy: the handle's stream (its last cudnnSetStream) was destroyed" in r.stderr


def test_kernel_sources_have_no_target_switches() -> None:
    for path in [*SOURCES.glob("*.cu"), *(REPO / "templates").rglob("*")]:
        if path.is_file():
            text = path.read_text()
            assert "FLOWC_HOST" not in text and "__CUDA_ARCH__" not in text, path


CUDA = find_cuda()


@pytest.mark.parametrize("name", PROGRAMS)
def test_cuda_build_compiles_and_links(name: str, tmp_path: Path) -> None:
    libs = CUDA_LIBS.get(name, [])
    missing = CUDA.missing(libs)
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CUDA build of {name}: missing {', '.join(missing)} (CI must have them)")
        pytest.skip(f"no {', '.join(missing)} on this machine: the CUDA build is not checked")
    exe = tmp_path / name
    r = run(cuda_compile_command(CUDA, [SOURCES / f"{name}.cu"], exe, libs=libs), check=False)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr.lower(), r.stderr
    if name == "libs":
        undefined = run(["nm", "-D", "--undefined-only", str(exe)]).stdout
        assert re.search(r"\bcublasLtMatmul\b", undefined), undefined
        assert re.search(r"\bcudnnConvolutionForward\b", undefined), undefined
