"""TfIdfVectorizer and the ai.onnx.ml ops (Binarizer, ArrayFeatureExtractor, LabelEncoder,
TreeEnsemble): flowc's import (lowering or registry reference) against onnxruntime where it
runs the node, else against ONNX's reference evaluator; the errors; and every kernel in one
host build."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from opcheck import Case, cases_model

from flowc.errors import ShapeError, UnsupportedOpError
from flowc.frontend.onnx import import_model
from flowc.harness.compare import compare
from flowc.interpreter import evaluate
from flowc.ir.graph import Attrs
from flowc.ir.verify import verify_graph
from flowc.ops.ml import DOMAIN
from flowc.ops.registry import get_op

RNG = np.random.default_rng(5)


class Spec:
    """One node: op, inputs (constant ones become initializers), attributes, domain and the
    oracle its expected output comes from ("ort" or "onnx", ONNX's reference evaluator)."""

    def __init__(
        self,
        op: str,
        inputs: Sequence[np.ndarray],
        attrs: Mapping[str, Any] | None = None,
        *,
        domain: str = DOMAIN,
        oracle: str = "ort",
        const_inputs: Sequence[int] = (),
        tol: float = 1e-6,
    ) -> None:
        self.op, self.inputs, self.attrs = op, [np.asarray(a) for a in inputs], dict(attrs or {})
        self.domain, self.oracle, self.const_inputs, self.tol = domain, oracle, const_inputs, tol


def build(specs: Sequence[Spec]) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    cases = [
        Case(x.op, x.inputs, x.attrs, const_inputs=x.const_inputs, domain=x.domain) for x in specs
    ]
    return cases_model(cases, {"": 21, DOMAIN: 5}, prefix="n")


def expected(spec: Spec) -> np.ndarray:
    model, feeds = build([spec])
    if spec.oracle == "ort":
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return np.asarray(sess.run(None, feeds)[0])
    return np.asarray(ReferenceEvaluator(model).run(None, feeds)[0])


def check(*specs: Spec) -> None:
    """Each node imported by flowc and evaluated, against its oracle."""
    for s in specs:
        model, feeds = build([s])
        graph = import_model(model)
        verify_graph(graph)
        got = evaluate(graph, feeds)["n0_out0"]
        want = expected(s)
        c = compare("out", got, want, s.tol)
        assert c.ok, f"{s.op} {s.attrs}: {c.reason or c.error}"


def floats(*shape: int, dtype: type = np.float32) -> np.ndarray:
    return RNG.uniform(-2.0, 2.0, shape).astype(dtype)


# -- Binarizer ----------------------------------------------------------------------------------


def test_binarizer() -> None:
    x = floats(3, 4, 5)
    x[0, 0, :2] = 0.5  # equal to the threshold: not above it
    nan = x.copy()
    nan[1, 1, 1] = np.nan  # onnxruntime refuses NaN inputs; ONNX's evaluator gives 0
    check(
        Spec("Binarizer", [x], {"threshold": 0.5}),
        Spec("Binarizer", [nan], {"threshold": 0.5}, oracle="onnx"),
        Spec("Binarizer", [floats(7)]),
        # Types onnxruntime has no kernel for: ONNX's evaluator.
        Spec("Binarizer", [floats(2, 3, dtype=np.float64)], {"threshold": 0.1}, oracle="onnx"),
        Spec(
            "Binarizer",
            [np.array([-3, -2, -1, 0, 1, 2], np.int64)],
            {"threshold": -1.5},
            oracle="onnx",
        ),
        Spec(
            "Binarizer", [np.array([[-1, 0, 1, 7]], np.int32)], {"threshold": 0.25}, oracle="onnx"
        ),
    )


def test_binarizer_lowers_to_compare_and_cast() -> None:
    model, _ = build([Spec("Binarizer", [floats(4)], {"threshold": 0.5})])
    ops = [n.op for n in import_model(model).nodes]
    assert ops == ["Greater", "Cast"]
    op = get_op(f"{DOMAIN}.Binarizer")
    got = op.evaluate([np.array([-2, -1, 0, 3], np.int64)], Attrs({"threshold": -1.5}))[0]
    assert got.tolist() == [0, 1, 1, 1] and got.dtype == np.int64


def test_binarizer_rejects_other_types() -> None:
    model, _ = build([Spec("Binarizer", [np.zeros(3, np.int8)])])
    with pytest.raises(ShapeError, match="X must be float, double, int64 or int32"):
        import_model(model)


# -- ArrayFeatureExtractor ----------------------------------------------------------------------


def test_array_feature_extractor() -> None:
    check(
        Spec("ArrayFeatureExtractor", [floats(3, 4), np.array([0, 3, 3], np.int64)]),
        Spec("ArrayFeatureExtractor", [floats(5), np.array([4, 1], np.int64)]),
        Spec("ArrayFeatureExtractor", [floats(2, 3, 5), np.array([[4, 1], [0, 2]], np.int64)]),
        Spec(
            "ArrayFeatureExtractor",
            [np.arange(10, dtype=np.int32).reshape(2, 5), np.array([2], np.int64)],
            const_inputs=(1,),
        ),
        # A negative index counts from the end (onnxruntime does not check it).
        Spec(
            "ArrayFeatureExtractor",
            [floats(2, 4, dtype=np.float64), np.array([-1, 0], np.int64)],
            oracle="onnx",
        ),
    )


def test_array_feature_extractor_constant_index_out_of_range() -> None:
    model, _ = build(
        [
            Spec(
                "ArrayFeatureExtractor",
                [floats(2, 4), np.array([1, 4], np.int64)],
                const_inputs=(1,),
            )
        ]
    )
    with pytest.raises(ShapeError, match="index 4 is out of range"):
        import_model(model)


# -- LabelEncoder -------------------------------------------------------------------------------


def _tensor(values: Sequence[Any], dtype: type) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, dtype=dtype))


