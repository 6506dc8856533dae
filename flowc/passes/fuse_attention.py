"""fuse_attention: scaled dot-product attention, as exporters spell it, becomes one
FusedAttention node (flowc/ops/attention.py), with its head split and K's transpose read
through strides instead of copied.

Matched per Softmax over the last axis, backwards from it:

- the scores' masks: an ``Add`` of a tensor that broadcasts to them (BERT's
  (1 - mask) * finfo.min, a causal constant) and a ``Where(cond, scores, fill)`` or
  ``Where(cond, fill, scores)`` with a scalar constant fill (GPT-2's causal mask), at most
  one of each, in either order;
- the scale: ``Mul``/``Div`` of the scores, of Q or of K by scalar constants (Sqrt of a
  constant has been folded by then);
- ``MatMul(Q, K^T)``; forwards from the Softmax, PyTorch's NaN guard
  ``Where(IsNaN(p), 0, p)`` or ONNX Attention's ``Where(fully_masked_rows, 0, p)`` with a
  constant condition that masks no row, when present, then ``MatMul(p, V)``;
- float Casts anywhere on the way (the rounding points of bf16/fp16 storage).

Every intermediate must feed only the next step (the scores are then never needed). Q, K
and V are followed back through Transpose, Reshape (Unsqueeze, Squeeze, Flatten), an
Expand over batches or heads (read with stride 0), one Split with equal chunks and the
scale Muls as long as their elements keep a fixed stride per logical axis; the output
forwards through Transpose and Reshape likewise, up to where batches or heads would
share an axis with another letter (so the Transpose(0,2,1,3) after the heads disappears;
the Reshape(B,S,H*D) after it stays, a view). What cannot be followed stays and is read
as it is. A constant mask that is 0 on and below the diagonal and at most -1e4 above it
(or a Where of such a condition with such a fill) becomes the ``causal`` flag: exp of
those scores underflows to 0, so skipping them gives the same result, and the kernel
skips the key tiles past the diagonal. Float32 (and float16/bfloat16 storage) only; heads
too big for a block's shared memory stay unfused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flowc.ir.dtype import DType
from flowc.ir.graph import Graph, Node, Value
from flowc.ops.attention import OP, format_layout, tile_shape
from flowc.ops.registry import get_op, node_attrs
from flowc.passes.live_uses import LiveUses
from flowc.passes.manager import register_pass

FLOATS = (DType.F32, DType.F16, DType.BF16)
# A fill or mask value at most this is "minus infinity" for the causal flag: exp(x - max)
# is exactly 0 in float32 (it underflows below -104) for any score within 9800 of the row's
# max. -1e4 takes in the older Hugging Face masks and finfo.min clamped to float16's range.
NEG_LARGE = -1e4

Layout = list[str]  # one letter string per axis, outer to inner ("" for size 1)


def _scalar(v: Value | None) -> float | None:
    """The value of a one-element float constant, else None."""
    if v is None or v.const is None or v.type.numel != 1 or not v.type.dtype.is_float:
        return None
    return float(np.asarray(v.const).reshape(-1)[0])


def _float_cast(node: Node | None) -> bool:
    """A Cast between float types: the narrow precisions' rounding points, which the fused
    kernel (computing in float32) reads through."""
    return (
        node is not None
        and node.op == "Cast"
        and node.inputs[0] is not None
        and node.inputs[0].type.dtype in FLOATS
        and node.outputs[0].type.dtype in FLOATS
    )


def _partition(letters: Layout, sizes: dict[str, int], shape: tuple[int, ...]) -> Layout | None:
    """The layout of a row-major tensor of ``shape`` holding the letters of ``letters`` in
    that order (size-1 letters dropped), or None when an axis would cut a letter."""
    flat = [c for ax in letters for c in ax if sizes[c] > 1]
    out: Layout = []
    at = 0
    for n in shape:
        axis = ""
        prod = 1
        while prod < n and at < len(flat):
            axis += flat[at]
            prod *= sizes[flat[at]]
            at += 1
        if prod != n:
            return None
        out.append(axis)
    return out if at == len(flat) else None


@dataclass
class Path:
    """An operand followed back to the tensor the kernel reads."""

    value: Value
    layout: Layout
    sizes: dict[str, int]
    chunk: tuple[int, int] = (0, 1)
    scale: float = 1.0
    absorbed: list[Node] = field(default_factory=list)


def _start(v: Value, letters: str, sizes: dict[str, int]) -> Layout | None:
    """The layout of a MatMul operand whose axes are the last len(shape) of ``letters``;
    an axis of size 1 where the letter is bigger is a broadcast (the letter is absent)."""
    shape = v.type.shape
    lets = letters[len(letters) - len(shape) :]
    out: Layout = []
    for c, n in zip(lets, shape, strict=True):
        if n == sizes[c]:
            out.append(c if n > 1 else "")
        elif n == 1 and c in "bh":
            out.append("")
        else:
            return None
    return out


def _follow(path: Path, scaled: bool) -> Path:
    """Walk ``path`` back through views, one Split and (with ``scaled``) scalar scales."""
    while True:
        p = path.value.producer
        if p is None or not p.inputs or p.inputs[0] is None:
            return path
        x = p.inputs[0]
        a = node_attrs(p)
        if p.op == "Transpose":
            perm = [int(i) for i in a["perm"]]
            lay: Layout = [""] * len(perm)
            for k, src in enumerate(perm):
                lay[src] = path.layout[k]
            path.layout = lay
        elif p.op in ("Reshape", "Unsqueeze", "Squeeze", "Flatten"):
            got = _partition(path.layout, path.sizes, x.type.shape)
            if got is None:
                return path
            path.layout = got
        elif p.op == "Expand":
            # Axes the Expand broadcasts hold no data of their own: their letters (batches,
            # heads: a key shared by heads) are read with stride 0.
            y = path.value.type.shape
            xs = (1,) * (len(y) - x.type.rank) + x.type.shape
            if x.type.rank > len(y):
                return path
            lay = [ax if n == m else "" for ax, n, m in zip(path.layout, xs, y, strict=True)]
            gone = {c for ax, kept in zip(path.layout, lay, strict=True) if not kept for c in ax}
            if not gone <= {"b", "h"}:
                return path
            path.layout = lay[len(y) - x.type.rank :]
        elif p.op == "Split" and path.chunk == (0, 1):
            axis = int(a["axis"]) % x.type.rank
            sizes = {o.type.shape[axis] for o in p.outputs}
            if len(sizes) != 1 or path.value.type.shape[axis] <= 1:
                return path
            index = p.outputs.index(path.value)
            path.layout = list(path.layout)
            path.layout[axis] = "c" + path.layout[axis]
            path.sizes = {**path.sizes, "c": len(p.outputs)}
            path.chunk = (index, len(p.outputs))
        elif _float_cast(p):
            # The kernel loads either side of a Cast and computes in float32; a narrowing
            # one stays where nothing else can be read through before it (the narrow value
            # is half the bytes, and its Cast joins the producer's element-wise kernel).
            narrows = x.type.dtype.np.itemsize > path.value.type.dtype.np.itemsize
            before = x.producer.op if x.producer is not None else ""
            if narrows and before not in ("Transpose", "Reshape", "Split", "Mul", "Div", "Cast"):
                return path
        elif scaled and p.op in ("Mul", "Div") and len(p.inputs) == 2:
            other = p.inputs[1]
            if p.op == "Mul" and _scalar(x) is not None and p.inputs[1] is not None:
                x, other = p.inputs[1], x
            c = _scalar(other)
            if (
                c is None
                or x is None
                or x.type.shape != path.value.type.shape
                or x.type.dtype not in FLOATS
                or (p.op == "Div" and c == 0)
            ):
                return path
            path.scale *= c if p.op == "Mul" else 1.0 / c
        else:
            return path
        path.absorbed.append(p)
        path.value = x


def _forward(
    v: Value,
    layout: Layout,
    sizes: dict[str, int],
    users: dict[Value, list[Node]],
    outs: set[Value],
) -> tuple[Value, Layout]:
    """Follow the attention output forward through Transposes and Reshapes it alone feeds."""
    while v not in outs:
        us = users.get(v, [])
        if len(us) != 1 or us[0].inputs[0] is not v:
            break
        if us[0].op not in ("Transpose", "Reshape") and not _float_cast(us[0]):
            break
        u = us[0]
        y = u.outputs[0]
        if _float_cast(u):
            v = y  # the kernel writes the Cast's type
            continue
        if u.op == "Transpose":
            perm = [int(i) for i in node_attrs(u)["perm"]]
            lay = [layout[src] for src in perm]
        else:
            got = _partition(layout, sizes, y.type.shape)
            if got is None:
                break
            lay = got
        # Batches and heads keep axes of their own in the output: a mesh then splits them
        # only where its factor divides them (the Reshape that merges them stays, a view).
        if any(len(ax) > 1 and any(c in "bh" for c in ax) for ax in lay):
            break
        v, layout = y, lay
    return v, layout


def _cast_forward(v: Value, users: dict[Value, list[Node]], outs: set[Value]) -> Value:
    """``v`` after the float Casts that alone read it, one after another."""
    while v not in outs:
        us = users.get(v, [])
        if len(us) != 1 or not _float_cast(us[0]):
            break
        v = us[0].outputs[0]
    return v


def _only_use(users: dict[Value, list[Node]], outs: set[Value], v: Value, node: Node) -> bool:
    us = users.get(v, [])
    return v not in outs and len(us) == 1 and us[0] is node


def _broadcasts_to(shape: tuple[int, ...], full: tuple[int, ...]) -> bool:
    if len(shape) > len(full):
        return False
    tail = full[len(full) - len(shape) :]
    return all(s in (1, f) for s, f in zip(shape, tail, strict=True))


def _is_causal(keep: np.ndarray, sq: int, sk: int) -> bool:
    """``keep`` ([..., Sq, Sk], size-1 leading dims) is true exactly on and below the
    diagonal that ends at the last key."""
    if keep.ndim < 2 or keep.shape[-2:] != (sq, sk) or any(n != 1 for n in keep.shape[:-2]):
        return False
    tril = np.tril(np.ones((sq, sk), dtype=bool), k=sk - sq)
    return bool(np.array_equal(keep.reshape(sq, sk), tril))


@dataclass
class Match:
    steps: list[tuple[str, Node, Value]]  # ("add"|"keep_true"|"keep_false", node, other)
    fill: float
    scale: float
    mm: Node


def _scores(sm_in: Value, users: dict[Value, list[Node]], outs: set[Value]) -> Match | None:
    """From the Softmax's input back to the Q K^T MatMul: masks, then scales."""
    steps: list[tuple[str, Node, Value]] = []
    fill = 0.0
    scale = 1.0
    v = sm_in
    while True:
        p = v.producer
        while _float_cast(p):
            assert p is not None and p.inputs[0] is not None
            if not _only_use(users, outs, p.inputs[0], p):
                return None
            v = p.inputs[0]
            p = v.producer
        if p is None:
            return None
        if p.op == "MatMul":
            return Match(steps[::-1], fill, scale, p)
        if p.op == "Add" and not steps_have(steps, "add") and scale == 1.0:
            a, b = p.inputs
            assert a is not None and b is not None
            # The scores side is the one of the output's shape that is not the mask.
            cand = [(a, b), (b, a)]
            pick = None
            for s, m in cand:
                scores_side = s.producer is not None and s.producer.op in (
                    "MatMul",
                    "Mul",
                    "Div",
                    "Where",
                    "Cast",
                )
                if (
                    scores_side
                    and s.type.shape == v.type.shape
                    and _broadcasts_to(m.type.shape, v.type.shape)
                ):
                    pick = (s, m)
                    break
            if pick is None:
                return None
            s, m = pick
            steps.append(("add", p, m))
        elif p.op == "Where" and not steps_have(steps, "keep") and scale == 1.0:
            c, x, y = p.inputs
            assert c is not None and x is not None and y is not None
            if _scalar(y) is not None and x.type.shape == v.type.shape:
                mode, s, f = "keep_true", x, _scalar(y)
            elif _scalar(x) is not None and y.type.shape == v.type.shape:
                mode, s, f = "keep_false", y, _scalar(x)
            else:
                return None
            if not _broadcasts_to(c.type.shape, v.type.shape):
                return None
            assert f is not None
            fill = f
            steps.append((mode, p, c))
        elif p.op in ("Mul", "Div"):
            a, b = p.inputs
            if p.op == "Mul" and _scalar(a) is not None:
                a, b = b, a
            factor = _scalar(b)
            bad = factor is None or (p.op == "Div" and factor == 0)
            if a is None or factor is None or bad or a.type.shape != v.type.shape:
                return None
            scale *= factor if p.op == "Mul" else 1.0 / factor
            s = a
        else:
            return None
        if not _only_use(users, outs, s, p):
            return None
        v = s


