"""An independent check of a memory plan against the program as emitted, written apart from
the planner on purpose.

It replays the emitted per-stream operations (runs, event records, event waits) with its
own vector clocks -- a wait orders its stream after the latest record of the event at the
time the wait is issued, as on a GPU -- and fails if a node may read a value before (or
without) its write having happened, if two values whose bytes overlap are not ordered (the
earlier one's every access before the later one's write; the one exception: an element-wise
node writing over the input only it still reads), if a stream is not joined back into
stream 0 by the end of the run, if a training step's state is overwritten (Graph.state)
before a reader of it has run, if a view is not at its base's bytes, if anything is
misaligned or outside the arena, or if the plan's lower bound is not the peak of live
aligned bytes in issue order, each buffer live from its first access to its join (the first
step after which every later step happens after all its accesses). A stream's library
workspace counts as one more stored value, written by the stream's first library call (an
op's ``library``) and read by the others.

Aliases (the plan's ``elided`` nodes and ``concat_inputs``): each aliased value must lie
inside its base's bytes exactly where the op puts it -- found here by running the op's
reference on arrays of element indices, not by the planner's arithmetic -- and be an arena
value produced by a node that runs. Aliases are the same storage: a value's accesses are
those of every alias whose bytes meet its own, and its writes those of the aliases that
write (an elided node writes nothing), so a value overlapping any of them must be ordered
after all of those accesses (or all of its own before their writes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flowc.ir.graph import Graph, Node, Value
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
        need = get_op(node.op).workspace_bytes(node, plan.workspace_cap)
        if need > 0:
            ws = _Workspace(step_stream[k], plan.workspace_size(step_stream[k]))
            if ws.stream not in plan.workspaces or ws.nbytes < need:
                raise PlanError(
                    f"{node.op} {node.name!r} calls a library on stream {ws.stream} that may "
                    f"use {need} bytes of workspace, which the stream has not"
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

    # State writes (Graph.state): a training step's next parameter is written over the
    # parameter's bytes, so every other access of them happens before the write, and a
    # writer that reads them itself does so element by element.
    for x, xn in graph.state_pairs():
        w = writer.get(xn)
        if w is None:
            raise PlanError(f"state {x.name!r}: nothing writes its next value {xn.name!r}")
        for r in readers.get(x, []):
            if r == w:
                if get_op(steps[w].op).family != "elementwise":
                    raise PlanError(
                        f"{steps[w].op} {steps[w].name!r} writes {xn.name!r} over {x.name!r}, "
                        "which it reads other than element by element"
                    )
            elif not hb(r, w):
                raise PlanError(
                    f"{steps[w].op} {steps[w].name!r} may overwrite {x.name!r} (with "
                    f"{xn.name!r}) before {steps[r].op} {steps[r].name!r} reads it "
                    "(no event orders them)"
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

    # Aliases: each claimed one at its op's offset in its base, an arena value written by
    # a node that runs.
    alias_of = _check_aliases(graph, plan, arena, external, view_of, base)
    family: dict[Value | _Workspace, Value | _Workspace] = {}

    def top(v: Value | _Workspace) -> Value | _Workspace:
        while isinstance(v, Value) and v in alias_of:
            v = alias_of[v]
        return v

    elided = plan.elided
    own_writes: dict[Value | _Workspace, list[int]] = {}
    own_acc: dict[Value | _Workspace, list[int]] = {}
    for v in arena:
        w = writer[v]
        writes = [] if steps[w] in elided else [w]
        own_writes[v] = writes
        own_acc[v] = [*writes, *readers.get(v, []), w]
        family[v] = top(v)
    members: dict[Value | _Workspace, list[Value | _Workspace]] = {}
    for v in arena:
        members.setdefault(family[v], []).append(v)

    def meets(u: Value | _Workspace, v: Value | _Workspace) -> bool:
        return arena[u][0] < arena[v][1] and arena[v][0] < arena[u][1]

    acc: dict[Value | _Workspace, list[int]] = {}
    wr: dict[Value | _Workspace, list[int]] = {}
    for v in arena:
        near = (
            [m for m in members[family[v]] if meets(m, v)] if len(members[family[v]]) > 1 else [v]
        )
        acc[v] = sorted({a for m in near for a in own_acc[m]})
        wr[v] = sorted({a for m in near for a in own_writes[m]})

    def in_place(u: Value | _Workspace, v: Value | _Workspace, w: int) -> bool:
        """``v`` is written by element-wise node ``w`` over an input's own bytes: every
        input of ``w`` whose bytes meet ``v``'s starts where ``v`` does and covers it (so
        each element is read before the same thread writes it), and ``u`` lies inside."""
        node = steps[w]
        if get_op(node.op).family != "elementwise" or wr[v] != [w]:
            return False
        lo, hi = arena[v]
        inside = False
        for i in node.inputs:
            if i is None or base(i) not in arena:
                continue
            ilo, ihi = arena[base(i)]
            if ilo < hi and lo < ihi:
                if ilo != lo or ihi < hi:
                    return False
                inside = inside or (ilo <= arena[u][0] and arena[u][1] <= ihi)
        return inside

    def before(u: Value | _Workspace, v: Value | _Workspace) -> bool:
        """Every access of ``u``'s bytes happens before every write of ``v``'s, or ``v``'s
        writer is an element-wise node overwriting ``u`` in place as its last access."""
        for w in wr[v]:
            others = [a for a in acc[u] if a != w]
            if not all(hb(a, w) for a in others):
                return False
            if w in acc[u] and not in_place(u, v, w):
                return False
        return True

    # Sweep by offset: only values whose bytes overlap are compared; aliases of one family
    # are one storage (checked above), so only values of different families are.
    by_lo = sorted(arena, key=lambda v: (arena[v][0], writer[v]))
    active: list[Value | _Workspace] = []
    for v in by_lo:
        lo, hi = arena[v]
        active = [u for u in active if arena[u][1] > lo]
        for u in active:
            if family[u] is family[v] or before(u, v) or before(v, u):
                continue
            first, second = (u, v) if writer[u] < writer[v] else (v, u)
            w = writer[second]
            raise PlanError(
                f"{steps[w].op} {steps[w].name!r}: {second.name!r} {list(arena[second])} "
                f"overwrites {first.name!r} {list(arena[first])}, which may still be read "
                "(no happens-before order between them)"
            )
        active.append(v)

    # The bound: the peak of live aligned bytes of the values over the issue order, each
    # buffer live from its first access to its join; plus the workspaces, which sit on top.
    on_stream: list[list[int]] = [[] for _ in range(streams)]
    for k, (s, _, _) in enumerate(runs):
        on_stream[s].append(k)
    delta = [0] * (len(steps) + 2)
    by_buffer: dict[int, list[Value | _Workspace]] = {}
    for v in arena:
        by_buffer.setdefault(buffer_of[v], []).append(v)
    for bid, vs in by_buffer.items():
        if plan.buffers[bid].workspace >= 0:
            continue
        touched = [a for u in vs for a in own_acc[u]]
        last = [0] * streams
        for a in touched:
            last[runs[a][0]] = max(last[runs[a][0]], runs[a][1])
        end = max(touched) + 1
        for ks in on_stream if streams > 1 else []:
            # The stream's runs that happen after every access form a suffix of it (its
            # clocks only grow): find where it begins.
            lo, hi = 0, len(ks)
            while lo < hi:
                mid = (lo + hi) // 2
                if all(c >= x for c, x in zip(runs[ks[mid]][2], last, strict=True)):
                    hi = mid
                else:
                    lo = mid + 1
            if lo > 0:
                end = max(end, ks[lo - 1] + 1)
        delta[min(touched)] += plan.buffers[bid].size
        delta[end] -= plan.buffers[bid].size
    peak = live = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    peak += plan.workspace_total()
    if plan.lower_bound != peak:
        raise PlanError(
            f"the plan's lower bound {plan.lower_bound} differs from the replayed peak {peak}"
        )


def _index_positions(node: Node, ins: list[np.ndarray | None]) -> list[np.ndarray]:
    """The op's reference applied to index arrays: where each element lands."""
    out = get_op(node.op).reference(ins, node.attrs.merged(get_op(node.op).attrs))
    if isinstance(out, np.ndarray):
        return [out]
    return [np.asarray(o) for o in out]


