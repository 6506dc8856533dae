"""Gantt pictures of a schedule: one row per stream per rank, each actor a bar from its start to
its end, coloured by pipeline stage, micro-batch or kind; idle time (a pipeline's bubbles, a
stream waiting on an event) shows as the row's pale background between bars.

``draw_gantt`` takes what ``schedule.json`` holds (the modeled schedule, format version 1):

    {"version": 1, "ranks": [{"rank": 0, "stage": 0, "makespan_us": ..., "critical_path": [ids],
      "streams": [{"id": 0, "name": "compute0", "actors": [ids in firing order]}],
      "actors": [{"id", "name", "op", "kind", "stream", "stage", "microbatch", "start_us",
                  "end_us", "label", "reads", "writes"}],
      "events": [{"id", "record_after", "wait_before", "kind"}]}]}

Each bar is labelled with the model's name for its actor (``bar_labels``: the schedule's
"label", or one made the same way from "name", "writes" and "op"; flowc.schedule.labels),
cut further to the bar's width keeping its tail; a name is text, never math (a ``$`` is a
dollar sign).

or a measured trace: the JSON lines that ``FLOWC_TRACE`` makes a compiled model write
(runtime_cpp/flowc/trace.h), several ranks' lines together, which ``schedule_from_trace`` turns
into the same form. A trace's times are each rank's own, counted from that rank's run start.

The picture is deterministic: the Agg renderer with matplotlib's default style and bundled
font, a size that depends only on the number of rows, and no date or version in the PNG's
metadata, so the same schedule gives the same bytes.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flowc.atomic_file import write_file_atomic
from flowc.errors import FlowcError
from flowc.schedule.labels import TEXT_LIMIT, Name, model_name, short_name, unique_labels

COLOR_BY = ("stage", "microbatch", "kind")
KINDS = ("node", "collective", "send", "recv", "copy")

# Inches: the figure is WIDTH wide and HEAD + ROW * rows tall, at DPI dots per inch.
WIDTH = 12.0
HEAD = 1.6
ROW = 0.5
DPI = 100
# Margins (inches) around the axes: room for the row labels, the legend, title and time axis.
LEFT = 2.3
RIGHT = 1.7
TOP = 0.6
BOTTOM = 0.7
MAX_ROWS = 200
FONT_PT = 8.0

# matplotlib's tab20 colours, in the order that keeps neighbours (stage s, s+1) apart.
PALETTE = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
    "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5",
]  # fmt: skip


def figure_size(rows: int) -> tuple[int, int]:
    """The picture's width and height in pixels for ``rows`` rows."""
    return round(WIDTH * DPI), round((HEAD + ROW * rows) * DPI)


def _bad(what: str, hint: str | None = None) -> FlowcError:
    return FlowcError(
        f"cannot draw the schedule: {what}",
        hint=hint or "give a schedule.json written by flowc, or FLOWC_TRACE lines",
    )


