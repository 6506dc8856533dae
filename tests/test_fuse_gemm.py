"""fuse_gemm: GEMM epilogues (bias, ReLU, the tanh GELU in its spellings, the residual as C),
K^T as a transpose flag, Split chunks and head splits read in place, on small onnx.helper
models against onnxruntime (flowc's reference and the host build), and what fuses on the
shared transformer models."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import SHARED_MODELS
from onnx import TensorProto, helper, numpy_helper
from test_models import _shared_io

from flowc.compiler import compile_graph
from flowc.frontend.onnx import ImportOptions, import_model, import_onnx
from flowc.harness.build import build, run
from flowc.harness.compare import max_rel_error
from flowc.harness.ort import run_onnxruntime
from flowc.interpreter import evaluate
from flowc.ir.graph import Graph, Node
from flowc.passes.manager import COMPILE_PIPELINE, PassManager, compile_pipeline

RNG = np.random.default_rng(5)
TOL = 1e-5


def _f(*shape: int) -> np.ndarray:
    return RNG.uniform(-1.5, 1.5, shape).astype(np.float32)


class _Model:
    """An ONNX graph under construction: nodes, inputs, weights, outputs."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.outputs: list[str] = []
        self.feeds: dict[str, np.ndarray] = {}
        self.k = 0

    def input(self, name: str, a: np.ndarray) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, a.shape))
        self.feeds[name] = a
        return name

    def const(self, a: np.ndarray | float) -> str:
        name = f"c{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(a, dtype=np.float32), name))
        return name

    def const_i64(self, values: list[int]) -> str:
        name = f"c{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.array(values, dtype=np.int64), name))
        return name

    def op(self, op: str, *ins: str, out: str | None = None, **attrs: object) -> str:
        self.k += 1
        name = out or f"t{self.k}"
        self.nodes.append(helper.make_node(op, list(ins), [name], name=f"n{self.k}", **attrs))
        return name

    def output(self, name: str) -> None:
        self.outputs.append(name)

    def proto(self) -> onnx.ModelProto:
        outs = [helper.make_empty_tensor_value_info(o) for o in self.outputs]
        g = helper.make_graph(self.nodes, "fusions", self.inputs, outs, initializer=self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
        m.ir_version = 9
        return m


def _tanh_gelu(m: _Model, z: str, cube: bool, out: str) -> str:
    """0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))), with Pow or z*z*z, operands in
    the orders PyTorch's exporters emit (HF gelu_new) and a reordered one."""
    z3 = m.op("Mul", m.op("Mul", z, z), z) if cube else m.op("Pow", z, m.const(3.0))
    inner = m.op("Mul", m.op("Add", z, m.op("Mul", m.const(0.044715), z3)), m.const(0.7978846))
    one_plus = m.op("Add", m.const(1.0), m.op("Tanh", inner))
    if cube:
        return m.op("Mul", one_plus, m.op("Mul", m.const(0.5), z), out=out)
    return m.op("Mul", m.op("Mul", z, m.const(0.5)), one_plus, out=out)


def fusion_model() -> _Model:
    m = _Model()
    x = m.input("x", _f(4, 6))
    x3 = m.input("x3", _f(2, 3, 6))
    r = m.input("r", _f(4, 5))
    r3 = m.input("r3", _f(2, 3, 5))
    y = m.input("y", _f(5, 6))
    xs = m.input("xs", _f(3, 6))
    h = m.input("h", _f(4, 8))
    hb = m.input("hb", _f(2, 4, 3))
    w, b = m.const(_f(6, 5)), m.const(_f(5))

    def linear() -> str:
        return m.op("Add", m.op("MatMul", x, w), b)

    m.op("Relu", linear(), out="relu")
    _tanh_gelu(m, linear(), cube=False, out="gelu_pow")
    _tanh_gelu(m, linear(), cube=True, out="gelu_cube")
    # TorchScript's erf GELU: exact, one element-wise kernel after the GEMM.
    z = linear()
    erf = m.op("Erf", m.op("Div", z, m.const(1.4142135)))
    m.op("Mul", m.op("Mul", z, m.const(0.5)), m.op("Add", erf, m.const(1.0)), out="gelu_erf")
    m.op("Gelu", linear(), out="onnx_gelu_tanh", approximate="tanh")
    m.op("Gelu", linear(), out="onnx_gelu_erf")
    # Gemm's C as the bias, then a residual Add; a 3-D MatMul with bias and residual.
    g = m.op("Gemm", x, m.const(_f(5, 6)), m.const(_f(5)), transB=1)
    m.op("Add", r, g, out="gemm_res")
    m.op("Add", m.op("Add", m.op("MatMul", x3, w), b), r3, out="mm3_res")
    # K^T: the transpose flag.
    m.op("MatMul", x, m.op("Transpose", y, perm=[1, 0]), out="kt")
    # A fused projection split in three, its chunks read in place (q, k^T, v).
    q, k, v = (f"qkv{i}" for i in range(3))
    proj = m.op("MatMul", xs, m.const(_f(6, 12)))
    m.nodes.append(helper.make_node("Split", [proj], [q, k, v], axis=-1, num_outputs=3))
    scores = m.op("MatMul", q, m.op("Transpose", k, perm=[1, 0]))
    m.op("MatMul", scores, v, out="split_views")
    # A head split (S, H*D) -> (H, S, D) read through batch strides.
    heads = m.op("Transpose", m.op("Reshape", h, m.const_i64([4, 2, 4])), perm=[1, 0, 2])
    m.op("MatMul", heads, hb, out="head_split")
    # (B, S, H*D) -> (B, H, S, D): no one stride steps over both B and H (S > 1), so a loop
    # over B of strided-batched calls over H.
    h2, hb2 = m.input("h2", _f(2, 3, 8)), m.input("hb2", _f(2, 2, 4, 3))
    heads2 = m.op("Transpose", m.op("Reshape", h2, m.const_i64([2, 3, 2, 4])), perm=[0, 2, 1, 3])
    m.op("MatMul", heads2, hb2, out="head_split_batched")
    for o in [
        "relu",
        "gelu_pow",
        "gelu_cube",
        "gelu_erf",
        "onnx_gelu_tanh",
        "onnx_gelu_erf",
        "gemm_res",
        "mm3_res",
        "kt",
        "split_views",
        "head_split",
        "head_split_batched",
    ]:
        m.output(o)
    return m


def _producer(graph: Graph, name: str) -> Node:
    (v,) = [o for o in graph.outputs if o.name == name]
    assert v.producer is not None
    return v.producer


def _gemm_of(graph: Graph, name: str) -> Node:
    """The FusedGemm whose result the output ``name`` is (through a free Reshape view)."""
    node = _producer(graph, name)
    while node.op == "Reshape":
        src = node.inputs[0]
        assert src is not None and src.producer is not None
        node = src.producer
    return node


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Graph, Path, _Model]:
    m = fusion_model()
    graph = PassManager(COMPILE_PIPELINE).run(import_model(m.proto()))
    out = tmp_path_factory.mktemp("fuse_gemm") / "out"
    compile_graph(graph, out, poison=True)
    bdir = build(out, "host", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
    return graph, out, m


def test_epilogues_fused(compiled: tuple[Graph, Path, _Model]) -> None:
    graph, _, _ = compiled
    ops = graph.op_counts()
    # Only the fused projection stays a plain GEMM (nothing follows it but its chunks' reads).
    assert ops.get("MatMul") == 1 and "Gemm" not in ops, ops
    # The Split and the K^T / head-split Transposes are read in place, not copied.
    assert "Split" not in ops and "Transpose" not in ops, ops
    for name, act in (
        ("relu", "relu"),
        ("gelu_pow", "gelu_tanh"),
        ("gelu_cube", "gelu_tanh"),
        ("onnx_gelu_tanh", "gelu_tanh"),
    ):
        node = _producer(graph, name)
        assert node.op == "FusedGemm", (name, node.op)
        assert node.attrs["activation"] == act and node.inputs[2] is not None, name
    # The erf GELUs keep their exact form: the bias fuses into the GEMM, the GELU is one
    # element-wise kernel (its Div, Erf, Add and Muls in one FusedElementwise).
    for name in ("gelu_erf", "onnx_gelu_erf"):
        node = _producer(graph, name)
        assert node.op in ("FusedElementwise", "Gelu"), (name, node.op)
        (src,) = [i for i in node.inputs if i is not None and i.producer is not None]
        gemm = src.producer
        assert gemm is not None and gemm.op == "FusedGemm", name
        assert gemm.attrs.get("activation", "none") == "none" and gemm.inputs[2] is not None
    for name in ("gemm_res", "mm3_res"):
        node = _gemm_of(graph, name)
        assert node.op == "FusedGemm" and node.inputs[2] is not None, name
        assert len(node.inputs) > 3 and node.inputs[3] is not None, name
    kt = _producer(graph, "kt")
    assert kt.attrs.get("transB") == 1 and kt.inputs[1] is not None
    assert kt.inputs[1].name == "y"
    heads = _producer(graph, "head_split")
    # (H, S, D) read from (S, H*D): batch stride D, leading dimension H*D (through the
    # Reshape, a free view of h).
    assert heads.attrs.get("a_view") == (0, 4, 8, 1)
    src = heads.inputs[0]
    assert src is not None and src.producer is not None and src.producer.op == "Reshape"
    batched = _producer(graph, "head_split_batched")
    assert batched.attrs.get("a_view") == (0, 24, 4, 8, 1)
    views = [_producer(graph, "split_views")]
    views.append(views[0].inputs[0].producer)  # type: ignore[union-attr]
    assert {n.attrs.get("b_view") for n in views} == {(8, 12, 1), (4, 1, 12)}


def test_fused_graph_matches_onnxruntime(compiled: tuple[Graph, Path, _Model]) -> None:
    graph, out, m = compiled
    ref = run_onnxruntime(m.proto(), m.feeds)
    # flowc's NumPy reference of the fused graph, and the host build (cuBLASLt's epilogues
    # emulated through CBLAS).
    interpreted = evaluate(graph, m.feeds)
    got, _ = run(out, m.feeds, env={"FLOWC_SIM_ORDER": "shuffle:2"})
    for name in m.outputs:
        assert max_rel_error(interpreted[name], ref[name]) <= TOL, name
        assert max_rel_error(got[name], ref[name]) <= TOL, name


def _fused(name: str, precision: str = "fp32") -> list[Node]:
    feeds, _ = _shared_io(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = import_onnx(
            SHARED_MODELS / f"{name}.onnx",
            ImportOptions(shapes={k: v.shape for k, v in feeds.items()}),
        )
    graph = PassManager(compile_pipeline(precision)).run(graph)
    return [n for n in graph.nodes if n.op == "FusedGemm"]


def _counts(nodes: list[Node]) -> dict[str, int]:
    return {
        "bias": sum(len(n.inputs) > 2 and n.inputs[2] is not None for n in nodes),
        "residual": sum(len(n.inputs) > 3 and n.inputs[3] is not None for n in nodes),
        "gelu": sum(n.attrs.get("activation") == "gelu_tanh" for n in nodes),
        "relu": sum(n.attrs.get("activation") == "relu" for n in nodes),
    }


def test_shared_models_epilogues() -> None:
    # Two layers each. GPT-2's MLP spells the tanh GELU (gelu_new) with Pow: fused; BERT's
    # and ViT's erf GELU stays exact (an element-wise kernel); the residual Adds after the
    # attention output and the MLP projections become C.
    gpt2 = _counts(_fused("gpt2_tiny"))
    assert gpt2["gelu"] == 2 and gpt2["residual"] == 4, gpt2
    for name in ("bert_tiny", "vit_tiny"):
        c = _counts(_fused(name))
        assert c["residual"] == 4 and c["bias"] >= 10 and c["gelu"] == 0, (name, c)
    mlp = _counts(_fused("mlp"))
    assert mlp == {"bias": 2, "residual": 0, "gelu": 0, "relu": 1}, mlp
    # Stored in bfloat16: through widen_types' casts, with the GELU's constants rounded.
    gpt2 = _counts(_fused("gpt2_tiny", "bf16"))
    assert gpt2["gelu"] == 2 and gpt2["residual"] == 4, gpt2
