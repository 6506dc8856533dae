"""Classic machine-learning ops: TfIdfVectorizer and the ai.onnx.ml domain's Binarizer,
ArrayFeatureExtractor, LabelEncoder and TreeEnsemble.

The ai.onnx.ml ops live outside the default domain, so the registry holds them under their
qualified names (``ai.onnx.ml.Binarizer``) and the importer looks nodes of that domain up that
way. Binarizer and ArrayFeatureExtractor are lowered on import to ops flowc already compiles
(Greater + Cast, Reshape + Gather); the others have kernels (templates/kernels/ml.cu.j2) with
their constant tables (n-gram pool, sorted keys, tree nodes) baked into the generated code.

flowc has no string tensors, so string pools, keys and values are refused with an error that
says so.

Where the specification is silent or onnxruntime departs from it, flowc follows:
- LabelEncoder: the specification: a repeated key's last value wins (onnxruntime keeps the
  first).
- TfIdfVectorizer: onnxruntime (which follows the specification's words; ONNX's reference
  evaluator does not): weights belong to the pool's n-grams, not to output coordinates; a
  repeated n-gram is an error.
- TreeEnsemble: onnxruntime for a target no leaf reaches (0, also under MIN and MAX); the
  specification for BRANCH_MEMBER (the feature's exact value is looked up; onnxruntime
  truncates it to an integer). post_transform other than NONE is refused: the specification
  and onnxruntime number SOFTMAX and LOGISTIC the other way round.

One idea: the ai.onnx.ml family beside its template (ml.cu.j2); kept whole because an op
family is one module, each op's inference, reference, SBP and emitter together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from flowc.codegen.cpp import CTYPES, c_float, c_literal
from flowc.errors import UnsupportedOpError
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node
from flowc.ir.types import TensorType
from flowc.ops.registry import (
    InferCtx,
    defop,
    elementwise_flops,
    first,
    get_op,
    ints,
    node_attrs,
)

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.builder import AdapterNode
    from flowc.ir.graph import Value

FAMILY = "ml"
DOMAIN = "ai.onnx.ml"
TEMPLATE = "ml.cu.j2"
NO_STRINGS = "flowc has no string tensors"


def _validate(n: AdapterNode, op: str) -> Attrs:
    """Run a registry op's inference on an ONNX node before lowering it (the lowering's own
    nodes would report errors in their terms, not the node's); its attributes with defaults."""
    opdef = get_op(op)
    lo, hi = opdef.inputs
    present = len([v for v in n.inputs if v is not None])
    ctx = InferCtx(
        op,
        n.name,
        [v.type if v is not None else None for v in n.inputs],
        [v.const if v is not None else None for v in n.inputs],
        Attrs(n.attrs).merged(opdef.attrs),
        len(n.output_names),
    )
    if not lo <= present <= hi:
        raise ctx.fail(f"takes {lo}..{hi} inputs, got {present}")
    opdef.infer(ctx)
    return ctx.attrs


def _out_name(n: AdapterNode, k: int = 0) -> list[str] | None:
    return [n.output_names[k]] if k < len(n.output_names) and n.output_names[k] else None


def _int_table(values: Sequence[int]) -> str:
    """A C++ initializer list of int64 values (INT64_MIN has no plain literal)."""
    return ", ".join("INT64_MIN" if v == -(1 << 63) else str(int(v)) for v in values)


# -- Binarizer ----------------------------------------------------------------------------------

_BINARIZER_TYPES = (DType.F32, DType.F64, DType.I64, DType.I32)


def _binarizer_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    if x.dtype not in _BINARIZER_TYPES:
        raise ctx.fail(f"X must be float, double, int64 or int32, got {x.dtype}")
    return [x]


def _binarizer_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = first(xs)
    # NumPy compares an integer array with a Python float in float64, as the lowering does.
    return np.asarray(x > float(a["threshold"])).astype(x.dtype)


def _binarizer_import(n: AdapterNode) -> list[Value]:
    """X > threshold as Greater, then Cast back to X's type. The threshold is a float32
    attribute: float inputs compare with it exactly in their own type; integer inputs compare
    in float64 (rounding it to an integer type would move it)."""
    a = _validate(n, f"{DOMAIN}.Binarizer")
    x = n.inputs[0]
    assert x is not None
    dt = x.type.dtype
    cmp_type = dt if dt.is_float else DType.F64
    xv = x if dt == cmp_type else n.emit("Cast", [x], {"to": cmp_type.onnx}, suffix="f64")[0]
    t = n.const("threshold", float(a["threshold"]), cmp_type.np)
    above = n.emit("Greater", [xv, t], suffix="above")[0]
    return n.emit("Cast", [above], {"to": dt.onnx}, output_names=_out_name(n))


