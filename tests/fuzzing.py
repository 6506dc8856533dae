"""Fuzzing flowc's front ends: mutant generators and a bounded runner, shared by
tests/test_fuzz_onnx.py, tests/test_dsl_fuzz.py and bench/fuzz.py.

A case is ``(generator, seed)``; ``make_case`` turns it into a model file's bytes,
deterministically, so a failure reproduces from its seed alone. Generators:

* ``onnx``: seeded mutations of real models (the shared test models, the example model) and
  of small built models (one op family each), at the protobuf level (dims and ranks past
  64, dtypes, names, attribute types and values, initializer lengths, sparse initializers,
  Constant data, opset versions past an int32, cycles, missing inputs, local functions, op
  types) and at the byte level.
* ``dsl``: mutations of DSL programs, huge shapes in fills and shape ops included, and
  meshes, stage numbers and ranks past flowc's bounds.

``run_cases`` runs each case in a forked child of the calling process (the imports are
paid once, a fork costs milliseconds) under an address-space limit and a wall-clock
timeout. A case must end in acceptance (import, random inputs, the reference interpreter
where the graph is small, compile passes and code generation all succeed: what `flowc eval`
and `flowc compile` do) or a FlowcError with exit code 2; anything else is an internal
error, a crash (the child died on a signal), a hang, or memory (a MemoryError, or the limit
hit).
"""

from __future__ import annotations

import gc
import json
import os
import random
import resource
import select
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from flowc.ir.graph import Graph

REPO = Path(__file__).resolve().parent.parent
SHARED_MODELS = REPO / "tests" / "data" / "models"

OUTCOMES = ("accepted", "rejected", "internal", "crash", "hang", "memory")
GOOD = ("accepted", "rejected")
MEMORY_LIMIT = 4 << 30
CASE_TIMEOUT = 20.0


@dataclass(frozen=True)
class Case:
    """One model file to try: its name (what made it), bytes and suffix; ONNX models also
    carry the --shape values their dynamic inputs need."""

    name: str
    suffix: str
    data: bytes
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


# -- seed models ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seed:
    name: str
    model: onnx.ModelProto
    shapes: dict[str, tuple[int, ...]]


def _real_seed(path: Path) -> Seed:
    shapes: dict[str, tuple[int, ...]] = {}
    io = path.with_name(path.stem + ".io.npz")
    if io.is_file():
        with np.load(io) as z:
            shapes = {k[3:]: tuple(z[k].shape) for k in z.files if k.startswith("in:")}
    return Seed(path.stem, onnx.load(str(path)), shapes)


def _f(name: str, shape: list[int], dtype: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _w(name: str, shape: list[int], seed: int = 0) -> TensorProto:
    a = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return onnx.numpy_helper.from_array(a, name)


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    inits: list[TensorProto] | None = None,
    opset: int = 17,
    **kw: object,
) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, inits or [])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], **kw)  # type: ignore[arg-type]


