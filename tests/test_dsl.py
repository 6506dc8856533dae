"""The DSL front end: each construct, its results against NumPy, each error with its exact
position, and the CLI on .flow programs (convert, eval, inspect, compile, verify)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_MODELS
from test_cli import assert_clean_error, flowc

from flowc.errors import FlowcError
from flowc.frontend.dsl import DslError, load_program, parse_program
from flowc.interpreter import evaluate
from flowc.ir import DType, Graph, Mesh, NdSbp, Sbp
from flowc.ir.graph import is_splat
from flowc.ir.printer import print_graph
from flowc.ops.registry import all_ops, op_by_dsl_name

# -- helpers ---------------------------------------------------------------------------------


def program(
    *body: str,
    sig: str = "x: f32[2, 3]",
    outs: str = "y: f32[2, 3]",
    ret: str | None = "y",
    head: str = "",
) -> str:
    """A graph `g` with the body's statements, one per line (line 2 onwards, after `head`),
    then `return RET`."""
    lines = [*(head.splitlines() if head else []), f"graph g({sig}) -> ({outs}) {{"]
    lines += ["    " + b for b in body]
    if ret is not None:
        lines.append("    return " + ret if ret else "    return")
    return "\n".join([*lines, "}"]) + "\n"


def parse(text: str, weights: Path | None = None, base_dir: Path | None = None) -> Graph:
    return parse_program(text, "t.flow", weights, base_dir)


def check_error(
    text: str,
    line: int,
    at: str | int,
    *fragments: str,
    hint: str | None = None,
    weights: Path | None = None,
) -> str:
    """The program fails with `t.flow:LINE:COL: ...` where COL is the first `at` on that
    line (or the column `at`), shows the line, puts the caret under it, and says each
    fragment (and the hint)."""
    with pytest.raises(DslError) as ei:
        parse(text, weights)
    msg = str(ei.value)
    src = text.split("\n")[line - 1]
    col = at if isinstance(at, int) else src.index(at) + 1
    first, shown, caret, *rest = msg.split("\n")
    assert first.startswith(f"t.flow:{line}:{col}: "), msg
    assert shown == "  " + src, msg
    assert caret == "  " + " " * (col - 1) + "^", msg
    for f in fragments:
        assert f in first, f"{f!r} not in {msg!r}"
    if hint is not None:
        assert rest and rest[0].startswith("  hint: ") and hint in rest[0], msg
    return msg


def run(g: Graph, **feeds: np.ndarray) -> dict[str, np.ndarray]:
    return evaluate(g, feeds)


def const(g: Graph, name: str) -> np.ndarray:
    (v,) = [c for c in g.constants if c.name == name]
    assert v.const is not None
    return v.const


X = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5


# -- constructs ------------------------------------------------------------------------------


def test_expressions_evaluate_like_numpy() -> None:
    g = parse(
        program(
            "const w: f32[3, 3] = [1, 0, 2, 0, 1, 0, -1, 0, 1]",
            "param b: f32[3] = fill(0.5)",
            "y = -(x @ w + b) * 2 - x / (x * x + 1) + (x - 1) * -3",
        )
    )
    w = np.array([1, 0, 2, 0, 1, 0, -1, 0, 1], np.float32).reshape(3, 3)
    want = -(X @ w + 0.5) * 2 - X / (X * X + 1) + (X - 1) * -3
    got = run(g, x=X)["y"]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert [n.op for n in g.nodes][:2] == ["MatMul", "Add"]


def test_every_registry_op_is_reachable_by_its_dsl_name() -> None:
    for op in all_ops():
        assert op.dsl_name == op.dsl_name.lower() and op_by_dsl_name(op.dsl_name) is op
        # With no inputs each op answers for itself: never "unknown op".
        with pytest.raises(FlowcError) as ei:
            parse(program(f"o = {op.dsl_name}()", "y = relu(x)"))
        assert "unknown op" not in str(ei.value), op.name


def test_calls_with_positional_and_keyword_attributes() -> None:
    g = parse(
        program(
            "t = transpose(x, perm=[1, 0])",
            "s = softmax(t, axis=0)",
            "l = leaky_relu(x, alpha=0.25)",
            "r = reduce_sum(x, [1], keepdims=1)",
            "c = cast(x, to=7)",
            'p = pad(x, [0, 1, 0, 1], mode="constant")',
            "k = constant(value=tensor(f32[2, 3], [1, 2, 3, 4, 5, 6]))",
            "y = l + r + k",
            outs="y: f32[2, 3], s: f32[3, 2], c: i64[2, 3], p: f32[2, 5]",
            ret="y, s, c, p",
        )
    )
    out = run(g, x=X)
    np.testing.assert_allclose(out["s"], np.exp(X.T) / np.exp(X.T).sum(0), rtol=1e-6)
    lr = np.where(X > 0, X, 0.25 * X)
    k = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(out["y"], lr + X.sum(1, keepdims=True) + k, rtol=1e-6)
    assert out["c"].dtype == np.int64
    np.testing.assert_array_equal(out["p"], np.pad(X, ((0, 0), (1, 1))))
    attrs = {n.op: dict(n.attrs) for n in g.nodes}
    assert attrs["Transpose"]["perm"] == (1, 0) and attrs["Pad"]["mode"] == "constant"
    assert attrs["LeakyRelu"]["alpha"] == 0.25 and attrs["Cast"]["to"] == 7


def test_literals_take_their_type_from_context() -> None:
    g = parse(
        program(
            "h = cast(x, to=10) * 2",  # f16 tensor: the 2 is f16
            "n = i + 1",  # i32 tensor: the 1 is i32
            "r = reshape(x, [3, -1])",  # a shape: i64
            "w = where(c, x, 0)",  # typed like x, not like the bool condition
            "f = 2.5",  # alone: f32
            "k = 2 * 3 + 1",  # alone: i64, folded
            "z = complex(1, 2)",  # alone: c64
            "q = x + [1, 2, 3]",  # a list next to f32: f32[3]
            "e = 1 / 0",  # IEEE division
            "y = relu(x)",
            sig="x: f32[2, 3], i: i32[2], c: bool[2, 3]",
        )
    )
    types = {v.name: v.type for v in g.values()}
    assert str(types["h"]) == "f16[2, 3]" and str(types["n"]) == "i32[2]"
    assert str(types["r"]) == "f32[3, 2]" and str(types["w"]) == "f32[2, 3]"
    assert str(types["f"]) == "f32[]" and str(types["k"]) == "i64[]"
    assert str(types["z"]) == "c64[]" and str(types["q"]) == "f32[2, 3]"
    by_op = {n.op: n for n in g.nodes}
    shape = by_op["Reshape"].inputs[1]
    assert shape is not None and shape.const is not None and shape.const.dtype == np.int64
    assert shape.const.tolist() == [3, -1]
    scalars = {n.op: n.inputs[1] for n in g.nodes if n.op in ("Mul", "Add")}
    assert all(v is not None for v in scalars.values())
    assert const(g, "k").tolist() == 7 and const(g, "f").tolist() == 2.5
    assert const(g, "z").tolist() == 1 + 2j and np.isinf(const(g, "e"))
    where = by_op["Where"].inputs[2]
    assert where is not None and where.type.dtype is DType.F32


def test_const_declarations_have_exact_types() -> None:
    g = parse(
        program(
            "const a: u8[3] = [1, 2, 255]",
            "const b: bool[2] = [true, false]",
            "const c: f64[] = -inf",
            "const d: c64[2] = [complex(1, -2), nan]",
            "const e: i64[2, 2] = [1, -2, 3, -4]",
            "const f: bf16[2] = [0.1, 3]",
            "const g: f32[0] = []",
            "const h: bool[] = true",
            "y = relu(x)",
        )
    )
    assert const(g, "a").dtype == np.uint8 and const(g, "a").tolist() == [1, 2, 255]
    assert const(g, "b").tolist() == [True, False]
    assert const(g, "c").dtype == np.float64 and const(g, "c").tolist() == -np.inf
    d = const(g, "d")
    assert d.dtype == np.complex64 and d[0] == 1 - 2j and np.isnan(d[1].real)
    assert const(g, "e").shape == (2, 2) and const(g, "e")[1, 1] == -4
    assert const(g, "f").dtype == DType.BF16.np and float(const(g, "f")[1]) == 3.0
    assert const(g, "g").shape == (0,) and const(g, "h").tolist() is True


def test_param_initializers(tmp_path: Path) -> None:
    np.savez(tmp_path / "w.npz", w=np.arange(6, dtype=np.float32).reshape(2, 3))
    text = program(
        "param z: f32[2, 3] = zeros",
        "param o: i64[4] = ones",
        "param f: f32[2, 3] = fill(0.25)",
        "param t: bool[3] = fill(true)",
        "param n: f32[200] = normal(1.0, 0.5)",
        "param n2: f32[200] = normal(1.0, 0.5)",
        "param u: f64[300] = uniform(-2, 3)",
        'param w: f32[2, 3] = load("w")',
        "y = x + w + z + f",
        head='weights "w.npz"',
    )
    g = parse(text, base_dir=tmp_path)
    assert is_splat(const(g, "z")) and float(const(g, "z")[0, 0]) == 0.0
    assert const(g, "o").dtype == np.int64 and const(g, "o").tolist() == [1, 1, 1, 1]
    assert is_splat(const(g, "f")) and const(g, "t").tolist() == [True] * 3
    n = const(g, "n")
    assert n.dtype == np.float32 and abs(n.mean() - 1.0) < 0.15 and abs(n.std() - 0.5) < 0.1
    # seeded by the name: the same program makes the same numbers, another name others
    assert np.array_equal(parse(text, base_dir=tmp_path).constants[4].const, n)
    assert not np.array_equal(const(g, "n2"), n)
    u = const(g, "u")
    assert u.dtype == np.float64 and u.min() >= -2 and u.max() < 3 and u.std() > 1
    np.testing.assert_array_equal(const(g, "w"), np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(run(g, x=X)["y"], X + np.arange(6).reshape(2, 3) + 0.25)


def test_load_from_npz_and_safetensors(tmp_path: Path) -> None:
    arrays = {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "/h.0/attn/c_attn/weight": np.full((3,), 2, np.float16),
        "ids": np.array([3, 1], np.int64),
    }
    text = program(
        'param w: f32[2, 3] = load("w")',
        'param "/h.0/attn/c_attn/weight": f16[3] = load("/h.0/attn/c_attn/weight")',
        'param ids: i64[2] = load("ids")',
        "y = x * w",
    )
    np.savez(tmp_path / "a.npz", **arrays)
    files = [tmp_path / "a.npz"]
    try:
        from safetensors.numpy import save_file
    except ImportError:  # the dependency is being added; the .npz path still runs
        pass
    else:
        save_file(arrays, str(tmp_path / "a.safetensors"))
        files.append(tmp_path / "a.safetensors")
    for f in files:
        g = parse(text, weights=f)
        for k, a in arrays.items():
            got = const(g, k)
            assert got.dtype == a.dtype and np.array_equal(got, a), (f, k)
        np.testing.assert_array_equal(run(g, x=X)["y"], X * arrays["w"])


def test_multi_result_bindings() -> None:
    g = parse(
        program(
            "q, k, v = split(x, axis=1, num_outputs=3)",
            "values, indices = topk(x, [2], axis=-1)",
            "a, b: f32[1, 3] = split(x, [1, 1])",
            "y = q",
            outs="y: f32[2, 1], values: f32[2, 2], indices: i64[2, 2], b: f32[1, 3]",
            ret="y, values, indices, b",
        )
    )
    out = run(g, x=X)
    np.testing.assert_array_equal(out["y"], X[:, :1])
    np.testing.assert_array_equal(out["values"], -np.sort(-X, axis=-1)[:, :2])
    np.testing.assert_array_equal(out["indices"], np.argsort(-X, axis=-1)[:, :2])
    np.testing.assert_array_equal(out["b"], X[1:])
    split = next(n for n in g.nodes if n.op == "Split")
    assert [o.name for o in split.outputs] == ["q", "k", "v"]


def test_quoted_names_survive_the_round_trip() -> None:
    names = [
        "/h.0/attn/c_attn/Gemm_output_0",
        'a "quoted" \\ name',
        "ünï 日本 🙂",
        "graph",
        "B",
        "",
        "_t1",
    ]
    sig = ", ".join(f"{_q(n)}: f32[2]" for n in names[:2])
    body = [f"{_q(names[2])} = {_q(names[0])} + {_q(names[1])}"]
    body += [f"{_q(n)} = relu({_q(names[2])})" for n in names[3:]]
    outs = ", ".join(f"{_q(n)}: f32[2]" for n in names[3:])
    text = program(*body, sig=sig, outs=outs, ret=", ".join(_q(n) for n in names[3:]))
    g = parse(text)
    assert [v.name for v in g.inputs] == names[:2]
    assert [v.name for v in g.outputs] == names[3:]
    printed = print_graph(g)
    assert '"/h.0/attn/c_attn/Gemm_output_0": f32[2]' in printed
    assert print_graph(parse(printed)) == printed
    a = np.array([1.0, -2.0], np.float32)
    out = run(g, **{names[0]: a, names[1]: a})
    assert list(out) == names[3:]
    assert all(np.array_equal(v, np.maximum(2 * a, 0)) for v in out.values())


def test_names_the_reader_could_take_for_its_own() -> None:
    # "" is no name Graph.add_constant keeps; _t1, _t2 are what the reader calls literals
    g = parse(
        program(
            'param "": f32[3] = fill(1.0)',
            "a = x * 2 + 1",  # literals: temporaries _t1, _t2, ...
            '_t1 = a + ""',
            "_t2 = _t1 * 3",
            "y = _t2",
        )
    )
    assert g.constants[0].name == ""
    np.testing.assert_array_equal(run(g, x=X)["y"], ((X * 2 + 1) + 1) * 3)
    printed = print_graph(g)
    assert print_graph(parse(printed)) == printed


def _q(name: str) -> str:
    import json

    return json.dumps(name)


def test_stages_are_carried_into_the_ir() -> None:
    g = parse(
        program(
            "stage 0 {",
            "    a = relu(x)",
            "    b = a * 2",
            "}",
            "stage 3 {",
            "    c = b + 1",
            "}",
            "y = c - x",
        )
    )
    assert [(n.op, n.stage) for n in g.nodes][:2] == [("Relu", 0), ("Mul", 0)]
    assert [n.stage for n in g.nodes] == [0, 0, 3, None]
    printed = print_graph(g)
    assert "    stage 0 {\n        a: f32[2, 3] = relu(x)\n" in printed
    assert print_graph(parse(printed)) == printed


def test_mesh_and_placements() -> None:
    text = program(
        "param w: f32[3, 4] @ (B, S(1)) = zeros",
        "h: f32[2, 4] @ (S(0), S(1)) = x @ w",
        "z @ (P, B) = relu(h)",
        "y = z",
        sig="x: f32[2, 3] @ (S(0), B), v: f32[4] @ (B, B)",
        outs="y: f32[2, 4] @ (S(0), B)",
        head="mesh gpus[2, 2]",
    )
    g = parse(text)
    assert g.mesh == Mesh("gpus", (2, 2))
    sbp = {v.name: v.sbp for v in g.values()}
    assert sbp["x"] == NdSbp((Sbp.split(0), Sbp("B")))
    assert sbp["v"] == NdSbp((Sbp("B"), Sbp("B")))
    assert sbp["w"] == NdSbp((Sbp("B"), Sbp.split(1)))
    assert sbp["h"] == NdSbp((Sbp.split(0), Sbp.split(1)))
    assert sbp["z"] == NdSbp((Sbp("P"), Sbp("B")))
    assert sbp["y"] == NdSbp((Sbp.split(0), Sbp("B")))
    printed = print_graph(g)
    assert printed.startswith("mesh gpus[2, 2]\n\ngraph g(x: f32[2, 3] @ (S(0), B), ")
    assert print_graph(parse(printed)) == printed
    one = parse(
        program("y = relu(x)", sig="x: f32[2, 4] @ S(1)", outs="y: f32[2, 4]", head="mesh m[4]")
    )
    assert one.inputs[0].sbp == NdSbp((Sbp.split(1),))
    with pytest.raises(DslError, match=r"t.flow:2:22: S\(1\) cuts axis 1 of input 'x'"):
        parse(program("y = relu(x)", sig="x: f32[2, 3] @ S(1)", head="mesh m[4]"))


def test_comments_separators_and_line_endings(tmp_path: Path) -> None:
    text = (
        "# leading comment\n\n"
        "mesh gpus[2]  # the mesh\n"
        "graph g(x: f32[2, 3] @ S(0)) -> (y: f32[2, 3]) {  # signature\n"
        "    # a whole line\n"
        "    a = relu(x) ; b = a + 1   # two statements\n"
        "\n"
        "    stage 1 {  # stage\n"
        "        y = b * 2  # in a stage\n"
        "    }\n"
        "    return y  # done\n"
        "}\n"
        "# trailing comment"
    )
    g = parse(text)
    np.testing.assert_array_equal(run(g, x=X)["y"], (np.maximum(X, 0) + 1) * 2)
    crlf = parse(text.replace("\n", "\r\n"))
    assert print_graph(crlf) == print_graph(g)
    p = tmp_path / "bom.flow"
    p.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert print_graph(load_program(p)) == print_graph(g)


def test_omitted_inputs() -> None:
    g = parse(program("y = clip(x, _, 1.0)"))
    (node,) = g.nodes
    assert node.op == "Clip" and node.inputs[1] is None
    np.testing.assert_array_equal(run(g, x=X)["y"], np.minimum(X, 1.0))
    assert "= clip(x, _, " in print_graph(g)


def test_graph_without_outputs_and_returned_inputs_and_params() -> None:
    g = parse("graph nothing(x: f32[2]) -> () {\n    return\n}\n")
    assert g.outputs == [] and print_graph(g).endswith("    return\n}\n")
    assert print_graph(parse(print_graph(g))) == print_graph(g)
    g = parse(
        "graph g(x: f32[2]) -> (x: f32[2], c: f32[]) {\n    const c: f32[] = 1\n    return x, c\n}\n"
    )
    assert [v.name for v in g.outputs] == ["x", "c"]


def test_printer_writes_every_dtype_and_reads_it_back(tmp_path: Path) -> None:
    g = Graph("dtypes")
    rng = np.random.default_rng(0)
    for d in DType:
        small = (rng.integers(0, 3, size=3)).astype(d.np)
        big = (rng.integers(0, 3, size=20)).astype(d.np)
        g.add_constant(f"s_{d.short}", small)
        g.add_constant(f"f_{d.short}", np.broadcast_to(small[:1], (20,)))
        g.add_constant(f"b_{d.short}", big)
    g.outputs = list(g.constants)
    text = print_graph(g)
    assert "param f_bf16: bf16[20] = fill(" in text and "const s_i4: i4[3] = [" in text
    arrays = {}
    for c in g.constants:
        if c.name.startswith("b_") and c.const is not None:
            a = c.const
            # .npz holds ml_dtypes arrays as raw bytes (float8_e5m2's own descriptor '<f1'
            # does not read back); the reader views them as the declared type
            ml = a.dtype.type.__module__.startswith("ml_dtypes")
            arrays[c.name] = a.view(f"V{a.dtype.itemsize}") if ml else a
    np.savez(tmp_path / "w.npz", **arrays)
    g2 = parse(text, weights=tmp_path / "w.npz")
    assert print_graph(g2) == text
    for a, b in zip(g.constants, g2.constants, strict=True):
        assert a.type == b.type and a.const is not None and b.const is not None
        assert a.const.tobytes() == np.ascontiguousarray(b.const).tobytes(), a.name


# -- errors ----------------------------------------------------------------------------------


def test_unknown_op_suggests_close_names() -> None:
    check_error(program("y = rellu(x)"), 2, "rellu", "unknown op 'rellu'", hint="did you mean relu")
    check_error(
        program("y = LayerNorm(x)"),
        2,
        "LayerNorm",
        "unknown op 'LayerNorm'",
        hint="did you mean layer_normalization",
    )
    check_error(program("y = zzzz(x)"), 2, "zzzz", "unknown op 'zzzz'", hint="`flowc ops` lists")


def test_undefined_name() -> None:
    check_error(program("y = relu(xx)"), 2, "xx", "'xx' is not defined", hint="did you mean 'x'")
    check_error(program(ret="z"), 2, "z", "'z' is not defined")


def test_redefinition() -> None:
    check_error(
        program("y = relu(x)", "y = relu(x)"),
        3,
        "y",
        "'y' is already defined (at line 2, column 5)",
    )
    check_error(
        program("param x: f32[2] = zeros", "y = relu(x)"), 2, "x:", "'x' is already defined"
    )
    check_error(
        program("y = x", sig="x: f32[2, 3], x: f32[2]"),
        1,
        "x: f32[2]",
        "input 'x' is declared twice",
    )
    check_error(
        program("a, a = split(x, num_outputs=2)", "y = x"), 2, "a =", "'a' is already defined"
    )


def test_type_annotation_mismatch() -> None:
    check_error(
        program("y: f32[3, 2] = relu(x)"),
        2,
        "y",
        "'y' is declared f32[3, 2], but the expression gives f32[2, 3]",
    )


def test_placement_errors() -> None:
    check_error(
        program("y = relu(x)", sig="x: f32[2, 3] @ S(2)", head="mesh gpus[2]"),
        2,
        "S(2)",
        "S(2) splits axis 2, but input 'x' has rank 2 (f32[2, 3])",
    )
    check_error(
        program("y @ (S(0), B) = relu(x)", head="mesh gpus[4]"),
        3,
        "@",
        "placement of 'y' has 2 entries, but mesh gpus[4] has 1 axes",
        hint="one S(i), B or P per mesh axis",
    )
    check_error(
        program("param w: f32[2] @ B = zeros", "y = relu(x)"),
        2,
        "@",
        "a placement on 'w' needs a mesh",
        hint="mesh gpus[4]",
    )
    check_error(
        program("y @ B = relu(x)", outs="y: f32[2, 3] @ S(0)", head="mesh m[2]"),
        4,
        "y",
        "output 'y' is placed @ S(0) in the signature, but @ B where it is defined",
    )
    check_error(
        program("y = x", head="mesh m[2]\nmesh n[2]"), 2, "mesh", "the mesh is declared twice"
    )
    check_error(program("y = x", head="mesh m[2, 0]"), 1, "mesh", "at least one device")


def test_type_errors() -> None:
    check_error(
        program("y = x", sig="x: f33[2, 3]"),
        1,
        "f33",
        "unknown element type 'f33'",
        hint="did you mean f32",
    )
    check_error(program("y = x", sig="x: f32[2, -3]"), 1, "-3", "dimension -3 is negative")
    check_error(
        program("const c: f32[3] = [1, 2]", "y = x"),
        2,
        "const",
        "f32[3] holds 3 element(s), but 2 are given",
    )
    check_error(program("const c: u8[] = 256", "y = x"), 2, "const", "do not fit u8[]")
    check_error(program("y = x + 1e400 * complex(0, 1)"), 2, "x +", "does not fit f32")
    check_error(
        program("y = u + -1", sig="u: u8[2]", outs="y: u8[2]"),
        2,
        "u +",
        "the literal -1 does not fit u8",
    )
    check_error(program("y = x * " + "9" * 5000), 2, "9", "has too many digits")


def test_weights_errors(tmp_path: Path) -> None:
    np.savez(tmp_path / "w.npz", weight=np.zeros((3, 2), np.float32))
    load = program('param w: f32[2, 3] = load("weight")', "y = x + w")
    check_error(load, 2, "load", "load('weight') needs a weights file", hint="--weights FILE")
    check_error(
        program('param w: f32[2, 3] = load("weigth")', "y = x + w"),
        2,
        "load",
        "has no array named 'weigth'",
        hint="did you mean 'weight'",
        weights=tmp_path / "w.npz",
    )
    check_error(
        load,
        2,
        "load",
        "'weight' in ",
        "is f32[3, 2], but 'w' is declared f32[2, 3]",
        weights=tmp_path / "w.npz",
    )
    check_error(load, 2, "load", "does not exist", weights=tmp_path / "nope.npz")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    check_error(load, 2, "load", "cannot be read", weights=tmp_path / "bad.npz")
    (tmp_path / "w.txt").write_text("w")
    check_error(load, 2, "load", "unknown format '.txt'", weights=tmp_path / "w.txt")
    check_error(load, 2, "load", "is a directory", weights=tmp_path)
    check_error(
        program("y = x", head='weights "a.npz"\nweights "b.npz"'), 2, "weights", "declared twice"
    )
    try:
        import safetensors  # noqa: F401
    except ImportError:
        return
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    check_error(load, 2, "load", "cannot be read", weights=tmp_path / "bad.safetensors")


def test_initializer_errors() -> None:
    # a type of more elements than any value may have is refused where it is written
    check_error(
        program(f"param p: f32[{'9' * 20}] = zeros", "y = x"),
        2,
        "f32[9",
        "has more elements than flowc supports",
    )
    check_error(
        program("param p: f32[2] = zeros(1)", "y = x"), 2, "zeros", "zeros takes no arguments"
    )
    check_error(
        program("param p: f32[2] = normal(0)", "y = x"), 2, "normal", "normal takes two numbers"
    )
    check_error(
        program("param p: f32[2] = normal(0, -1)", "y = x"), 2, "normal", "cannot make f32[2]"
    )
    check_error(program("param p: i64[2] = uniform(0, 1)", "y = x"), 2, "uniform", "makes floats")
    check_error(
        program("param p: f32[2] = xavier", "y = x"),
        2,
        "xavier",
        "unknown initializer 'xavier'",
        hint="normal(mean, std)",
    )
    check_error(
        program("param p: u8[2] = fill(-1)", "y = x"), 2, "fill", "fill(-1) does not fit u8"
    )


def test_call_errors() -> None:
    check_error(
        program("y = softmax(x, axs=1)"),
        2,
        "axs",
        "softmax has no attribute 'axs'",
        hint="did you mean axis",
    )
    check_error(
        program("y = softmax(x, axis=1, axis=0)"), 2, "axis=0", "attribute 'axis' is given twice"
    )
    check_error(program("y = softmax(axis=1, x)"), 2, "x)", "inputs come before attributes")
    check_error(
        program("y = softmax(x, axis=complex(1, 0))"),
        2,
        "complex",
        "an attribute cannot be a complex number",
    )
    # says which attribute is wrong and what it takes (issue 23, point 8: it said
    # "int() argument must be ... not 'tuple'")
    check_error(
        program("y = softmax(x, axis=[1, 2])"),
        2,
        "softmax",
        "softmax: attribute 'axis' takes an integer, got [1, 2]",
    )
    check_error(
        program("y = all_gather(x)"), 2, "all_gather", "all_gather needs the attribute 'mesh'"
    )
    check_error(program("y = relu(x, x)"), 2, "relu", "takes 1..1 inputs, got 2")
    check_error(program("a, b = relu(x)", "y = x"), 2, "relu", "has 1..1 outputs, got 2")
    check_error(
        program("y = relu(split(x, axis=1, num_outputs=3))"),
        2,
        "split",
        "num_outputs is 3 but the node has 1 outputs",
    )
    check_error(
        program("a, b = x + 1", "y = x"), 2, "a", "2 names, but the expression gives one result"
    )
    check_error(program("y = x + _"), 2, "x + _", "'_' (an omitted input) cannot be an operand")
    check_error(program("y = _"), 2, "_", "cannot be bound")
    check_error(
        program("z = [1, 2] + [1, 2, 3]", "y = x"),
        2,
        "[1, 2] +",
        "cannot compute [1, 2] + [1, 2, 3]",
    )
    check_error(
        program('y = relu("\\q")'), 2, "\\q", "bad escape in a quoted string", hint="JSON escapes"
    )


def test_syntax_errors_say_what_was_expected() -> None:
    check_error(program("y = relu(x x)"), 2, "x)", "unexpected 'x'; expected ", "')'")
    check_error(program("y = relu(x) $"), 2, "$", "unexpected character '$'; expected ")
    # the end of the text: the caret goes just past the last thing written
    text = "graph g(x: f32[2]) -> (y: f32[2]) {\n    y = relu(x  "
    with pytest.raises(DslError) as ei:
        parse(text)
    first, shown, caret = str(ei.value).split("\n")
    assert first.startswith("t.flow:2:15: the program ends too early; expected ")
    assert shown == "      y = relu(x  " and caret == "  " + " " * 14 + "^"
    # a line that ends too early: the caret goes at its end
    with pytest.raises(DslError) as ei:
        parse("graph g(x: f32[2]) -> (y: f32[2]) {\n    y = relu(x\n}\n")
    first, shown, caret = str(ei.value).split("\n")
    assert first.startswith("t.flow:2:15: unexpected the end of the line; expected ")
    assert "')'" in first and caret == "  " + " " * 14 + "^"
    check_error(
        program("y = relu(x)", "z = 1 +"),
        3,
        len("    z = 1 +") + 1,
        "unexpected the end of the line; expected a name, a number",
    )
    check_error("", 1, "", "the program ends too early; expected a new line, ';', 'dim', 'graph'")
    check_error(program("y = relu(x)", sig="x f32[2]"), 1, "f32", "unexpected 'f32'; expected ':'")


def test_return_errors() -> None:
    check_error(
        program("y = relu(x)", ret="y, x"),
        3,
        "return",
        "returns 2 value(s), but the signature declares 1",
    )
    check_error(
        program("y = transpose(x)", outs="y: f32[2, 3]"),
        3,
        "y",
        "output 'y' is declared f32[2, 3], but 'y' is f32[3, 2]",
    )
    check_error(
        program("z = relu(x)", ret="z"),
        3,
        "z",
        "the signature's output 'y' is returned as 'z'",
        hint="bind the result to 'y'",
    )
    check_error("graph g() -> () {\n}\n", 1, "graph", "graph 'g' has no return statement")
    check_error(
        program("y = relu(x)", "return y", "z = x", ret=None),
        4,
        "z",
        "nothing may follow return",
    )
    check_error(
        program("stage 0 {", "    return y", "}", "y = x"),
        3,
        "return",
        "return belongs after the stages",
    )
    check_error(
        program("stage 0 {", "    stage 1 {", "    }", "}", "y = x"),
        3,
        "stage",
        "stages do not nest",
    )


def test_errors_point_at_the_right_line_past_form_feeds_and_tabs() -> None:
    # \f and \u2028 are line breaks to str.splitlines(), not to the parser
    text = program("# a\f comment \u2028 here", "y = rellu(x)")
    check_error(text, 3, "rellu", "unknown op")
    text = program("y =\trellu(x)")
    with pytest.raises(DslError) as ei:
        parse(text)
    msg = str(ei.value)
    assert msg.split("\n")[2] == "  " + " " * len("    y =") + "\t^"


# -- the CLI ---------------------------------------------------------------------------------

TINY = """graph tiny(x: f32[4, 3]) -> (y: f32[4, 2]) {
    param w: f32[3, 2] = load("w")
    param b: f32[2] = fill(0.5)
    y = relu(x @ w + b)
    return y
}
"""
W = np.arange(6, dtype=np.float32).reshape(3, 2) - 2
XT = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)


def tiny(tmp_path: Path, declared: bool = False) -> Path:
    np.savez(tmp_path / "w.npz", w=W)
    np.savez(tmp_path / "w2.npz", w=2 * W)
    np.save(tmp_path / "x.npy", XT)
    p = tmp_path / "tiny.flow"
    p.write_text(('weights "w.npz"\n' if declared else "") + TINY)
    return p


def test_cli_eval_inspect_compile_on_a_flow_program(tmp_path: Path) -> None:
    p = tiny(tmp_path)
    w = str(tmp_path / "w.npz")
    r = flowc(
        "eval",
        str(p),
        "--weights",
        w,
        "--input",
        f"x={tmp_path / 'x.npy'}",
        "-o",
        str(tmp_path / "o.npz"),
    )
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(
        np.load(tmp_path / "o.npz")["y"], np.maximum(XT @ W + 0.5, 0), rtol=1e-6
    )
    r = flowc("inspect", str(p), "--weights", w)
    assert r.returncode == 0, r.stderr
    assert "graph 'tiny'" in r.stdout and "f32[4, 3]" in r.stdout and "MatMul" in r.stdout
    r = flowc("compile", str(p), "--weights", w, "--target", "host", "-o", str(tmp_path / "proj"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "proj" / "CMakeLists.txt").is_file()


@pytest.mark.slow
def test_cli_verify_on_a_flow_program(tmp_path: Path) -> None:
    p = tiny(tmp_path, declared=True)
    r = flowc("verify", str(p), "--target", "host", "-o", str(tmp_path / "proj"))
    assert r.returncode == 0, r.stderr + r.stdout
    assert "PASS" in r.stdout


def test_cli_weights_flag_overrides_the_declared_file(tmp_path: Path) -> None:
    p = tiny(tmp_path, declared=True)
    out = {}
    for tag, extra in (("declared", []), ("override", ["--weights", str(tmp_path / "w2.npz")])):
        r = flowc(
            "eval",
            str(p),
            *extra,
            "--input",
            f"x={tmp_path / 'x.npy'}",
            "-o",
            str(tmp_path / f"{tag}.npz"),
        )
        assert r.returncode == 0, r.stderr
        out[tag] = np.load(tmp_path / f"{tag}.npz")["y"]
    np.testing.assert_allclose(out["declared"], np.maximum(XT @ W + 0.5, 0), rtol=1e-6)
    np.testing.assert_allclose(out["override"], np.maximum(XT @ (2 * W) + 0.5, 0), rtol=1e-6)


def test_cli_errors_on_flow_programs(tmp_path: Path) -> None:
    p = tiny(tmp_path)
    r = flowc("inspect", str(p), "--weights", str(tmp_path / "w.npz"), "--shape", "x=2x3")
    assert_clean_error(r, "--shape/--dim fix an ONNX model's dynamic dimensions", "hint:")
    r = flowc("inspect", str(p))
    assert_clean_error(
        r, "tiny.flow:2:26: load('w') needs a weights file", "^", "hint: pass --weights"
    )
    bad = tmp_path / "bad.flow"
    bad.write_text(TINY.replace("relu(", "rellu("))
    r = flowc(
        "eval",
        str(bad),
        "--weights",
        str(tmp_path / "w.npz"),
        "--random-inputs",
        "-o",
        str(tmp_path / "o.npz"),
    )
    assert_clean_error(
        r, "bad.flow:4:9: unknown op 'rellu'", "    y = rellu(x @ w + b)\n", "did you mean relu"
    )
    assert not (tmp_path / "o.npz").exists()
    r = flowc("inspect", str(tmp_path / "missing.flow"))
    assert_clean_error(r, "missing.flow: no such file")


# -- convert ---------------------------------------------------------------------------------

MODELS = {
    "mlp": [],
    "gpt2_tiny": [],
    "bert_tiny": ["--dim", "batch=2", "--dim", "seq=32"],
    "resnet_tiny": [],
    "vit_tiny": [],
}


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`flowc ARGS` in this process (faster than a subprocess): exit code, stdout, stderr."""
    from flowc.cli import main

    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("model", sorted(MODELS))