def test_label_encoder_int_keys() -> None:
    x = np.array([[1, 7, 3], [2, -5, 9]], np.int64)
    check(
        Spec(
            "LabelEncoder",
            [x],
            {"keys_int64s": [3, 1, 2, -5], "values_floats": [0.5, 1.5, 2.5, 3.5]},
        ),
        Spec(
            "LabelEncoder",
            [x],
            {"keys_int64s": [3, 1, 2], "values_int64s": [30, 10, 20], "default_int64": 42},
        ),
        # A repeated key: the last one wins, as the specification says (onnxruntime keeps
        # the first).
        Spec(
            "LabelEncoder",
            [x],
            {"keys_int64s": [1, 2, 1], "values_int64s": [5, 6, 7]},
            oracle="onnx",
        ),
    )


def test_label_encoder_float_keys() -> None:
    x = np.array([1.0, np.nan, -0.0, 2.5, 0.0, 7.0], np.float32)
    check(
        Spec(
            "LabelEncoder",
            [x],
            {"keys_floats": [2.5, float("nan"), 0.0, 1.0], "values_int64s": [1, 2, 3, 4]},
        ),
        Spec(
            "LabelEncoder",
            [x],
            {"keys_floats": [2.5, 1.0], "values_floats": [-1.0, 8.0], "default_float": 3.0},
        ),
    )


def test_label_encoder_tensor_maps() -> None:
    # onnxruntime has no kernel for these tensor-attribute type pairs: ONNX's evaluator.
    check(
        Spec(
            "LabelEncoder",
            [np.array([4, 1, 9, 4], np.int32)],
            {
                "keys_tensor": _tensor([1, 4], np.int32),
                "values_tensor": _tensor([10, 40], np.int16),
                "default_tensor": _tensor([-7], np.int16),
            },
            oracle="onnx",
        ),
        Spec(
            "LabelEncoder",
            [np.array([0.25, 3.0, 1.0], np.float64)],
            {
                "keys_tensor": _tensor([1.0, 0.25], np.float64),
                "values_tensor": _tensor([2.0, 8.0], np.float64),
                "default_tensor": _tensor([0.5], np.float64),
            },
            oracle="onnx",
        ),
    )
    # Without default_tensor: the specification's -1 for integer values.
    op = get_op(f"{DOMAIN}.LabelEncoder")
    a = Attrs(
        {"keys_tensor": np.array([1, 2], np.int16), "values_tensor": np.array([5, 6], np.int32)}
    )
    got = op.evaluate([np.array([2, 3], np.int16)], a)[0]
    assert got.tolist() == [6, -1] and got.dtype == np.int32


