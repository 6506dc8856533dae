"""CUDA Graphs in the runtime: tests/runtime/graphs.cu on the host emulator (capture and replay
against direct launches, CUDA's capture errors, a missing edge under shuffled replay, the launch
counters of flowc::GraphRunner), and its nvcc build (compile and link)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

from flowc.toolchain import cuda_compile_command, find_cuda, host_compile_command

SOURCE = REPO / "tests" / "runtime" / "graphs.cu"


def run(
    cmd: list[str], env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "2", **(env or {})}
    r = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=300)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


@pytest.fixture(scope="module")
def graphs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exe = tmp_path_factory.mktemp("graphs") / "graphs"
    r = run(host_compile_command([SOURCE], exe), check=False)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr, r.stderr
    return exe


def test_capture_replay_and_capture_errors(graphs: Path) -> None:
    for order in ("forward", "reverse", "shuffle:5"):
        r = run([str(graphs)], {"FLOWC_SIM_ORDER": order})
        assert r.stdout.endswith("0 failures\n") and "FAIL" not in r.stdout, (order, r.stdout)
    passed = r.stdout
    assert "PASS graph replay equals direct launches over 2 streams, 3 inputs" in passed
    assert "PASS captured gemm replays with new inputs" in passed
    # Each error CUDA raises during capture, and what it does to the capture.
    for line in [
        "a fork not joined back: cudaErrorStreamCaptureUnjoined",
        "cudaStreamSynchronize: cudaErrorStreamCaptureUnsupported",
        "cudaStreamSynchronize, then cudaStreamEndCapture: cudaErrorStreamCaptureInvalidated",
        "cudaDeviceSynchronize: cudaErrorStreamCaptureUnsupported",
        "cudaDeviceSynchronize, then cudaStreamEndCapture: cudaErrorStreamCaptureInvalidated",
        "cudaMalloc: cudaErrorStreamCaptureUnsupported",
        "cudaMalloc, then cudaStreamEndCapture: cudaErrorStreamCaptureInvalidated",
        "cudaFree: cudaErrorStreamCaptureUnsupported",
        "cudaMemcpy: cudaErrorStreamCaptureUnsupported",
        "cudaMemcpy, then cudaStreamEndCapture: cudaErrorStreamCaptureInvalidated",
        "a kernel on the legacy stream: cudaErrorStreamCaptureImplicit",
        "legacy stream, then EndCapture: cudaErrorStreamCaptureInvalidated",
        "cudaMalloc in another thread during a global capture: cudaErrorStreamCaptureUnsupported",
        "cudaMalloc in another thread during a thread-local capture: cudaSuccess",
        "waiting on an event recorded outside the capture: cudaErrorStreamCaptureIsolation",
        "EndCapture on a forked stream: cudaErrorStreamCaptureUnmatched",
        "cudaGraphExecUpdate, other topology: cudaErrorGraphExecUpdateFailure",
        # An event recorded in a capture stays captured after it ends (the completion event a
        # model must not record in a caller's capture).
        "cudaEventSynchronize on an event recorded in a capture that has ended: cudaErrorCapturedEvent",
        "cudaEventQuery on an event recorded in a capture that has ended: cudaErrorCapturedEvent",
        "the same event recorded again outside a capture: cudaSuccess",
        # A library handle's first call (lazy initialization) fails a capture.
        "a library handle's first call inside a capture: cudaErrorStreamCaptureInvalidated",
    ]:
        assert f"PASS {line}\n" in passed, line
    assert re.search(
        r"PASS runner reports a failed capture: .*cudaErrorStreamCaptureInvalidated", passed
    )
    assert "PASS runner falls back to direct launches\n" in passed
    assert "PASS runner's first run is direct\n" in passed


def _edge_results(exe: Path, order: str) -> dict[str, str]:
    r = run([str(exe), "missing-edge"], {"FLOWC_SIM_ORDER": order})
    return {line.split()[1]: line.split()[0] for line in r.stdout.splitlines()}


def test_a_missing_edge_in_a_capture_gives_wrong_results(graphs: Path) -> None:
    wrong = 0
    for seed in range(1, 6):
        res = _edge_results(graphs, f"shuffle:{seed}")
        assert res["with_edge"] == "CORRECT", (seed, res)
        wrong += res["missing_edge"] == "WRONG"
    assert wrong > 0
    # Capture (issue) order hides it, as it would on a GPU that happened to run in order.
    assert _edge_results(graphs, "forward") == {"missing_edge": "CORRECT", "with_edge": "CORRECT"}


def _counters(exe: Path, runs: int) -> tuple[int, int, int]:
    r = run([str(exe), "runner", str(runs)], {"FLOWC_SIM_STATS": "1"})
    assert r.stdout.count("PASS runner run") == runs, r.stdout
    m = re.search(
        r"flowc sim launches: (\d+) stream kernels, (\d+) graph launches, (\d+) graph kernels",
        r.stderr,
    )
    assert m, r.stderr
    return int(m[1]), int(m[2]), int(m[3])


def test_after_the_capture_each_run_is_one_graph_launch(graphs: Path) -> None:
    # The first run is the warm-up: its 3 kernels go out on the streams, no graph yet.
    assert _counters(graphs, 1) == (3, 0, 0)
    # The second captures and launches; each run after it: one graph launch, no stream launch
    # (its 3 kernels run inside it).
    assert _counters(graphs, 4) == (3, 3, 9)


CUDA = find_cuda()


def test_cuda_build_of_graphs_compiles_and_links(tmp_path: Path) -> None:
    libs = ["cublasLt"]  # graphs.cu captures a flowc::gemm
    missing = CUDA.missing(libs)
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CUDA build of graphs: missing {', '.join(missing)} (CI must have them)")
        pytest.skip(f"no {', '.join(missing)} on this machine: the CUDA build is not checked")
    exe = tmp_path / "graphs"
    r = run(cuda_compile_command(CUDA, [SOURCE], exe, libs=libs), check=False)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr.lower(), r.stderr
    # The capture API comes from CUDA's runtime (linked statically), not from the emulator.
    symbols = run(["nm", str(exe)]).stdout
    for sym in ("cudaStreamBeginCapture", "cudaStreamEndCapture", "cudaGraphLaunch"):
        assert re.search(rf" [Tt] {sym}$", symbols, re.M), sym
