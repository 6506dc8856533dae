"""CUDA Graphs in the generated model (templates/model.cu.j2): compiled by default, run() copies
the caller's inputs into staging buffers, replays one graph of the schedule and copies the
outputs out; `--no-cuda-graph` launches directly. On the host emulator: mlp and a two-stream
model match onnxruntime with graphs on and off, over runs with new input and output pointers
every time, runs queued back to back, shuffled replay orders and a caller that captures run()
into its own graph (then reads last_error() inside the capture and synchronize() after it); the
emulator's counters show one graph launch and no stream kernel per run (create() ran the schedule
once, uncaptured, to warm the libraries up); the nvcc build of the two-stream captured program compiles and links without
warnings.

Each program is the project's model.cu linked with HARNESS below, compiled once for all (every
program has the prefix P_): the driver is not needed here, and skipping its compile keeps the
builds short. A program is built once per test session (tests/test_trace.py reuses the
two-stream one)."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import SHARED_MODELS
from onnx import TensorProto, helper, numpy_helper

from flowc import cli
from flowc.harness.compare import max_rel_error
from flowc.harness.ort import run_onnxruntime
from flowc.resources import runtime_dir
from flowc.toolchain import HOST_FLAGS, HOST_LIBS, cuda_compile_command, find_cuda

TOL = 1e-4

# A caller of the C API: `harness WEIGHTS DIR RUNS MODE`. Run r reads input k from
# DIR/in<r % 2>_<k>.bin into a buffer of its own (every run has new input and output pointers)
# and writes output k to DIR/out<r>_<k>.bin. MODE: sync (synchronize after each run), queue (all
# runs queued back to back, one synchronize), capture (the caller captures each run() on its own
# stream into its own CUDA graph and launches that). Host target: device memory is host memory.
HARNESS = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "flowc/device.h"
#include "model.h"

static size_t elem_bytes(int dtype) {
  switch (dtype) {
    case 1: case 6: case 12: return 4;
    case 7: case 11: case 13: return 8;
    case 4: case 5: case 10: case 16: return 2;
    default: return 1;
  }
}

static int fail(P_model* m, const char* what) {
  std::fprintf(stderr, "harness: %s: %s\n", what, P_last_error(m));
  return 1;
}

int main(int argc, char** argv) {
  if (argc != 5) return 2;
  const std::string dir = argv[2], mode = argv[4];
  const int runs = std::atoi(argv[3]);
  P_model* m = nullptr;
  if (P_create(argv[1], &m) != 0) return fail(nullptr, "create");
  const int nin = P_num_inputs(), nout = P_num_outputs();
  std::vector<std::vector<void*>> ins(runs), outs(runs);
  std::vector<size_t> out_bytes;
  for (int k = 0; k < nout; ++k) {
    size_t n = elem_bytes(P_output_dtype(k));
    for (int d = 0; d < P_output_rank(k); ++d) n *= size_t(P_output_shape(k)[d]);
    out_bytes.push_back(n);
  }
  cudaStream_t own = nullptr;
  if (mode == "capture" && cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking) != cudaSuccess) return 3;
  for (int r = 0; r < runs; ++r) {
    for (int k = 0; k < nin; ++k) {
      const std::string path = dir + "/in" + std::to_string(r % 2) + "_" + std::to_string(k) + ".bin";
      std::FILE* f = std::fopen(path.c_str(), "rb");
      if (f == nullptr) return 4;
      std::fseek(f, 0, SEEK_END);
      const long size = std::ftell(f);
      std::fseek(f, 0, SEEK_SET);
      void* p = std::malloc(size_t(size) + 1);
      if (std::fread(p, 1, size_t(size), f) != size_t(size)) return 4;
      std::fclose(f);
      ins[r].push_back(p);
    }
    for (int k = 0; k < nout; ++k) outs[r].push_back(std::calloc(out_bytes[size_t(k)] + 1, 1));
    if (mode == "capture") {
      cudaGraph_t g = nullptr;
      cudaGraphExec_t exec = nullptr;
      if (cudaStreamBeginCapture(own, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return 5;
      if (P_run(m, ins[r].data(), outs[r].data(), own) != 0) return fail(m, "run (captured)");
      // Neither may touch the capture: last_error() makes no CUDA call, and synchronize() has
      // no event of a captured run to wait on.
      if (std::strcmp(P_last_error(m), "") != 0) return fail(m, "last_error in the capture");
      if (P_synchronize(m) != 0) return fail(m, "synchronize in the capture");
      if (cudaStreamEndCapture(own, &g) != cudaSuccess) return 5;
      if (cudaGraphInstantiate(&exec, g, 0) != cudaSuccess) return 5;
      if (cudaGraphLaunch(exec, own) != cudaSuccess || cudaStreamSynchronize(own) != cudaSuccess) return 5;
      if (std::strcmp(P_last_error(m), "") != 0) return fail(m, "captured run");
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(g);
      continue;
    }
    if (P_run(m, ins[r].data(), outs[r].data(), nullptr) != 0) return fail(m, "run");
    if (mode == "sync" && P_synchronize(m) != 0) return fail(m, "synchronize");
  }
  if (P_synchronize(m) != 0) return fail(m, "synchronize");
  std::fprintf(stderr, "graph status: %s\n", P_cuda_graph_status(m));
  for (int r = 0; r < runs; ++r) {
    for (int k = 0; k < nout; ++k) {
      const std::string path = dir + "/out" + std::to_string(r) + "_" + std::to_string(k) + ".bin";
      std::FILE* f = std::fopen(path.c_str(), "wb");
      if (f == nullptr || std::fwrite(outs[r][size_t(k)], 1, out_bytes[size_t(k)], f) != out_bytes[size_t(k)]) {
        return 6;
      }
      std::fclose(f);
      std::free(outs[r][size_t(k)]);
    }
    for (void* p : ins[r]) std::free(p);
  }
  if (own != nullptr) cudaStreamDestroy(own);
  P_destroy(m);
  return 0;
}
"""

