"""IR: dtypes, types, placement, the verifier's messages, the printer and the grammar."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from lark import Lark

from flowc.errors import VerifyError
from flowc.ir import DType, Graph, Mesh, NdSbp, Sbp, TensorType
from flowc.ir.graph import Attrs, Node, Value, compact_constant, is_splat, make_splat
from flowc.ir.printer import ident, print_graph
from flowc.ir.verify import verify_graph
from flowc.resources import grammar_file


@pytest.fixture(scope="module")
def parser() -> Lark:
    return Lark(grammar_file().read_text(), parser="lalr")


def test_every_onnx_numeric_type_and_bool_has_a_dtype() -> None:
    skip = {onnx.TensorProto.UNDEFINED, onnx.TensorProto.STRING}
    for name, code in onnx.TensorProto.DataType.items():
        if code in skip:
            continue
        d = DType.from_onnx(code)
        assert d.onnx == code, name
        assert DType.from_short(d.short) is d
        assert DType.from_numpy(d.np) is d
        assert np.dtype(onnx.helper.tensor_dtype_to_np_dtype(code)) == d.np, name
    with pytest.raises(ValueError, match="not supported"):
        DType.from_onnx(onnx.TensorProto.STRING)


def test_dtype_classes() -> None:
    assert DType.F32.is_float and DType.BF16.is_float and not DType.I64.is_float
    assert DType.U8.is_int and not DType.U8.is_signed and DType.I4.is_signed
    assert DType.BOOL.itemsize == 1 and DType.F64.itemsize == 8


def test_tensor_type() -> None:
    t = TensorType((2, 3), DType.F32)
    assert str(t) == "f32[2, 3]" and t.numel == 6 and t.nbytes == 24 and t.rank == 2
    assert str(TensorType((), DType.I64)) == "i64[]"
    with pytest.raises(ValueError, match="negative"):
        TensorType((-1,), DType.F32)


def test_sbp_and_mesh() -> None:
    mesh = Mesh("gpus", (2, 2))
    assert str(mesh) == "gpus[2, 2]" and mesh.size == 4
    sbp = NdSbp((Sbp.split(1), Sbp("B")))
    assert str(sbp) == "(S(1), B)"
    assert str(NdSbp((Sbp("P"),))) == "P"
    sbp.check(TensorType((4, 4), DType.F32), mesh)
    with pytest.raises(ValueError, match="splits axis 1 of a rank-1"):
        sbp.check(TensorType((4,), DType.F32), mesh)
    with pytest.raises(ValueError, match="has 1 entries but mesh"):
        NdSbp((Sbp("B"),)).check(TensorType((4,), DType.F32), mesh)
    with pytest.raises(ValueError, match="unknown SBP kind"):
        Sbp("X")
    with pytest.raises(ValueError, match="at least one device"):
        Mesh("m", (0,))
    # at most 65,536 devices and 3 axes (issue 23, point 5)
    Mesh("m", (256, 256))
    with pytest.raises(ValueError, match="65537 devices; flowc supports at most 65536"):
        Mesh("m", (65537,))
    with pytest.raises(ValueError, match="4 axes; flowc supports at most 3"):
        Mesh("m", (2, 2, 2, 2))


def test_attrs_are_frozen_and_sorted() -> None:
    a = Attrs({"b": [1, 2], "a": np.array([1.5], np.float32), "c": True})
    assert list(a) == ["a", "b", "c"]
    assert a["b"] == (1, 2) and a["c"] == 1
    assert not a["a"].flags.writeable
    assert a.merged({"d": 3, "b": 0})["b"] == (1, 2)


def test_splats_stay_small() -> None:
    s = make_splat(0.02, (1000, 1000), np.dtype(np.float32))
    assert is_splat(s) and s.shape == (1000, 1000) and s.strides == (0, 0)
    c = compact_constant(np.full((64,), 3, np.int64))
    assert is_splat(c) and int(c[5]) == 3
    dense = compact_constant(np.arange(64))
    assert not is_splat(dense)


def _tiny_graph() -> Graph:
    g = Graph("tiny")
    x = g.add_input("x", TensorType((2, 3), DType.F32))
    w = g.add_constant("w", np.ones((3,), np.float32))
    n = g.add_node("Add", [x, w], [TensorType((2, 3), DType.F32)], name="add0", output_names=["y"])
    r = g.add_node(
        "Relu", [n.outputs[0]], [TensorType((2, 3), DType.F32)], name="relu0", output_names=["/z:0"]
    )
    g.outputs = [r.outputs[0]]
    return g


def test_verify_accepts_a_good_graph() -> None:
    verify_graph(_tiny_graph())


def test_verify_names_the_node_for_a_wrong_type() -> None:
    g = _tiny_graph()
    g.nodes[1].outputs[0].type = TensorType((3, 2), DType.F32)
    with pytest.raises(
        VerifyError, match=r"node #1 Relu 'relu0': output '/z:0' has type f32\[3, 2\]"
    ):
        verify_graph(g)


def test_verify_catches_order_and_dangling_uses() -> None:
    g = _tiny_graph()
    g.nodes.reverse()
    with pytest.raises(
        VerifyError, match=r"node #0 Relu 'relu0': input 0 .* used before it is defined"
    ):
        verify_graph(g)
    g = _tiny_graph()
    ghost = Value("ghost", TensorType((2, 3), DType.F32))
    g.nodes[1].inputs[0] = ghost
    with pytest.raises(VerifyError, match=r"input 0 \('ghost'\) is used before it is defined"):
        verify_graph(g)


def test_verify_catches_ssa_violations_and_unknown_ops() -> None:
    g = _tiny_graph()
    g.nodes[1].outputs[0].name = "y"
    with pytest.raises(VerifyError, match="two values are named 'y'"):
        verify_graph(g)
    g = _tiny_graph()
    g.inputs.append(g.inputs[0])
    with pytest.raises(VerifyError, match="'x' is defined twice"):
        verify_graph(g)
    g = _tiny_graph()
    y = g.nodes[0].outputs[0]
    g.nodes.append(Node("Relu", [y], [y], name="again"))
    with pytest.raises(VerifyError, match="output 'y' does not point back to its node"):
        verify_graph(g)
    g = _tiny_graph()
    g.nodes[1].op = "Frobnicate"
    with pytest.raises(VerifyError, match="unknown op 'Frobnicate'"):
        verify_graph(g)


def test_verify_checks_placements_against_the_mesh() -> None:
    g = _tiny_graph()
    g.inputs[0].sbp = NdSbp((Sbp.split(0),))
    with pytest.raises(VerifyError, match="graph has no mesh"):
        verify_graph(g)
    g.mesh = Mesh("gpus", (2, 2))
    with pytest.raises(VerifyError, match="has 1 entries but mesh"):
        verify_graph(g)
    g.inputs[0].sbp = NdSbp((Sbp.split(0), Sbp("B")))
    verify_graph(g)


def test_printer_writes_dsl_with_placement_and_quoted_names(parser: Lark) -> None:
    g = _tiny_graph()
    g.mesh = Mesh("gpus", (2, 2))
    g.inputs[0].sbp = NdSbp((Sbp.split(0), Sbp("B")))
    g.nodes[0].outputs[0].sbp = NdSbp((Sbp("P"), Sbp.split(1)))
    text = print_graph(g)
    assert text == (
        "mesh gpus[2, 2]\n\n"
        'graph tiny(x: f32[2, 3] @ (S(0), B)) -> ("/z:0": f32[2, 3]) {\n'
        "    const w: f32[3] = [1.0, 1.0, 1.0]\n"
        "    y: f32[2, 3] @ (P, S(1)) = add(x, w)\n"
        '    "/z:0": f32[2, 3] = relu(y)\n'
        '    return "/z:0"\n'
        "}\n"
    )
    parser.parse(text)


def test_printer_constants_and_attributes(parser: Lark) -> None:
    g = Graph("c")
    x = g.add_input("x", TensorType((4, 4), DType.F32))
    big = g.add_constant("big", np.arange(16, dtype=np.float32).reshape(4, 4))
    fill = g.add_constant("fill", make_splat(0.02, (4, 4), np.dtype(np.float32)))
    s = g.add_constant("s", np.array(np.inf, np.float32))
    a = g.add_node("Add", [x, big], [TensorType((4, 4), DType.F32)], output_names=["a"]).outputs[0]
    b = g.add_node("Mul", [a, fill], [TensorType((4, 4), DType.F32)], output_names=["b"]).outputs[0]
    c = g.add_node("Max", [b, s], [TensorType((4, 4), DType.F32)], output_names=["c"]).outputs[0]
    d = g.add_node(
        "LeakyRelu", [c], [TensorType((4, 4), DType.F32)], {"alpha": 0.1}, output_names=["B"]
    ).outputs[0]
    g.outputs = [d]
    verify_graph(g)
    text = print_graph(g)
    assert 'param big: f32[4, 4] = load("big")' in text
    assert 'param "fill": f32[4, 4] = fill(0.02)' in text
    assert "const s: f32[] = inf" in text
    assert '"B": f32[4, 4] = leaky_relu(c, alpha=0.1)' in text
    parser.parse(text)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("x", "x"),
        ("/h.0/attn/Gemm_output_0", '"/h.0/attn/Gemm_output_0"'),
        ('a"b\n', '"a\\"b\\n"'),
        ("graph", '"graph"'),
        ("B", '"B"'),
    ],
)
def test_identifiers_are_escaped(name: str, expected: str) -> None:
    assert ident(name) == expected
