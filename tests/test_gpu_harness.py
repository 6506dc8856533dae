"""The GPU harnesses (flowc/harness/gpu.py).

On every machine with nvcc: the kernels of a model of single-op nodes (one per kernel
family, side by side) build into a cubin, every launch of the generated program is read
into a plan whose packed arguments match the compiled kernels' parameter layouts, and the
whole-program path (ctypes, the C API, a backend's buffers) runs the host target's library
against onnxruntime.

With a GPU (`pytest -m gpu`, `make gpu-check`): the same kernels launched by PyCUDA
against flowc's NumPy reference, and whole programs (an MLP block, the bundled ResNet) run
through their CUDA library with PyCUDA's and CuPy's buffers and streams against
onnxruntime. Without a GPU these skip, saying so (also under CI=true: CI has no GPU).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from opcheck import Case, cases_model

from flowc.harness import gpu

RNG = np.random.default_rng(14)
REPO = Path(__file__).resolve().parent.parent


def rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# One node per kernel family the generated code has its own kernels for (GEMM and
# convolution are library calls, checked in whole programs).
FAMILY_CASES = [
    Case("Add", [rand(4, 1, 33), rand(5, 33)]),  # broadcast element-wise
    Case("Mul", [rand(2, 3, 1, 8), rand(3, 5, 1)]),
    Case("Tanh", [rand(1000)]),
    Case("Softmax", [rand(6, 100)], {"axis": -1}),  # rows
    Case("Softmax", [rand(2, 5, 7)], {"axis": 1}),  # strided
    Case(
        "LayerNormalization", [rand(6, 64), rand(64), rand(64)], {"axis": -1}, const_inputs=(1, 2)
    ),
    Case("ReduceSum", [rand(4, 8, 9), np.array([1], np.int64)], {"keepdims": 0}, const_inputs=(1,)),
    Case("ReduceMax", [rand(3, 70), np.array([-1], np.int64)], {"keepdims": 1}, const_inputs=(1,)),
    Case("Transpose", [rand(3, 4, 5)], {"perm": [2, 0, 1]}),
    Case("Gather", [rand(10, 7), np.array([[1, 3], [9, 0]], np.int64)], {"axis": 0}),
    Case("Concat", [rand(2, 3), rand(2, 5)], {"axis": 1}),
    Case("MaxPool", [rand(1, 2, 9, 9)], {"kernel_shape": [3, 3], "strides": [2, 2]}),
]
# What the plan must launch: a kernel name fragment per family.
FAMILY_KERNELS = ["elementwise", "softmax", "normalize", "reduce", "gather", "copy", "pool"]


def _need_nvcc() -> None:
    from flowc.toolchain import find_cuda

    if find_cuda().nvcc is None:
        if os.environ.get("CI") == "true":
            pytest.fail("nvcc is missing (CI must have it)")
        pytest.skip("no nvcc here: the cubin is not built")


@pytest.fixture(scope="module")
def need_gpu() -> None:
    """Module-scoped, so that it runs (and skips) before the module-scoped builds."""
    why = gpu.have_gpu()
    if why is not None:
        pytest.skip(f"{why}: the GPU harnesses run only on a machine with a GPU")


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The family model, compiled (one project shared by this module's tests)."""
    model, feeds = cases_model(FAMILY_CASES, {"": 21})
    inferred = onnx.shape_inference.infer_shapes(model)
    del model.graph.output[:]
    model.graph.output.extend(inferred.graph.output)
    project = tmp_path_factory.mktemp("families") / "project"
    graph = gpu.compile_for_harness(model, project)
    return {"model": model, "feeds": feeds, "project": project, "graph": graph}


