"""Lowering: a logical graph and its plan to one rank's (physical) graph.

Every rank runs the same program (SPMD) on equal local shapes; what differs between ranks is
the weights (each rank's file holds its shards) and the device coordinates that the
coordinate-dependent ops read at run time. The physical graph:

- takes every graph input whole (every rank reads the whole input) and cuts its shard with a
  free local slice;
- holds each constant at its local shape; ``Physical.shards`` maps it to the logical array and
  layout each rank's piece is cut from;
- runs every node on local shapes (constants that spell out shapes are replaced through the
  op's ``localize`` hook; a signature may name another op to run, as a vocabulary-split
  Gather runs GatherShard);
- holds a float16/bfloat16 partial sum (P) in float32: a node with such an output computes
  in float32 (its narrow operands widened, a weight shard stored widened), the reduction
  adds float32 values, and the sum is rounded to the narrow type after it; so a mesh
  rounds where one device does, once, after the sum;
- inserts the boxing steps wherever a consumer wants another layout than its producer gives,
  as communication ops (flowc.ops.comm) with Reshape/Transpose around them when the tensor
  axis is not the first, and makes every graph output whole (all-B) at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flowc.ir.dtype import DType
from flowc.ir.graph import Graph, Node, Value, is_splat, make_splat
from flowc.ir.layout import (
    NARROW_FLOATS,
    broadcast,
    carried_type,
    has_partial,
    is_partial_root,
    local_type,
    shard,
)
from flowc.ir.types import Mesh, NdSbp, TensorType
from flowc.ops.registry import get_op
from flowc.parallel import boxing as bx
from flowc.parallel.cost import Profile, boxing_plan
from flowc.parallel.plan import Plan


@dataclass
class Physical:
    """One rank's graph plus what makes it rank-specific."""

    graph: Graph
    mesh: Mesh
    # Physical constant -> (logical array, layout): rank r holds shard(array, layout, r).
    shards: dict[Value, tuple[np.ndarray, NdSbp]] = field(default_factory=dict)
    # Boxing that runs: (logical value, consumer or None for a graph output, step).
    boxing: list[tuple[Value, Node | None, bx.BoxingStep]] = field(default_factory=list)
    # Physical comm node -> the boxing step it carries out.
    comm_steps: dict[Node, bx.BoxingStep] = field(default_factory=dict)
    # A training step's state that is not whole on every rank (ZeRO: split), by name: rank r
    # keeps shard(first value, layout, r), and its input and output are that shard.
    state_layouts: dict[str, NdSbp] = field(default_factory=dict)

    def state_for(self, name: str, array: np.ndarray, coords: tuple[int, ...]) -> np.ndarray:
        """Rank ``coords``'s first value of state ``name`` (``array``: the whole one)."""
        layout = self.state_layouts.get(name)
        if layout is None:
            return array
        if is_splat(array):
            shape = local_type(TensorType(array.shape, DType.F32), layout, self.mesh).shape
            return make_splat(array.reshape(-1)[0] if array.size else 0, shape, array.dtype)
        return shard(array, layout, self.mesh, coords)

    def constant_for(self, v: Value, coords: tuple[int, ...]) -> np.ndarray:
        """Rank ``coords``'s data for physical constant ``v``."""
        assert v.const is not None
        if v not in self.shards:
            return v.const
        array, sbp = self.shards[v]
        if is_splat(array):
            t = local_type(TensorType(array.shape, v.type.dtype), sbp, self.mesh)
            value = array.reshape(-1)[0] if array.size else 0
            if not is_partial_root(sbp, coords):
                value = 0
            return make_splat(value, t.shape, array.dtype)
        return shard(array, sbp, self.mesh, coords)


def _as_f32(a: np.ndarray) -> np.ndarray:
    """A constant in float32 (a fill stays a fill: it is not expanded)."""
    if is_splat(a):
        return make_splat(
            np.float32(a.reshape(-1)[0] if a.size else 0), a.shape, np.dtype(np.float32)
        )
    return a.astype(np.float32)


