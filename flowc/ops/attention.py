"""FusedAttention: softmax(scale * Q K^T [+ mask] [where cond]) V in one kernel, per head.

The fuse_attention pass (flowc/passes/fuse_attention.py) builds this node from what
exporters emit; no ONNX model names it. The logical problem has four axes per operand,
``b`` (batch), ``h`` (heads), ``s`` (sequence: the query's for Q and the output, the key's
for K and V) and ``d`` (features: the head dim of Q and K, the value head dim of V and the
output). Each operand is read where its producer left it, through strides: a *layout*
attribute says which of those letters each axis of the operand's tensor holds, outer to
inner, so that Q = Reshape(B,S,H,D) + Transpose(0,2,1,3) of a (B,S,H*D) projection is read
from the projection itself with layout ``b,s,hd``, and a Split of a fused (B,S,3E)
projection as chunk k of ``b,s,chd`` (``c``: the chunk, its count and index in ``*_chunk``).
``1`` is an axis of size 1; a letter an operand lacks is broadcast (a key shared by heads).
The output's layout folds the Transpose(0,2,1,3) + Reshape(B,S,H*D) that follows.

The layouts are relative to the tensors' shapes and ``sizes`` holds the global letter sizes
(B, H, Sq, Sk, D, Dv): on one rank of a mesh, an axis smaller than its letters' product is
split on its first letter (b or h, the only axes the SBP signatures split), so inference
and the kernel derive each rank's sizes and strides from its own shapes.

Scores: ``scale`` * Q K^T; then the optional additive ``mask`` (input 3, broadcast to
[b, h, Sq, Sk] aligned from the right) and the optional ``where`` (input 4, a bool
condition: "keep_true" keeps the score where it holds and puts ``where_fill`` elsewhere,
"keep_false" the other way round), in the order ``mask_first`` says; ``causal`` excludes
keys after the query's position (j > i + Sk - Sq), which the pass sets only where the model
puts a fill so negative that exp underflows to 0 there anyway, so the result is the same.
Softmax over the keys, ``nan_zero`` maps NaN probabilities to 0 (PyTorch's SDPA export
guards fully masked rows so), then the weighted sum of V. The kernel computes in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from flowc.codegen.cpp import c_float
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node
from flowc.ir.symbolic import SymDim, evaluate
from flowc.ir.types import TensorType
from flowc.ops import grad
from flowc.ops import sbp_rules as sr
from flowc.ops.random import dropout_keep, seed_words
from flowc.ops.reduce import kernel_ctype
from flowc.ops.registry import InferCtx, SbpSignature, defop, get_op, set_vjp

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.graph import Value

FAMILY = "attention"
OP = "FusedAttention"
OPERANDS = ("q", "k", "v")
WHERE_MODES = ("none", "keep_true", "keep_false")
# Threads per query row: they split the row's keys for the scores and its output features
# for the weighted sum (lanes of one warp: their max and sum meet by shuffles).
TPR = 4
# Static shared memory a block may use (48 KiB is every CUDA device's static limit).
SHARED_LIMIT = 48 * 1024
# Query-row and key tile sizes tried in order, biggest first.
TILES = ((32, 32), (32, 16), (16, 16), (16, 8), (8, 8))


def parse_layout(text: str) -> list[str]:
    """A layout attribute as one letter string per axis ("" for a size-1 axis)."""
    return ["" if a == "1" else a for a in text.split(",")]


def format_layout(axes: list[str]) -> str:
    return ",".join(a or "1" for a in axes)


def tile_shape(d: int, dv: int) -> tuple[int, int] | None:
    """(query rows, keys) per tile whose shared memory fits, or None when none does."""
    for bm, bn in TILES:
        floats = bm * (d + 1) + bn * (d + 1) + bn * dv + bm * (bn + 1)
        if floats * 4 <= SHARED_LIMIT:
            return bm, bn
    return None


@dataclass(frozen=True)
class Operand:
    """Where one operand's logical [b, h, s, d] elements lie in its tensor."""

    offset: int
    strides: tuple[int, int, int, int]  # elements, for b, h, s, d (0: broadcast)


def _global_letters(a: Attrs, which: str) -> dict[str, int]:
    b, h, sq, sk, d, dv = (int(x) for x in a["sizes"])
    chunk = a[f"{which}_chunk"]
    count = int(chunk[1])
    if which == "q":
        return {"b": b, "h": h, "s": sq, "d": d, "c": count}
    if which == "k":
        return {"b": b, "h": h, "s": sk, "d": d, "c": count}
    return {"b": b, "h": h, "s": sk, "d": dv, "c": count}


