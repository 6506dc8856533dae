"""ONNX control flow (If, Loop, Scan) as a static program.

flowc compiles one straight-line program for fixed shapes, so control flow is resolved while
importing: an If whose condition is known at compile time imports the branch it takes; one
whose condition comes at run time imports both branches and selects each output with Where
(both branches run; they have no side effects). Loop and Scan are unrolled: Loop needs its trip
count and its condition known at compile time, Scan iterates over a dimension of known length.
Each iteration's body is imported with the outer scope visible, as ONNX scoping requires.
Anything else (loops whose exit depends on run-time data, sequences, optional values) is
rejected with an error saying why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from flowc.errors import ShapeError
from flowc.frontend.onnx_validate import sparse_array, tensor_array
from flowc.ir.builder import GraphBuilder
from flowc.ir.graph import Value

CONTROL_OPS = ("If", "Loop", "Scan")

# More iterations than this is almost certainly not a model meant to be unrolled.
MAX_UNROLL = 4096

ConvertFn = Callable[[GraphBuilder, onnx.NodeProto, dict[str, int], dict[str, Value]], None]
OrderFn = Callable[[Sequence[onnx.NodeProto], set[str]], list[onnx.NodeProto]]


@dataclass(eq=False)
class _Ctx:
    """One control-flow node being resolved: its builder, the opsets, and how to convert
    and order the nodes of its bodies."""

    b: GraphBuilder
    node: onnx.NodeProto
    domains: dict[str, int]
    convert: ConvertFn
    order: OrderFn

    @property
    def where(self) -> str:
        return f"{self.node.op_type} node {self.node.name or '(unnamed)'!r}"

    def fail(self, message: str, hint: str | None = None) -> ShapeError:
        return ShapeError(f"{self.where}: {message}", hint)

    def graph_attr(self, name: str) -> onnx.GraphProto:
        for a in self.node.attribute:
            if a.name == name and a.type == onnx.AttributeProto.GRAPH:
                return a.g
        raise self.fail(f"has no {name!r} subgraph")

    def int_attr(self, name: str, default: int) -> int:
        for a in self.node.attribute:
            if a.name == name:
                return int(a.i)
        return default

    def ints_attr(self, name: str, default: Sequence[int]) -> list[int]:
        for a in self.node.attribute:
            if a.name == name:
                return [int(x) for x in a.ints]
        return list(default)

    def const(self, tag: str, array: Any) -> Value:
        return self.b.constant(f"{self.node.name or self.node.op_type}/{tag}", np.asarray(array))

    def emit(
        self, op: str, inputs: list[Value | None], attrs: dict[str, Any] | None = None
    ) -> Value:
        return self.b.emit(
            op, inputs, attrs or {}, name=f"{self.node.name or self.node.op_type}/{op}"
        )[0]

    def run_body(
        self, body: onnx.GraphProto, outer: dict[str, Value], bound: Sequence[Value | None]
    ) -> list[Value]:
        """Import ``body`` once with its inputs bound to ``bound``; returns its outputs."""
        if len(bound) != len(body.input):
            raise self.fail(f"its body takes {len(body.input)} inputs, given {len(bound)}")
        scope = dict(outer)
        for vi, v in zip(body.input, bound, strict=True):
            if v is None:
                raise self.fail(
                    f"body input {vi.name!r} has no value (optional inputs are not supported)"
                )
            scope[vi.name] = v
        for t in body.initializer:
            scope[t.name] = self.b.constant(t.name, tensor_array(t, f"initializer {t.name!r}"))
        for sp in body.sparse_initializer:
            name = sp.values.name
            scope[name] = self.b.constant(name, sparse_array(sp, f"sparse initializer {name!r}"))
        for n in self.order(body.node, set(scope)):
            self.convert(self.b, n, self.domains, scope)
        outs = []
        for vo in body.output:
            if vo.name not in scope:
                raise self.fail(f"its body output {vo.name!r} is never computed")
            outs.append(scope[vo.name])
        return outs

    def stack(self, values: list[Value], axis: int) -> Value:
        """Stack equally shaped values along a new ``axis``."""
        rank = values[0].type.rank + 1
        ax = axis + rank if axis < 0 else axis
        parts = [
            self.emit("Unsqueeze", [v, self.const("axis", np.array([ax], np.int64))])
            for v in values
        ]
        return parts[0] if len(parts) == 1 else self.emit("Concat", list(parts), {"axis": ax})


def _scalar_bool(ctx: _Ctx, v: Value, what: str) -> bool | None:
    """The value of a boolean scalar known at compile time, else None."""
    if v.const is None:
        return None
    a = np.asarray(v.const)
    if a.size != 1:
        raise ctx.fail(f"{what} must hold one value, got shape {list(a.shape)}")
    return bool(a.reshape(-1)[0])


def convert_control(
    builder: GraphBuilder,
    node: onnx.NodeProto,
    domains: dict[str, int],
    env: dict[str, Value],
    convert: ConvertFn,
    order: OrderFn,
) -> None:
    ctx = _Ctx(builder, node, domains, convert, order)
    inputs = [env[i] if i else None for i in node.input]
    if node.op_type == "If":
        outs = _if(ctx, inputs, env)
    elif node.op_type == "Loop":
        outs = _loop(ctx, inputs, env)
    else:
        outs = _scan(ctx, inputs, env)
    if len(outs) < len([o for o in node.output if o]):
        raise ctx.fail(f"produces {len(outs)} outputs but the node names {len(node.output)}")
    for name, v in zip(node.output, outs, strict=False):
        if name:
            env[name] = v


def _if(ctx: _Ctx, inputs: list[Value | None], env: dict[str, Value]) -> list[Value]:
    cond = inputs[0] if inputs else None
    if cond is None:
        raise ctx.fail("needs a condition input")
    then_g, else_g = ctx.graph_attr("then_branch"), ctx.graph_attr("else_branch")
    known = _scalar_bool(ctx, cond, "the condition")
    if known is not None:
        return ctx.run_body(then_g if known else else_g, env, [])
    # A run-time condition: run both branches, pick each output element-wise.
    then_outs = ctx.run_body(then_g, env, [])
    else_outs = ctx.run_body(else_g, env, [])
    if cond.type.numel != 1:
        raise ctx.fail(f"the condition must hold one value, got shape {list(cond.type.shape)}")
    if len(then_outs) != len(else_outs):
        raise ctx.fail(
            f"its then_branch gives {len(then_outs)} output(s) but its else_branch "
            f"{len(else_outs)}; both must give the node's outputs"
        )
    flag = ctx.emit("Reshape", [cond, ctx.const("scalar", np.zeros(0, np.int64))])
    outs = []
    for k, (t, e) in enumerate(zip(then_outs, else_outs, strict=True)):
        if t.type != e.type:
            raise ctx.fail(
                f"the condition is computed at run time and output {k} differs between the "
                f"branches ({t.type} vs {e.type}); flowc compiles one static program, so both "
                "branches must give the same shapes and types",
                hint="make the condition a constant, or give both branches equal shapes",
            )
        outs.append(ctx.emit("Where", [flag, t, e]))
    return outs


def _loop(ctx: _Ctx, inputs: list[Value | None], env: dict[str, Value]) -> list[Value]:
    body = ctx.graph_attr("body")
    trip = inputs[0] if inputs else None
    cond = inputs[1] if len(inputs) > 1 else None
    carried: list[Value] = [v for v in inputs[2:] if v is not None]
    if len(carried) != len(inputs[2:]):
        raise ctx.fail("omitted loop-carried inputs are not supported")
    if trip is not None and trip.const is None:
        raise ctx.fail(
            "input 0 (the trip count) must be known at compile time: flowc unrolls loops",
            hint="give the trip count as a constant (or fix the input shapes it derives from)",
        )
    count = None
    if trip is not None:
        a = np.asarray(trip.const)
        if a.size != 1 or a.dtype.kind not in "iu":
            raise ctx.fail(
                f"input 0 (the trip count) must be one integer, got {a.dtype} of shape "
                f"{list(a.shape)}"
            )
        count = int(a.reshape(-1)[0])
    going = True if cond is None else _scalar_bool(ctx, cond, "the initial condition")
    if going is None:
        raise ctx.fail("input 1 (the condition) must be known at compile time: flowc unrolls loops")
    if count is None and cond is None:
        raise ctx.fail("has neither a trip count nor a condition: it never ends")
    n_state = len(carried)
    scans: list[list[Value]] = []
    i = 0
    cond_v = cond if cond is not None else ctx.const("cond", np.array(True))
    while going and (count is None or i < count):
        if i >= MAX_UNROLL:
            raise ctx.fail(f"runs more than {MAX_UNROLL} iterations; flowc unrolls loops")
        it = ctx.const(f"iter{i}", np.array(i, np.int64))
        outs = ctx.run_body(body, env, [it, cond_v, *carried])
        if len(outs) < 1 + n_state:
            raise ctx.fail(f"its body gives {len(outs)} outputs, needs at least {1 + n_state}")
        cond_v = outs[0]
        carried = outs[1 : 1 + n_state]
        scans.append(outs[1 + n_state :])
        i += 1
        known = _scalar_bool(ctx, cond_v, "the body's condition")
        if known is None:
            raise ctx.fail(
                "its condition is computed from run-time data; flowc unrolls loops and needs "
                "the number of iterations known at compile time"
            )
        going = known
    n_scan = len(body.output) - 1 - n_state
    if n_scan and not scans:
        raise ctx.fail("runs zero iterations, so its scan outputs have no element shape")
    stacked = [ctx.stack([s[k] for s in scans], 0) for k in range(n_scan)]
    return [*carried, *stacked]


def _scan(ctx: _Ctx, inputs: list[Value | None], env: dict[str, Value]) -> list[Value]:
    body = ctx.graph_attr("body")
    opset = ctx.domains.get("", 0)
    n_scan_in = ctx.int_attr("num_scan_inputs", -1)
    if opset < 9:
        # Opset 8: a leading batch axis on every input and output, then sequence_lens.
        if inputs and inputs[0] is not None:
            raise ctx.fail("sequence_lens is not supported (every sequence has full length)")
        inputs = inputs[1:]
    if n_scan_in < 1 or n_scan_in > len(inputs):
        raise ctx.fail(f"num_scan_inputs {n_scan_in} does not fit its {len(inputs)} inputs")
    if any(v is None for v in inputs):
        raise ctx.fail("omitted inputs are not supported")
    vals: list[Value] = [v for v in inputs if v is not None]
    n_state = len(vals) - n_scan_in
    n_scan_out = len(body.output) - n_state
    if opset < 9:
        dirs = ctx.ints_attr("directions", [0] * n_scan_in)
        batch = vals[0].type.shape[0]
        per_batch = []
        for b in range(batch):
            idx = ctx.const(f"b{b}", np.array(b, np.int64))
            row = [ctx.emit("Gather", [v, idx], {"axis": 0}) for v in vals]
            per_batch.append(
                _scan_steps(
                    ctx,
                    body,
                    env,
                    row[:n_state],
                    row[n_state:],
                    [0] * n_scan_in,
                    dirs,
                    [0] * n_scan_out,
                    [0] * n_scan_out,
                )
            )
        return [ctx.stack([r[k] for r in per_batch], 0) for k in range(len(per_batch[0]))]
    return _scan_steps(
        ctx,
        body,
        env,
        vals[:n_state],
        vals[n_state:],
        ctx.ints_attr("scan_input_axes", [0] * n_scan_in),
        ctx.ints_attr("scan_input_directions", [0] * n_scan_in),
        ctx.ints_attr("scan_output_axes", [0] * n_scan_out),
        ctx.ints_attr("scan_output_directions", [0] * n_scan_out),
    )


def _scan_steps(
    ctx: _Ctx,
    body: onnx.GraphProto,
    env: dict[str, Value],
    state: list[Value],
    xs: list[Value],
    in_axes: list[int],
    in_dirs: list[int],
    out_axes: list[int],
    out_dirs: list[int],
) -> list[Value]:
    """Opset-9 Scan, unrolled: final states, then the scan outputs stacked."""
    n_state = len(state)
    n_scan_out = len(body.output) - n_state
    axes = [a + x.type.rank if a < 0 else a for a, x in zip(in_axes, xs, strict=True)]
    lengths = {x.type.shape[a] for a, x in zip(axes, xs, strict=True)}
    if len(lengths) != 1:
        raise ctx.fail(
            f"its scan inputs have different lengths along their scan axes: {sorted(lengths)}"
        )
    length = lengths.pop()
    if length > MAX_UNROLL:
        raise ctx.fail(f"scans {length} steps; flowc unrolls scans up to {MAX_UNROLL}")
    per_step: list[list[Value]] = []
    for t in range(length):
        slices = []
        for x, a, d in zip(xs, axes, in_dirs, strict=True):
            idx = ctx.const(f"t{t}", np.array(length - 1 - t if d else t, np.int64))
            slices.append(ctx.emit("Gather", [x, idx], {"axis": a}))
        outs = ctx.run_body(body, env, [*state, *slices])
        state = outs[:n_state]
        per_step.append(outs[n_state:])
    if n_scan_out and not per_step:
        raise ctx.fail("scans zero steps, so its scan outputs have no element shape")
    results = list(state)
    for k in range(n_scan_out):
        steps = [s[k] for s in per_step]
        if out_dirs[k]:
            steps.reverse()
        rank = steps[0].type.rank + 1
        a = out_axes[k] + rank if out_axes[k] < 0 else out_axes[k]
        results.append(ctx.stack(steps, a))
    return results
