"""`model_main --bench N` and `flowc run --bench N` on one- and two-rank host builds, and the
actor trace recorder (runtime_cpp/flowc/trace.h) through tests/runtime/trace.cu: two streams,
the recorded actors, streams and times, per stream in issue order, across FLOWC_SIM_ORDERs;
the per-rank file names; the CUDA build of the same program."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import REPO, run_cli
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from flowc.harness.build import bench_figures, build, build_dir, launcher, run
from flowc.schedule import gantt
from flowc.toolchain import cuda_compile_command, find_cuda, host_compile_command

W = np.random.default_rng(3).standard_normal((16, 32)).astype(np.float32)
X = np.random.default_rng(4).standard_normal((8, 16)).astype(np.float32)
TRACE_SOURCE = REPO / "tests" / "runtime" / "trace.cu"
CUDA = find_cuda()
# Without Open MPI the two-rank project cannot be built or run (CI has it).
HAVE_MPI = shutil.which("mpirun") is not None or os.environ.get("CI") == "true"
HUMAN = re.compile(
    r"^bench: (\d+) runs, median ([\d.]+) ms, p90 ([\d.]+) ms, min ([\d.]+) ms; throughput "
    r"([\d.]+) runs/s \((\d+) queued back to back, (\d+) warm-up, (\d+) ranks?\)$"
)


def _model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "bench",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 32])],
        initializer=[numpy_helper.from_array(W, "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _compile_and_build(model: Path, out: Path, *extra: str) -> Path:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "flowc",
            "compile",
            str(model),
            "-o",
            str(out),
            "--target",
            "host",
            *list(extra),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    build(out, "host", quick=True)
    assert "warning" not in (build_dir(out, "host") / "flowc-build.log").read_text().lower()
    return out


def _compile_trace(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The project and the trace program, built side by side (each build uses about one
    core): "two" (the model on --mesh 2: the bench's meetings of ranks are the part a
    one-rank program lacks; tests/test_codegen_edges.py runs a one-rank --bench), "trace"
    (host) and, with a CUDA toolchain, "trace_cuda" (compiled and linked only)."""
    root = tmp_path_factory.mktemp("bench")
    onnx.save(_model(), root / "m.onnx")
    np.save(root / "x.npy", X)
    with ThreadPoolExecutor(4) as pool:
        two = None
        if HAVE_MPI:
            two = pool.submit(_compile_and_build, root / "m.onnx", root / "two", "--mesh", "2")
        host = pool.submit(
            _compile_trace, host_compile_command([TRACE_SOURCE], root / "trace", extra=["-O0"])
        )
        cuda = None
        if CUDA.nvcc is not None:
            cuda = pool.submit(
                _compile_trace,
                cuda_compile_command(CUDA, [TRACE_SOURCE], root / "trace_cuda", libs=[]),
            )
        paths = {"root": root}
        if two is not None:
            paths["two"] = two.result()
        assert "warning" not in host.result()
        paths["trace"] = root / "trace"
        if cuda is not None:
            assert "warning" not in cuda.result().lower()
            paths["trace_cuda"] = root / "trace_cuda"
    return paths


def _driver(
    project: Path, out_dir: Path, *extra: str, env: dict[str, str] | None = None, ranks: int = 2
) -> subprocess.CompletedProcess[str]:
    """model_main of ``project`` under mpirun (ranks=0: started alone, for argument errors,
    which come before MPI starts)."""
    prefix, launch_env = launcher(ranks, "host") if ranks else ([], {})
    cmd = [
        *prefix,
        str(build_dir(project, "host") / "model_main"),
        "--weights",
        str(project / "weights.bin"),
        "--input",
        f"x={project.parent / 'x.npy'}",
        "--out-dir",
        str(out_dir),
        *extra,
    ]
    full_env = {**os.environ, **launch_env, **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env)


def _check_figures(stdout: str, runs: int, ranks: int) -> dict[str, Any]:
    human = [m for line in stdout.splitlines() if (m := HUMAN.match(line))]
    assert len(human) == 1, stdout  # rank 0 alone prints
    f = bench_figures(stdout)
    assert [ln.startswith('{"bench":') for ln in stdout.splitlines()].count(True) == 1
    lat = f["latency_ms"]
    assert (f["version"], f["target"], f["runs"], f["ranks"]) == (1, "host", runs, ranks)
    assert f["warmup"] == min(runs, 3)
    assert 0 < lat["min"] <= lat["median"] <= lat["p90"] <= lat["max"]
    assert lat["min"] <= lat["mean"] <= lat["max"]
    assert math.isclose(
        f["throughput_runs_per_s"], 1000 * runs / f["throughput_window_ms"], rel_tol=1e-4
    )
    # The human line says the same, rounded.
    g = human[0].groups()
    assert (int(g[0]), int(g[5]), int(g[6]), int(g[7])) == (runs, runs, f["warmup"], ranks)
    assert abs(float(g[1]) - lat["median"]) <= 6e-4 and abs(float(g[2]) - lat["p90"]) <= 6e-4
    return f