def test_label_encoder_strings_are_unsupported() -> None:
    node = helper.make_node(
        "LabelEncoder", ["x"], ["y"], domain=DOMAIN, keys_strings=["a"], values_int64s=[1]
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.INT64, [2])],
        [helper.make_empty_tensor_value_info("y")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 4)]
    )
    with pytest.raises(UnsupportedOpError, match="string keys or values"):
        import_model(model)


@pytest.mark.parametrize(
    "x, attrs, message",
    [
        (np.zeros(2, np.int32), {"keys_int64s": [1], "values_int64s": [2]}, "must match"),
        (np.zeros(2, np.int64), {"keys_int64s": [1, 2], "values_int64s": [2]}, "has 2 entries"),
        (np.zeros(2, np.int64), {"values_int64s": [2]}, "exactly one keys_"),
    ],
)
def test_label_encoder_errors(x: np.ndarray, attrs: dict[str, Any], message: str) -> None:
    model, _ = build([Spec("LabelEncoder", [x], attrs)])
    with pytest.raises(ShapeError, match=message):
        import_model(model)


# -- TfIdfVectorizer ----------------------------------------------------------------------------

# 1-grams [2], [3], [5], [4]; 2-grams [5, 6], [7, 8], [6, 7]; 3-grams [5, 6, 7], [1, 1, 3].
POOL = {
    "pool_int64s": [2, 3, 5, 4, 5, 6, 7, 8, 6, 7, 5, 6, 7, 1, 1, 3],
    "ngram_counts": [0, 4, 10],
    "ngram_indexes": [0, 1, 2, 3, 4, 5, 6, 7, 8],
}
TOKENS = np.array([[1, 1, 3, 3, 3, 7, 8, 6, 7, 5, 6, 8], [5, 6, 7, 8, 6, 7, 5, 1, 6, 7, 4, 2]])


def tfidf(mode: str, lo: int, hi: int, skip: int, **extra: Any) -> dict[str, Any]:
    return {
        **POOL,
        "mode": mode,
        "min_gram_length": lo,
        "max_gram_length": hi,
        "max_skip_count": skip,
        **extra,
    }


WEIGHTS = [0.5, 1.5, 2.0, 0.25, 3.0, 1.0, 0.75, 4.0, 2.5]


@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
@pytest.mark.parametrize("lo, hi, skip", [(1, 1, 0), (2, 2, 0), (1, 2, 2), (1, 3, 1), (3, 3, 3)])
def test_tfidf_against_onnxruntime(mode: str, lo: int, hi: int, skip: int) -> None:
    specs = [
        Spec("TfIdfVectorizer", [TOKENS], tfidf(mode, lo, hi, skip), domain=""),
        Spec("TfIdfVectorizer", [TOKENS[1].astype(np.int32)], tfidf(mode, lo, hi, skip), domain=""),
    ]
    if mode != "TF":
        specs.append(
            Spec(
                "TfIdfVectorizer",
                [TOKENS.astype(np.int32)],
                tfidf(mode, lo, hi, skip, weights=WEIGHTS),
                domain="",
            )
        )
    check(*specs)


def test_tfidf_shared_and_sparse_coordinates() -> None:
    # Several n-grams on one coordinate, coordinates no n-gram maps to, weights per n-gram.
    shared = {**POOL, "ngram_indexes": [3, 0, 3, 5, 0, 0, 1, 5, 3]}
    for mode in ("TF", "IDF", "TFIDF"):
        attrs = tfidf(mode, 1, 3, 2, weights=WEIGHTS)
        attrs.update(shared)
        check(Spec("TfIdfVectorizer", [TOKENS], attrs, domain=""))
        del attrs["weights"]
        check(Spec("TfIdfVectorizer", [TOKENS], attrs, domain=""))


@pytest.mark.parametrize(
    "attrs, message",
    [
        ({**tfidf("TF", 1, 2, 0), "ngram_counts": [0, 3]}, "not a whole number of 2-grams"),
        ({**tfidf("TF", 1, 2, 0), "ngram_indexes": [0, 1]}, "the pool holds 9 n-grams"),
        ({**tfidf("TF", 1, 2, 0), "pool_int64s": [2, 2, *POOL["pool_int64s"][2:]]}, "twice"),
        (tfidf("TFIDF", 1, 2, 0, weights=[1.0, 2.0]), "weights has 2 entries"),
        (tfidf("BM25", 1, 2, 0), "mode must be one of"),
        (tfidf("TF", 3, 2, 0), "min_gram_length"),
    ],
)
def test_tfidf_errors(attrs: dict[str, Any], message: str) -> None:
    model, _ = build([Spec("TfIdfVectorizer", [TOKENS], attrs, domain="")])
    with pytest.raises(ShapeError, match=message):
        import_model(model)


