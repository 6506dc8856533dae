"""Pipeline training: a training step cut into P stage programs, one per rank, whose
micro-batches run in the 1F1B or GPipe order with the backward flowing back through the
stages.

The step is built with M micro-batches unrolled (flowc.training.step, as --accumulate M
builds it: each micro-batch's forward, loss and backward, the gradients summed, one update),
then every node gets a stage:

- The forward (the nodes the loss depends on) is cut at the boundary values, one per cut
  (micro-batch k's copy of a boundary ``h`` is ``h@mbk``): a forward value's stage is the
  number of boundaries it depends on or is, and a node runs on the latest stage among its
  inputs (the node making boundary j on stage j - 1 at least). Nodes reading only
  parameters, constants and the batch (a transposed weight, a label count) take the
  earliest stage that reads them.
- A parameter (or batch-norm statistic) lives on the earliest stage whose forward reads it;
  its optimizer state with it. A backward node runs beside the forward node it
  differentiates (autodiff names it "<forward node>/grad/..."): next to its stashed
  activations. Of the rest, a node reading state runs on its stage (an update), one
  reading forward values on the latest of their stages, and one reading only gradients on
  the earliest stage that uses its result (a gradient's sum over the micro-batches where
  its update is). A weight shared by layers of two stages is sent from its own at the
  start; its gradients come back.
- Nodes that read only the step counter, the learning rate and constants (the schedule's
  rate, dropout keys, the next step count) run on every stage: each keeps its own counter.

Within a stage the nodes run in the schedule's order of (phase, micro-batch) groups
(``flowc.schedule.pipeline``: 1F1B or GPipe), a node never before a node it reads. Every
value a stage reads from another travels in an ``Exchange`` between two groups: after the
group that makes it on the sending stage, before the first group that reads it on the
receiving one; a stage's sends and receives between two groups are one exchange (one NCCL
group, nonblocking MPI calls waited together), which is what keeps two neighbours from both
waiting to send (Megatron's send-forward-receive-backward). Between two ranks the values
travel in one order on both sides (NCCL and MPI match messages in order); the loss and the
label count go from the last stage to every other one at the end, so every rank's
train_step() reports them. ``check_exchanges`` runs the exchanges of all stages under
rendezvous semantics (an exchange ends when each of its transfers' partners has reached
its own) and refuses an order that would deadlock.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from flowc.errors import InputError
from flowc.ir.graph import Attrs, Graph, Node, Value
from flowc.ir.types import Mesh
from flowc.ir.verify import verify_graph
from flowc.ops.registry import state_writes
from flowc.parallel.cost import Profile, kernel_time
from flowc.schedule.pipeline import Phase, PipelineRun, Schedule, gpipe, one_f_one_b, simulate

SCHEDULES = ("1f1b", "gpipe")
_MB = re.compile(r"@mb(\d+)")


@dataclass
class TrainStage:
    index: int
    graph: Graph  # the stage's program: its nodes, in run order, and its exchanges
    state: list[str]  # the state inputs it holds (its parameters, their moments, the counter)
    sent_bytes: int = 0  # per step, to other stages
    exchanges: int = 0


@dataclass
class TrainPipeline:
    stages: list[TrainStage]
    microbatches: int
    schedule: str
    order: Schedule  # per stage, the (phase, micro-batch) groups in firing order
    # Each state input's stage (-1: every stage holds its own copy).
    state_stage: dict[str, int] = field(default_factory=dict)
    # The modeled run of the groups (the profile's times per stage), bubble included, and
    # each cut's modeled transfer of one micro-batch.
    modeled: PipelineRun | None = None
    transfer_s: list[float] = field(default_factory=list)

    def lines(self) -> list[str]:
        p, m = len(self.stages), self.microbatches
        out = []
        for st in self.stages:
            params = sum(1 for n, s in self.state_stage.items() if s == st.index)
            out.append(
                f"stage {st.index}: {len(st.graph.nodes)} nodes, {params} state tensors, "
                f"{st.exchanges} exchanges sending {st.sent_bytes:,} B per step"
            )
        if self.modeled is not None:
            ideal = (p - 1) / (m + p - 1)
            out.append(
                f"modeled bubble ({self.schedule}, {p} stages, {m} micro-batches): "
                f"{self.modeled.bubble:.3f} (the formula (P-1)/(M+P-1): {ideal:.3f}); "
                f"micro-batches in flight per stage: {self.modeled.max_in_flight}"
            )
            busy = ", ".join(f"{b * 1e6:.1f}" for b in self.modeled.busy_s)
            cuts = ", ".join(f"{t * 1e6:.1f}" for t in self.transfer_s) or "none"
            out.append(
                f"modeled step {self.modeled.makespan * 1e6:.1f} us: compute per stage {busy} "
                f"us; a micro-batch's transfer per cut {cuts} us (beside the compute)"
            )
        return out


def group_order(schedule: str, stages: int, microbatches: int) -> Schedule:
    if schedule not in SCHEDULES:
        raise InputError(
            f"--pipeline-schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}"
        )
    if schedule == "gpipe":
        return gpipe(stages, microbatches, backward=True)
    return one_f_one_b(stages, microbatches)


def _ancestors(graph: Graph, roots: Sequence[Value]) -> set[Node]:
    seen: set[Node] = set()
    stack = [v.producer for v in roots if v.producer is not None]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(i.producer for i in n.inputs if i is not None and i.producer is not None)
    return seen


def _base_name(name: str) -> tuple[str, int]:
    """A value's name without its micro-batch suffix, and the micro-batch (0: none)."""
    m = _MB.search(name)
    if m is None:
        return name, 0
    return name[: m.start()] + name[m.end() :], int(m.group(1))