class _Lowerer:
    def __init__(
        self, graph: Graph, plan: Plan, profile: Profile | None, local_io: bool = False
    ) -> None:
        self.local_io = local_io
        self.logical = graph
        self.plan = plan
        self.mesh = plan.mesh
        self.profile = profile
        self.g = Graph(graph.name)
        self.g.mesh = plan.mesh
        self.g.meta = dict(graph.meta)
        self.phys = Physical(self.g, plan.mesh)
        # (logical value, layout) -> the physical value holding it so.
        self.held: dict[tuple[Value, NdSbp], Value] = {}
        self.mesh_attr = tuple(plan.mesh.shape)
        # Physical value -> its float32 copy (widen()).
        self.widened: dict[Value, Value] = {}

    # -- building blocks --------------------------------------------------------------------

    def add(self, op: str, inputs: list[Value | None], attrs: dict[str, Any], name: str) -> Node:
        opdef = get_op(op)
        probe = Node(op, inputs, [], attrs, name)
        types = opdef.infer(opdef.ctx(probe))
        probe.outputs = []
        return self.g.add_node(op, inputs, types, attrs, name=name)

    def const(self, name: str, array: np.ndarray) -> Value:
        return self.g.add_constant(name, array)

    def cast(self, x: Value, to: DType, name: str) -> Value:
        return self.add("Cast", [x], {"to": to.onnx, "saturate": 0}, name).outputs[0]

    def widen(self, x: Value) -> Value:
        """``x`` in float32 when it is a narrow float: a constant (a weight shard) is stored
        widened, so nothing is cast at run time; a computed value gets a Cast."""
        if x.type.dtype not in NARROW_FLOATS:
            return x
        if x in self.widened:
            return self.widened[x]
        if x.const is not None:
            w = self.const(f"{x.name}/f32", _as_f32(x.const))
            if x in self.phys.shards:
                array, sbp = self.phys.shards[x]
                self.phys.shards[w] = (_as_f32(array), sbp)
        else:
            w = self.cast(x, DType.F32, f"{x.name}/f32")
        self.widened[x] = w
        return w

    def reshape(self, x: Value, shape: tuple[int, ...], name: str) -> Value:
        if x.type.shape == shape:
            return x
        s = self.const(f"{name}/shape", np.array(shape, dtype=np.int64))
        return self.add("Reshape", [x, s], {}, f"{name}/reshape").outputs[0]

    def move_axis(self, x: Value, src: int, dst: int, name: str) -> Value:
        """Move axis ``src`` to ``dst``: a Reshape when only size-1 axes are passed over."""
        shape = list(x.type.shape)
        perm = list(range(len(shape)))
        perm.insert(dst, perm.pop(src))
        lo, hi = min(src, dst), max(src, dst)
        passed = [shape[k] for k in range(lo, hi + 1) if k != src]
        new_shape = tuple(shape[k] for k in perm)
        if math.prod(passed) == 1 or shape[src] == 1:
            return self.reshape(x, new_shape, name)
        return self.add("Transpose", [x], {"perm": perm}, f"{name}/transpose").outputs[0]

    # -- boxing -----------------------------------------------------------------------------

    def step(self, x: Value, step: bx.BoxingStep, name: str) -> Value:
        a = step.mesh_axis
        p = step.group_size
        comm = {"mesh": self.mesh_attr, "mesh_axis": a}
        src, dst = step.src.parts[a], step.dst.parts[a]
        shape = x.type.shape
        node: Node
        if step.collective == bx.ALL_REDUCE:
            node = self.add("AllReduce", [x], comm, name)
            y = node.outputs[0]
        elif step.collective == bx.B_TO_P:
            node = self.add("ShardZero", [x], comm, name)
            y = node.outputs[0]
        elif step.collective == bx.LOCAL_SLICE:
            node = self.add("ShardSlice", [x], {**comm, "axis": dst.axis}, name)
            y = node.outputs[0]
        elif step.collective == bx.ALL_GATHER:
            d = src.axis
            assert d is not None
            node = self.add("AllGather", [x], comm, name)
            stacked = self.move_axis(node.outputs[0], 0, d, name)
            y = self.reshape(stacked, (*shape[:d], shape[d] * p, *shape[d + 1 :]), name)
        elif step.collective == bx.REDUCE_SCATTER:
            d = dst.axis
            assert d is not None
            split = self.reshape(x, (*shape[:d], p, shape[d] // p, *shape[d + 1 :]), name)
            front = self.move_axis(split, d, 0, name)
            node = self.add("ReduceScatter", [front], comm, name)
            y = node.outputs[0]
        else:  # all-to-all: S(i) -> S(j)
            i, j = src.axis, dst.axis
            assert i is not None and j is not None
            split = self.reshape(x, (*shape[:j], p, shape[j] // p, *shape[j + 1 :]), name)
            front = self.move_axis(split, j, 0, name)
            node = self.add("AllToAll", [front], comm, name)
            rest = (*shape[:j], shape[j] // p, *shape[j + 1 :])
            back = self.move_axis(node.outputs[0], 0, i, name)
            y = self.reshape(back, (*rest[:i], rest[i] * p, *rest[i + 1 :]), name)
        self.phys.comm_steps[node] = step
        return y

    def box(self, v: Value, want: NdSbp, consumer: Node | None, have: NdSbp | None = None) -> Value:
        key = (v, want)
        if key in self.held:
            return self.held[key]
        have = self.plan.value_sbp[v] if have is None else have
        base = self.held[(v, have)]
        steps = (
            bx.boxing_steps(v.type, self.mesh, have, want)
            if self.profile is None
            else boxing_plan(v.type, self.mesh, have, want, self.profile)
        )
        x = base
        for k, st in enumerate(steps):
            if has_partial(st.dst) and x.type.dtype != carried_type(v.type, st.dst).dtype:
                x = self.widen(x)  # B -> P: the partial sum is carried in float32
            x = self.step(x, st, f"box/{v.name}/{k}")
            if not has_partial(st.dst) and x.type.dtype != v.type.dtype:
                # Reduced: rounded to the narrow type once, after the sum.
                x = self.cast(x, v.type.dtype, f"box/{v.name}/{k}/round")
            self.phys.boxing.append((v, consumer, st))
            self.held.setdefault((v, st.dst), x)
        self.held[key] = x
        return x

    # -- the graph --------------------------------------------------------------------------

    def run(self) -> Physical:
        mesh = self.mesh
        whole = broadcast(mesh)
        state = self.logical.state
        for v in self.logical.inputs:
            layout = self.plan.value_sbp[v]
            if v.name in state and layout != whole:
                # Split state (ZeRO): each rank keeps its shard, in place from step to step.
                self.phys.state_layouts[v.name] = layout
                self.held[(v, layout)] = self.g.add_input(v.name, local_type(v.type, layout, mesh))
                continue
            if self.local_io:
                # Each rank is handed its own part of the input (a micro-batch).
                local = carried_type(local_type(v.type, layout, mesh), layout)
                self.held[(v, layout)] = self.g.add_input(v.name, local)
                continue
            x = self.g.add_input(v.name, v.type)
            self.held[(v, whole)] = x
            if layout != whole:
                # Every rank reads the whole input and keeps its shard: free local slices.
                self.box(v, layout, None, have=whole)
        for c in self.logical.constants:
            assert c.const is not None
            layout = self.plan.value_sbp[c]
            t = local_type(c.type, layout, mesh)
            origin = (0,) * mesh.ndim
            if layout == whole:
                pc = self.const(c.name, c.const)
            else:
                piece = (
                    make_splat(
                        c.const.reshape(-1)[0] if c.const.size else 0, t.shape, c.const.dtype
                    )
                    if is_splat(c.const)
                    else shard(c.const, layout, mesh, origin)
                )
                pc = self.const(c.name, piece)
                self.phys.shards[pc] = (c.const, layout)
            self.held[(c, layout)] = pc
        for node in self.logical.nodes:
            self.lower_node(node)
        outs = [
            self.box(
                o,
                self.plan.value_sbp[o] if self.local_io else self.plan.leaves_as(self.logical, o),
                None,
            )
            for o in self.logical.outputs
        ]
        for o, x in zip(self.logical.outputs, outs, strict=True):
            self.rename_output(x, o.name)
        self.g.outputs = outs
        # A training step's state (the inputs and the outputs written over them keep their
        # names): whole on every rank, or its shard (state_layouts).
        self.g.state = dict(self.logical.state)
        self.g.params = {n: a for n, a in self.logical.params.items() if n in self.g.state}
        self.g.train = dict(self.logical.train)
        # A weight shard that only its widened copy serves is not shipped.
        read = {i for n in self.g.nodes for i in n.inputs if i is not None} | set(outs)
        dropped = {c for c in self.widened if c.const is not None and c not in read}
        if dropped:
            self.g.constants = [c for c in self.g.constants if c not in dropped]
            for c in dropped:
                self.phys.shards.pop(c, None)
        return self.phys

    def rename_output(self, x: Value, name: str) -> None:
        """Outputs keep their logical names (the C API and flowc_model.json show them): the
        value holding the name before boxing takes another."""
        if x.name == name:
            return
        holder = next((v for v in self.g.values() if v.name == name), None)
        if holder is not None:
            if holder in self.g.inputs:
                return
            self.g.rename(holder, self.g.unique_name(f"{name}/local"))
        self.g.rename(x, name)

    def lower_node(self, node: Node) -> None:
        strategy = self.plan.node_strategy[node]
        opdef = get_op(node.op)
        inputs: list[Value | None] = []
        for i, v in enumerate(node.inputs):
            if v is None:
                inputs.append(None)
                continue
            want = strategy.input(i)
            assert want is not None
            inputs.append(self.box(v, want, node))
        local_outs = [
            local_type(o.type, strategy.output(j), self.mesh) for j, o in enumerate(node.outputs)
        ]
        # In float32 when it makes a narrow partial sum or takes one (a linear op on P).
        wide = any(
            carried_type(o.type, strategy.output(j)) != o.type for j, o in enumerate(node.outputs)
        ) or any(
            x is not None and v is not None and x.type.dtype != v.type.dtype
            for x, v in zip(inputs, node.inputs, strict=True)
        )
        if wide:
            inputs = [None if x is None else self.widen(x) for x in inputs]
            local_outs = [
                t.with_dtype(DType.F32) if t.dtype in NARROW_FLOATS else t for t in local_outs
            ]
        if opdef.localize is not None:
            local_ins = [None if x is None else x.type for x in inputs]
            for i, array in opdef.localize(node, local_ins, local_outs).items():  # type: ignore[arg-type]
                inputs[i] = self.const(f"{node.name or node.op}/local{i}", array)
        op = node.op
        attrs: dict[str, Any] = dict(node.attrs)
        if wide and op == "Cast" and int(attrs.get("to", 0)) in {d.onnx for d in NARROW_FLOATS}:
            attrs["to"] = DType.F32.onnx
        if strategy.physical is not None:
            op = strategy.physical
            attrs["mesh"] = self.mesh_attr
            attrs["shard_axes"] = tuple(
                a for a, sig in enumerate(strategy.axes) if sig.physical is not None
            )
            if "shard_dims" in get_op(op).attrs:
                # The output's tensor axis each of those mesh axes splits (an op that needs
                # its shard's place in the whole: TrainDropoutShard's element indices).
                out = strategy.output(0)
                dims = []
                for a in attrs["shard_axes"]:
                    dim = out.parts[a].axis
                    assert dim is not None
                    dims.append(dim)
                attrs["shard_dims"] = tuple(dims)
        pnode = self.g.add_node(
            op,
            inputs,
            local_outs,
            attrs,
            name=node.name,
            output_names=[o.name for o in node.outputs],
        )
        got = get_op(op).infer_types(pnode)
        # (shapes and types: what is symbolic in the rank graph is fitted after lowering)
        if [(t.shape, t.dtype) for t in got] != [(t.shape, t.dtype) for t in local_outs]:
            raise AssertionError(
                f"{node.op} node {node.name!r} under {strategy}: local types {got} != planned {local_outs}"
            )
        pnode.stage = node.stage
        for j, o in enumerate(node.outputs):
            y, layout = pnode.outputs[j], strategy.output(j)
            if y.type.dtype != carried_type(o.type, layout).dtype:
                y = self.cast(y, o.type.dtype, f"{node.name or node.op}/round{j}")
            self.held[(o, layout)] = y


def lower(
    graph: Graph, plan: Plan, profile: Profile | None = None, *, local_io: bool = False
) -> Physical:
    """One rank's graph for ``plan`` (see the module docstring); with ``profile`` the boxing
    sequences are the ones the cost model priced. With ``local_io`` each rank's inputs and
    outputs are its own parts in their planned layouts (micro-batches), not whole tensors."""
    plan.check(graph)
    return _Lowerer(graph, plan, profile, local_io).run()


def lower_boxing(
    ttype: TensorType,
    mesh: Mesh,
    src: NdSbp,
    dst: NdSbp,
    profile: Profile | None = None,
) -> Physical:
    """A physical graph that only converts its input (held as ``src``) to ``dst``: the unit
    the boxing tests run in the simulator."""
    logical = Graph("boxing")
    x = logical.add_input("x", ttype)
    logical.outputs = [x]
    plan = Plan(mesh, {}, {x: src}, method="given")
    low = _Lowerer(logical, plan, profile)
    px = low.g.add_input("x", local_type(ttype, src, mesh))
    low.held[(x, src)] = px
    low.g.outputs = [low.box(x, dst, None)]
    return low.phys
