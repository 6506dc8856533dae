"""Symbolic dims (--dim NAME=LO..HI): one program for every size in range.

The references: onnxruntime on the same ONNX model at each size, NumPy for the polynomial
fits. Builds are shared per module (one host build of an exporter-style encoder and one of
bert_tiny, one CUDA compile-and-link)."""

from __future__ import annotations

import ctypes
import json
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import SHARED_MODELS, require_cuda_build_toolchain, run_cli
from onnx import TensorProto, helper, numpy_helper

from flowc.api import Project
from flowc.codegen.cpp import CodegenError
from flowc.compiler import compile_graph, compile_model, load_model
from flowc.errors import InputError, ShapeError
from flowc.frontend.dsl import parse_program
from flowc.harness.build import build, run
from flowc.harness.compare import max_rel_error
from flowc.harness.ort import inference_mode, run_onnxruntime
from flowc.ir.printer import print_graph
from flowc.ir.symbolic import DimRange, SymDim, fit, fit_grid, probe_points
from flowc.options import CompileOptions, ModelArgs, parse_dim_ranges, parse_shape_ranges

TOL = 1e-4


def _encoder(path: Path) -> Path:
    """An encoder layer as exporters write one: the flattening reshape's target computed
    from Shape -> Gather -> Unsqueeze -> Mul -> Concat, a GEMM with ReLU, the reshape back,
    a LayerNorm and a softmax over the features; batch and seq are named dims."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "B"),
        numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "G"),
        numpy_helper.from_array(np.array(0, np.int64), "i0"),
        numpy_helper.from_array(np.array(1, np.int64), "i1"),
        numpy_helper.from_array(np.array([0], np.int64), "ax"),
        numpy_helper.from_array(np.array([16], np.int64), "c16"),
    ]
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["s", "i1"], ["t"], axis=0),
        helper.make_node("Unsqueeze", ["b", "ax"], ["bu"]),
        helper.make_node("Unsqueeze", ["t", "ax"], ["tu"]),
        helper.make_node("Mul", ["bu", "tu"], ["bt"]),
        helper.make_node("Concat", ["bt", "c16"], ["flat"], axis=0),
        helper.make_node("Reshape", ["x", "flat"], ["x2"]),
        helper.make_node("MatMul", ["x2", "W"], ["y2"]),
        helper.make_node("Add", ["y2", "B"], ["y3"]),
        helper.make_node("Relu", ["y3"], ["r"]),
        helper.make_node("Concat", ["bu", "tu", "c16"], ["back"], axis=0),
        helper.make_node("Reshape", ["r", "back"], ["r3"]),
        helper.make_node("LayerNormalization", ["r3", "G", "B"], ["n"], axis=-1),
        helper.make_node("Softmax", ["n"], ["y"], axis=-1),
    ]
    vi = helper.make_tensor_value_info
    g = helper.make_graph(
        nodes,
        "enc",
        [vi("x", TensorProto.FLOAT, ["batch", "seq", 16])],
        [vi("y", TensorProto.FLOAT, ["batch", "seq", 16])],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def _compile(model: Path, dims: tuple[str, ...], out: Path, target: str = "host") -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = load_model(ModelArgs(path=model, dims=dims))
    # Debug builds poison dead arena bytes with NaN: a read past this run's prefix shows.
    compile_graph(graph, out, source=model.name, poison=target == "host", build_target=target)
    return out


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("enc")
    model = _encoder(tmp / "enc.onnx")
    out = _compile(model, ("batch=1..8", "seq=1..32"), tmp / "out")
    build(out, "host", quick=True)
    return model, out


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = _compile(
        SHARED_MODELS / "bert_tiny.onnx",
        ("batch=1..4", "seq=1..16"),
        tmp_path_factory.mktemp("bert") / "out",
    )
    bdir = build(out, "host", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
    return out


def test_encoder_one_build_matches_onnxruntime_over_the_range(encoder: tuple[Path, Path]) -> None:
    model, out = encoder
    info = json.loads((out / "flowc_model.json").read_text())
    assert info["symbols"] == [
        {"name": "batch", "min": 1, "max": 8, "typical": 8},
        {"name": "seq", "min": 1, "max": 32, "typical": 32},
    ]
    assert info["inputs"][0]["dims"] == ["batch", "seq", None]
    proto = onnx.load(str(model))
    for b, s in [(1, 1), (8, 32), (3, 7), (2, 17)]:
        x = np.random.default_rng(b * 100 + s).standard_normal((b, s, 16)).astype(np.float32)
        ref = run_onnxruntime(proto, {"x": x})["y"]
        # the emulator's race-revealing order must not matter either
        got, _ = run(out, {"x": x}, env={"FLOWC_SIM_ORDER": "shuffle:3"})
        assert got["y"].shape == (b, s, 16)
        assert max_rel_error(got["y"], ref) <= TOL, (b, s)


def test_one_cuda_graph_per_size_bucket_serves_every_size_in_it(
    encoder: tuple[Path, Path],
) -> None:
    """One process, many sizes (the Python API's Model): a bucket's graph is captured on its
    second run at the bucket's ends and replayed for every size in it; each run's outputs
    (at its own sizes) match onnxruntime."""
    model, out = encoder
    proto = onnx.load(str(model))
    expect = [
        ((3, 7), "not captured yet"),  # bucket (4, 8): its first run warms it up
        ((3, 7), "captured"),
        ((4, 8), "captured"),  # the bucket's ends: the same graph
        ((3, 5), "captured"),
        ((1, 1), "not captured yet"),  # bucket (1, 1)
        ((8, 32), "captured"),  # the bound's bucket, warmed up by create()
        ((5, 17), "captured"),  # bucket (8, 32) too: its graph, replayed at (5, 17)
    ]
    with Project(out).load("host") as m:
        for k, ((b, s), status) in enumerate(expect):
            x = np.random.default_rng(k).standard_normal((b, s, 16)).astype(np.float32)
            got = m.run({"x": x})["y"]
            assert got.shape == (b, s, 16)
            assert max_rel_error(got, run_onnxruntime(proto, {"x": x})["y"]) <= TOL, (b, s)
            assert m.cuda_graph_status() == status, (b, s)


def test_size_buckets_are_powers_of_two_capped_in_number() -> None:
    from flowc.codegen.program import MAX_BUCKETS, size_buckets

    assert size_buckets({"b": DimRange(1, 24), "n0": DimRange(0, 9, computed=True)}) == {
        "b": [1, 2, 4, 8, 16, 24],
        "n0": [9],
    }
    assert size_buckets({"s": DimRange(3, 64)}) == {"s": [4, 8, 16, 32, 64]}
    # 10 x 10 buckets of powers of two pass the cap: powers of 4 instead (6 x 6)
    wide = size_buckets({"b": DimRange(1, 512), "s": DimRange(1, 512)})
    assert wide == {"b": [1, 4, 16, 64, 256, 512], "s": [1, 4, 16, 64, 256, 512]}
    assert len(wide["b"]) * len(wide["s"]) <= MAX_BUCKETS


def test_bert_tiny_one_build_matches_onnxruntime_over_the_range(bert: Path) -> None:
    """Symbolic batch and sequence through the exporter's mask arithmetic (a flattened-mask
    Gather whose indices become a SizePolynomial), fused attention masked by the run's
    length, LayerNorm rows, the pooler's Gather, both ends of the ranges included."""
    proto = inference_mode(onnx.load(str(SHARED_MODELS / "bert_tiny.onnx")))
    for b, s in [(1, 1), (4, 16), (2, 7), (3, 12)]:
        rng = np.random.default_rng(b * 100 + s)
        ids = rng.integers(0, 1000, (b, s)).astype(np.int64)
        mask = np.ones((b, s), np.int64)
        if s > 2:
            mask[0, -2:] = 0  # padding in the first row
        feeds = {"input_ids": ids, "attention_mask": mask}
        ref = run_onnxruntime(proto, feeds)
        got, _ = run(bert, feeds)
        for k, v in ref.items():
            assert got[k].shape == v.shape
            assert max_rel_error(got[k], v) <= TOL, (b, s, k)


