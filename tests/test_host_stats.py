"""FLOWC_STATS=1: the driver prints the launches per run (kernels + library calls, a replayed
CUDA Graph's nodes counted one by one) as the host emulator counts them, the same with and
without a graph; `flowc run --stats` passes it on. And OMP_WAIT_POLICY: the host driver
restarts itself with PASSIVE when the variable is unset, and `flowc run` sets it."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import run_cli
from onnx import TensorProto, helper, numpy_helper

from flowc import cli
from flowc.harness.build import build, build_dir, run
from flowc.harness.compare import max_rel_error
from flowc.harness.ort import run_onnxruntime

LAUNCHES = re.compile(
    r"^launches per run: (\d+) \((\d+) kernels, (\d+) library calls; counted over (\d+) runs?\)$",
    re.M,
)
COPIES = re.compile(r"^copies per run: (\d+) memcpy, (\d+) memset$", re.M)
# The ops the generated code runs as library calls (cuBLASLt/cuDNN on the GPU, OpenBLAS here).
LIBRARY_OPS = {"Conv", "Gemm", "MatMul"}


def small_cnn() -> onnx.ModelProto:
    """Conv + bias, Relu, global pooling, Gemm, Softmax: kernels and both kinds of library call."""
    rng = np.random.default_rng(3)

    def init(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "g", "gb"], ["l"], transB=1),
        helper.make_node("Softmax", ["l"], ["y"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "small_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])],
        [init("w", 4, 3, 3, 3), init("b", 4), init("g", 5, 4), init("gb", 5)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@dataclass
class Built:
    project: Path
    exe: Path


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("stats") / "small_cnn.onnx"
    onnx.save(small_cnn(), str(path))
    return path


def _built(root: Path, model: Path, flags: list[str]) -> Built:
    project = root / "out"
    cli.main(["compile", str(model), "-o", str(project), "--target", "host", *flags])
    bdir = build(project, "host", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
    return Built(project, build_dir(project, "host") / "model_main")


@pytest.fixture(scope="module")
def graph_build(tmp_path_factory: pytest.TempPathFactory, model_file: Path) -> Built:
    return _built(tmp_path_factory.mktemp("graph"), model_file, [])


@pytest.fixture(scope="module")
def direct_build(tmp_path_factory: pytest.TempPathFactory, model_file: Path) -> Built:
    return _built(tmp_path_factory.mktemp("direct"), model_file, ["--no-cuda-graph"])


def run_bodies(model_cu: str) -> str:
    """The code of run() (a call of issue()), issue() and the schedule functions it calls
    (run_stage_*): what a run executes, each statement once (the schedule is straight-line
    code)."""
    bodies = re.findall(
        r"^(?:static int run_stage_\d+|static int issue|extern \"C\" int \w+_run)\(.*?^}$",
        model_cu,
        re.S | re.M,
    )
    assert len(bodies) == 3, "expected run(), issue() and one run_stage_0()"
    return "\n".join(bodies)


def _feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(5).standard_normal((2, 3, 8, 8)).astype(np.float32)}


def _driver(
    built: Built, work: Path, *args: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    work.mkdir(parents=True, exist_ok=True)
    np.save(work / "x.npy", _feeds()["x"])
    cmd = [str(built.exe), "--weights", str(built.project / "weights.bin")]
    cmd += ["--input", f"x={work / 'x.npy'}", "--out-dir", str(work / "o"), *args]
    base = {k: v for k, v in os.environ.items() if k not in ("FLOWC_STATS", "OMP_WAIT_POLICY")}
    r = subprocess.run(cmd, capture_output=True, text=True, env={**base, **env}, timeout=120)
    assert r.returncode == 0, r.stderr
    return r


def _stats(stdout: str) -> tuple[tuple[int, int, int, int], tuple[int, int]]:
    launches, copies = LAUNCHES.findall(stdout), COPIES.findall(stdout)
    assert len(launches) == 1 and len(copies) == 1, stdout
    total, kernels, library, runs = map(int, launches[0])
    assert total == kernels + library
    return (total, kernels, library, runs), (int(copies[0][0]), int(copies[0][1]))


def test_launches_per_run_match_the_generated_code(
    graph_build: Built, direct_build: Built, tmp_path: Path
) -> None:
    library_ops = sum(n.op_type in LIBRARY_OPS for n in small_cnn().graph.node)
    figures = {}
    for name, built in (("graph", graph_build), ("direct", direct_build)):
        code = run_bodies((built.project / "model.cu").read_text())
        r = _driver(built, tmp_path / name, env={"FLOWC_STATS": "1"})
        got = np.load(tmp_path / name / "o" / "y.npy")
        ref = run_onnxruntime(small_cnn(), _feeds())["y"]
        assert max_rel_error(got, ref) <= 1e-4
        (total, kernels, library, runs), copies = _stats(r.stdout)
        assert runs == 1
        assert kernels == code.count("FLOWC_LAUNCH("), code
        assert library == library_ops == 2
        figures[name] = (total, copies)
    assert "GraphRunner" in (graph_build.project / "model.cu").read_text()
    assert "GraphRunner" not in (direct_build.project / "model.cu").read_text()
    # A replayed graph counts its nodes one by one: the same launches as issuing them.
    assert figures["graph"][0] == figures["direct"][0]
    # Direct: the copies and sets run() and the schedule issue (the error flag's reset and
    # copy back); the graph build adds one staging copy per input and per output around the
    # replay (docs/codegen.md, "CUDA Graphs").
    direct_code = run_bodies((direct_build.project / "model.cu").read_text())
    assert figures["direct"][1] == (
        direct_code.count("cudaMemcpyAsync("),
        direct_code.count("cudaMemsetAsync("),
    )
    assert figures["graph"][1] == (figures["direct"][1][0] + 2, figures["direct"][1][1])


def test_bench_prints_the_per_run_figure_of_its_runs(graph_build: Built, tmp_path: Path) -> None:
    one = _stats(_driver(graph_build, tmp_path / "one", env={"FLOWC_STATS": "1"}).stdout)
    r = _driver(graph_build, tmp_path / "bench", "--bench", "2", env={"FLOWC_STATS": "1"})
    assert r.stdout.index('{"bench":') < r.stdout.index("launches per run")
    (total, kernels, library, runs), copies = _stats(r.stdout)
    assert runs == 2 + 2 * 2  # warm-up min(N, 3), then N for throughput and N for latency
    assert (total, kernels, library) == one[0][:3] and copies == one[1]


def test_without_flowc_stats_nothing_is_counted_aloud(graph_build: Built, tmp_path: Path) -> None:
    for value in (None, "0"):
        env = {} if value is None else {"FLOWC_STATS": value}
        r = _driver(graph_build, tmp_path / str(value), env=env)
        assert "per run" not in r.stdout + r.stderr, r.stdout


def test_flowc_run_stats(
    graph_build: Built,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FLOWC_STATS", raising=False)
    np.save(tmp_path / "x.npy", _feeds()["x"])
    common = [
        "run",
        str(graph_build.project),
        "--target",
        "host",
        "--input",
        f"x={tmp_path / 'x.npy'}",
    ]
    code, text = run_cli([*common, "--stats"], capsys)  # no -o needed
    assert code == 0, text
    expected = _stats(_driver(graph_build, tmp_path / "d", env={"FLOWC_STATS": "1"}).stdout)
    assert _stats(text) == expected
    # Without the flag, not unless the environment asks for it (the child inherits it).
    code, text = run_cli([*common, "-o", str(tmp_path / "a.npz")], capsys)
    assert code == 0 and "per run" not in text, text
    monkeypatch.setenv("FLOWC_STATS", "1")
    code, text = run_cli([*common, "-o", str(tmp_path / "b.npz")], capsys)
    assert code == 0 and _stats(text) == expected, text


def _omp_env_blocks(stderr: str) -> list[str]:
    """libgomp's OMP_DISPLAY_ENV report, once per start of the program: each one's
    OMP_WAIT_POLICY."""
    starts = stderr.count("OPENMP DISPLAY ENVIRONMENT BEGIN")
    policies = re.findall(r"OMP_WAIT_POLICY = '(\w+)'", stderr)
    assert len(policies) == starts, stderr
    return policies


def test_the_host_driver_restarts_itself_with_a_passive_wait(
    graph_build: Built, tmp_path: Path
) -> None:
    # Unset: two starts, the second with PASSIVE (libgomp shows PASSIVE for an unset variable
    # too, so the count of starts is what tells them apart).
    r = _driver(graph_build, tmp_path / "unset", env={"OMP_DISPLAY_ENV": "true"})
    assert _omp_env_blocks(r.stderr) == ["PASSIVE", "PASSIVE"]
    assert np.load(tmp_path / "unset" / "o" / "y.npy").shape == (2, 5)
    # A user's setting is kept, ACTIVE too: one start.
    for policy in ("ACTIVE", "PASSIVE"):
        env = {"OMP_DISPLAY_ENV": "true", "OMP_WAIT_POLICY": policy}
        r = _driver(graph_build, tmp_path / policy, env=env)
        assert _omp_env_blocks(r.stderr) == [policy]


def test_flowc_run_sets_the_wait_policy_for_host_runs(
    graph_build: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict[str, str]] = []

    def recording_run(*args: Any, env: dict[str, str] | None = None, **kw: Any) -> Any:
        seen.append(dict(env or {}))
        return run(*args, env=env, **kw)

    monkeypatch.setattr("flowc.harness.build.run", recording_run)
    np.save(tmp_path / "x.npy", _feeds()["x"])
    args = [
        "run",
        str(graph_build.project),
        "--target",
        "host",
        "--input",
        f"x={tmp_path / 'x.npy'}",
    ]
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cli.main([*args, "-o", str(tmp_path / "a.npz")])
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cli.main([*args, "-o", str(tmp_path / "b.npz")])
    assert seen[0].get("OMP_WAIT_POLICY") == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in seen[1]  # the user's ACTIVE is inherited as it is