def test_convert_then_eval_gives_the_same_outputs(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    onnx_path = SHARED_MODELS / f"{model}.onnx"
    io = np.load(SHARED_MODELS / f"{model}.io.npz")
    inputs = []
    for k in io.files:
        if k.startswith("in:"):
            np.save(tmp_path / f"{k[3:]}.npy", io[k])
            inputs += ["--input", f"{k[3:]}={tmp_path / (k[3:] + '.npy')}"]
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = cli(
        capsys, "convert", str(onnx_path), *MODELS[model], "-o", str(out / f"{model}.flow")
    )
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [f"{model}.flow", f"{model}.weights.npz"]
    text = (out / f"{model}.flow").read_text()
    assert text.startswith(f'weights "{model}.weights.npz"\n')
    code, _, err = cli(
        capsys, "eval", str(onnx_path), *MODELS[model], *inputs, "-o", str(tmp_path / "a.npz")
    )
    assert code == 0, err
    code, _, err = cli(
        capsys, "eval", str(out / f"{model}.flow"), *inputs, "-o", str(tmp_path / "b.npz")
    )
    assert code == 0, err
    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    assert a.files == b.files
    for k in a.files:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
    # the written program is the printer's fixed point
    g = load_program(out / f"{model}.flow")
    assert print_graph(g, weights=f"{model}.weights.npz") == text


def test_a_failing_convert_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "broken.onnx").write_bytes(b"not an onnx model")
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = cli(capsys, "convert", str(tmp_path / "broken.onnx"), "-o", str(out / "m.flow"))
    assert code == 2 and "error:" in err
    code, _, err = cli(capsys, "convert", str(SHARED_MODELS / "mlp.onnx"), "-o", str(out / "m.txt"))
    assert code == 2 and "must end in .flow" in err
    bad = tmp_path / "bad.flow"
    bad.write_text("graph g( {\n")
    code, _, err = cli(capsys, "convert", str(bad), "-o", str(out / "m.flow"))
    assert code == 2 and "bad.flow:1:10" in err
    assert list(out.iterdir()) == []