needs_mpi = pytest.mark.skipif(
    not HAVE_MPI, reason="needs Open MPI (mpirun) to start several ranks"
)


@needs_mpi
def test_bench_times_warmup_queued_and_synchronized_runs(
    built: dict[str, Path], tmp_path: Path
) -> None:
    for n in (5, 1):
        t0 = time.perf_counter()
        r = _driver(
            built["two"], tmp_path / f"o{n}", "--bench", str(n), env={"FLOWC_SIM_STATS": "1"}
        )
        wall_ms = 1000 * (time.perf_counter() - t0)
        assert r.returncode == 0, r.stderr
        f = _check_figures(r.stdout, n, 2)  # both ranks ran it, rank 0 printed
        lat = f["latency_ms"]
        # The timed runs are real: the job took at least as long as they did.
        assert f["throughput_window_ms"] + n * lat["mean"] < wall_ms
        # Each rank's calls of the model's one GEMM (ReLU fused as its epilogue, on a mesh
        # as on one device): the outputs' run, the warm-up runs, N queued for the
        # throughput and N one at a time for the latency.
        calls = [
            int(m.group(1))
            for ln in r.stderr.splitlines()
            if (m := re.match(r"flowc sim work run: \d+ kernels, (\d+) library calls", ln))
        ]
        assert calls == [1 + min(n, 3) + 2 * n] * 2, r.stderr
        if n == 1:
            assert lat["min"] == lat["median"] == lat["p90"] == lat["max"]
        # The outputs are written as without --bench.
        assert np.allclose(np.load(tmp_path / f"o{n}" / "y.npy"), np.maximum(X @ W, 0), atol=1e-5)
    for bad in ("0", "-3", "1000001", "many", ""):
        r = _driver(built["two"], tmp_path / "bad", "--bench", bad, ranks=0)
        assert r.returncode == 2, (bad, r.stderr)
        assert f"--bench {bad}: expected a number of runs from 1 to 1000000" in r.stderr


@needs_mpi
def test_flowc_run_bench(
    built: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x = str(built["root"] / "x.npy")
    base = ["run", str(built["two"]), "--target", "host", "--input", f"x={x}"]
    code, text = run_cli([*base, "--bench", "3", "-o", str(tmp_path / "y.npz")], capsys)
    assert code == 0, text
    assert re.search(
        r"^latency: median [\d.]+ ms, p90 [\d.]+ ms, min [\d.]+ ms \(3 runs, each synchronized\)$",
        text,
        re.M,
    ), text
    assert re.search(
        r"^throughput: [\d.]+ runs/s \(3 runs queued back to back; 3 warm-up runs first; host, "
        r"2 ranks\)$",
        text,
        re.M,
    ), text
    assert np.allclose(np.load(tmp_path / "y.npz")["y"], np.maximum(X @ W, 0), atol=1e-5)
    # --bench alone needs no output file.
    code, text = run_cli([*base, "--bench", "2"], capsys)
    assert code == 0 and "(2 runs, each synchronized)" in text, text
    assert list(tmp_path.iterdir()) == [tmp_path / "y.npz"]
    for bad in ("0", "1000001"):
        code, text = run_cli([*base, "--bench", bad], capsys)
        assert code == 2 and f"--bench {bad}: expected a number of runs from 1 to 1000000" in text
        assert "Traceback" not in text
    code, text = run_cli([*base, "--bench", "x"], capsys)
    assert code == 2 and "'x' is not a valid integer" in text, text
    code, text = run_cli(base, capsys)
    assert code == 2 and "needs -o OUT.npz for the outputs (or --bench N" in text, text
    # The harness reads the same figures.
    got, stdout = run(built["two"], {"x": X}, target="host", bench=2)
    assert np.allclose(got["y"], np.maximum(X @ W, 0), atol=1e-5)
    assert bench_figures(stdout)["runs"] == 2


@needs_mpi
def test_trace_of_a_bench_on_two_ranks(built: dict[str, Path], tmp_path: Path) -> None:
    """FLOWC_TRACE with --bench 4 on two ranks: one file per rank, holding the runs that were
    synchronized one by one (the outputs' run 0, warm-up 1-3, latency 8-11) and, of the four
    queued back to back (4-7), only the last: nothing synchronized in between. The files draw
    as a measured Gantt chart with schedule.json's stream names."""
    r = _driver(
        built["two"],
        tmp_path / "out",
        "--bench",
        "4",
        env={"FLOWC_TRACE": str(tmp_path / "t.jsonl")},
    )
    assert r.returncode == 0, r.stderr
    files = [tmp_path / f"t.rank{rank}.jsonl" for rank in range(2)]
    assert not (tmp_path / "t.jsonl").exists()
    schedule = json.loads((built["two"] / "schedule.json").read_text())
    for rank, path in enumerate(files):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert sorted({ln["run"] for ln in lines}) == [0, 1, 2, 3, 7, 8, 9, 10, 11]
        assert {ln["rank"] for ln in lines} == {rank}
        modeled = next(m for m in schedule["ranks"] if m["rank"] == rank)
        actors = sorted((a["id"], a["name"], a["stream"]) for a in modeled["actors"])
        for run_no in (0, 7, 11):
            got = [(ln["actor"], ln["name"], ln["stream"]) for ln in lines if ln["run"] == run_no]
            assert got == actors, (rank, run_no)
    records = gantt.read_trace(files)
    measured = gantt.schedule_from_trace(records, schedule=schedule)
    assert [m["run"] for m in measured["ranks"]] == [11, 11]
    out = gantt.draw_gantt(records, tmp_path / "trace.png")
    rows = sum(len({a["stream"] for a in m["actors"]}) for m in measured["ranks"])
    assert Image.open(out).size == gantt.figure_size(rows)


NAMES = ["a0", "b0", "a1", 'b1 "q" \\ \t \u00e9 \U0001f600 \ufffd', "a2", "join"]
STREAMS = [0, 1, 0, 1, 0, 0]
ORDER = {0: [2, 0, 4, 5], 1: [1, 3]}  # each stream's actors in issue order


def _trace(exe: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(exe), *args],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "FLOWC_TRACE"} | env,
    )