def assign_stages(
    graph: Graph,
    stages: int,
    boundaries: Sequence[str],
    owned: dict[str, str],
    global_inputs: set[str],
    loss: str,
) -> tuple[dict[Node, int | None], dict[str, int]]:
    """Each node's stage (None: every stage runs its own copy) and each state input's (-1:
    every stage), as the module docstring says. ``owned``: optimizer state -> its
    parameter; ``global_inputs``: the inputs every stage holds (step counter, rate)."""
    if len(boundaries) != stages - 1:
        raise InputError(
            f"--stage-boundary names {len(boundaries)} value(s) for {stages} pipeline stages; "
            f"{stages} stages need {stages - 1}"
        )
    index = {b: j + 1 for j, b in enumerate(boundaries)}
    loss_v = next((o for o in graph.outputs if o.name == loss), None)
    assert loss_v is not None, "the step has no loss output"
    forward = _ancestors(graph, [loss_v])
    found = {_base_name(o.name)[0] for n in graph.nodes if n in forward for o in n.outputs} & set(
        index
    )
    missing = [b for b in boundaries if b not in found]
    if missing:
        names = [
            o.name for n in graph.nodes if n in forward for o in n.outputs if "@mb" not in o.name
        ]
        raise InputError(
            f"--stage-boundary {missing[0]!r} is not a value of the training step's forward",
            hint="name a value the forward makes (after the training fusions), e.g. "
            + ", ".join(repr(n) for n in names[len(names) // 4 :: max(1, len(names) // 4)][:3]),
        )
    users = graph.users()
    inputs = {v.name: v for v in graph.inputs}
    stage_of: dict[Node, int | None] = {}
    sv: dict[Value, int] = {}  # forward values on a stage
    pending: list[Node] = []
    for n in graph.nodes:
        if n not in forward:
            continue
        staged = [sv[i] for i in n.inputs if i is not None and i in sv]
        at = max(staged, default=-1)
        for o in n.outputs:
            j = index.get(_base_name(o.name)[0])
            if j is not None and at > j - 1:
                raise InputError(
                    f"--stage-boundary {boundaries[j - 1]!r} is made after "
                    f"{boundaries[at - 1]!r}: the cuts must follow the forward's order",
                )
            if j is not None:
                at = j - 1
        if at < 0:
            pending.append(n)
            continue
        stage_of[n] = at
        for o in n.outputs:
            j = index.get(_base_name(o.name)[0])
            sv[o] = j if j is not None else at
    # Forward nodes reading no staged value: the earliest forward stage that reads them.
    for n in reversed(pending):
        cons = [stage_of.get(c) for o in n.outputs for c in users.get(o, []) if c in forward]
        known = [c for c in cons if c is not None]
        if known:
            stage_of[n] = min(known)
    # State: the earliest forward stage reading it (through views and free nodes).
    state_stage: dict[str, int] = {}
    for v in graph.inputs:
        if v.name in global_inputs or v.name not in graph.state:
            continue
        readers = [stage_of.get(c) for c in users.get(v, []) if c in forward]
        known = [r for r in readers if r is not None]
        if known:
            state_stage[v.name] = min(known)
    for name, param in owned.items():
        if param in state_stage:
            state_stage[name] = state_stage[param]
    for v in graph.inputs:
        if v.name in graph.state and v.name not in global_inputs:
            state_stage.setdefault(v.name, 0)
    for name in global_inputs:
        if name in inputs:
            state_stage[name] = -1
    # Everything else, in order: state readers on the state's stage, forward readers on the
    # latest forward stage they read, nodes of the global inputs everywhere.
    glob: set[Value] = {inputs[g] for g in global_inputs if g in inputs}
    later: list[Node] = []
    by_name = {n.name: st for n, st in stage_of.items() if n.name and st is not None}
    for n in graph.nodes:
        if n in stage_of:
            continue
        ins = [i for i in n.inputs if i is not None]
        if n not in forward and all(i in glob or i.const is not None for i in ins):
            stage_of[n] = None
            glob.update(n.outputs)
            continue
        # A backward node is named after the forward node it differentiates (autodiff's
        # "<node>/grad/..."): it runs beside it, whatever state it reads (a weight shared
        # with another stage's layer is sent there).
        origin = next(
            (
                by_name[x.split("/grad/")[0]]
                for x in [n.name, *(o.name for o in n.outputs)]
                if "/grad/" in x and x.split("/grad/")[0] in by_name
            ),
            None,
        )
        if origin is not None and n not in forward:
            stage_of[n] = origin
            continue
        held = [state_stage[i.name] for i in ins if i.name in state_stage and i not in glob]
        if held:
            stage_of[n] = max(held)
            continue
        seen = [sv[i] for i in ins if i in sv]
        if seen and n not in forward:
            stage_of[n] = max(seen)
            continue
        later.append(n)
    outputs_of = {o: name for name, o in ((v.name, v) for v in graph.outputs)}
    state_by_output = {o: i for i, o in graph.state.items() if o is not None}
    for n in reversed(later):
        cons = [stage_of.get(c) for o in n.outputs for c in users.get(o, [])]
        known = [c for c in cons if c is not None]
        for o in n.outputs:
            state_in = state_by_output.get(outputs_of.get(o, ""))
            if state_in is not None and state_stage.get(state_in, -1) >= 0:
                known.append(state_stage[state_in])
        stage_of[n] = min(known) if known else stages - 1
    # What every stage's own copy of a global state's next value needs (the step counter
    # advances only on a finite loss): copied on every stage too, reading what it needs of
    # other stages (the loss) from them.
    producer = {o: n for n in graph.nodes for o in n.outputs}
    stack = [
        producer[o]
        for o in graph.outputs
        if state_by_output.get(o.name) in global_inputs and o in producer
    ]
    while stack:
        n = stack.pop()
        if n in forward or stage_of.get(n, 0) is None:
            continue
        stage_of[n] = None
        stack.extend(producer[i] for i in n.inputs if i is not None and i in producer)
    return stage_of, state_stage


def auto_boundaries(
    graph: Graph,
    stages: int,
    prediction: str,
    profile: Profile,
    global_inputs: Collection[str] = (),
) -> list[str]:
    """P-1 cut values for the step's forward: among the values micro-batch 0's forward makes
    before ``prediction`` (the loss's input) that are the only value crossing their point
    of the forward's order (a chain's links; the residual stream between transformer
    blocks), the ones splitting the forward's modeled time most evenly."""
    pred = next((v for n in graph.nodes for v in n.outputs if v.name == prediction), None)
    assert pred is not None, f"the step has no value {prediction!r}"
    forward = _ancestors(graph, [pred])
    nodes = [
        n
        for n in graph.nodes
        if n in forward
        and all(
            _base_name(x)[1] == 0 and "@mb" not in x for x in [n.name, *(o.name for o in n.outputs)]
        )
    ]
    pos = {n: k for k, n in enumerate(nodes)}
    # Values of the batch, the step counter and constants alone (an attention mask, a
    # dropout key every layer reads) cross wherever they are needed and do not count
    # against a cut.
    state = set(graph.state) - set(global_inputs)
    free: set[Value] = set()
    for n in nodes:
        if all(
            i is None or (i.producer is None and i.name not in state) or i in free for i in n.inputs
        ):
            free.update(n.outputs)
    last_read: dict[Value, int] = {}
    for k, n in enumerate(nodes):
        for i in n.inputs:
            if i is not None and i.producer in pos:
                last_read[i] = k
    times = [kernel_time(n, profile) for n in nodes]
    total = sum(times) or 1.0
    candidates: list[tuple[float, str]] = []  # (forward time before the cut, value)
    live: set[Value] = set()
    done = 0.0
    for k, n in enumerate(nodes):
        done += times[k]
        live = {v for v in live if last_read.get(v, -1) > k}
        live.update(o for o in n.outputs if last_read.get(o, -1) > k and o not in free)
        if len(live) == 1 and k < len(nodes) - 1:
            (v,) = live
            if v.producer is n and v.type.rank > 0:
                candidates.append((done / total, v.name))
    if len(candidates) < stages - 1:
        raise InputError(
            f"--pipeline {stages}: the training step's forward has {len(candidates)} points "
            f"where one value alone crosses, too few for {stages} stages",
            hint="name the cuts with --stage-boundary, or use fewer stages",
        )
    chosen: list[str] = []
    at = -1
    for j in range(1, stages):
        left = stages - 1 - j  # cuts still to place after this one
        best = min(
            range(at + 1, len(candidates) - left),
            key=lambda c: abs(candidates[c][0] - j / stages),
        )
        chosen.append(candidates[best][1])
        at = best
    return chosen


def _groups(
    graph: Graph,
    stage_of: dict[Node, int | None],
    forward: set[Node],
    order: Schedule,
) -> dict[Node, int]:
    """Each node's tag group (its rank in its stage's firing order): phase from ``forward``,
    micro-batch from the @mbK names (else the latest of its inputs')."""
    mb: dict[Value, int] = {}
    out: dict[Node, int] = {}
    rank = [{(a.phase, a.microbatch): k for k, a in enumerate(o)} for o in order]
    for n in graph.nodes:
        k = max((mb.get(i, 0) for i in n.inputs if i is not None), default=0)
        for name in [n.name, *(o.name for o in n.outputs)]:
            k = max(k, _base_name(name)[1])
        for o in n.outputs:
            mb[o] = k
        s = stage_of[n]
        if s is None:
            out[n] = 0
        else:
            out[n] = rank[s][(Phase.F if n in forward else Phase.B, k)]
    return out


@dataclass
class _Transfer:
    value: Value
    src: int
    dst: int
    send_slot: int  # exchange slot on the sender (slot j: before group j)
    need_slot: int  # on the receiver
    recv_slot: int = 0


def check_exchanges(transfers: list[_Transfer], stages: int, slots: int) -> None:
    """Raises if the exchanges, run under rendezvous semantics, would wait on each other."""
    pos = [0] * stages
    done = [False] * len(transfers)
    at: list[dict[int, list[int]]] = [{} for _ in range(stages)]
    for k, t in enumerate(transfers):
        at[t.src].setdefault(t.send_slot, []).append(k)
        at[t.dst].setdefault(t.recv_slot, []).append(k)
    while True:
        for k, t in enumerate(transfers):
            if not done[k] and pos[t.src] == t.send_slot and pos[t.dst] == t.recv_slot:
                done[k] = True
        moved = False
        for s in range(stages):
            while pos[s] <= slots and all(done[k] for k in at[s].get(pos[s], [])):
                pos[s] += 1
                moved = True
        if all(p > slots for p in pos):
            return
        if not moved:
            stuck = [f"stage {s} at exchange {pos[s]}" for s in range(stages) if pos[s] <= slots]
            waiting = [
                f"{t.value.name} {t.src}->{t.dst} (slots {t.send_slot}/{t.recv_slot})"
                for k, t in enumerate(transfers)
                if not done[k] and (pos[t.src] == t.send_slot or pos[t.dst] == t.recv_slot)
            ]
            raise AssertionError(
                f"the pipeline's exchanges would deadlock: {', '.join(stuck)}; waiting: "
                + "; ".join(waiting[:6])
            )


def build_train_pipeline(
    graph: Graph,
    stages: int,
    microbatches: int,
    boundaries: Sequence[str],
    *,
    schedule: str = "1f1b",
    owned: dict[str, str],
    global_inputs: set[str],
    batch: Sequence[str],
    loss: str,
    broadcast: Sequence[str],
    profile: Profile,
    mesh: Mesh | None = None,
) -> TrainPipeline:
    """The stage programs of training step ``graph`` (M micro-batches unrolled): see the
    module docstring. ``batch``: the batch inputs, which every stage program takes (the
    stages read theirs); ``broadcast``: outputs every stage reports (the loss and the label
    count, made on the last stage). ``mesh``: the whole mesh (P, K) when each stage's K
    devices run ``graph`` as a data-parallel rank program (its collectives along mesh axis
    1 of the whole mesh; its exchanges between ranks at the same place in their stages)."""
    order = group_order(schedule, stages, microbatches)
    k = 1 if mesh is None else mesh.size // stages
    stage_of, state_stage = assign_stages(graph, stages, boundaries, owned, global_inputs, loss)
    empty = [s for s in range(stages) if not any(v == s for v in stage_of.values())]
    if empty:
        raise InputError(
            f"--pipeline {stages}: stage {empty[0]} of the training step would have no work "
            f"(cuts at {', '.join(repr(b) for b in boundaries)})",
            hint="use fewer stages, or name cuts that leave each stage some of the forward "
            "(--stage-boundary)",
        )
    loss_v = next(o for o in graph.outputs if o.name == loss)
    forward = _ancestors(graph, [loss_v])
    tag = _groups(graph, stage_of, forward, order)
    groups = len(order[0])
    # The group each node really runs in: never before its producers on its stage, and a
    # state's writer after every reader of the state on its stage.
    after: dict[Node, list[Node]] = {w.writer: w.readers for w in state_writes(graph)}
    eff: dict[Node, int] = {}
    producer_stage_group: dict[Value, tuple[int | None, int]] = {}
    # A copied node reading a stage's value (through other copies or not) runs in the last
    # group, once what it reads has been made wherever it is made.
    late: set[Node] = set()
    for n in graph.nodes:
        if stage_of[n] is None and any(
            i is not None
            and i.producer is not None
            and (stage_of.get(i.producer) is not None or i.producer in late)
            for i in n.inputs
        ):
            late.add(n)
    for n in graph.nodes:
        grp = groups - 1 if n in late else tag[n]
        for i in n.inputs:
            if i is not None and i in producer_stage_group:
                ps, pg = producer_stage_group[i]
                if ps == stage_of[n] or ps is None:
                    grp = max(grp, pg)
        for r in after.get(n, []):
            # A writer every stage copies (the step counter's) follows the readers of all.
            if r in eff and (stage_of[n] is None or stage_of.get(r) in (stage_of[n], None)):
                grp = max(grp, eff[r])
        eff[n] = grp
        for o in n.outputs:
            producer_stage_group[o] = (stage_of[n], grp)
    # Transfers: a value made on one stage and read on another (or reported by all).
    users = graph.users()
    transfers: list[_Transfer] = []
    broadcast_values = [o for o in graph.outputs if o.name in broadcast]
    # What a stage makes, with the slot after which it is there: its nodes' results, and
    # its state (from the start: a parameter shared with a layer of another stage, an
    # exporter's deduplicated zeros, goes there before anything, and its gradient back).
    sources: list[tuple[Value, int, int]] = [
        (v, state_stage[v.name], 0) for v in graph.inputs if state_stage.get(v.name, -1) >= 0
    ]
    for n in graph.nodes:
        s = stage_of[n]
        if s is not None:
            sources += [(o, s, eff[n] + 1) for o in n.outputs]
    for o, s, ready in sources:
        need: dict[int, int] = {}
        for c in users.get(o, []):
            cs = stage_of[c]
            for dst in range(stages) if cs is None else [cs]:
                if dst != s:
                    need[dst] = min(need.get(dst, groups), eff[c])
        if o in broadcast_values:
            for dst in range(stages):
                if dst != s:
                    need[dst] = min(need.get(dst, groups), groups)
        for dst, slot in sorted(need.items()):
            transfers.append(_Transfer(o, s, dst, ready, slot))
    # Between two ranks, one order on both sides: the sender's; a receive moves earlier
    # where a value sent later is needed sooner.
    pairs: dict[tuple[int, int], list[_Transfer]] = {}
    position = {o: k for k, (o, _, _) in enumerate(sources)}
    for t in transfers:
        pairs.setdefault((t.src, t.dst), []).append(t)
    for seq in pairs.values():
        seq.sort(key=lambda t: (t.send_slot, position[t.value]))
        low = groups
        for t in reversed(seq):
            low = min(low, t.need_slot)
            t.recv_slot = low
    check_exchanges(transfers, stages, groups)
    # The stage graphs.
    state_by_output = {o: i for i, o in graph.state.items() if o is not None}
    result = []
    for s in range(stages):
        g = Graph(f"{graph.name}_stage{s}")
        g.meta = dict(graph.meta)
        held = [v.name for v in graph.inputs if state_stage.get(v.name, -2) in (s, -1)]
        vmap: dict[Value, Value] = {}
        for v in graph.inputs:
            if v.name in batch or v.name in held:
                vmap[v] = g.add_input(v.name, v.type)
                if v.name in graph.params:
                    g.params[v.name] = graph.params[v.name]
        # The globals this stage needs: those its own nodes read, and what it reports.
        needed: set[Node] = set()
        stack = [n for n in graph.nodes if stage_of[n] == s]
        stack += [
            o.producer
            for o in graph.outputs
            if o.producer is not None
            and stage_of[o.producer] is None
            and (o.name not in state_by_output or state_by_output[o.name] in held)
        ]
        while stack:
            n = stack.pop()
            for i in n.inputs:
                p = i.producer if i is not None else None
                if p is not None and stage_of[p] is None and p not in needed:
                    needed.add(p)
                    stack.append(p)
            if stage_of[n] is None:
                needed.add(n)
        mine = [n for n in graph.nodes if stage_of[n] == s or n in needed]
        items: list[tuple[float, int, Node | int]] = [
            (float(eff[n]), k, n) for k, n in enumerate(mine)
        ]
        sends = [t for t in transfers if t.src == s]
        recvs = [t for t in transfers if t.dst == s]
        slots = sorted({t.send_slot for t in sends} | {t.recv_slot for t in recvs})
        items += [(slot - 0.5, -1, slot) for slot in slots]
        items.sort(key=lambda x: (x[0], x[1]))

        get = _values_of(g, vmap, s)
        stage = TrainStage(s, g, held)
        for _, _, item in items:
            if isinstance(item, Node):
                n = item
                copy = g.add_node(
                    n.op,
                    [get(i) if i is not None else None for i in n.inputs],
                    [o.type for o in n.outputs],
                    _on_whole_mesh(n.attrs, mesh) if k > 1 and mesh is not None else n.attrs,
                    name=n.name,
                    output_names=[o.name for o in n.outputs],
                )
                for o, made in zip(n.outputs, copy.outputs, strict=True):
                    vmap[o] = made
                continue
            out_t = sorted(
                (t for t in sends if t.send_slot == item),
                key=lambda t: (t.dst, t.send_slot, position[t.value]),
            )
            in_t = sorted(
                (t for t in recvs if t.recv_slot == item),
                key=lambda t: (t.src, t.send_slot, position[t.value]),
            )
            ex = g.add_node(
                "Exchange",
                [vmap[t.value] for t in out_t],
                [t.value.type for t in in_t],
                {
                    "send_to": [t.dst - s for t in out_t],
                    "recv_from": [t.src - s for t in in_t],
                    "ranks_per_stage": k,
                    "shapes": [list(t.value.type.shape) for t in in_t],
                    "dtypes": [t.value.type.dtype.onnx for t in in_t],
                },
                name=f"exchange{item}_stage{s}",
                output_names=[t.value.name for t in in_t],
            )
            for t, o in zip(in_t, ex.outputs, strict=True):
                vmap[t.value] = o
            stage.exchanges += 1
            stage.sent_bytes += sum(t.value.type.nbytes for t in out_t)
        for o in graph.outputs:
            if o.name in state_by_output and state_by_output[o.name] not in held:
                continue
            if o in vmap or o.const is not None:
                g.outputs.append(get(o))
        for name, out_name in graph.state.items():
            if name in held:
                g.state[name] = out_name
        verify_graph(g)
        result.append(stage)
    pipe = TrainPipeline(result, microbatches, schedule, order, state_stage)
    pipe.modeled, pipe.transfer_s = _model(
        graph, stage_of, forward, order, microbatches, profile, transfers
    )
    return pipe


def _on_whole_mesh(attrs: Attrs, mesh: Mesh) -> Attrs:
    """A stage rank program's node on the whole mesh: what acted along mesh axis a of a
    stage's devices acts along axis a + 1 (axis 0 being the pipeline's)."""
    if attrs.get("mesh") is None:
        return attrs
    out = dict(attrs.items())
    out["mesh"] = list(mesh.shape)
    if "mesh_axis" in out:
        out["mesh_axis"] = int(out["mesh_axis"]) + 1
    if out.get("shard_axes") is not None:
        out["shard_axes"] = [int(a) + 1 for a in out["shard_axes"]]
    return Attrs(out)


def _values_of(g: Graph, vmap: dict[Value, Value], s: int) -> Callable[[Value], Value]:
    """Stage graph ``g``'s value for a step value: mapped already, or its own copy of a
    constant."""

    def get(v: Value) -> Value:
        if v not in vmap:
            assert v.const is not None, f"value {v.name!r} is not available on stage {s}"
            vmap[v] = g.add_constant(v.name, v.const)
        return vmap[v]

    return get


def _model(
    graph: Graph,
    stage_of: dict[Node, int | None],
    forward: set[Node],
    order: Schedule,
    microbatches: int,
    profile: Profile,
    transfers: list[_Transfer],
) -> tuple[PipelineRun, list[float]]:
    """The groups' modeled run: each stage's forward and backward time per micro-batch (its
    nodes' kernel times, averaged over the micro-batches), each cut's transfer time."""
    stages = len(order)
    f_s = [0.0] * stages
    b_s = [0.0] * stages
    for n in graph.nodes:
        s = stage_of[n]
        if s is None:
            continue
        secs = kernel_time(n, profile)
        if n in forward:
            f_s[s] += secs / microbatches
        else:
            b_s[s] += secs / microbatches
    # A cut's transfer: one micro-batch's share of the bytes crossing it, the larger way
    # (forward activations or backward gradients), in one exchange.
    link = profile.axis_link(0)
    ways = [[0, 0] for _ in range(max(0, stages - 1))]
    for t in transfers:
        if abs(t.dst - t.src) == 1:
            ways[min(t.src, t.dst)][int(t.src > t.dst)] += t.value.type.nbytes
    cut = [link.alpha + max(w) / microbatches / link.bandwidth for w in ways]
    return simulate(order, microbatches, f_s, b_s, cut), cut