def steps_have(steps: list[tuple[str, Node, Value]], kind: str) -> bool:
    return any(k.startswith(kind) for k, _, _ in steps)


def _fuse(
    graph: Graph, sm: Node, users: dict[Value, list[Node]], live: LiveUses | None = None
) -> bool:
    outs = live.outs if live is not None else graph.kept()
    x = sm.inputs[0]
    if x is None or x.type.rank not in (2, 3, 4) or x.type.dtype not in FLOATS:
        return False
    if int(node_attrs(sm)["axis"]) % x.type.rank != x.type.rank - 1:
        return False
    # Forwards: the NaN guard and a training dropout (either order: the guard maps NaN to 0,
    # which a dropped element is too), then P V.
    p = _cast_forward(sm.outputs[0], users, outs)
    nan_zero = False
    us = users.get(p, [])
    if p in outs:
        return False
    dropout: Node | None = None
    if len(us) == 1 and us[0].op == "TrainDropout" and us[0].inputs[0] is p:
        dropout = us[0]
        p = _cast_forward(dropout.outputs[0], users, outs)
        us = users.get(p, [])
        if p in outs:
            return False
    if len(us) == 2 and {u.op for u in us} == {"IsNaN", "Where"}:
        isnan = next(u for u in us if u.op == "IsNaN")
        guard = next(u for u in us if u.op == "Where")
        m = isnan.outputs[0]
        if not (
            _only_use(users, outs, m, guard)
            and guard.inputs[0] is m
            and guard.inputs[2] is p
            and _scalar(guard.inputs[1]) == 0.0
        ):
            return False
        nan_zero = True
        p = _cast_forward(guard.outputs[0], users, outs)
        us = users.get(p, [])
        if p in outs:
            return False
    if len(us) == 1 and us[0].op == "Where" and us[0].inputs[2] is p:
        # ONNX Attention's guard for fully masked rows: Where(cond, 0, p) with a constant
        # cond; with no row masked it changes nothing.
        guard = us[0]
        rows = guard.inputs[0]
        if rows is None or rows.const is None or bool(np.any(rows.const)):
            return False
        if _scalar(guard.inputs[1]) != 0.0 or guard.outputs[0].type.shape != p.type.shape:
            return False
        p = _cast_forward(guard.outputs[0], users, outs)
        us = users.get(p, [])
        if p in outs:
            return False
    if dropout is None and len(us) == 1 and us[0].op == "TrainDropout" and us[0].inputs[0] is p:
        # A training dropout of the probabilities: the kernels draw its mask (keyed by the
        # element's index in these [b, h, Sq, Sk] probabilities, as it does).
        dropout = us[0]
        p = _cast_forward(dropout.outputs[0], users, outs)
        us = users.get(p, [])
        if p in outs:
            return False
    if len(us) != 1 or us[0].op != "MatMul" or us[0].inputs[0] is not p:
        return False
    pv = us[0]
    if not _only_use(users, outs, x, sm):
        return False
    match = _scores(x, users, outs)
    if match is None:
        return False
    mm = match.mm
    qop, ktop = mm.inputs
    vop = pv.inputs[1]
    assert qop is not None and ktop is not None and vop is not None
    scores = mm.outputs[0]
    r = scores.type.rank
    if any(o.type.rank != r for o in (qop, ktop, vop, pv.outputs[0])):
        return False
    if any(o.type.dtype not in FLOATS for o in (qop, ktop, vop)):
        return False
    batch = (1,) * (4 - r) + scores.type.shape[:-2]
    bsz, heads = batch[-2], batch[-1]
    sq, sk = scores.type.shape[-2:]
    d, dv = qop.type.shape[-1], vop.type.shape[-1]
    if tile_shape(d, dv) is None or min(sq, sk, d, dv) < 1:
        return False
    qk = {"b": bsz, "h": heads, "d": d}
    paths = {}
    for w, val, letters, s in (
        ("q", qop, "bhsd", sq),
        ("k", ktop, "bhds", sk),
        ("v", vop, "bhsd", sk),
    ):
        sizes = {**qk, "s": s, "d": dv if w == "v" else d}
        lay = _start(val, letters, sizes)
        if lay is None:
            return False
        paths[w] = _follow(Path(val, lay, sizes), scaled=w != "v")
    out_sizes = {"b": bsz, "h": heads, "s": sq, "d": dv}
    first = _start(pv.outputs[0], "bhsd", out_sizes)
    if first is None:
        return False
    final, out_layout = _forward(pv.outputs[0], first, out_sizes, users, outs)

    steps = match.steps
    mask: Value | None = None
    cond: Value | None = None
    where = "none"
    causal = 0
    if len(steps) == 1 and sk >= sq:
        kind, _, other = steps[0]
        if kind == "add" and other.const is not None:
            mc = np.asarray(other.const, dtype=np.float64)
            lower = np.broadcast_to(mc, mc.shape)
            keep = lower == 0
            if _is_causal(keep, sq, sk) and bool(np.all(lower[~keep] <= NEG_LARGE)):
                causal = 1
        elif kind != "add" and other.const is not None and match.fill <= NEG_LARGE:
            keep = np.asarray(other.const).astype(bool)
            if _is_causal(keep if kind == "keep_true" else ~keep, sq, sk):
                causal = 1
    mask_first = 1
    if not causal:
        for at, (kind, _, other) in enumerate(steps):
            if kind == "add":
                mask = other
                mask_first = int(at == 0)
            else:
                cond, where = other, kind
        if cond is not None and cond.type.dtype != DType.BOOL:
            return False
        if mask is not None and mask.type.dtype not in FLOATS:
            return False
    q, k, v = paths["q"], paths["k"], paths["v"]
    attrs = {
        "sizes": (bsz, heads, sq, sk, d, dv),
        "q_layout": format_layout(q.layout),
        "k_layout": format_layout(k.layout),
        "v_layout": format_layout(v.layout),
        "out_layout": format_layout(out_layout),
        "q_chunk": q.chunk,
        "k_chunk": k.chunk,
        "v_chunk": v.chunk,
        "scale": float(np.float32(match.scale * q.scale * k.scale)),
        "where": where,
        "where_fill": match.fill if where != "none" else 0.0,
        "mask_first": mask_first,
        "causal": causal,
        "nan_zero": int(nan_zero),
        "out_dtype": final.type.dtype.onnx,
    }
    key: Value | None = None
    if dropout is not None:
        drop = node_attrs(dropout)
        attrs.update(
            dropout=float(drop["ratio"]),
            dropout_stream=int(drop["stream"]),
            seed=int(drop["seed"]),
        )
        key = dropout.inputs[1]
    inputs: list[Value | None] = [q.value, k.value, v.value, mask, cond, key]
    while inputs[-1] is None:
        inputs.pop()
    node = Node(OP, inputs, [], attrs, name=sm.name)
    node.stage = sm.stage  # a DSL stage block's nodes stay in it
    (t,) = get_op(OP).infer_types(node)
    if t != final.type:
        return False
    out = Value(graph.claim_name(f"{final.name}/attention"), t, producer=node)
    node.outputs = [out]
    graph.replace_uses(final, out)
    # The result keeps the name of the value it replaces (graph outputs are named).
    out.name, final.name = final.name, out.name
    producer = final.producer
    assert producer is not None
    graph.nodes.insert(graph.nodes.index(producer) + 1, node)
    if live is not None:
        live.move_uses(final, out)
        live.add(node)
        if not live.used(final):
            live.drop(producer)
    return True


@register_pass("fuse_attention")
def fuse_attention(graph: Graph) -> Graph:
    live = LiveUses(graph)
    for sm in [n for n in graph.nodes if n.op == "Softmax"]:
        if sm in live.alive and _fuse(graph, sm, live.users, live):
            # The replaced chain is out of the uses at once (they would hide single uses
            # later), kept up to date rather than rebuilt: quadratic on a deep model.
            live.matched()
    live.finish()
    return graph
