"""Gantt pictures (flowc/schedule/gantt.py): a synthetic two-rank, two-stream pipeline schedule
drawn as a PNG of the documented size whose pixels show each bar in its stage's (or
micro-batch's) colour where the schedule puts it and the idle background in the bubbles;
the bytes are the same on every draw; measured traces draw through the adapter; bad input
and bad paths are clear errors, and a failed write leaves the old picture in place."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pytest
from PIL import Image

from flowc.errors import FlowcError
from flowc.schedule import gantt
from flowc.schedule.gantt import (
    PALETTE,
    bar_labels,
    draw_gantt,
    figure_size,
    schedule_from_trace,
)

MICROBATCHES = 3


def pipeline() -> dict[str, Any]:
    """GPipe on two stages: rank r is stage r; per micro-batch m a compute actor (stream 0,
    100 us) then a send or receive on the comm stream (stream 1, 40 us). Stage 1's compute of
    m starts when stage 0's send of m ends, so rank 1 idles for the first 140 us (a bubble)."""
    ranks = []
    for rank in range(2):
        actors: list[dict[str, Any]] = []
        for m in range(MICROBATCHES):
            compute = rank * 140.0 + m * 100.0
            comm = compute + 100.0 if rank == 0 else compute - 40.0
            actors.append(
                dict(id=2 * m, name=f"mlp_{m}", op="MatMul", kind="node", stream=0)
                | dict(stage=rank, microbatch=m, start_us=compute, end_us=compute + 100.0)
            )
            actors.append(
                dict(id=2 * m + 1, name=f"{'send' if rank == 0 else 'recv'}_{m}", op="Send")
                | dict(kind="send" if rank == 0 else "recv", stream=1, stage=rank)
                | dict(microbatch=m, start_us=comm, end_us=comm + 40.0)
            )
        ranks.append(
            {
                "rank": rank,
                "stage": rank,
                "makespan_us": max(a["end_us"] for a in actors),
                "critical_path": [0, 2, 4],
                "streams": [
                    {"id": 0, "name": "compute0", "actors": [0, 2, 4]},
                    {"id": 1, "name": "comm", "actors": [1, 3, 5]},
                ],
                "actors": actors,
                "events": [{"id": 0, "record_after": 0, "wait_before": 1, "kind": "raw"}],
            }
        )
    return {"version": 1, "ranks": ranks}


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    # The header chunk's CRC: a well-formed file, not just the right first bytes.
    assert zlib.crc32(data[12:29]) == struct.unpack(">I", data[29:33])[0]
    return struct.unpack(">II", data[16:24])


def pixel(img: np.ndarray, rows: int, row: int, t_us: float, span: float) -> str:
    """The colour (#rrggbb) drawn at time ``t_us`` on row ``row``, a quarter of the bar's height
    below its middle (away from the label), from the layout's documented margins."""
    w, h = figure_size(rows)
    left, right = gantt.LEFT * gantt.DPI, w - gantt.RIGHT * gantt.DPI
    top, bottom = gantt.TOP * gantt.DPI, h - gantt.BOTTOM * gantt.DPI
    x = left + t_us / (span * 1.01) * (right - left)
    y = top + (row + 0.5 + 0.2) / rows * (bottom - top)
    r, g, b = img[round(y), round(x), :3]
    return f"#{r:02x}{g:02x}{b:02x}"


def test_pipeline_schedule_draws_bars_and_bubbles(tmp_path: Path) -> None:
    out = draw_gantt(pipeline(), tmp_path / "pipe.png")
    data = out.read_bytes()
    assert png_size(data) == figure_size(4) == (1200, 360)
    img = np.asarray(Image.open(out).convert("RGB"))
    span = 140.0 + 300.0  # rank 1's last compute ends at 440 us
    # Rows: rank 0 compute0, rank 0 comm, rank 1 compute0, rank 1 comm.
    assert pixel(img, 4, 0, 50, span) == PALETTE[0]  # stage 0 computes micro-batch 0
    assert pixel(img, 4, 2, 250, span) == PALETTE[1]  # stage 1 computes micro-batch 1
    assert pixel(img, 4, 3, 120, span) == PALETTE[1]  # stage 1 receives micro-batch 0
    # Bubbles: stage 1 before its first micro-batch, stage 0 after its last.
    assert pixel(img, 4, 2, 70, span) == "#eeeeee"
    assert pixel(img, 4, 0, 380, span) == "#eeeeee"
    assert pixel(img, 4, 1, 50, span) == "#eeeeee"  # no send before the first compute ends
    # The same bytes every time, whatever the caller's matplotlib settings.
    with matplotlib.rc_context({"font.size": 20, "axes.facecolor": "black"}):
        again = draw_gantt(pipeline(), tmp_path / "again.png").read_bytes()
    assert again == data
    assert b"Matplotlib" not in data and b"Software" not in data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.png", "pipe.png"]
    assert (tmp_path / "pipe.png").stat().st_mode & 0o777 != 0o600  # not mkstemp's mode