def test_trace_records_actors_on_two_streams(built: dict[str, Path], tmp_path: Path) -> None:
    for order in ("forward", "reverse", "shuffle:7"):
        path = tmp_path / f"{order.replace(':', '_')}.jsonl"
        r = _trace(built["trace"], {"FLOWC_TRACE": str(path), "FLOWC_SIM_ORDER": order})
        assert r.returncode == 0 and r.stdout == "enabled=1\ndone\n", r.stderr
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert all(
            line.keys() == {"run", "rank", "actor", "name", "stream", "start_us", "end_us"}
            for line in lines
        )
        # Runs 0 and 1 flushed one by one; of runs 2 and 3, queued together, only 3.
        assert sorted({line["run"] for line in lines}) == [0, 1, 3]
        for run_no in (0, 1, 3):
            got = [line for line in lines if line["run"] == run_no]
            assert [g["actor"] for g in got] == list(range(6))  # actor id order
            assert [g["name"] for g in got] == NAMES
            assert [g["stream"] for g in got] == STREAMS
            assert all(g["rank"] == 0 and 0 <= g["start_us"] <= g["end_us"] for g in got)
            by_id = {g["actor"]: g for g in got}
            for stream, issued in ORDER.items():
                started = sorted(issued, key=lambda a: by_id[a]["start_us"])
                assert started == issued, (order, run_no, stream, got)
                # One stream runs one actor at a time.
                for a, b in itertools.pairwise(issued):
                    assert by_id[a]["end_us"] <= by_id[b]["start_us"], (order, run_no, a, b)
            # "join" waits on an event recorded after b1: real times show the wait.
            assert by_id[5]["start_us"] >= by_id[3]["end_us"], (order, got)


def test_trace_files_per_rank_and_when_off(built: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "dir.d").mkdir()
    for given, written in [
        ("t.jsonl", "t.rank1.jsonl"),
        ("dir.d/t", "dir.d/t.rank1"),
        (".hidden", ".hidden.rank1"),
    ]:
        r = _trace(built["trace"], {"FLOWC_TRACE": str(tmp_path / given)}, "1")
        assert r.returncode == 0, r.stderr
        lines = (tmp_path / written).read_text().splitlines()
        assert len(lines) == 18 and all(json.loads(ln)["rank"] == 1 for ln in lines)
        assert not (tmp_path / given).exists()
    # Off: no events, no file; an empty value is off too.
    for env in ({}, {"FLOWC_TRACE": ""}):
        r = _trace(built["trace"], env)
        assert r.returncode == 0 and r.stdout == "enabled=0\ndone\n", r.stderr
    r = _trace(built["trace"], {"FLOWC_TRACE": str(tmp_path / "none" / "t.jsonl")})
    assert r.returncode == 1
    assert f"cannot open {tmp_path / 'none' / 't.jsonl'} for writing: No such file" in r.stderr


def test_trace_builds_for_cuda(built: dict[str, Path]) -> None:
    if "trace_cuda" not in built:
        if os.environ.get("CI") == "true":
            pytest.fail("no nvcc: CI must build the CUDA trace program")
        pytest.skip("no nvcc on this machine: the CUDA build is not checked")
    symbols = subprocess.run(
        ["nm", str(built["trace_cuda"])], capture_output=True, text=True, check=True
    ).stdout
    # Linked against CUDA's runtime (static cudart), not the emulator's inline functions.
    assert re.search(r" [tT] cudaEventElapsedTime$", symbols, re.M)
    assert "flowc::sim" not in symbols and "_ZN5flowc3sim" not in symbols
