"""Every op's SBP signatures, checked by running them: for each strategy of a one-node graph
on 1-D and 2-D meshes, shard the inputs (partial sums as random parts), run the op's NumPy
reference (or the physical op's) on every rank's pieces, and put the outputs back together:
they must be the logical reference's output, with the local shapes the layout promises."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flowc.codegen.cpp import ctype
from flowc.codegen.program import template_env
from flowc.ir.builder import GraphBuilder
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Graph, Node, Value
from flowc.ir.layout import all_coords, local_type, shard, unshard
from flowc.ir.types import Mesh, NdSbp, Sbp, TensorType
from flowc.ops.registry import InferCtx, all_ops, get_op
from flowc.parallel.strategies import Strategy, signatures_1d, strategies
from flowc.toolchain import host_compile_command

MESHES = [Mesh("m", (2,)), Mesh("m", (4,)), Mesh("m", (2, 2))]
INT_MAX = np.iinfo(np.int64).max

_rng = np.random.default_rng(0)


def f32(*shape: int, lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    return _rng.uniform(lo, hi, shape).astype(np.float32)


def ints(*shape: int, lo: int = -4, hi: int = 4, dtype: type = np.int32) -> np.ndarray:
    return _rng.integers(lo, hi, shape).astype(dtype)


def bools(*shape: int) -> np.ndarray:
    return _rng.random(shape) < 0.5


def i64(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


@dataclass
class Case:
    """A one-node graph: ``inputs`` (None: omitted), those at ``consts`` made constants (shape,
    axes, pads, ...); ``has``/``lacks``: signatures (as printed) that must / must not exist."""

    id: str
    op: str
    inputs: Sequence[np.ndarray | None]
    attrs: Mapping[str, Any] = field(default_factory=dict)
    consts: Sequence[int] = ()
    outputs: int = 1
    has: Sequence[str] = ()
    lacks: Sequence[str] = ()


def _unary_input(op: str) -> np.ndarray:
    if op == "Acosh":
        return f32(4, 2, 4, lo=1.1, hi=2.0)
    if op == "BitwiseNot":
        return ints(4, 2, 4)
    if op == "Not":
        return bools(4, 2, 4)
    return f32(4, 2, 4, lo=0.1, hi=0.9)


# Every one-input element-wise op (Cast, which needs a target type, has cases of its own).
UNARY = [o.name for o in all_ops() if o.family == "elementwise" and o.inputs == (1, 1)]
UNARY.remove("Cast")

CASES: list[Case] = [
    Case(
        op,
        op,
        [_unary_input(op)],
        has=["(S(0)) -> (S(0))", "(S(2)) -> (S(2))"] + (["(P) -> (P)"] if op == "Neg" else []),
        lacks=[] if op == "Neg" else ["(P) -> (P)"],
    )
    for op in UNARY
]

# Broadcasting: a [4, 1, 8] and b [4, 8] give [4, 4, 8]; a has no data along output axis 1
# and b none along output axis 0.
_A, _B = f32(4, 1, 8), f32(4, 8)
_BCAST = ["(S(0), B) -> (S(0))", "(B, S(0)) -> (S(1))", "(S(2), S(1)) -> (S(2))"]
CASES += [
    Case("Add", "Add", [_A, _B], has=[*_BCAST, "(P, P) -> (P)"], lacks=["(P, B) -> (P)"]),
    Case("Sub", "Sub", [_A, _B], has=["(P, P) -> (P)"], lacks=["(B, P) -> (P)"]),
    Case("Mul", "Mul", [_A, _B], has=["(P, B) -> (P)", "(B, P) -> (P)"], lacks=["(P, P) -> (P)"]),
    Case("Div", "Div", [_A, f32(4, 8, lo=1, hi=2)], has=["(P, B) -> (P)"], lacks=["(B, P) -> (P)"]),
    Case("Pow", "Pow", [f32(4, 1, 8, lo=0.5, hi=2), _B], has=_BCAST, lacks=["(P, B) -> (P)"]),
    Case("Mod", "Mod", [ints(4, 1, 8), ints(4, 8, lo=1, hi=5)], has=_BCAST),
    Case("PRelu", "PRelu", [f32(4, 4, 8), f32(4, 1, 1)], has=["(S(0), S(0)) -> (S(0))"]),
    *(
        Case(op, op, [_A, _B], has=_BCAST, lacks=["(P, P) -> (P)"])
        for op in ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual")
    ),
    *(Case(op, op, [bools(4, 1, 8), bools(4, 8)], has=_BCAST) for op in ("And", "Or", "Xor")),
    *(
        Case(op, op, [ints(4, 1, 8), ints(4, 8)], has=_BCAST)
        for op in ("BitwiseAnd", "BitwiseOr", "BitwiseXor")
    ),
    Case(
        "BitShift",
        "BitShift",
        [ints(4, 1, 8, lo=0, hi=9, dtype=np.uint32), ints(4, 8, lo=0, hi=3, dtype=np.uint32)],
        {"direction": "RIGHT"},
        has=_BCAST,
    ),
    Case(
        "Sum",
        "Sum",
        [f32(4, 8), f32(8), f32(4, 1)],
        has=["(S(0), B, S(0)) -> (S(0))", "(S(1), S(0), B) -> (S(1))", "(P, P, P) -> (P)"],
    ),
    Case("Mean", "Mean", [f32(4, 8), f32(8), f32(4, 1)], has=["(P, P, P) -> (P)"]),
    Case("Max", "Max", [f32(4, 8), f32(8), f32(4, 1)], lacks=["(P, P, P) -> (P)"]),
    Case("Min", "Min", [f32(4, 8), f32(8)], lacks=["(P, P) -> (P)"]),
    Case("Where", "Where", [bools(4, 8), f32(4, 8), f32(8)], has=["(S(1), S(1), S(0)) -> (S(1))"]),
    Case(
        "Clip",
        "Clip",
        [f32(4, 8), np.float32(-0.5), np.float32(0.5)],
        consts=(1, 2),
        has=["(S(1), B, B) -> (S(1))"],
        lacks=["(P, B, B) -> (P)"],
    ),
    Case("Clip-max-only", "Clip", [f32(4, 8), None, np.float32(0.5)], consts=(2,)),
    Case("Cast-f64", "Cast", [f32(4, 8)], {"to": DType.F64.onnx}, has=["(P) -> (P)"]),
    Case(
        "Cast-i32", "Cast", [f32(4, 8, lo=-9, hi=9)], {"to": DType.I32.onnx}, lacks=["(P) -> (P)"]
    ),
    Case("CastLike", "CastLike", [f32(4, 8), np.zeros(1)], has=["(P, B) -> (P)"]),
    Case(
        "FusedElementwise",
        "FusedElementwise",
        [f32(4, 8), f32(8)],
        {
            "program": json.dumps(
                [
                    {"op": "Mul", "args": [0, 1], "attrs": {}, "dtype": "f32", "shape": [4, 8]},
                    {"op": "Relu", "args": [-1], "attrs": {}, "dtype": "f32", "shape": [4, 8]},
                ]
            )
        },
        has=["(S(1), S(0)) -> (S(1))", "(S(0), B) -> (S(0))"],
        lacks=["(P, B) -> (P)"],
    ),
    # A gradient accumulation fused into one chain (g0 + g1 + g2) stays a partial sum; so
    # does a product with one partial factor; adding a whole term to one does not.
    Case(
        "FusedElementwise-sum",
        "FusedElementwise",
        [f32(4, 8), f32(4, 8), f32(4, 8)],
        {
            "program": json.dumps(
                [
                    {"op": "Add", "args": [0, 1], "attrs": {}, "dtype": "f32", "shape": [4, 8]},
                    {"op": "Add", "args": [-1, 2], "attrs": {}, "dtype": "f32", "shape": [4, 8]},
                ]
            )
        },
        has=["(P, P, P) -> (P)", "(S(0), S(0), S(0)) -> (S(0))"],
        lacks=["(P, B, B) -> (P)"],
    ),
    Case(
        "FusedElementwise-scaled",
        "FusedElementwise",
        [f32(4, 8), f32(8), f32(4, 8)],
        {
            "program": json.dumps(
                [
                    {"op": "Mul", "args": [0, 1], "attrs": {}, "dtype": "f32", "shape": [4, 8]},
                    {"op": "Neg", "args": [-1], "attrs": {}, "dtype": "f32", "shape": [4, 8]},
                    {"op": "Div", "args": [-2, 1], "attrs": {}, "dtype": "f32", "shape": [4, 8]},
                    {"op": "Mul", "args": [-3, 2], "attrs": {}, "dtype": "f32", "shape": [4, 8]},
                ]
            )
        },
        has=["(P, B, B) -> (P)", "(B, B, P) -> (P)"],
        lacks=["(B, P, B) -> (P)", "(P, P, P) -> (P)"],
    ),
    Case(
        "FusedElementwise-affine",
        "FusedElementwise",
        [f32(4, 8), f32(4, 8)],
        {
            "program": json.dumps(
                [
                    {"op": "Exp", "args": [1], "attrs": {}, "dtype": "f32", "shape": [4, 8]},
                    {"op": "Add", "args": [0, -1], "attrs": {}, "dtype": "f32", "shape": [4, 8]},
                ]
            )
        },
        lacks=["(P, B) -> (P)", "(P, P) -> (P)", "(B, P) -> (P)"],
    ),
    # Q, K, V read as heads of [B, S, H * D] projections, a [B, 1, 1, S] mask, the output
    # [B, S, H, D]: batches and heads split (the mask follows the batch, is whole for a head
    # split), on meshes whose factors divide them; keys never.
    Case(
        "FusedAttention",
        "FusedAttention",
        [f32(4, 8, 8), f32(4, 8, 8), f32(4, 8, 8), f32(4, 1, 1, 8, lo=-2, hi=0)],
        {
            "sizes": (4, 2, 8, 8, 4, 4),
            **{f"{w}_layout": "b,s,hd" for w in ("q", "k", "v")},
            "out_layout": "b,s,h,d",
            "scale": 0.5,
        },
        has=["(S(0), S(0), S(0), S(0)) -> (S(0))", "(S(2), S(2), S(2), B) -> (S(2))"],
        lacks=["(S(1), S(1), S(1), S(3)) -> (S(1))"],
    ),
]

# Training: dropout draws its mask by the element's index in the whole tensor, so a shard
# runs the op that knows its place (the physical op, or the fused attention given it).
_ATTN = {
    "sizes": (4, 2, 8, 8, 4, 4),
    **{f"{w}_layout": "b,s,hd" for w in ("q", "k", "v")},
    "out_layout": "b,s,h,d",
    "scale": 0.5,
}
_DROP = {"dropout": 0.25, "dropout_stream": 1, "seed": 7}
_QKV = [f32(4, 8, 8), f32(4, 8, 8), f32(4, 8, 8)]
_MASK = f32(4, 1, 1, 8, lo=-2, hi=0)
_STEP = np.array(3, np.int64)
CASES += [
    Case(
        "ScatterND-add",
        "ScatterND",
        [f32(8, 4), ints(8, 1, lo=-8, hi=8, dtype=np.int64), f32(8, 4)],
        {"reduction": "add"},
        has=[
            "(S(1), B, S(1)) -> (S(1))",
            "(S(0), B, B) -> (S(0)) [ScatterNDShard]",
            "(P, B, P) -> (P)",
            "(P, S(0), S(0)) -> (P)",
        ],
    ),
    Case(
        "ScatterND-replace",
        "ScatterND",
        [f32(8, 4, 2), np.array([[1, 0], [6, 3], [-3, 1], [2, 2]], np.int64), f32(4, 2)],
        has=["(S(2), B, S(1)) -> (S(2))", "(S(0), B, B) -> (S(0)) [ScatterNDShard]"],
        lacks=["(P, B, P) -> (P)"],
    ),
    Case(
        "TrainDropout",
        "TrainDropout",
        [f32(4, 4, 8), _STEP],
        {"ratio": 0.3, "seed": 5, "stream": 2},
        has=[
            "(S(0), B) -> (S(0)) [TrainDropoutShard]",
            "(S(2), B) -> (S(2)) [TrainDropoutShard]",
            "(P, B) -> (P)",
        ],
    ),
    Case(
        "FusedAttention-dropout",
        "FusedAttention",
        [*_QKV, _MASK, None, _STEP],
        {**_ATTN, **_DROP},
        has=[
            "(S(0), S(0), S(0), S(0), -, B) -> (S(0)) [FusedAttention]",
            "(S(2), S(2), S(2), B, -, B) -> (S(2)) [FusedAttention]",
        ],
    ),
    Case(
        "FusedAttentionGrad",
        "FusedAttentionGrad",
        [*_QKV, f32(4, 8, 2, 4), f32(4, 8, 2, 4), _MASK],
        _ATTN,
        outputs=4,
        has=[
            "(S(0), S(0), S(0), S(0), S(0), S(0)) -> (S(0), S(0), S(0), S(0))",
            "(S(2), S(2), S(2), S(2), S(2), B) -> (S(1), S(1), S(1), S(1))",
        ],
    ),
    Case(
        "FusedAttentionGrad-dropout",
        "FusedAttentionGrad",
        [*_QKV, f32(4, 8, 2, 4), f32(4, 8, 2, 4), _MASK, None, _STEP],
        {**_ATTN, **_DROP},
        outputs=4,
        has=[
            "(S(0), S(0), S(0), S(0), S(0), S(0), -, B) -> (S(0), S(0), S(0), S(0)) "
            "[FusedAttentionGrad]",
            "(S(2), S(2), S(2), S(2), S(2), B, -, B) -> (S(1), S(1), S(1), S(1)) "
            "[FusedAttentionGrad]",
        ],
    ),
]

# Integers: sums and products wrap exactly, but a division truncates each part.
_I, _J = ints(4, 8, lo=-50, hi=50), ints(4, 8, lo=1, hi=5)
CASES += [
    Case("Add-int", "Add", [_I, _J], has=["(P, P) -> (P)"]),
    Case("Mul-int", "Mul", [_I, _J], has=["(P, B) -> (P)"]),
    Case("Div-int", "Div", [_I, _J], has=["(S(0), S(0)) -> (S(0))"], lacks=["(P, B) -> (P)"]),
    Case("Mean-int", "Mean", [_I, _J], lacks=["(P, P) -> (P)"]),
    Case("ReduceSum-int", "ReduceSum", [_I], has=["(S(1)) -> (P)", "(P) -> (P)"]),
    Case("ReduceMean-int", "ReduceMean", [_I], lacks=["(P) -> (P)"]),
    Case("MatMul-int", "MatMul", [_I, ints(8, 4)], has=["(S(1), S(0)) -> (P)"]),
    Case("Gemm-int", "Gemm", [_I, ints(8, 4), ints(4)], has=["(P, B, P) -> (P)"]),
    Case(
        "Gemm-int-scaled",
        "Gemm",
        [_I, ints(8, 4), ints(4)],
        {"alpha": 0.5},
        has=["(S(0), B, B) -> (S(0))"],
        lacks=["(S(1), S(0), P) -> (P)", "(P, B, P) -> (P)"],
    ),
]

_MATMUL_2D = [
    "(S(0), B) -> (S(0))",
    "(B, S(1)) -> (S(1))",
    "(S(1), S(0)) -> (P)",
    "(P, B) -> (P)",
    "(B, P) -> (P)",
]
CASES += [
    Case("MatMul-2d", "MatMul", [f32(8, 4), f32(4, 8)], has=_MATMUL_2D, lacks=["(P, P) -> (P)"]),
    Case(
        "MatMul-batch",
        "MatMul",
        [f32(2, 4, 8), f32(8, 4)],
        has=["(S(0), B) -> (S(0))", "(S(1), B) -> (S(1))", "(S(2), S(0)) -> (P)"],
    ),
    Case(
        "MatMul-batch-broadcast",
        "MatMul",
        [f32(2, 1, 4, 8), f32(4, 8, 4)],
        has=["(S(0), B) -> (S(0))", "(B, S(0)) -> (S(1))", "(S(3), S(1)) -> (P)"],
    ),
    Case("MatMul-vec-mat", "MatMul", [f32(8), f32(2, 8, 4)], has=["(S(0), S(1)) -> (P)"]),
    Case("MatMul-mat-vec", "MatMul", [f32(2, 4, 8), f32(8)], has=["(S(1), B) -> (S(1))"]),
    Case("MatMul-vec-vec", "MatMul", [f32(8), f32(8)], has=["(S(0), S(0)) -> (P)"]),
    # fuse_gemm's GEMM + epilogue: row/column/batch splits; a k split only without one.
    Case(
        "FusedGemm-bias-relu",
        "FusedGemm",
        [f32(2, 4, 8), f32(8, 4), f32(4)],
        {"activation": "relu"},
        has=["(S(1), B, B) -> (S(1))", "(B, S(1), S(0)) -> (S(2))", "(S(0), B, B) -> (S(0))"],
        lacks=["(S(2), S(0), B) -> (P)"],
    ),
    # A bias epilogue over a k split: the bias is P (one rank adds it), never B.
    Case(
        "FusedGemm-bias",
        "FusedGemm",
        [f32(4, 8), f32(8, 6), f32(6)],
        has=["(S(1), S(0), P) -> (P)", "(P, B, P) -> (P)", "(B, P, P) -> (P)"],
        lacks=["(S(1), S(0), B) -> (P)", "(P, B, B) -> (P)"],
    ),
    Case(
        "FusedGemm-bias-gelu",
        "FusedGemm",
        [f32(4, 8), f32(8, 6), f32(6)],
        {"activation": "gelu_tanh"},
        has=["(B, S(1), S(0)) -> (S(1))", "(S(0), B, B) -> (S(0))"],
        lacks=["(S(1), S(0), P) -> (P)", "(P, B, P) -> (P)", "(S(1), S(0), B) -> (P)"],
    ),
    # A residual epilogue likewise: P with a k split (one rank adds it), never B.
    Case(
        "FusedGemm-residual",
        "FusedGemm",
        [f32(4, 8), f32(8, 6), None, f32(4, 6)],
        has=["(S(1), S(0), -, P) -> (P)", "(P, B, -, P) -> (P)"],
        lacks=["(S(1), S(0), -, B) -> (P)"],
    ),
    Case(
        "FusedGemm-bias-residual",
        "FusedGemm",
        [f32(4, 8), f32(8, 6), f32(6), f32(4, 6)],
        has=["(S(1), S(0), P, P) -> (P)"],
        lacks=["(S(1), S(0), B, P) -> (P)", "(S(1), S(0), P, B) -> (P)"],
    ),
    Case(
        "FusedGemm-residual-relu",
        "FusedGemm",
        [f32(4, 8), f32(8, 6), f32(6), f32(4, 6)],
        {"activation": "relu"},
        has=["(S(0), B, B, S(0)) -> (S(0))"],
        lacks=["(S(1), S(0), P, P) -> (P)"],
    ),
    Case(
        "FusedGemm-transB",
        "FusedGemm",
        [f32(4, 8), f32(6, 8)],
        {"transB": 1},
        has=["(S(1), S(1)) -> (P)", "(B, S(0)) -> (S(1))", "(P, B) -> (P)"],
    ),
    Case(
        "Gemm",
        "Gemm",
        [f32(8, 4), f32(4, 8), f32(8)],
        {"alpha": 0.5, "beta": 2.0},
        has=["(S(0), B, B) -> (S(0))", "(B, S(1), S(0)) -> (S(1))", "(S(1), S(0), P) -> (P)"],
        lacks=["(S(1), S(0), B) -> (P)"],
    ),
    Case(
        "Gemm-transA-colC",
        "Gemm",
        [f32(4, 8), f32(4, 8), f32(8, 1)],
        {"transA": 1},
        has=["(S(1), B, S(0)) -> (S(0))", "(B, S(1), B) -> (S(1))", "(S(0), S(0), P) -> (P)"],
    ),
    Case(
        "Gemm-transB-rowC",
        "Gemm",
        [f32(8, 4), f32(8, 4), f32(1, 8)],
        {"transB": 1},
        has=["(B, S(0), S(1)) -> (S(1))", "(S(1), S(1), P) -> (P)", "(P, B, P) -> (P)"],
    ),
    Case(
        "Gemm-no-C",
        "Gemm",
        [f32(4, 8), f32(8, 4)],
        {"transA": 1, "transB": 1},
        has=["(B, P) -> (P)"],
    ),
]

_CONV = {"pads": (1, 1, 1, 1)}
CASES += [
    Case(
        "Conv",
        "Conv",
        [f32(4, 4, 5, 5), f32(8, 4, 3, 3), f32(8)],
        _CONV,
        has=["(S(0), B, B) -> (S(0))", "(B, S(0), S(0)) -> (S(1))", "(S(1), S(1), P) -> (P)"],
        lacks=["(S(2), B, B) -> (S(2))"],
    ),
    Case(
        "Conv-group2",
        "Conv",
        [f32(4, 4, 5, 5), f32(8, 2, 3, 3), f32(8)],
        {**_CONV, "group": 2},
        has=["(S(0), B, B) -> (S(0))", "(P, B, P) -> (P)"],
        lacks=["(B, S(0), S(0)) -> (S(1))", "(S(1), S(1), P) -> (P)"],
    ),
    Case("Conv-no-bias", "Conv", [f32(2, 4, 6), f32(4, 4, 3)], has=["(B, P) -> (P)"]),
    # Relu after the sum: no partial sums; the residual is laid out like the result.
    Case(
        "FusedConv",
        "FusedConv",
        [f32(4, 4, 5, 5), f32(8, 4, 3, 3), f32(8), f32(4, 8, 5, 5)],
        {**_CONV, "activation": "Relu"},
        has=["(S(0), B, B, S(0)) -> (S(0))", "(B, S(0), S(0), S(1)) -> (S(1))"],
        lacks=["(S(1), S(1), P, P) -> (P)", "(P, B, P, P) -> (P)"],
    ),
    Case(
        "ConvTranspose",
        "ConvTranspose",
        [f32(4, 4, 3, 3), f32(4, 8, 3, 3), f32(8)],
        {"strides": (2, 2)},
        has=["(B, S(1), S(0)) -> (S(1))", "(S(1), S(0), P) -> (P)"],
    ),
]

_POOL = {"kernel_shape": (2, 2), "strides": (2, 2)}
_X4 = f32(4, 4, 6, 6)
CASES += [
    Case("MaxPool", "MaxPool", [_X4], _POOL, has=["(S(1)) -> (S(1))"], lacks=["(P) -> (P)"]),
    Case("MaxPool-indices", "MaxPool", [_X4], _POOL, outputs=2, lacks=["(S(0)) -> (S(0), S(0))"]),
    Case(
        "AveragePool",
        "AveragePool",
        [_X4],
        {**_POOL, "pads": (1, 1, 0, 0)},
        has=["(S(0)) -> (S(0))", "(P) -> (P)"],
        lacks=["(S(2)) -> (S(2))"],
    ),
    Case("LpPool", "LpPool", [_X4], _POOL, lacks=["(P) -> (P)"]),
    Case("GlobalAveragePool", "GlobalAveragePool", [_X4], has=["(P) -> (P)"]),
    Case("GlobalMaxPool", "GlobalMaxPool", [_X4], has=["(S(1)) -> (S(1))"]),
    Case("GlobalLpPool", "GlobalLpPool", [_X4], lacks=["(P) -> (P)"]),
]

_C4 = [f32(4), f32(4), f32(4), f32(4, lo=0.5, hi=1.5)]
CASES += [
    Case(
        "BatchNormalization",
        "BatchNormalization",
        [f32(4, 4, 4, 2), *_C4],
        has=["(S(1), S(0), S(0), S(0), S(0)) -> (S(1))", "(S(2), B, B, B, B) -> (S(2))"],
    ),
    Case(
        "LayerNormalization",
        "LayerNormalization",
        [f32(4, 4, 8), f32(8), f32(8)],
        outputs=3,
        has=["(S(1), B, B) -> (S(1), S(1), S(1))"],
        lacks=["(S(2), B, B) -> (S(2), S(2), S(2))"],
    ),
    Case(
        # Rows are independent: logits and labels split alike along a batch axis, never
        # along the classes (the log-sum-exp needs the whole row).
        "SoftmaxCrossEntropy",
        "SoftmaxCrossEntropy",
        [f32(4, 2, 8), ints(4, 2, lo=0, hi=8, dtype=np.int64)],
        {"has_ignore": 1, "ignore_index": 3, "label_smoothing": 0.1},
        outputs=2,
        has=["(S(0), S(0)) -> (S(0), S(0))", "(S(1), S(1)) -> (S(1), S(1))"],
        lacks=["(S(2), B) -> (S(2), S(2))", "(P, B) -> (P, P)"],
    ),
    Case(
        "LayerNormalization-axis1",
        "LayerNormalization",
        [f32(4, 4, 8), f32(4, 8)],
        {"axis": 1},
        has=["(S(0), B) -> (S(0))"],
        lacks=["(S(1), B) -> (S(1))"],
    ),
    Case(
        "InstanceNormalization",
        "InstanceNormalization",
        [f32(4, 4, 6), f32(4), f32(4)],
        has=["(S(1), S(0), S(0)) -> (S(1))"],
        lacks=["(S(2), B, B) -> (S(2))"],
    ),
    Case(
        "GroupNormalization",
        "GroupNormalization",
        [f32(4, 4, 6), f32(4), f32(4)],
        {"num_groups": 2},
        has=["(S(0), B, B) -> (S(0))"],
        lacks=["(S(1), S(0), S(0)) -> (S(1))"],
    ),
    Case("LRN", "LRN", [_X4], {"size": 3}, has=["(S(2)) -> (S(2))"], lacks=["(S(1)) -> (S(1))"]),
    Case(
        "MeanVarianceNormalization",
        "MeanVarianceNormalization",
        [f32(4, 4, 2, 4)],
        has=["(S(1)) -> (S(1))"],
        lacks=["(S(0)) -> (S(0))"],
    ),
]

CASES += [
    Case(
        f"{op}-axis{axis}",
        op,
        [f32(4, 4, 8)],
        {"axis": axis},
        has=["(S(0)) -> (S(0))"],
        lacks=[f"(S({axis % 3})) -> (S({axis % 3}))", "(P) -> (P)"],
    )
    for op in ("Softmax", "LogSoftmax", "Hardmax")
    for axis in (-1, 1)
]

REDUCE = [o.name for o in all_ops() if o.family == "reduce" and o.name.startswith("Reduce")]
CASES += [
    Case(
        f"{op}-keep{keep}",
        op,
        [f32(4, 4, 8, lo=0.5, hi=1.5), i64(1)],
        {"keepdims": keep},
        consts=(1,),
        has=["(S(0), B) -> (S(0))", f"(S(2), B) -> (S({2 if keep else 1}))"]
        + (["(S(1), B) -> (P)"] if op == "ReduceSum" else [])
        + (["(P, B) -> (P)"] if op in ("ReduceSum", "ReduceMean") else []),
        lacks=[] if op == "ReduceSum" else ["(S(1), B) -> (P)"],
    )
    for op in REDUCE
    for keep in (0, 1)
]
CASES += [
    Case("ReduceSum-all", "ReduceSum", [f32(4, 8)], has=["(S(0)) -> (P)", "(S(1)) -> (P)"]),
    Case(
        "ReduceMax-noop",
        "ReduceMax",
        [f32(4, 8)],
        {"noop_with_empty_axes": 1},
        has=["(S(1)) -> (S(1))"],
    ),
    *(
        Case(
            f"{op}-keep{keep}",
            op,
            [f32(4, 4, 8)],
            {"axis": 1, "keepdims": keep},
            has=[f"(S(2)) -> (S({2 if keep else 1}))"],
            lacks=["(S(1)) -> (S(1))"],
        )
        for op in ("ArgMax", "ArgMin")
        for keep in (0, 1)
    ),
    Case(
        "CumSum",
        "CumSum",
        [f32(4, 4, 8), i64(-1)],
        {"exclusive": 1},
        consts=(1,),
        has=["(S(1), B) -> (S(1))", "(P, B) -> (P)"],
        lacks=["(S(2), B) -> (S(2))"],
    ),
]

CASES += [
    Case(
        "Reshape-merge",
        "Reshape",
        [f32(4, 6, 4), i64(24, 4)],
        consts=(1,),
        has=["(S(0), B) -> (S(0))", "(S(2), B) -> (S(1))", "(P, B) -> (P)"],
        lacks=["(S(1), B) -> (S(0))"],
    ),
    Case(
        "Reshape-split",
        "Reshape",
        [f32(24, 4), i64(4, 6, 4)],
        consts=(1,),
        has=["(S(0), B) -> (S(0))", "(S(1), B) -> (S(2))"],
    ),
    Case(
        "Reshape-regroup",
        "Reshape",
        [f32(8, 6), i64(2, 4, 3, 2)],
        consts=(1,),
        has=["(S(0), B) -> (S(0))", "(S(1), B) -> (S(2))"],
    ),
    Case(
        "Reshape-ones",
        "Reshape",
        [f32(4, 1, 8, 1), i64(0, -1)],
        consts=(1,),
        has=["(S(0), B) -> (S(0))"],
    ),
    Case(
        "Flatten",
        "Flatten",
        [f32(4, 2, 4, 4)],
        {"axis": 2},
        has=["(S(0)) -> (S(0))", "(S(2)) -> (S(1))"],
        lacks=["(S(1)) -> (S(0))"],
    ),
    Case(
        "Transpose",
        "Transpose",
        [f32(2, 4, 8)],
        {"perm": (2, 0, 1)},
        has=["(S(2)) -> (S(0))", "(S(0)) -> (S(1))", "(P) -> (P)"],
    ),
    Case(
        "Squeeze",
        "Squeeze",
        [f32(4, 1, 8), i64(1)],
        consts=(1,),
        has=["(S(2), B) -> (S(1))"],
    ),
    Case("Squeeze-all", "Squeeze", [f32(4, 1, 8)], has=["(P) -> (P)"], lacks=["(S(0)) -> (S(0))"]),
    Case(
        "Unsqueeze",
        "Unsqueeze",
        [f32(4, 8), i64(0, 2)],
        consts=(1,),
        has=["(S(0), B) -> (S(1))", "(S(1), B) -> (S(3))"],
    ),
    Case(
        "Concat",
        "Concat",
        [f32(4, 2, 4), f32(4, 4, 4), f32(4, 2, 4)],
        {"axis": 1},
        has=["(S(0), S(0), S(0)) -> (S(0))", "(P, P, P) -> (P)"],
        lacks=["(S(1), S(1), S(1)) -> (S(1))"],
    ),
    Case(
        "Split",
        "Split",
        [f32(4, 8, 4), i64(2, 6)],
        {"axis": 1},
        consts=(1,),
        outputs=2,
        has=["(S(2), B) -> (S(2), S(2))", "(P, B) -> (P, P)"],
        lacks=["(S(1), B) -> (S(1), S(1))"],
    ),
    Case(
        "Split-num-outputs",
        "Split",
        [f32(4, 8)],
        {"axis": 0, "num_outputs": 2},
        outputs=2,
        has=["(S(1)) -> (S(1), S(1))"],
    ),
    Case(
        "Slice",
        "Slice",
        [f32(4, 8, 4), i64(1), i64(5), i64(1)],
        consts=(1, 2, 3),
        has=["(S(0), B, B, B) -> (S(0))", "(S(2), B, B, B) -> (S(2))"],
        lacks=["(S(1), B, B, B) -> (S(1))"],
    ),
    Case(
        "Slice-whole-axis",
        "Slice",
        [f32(4, 8, 4), i64(0, -8), i64(INT_MAX, 8), i64(0, 1), i64(1, 1)],
        consts=(1, 2, 3, 4),
        has=["(S(0), B, B, B, B) -> (S(0))", "(S(1), B, B, B, B) -> (S(1))"],
    ),
    Case(
        "Slice-step2",
        "Slice",
        [f32(4, 8), i64(0), i64(8), i64(1), i64(2)],
        consts=(1, 2, 3, 4),
        lacks=["(S(1), B, B, B, B) -> (S(1))"],
    ),
    Case(
        "Expand",
        "Expand",
        [f32(4, 1, 8), i64(2, 4, 4, 8)],
        consts=(1,),
        has=["(B, B) -> (S(0))", "(S(0), B) -> (S(1))", "(B, B) -> (S(2))", "(P, B) -> (P)"],
    ),
    Case(
        "Tile",
        "Tile",
        [f32(4, 2, 4), i64(1, 2, 1)],
        consts=(1,),
        has=["(S(0), B) -> (S(0))", "(S(2), B) -> (S(2))"],
        lacks=["(S(1), B) -> (S(1))"],
    ),
    Case(
        "Pad-zero",
        "Pad",
        [f32(4, 4, 6), i64(0, 0, 1, 0, 0, 2), np.float32(0)],
        consts=(1, 2),
        has=["(S(1), B, B) -> (S(1))", "(P, B, B) -> (P)"],
        lacks=["(S(2), B, B) -> (S(2))"],
    ),
    Case(
        "Pad-value",
        "Pad",
        [f32(4, 4, 6), i64(1, 0, 1, 0), np.float32(1.5), i64(0, 2)],
        consts=(1, 2, 3),
        has=["(S(1), B, B, B) -> (S(1))"],
        lacks=["(P, B, B, B) -> (P)"],
    ),
    Case(
        "Pad-reflect",
        "Pad",
        [f32(4, 4, 6), i64(0, 0, 2, 0, 0, 1)],
        {"mode": "reflect"},
        consts=(1,),
        has=["(P, B) -> (P)"],
    ),
    Case("Identity", "Identity", [f32(4, 8)], has=["(S(1)) -> (S(1))", "(P) -> (P)"]),
    Case(
        "Dropout",
        "Dropout",
        [f32(4, 8)],
        outputs=2,
        has=["(S(1)) -> (S(1), S(1))"],
        lacks=["(P) -> (P, P)"],
    ),
    Case(
        "DepthToSpace-DCR",
        "DepthToSpace",
        [f32(4, 8, 4, 2)],
        {"blocksize": 2},
        has=["(S(2)) -> (S(2))", "(P) -> (P)"],
        lacks=["(S(1)) -> (S(1))"],
    ),
    Case(
        "DepthToSpace-CRD",
        "DepthToSpace",
        [f32(2, 16, 2, 4)],
        {"blocksize": 2, "mode": "CRD"},
        has=["(S(1)) -> (S(1))", "(S(3)) -> (S(3))"],
    ),
    Case(
        "SpaceToDepth",
        "SpaceToDepth",
        [f32(4, 2, 8, 4)],
        {"blocksize": 2},
        has=["(S(0)) -> (S(0))", "(S(2)) -> (S(2))"],
        lacks=["(S(1)) -> (S(1))"],
    ),
]

CASES += [
    Case(
        "Gather",
        "Gather",
        [f32(8, 4), ints(2, 4, lo=-8, hi=8, dtype=np.int64)],
        has=[
            "(S(0), B) -> (P) [GatherShard]",
            "(B, S(1)) -> (S(1))",
            "(S(1), B) -> (S(2))",
            "(P, B) -> (P)",
        ],
        lacks=["(S(0), B) -> (S(0))"],
    ),
    Case(
        "Gather-axis1",
        "Gather",
        [f32(4, 8, 2), ints(4, lo=0, hi=8, dtype=np.int64)],
        {"axis": 1},
        has=["(S(1), B) -> (P) [GatherShard]", "(B, S(0)) -> (S(1))", "(S(2), B) -> (S(2))"],
    ),
    Case(
        "Trilu",
        "Trilu",
        [f32(2, 4, 4, 4), i64(1)],
        {"upper": 0},
        consts=(1,),
        has=["(S(1), B) -> (S(1))", "(P, B) -> (P)"],
        lacks=["(S(2), B) -> (S(2))"],
    ),
    Case(
        "TopK",
        "TopK",
        [f32(4, 4, 8), i64(3)],
        consts=(1,),
        outputs=2,
        has=["(S(1), B) -> (S(1), S(1))"],
        lacks=["(S(2), B) -> (S(2), S(2))"],
    ),
    Case(
        "OneHot",
        "OneHot",
        [ints(4, 2, lo=-8, hi=8, dtype=np.int64), i64(8), np.array([0.0, 1.0], np.float32)],
        {"axis": 1},
        consts=(1, 2),
        has=["(S(0), B, B) -> (S(0))", "(S(1), B, B) -> (S(2))"],
    ),
]

CASES += [
    Case(
        "CumProd",
        "CumProd",
        [f32(4, 4, 8, lo=0.5, hi=1.5), i64(1)],
        {"reverse": 1},
        consts=(1,),
        has=["(S(0), B) -> (S(0))", "(S(2), B) -> (S(2))"],
        lacks=["(S(1), B) -> (S(1))", "(P, B) -> (P)"],
    ),
    Case(
        "LpNormalization",
        "LpNormalization",
        [f32(4, 4, 8)],
        {"p": 1, "axis": 1},
        has=["(S(0)) -> (S(0))", "(S(2)) -> (S(2))"],
        lacks=["(S(1)) -> (S(1))"],
    ),
    Case("Det", "Det", [f32(4, 2, 3, 3)], has=["(S(0)) -> (S(0))", "(S(1)) -> (S(1))"]),
    Case(
        "ReverseSequence",
        "ReverseSequence",
        [f32(4, 4, 4), i64(4, 0, 2, 3)],
        {"batch_axis": 1, "time_axis": 0},
        has=["(S(1), S(0)) -> (S(1))", "(S(2), B) -> (S(2))"],
        lacks=["(S(0), B) -> (S(0))"],
    ),
    Case(
        "TensorScatter",
        "TensorScatter",
        [f32(4, 4, 8, 2), f32(4, 4, 3, 2), i64(0, 5, 1, 2)],
        has=[
            "(S(0), S(0), S(0)) -> (S(0))",
            "(S(1), S(1), B) -> (S(1))",
            "(S(3), S(3), B) -> (S(3))",
        ],
        lacks=["(S(0), S(0), B) -> (S(0))", "(S(2), S(2), B) -> (S(2))"],
    ),
    Case(
        "TensorScatter-no-indices",
        "TensorScatter",
        [f32(4, 8, 2), f32(4, 3, 2)],
        {"mode": "circular"},
        has=["(S(0), S(0)) -> (S(0))", "(S(2), S(2)) -> (S(2))"],
        lacks=["(S(1), S(1)) -> (S(1))"],
    ),
]


def build(case: Case) -> Node:
    g = Graph("one")
    b = GraphBuilder(g, fold=False)
    ins: list[Value | None] = []
    for i, a in enumerate(case.inputs):
        if a is None:
            ins.append(None)
        elif i in case.consts:
            ins.append(b.constant(f"c{i}", np.asarray(a)))
        else:
            arr = np.asarray(a)
            ins.append(g.add_input(f"x{i}", TensorType(arr.shape, DType.from_numpy(arr.dtype))))
    b.emit(case.op, ins, case.attrs, name="n", num_outputs=case.outputs)
    return g.nodes[-1]


def close(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype, what
    if ref.dtype.kind != "f":
        np.testing.assert_array_equal(got, ref, err_msg=what)
        return
    finite = np.abs(ref[np.isfinite(ref)])
    scale = max(float(finite.max()) if finite.size else 0.0, 1.0)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * scale, err_msg=what)


def run_strategy(node: Node, arrays: list[np.ndarray | None], s: Strategy, mesh: Mesh) -> None:
    """Every rank runs the op on its pieces; the pieces put together are the logical output."""
    opdef = get_op(node.op)
    ref = opdef.evaluate(arrays, node.attrs)
    op = s.physical or node.op
    attrs: dict[str, Any] = dict(node.attrs)
    if s.physical:
        # As flowc.parallel.lower gives them.
        attrs["mesh"] = mesh.shape
        attrs["shard_axes"] = tuple(a for a, sig in enumerate(s.axes) if sig.physical)
        if "shard_dims" in get_op(s.physical).attrs:
            attrs["shard_dims"] = tuple(s.output(0).parts[a].axis for a in attrs["shard_axes"])
    local_outs = [local_type(o.type, s.output(j), mesh) for j, o in enumerate(node.outputs)]
    results: list[dict[tuple[int, ...], np.ndarray]] = [{} for _ in node.outputs]
    rng = np.random.default_rng(1)
    for coords in all_coords(mesh):
        pieces: list[np.ndarray | None] = []
        local_ins: list[TensorType | None] = []
        for i, (v, a) in enumerate(zip(node.inputs, arrays, strict=True)):
            sbp = s.input(i)
            if v is None or a is None or sbp is None:
                pieces.append(None)
                local_ins.append(None)
                continue
            pieces.append(shard(a, sbp, mesh, coords, rng))
            local_ins.append(local_type(v.type, sbp, mesh))
        if opdef.localize is not None:
            for i, array in opdef.localize(node, local_ins, local_outs).items():
                pieces[i] = array
        phys = get_op(op)
        ctx = InferCtx(
            op,
            node.name,
            local_ins,
            [
                p if v is not None and v.const is not None else None
                for p, v in zip(pieces, node.inputs, strict=True)
            ],
            Attrs(attrs).merged(phys.attrs),
            len(node.outputs),
        )
        assert phys.infer(ctx) == local_outs, f"{s} at {coords}: local inference"
        outs = phys.evaluate(pieces, Attrs({**attrs, "coords": coords}))
        for j, (o, t) in enumerate(zip(outs, local_outs, strict=False)):
            assert o.shape == t.shape, f"{s} at {coords}: output {j} is {o.shape}, not {t.shape}"
            results[j][coords] = o
    for j, r in enumerate(ref[: len(node.outputs)]):
        close(unshard(results[j], s.output(j), mesh), r, f"{node.op} {s} on {mesh}, output {j}")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_signatures_compute_the_op(case: Case) -> None:
    node = build(case)
    printed = {str(sig) for sig in signatures_1d(node)}
    for want in case.has:
        assert want in printed, f"{case.id}: {want} missing from {sorted(printed)}"
    for bad in case.lacks:
        assert bad not in printed, f"{case.id}: {bad} must not be a signature"
    arrays = [None if a is None else np.asarray(a) for a in case.inputs]
    for mesh in MESHES:
        found = strategies(node, mesh)
        assert len(found) > 1 or not case.has, f"{case.id}: nothing but all-B on {mesh}"
        for s in found:
            run_strategy(node, arrays, s, mesh)


def test_every_op_with_signatures_is_checked() -> None:
    declared = {op.name for op in all_ops() if op.sbp is not None}
    assert declared <= {c.op for c in CASES}


class _KernelRecorder:
    """What GatherShard's emit hook calls on a Program, recorded as C++ for a test driver:
    pointers are the driver's variables, mesh coordinates its ``coords`` array."""

    def __init__(self) -> None:
        self.env = template_env()
        self.kernels: list[str] = []
        self.statements: list[str] = []

    def kernel(self, template: str, macro: str, **params: Any) -> str:
        name = f"k{len(self.kernels)}"
        module = self.env.get_template(f"kernels/{template}").module
        self.kernels.append(str(getattr(module, macro)(name=name, **params)))
        return name

    def launch(self, kernel: str, total: int, args: list[str]) -> None:
        grid = (total + 255) // 256
        self.statements.append(
            f"FLOWC_LAUNCH({kernel}, dim3({grid}), dim3(256), 0, nullptr, {', '.join(args)});"
        )

    def ctype(self, v: Value) -> str:
        return ctype(v.type.dtype)

    def cptr(self, v: Value) -> str:
        return v.name

    def ptr(self, v: Value) -> str:
        return v.name

    def mesh_coord(self, axis: int) -> str:
        return f"coords[{axis}]"


