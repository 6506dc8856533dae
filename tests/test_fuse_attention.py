"""fuse_attention and the FusedAttention kernel: the pattern as exporters spell it becomes
one node per layer (the shared models, the GPT-2-small-size graph), with no copy left for
K^T, the head split or the Split of a fused projection; the fused kernel on the host target
and the op's NumPy reference agree with onnxruntime on the unfused model, at shapes that
cover causal, additive and where masks, no mask, the NaN guard, S not a multiple of the
tile, head dims 64, 128 and odd ones, rank-3 heads and K given already transposed."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import REPO, SHARED_MODELS
from onnx import TensorProto, helper, numpy_helper

from flowc.compiler import compile_graph
from flowc.frontend.onnx import ImportOptions, import_model, import_onnx
from flowc.harness.build import build, run
from flowc.harness.compare import max_rel_error
from flowc.harness.ort import run_onnxruntime
from flowc.interpreter import evaluate
from flowc.ir.dtype import DType
from flowc.ir.graph import Graph
from flowc.passes.manager import COMPILE_PIPELINE, PassManager, compile_pipeline

TOL = 1e-4
F32_MIN = float(np.finfo(np.float32).min)


class _Model:
    """A few attention subgraphs side by side, each with its own inputs and output."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.feeds: dict[str, np.ndarray] = {}
        self.rng = np.random.default_rng(0)
        self.count = 0

    def op(self, op: str, ins: list[str], **attrs: object) -> str:
        self.count += 1
        out = f"{op.lower()}_{self.count}"
        self.nodes.append(helper.make_node(op, ins, [out], name=f"n{self.count}", **attrs))
        return out

    def const(self, a: np.ndarray) -> str:
        name = f"c{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(a, name))
        return name

    def input(self, name: str, a: np.ndarray) -> str:
        dt = TensorProto.BOOL if a.dtype == bool else helper.np_dtype_to_tensor_dtype(a.dtype)
        self.inputs.append(helper.make_tensor_value_info(name, dt, list(a.shape)))
        self.feeds[name] = a
        return name

    def randn(self, name: str, *shape: int) -> str:
        return self.input(name, self.rng.standard_normal(shape).astype(np.float32))

    def output(self, v: str, shape: tuple[int, ...]) -> None:
        self.outputs.append(helper.make_tensor_value_info(v, TensorProto.FLOAT, list(shape)))

    def heads(self, x: str, b: int, s: int, h: int, d: int, perm: list[int]) -> str:
        shape = self.const(np.array([b, s, h, d], dtype=np.int64))
        return self.op("Transpose", [self.op("Reshape", [x, shape])], perm=perm)

    def merge(self, o: str, b: int, s: int, e: int) -> str:
        t = self.op("Transpose", [o], perm=[0, 2, 1, 3])
        return self.op("Reshape", [t, self.const(np.array([b, s, e], dtype=np.int64))])

    def model(self) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, "attn", self.inputs, self.outputs, self.inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _cases() -> _Model:
    m = _Model()
    # BERT (TorchScript): projections split into heads, K by Transpose(0,2,3,1), Div by
    # sqrt(d), an additive (1 - mask) * finfo.min with padding; S = 37 (two key tiles).
    b, s, h, d = 2, 37, 2, 64
    q, k, v = (m.randn(f"a_{w}", b, s, h * d) for w in "qkv")
    scores = m.op(
        "MatMul", [m.heads(q, b, s, h, d, [0, 2, 1, 3]), m.heads(k, b, s, h, d, [0, 2, 3, 1])]
    )
    scores = m.op("Div", [scores, m.const(np.array(math.sqrt(d), dtype=np.float32))])
    keep = np.ones((b, s), dtype=np.int64)
    keep[1, 29:] = 0
    mask = m.op("Cast", [m.input("a_mask", keep)], to=TensorProto.FLOAT)
    mask = m.op("Sub", [m.const(np.array(1.0, dtype=np.float32)), mask])
    mask = m.op("Mul", [mask, m.const(np.array(F32_MIN, dtype=np.float32))])
    mask = m.op("Unsqueeze", [mask, m.const(np.array([1, 2], dtype=np.int64))])
    p = m.op("Softmax", [m.op("Add", [scores, mask])], axis=-1)
    o = m.op("MatMul", [p, m.heads(v, b, s, h, d, [0, 2, 1, 3])])
    m.output(m.merge(o, b, s, h * d), (b, s, h * d))

    # GPT-2 (torch.export): one (B, S, 3E) projection split in three, the scale on Q and K,
    # Where(causal, scores, finfo.min), the NaN guard; odd head dim 17, S = 40.
    b, s, h, d = 1, 40, 3, 17
    qkv = m.randn("b_qkv", b, s, 3 * h * d)
    parts = [f"b_split{i}" for i in range(3)]
    m.nodes.append(helper.make_node("Split", [qkv], parts, name="split", axis=-1, num_outputs=3))
    root = m.const(np.array(1 / math.sqrt(math.sqrt(d)), dtype=np.float32))
    qh = m.op("Mul", [m.heads(parts[0], b, s, h, d, [0, 2, 1, 3]), root])
    kt = m.op("Mul", [m.heads(parts[1], b, s, h, d, [0, 2, 3, 1]), root])
    causal = m.const(np.tril(np.ones((s, s), dtype=bool)).reshape(1, 1, s, s))
    lowest = m.const(np.array(F32_MIN, dtype=np.float32))
    p = m.op("Softmax", [m.op("Where", [causal, m.op("MatMul", [qh, kt]), lowest])], axis=-1)
    zero = m.const(np.array(0.0, dtype=np.float32))
    p = m.op("Where", [m.op("IsNaN", [p]), zero, p])
    o = m.op("MatMul", [p, m.heads(parts[2], b, s, h, d, [0, 2, 1, 3])])
    m.output(m.merge(o, b, s, h * d), (b, s, h * d))

    # No mask; Q, K^T and V given in head layout (K already transposed); head dim 128 (the
    # smaller key tile), 5 queries over 70 keys (three tiles), the scale after the product.
    b, h, sq, sk, d = 1, 2, 5, 70, 128
    scores = m.op("MatMul", [m.randn("c_q", b, h, sq, d), m.randn("c_kt", b, h, d, sk)])
    scores = m.op("Mul", [m.const(np.array(1 / math.sqrt(d), dtype=np.float32)), scores])
    o = m.op("MatMul", [m.op("Softmax", [scores], axis=-1), m.randn("c_v", b, h, sk, d)])
    m.output(o, (b, h, sq, d))

    # Rank-3 heads (B * H, S, D), a run-time Where(pad, -inf, scores) that masks every key
    # of one head (its row is NaN, which the guard maps to 0), then an additive bias.
    n, s, d = 4, 33, 32
    pad = np.zeros((n, 1, s), dtype=bool)
    pad[1, 0, 20:] = True
    pad[3] = True
    q, k, v = (m.randn(f"d_{w}", n, s, d) for w in "qkv")
    scores = m.op("MatMul", [q, m.op("Transpose", [k], perm=[0, 2, 1])])
    ninf = m.const(np.array(-np.inf, dtype=np.float32))
    scores = m.op("Where", [m.input("d_pad", pad), ninf, scores])
    scores = m.op("Add", [scores, m.randn("d_bias", 1, s, s)])
    p = m.op("Softmax", [scores], axis=-1)
    p = m.op("Where", [m.op("IsNaN", [p]), zero, p])
    m.output(m.op("MatMul", [p, v]), (n, s, d))
    return m


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> tuple[_Model, Graph, Path]:
    m = _cases()
    graph = PassManager(COMPILE_PIPELINE).run(import_model(m.model(), name="attn"))
    out = tmp_path_factory.mktemp("attn") / "out"
    compile_graph(graph, out, poison=True)
    build(out, "host", quick=True)
    return m, graph, out


