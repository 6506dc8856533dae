"""Fused attention in training: FusedAttention's VJP (FusedAttentionGrad, a flash-style
backward recomputing the scores: no [Sq, Sk] buffer) against float64 central differences of
the forward's reference over its masks and layouts; the backward's kernels compiled for the
host against the float64 evaluation; and a transformer trained with its attention fused,
equal to the unfused step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_autodiff import check_vjp, host_matches_float64

R = np.random.default_rng(11)


def r(*shape: int) -> np.ndarray:
    return R.standard_normal(shape)


B, H, SQ, SK, D, DV = 2, 2, 3, 4, 3, 2


def _attrs(**kw: Any) -> dict[str, Any]:
    return {"sizes": [B, H, SQ, SK, D, DV], "scale": 0.7, **kw}


def _qkv() -> list[np.ndarray]:
    return [r(B, H, SQ, D), r(B, H, SK, D), r(B, H, SK, DV)]


CASES: list[tuple[str, dict[str, Any], list[Any], dict[int, np.ndarray]]] = []


def _case(name: str, attrs: dict[str, Any], extra: list[Any], consts: dict[int, Any]) -> None:
    CASES.append((name, attrs, extra, consts))


_pad = np.where(np.arange(SK) < 3, 0.0, -1e9).reshape(1, 1, 1, SK)  # the last key padded
_case("plain", _attrs(), [], {})
_case("padding mask", _attrs(), [_pad], {3: _pad})
_case("causal", _attrs(causal=1), [], {})
_keep = R.random((B, 1, SQ, SK)) > 0.3
_case("where keep_true", _attrs(where="keep_true", where_fill=-3.0), [None, _keep], {4: _keep})
_key = np.asarray(3, np.int64)  # the step a dropout's mask is drawn at
_case(
    "dropout",
    _attrs(dropout=0.3, dropout_stream=2, seed=5),
    [None, None, _key],
    {5: _key},
)
_bias = r(1, H, SQ, SK)
_case(
    "where, then a mask",
    _attrs(where="keep_false", where_fill=-2.0, mask_first=0),
    [_bias, _keep],
    {3: _bias, 4: _keep},
)


@pytest.mark.parametrize(("name", "attrs", "extra", "consts"), CASES, ids=[c[0] for c in CASES])
def test_fused_attention_vjp(
    name: str, attrs: dict[str, Any], extra: list[Any], consts: dict[int, np.ndarray]
) -> None:
    check_vjp("FusedAttention", [*_qkv(), *extra], attrs, consts=consts)


def test_vjp_through_layouts_and_chunks() -> None:
    # Q, K, V as the three chunks of one fused (b, s, 3*h*d) projection, K shared by the
    # batch (b broadcast), the output merged back to (b, s, h*dv).
    b, h, s, d = 2, 2, 3, 2
    qkv = r(b, s, 3 * h * d)
    attrs = {
        "sizes": [b, h, s, s, d, d],
        "q_layout": "b,s,chd",
        "k_layout": "b,s,chd",
        "v_layout": "b,s,chd",
        "q_chunk": [0, 3],
        "k_chunk": [1, 3],
        "v_chunk": [2, 3],
        "out_layout": "b,s,hd",
        "scale": 0.5,
    }
    check_vjp("FusedAttention", [qkv, qkv.copy(), qkv.copy()], attrs)
    shared = {"sizes": [b, h, s, s, d, d], "k_layout": "h,s,d", "scale": 0.5}
    check_vjp("FusedAttention", [r(b, h, s, d), r(h, s, d), r(b, h, s, d)], shared)


def test_the_backward_kernels_on_the_host_match_float64(tmp_path: Path) -> None:
    # A padding bias (trained), a where condition, causal, dropout on the probabilities.
    from flowc.autodiff import gradients
    from flowc.ir.builder import GraphBuilder
    from flowc.ir.dtype import DType
    from flowc.ir.graph import Graph
    from flowc.ir.types import TensorType

    b, h, sq, sk, d, dv = 2, 3, 5, 7, 4, 3

    def network(dt: DType) -> Graph:
        g = Graph("attn")
        gb = GraphBuilder(g, fold=False)
        q = g.add_input("q", TensorType((b, sq, h * d), dt))
        k = g.add_input("k", TensorType((b, h, sk, d), dt))
        v = g.add_input("v", TensorType((b, h, sk, dv), dt))
        bias = g.add_input("bias", TensorType((b, 1, 1, sk), dt))
        keep = gb.constant("keep", np.arange(sk)[None, None, None, :] % 3 != 1)
        attrs = {
            "sizes": [b, h, sq, sk, d, dv],
            "q_layout": "b,s,hd",
            "out_layout": "b,s,hd",
            "scale": 0.6,
            "where": "keep_true",
            "where_fill": -5.0,
            "causal": 1,
            "dropout": 0.25,
            "dropout_stream": 1,
            "seed": 7,
        }
        step = gb.constant("step", np.asarray(4, np.int64))
        y = gb.emit("FusedAttention", [q, k, v, bias, keep, step], attrs)[0]
        w = gb.constant(
            "w", np.linspace(-1, 1, b * sq * h * dv).reshape(b, sq, h * dv).astype(dt.np)
        )
        loss = gb.emit("ReduceSum", [gb.emit("Mul", [y, w])[0]], {"keepdims": 0})[0]
        # The bias trained too: the backward's scores-gradient path.
        grads = gradients(g, loss, [q, k, v, bias])
        g.outputs = [loss, *(grads[x] for x in (q, k, v, bias))]  # type: ignore[misc]
        return g

    g32, g64 = network(DType.F32), network(DType.F64)
    assert any(n.op == "FusedAttentionGrad" for n in g32.nodes)
    feeds = {
        v.name: R.standard_normal(v.type.shape) * (0.0 if v.name == "bias" else 1.0)
        for v in g64.inputs
    }
    feeds["bias"][..., -1] = -1e9  # a padded key
    host_matches_float64(g32, g64, feeds, tmp_path / "out")


@pytest.mark.parametrize("mask_first", [1, 0])
def test_a_trained_additive_mask_gets_the_scores_gradient(mask_first: int) -> None:
    # A position bias (or an exporter's mask initializer imported as a parameter): the one
    # case where the backward writes the scores' gradient, summed to the mask's shape.
    attrs = _attrs(where="keep_true", where_fill=-1.5, mask_first=mask_first)
    check_vjp("FusedAttention", [*_qkv(), r(1, H, SQ, SK), _keep], attrs, consts={4: _keep})


def test_bert_tiny_trains_with_its_attention_fused_as_jax_does(tmp_path: Path) -> None:
    """bert_tiny's step with both attentions fused (padding mask, the fused backward) over
    10 AdamW steps against JAX and optax on the unfused graph, float32 both."""
    from test_mixed_precision import BERT, OPT, _bert_data, _jax_losses

    from flowc.compiler import TRAIN_PRE_PASSES
    from flowc.frontend import ImportOptions, load_graph
    from flowc.passes.manager import PassManager
    from flowc.trainer import compile_step, load_data, run_steps, spec_from

    data = _bert_data(tmp_path)
    spec = spec_from("mse:pooler_output,target", OPT)
    step, project = compile_step(BERT, spec, tmp_path / "s", batch=2, dim=["seq=16"], target="host")
    counts = step.graph.op_counts()
    assert counts.get("FusedAttention") == 2 and counts.get("FusedAttentionGrad") == 2, counts
    assert "Softmax" not in counts  # no probabilities anywhere in the step
    project.build("host", quick=True)
    arrays = load_data(data, step)
    with project.load("host") as model:
        got = run_steps(model, step, arrays, steps=10, batch=2, shuffle=False)
    opts = ImportOptions(trainable=True, batch=2, dims={"seq": 16})
    graph = PassManager(TRAIN_PRE_PASSES).run(load_graph(BERT, opts))
    want = _jax_losses(graph, arrays, 10)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got.losses, want, strict=True))
    assert worst < 1e-5, worst


def test_a_fused_dropout_draws_the_unfused_mask() -> None:
    """fuse_attention takes a training dropout of the probabilities into the node; its
    forward equals the unfused graph's (TrainDropout's mask over the same elements)."""
    from flowc.interpreter import evaluate
    from flowc.ir.builder import GraphBuilder
    from flowc.ir.dtype import DType
    from flowc.ir.graph import Graph
    from flowc.ir.types import TensorType
    from flowc.passes.fuse_attention import fuse_attention

    def graph() -> Graph:
        g = Graph("attn")
        gb = GraphBuilder(g, fold=False)
        q = g.add_input("q", TensorType((B, H, SQ, D), DType.F32))
        k = g.add_input("k", TensorType((B, H, SK, D), DType.F32))
        v = g.add_input("v", TensorType((B, H, SK, DV), DType.F32))
        step = g.add_input("train/step", TensorType((), DType.I64))
        kt = gb.emit("Transpose", [k], {"perm": [0, 1, 3, 2]})[0]
        s = gb.emit("MatMul", [q, kt])[0]
        p = gb.emit("Softmax", [s], {"axis": -1})[0]
        pd = gb.emit("TrainDropout", [p, step], {"ratio": 0.4, "stream": 3, "seed": 11})[0]
        g.outputs = [gb.emit("MatMul", [pd, v])[0]]
        return g

    feeds = {"q": r(B, H, SQ, D), "k": r(B, H, SK, D), "v": r(B, H, SK, DV)}
    feeds = {n: a.astype(np.float32) for n, a in feeds.items()}
    feeds["train/step"] = np.asarray(6, np.int64)
    plain = graph()
    (want,) = evaluate(plain, feeds).values()
    fused = fuse_attention(graph())
    node = next(n for n in fused.nodes if n.op == "FusedAttention")
    assert float(node.attrs["dropout"]) == 0.4 and int(node.attrs["dropout_stream"]) == 3
    assert not any(n.op == "TrainDropout" for n in fused.nodes)
    got = evaluate(fused, feeds)[fused.outputs[0].name]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
