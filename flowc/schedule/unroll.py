"""A pipeline stage's micro-batches unrolled into one actor program, with register counts.

A stage runs the same graph once per micro-batch. Rather than a loop whose every iteration
waits for the one before, the M micro-batches become M copies of the stage graph in one
graph (copy m reads micro-batch m's slice of each input and writes its slice of each
output; constants and inputs every micro-batch reads whole are shared), so the actor
simulator orders them and the memory plan places them like any other program: stage s can
compute micro-batch m+1 while m is still being sent.

What bounds the overlap is each register's count k: the copy of an actor for micro-batch
m+k writes a register only after every reader of that register's micro-batch-m copy has
fired (the back-pressure edges, OneFlow's ack). The values crossing a cut (what a Send reads,
what a Recv writes) have k = BOUNDARY_REGISTERS, double buffers, so a transfer overlaps the
next micro-batch's work; every other register has k = 1. The memory plan over the unrolled
program then holds the copies: those whose lives are ordered share bytes. A cut's transfers
stay in micro-batch order on both sides (an edge from each to the next), so the two ranks
of a transfer always issue it in the same place of their sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowc.ir.graph import Graph, Node, Value
from flowc.ir.verify import verify_graph
from flowc.parallel.cost import Profile
from flowc.schedule.actors import ActorGraph, build_actor_graph
from flowc.schedule.program import Schedule
from flowc.schedule.streams import schedule_actors

# Copies of a register that crosses a cut: micro-batch m+1 is written while m is in flight.
BOUNDARY_REGISTERS = 2
TRANSFER_OPS = frozenset({"Send", "Recv"})


@dataclass
class Unrolled:
    graph: Graph
    microbatches: int
    # Per input of ``graph``: (the stage graph's input index, micro-batch; -1 for an input
    # every micro-batch reads whole, shared by all copies). Likewise per output.
    inputs: list[tuple[int, int]] = field(default_factory=list)
    outputs: list[tuple[int, int]] = field(default_factory=list)
    # Per node of ``graph``: (the stage graph's node index, micro-batch).
    origin: dict[Node, tuple[int, int]] = field(default_factory=dict)


def unroll(
    stage: Graph, microbatches: int, input_strides: list[int], output_strides: list[int]
) -> Unrolled:
    """``stage`` once per micro-batch, the copies in micro-batch order (so the actor of
    node j for micro-batch m has id m * n + j, n the stage's actor count). An input or
    output of stride 0 (the same for every micro-batch) is read once and written by the
    last copy only. With one micro-batch the graph is ``stage``'s nodes under their names."""
    g = Graph(stage.name)
    g.meta = dict(stage.meta)
    out = Unrolled(g, microbatches)
    for c in stage.constants:
        g.claim_name(c.name)
        g.constants.append(c)  # the same values: one weights layout serves every copy

    def suffix(name: str, m: int) -> str:
        return name if microbatches == 1 else f"{name}@mb{m}"

    shared: dict[Value, Value] = {}
    for k, (v, stride) in enumerate(zip(stage.inputs, input_strides, strict=True)):
        if stride == 0:
            shared[v] = g.add_input(suffix(v.name, 0) if microbatches > 1 else v.name, v.type)
            out.inputs.append((k, -1))
    for m in range(microbatches):
        vmap: dict[Value, Value] = {c: c for c in stage.constants}
        vmap.update(shared)
        for k, (v, stride) in enumerate(zip(stage.inputs, input_strides, strict=True)):
            if stride != 0:
                vmap[v] = g.add_input(suffix(v.name, m), v.type)
                out.inputs.append((k, m))
        for j, node in enumerate(stage.nodes):
            copy = g.add_node(
                node.op,
                [vmap[i] if i is not None else None for i in node.inputs],
                [o.type for o in node.outputs],
                node.attrs,
                name=suffix(node.name, m) if node.name else "",
                output_names=[suffix(o.name, m) for o in node.outputs],
            )
            copy.stage = node.stage
            copy.sym_attrs = dict(node.sym_attrs)
            out.origin[copy] = (j, m)
            for o, c in zip(node.outputs, copy.outputs, strict=True):
                vmap[o] = c
        for k, (v, stride) in enumerate(zip(stage.outputs, output_strides, strict=True)):
            if stride != 0 or m == microbatches - 1:
                g.outputs.append(vmap[v])
                out.outputs.append((k, m if stride != 0 else -1))
    verify_graph(g)
    return out


def add_back_pressure(ag: ActorGraph, unrolled: Unrolled) -> None:
    """Give each register its count and each actor the back-pressure edges it implies: the
    copy for micro-batch m+k of an actor writing a register with count k fires after every
    reader of the copy for micro-batch m (and after that copy's writer)."""
    if unrolled.microbatches == 1:
        return
    actor_of: dict[tuple[int, int], int] = {}
    for a in ag.actors:
        j, m = unrolled.origin[a.node]
        a.microbatch = m
        actor_of[(j, m)] = a.id
    for reg in ag.registers:
        p = reg.producer
        boundary = p >= 0 and ag.actors[p].op == "Recv"
        boundary = boundary or any(ag.actors[c].op == "Send" for c in reg.consumers)
        reg.count = BOUNDARY_REGISTERS if boundary else 1
    for a in ag.actors:
        j, m = unrolled.origin[a.node]
        for slot, r in enumerate(a.outputs):
            k = ag.registers[r].count
            if m < k:
                continue
            # The same register of the copy k micro-batches back: its writer and readers.
            earlier = ag.registers[ag.actors[actor_of[(j, m - k)]].outputs[slot]]
            for d in [earlier.producer, *earlier.consumers]:
                if d >= 0 and d != a.id and d not in a.deps:
                    a.deps.append(d)
        # A cut's transfers go in micro-batch order on both sides, so that every pair of
        # ranks issues matching sends and receives (NCCL and MPI pair them in issue order).
        if a.op in TRANSFER_OPS and m > 0:
            prev = actor_of[(j, m - 1)]
            if prev not in a.deps:
                a.deps.append(prev)


def schedule_stages(
    stages: list[Unrolled], profile: Profile, streams: int | None = None
) -> list[Schedule]:
    """Each stage's unrolled actors simulated in stage order: a receive of stage s may start
    no earlier than the matching send of stage s - 1 (the same micro-batch's j-th send
    there for its j-th receive) starts in that stage's schedule."""
    out: list[Schedule] = []
    sends: dict[tuple[int, int], float] = {}  # (micro-batch, j) -> start of the j-th send
    for s, u in enumerate(stages):
        ag = build_actor_graph(u.graph, profile)
        add_back_pressure(ag, u)
        count: dict[int, int] = {}
        for a in ag.actors:
            a.stage = s
            if a.op == "Recv" and s > 0:
                j = count.get(a.microbatch, 0)
                count[a.microbatch] = j + 1
                a.release_s = sends.get((a.microbatch, j), 0.0)
        sched = schedule_actors(ag, profile, streams)
        sends = {}
        count = {}
        for a in ag.actors:
            if a.op == "Send":
                j = count.get(a.microbatch, 0)
                count[a.microbatch] = j + 1
                sends[(a.microbatch, j)] = sched.start_s[a.id]
        out.append(sched)
    return out
