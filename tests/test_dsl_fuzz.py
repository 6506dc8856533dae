"""Properties of the DSL front end, checked on generated inputs (hypothesis).

* Round trip: a random graph (GraphBuilder; a handful of ops, random shapes and names, an
  optional mesh with placements, optional stages, inline / fill / load constants) prints to
  text that parses back to a graph that prints to the same text and computes the same
  outputs.
* Fuzzing: random strings, random token sequences from the grammar's vocabulary, every op
  called with random inputs and attributes, and character- and token-level mutations of
  valid programs (hand-written ones and printed random graphs). parse_program must give a
  Graph or raise a FlowcError, never any other exception; and a Graph it gives must
  round-trip.

Every test is derandomized with an explicit example count, so CI runs the same inputs each
time; `pytest --hypothesis-show-statistics` shows how many each one tried.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from flowc.errors import FlowcError
from flowc.frontend.dsl import parse_program, parser
from flowc.interpreter import evaluate
from flowc.ir import DType, Graph, Mesh, NdSbp, Sbp, TensorType
from flowc.ir.builder import GraphBuilder
from flowc.ir.graph import Value, is_splat, make_splat
from flowc.ir.layout import fits
from flowc.ir.printer import INLINE_MAX, print_graph
from flowc.ir.verify import verify_graph
from flowc.ops.registry import all_ops

# Example counts, one input each (the round trip: one graph each); 3550 in all.
N_ROUNDTRIP = 200
N_RANDOM_TEXT = 500
N_TOKENS = 500
N_BODY_TOKENS = 400
N_CHAR_MUTATIONS = 600
N_TOKEN_MUTATIONS = 600
N_PRINTED_MUTATIONS = 250
N_OP_CALLS = 500


def fuzz_settings(n: int) -> Callable[[Callable[..., None]], Callable[..., None]]:
    return settings(
        deadline=None,
        max_examples=n,
        derandomize=True,
        database=None,
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# -- helpers ---------------------------------------------------------------------------------


def stored_weights(g: Graph) -> dict[str, np.ndarray]:
    """The constants the printer writes as load("name"), as `flowc convert` stores them."""
    return {
        c.name: np.ascontiguousarray(c.const)
        for c in g.constants
        if c.const is not None and not is_splat(c.const) and c.const.size > INLINE_MAX
    }


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    import zipfile

    # Member by member, as `flowc convert` writes its weights.
    with zipfile.ZipFile(path, "w") as z:
        for name, a in arrays.items():
            if a.dtype.type.__module__.startswith("ml_dtypes"):
                # ml_dtypes arrays go in as raw bytes, which the reader views back: NumPy
                # writes float8_e5m2 with the descriptor '<f1', which it cannot read.
                a = a.view(f"V{a.dtype.itemsize}")
            with z.open(f"{name}.npy", "w") as f:
                np.lib.format.write_array(f, a, allow_pickle=False)


def roundtrip(g: Graph, where: Path) -> Graph:
    """print -> parse -> print is a fixed point; returns the parsed graph."""
    arrays = stored_weights(g)
    weights = None
    if arrays:
        weights = "w.npz"
        write_npz(where / weights, arrays)
    text = print_graph(g, weights=weights)
    g2 = parse_program(text, "roundtrip.flow", base_dir=where)
    again = print_graph(g2, weights=weights)
    assert again == text, f"not a fixed point:\n{text}\n---\n{again}"
    return g2


def same_array(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    dt = DType.from_numpy(a.dtype)
    if dt.is_complex:
        return bool(np.array_equal(a, b, equal_nan=True))
    if dt.is_float:
        # ml_dtypes floats compare through float64, which holds their values exactly
        return bool(np.array_equal(a.astype(np.float64), b.astype(np.float64), equal_nan=True))
    return bool(np.array_equal(a.astype(np.int64), b.astype(np.int64)))


def parse_or_flowc_error(text: str, where: Path, weights: Path | None = None) -> Graph | None:
    """The fuzz property: a Graph (which must itself round-trip) or a FlowcError."""
    try:
        g = parse_program(text, "fuzz.flow", weights=weights, base_dir=where)
    except FlowcError as e:
        # the error names the file and a position
        assert str(e).startswith("fuzz.flow"), str(e)
        return None
    assert isinstance(g, Graph)
    with tempfile.TemporaryDirectory() as d:  # not `where`: later inputs must not see w.npz
        roundtrip(g, Path(d))
    return g


@pytest.fixture(scope="module")
def wdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("dsl-fuzz")
    write_npz(
        d / "seed.npz",
        {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), "b": np.ones(3, np.float32)},
    )
    return d


# -- random graphs ---------------------------------------------------------------------------

PLAIN = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}", fullmatch=True)
SPECIAL = st.sampled_from(
    [
        "/h.0/attn/c_attn/Gemm_output_0",
        "onnx::MatMul_123",
        'quote"d',
        "back\\slash",
        "tab\there",
        "new\nline",
        "ünïcödé",
        "日本語",
        "🙂",
        "",
        " ",
        "x:0",
        "1abc",
        # keywords and names the reader makes up itself
        "graph",
        "param",
        "const",
        "return",
        "mesh",
        "stage",
        "weights",
        "load",
        "fill",
        "tensor",
        "complex",
        "inf",
        "nan",
        "true",
        "false",
        "S",
        "B",
        "P",
        "_",
        "_t1",
        "_t2",
        "_t3",
        "f32",
        "relu",
        "zeros",
    ]
)
# Any text but lone surrogates: ONNX names are UTF-8, and an .npz member name must encode.
ANY = st.text(st.characters(exclude_categories=("Cs",)), max_size=6)
NAMES = st.one_of(PLAIN, SPECIAL, ANY)

# Element types of constants that are only returned (no op reads them): the printer must
# write and read back every one.
EXOTIC = [DType.BF16, DType.F16, DType.F64, DType.I4, DType.U8, DType.C64, DType.BOOL]
EXOTIC += [DType.F8E4M3FN, DType.I64, DType.F8E5M2]

SHAPES = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)
F32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


@st.composite
def graphs(draw: st.DrawFn) -> Graph:
    taken: set[str] = set()

    def fresh(no_nul: bool = False) -> str:
        n = draw(NAMES)
        if no_nul:
            n = n.replace("\x00", "0")  # a zip member's name (an .npz key) ends at NUL
        while n in taken:  # unique without a filter, which would reject whole examples
            n += "'"
        taken.add(n)
        return n

    g = Graph(draw(NAMES))
    b = GraphBuilder(g, fold=False)
    if draw(st.booleans()):
        g.mesh = Mesh(draw(NAMES), tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)

    def place(v: Value) -> None:
        if g.mesh is None or not draw(st.booleans()):
            return
        kinds = [Sbp("B"), Sbp("P"), *(Sbp.split(a) for a in range(v.type.rank))]
        sbp = NdSbp(tuple(draw(st.sampled_from(kinds)) for _ in g.mesh.shape))
        # flowc splits only evenly (the reader rejects other placements).
        if fits(v.type.shape, sbp, g.mesh):
            v.sbp = sbp

    def constant(dtype: DType, shape: tuple[int, ...]) -> Value:
        n = int(np.prod(shape))
        kind = draw(st.sampled_from(["inline", "splat", "load"] if n > 1 else ["inline"]))
        if kind == "splat":
            x = draw(F32) if dtype is DType.F32 else draw(st.integers(0, 1))
            a = make_splat(x, shape, dtype.np)
        elif kind == "inline" and n <= INLINE_MAX and dtype is DType.F32:
            a = np.array(draw(st.lists(F32, min_size=n, max_size=n)), np.float32).reshape(shape)
        else:
            if kind == "load" and n <= INLINE_MAX:
                shape = (*shape[:-1], shape[-1] + INLINE_MAX)
                n = int(np.prod(shape))
            if dtype is DType.BOOL:
                a = rng.random(shape) < 0.5
            elif dtype.is_int:
                a = rng.integers(-8 if dtype.is_signed else 0, 8, size=shape).astype(dtype.np)
            elif dtype.is_complex:
                a = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype.np)
            else:
                a = rng.standard_normal(shape).astype(dtype.np)
        v = g.add_constant(fresh(no_nul=kind == "load"), a)
        place(v)
        return v

    pool: list[Value] = []  # f32 values the ops read
    for _ in range(draw(st.integers(0, 3))):
        v = g.add_input(fresh(), TensorType(draw(SHAPES), DType.F32))
        place(v)
        pool.append(v)
    for _ in range(draw(st.integers(0 if pool else 1, 2))):
        pool.append(constant(DType.F32, draw(SHAPES)))
    extras = [
        constant(draw(st.sampled_from(EXOTIC)), draw(SHAPES))
        for _ in range(draw(st.integers(0, 2)))
    ]

    def i64(values: list[int]) -> Value:
        return g.add_constant(fresh(), np.array(values, np.int64))

    def pick() -> Value:
        return draw(st.sampled_from(pool))

    for _ in range(draw(st.integers(0, 8))):
        x = pick()
        r = x.type.rank
        ops = ["Add", "Mul", "Relu", "Reshape", "Clip"]
        if r > 0:  # the ops with an axis
            ops += ["MatMul", "Transpose", "Concat", "Split", "ReduceSum", "Softmax"]
        op = draw(st.sampled_from(ops))
        ins: list[Value | None] = [x]
        attrs: dict[str, object] = {}
        n_out = 1
        if op in ("Add", "Mul"):
            same = [v for v in pool if v.type.shape[-r:] == x.type.shape or v.type.shape == ()]
            ins.append(draw(st.sampled_from(same)) if same else x)
        elif op == "MatMul":
            ins.append(constant(DType.F32, (x.type.shape[-1], draw(st.integers(1, 4)))))
        elif op == "Transpose":
            attrs["perm"] = draw(st.permutations(range(r)))
        elif op == "Reshape":
            n = x.type.numel
            ins.append(
                i64(draw(st.sampled_from([[n], [-1], [1, n], [n, 1], list(x.type.shape[::-1])])))
            )
        elif op == "Concat":
            ins.append(x)
            attrs["axis"] = draw(st.integers(-r, r - 1))
        elif op == "Split":
            axis = draw(st.integers(0, r - 1))
            attrs["axis"] = axis
            n_out = draw(st.integers(1, max(1, x.type.shape[axis])))
            if draw(st.booleans()):
                attrs["num_outputs"] = n_out
            else:
                d = x.type.shape[axis]
                sizes = [d // n_out] * n_out
                sizes[-1] += d - sum(sizes)
                ins.append(i64(sizes))
        elif op == "ReduceSum":
            attrs["keepdims"] = draw(st.integers(0, 1))
            if draw(st.booleans()):
                ins.append(i64(sorted(draw(st.sets(st.integers(0, r - 1), min_size=1)))))
        elif op == "Softmax":
            attrs["axis"] = draw(st.integers(-r, r - 1))
        elif op == "Clip":
            # min omitted: printed as `_`
            ins += [None, constant(DType.F32, ())]
        names = [fresh() for _ in range(n_out)]
        try:
            outs = b.emit(op, ins, attrs, name=names[0], output_names=names, num_outputs=n_out)
        except FlowcError:
            continue  # an op these inputs do not fit: leave it out
        stage = draw(st.none() | st.integers(0, 3))
        for o in outs:
            assert o.producer is not None
            o.producer.stage = stage
            place(o)
            pool.append(o)
    candidates = pool + extras
    outs = draw(st.lists(st.sampled_from(candidates), max_size=3, unique_by=id))
    g.outputs = outs
    verify_graph(g)
    return g


@fuzz_settings(N_ROUNDTRIP)
@given(graphs(), st.integers(0, 2**32 - 1))
def test_print_parse_print_is_a_fixed_point_and_computes_the_same(g: Graph, seed: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        g2 = roundtrip(g, Path(d))
    assert [v.name for v in g2.outputs] == [v.name for v in g.outputs]
    assert [n.stage for n in g2.nodes] == [n.stage for n in g.nodes]
    assert [v.sbp for v in g2.values()] == [v.sbp for v in g.values()]
    assert g2.mesh == g.mesh
    rng = np.random.default_rng(seed)
    feeds = {v.name: rng.standard_normal(v.type.shape).astype(np.float32) for v in g.inputs}
    with np.errstate(all="ignore"):  # random data overflows now and then, the same way twice
        want, got = evaluate(g, feeds), evaluate(g2, feeds)
    assert list(got) == list(want)
    for k in want:
        assert same_array(got[k], want[k]), k


# -- fuzzing: random text and tokens ---------------------------------------------------------


def grammar_words() -> list[str]:
    """Every keyword and punctuation mark of the grammar, from the grammar itself."""
    p = parser()
    return sorted({t.pattern.value for t in p.terminals if t.pattern.type == "str"})


OPS = sorted(o.dsl_name for o in all_ops())
VOCAB = [
    *grammar_words(),
    "\n",
    "\n",
    "\n    ",
    "x",
    "y",
    "w",
    "h",
    '"/a:0"',
    '"x"',
    '"bad \\q escape"',
    "0",
    "1",
    "2",
    "-1",
    "3.5",
    "1e400",
    "-0.0",
    "9" * 30,
    "f32",
    "i64",
    "bool",
    "c64",
    "bf16",
    "f33",
    "zeros",
    "ones",
    "normal",
    "uniform",
    "axis",
    "perm",
    "num_outputs",
    "keepdims",
    "# comment",
    "\t",
    "$",
    "\\",
    "é",
    *OPS,
]

HEADER = "mesh gpus[2]\ngraph g(x: f32[4, 3] @ S(0), w: f32[3, 3]) -> (y: f32[4, 3]) {\n"
FOOTER = "\n    y = relu(x)\n    return y\n}\n"


@fuzz_settings(N_RANDOM_TEXT)
@given(st.text(max_size=120))
def test_fuzz_random_text(wdir: Path, text: str) -> None:
    parse_or_flowc_error(text, wdir)


@fuzz_settings(N_TOKENS)
@given(st.lists(st.sampled_from(VOCAB), max_size=40))
def test_fuzz_token_sequences(wdir: Path, tokens: list[str]) -> None:
    parse_or_flowc_error(" ".join(tokens), wdir)


@fuzz_settings(N_BODY_TOKENS)
@given(st.lists(st.lists(st.sampled_from(VOCAB), max_size=12), max_size=4))
def test_fuzz_token_statements_in_a_graph(wdir: Path, lines: list[list[str]]) -> None:
    """Random statements inside a valid graph: past the parser, into the reader's checks."""
    body = "\n".join("    " + " ".join(line) for line in lines)
    parse_or_flowc_error(HEADER + body + FOOTER, wdir)