def local_letters(
    a: Attrs, which: str, shape: tuple[int, ...], fail: type[Exception] | None = None
) -> dict[str, int]:
    """The letter sizes of operand ``which`` (q, k, v) on a tensor of ``shape``: the global
    sizes, but where an axis is smaller than its letters' product (one rank's share of a
    split), its first letter shrinks by that factor. Letters the layout lacks are absent."""
    axes = parse_layout(str(a[f"{which}_layout"]))
    g = _global_letters(a, which)
    if len(axes) != len(shape):
        raise ValueError(f"{which} has rank {len(shape)}, its layout {len(axes)} axes")
    out: dict[str, int] = {}
    for letters, n in zip(axes, shape, strict=True):
        want = math.prod(g[c] for c in letters)
        sizes = {c: g[c] for c in letters}
        if want != n:
            first = letters[:1]
            if not first or first not in "bh" or n <= 0 or want % n or g[first] % (want // n):
                raise ValueError(
                    f"{which}'s axis of size {n} does not hold its layout's letters "
                    f"{letters or '1'} (sizes {sizes})"
                )
            sizes[first] = g[first] // (want // n)
        out.update(sizes)
    return out


def operand_view(
    layout: str, shape: tuple[int, ...], letters: dict[str, int], chunk_index: int
) -> Operand:
    """Offset and b, h, s, d strides (elements) of an operand of ``shape`` (row-major)."""
    axes = parse_layout(layout)
    strides = {c: 0 for c in "bhsdc"}
    step = 1
    for ax in range(len(axes) - 1, -1, -1):
        inner = step
        for c in reversed(axes[ax]):
            strides[c] = inner
            inner *= letters[c]
        step *= shape[ax]
    return Operand(
        chunk_index * strides["c"], (strides["b"], strides["h"], strides["s"], strides["d"])
    )


@dataclass(frozen=True)
class Geometry:
    """One node's (or one rank's) logical sizes and its operands' views."""

    b: int
    h: int
    sq: int
    sk: int
    d: int
    dv: int
    views: dict[str, Operand]  # q, k, v, out
    out_shape: tuple[int, ...]


def geometry(a: Attrs, shapes: dict[str, tuple[int, ...]]) -> Geometry:
    """From the q, k, v shapes: the sizes and views; ValueError when they do not agree."""
    lets = {w: local_letters(a, w, shapes[w]) for w in OPERANDS}
    b = max(lets[w].get("b", 1) for w in OPERANDS)
    h = max(lets[w].get("h", 1) for w in OPERANDS)
    for w in OPERANDS:
        for c, n in (("b", b), ("h", h)):
            if lets[w].get(c, 1) not in (1, n):
                raise ValueError(f"{w} has {c} = {lets[w][c]}, another operand {n}")
    # A letter of size 1 may be left out of a layout.
    sq, sk = lets["q"].get("s", 1), lets["k"].get("s", 1)
    d, dv = lets["q"].get("d", 1), lets["v"].get("d", 1)
    if lets["v"].get("s", 1) != sk or lets["k"].get("d", 1) != d:
        raise ValueError(
            f"k ({sk} keys of {lets['k'].get('d', 1)}) and v ({lets['v'].get('s', 1)} keys) "
            f"do not match q's head dim {d}"
        )
    out_letters = {"b": b, "h": h, "s": sq, "d": dv}
    out_axes = parse_layout(str(a["out_layout"]))
    out_shape = tuple(math.prod(out_letters[c] for c in ax) for ax in out_axes)
    views = {
        w: operand_view(
            str(a[f"{w}_layout"]),
            shapes[w],
            lets[w],
            int(a[f"{w}_chunk"][0]),
        )
        for w in OPERANDS
    }
    views["out"] = operand_view(str(a["out_layout"]), out_shape, out_letters, 0)
    return Geometry(b, h, sq, sk, d, dv, views, out_shape)


def mask_strides(shape: tuple[int, ...], g: Geometry) -> tuple[int, int, int, int]:
    """Element strides over [b, h, i, j] of a mask broadcast to the scores (right-aligned);
    ValueError when it does not broadcast to them."""
    full = (g.b, g.h, g.sq, g.sk)
    if len(shape) > 4:
        raise ValueError(f"a mask of rank {len(shape)} (at most 4)")
    out = [0, 0, 0, 0]
    step = 1
    for k in range(len(shape) - 1, -1, -1):
        at = 4 - len(shape) + k
        if shape[k] != 1:
            if shape[k] != full[at]:
                raise ValueError(
                    f"a mask of shape {list(shape)} does not broadcast to {list(full)}"
                )
            out[at] = step
        step *= shape[k]
    return out[0], out[1], out[2], out[3]


def _shapes(ctx: InferCtx) -> dict[str, tuple[int, ...]]:
    return {w: ctx.shape(i) for i, w in enumerate(OPERANDS)}


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_attrs(ctx: InferCtx) -> None:
    """The attributes' types and forms (a DSL program may write anything)."""
    a = ctx.attrs
    if "sizes" not in a:
        raise ctx.fail("needs sizes=[B, H, Sq, Sk, D, Dv] (the global letter sizes)")
    sizes = a["sizes"]
    if not (
        isinstance(sizes, tuple) and len(sizes) == 6 and all(_is_int(n) and n >= 1 for n in sizes)
    ):
        raise ctx.fail(f"sizes must be 6 positive integers [B, H, Sq, Sk, D, Dv], not {sizes!r}")
    for w in (*OPERANDS, "out"):
        text = a[f"{w}_layout"]
        allowed = "bhsdc" if w != "out" else "bhsd"
        axes = parse_layout(text) if isinstance(text, str) else None
        letters = "".join(axes or [])
        if (
            axes is None
            or any(ax != "" and not set(ax) <= set(allowed) for ax in axes)
            or len(set(letters)) != len(letters)
            or any(ax == "" for ax in str(text).split(","))
        ):
            raise ctx.fail(
                f"{w}_layout must name each of the letters {allowed} at most once, axes "
                f"separated by commas ('1': a size-1 axis), not {text!r}"
            )
        if w == "out":
            continue
        chunk = a[f"{w}_chunk"]
        if not (
            isinstance(chunk, tuple)
            and len(chunk) == 2
            and all(_is_int(n) for n in chunk)
            and 0 <= chunk[0] < chunk[1]
            and (chunk[1] > 1) == ("c" in letters)
        ):
            raise ctx.fail(
                f"{w}_chunk must be [index, count] with 0 <= index < count, count > 1 exactly "
                f"when {w}_layout has the chunk letter c; got {chunk!r}"
            )
    for name in ("scale", "where_fill"):
        if not isinstance(a[name], (int, float, np.number)) or isinstance(a[name], bool):
            raise ctx.fail(f"{name} must be a number, not {a[name]!r}")
    for name in ("mask_first", "causal", "nan_zero"):
        if a[name] not in (0, 1) or isinstance(a[name], float):
            raise ctx.fail(f"{name} must be 0 or 1, not {a[name]!r}")
    if str(a["where"]) not in WHERE_MODES:
        raise ctx.fail(f"where must be one of {', '.join(WHERE_MODES)}, not {a['where']!r}")
    ratio = a["dropout"]
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio < 1.0:
        raise ctx.fail(f"dropout must be a number in [0, 1), not {ratio!r}")
    for name in ("dropout_stream", "seed"):
        v = a[name]
        if not _is_int(v) or not 0 <= v < 2**63:
            raise ctx.fail(f"{name} must be an integer in [0, 2**63), not {v!r}")


def _check_dropout_key(ctx: InferCtx, at: int) -> None:
    """A training dropout on the probabilities (dropout > 0) reads its key (the step, an
    int64 scalar) at input ``at``; without one there is no such input."""
    wants = float(ctx.attrs["dropout"]) > 0.0
    if ctx.has(at) != wants:
        raise ctx.fail(
            f"dropout > 0 goes with its key (input {at}, the step as an int64 scalar), and "
            "only then"
        )
    if wants and (ctx.dtype(at) != DType.I64 or ctx.shape(at) != ()):
        raise ctx.fail(f"the dropout key (input {at}) must be an int64 scalar")


def _infer(ctx: InferCtx) -> list[TensorType]:
    _check_attrs(ctx)
    a = ctx.attrs
    for i in (0, 1, 2):
        if not ctx.dtype(i).is_float:
            raise ctx.fail(f"needs floating-point operands, got {ctx.dtype(i)} at input {i}")
    dt = ctx.dtype(0)
    code = a["out_dtype"]
    if code != 0:
        try:
            dt = DType.from_onnx(int(code))
        except (ValueError, KeyError, TypeError):
            raise ctx.fail(f"out_dtype {code!r} is not an ONNX element type") from None
        if not dt.is_float:
            raise ctx.fail(f"out_dtype must be a floating-point type, not {dt}")
    try:
        g = geometry(a, _shapes(ctx))
        if ctx.has(3):
            if not ctx.dtype(3).is_float:
                raise ctx.fail(f"the additive mask must be floating-point, got {ctx.dtype(3)}")
            mask_strides(ctx.shape(3), g)
        if ctx.has(4):
            if ctx.dtype(4) != DType.BOOL:
                raise ctx.fail(f"the where condition must be bool, got {ctx.dtype(4)}")
            mask_strides(ctx.shape(4), g)
    except ValueError as e:
        raise ctx.fail(str(e)) from None
    if ctx.has(4) != (str(a["where"]) != "none"):
        raise ctx.fail("a where condition (input 4) goes with where != none, and only then")
    _check_dropout_key(ctx, 5)
    return [TensorType(g.out_shape, dt)]


def _logical(x: np.ndarray, view: Operand, shape4: tuple[int, int, int, int]) -> np.ndarray:
    flat = np.ascontiguousarray(x).reshape(-1)
    item = flat.itemsize
    return np.lib.stride_tricks.as_strided(
        flat[view.offset :], shape4, tuple(s * item for s in view.strides), writeable=False
    )


def _reference(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    q, k, v = xs[0], xs[1], xs[2]
    assert q is not None and k is not None and v is not None
    g = geometry(a, {"q": q.shape, "k": k.shape, "v": v.shape})
    wide = np.promote_types(q.dtype, np.float32)
    ql = _logical(q, g.views["q"], (g.b, g.h, g.sq, g.d)).astype(wide)
    kl = _logical(k, g.views["k"], (g.b, g.h, g.sk, g.d)).astype(wide)
    vl = _logical(v, g.views["v"], (g.b, g.h, g.sk, g.dv)).astype(wide)
    with np.errstate(all="ignore"):
        s = np.matmul(ql, np.swapaxes(kl, -1, -2)) * wide.type(float(a["scale"]))

        def add(s: np.ndarray) -> np.ndarray:
            m = xs[3] if len(xs) > 3 else None
            return s if m is None else s + m.astype(wide)

        def where(s: np.ndarray) -> np.ndarray:
            c = xs[4] if len(xs) > 4 else None
            if c is None:
                return s
            fill = wide.type(float(a["where_fill"]))
            keep = c.astype(bool) if a["where"] == "keep_true" else ~c.astype(bool)
            return np.where(keep, s, fill)

        s = where(add(s)) if int(a["mask_first"]) else add(where(s))
        if int(a["causal"]):
            i = np.arange(g.sq)[:, None]
            j = np.arange(g.sk)[None, :]
            s = np.where(j > i + (g.sk - g.sq), -np.inf, s)
        e = np.exp(s - np.max(s, axis=-1, keepdims=True))
        p = e / np.sum(e, axis=-1, keepdims=True)
        if int(a["nan_zero"]):
            p = np.where(np.isnan(p), 0, p)
        p = p * _dropout_scale(a, g, xs[5] if len(xs) > 5 else None, _out_letters(a))
        o = np.matmul(p, vl)
    code = int(a["out_dtype"])
    out = np.zeros(g.out_shape, DType.from_onnx(code).np if code else q.dtype)
    view = g.views["out"]
    item = out.itemsize
    dst = np.lib.stride_tricks.as_strided(
        out.reshape(-1), (g.b, g.h, g.sq, g.dv), tuple(s * item for s in view.strides)
    )
    dst[...] = o.astype(out.dtype)
    return out


def _type_geometry(ins: list[TensorType | None], a: Attrs) -> Geometry | None:
    """The geometry of q, k, v's types (None when they do not agree: no FLOPs to count)."""
    q, k, v = ins[0], ins[1], ins[2]
    assert q is not None and k is not None and v is not None
    try:
        return geometry(a, {"q": q.shape, "k": k.shape, "v": v.shape})
    except ValueError:
        return None


def _dropout_params(a: Attrs) -> dict[str, object]:
    """The kernels' dropout parameters (ratio 0: none): the keep threshold, the kept scale,
    TrainDropout's stream and the seed's Philox key words."""
    ratio = float(a["dropout"])
    k0, k1 = seed_words(int(a["seed"]))
    return {
        "dropout": ratio > 0.0,
        "ratio": c_float(ratio),
        "keep_scale": c_float(1.0 / (1.0 - ratio)),
        "stream": f"{int(a['dropout_stream']) & 0xFFFFFFFF}u",
        "k0": f"{k0}u",
        "k1": f"{k1}u",
    }


def _extra_args(
    prog: Program,
    g: Geometry,
    mask: Value | None,
    cond: Value | None,
    key: Value | None,
    a: Attrs,
    letters: Sequence[str],
) -> list[str]:
    """The kernels' optional arguments: the additive mask and the where condition with their
    [b, h, i, j] strides, then the dropout's key, the shard's first batch and head in the
    whole and the whole's head count (its mask's index)."""
    args: list[str] = []
    for x in (mask, cond):
        if x is not None:
            args += [prog.cptr(x), *(f"(int64_t){s}" for s in mask_strides(x.type.shape, g))]
    if key is not None:
        b0, h0 = _shard_offsets(prog, a, letters, g)
        args += [
            prog.cptr(key),
            f"(int64_t)({b0})",
            f"(int64_t)({h0})",
            f"(int64_t){int(a['sizes'][1])}",
        ]
    return args


def _strided(expr: str, view: Operand) -> list[str]:
    """A kernel's pointer and b, h, s, d stride arguments for an operand's view."""
    base = f"{expr} + {view.offset}" if view.offset else expr
    return [base, *(f"(int64_t){s}" for s in view.strides)]


def _dropout_scale(
    a: Attrs, g: Geometry, key: np.ndarray | None, letters: Sequence[str]
) -> np.ndarray | float:
    """The probabilities' dropout as a factor per [b, h, i, j]: 1 / (1 - ratio) where kept, 0
    where dropped, the mask TrainDropout draws over the unfused [b, h, Sq, Sk] probabilities
    (so fused and unfused draw the same); 1 without dropout."""
    ratio = float(a["dropout"])
    if ratio == 0.0 or key is None:
        return 1.0
    # A shard's part of the whole [B, H, Sq, Sk] mask (the simulator gives its coordinates).
    first = {}
    for letter, local in (("b", g.b), ("h", g.h)):
        chunk = 0
        for m in _shard_digits(a, letters)[letter]:
            chunk = chunk * int(a["mesh"][m]) + int(a["coords"][m])
        first[letter] = chunk * local
    b0 = int(a["dropout_batch0"])
    whole = (b0 + int(a["sizes"][0]), int(a["sizes"][1]), g.sq, g.sk)
    keep = dropout_keep(whole, ratio, int(a["seed"]), int(a["dropout_stream"]), int(key))
    keep = keep[b0 + first["b"] : b0 + first["b"] + g.b, first["h"] : first["h"] + g.h]
    return np.where(keep, 1.0 / (1.0 - ratio), 0.0)


def _flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    g = _type_geometry(ins, a)
    if g is None:
        return 0
    pairs = g.b * g.h * g.sq * g.sk
    # Two multiply-adds per (pair, feature) for Q K^T and P V; the softmax's max, exp
    # (4, as in elementwise), sum and scale per pair.
    return 2 * pairs * (g.d + g.dv) + 7 * pairs


def _split_axis(layout: str, letter: str) -> int | bool | None:
    """The axis to split for ``letter`` (its first letter), None when the operand lacks it
    (broadcast: B), False when the letter is inside an axis (no split)."""
    for ax, letters in enumerate(parse_layout(layout)):
        if letter in letters:
            return ax if letters[0] == letter else False
    return None


def _signatures(
    ctx: InferCtx,
    outs: list[TensorType],
    operands: Mapping[int, str],
    masks: tuple[int, int],
    out_axis: Callable[[str], int | bool | None],
    physical: str,
) -> list[SbpSignature]:
    """Batches and heads are independent: split either on every operand that has it
    (``operands``: input index -> its layout attribute; ``masks``: the additive mask's and
    the where condition's inputs, split where they do not broadcast), every output on
    ``out_axis(letter)``. With a dropout of the probabilities the split runs ``physical``
    (the op itself, given its shard's place: the mask is drawn by the element's index in
    the whole [B, H, Sq, Sk])."""
    a = ctx.attrs
    dropout = float(a["dropout"]) > 0.0
    sigs = []
    for letter, at in (("b", 0), ("h", 1)):
        given: dict[int, sr.Sbp] = {}
        ok = True
        for i, attr in operands.items():
            ax = _split_axis(str(a[attr]), letter)
            if ax is False:
                ok = False
            elif ax is not None:
                given[i] = sr.S(int(ax))
        out_ax = out_axis(letter)
        if not ok or out_ax is None or out_ax is False or not given:
            continue
        for i in masks:
            if ctx.has(i):
                shape = ctx.shape(i)
                k = len(shape) - 4 + at
                if k >= 0 and shape[k] != 1:
                    given[i] = sr.S(k)
        sigs.append(
            sr.sig(ctx, given, sr.S(int(out_ax)), len(outs), physical=physical if dropout else None)
        )
    return sigs


def _sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    operands = {i: f"{w}_layout" for i, w in enumerate(OPERANDS)}
    out_layout = str(ctx.attrs["out_layout"])
    return _signatures(ctx, outs, operands, (3, 4), lambda c: _split_axis(out_layout, c), OP)


def _shard_digits(a: Attrs, out_letters: Sequence[str]) -> dict[str, list[int]]:
    """For the batch and head letters, the mesh axes that split them (the digits of the
    shard's chunk number, most significant first; none unsplit). ``out_letters``: the
    letter of each axis of output 0 (``shard_dims`` names those axes)."""
    digits: dict[str, list[int]] = {"b": [], "h": []}
    if a.get("mesh") and a.get("shard_axes"):
        for m, d in sorted(zip(a["shard_axes"], a["shard_dims"], strict=True)):
            digits[out_letters[d]].append(int(m))
    return digits


def _shard_offsets(
    prog: Program, a: Attrs, out_letters: Sequence[str], g: Geometry
) -> tuple[str, str]:
    """The shard's first batch and head in the whole, as C++ expressions of the rank's mesh
    coordinates ("0" unsplit; the batch after dropout_batch0)."""
    out = []
    for letter, local in (("b", g.b), ("h", g.h)):
        chunk = "0"
        for m in _shard_digits(a, out_letters)[letter]:
            chunk = f"({chunk}) * {int(a['mesh'][m])} + static_cast<int64_t>({prog.mesh_coord(m)})"
        out.append(f"({chunk}) * {local}")
    # A micro-batch's batches start further on in the step's (dropout_batch0).
    return f"{int(a['dropout_batch0'])} + {out[0]}", out[1]


def _out_letters(a: Attrs) -> list[str]:
    return [axis[0] if axis else "" for axis in parse_layout(str(a["out_layout"]))]


def _emit_sized(prog: Program, node: Node, a: Attrs, kernel: dict[str, Any], bm: int) -> None:
    """The kernel of a program with symbolic dims: the bound's tiles and head dims; its
    offsets, strides, lengths and block count computed in the kernel from the run's size
    table (polynomials of the sizes, Program.sized_ints), rows and keys past the run's lengths
    masked as at any length. Its grid covers the sizes on the host (run()'s hdims: a size
    bucket's, under a CUDA Graph); blocks past the run's exit."""
    q, k, v = node.inputs[0], node.inputs[1], node.inputs[2]
    mask = node.inputs[3] if len(node.inputs) > 3 else None
    cond = node.inputs[4] if len(node.inputs) > 4 else None
    y = node.outputs[0]
    assert q is not None and k is not None and v is not None
    if len(node.inputs) > 5 and node.inputs[5] is not None:
        raise prog.fail("a training dropout with symbolic dims has no kernel")

    letters: tuple[SymDim | int, ...] = node.sym_attrs.get("sizes") or tuple(a["sizes"])
    names = [f"{w}{s}" for w in ("q", "k", "v", "o") for s in ("_at", "b", "h", "s", "d")]
    names = [n.replace("o_at", "out_at") for n in names]
    names += [f"m{s}" for s in "bhij"] if mask is not None else []
    names += [f"c{s}" for s in "bhij"] if cond is not None else []
    names += ["batch", "heads", "sq", "sk", "d", "dv"]

    def ints(at: Mapping[str, int]) -> list[int]:
        sizes = tuple(evaluate(x, at) for x in letters)
        here = Attrs({**a, "sizes": sizes})
        shapes = {w: x.type.shape_at(at) for w, x in zip(OPERANDS, (q, k, v), strict=True)}
        g = geometry(here, shapes)
        out: list[int] = []
        for w in ("q", "k", "v", "out"):
            out += [g.views[w].offset, *g.views[w].strides]
        for x in (mask, cond):
            if x is not None:
                out += mask_strides(x.type.shape_at(at), g)
        return [*out, g.b, g.h, g.sq, g.sk, g.d, g.dv]

    inside = dict(zip(names, prog.sized_ints(ints, "sizes"), strict=True))
    if not (inside.pop("d").isdigit() and inside.pop("dv").isdigit()):
        raise prog.fail("symbolic head dims have no kernel")
    b, h, sq = prog.sized_ints(ints)[-6:-3]
    kern = prog.kernel("attention.cu.j2", "flash_attention", **kernel, sized=inside)
    args = [prog.cptr(q), prog.cptr(k), prog.cptr(v)]
    args += [prog.cptr(x) for x in (mask, cond) if x is not None]
    args += [prog.ptr(y), c_float(float(a["scale"]))]
    if str(a["where"]) != "none":
        args.append(c_float(float(a["where_fill"])))
    blocks = f"static_cast<unsigned>(({b}) * ({h}) * ((({sq}) + {bm - 1}) / {bm}))"
    prog.launch_grid(kern, [blocks], bm * TPR, [*args, "ddims"])


def _sizeless(a: Attrs) -> Attrs:
    """The attributes without the letter sizes (which symbolic dims change; the emitter
    computes them at run time)."""
    return Attrs({k: v for k, v in a.items() if k != "sizes"})


def _emit(prog: Program, node: Node) -> None:
    q, k, v = node.inputs[0], node.inputs[1], node.inputs[2]
    mask = node.inputs[3] if len(node.inputs) > 3 else None
    cond = node.inputs[4] if len(node.inputs) > 4 else None
    y = node.outputs[0]
    assert q is not None and k is not None and v is not None
    a = node.attrs.merged(get_op(OP).attrs)
    if y.type.numel == 0:
        return
    for x in (q, k, v, y, mask):
        if x is not None and x.type.dtype not in (DType.F32, DType.F16, DType.BF16):
            raise prog.fail(
                f"the fused kernel reads float32, float16 or bfloat16, not {x.type.dtype}"
            )
    g = geometry(a, {"q": q.type.shape, "k": k.type.shape, "v": v.type.shape})
    tiles = tile_shape(g.d, g.dv)
    if tiles is None:
        raise prog.fail(
            f"head dims {g.d}/{g.dv} need more shared memory than a block has "
            "(fuse_attention leaves such heads unfused)"
        )
    bm, bn = tiles
    where = str(a["where"])
    kernel: dict[str, Any] = {
        "qt": kernel_ctype(prog, q),
        "kt": kernel_ctype(prog, k),
        "vt": kernel_ctype(prog, v),
        "ot": kernel_ctype(prog, y),
        "mt": kernel_ctype(prog, mask) if mask is not None else "float",
        "d": g.d,
        "dv": g.dv,
        "bm": bm,
        "bn": bn,
        "tpr": TPR,
        "has_mask": mask is not None,
        "where": where,
        "mask_first": bool(int(a["mask_first"])),
        "causal": bool(int(a["causal"])),
        "nan_zero": bool(int(a["nan_zero"])),
        **_dropout_params(a),
    }
    if prog.is_sized(node):
        _emit_sized(prog, node, a, kernel, bm)
        return
    kern = prog.kernel("attention.cu.j2", "flash_attention", **kernel)

    args = [
        *_strided(prog.cptr(q), g.views["q"]),
        *_strided(prog.cptr(k), g.views["k"]),
        *_strided(prog.cptr(v), g.views["v"]),
    ]
    key = node.inputs[5] if len(node.inputs) > 5 else None
    args += _extra_args(prog, g, mask, cond, key, a, _out_letters(a))
    args += _strided(prog.ptr(y), g.views["out"])
    args += [
        str(g.h),
        f"(int64_t){g.sq}",
        f"(int64_t){g.sk}",
        c_float(float(a["scale"])),
    ]
    if where != "none":
        args.append(c_float(float(a["where_fill"])))
    blocks = g.b * g.h * ((g.sq + bm - 1) // bm)
    prog.launch_blocks(kern, blocks, bm * TPR, 0, args)


defop(
    OP,
    FAMILY,
    infer=_infer,
    reference=_reference,
    attrs={
        "sizes": None,
        "q_layout": "b,h,s,d",
        "k_layout": "b,h,s,d",
        "v_layout": "b,h,s,d",
        "out_layout": "b,h,s,d",
        "q_chunk": (0, 1),
        "k_chunk": (0, 1),
        "v_chunk": (0, 1),
        "scale": 1.0,
        "where": "none",
        "where_fill": 0.0,
        "mask_first": 1,
        "causal": 0,
        "nan_zero": 0,
        # The output's ONNX element type; 0: q's.
        "out_dtype": 0,
        # A training dropout of the probabilities (TrainDropout's ratio, stream and seed;
        # its key, the step, is input 5): fused, it draws TrainDropout's mask.
        "dropout": 0.0,
        "dropout_stream": 0,
        "seed": 0,
        # Micro-batch k of a step's micro-batches (flowc.training.step): its batches are
        # batches dropout_batch0.. of the whole step's, whose masks it draws.
        "dropout_batch0": 0,
        # A split with a dropout (flowc.parallel.lower): the mesh, its axes that split and
        # the output axes they split, so the kernels find their shard's place in the whole.
        "mesh": None,
        "shard_axes": None,
        "shard_dims": None,
        "microbatch": 0,
    },
    inputs=(3, 6),
    flops=_flops,
    sbp=_sbp,
    emit=_emit,
    sized=True,
    sizeless=_sizeless,
)


# -- the gradient: FusedAttentionGrad, and FusedAttention's VJP ----------------------------------

GRAD_OP = "FusedAttentionGrad"
# Threads per block of the backward's row and column kernels (one thread per row, per key).
GRAD_THREADS = 128


def _grad_infer(ctx: InferCtx) -> list[TensorType]:
    """Inputs q, k, v, the forward's output o, its gradient do, then the forward's mask and
    where condition (absent or present as there); outputs dq, dk, dv contiguous [b, h, s, d]
    in q's type, and the rows' log-sum-exp and dO.O, [b, h, Sq, 2] float32."""
    _check_attrs(ctx)
    a = ctx.attrs
    try:
        g = geometry(a, _shapes(ctx))
    except ValueError as e:
        raise ctx.fail(str(e)) from None
    for i, what in ((3, "the output"), (4, "the output's gradient")):
        if ctx.shape(i) != g.out_shape:
            raise ctx.fail(f"{what} has shape {list(ctx.shape(i))}, not {list(g.out_shape)}")
    if ctx.has(6) != (str(a["where"]) != "none"):
        raise ctx.fail("a where condition (input 6) goes with where != none, and only then")
    _check_dropout_key(ctx, 7)
    dt = ctx.dtype(0)
    outs = [
        TensorType((g.b, g.h, g.sq, g.d), dt),
        TensorType((g.b, g.h, g.sk, g.d), dt),
        TensorType((g.b, g.h, g.sk, g.dv), dt),
        TensorType((g.b, g.h, g.sq, 2), DType.F32),
    ]
    if a["mask_grad"] not in (0, 1):
        raise ctx.fail(f"mask_grad must be 0 or 1, not {a['mask_grad']!r}")
    if int(a["mask_grad"]):
        if not ctx.has(5):
            raise ctx.fail("mask_grad=1 needs the additive mask (input 5)")
        outs.append(TensorType((g.b, g.h, g.sq, g.sk), DType.F32))
    return outs


def _scores(
    xs: list[np.ndarray | None], a: Attrs, g: Geometry, mask_at: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The forward's logical q, k, v (float64), its scores, where Q K^T reaches them and
    where the additive mask does."""
    q, k, v = xs[0], xs[1], xs[2]
    assert q is not None and k is not None and v is not None
    ql = _logical(q, g.views["q"], (g.b, g.h, g.sq, g.d)).astype(np.float64)
    kl = _logical(k, g.views["k"], (g.b, g.h, g.sk, g.d)).astype(np.float64)
    vl = _logical(v, g.views["v"], (g.b, g.h, g.sk, g.dv)).astype(np.float64)
    s = np.matmul(ql, np.swapaxes(kl, -1, -2)) * float(a["scale"])
    through = np.ones(s.shape, bool)
    mask_through = np.ones(s.shape, bool)
    m = xs[mask_at] if len(xs) > mask_at else None
    c = xs[mask_at + 1] if len(xs) > mask_at + 1 else None
    steps = ["add", "where"] if int(a["mask_first"]) else ["where", "add"]
    for step in steps:
        if step == "add" and m is not None:
            s = s + m.astype(np.float64)
        if step == "where" and c is not None:
            keep = c.astype(bool) if a["where"] == "keep_true" else ~c.astype(bool)
            keep = np.broadcast_to(keep, s.shape)
            s = np.where(keep, s, float(a["where_fill"]))
            through = through & keep
            if step == steps[-1]:  # the fill replaces what the mask added
                mask_through = mask_through & keep
    if int(a["causal"]):
        i = np.arange(g.sq)[:, None]
        j = np.arange(g.sk)[None, :]
        s = np.where(j > i + (g.sk - g.sq), -np.inf, s)
    return ql, kl, vl, s, through, mask_through


def _grad_reference(xs: list[np.ndarray | None], a: Attrs) -> list[np.ndarray]:
    q, k, v, o, do = xs[0], xs[1], xs[2], xs[3], xs[4]
    assert q is not None and k is not None and v is not None and o is not None and do is not None
    g = geometry(a, {"q": q.shape, "k": k.shape, "v": v.shape})
    ql, kl, vl, s, through, mask_through = _scores(xs, a, g, 5)
    view = g.views["out"]
    shape4 = (g.b, g.h, g.sq, g.dv)
    ol = _logical(o, view, shape4).astype(np.float64)
    dol = _logical(do, view, shape4).astype(np.float64)
    with np.errstate(all="ignore"):
        top = np.max(s, axis=-1, keepdims=True)
        total = np.sum(np.where(np.isinf(s), 0.0, np.exp(s - top)), axis=-1, keepdims=True)
        lse = np.where(total > 0, top + np.log(total), np.inf)
        p = np.where(np.isinf(lse) | np.isinf(s), 0.0, np.exp(s - lse))
    delta = np.sum(dol * ol, axis=-1, keepdims=True)
    # With dropout, O = (P * M) V: V's gradient weighs by P * M, and P's is M * dO V^T.
    drop = _dropout_scale(a, g, xs[7] if len(xs) > 7 else None, GRAD_LETTERS)
    dp = np.matmul(dol, np.swapaxes(vl, -1, -2)) * drop
    raw = p * (dp - delta)
    ds = np.where(through, raw, 0.0) * float(a["scale"])
    dt = q.dtype
    stats = np.concatenate([lse, delta], axis=-1).astype(np.float32)
    outs = [
        np.matmul(ds, kl).astype(dt),
        np.matmul(np.swapaxes(ds, -1, -2), ql).astype(dt),
        np.matmul(np.swapaxes(p * drop, -1, -2), dol).astype(dt),
        stats,
    ]
    if int(a["mask_grad"]):
        outs.append(np.where(mask_through & (p > 0), raw, 0.0).astype(np.float32))
    return outs


def _grad_flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    # The scores three times (the row sweeps twice, the columns once), dO.V twice, and the
    # three products into dQ, dK, dV.
    g = _type_geometry(ins, a)
    if g is None:
        return 0
    pairs = g.b * g.h * g.sq * g.sk
    return pairs * (3 * 2 * g.d + 2 * 2 * g.dv + 2 * (2 * g.d + g.dv) + 12)


# The backward's outputs (dq, dk, dv, the stats, dmask) are contiguous [b, h, ...].
GRAD_LETTERS = ("b", "h", "s", "d")


def _grad_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    """The forward's splits: q, k, v as laid out, the output and its gradient as the
    forward's output, the mask and condition (inputs 5, 6) where they do not broadcast;
    every output on b (axis 0) or h (axis 1)."""
    operands = {0: "q_layout", 1: "k_layout", 2: "v_layout", 3: "out_layout", 4: "out_layout"}
    return _signatures(ctx, outs, operands, (5, 6), GRAD_LETTERS.index, GRAD_OP)


def _grad_emit(prog: Program, node: Node) -> None:
    q, k, v, o, do = node.inputs[:5]
    mask = node.inputs[5] if len(node.inputs) > 5 else None
    cond = node.inputs[6] if len(node.inputs) > 6 else None
    dq, dk, dv, stats = node.outputs[:4]
    dmask = node.outputs[4] if len(node.outputs) > 4 else None
    assert q is not None and k is not None and v is not None and o is not None and do is not None
    a = node.attrs.merged(get_op(GRAD_OP).attrs)
    if dq.type.numel == 0 and dk.type.numel == 0:
        return
    for x in (q, k, v, o, do, dq, mask):
        if x is not None and x.type.dtype not in (DType.F32, DType.F16, DType.BF16):
            raise prog.fail(
                f"the fused backward reads float32, float16 or bfloat16, not {x.type.dtype}"
            )
    if o.type.dtype != do.type.dtype:
        raise prog.fail(f"the output is {o.type.dtype}, its gradient {do.type.dtype}")
    g = geometry(a, {"q": q.type.shape, "k": k.type.shape, "v": v.type.shape})
    where = str(a["where"])
    params = dict(
        qt=kernel_ctype(prog, q),
        kt=kernel_ctype(prog, k),
        vt=kernel_ctype(prog, v),
        ot=kernel_ctype(prog, o),
        mt=kernel_ctype(prog, mask) if mask is not None else "float",
        gt=kernel_ctype(prog, dq),
        d=g.d,
        dv=g.dv,
        has_mask=mask is not None,
        where=where,
        mask_first=bool(int(a["mask_first"])),
        causal=bool(int(a["causal"])),
        **_dropout_params(a),
    )
    rows = prog.kernel(
        "attention.cu.j2", "attention_grad_rows", mask_grad=dmask is not None, **params
    )
    cols = prog.kernel("attention.cu.j2", "attention_grad_cols", **params)

    out_view = g.views["out"]
    args = [
        *_strided(prog.cptr(q), g.views["q"]),
        *_strided(prog.cptr(k), g.views["k"]),
        *_strided(prog.cptr(v), g.views["v"]),
        prog.cptr(o) + (f" + {out_view.offset}" if out_view.offset else ""),
        *_strided(prog.cptr(do), out_view),
    ]
    key = node.inputs[7] if len(node.inputs) > 7 else None
    args += _extra_args(prog, g, mask, cond, key, a, GRAD_LETTERS)
    args += [
        prog.ptr(stats),
        f"(int64_t){g.b * g.h}",
        str(g.h),
        f"(int64_t){g.sq}",
        f"(int64_t){g.sk}",
        c_float(float(a["scale"])),
    ]
    if where != "none":
        args.append(c_float(float(a["where_fill"])))
    bh = g.b * g.h
    # The rows first (they write the stats the columns read), on the same stream.
    prog.launch_blocks(
        rows, (bh * g.sq + GRAD_THREADS - 1) // GRAD_THREADS, GRAD_THREADS, 0,
        [*args, prog.ptr(dq), *([prog.ptr(dmask)] if dmask is not None else [])],
    )  # fmt: skip
    prog.launch_blocks(
        cols, (bh * g.sk + GRAD_THREADS - 1) // GRAD_THREADS, GRAD_THREADS, 0,
        [*args, prog.ptr(dk), prog.ptr(dv)],
    )  # fmt: skip


defop(
    GRAD_OP,
    FAMILY,
    infer=_grad_infer,
    reference=_grad_reference,
    # The forward's, and mask_grad: 1 when the additive mask is trained (a fifth output, the
    # scores' gradient [b, h, Sq, Sk] float32, which only then exists).
    attrs={**get_op(OP).attrs, "mask_grad": 0},
    inputs=(5, 8),
    outputs=(4, 5),
    flops=_grad_flops,
    sbp=_grad_sbp,
    # It reads and writes bfloat16/float16 itself (computing in float32), as the forward.
    narrow=frozenset({DType.BF16, DType.F16}),
    emit=_grad_emit,
)


def _to_operand(b: grad.GradBuilder, gl: Value, a: Attrs, which: str, x: Value) -> Value:
    """A logical [b, h, s, d] gradient laid out as operand ``which`` is (tensor ``x``): summed
    over the letters it broadcasts, ordered as its layout's letters, its chunk of a fused
    projection placed among zeros, reshaped to the operand's shape."""
    axes = parse_layout(str(a[f"{which}_layout"]))
    letters = "".join(axes)
    missing = [k for k, c in enumerate("bhsd") if c not in letters]
    if missing:
        gl = grad.reduce_sum(b, gl, missing, keepdims=False)
    kept = [c for c in "bhsd" if c in letters]
    order = [c for c in letters if c != "c"]
    perm = [kept.index(c) for c in order]
    if perm != sorted(perm):
        gl = grad.op1(b, "Transpose", gl, perm=perm)
    if "c" in letters:
        at = letters.index("c")
        index, count = (int(n) for n in a[f"{which}_chunk"])
        gl = grad.op1(b, "Unsqueeze", gl, grad.ints(b, [at]))
        rank = gl.type.rank
        pads = [0] * (2 * rank)
        pads[at], pads[rank + at] = index, count - 1 - index
        gl = grad.op1(b, "Pad", gl, grad.ints(b, pads), mode="constant")
    return grad.reshape(b, gl, x.type.shape)


def _vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """The flash-style backward (FusedAttentionGrad: the scores recomputed, no [Sq, Sk]
    buffer), its gradients laid out as the operands. An additive mask that is trained (a
    position bias; an exporter's mask initializer imported as a parameter) gets the scores'
    gradient summed to its shape: the one case with an [Sq, Sk] buffer."""
    g = gouts[0]
    grads: list[Value | None] = [None] * len(node.inputs)
    mask_grad = len(node.inputs) > 3 and need[3] and node.inputs[3] is not None
    if g is None or not (any(need[:3]) or mask_grad):
        return grads
    q, k, v = node.inputs[0], node.inputs[1], node.inputs[2]
    assert q is not None and k is not None and v is not None
    a = node.attrs.merged(get_op(OP).attrs)
    extra = list(node.inputs[3:])
    ins: list[Value | None] = [q, k, v, node.outputs[0], g, *extra]
    attrs = {**dict(node.attrs), "mask_grad": int(mask_grad)}
    outs = b.emit(GRAD_OP, ins, attrs, num_outputs=5 if mask_grad else 4)
    for i, (which, gl, x) in enumerate((("q", outs[0], q), ("k", outs[1], k), ("v", outs[2], v))):
        if need[i]:
            grads[i] = _to_operand(b, gl, a, which, x)
    mask = node.inputs[3] if len(node.inputs) > 3 else None
    if mask_grad and mask is not None:
        dm = grad.unbroadcast(b, outs[4], mask.type.shape)
        if mask.type.dtype != dm.type.dtype:
            dm = grad.op1(b, "Cast", dm, to=mask.type.dtype.onnx)
        grads[3] = dm
    return grads


set_vjp(OP, _vjp)
