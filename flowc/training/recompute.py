"""Activation recomputation: forward values the backward reads are computed again in the
backward instead of being kept from the forward (``--recompute none|auto|all``).

A choice is a set R of forward nodes. Each node of R that the backward needs gets one copy
(``<node>/grad/recompute``), placed before the first backward node that reads it; the copy
reads the copies of its inputs whose producers are in R too and the forward's own values
otherwise; the backward reads the copies. A view (Reshape, Squeeze, ...) whose base is
recomputed is recomputed with it (it costs nothing). Kernels are deterministic and the
dropout masks counter-based, so a copy computes the same bits as its original: the step's
results do not change, only which bytes live when (the memory-order schedule places the
copies, and the backward's reads keep the forward's values alive no longer).

What the forward keeps for the backward (the saved activations) is counted by storage: a
view's bytes are its base's; graph inputs and constants (parameters, the batch) live outside
the arena and count for nothing.

* ``all``: the forward is cut into segments at its narrow points (where only the value just
  computed crosses, beside long-lived values such as an attention mask), about sqrt(F) of
  its F nodes apart as Chen et al.'s checkpointing spaces them; only the values crossing the
  cuts are kept, and each segment is recomputed when its backward begins.
* ``auto``: the least extra FLOPs under a limit on the step's arena: greedily, the saved
  value that frees the most bytes per FLOP of its recomputation (views and copies first:
  they free bytes for nothing), until the estimate covers what is over the limit; then the
  compiled arena (schedule and memory plan, measured by the driver) decides, and the search
  goes on while it is over.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from flowc.errors import InputError
from flowc.ir.graph import Graph, Node, Value
from flowc.ops.registry import get_op, is_view

MODES = ("none", "auto", "all")
COPY_SUFFIX = "/grad/recompute"
# auto's rounds of estimate-then-measure before it gives up on the limit.
MAX_ROUNDS = 12


def is_backward_name(name: str) -> bool:
    """A node autodiff built (``<node>/grad/<op>``, the seed's ``grad/<op>``) or a copy."""
    return "/grad/" in name or name.startswith("grad/")


@dataclass
class StepParts:
    """The step's nodes split into the forward (the model and the loss) and the rest (the
    backward, and the update, which reads gradients)."""

    forward: list[Node]
    backward: list[Node]
    root: dict[Value, Value]  # value -> the value whose bytes it is (views: their base)

    @classmethod
    def of(cls, graph: Graph) -> StepParts:
        after: set[Value] = set()
        forward: list[Node] = []
        backward: list[Node] = []
        root: dict[Value, Value] = {}
        for node in graph.nodes:
            if is_backward_name(node.name) or any(i in after for i in node.inputs):
                backward.append(node)
                after.update(node.outputs)
            else:
                forward.append(node)
            if is_view(graph, node) and node.inputs[0] is not None:
                base = node.inputs[0]
                root[node.outputs[0]] = root.get(base, base)
        return cls(forward, backward, root)


@dataclass
class RecomputeReport:
    mode: str
    recomputed: list[str] = field(default_factory=list)  # forward nodes copied (code-running)
    saved_before: int = 0  # bytes the forward keeps for the backward, without / with
    saved_after: int = 0
    flops_added: int = 0
    forward_flops: int = 0
    arena_before: int | None = None  # the compiled arena (auto measures it)
    arena_after: int | None = None
    arena_limit: int | None = None  # what --mem-limit leaves the arena

    def lines(self) -> list[str]:
        if self.mode == "none":
            return []
        if self.mode == "auto" and not self.recomputed:
            return [
                f"recompute auto: the step fits as it is (arena {self.arena_after:,} bytes, "
                f"{self.arena_limit:,} left for it by --mem-limit): nothing recomputed"
            ]
        pct = 100.0 * self.flops_added / self.forward_flops if self.forward_flops else 0.0
        out = [
            f"recompute {self.mode}: {len(self.recomputed)} forward nodes recomputed in the "
            f"backward; saved activations {self.saved_before:,} -> {self.saved_after:,} bytes; "
            f"+{self.flops_added:,} FLOPs ({pct:.1f}% of the forward)"
        ]
        if self.arena_before is not None and self.arena_after is not None:
            out.append(f"  arena {self.arena_before:,} -> {self.arena_after:,} bytes")
        if self.recomputed:
            shown = ", ".join(self.recomputed[:8])
            more = f" and {len(self.recomputed) - 8} more" if len(self.recomputed) > 8 else ""
            out.append(f"  recomputed: {shown}{more}")
        return out


def _flops(node: Node) -> int:
    return get_op(node.op).count_flops(node)


def _closure(graph: Graph, parts: StepParts, chosen: set[Node]) -> set[Node]:
    """``chosen`` and the views of what it makes (views cost nothing to recompute)."""
    full = set(chosen)
    made = {o for n in chosen for o in n.outputs}
    for node in parts.forward:
        if node not in full and is_view(graph, node) and node.inputs[0] in made:
            full.add(node)
            made.update(node.outputs)
    return full


def saved_roots(graph: Graph, parts: StepParts, chosen: set[Node]) -> dict[Value, int]:
    """The storage the forward keeps for the backward when ``chosen`` is recomputed: each
    root value (a view's base) of a forward value that a backward node or a copy reads,
    with its bytes."""
    full = _closure(graph, parts, chosen)
    made_by = {o: n for n in parts.forward for o in n.outputs}
    need: set[Value] = set()
    for node in parts.backward:
        need.update(i for i in node.inputs if i is not None and i in made_by)
    # The copies that are needed read their inputs: walk down from what the backward reads.
    stack = [made_by[v] for v in need if made_by[v] in full]
    seen: set[Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for i in node.inputs:
            if i is not None and i in made_by:
                if made_by[i] in full:
                    stack.append(made_by[i])
                else:
                    need.add(i)
    out: dict[Value, int] = {}
    for v in need:
        if made_by[v] in full:
            continue
        r = parts.root.get(v, v)
        if r in made_by:  # not a graph input or constant
            out[r] = r.type.nbytes
    return out


def saved_bytes(graph: Graph) -> int:
    """The bytes of the forward's values the backward of ``graph`` (a step) keeps alive."""
    parts = StepParts.of(graph)
    return sum(saved_roots(graph, parts, set()).values())


def apply(graph: Graph, chosen: set[Node]) -> list[Node]:
    """Recompute ``chosen`` (forward nodes of ``graph``, a step) in the backward, in place;
    returns the forward nodes copied, in the order of their copies."""
    parts = StepParts.of(graph)
    full = _closure(graph, parts, chosen)
    made_by = {o: n for n in parts.forward if n in full for o in n.outputs}
    copies: dict[Value, Value] = {}
    copied: list[Node] = []
    backward = set(parts.backward)
    order: list[Node] = []

    def copy_of(v: Value) -> Value:
        """``v``'s copy, made with the copies it reads first (depth first, without
        recursion: a recomputed chain may be thousands of nodes long)."""
        stack = [made_by[v]]
        while stack:
            node = stack[-1]
            if node.outputs[0] in copies:
                stack.pop()
                continue
            pending = [
                made_by[i]
                for i in node.inputs
                if i is not None and i in made_by and i not in copies
            ]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            ins = [None if i is None else copies.get(i, i) for i in node.inputs]
            dup = graph.add_node(
                node.op,
                ins,
                [o.type for o in node.outputs],
                node.attrs,
                name=f"{node.name or node.op}{COPY_SUFFIX}",
                output_names=[f"{o.name}{COPY_SUFFIX}" for o in node.outputs],
            )
            for o, c in zip(node.outputs, dup.outputs, strict=True):
                copies[o] = c
            order.append(dup)
            copied.append(node)
        return copies[v]

    for node in list(graph.nodes):
        if node in backward:
            node.inputs = [
                None if i is None else (copy_of(i) if i in made_by else i) for i in node.inputs
            ]
        order.append(node)
    graph.nodes = order
    graph.remove_unused()
    return [n for n in copied if not is_view(graph, n)]


def _checkpoints(graph: Graph, parts: StepParts) -> set[Node]:
    """``all``'s choice: every forward node but those whose values cross the cuts (see the
    module's docstring)."""
    return set().union(*_segments(graph, parts))


def _segments(graph: Graph, parts: StepParts) -> list[set[Node]]:
    """The forward's code-running nodes between its cuts (each cut's node and the makers of
    long-lived values are kept), in forward order."""
    runs = [n for n in parts.forward if not is_view(graph, n)]
    pos = {n: k for k, n in enumerate(runs)}
    made_at: dict[Value, int] = {o: pos[n] for n in runs for o in n.outputs}
    last: dict[Value, int] = {}
    for n in runs:
        for i in n.inputs:
            if i is None:
                continue
            r = parts.root.get(i, i)
            if r in made_at:
                last[r] = max(last.get(r, -1), pos[n])
    count = len(runs)
    if count == 0:
        return []
    long_lived = {r for r, end in last.items() if end - made_at[r] > count // 2}
    # Values alive across position k (made at or before it, read after it).
    starts: dict[int, list[Value]] = {}
    for r, end in last.items():
        if end > made_at[r] and r not in long_lived:
            starts.setdefault(made_at[r], []).append(r)
    spacing = max(1, round(math.sqrt(count)))
    keep: set[Node] = {runs[made_at[r]] for r in long_lived}
    alive: set[Value] = set()
    previous = -1
    segments: list[set[Node]] = [set()]
    for k, node in enumerate(runs):
        alive = {r for r in alive if last[r] > k}
        alive.update(starts.get(k, []))
        narrow = all(made_at[r] == k for r in alive)
        if narrow and alive and k - previous >= spacing:
            keep.add(node)
            previous = k
            segments.append(set())
        elif node not in keep:
            segments[-1].add(node)
    return [s for s in segments if s]


def _candidates(
    graph: Graph,
    parts: StepParts,
    chosen: set[Node],
    saved: dict[Value, int],
    segments: list[set[Node]],
) -> list[tuple[float, int, int, set[Node]]]:
    """(FLOPs per byte freed, -bytes, order, nodes) for each way to recompute more, best
    first: a forward node whose values are saved (recomputing it frees its outputs' bytes
    and keeps its inputs instead, those not kept already), or a whole segment of ``all``
    (a chain of nodes each of which alone would free nothing: a MatMul whose input is not
    kept otherwise)."""
    made_by = {o: n for n in parts.forward for o in n.outputs}
    full = _closure(graph, parts, chosen)
    index = {n: k for k, n in enumerate(parts.forward)}
    out = []
    producers = {made_by[r] for r in saved}
    for node in producers:
        if is_view(graph, node) or node in full:
            continue
        freed = sum(saved.get(o, 0) for o in node.outputs)
        cost = 0
        for i in node.inputs:
            if i is None:
                continue
            r = parts.root.get(i, i)
            if r in made_by and r not in saved and made_by[r] not in full:
                cost += r.type.nbytes
        gain = freed - cost
        if gain <= 0:
            continue
        out.append((_flops(node) / gain, -gain, index[node], {node}))
    total = sum(saved.values())
    for k, seg in enumerate(segments):
        more = seg - full
        if not more:
            continue
        gain = total - sum(saved_roots(graph, parts, chosen | more).values())
        if gain > 0:
            flops = sum(_flops(n) for n in more)
            out.append((flops / gain, -gain, len(parts.forward) + k, more))
    out.sort(key=lambda t: (t[0], t[1], t[2]))
    return out


ArenaOf = Callable[[set[int]], int]


def recompute(
    graph: Graph,
    mode: str,
    *,
    arena_limit: int | None = None,
    arena_of: ArenaOf | None = None,
) -> RecomputeReport:
    """Apply ``mode`` to ``graph`` (a training step before its fusions) in place.
    ``arena_of(indices)``: the compiled arena of the step with the forward nodes at those
    positions of graph.nodes recomputed (auto's measure); ``arena_limit``: auto's bound."""
    if mode not in MODES:
        raise InputError(f"--recompute {mode!r}: expected one of {', '.join(MODES)}")
    report = RecomputeReport(mode)
    parts = StepParts.of(graph)
    report.forward_flops = sum(_flops(n) for n in parts.forward)
    report.saved_before = sum(saved_roots(graph, parts, set()).values())
    report.saved_after = report.saved_before
    if mode == "none":
        return report
    if mode == "all":
        chosen = _checkpoints(graph, parts)
    else:
        if arena_limit is None or arena_of is None:
            raise InputError(
                "--recompute auto needs --mem-limit (what the step must fit)",
                hint="e.g. --recompute auto --mem-limit 64MiB, or --recompute all",
            )
        report.arena_limit = arena_limit
        chosen = _auto(graph, parts, arena_limit, arena_of, report)
    copied = apply(graph, chosen)
    report.recomputed = [n.name or n.op for n in copied]
    report.flops_added = sum(_flops(n) for n in copied)
    report.saved_after = saved_bytes(graph)
    return report


def _auto(
    graph: Graph, parts: StepParts, limit: int, arena_of: ArenaOf, report: RecomputeReport
) -> set[Node]:
    """The greedy choice in rounds, each picking until its estimate covers what the last
    measure was over the limit; then the shortest prefix of the picks that still fits, by
    bisection (an estimate counts saved bytes, which the arena's peak may not follow one
    for one, so the last round may overshoot)."""
    index = {n: k for k, n in enumerate(graph.nodes)}

    def measure(picks: list[set[Node]]) -> int:
        return arena_of({index[n] for p in picks for n in p})

    picks: list[set[Node]] = []
    chosen: set[Node] = set()
    segments = _segments(graph, parts)
    arena = report.arena_before = measure(picks)
    report.arena_after = arena
    rounds, fits_not = 0, 0  # picks[:fits_not] is known not to fit
    while arena > limit:
        rounds += 1
        fits_not = len(picks)
        saved = saved_roots(graph, parts, chosen)
        over, freed = arena - limit, 0
        while freed < over:
            cands = _candidates(graph, parts, chosen, saved, segments)
            if not cands:
                # Nothing frees bytes on its own any more: the rest of all's choice, whole
                # (saved bytes may not move while the arena's peak does).
                rest = set().union(*segments) - _closure(graph, parts, chosen)
                if rest:
                    picks.append(rest)
                    chosen |= rest
                break
            _, neg_gain, _, nodes = cands[0]
            picks.append(nodes)
            chosen |= nodes
            freed += -neg_gain
            saved = saved_roots(graph, parts, chosen)
        if len(picks) == fits_not or rounds > MAX_ROUNDS:
            least = measure(segments)
            if least <= limit:
                # The greedy's mix overshot what all's segments alone reach: take those.
                report.arena_after = least
                return set().union(*segments)
            raise InputError(
                f"--mem-limit: the step's arena needs {arena:,} bytes and recomputation "
                f"cannot bring it to {limit:,} (recomputing every segment: {least:,})",
                hint="raise --mem-limit, lower --batch, or use --accumulate with a smaller batch",
            )
        arena = measure(picks)
    lo, hi = fits_not, len(picks)  # picks[:lo] does not fit; picks[:hi] does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        a = measure(picks[:mid])
        if a <= limit:
            hi, arena = mid, a
        else:
            lo = mid
    report.arena_after = arena
    return set().union(*picks[:hi])
