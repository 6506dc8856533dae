"""The actor graph of one rank's program.

Every node that runs code (a kernel, a library call, a collective, a copy) is an actor; a
view (Reshape, Squeeze, ...) runs nothing and is an alias of its input's bytes, so reading a
view is reading its base. Each value an actor writes is a register: the bytes its consumers
read. A register's ``count`` is how many copies of it exist (k = 1: the next write waits for
every reader of the previous one; k > 1 lets k micro-batches be in flight). An actor may fire
once each input register holds its data and an output register is free again (every
consumer of the previous use has fired) -- OneFlow's req/ack, decided here at compile time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from flowc.ir.graph import Graph, Node, Value
from flowc.ir.types import TensorType
from flowc.ops.registry import get_op, is_view, state_writes
from flowc.parallel.cost import COLLECTIVE_OPS, Profile, device_share, kernel_time

KINDS = ("node", "collective", "copy", "send", "recv", "exchange")


@dataclass
class Register:
    id: int
    value: Value  # the storage root the producer writes
    nbytes: int
    producer: int  # actor id; -1 for a graph input or constant
    consumers: list[int] = field(default_factory=list)
    count: int = 1


@dataclass
class Actor:
    id: int
    node: Node
    kind: str
    time_s: float  # alone on the device, from the cost model
    share: float  # fraction of the device it occupies alone (see parallel.cost.device_share)
    inputs: list[int] = field(default_factory=list)  # registers read
    outputs: list[int] = field(default_factory=list)  # registers written
    deps: list[int] = field(default_factory=list)  # actors whose registers it reads
    stage: int = 0
    microbatch: int = 0
    # The earliest it may start (a pipeline's receive: when the sending stage sends).
    release_s: float = 0.0

    @property
    def name(self) -> str:
        return self.node.name or self.node.op

    @property
    def op(self) -> str:
        return self.node.op


@dataclass
class ActorGraph:
    graph: Graph
    actors: list[Actor]
    registers: list[Register]
    register_of: dict[Value, int]  # every value (views through their base) -> register
    views: list[Node]  # alias nodes, in graph order

    def users(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.actors]
        for a in self.actors:
            for d in a.deps:
                out[d].append(a.id)
        return out


def actor_kind(node: Node) -> str:
    if node.op in COLLECTIVE_OPS:
        return "collective"
    if node.op in ("Send", "Recv", "Exchange"):
        return node.op.lower()
    if get_op(node.op).view:
        return "copy"  # a view whose result is a graph output: its bytes are copied
    return "node"


def _at_sizes(node: Node, sizes: Mapping[str, int]) -> Node:
    """``node`` as it runs when the symbols have ``sizes``: what its cost is weighed at (a
    stand-in outside the graph)."""

    def value(v: Value | None) -> Value | None:
        if v is None or v.type.sym is None:
            return v
        return Value(v.name, TensorType(v.type.shape_at(sizes), v.type.dtype), const=v.const)

    outs = [value(o) for o in node.outputs]
    stand_in = Node(node.op, [value(i) for i in node.inputs], [o for o in outs if o], node.attrs)
    stand_in.name = node.name
    for o in node.outputs:  # Node() took the outputs' producer: give it back
        o.producer = node
    return stand_in


def build_actor_graph(graph: Graph, profile: Profile) -> ActorGraph:
    """Actors in the graph's (topological) order, registers for every value they write and
    for the graph's inputs and constants (producer -1). A graph with symbolic dims is costed
    at each symbol's typical size (--dim batch=1..64@8; the bound when none is named); its
    registers hold the bound's bytes, which the memory is planned for."""
    typical = {s: r.weighed for s, r in graph.symbols.items()}
    costed = (lambda n: _at_sizes(n, typical)) if typical else (lambda n: n)
    registers: list[Register] = []
    register_of: dict[Value, int] = {}

    def new_register(v: Value, producer: int) -> int:
        r = Register(len(registers), v, v.type.nbytes, producer)
        registers.append(r)
        register_of[v] = r.id
        return r.id

    for v in [*graph.inputs, *graph.constants]:
        new_register(v, -1)
    actors: list[Actor] = []
    views: list[Node] = []
    for node in graph.nodes:
        if is_view(graph, node):
            src = node.inputs[0] if node.inputs else None
            if src is not None and src in register_of:
                register_of[node.outputs[0]] = register_of[src]
            else:  # a view of nothing (no input): its own empty register
                new_register(node.outputs[0], -1)
            views.append(node)
            continue
        a = Actor(
            len(actors),
            node,
            actor_kind(node),
            kernel_time(costed(node), profile),
            device_share(costed(node), profile),
        )
        for i in node.inputs:
            if i is None:
                continue
            r = register_of[i]
            if r not in a.inputs:
                a.inputs.append(r)
                registers[r].consumers.append(a.id)
                p = registers[r].producer
                if p >= 0 and p not in a.deps:
                    a.deps.append(p)
        for o in node.outputs:
            a.outputs.append(new_register(o, a.id))
        actors.append(a)
    # A state write overwrites its input's bytes: it waits for every reader of them (the
    # order_state_writes pass put those readers first).
    actor_of = {a.node: a for a in actors}
    for w in state_writes(graph):
        wa = actor_of[w.writer]
        for reader in w.readers:
            ra = actor_of.get(reader)
            if ra is None:
                continue
            if ra.id > wa.id:
                raise ValueError(
                    f"internal: state write {w.writer.name!r} comes before its reader "
                    f"{reader.name!r} (run the order_state_writes pass)"
                )
            if ra.id not in wa.deps:
                wa.deps.append(ra.id)
    return ActorGraph(graph, actors, registers, register_of, views)