# -- fuzzing: every op with random inputs and attributes --------------------------------------

ALL_OPS = all_ops()
CALL_HEADER = (
    "graph g(x: f32[2, 3, 4], y: f32[2, 3, 4], i: i64[2, 3], b: bool[2, 3, 4], s: f32[], "
    "v: f32[4], h: f16[2, 3, 4], u: u8[2, 3]) -> () {\n"
)
CALL_ARGS = st.sampled_from(
    [
        *("x", "y", "i", "b", "s", "v", "h", "u", "_", "1", "0", "-1", "2.5", "[1, 2]"),
        *("[0, 1, 2]", "[-1]", "[2, 3, 4]", "[]", "[1.5]", "nan", "inf", "complex(1, 2)"),
        "99999999999",
    ]
)
ATTR_VALUES = st.sampled_from(
    [
        *("0", "1", "-1", "2", "3", "-5", "7", "100", "9" * 20, "0.5", "-0.0", "nan", "inf"),
        *("-inf", "1e308", '"abc"', '""', '"NCHW"', '"constant"', "true", "false", "[]"),
        *("[0]", "[1, 0]", "[0, 1, 2]", "[2, 1, 0]", "[-1]", "[1, 1, 1, 1]", "[1.5, 2]"),
        *('["a", "b"]', "[[1, 2]]", "tensor(f32[2], [1, 2])", "tensor(i64[], 3)"),
        *("tensor(f32[0], [])", "tensor(bool[1], true)", "tensor(bf16[2], [0.5, 3])"),
        "complex(1, 1)",
    ]
)