def test_colour_by_microbatch_and_kind(tmp_path: Path) -> None:
    span = 440.0
    img = np.asarray(
        Image.open(draw_gantt(pipeline(), tmp_path / "mb.png", color_by="microbatch")).convert(
            "RGB"
        )
    )
    # Micro-batch m is colour m on both stages.
    assert pixel(img, 4, 0, 50, span) == PALETTE[0]
    assert pixel(img, 4, 0, 150, span) == PALETTE[1]
    assert pixel(img, 4, 0, 250, span) == PALETTE[2]
    assert pixel(img, 4, 2, 250, span) == PALETTE[1]  # stage 1's micro-batch 1 (240..340 us)
    img = np.asarray(
        Image.open(draw_gantt(pipeline(), tmp_path / "kind.png", color_by="kind")).convert("RGB")
    )
    # Kinds in a fixed order: node, send, recv present -> colours 0, 1, 2.
    assert pixel(img, 4, 0, 50, span) == PALETTE[0]
    assert pixel(img, 4, 1, 120, span) == PALETTE[1]
    assert pixel(img, 4, 3, 120, span) == PALETTE[2]
    with pytest.raises(FlowcError, match="cannot colour a Gantt chart by 'rank'"):
        draw_gantt(pipeline(), tmp_path / "x.png", color_by="rank")


def test_a_measured_trace_draws_through_the_adapter(tmp_path: Path) -> None:
    # Two ranks' FLOWC_TRACE lines: runs 0 and 1 on both, run 2 on rank 0 only.
    records = []
    for rank in range(2):
        for run in range(3 if rank == 0 else 2):
            for actor, (stream, start) in enumerate([(0, 10.0), (1, 0.0), (0, 0.0)]):
                records.append(
                    dict(run=run, rank=rank, actor=actor, name=f"a{actor}", stream=stream)
                    | dict(start_us=start + run, end_us=start + run + 5.0)
                )
    sched = schedule_from_trace(records)
    assert [r["run"] for r in sched["ranks"]] == [1, 1]  # the latest run of every rank
    r0 = sched["ranks"][0]
    # Each stream's actors in the order they started.
    assert [(s["id"], s["actors"]) for s in r0["streams"]] == [(0, [2, 0]), (1, [1])]
    assert r0["makespan_us"] == 16.0
    # Stages and names from a modeled schedule, matched by rank and actor id.
    modeled = pipeline()
    with_model = schedule_from_trace(records, run=0, schedule=modeled)
    assert [a["stage"] for a in with_model["ranks"][1]["actors"]] == [1, 1, 1]
    assert with_model["ranks"][0]["streams"][1]["name"] == "comm"
    with pytest.raises(FlowcError, match=r"run 2 is not in the trace of every rank"):
        schedule_from_trace(records, run=2)
    # A list of records is drawn directly.
    out = draw_gantt(records, tmp_path / "trace.png")
    assert png_size(out.read_bytes()) == figure_size(4)
    with pytest.raises(FlowcError, match="no records"):
        draw_gantt([], tmp_path / "none.png")
    bad = [dict(records[0], end_us="soon")]
    with pytest.raises(FlowcError, match=r"trace record 0: 'end_us' is 'soon'"):
        draw_gantt(bad, tmp_path / "bad.png")


def test_empty_or_malformed_schedules_are_clear_errors(tmp_path: Path) -> None:
    for sched, message in [
        ({"version": 1, "ranks": []}, "it has no actors"),
        ({"version": 1, "ranks": [{"rank": 0, "actors": [], "streams": []}]}, "it has no actors"),
        ({"version": 2, "ranks": []}, "schedule format version 2, expected 1"),
        ({"version": 1, "ranks": "all"}, "'ranks' is not a list"),
    ]:
        with pytest.raises(FlowcError, match=message):
            draw_gantt(sched, tmp_path / "out.png")
    backwards = pipeline()
    backwards["ranks"][1]["actors"][3]["end_us"] = 0.0
    with pytest.raises(FlowcError, match=r"rank 1, actor 3 ends \(0.0 us\) before it starts"):
        draw_gantt(backwards, tmp_path / "out.png")
    assert list(tmp_path.iterdir()) == []