def test_tfidf_string_pool_is_refused() -> None:
    op = get_op("TfIdfVectorizer")
    from flowc.ir.dtype import DType
    from flowc.ir.types import TensorType
    from flowc.ops.registry import InferCtx

    attrs = Attrs({**tfidf("TF", 1, 1, 0), "pool_strings": ("a",)}).merged(op.attrs)
    ctx = InferCtx("TfIdfVectorizer", "t", [TensorType((3,), DType.I64)], [None], attrs, 1)
    with pytest.raises(ShapeError, match="string pools"):
        op.infer(ctx)


# -- TreeEnsemble -------------------------------------------------------------------------------


def random_forest(
    trees: int, depth: int, features: int, targets: int, modes: Sequence[int], seed: int
) -> dict[str, Any]:
    """Complete binary trees of ``depth`` levels, nodes laid out tree by tree; splits and
    member sets drawn from the grid the test inputs use, so ties and members occur."""
    rng = np.random.default_rng(seed)
    grid = np.arange(-2.0, 2.01, 0.5)
    a: dict[str, list[Any]] = {
        k: []
        for k in (
            "nodes_featureids",
            "nodes_splits",
            "nodes_modes",
            "nodes_truenodeids",
            "nodes_falsenodeids",
            "nodes_trueleafs",
            "nodes_falseleafs",
            "nodes_missing_value_tracks_true",
            "leaf_targetids",
            "leaf_weights",
            "tree_roots",
            "membership_values",
        )
    }
    for _ in range(trees):
        base = len(a["nodes_featureids"])
        a["tree_roots"].append(base)
        inner = 2**depth - 1
        for i in range(inner):
            mode = int(rng.choice(modes))
            a["nodes_featureids"].append(int(rng.integers(features)))
            a["nodes_modes"].append(mode)
            a["nodes_splits"].append(float(rng.choice(grid)) if mode != 6 else 0.0)
            if mode == 6:
                # onnxruntime only takes integral members.
                members = rng.choice(
                    np.arange(-2.0, 2.5), size=int(rng.integers(1, 4)), replace=False
                )
                a["membership_values"] += [float(m) for m in members] + [float("nan")]
            a["nodes_missing_value_tracks_true"].append(int(rng.integers(2)))
            for side, child in (("true", 2 * i + 1), ("false", 2 * i + 2)):
                if child < inner:
                    a[f"nodes_{side}nodeids"].append(base + child)
                    a[f"nodes_{side}leafs"].append(0)
                else:
                    a[f"nodes_{side}nodeids"].append(len(a["leaf_targetids"]))
                    a[f"nodes_{side}leafs"].append(1)
                    a["leaf_targetids"].append(int(rng.integers(targets)))
                    a["leaf_weights"].append(float(rng.uniform(-3, 3)))
    out: dict[str, Any] = {k: v for k, v in a.items() if v}
    out["nodes_modes"] = _tensor(a["nodes_modes"], np.uint8)
    out["n_targets"] = targets
    return out


def forest(dtype: type, **kw: Any) -> dict[str, Any]:
    a = random_forest(**kw)
    a["nodes_splits"] = _tensor(a["nodes_splits"], dtype)
    a["leaf_weights"] = _tensor(a["leaf_weights"], dtype)
    if "membership_values" in a:
        a["membership_values"] = _tensor(a["membership_values"], dtype)
    return a


def grid_inputs(rows: int, features: int, dtype: type) -> np.ndarray:
    """Integers (onnxruntime truncates a feature to an integer before a member test; exact
    and truncated membership agree on them) that tie with the integral splits, and NaNs."""
    x = RNG.integers(-3, 4, size=(rows, features)).astype(dtype)
    x[RNG.uniform(size=x.shape) < 0.1] = np.nan
    return x


