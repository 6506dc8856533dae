"""FLOWC_TRACE=FILE on a generated two-stream model (the program of tests/test_cuda_graph.py, host
emulator): every actor of schedule.json appears once per run, named and on its stream; per
stream the recorded starts follow the stream's firing order in schedule.json, and every event
of the schedule orders its waiting actor after its recording one, under forward and shuffled
stream orders. Tracing runs the schedule directly (a replayed graph would not record the
trace's events), and the outputs still match onnxruntime."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from test_cuda_graph import (
    Program,
    build_program,
    check_matches_onnxruntime,
    counters,
    run_program,
)


@pytest.fixture(scope="module")
def branches(tmp_path_factory: pytest.TempPathFactory) -> Program:
    return build_program(tmp_path_factory, "branches")


def _trace(prog: Program, work: Path, runs: int, order: str) -> tuple[list[dict[str, Any]], str]:
    path = work / "trace.jsonl"
    env = {"FLOWC_TRACE": str(path), "FLOWC_SIM_ORDER": order, "FLOWC_SIM_STATS": "1"}
    results, stderr = run_program(prog, work, runs, env=env)
    check_matches_onnxruntime(prog, results)
    return [json.loads(line) for line in path.read_text().splitlines()], stderr


def test_trace_follows_the_schedule(branches: Program, tmp_path: Path) -> None:
    sched = json.loads((branches.project / "schedule.json").read_text())
    (rank,) = sched["ranks"]
    actors = {a["id"]: a for a in rank["actors"]}
    streams = {s["id"]: s["actors"] for s in rank["streams"]}
    assert len(streams) == 2 and all(streams.values())
    for order in ("forward", "shuffle:4", "shuffle:9"):
        lines, stderr = _trace(branches, tmp_path / order.replace(":", ""), 2, order)
        _, graph_launches, _ = counters(stderr)
        assert graph_launches == 0, stderr  # tracing launches the schedule directly
        assert sorted({line["run"] for line in lines}) == [0, 1]
        for run in (0, 1):
            got = [line for line in lines if line["run"] == run]
            by_id = {line["actor"]: line for line in got}
            assert len(by_id) == len(got) and sorted(by_id) == sorted(actors), (order, run)
            for a, line in by_id.items():
                assert line["rank"] == 0
                assert line["stream"] == actors[a]["stream"], (order, a)
                assert line["name"] == actors[a]["name"], (order, a)
                assert line["start_us"] <= line["end_us"], (order, a)
            for s, firing in streams.items():
                # A stream runs its actors one after another, in the schedule's order (two
                # actors with no work between their events may share a timestamp).
                for a, b in itertools.pairwise(firing):
                    assert by_id[a]["stream"] == by_id[b]["stream"] == s
                    assert by_id[a]["end_us"] <= by_id[b]["start_us"], (order, s, a, b)
            for e in rank["events"]:
                before, after = by_id[e["record_after"]], by_id[e["wait_before"]]
                assert before["end_us"] <= after["start_us"], (order, e)
