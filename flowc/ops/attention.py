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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from flowc.codegen.cpp import c_float
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node
from flowc.ir.types import TensorType
from flowc.ops import sbp_rules as sr
from flowc.ops.reduce import kernel_ctype
from flowc.ops.registry import InferCtx, SbpSignature, defop, get_op

if TYPE_CHECKING:
    from flowc.codegen.program import Program

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


def _flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    q, k, v = ins[0], ins[1], ins[2]
    assert q is not None and k is not None and v is not None
    try:
        g = geometry(a, {"q": q.shape, "k": k.shape, "v": v.shape})
    except ValueError:
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


def _sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    """Batches and heads are independent: split either on every operand that has it."""
    a = ctx.attrs
    sigs = []
    for letter, at in (("b", 0), ("h", 1)):
        given: dict[int, sr.Sbp] = {}
        ok = True
        for i, w in enumerate(OPERANDS):
            ax = _split_axis(str(a[f"{w}_layout"]), letter)
            if ax is False:
                ok = False
            elif ax is not None:
                given[i] = sr.S(int(ax))
        out_ax = _split_axis(str(a["out_layout"]), letter)
        if not ok or out_ax is None or out_ax is False or not given:
            continue
        for i in (3, 4):
            if ctx.has(i):
                shape = ctx.shape(i)
                k = len(shape) - 4 + at
                if k >= 0 and shape[k] != 1:
                    given[i] = sr.S(k)
        sigs.append(sr.sig(ctx, given, sr.S(int(out_ax)), len(outs)))
    return sigs


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
    kern = prog.kernel(
        "attention.cu.j2",
        "flash_attention",
        qt=kernel_ctype(prog, q),
        kt=kernel_ctype(prog, k),
        vt=kernel_ctype(prog, v),
        ot=kernel_ctype(prog, y),
        mt=kernel_ctype(prog, mask) if mask is not None else "float",
        d=g.d,
        dv=g.dv,
        bm=bm,
        bn=bn,
        tpr=TPR,
        has_mask=mask is not None,
        where=where,
        mask_first=bool(int(a["mask_first"])),
        causal=bool(int(a["causal"])),
        nan_zero=bool(int(a["nan_zero"])),
    )

    def strided(expr: str, view: Operand) -> list[str]:
        base = f"{expr} + {view.offset}" if view.offset else expr
        return [base, *(f"(int64_t){s}" for s in view.strides)]

    args = [
        *strided(prog.cptr(q), g.views["q"]),
        *strided(prog.cptr(k), g.views["k"]),
        *strided(prog.cptr(v), g.views["v"]),
    ]
    if mask is not None:
        args += [prog.cptr(mask), *(f"(int64_t){s}" for s in mask_strides(mask.type.shape, g))]
    if cond is not None:
        args += [prog.cptr(cond), *(f"(int64_t){s}" for s in mask_strides(cond.type.shape, g))]
    args += strided(prog.ptr(y), g.views["out"])
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
    },
    inputs=(3, 5),
    flops=_flops,
    sbp=_sbp,
    emit=_emit,
)
