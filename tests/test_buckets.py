"""Gradient buckets (flowc/parallel/buckets.py, issue 30): a rank graph's all-reduces merged
into AllReduce nodes of several parts, never one that depends on another (a cycle), never
across mesh axes or types; the driver picks the cap by the schedule's modeled time. The
runtime's bucket (one NCCL group, one packed MPI call) is checked on every mesh axis and
type by tests/runtime/comm_collectives.cu, and data parallel training through it by
test_distributed_training.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from conftest import SHARED_MODELS

from flowc.compiler import bucket_gradients
from flowc.ir.dtype import DType
from flowc.ir.graph import Graph, Value
from flowc.ir.types import TensorType
from flowc.ir.verify import verify_graph
from flowc.ops.registry import get_op
from flowc.parallel.buckets import bucket_all_reduces

MESH = {"mesh": (2, 2), "mesh_axis": 0}


def _reduce(g: Graph, x: Value, **attrs: object) -> Value:
    return g.add_node("AllReduce", [x], [x.type], {**MESH, **attrs}, name=f"ar/{x.name}").outputs[0]


def _graph() -> tuple[Graph, dict[str, Value]]:
    """a, b, c, e f32 and h f16, each all-reduced over mesh axis 0 (e over axis 1); c's
    all-reduce reads a's result (through a Relu): it may not join a's bucket."""
    g = Graph("rank")
    f32, f16 = TensorType((256,), DType.F32), TensorType((256,), DType.F16)
    v = {n: g.add_input(n, f16 if n == "h" else f32) for n in "abceh"}
    ra = _reduce(g, v["a"])
    relu = g.add_node("Relu", [ra], [f32], name="relu").outputs[0]
    rb = _reduce(g, v["b"])
    rc = _reduce(g, g.add_node("Add", [v["c"], relu], [f32], name="add").outputs[0])
    re = _reduce(g, v["e"], mesh_axis=1)
    rh = _reduce(g, v["h"])
    g.outputs = [ra, rb, rc, re, rh]
    return g, {"a": ra, "b": rb, "c": rc, "e": re, "h": rh}


def test_buckets_merge_what_they_may_and_nothing_else() -> None:
    g, out = _graph()
    assert bucket_all_reduces(g, 1 << 20) == 1
    verify_graph(g)
    reduces = [n for n in g.nodes if n.op == "AllReduce"]
    parts = sorted(tuple(sorted(o.name for o in n.outputs)) for n in reduces)
    # a and b share a bucket; c waits for a (no cycle), e is on another axis, h another type.
    assert parts == sorted(
        [(out["a"].name, out["b"].name), (out["c"].name,), (out["e"].name,), (out["h"].name,)]
    )
    bucket = next(n for n in reduces if len(n.inputs) == 2)
    assert get_op("AllReduce").infer_types(bucket) == [o.type for o in bucket.outputs]
    # Every value keeps its name and its readers: the graph's outputs are the same values.
    assert g.outputs == list(out.values())


def test_a_cap_smaller_than_two_parts_keeps_them_apart() -> None:
    g, _ = _graph()
    assert bucket_all_reduces(g, 1024) == 0  # each part is 1 KiB: two do not fit
    assert bucket_all_reduces(g, 0) == 0
    assert sum(n.op == "AllReduce" for n in g.nodes) == 5


def test_the_driver_buckets_the_mlp_s_gradients_where_the_model_says_it_pays() -> None:
    """The MLP's data plan on 2 ranks: its four gradients' and the loss's all-reduces become
    one bucket (five latencies become one), which the schedule's simulation prices lower."""
    import dataclasses

    from flowc.api import compile_options
    from flowc.compiler import load_training, parallelize, placement_target
    from flowc.trainer import spec_from

    spec = spec_from("cross_entropy:/m/m.2/Gemm_output_0,labels", "adamw:lr=0.01")
    opts = compile_options(SHARED_MODELS / "mlp.onnx", mesh="2", parallel="data")
    step = load_training(opts.model, spec, batch=8)
    placement = placement_target(opts.model, opts.parallel)
    assert placement is not None
    placed = parallelize(step.graph, dataclasses.replace(placement, streams=1))
    graph = placed.physical.graph
    sizes = sorted(n.outputs[0].type.nbytes for n in graph.nodes if n.op == "AllReduce")
    assert sizes == [4, 40, 1024, 10240, 65536]
    choice = bucket_gradients(graph, streams=1, schedule_for="memory")
    verify_graph(graph)
    assert (choice.before, choice.after) == (5, 1)
    assert choice.tried[choice.cap] < choice.tried[0]
    (bucket,) = [n for n in graph.nodes if n.op == "AllReduce"]
    assert sorted(o.type.nbytes for o in bucket.outputs) == sizes
    assert "5 all-reduces in 1" in choice.line()
    assert np.isfinite(choice.tried[0])


def test_the_schedule_overlaps_bert_s_gradient_reductions_with_its_backward(tmp_path: Path) -> None:
    """bert_tiny data parallel on 2 ranks: the batch stays split through the attention (its
    fused kernels and their backward take S(0)), the gradients' all-reduces are bucketed,
    and the schedule runs them on the communication stream beside the backward's compute:
    in the modeled trace (schedule.json, `flowc inspect --gantt`) most of their time
    overlaps compute. (The host emulator runs one operation at a time, so a host
    FLOWC_TRACE shows no overlap; on a GPU it would.)"""
    import json

    from flowc.trainer import compile_step, spec_from

    spec = spec_from("mse:pooler_output,target", "adamw:lr=0.001")
    said: list[str] = []
    _, project = compile_step(
        SHARED_MODELS / "bert_tiny.onnx", spec, tmp_path / "p", batch=4, target="host",
        mesh="2", parallel="data", dim=["seq=16"], progress=said.append,
    )  # fmt: skip
    line = next(s for s in said if s.startswith("gradient buckets:"))
    assert " in " in line and "modeled step" in line, line
    rank = json.loads((project.path / "schedule.json").read_text())["ranks"][0]
    actors = rank["actors"]
    comm = [a for a in actors if a["kind"] == "collective"]
    compute = [a for a in actors if a["kind"] == "node"]
    assert comm and {a["stream"] for a in comm}.isdisjoint({a["stream"] for a in compute})
    assert any(a["op"] == "AllReduce" and "bucket/" in a["name"] for a in comm)
    # The attention runs on each rank's half of the batch: nothing gathers q, k or v.
    assert not any(
        a["op"] == "AllGather" and "/attention/self/" in a["name"] and "Add" in a["name"]
        for a in comm
    )

    def overlap(a: dict[str, Any]) -> float:
        return sum(
            max(0.0, min(a["end_us"], c["end_us"]) - max(a["start_us"], c["start_us"]))
            for c in compute
        )

    busy = sum(a["end_us"] - a["start_us"] for a in comm)
    assert sum(overlap(a) for a in comm) > 0.5 * busy
