"""The shared emitter of element-wise ops: one broadcasting kernel built from the op's cexpr."""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING

from flowc.codegen.cpp import DIVMOD_LIMIT, CodegenError, ctype, fast_divmod
from flowc.codegen.cpp import divmod_magic as divmod_magic  # re-exported
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node, Value
from flowc.ops.registry import get_op

if TYPE_CHECKING:
    from flowc.codegen.program import Program


def broadcast_index(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> str:
    """The C++ offset into an operand of ``in_shape`` read at the output coordinates c0, c1..."""
    if in_shape == out_shape:
        return "i"
    if len(in_shape) > len(out_shape):
        raise CodegenError(
            f"operand of shape {list(in_shape)} does not broadcast to {list(out_shape)}"
        )
    rank = len(out_shape)
    terms = []
    stride = 1
    for k in range(len(in_shape) - 1, -1, -1):
        axis = rank - len(in_shape) + k
        if in_shape[k] != 1:
            terms.append(f"c{axis}" if stride == 1 else f"c{axis} * {stride}")
        stride *= in_shape[k]
    return " + ".join(reversed(terms)) or "0"


def substitute(expr: str, operands: list[str], out_t: str, in_t: str) -> str:
    text = re.sub(r"\$(\d+)", lambda m: operands[int(m.group(1))], expr)
    return text.replace("$T", out_t).replace("$I", in_t)


def _strides(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[int]:
    """The operand's stride (in elements) along each output dim; 0 where it broadcasts."""
    if len(in_shape) > len(out_shape):
        raise CodegenError(
            f"operand of shape {list(in_shape)} does not broadcast to {list(out_shape)}"
        )
    padded = (1,) * (len(out_shape) - len(in_shape)) + tuple(in_shape)
    strides = [0] * len(out_shape)
    step = 1
    for k in range(len(out_shape) - 1, -1, -1):
        if padded[k] != 1:
            strides[k] = step
        step *= padded[k]
    return strides


def broadcast_plan(
    shapes: list[tuple[int, ...]], out_shape: tuple[int, ...]
) -> tuple[list[int], list[list[int] | None]]:
    """The output's dims merged as far as every operand allows (size-1 dims dropped, two
    neighbours merged when each operand is contiguous across them or broadcasts along both),
    innermost first, and per operand its strides along them, innermost first, or None when it
    is read at the flat output index (it has the output's elements in the output's order)."""
    kept = [k for k, d in enumerate(out_shape) if d != 1]
    per_op = [[_strides(sh, out_shape)[k] for k in kept] for sh in shapes]
    dims: list[int] = []
    merged: list[list[int]] = [[] for _ in shapes]
    for pos, k in enumerate(kept):
        size = out_shape[k]
        if dims and all(merged[j][-1] == per_op[j][pos] * size for j in range(len(shapes))):
            dims[-1] *= size
            for j in range(len(shapes)):
                merged[j][-1] = per_op[j][pos]
            continue
        dims.append(size)
        for j in range(len(shapes)):
            merged[j].append(per_op[j][pos])
    dense = [math.prod(dims[k + 1 :]) for k in range(len(dims))]
    strides: list[list[int] | None] = [None if m == dense else list(reversed(m)) for m in merged]
    return list(reversed(dims)), strides


def _pointwise_sized(
    prog: Program, values: list[Value], out: Value, steps: list[dict[str, str]], result: str
) -> None:
    """The pointwise kernel of a program with symbolic dims: sizes read from the run's size
    table, each operand's offset from the output coordinates and its own dims' products."""
    ot = out.type
    rank = ot.rank
    dims = [{"axis": a, "size": prog.dim(ot, a)} for a in range(rank)]
    operands: list[dict[str, object]] = []
    for k, v in enumerate(values):
        t = v.type
        op: dict[str, object] = {"ctype": ctype(t.dtype), "at": k}
        if t.shape == ot.shape and t.sym == ot.sym:
            op["same"] = True
        elif t.numel == 1 and t.sym is None:
            op["scalar"] = True
        else:
            if t.rank > rank:
                raise prog.fail(f"operand {v.name!r} of type {t} does not broadcast to {ot}")
            terms: list[str] = []
            stride: list[str] = []
            for j in range(t.rank - 1, -1, -1):
                a = rank - t.rank + j
                own = prog.dim(t, j, "sizes")
                if t.sym is None or t.sym[j] is None:
                    if t.shape[j] == 1:
                        continue  # broadcast along this axis
                    if (ot.sym is not None and ot.sym[a] is not None) or ot.shape[a] != t.shape[j]:
                        raise prog.fail(
                            f"operand {v.name!r} of type {t} does not broadcast to {ot} "
                            f"(its dim {j} against the output's)"
                        )
                elif ot.sym is None or ot.sym[a] != t.sym[j]:
                    raise prog.fail(
                        f"operand {v.name!r} of type {t}: its dim {j} is not the output's ({ot})"
                    )
                terms.append(" * ".join([f"c{a}", *stride]))
                stride.append(f"D{a}" if t.sym is not None and t.sym[j] is not None else own)
            op["index"] = " + ".join(reversed(terms)) or "0"
        op.setdefault("same", False)
        op.setdefault("scalar", False)
        operands.append(op)
    total = " * ".join(f"D{a}" for a in range(rank)) or "1"
    read = [int(a) for op in operands for a in re.findall(r"c(\d+)", str(op.get("index", "")))]
    name = prog.kernel(
        "elementwise.cu.j2",
        "pointwise_sized",
        first=min(read, default=rank),
        operands=operands,
        out_type=ctype(ot.dtype),
        steps=steps,
        result=result,
        dims=dims,
        total=total,
    )
    args = [*(prog.cptr(v) for v in values), prog.ptr(out)]
    prog.launch_sized(name, prog.numel(ot), args)


def emit_broadcast_sized(prog: Program, x: Value, out: Value) -> None:
    """``x`` broadcast into ``out`` (Expand) in a program with symbolic dims."""
    _pointwise_sized(prog, [x], out, [], "a0")


def _pointwise(prog: Program, macro: str, values: list[Value], out: Value, **body: object) -> None:
    """Render and launch the shared kernel (elementwise.cu.j2: pointwise) for operands
    ``values`` writing ``out``; ``body`` is the macro's expression part."""
    if prog.node is not None and prog.is_sized(prog.node):
        steps = body.get("steps", [])
        assert isinstance(steps, list)
        result = f"t{len(steps) - 1}" if steps else str(body["expr"])
        _pointwise_sized(prog, values, out, steps, result)
        return
    shape = out.type.shape
    n = math.prod(shape)
    dims, strides = broadcast_plan([v.type.shape for v in values], shape)
    wide = n >= DIVMOD_LIMIT
    operands: list[dict[str, object]] = []
    slots = 0
    for k, (v, st) in enumerate(zip(values, strides, strict=True)):
        # A scalar (one element for all) needs no offset: in[0].
        scalar = st is not None and not any(st)
        op: dict[str, object] = {
            "ctype": ctype(v.type.dtype),
            "at": k,
            "same": st is None,
            "scalar": scalar,
            "inner": 0,
        }
        if st is not None and not scalar:
            op.update(slot=slots, inner=int(st[0] == 1), index=broadcast_index(v.type.shape, shape))
            slots += 1
        operands.append(op)
    strides = [st if st is not None and any(st) else None for st in strides]
    # With a broadcast operand that is no scalar, at least two dims stay after merging.
    rank = len(dims) if slots else 0
    # Four at a time: always without broadcasting (the tail goes one by one); with it, when
    # the innermost merged dim holds whole Vec4s and every broadcast operand runs along it or
    # is constant along it.
    vec = (
        4
        if rank == 0
        or (not wide and dims[0] % 4 == 0 and all(st is None or st[0] in (0, 1) for st in strides))
        else 1
    )
    coords = [{"axis": a, "size": d} for a, d in enumerate(shape)] if wide and slots else []
    name = prog.kernel(
        "elementwise.cu.j2",
        macro,
        operands=operands,
        out_type=ctype(out.type.dtype),
        rank=rank,
        nb=slots,
        vec=vec,
        wide=wide,
        dims=coords,
        **body,
    )
    args = [*(prog.cptr(v) for v in values), prog.ptr(out), f"(int64_t){n}"]
    if rank and not wide:
        divs = ", ".join(fast_divmod(d) for d in dims)
        rows = ", ".join(
            "{" + ", ".join(f"{x}u" for x in st) + "}" for st in strides if st is not None
        )
        args.append(f"FlowcBroadcast<{rank}, {slots}>{{{{{divs}}}, {{{rows}}}}}")
    prog.launch(name, n, args)


def emit_elementwise(prog: Program, node: Node) -> None:
    opdef = get_op(node.op)
    assert opdef.cexpr is not None
    out = node.outputs[0]
    present = tuple(i is not None for i in node.inputs)
    expr = opdef.cexpr(node.attrs.merged(opdef.attrs), present)
    # Only inputs the expression reads become operands: CastLike's second input, for one,
    # gives a type, not data.
    used = {int(m) for m in re.findall(r"\$(\d+)", expr)}
    values: list[Value] = [i for k, i in enumerate(node.inputs) if i is not None and k in used]
    names = []
    k = 0
    for j, p in enumerate(present):
        names.append(f"a{k}" if p and j in used else "MISSING")
        k += int(p and j in used)
    out_t = ctype(out.type.dtype)
    in_t = ctype(values[0].type.dtype) if values else out_t
    body = substitute(expr, names, out_t, in_t)
    _pointwise(prog, "elementwise", values, out, expr=body)


def emit_fused(prog: Program, node: Node) -> None:
    """One kernel for a FusedElementwise chain: each step a local variable, operands read
    through their broadcast strides at the output's coordinates."""
    out = node.outputs[0]
    values: list[Value] = [i for i in node.inputs if i is not None]

    steps = json.loads(node.attrs["program"])
    chain: list[dict[str, str]] = []
    for step in steps:
        opdef = get_op(step["op"])
        assert opdef.cexpr is not None
        args = step["args"]
        present = tuple(a is not None for a in args)
        names = ["MISSING" if a is None else (f"a{a}" if a >= 0 else f"t{-a - 1}") for a in args]
        step_t = ctype(DType.from_short(step["dtype"]))
        first = args[0] if args and args[0] is not None else None
        if first is None:
            in_t = step_t
        elif first >= 0:
            in_t = ctype(values[first].type.dtype)
        else:
            in_t = ctype(DType.from_short(steps[-first - 1]["dtype"]))
        expr = substitute(
            opdef.cexpr(Attrs(step["attrs"]).merged(opdef.attrs), present), names, step_t, in_t
        )
        chain.append({"ctype": step_t, "expr": expr})
    _pointwise(prog, "fused", values, out, steps=chain)