@pytest.mark.parametrize("aggregate", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tree_ensemble(aggregate: int, dtype: type) -> None:
    a = forest(dtype, trees=4, depth=3, features=3, targets=3, modes=range(7), seed=aggregate)
    a["aggregate_function"] = aggregate
    check(Spec("TreeEnsemble", [grid_inputs(40, 3, dtype)], a, tol=1e-5))


def test_tree_ensemble_membership_is_exact() -> None:
    # BRANCH_MEMBER tests the feature's value itself (onnxruntime truncates it to an integer
    # first, so 0.5 would be a member of {0} there).
    a: dict[str, Any] = {
        "tree_roots": [0],
        "nodes_featureids": [0],
        "nodes_splits": np.array([0.0], np.float32),
        "nodes_modes": np.array([6], np.uint8),
        "nodes_truenodeids": [0],
        "nodes_falsenodeids": [1],
        "nodes_trueleafs": [1],
        "nodes_falseleafs": [1],
        "leaf_targetids": [0, 0],
        "leaf_weights": np.array([1.0, 2.0], np.float32),
        "membership_values": np.array([0.0, 2.5, np.nan], np.float32),
        "n_targets": 1,
    }
    x = np.array([[0.0], [0.5], [2.5], [2.0], [np.nan]], np.float32)
    got = get_op(f"{DOMAIN}.TreeEnsemble").evaluate([x], Attrs(a))[0]
    assert got.reshape(-1).tolist() == [1.0, 2.0, 1.0, 2.0, 2.0]


def test_tree_ensemble_one_mode_and_leaf_tree() -> None:
    # Only BRANCH_LEQ (the kernel's switch-free path), and a tree that is a single leaf: one
    # node whose branches both name the same leaf.
    a = forest(np.float32, trees=2, depth=2, features=2, targets=2, modes=[0], seed=9)
    node = len(a["nodes_featureids"])
    leaf = len(a["leaf_targetids"])
    a["tree_roots"].append(node)
    for k, v in (
        ("nodes_featureids", 0),
        ("nodes_truenodeids", leaf),
        ("nodes_falsenodeids", leaf),
        ("nodes_trueleafs", 1),
        ("nodes_falseleafs", 1),
        ("nodes_missing_value_tracks_true", 0),
        ("leaf_targetids", 1),
    ):
        a[k] = [*a[k], v]
    splits = numpy_helper.to_array(a["nodes_splits"])
    a["nodes_splits"] = _tensor([*splits, 0.0], np.float32)
    a["nodes_modes"] = _tensor([0] * (node + 1), np.uint8)
    a["leaf_weights"] = _tensor([*numpy_helper.to_array(a["leaf_weights"]), 10.0], np.float32)
    check(Spec("TreeEnsemble", [grid_inputs(30, 2, np.float32)], a, tol=1e-5))


def test_tree_ensemble_float16_runs_in_float32() -> None:
    a = forest(np.float16, trees=2, depth=2, features=2, targets=2, modes=[0, 3], seed=4)
    x = grid_inputs(12, 2, np.float16)
    model, feeds = build([Spec("TreeEnsemble", [x], a)])
    graph = import_model(model)
    assert [n.op for n in graph.nodes] == ["Cast", f"{DOMAIN}.TreeEnsemble", "Cast"]
    got = evaluate(graph, feeds)["n0_out0"]
    wide = forest(np.float32, trees=2, depth=2, features=2, targets=2, modes=[0, 3], seed=4)
    want = expected(Spec("TreeEnsemble", [x.astype(np.float32)], wide))
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"post_transform": 1}, "post_transform 1 is not supported"),
        ({"nodes_featureids": [0, 5, 0]}, "tests feature 5"),
        ({"nodes_truenodeids": [1, 0, 3], "nodes_trueleafs": [0, 0, 1]}, "cycle"),
        ({"leaf_targetids": [0, 1, 2, 3]}, "leaf_targetids must lie in"),
        ({"nodes_falsenodeids": [2, 9, 3]}, "out of range"),
        ({"nodes_modes": _tensor([0, 6, 0], np.uint8)}, "membership_values holds 0"),
    ],
)
def test_tree_ensemble_errors(change: dict[str, Any], message: str) -> None:
    a: dict[str, Any] = {
        "tree_roots": [0],
        "nodes_featureids": [0, 1, 0],
        "nodes_splits": _tensor([0.0, 1.0, 2.0], np.float32),
        "nodes_modes": _tensor([0, 0, 0], np.uint8),
        "nodes_truenodeids": [1, 0, 1],
        "nodes_falsenodeids": [2, 2, 3],
        "nodes_trueleafs": [0, 1, 1],
        "nodes_falseleafs": [0, 1, 1],
        "leaf_targetids": [0, 1, 0, 1],
        "leaf_weights": _tensor([1.0, 2.0, 3.0, 4.0], np.float32),
        "n_targets": 2,
    }
    a.update(change)
    model, _ = build([Spec("TreeEnsemble", [floats(3, 2)], a)])
    with pytest.raises(ShapeError, match=message):
        import_model(model)


