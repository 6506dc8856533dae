"""RNN, GRU and LSTM against onnxruntime: the ONNX import unrolls each into existing ops, and
both that unrolled graph and the ops' own NumPy reference (what a DSL call evaluates) must
match onnxruntime over directions, layouts, optional inputs and outputs, sequence_lens
(constant or computed at run time), activations with alpha/beta, clip, linear_before_reset
and input_forget. onnxruntime has no layout=1 kernels: those cases run onnxruntime on the
transposed layout-0 problem."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from opcheck import Case, check_compiled, make_op_model

from flowc.errors import ShapeError
from flowc.frontend.dsl import parse_program
from flowc.frontend.onnx import import_model
from flowc.harness.compare import compare
from flowc.harness.ort import run_onnxruntime
from flowc.interpreter import evaluate
from flowc.ir.graph import Attrs
from flowc.ir.verify import verify_graph
from flowc.ops.registry import get_op

rng = np.random.default_rng(11)
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
OUTPUTS = {"RNN": 2, "GRU": 2, "LSTM": 3}
# Sums over a few steps of float32 products: onnxruntime rounds differently.
TOL = 1e-5


def rand(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def rnn_inputs(
    op: str,
    *,
    seq: int = 4,
    batch: int = 3,
    input_size: int = 2,
    hidden: int = 3,
    dirs: int = 1,
    layout: int = 0,
    bias: bool = True,
    lens: list[int] | None = None,
    h0: bool = False,
    c0: bool = False,
    peep: bool = False,
) -> list[np.ndarray | None]:
    """X, W, R, B, sequence_lens, initial_h (, initial_c, P); None marks an omitted one."""
    g = GATES[op]
    state = (dirs, batch, hidden) if layout == 0 else (batch, dirs, hidden)
    ins: list[np.ndarray | None] = [
        rand(seq, batch, input_size) if layout == 0 else rand(batch, seq, input_size),
        rand(dirs, g * hidden, input_size, scale=0.7),
        rand(dirs, g * hidden, hidden, scale=0.7),
        rand(dirs, 2 * g * hidden, scale=0.5) if bias else None,
        None if lens is None else np.array(lens, np.int32),
        rand(*state) if h0 else None,
    ]
    if op == "LSTM":
        ins += [rand(*state) if c0 else None, rand(dirs, 3 * hidden) if peep else None]
    while ins[-1] is None:
        ins.pop()
    return ins


def ort_outputs(
    op: str, ins: list[np.ndarray | None], attrs: dict[str, Any], nout: int, opset: int
) -> list[np.ndarray]:
    """onnxruntime's outputs; for layout=1, those of the transposed layout-0 problem."""
    if not attrs.get("layout"):
        model, feeds = make_op_model(op, ins, attrs, opset=opset, num_outputs=nout)
        return list(run_onnxruntime(model, feeds).values())
    ins0 = list(ins)
    for i in (0, 5, 6):  # X, initial_h, initial_c: swap batch with seq / directions
        a = ins0[i] if i < len(ins0) else None
        if a is not None:
            ins0[i] = a.transpose(1, 0, 2)
    model, feeds = make_op_model(op, ins0, {**attrs, "layout": 0}, opset=opset, num_outputs=nout)
    y, *states = run_onnxruntime(model, feeds).values()
    return [y.transpose(2, 0, 1, 3), *(s.transpose(1, 0, 2) for s in states)][:nout]