def test_every_case_fuses_with_no_copies(cases: tuple[_Model, Graph, Path]) -> None:
    _, graph, _ = cases
    counts = graph.op_counts()
    assert counts.get("FusedAttention") == 4, counts
    # Head splits, K^T, the Split and the scores are all read in place.
    for op in ("Transpose", "Split", "Softmax", "MatMul", "IsNaN"):
        assert op not in counts, counts
    fused = {n.outputs[0].name: n for n in graph.nodes if n.op == "FusedAttention"}
    causal = [n for n in fused.values() if n.attrs["causal"]]
    assert len(causal) == 1 and len(causal[0].inputs) == 3  # the constant mask is gone
    assert causal[0].attrs["q_chunk"] == (0, 3) and causal[0].attrs["v_chunk"] == (2, 3)


def test_host_kernel_and_reference_match_onnxruntime(cases: tuple[_Model, Graph, Path]) -> None:
    m, graph, out = cases
    ref = run_onnxruntime(m.model(), m.feeds)
    ours = evaluate(graph, m.feeds)
    got, _ = run(out, m.feeds, env={"FLOWC_SIM_ORDER": "shuffle:3"})
    for k, want in ref.items():
        assert np.isfinite(want).all(), k  # the NaN guard made the masked head 0
        assert max_rel_error(ours[k], want) <= TOL, k
        assert max_rel_error(got[k], want) <= TOL, k