def test_cubin_holds_every_launched_kernel(families: dict[str, Any]) -> None:
    _need_nvcc()
    project = families["project"]
    plan = gpu.launch_plan(project)
    launched = {op.kernel for op in plan.run if isinstance(op, gpu.Launch)}
    for fragment in FAMILY_KERNELS:
        assert any(fragment in k for k in launched), (fragment, sorted(launched))
    # Every output is written by the program the plan holds.
    assert len(plan.info["outputs"]) == len(FAMILY_CASES)
    cubin = gpu.kernel_cubin(project, "sm_90").read_bytes()
    kernels = gpu.cubin_kernels(cubin)
    symbols = gpu.check_cubin(plan, kernels)  # raises on a parameter layout mismatch
    assert set(symbols) == set(plan.kernels)
    assert len(set(symbols.values())) == len(symbols)
    for name, sym in symbols.items():
        params = kernels[sym].params
        assert len(params) == len(plan.kernels[name])
        assert kernels[sym].param_bytes == params[-1][0] + params[-1][1]
    # The packed buffers: each pointer's address and each scalar at its parameter's offset.
    bases = ["input", "output", "weights", "arena", "error_flag"]

    def code(p: gpu.Pointer) -> int:
        return (bases.index(p.base) + 1) << 48 | p.index << 32 | p.offset

    structs = 0
    for op in plan.run:
        if not isinstance(op, gpu.Launch):
            continue
        assert op.grid.x >= 1 and op.block.x >= 1
        params = plan.kernels[op.kernel]
        buf = plan.pack(op, code)
        offsets = gpu.param_offsets([p.layout for p in params])
        assert len(buf) == offsets[-1][0] + offsets[-1][1]
        for p, a, (at, size) in zip(params, op.args, offsets, strict=True):
            if isinstance(a, gpu.Pointer):
                assert int.from_bytes(buf[at : at + 8], "little") == code(a)
            elif isinstance(a, gpu.Aggregate):
                structs += 1
                assert size == p.layout.size and len(p.layout.leaves) > 1
            else:
                fmt = p.layout.leaves[0][1]
                assert struct.unpack_from("<" + fmt, buf, at)[0] == a
    assert structs  # the broadcast kernels take their sizes in a struct


def test_plan_reads_generated_expressions() -> None:
    """The expressions codegen writes (casts, hex floats, INFINITY, offsets) read back as
    the values they denote; a library call or an unknown statement is refused by name."""
    line = (
        "FLOWC_LAUNCH(k3_fill, dim3(2, 3), dim3(128), 64, streams[1], "
        "reinterpret_cast<float*>((weights + 512)), 0x1.8p+1f, static_cast<float>(-INFINITY), "
        "static_cast<int64_t>(-7LL), (int64_t)660, reinterpret_cast<float*>(arena + 256) + 3);"
    )
    op = gpu._op(line, "test")
    assert isinstance(op, gpu.Launch)
    assert op.kernel == "k3_fill" and op.grid == gpu.Dim3(2, 3) and op.block == gpu.Dim3(128)
    assert op.shared == 64
    assert op.args[0] == gpu.Pointer("weights", 0, 512, 4)
    assert op.args[1:5] == [3.0, float("-inf"), -7, 660]
    assert op.args[5] == gpu.Pointer("arena", 0, 256 + 12, 4)
    copy = gpu._op(
        "cudaMemcpyAsync(outputs[1], (arena + 64), 40, cudaMemcpyDeviceToDevice, streams[0]);",
        "test",
    )
    assert copy == gpu.Copy(gpu.Pointer("output", 1, 0, 0), gpu.Pointer("arena", 0, 64, 1), 40)
    assert gpu._op("trace_begin(m, 4, streams[0]);", "test") is None
    with pytest.raises(gpu.HarnessError, match="library call"):
        gpu._op("{ flowc::Status st = flowc::gemm(m->blas[0], 1); if (!st.ok()) return 1; }", "t")
    # Structs by value, laid out as nvcc does (checked against cubins in the test above).
    types = gpu.Types(
        "struct D {\n  uint32_t d, mul;\n  __device__ uint32_t f(uint32_t n) const { return n; }\n};\n"
        "template <int R, int K>\nstruct B {\n  D dim[R];\n  int64_t n;\n  uint32_t s[K][R];\n};\n"
    )
    lay = types.layout("const B<2, 1>")
    assert (lay.size, lay.align) == (32, 8)
    assert [o for o, _ in lay.leaves] == [0, 4, 8, 12, 16, 24, 28]
    scalars = [gpu.Layout.scalar(c) for c in "Qiqf"]
    assert gpu.param_offsets([*scalars, lay]) == [(0, 8), (8, 4), (16, 8), (24, 4), (32, 32)]
    value = gpu._Parser("B<2, 1>{{D{3u, 5u}, D{7u, 9u}}, (int64_t)-2, {{1u, 2u}}}").expr()
    plan = gpu.Plan({"k": [gpu.Param("b", "B<2, 1>", False, lay)]}, [], [], 0, 0, 0)
    buf = plan.pack(gpu.Launch("k", gpu.Dim3(1), gpu.Dim3(1), 0, [value]))
    assert struct.unpack("<IIIIqII", buf) == (3, 5, 7, 9, -2, 1, 2)


