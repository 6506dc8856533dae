"""An independent check of a memory plan, written apart from the planner on purpose.

It replays the schedule step by step with its own notion of which bytes hold live data, and
fails if a node's output lands on bytes that still hold something read later (other than the
dying input an element-wise node overwrites in place), if a view is not at its base's bytes,
if anything is misaligned or outside the arena, or if the plan's lower bound is not the
maximum of live aligned bytes.
"""

from __future__ import annotations

from flowc.ir.graph import Graph, Value
from flowc.ops.registry import get_op
from flowc.passes.memory_plan import ALIGN, MemoryPlan


class PlanError(AssertionError):
    pass


def check_memory_plan(graph: Graph, plan: MemoryPlan) -> None:
    steps = plan.steps
    outputs = set(graph.outputs)
    external = set(graph.inputs) | set(graph.constants) | outputs
    view_of: dict[Value, Value] = {}
    for node in steps:
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

    # When is each stored value last needed? (a read of a view is a read of its base)
    last: dict[Value, int] = {}
    for t, node in enumerate(steps):
        for o in node.outputs:
            last.setdefault(base(o), t)
        for i in node.inputs:
            if i is not None:
                last[base(i)] = t

    def extent(v: Value) -> tuple[int, int]:
        off = plan.offset(v)
        return off, off + v.type.nbytes

    live: dict[Value, tuple[int, int]] = {}
    peak = 0
    for t, node in enumerate(steps):
        for v, b in view_of.items():
            if (
                v in node.outputs
                and b in plan.value_buffer
                and plan.offset(v) != plan.offset(base(b))
            ):
                raise PlanError(f"view {v.name!r} is not placed at its base {base(b).name!r}")
        dying_inputs = {base(i) for i in node.inputs if i is not None and last.get(base(i)) == t}
        for o in node.outputs:
            if o in external or o in view_of:
                continue
            if o not in plan.value_buffer:
                raise PlanError(f"intermediate {o.name!r} has no place in the arena")
            lo, hi = extent(o)
            if lo % ALIGN:
                raise PlanError(f"{o.name!r} at offset {lo} is not {ALIGN}-byte aligned")
            if hi > plan.arena_bytes:
                raise PlanError(
                    f"{o.name!r} ends at {hi}, past the arena ({plan.arena_bytes} bytes)"
                )
            for other, (olo, ohi) in live.items():
                if lo < ohi and olo < hi:
                    same_place = (olo, ohi) == (lo, hi) or (olo == lo and ohi >= hi)
                    in_place = (
                        other in dying_inputs
                        and same_place
                        and get_op(node.op).family == "elementwise"
                    )
                    if not in_place:
                        raise PlanError(
                            f"step {t} ({node.op} {node.name!r}): {o.name!r} [{lo}, {hi}) overwrites "
                            f"{other.name!r} [{olo}, {ohi}), still needed at step {last[other]}"
                        )
            live[o] = (lo, hi)
        step_bytes = _aligned_live(live, plan)
        peak = max(peak, step_bytes)
        for v in [v for v in live if last.get(v, t) <= t]:
            del live[v]
    if plan.lower_bound != peak:
        raise PlanError(
            f"the plan's lower bound {plan.lower_bound} differs from the replayed peak {peak}"
        )


def _aligned_live(live: dict[Value, tuple[int, int]], plan: MemoryPlan) -> int:
    """Bytes of the distinct buffers holding live values (in-place values share one)."""
    buffers = {plan.value_buffer[v] for v in live}
    return sum(plan.buffers[b].size for b in buffers)