def _c_array(ct: str, name: str, a: np.ndarray) -> str:
    return f"static const {ct} {name}[] = {{{', '.join(repr(x) for x in a.reshape(-1).tolist())}}};"


def test_gather_shard_kernel_matches_its_reference(tmp_path: Path) -> None:
    """The emitted masked gather, run on the host for every rank of a 2 x 2 mesh whose two
    axes split the table's rows, gives what the reference gives each rank, and the ranks'
    outputs add up to the Gather."""
    mesh = Mesh("m", (2, 2))
    table, idx = f32(8, 3), i64(7, -1, 0, 3, -6, 4)
    g = Graph("shard")
    split = NdSbp((Sbp.split(0), Sbp.split(0)))
    x = g.add_input("x", TensorType((2, 3), DType.F32))
    ind = g.add_input("ind", TensorType(idx.shape, DType.I64))
    attrs = {"axis": 0, "mesh": mesh.shape, "shard_axes": (0, 1)}
    out_type = TensorType((6, 3), DType.F32)
    node = g.add_node("GatherShard", [x, ind], [out_type], attrs, output_names=["out"])
    rec = _KernelRecorder()
    opdef = get_op("GatherShard")
    assert opdef.emit is not None
    opdef.emit(rec, node)
    coords = all_coords(mesh)
    pieces = [shard(table, split, mesh, c) for c in coords]
    source = "\n".join(
        [
            "#include <cstdio>",
            '#include "flowc/device.h"',
            *rec.kernels,
            _c_array("float", "tables", np.stack(pieces)),
            _c_array("int64_t", "indices", idx),
            "int main() {",
            "  float *x, *out; int64_t* ind; int* error_flag;",
            "  cudaMalloc(&x, 6 * sizeof(float)); cudaMalloc(&out, 18 * sizeof(float));",
            "  cudaMalloc(&ind, 6 * sizeof(int64_t)); cudaMalloc(&error_flag, sizeof(int));",
            "  cudaMemcpy(ind, indices, 6 * sizeof(int64_t), cudaMemcpyHostToDevice);",
            "  cudaMemset(error_flag, 0, sizeof(int));",
            "  for (int r = 0; r < 4; ++r) {",
            "    const int coords[2] = {r / 2, r % 2};",
            "    cudaMemcpy(x, tables + 6 * r, 6 * sizeof(float), cudaMemcpyHostToDevice);",
            *(f"    {s}" for s in rec.statements),
            "    cudaDeviceSynchronize();",
            "    float host[18];",
            "    cudaMemcpy(host, out, sizeof(host), cudaMemcpyDeviceToHost);",
            '    for (float v : host) std::printf("%.9g ", v);',
            '    std::printf("\\n");',
            "  }",
            "  int flag = 0;",
            "  cudaMemcpy(&flag, error_flag, sizeof(int), cudaMemcpyDeviceToHost);",
            "  return flag;",
            "}",
        ]
    )
    (tmp_path / "gather_shard.cu").write_text(source)
    exe = tmp_path / "gather_shard"
    build = subprocess.run(
        host_compile_command([tmp_path / "gather_shard.cu"], exe), capture_output=True, text=True
    )
    assert build.returncode == 0, build.stderr
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    got = [np.array(line.split(), np.float32).reshape(6, 3) for line in ran.stdout.splitlines()]
    total = np.zeros((6, 3), np.float32)
    for c, piece, out in zip(coords, pieces, got, strict=True):
        want = opdef.evaluate([piece, idx], Attrs({**attrs, "coords": c}))[0]
        np.testing.assert_array_equal(out, want)
        total += out
    np.testing.assert_array_equal(total, get_op("Gather").evaluate([table, idx], Attrs())[0])