# -- all kernels in one host build --------------------------------------------------------------


def test_ml_ops_compiled(tmp_path: Path) -> None:
    from flowc.compiler import compile_graph
    from flowc.harness.build import build as build_project
    from flowc.harness.build import run
    from flowc.passes.manager import COMPILE_PIPELINE, PassManager

    shared = {**POOL, "ngram_indexes": [3, 0, 3, 5, 0, 0, 1, 5, 3]}
    tree = forest(np.float32, trees=4, depth=3, features=3, targets=3, modes=range(7), seed=1)
    tree64 = forest(np.float64, trees=3, depth=2, features=2, targets=2, modes=[0], seed=2)
    specs = [
        Spec("Binarizer", [floats(3, 4)], {"threshold": 0.5}),
        Spec(
            "Binarizer",
            [np.array([-3, -2, -1, 0, 5], np.int64)],
            {"threshold": -1.5},
            oracle="onnx",
        ),
        Spec("ArrayFeatureExtractor", [floats(5), np.array([4, 1], np.int64)]),
        Spec("ArrayFeatureExtractor", [floats(2, 3, 5), np.array([[4, 1], [0, 2]], np.int64)]),
        Spec(
            "LabelEncoder",
            [TOKENS],
            {"keys_int64s": [3, 1, 2, 7], "values_floats": [0.5, 1.5, 2.5, 3.5]},
        ),
        Spec(
            "LabelEncoder",
            [np.array([1.0, np.nan, -0.0, 2.5, 0.0, 7.0], np.float32)],
            {"keys_floats": [2.5, float("nan"), 0.0, 1.0], "values_int64s": [1, 2, 3, 4]},
        ),
        Spec(
            "LabelEncoder",
            [np.array([4, 1, 9, 4], np.int32)],
            {
                "keys_tensor": _tensor([1, 4], np.int32),
                "values_tensor": _tensor([10, 40], np.int16),
                "default_tensor": _tensor([-7], np.int16),
            },
            oracle="onnx",
        ),
        Spec("TfIdfVectorizer", [TOKENS], tfidf("TF", 1, 3, 2), domain=""),
        Spec("TfIdfVectorizer", [TOKENS[0].astype(np.int32)], tfidf("TF", 2, 2, 0), domain=""),
        Spec(
            "TfIdfVectorizer",
            [TOKENS],
            {**tfidf("IDF", 1, 3, 2, weights=WEIGHTS), **shared},
            domain="",
        ),
        Spec("TfIdfVectorizer", [TOKENS], {**tfidf("IDF", 2, 3, 1), **shared}, domain=""),
        Spec(
            "TfIdfVectorizer",
            [TOKENS],
            {**tfidf("TFIDF", 1, 3, 2, weights=WEIGHTS), **shared},
            domain="",
        ),
        Spec("TfIdfVectorizer", [TOKENS], tfidf("TFIDF", 1, 2, 1), domain=""),
        Spec("TreeEnsemble", [grid_inputs(40, 3, np.float32)], tree, tol=1e-5),
        Spec(
            "TreeEnsemble",
            [grid_inputs(20, 3, np.float32)],
            {**tree, "aggregate_function": 0},
            tol=1e-5,
        ),
        Spec("TreeEnsemble", [grid_inputs(20, 3, np.float32)], {**tree, "aggregate_function": 2}),
        Spec("TreeEnsemble", [grid_inputs(20, 2, np.float64)], {**tree64, "aggregate_function": 3}),
    ]
    model, feeds = build(specs)
    graph = PassManager(COMPILE_PIPELINE).run(import_model(model))
    project = tmp_path / "project"
    compile_graph(graph, project, poison=True)
    bdir = build_project(project, "host")
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
    got, _ = run(project, feeds, target="host")
    failures = []
    for k, s in enumerate(specs):
        c = compare(f"n{k}_out0", got[f"n{k}_out0"], expected(s), s.tol)
        if not c.ok:
            failures.append(f"{s.op} {k}: {c.reason or c.error}")
    assert not failures, "\n".join(failures)