def check_rnn(
    op: str,
    ins: list[np.ndarray | None],
    attrs: dict[str, Any],
    *,
    opset: int = 22,
    nout: int | None = None,
    const_inputs: tuple[int, ...] = (),
    tol: float = TOL,
) -> None:
    """The unrolled import and the op's reference, each against onnxruntime."""
    nout = nout or OUTPUTS[op]
    expected = ort_outputs(op, ins, attrs, nout, opset)
    model, feeds = make_op_model(
        op, ins, attrs, opset=opset, num_outputs=nout, const_inputs=const_inputs
    )
    graph = import_model(model)
    verify_graph(graph)
    assert not [n for n in graph.nodes if n.op in GATES], "the recurrence is not unrolled"
    got = evaluate(graph, feeds)
    direct = get_op(op).evaluate(list(ins), Attrs(attrs))
    for k, want in enumerate(expected):
        for how, have in (("unrolled", got[f"out{k}"]), ("reference", direct[k])):
            c = compare(f"out{k}", have, want, tol)
            assert c.ok, f"{op} {attrs} {how} output {k}: {c.reason or f'error {c.error:.3g}'}"


# -- directions, layouts, opsets, optional inputs ---------------------------------------------


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("layout", [0, 1])
def test_directions_and_layouts(op: str, direction: str, layout: int) -> None:
    dirs = 2 if direction == "bidirectional" else 1
    attrs = {"hidden_size": 3, "direction": direction, "layout": layout}
    full = rnn_inputs(op, dirs=dirs, layout=layout, h0=True, c0=True, peep=True)
    check_rnn(op, full, attrs)
    check_rnn(op, rnn_inputs(op, dirs=dirs, layout=layout, bias=False), attrs)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("opset", [7, 14, 22])
def test_opsets(op: str, opset: int) -> None:
    check_rnn(op, rnn_inputs(op, h0=True, c0=True), {"hidden_size": 3}, opset=opset)
    attrs = {"hidden_size": 3, "direction": "bidirectional"}
    check_rnn(op, rnn_inputs(op, dirs=2, seq=1, batch=1), attrs, opset=opset)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_constant_weights_and_no_hidden_size(op: str) -> None:
    # hidden_size may be left out (R gives it); weights as initializers fold their slicing.
    ins = rnn_inputs(op, h0=True, c0=True, peep=True, batch=1, seq=6, hidden=4)
    consts = tuple(range(1, len(ins)))
    expected = ort_outputs(op, ins, {"hidden_size": 4}, OUTPUTS[op], 22)
    model, feeds = make_op_model(
        op, ins, {}, opset=22, num_outputs=OUTPUTS[op], const_inputs=consts
    )
    got = evaluate(import_model(model), feeds)
    for k, want in enumerate(expected):
        assert compare(f"out{k}", got[f"out{k}"], want, TOL).ok


def test_lstm_initial_c_without_initial_h_and_peepholes_alone() -> None:
    x, w, r, b = rnn_inputs("LSTM")
    c0 = rand(1, 3, 3)
    check_rnn("LSTM", [x, w, r, b, None, None, c0], {"hidden_size": 3})
    check_rnn("LSTM", [x, w, r, None, None, None, None, rand(1, 9)], {"hidden_size": 3})


# -- sequence_lens ----------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("lens", [[4, 2, 1], [4, 0, 3], [4, 4, 4]])
def test_sequence_lens(op: str, direction: str, lens: list[int]) -> None:
    """Shorter sequences keep their state and write zeros to Y; reverse runs each sequence
    backwards within its own length; an empty one ends in zero states (as onnxruntime)."""
    dirs = 2 if direction == "bidirectional" else 1
    attrs = {"hidden_size": 3, "direction": direction}
    ins = rnn_inputs(op, dirs=dirs, lens=lens, h0=True, c0=True, peep=True)
    check_rnn(op, ins, attrs)  # sequence_lens computed at run time (a graph input)
    check_rnn(op, ins, attrs, const_inputs=(4,))  # and known when compiling


def test_sequence_lens_layout_1() -> None:
    ins = rnn_inputs("GRU", dirs=2, layout=1, lens=[1, 4, 3], h0=True)
    check_rnn("GRU", ins, {"hidden_size": 3, "direction": "bidirectional", "layout": 1})


