"""Adagrad, Adam and Momentum (domain ai.onnx.preview.training): flowc's reference and the
import lowering against ONNX's reference evaluator (onnxruntime has no kernels for this
domain), the lowering's structure, the errors, and one host build."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator
from opcheck import Case, cases_model

from flowc.errors import ShapeError, UnsupportedOpError
from flowc.frontend.onnx import import_model
from flowc.harness.compare import compare
from flowc.interpreter import evaluate
from flowc.ir.graph import Attrs
from flowc.ir.verify import verify_graph
from flowc.ops.registry import get_op
from flowc.ops.training import DOMAIN

RNG = np.random.default_rng(3)


def rand(*shape: int, dtype: type = np.float32) -> np.ndarray:
    return RNG.uniform(-1.0, 1.0, shape).astype(dtype)


def positive(*shape: int, dtype: type = np.float32) -> np.ndarray:
    return RNG.uniform(0.1, 1.0, shape).astype(dtype)


class Node:
    """One optimizer node: op, inputs (R, T, then the tensors), attributes, output count."""

    def __init__(
        self,
        op: str,
        inputs: Sequence[np.ndarray],
        attrs: Mapping[str, Any],
        outputs: int,
        const_inputs: Sequence[int] = (),
    ) -> None:
        self.op, self.inputs, self.attrs, self.outputs = op, inputs, attrs, outputs
        self.const_inputs = const_inputs


def make_model(nodes: Sequence[Node]) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    cases = [
        Case(
            n.op,
            n.inputs,
            n.attrs,
            num_outputs=n.outputs,
            const_inputs=n.const_inputs,
            domain=DOMAIN,
        )
        for n in nodes
    ]
    return cases_model(cases, {"": 21, DOMAIN: 1}, prefix="n")


def reference_outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    outs = ReferenceEvaluator(model).run(None, feeds)
    return {o.name: np.asarray(a) for o, a in zip(model.graph.output, outs, strict=True)}


def check(nodes: Sequence[Node], tol: float = 1e-6) -> dict[str, np.ndarray]:
    """The imported (lowered) graph and the registry references, against ONNX's evaluator."""
    model, feeds = make_model(nodes)
    want = reference_outputs(model, feeds)
    graph = import_model(model)
    verify_graph(graph)
    got = evaluate(graph, feeds)
    for name, r in want.items():
        c = compare(name, got[name], r.astype(got[name].dtype), tol)
        assert c.ok, f"lowered {name}: {c.reason or c.error}"
    for k, node in enumerate(nodes):
        op = get_op(f"{DOMAIN}.{node.op}")
        refs = op.evaluate(list(node.inputs), Attrs(dict(node.attrs)))
        for j, r in enumerate(refs):
            name = f"n{k}_out{j}"
            c = compare(name, r, want[name].astype(r.dtype), tol)
            assert c.ok, f"reference {name}: {c.reason or c.error}"
    return got


def scalars(r: float, t: int) -> list[np.ndarray]:
    return [np.array(r, np.float32), np.array(t, np.int64)]


ADAGRAD = {"decay_factor": 0.1, "epsilon": 1e-5, "norm_coefficient": 0.001}
ADAM = {"alpha": 0.95, "beta": 0.85, "epsilon": 1e-2, "norm_coefficient": 0.001}
MOMENTUM = {"alpha": 0.95, "beta": 0.85, "mode": "standard", "norm_coefficient": 0.001}


@pytest.mark.parametrize("t", [0, 3])
def test_adagrad(t: int) -> None:
    check([Node("Adagrad", [*scalars(0.1, t), rand(3, 4), rand(3, 4), positive(3, 4)], ADAGRAD, 2)])
    # Two tensors at once; the attribute defaults.
    x1, x2 = rand(5), rand(2, 3)
    ins = [*scalars(0.5, t), x1, x2, rand(5), rand(2, 3), positive(5), positive(2, 3)]
    check([Node("Adagrad", ins, {}, 4)])


@pytest.mark.parametrize("t", [0, 1, 7])
def test_adam(t: int) -> None:
    ins = [*scalars(0.1, t), rand(4, 2), rand(4, 2), rand(4, 2), positive(4, 2)]
    check([Node("Adam", ins, ADAM, 3)])
    post = {**ADAM, "norm_coefficient_post": 0.02}
    ins = [*scalars(0.3, t), rand(3), rand(2, 2), rand(3), rand(2, 2)]
    ins += [rand(3), rand(2, 2), positive(3), positive(2, 2)]
    check([Node("Adam", ins, post, 6)])


@pytest.mark.parametrize("t", [0, 2])
@pytest.mark.parametrize("mode", ["standard", "nesterov"])
def test_momentum(t: int, mode: str) -> None:
    attrs = {**MOMENTUM, "mode": mode}
    check([Node("Momentum", [*scalars(0.1, t), rand(6), rand(6), rand(6)], attrs, 2)])
    ins = [*scalars(0.2, t), rand(2, 3), rand(4), rand(2, 3), rand(4), rand(2, 3), rand(4)]
    check([Node("Momentum", ins, attrs, 4)])