def test_bad_paths_and_failed_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FlowcError, match=r"no_dir is not an existing folder"):
        draw_gantt(pipeline(), tmp_path / "no_dir" / "g.png")
    (tmp_path / "d.png").mkdir()
    with pytest.raises(FlowcError, match=r"d\.png: it is a folder"):
        draw_gantt(pipeline(), tmp_path / "d.png")
    with pytest.raises(FlowcError, match="drawn as PNG"):
        draw_gantt(pipeline(), tmp_path / "g.svg")
    # A write that fails half way (a full disk) leaves the earlier picture and no temporary file.
    old = tmp_path / "g.png"
    old.write_bytes(b"old picture")
    from matplotlib.figure import Figure

    def full_disk(self: Figure, f: Any, **kwargs: Any) -> None:
        f.write(b"half a png")
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(Figure, "savefig", full_disk)
    with pytest.raises(FlowcError, match=r"cannot write .*g\.png: No space left on device"):
        draw_gantt(pipeline(), old)
    assert old.read_bytes() == b"old picture"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.png", "g.png"]


def named_actors() -> list[dict[str, Any]]:
    """One stream of actors named as exporters name nodes, and worse: a scoped path, math
    and markup, a long path twice, an index-only name with a named output, a boxing step
    flowc inserted, no name at all."""
    long = "/model/layers.0/" + "a_very_long_module_name/" * 3 + "out_proj/MatMul"
    names = [
        ("/model/layers.0/self_attn/q_proj/MatMul", [], "MatMul"),
        ("$x$ [b] <i>", [], "Softmax"),
        (long, [], "MatMul"),
        (long, [], "MatMul"),
        ("n7", ["attn/out"], "Add"),
        ("box/h/0", ["box/h/0:0"], "AllReduce"),
        ("", [], "Relu"),
    ]
    return [
        dict(id=10 + k, name=name, writes=writes, op=op, kind="node", stream=0, stage=0)
        | dict(microbatch=0, start_us=100.0 * k, end_us=100.0 * (k + 1))
        for k, (name, writes, op) in enumerate(names)
    ]


def test_bars_show_model_names_shortened_unique_and_literal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    actors = named_actors()
    labels = bar_labels(actors)
    assert labels == [
        "model/layers.0/self_attn/q_proj/MatMul",
        "$x$ [b] <i>",
        "…/a_very_long_module_name/out_proj/MatMul #12",  # the same name twice: ids
        "…/a_very_long_module_name/out_proj/MatMul #13",
        "attn/out",  # "n7" is only an index: the value it writes
        "AllReduce(h)",  # what flowc inserted: the op and the value it moves
        "Relu",  # no name at all: the op
    ]
    # A schedule's own labels (Schedule.to_json writes them) are taken as they are.
    given = [dict(a, label=f"L{a['id']}") for a in actors]
    assert bar_labels(given) == [f"L{a['id']}" for a in actors]
    # Drawn: every bar wide enough shows its label, cut to the bar with its tail kept, as
    # text (math text off: "$x$" is not italic x).
    drawn: list[Any] = []
    monkeypatch.setattr(gantt, "_save", lambda fig, path: drawn.append(fig))
    sched = {
        "version": 1,
        "ranks": [
            {
                "rank": 0,
                "actors": actors,
                "streams": [{"id": 0, "name": "compute0", "actors": [a["id"] for a in actors]}],
            }
        ],
    }
    draw_gantt(sched, tmp_path / "names.png")
    (ax,) = drawn[0].axes
    texts = ax.texts
    shown = [t.get_text() for t in texts]
    assert len(shown) == len(labels)
    for text, label in zip(shown, labels, strict=True):
        assert text == label or (text.startswith("…") and label.endswith(text[1:])), text
    assert "$x$ [b] <i>" in shown and "AllReduce(h)" in shown
    assert all(not t.get_parse_math() for t in [*texts, *ax.get_yticklabels(), ax.title])


def test_a_measured_trace_takes_the_modeled_labels() -> None:
    actors = [dict(a, label=f"layer {a['id']}") for a in named_actors()]
    modeled = {"version": 1, "ranks": [{"rank": 0, "actors": actors, "streams": []}]}
    records = [
        dict(run=0, rank=0, actor=a["id"], name=a["name"], stream=0)
        | dict(start_us=a["start_us"], end_us=a["end_us"])
        for a in actors
    ]
    measured = schedule_from_trace(records, schedule=modeled)["ranks"][0]["actors"]
    assert bar_labels(measured) == [f"layer {a['id']}" for a in actors]
    # Without the modeled schedule, the names as the trace records them (the runtime writes
    # the node's name), shortened the same way.
    alone = schedule_from_trace(records)["ranks"][0]["actors"]
    assert bar_labels(alone)[0] == "model/layers.0/self_attn/q_proj/MatMul"
    assert len(set(bar_labels(alone))) == len(alone)
