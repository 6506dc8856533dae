"""Philox4x32-10 in NumPy: the twin of runtime_cpp/flowc/philox.h, vectorized over counters.

Salmon, Moraes, Dror and Shaw's counter-based generator (SC 2011; Random123): four 32-bit
words from a 128-bit counter and a 64-bit key in ten rounds of two 32x32->64 multiplies, the
key bumped by a Weyl sequence between rounds. Random bits that are a pure function of
(key, counter) are what training needs: a dropout mask keyed by seed, step and the element's
logical index is the same on the host and the GPU, in the forward and when the backward
computes it again, and under any later split of the tensor over devices. Tested against
Random123's published known-answer vectors (tests/test_philox.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from flowc.codegen.cpp import c_float
from flowc.errors import ShapeError
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node, make_splat
from flowc.ir.types import TensorType
from flowc.ops import grad
from flowc.ops import sbp_rules as sr
from flowc.ops.registry import InferCtx, SbpSignature, defop

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.builder import AdapterNode
    from flowc.ir.graph import Value

M0, M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
W0, W1 = 0x9E3779B9, 0xBB67AE85
_LOW = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


def philox4x32_10(counter: np.ndarray, key: tuple[int, int]) -> np.ndarray:
    """The generator's blocks: ``counter`` (..., 4) uint32 words, ``key`` two 32-bit words;
    returns (..., 4) uint32."""
    c = np.asarray(counter, dtype=np.uint32).astype(np.uint64)
    if c.shape[-1:] != (4,):
        raise ValueError(f"a Philox counter is 4 words, got shape {c.shape}")
    c0, c1, c2, c3 = (c[..., i] for i in range(4))
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for r in range(10):
        if r > 0:
            k0, k1 = (k0 + W0) & 0xFFFFFFFF, (k1 + W1) & 0xFFFFFFFF
        p0, p1 = M0 * c0, M1 * c2
        hi0, lo0 = p0 >> _SHIFT, p0 & _LOW
        hi1, lo1 = p1 >> _SHIFT, p1 & _LOW
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def to_unit_float(words: np.ndarray) -> np.ndarray:
    """Words' top 24 bits as float32 in [0, 1) (philox.h's to_unit_float: exact)."""
    return (np.asarray(words, dtype=np.uint32) >> np.uint32(8)).astype(np.float32) * np.float32(
        1.0 / 16777216.0
    )


# -- TrainDropout ------------------------------------------------------------------------------
#
# Dropout as a training step runs it: y = x * keep / (1 - ratio), keep = u >= ratio, where u
# is element i's uniform float from the Philox block of counter (i / 4 low and high words,
# the node's stream, the step) and key (the seed's low and high words), word i % 4. The mask
# is a pure function of (seed, stream, step, i): the backward applies the same op to the
# gradient, recomputing the mask instead of keeping it. Inputs: x (float), step (int64
# scalar: the step counter the training program keeps on the device).

FAMILY = "random"
# offset: x's elements are elements offset.. of the tensor whose masks it draws (micro-batch
# k of a step's micro-batches: k times its size, flowc.training.step).
DROPOUT_ATTRS = {"ratio": 0.5, "seed": 0, "stream": 0, "offset": 0}
# The step counter a training program keeps (flowc.training.step's state): the graph input a
# model's training dropouts read, made at import by the first of them.
STEP_INPUT = "train/step"


def import_train_dropout(n: AdapterNode, x: Value) -> list[Value]:
    """An ONNX Dropout with training_mode on, in a model imported to train it: TrainDropout
    of the step counter (the graph input STEP_INPUT), stream k for the model's k-th dropout;
    the seed is the training's (build_step sets it). A mask output, when asked for, is the
    same draw applied to ones."""
    ratio_v = n.input(1)
    if ratio_v is not None and ratio_v.const is None:
        raise ShapeError(
            f"Dropout node {n.name!r}: input 1 (ratio) must be known at compile time",
            hint="export the model with a constant dropout ratio",
        )
    ratio = 0.5 if ratio_v is None or ratio_v.const is None else float(ratio_v.const.reshape(-1)[0])
    if not 0.0 <= ratio < 1.0:
        raise ShapeError(f"Dropout node {n.name!r}: ratio {ratio} is not in [0, 1)")
    graph = n.builder.graph
    step = next((v for v in graph.inputs if v.name == STEP_INPUT), None)
    if step is None:
        step = graph.add_input(STEP_INPUT, TensorType((), DType.I64))
    stream = sum(1 for node in graph.nodes if node.op == "TrainDropout")
    attrs = {"ratio": ratio, "seed": 0, "stream": stream}
    outs = n.emit("TrainDropout", [x, step], attrs)
    if len(n.output_names) > 1 and n.output_names[1]:
        ones = n.const("ones", make_splat(1, x.type.shape, x.type.dtype.np))
        kept = n.emit("TrainDropout", [ones, step], attrs, suffix="mask")[0]
        outs.append(n.emit("Cast", [kept], {"to": DType.BOOL.onnx}, suffix="mask_bool")[0])
    return outs


def seed_words(seed: int) -> tuple[int, int]:
    """The Philox key of a training seed: its low and high 32 bits."""
    return seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF


def dropout_keep(
    shape: tuple[int, ...], ratio: float, seed: int, stream: int, step: int
) -> np.ndarray:
    """The keep mask (bool, ``shape``) TrainDropout draws at ``step``: the NumPy reference
    of the kernel's, and what the tests inject into other references."""
    n = int(np.prod(shape, dtype=np.int64))
    blocks = (n + 3) // 4
    q = np.arange(blocks, dtype=np.uint64)
    counter = np.zeros((blocks, 4), np.uint32)
    counter[:, 0] = (q & _LOW).astype(np.uint32)
    counter[:, 1] = (q >> _SHIFT).astype(np.uint32)
    counter[:, 2] = np.uint32(stream & 0xFFFFFFFF)
    counter[:, 3] = np.uint32(step & 0xFFFFFFFF)
    u = to_unit_float(philox4x32_10(counter, seed_words(seed)).reshape(-1)[:n])
    return (u >= np.float32(ratio)).reshape(shape)


