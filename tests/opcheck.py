"""Single-op checks: build a one-node ONNX model, run onnxruntime on it, import it with flowc,
evaluate flowc's NumPy reference, and compare outputs (dtype, shape, error <= tol)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from flowc.frontend.onnx import import_model
from flowc.harness.compare import compare
from flowc.harness.ort import run_onnxruntime
from flowc.interpreter import evaluate
from flowc.ir.verify import verify_graph


def make_op_model(
    op_type: str,
    inputs: Sequence[np.ndarray | None],
    attrs: Mapping[str, Any] | None = None,
    *,
    opset: int = 21,
    num_outputs: int = 1,
    const_inputs: Sequence[int] = (),
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A one-node model; inputs listed in ``const_inputs`` become initializers, None is omitted."""
    in_names, vis, inits, feeds = [], [], [], {}
    for i, a in enumerate(inputs):
        if a is None:
            in_names.append("")
            continue
        name = f"in{i}"
        in_names.append(name)
        a = np.asarray(a)
        if i in const_inputs:
            inits.append(numpy_helper.from_array(a, name))
        else:
            vis.append(
                helper.make_tensor_value_info(
                    name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape
                )
            )
            feeds[name] = a
    out_names = [f"out{i}" for i in range(num_outputs)]
    node = helper.make_node(
        op_type, in_names, out_names, name=f"{op_type.lower()}_0", **dict(attrs or {})
    )
    outs = [helper.make_empty_tensor_value_info(n) for n in out_names]
    graph = helper.make_graph([node], f"test_{op_type}", vis, outs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8 if opset < 21 else 10
    inferred = onnx.shape_inference.infer_shapes(model)
    del model.graph.output[:]
    for o in inferred.graph.output:
        # Bad attributes can make ONNX's inference declare negative dims or a string type;
        # the import would refuse the declaration before the op's own check could speak.
        t = o.type.tensor_type
        dims = [d.dim_value for d in t.shape.dim if d.HasField("dim_value")]
        ok = t.elem_type not in (0, onnx.TensorProto.STRING) and all(d >= 0 for d in dims)
        model.graph.output.append(o if ok else helper.make_empty_tensor_value_info(o.name))
    return model, feeds


def check_op(
    op_type: str,
    inputs: Sequence[np.ndarray | None],
    attrs: Mapping[str, Any] | None = None,
    *,
    opset: int = 21,
    num_outputs: int = 1,
    const_inputs: Sequence[int] = (),
    tol: float = 1e-5,
    reference: str = "onnxruntime",
) -> dict[str, np.ndarray]:
    """flowc's NumPy evaluation of one node against onnxruntime, or against ONNX's own
    reference evaluator (``reference="onnx"``) where the two disagree and the ONNX test data
    sides with the latter."""
    model, feeds = make_op_model(
        op_type, inputs, attrs, opset=opset, num_outputs=num_outputs, const_inputs=const_inputs
    )
    if reference == "onnx":
        from onnx.reference import ReferenceEvaluator

        outs = ReferenceEvaluator(model).run(None, feeds)
        ref = {o.name: np.asarray(a) for o, a in zip(model.graph.output, outs, strict=True)}
    else:
        ref = run_onnxruntime(model, feeds)
    graph = import_model(model)
    verify_graph(graph)
    got = evaluate(graph, feeds)
    for name, r in ref.items():
        c = compare(name, got[name], r, tol)
        assert c.ok, (
            f"{op_type} (opset {opset}, attrs {dict(attrs or {})}): {name}: {c.reason or f'error {c.error:.3g} > {tol}'}"
        )
    return got


class Case:
    """One node to check in a compiled program: op, inputs (None = omitted), attributes."""

    def __init__(
        self,
        op_type: str,
        inputs: Sequence[np.ndarray | None],
        attrs: Mapping[str, Any] | None = None,
        *,
        num_outputs: int = 1,
        const_inputs: Sequence[int] = (),
        tol: float = 1e-5,
        domain: str = "",
    ) -> None:
        self.op_type = op_type
        self.inputs = inputs
        self.attrs = dict(attrs or {})
        self.domain = domain
        self.num_outputs = num_outputs
        self.const_inputs = const_inputs
        self.tol = tol


def cases_model(
    cases: Sequence[Case], opsets: Mapping[str, int], ir_version: int = 10, prefix: str = "c"
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One ONNX model with a node per case, side by side: inputs PREFIXk_inI (constant ones
    as initializers, None omitted), outputs PREFIXk_outJ with no declared type; and its feeds."""
    nodes, vis, inits, feeds, outs = [], [], [], {}, []
    for k, case in enumerate(cases):
        names = []
        for i, a in enumerate(case.inputs):
            if a is None:
                names.append("")
                continue
            name = f"{prefix}{k}_in{i}"
            names.append(name)
            a = np.asarray(a)
            if i in case.const_inputs:
                inits.append(numpy_helper.from_array(a, name))
            else:
                vis.append(
                    helper.make_tensor_value_info(
                        name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape
                    )
                )
                feeds[name] = a
        out_names = [f"{prefix}{k}_out{j}" for j in range(case.num_outputs)]
        nodes.append(
            helper.make_node(
                case.op_type,
                names,
                out_names,
                name=f"case{k}_{case.op_type}",
                domain=case.domain,
                **case.attrs,
            )
        )
        outs += out_names
    graph = helper.make_graph(
        nodes,
        "cases",
        vis,
        [helper.make_empty_tensor_value_info(n) for n in outs],
        initializer=inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()]
    )
    model.ir_version = ir_version
    return model, feeds


def check_compiled(
    cases: Sequence[Case],
    tmp_path: Any,
    *,
    opset: int = 21,
    target: str = "host",
    model: onnx.ModelProto | None = None,
) -> str:
    """Put every case in one ONNX model (one node each), compile it with flowc (with the
    compile pipeline, fusion included), build it once for the host, run it once, and compare
    each output with onnxruntime; returns the generated model.cu."""
    from pathlib import Path

    from flowc.compiler import compile_graph
    from flowc.harness.build import build, run

    tols = {
        f"c{k}_out{j}": (case, case.tol)
        for k, case in enumerate(cases)
        for j in range(case.num_outputs)
    }
    if model is None:
        model, feeds = cases_model(cases, {"": opset}, ir_version=8 if opset < 21 else 10)
        inferred = onnx.shape_inference.infer_shapes(model)
        del model.graph.output[:]
        model.graph.output.extend(inferred.graph.output)
    else:
        # A whole model: cases[0].inputs feed its inputs in order.
        feeds = {
            vi.name: np.asarray(a)
            for vi, a in zip(model.graph.input, cases[0].inputs, strict=False)
        }
        tols = {o.name: (cases[0], cases[0].tol) for o in model.graph.output}
    ref = run_onnxruntime(model, feeds)
    from flowc.passes.manager import COMPILE_PIPELINE, PassManager

    g = PassManager(COMPILE_PIPELINE).run(import_model(model))
    project = Path(tmp_path) / "project"
    compile_graph(g, project, poison=True)
    build(project, target, quick=True)
    got, _ = run(project, feeds, target=target)
    failures = []
    for name, r in ref.items():
        case, tol = tols[name]
        c = compare(name, got[name], r, tol)
        if not c.ok:
            failures.append(
                f"{case.op_type} {case.attrs} inputs {[None if a is None else np.asarray(a).shape for a in case.inputs]}: {c.reason or f'error {c.error:.3g} > {tol}'}"
            )
    assert not failures, "\n".join(failures)
    return (project / "model.cu").read_text()
