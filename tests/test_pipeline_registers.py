"""Register counts in a pipeline stage (flowc/schedule/unroll.py): a stage's micro-batches
unrolled into one program, the registers at a cut double-buffered (a send of micro-batch m
overlaps the work on m+1), back-pressure bounding what is in flight, the memory plan giving
the copies, and the emitted program checked by the independent memory checker."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from test_pipeline_host import compiled

from flowc.compiler import CompiledPipeline
from flowc.memory.check import check_memory_plan
from flowc.schedule.unroll import BOUNDARY_REGISTERS


@cache
def mlp_pipeline(micro: int) -> CompiledPipeline:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return compiled("mlp", Path(tmp) / "out", (2,), 2, micro, batch=4)


def transfers(c: CompiledPipeline, stage: int, op: str) -> list[int]:
    """The stage's ``op`` (Send/Recv) actors, by micro-batch."""
    actors = c.schedules[stage].actors.actors
    found = sorted((a.microbatch, a.id) for a in actors if a.op == op)
    return [a for _, a in found]


def test_cut_registers_are_double_buffered() -> None:
    c = mlp_pipeline(4)
    sched, plan = c.schedules[0], c.memory[0]
    ag = sched.actors
    sends = transfers(c, 0, "Send")
    assert [ag.actors[a].microbatch for a in sends] == [0, 1, 2, 3]
    sent = [ag.actors[a].node.inputs[0] for a in sends]
    regs = [ag.registers[ag.register_of[v]] for v in sent]
    assert all(r.count == BOUNDARY_REGISTERS for r in regs)
    assert all(r.count == 1 for r in ag.registers if r not in regs and r.producer >= 0), (
        "only the registers at the cut have two copies"
    )
    writers = [r.producer for r in regs]
    for m in range(3):
        # Micro-batch m+1 is written while m is still being sent: two buffers.
        assert plan.offset(sent[m]) != plan.offset(sent[m + 1])
        assert not sched.hb(sends[m], writers[m + 1])
    for m in range(2):
        # Back-pressure: the copy for m+2 reuses m's register only after m's send.
        assert sched.hb(sends[m], writers[m + 2])
    # The modeled schedule overlaps the first send with micro-batch 1's compute.
    s0, e0 = sched.start_s[sends[0]], sched.end_s[sends[0]]
    assert any(
        a.microbatch == 1
        and a.kind == "node"
        and sched.start_s[a.id] < e0
        and s0 < sched.end_s[a.id]
        for a in ag.actors
    )
    # The receiving stage holds exactly two receive buffers for its four micro-batches.
    recvs = transfers(c, 1, "Recv")
    got = [c.schedules[1].actors.actors[a].node.outputs[0] for a in recvs]
    assert len({c.memory[1].offset(v) for v in got}) == BOUNDARY_REGISTERS
    for s in range(2):
        check_memory_plan(c.unrolled[s].graph, c.memory[s], c.programs[s])


def test_receives_wait_for_the_sending_stage_in_the_model() -> None:
    c = mlp_pipeline(4)
    timeline = json.loads(c.files["schedule.json"])
    by_rank = {r["rank"]: r for r in timeline["ranks"]}
    start = {
        (r, a["op"], a["microbatch"]): a["start_us"]
        for r in (0, 1)
        for a in by_rank[r]["actors"]
        if a["op"] in ("Send", "Recv")
    }
    for m in range(4):
        assert start[(1, "Recv", m)] >= start[(0, "Send", m)]
    # Both sides issue the cut's transfers in micro-batch order (they pair in issue order).
    for stage, op in ((0, "Send"), (1, "Recv")):
        sched = c.schedules[stage]
        acts = transfers(c, stage, op)
        assert [sched.pos[a] for a in acts] == sorted(sched.pos[a] for a in acts)
        assert len({sched.stream_of[a] for a in acts}) == 1
    assert sorted({a["microbatch"] for a in by_rank[1]["actors"]}) == [0, 1, 2, 3]


def test_one_microbatch_is_the_stage_graph() -> None:
    c = mlp_pipeline(1)
    for stage, u in zip(c.pipeline.stages, c.unrolled, strict=True):
        assert [n.name for n in u.graph.nodes] == [n.name for n in stage.graph.nodes]
        assert u.graph.constants == stage.graph.constants
    assert all(r.count == 1 for s in c.schedules for r in s.actors.registers)