def _built_seeds() -> list[Seed]:
    """Small models, one op family each: mutants of them are cheap and reach the ops'
    attribute handling (conv, reduce, norm, shape ops, Constant, control flow, functions)."""
    mk = helper.make_node
    x4 = _f("x", [1, 3, 8, 8])
    seeds = [
        _model(
            [
                mk("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
                mk("MaxPool", ["c"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
                mk("AveragePool", ["p"], ["y"], kernel_shape=[2, 2], auto_pad="SAME_UPPER"),
            ],
            [x4],
            [_f("y", [1, 4, 4, 4])],
            [_w("w", [4, 3, 3, 3]), _w("b", [4], 1)],
        ),
        _model(
            [
                mk("ReduceMean", ["x"], ["m"], axes=[1], keepdims=1),
                mk("ReduceSum", ["x", "ax"], ["s"], keepdims=0),
                mk("ArgMax", ["x"], ["a"], axis=2, keepdims=0),
                mk("Softmax", ["m"], ["y"], axis=-1),
            ],
            [x4],
            [_f("y", [1, 1, 8, 8]), _f("s", [1, 8, 8]), _f("a", [1, 3, 8], TensorProto.INT64)],
            [onnx.numpy_helper.from_array(np.array([1], np.int64), "ax")],
        ),
        _model(
            [
                mk("LayerNormalization", ["x", "g", "b"], ["l"], axis=-1, epsilon=1e-5),
                mk("InstanceNormalization", ["x", "s3", "b3"], ["i"], epsilon=1e-5),
                mk("BatchNormalization", ["i", "s3", "b3", "b3", "s3"], ["n"]),
                mk("Add", ["l", "n"], ["y"]),
            ],
            [x4],
            [_f("y", [1, 3, 8, 8])],
            [_w("g", [8]), _w("b", [8], 1), _w("s3", [3], 2), _w("b3", [3], 3)],
        ),
        _model(
            [
                mk("Shape", ["x"], ["sh"]),
                mk("Gather", ["sh", "i0"], ["d0"], axis=0),
                mk("Reshape", ["x", "rs"], ["r"]),
                mk("Transpose", ["r"], ["t"], perm=[1, 0]),
                mk("Slice", ["t", "st", "en", "axs"], ["sl"]),
                mk("Unsqueeze", ["sl", "axs"], ["u"]),
                mk("Expand", ["u", "ex"], ["e"]),
                mk("Concat", ["e", "e"], ["c"], axis=0),
                mk("Tile", ["c", "reps"], ["ti"]),
                mk("Split", ["ti"], ["y", "y2"], axis=0, num_outputs=2),
                mk("Cast", ["d0"], ["dc"], to=TensorProto.FLOAT),
            ],
            [x4],
            [_f("y", [2, 64, 3]), _f("y2", [2, 64, 3]), _f("dc", [])],
            [
                onnx.numpy_helper.from_array(np.array(0, np.int64), "i0"),
                onnx.numpy_helper.from_array(np.array([3, 64], np.int64), "rs"),
                onnx.numpy_helper.from_array(np.array([0], np.int64), "st"),
                onnx.numpy_helper.from_array(np.array([64], np.int64), "en"),
                onnx.numpy_helper.from_array(np.array([0], np.int64), "axs"),
                onnx.numpy_helper.from_array(np.array([2, 64, 3], np.int64), "ex"),
                onnx.numpy_helper.from_array(np.array([1, 1, 1], np.int64), "reps"),
            ],
            opset=18,
        ),
        _model(
            [
                mk("Constant", [], ["k"], value=_w("kv", [2, 3])),
                mk("Constant", [], ["f"], value_floats=[1.0, 2.0, 3.0]),
                mk("Constant", [], ["n"], value_int=4),
                mk("Add", ["k", "f"], ["a"]),
                mk("MatMul", ["a", "m"], ["mm"]),
                mk("Gemm", ["mm", "m2", "f"], ["y"], transB=1, alpha=0.5),
                mk("Where", ["c", "y", "y"], ["z"]),
                mk("CastLike", ["n", "y"], ["nc"]),
            ],
            [_f("c", [2, 3], TensorProto.BOOL)],
            [_f("z", [2, 3]), _f("nc", [])],
            [_w("m", [3, 4]), _w("m2", [3, 4], 1)],
        ),
        _if_loop_seed(),
        _function_seed(),
        _sparse_seed(),
        _model(
            [
                mk("Gather", ["emb", "ids"], ["e"], axis=0),
                mk("Attention", ["e", "e", "e"], ["y"], q_num_heads=2, kv_num_heads=2),
            ],
            [_f("ids", [1, 4], TensorProto.INT64)],
            [_f("y", [1, 4, 8])],
            [_w("emb", [10, 8])],
            opset=23,
        ),
    ]
    return [Seed(f"built{k}", m, {}) for k, m in enumerate(seeds)]


def _if_loop_seed() -> onnx.ModelProto:
    mk = helper.make_node
    then = helper.make_graph([mk("Relu", ["x"], ["t"])], "then", [], [_f("t", [4])])
    other = helper.make_graph([mk("Neg", ["x"], ["o"])], "else", [], [_f("o", [4])])
    body = helper.make_graph(
        [
            mk("Add", ["acc", "x"], ["acc2"]),
            mk("Identity", ["cond"], ["cond2"]),
        ],
        "body",
        [_f("i", [], TensorProto.INT64), _f("cond", [], TensorProto.BOOL), _f("acc", [4])],
        [_f("cond2", [], TensorProto.BOOL), _f("acc2", [4])],
    )
    return _model(
        [
            mk("If", ["c"], ["y"], then_branch=then, else_branch=other),
            mk("Loop", ["trip", "", "y"], ["z"], body=body),
        ],
        [_f("x", [4]), _f("c", [], TensorProto.BOOL)],
        [_f("z", [4])],
        [onnx.numpy_helper.from_array(np.array(3, np.int64), "trip")],
    )


def _function_seed() -> onnx.ModelProto:
    mk = helper.make_node
    fn = helper.make_function(
        "local",
        "Scale",
        ["a", "b"],
        ["c"],
        [mk("Mul", ["a", "b"], ["t"]), mk("Relu", ["t"], ["c"])],
        [helper.make_opsetid("", 17)],
    )
    m = _model(
        [
            mk("Scale", ["x", "x"], ["s"], domain="local"),
            mk("Celu", ["s"], ["y"], alpha=0.5),
        ],
        [_f("x", [2, 3])],
        [_f("y", [2, 3])],
    )
    m.opset_import.append(helper.make_opsetid("local", 1))
    m.functions.append(fn)
    return m


def _sparse_seed() -> onnx.ModelProto:
    values = onnx.numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "sp")
    indices = onnx.numpy_helper.from_array(np.array([1, 4], np.int64), "sp_i")
    sp = helper.make_sparse_tensor(values, indices, [2, 3])
    m = _model([helper.make_node("Add", ["x", "sp"], ["y"])], [_f("x", [2, 3])], [_f("y", [2, 3])])
    m.graph.sparse_initializer.append(sp)
    return m


@cache
def onnx_seeds() -> list[Seed]:
    """The real test models (where this checkout has them) and the built ones."""
    paths = sorted(SHARED_MODELS.glob("*.onnx")) + sorted((REPO / "examples/models").glob("*.onnx"))
    return [_real_seed(p) for p in paths] + _built_seeds()


# -- ONNX mutations ---------------------------------------------------------------------------

DIMS = [-1, 0, -7, 1, 3, 2**31, 2**40, 2**62, 2**63 - 1]
RANKS = [9, 33, 64, 65, 100]
# Opset versions: ONNX's, and past them up to the field's int64 (the schema lookup's int32)
OPSETS = [1, 5, 7, 9, 11, 13, 15, 17, 18, 19, 21, 22, 23, 24, 30, 0, -1]
OPSETS += [2**31 - 1, 2**31, 2**40, 2**63 - 1]
DTYPES = [0, 1, 2, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16, 17, 19, 21, 22, 23, 25, 26, 40, 99, -3]
INTS = [0, 1, -1, 2, 3, -5, 7, 64, 2**31, -(2**31), 2**62, 2**63 - 1, -(2**63)]
FLOATS = [0.0, -1.0, 1e-5, 1e38, float("inf"), float("nan"), -0.5]
STRINGS = ["", "NOTSET", "SAME_UPPER", "VALID", "bogus", "linear", "nearest", "é\x00"]
OP_TYPES = [
    "Conv",
    "ConvTranspose",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ArgMax",
    "Softmax",
    "LogSoftmax",
    "LayerNormalization",
    "BatchNormalization",
    "InstanceNormalization",
    "GroupNormalization",
    "Reshape",
    "Transpose",
    "Slice",
    "Gather",
    "GatherElements",
    "GatherND",
    "ScatterND",
    "Concat",
    "Split",
    "Squeeze",
    "Unsqueeze",
    "Expand",
    "Tile",
    "Pad",
    "Resize",
    "Cast",
    "MatMul",
    "Gemm",
    "Einsum",
    "TopK",
    "CumSum",
    "OneHot",
    "Range",
    "ConstantOfShape",
    "Shape",
    "Size",
    "Flatten",
    "DepthToSpace",
    "SpaceToDepth",
    "Where",
    "Clip",
    "Add",
    "Div",
    "Pow",
    "Relu",
    "Erf",
    "Identity",
    "Dropout",
    "Trilu",
    "NonZero",
    "Compress",
    "ReverseSequence",
    "Unique",
    "LRN",
    "Upsample",
    "Constant",
    "If",
    "Loop",
    "Scan",
    "QuantizeLinear",
    "DequantizeLinear",
    "LSTM",
    "GRU",
    "RNN",
    "Col2Im",
    "GridSample",
    "RoiAlign",
    "NonMaxSuppression",
    "STFT",
    "DFT",
    "Attention",
    "RotaryEmbedding",
]
ATTR_TYPES = [
    onnx.AttributeProto.FLOAT,
    onnx.AttributeProto.INT,
    onnx.AttributeProto.STRING,
    onnx.AttributeProto.TENSOR,
    onnx.AttributeProto.GRAPH,
    onnx.AttributeProto.FLOATS,
    onnx.AttributeProto.INTS,
    onnx.AttributeProto.STRINGS,
    onnx.AttributeProto.SPARSE_TENSOR,
    onnx.AttributeProto.TYPE_PROTO,
    onnx.AttributeProto.UNDEFINED,
]


def _graphs(g: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """A graph and every subgraph in its nodes' attributes."""
    yield g
    for n in g.node:
        for a in n.attribute:
            if a.HasField("g"):
                yield from _graphs(a.g)
            for sg in a.graphs:
                yield from _graphs(sg)


def _pick_graph(rng: random.Random, m: onnx.ModelProto) -> onnx.GraphProto:
    gs = list(_graphs(m.graph))
    return gs[0] if rng.random() < 0.7 else rng.choice(gs)


def _value_infos(g: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    return [*g.input, *g.output, *g.value_info]


def _all_names(g: onnx.GraphProto) -> list[str]:
    names = [v.name for v in g.input] + [t.name for t in g.initializer]
    return names + [o for n in g.node for o in n.output]


def mut_dim(rng: random.Random, m: onnx.ModelProto) -> str:
    vis = [v for v in _value_infos(_pick_graph(rng, m)) if v.type.tensor_type.shape.dim]
    if not vis:
        return "dim: none"
    v = rng.choice(vis)
    dims = v.type.tensor_type.shape.dim
    d = rng.choice(dims)
    r = rng.random()
    if r < 0.65:
        d.dim_value = rng.choice(DIMS)
    elif r < 0.75:
        d.dim_param = rng.choice(["", "batch", "seq", "zz"])
    elif r < 0.85:
        dims.add().dim_value = rng.choice(DIMS)
    elif r < 0.92:
        # ranks past ONNX's usual ones, up to and past NumPy's limit of 64
        for _ in range(rng.choice(RANKS) - len(dims)):
            dims.add().dim_value = 1
        return f"rank of {v.name} -> {len(dims)}"
    else:
        del dims[:]
    return f"dim of {v.name}"


def mut_dtype(rng: random.Random, m: onnx.ModelProto) -> str:
    g = _pick_graph(rng, m)
    code = rng.choice(DTYPES)
    r = rng.random()
    if r < 0.4 and (g.input or g.output):
        v = rng.choice([*g.input, *g.output])
        v.type.tensor_type.elem_type = code
        return f"dtype {code} of value {v.name}"
    if r < 0.7 and g.initializer:
        t = rng.choice(g.initializer)
        t.data_type = code
        return f"dtype {code} of initializer {t.name}"
    casts = [a for n in g.node for a in n.attribute if a.name in ("to", "dtype", "output_dtype")]
    if casts:
        a = rng.choice(casts)
        a.i = code
        return f"dtype attribute {code}"
    return "dtype: none"


def mut_name(rng: random.Random, m: onnx.ModelProto) -> str:
    g = _pick_graph(rng, m)
    names = _all_names(g)
    new = rng.choice(["", " ", "x", "y", "é", "a\x00b", "\u2603", *names[:20]])
    r = rng.random()
    if r < 0.3 and g.node:
        n = rng.choice(g.node)
        if n.input:
            k = rng.randrange(len(n.input))
            n.input[k] = new
            return f"input {k} of node {n.name} renamed {new!r}"
    if r < 0.5 and g.node:
        n = rng.choice(g.node)
        if n.output:
            k = rng.randrange(len(n.output))
            n.output[k] = new
            return f"output {k} of node {n.name} renamed {new!r}"
    if r < 0.7 and g.initializer:
        t = rng.choice(g.initializer)
        t.name = new
        return f"initializer renamed {new!r}"
    if r < 0.85 and g.output:
        v = rng.choice(g.output)
        v.name = new
        return f"output renamed {new!r}"
    if g.input:
        v = rng.choice(g.input)
        v.name = new
        return f"input renamed {new!r}"
    return "name: none"


def _set_attr_value(rng: random.Random, a: onnx.AttributeProto, t: int) -> None:
    name = a.name
    a.Clear()
    a.name = name
    a.type = t  # type: ignore[assignment]
    A = onnx.AttributeProto
    if t == A.FLOAT:
        a.f = rng.choice(FLOATS)
    elif t == A.INT:
        a.i = rng.choice(INTS)
    elif t == A.STRING:
        a.s = rng.choice(STRINGS).encode()
    elif t == A.TENSOR:
        a.t.CopyFrom(_random_tensor(rng, name))
    elif t == A.GRAPH:
        a.g.CopyFrom(helper.make_graph([], "empty", [], []))
    elif t == A.FLOATS:
        a.floats.extend(rng.choice(FLOATS) for _ in range(rng.randrange(5)))
    elif t == A.INTS:
        a.ints.extend(rng.choice(INTS) for _ in range(rng.randrange(6)))
    elif t == A.STRINGS:
        a.strings.extend(rng.choice(STRINGS).encode() for _ in range(rng.randrange(3)))
    elif t == A.SPARSE_TENSOR:
        a.sparse_tensor.CopyFrom(_random_sparse(rng, name))
    elif t == A.TYPE_PROTO:
        a.tp.CopyFrom(helper.make_tensor_type_proto(TensorProto.FLOAT, [2]))


def mut_attr(rng: random.Random, m: onnx.ModelProto) -> str:
    g = _pick_graph(rng, m)
    if not g.node:
        return "attr: none"
    n = rng.choice(g.node)
    r = rng.random()
    if n.attribute and r < 0.45:
        a = rng.choice(n.attribute)
        # usually the same type with another value, else another type
        t = a.type if rng.random() < 0.5 else rng.choice(ATTR_TYPES)
        _set_attr_value(rng, a, t)
        return f"attribute {a.name} of {n.name} ({n.op_type}) set, type {t}"
    if n.attribute and r < 0.6:
        a = rng.choice(n.attribute)
        n.attribute.remove(a)
        return f"attribute {a.name} of {n.name} removed"
    if n.attribute and r < 0.7:
        n.attribute.append(rng.choice(n.attribute))
        return f"attribute of {n.name} duplicated"
    names = [
        "axis",
        "axes",
        "keepdims",
        "perm",
        "kernel_shape",
        "pads",
        "strides",
        "dilations",
        "group",
        "epsilon",
        "to",
        "mode",
        "auto_pad",
        "value",
        "num_outputs",
        "split",
        "transA",
        "alpha",
        "bogus",
        "ceil_mode",
        "storage_order",
        "noop_with_empty_axes",
    ]
    a = n.attribute.add()
    a.name = rng.choice(names)
    _set_attr_value(rng, a, rng.choice(ATTR_TYPES))
    return f"attribute {a.name} added to {n.name} ({n.op_type})"


def _random_tensor(rng: random.Random, name: str) -> TensorProto:
    t = TensorProto()
    t.name = name
    shape = [rng.choice([0, 1, 2, 3, 5]) for _ in range(rng.randrange(3))]
    t.dims.extend(shape)
    t.data_type = rng.choice([1, 1, 7, 8, 9, 10, 16, 2, 3, 0, 99])
    n = int(np.prod(shape)) + rng.choice([0, 0, -1, 1, 3])
    r = rng.random()
    if r < 0.4:
        t.raw_data = bytes(rng.randrange(256) for _ in range(max(0, n) * rng.choice([1, 2, 4, 8])))
    elif r < 0.6:
        t.float_data.extend(float(k) for k in range(max(0, n)))
    elif r < 0.8:
        t.int64_data.extend(range(max(0, n)))
    elif r < 0.9:
        t.string_data.extend(b"s" for _ in range(max(0, n)))
    else:
        t.int32_data.extend(range(max(0, n)))
    return t


def _random_sparse(rng: random.Random, name: str) -> onnx.SparseTensorProto:
    nv = rng.randrange(4)
    values = onnx.numpy_helper.from_array(np.arange(nv, dtype=np.float32), name)
    shape = [rng.choice([0, 2, 3, 2**40]) for _ in range(rng.choice([1, 2, 2]))]
    if rng.random() < 0.5:
        idx = np.array([rng.choice([0, 1, 5, -1, 2**40]) for _ in range(nv)], np.int64)
    else:
        idx = np.array(
            [[rng.choice([0, 1, 9, -2]) for _ in shape] for _ in range(nv)], np.int64
        ).reshape(nv, len(shape))
    if rng.random() < 0.2:
        idx = idx[:-1] if len(idx) else np.zeros(3, np.int64)
    sp = onnx.SparseTensorProto()
    sp.values.CopyFrom(values)
    sp.indices.CopyFrom(onnx.numpy_helper.from_array(idx, name + "_i"))
    sp.dims.extend(shape)
    if rng.random() < 0.1:
        sp.values.data_type = 8
    return sp


def mut_initializer(rng: random.Random, m: onnx.ModelProto) -> str:
    g = _pick_graph(rng, m)
    r = rng.random()
    if g.initializer and r < 0.5:
        t = rng.choice(g.initializer)
        k = rng.random()
        if k < 0.3 and t.raw_data:
            t.raw_data = t.raw_data[: rng.randrange(len(t.raw_data))]
        elif k < 0.45:
            t.raw_data = t.raw_data + b"\x01" * rng.choice([1, 3, 8])
        elif k < 0.65 and t.dims:
            t.dims[rng.randrange(len(t.dims))] = rng.choice(DIMS)
        elif k < 0.75:
            t.dims.append(rng.choice([2, 0, 2**33]))
        elif k < 0.85:
            t.ClearField("raw_data")
            t.float_data.extend([1.0] * rng.choice([0, 1, 7]))
        else:
            t.data_location = TensorProto.EXTERNAL
            del t.external_data[:]
            e = t.external_data.add()
            e.key, e.value = "location", rng.choice(["missing.bin", "../x", "/dev/zero", ""])
            if rng.random() < 0.5:
                e = t.external_data.add()
                e.key, e.value = "length", rng.choice(["-1", "100", "x", str(2**40)])
        return f"initializer {t.name} data changed"
    used = [i for n in g.node for i in n.input if i]
    name = rng.choice(used) if used and rng.random() < 0.7 else "extra"
    if r < 0.75:
        t = _random_tensor(rng, name)
        g.initializer.append(t)
        return f"initializer {name} (dtype {t.data_type}) added"
    sp = _random_sparse(rng, name)
    g.sparse_initializer.append(sp)
    return f"sparse initializer {name} added"


def mut_constant(rng: random.Random, m: onnx.ModelProto) -> str:
    g = _pick_graph(rng, m)
    used = [i for n in g.node for i in n.input if i]
    out = rng.choice(used) if used and rng.random() < 0.8 else "cst"
    n = helper.make_node("Constant", [], [out], name=f"fuzz_const_{out}")
    for _ in range(rng.choice([1, 1, 1, 2, 0])):
        a = n.attribute.add()
        a.name = rng.choice(
            [
                "value",
                "value_float",
                "value_floats",
                "value_int",
                "value_ints",
                "value_string",
                "value_strings",
                "sparse_value",
                "bogus",
            ]
        )
        _set_attr_value(rng, a, rng.choice(ATTR_TYPES))
    # a redefinition of an existing value goes first, so the original one loses
    for k, node in enumerate(g.node):
        if out in node.output:
            g.node.remove(node)
            g.node.insert(k, n)
            break
    else:
        g.node.insert(0, n)
    return f"Constant {out} with {[a.name for a in n.attribute]}"


def mut_opset(rng: random.Random, m: onnx.ModelProto) -> str:
    r = rng.random()
    if r < 0.6 and m.opset_import:
        o = rng.choice(m.opset_import)
        o.version = rng.choice(OPSETS)
        return f"opset {o.domain!r} -> {o.version}"
    if r < 0.8:
        del m.opset_import[:]
        return "no opset imports"
    o = m.opset_import.add()
    o.domain = rng.choice(["", "ai.onnx", "com.microsoft", "ai.onnx.ml", "weird"])
    o.version = rng.choice([1, 17, 99, 2**31, 2**63 - 1])
    return f"extra opset {o.domain!r}"


def mut_graph(rng: random.Random, m: onnx.ModelProto) -> str:
    """Cycles, missing inputs, dropped nodes, inputs and initializers."""
    g = _pick_graph(rng, m)
    if not g.node:
        return "graph: none"
    r = rng.random()
    k = rng.randrange(len(g.node))
    n = g.node[k]
    if r < 0.25 and n.input:
        # read a value a later node (or this one) computes: a cycle
        later = [o for x in g.node[k:] for o in x.output if o]
        if later:
            n.input[rng.randrange(len(n.input))] = rng.choice(later)
        return f"cycle at node {n.name}"
    if r < 0.45 and n.input:
        j = rng.randrange(len(n.input))
        if rng.random() < 0.5:
            n.input[j] = ""
        else:
            del n.input[j:]
        return f"input {j} of node {n.name} removed"
    if r < 0.55:
        n.input.append(rng.choice([*_all_names(g), "", "nowhere"]))
        return f"input added to node {n.name}"
    if r < 0.65:
        n.output.append(rng.choice(["extra_out", "", *(_all_names(g)[:5])]))
        return f"output added to node {n.name}"
    if r < 0.75:
        del g.node[k]
        return f"node {n.name} removed"
    if r < 0.82 and g.input:
        del g.input[rng.randrange(len(g.input))]
        return "graph input removed"
    if r < 0.88 and g.initializer:
        del g.initializer[rng.randrange(len(g.initializer))]
        return "initializer removed"
    if r < 0.94:
        g.output.append(rng.choice([*g.output, *g.input] or [_f("zz", [1])]))
        return "graph output duplicated"
    v = g.output.add()
    v.name = rng.choice(_all_names(g))
    v.type.tensor_type.elem_type = rng.choice([8, 1, 7, 0])
    return f"graph output {v.name} added"


def mut_op_type(rng: random.Random, m: onnx.ModelProto) -> str:
    g = _pick_graph(rng, m)
    if not g.node:
        return "op: none"
    n = rng.choice(g.node)
    old = n.op_type
    n.op_type = rng.choice(OP_TYPES)
    if rng.random() < 0.1:
        n.domain = rng.choice(["ai.onnx", "com.microsoft", "local", "ai.onnx.preview.training"])
    return f"node {n.name} {old} -> {n.op_type}"


def mut_function(rng: random.Random, m: onnx.ModelProto) -> str:
    """A local function with a broken body (or a broken copy of an existing one)."""
    mk = helper.make_node
    if m.functions and rng.random() < 0.5:
        fn = rng.choice(m.functions)
    else:
        fn = helper.make_function(
            "local", "F", ["a"], ["b"], [mk("Relu", ["a"], ["b"])], [helper.make_opsetid("", 17)]
        )
        m.functions.append(fn)
        if not any(o.domain == "local" for o in m.opset_import):
            m.opset_import.append(helper.make_opsetid("local", 1))
        used = [i for n in m.graph.node for i in n.input if i]
        if used:
            src = rng.choice(used)
            m.graph.node.insert(0, mk("F", [src], [src + "_f"], domain="local"))
            for n in m.graph.node[1:]:
                n.input[:] = [src + "_f" if i == src else i for i in n.input]
    r = rng.random()
    if r < 0.25 and fn.node:
        fn.node[0].input[:] = ["undefined_inside"]
    elif r < 0.4:
        del fn.output[:]
        fn.output.append("never")
    elif r < 0.55:
        fn.node.append(mk(fn.name, list(fn.input), ["rec"], domain=fn.domain))  # recursion
    elif r < 0.7 and fn.node:
        fn.node[0].op_type = rng.choice(["NoSuchOp", *OP_TYPES[:20]])
    elif r < 0.8:
        del fn.input[:]
    elif r < 0.9:
        a = fn.node[0].attribute.add() if fn.node else onnx.AttributeProto()
        a.name = "alpha"
        a.ref_attr_name = "missing_attr"
        a.type = onnx.AttributeProto.FLOAT
    else:
        del fn.opset_import[:]
    return f"function {fn.domain}.{fn.name} broken"


def mut_value_info(rng: random.Random, m: onnx.ModelProto) -> str:
    g = _pick_graph(rng, m)
    vs = list(_value_infos(g))
    if not vs:
        return "value_info: none"
    v = rng.choice(vs)
    r = rng.random()
    if r < 0.3:
        v.type.Clear()
        v.type.sequence_type.elem_type.tensor_type.elem_type = 1
    elif r < 0.5:
        v.type.Clear()
    elif r < 0.7:
        v.type.tensor_type.ClearField("shape")
    else:
        v.type.tensor_type.elem_type = 8  # string
    return f"type of {v.name} changed"


MUTATORS: list[Callable[[random.Random, onnx.ModelProto], str]] = [
    mut_dim, mut_dim, mut_dtype, mut_dtype, mut_name, mut_attr, mut_attr, mut_attr,
    mut_initializer, mut_initializer, mut_constant, mut_opset, mut_graph, mut_graph,
    mut_op_type, mut_op_type, mut_function, mut_value_info,
]  # fmt: skip


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """Byte flips, inserts, deletes and truncation; ONNX serializes the graph's nodes before
    its initializers, so positions favour the head of the file, where the structure is."""
    b = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 4, 8])):
        if not b:
            break
        r = rng.random()
        pos = rng.randrange(min(len(b), 4096)) if r < 0.6 else rng.randrange(len(b))
        k = rng.random()
        if k < 0.5:
            b[pos] = rng.randrange(256)
        elif k < 0.65:
            b[pos : pos + 1] = b""
        elif k < 0.8:
            b[pos:pos] = bytes([rng.randrange(256)])
        elif k < 0.9:
            b[pos : pos + 8] = struct.pack("<q", rng.choice(INTS))[: len(b[pos : pos + 8])]
        else:
            del b[pos:]
    return bytes(b)


def onnx_case(seed: int) -> Case:
    rng = random.Random(seed)
    seeds = onnx_seeds()
    # the built models half the time: their mutants are cheap and reach the op families
    built = [x for x in seeds if x.name.startswith("built")]
    s = rng.choice(built if rng.random() < 0.5 or len(built) == len(seeds) else seeds)
    m = onnx.ModelProto()
    m.CopyFrom(s.model)
    what = []
    if rng.random() < 0.85:
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            mut = rng.choice(MUTATORS)
            what.append(mut(rng, m))
        data = m.SerializeToString()
    else:
        data = mutate_bytes(rng, m.SerializeToString())
        what.append("bytes")
    shapes = dict(s.shapes)
    if rng.random() < 0.05 and shapes:
        k = rng.choice(sorted(shapes))
        shapes[k] = tuple(rng.choice([1, 2, 2**20, 2**33]) for _ in shapes[k])
    return Case(f"onnx-{seed} {s.name}: " + "; ".join(what), ".onnx", data, shapes)


# -- DSL mutations ----------------------------------------------------------------------------

DSL_SEEDS = [
    "graph g(x: f32[{a}]) -> (y: f32[{a}]) {{\n    param w: f32[{a}] = fill({v})\n"
    "    y = x + w\n    return y\n}}\n",
    "graph g() -> (y: f32[{a}, {b}]) {{\n    param w: f32[{a}, {b}] = {init}\n    y = relu(w)\n"
    "    return y\n}}\n",
    "graph g(x: f32[2, 3]) -> (y: f32[2, 3]) {{\n    const c: f32[{a}] = fill({v})\n"
    "    s = reduce_sum(c, [0], keepdims=0)\n    y = x * s\n    return y\n}}\n",
    "graph g(x: f32[{a}, 4]) -> (y: f32[{a}, {b}]) {{\n    param w: f32[4, {b}] = {init}\n"
    "    y = x @ w\n    return y\n}}\n",
    "graph g(x: f32[2]) -> (y: f32[{a}, {b}]) {{\n    y = expand(x, [{a}, {b}])\n"
    "    return y\n}}\n",
    "graph g(x: f32[2]) -> (y: f32[{a}]) {{\n    param w: f32[{a}] = {init}\n"
    "    t = tile(w, [{b}])\n    y = reshape(t, [{a}])\n    return y\n}}\n",
    # meshes, stages and ranks past what flowc holds
    "mesh gpus[{mesh}]\ngraph g(x: f32[{a}, 4] @ S(0)) -> (y: f32[{a}, 4]) {{\n"
    "    y = relu(x)\n    return y\n}}\n",
    "graph g(x: f32[{a}, 4]) -> (y: f32[{a}, 4]) {{\n    stage {stage} {{\n"
    "        h = relu(x)\n    }}\n    y = h * 2.0\n    return y\n}}\n",
    "graph g(x: f32[{ones}]) -> (y: f32[{ones}]) {{\n    t = unsqueeze(x, [0])\n"
    "    y = squeeze(t, [0])\n    return y\n}}\n",
]
DSL_MESHES = ["2", "4", "65536", "65537", "2147483648", "2, 2", "2, 2, 2, 2", "1" * 40]
DSL_RANKS = [1, 8, 63, 64, 65, 100]
DSL_DIMS = [1, 2, 3, 7, 2**16, 2**24, 2**31, 2**31 + 1, 2**33, 2**40, 2**63 - 1, 0]
DSL_INITS = ["zeros", "ones", "fill(2)", "normal(0.0, 1.0)", "uniform(0.5, 1.5)", "fill(nan)"]


@cache
def dsl_programs() -> list[str]:
    progs = [p.read_text() for p in sorted((REPO / "examples").glob("*.flow"))]
    return progs


TOKEN_WORDS = [
    "2147483648", "4294967296", "0", "-1", "1e309", "nan", "[", "]", "(", ")", ",", "=", "_",
    "f32", "i64", "f16", "bool", "fill(2)", "zeros", "param", "const", "@", "S(0)", "B",
    "reshape", "expand", "tile", "axis=", "[2147483648, 2147483648]", "[0]", "\n",
]  # fmt: skip


def dsl_case(seed: int) -> Case:
    rng = random.Random(seed)
    r = rng.random()
    if r < 0.5:
        text = rng.choice(DSL_SEEDS).format(
            a=rng.choice(DSL_DIMS),
            b=rng.choice(DSL_DIMS),
            v=rng.choice(["2", "0.5", "-1", "nan", "1e38"]),
            init=rng.choice(DSL_INITS),
            mesh=rng.choice(DSL_MESHES),
            stage=rng.choice([0, 1, 65535, 65536, 2**31]),
            ones=", ".join(["1"] * rng.choice(DSL_RANKS)),
        )
        what = "template"
    else:
        text = rng.choice(dsl_programs())
        what = "example"
    # then token edits: numbers into huge dims, words swapped in
    toks = text.split(" ")
    for _ in range(rng.choice([0, 1, 2, 3]) if r < 0.5 else rng.choice([1, 2, 3, 5])):
        i = rng.randrange(len(toks))
        k = rng.random()
        if k < 0.4:
            toks[i] = "".join(str(rng.choice(DSL_DIMS)) if c.isdigit() else c for c in toks[i])
        elif k < 0.7:
            toks[i] = rng.choice(TOKEN_WORDS)
        elif k < 0.85:
            del toks[i]
        else:
            toks.insert(i, rng.choice(TOKEN_WORDS))
        what += f" edit{i}"
    return Case(f"dsl-{seed} {what}", ".flow", " ".join(toks).encode())


GENERATORS: dict[str, Callable[[int], Case]] = {"onnx": onnx_case, "dsl": dsl_case}


def make_case(gen: str, seed: int) -> Case:
    return GENERATORS[gen](seed)


# -- checking one case ------------------------------------------------------------------------


# The largest graph the check also evaluates, in FLOPs (the ops' cost model) and in the
# bytes its nodes compute: the mutants of the small models, not the bigger real ones nor a
# fill of gigabytes (milliseconds each, not seconds).
EVAL_MAX_FLOPS = 50_000_000
EVAL_MAX_BYTES = 64 << 20


def check_file(path: Path, shapes: dict[str, tuple[int, ...]]) -> tuple[str, str]:
    """(outcome, message) of one model file: imported, given random inputs, evaluated by
    the reference interpreter (`flowc eval`, where small), compiled and code generated, or
    a FlowcError of exit code 2, or else an internal error."""
    from flowc.compiler import generate_program
    from flowc.errors import FlowcError
    from flowc.frontend import ImportOptions, load_graph
    from flowc.interpreter import MAX_RANDOM_INPUT_BYTES, evaluate, random_inputs
    from flowc.passes.manager import COMPILE_PIPELINE, DEFAULT_PIPELINE, PassManager

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            g = load_graph(path, ImportOptions(shapes=shapes))
            # Inputs past the bound must be refused before any is made; below it, making
            # them is checked only where that is quick.
            total = sum(v.type.nbytes for v in g.inputs)
            feeds = None
            if total > MAX_RANDOM_INPUT_BYTES or total <= 16 << 20:
                feeds = random_inputs(g)
            # What `flowc eval` runs, then the rest of what `flowc compile` runs.
            g = PassManager(DEFAULT_PIPELINE).run(g)
            if feeds is not None and _small(g):
                evaluate(g, feeds)
            g = PassManager(COMPILE_PIPELINE[len(DEFAULT_PIPELINE) :]).run(g)
            generate_program(g)
    except FlowcError as e:
        if e.exit_code != 2:
            return "internal", f"{type(e).__name__} (exit {e.exit_code}): {e}"
        return "rejected", str(e)
    except MemoryError:
        return "memory", traceback.format_exc()
    except RecursionError:
        return "internal", traceback.format_exc()
    except Exception:
        return "internal", traceback.format_exc()
    return "accepted", ""


def _small(g: Graph) -> bool:
    from flowc.ops.registry import get_op

    computed = sum(o.type.nbytes for n in g.nodes for o in n.outputs)
    return (
        computed <= EVAL_MAX_BYTES
        and sum(get_op(n.op).count_flops(n) for n in g.nodes) <= EVAL_MAX_FLOPS
    )


def warm_up() -> None:
    """Import, compile and generate code once in this process, so every forked child starts
    with the modules imported, the passes registered and the code templates compiled."""
    with tempfile.TemporaryDirectory() as d:
        for case in (onnx_case_of(onnx_seeds()[-1]), dsl_case(0)):
            path = Path(d) / f"warm{case.suffix}"
            path.write_bytes(case.data)
            check_file(path, case.shapes)


def onnx_case_of(seed: Seed) -> Case:
    return Case(seed.name, ".onnx", seed.model.SerializeToString(), dict(seed.shapes))


def _child(gen: str, seed: int, workdir: Path, wfd: int) -> None:
    outcome, message = "internal", "child failed before checking"
    try:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        case = make_case(gen, seed)
        d = workdir / f"{gen}-{seed}"
        d.mkdir()
        path = d / f"model{case.suffix}"
        path.write_bytes(case.data)
        outcome, message = check_file(path, case.shapes)
        shutil.rmtree(d, ignore_errors=True)  # thousands of cases must not fill the disk
    except MemoryError:
        outcome, message = "memory", "MemoryError"
    except BaseException:
        outcome, message = "internal", traceback.format_exc()
    finally:
        try:
            os.write(wfd, json.dumps({"outcome": outcome, "message": message[-4000:]}).encode())
        finally:
            os._exit(0)


@dataclass
class Result:
    gen: str
    seed: int
    outcome: str
    message: str
    seconds: float


def run_cases(
    cases: Iterable[tuple[str, int]],
    jobs: int = 2,
    timeout: float = CASE_TIMEOUT,
    deadline: float | None = None,
    warm: bool = True,
) -> Iterator[Result]:
    """Run each case in a forked child (at most ``jobs`` at once); yields results as they
    finish. ``deadline`` (a time.monotonic() value) stops starting new cases; ``warm``
    first runs one case here, so the children inherit a warmed-up process."""
    it = iter(cases)
    if warm:
        warm_up()
    # Children inherit the parent's objects copy-on-write; a collection in a child would touch
    # (and so copy) every page of them. Frozen objects are never scanned.
    gc.collect()
    gc.freeze()
    running: dict[int, tuple[str, int, int, float, bytearray]] = {}  # pid -> case, fd, t0, out
    with tempfile.TemporaryDirectory(prefix="flowc-fuzz-") as tmp:
        workdir = Path(tmp)
        exhausted = False
        while True:
            while not exhausted and len(running) < jobs:
                if deadline is not None and time.monotonic() > deadline:
                    exhausted = True
                    break
                nxt = next(it, None)
                if nxt is None:
                    exhausted = True
                    break
                gen, seed = nxt
                r, w = os.pipe()
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    os.close(r)
                    _child(gen, seed, workdir, w)
                os.close(w)
                running[pid] = (gen, seed, r, time.monotonic(), bytearray())
            if not running:
                return
            fds = {v[2]: pid for pid, v in running.items()}
            ready, _, _ = select.select(list(fds), [], [], 0.1)
            for fd in ready:
                pid = fds[fd]
                chunk = os.read(fd, 65536)
                if chunk:
                    running[pid][4].extend(chunk)
                    continue
                # end of file: the child has written its result and exited (or died)
                gen, seed, _, t0, buf = running.pop(pid)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                yield _result(gen, seed, status, bytes(buf), time.monotonic() - t0)
            now = time.monotonic()
            for pid in list(running):
                gen, seed, fd, t0, _ = running[pid]
                if now - t0 > timeout:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    os.close(fd)
                    del running[pid]
                    yield Result(gen, seed, "hang", f"over {timeout:.0f} s", now - t0)


def _result(gen: str, seed: int, status: int, out: bytes, seconds: float) -> Result:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        # the address-space limit shows as an abort or a kill in native code
        kind = "memory" if sig in (signal.SIGKILL,) else "crash"
        return Result(gen, seed, kind, f"killed by signal {signal.Signals(sig).name}", seconds)
    try:
        d = json.loads(out.decode())
        return Result(gen, seed, d["outcome"], d["message"], seconds)
    except (ValueError, KeyError):
        return Result(gen, seed, "crash", f"no result (exit status {status})", seconds)
