"""An independent check of a memory plan against the program as emitted, written apart from
the planner on purpose.

It replays the emitted per-stream operations (runs, event records, event waits) with its
own vector clocks -- a wait orders its stream after the latest record of the event at the
time the wait is issued, as on a GPU -- and fails if a node may read a value before (or
without) its write having happened, if two values whose bytes overlap are not ordered (the
earlier one's every access before the later one's write; the one exception: an element-wise
node writing over the input only it still reads), if a stream is not joined back into
stream 0 by the end of the run, if a view is not at its base's bytes, if anything is
misaligned or outside the arena, or if the plan's lower bound is not the peak of live
aligned bytes in issue order. A stream's library workspace counts as one more stored value,
written by the stream's first library call (an op's ``library``) and read by the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flowc.ir.graph import Graph, Value
from flowc.memory.plan import ALIGN, MemoryPlan
from flowc.ops.registry import get_op
from flowc.schedule.program import StreamOp


class PlanError(AssertionError):
    pass


@dataclass(frozen=True)
class _Workspace:
    """A stream's library workspace, checked as a value of its own."""

    stream: int
    nbytes: int

    @property
    def name(self) -> str:
        return f"the library workspace of stream {self.stream}"


def linear_program(plan: MemoryPlan) -> list[StreamOp]:
    """A one-stream program running the plan's steps in order."""
    return [StreamOp("run", 0, node) for node in plan.steps]