def test_runtime_sequence_lens_stay_an_input() -> None:
    ins = rnn_inputs("LSTM", lens=[3, 1, 2])
    model, _ = make_op_model("LSTM", ins, {"hidden_size": 3}, opset=22, num_outputs=3)
    graph = import_model(model)
    assert "in4" in [v.name for v in graph.inputs]
    assert any(n.op == "Where" for n in graph.nodes)
    # Full-length constant lens need no masks at all.
    full = rnn_inputs("LSTM", lens=[4, 4, 4])
    model, _ = make_op_model("LSTM", full, {"hidden_size": 3}, num_outputs=3, const_inputs=(4,))
    assert not any(n.op == "Where" for n in import_model(model).nodes)


# -- attributes -------------------------------------------------------------------------------


ACTIVATION_CASES: list[tuple[str, dict[str, Any]]] = [
    ("RNN", {"activations": ["Relu"]}),
    ("RNN", {"activations": ["Sigmoid"]}),
    ("RNN", {"activations": ["Softsign"]}),
    ("RNN", {"activations": ["Softplus"]}),
    ("RNN", {"activations": ["HardSigmoid"]}),
    ("RNN", {"activations": ["HardSigmoid"], "activation_alpha": [0.3], "activation_beta": [0.4]}),
    ("RNN", {"activations": ["LeakyRelu"]}),
    ("RNN", {"activations": ["LeakyRelu"], "activation_alpha": [0.3]}),
    ("RNN", {"activations": ["ThresholdedRelu"], "activation_alpha": [0.2]}),
    ("RNN", {"activations": ["Elu"]}),
    ("RNN", {"activations": ["Elu"], "activation_alpha": [0.5]}),
    ("RNN", {"activations": ["Affine"], "activation_alpha": [0.5], "activation_beta": [0.1]}),
    ("RNN", {"activations": ["ScaledTanh"], "activation_alpha": [1.5], "activation_beta": [0.5]}),
    # The RNN schema's old default [Tanh, Tanh]: a one-directional layer takes the first.
    ("RNN", {"activations": ["Relu", "Tanh"]}),
    ("GRU", {"activations": ["HardSigmoid", "LeakyRelu"], "activation_alpha": [0.3, 0.2]}),
    (
        "LSTM",
        {
            "activations": ["HardSigmoid", "Elu", "ScaledTanh"],
            "activation_alpha": [0.3, 0.5, 1.5],
            "activation_beta": [0.4, 0.8],
        },
    ),
]


@pytest.mark.parametrize(("op", "attrs"), ACTIVATION_CASES)
def test_activations(op: str, attrs: dict[str, Any]) -> None:
    # Unbounded activations grow the state: compare relative to the magnitude.
    check_rnn(op, rnn_inputs(op, h0=True, c0=True), {"hidden_size": 3, **attrs}, tol=1e-4)


def test_bidirectional_activations_are_consumed_in_order() -> None:
    """alpha and beta lists feed, in order, only the functions that take them."""
    attrs = {
        "hidden_size": 3,
        "direction": "bidirectional",
        "activations": ["HardSigmoid", "Elu", "ScaledTanh", "Sigmoid", "LeakyRelu", "Tanh"],
        "activation_alpha": [0.3, 0.5, 1.5, 0.1],
        "activation_beta": [0.4, 0.8],
    }
    check_rnn("LSTM", rnn_inputs("LSTM", dirs=2, h0=True, c0=True), attrs, tol=1e-4)
    attrs = {
        "hidden_size": 3,
        "direction": "bidirectional",
        "activations": ["LeakyRelu", "Affine"],
        "activation_alpha": [0.3, 0.5],
        "activation_beta": [0.4],
    }
    check_rnn("RNN", rnn_inputs("RNN", dirs=2, h0=True), attrs, tol=1e-4)