defop(
    f"{DOMAIN}.Binarizer",
    FAMILY,
    infer=_binarizer_infer,
    reference=_binarizer_ref,
    attrs={"threshold": 0.0},
    flops=elementwise_flops(1),
    onnx_import=_binarizer_import,
    dsl_name="binarizer",
)


# -- ArrayFeatureExtractor ----------------------------------------------------------------------


def _afe_infer(ctx: InferCtx) -> list[TensorType]:
    x, idx = ctx.type(0), ctx.type(1)
    if x.rank == 0:
        raise ctx.fail("X must have at least one axis; the indices select along its last")
    if idx.dtype not in (DType.I64, DType.I32):
        raise ctx.fail(f"Y (the indices) must be int64 or int32, got {idx.dtype}")
    dim = x.shape[-1]
    c = ctx.maybe_const(1)
    if c is not None and c.size:
        bad = c[(c < -dim) | (c >= dim)]
        if bad.size:
            raise ctx.fail(
                f"index {int(bad.reshape(-1)[0])} is out of range for X's last axis ({dim})"
            )
    # A vector X gives one row, as onnxruntime has it.
    lead = x.shape[:-1] if x.rank > 1 else (1,)
    return [x.with_shape((*lead, idx.numel))]


def _afe_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, idx = xs[0], xs[1]
    assert x is not None and idx is not None
    dim = x.shape[-1]
    i = idx.astype(np.int64).reshape(-1)
    if i.size and (i.min() < -dim or i.max() >= dim):
        bad = i[(i < -dim) | (i >= dim)][0]
        raise IndexError(f"index {bad} is out of range for the last axis ({dim})")
    y = np.take(x, np.where(i < 0, i + dim, i), axis=-1)
    return np.ascontiguousarray(y.reshape(1, -1) if x.ndim == 1 else y)


def _afe_import(n: AdapterNode) -> list[Value]:
    """Gather along X's last axis with the flattened indices (a vector X gains a leading 1)."""
    _validate(n, f"{DOMAIN}.ArrayFeatureExtractor")
    x, idx = n.inputs[0], n.inputs[1]
    assert x is not None and idx is not None
    flat = n.emit("Reshape", [idx, n.const("flat", [-1], np.int64)], suffix="flat")[0]
    last = x.type.rank - 1
    if x.type.rank > 1:
        return n.emit("Gather", [x, flat], {"axis": last}, output_names=_out_name(n))
    row = n.emit("Gather", [x, flat], {"axis": 0}, suffix="gather")[0]
    shape = n.const("row", [1, -1], np.int64)
    return n.emit("Reshape", [row, shape], output_names=_out_name(n))


defop(
    f"{DOMAIN}.ArrayFeatureExtractor",
    FAMILY,
    infer=_afe_infer,
    reference=_afe_ref,
    inputs=2,
    onnx_import=_afe_import,
    dsl_name="array_feature_extractor",
)


# -- LabelEncoder -------------------------------------------------------------------------------

_LABEL_TYPES = (DType.I64, DType.I32, DType.I16, DType.F32, DType.F64)


@dataclass(frozen=True)
class _LabelTable:
    """A LabelEncoder's mapping: sorted unique keys (the last of repeated keys wins), their
    values, the value for a NaN input when a NaN key is given, and the default."""

    key_type: DType
    value_type: DType
    keys: np.ndarray
    values: np.ndarray
    nan_value: Any
    default: Any


def _one_of(a: Attrs, prefix: str) -> tuple[str, Any]:
    given = [
        (k, a[k])
        for k in (f"{prefix}_int64s", f"{prefix}_floats", f"{prefix}_strings", f"{prefix}_tensor")
        if a.get(k) is not None
    ]
    if len(given) != 1:
        names = ", ".join(k for k, _ in given) or "none"
        raise ValueError(f"exactly one {prefix}_* attribute must be set, got {names}")
    return given[0]


