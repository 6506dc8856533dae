"""The shared emitter of element-wise ops: one broadcasting kernel built from the op's cexpr."""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING

from flowc.codegen.cpp import CodegenError, ctype
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node, Value

if TYPE_CHECKING:
    from flowc.codegen.program import Program


# Numerators of FlowcDivmod (templates/kernels/common.cu.j2) stay below this.
DIVMOD_LIMIT = 1 << 31


def divmod_magic(d: int) -> tuple[int, int, int]:
    """(d, mul, shr) such that n // d == (n * mul >> 32) >> shr for 0 <= n < 2^31 (d > 1;
    d == 1 is the kernel's own case): shr + 32 = 31 + ceil(log2 d), mul = ceil(2^(shr+32) / d),
    which fits 32 bits. The round-up error n * (mul * d - 2^(shr+32)) / 2^(shr+32) stays below
    1 / d for n < 2^31, so the floor is exact (the scheme CUTLASS's FastDivmod uses)."""
    if not 1 <= d < DIVMOD_LIMIT:
        raise CodegenError(f"internal: fast division by {d} (needs 1 <= d < 2^31)")
    if d == 1:
        return 1, 0, 0
    p = 31 + (d - 1).bit_length()
    return d, -(-(1 << p) // d), p - 32


def fast_divmod(d: int) -> str:
    """The C++ FlowcDivmod for divisor ``d``, as a kernel argument."""
    dd, mul, shr = divmod_magic(d)
    return f"FlowcDivmod{{{dd}u, {mul}u, {shr}u}}"


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


def emit_elementwise(prog: Program, node: Node) -> None:
    from flowc.ops.registry import get_op  # the op modules import this one as they load

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
    operands = [
        {"ctype": ctype(v.type.dtype), "index": broadcast_index(v.type.shape, out.type.shape)}
        for v in values
    ]
    needs_coords = any(o["index"] != "i" for o in operands)
    dims = [{"axis": a, "size": s} for a, s in enumerate(out.type.shape)] if needs_coords else []
    name = prog.kernel(
        "elementwise.cu.j2", "elementwise", operands=operands, out_type=out_t, dims=dims, expr=body
    )
    n = math.prod(out.type.shape)
    prog.launch(name, n, [*(prog.cptr(v) for v in values), prog.ptr(out), f"(int64_t){n}"])


def emit_fused(prog: Program, node: Node) -> None:
    """One kernel for a FusedElementwise chain: each step a local variable, operands read
    through their broadcast strides at the output's coordinates."""
    out = node.outputs[0]
    values: list[Value] = [i for i in node.inputs if i is not None]
    from flowc.ops.registry import get_op

    steps = json.loads(node.attrs["program"])
    lines = []
    for k, step in enumerate(steps):
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
        lines.append(f"const {step_t} t{k} = static_cast<{step_t}>({expr});")
    out_t = ctype(out.type.dtype)
    operands = [
        {"ctype": ctype(v.type.dtype), "index": broadcast_index(v.type.shape, out.type.shape)}
        for v in values
    ]
    needs_coords = any(o["index"] != "i" for o in operands)
    dims = [{"axis": a, "size": s} for a, s in enumerate(out.type.shape)] if needs_coords else []
    name = prog.kernel(
        "elementwise.cu.j2",
        "fused",
        operands=operands,
        out_type=out_t,
        dims=dims,
        lines=lines,
        result=f"t{len(steps) - 1}",
    )
    n = math.prod(out.type.shape)
    prog.launch(name, n, [*(prog.cptr(v) for v in values), prog.ptr(out), f"(int64_t){n}"])