def _run_of(flat: np.ndarray) -> int | None:
    """The first index when ``flat`` is a run of consecutive indices, else None."""
    if flat.size == 0:
        return None
    first = int(flat[0])
    return first if np.array_equal(flat, np.arange(first, first + flat.size)) else None


def _check_aliases(
    graph: Graph,
    plan: MemoryPlan,
    arena: dict[Value | _Workspace, tuple[int, int]],
    external: set[Value],
    view_of: dict[Value, Value],
    base: object,
) -> dict[Value, Value]:
    """Verify every alias the plan claims; return alias -> the value it lies in."""
    alias_of: dict[Value, Value] = {}

    def consts(node: Node) -> list[np.ndarray | None]:
        return [None if i is None or i.const is None else np.asarray(i.const) for i in node.inputs]

    def at(v: Value, where: Value, elements: int, what: str) -> None:
        if v in external or v in view_of or v not in arena or where not in arena:
            raise PlanError(
                f"{what}: {v.name!r} is not an arena value of its own, so it cannot alias"
            )
        lo, hi = arena[where]
        want = lo + elements * v.type.dtype.itemsize
        got = arena[v][0]
        if got != want:
            raise PlanError(
                f"{what}: {v.name!r} is at offset {got}, not inside {where.name!r} at {want} "
                "where the op puts it"
            )
        if not (lo <= got and got + v.type.nbytes <= hi):
            raise PlanError(f"{what}: {v.name!r} lies outside {where.name!r}'s bytes")
        if v in alias_of:
            raise PlanError(f"{what}: {v.name!r} already lives inside {alias_of[v].name!r}")
        alias_of[v] = where

    claimed = plan.concat_inputs
    for node in graph.nodes:
        what = f"{node.op} {node.name!r}"
        ks = [k for k in range(len(node.inputs)) if (node, k) in claimed]
        if node in plan.elided and node.op not in ("Concat", "Split", "Slice"):
            raise PlanError(f"{what} is elided, but only Concat, Split and Slice may alias")
        if ks or (node in plan.elided and node.op == "Concat"):
            if node.op != "Concat":
                raise PlanError(f"{what}: only a Concat's inputs are written in place")
            xs = [i for i in node.inputs if i is not None]
            if node in plan.elided and len(ks) != len(xs):
                raise PlanError(f"{what} runs nothing, but not all its inputs are in place")
            out = node.outputs[0]
            tags, start = [], 0
            for x in xs:
                tags.append(start)
                start += x.type.numel
            ins: list[np.ndarray | None] = []
            j = 0
            for i in node.inputs:
                if i is None:
                    ins.append(None)
                    continue
                ins.append(np.arange(tags[j], tags[j] + i.type.numel).reshape(i.type.shape))
                j += 1
            flat = _index_positions(node, ins)[0].reshape(-1)
            for k in ks:
                xk = node.inputs[k]
                assert xk is not None
                x = xk
                if xs.count(x) != 1:
                    raise PlanError(f"{what}: {x.name!r} appears twice, so it cannot be in place")
                if x.producer is None or x.producer in plan.elided:
                    raise PlanError(f"{what}: {x.name!r} is not written by a node that runs")
                tag = tags[xs.index(x)]
                pos = np.nonzero((flat >= tag) & (flat < tag + x.type.numel))[0]
                first = _run_of(pos)
                if first is None or _run_of(flat[pos]) != tag:
                    raise PlanError(f"{what}: {x.name!r} is not one contiguous slice of the output")
                at(x, out, first, what)
        elif node in plan.elided:
            src = node.inputs[0]
            if src is None:
                raise PlanError(f"{what} is elided without an input")
            x = src
            ins = consts(node)
            ins[0] = np.arange(x.type.numel).reshape(x.type.shape)
            if node.op == "Split" and (len(ins) < 2 or ins[1] is None):
                # Sizes from the outputs' own shapes (a graph may leave them implicit).
                axis = int(node.attrs.get("axis", 0)) % x.type.rank
                ins[1:] = [np.array([o.type.shape[axis] for o in node.outputs], np.int64)]
            for o, got in zip(node.outputs, _index_positions(node, ins), strict=True):
                flat = np.asarray(got).reshape(-1)
                first = _run_of(flat)
                if first is None or math.prod(o.type.shape) != flat.size:
                    raise PlanError(f"{what}: {o.name!r} is not a contiguous slice of its input")
                b = x
                while b in view_of:
                    b = view_of[b]
                at(o, b, first, what)
    return alias_of