def check_memory_plan(
    graph: Graph, plan: MemoryPlan, program: Sequence[StreamOp] | None = None
) -> None:
    ops = list(linear_program(plan) if program is None else program)
    outputs = set(graph.outputs)
    external = set(graph.inputs) | set(graph.constants) | outputs

    view_of: dict[Value, Value] = {}
    for node in graph.nodes:
        if (
            get_op(node.op).view
            and node.outputs[0] not in outputs
            and node.inputs
            and node.inputs[0] is not None
        ):
            view_of[node.outputs[0]] = node.inputs[0]

    def base(v: Value) -> Value:
        while v in view_of:
            v = view_of[v]
        return v

    # Replay: each run gets (stream, position, clock).
    streams = 1 + max((op.stream for op in ops), default=0)
    clock = [[0] * streams for _ in range(streams)]
    recorded: dict[int, list[int]] = {}
    runs: list[tuple[int, int, list[int]]] = []
    for op in ops:
        s = op.stream
        if op.kind == "record":
            recorded[op.event] = list(clock[s])
        elif op.kind == "wait":
            if op.event not in recorded:
                raise PlanError(f"stream {s} waits on event {op.event} before any record of it")
            clock[s] = [max(x, y) for x, y in zip(clock[s], recorded[op.event], strict=True)]
        elif op.kind == "run":
            clock[s][s] += 1
            assert op.node is not None
            runs.append((s, clock[s][s], list(clock[s])))
        else:
            raise PlanError(f"unknown operation {op.kind!r}")
    for s in range(1, streams):
        if clock[0][s] < clock[s][s]:
            raise PlanError(f"stream {s} is not joined into stream 0 at the end of the run")

    def hb(a: int, b: int) -> bool:
        sa, pa, _ = runs[a]
        return a == b or runs[b][2][sa] >= pa

    steps = [op.node for op in ops if op.kind == "run" and op.node is not None]
    step_stream = [op.stream for op in ops if op.kind == "run" and op.node is not None]
    # Accesses of each stored value (a read of a view is a read of its base).
    writer: dict[Value | _Workspace, int] = {}
    readers: dict[Value | _Workspace, list[int]] = {}
    for k, node in enumerate(steps):
        for i in node.inputs:
            if i is not None:
                readers.setdefault(base(i), []).append(k)
        for o in node.outputs:
            if o not in view_of:
                writer[o] = k
        if get_op(node.op).library and plan.workspace_bytes:
            ws = _Workspace(step_stream[k], plan.workspace_bytes)
            if ws.stream not in plan.workspaces:
                raise PlanError(
                    f"{node.op} {node.name!r} calls a library on stream "
                    f"{ws.stream}, which has no workspace"
                )
            if ws in writer:
                readers.setdefault(ws, []).append(k)
            else:
                writer[ws] = k
    for v, rs in readers.items():
        w = writer.get(v)
        if w is None:
            continue
        for r in rs:
            if not hb(w, r):
                raise PlanError(
                    f"{steps[r].op} {steps[r].name!r} may read {v.name!r} before "
                    f"{steps[w].op} {steps[w].name!r} writes it (no event orders them)"
                )

    arena: dict[Value | _Workspace, tuple[int, int]] = {}
    buffer_of: dict[Value | _Workspace, int] = {}
    for v in writer:
        if isinstance(v, _Workspace):
            buffer_of[v] = plan.workspaces[v.stream]
            lo, hi = plan.workspace_offset(v.stream), plan.workspace_offset(v.stream) + v.nbytes
        elif v in external:
            continue
        elif v not in plan.value_buffer:
            raise PlanError(f"intermediate {v.name!r} has no place in the arena")
        else:
            buffer_of[v] = plan.value_buffer[v]
            lo = plan.offset(v)
            hi = lo + v.type.nbytes
        if lo % ALIGN:
            raise PlanError(f"{v.name!r} at offset {lo} is not {ALIGN}-byte aligned")
        if hi > plan.arena_bytes:
            raise PlanError(f"{v.name!r} ends at {hi}, past the arena ({plan.arena_bytes} bytes)")
        arena[v] = (lo, hi)
    for v, b in view_of.items():
        if (
            b in plan.value_buffer
            and v in plan.value_buffer
            and plan.offset(v) != plan.offset(base(b))
        ):
            raise PlanError(f"view {v.name!r} is not placed at its base {base(b).name!r}")

    def accesses(v: Value | _Workspace) -> list[int]:
        return [writer[v], *readers.get(v, [])]

    def before(u: Value | _Workspace, v: Value | _Workspace) -> bool:
        """Every access of ``u`` happens before ``v`` is written, or ``v``'s writer is an
        element-wise node overwriting ``u`` in place as the last access of ``u``."""
        w = writer[v]
        others = [a for a in accesses(u) if a != w]
        if not all(hb(a, w) for a in others):
            return False
        if w in accesses(u):
            return (
                get_op(steps[w].op).family == "elementwise"
                and arena[u][0] == arena[v][0]
                and arena[u][1] >= arena[v][1]
            )
        return True

    # Sweep by offset: only values whose bytes overlap are compared.
    by_lo = sorted(arena, key=lambda v: (arena[v][0], writer[v]))
    active: list[Value | _Workspace] = []
    for v in by_lo:
        lo, hi = arena[v]
        active = [u for u in active if arena[u][1] > lo]
        for u in active:
            if before(u, v) or before(v, u):
                continue
            first, second = (u, v) if writer[u] < writer[v] else (v, u)
            w = writer[second]
            raise PlanError(
                f"{steps[w].op} {steps[w].name!r}: {second.name!r} {list(arena[second])} "
                f"overwrites {first.name!r} {list(arena[first])}, which may still be read "
                "(no happens-before order between them)"
            )
        active.append(v)

    # The bound: the peak of live aligned bytes over the issue order.
    delta = [0] * (len(steps) + 2)
    members: dict[int, list[Value | _Workspace]] = {}
    for v in arena:
        members.setdefault(buffer_of[v], []).append(v)
    for bid, vs in members.items():
        acc = [a for u in vs for a in accesses(u)]
        delta[min(acc)] += plan.buffers[bid].size
        delta[max(acc) + 1] -= plan.buffers[bid].size
    peak = live = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    if plan.lower_bound != peak:
        raise PlanError(
            f"the plan's lower bound {plan.lower_bound} differs from the replayed peak {peak}"
        )