@st.composite
def op_calls(draw: st.DrawFn) -> str:
    from flowc.frontend.dsl import known_attributes

    op = draw(st.sampled_from(ALL_OPS))
    known = sorted(known_attributes(op.name)) or ["axis"]
    args = draw(st.lists(CALL_ARGS, max_size=4))
    kwargs = draw(
        st.lists(
            st.tuples(st.sampled_from(known), ATTR_VALUES), max_size=3, unique_by=lambda t: t[0]
        )
    )
    targets = ", ".join(f"o{k}" for k in range(draw(st.integers(1, 3))))
    return f"{targets} = {op.dsl_name}({', '.join(args + [f'{k}={v}' for k, v in kwargs])})"


@fuzz_settings(N_OP_CALLS)
@given(st.lists(op_calls(), min_size=1, max_size=3))
def test_fuzz_every_op_with_random_inputs_and_attributes(wdir: Path, calls: list[str]) -> None:
    """Type inference of every op meets what a program can write (axis=[1, 2], perm="ab",
    a bool where a float goes, ...): a Graph or a FlowcError at the call."""
    text = CALL_HEADER + "".join(f"    {c}\n" for c in calls) + "    return\n}\n"
    parse_or_flowc_error(text, wdir)


# -- fuzzing: mutations of valid programs ----------------------------------------------------