def _number(x: Any, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        raise _bad(f"{where} is {x!r}, not a finite number")
    return float(x)


def _integer(x: Any, where: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise _bad(f"{where} is {x!r}, not an integer")
    return x


def read_trace(paths: Path | Sequence[Path]) -> list[dict[str, Any]]:
    """The records of one or more FLOWC_TRACE files (one per rank: trace.rank<R>.jsonl)."""
    records: list[dict[str, Any]] = []
    for path in [paths] if isinstance(paths, Path) else list(paths):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise FlowcError(f"cannot read the trace {path}: {e}") from None
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise FlowcError(f"{path}:{n}: not a JSON line ({e})") from None
            if not isinstance(rec, dict):
                raise FlowcError(f"{path}:{n}: not a JSON object")
            records.append(rec)
    return records


def schedule_from_trace(
    records: Iterable[Mapping[str, Any]],
    run: int | None = None,
    schedule: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A measured run as a schedule dict. ``records``: FLOWC_TRACE lines of any ranks;
    ``run``: which run (default: the latest that every rank recorded); ``schedule``: the
    modeled schedule, whose stream names, stages, micro-batches, ops and kinds the measured
    actors take (matched by rank and actor id; without it every actor is a "node" of stage 0,
    micro-batch 0, and streams are named by number)."""
    by_rank: dict[int, list[Mapping[str, Any]]] = {}
    for k, rec in enumerate(records):
        where = f"trace record {k}"
        for key in ("run", "rank", "actor", "stream"):
            _integer(rec.get(key), f"{where}: {key!r}")
        for key in ("start_us", "end_us"):
            _number(rec.get(key), f"{where}: {key!r}")
        by_rank.setdefault(rec["rank"], []).append(rec)
    if not by_rank:
        raise _bad("the trace has no records", hint="was FLOWC_TRACE set when the model ran?")
    runs = set.intersection(*({r["run"] for r in recs} for recs in by_rank.values()))
    if run is None:
        if not runs:
            raise _bad("no run was recorded by every rank of the trace")
        run = max(runs)
    elif run not in runs:
        raise _bad(
            f"run {run} is not in the trace of every rank",
            hint=f"runs recorded by every rank: {sorted(runs)}",
        )
    modeled: dict[int, Mapping[str, Any]] = {}
    if schedule is not None:
        for r in _ranks(schedule):
            modeled[r["rank"]] = r
    ranks = []
    for rank in sorted(by_rank):
        model = modeled.get(rank, {})
        known = {a["id"]: a for a in model.get("actors", [])}
        names = {s["id"]: s["name"] for s in model.get("streams", [])}
        actors = []
        order: dict[int, list[tuple[float, int]]] = {}
        for rec in by_rank[rank]:
            if rec["run"] != run:
                continue
            m = known.get(rec["actor"], {})
            actors.append(
                {
                    "id": rec["actor"],
                    "name": str(rec.get("name", m.get("name", rec["actor"]))),
                    "op": m.get("op", ""),
                    "writes": list(m.get("writes", []) or []),
                    **({"label": m["label"]} if "label" in m else {}),
                    "kind": m.get("kind", "node"),
                    "stream": rec["stream"],
                    "stage": m.get("stage", model.get("stage", 0)),
                    "microbatch": m.get("microbatch", 0),
                    "start_us": float(rec["start_us"]),
                    "end_us": float(rec["end_us"]),
                }
            )
            order.setdefault(rec["stream"], []).append((float(rec["start_us"]), rec["actor"]))
        ranks.append(
            {
                "rank": rank,
                "stage": model.get("stage", 0),
                "makespan_us": max((a["end_us"] for a in actors), default=0.0),
                "critical_path": [],
                "streams": [
                    {
                        "id": s,
                        "name": names.get(s, f"stream {s}"),
                        "actors": [a for _, a in sorted(order[s])],
                    }
                    for s in sorted(order)
                ],
                "actors": actors,
                "events": [],
                "run": run,
            }
        )
    return {"version": 1, "ranks": ranks, "measured": True}


def _ranks(schedule: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    if not isinstance(schedule, Mapping):
        raise _bad(f"expected a schedule object, got {type(schedule).__name__}")
    if schedule.get("version") != 1:
        raise _bad(f"schedule format version {schedule.get('version')!r}, expected 1")
    ranks = schedule.get("ranks")
    if not isinstance(ranks, list) or not all(isinstance(r, Mapping) for r in ranks):
        raise _bad("'ranks' is not a list of objects")
    for r in ranks:
        _integer(r.get("rank"), "a rank's 'rank'")
    return ranks


def _rows(
    ranks: list[Mapping[str, Any]],
) -> tuple[list[tuple[int, int, str]], list[tuple[int, dict[str, Any]]]]:
    """The rows, (rank, stream, label) sorted by rank then stream, and every actor with its
    row index, checked."""
    keys: dict[tuple[int, int], str] = {}
    bars: list[tuple[tuple[int, int], dict[str, Any]]] = []
    for r in ranks:
        rank = r["rank"]
        actors = r.get("actors", [])
        if not isinstance(actors, list):
            raise _bad(f"rank {rank}: 'actors' is not a list")
        names = {}
        for s in r.get("streams", []) or []:
            names[_integer(s.get("id"), f"rank {rank}: a stream's 'id'")] = str(s.get("name", ""))
        labels = bar_labels(actors)
        for a, label in zip(actors, labels, strict=True):
            where = f"rank {rank}, actor {a.get('id')!r}"
            stream = _integer(a.get("stream"), f"{where}: 'stream'")
            start = _number(a.get("start_us"), f"{where}: 'start_us'")
            end = _number(a.get("end_us"), f"{where}: 'end_us'")
            if end < start:
                raise _bad(f"{where} ends ({end} us) before it starts ({start} us)")
            keys.setdefault((rank, stream), names.get(stream) or f"stream {stream}")
            bars.append(((rank, stream), {**a, "start_us": start, "end_us": end, "label": label}))
    rows = sorted(keys)
    if not rows:
        raise _bad("it has no actors", hint="a schedule needs at least one rank with actors")
    if len(rows) > MAX_ROWS:
        raise _bad(f"it has {len(rows)} rows (rank, stream); at most {MAX_ROWS} fit a picture")
    index = {k: i for i, k in enumerate(rows)}
    return [(k[0], k[1], keys[k]) for k in rows], [(index[k], a) for k, a in bars]


def _time_text(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:.3f} s"
    if us >= 1e3:
        return f"{us / 1e3:.3f} ms"
    return f"{us:.1f} us"


def _printable(text: str, glyphs: set[int]) -> str:
    """``text`` as the picture shows it: characters the font lacks, and controls, as "?"."""
    return "".join(c if ord(c) in glyphs and c.isprintable() else "?" for c in text)


def _glyphs() -> set[int]:
    """The code points the picture's font (DejaVu Sans, bundled with matplotlib) can draw."""
    from matplotlib import font_manager, ft2font

    path = font_manager.findfont(font_manager.FontProperties(family="DejaVu Sans"))
    return set(ft2font.FT2Font(path).get_charmap())


def _color_key(actor: Mapping[str, Any], color_by: str) -> tuple[int, str]:
    """The value an actor is coloured by: (order, legend label)."""
    if color_by == "kind":
        kind = str(actor.get("kind", "node"))
        return (KINDS.index(kind) if kind in KINDS else len(KINDS), kind)
    value = actor.get(color_by, 0)
    n = value if isinstance(value, int) and not isinstance(value, bool) else 0
    return (n, f"{'stage' if color_by == 'stage' else 'micro-batch'} {n}")


def bar_labels(actors: Sequence[Mapping[str, Any]]) -> list[str]:
    """The label of each of one rank's actors, in order: the schedule's own ("label", what
    ``Schedule.to_json`` writes) when every actor has a distinct one, else made here the
    same way from the names (flowc.schedule.labels: an index-only name gives way to the value
    it writes, a boxing step reads ``AllGather(VALUE)``), shortened and unique among the
    rank's actors (a collision told apart by the actor's id, or by its position when the ids
    are not distinct integers)."""
    given = [a.get("label") for a in actors]
    if all(isinstance(g, str) and g.strip() for g in given) and len(set(given)) == len(given):
        return [short_name(str(g), TEXT_LIMIT) for g in given]
    ids = [a.get("id") for a in actors]
    keys = [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
    if len(keys) != len(ids) or len(set(keys)) != len(keys):
        keys = list(range(len(actors)))
    names: dict[int, Name] = {}
    for key, a in zip(keys, actors, strict=True):
        writes = a.get("writes")
        names[key] = model_name(
            str(a.get("name", a.get("id", ""))),
            [str(w) for w in writes] if isinstance(writes, list) else [],
            str(a.get("op", "") or ""),
        )
    labels = unique_labels(names, TEXT_LIMIT)
    return [labels[key] for key in keys]


def draw_gantt(
    schedule: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    path: Path,
    color_by: str = "stage",
    title: str | None = None,
) -> Path:
    """Draw ``schedule`` (a schedule.json dict, or a list of FLOWC_TRACE records) as a PNG at
    ``path``, written atomically (a temporary file beside it, then renamed). ``color_by``:
    "stage", "microbatch" or "kind". Returns ``path``."""
    if color_by not in COLOR_BY:
        raise FlowcError(
            f"cannot colour a Gantt chart by {color_by!r}", hint=f"use one of {', '.join(COLOR_BY)}"
        )
    if not isinstance(schedule, Mapping):
        schedule = schedule_from_trace(schedule)
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise FlowcError(
            f"{path}: a Gantt chart is drawn as PNG", hint="give a path ending in .png"
        )
    parent = path.parent
    if not parent.is_dir():
        raise FlowcError(
            f"cannot write {path}: {parent} is not an existing folder",
            hint="create the folder first or choose another path",
        )
    if path.is_dir():
        raise FlowcError(
            f"cannot write {path}: it is a folder", hint="give a file name ending in .png"
        )
    ranks = _ranks(schedule)
    rows, bars = _rows(ranks)

    import matplotlib
    import matplotlib.style
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    makespan = max(
        [b["end_us"] for _, b in bars]
        + [_number(r.get("makespan_us", 0.0), f"rank {r['rank']}: 'makespan_us'") for r in ranks]
    )
    span = makespan if makespan > 0 else 1.0
    critical = {(r["rank"], a) for r in ranks for a in r.get("critical_path", []) or []}
    row_of = {(rank, stream): i for i, (rank, stream, _) in enumerate(rows)}
    width_px, height_px = figure_size(len(rows))
    glyphs = _glyphs()

    with (
        matplotlib.style.context("default"),
        matplotlib.rc_context(
            {"font.family": "DejaVu Sans", "font.size": FONT_PT, "svg.hashsalt": "flowc"}
        ),
    ):
        fig = Figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI)
        FigureCanvasAgg(fig)
        w_in, h_in = width_px / DPI, height_px / DPI
        fig.subplots_adjust(
            left=LEFT / w_in, right=1 - RIGHT / w_in, top=1 - TOP / h_in, bottom=BOTTOM / h_in
        )
        ax = fig.add_subplot(1, 1, 1)
        # Each row's extent in pale grey: the gaps between bars on it are idle time.
        busy = [0.0] * len(rows)
        for row, b in bars:
            busy[row] += b["end_us"] - b["start_us"]
        for i in range(len(rows)):
            ax.barh(i, span, left=0, height=0.8, color="#eeeeee", edgecolor="none", zorder=1)
        keys = sorted({_color_key(b, color_by) for _, b in bars})
        color = {k: PALETTE[n % len(PALETTE)] for n, k in enumerate(keys)}
        # White text on the strong first ten colours, black on the pale rest.
        ink = {k: "white" if n % len(PALETTE) < 10 else "black" for n, k in enumerate(keys)}
        # A bar a pixel wide at least, so an actor of (modeled) zero time still shows.
        us_per_px = span / ((WIDTH - LEFT - RIGHT) * DPI)
        char_us = us_per_px * FONT_PT * 0.62 * DPI / 72  # about one character's width
        for row, b in sorted(bars, key=lambda rb: (rb[0], rb[1]["start_us"], str(rb[1].get("id")))):
            key = _color_key(b, color_by)
            width = max(b["end_us"] - b["start_us"], us_per_px)
            on_path = (rows[row][0], b.get("id")) in critical
            ax.barh(
                row,
                width,
                left=b["start_us"],
                height=0.8,
                color=color[key],
                edgecolor="black" if on_path else "white",
                linewidth=1.4 if on_path else 0.4,
                zorder=3,
            )
            # The actor's label where it fits; shortened (its tail kept) down to 7 characters.
            name = _printable(b["label"], glyphs)
            fits = int(width / char_us) - 1
            if fits >= len(name) or fits >= 7:
                label = name if fits >= len(name) else short_name(name, fits)
                ax.text(
                    b["start_us"] + width / 2,
                    row,
                    label,
                    ha="center",
                    va="center",
                    fontsize=FONT_PT - 1,
                    color=ink[key],
                    clip_on=True,
                    parse_math=False,  # a "$" in a name is a dollar sign
                    zorder=4,
                )
        # Events between streams: a thin line from where one is recorded to where it is waited.
        for r in ranks:
            ends = {a.get("id"): a for a in r.get("actors", [])}
            for e in r.get("events", []) or []:
                src, dst = ends.get(e.get("record_after")), ends.get(e.get("wait_before"))
                if src is None or dst is None:
                    continue
                y0 = row_of.get((r["rank"], src.get("stream")))
                y1 = row_of.get((r["rank"], dst.get("stream")))
                if y0 is None or y1 is None or y0 == y1:
                    continue
                ax.annotate(
                    "",
                    xy=(float(dst["start_us"]), y1),
                    xytext=(float(src["end_us"]), y0),
                    arrowprops={"arrowstyle": "->", "color": "#555555", "lw": 0.6},
                    zorder=5,
                )
        labels = []
        for i, (rank, _, name) in enumerate(rows):
            idle = 100.0 * max(0.0, 1 - busy[i] / span)
            labels.append(f"rank {rank} · {_printable(name, glyphs)}  (idle {idle:.0f}%)")
        ax.set_yticks(range(len(rows)), labels, parse_math=False)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xlim(0, span * 1.01)
        ax.set_xlabel(
            "time (us)" + (", each rank from its own run start" if schedule.get("measured") else "")
        )
        ax.grid(axis="x", color="#cccccc", linewidth=0.5, zorder=0)
        ax.set_axisbelow(True)
        handles = [Patch(facecolor=color[k], label=k[1]) for k in keys[:24]]
        if len(keys) > 24:
            handles.append(Patch(facecolor="white", label=f"... {len(keys) - 24} more"))
        if critical:
            handles.append(
                Patch(facecolor="white", edgecolor="black", linewidth=1.4, label="critical path")
            )
        handles.append(Patch(facecolor="#eeeeee", label="idle"))
        ax.legend(
            handles=handles,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            fontsize=FONT_PT,
            frameon=False,
            borderaxespad=0.0,
        )
        what = "measured run" if schedule.get("measured") else "modeled schedule"
        streams = len(rows)
        ax.set_title(
            f"{_printable(title, glyphs) + ': ' if title else ''}{what}, {len(ranks)} rank{'s' * (len(ranks) != 1)}, "
            f"{streams} stream{'s' * (streams != 1)}: makespan {_time_text(makespan)}",
            fontsize=FONT_PT + 2,
            parse_math=False,
        )
        _save(fig, path)
    return path


def _save(fig: Any, path: Path) -> None:
    """Render ``fig`` to ``path`` atomically; PNG metadata without matplotlib's version, so
    the bytes are reproducible."""
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png", dpi=DPI, metadata={"Software": None})
    except OSError as e:  # rendering failed: nothing was written
        raise FlowcError(f"cannot write {path}: {e.strerror or e}") from None
    write_file_atomic(path, png.getvalue())