def _fused_count(graph: Graph) -> int:
    return graph.op_counts().get("FusedAttention", 0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    ("name", "layers", "dims"),
    [("bert_tiny", 2, {"batch": 2, "seq": 32}), ("gpt2_tiny", 2, {}), ("vit_tiny", 2, {})],
)
def test_one_fused_attention_per_layer(
    name: str, layers: int, dims: dict[str, int], precision: str
) -> None:
    """Also in bf16 storage, where Casts surround every step: the kernel reads the narrow
    values and computes in float32."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = import_onnx(SHARED_MODELS / f"{name}.onnx", ImportOptions(dims=dims))
    g = PassManager(compile_pipeline(precision)).run(g)
    assert _fused_count(g) == layers
    counts = g.op_counts()
    assert "Softmax" not in counts and "Split" not in counts, counts
    for n in g.nodes:
        if n.op == "FusedAttention" and precision == "bf16":
            assert {i.type.dtype for i in n.inputs[:3] if i is not None} == {DType.BF16}


def test_gpt2_small_size_graph_has_no_head_copies(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    from gpt2_graph import gpt2_model

    path = tmp_path / "gpt2.onnx"
    model = gpt2_model(12, 768, 12, 128, 1, 1000, weights="fill")
    onnx.save(model, str(path))
    g = PassManager(COMPILE_PIPELINE).run(import_onnx(path))
    counts = g.op_counts()
    assert _fused_count(g) == 12
    # No copy kernel is left for K^T, the head split, the merge or the q/k/v Split.
    assert "Transpose" not in counts and "Split" not in counts, counts
    for n in g.nodes:
        if n.op == "FusedAttention":
            assert n.attrs["causal"] == 1 and len(n.inputs) == 3
            assert {i.name for i in n.inputs if i is not None} == {n.inputs[0].name}


@pytest.mark.parametrize(
    ("name", "method", "batch"),
    [("bert_tiny", "tensor", 2), ("gpt2_tiny", "tensor", 2), ("bert_tiny", "data", 4)],
)
def test_fused_attention_splits_heads_and_batches_on_a_mesh(
    name: str, method: str, batch: int
) -> None:
    """The op's SBP signatures: heads (or batches) split over 2 ranks, each rank's
    FusedAttention reading its own share, checked by the multi-rank simulator."""
    from test_parallel_models import check_outputs, logical, reference, tensor_parallel

    from flowc.compiler import parallelize
    from flowc.ir.types import Mesh
    from flowc.parallel import ParallelOptions
    from flowc.parallel.simulate import simulate

    g = PassManager(("lower_ops", "widen_types", "fuse_attention")).run(logical(name, batch))
    assert _fused_count(g) == 2
    mesh = Mesh("gpus", (2,))
    if method == "tensor":
        opts = ParallelOptions(mesh, "auto", sbp=tensor_parallel(g, mesh))
    else:
        opts = ParallelOptions(mesh, "data")
    result = parallelize(g, opts)
    fused = [n for n in result.plan.node_strategy if n.op == "FusedAttention"]
    assert all(result.plan.value_sbp[n.outputs[0]].parts[0].kind == "S" for n in fused)
    local = [n for n in result.physical.graph.nodes if n.op == "FusedAttention"]
    assert all(n.outputs[0].type.numel * 2 == fused[0].outputs[0].type.numel for n in local)
    feeds, ref = reference(name, batch)
    check_outputs(name, simulate(result.physical, feeds), ref, batch)


def test_fused_node_keeps_its_pipeline_stage() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the export's training-mode Dropout
        g = import_onnx(SHARED_MODELS / "gpt2_tiny.onnx")
    g = PassManager(("fold_constants", "simplify", "lower_ops", "widen_types")).run(g)
    for k, n in enumerate(n for n in g.nodes if n.op == "Softmax"):
        n.stage = k
    g = PassManager(("fuse_attention",)).run(g)
    assert [n.stage for n in g.nodes if n.op == "FusedAttention"] == [0, 1]
