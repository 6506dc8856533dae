"""The IR's printed form: the flowc DSL (grammar/flow.lark), one typed binding per node.

    mesh gpus[2, 2]
    graph mlp(x: f32[8, 64] @ (S(0), B)) -> (y: f32[8, 10]) {
        param w: f32[64, 10] = load("w")
        const shape: i64[2] = [8, 10]
        param fill_w: f32[64, 10] = fill(0.02)
        y: f32[8, 10] @ (S(0), B) = matmul(x, w)
        return y
    }

Constants are shown by type, not data: small ones (at most 8 elements) inline, splats as
``fill(v)``, the rest as ``load("name")`` references into the weights. Names that are not
plain identifiers are quoted with escapes, so any ONNX name survives the round trip.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from flowc.ir.graph import Graph, Value, is_splat

KEYWORDS = frozenset(
    {"graph", "param", "const", "return", "mesh", "stage", "load", "fill", "tensor", "complex"}
    | {"weights", "state", "train", "dim"}
    | {"inf", "nan", "true", "false", "S", "B", "P", "_"}
)
_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
INLINE_MAX = 8


def ident(name: str) -> str:
    """A name as the DSL writes it: bare when it is a plain identifier, else quoted."""
    if _PLAIN.match(name) and name not in KEYWORDS:
        return name
    return json.dumps(name, ensure_ascii=True)


def scalar(x: Any) -> str:
    if isinstance(x, np.generic) and not isinstance(x, (np.number, np.bool_)):
        # ml_dtypes' scalars (bfloat16, the float8/6/4 types, int4, ...) are no NumPy number
        # type. A Python float or int holds each of their values exactly, so its text reads
        # back to the same element.
        from flowc.ir.dtype import DType

        x = float(x) if DType.from_numpy(x.dtype).is_float else int(x)
    if isinstance(x, (bool, np.bool_)):
        return "true" if x else "false"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    if isinstance(x, (float, np.floating)):
        f = float(x)
        if math.isnan(f):
            return "nan"
        if math.isinf(f):
            return "inf" if f > 0 else "-inf"
        # NumPy's str() of a float32/float16 scalar is the shortest text that reads back to
        # the same value at that precision (0.02, not 0.019999999552965164).
        text = str(x) if isinstance(x, np.floating) else repr(f)
        return text if any(c in text for c in ".en") else text + ".0"
    if isinstance(x, (complex, np.complexfloating)):
        return f"complex({scalar(x.real)}, {scalar(x.imag)})"
    if isinstance(x, str):
        return json.dumps(x, ensure_ascii=True)
    raise TypeError(f"cannot print {x!r}")


def literal(a: np.ndarray) -> str:
    """Elements of a small array, flat (the declared type gives the shape)."""
    if a.ndim == 0:
        return scalar(a[()])
    return "[" + ", ".join(scalar(x) for x in a.reshape(-1)) + "]"


def attr_value(v: Any) -> str:
    if isinstance(v, np.ndarray):
        from flowc.ir.dtype import DType

        dt = DType.from_numpy(v.dtype).short
        shape = ", ".join(str(d) for d in v.shape)
        return f"tensor({dt}[{shape}], {literal(v)})"
    if isinstance(v, tuple):
        return "[" + ", ".join(attr_value(x) for x in v) + "]"
    return scalar(v)


def typed(v: Value) -> str:
    s = f"{ident(v.name)}: {v.type}"
    if v.sbp is not None:
        s += f" @ {v.sbp}"
    return s


def constant_decl(c: Value) -> str:
    a = c.const
    assert a is not None
    if is_splat(a):
        return f"param {typed(c)} = fill({scalar(a.reshape(-1)[0])})"
    if a.size <= INLINE_MAX:
        return f"const {typed(c)} = {literal(a)}"
    return f"param {typed(c)} = load({scalar(c.name)})"


def print_graph(g: Graph, weights: str | None = None) -> str:
    """The graph as DSL text; ``weights`` names the file its load(...) params come from
    (a path relative to the program), written as a ``weights`` declaration."""
    from flowc.ops.registry import get_op

    lines = []
    if g.mesh is not None:
        lines.append(f"mesh {ident(g.mesh.name)}[{', '.join(str(d) for d in g.mesh.shape)}]")
    if weights is not None:
        lines.append(f"weights {scalar(weights)}")
    used = {
        x for v in g.values() if v.type.sym is not None for d in v.type.sym if d for x in d.symbols
    }
    for sym, r in g.symbols.items():
        if sym in used or not r.computed:
            lines.append(f"dim {sym}: {r}")
    if lines:
        lines.append("")
    ins = ", ".join(typed(v) for v in g.inputs)
    outs = ", ".join(typed(v) for v in g.outputs)
    lines.append(f"graph {ident(g.name)}({ins}) -> ({outs}) {{")
    for c in g.constants:
        lines.append("    " + constant_decl(c))
    for name, nxt in g.state.items():
        lines.append("    " + state_decl(name, np.asarray(g.params[name]), nxt))
    stage: int | None = None
    for n in g.nodes:
        if n.stage != stage:
            if stage is not None:
                lines.append("    }")
            if n.stage is not None:
                lines.append(f"    stage {n.stage} {{")
            stage = n.stage
        pad = "        " if stage is not None else "    "
        args = [ident(i.name) if i is not None else "_" for i in n.inputs]
        args += [f"{k}={attr_value(v)}" for k, v in n.attrs.items()]
        lhs = ", ".join(typed(o) for o in n.outputs)
        lines.append(f"{pad}{lhs} = {get_op(n.op).dsl_name}({', '.join(args)})")
    if stage is not None:
        lines.append("    }")
    ret = ", ".join(ident(v.name) for v in g.outputs)
    lines.append(f"    return {ret}" if ret else "    return")  # a graph may have no outputs
    lines.append("}")
    if g.train:
        lines += ["", "train {", *(f"    {line}" for line in train_lines(g.train)), "}"]
    return "\n".join(lines) + "\n"


def state_decl(name: str, first: np.ndarray, nxt: str | None) -> str:
    """``state NAME = INIT [-> NEXT]``: a splat (or a scalar) as fill(v), else load("NAME")."""
    if first.ndim == 0 or is_splat(first):
        init = f"fill({scalar(first.reshape(-1)[0])})"
    else:
        init = f"load({scalar(name)})"
    return f"state {ident(name)} = {init}" + (f" -> {ident(nxt)}" if nxt is not None else "")


def train_lines(train: dict[str, str]) -> list[str]:
    """A train block's lines from its options (Graph.train), as the reader takes them."""

    def value(text: str) -> str:
        try:
            float(text)
            return text
        except ValueError:
            return "true" if text == "true" else "false" if text == "false" else scalar(text)

    def call(text: str, names: bool, extra: dict[str, str] | None = None) -> str:
        fn, _, rest = text.partition(":")
        parts = [p for p in rest.split(",") if p]
        args = [ident(p) for p in parts] if names else []
        if not names:
            args = [f"{k}={value(v)}" for k, _, v in (p.partition("=") for p in parts)]
        args += [f"{k}={value(v)}" for k, v in (extra or {}).items()]
        return f"{fn}({', '.join(args)})"

    lines = []
    if "loss" in train:
        kw: dict[str, str] = {
            k: train[k] for k in ("ignore_index", "label_smoothing") if k in train
        }
        lines.append(f"loss = {call(train['loss'], True, kw)}")
    if "optimizer" in train:
        lines.append(f"optimizer = {call(train['optimizer'], False)}")
    if "lr_schedule" in train:
        lines.append(f"schedule = {call(train['lr_schedule'], False)}")
    for k, v in train.items():
        if k not in ("loss", "optimizer", "lr_schedule", "ignore_index", "label_smoothing"):
            lines.append(f"{k} = {value(v)}")
    return lines