def test_bert_tiny_graph_computes_size_constants_on_the_device() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = load_model(
            ModelArgs(path=SHARED_MODELS / "bert_tiny.onnx", dims=("batch=1..4", "seq=1..16"))
        )
    ops = {n.op for n in g.nodes}
    # b * seq + s into the flattened mask; the token-type row broadcast over batch and seq
    assert {"SizePolynomial", "Expand", "FusedAttention"} <= ops
    att = next(n for n in g.nodes if n.op == "FusedAttention")
    b, h, sq, sk, d, dv = att.sym_attrs["sizes"]
    assert (str(b), h, str(sq), str(sk), d, dv) == ("batch", 2, "seq", "seq", 64, 64)


def test_inputs_outside_the_range_are_refused(
    bert: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = np.zeros((2, 5), np.int64)
    cases = [
        ((5, 4), (5, 4), "outside 1..4"),
        ((2, 17), (2, 17), "outside 1..16"),
        ((2, 5), (2, 6), "'input_ids' makes it 5"),
        ((2, 5, 1), (2, 5), "expected i64[batch:1..4, seq:1..16]"),
    ]
    for id_shape, mask_shape, message in cases:
        np.save(tmp_path / "ids.npy", np.zeros(id_shape, np.int64))
        np.save(tmp_path / "mask.npy", np.ones(mask_shape, np.int64))
        code, err = run_cli(
            [
                "run",
                str(bert),
                "--input",
                f"input_ids={tmp_path / 'ids.npy'}",
                "--input",
                f"attention_mask={tmp_path / 'mask.npy'}",
                "-o",
                str(tmp_path / "o.npz"),
            ],
            capsys,
        )
        assert code == 2 and message in err, (id_shape, err)
        assert not (tmp_path / "o.npz").exists()
    del ids


def test_driver_refuses_inputs_that_disagree_on_a_symbol(bert: Path, tmp_path: Path) -> None:
    import subprocess

    np.save(tmp_path / "ids.npy", np.zeros((2, 5), np.int64))
    np.save(tmp_path / "mask.npy", np.ones((3, 5), np.int64))
    r = subprocess.run(
        [
            str(bert / "build-host" / "model_main"),
            "--weights",
            str(bert / "weights.bin"),
            "--input",
            f"input_ids={tmp_path / 'ids.npy'}",
            "--input",
            f"attention_mask={tmp_path / 'mask.npy'}",
            "--out-dir",
            str(tmp_path / "res"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "dim 0 (batch) is 3, but input 'input_ids' makes it 2" in r.stderr
    assert not (tmp_path / "res").exists()


def test_run_shaped_reports_bad_dims_with_a_status(bert: Path) -> None:
    """The C API itself (ctypes over the host build's library): a size out of range, a fixed
    dim changed, inputs that disagree: a nonzero status, last_error naming input and dim,
    nothing run."""
    lib = ctypes.CDLL(str(bert / "build-host" / "libbert_tiny_model.so"))
    p = "bert_tiny_"
    model = ctypes.c_void_p()
    create = getattr(lib, p + "create")
    create.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
    assert create(str(bert / "weights.bin").encode(), ctypes.byref(model)) == 0
    try:
        run_shaped = getattr(lib, p + "run_shaped")
        run_shaped.argtypes = [ctypes.c_void_p] * 5
        last_error = getattr(lib, p + "last_error")
        last_error.argtypes = [ctypes.c_void_p]
        last_error.restype = ctypes.c_char_p
        assert getattr(lib, p + "num_symbols")() == 2
        sym_max = getattr(lib, p + "symbol_max")
        sym_max.restype = ctypes.c_int64
        assert [sym_max(0), sym_max(1)] == [4, 16]

        def status(ids: tuple[int, int], mask: tuple[int, int]) -> tuple[int, str]:
            dims = [(ctypes.c_int64 * 2)(*ids), (ctypes.c_int64 * 2)(*mask)]
            table = (ctypes.c_void_p * 2)(*(ctypes.cast(d, ctypes.c_void_p) for d in dims))
            rc = run_shaped(model, None, table, None, None)
            return rc, (last_error(model) or b"").decode()

        rc, msg = status((5, 3), (5, 3))
        assert rc != 0 and "input input_ids dim 0 (batch) is 5, outside its range 1..4" in msg
        rc, msg = status((2, 3), (2, 4))
        assert (
            rc != 0
            and "input attention_mask dim 1 (seq) is 4 but input input_ids makes it 3" in msg
        )
        rc, msg = status((2, 0), (2, 0))
        assert rc != 0 and "outside its range 1..16" in msg
    finally:
        destroy = getattr(lib, p + "destroy")
        destroy.argtypes = [ctypes.c_void_p]
        destroy(model)


def test_static_dims_give_todays_static_program(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = load_model(
            ModelArgs(path=SHARED_MODELS / "bert_tiny.onnx", dims=("batch=2", "seq=7"))
        )
    assert not graph.symbols and all(v.type.sym is None for v in graph.values())
    compile_graph(graph, tmp_path / "out")
    for f in ("model.cu", "model.h", "main.cu"):
        text = (tmp_path / "out" / f).read_text()
        assert "run_shaped" not in text and "flowc_set_sizes" not in text and "hdims" not in text
    assert "symbols" not in json.loads((tmp_path / "out" / "flowc_model.json").read_text())


@pytest.mark.parametrize(
    "model",
    [
        "bert_tiny",
        "resnet_tiny",
        "vit_tiny",
        "transposes",
        "mesh",
        "pipeline",
        "topk",
        "reductions",
    ],
)
def test_cuda_build_of_a_dynamic_program_compiles_and_links(model: str, tmp_path: Path) -> None:
    require_cuda_build_toolchain()
    if model in ("transposes", "topk", "reductions"):
        if model == "topk":  # a k read on the device
            out = _compile(_topk(tmp_path / "tk.onnx"), ("batch=1..8",), tmp_path / "out", "cuda")
        elif model == "reductions":  # extents and strides read on the device
            _reductions(tmp_path / "red.onnx")
            dims = ("batch=1..8", "seq=1..16")
            out = _compile(tmp_path / "red.onnx", dims, tmp_path / "out", "cuda")
        else:
            _transposes(tmp_path / "tr.onnx")
            out = _compile(tmp_path / "tr.onnx", ("b=1..4", "s=1..9"), tmp_path / "out", "cuda")
        bdir = build(out, "cuda", quick=True)
        assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
        return
    if model in ("mesh", "pipeline"):  # NCCL's collectives and transfers at the run's counts
        mlp = _tensor_parallel_mlp(tmp_path / "tp.onnx")
        par: dict[str, Any] = (
            {"sbps": ("W1=S(1)", "W2=S(0)")} if model == "mesh" else {"pipeline": 2}
        )
        out = _mesh_compile(mlp, ("batch=1..8",), tmp_path / "out", "cuda", mesh="2", **par)
        bdir = build(out, "cuda", quick=True)
        assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
        return
    if model == "bert_tiny":
        path, dims = SHARED_MODELS / "bert_tiny.onnx", ("batch=1..4", "seq=1..16")
    else:
        m, path = _with_dynamic_batch(model, tmp_path)
        onnx.save(_batch_from_the_input(m), str(path))
        dims = ("batch=1..6",)
    out = _compile(path, dims, tmp_path / "out", "cuda")
    bdir = build(out, "cuda", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()


# -- what no one program serves is refused, naming the node -------------------------------------


def _model(
    path: Path, nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], **io: list
) -> Path:  # type: ignore[type-arg]
    vi = helper.make_tensor_value_info
    g = helper.make_graph(
        nodes,
        "m",
        [vi(n, TensorProto.FLOAT, d) for n, d in io["inputs"]],
        [vi(n, TensorProto.FLOAT, d) for n, d in io["outputs"]],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def test_a_dim_that_is_no_polynomial_is_refused_naming_the_node(tmp_path: Path) -> None:
    # x[:, : seq // 2]: half the sequence
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i1"], ["t"], axis=0),
        helper.make_node("Div", ["t", "two"], ["half"]),
        helper.make_node("Unsqueeze", ["half", "ax"], ["end"]),
        helper.make_node("Slice", ["x", "zero", "end", "ax1"], ["y"], name="halve"),
    ]
    inits = [
        numpy_helper.from_array(np.array(1, np.int64), "i1"),
        numpy_helper.from_array(np.array(2, np.int64), "two"),
        numpy_helper.from_array(np.array([0], np.int64), "ax"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([1], np.int64), "ax1"),
    ]
    path = _model(
        tmp_path / "half.onnx",
        nodes,
        inits,
        inputs=[("x", ["batch", "seq"])],
        outputs=[("y", ["batch", "half"])],
    )
    with pytest.raises(ShapeError, match="Slice node 'halve' reads 'end'") as e:
        load_model(ModelArgs(path=path, dims=("batch=1..4", "seq=2..32")))
    assert "computed from the sizes ([6] at batch=2, seq=12, [16] at the bound)" in str(e.value)
    assert e.value.hint is not None and "--dim NAME=N" in e.value.hint


def test_a_dim_that_is_no_polynomial_is_refused(tmp_path: Path) -> None:
    # a stride-2 pool halves the sequence: floor(seq / 2) is no polynomial of seq
    path = _model(
        tmp_path / "pool.onnx",
        [helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2], strides=[2], name="pool")],
        [],
        inputs=[("x", ["batch", 4, "seq"])],
        outputs=[("y", ["batch", 4, "half"])],
    )
    with pytest.raises(ShapeError, match="MaxPool node 'pool'") as e:
        load_model(ModelArgs(path=path, dims=("batch=1..4", "seq=2..32")))
    assert "dim 2 is" in str(e.value) and "not a polynomial of batch, seq" in str(e.value)


def test_an_op_without_a_size_generic_kernel_is_refused(tmp_path: Path) -> None:
    w = numpy_helper.from_array(np.ones((2, 3, 1, 1), np.float32), "w")
    path = _model(
        tmp_path / "conv.onnx",
        [helper.make_node("Conv", ["x", "w"], ["y"], name="conv0")],
        [w],
        inputs=[("x", [1, 3, "h", 4])],
        outputs=[("y", [1, 2, "h", 4])],
    )
    # (a symbolic batch has a kernel: Program.leading_only; a symbolic height has none)
    graph = load_model(ModelArgs(path=path, dims=("h=1..4",)))
    with pytest.raises(CodegenError, match="no size-generic kernel yet") as e:
        compile_graph(graph, tmp_path / "out")
    assert "Conv: 1 node(s), first: 'conv0'" in e.value.message
    assert not (tmp_path / "out").exists()


def _tensor_parallel_mlp(path: Path, layers: int = 2) -> Path:
    """x[batch, 16] -> MatMul W1 -> Relu -> MatMul W2 -> y (``layers`` 1: y = x W1)."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "W1")
    w2 = numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32), "W2")
    if layers == 1:
        return _model(
            path,
            [helper.make_node("MatMul", ["x", "W1"], ["h"])],
            [w1],
            inputs=[("x", ["batch", 16])],
            outputs=[("h", ["batch", 32])],
        )
    return _model(
        path,
        [
            helper.make_node("MatMul", ["x", "W1"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("MatMul", ["r", "W2"], ["y"]),
        ],
        [w1, w2],
        inputs=[("x", ["batch", 16])],
        outputs=[("y", ["batch", 8])],
    )


def _mesh_compile(
    model: Path, dims: tuple[str, ...], out: Path, target: str = "host", **par: Any
) -> Path:
    from flowc.options import ParallelArgs

    opts = CompileOptions(
        ModelArgs(path=model, dims=dims), parallel=ParallelArgs(**par), target=target
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compile_model(opts, out, target="host")
    return out


@pytest.mark.parametrize(
    ("sbps", "collective"),
    [
        (("W1=S(1)", "W2=S(0)"), "all_reduce"),  # columns, then rows: partial sums
        (("W1=S(1)", "h=S(1)"), "all_gather"),  # the output's columns, behind the batch
    ],
)
def test_a_mesh_program_with_symbolic_dims_matches_onnxruntime(
    sbps: tuple[str, ...], collective: str, tmp_path: Path
) -> None:
    """Two ranks, a weight split by columns: the partial sums of a second product
    all-reduced, or (one product) the output's columns all-gathered into the whole output
    (a transpose that moves the symbolic batch), at the run's row count; every size of the
    symbolic batch against onnxruntime."""
    model = _tensor_parallel_mlp(
        tmp_path / "tp.onnx", layers=2 if collective == "all_reduce" else 1
    )
    out = _mesh_compile(model, ("batch=1..8",), tmp_path / "out", mesh="2", sbps=sbps)
    text = (out / "model.cu").read_text()
    assert re.search(rf"comm::{collective}\(.*hdims\[0\]", text)
    build(out, "host", quick=True)
    proto = onnx.load(str(model))
    for b in (1, 8, 3):
        x = np.random.default_rng(b).standard_normal((b, 16)).astype(np.float32)
        got, _ = run(out, {"x": x})
        for k, v in run_onnxruntime(proto, {"x": x}).items():
            assert got[k].shape == v.shape and max_rel_error(got[k], v) <= TOL, (b, k)


def test_bert_tiny_placed_on_a_mesh_with_symbolic_batch_and_seq(tmp_path: Path) -> None:
    """The search places bert_tiny on two ranks splitting no symbolic dim; the rank graph's
    types are fitted from the model at other sizes placed by the same plan."""
    out = _mesh_compile(
        SHARED_MODELS / "bert_tiny.onnx", ("batch=1..4", "seq=1..16"), tmp_path / "out", mesh="2"
    )
    text = (out / "model.cu").read_text()
    assert "flowc::comm::" in text and "kNumSymbols = 2" in text
    build(out, "host", quick=True)
    proto = onnx.load(str(SHARED_MODELS / "bert_tiny.onnx"))
    for b, s in [(1, 1), (4, 16), (3, 7)]:
        rng = np.random.default_rng(b * 10 + s)
        mask = np.ones((b, s), np.int64)
        mask[0, s // 2 :] = 0
        feeds = {"input_ids": rng.integers(0, 1000, (b, s)), "attention_mask": mask}
        got, _ = run(out, feeds)
        for k, v in run_onnxruntime(proto, feeds).items():
            assert got[k].shape == v.shape and max_rel_error(got[k], v) <= TOL, (b, s, k)


def test_bert_tiny_pipelined_with_symbolic_batch_and_seq(tmp_path: Path) -> None:
    """Two pipeline stages, one device each: the cut's activations sent and received at the
    run's element counts, both stages reading the same size table."""
    out = _mesh_compile(
        SHARED_MODELS / "bert_tiny.onnx",
        ("batch=1..4", "seq=1..16"),
        tmp_path / "out",
        mesh="2",
        pipeline=2,
    )
    assert re.search(
        r"comm::Transfer::kSend, .*static_cast<size_t>\(", (out / "model.cu").read_text()
    )
    build(out, "host", quick=True)
    proto = onnx.load(str(SHARED_MODELS / "bert_tiny.onnx"))
    for b, s in [(1, 1), (4, 16), (2, 11)]:
        rng = np.random.default_rng(b * 10 + s)
        mask = np.ones((b, s), np.int64)
        mask[-1, s // 2 :] = 0
        feeds = {"input_ids": rng.integers(0, 1000, (b, s)), "attention_mask": mask}
        got, _ = run(out, feeds)
        for k, v in run_onnxruntime(proto, feeds).items():
            assert got[k].shape == v.shape and max_rel_error(got[k], v) <= TOL, (b, s, k)


@pytest.mark.parametrize(
    ("par", "message"),
    [
        ({"mesh": "2", "sbps": ("x=S(0)",)}, "symbolic dims, which are never split"),
        ({"mesh": "2", "parallel": "data"}, "on axis 0, a symbolic dim"),
        ({"mesh": "2", "pipeline": 2, "microbatches": 2}, "one micro-batch on one device"),
        ({"mesh": "2x2", "pipeline": 2}, "a pipeline of one device per stage"),
    ],
)
def test_splitting_a_symbolic_dim_is_refused_with_the_reason(
    par: dict[str, Any], message: str, tmp_path: Path
) -> None:
    model = _tensor_parallel_mlp(tmp_path / "tp.onnx")
    with pytest.raises(InputError, match=message):
        _mesh_compile(model, ("batch=1..8",), tmp_path / "out", **par)
    assert not (tmp_path / "out").exists()


# -- options, the DSL and the printer ---------------------------------------------------------


def test_dim_ranges_parse_and_bad_ones_are_refused() -> None:
    static, ranges = parse_dim_ranges(["batch=1..64@8", "seq=1..512", "heads=12"])
    assert static == {"heads": 12}
    assert ranges == {"batch": DimRange(1, 64, 8), "seq": DimRange(1, 512)}
    assert ranges["batch"].weighed == 8 and ranges["seq"].weighed == 512
    for bad, why in [
        ("batch=64..1", "is empty (its min is above its max)"),
        ("batch=0..4", "starts at 1 or more"),
        ("batch=1..x", "neither a size"),
        ("batch=1..8@9", "typical size 9 is outside 1..8"),
        ("a b=1..4", "not a symbol name"),
    ]:
        with pytest.raises(InputError, match=re.escape(why)):
            parse_dim_ranges([bad])
    shapes, sranges = parse_shape_ranges(["x=1..8x3x224x224"])
    assert shapes == {"x": (8, 3, 224, 224)} and sranges == {("x", 0): DimRange(1, 8)}


def test_cli_refuses_an_empty_range(
    encoder: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, _ = encoder
    code, err = run_cli(
        ["compile", str(model), "-o", str(tmp_path / "o"), "--dim", "batch=8..1", "--dim", "seq=4"],
        capsys,
    )
    assert code == 2 and "the range 8..1 is empty" in err
    assert not (tmp_path / "o").exists()


def test_shape_ranges_name_the_models_symbol(encoder: tuple[Path, Path]) -> None:
    model, _ = encoder
    g = load_model(ModelArgs(path=model, shapes=("x=2..6x1..9x16",)))
    assert g.symbols == {"batch": DimRange(2, 6), "seq": DimRange(1, 9)}
    assert str(g.inputs[0].type) == "f32[batch, seq, 16]"


PROGRAM = """\
dim batch: 1..64@8

graph m(x: f32[batch, seq:1..16, 4]) -> (y: f32[batch*seq, 3]) {
    param w: f32[4, 3] = fill(0.5)
    h = relu(x)
    f = reshape(h, [-1, 4])
    y = f @ w
    return y
}
"""


def test_dsl_symbolic_dims_print_and_read_back() -> None:
    g = parse_program(PROGRAM)
    assert {k: str(v) for k, v in g.symbols.items()} == {"batch": "1..64@8", "seq": "1..16"}
    text = print_graph(g)
    assert "dim batch: 1..64@8\ndim seq: 1..16\n" in text
    assert "y: f32[batch*seq, 3] = matmul(" in text
    again = parse_program(text)
    assert print_graph(again) == text
    assert [str(v.type) for v in again.values()] == [str(v.type) for v in g.values()]


@pytest.mark.parametrize(
    ("sig", "message"),
    [
        ("x: f32[b, 4]", "unknown symbol 'b' in a dimension"),
        ("x: f32[b:4..2, 4]", "the range 4..2 is empty"),
        ("x: f32[b<=4, b<=8]", "symbol 'b' is 1..8 here but 1..4 before"),
    ],
)
def test_dsl_symbol_errors_point_at_the_dim(sig: str, message: str) -> None:
    from flowc.frontend.dsl import DslError

    with pytest.raises(DslError, match=message):
        parse_program(f"graph m({sig}) -> (y: f32[2]) {{\n    y = x\n    return y\n}}\n")


# -- the fits ---------------------------------------------------------------------------------


def test_multilinear_fit_finds_integer_polynomials_and_refuses_others() -> None:
    ranges = {"batch": DimRange(1, 64), "seq": DimRange(1, 512)}
    points = probe_points(ranges)
    assert all(1 < p["batch"] < 64 and 1 < p["seq"] < 512 for p in points)
    names = list(ranges)
    for f, want in [
        (lambda b, s: b * s, "batch*seq"),
        (lambda b, s: 2 * s + 1, "1+2*seq"),
        (lambda b, s: 12 * b * s + b, "batch+12*batch*seq"),
        (lambda b, s: 7, "7"),
    ]:
        got = fit(names, points, [f(p["batch"], p["seq"]) for p in points])
        assert str(got) == want
    assert fit(names, points, [p["seq"] // 2 + p["seq"] % 2 for p in points]) is None


def test_grid_fit_matches_numpy_polynomials() -> None:
    rng = np.random.default_rng(1)
    grid = [[5, 8, 13, 21], [3, 4, 9, 10]]
    for _ in range(20):
        coef = rng.integers(-5, 6, (4, 4))
        vals = [
            int(sum(coef[i, j] * b**i * s**j for i in range(4) for j in range(4)))
            for b in grid[0]
            for s in grid[1]
        ]
        f = fit_grid(["b", "s"], grid, vals)
        assert f is not None
        for b, s in [(1, 1), (7, 30), (100, 2)]:
            want = int(sum(coef[i, j] * b**i * s**j for i in range(4) for j in range(4)))
            got = f.evaluate({"b": b, "s": s}) if isinstance(f, SymDim) else f
            assert got == want


# -- outputs whose size depends on the data ---------------------------------------------------


def _detection(path: Path) -> Path:
    """Detection post-processing: boxes and scores -> NonMaxSuppression -> the selected
    boxes gathered; the number of boxes N is a named dim."""
    nh = numpy_helper
    nodes = [
        helper.make_node(
            "NonMaxSuppression",
            ["boxes", "scores", "k", "iou", "thr"],
            ["selected"],
            name="nms",
            center_point_box=0,
        ),
        helper.make_node("Gather", ["selected", "two"], ["box_index"], axis=1),
        helper.make_node("Squeeze", ["boxes", "zero"], ["b0"]),
        helper.make_node("Gather", ["b0", "box_index"], ["picked"], axis=0),
    ]
    inits = [
        nh.from_array(np.array([5], np.int64), "k"),
        nh.from_array(np.array([0.5], np.float32), "iou"),
        nh.from_array(np.array([0.3], np.float32), "thr"),
        nh.from_array(np.array(2, np.int64), "two"),
        nh.from_array(np.array([0], np.int64), "zero"),
    ]
    vi = helper.make_tensor_value_info
    g = helper.make_graph(
        nodes,
        "det",
        [vi("boxes", TensorProto.FLOAT, [1, "N", 4]), vi("scores", TensorProto.FLOAT, [1, 3, "N"])],
        [vi("selected", TensorProto.INT64, ["n", 3]), vi("picked", TensorProto.FLOAT, ["n", 4])],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def _boxes(n: int, seed: int, flipped: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    corner = rng.random((1, n, 2)).astype(np.float32)
    size = (rng.random((1, n, 2)) * 0.4).astype(np.float32)
    boxes = np.concatenate([corner, corner + size], -1).astype(np.float32)
    if flipped:  # the other corner first
        boxes = boxes[..., [2, 3, 0, 1]]
    scores = rng.random((1, 3, n)).astype(np.float32)
    if seed % 2:
        scores = np.round(scores * 4) / 4  # equal scores
    return {"boxes": np.ascontiguousarray(boxes), "scores": scores}


def test_detection_post_processing_equals_onnxruntime_exactly(tmp_path: Path) -> None:
    """One build for 8..200 boxes: the selection (a computed count of rows) and the boxes
    gathered by it, bit for bit, for random boxes of several counts."""
    model = _detection(tmp_path / "det.onnx")
    out = _compile(model, ("N=1..200",), tmp_path / "out")
    build(out, "host", quick=True)
    info = json.loads((out / "flowc_model.json").read_text())
    # the bound at the bound (3 classes x 5), kept below 5 boxes, where the op's is smaller
    assert {"name": "n0", "min": 0, "max": 15, "typical": 15} in info["symbols"]
    proto = onnx.load(str(model))
    for seed, n in enumerate([8, 9, 13, 64, 200, 150, 1, 2]):
        feeds = _boxes(n, seed, flipped=seed % 3 == 2)
        ref = run_onnxruntime(proto, feeds)
        got, _ = run(out, feeds)
        for k in ("selected", "picked"):
            assert got[k].shape == ref[k].shape and np.array_equal(got[k], ref[k]), (n, k)
    # In one process (the Python API), the counts the device computed size each output, run
    # after run, through the size buckets' graphs (every n within 129..200: one bucket).
    with Project(out).load("host") as m:
        for seed, n in enumerate([200, 150, 150, 9, 200]):
            feeds = _boxes(n, seed + 10, flipped=False)
            ref, got = run_onnxruntime(proto, feeds), m.run(feeds)
            for k in ("selected", "picked"):
                assert got[k].shape == ref[k].shape and np.array_equal(got[k], ref[k]), (n, k)
        assert m.cuda_graph_status() == "captured"


def test_a_count_bounded_by_a_changing_size_keeps_the_bounds_buffer(tmp_path: Path) -> None:
    """A program's non_zero of a [batch, 4] input: every reading at a probe size keeps the
    declared bound (n0 <= 32), so its type is fitted like any count's."""
    path = tmp_path / "nz.flow"
    path.write_text(
        "dim batch: 1..8\ndim n0: 0..32 computed\n\n"
        "graph m(x: f32[batch, 4]) -> (y: i64[2, n0]) {\n"
        "    y: i64[2, n0] = non_zero(x)\n    return y\n}\n"
    )
    graph = load_model(ModelArgs(path=path))
    assert graph.symbols["n0"] == DimRange(0, 32, computed=True)
    assert str(graph.outputs[0].type) == "i64[2, n0]"


def test_a_data_dependent_count_on_a_mesh_or_pipeline_is_refused(tmp_path: Path) -> None:
    """A count the device computes is each rank's own: a mesh or a later stage would not
    know it."""
    model = _detection(tmp_path / "det.onnx")
    for par in ({"mesh": "2"}, {"mesh": "2", "pipeline": 2}):
        with pytest.raises(InputError, match=r"count .* is for one device for now"):
            _mesh_compile(model, ("N=8..200",), tmp_path / "out", **par)
        assert not (tmp_path / "out").exists()


def test_a_count_past_its_bound_is_an_error_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    vi = helper.make_tensor_value_info
    g = helper.make_graph(
        [helper.make_node("NonZero", ["x"], ["idx"], name="nz")],
        "nz",
        [vi("x", TensorProto.FLOAT, [4, 5])],
        [vi("idx", TensorProto.INT64, [2, "n"])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(tmp_path / "nz.onnx"))
    code, err = run_cli(
        ["compile", str(tmp_path / "nz.onnx"), "-o", str(tmp_path / "o"), "--bound", "nope=3"],
        capsys,
    )
    assert code == 2 and "no data-dependent output named 'nope'" in err and "idx" in err
    out = tmp_path / "out"
    code, err = run_cli(
        [
            "compile",
            str(tmp_path / "nz.onnx"),
            "-o",
            str(out),
            "--bound",
            "idx=6",
            "--target",
            "host",
        ],
        capsys,
    )
    assert code == 0, err
    build(out, "host", quick=True)
    x = np.zeros((4, 5), np.float32)
    x[1, 2] = x[3, 0] = 1.0
    got, _ = run(out, {"x": x})
    assert np.array_equal(got["idx"], np.array(np.nonzero(x)))
    np.save(tmp_path / "x.npy", np.ones((4, 5), np.float32))  # 20 nonzero, 6 rows
    code, err = run_cli(
        ["run", str(out), "--input", f"x={tmp_path / 'x.npy'}", "-o", str(tmp_path / "o.npz")],
        capsys,
    )
    assert code == 2 and "had more rows than its bound" in err
    assert not (tmp_path / "o.npz").exists()


def _topk(path: Path) -> Path:
    """TopK with a k of run time (an input) over a symbolic batch, its values squared;
    beside it TopK with a constant k, the smallest first, and NonZero of the [batch, 10]
    input's positive part (a count whose op bounds it by a size that changes)."""
    vi = helper.make_tensor_value_info
    g = helper.make_graph(
        [
            helper.make_node("TopK", ["x", "k"], ["values", "idx"], axis=-1, name="top"),
            helper.make_node("Mul", ["values", "values"], ["sq"]),
            helper.make_node("TopK", ["x", "three"], ["low", "low_idx"], axis=1, largest=0),
            helper.make_node("Relu", ["x"], ["pos"]),
            helper.make_node("NonZero", ["pos"], ["nz"]),
        ],
        "topk",
        [vi("x", TensorProto.FLOAT, ["batch", 10]), vi("k", TensorProto.INT64, [1])],
        [
            vi("sq", TensorProto.FLOAT, ["batch", "n"]),
            vi("idx", TensorProto.INT64, ["batch", "n"]),
            vi("low", TensorProto.FLOAT, ["batch", 3]),
            vi("low_idx", TensorProto.INT64, ["batch", 3]),
            vi("nz", TensorProto.INT64, [2, "m"]),
        ],
        [numpy_helper.from_array(np.array([3], np.int64), "three")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def test_topk_with_a_k_of_run_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """k read on the device is the outputs' computed count (bounded by --bound idx=6), its
    consumer sized by it; a k past the bound or outside the axis is an error status.
    NonZero's count keeps the buffer of the bound's 8 x 10 elements at every batch."""
    model = _topk(tmp_path / "topk.onnx")
    out = tmp_path / "out"
    args = ["compile", str(model), "-o", str(out), "--dim", "batch=1..8", "--target", "host"]
    code, err = run_cli([*args, "--bound", "idx=6"], capsys)
    assert code == 0, err
    info = json.loads((out / "flowc_model.json").read_text())
    assert {"name": "n0", "min": 0, "max": 6, "typical": 6} in info["symbols"]
    assert {"name": "n1", "min": 0, "max": 80, "typical": 80} in info["symbols"]
    build(out, "host", quick=True)
    proto = onnx.load(str(model))
    rng = np.random.default_rng(7)
    with Project(out).load("host") as m:
        for b, k in ((1, 0), (8, 6), (3, 4), (8, 1), (5, 6)):
            x = rng.standard_normal((b, 10)).astype(np.float32)
            x[:, 2] = x[:, 5]  # a tie: the lower index first
            feeds = {"x": x, "k": np.array([k], np.int64)}
            ref, got = run_onnxruntime(proto, feeds), m.run(feeds)
            for name in ("sq", "idx", "low", "low_idx", "nz"):
                assert got[name].shape == ref[name].shape, (b, k, name)
                assert np.array_equal(got[name], ref[name]), (b, k, name)
    np.save(tmp_path / "x.npy", rng.standard_normal((2, 10)).astype(np.float32))
    for k, message in ((7, "had more rows than its bound"), (11, "TopK's k was negative")):
        np.save(tmp_path / "k.npy", np.array([k], np.int64))
        code, err = run_cli(
            [
                "run",
                str(out),
                "--input",
                f"x={tmp_path / 'x.npy'}",
                "--input",
                f"k={tmp_path / 'k.npy'}",
                "-o",
                str(tmp_path / "o.npz"),
            ],
            capsys,
        )
        assert code == 2 and message in err, (k, err)
        assert not (tmp_path / "o.npz").exists()
    code, err = run_cli([*args, "-o", str(tmp_path / "o2"), "--bound", "low=2"], capsys)
    assert code == 2 and "no data-dependent output named 'low'" in err


@pytest.mark.parametrize(
    ("decls", "body"),
    [
        (
            "dim n0: 0..20 computed",
            "graph m(x: f32[4, 5]) -> (y: i64[2, n0]) {\n"
            "    y: i64[2, n0] = non_zero(x)\n    return y\n",
        ),
        (
            "dim batch: 1..8\ndim n0: 0..6 computed",
            "graph m(x: f32[batch, 10], k: i64[1]) -> (v: f32[batch, n0], i: i64[batch, n0]) {\n"
            "    v: f32[batch, n0], i: i64[batch, n0] = topk(x, k, bound=6)\n    return v, i\n",
        ),
    ],
)
def test_computed_dims_print_and_read_back(decls: str, body: str) -> None:
    text = f"{decls}\n\n{body}}}\n"
    g = parse_program(text)
    assert g.symbols["n0"] == DimRange(0, 6 if "topk" in body else 20, computed=True)
    assert print_graph(g) == text


def test_shared_mlp_rewritten_with_a_dynamic_batch(tmp_path: Path) -> None:
    """The shared MLP with its batch dim renamed to a symbol: one build for 1..16 rows."""
    m, path = _with_dynamic_batch("mlp", tmp_path)
    out = _compile(path, ("batch=1..16",), tmp_path / "out")
    build(out, "host", quick=True)
    name = m.graph.input[0].name
    width = m.graph.input[0].type.tensor_type.shape.dim[1].dim_value
    for b in (1, 16, 5, 8):
        x = np.random.default_rng(b).standard_normal((b, width)).astype(np.float32)
        ref = run_onnxruntime(m, {name: x})
        got, _ = run(out, {name: x})
        for k, v in ref.items():
            assert got[k].shape == v.shape and max_rel_error(got[k], v) <= TOL, (b, k)


def _with_dynamic_batch(name: str, tmp_path: Path) -> tuple[onnx.ModelProto, Path]:
    """A shared model with its inputs' and outputs' first dim renamed to the symbol batch."""
    m = onnx.load(str(SHARED_MODELS / f"{name}.onnx"))
    for vi in (*m.graph.input, *m.graph.output):
        vi.type.tensor_type.shape.dim[0].dim_param = "batch"
    path = tmp_path / f"{name}.onnx"
    onnx.save(m, str(path))
    return m, path


def _batch_from_the_input(m: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite a model exported for one batch the way a dynamic export spells it. Each int64
    shape constant (a Constant node or an initializer) read by a Reshape, or by the Equal/Where
    of an Expand's shape: a leading 1 (the export's batch) becomes Concat(Shape(input)[0:1],
    the rest); a Reshape shape with no -1 gets -1 first (its first dim absorbs the batch:
    GPT-2's [seq, hidden] rows). Exported value_info (static shapes) is dropped."""
    g = m.graph
    readers: dict[str, set[str]] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, set()).add(n.op_type)
    c = numpy_helper.from_array
    nodes = [
        helper.make_node("Shape", [g.input[0].name], ["dyn_shape"]),
        helper.make_node("Constant", [], ["dyn_0"], value=c(np.array([0], np.int64))),
        helper.make_node("Constant", [], ["dyn_1"], value=c(np.array([1], np.int64))),
        helper.make_node("Slice", ["dyn_shape", "dyn_0", "dyn_1"], ["dyn_batch"]),
    ]

    def rewrite(name: str, v: np.ndarray) -> np.ndarray | None:
        """The constant's new value, or None where nodes made from the batch now give it."""
        reads = readers.get(name, set())
        if not (reads & {"Reshape", "Equal", "Where"}) or v.dtype != np.int64 or v.ndim != 1:
            return v
        if len(v) >= 2 and v[0] == 1:
            nodes.append(helper.make_node("Constant", [], [name + "_rest"], value=c(v[1:].copy())))
            nodes.append(helper.make_node("Concat", ["dyn_batch", name + "_rest"], [name], axis=0))
            return None
        if reads == {"Reshape"} and len(v) >= 2 and -1 not in v:
            return np.array([-1, *v[1:]], np.int64)
        return v

    inits = []
    for t in g.initializer:
        v = rewrite(t.name, numpy_helper.to_array(t))
        if v is not None:
            inits.append(c(v, t.name))
    for n in g.node:
        if n.op_type == "Constant" and n.attribute[0].name == "value":
            v = rewrite(n.output[0], numpy_helper.to_array(n.attribute[0].t))
            if v is not None:
                nodes.append(helper.make_node("Constant", [], [n.output[0]], value=c(v)))
        else:
            nodes.append(n)
    del g.node[:], g.initializer[:], g.value_info[:]
    g.node.extend(nodes)
    g.initializer.extend(inits)
    onnx.checker.check_model(m)
    return m


def _check_images(m: onnx.ModelProto, out: Path, batches: tuple[int, ...]) -> None:
    name = m.graph.input[0].name
    image = [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim[1:]]
    for b in batches:
        x = np.random.default_rng(b).standard_normal((b, *image)).astype(np.float32)
        ref = run_onnxruntime(m, {name: x})
        got, _ = run(out, {name: x})
        for k, v in ref.items():
            assert got[k].shape == v.shape and max_rel_error(got[k], v) <= TOL, (b, k)


def test_shared_vit_rewritten_with_a_dynamic_batch(tmp_path: Path) -> None:
    """The shared ViT (exported for one image) with its shape constants taking the batch
    from the input: the patch convolution, a batch-leading Transpose, the cls token's Expand
    and Concat, fused attention over 1..5 images against onnxruntime."""
    m, path = _with_dynamic_batch("vit_tiny", tmp_path)
    onnx.save(_batch_from_the_input(m), str(path))
    out = _compile(path, ("batch=1..5",), tmp_path / "out")
    build(out, "host", quick=True)
    _check_images(m, out, (1, 5, 2))


def test_shared_gpt2_rewritten_with_a_dynamic_batch(tmp_path: Path) -> None:
    """The shared GPT-2 (torch.export, one sequence of 32 tokens) with its shape constants
    taking the batch from the input: embeddings, Split, attention, the LM head over 1..4
    sequences against onnxruntime. (Its causal mask and positions are constants of the
    export's length: the sequence stays fixed.)"""
    m, path = _with_dynamic_batch("gpt2_tiny", tmp_path)
    m = inference_mode(_batch_from_the_input(m))
    onnx.save(m, str(path))
    out = _compile(path, ("batch=1..4",), tmp_path / "out")
    build(out, "host", quick=True)
    for b in (1, 4, 3):
        ids = np.random.default_rng(b).integers(0, 1000, (b, 32))
        ref = run_onnxruntime(m, {"input_ids": ids})
        got, _ = run(out, {"input_ids": ids})
        for k, v in ref.items():
            assert got[k].shape == v.shape and max_rel_error(got[k], v) <= TOL, (b, k)


def test_shared_resnet_with_a_dynamic_batch(tmp_path: Path) -> None:
    """Convolutions (library plans per power-of-two batch), max and global pools with a
    symbolic batch: one build for 1..6 images against onnxruntime."""
    m, path = _with_dynamic_batch("resnet_tiny", tmp_path)
    out = _compile(path, ("batch=1..6",), tmp_path / "out")
    build(out, "host", quick=True)
    _check_images(m, out, (1, 6, 3, 4))


def _reductions(path: Path) -> onnx.ModelProto:
    """Reductions over trailing fixed axes, Slice and Split of fixed axes and ArgMax over
    the last of x [batch, 6, 4]; reductions and arg reductions over the symbolic axes of
    z [batch, seq, 8] and m [batch, seq] (mean pooling over seq, the whole tensor, axes 0
    and 2, the log-sum-exp over seq last, the lengths of a 0/1 mask); z split along its
    last axis, sliced along seq from its front (the first token, all but it), from its end
    (the last token; x's last row of the batch) and backwards, and along the last axis
    backwards."""
    c = numpy_helper.from_array
    inits = [
        c(np.array([1], np.int64), "one"),
        c(np.array([5], np.int64), "five"),
        c(np.array([2], np.int64), "axis2"),
        c(np.array([-1], np.int64), "last"),
        c(np.array([2, 2], np.int64), "halves"),
        c(np.array([0, 2], np.int64), "ax02"),
        c(np.array([4, 4], np.int64), "halves4"),
        c(np.array([0], np.int64), "zero"),
        c(np.array([1 << 40], np.int64), "end"),
        c(np.array([7], np.int64), "seven"),
        c(np.array([-3], np.int64), "minus3"),
        c(np.array([-(1 << 40)], np.int64), "lowest"),
    ]
    nodes = [
        helper.make_node("ReduceMean", ["x", "last"], ["mean"], keepdims=1),
        helper.make_node("Sub", ["x", "mean"], ["centred"]),
        helper.make_node("Slice", ["centred", "one", "five", "one"], ["mid"]),
        helper.make_node("Split", ["mid", "halves"], ["a", "b"], axis=2),
        helper.make_node("Mul", ["a", "b"], ["ab"]),
        helper.make_node("ReduceSum", ["ab", "axis2"], ["s"], keepdims=0),
        helper.make_node("ArgMax", ["x"], ["arg"], axis=-1, keepdims=0),
        helper.make_node("ReduceMean", ["z", "one"], ["pool"], keepdims=0),
        helper.make_node("ReduceSum", ["z"], ["total"], keepdims=0),
        helper.make_node("ReduceMax", ["z", "ax02"], ["zmax"], keepdims=1),
        helper.make_node("ReduceMean", ["z", "last"], ["rowmean"], keepdims=1),
        helper.make_node("Transpose", ["z"], ["zt"], perm=[0, 2, 1]),
        helper.make_node("ReduceLogSumExp", ["zt", "last"], ["lse"], keepdims=0),
        helper.make_node("ArgMax", ["z"], ["zarg"], axis=1, keepdims=0),
        helper.make_node("ArgMin", ["z"], ["zlow"], axis=-1, select_last_index=1),
        helper.make_node("ReduceSum", ["m", "last"], ["lens"], keepdims=0),
        helper.make_node("Split", ["z", "halves4"], ["z_lo", "z_hi"], axis=2),
        helper.make_node("Slice", ["z", "zero", "one", "one"], ["cls"]),
        helper.make_node("Slice", ["z", "one", "end", "one"], ["tail"]),
        helper.make_node("Slice", ["z", "seven", "zero", "last", "minus3"], ["every3"]),
        helper.make_node("Slice", ["x", "last", "end", "zero"], ["lastrow"]),
        helper.make_node("Slice", ["z", "last", "end", "one"], ["last_token"]),
        helper.make_node("Slice", ["z", "last", "lowest", "one", "last"], ["backwards"]),
    ]
    vi = helper.make_tensor_value_info
    f, i = TensorProto.FLOAT, TensorProto.INT64
    g = helper.make_graph(
        nodes,
        "red",
        [
            vi("x", f, ["batch", 6, 4]),
            vi("z", f, ["batch", "seq", 8]),
            vi("m", i, ["batch", "seq"]),
        ],
        [
            vi("s", f, ["batch", 4]),
            vi("arg", i, ["batch", 6]),
            vi("pool", f, ["batch", 8]),
            vi("total", f, []),
            vi("zmax", f, [1, "seq", 1]),
            vi("rowmean", f, ["batch", "seq", 1]),
            vi("lse", f, ["batch", 8]),
            vi("zarg", i, ["batch", 8]),
            vi("zlow", i, ["batch", "seq", 1]),
            vi("lens", i, ["batch"]),
            vi("z_lo", f, ["batch", "seq", 4]),
            vi("z_hi", f, ["batch", "seq", 4]),
            vi("cls", f, ["batch", 1, 8]),
            vi("tail", f, ["batch", "seq - 1", 8]),
            vi("every3", f, ["batch", "seq", 2]),
            vi("lastrow", f, [1, 6, 4]),
            vi("last_token", f, ["batch", 1, 8]),
            vi("backwards", f, ["batch", "seq", 8]),
        ],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return m


def test_reductions_slices_and_splits_over_symbolic_dims(tmp_path: Path) -> None:
    """Reductions over trailing fixed axes (rows of the run's count), Slice and Split of
    fixed axes, ArgMax over the last, with the batch symbolic; reductions and arg
    reductions over symbolic axes (the run's extents read by the kernel); slices whose
    start moves with the sizes (the run's length plus a negative start); against
    onnxruntime."""
    m = _reductions(tmp_path / "red.onnx")
    out = _compile(tmp_path / "red.onnx", ("batch=1..8", "seq=1..16"), tmp_path / "out")
    build(out, "host", quick=True)
    with Project(out).load("host") as model:
        for b, t in ((1, 1), (8, 16), (3, 5), (8, 3), (2, 16)):
            rng = np.random.default_rng(b * t)
            z = rng.standard_normal((b, t, 8)).astype(np.float32)
            z[:, :, 5] = z[:, :, 2]  # ties: the first (ArgMax) and the last (select_last_index)
            feeds = {
                "x": rng.standard_normal((b, 6, 4)).astype(np.float32),
                "z": z,
                "m": rng.integers(0, 2, (b, t)).astype(np.int64),
            }
            ref, got = run_onnxruntime(m, feeds), model.run(feeds)
            for name, want in ref.items():
                assert got[name].shape == want.shape, (b, t, name)
                if want.dtype == np.int64:
                    assert np.array_equal(got[name], want), (b, t, name)
                else:
                    assert max_rel_error(got[name], want) <= TOL, (b, t, name)


def _transposes(path: Path) -> onnx.ModelProto:
    """Transposes that move b and s; an attention layer left unfused (ReLU for the softmax):
    products whose matrices change size, q K^T (s x s) and P V (contracting over s, a bias
    added), and a Gram matrix x x^T; the scores' lower triangle (Trilu) and a running sum
    over s (CumSum, as exporters compute positions)."""
    rng = np.random.default_rng(3)
    c = numpy_helper.from_array

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return c((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    inits = [
        weight("Wq", 16, 16),
        weight("Wk", 16, 16),
        weight("Wv", 16, 16),
        weight("bias", 8),
        c(np.array(0.25, np.float32), "scale"),
        c(np.array([0, 0, 2, 8], np.int64), "heads"),
        c(np.array(1, np.int64), "axis1"),
    ]
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]),
        helper.make_node("Relu", ["t"], ["y"]),
        helper.make_node("Transpose", ["x"], ["z"], perm=[2, 0, 1]),
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["x", "xt"], ["gram"]),
    ]
    for w in "qkv":
        nodes.append(helper.make_node("MatMul", ["h", f"W{w}"], [f"{w}0"]))
        nodes.append(helper.make_node("Reshape", [f"{w}0", "heads"], [f"{w}1"]))
        perm = [0, 2, 3, 1] if w == "k" else [0, 2, 1, 3]
        nodes.append(helper.make_node("Transpose", [f"{w}1"], [w], perm=perm))
    nodes += [
        helper.make_node("MatMul", ["q", "k"], ["s0"]),
        helper.make_node("Mul", ["s0", "scale"], ["s1"]),
        helper.make_node("Relu", ["s1"], ["p"]),
        helper.make_node("MatMul", ["p", "v"], ["o0"]),
        helper.make_node("Add", ["o0", "bias"], ["o"]),
        helper.make_node("Trilu", ["s1"], ["causal"], upper=0),
        helper.make_node("CumSum", ["x", "axis1"], ["pos"]),
    ]
    vi = helper.make_tensor_value_info
    f = TensorProto.FLOAT
    g = helper.make_graph(
        nodes,
        "tr",
        [vi("x", f, ["b", "s", 3]), vi("h", f, ["b", "s", 16])],
        [
            vi("y", f, ["s", "b", 3]),
            vi("z", f, [3, "b", "s"]),
            vi("gram", f, ["b", "s", "s"]),
            vi("o", f, ["b", 2, "s", 8]),
            vi("causal", f, ["b", 2, "s", "s"]),
            vi("pos", f, ["b", "s", 3]),
        ],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return m


def test_transposes_and_products_that_move_symbolic_dims(tmp_path: Path) -> None:
    """Batch and sequence moved by Transpose (seq-first layouts, heads before tokens): the
    run's dims and strides from the size table; products of matrices whose sizes change
    (flowc's tiled kernel, its extents and steps from the table); against onnxruntime."""
    m = _transposes(tmp_path / "tr.onnx")
    out = _compile(tmp_path / "tr.onnx", ("b=1..4", "s=1..9"), tmp_path / "out")
    build(out, "host", quick=True)
    code = (out / "model.cu").read_text()
    assert code.count("matmul_tiled_sized(const") == 3, "q K^T, P V and x x^T"
    with Project(out).load("host") as model:
        for b, s in [(1, 1), (4, 9), (3, 5), (2, 9), (4, 2)]:
            rng = np.random.default_rng(b + s)
            feeds = {
                "x": rng.standard_normal((b, s, 3)).astype(np.float32),
                "h": rng.standard_normal((b, s, 16)).astype(np.float32),
            }
            got = model.run(feeds)
            for k, v in run_onnxruntime(m, feeds).items():
                assert got[k].shape == v.shape, (b, s, k)
                if k in ("y", "z"):
                    assert np.array_equal(got[k], v), (b, s, k)
                else:
                    assert max_rel_error(got[k], v) <= TOL, (b, s, k)


def test_concat_places_each_input_at_its_run_time_offset(tmp_path: Path) -> None:
    vi = helper.make_tensor_value_info
    nodes = [
        helper.make_node("Concat", ["x", "y"], ["c"], axis=1),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Concat", ["r", "r"], ["z"], axis=0),
    ]
    g = helper.make_graph(
        nodes,
        "cc",
        [vi("x", TensorProto.FLOAT, ["b", "s", 4]), vi("y", TensorProto.FLOAT, ["b", 3, 4])],
        [vi("z", TensorProto.FLOAT, ["z0", "z1", 4])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(tmp_path / "cc.onnx"))
    out = _compile(tmp_path / "cc.onnx", ("b=1..4", "s=1..9"), tmp_path / "out")
    build(out, "host", quick=True)
    for b, s in [(1, 1), (4, 9), (2, 5)]:
        rng = np.random.default_rng(b + s)
        feeds = {
            "x": rng.standard_normal((b, s, 4)).astype(np.float32),
            "y": rng.standard_normal((b, 3, 4)).astype(np.float32),
        }
        got, _ = run(out, feeds)
        assert np.array_equal(got["z"], run_onnxruntime(m, feeds)["z"]), (b, s)