def _as_array(name: str, v: Any) -> np.ndarray:
    if name.endswith("_strings") or (isinstance(v, np.ndarray) and v.dtype.kind in "OSU"):
        raise ValueError(f"string {name.split('_')[0]} ({name}) are not supported: {NO_STRINGS}")
    if name.endswith("_int64s"):
        return np.array(v, dtype=np.int64).reshape(-1)
    if name.endswith("_floats"):
        return np.array(v, dtype=np.float32).reshape(-1)
    arr = np.asarray(v).reshape(-1)
    if DType.from_numpy(arr.dtype) not in _LABEL_TYPES:
        raise ValueError(f"{name} has element type {arr.dtype}, not one LabelEncoder maps")
    return arr


def _label_table(a: Attrs) -> _LabelTable:
    kname, kv = _one_of(a, "keys")
    vname, vv = _one_of(a, "values")
    keys, values = _as_array(kname, kv), _as_array(vname, vv)
    if keys.size != values.size:
        raise ValueError(f"{kname} has {keys.size} entries but {vname} has {values.size}")
    vt = DType.from_numpy(values.dtype)
    if vname == "values_tensor":
        d = a.get("default_tensor")
        if d is None:  # the specification's defaults: -1 for integers, -0.0 for floats
            default = values.dtype.type(-0.0 if vt.is_float else -1)
        else:
            d = np.asarray(d).reshape(-1)
            if d.size != 1 or d.dtype != values.dtype:
                raise ValueError(
                    f"default_tensor must hold one {values.dtype} value, got {d.size} of {d.dtype}"
                )
            default = d[0]
    elif vname == "values_int64s":
        default = np.int64(a["default_int64"])
    else:
        default = np.float32(a["default_float"])
    mapping: dict[Any, Any] = {}
    nan_value = None
    for k, v in zip(keys.tolist(), values.tolist(), strict=True):
        if isinstance(k, float) and math.isnan(k):
            nan_value = v  # any NaN input matches any NaN key
        else:
            mapping[k] = v  # 0.0 and -0.0 are one key; the last one given wins
    order = sorted(mapping)
    return _LabelTable(
        DType.from_numpy(keys.dtype),
        vt,
        np.array(order, dtype=keys.dtype),
        np.array([mapping[k] for k in order], dtype=values.dtype),
        None if nan_value is None else values.dtype.type(nan_value),
        default,
    )


def _label_infer(ctx: InferCtx) -> list[TensorType]:
    table = ctx.check(_label_table, ctx.attrs)
    x = ctx.type(0)
    if x.dtype != table.key_type:
        raise ctx.fail(f"X is {x.dtype} but the keys are {table.key_type}; they must match")
    return [x.with_dtype(table.value_type)]


def _label_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = first(xs)
    t = _label_table(a)
    y = np.full(x.shape, t.default, dtype=t.values.dtype)
    if t.keys.size:
        at = np.minimum(np.searchsorted(t.keys, x), t.keys.size - 1)
        hit = t.keys[at] == x
        y[hit] = t.values[at[hit]]
    if t.nan_value is not None and x.dtype.kind == "f":
        y[np.isnan(x)] = t.nan_value
    return y


def _label_import(n: AdapterNode) -> None:
    """Refuse string maps as unsupported (not as a shape error); others import as they are."""
    for k in ("keys_strings", "values_strings"):
        if n.attrs.get(k) is not None:
            raise UnsupportedOpError(
                f"LabelEncoder node {n.name!r}: string keys or values ({k}) are not supported: "
                f"{NO_STRINGS}",
                hint="only numeric LabelEncoder maps compile",
            )
    return None