def test_float64_and_one_element_vector_scalars() -> None:
    r, t = np.array([0.1], np.float32), np.array([2], np.int64)
    f64 = np.float64
    ins = [r, t, rand(3, dtype=f64), rand(3, dtype=f64), rand(3, dtype=f64), positive(3, dtype=f64)]
    got = check([Node("Adam", ins, ADAM, 3)])
    assert got["n0_out0"].dtype == np.float64 and got["n0_out0"].shape == (3,)


def test_lowering_is_element_wise_and_folds_with_constant_count() -> None:
    ins = [*scalars(0.1, 3), rand(4), rand(4), rand(4), positive(4)]
    model, _ = make_model([Node("Adam", ins, ADAM, 3, const_inputs=(0, 1))])
    graph = import_model(model)
    ops = {n.op for n in graph.nodes}
    assert ops <= {"Add", "Sub", "Mul", "Div", "Sqrt"}, ops
    # R and T at run time: the bias correction is computed once, from T, in the graph.
    model, _ = make_model([Node("Adam", ins, ADAM, 3)])
    ops = [n.op for n in import_model(model).nodes]
    assert ops.count("Pow") == 2 and ops.count("Where") == 2


def test_errors() -> None:
    ins = [*scalars(0.1, 0), rand(4), rand(4)]
    with pytest.raises(ShapeError, match="3 inputs per optimized tensor"):
        import_model(make_model([Node("Adagrad", ins, {}, 2)])[0])
    ins = [*scalars(0.1, 0), rand(4), rand(5), rand(4)]
    with pytest.raises(ShapeError, match="belongs to optimized tensor 0"):
        import_model(make_model([Node("Momentum", ins, MOMENTUM, 2)])[0])
    ins = [*scalars(0.1, 0), rand(4), rand(4), rand(4)]
    with pytest.raises(ShapeError, match="required attribute 'alpha' is not set"):
        import_model(
            make_model(
                [
                    Node(
                        "Momentum",
                        ins,
                        {"beta": 1.0, "mode": "standard", "norm_coefficient": 0.0},
                        2,
                    )
                ]
            )[0]
        )
    with pytest.raises(ShapeError, match="mode must be"):
        import_model(make_model([Node("Momentum", ins, {**MOMENTUM, "mode": "heavy"}, 2)])[0])
    with pytest.raises(ShapeError, match="T \\(the update count\\) must be an int64 scalar"):
        bad = [np.array(0.1, np.float32), np.array(1, np.int32), rand(4), rand(4), rand(4)]
        import_model(make_model([Node("Adagrad", bad, {}, 2)])[0])


def test_other_domains_stay_unsupported() -> None:
    # The qualified lookup finds registry ops only: an unknown op of another domain is
    # still reported as unsupported, with its domain.
    model, _ = make_model([Node("Adagrad", [*scalars(0.1, 0), rand(4), rand(4), rand(4)], {}, 2)])
    model.graph.node[0].op_type = "Lamb"
    with pytest.raises(UnsupportedOpError, match=r"ai\.onnx\.preview\.training\.Lamb"):
        import_model(model)


def test_training_ops_compiled(tmp_path: Path) -> None:
    from flowc.compiler import compile_graph
    from flowc.harness.build import build, run
    from flowc.passes.manager import COMPILE_PIPELINE, PassManager

    nodes = [
        Node("Adagrad", [*scalars(0.1, 2), rand(3, 4), rand(3, 4), positive(3, 4)], ADAGRAD, 2),
        Node(
            "Adam",
            [
                *scalars(0.1, 3),
                rand(5),
                rand(2, 2),
                rand(5),
                rand(2, 2),
                rand(5),
                rand(2, 2),
                positive(5),
                positive(2, 2),
            ],
            {**ADAM, "norm_coefficient_post": 0.01},
            6,
        ),
        Node("Adam", [*scalars(0.1, 0), rand(6), rand(6), rand(6), positive(6)], ADAM, 3),
        Node("Momentum", [*scalars(0.2, 0), rand(7), rand(7), rand(7)], MOMENTUM, 2),
        Node(
            "Momentum",
            [*scalars(0.2, 4), rand(2, 3), rand(2, 3), rand(2, 3)],
            {**MOMENTUM, "mode": "nesterov"},
            2,
        ),
    ]
    model, feeds = make_model(nodes)
    want = reference_outputs(model, feeds)
    graph = PassManager(COMPILE_PIPELINE).run(import_model(model))
    project = tmp_path / "project"
    compile_graph(graph, project, poison=True)
    build(project, "host", quick=True)
    got, _ = run(project, feeds, target="host")
    for name, r in want.items():
        c = compare(name, got[name], r.astype(np.float32), 1e-5)
        assert c.ok, f"{name}: {c.reason or c.error}"
