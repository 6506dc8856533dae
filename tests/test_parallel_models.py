"""Every test model, placed on meshes 2, 4 and 2x2: the NumPy multi-rank simulator runs each
rank's program with simulated collectives and must reproduce onnxruntime's outputs."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import onnx
import pytest
from conftest import SHARED_MODELS

from flowc.compiler import parallelize
from flowc.errors import FlowcWarning
from flowc.frontend import ImportOptions, load_graph
from flowc.harness.compare import max_rel_error
from flowc.harness.ort import inference_mode, run_onnxruntime
from flowc.interpreter import random_inputs
from flowc.ir.graph import Graph, Value
from flowc.ir.layout import fits
from flowc.ir.types import Mesh, NdSbp, Sbp
from flowc.parallel import Parallelized, ParallelOptions
from flowc.parallel.simulate import simulate
from flowc.passes.manager import PassManager

MODELS = ["mlp", "bert_tiny", "gpt2_tiny", "resnet_tiny", "vit_tiny"]
MESHES = {"2": (2,), "4": (4,), "2x2": (2, 2)}


@functools.cache
def logical(name: str, batch: int = 2) -> Graph:
    opts = ImportOptions(dims={"batch": batch, "seq": 32}) if name == "bert_tiny" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlowcWarning)
        g = load_graph(SHARED_MODELS / f"{name}.onnx", opts)
    return PassManager(("fold_constants", "simplify", "split_projections")).run(g)


@functools.cache
def reference(name: str, batch: int = 2) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    feeds = random_inputs(logical(name, batch), seed=1)
    model = inference_mode(onnx.load(str(SHARED_MODELS / f"{name}.onnx")))
    return feeds, run_onnxruntime(model, feeds)


def tensor_parallel(graph: Graph, mesh: Mesh) -> dict[str, NdSbp]:
    """A hand-set Megatron-style plan on the last mesh axis: projection weights alternate
    between a column split and a row split; convolutions split output channels."""
    fixed: dict[str, NdSbp] = {}
    last = mesh.ndim - 1

    def put(w: Value, axis: int) -> None:
        sbp = NdSbp(tuple(Sbp("S", axis) if a == last else Sbp("B") for a in range(mesh.ndim)))
        if w.name not in fixed and fits(w.type.shape, sbp, mesh):
            fixed[w.name] = sbp

    column = True
    for node in graph.nodes:
        w = node.inputs[1] if len(node.inputs) > 1 else None
        if w is None or w.const is None:
            continue
        if node.op == "Conv" and int(node.attrs.get("group", 1)) == 1:
            put(w, 0)
        elif node.op in ("MatMul", "Gemm") and w.type.rank == 2:
            trans = node.op == "Gemm" and int(node.attrs.get("transB", 0)) == 1
            n_axis, k_axis = (0, 1) if trans else (1, 0)
            put(w, n_axis if column else k_axis)
            column = not column
    assert fixed, "the hand-set plan splits nothing"
    return fixed


def check_outputs(
    name: str, outs: list[np.ndarray], ref: dict[str, np.ndarray], batch: int = 2
) -> float:
    names = [o.name for o in logical(name, batch).outputs]
    err = max(max_rel_error(got, ref[n]) for n, got in zip(names, outs, strict=True))
    assert err < 1e-4, f"{name}: error {err:.2e} against onnxruntime"
    return err


def check(name: str, result: Parallelized, batch: int = 2) -> float:
    feeds, ref = reference(name, batch)
    return check_outputs(name, simulate(result.physical, feeds), ref, batch)


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", MODELS)
def test_auto_plan_reproduces_onnxruntime(name: str, mesh: str) -> None:
    m = Mesh("gpus", MESHES[mesh])
    result = parallelize(logical(name), ParallelOptions(m, "auto"))
    check(name, result)


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", MODELS)
def test_hand_set_tensor_parallel_plan(name: str, mesh: str) -> None:
    m = Mesh("gpus", MESHES[mesh])
    g = logical(name)
    fixed = tensor_parallel(g, m)
    result = parallelize(g, ParallelOptions(m, "auto", sbp=fixed))
    for v in [*g.constants]:
        if v.name in fixed:
            assert result.plan.value_sbp[v] == fixed[v.name]
    # Split weights mean real collectives on the way (an all-reduce of partial sums, or a
    # gather of split activations).
    assert any(not st.is_local for _, _, st in result.cost.boxing)
    check(name, result)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_data_parallel_bert_with_batch_8(mesh: str) -> None:
    m = Mesh("gpus", MESHES[mesh])
    result = parallelize(logical("bert_tiny", 8), ParallelOptions(m, "data"))
    inputs = logical("bert_tiny", 8).inputs
    split = NdSbp(tuple(Sbp("S", 0) for _ in m.shape))
    assert all(result.plan.value_sbp[v] == split for v in inputs)
    check("bert_tiny", result, batch=8)


def test_auto_under_a_memory_limit_shards_gpt2() -> None:
    m = Mesh("gpus", (4,))
    g = logical("gpt2_tiny")
    whole = parallelize(g, ParallelOptions(m, "none"))
    limit = whole.memory.total // 2
    result = parallelize(g, ParallelOptions(m, "auto", mem_limit=limit))
    assert result.memory.total <= limit
    check("gpt2_tiny", result)


def test_gpt2_under_a_memory_limit_splits_every_layer_megatron_style() -> None:
    # 1 MB per device is below the parameters' 2.6 MB: every layer's weights must be split,
    # and each all-reduce sums a row-split output projection (the Megatron pattern; a layer
    # may gather instead where that is cheaper within the budget).
    import re

    m = Mesh("gpus", (4,))
    g = logical("gpt2_tiny")
    result = parallelize(g, ParallelOptions(m, "auto", mem_limit=1_000_000))
    assert result.memory.total <= 1_000_000
    reduced = set()
    for v, _, st in result.cost.boxing:
        if st.collective != "all-reduce":
            continue
        assert v.producer is not None
        weight = v.producer.inputs[1]
        assert weight is not None
        found = re.search(r"h\.(\d+)\.(attn|mlp)\.c_proj", weight.name)
        assert found, (
            f"all-reduce of {v.name} (from {weight.name}) is not after a layer's output projection"
        )
        reduced.add((int(found.group(1)), found.group(2)))
    assert {layer for layer, _ in reduced} == {0, 1}, "both layers are split"
    check("gpt2_tiny", result)


@pytest.mark.parametrize("mesh", ["4", "2x2"])
@pytest.mark.parametrize("name", MODELS)
def test_auto_is_at_most_the_best_baseline(name: str, mesh: str) -> None:
    from flowc.errors import InputError

    m = Mesh("gpus", MESHES[mesh])
    g = logical(name)
    auto = parallelize(g, ParallelOptions(m, "auto")).cost.total_s
    baselines = {
        "none": parallelize(g, ParallelOptions(m, "none")).cost.total_s,
        "tensor": parallelize(
            g, ParallelOptions(m, "auto", sbp=tensor_parallel(g, m))
        ).cost.total_s,
    }
    try:
        baselines["data"] = parallelize(g, ParallelOptions(m, "data")).cost.total_s
    except InputError:
        assert any(v.type.shape[0] % m.size for v in g.inputs)  # a batch of 1 or 2
    for what, t in baselines.items():
        assert auto <= t * (1 + 1e-9), f"{name}: auto {auto:.3e} s > {what} {t:.3e} s"