def test_default_activation_parameters_follow_the_specification() -> None:
    """The spec takes defaults from the ONNX ops of the same name: ThresholdedRelu's alpha
    is 1.0 (onnxruntime uses 0 here), Affine's the retired op's 1.0 and 0.0."""
    ins = rnn_inputs("RNN", h0=True)
    rnn = get_op("RNN")
    for name, explicit in (
        ("ThresholdedRelu", {"activation_alpha": [1.0]}),
        ("Affine", {"activation_alpha": [1.0], "activation_beta": [0.0]}),
        ("LeakyRelu", {"activation_alpha": [0.01]}),
        ("HardSigmoid", {"activation_alpha": [0.2], "activation_beta": [0.5]}),
    ):
        plain = rnn.evaluate(list(ins), Attrs({"activations": [name]}))
        given = rnn.evaluate(list(ins), Attrs({"activations": [name], **explicit}))
        for a, b in zip(plain, given, strict=True):
            np.testing.assert_array_equal(a, b)
    # Names match without regard to case (onnxruntime's GRU and LSTM do so too).
    upper = rnn.evaluate(list(ins), Attrs({"activations": ["Softsign"]}))
    lower = rnn.evaluate(list(ins), Attrs({"activations": ["softsign"]}))
    np.testing.assert_array_equal(upper[0], lower[0])


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_clip(op: str) -> None:
    """clip bounds the input of every gate activation (not the cell's h(C))."""
    check_rnn(op, rnn_inputs(op, h0=True, c0=True, peep=True), {"hidden_size": 3, "clip": 0.4})
    attrs = {"hidden_size": 3, "clip": 0.7, "direction": "bidirectional"}
    check_rnn(op, rnn_inputs(op, dirs=2, lens=[2, 4, 3]), attrs)


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_gru_linear_before_reset(direction: str) -> None:
    dirs = 2 if direction == "bidirectional" else 1
    attrs = {"hidden_size": 3, "direction": direction, "linear_before_reset": 1}
    check_rnn("GRU", rnn_inputs("GRU", dirs=dirs, h0=True), attrs)
    check_rnn("GRU", rnn_inputs("GRU", dirs=dirs, lens=[1, 3, 4]), attrs)
    check_rnn("GRU", rnn_inputs("GRU", dirs=dirs, bias=False), attrs)


def test_lstm_input_forget() -> None:
    attrs = {"hidden_size": 3, "input_forget": 1}
    check_rnn("LSTM", rnn_inputs("LSTM", h0=True, c0=True, peep=True), attrs)
    check_rnn("LSTM", rnn_inputs("LSTM", h0=True, c0=True), {**attrs, "clip": 0.4})


# -- omitted outputs --------------------------------------------------------------------------