def _label_emit(prog: Program, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    assert x is not None
    t = _label_table(node_attrs(node))
    kt, vt = CTYPES[t.key_type], CTYPES[t.value_type]
    name = prog.kernel(
        TEMPLATE,
        "label_encoder",
        ktype=kt,
        vtype=vt,
        count=int(t.keys.size),
        keys=", ".join(c_literal(k, t.key_type, kt) for k in t.keys.tolist()),
        values=", ".join(c_literal(v, t.value_type, vt) for v in t.values.tolist()),
        default=c_literal(t.default, t.value_type, vt),
        nan_value=None if t.nan_value is None else c_literal(t.nan_value, t.value_type, vt),
    )
    prog.launch(name, y.type.numel, [prog.cptr(x), prog.ptr(y), f"(int64_t){y.type.numel}"])


defop(
    f"{DOMAIN}.LabelEncoder",
    FAMILY,
    infer=_label_infer,
    reference=_label_ref,
    attrs={
        "default_float": -0.0,
        "default_int64": -1,
        "default_string": "_Unused",
        "default_tensor": None,
        "keys_floats": None,
        "keys_int64s": None,
        "keys_strings": None,
        "keys_tensor": None,
        "values_floats": None,
        "values_int64s": None,
        "values_strings": None,
        "values_tensor": None,
    },
    flops=elementwise_flops(1),
    onnx_import=_label_import,
    emit=_label_emit,
    dsl_name="label_encoder",
)


# -- TfIdfVectorizer ----------------------------------------------------------------------------

_TFIDF_MODES = ("TF", "IDF", "TFIDF")


@dataclass(frozen=True)
class _Ngrams:
    """The pool's n-grams of the counted lengths: tokens, output coordinate and weight (1
    without weights), sorted by coordinate."""

    grams: tuple[tuple[tuple[int, ...], int, float], ...]
    out_size: int
    mode: str
    max_skip: int
    weighted: bool


def _ngrams(a: Attrs) -> _Ngrams:
    if a.get("pool_strings") is not None:
        raise ValueError(f"string pools (pool_strings) are not supported: {NO_STRINGS}")
    if a.get("pool_int64s") is None:
        raise ValueError("pool_int64s is required")
    for req in ("ngram_counts", "ngram_indexes", "min_gram_length", "max_gram_length"):
        if a.get(req) is None:
            raise ValueError(f"attribute {req} is required")
    pool = ints(a["pool_int64s"])
    counts, indexes = ints(a["ngram_counts"]), ints(a["ngram_indexes"])
    lo, hi, skip = int(a["min_gram_length"]), int(a["max_gram_length"]), int(a["max_skip_count"])
    mode = str(a.get("mode"))
    if mode not in _TFIDF_MODES:
        raise ValueError(f"mode must be one of {', '.join(_TFIDF_MODES)}, got {mode!r}")
    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= min_gram_length <= max_gram_length, got {lo} and {hi}")
    if skip < 0:
        raise ValueError(f"max_skip_count must be >= 0, got {skip}")
    if any(b < p for p, b in zip([0, *counts], [*counts, len(pool)], strict=True)):
        raise ValueError(
            f"ngram_counts {counts} must rise from 0 to at most the pool's {len(pool)} items"
        )
    found: dict[tuple[int, ...], int] = {}  # n-gram -> its ordinal in the pool
    ordinal = 0
    for k, start in enumerate(counts):
        size = k + 1
        end = counts[k + 1] if k + 1 < len(counts) else len(pool)
        if (end - start) % size:
            raise ValueError(
                f"the {size}-grams (pool items {start}..{end - 1}) are {end - start} items, "
                f"not a whole number of {size}-grams"
            )
        for j in range((end - start) // size):
            if lo <= size <= hi:
                gram = tuple(pool[start + j * size : start + (j + 1) * size])
                if gram in found:
                    raise ValueError(f"the n-gram {list(gram)} appears twice in the pool")
                found[gram] = ordinal
            ordinal += 1
    if len(indexes) != ordinal or not indexes:
        raise ValueError(
            f"ngram_indexes has {len(indexes)} entries; the pool holds {ordinal} n-grams"
            + ("" if ordinal else " (it must hold at least one)")
        )
    if min(indexes) < 0:
        raise ValueError(f"ngram_indexes must be >= 0, got {min(indexes)}")
    w = a.get("weights")
    weights = [1.0] * ordinal if w is None else [float(v) for v in w]
    if len(weights) != ordinal:
        raise ValueError(f"weights has {len(weights)} entries, one per n-gram ({ordinal}) needed")
    grams = sorted(
        ((g, indexes[o], weights[o]) for g, o in found.items()), key=lambda e: (e[1], e[0])
    )
    return _Ngrams(tuple(grams), max(indexes) + 1, mode, skip, w is not None)


def _tfidf_infer(ctx: InferCtx) -> list[TensorType]:
    table = ctx.check(_ngrams, ctx.attrs)
    x = ctx.type(0)
    if x.dtype not in (DType.I32, DType.I64):
        raise ctx.fail(f"X must be int32 or int64 (pool_int64s), got {x.dtype}")
    if x.rank not in (1, 2):
        raise ctx.fail(f"X must be [C] or [N, C], got shape {list(x.shape)}")
    lead = x.shape[:1] if x.rank == 2 else ()
    return [TensorType((*lead, table.out_size), DType.F32)]


def _skips(n: int, max_skip: int) -> range:
    """The distances between an n-gram's items: unigrams are counted once, not per skip."""
    return range(1, 2) if n == 1 else range(1, max_skip + 2)


def _tfidf_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    """TF counts each coordinate's matches; TFIDF adds each match's n-gram weight; IDF takes
    the weight of the coordinate's last match in onnxruntime's scan order (skip distance,
    then start, then length), which is the n-gram's own weight when no two n-grams share a
    coordinate."""
    x = first(xs)
    t = _ngrams(a)
    rows = x.reshape(-1, x.shape[-1]) if x.ndim == 2 else x.reshape(1, -1)
    n_rows, c = rows.shape
    longest = max((len(g) for g, _, _ in t.grams), default=1)
    y = np.zeros((n_rows, t.out_size), dtype=np.float32)
    last = np.full((n_rows, t.out_size), -1, dtype=np.int64)
    for gram, coord, weight in t.grams:
        n = len(gram)
        for s in _skips(n, t.max_skip):
            starts = c - (n - 1) * s
            if starts <= 0:
                break
            match = np.ones((n_rows, starts), dtype=bool)
            for k, token in enumerate(gram):
                match &= rows[:, k * s : k * s + starts] == token
            found = match.sum(axis=1)
            if t.mode == "TF":
                y[:, coord] += found.astype(np.float32)
            elif t.mode == "TFIDF":
                y[:, coord] += np.float32(weight) * found.astype(np.float32)
            else:
                final = starts - 1 - np.argmax(match[:, ::-1], axis=1)
                key = np.where(found > 0, (s * c + final) * (longest + 1) + n, -1)
                later = key > last[:, coord]
                last[:, coord] = np.where(later, key, last[:, coord])
                y[:, coord] = np.where(later, np.float32(weight), y[:, coord])
    return y.reshape((t.out_size,) if x.ndim == 1 else (n_rows, t.out_size))


def _tfidf_flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    x = ins[0]
    assert x is not None
    t = _ngrams(a)
    rows = x.shape[0] if x.rank == 2 else 1
    per_row = sum(len(g) * len(_skips(len(g), t.max_skip)) * x.shape[-1] for g, _, _ in t.grams)
    return rows * per_row


def _tfidf_emit(prog: Program, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    assert x is not None
    t = _ngrams(node_attrs(node))
    if y.type.numel == 0:
        return
    if not t.grams or x.type.shape[-1] == 0:
        # Nothing can match: every output is 0.
        prog.zero(prog.ptr_void(y), y.type.nbytes)
        return
    first_gram = [0] * (t.out_size + 1)
    for _, coord, _ in t.grams:
        first_gram[coord + 1] += 1
    for k in range(t.out_size):
        first_gram[k + 1] += first_gram[k]
    lengths = [len(g) for g, _, _ in t.grams]
    starts = [sum(lengths[:k]) for k in range(len(lengths))]
    tokens = [tok for g, _, _ in t.grams for tok in g]
    name = prog.kernel(
        TEMPLATE,
        "tfidf",
        xtype=prog.ctype(x),
        cols=x.type.shape[-1],
        out_size=t.out_size,
        mode=t.mode,
        max_skip=t.max_skip,
        longest=max(lengths),
        num_grams=len(t.grams),
        num_tokens=len(tokens),
        first_gram=_int_table(first_gram),
        lengths=_int_table(lengths),
        starts=_int_table(starts),
        tokens=_int_table(tokens),
        weights=", ".join(c_float(w) for _, _, w in t.grams) if t.weighted else None,
    )
    prog.launch(name, y.type.numel, [prog.cptr(x), prog.ptr(y), f"(int64_t){y.type.numel}"])


defop(
    "TfIdfVectorizer",
    FAMILY,
    infer=_tfidf_infer,
    reference=_tfidf_ref,
    attrs={
        "max_gram_length": None,
        "max_skip_count": 0,
        "min_gram_length": None,
        "mode": None,
        "ngram_counts": None,
        "ngram_indexes": None,
        "pool_int64s": None,
        "pool_strings": None,
        "weights": None,
    },
    flops=_tfidf_flops,
    emit=_tfidf_emit,
    dsl_name="tfidf_vectorizer",
)


# -- TreeEnsemble (ai.onnx.ml opset 5) ---------------------------------------------------------

# nodes_modes: BRANCH_LEQ, LT, GTE, GT, EQ, NEQ, MEMBER.
_MEMBER = 6
_AGGREGATES = ("AVERAGE", "SUM", "MIN", "MAX")


@dataclass(frozen=True)
class _Forest:
    """A TreeEnsemble's trees. A branch target >= 0 is a node, ~leaf (< 0) a leaf; member
    nodes test ``members[member_begin[i]:member_end[i]]``."""

    feature: tuple[int, ...]
    split: tuple[float, ...]
    mode: tuple[int, ...]
    true_next: tuple[int, ...]
    false_next: tuple[int, ...]
    missing_true: tuple[bool, ...]
    member_begin: tuple[int, ...]
    member_end: tuple[int, ...]
    members: tuple[float, ...]
    roots: tuple[int, ...]
    leaf_target: tuple[int, ...]
    leaf_weight: tuple[float, ...]
    n_targets: int
    aggregate: str


def _floats(v: Any) -> list[float]:
    return [float(x) for x in np.asarray(v, dtype=np.float64).reshape(-1)]


def _forest(a: Attrs, features: int) -> _Forest:
    for req in (
        "tree_roots",
        "nodes_featureids",
        "nodes_splits",
        "nodes_modes",
        "nodes_truenodeids",
        "nodes_falsenodeids",
        "nodes_trueleafs",
        "nodes_falseleafs",
        "leaf_targetids",
        "leaf_weights",
    ):
        if a.get(req) is None:
            raise ValueError(f"attribute {req} is required")
    feature = ints(a["nodes_featureids"])
    count = len(feature)
    split = _floats(a["nodes_splits"])
    mode = ints(a["nodes_modes"])
    tids, fids = ints(a["nodes_truenodeids"]), ints(a["nodes_falsenodeids"])
    tleaf, fleaf = ints(a["nodes_trueleafs"]), ints(a["nodes_falseleafs"])
    mvt = a.get("nodes_missing_value_tracks_true")
    missing = [bool(v) for v in ints(mvt)] if mvt is not None else [False] * count
    for name, vals in (
        ("nodes_splits", split),
        ("nodes_modes", mode),
        ("nodes_truenodeids", tids),
        ("nodes_falsenodeids", fids),
        ("nodes_trueleafs", tleaf),
        ("nodes_falseleafs", fleaf),
        ("nodes_missing_value_tracks_true", missing),
    ):
        if len(vals) != count:
            raise ValueError(f"{name} has {len(vals)} entries, nodes_featureids {count}")
    targets, weights = ints(a["leaf_targetids"]), _floats(a["leaf_weights"])
    if len(targets) != len(weights):
        raise ValueError(
            f"leaf_targetids has {len(targets)} entries but leaf_weights {len(weights)}"
        )
    n_targets = a.get("n_targets")
    n_targets = int(n_targets) if n_targets is not None else max(targets, default=-1) + 1
    if n_targets < 1:
        raise ValueError(f"n_targets must be positive, got {n_targets}")
    if targets and not 0 <= min(targets) <= max(targets) < n_targets:
        raise ValueError(f"leaf_targetids must lie in [0, {n_targets}), got {targets}")
    agg = int(a["aggregate_function"])
    if not 0 <= agg < len(_AGGREGATES):
        raise ValueError(f"aggregate_function must be 0..3, got {agg}")
    for i in range(count):
        if not 0 <= mode[i] <= _MEMBER:
            raise ValueError(f"nodes_modes[{i}] is {mode[i]}; modes are 0..6")
        if not 0 <= feature[i] < features:
            raise ValueError(f"node {i} tests feature {feature[i]}; X has {features} features")

    def branch(i: int, ids: list[int], leafs: list[int], side: str) -> int:
        target = ids[i]
        bound = len(targets) if leafs[i] else count
        if not 0 <= target < bound:
            what = "leaf" if leafs[i] else "node"
            raise ValueError(f"node {i}'s {side} branch names {what} {target}, out of range")
        return ~target if leafs[i] else target

    true_next = [branch(i, tids, tleaf, "true") for i in range(count)]
    false_next = [branch(i, fids, fleaf, "false") for i in range(count)]

    # Member sets, NaN-delimited, in the order of the member nodes.
    members: list[float] = []
    begin, end = [0] * count, [0] * count
    sets: list[list[float]] = [[]]
    mv = a.get("membership_values")
    for v in _floats(mv) if mv is not None else []:
        if math.isnan(v):
            sets.append([])
        else:
            sets[-1].append(v)
    if not sets[-1]:
        sets.pop()
    member_nodes = [i for i in range(count) if mode[i] == _MEMBER]
    if len(sets) != len(member_nodes):
        raise ValueError(
            f"membership_values holds {len(sets)} NaN-delimited set(s) for "
            f"{len(member_nodes)} BRANCH_MEMBER node(s)"
        )
    for i, s in zip(member_nodes, sets, strict=True):
        begin[i] = len(members)
        members.extend(s)
        end[i] = len(members)

    roots = ints(a["tree_roots"])
    if not roots:
        raise ValueError("tree_roots is empty")
    for r in roots:
        if not 0 <= r < count:
            raise ValueError(f"tree root {r} is not a node (there are {count})")
    # Every walk must reach a leaf: no branch may lead back to a node on its own path.
    state = [0] * count  # 0 unvisited, 1 on the current path, 2 done
    for r in roots:
        stack = [(r, 0)]
        while stack:
            i, side = stack.pop()
            if side == 0:
                if state[i] == 2:
                    continue
                if state[i] == 1:
                    raise ValueError(f"the trees have a cycle through node {i}")
                state[i] = 1
                stack.append((i, 1))
                for nxt in (true_next[i], false_next[i]):
                    if nxt >= 0:
                        if state[nxt] == 1:
                            raise ValueError(f"the trees have a cycle through node {nxt}")
                        stack.append((nxt, 0))
            else:
                state[i] = 2
    return _Forest(
        tuple(feature),
        tuple(split),
        tuple(mode),
        tuple(true_next),
        tuple(false_next),
        tuple(missing),
        tuple(begin),
        tuple(end),
        tuple(members),
        tuple(roots),
        tuple(targets),
        tuple(weights),
        n_targets,
        _AGGREGATES[agg],
    )


def _tree_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    if x.dtype not in (DType.F32, DType.F64, DType.F16):
        raise ctx.fail(f"X must be float, double or float16, got {x.dtype}")
    if x.rank != 2:
        raise ctx.fail(f"X must be [N, F], got shape {list(x.shape)}")
    post = int(ctx.attr("post_transform"))
    if post != 0:
        # The specification numbers SOFTMAX 1 and LOGISTIC 2; onnxruntime reads 1 as LOGISTIC
        # and 2 as SOFTMAX. Rather than pick one, flowc asks for the explicit op.
        raise ctx.fail(
            f"post_transform {post} is not supported (only 0, NONE); apply Softmax or Sigmoid "
            "to the output instead"
        )
    forest = ctx.check(_forest, ctx.attrs, x.shape[1])
    return [TensorType((x.shape[0], forest.n_targets), x.dtype)]


def _decide(f: _Forest, node: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Each row's branch at its node: True for the true branch."""
    split = np.array(f.split)[node]
    mode = np.array(f.mode)[node]
    tests = [v <= split, v < split, v >= split, v > split, v == split, v != split]
    take = np.zeros(v.shape, dtype=bool)
    for m, test in enumerate(tests):
        take |= (mode == m) & test
    for i in np.unique(node[mode == _MEMBER]):
        rows = node == i
        take[rows] = np.isin(v[rows], f.members[f.member_begin[i] : f.member_end[i]])
    return take | (np.array(f.missing_true)[node] & np.isnan(v))


def _tree_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = first(xs)
    f = _forest(a, x.shape[1])
    rows = np.arange(x.shape[0])
    xv = x.astype(np.float64)
    # Scores in X's type, the trees added in order (as the kernel does); a target no leaf
    # reached stays 0 (onnxruntime's rule, also for MIN and MAX).
    acc = np.zeros((x.shape[0], f.n_targets), dtype=x.dtype)
    hit = np.zeros(acc.shape, dtype=bool)
    true_next, false_next = np.array(f.true_next), np.array(f.false_next)
    features = np.array(f.feature)
    weights = np.array(f.leaf_weight).astype(x.dtype)
    targets = np.array(f.leaf_target)
    for root in f.roots:
        cur = np.full(x.shape[0], root, dtype=np.int64)
        while (cur >= 0).any():
            on = cur >= 0
            node = cur[on]
            take = _decide(f, node, xv[rows[on], features[node]])
            cur[on] = np.where(take, true_next[node], false_next[node])
        leaf = ~cur
        tg, w = targets[leaf], weights[leaf]
        old = acc[rows, tg]
        if f.aggregate in ("SUM", "AVERAGE"):
            new = old + w
        elif f.aggregate == "MIN":
            new = np.where(hit[rows, tg], np.minimum(old, w), w)
        else:
            new = np.where(hit[rows, tg], np.maximum(old, w), w)
        acc[rows, tg] = new
        hit[rows, tg] = True
    if f.aggregate == "AVERAGE":
        acc = acc / x.dtype.type(len(f.roots))
    return acc.astype(x.dtype)


def _tree_flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    x = ins[0]
    assert x is not None
    return x.shape[0] * len(ints(a["tree_roots"])) * 8


def _tree_import(n: AdapterNode) -> list[Value] | None:
    """float16 X runs in float32 (flowc's float16 is storage only)."""
    x = n.inputs[0] if n.inputs else None
    if x is None or x.type.dtype != DType.F16:
        return None
    _validate(n, f"{DOMAIN}.TreeEnsemble")
    wide = n.emit("Cast", [x], {"to": DType.F32.onnx}, suffix="f32")[0]
    (y,) = n.emit(f"{DOMAIN}.TreeEnsemble", [wide], n.attrs, suffix="f32_trees")
    return n.emit("Cast", [y], {"to": DType.F16.onnx}, output_names=_out_name(n))


def _tree_emit(prog: Program, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    assert x is not None
    t = CTYPES.get(x.type.dtype)
    if t not in ("float", "double"):
        raise prog.fail(f"element type {x.type.dtype} has no kernel (float32 and float64 do)")
    f = _forest(node_attrs(node), x.type.shape[1])
    rows = x.type.shape[0]
    if rows == 0:
        return
    name = prog.kernel(
        TEMPLATE,
        "tree_ensemble",
        ctype=t,
        features=x.type.shape[1],
        n_targets=f.n_targets,
        num_nodes=len(f.feature),
        num_trees=len(f.roots),
        num_leaves=len(f.leaf_target),
        num_members=len(f.members),
        aggregate=f.aggregate,
        modes=sorted(set(f.mode)),
        any_missing=any(f.missing_true),
        feature=_int_table(f.feature),
        split=", ".join(c_float(v, "double") for v in f.split),
        mode=_int_table(f.mode),
        true_next=_int_table(f.true_next),
        false_next=_int_table(f.false_next),
        missing=", ".join("true" if m else "false" for m in f.missing_true),
        member_begin=_int_table(f.member_begin),
        member_end=_int_table(f.member_end),
        members=", ".join(c_float(v, "double") for v in f.members),
        roots=_int_table(f.roots),
        leaf_target=_int_table(f.leaf_target),
        leaf_weight=", ".join(c_float(v, t) for v in np.asarray(f.leaf_weight, x.type.dtype.np)),
    )
    prog.launch(name, rows, [prog.cptr(x), prog.ptr(y), f"(int64_t){rows}"])


defop(
    f"{DOMAIN}.TreeEnsemble",
    FAMILY,
    infer=_tree_infer,
    reference=_tree_ref,
    attrs={
        "aggregate_function": 1,
        "leaf_targetids": None,
        "leaf_weights": None,
        "membership_values": None,
        "n_targets": None,
        "nodes_falseleafs": None,
        "nodes_falsenodeids": None,
        "nodes_featureids": None,
        "nodes_hitrates": None,
        "nodes_missing_value_tracks_true": None,
        "nodes_modes": None,
        "nodes_splits": None,
        "nodes_trueleafs": None,
        "nodes_truenodeids": None,
        "post_transform": 0,
        "tree_roots": None,
    },
    flops=_tree_flops,
    onnx_import=_tree_import,
    emit=_tree_emit,
    dsl_name="tree_ensemble",
)