def test_convert_failing_after_the_weights_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import flowc.ir.printer

    def broken(*args: object, **kw: object) -> str:
        raise OSError("disk full")

    monkeypatch.setattr(flowc.ir.printer, "print_graph", broken)
    out = tmp_path / "out"
    out.mkdir()
    cli(capsys, "convert", str(SHARED_MODELS / "mlp.onnx"), "-o", str(out / "m.flow"))
    assert list(out.iterdir()) == []


def test_convert_of_a_flow_program_round_trips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tiny(tmp_path)
    code, _, err = cli(
        capsys,
        "convert",
        str(p),
        "--weights",
        str(tmp_path / "w.npz"),
        "-o",
        str(tmp_path / "again.flow"),
    )
    assert code == 0, err
    g = load_program(tmp_path / "again.flow")
    np.testing.assert_allclose(run(g, x=XT)["y"], np.maximum(XT @ W + 0.5, 0), rtol=1e-6)
    assert not [q for q in tmp_path.iterdir() if q.name.endswith(".tmp")]


def test_convert_keeps_float8_e5m2_weights_readable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import ml_dtypes
    import onnx
    from onnx import TensorProto, helper

    w = np.linspace(-2, 2, 16).astype(ml_dtypes.float8_e5m2)
    init = helper.make_tensor("w", TensorProto.FLOAT8E5M2, [16], w.view(np.uint8).tobytes(), True)
    f8 = TensorProto.FLOAT8E5M2
    graph = helper.make_graph(
        [helper.make_node("Concat", ["x", "w"], ["y"], axis=0)],
        "f8",
        [helper.make_tensor_value_info("x", f8, [16])],
        [helper.make_tensor_value_info("y", f8, [32])],
        [init],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    onnx.save(model, tmp_path / "f8.onnx")
    code, _, err = cli(
        capsys, "convert", str(tmp_path / "f8.onnx"), "-o", str(tmp_path / "f8.flow")
    )
    assert code == 0, err
    g = load_program(tmp_path / "f8.flow")
    x = np.zeros(16, ml_dtypes.float8_e5m2)
    np.testing.assert_array_equal(run(g, x=x)["y"].astype(np.float32)[16:], w.astype(np.float32))