def model_with_outputs(
    op: str, ins: list[np.ndarray | None], attrs: dict[str, Any], outputs: list[str]
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One node whose omitted outputs are empty names."""
    names = ["" if a is None else f"in{i}" for i, a in enumerate(ins)]
    vis = [
        helper.make_tensor_value_info(f"in{i}", helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
        for i, a in enumerate(ins)
        if a is not None
    ]
    node = helper.make_node(op, names, outputs, name="rec", **attrs)
    graph = helper.make_graph(
        [node], "g", vis, [helper.make_empty_tensor_value_info(o) for o in outputs if o]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])
    model.ir_version = 10
    model = onnx.shape_inference.infer_shapes(model)
    return model, {f"in{i}": a for i, a in enumerate(ins) if a is not None}


@pytest.mark.parametrize(
    ("op", "outputs"),
    [
        ("RNN", ["Y"]),
        ("RNN", ["", "Y_h"]),
        ("GRU", ["", "Y_h"]),
        ("LSTM", ["", "", "Y_c"]),
        ("LSTM", ["Y", "", "Y_c"]),
        ("LSTM", ["", "Y_h"]),
    ],
)
def test_omitted_outputs(op: str, outputs: list[str]) -> None:
    ins = rnn_inputs(op, lens=[4, 2, 3], h0=True)
    model, feeds = model_with_outputs(op, ins, {"hidden_size": 3}, outputs)
    want = run_onnxruntime(model, feeds)
    graph = import_model(model)
    assert [v.name for v in graph.outputs] == [o for o in outputs if o]
    if not outputs[0]:
        # Without Y, nothing assembles the sequence output.
        assert not any(n.op == "Concat" and n.outputs[0].type.rank == 4 for n in graph.nodes)
    got = evaluate(graph, feeds)
    for name, w in want.items():
        assert compare(name, got[name], w, TOL).ok, name


# -- edge shapes ------------------------------------------------------------------------------


def test_single_step_and_hidden_one() -> None:
    check_rnn("LSTM", rnn_inputs("LSTM", seq=1, batch=1, hidden=1, peep=True), {"hidden_size": 1})
    check_rnn("GRU", rnn_inputs("GRU", seq=1, batch=2, hidden=1), {"hidden_size": 1})


@pytest.mark.parametrize(("op", "direction"), [("GRU", "bidirectional"), ("LSTM", "reverse")])
def test_float64(op: str, direction: str) -> None:
    """onnxruntime computes these in float32 only: float64 results match its float32 ones
    to float32 precision, and the unrolled graph matches the reference to float64's."""
    dirs = 2 if direction == "bidirectional" else 1
    ins32 = rnn_inputs(op, dirs=dirs, h0=True, c0=True, peep=True, lens=[4, 2, 3])
    # every float input widened; sequence_lens (int32) as it is
    ins = [a if a is None or a.dtype != np.float32 else a.astype(np.float64) for a in ins32]
    attrs = {"hidden_size": 3, "direction": direction}
    want = ort_outputs(op, ins32, attrs, OUTPUTS[op], 22)
    model, feeds = make_op_model(op, ins, attrs, opset=22, num_outputs=OUTPUTS[op])
    got = evaluate(import_model(model), feeds)
    direct = get_op(op).evaluate(list(ins), Attrs(attrs))
    for k, w in enumerate(want):
        assert got[f"out{k}"].dtype == np.float64
        np.testing.assert_allclose(got[f"out{k}"], w, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[f"out{k}"], direct[k], rtol=1e-12, atol=1e-12)


# -- errors -----------------------------------------------------------------------------------


def import_error(op: str, ins: list[np.ndarray | None], attrs: dict[str, Any]) -> str:
    model, _ = make_op_model(op, ins, attrs, opset=22, num_outputs=2)
    with pytest.raises(ShapeError) as ei:
        import_model(model)
    return ei.value.message


@pytest.mark.parametrize(
    ("op", "change", "fragment"),
    [
        ("RNN", {"hidden_size": 4}, "hidden_size is 4 but R"),
        ("GRU", {"activations": ["Sigmoid"]}, "takes 2 (2 per direction)"),
        ("GRU", {"direction": "bidirectional"}, "W must have shape [2, 9, 2]"),
        ("LSTM", {"activations": ["Sigmoid", "Tanh", "Gelu"]}, "unknown activation 'Gelu'"),
        ("RNN", {"activations": ["ScaledTanh"]}, "ScaledTanh has no default parameters"),
        ("RNN", {"direction": "sideways"}, "direction must be forward, reverse or bidirectional"),
        ("GRU", {"linear_before_reset": 2}, "linear_before_reset must be 0 or 1"),
        ("RNN", {"clip": -1.0}, "clip must be positive"),
    ],
)
def test_bad_attributes(op: str, change: dict[str, Any], fragment: str) -> None:
    msg = import_error(op, rnn_inputs(op), {"hidden_size": 3, **change})
    assert fragment in msg, msg


def test_bad_inputs() -> None:
    x, w, r, b = rnn_inputs("LSTM")
    assert "B must have shape [1, 24]" in import_error("LSTM", [x, w, r, b[:, :12]], {})
    h0 = rand(1, 2, 3)
    msg = import_error("LSTM", [x, w, r, b, None, h0], {})
    assert "initial_h must have shape [1, 3, 3]" in msg, msg
    lens = np.array([1, 2, 9], np.int32)
    model, _ = make_op_model(
        "GRU", [*rnn_inputs("GRU"), lens], {}, num_outputs=2, const_inputs=(4,)
    )
    with pytest.raises(ShapeError, match=r"sequence_lens \[1, 2, 9\] must lie in \[0, 4\]"):
        import_model(model)
    x16 = x.astype(np.float16)
    assert "W has element type f32, expected f16" in import_error("LSTM", [x16, w, r], {})


def test_reference_reports_bad_attributes_as_value_errors() -> None:
    with pytest.raises(ValueError, match="unknown activation"):
        get_op("RNN").evaluate(list(rnn_inputs("RNN")), Attrs({"activations": ["Nope"]}))


# -- the DSL: an lstm call evaluates through the reference --------------------------------------


def test_dsl_lstm_call_matches_onnxruntime() -> None:
    x, w, r, b = rnn_inputs("LSTM", dirs=2)
    text = (
        "graph g(x: f32[4, 3, 2], w: f32[2, 12, 2], r: f32[2, 12, 3], b: f32[2, 24]) "
        "-> (y: f32[4, 2, 3, 3], yh: f32[2, 3, 3], yc: f32[2, 3, 3]) {\n"
        '    y, yh, yc = lstm(x, w, r, b, direction="bidirectional", hidden_size=3)\n'
        "    return y, yh, yc\n}\n"
    )
    graph = parse_program(text, "t.flow", None, None)
    assert [n.op for n in graph.nodes] == ["LSTM"]
    got = evaluate(graph, {"x": x, "w": w, "r": r, "b": b})
    attrs = {"hidden_size": 3, "direction": "bidirectional"}
    want = ort_outputs("LSTM", [x, w, r, b], attrs, 3, 22)
    for name, expect in zip(("y", "yh", "yc"), want, strict=True):
        assert compare(name, got[name], expect, TOL).ok, name


# -- compiled for the host ------------------------------------------------------------------------


def test_compiled_on_host(tmp_path: Any) -> None:
    """One build: the unrolled recurrences through fusion, planning and code generation."""
    lstm = rnn_inputs("LSTM", dirs=2, lens=[4, 1, 3], h0=True, c0=True, peep=True)
    gru = rnn_inputs("GRU", h0=True)
    rnn = rnn_inputs("RNN", dirs=1, lens=[2, 0, 4])
    cases = [
        Case("LSTM", lstm, {"hidden_size": 3, "direction": "bidirectional"}, num_outputs=3),
        Case(
            "GRU",
            gru,
            {"hidden_size": 3, "direction": "reverse", "linear_before_reset": 1},
            num_outputs=2,
            const_inputs=(1, 2, 3),
        ),
        Case(
            "RNN",
            rnn,
            {"hidden_size": 3, "activations": ["Relu"], "clip": 1.5},
            num_outputs=2,
            const_inputs=(4,),
        ),
        Case("GRU", rnn_inputs("GRU", seq=3, bias=False), {"hidden_size": 3}, num_outputs=2),
    ]
    code = check_compiled(cases, tmp_path, opset=22)
    assert "__global__" in code


def test_initializer_round_trip_keeps_weights_small() -> None:
    """Constant weights fold their per-direction slices; the unrolled graph adds no copy of
    W per time step."""
    ins = rnn_inputs("LSTM", seq=8, dirs=2)
    model, _ = make_op_model(
        "LSTM",
        ins,
        {"hidden_size": 3, "direction": "bidirectional"},
        num_outputs=3,
        const_inputs=(1, 2, 3),
    )
    graph = import_model(model)
    w_bytes = sum(numpy_helper.from_array(a).ByteSize() for a in ins[1:4] if a is not None)
    const_bytes = sum(v.const.nbytes for v in graph.constants if v.const is not None)
    assert const_bytes < 3 * w_bytes
    gemms = [n for n in graph.nodes if n.op == "Gemm"]
    # one input projection per direction, one recurrent product per step after the first
    assert len(gemms) == 2 * (1 + 7)