SEEDS = [
    # every construct once: headers, comments, params of each initializer, consts, quoted
    # names, placements, stages, multi-result bindings, omitted inputs, attributes
    """# a model
mesh gpus[2, 3]
weights "seed.npz"

graph mlp(x: f32[4, 4] @ (S(0), B), "/in:0": f32[4, 3]) -> (y: f32[4, 3], "/o:0": f32[4, 3]) {
    param w: f32[4, 3] @ (B, S(1)) = load("w")   # from seed.npz
    param b: f32[3] = ones
    param n: f32[3, 3] = normal(0.0, 0.02)
    param u: f32[3] = uniform(-1, 1)
    param z: f32[3] = zeros
    param f: f32[4, 3] = fill(0.5)
    const c: i64[2] = [4, 3]
    const t: bool[2] = [true, false]
    stage 0 {
        h: f32[4, 3] @ (S(0), B) = x @ w + b * 2
        q, k = split(h, [1, 2], axis=1)
    }
    stage 1 {
        y = relu(-h / 2.0 + (f - 1))
    }
    "/o:0" = clip(reshape(y, c), _, 6.0) @ n + "/in:0" * u
    s = softmax(y, axis=-1)
    r = reduce_sum(s, [1], keepdims=0)
    return y, "/o:0"
}
""",
    """graph g(a: f32[2, 3], i: i64[2]) -> (o: f32[3, 2], v: f32[2, 2], j: i64[2, 2]) {
    const e: f32[] = inf
    o = transpose(a, perm=[1, 0])
    v, j = topk(a, [2], axis=-1, largest=1)
    n = neg(i) ; m = concat(a, a, axis=0)
    k = leaky_relu(a, alpha=0.1) + 2 * 0.5 + e
    cc = complex(1, 2) * 2
    return o, v, j
}
""",
    'graph "weird \\"name\\""() -> (c: c64[2]) {\n    const c: c64[2] = [complex(1.0, -2.0), nan]\n'
    "    return c\n}\n",
    "graph empty() -> () {\n    return\n}\n",
    # symbolic dims: declared before the graph and in place, a polynomial, a computed count
    """dim batch: 1..8@4
dim n0: 0..24 computed

graph dyn(x: f32[batch, seq:1..6, 4], k: f32[4, 6]) -> (y: f32[batch*seq, 4], z: i64[2, n0]) {
    h = relu(x)
    y = reshape(h, [-1, 4])
    z: i64[2, n0] = non_zero(k)
    return y, z
}
""",
]