def _dropout_attrs(ctx: InferCtx) -> tuple[float, int, int]:
    ratio, seed, stream = ctx.attr("ratio"), ctx.attr("seed"), ctx.attr("stream")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio < 1.0:
        raise ctx.fail(f"ratio must be a number in [0, 1), got {ratio!r}")
    for name, v in (("seed", seed), ("stream", stream)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**63:
            raise ctx.fail(f"{name} must be an integer in [0, 2**63), got {v!r}")
    return float(ratio), int(seed), int(stream)


def _dropout_infer(ctx: InferCtx) -> list[TensorType]:
    _dropout_attrs(ctx)
    x, step = ctx.type(0), ctx.type(1)
    if not x.dtype.is_float:
        raise ctx.fail(f"x must be a float tensor, got {x}")
    if step.dtype != DType.I64 or step.rank != 0:
        raise ctx.fail(f"step must be an int64 scalar (the step counter), got {step}")
    return [x]


def _dropout_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, step = xs[0], xs[1]
    assert x is not None and step is not None
    ratio, off = float(a["ratio"]), int(a.get("offset", 0))
    keep = dropout_keep((off + x.size,), ratio, int(a["seed"]), int(a["stream"]), int(step))
    return _masked(x, keep[off:].reshape(x.shape), ratio)


def _masked(x: np.ndarray, keep: np.ndarray, ratio: float) -> np.ndarray:
    """x where kept, scaled by 1 / (1 - ratio); 0 where dropped."""
    scale = np.asarray(1.0 / (1.0 - ratio), dtype=x.dtype)
    return np.where(keep, x * scale, np.zeros((), x.dtype)).astype(x.dtype)


def _kernel_params(prog: Program, x: Value, a: Attrs) -> dict[str, str]:
    """What both dropout kernels take: the element type, threshold, kept scale, TrainDropout's
    stream and the seed's Philox key words."""
    ratio = float(a["ratio"])
    k0, k1 = seed_words(int(a["seed"]))
    return {
        "ctype": prog.ctype(x),
        "ratio": c_float(ratio),
        "scale": c_float(1.0 / (1.0 - ratio), prog.ctype(x)),
        "stream": f"{int(a['stream']) & 0xFFFFFFFF}u",
        "k0": f"{k0}u",
        "k1": f"{k1}u",
    }


def _dropout_emit(prog: Program, node: Node) -> None:
    x, step, out = node.inputs[0], node.inputs[1], node.outputs[0]
    assert x is not None and step is not None
    a = node.attrs.merged(DROPOUT_ATTRS)
    if int(a["offset"]):
        # Elements offset..: the shard kernel's per-element index, from there.
        shape = list(x.type.shape) or [1]
        name = prog.kernel(
            "elementwise.cu.j2",
            "train_dropout_shard",
            **_kernel_params(prog, x, a),
            local=shape,
            strides=[math.prod(shape[d + 1 :]) for d in range(len(shape))],
            split=[False] * len(shape),
            base=int(a["offset"]),
        )
        n = out.type.numel
        prog.launch(name, n, [prog.cptr(x), prog.cptr(step), prog.ptr(out), f"(int64_t){n}"])
        return
    name = prog.kernel(
        "elementwise.cu.j2",
        "train_dropout",
        **_kernel_params(prog, x, node.attrs.merged(DROPOUT_ATTRS)),
    )
    n = out.type.numel
    # A thread per Philox block: four elements each.
    prog.launch(name, (n + 3) // 4, [prog.cptr(x), prog.cptr(step), prog.ptr(out), f"(int64_t){n}"])


def _dropout_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    # The same mask and scale on the gradient: the op again, with the same key and step.
    g, step = gouts[0], node.inputs[1]
    if g is None or not need[0] or step is None:
        return [None, None]
    return [b.emit("TrainDropout", [g, step], dict(node.attrs))[0], None]


def _dropout_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    """Linear in x (P -> P, the same mask on every device); split on any axis, each rank
    runs TrainDropoutShard, which draws its elements' masks by their indices in the whole
    tensor: every plan draws the one-device masks."""
    return [
        sr.partial(ctx, outs),
        *(
            sr.sig(ctx, {0: sr.S(d)}, sr.S(d), 1, physical="TrainDropoutShard")
            for d in range(len(ctx.shape(0)))
        ),
    ]


defop(
    "TrainDropout",
    FAMILY,
    infer=_dropout_infer,
    reference=_dropout_ref,
    attrs=DROPOUT_ATTRS,
    inputs=2,
    emit=_dropout_emit,
    sbp=_dropout_sbp,
    vjp=_dropout_vjp,
)


# TrainDropoutShard: TrainDropout on one rank's shard of x, split along the tensor axes
# ``shard_dims`` by the mesh axes ``shard_axes`` (of the mesh of shape ``mesh``; several mesh
# axes on one tensor axis count in mixed radix, mesh axis 0 outermost, as flowc.ir.layout
# numbers chunks). Each element's mask is that of its index in the whole tensor, so the
# masks are the one-device run's. The reference reads the rank's coordinates from the
# ``coords`` attribute the simulator adds; generated code reads them at run time.
SHARD_ATTRS = {
    **DROPOUT_ATTRS,
    "mesh": None,
    "shard_axes": None,
    "shard_dims": None,
    "microbatch": 0,
}


def _shard_geometry(a: Attrs, local: tuple[int, ...]) -> tuple[tuple[int, ...], list[list[int]]]:
    """The whole tensor's shape, and per tensor axis the (mesh axis, size) digits of its
    chunk number, most significant first."""
    mesh, axes, dims = a["mesh"], a["shard_axes"], a["shard_dims"]
    digits: list[list[int]] = [[] for _ in local]
    for m, d in sorted(zip(axes, dims, strict=True)):
        digits[d].append(m)
    whole = tuple(n * math.prod(int(mesh[m]) for m in digits[d]) for d, n in enumerate(local))
    return whole, digits


def _dropout_shard_infer(ctx: InferCtx) -> list[TensorType]:
    mesh, axes, dims = (ctx.attrs.get(k) for k in ("mesh", "shard_axes", "shard_dims"))
    rank = ctx.type(0).rank
    if (
        not mesh
        or not axes
        or dims is None
        or len(axes) != len(dims)
        or any(not 0 <= m < len(mesh) for m in axes)
        or any(not 0 <= d < rank for d in dims)
    ):
        raise ctx.fail(
            f"shard_axes {axes} and shard_dims {dims} must pair mesh {mesh}'s axes with x's"
        )
    return _dropout_infer(ctx)


def _dropout_shard_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, step = xs[0], xs[1]
    assert x is not None and step is not None
    whole, digits = _shard_geometry(a, x.shape)
    box = []
    for d, n in enumerate(x.shape):
        chunk = 0
        for m in digits[d]:
            chunk = chunk * int(a["mesh"][m]) + int(a["coords"][m])
        box.append(slice(chunk * n, (chunk + 1) * n))
    ratio, off = float(a["ratio"]), int(a.get("offset", 0))
    n = math.prod(whole)
    keep = dropout_keep((off + n,), ratio, int(a["seed"]), int(a["stream"]), int(step))
    return _masked(x, keep[off:].reshape(whole)[tuple(box)], ratio)


def _dropout_shard_emit(prog: Program, node: Node) -> None:
    x, step, out = node.inputs[0], node.inputs[1], node.outputs[0]
    assert x is not None and step is not None
    a = node.attrs.merged(SHARD_ATTRS)
    local = x.type.shape
    whole, digits = _shard_geometry(a, local)
    strides = [math.prod(whole[d + 1 :]) for d in range(len(whole))]
    name = prog.kernel(
        "elementwise.cu.j2",
        "train_dropout_shard",
        **_kernel_params(prog, x, a),
        local=list(local),
        strides=strides,
        split=[bool(g) for g in digits],
        base=int(a["offset"]),
    )
    offsets = []
    for d, n in enumerate(local):
        if digits[d]:
            chunk = "0"
            for m in digits[d]:
                chunk = (
                    f"({chunk}) * {int(a['mesh'][m])} + static_cast<int64_t>({prog.mesh_coord(m)})"
                )
            offsets.append(f"({chunk}) * {n}")
    prog.launch(
        name,
        out.type.numel,
        [prog.cptr(x), prog.cptr(step), prog.ptr(out), f"(int64_t){out.type.numel}", *offsets],
    )


defop(
    "TrainDropoutShard",
    FAMILY,
    infer=_dropout_shard_infer,
    reference=_dropout_shard_ref,
    attrs=SHARD_ATTRS,
    inputs=2,
    emit=_dropout_shard_emit,
)
