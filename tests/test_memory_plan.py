"""Memory plan v1 and its independent checker."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import SHARED_MODELS
from hypothesis import given, settings
from hypothesis import strategies as st
from test_models import LIGHT_DIR, LIGHT_MODELS

from flowc.frontend.onnx import ImportOptions, import_onnx
from flowc.ir import DType, Graph, TensorType
from flowc.memory.check import PlanError, check_memory_plan
from flowc.memory.plan import ALIGN, plan_memory

MODELS = [
    SHARED_MODELS / f"{n}.onnx"
    for n in ("mlp", "bert_tiny", "gpt2_tiny", "resnet_tiny", "vit_tiny")
]
MODELS += [LIGHT_DIR / f"{n}.onnx" for n in LIGHT_MODELS]


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.stem)
def test_models_plan_checks_and_beats_naive(path) -> None:  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = import_onnx(
            path, ImportOptions(dims={"batch": 2, "seq": 32}) if "bert" in path.stem else None
        )
    plan = plan_memory(g)
    check_memory_plan(g, plan)
    assert plan.lower_bound <= plan.arena_bytes <= plan.naive_bytes
    # Greedy best fit lands within 10% of the bound on every model here.
    assert plan.arena_bytes <= 1.1 * plan.lower_bound
    assert all(b.offset % ALIGN == 0 for b in plan.buffers)


def _chain(ops: list[str]) -> Graph:
    g = Graph("chain")
    t = TensorType((4, 64), DType.F32)
    x = g.add_input("x", t)
    v = x
    for k, op in enumerate(ops):
        if op == "Reshape":
            shape = g.add_constant(
                f"s{k}", np.array([64, 4] if v.type.shape == (4, 64) else [4, 64], np.int64)
            )
            out = TensorType((64, 4) if v.type.shape == (4, 64) else (4, 64), DType.F32)
            v = g.add_node("Reshape", [v, shape], [out], output_names=[f"v{k}"]).outputs[0]
        elif op == "Add":
            v = g.add_node(
                "Add", [v, x if v.type == t else v], [v.type], output_names=[f"v{k}"]
            ).outputs[0]
        else:
            v = g.add_node(op, [v], [v.type], output_names=[f"v{k}"]).outputs[0]
    g.outputs = [v]
    return g


def test_elementwise_chain_runs_in_place_in_one_buffer() -> None:
    g = _chain(["Relu", "Exp", "Neg", "Tanh", "Relu"])
    plan = plan_memory(g)
    check_memory_plan(g, plan)
    # v0..v3 are intermediates; v1..v3 reuse v0's bytes; v4 is the output (caller memory).
    assert plan.inplace == 3 and len(plan.buffers) == 1 and plan.arena_bytes == 4 * 64 * 4


def test_views_alias_their_base_and_inputs_are_never_written() -> None:
    g = _chain(["Relu", "Reshape", "Exp", "Reshape", "Tanh"])
    plan = plan_memory(g)
    check_memory_plan(g, plan)
    v0, v1 = g.nodes[0].outputs[0], g.nodes[1].outputs[0]
    assert plan.offset(v1) == plan.offset(v0)
    assert g.inputs[0] not in plan.value_buffer  # the graph input is the caller's, untouched


def test_an_output_that_would_alias_an_input_is_copied() -> None:
    g = Graph("g")
    x = g.add_input("x", TensorType((3,), DType.F32))
    w = g.add_constant("w", np.ones(3, np.float32))
    y = g.add_node("Identity", [x], [x.type], output_names=["y"]).outputs[0]
    g.outputs = [y, x, w, y]
    plan = plan_memory(g)
    # The Identity that produces an output is a copy, not a view; x, w and the repeated y
    # must be copied into their output buffers.
    assert plan.output_copies == [x, w, y]
    assert y not in plan.value_buffer


def test_the_checker_catches_overlaps_and_bad_bounds() -> None:
    g = _chain(["Relu", "Exp", "Add", "Sigmoid"])  # Add reads v1 and x: v1 dies there
    plan = plan_memory(g)
    check_memory_plan(g, plan)
    g2 = Graph("fork")
    x = g2.add_input("x", TensorType((256,), DType.F32))
    a = g2.add_node("Relu", [x], [x.type], output_names=["a"]).outputs[0]
    b = g2.add_node("Exp", [x], [x.type], output_names=["b"]).outputs[0]
    c = g2.add_node("Add", [a, b], [x.type], output_names=["c"]).outputs[0]
    g2.outputs = [c]
    plan2 = plan_memory(g2)
    check_memory_plan(g2, plan2)
    assert plan2.offset(a) != plan2.offset(b)
    plan2.buffers[plan2.value_buffer[b]].offset = plan2.offset(a)  # both live at the Add
    with pytest.raises(PlanError, match="overwrites 'a'"):
        check_memory_plan(g2, plan2)
    plan3 = plan_memory(g2)
    plan3.lower_bound -= ALIGN
    with pytest.raises(PlanError, match="lower bound"):
        check_memory_plan(g2, plan3)
    plan4 = plan_memory(g2)
    plan4.buffers[0].offset += 4
    with pytest.raises(PlanError, match="aligned"):
        check_memory_plan(g2, plan4)


UNARY = ["Relu", "Exp", "Neg", "Tanh", "Sigmoid"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([*UNARY, "Add", "Mul", "Reshape", "MatMul"]),
            st.integers(0, 50),
            st.integers(0, 50),
        ),
        min_size=1,
        max_size=25,
    ),
    st.integers(1, 3),
)
def test_random_dags_plan_and_check(spec: list[tuple[str, int, int]], n_outputs: int) -> None:
    g = Graph("dag")
    t = TensorType((8, 8), DType.F32)
    vals = [g.add_input("x", t), g.add_constant("w", np.ones((8, 8), np.float32))]
    shape = g.add_constant("shape", np.array([8, 8], np.int64))
    for k, (op, i, j) in enumerate(spec):
        a, b = vals[i % len(vals)], vals[j % len(vals)]
        if op in UNARY:
            ins = [a]
        elif op == "Reshape":
            ins = [a, shape]
        else:
            ins = [a, b]
        vals.append(g.add_node(op, ins, [t], output_names=[f"v{k}"]).outputs[0])
    g.outputs = list(dict.fromkeys(vals[-n_outputs:]))
    g.verify()
    plan = plan_memory(g)
    check_memory_plan(g, plan)
    assert plan.lower_bound <= plan.arena_bytes <= max(plan.naive_bytes, 0)