TOKEN_RE = re.compile(
    r'"(?:[^"\\\n]|\\.)*"|#[^\n]*|[A-Za-z_][A-Za-z0-9_]*|-?\d+(?:\.\d*)?(?:[eE][+-]?\d+)?'
    r"|->|\n[ \t]*|[ \t]+|."
)


def mutate_chars(text: str, ops: list[tuple[int, int, str]]) -> str:
    for kind, at, ch in ops:
        if not text:
            text = ch
            continue
        i = at % len(text)
        if kind == 0:
            text = text[:i] + text[i + 1 :]
        elif kind == 1:
            text = text[:i] + ch + text[i:]
        elif kind == 2:
            j = (i + 1 + at // 7) % len(text)
            i, j = min(i, j), max(i, j)
            text = text[:i] + text[j : j + 1] + text[i + 1 : j] + text[i : i + 1] + text[j + 1 :]
        else:
            text = text[:i] + ch + text[i + 1 :]
    return text


def mutate_tokens(text: str, ops: list[tuple[int, int, str]]) -> str:
    toks = TOKEN_RE.findall(text)
    for kind, at, word in ops:
        if not toks:
            toks = [word]
            continue
        i = at % len(toks)
        if kind == 0:
            del toks[i]
        elif kind == 1:
            toks.insert(i, " " + word + " ")
        elif kind == 2:
            j = (at // 7) % len(toks)
            toks[i], toks[j] = toks[j], toks[i]
        else:
            toks[i] = toks[(at // 3) % len(toks)]  # duplicate another token here
    return "".join(toks)


CHAR_OPS = st.lists(
    st.tuples(
        st.integers(0, 3),
        st.integers(0, 10**6),
        st.sampled_from('()[]{},:;=@"\\#\n -_0123456789aSBPxé'),
    ),
    min_size=1,
    max_size=4,
)
TOKEN_OPS = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 10**6), st.sampled_from(VOCAB)),
    min_size=1,
    max_size=3,
)


@pytest.mark.parametrize("text", SEEDS)
def test_seed_programs_are_valid(wdir: Path, text: str) -> None:
    roundtrip(parse_program(text, "seed.flow", base_dir=wdir), wdir)


@fuzz_settings(N_CHAR_MUTATIONS)
@given(st.sampled_from(SEEDS), CHAR_OPS)
def test_fuzz_character_mutations(wdir: Path, seed: str, ops: list[tuple[int, int, str]]) -> None:
    parse_or_flowc_error(mutate_chars(seed, ops), wdir)


@fuzz_settings(N_TOKEN_MUTATIONS)
@given(st.sampled_from(SEEDS), TOKEN_OPS)
def test_fuzz_token_mutations(wdir: Path, seed: str, ops: list[tuple[int, int, str]]) -> None:
    parse_or_flowc_error(mutate_tokens(seed, ops), wdir)


@fuzz_settings(N_PRINTED_MUTATIONS)
@given(graphs(), st.one_of(CHAR_OPS.map(lambda o: ("c", o)), TOKEN_OPS.map(lambda o: ("t", o))))
def test_fuzz_mutations_of_printed_graphs(
    g: Graph, mutation: tuple[str, list[tuple[int, int, str]]]
) -> None:
    kind, ops = mutation
    with tempfile.TemporaryDirectory() as d:
        where = Path(d)
        arrays = stored_weights(g)
        if arrays:
            write_npz(where / "w.npz", arrays)
        text = print_graph(g, weights="w.npz" if arrays else None)
        mutated = mutate_chars(text, ops) if kind == "c" else mutate_tokens(text, ops)
        parse_or_flowc_error(mutated, where)


# -- through the whole pipeline, bounded (tests/fuzzing.py) ----------------------------------

N_PIPELINE = 200


def test_fuzz_dsl_mutants_compile_or_exit_2() -> None:
    """Mutated example programs and templates with huge shapes (fills, random params, expand,
    tile, reshape; meshes, stages and ranks past flowc's bounds) through import, random
    inputs, the reference interpreter, the compile passes and code generation, each in a
    forked child under a 4 GiB address-space limit: every one ends in success or a
    FlowcError of exit code 2, never an internal error, a MemoryError or a hang."""
    import fuzzing

    counts: dict[str, int] = {}
    bad = []
    for r in fuzzing.run_cases((("dsl", k) for k in range(N_PIPELINE)), jobs=2):
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
        if r.outcome not in fuzzing.GOOD:
            bad.append(f"dsl seed {r.seed}: {r.outcome}: {r.message[-1500:]}")
    assert not bad, "\n".join(bad[:5])
    assert counts.get("accepted", 0) > N_PIPELINE // 20


def test_huge_fill_param_is_not_materialized_by_folding() -> None:
    """A fill of 8 GiB is one element; an op on it is not folded (that would allocate the
    whole result) but left to run time, so the program still compiles."""
    from flowc.passes.manager import COMPILE_PIPELINE, PassManager

    g = parse_program(
        "graph g() -> (y: f32[2147483648]) {\n    param w: f32[2147483648] = fill(2)\n"
        "    y = relu(w)\n    return y\n}\n"
    )
    g = PassManager(COMPILE_PIPELINE).run(g)
    assert [n.op for n in g.nodes] and all(c.const is not None for c in g.constants)
    assert all(is_splat(c.const) for c in g.constants if c.const is not None and c.const.size > 1)