STATS = re.compile(
    r"flowc sim launches: (\d+) stream kernels, (\d+) graph launches, (\d+) graph kernels"
)


def branches_model() -> onnx.ModelProto:
    """Two inputs, three independent branches (two of them join), two outputs: what a two-stream
    schedule splits over its streams."""
    rng = np.random.default_rng(7)

    def w(name: str, rows: int, cols: int) -> onnx.TensorProto:
        a = rng.standard_normal((rows, cols)) / np.sqrt(rows)
        return numpy_helper.from_array(a.astype(np.float32), name)

    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["a1"], name="a_matmul1"),
        helper.make_node("Relu", ["a1"], ["a2"], name="a_relu"),
        helper.make_node("MatMul", ["a2", "W2"], ["a3"], name="a_matmul2"),
        helper.make_node("MatMul", ["x", "W3"], ["b1"], name="b_matmul1"),
        helper.make_node("Tanh", ["b1"], ["b2"], name="b_tanh"),
        helper.make_node("MatMul", ["b2", "W4"], ["b3"], name="b_matmul2"),
        helper.make_node("MatMul", ["z", "W5"], ["c1"], name="c_matmul"),
        helper.make_node("Sigmoid", ["c1"], ["c2"], name="c_sigmoid"),
        helper.make_node("Add", ["a3", "b3"], ["s"], name="join_add"),
        helper.make_node("Mul", ["s", "c2"], ["y"], name="join_mul"),
        helper.make_node("Exp", ["c1"], ["e"], name="c_exp"),
    ]
    f32 = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "branches",
        [
            helper.make_tensor_value_info("x", f32, [8, 64]),
            helper.make_tensor_value_info("z", f32, [8, 64]),
        ],
        [
            helper.make_tensor_value_info("y", f32, [8, 32]),
            helper.make_tensor_value_info("e", f32, [8, 32]),
        ],
        [w("W1", 64, 96), w("W2", 96, 32), w("W3", 64, 96), w("W4", 96, 32), w("W5", 64, 32)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@dataclass
class Program:
    project: Path  # OUT/
    exe: Path  # model.cu + HARNESS
    model: onnx.ModelProto
    feeds: list[dict[str, np.ndarray]]  # the two input sets (run r uses r % 2)


def _feeds(model: onnx.ModelProto) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(11)
    shapes = {
        i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input
    }
    inits = {t.name for t in model.graph.initializer}
    return [
        {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items() if n not in inits}
        for _ in range(2)
    ]


def _compile(model_path: Path, project: Path, flags: list[str]) -> None:
    cli.main(["compile", str(model_path), "-o", str(project), "--target", "host", *flags])


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "warning" not in (r.stdout + r.stderr).lower(), r.stderr


def _harness_object(root: Path, project: Path) -> Path:
    """HARNESS compiled once: every program has the prefix P_, so one object links with all."""
    obj = root / "harness.o"
    if not obj.exists():
        src = root / "harness.cpp"
        src.write_text(HARNESS)
        # -O1: the programs run a few times on small inputs; the compile is what costs.
        flags = [*HOST_FLAGS, "-O1", "-I", str(runtime_dir()), "-I", str(project)]
        _run(["g++", *flags, "-c", "-x", "c++", str(src), "-o", str(obj)])
    return obj


def build_program(factory: pytest.TempPathFactory, name: str) -> Program:
    """Program ``name`` (see PROGRAMS), built on first use in this session."""
    root = factory.getbasetemp() / "cuda-graph-programs"
    model_name, flags = PROGRAMS[name]
    if model_name == "branches":
        model = branches_model()
        model_path = root / "branches.onnx"
        if not model_path.exists():
            root.mkdir(parents=True, exist_ok=True)
            onnx.save(model, str(model_path))
    else:
        model_path = SHARED_MODELS / f"{model_name}.onnx"
        model = onnx.load(str(model_path))
    project = root / name / "out"
    exe = root / name / "harness"
    if not exe.exists():
        _compile(model_path, project, ["--prefix", "P", *flags])
        harness = _harness_object(root, project)
        obj = root / name / "model.o"
        # The project's own copy of the runtime headers, as its CMake build has it (model.cu
        # includes OUT/flowc/; the source tree's copy as well would define everything twice).
        source = ["-x", "c++", str(project / "model.cu")]
        _run(["g++", *HOST_FLAGS, "-O1", "-I", str(project), "-c", *source, "-o", str(obj)])
        _run(["g++", "-fopenmp", str(obj), str(harness), "-o", str(exe), *HOST_LIBS])
    return Program(project, exe, model, _feeds(model))


# name -> (model: "branches" or a shared model's name, flowc compile flags)
PROGRAMS = {
    "mlp": ("mlp", []),
    "mlp-direct": ("mlp", ["--no-cuda-graph"]),
    "branches": ("branches", ["--streams", "2"]),
}


def run_program(
    prog: Program, work: Path, runs: int, mode: str = "sync", env: dict[str, str] | None = None
) -> tuple[list[dict[str, np.ndarray]], str]:
    """Runs the harness; each run's outputs by name, and its stderr."""
    work.mkdir(parents=True, exist_ok=True)
    inputs = [i.name for i in prog.model.graph.input]
    for s, feeds in enumerate(prog.feeds):
        for k, name in enumerate(inputs):
            feeds[name].tofile(work / f"in{s}_{k}.bin")
    r = subprocess.run(
        [str(prog.exe), str(prog.project / "weights.bin"), str(work), str(runs), mode],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    outputs = [(o.name, o.type.tensor_type.shape.dim) for o in prog.model.graph.output]
    results = [
        {
            name: np.fromfile(work / f"out{run}_{k}.bin", dtype=np.float32).reshape(
                [d.dim_value for d in dims]
            )
            for k, (name, dims) in enumerate(outputs)
        }
        for run in range(runs)
    ]
    return results, r.stderr


def check_matches_onnxruntime(prog: Program, results: list[dict[str, np.ndarray]]) -> None:
    refs = [run_onnxruntime(prog.model, f) for f in prog.feeds]
    for run, got in enumerate(results):
        for name, ref in refs[run % 2].items():
            err = max_rel_error(got[name], ref)
            assert err <= TOL, (run, name, err)


def counters(stderr: str) -> tuple[int, int, int]:
    m = STATS.search(stderr)
    assert m is not None, stderr
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> Program:
    return build_program(tmp_path_factory, "mlp")


@pytest.fixture(scope="module")
def mlp_direct(tmp_path_factory: pytest.TempPathFactory) -> Program:
    return build_program(tmp_path_factory, "mlp-direct")


@pytest.fixture(scope="module")
def branches(tmp_path_factory: pytest.TempPathFactory) -> Program:
    return build_program(tmp_path_factory, "branches")


def test_the_two_stream_model_uses_two_streams(branches: Program) -> None:
    text = (branches.project / "model.cu").read_text()
    assert "constexpr int kNumStreams = 2;" in text
    assert "r.graph.run(" in text


def test_graph_and_direct_builds_match_onnxruntime(
    mlp: Program, mlp_direct: Program, branches: Program, tmp_path: Path
) -> None:
    assert "r.graph.run(" in (mlp.project / "model.cu").read_text()
    assert "GraphRunner" not in (mlp_direct.project / "model.cu").read_text()
    for prog in (mlp, mlp_direct, branches):
        for mode in ("sync", "queue"):
            # Four runs alternate two input sets, each run with new input and output buffers:
            # the graph keeps its own pointers and must still read and write the caller's.
            results, _ = run_program(prog, tmp_path / prog.exe.parent.name / mode, 4, mode)
            check_matches_onnxruntime(prog, results)


def test_after_the_first_run_each_run_is_one_graph_launch(
    mlp: Program, mlp_direct: Program, branches: Program, tmp_path: Path
) -> None:
    stats = {"FLOWC_SIM_STATS": "1"}
    per_run = {}
    for prog in (mlp, branches):
        _, one = run_program(prog, tmp_path / prog.exe.parent.name / "1", 1, env=stats)
        _, five = run_program(prog, tmp_path / prog.exe.parent.name / "5", 5, env=stats)
        s1, g1, k1 = counters(one)
        s5, g5, k5 = counters(five)
        # create() warms the libraries up (one uncaptured run), so the first run captures;
        # each run is one graph launch.
        assert g1 == 1 and g5 == 5, (one, five)
        assert s5 == s1, (one, five)  # create's fills and warm-up only: no run launches itself
        assert k1 > 0 and k5 == 5 * k1, (one, five)
        assert "graph status: captured\n" in five
        per_run[prog.exe.parent.name] = k1
    # Direct launches: no graph, and every run launches its kernels on the streams.
    _, one = run_program(mlp_direct, tmp_path / "direct1", 1, env=stats)
    _, five = run_program(mlp_direct, tmp_path / "direct5", 5, env=stats)
    (s1, g1, k1), (s5, g5, k5) = counters(one), counters(five)
    assert g1 == g5 == 0 and k1 == k5 == 0
    assert "graph status: off\n" in five
    assert s5 - s1 == 4 * per_run["mlp"], (one, five)  # the kernels the graph holds


def test_shuffled_replay_orders_still_match(branches: Program, tmp_path: Path) -> None:
    for seed in (1, 2, 3):
        results, _ = run_program(
            branches, tmp_path / str(seed), 3, env={"FLOWC_SIM_ORDER": f"shuffle:{seed}"}
        )
        check_matches_onnxruntime(branches, results)


def test_a_capturing_caller_gets_the_work_in_its_own_graph(
    branches: Program, tmp_path: Path
) -> None:
    results, err = run_program(
        branches, tmp_path / "capture", 3, "capture", env={"FLOWC_SIM_STATS": "1"}
    )
    check_matches_onnxruntime(branches, results)
    _, graphs, kernels = counters(err)
    assert graphs == 3 and kernels > 0  # the caller's three graphs; the model made none
    assert "graph status: not captured yet\n" in err


def test_cuda_build_of_the_captured_two_stream_program(branches: Program) -> None:
    tk = find_cuda()
    missing = tk.missing(["cublasLt", "cudnn"])
    if tk.nvcc is None or missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"no nvcc or {', '.join(missing)} (CI must have them)")
        pytest.skip("no CUDA toolkit here: the CUDA build is not checked")
    exe = branches.exe.parent / "harness-cuda"
    cmd = cuda_compile_command(
        tk,
        [branches.project / "model.cu", branches.exe.parent.parent / "harness.cpp"],
        exe,
        libs=["cublasLt", "cudnn"],
    )
    # The project's copy of the runtime headers (see build_program), and its model.h.
    _run([str(branches.project) if a == str(runtime_dir()) else a for a in cmd])
    assert exe.is_file()