def test_plan_refuses_library_calls(tmp_path: Path) -> None:
    model, _ = cases_model([Case("MatMul", [rand(4, 8), rand(8, 3)])], {"": 21})
    gpu.compile_for_harness(model, tmp_path / "p")
    with pytest.raises(gpu.HarnessError, match="whole-program harness"):
        gpu.launch_plan(tmp_path / "p")


def _mlp() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """MatMul (a library call) + bias + GELU-free activations + softmax: a small whole program."""
    w1, b1, w2 = rand(16, 32), rand(32), rand(32, 10)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["z"]),
        helper.make_node("Softmax", ["z"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp_block",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 16])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 10])],
        initializer=[
            numpy_helper.from_array(w1, "w1"),
            numpy_helper.from_array(b1, "b1"),
            numpy_helper.from_array(w2, "w2"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model, {"x": rand(4, 16)}


def test_whole_program_through_ctypes_on_the_host_library(tmp_path: Path) -> None:
    """The whole-program path (ctypes, create/run/synchronize/destroy, a backend's buffers)
    on the host target's library, where device memory is host memory."""
    from flowc.harness.build import build

    model, feeds = _mlp()
    project = tmp_path / "p"
    gpu.compile_for_harness(model, project)
    build(project, "host", quick=True)
    results = gpu.check_program(model, project, feeds, gpu.HostBackend(), target="host")
    assert [c.name for c in results] == ["y"]
    assert all(c.ok for c in results), gpu.describe(results)


# -- on a GPU -------------------------------------------------------------------------------


def _require(module: str) -> None:
    try:
        __import__(module)
    except ImportError:
        pytest.skip(f"{module} is not installed (pip install 'flowc[gpu]' for PyCUDA)")


@pytest.mark.gpu
def test_kernels_on_gpu(need_gpu: None, families: dict[str, Any]) -> None:
    """Every family's kernels, built into a cubin for this GPU and launched by PyCUDA as
    the generated code launches them, against flowc's NumPy reference."""
    from flowc.interpreter import evaluate

    _require("pycuda")
    project = families["project"]
    plan = gpu.launch_plan(project)
    cubin = gpu.kernel_cubin(project, gpu.device_arch()).read_bytes()
    got = gpu.run_plan(project, plan, cubin, families["feeds"])
    ref = evaluate(families["graph"], families["feeds"])
    bad = []
    for name, a in got.items():
        c = gpu.compare(name, a, np.asarray(ref[name]), 1e-5)
        if not c.ok:
            bad.append(f"{name}: {c.reason or c.error}")
    assert not bad, bad


@pytest.fixture(scope="module")
def cuda_mlp(need_gpu: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from flowc.harness.build import build

    model, feeds = _mlp()
    project = tmp_path_factory.mktemp("mlp") / "p"
    gpu.compile_for_harness(model, project)
    build(project, "cuda", quick=True)
    return {"model": model, "feeds": feeds, "project": project}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pycuda", "cupy"])
def test_whole_program_on_gpu(need_gpu: None, backend: str, cuda_mlp: dict[str, Any]) -> None:
    """The CUDA library through ctypes on the backend's device buffers and stream."""
    _require(backend)
    be = gpu.gpu_backend(backend)
    results = gpu.check_program(cuda_mlp["model"], cuda_mlp["project"], cuda_mlp["feeds"], be)
    assert all(c.ok for c in results), gpu.describe(results)


@pytest.mark.gpu
def test_resnet_tiny_on_gpu(need_gpu: None, tmp_path: Path) -> None:
    """The bundled ResNet (cuDNN convolutions, pooling, GEMM) as a whole program on the
    GPU through the preferred backend (PyCUDA, else CuPy), against onnxruntime."""
    from flowc.harness.build import build

    path = REPO / "examples" / "models" / "resnet_tiny.onnx"
    model = onnx.load(str(path))
    io = np.load(path.with_suffix(".io.npz"))
    feeds = {k[3:]: io[k] for k in io.files if k.startswith("in:")}
    project = tmp_path / "p"
    gpu.compile_for_harness(model, project)
    build(project, "cuda", quick=True)
    results = gpu.check_program(model, project, feeds, gpu.gpu_backend(), tol=1e-3)
    assert all(c.ok for c in results), gpu.describe(results)
