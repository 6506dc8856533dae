"""`flowc inspect MODEL --report DIR`: one self-contained HTML page (DIR/index.html) about a
compiled model: the graph (SVG drawn by Graphviz ``dot``), memory over time (a PNG from the
MemoryPlan), the actor schedule's Gantt chart (flowc.schedule.gantt) and the tables
`flowc inspect` prints (recorded from its own console, so the page shows the same numbers).

The page makes no requests: the SVG is inline, the PNGs are data: URIs, the CSS is inline and
there is no script. Every model string is escaped for HTML (and for DOT in report.graph).

The report sits at the top of the layers: it reads the IR, the schedule and the memory plan,
and only flowc.cli imports it.
"""

from __future__ import annotations

import base64
import html
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowc.atomic_file import write_file_atomic
from flowc.errors import FlowcError
from flowc.ir.graph import Graph, Node, Value
from flowc.report.graph import (
    COLLAPSE_ABOVE,
    COLLECTIVE_COLOR,
    FAMILY_COLORS,
    OTHER_COLOR,
    STAGE_COLOR,
    Drawing,
    draw,
    find_dot,
)
from flowc.report.memory import draw_memory, largest, live_bytes

# The Gantt chart of a schedule, drawn here for the page and by `flowc inspect --gantt`
# (which reaches the schedule's drawing through the report, not the schedule package), and
# the labels every view gives nodes and actors (the same way to the same place).
from flowc.schedule.gantt import draw_gantt
from flowc.schedule.labels import node_labels

if TYPE_CHECKING:
    from flowc.memory.plan import MemoryPlan
    from flowc.schedule.program import Schedule

__all__ = [
    "COLLAPSE_ABOVE",
    "Report",
    "check_target",
    "draw_gantt",
    "find_dot",
    "node_labels",
    "rich_html",
    "write_report",
]

PAGE = "index.html"


@dataclass
class Report:
    """What the page shows. ``graph`` is drawn (the logical graph on a mesh, with ``sbp``
    its layouts and ``collectives`` the collectives per (value, consumer or None for an
    output)); ``plan`` and ``schedule`` are the compiled (rank) program's; ``tables_html``
    is the recorded `flowc inspect` output."""

    title: str
    graph: Graph
    plan: MemoryPlan
    schedule: Schedule
    tables_html: str
    sbp: Mapping[Value, Any] = field(default_factory=dict)
    collectives: Mapping[tuple[Value, Node | None], list[str]] = field(default_factory=dict)
    ranks: int = 1
    notes: list[str] = field(default_factory=list)
    collapse_above: int = COLLAPSE_ABOVE


@dataclass
class Written:
    """What write_report made, for the caller and tests."""

    path: Path
    drawing: Drawing
    peak_live: int


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _gantt_png(schedule: Schedule, title: str) -> bytes:
    # draw_gantt writes a file (atomically); a private temporary folder holds it.
    with tempfile.TemporaryDirectory(prefix="flowc-report-") as tmp:
        path = Path(tmp) / "gantt.png"
        draw_gantt({"version": 1, "ranks": [schedule.to_json(rank=0)]}, path, title=title)
        return path.read_bytes()


CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif;
       margin: 0; color: #1a1a1a; background: #ffffff; }
header { background: #1f3b57; color: #ffffff; padding: 14px 24px; }
header h1 { margin: 0 0 4px 0; font-size: 20px; }
header p { margin: 0; font-size: 13px; color: #d8e3ee; }
nav { padding: 8px 24px; background: #eef2f6; border-bottom: 1px solid #d0d7de; font-size: 13px; }
nav a { margin-right: 16px; color: #1f3b57; }
main { padding: 8px 24px 40px 24px; }
section { margin-top: 18px; }
h2 { font-size: 17px; border-bottom: 1px solid #d0d7de; padding-bottom: 4px; }
.note { font-size: 13px; color: #444444; }
.graph { overflow: auto; max-height: 85vh; border: 1px solid #d0d7de; background: #fcfcfc; }
.graph svg { display: block; }
img { max-width: 100%; height: auto; border: 1px solid #d0d7de; }
table.data { border-collapse: collapse; font-size: 12px; }
table.data th, table.data td { border: 1px solid #d0d7de; padding: 3px 8px; text-align: left; }
table.data td.num { text-align: right; font-variant-numeric: tabular-nums; }
.legend span { display: inline-block; margin: 2px 8px 2px 0; padding: 1px 8px;
               border: 1px solid #999999; border-radius: 4px; font-size: 12px; }
pre.rich { font-size: 12px; line-height: 1.3; background: #fafafa; border: 1px solid #d0d7de;
           padding: 8px; overflow: auto; }
"""


def _legend(families: list[str], has_coll: bool, has_stage: bool) -> str:
    spans = [
        f'<span style="background:{FAMILY_COLORS.get(f, OTHER_COLOR)}">{_esc(f)}</span>'
        for f in families
    ]
    spans.append(
        '<span style="background:#ffffff; border-style:double">collapsed (double border)</span>'
    )
    if has_coll:
        spans.append(
            f'<span style="color:{COLLECTIVE_COLOR}; border-color:{COLLECTIVE_COLOR}">'
            "collective (red edge)</span>"
        )
    if has_stage:
        spans.append(
            f'<span style="color:{STAGE_COLOR}; border-color:{STAGE_COLOR}">'
            "stage boundary (dashed)</span>"
        )
    return '<p class="legend">' + "".join(spans) + "</p>"


def render(report: Report, progress: Callable[[str], None] | None = None) -> tuple[str, Written]:
    """The page's HTML (and what went into it)."""
    say = progress or (lambda _msg: None)
    drawing = draw(
        report.graph, report.sbp, report.collectives, report.collapse_above, progress=say
    )
    say(f"graph drawn in {drawing.seconds:.2f} s; drawing memory over time and the schedule")
    plan = report.plan
    rows = "".join(
        "<tr>"
        f"<td>{_esc(r.name)}</td><td class=num>{r.size}</td><td class=num>{r.offset}</td>"
        f"<td>{_esc(r.first)}</td><td>{_esc(r.last)}</td>"
        "</tr>"
        for r in largest(plan)
    )
    # No buffers (every value is an input, an output or a weight): nothing to draw.
    memory = (
        f'<img alt="memory over time" src="{_data_uri(draw_memory(plan, report.title))}">'
        '<table class="data"><tr><th>largest buffers</th><th>bytes</th><th>offset</th>'
        f"<th>first step</th><th>last step</th></tr>{rows}</table>"
        if plan.buffers
        else '<p class="note">No arena buffers: every value is an input, an output or a weight.</p>'
    )
    sched = report.schedule
    # A graph without nodes (its outputs are its inputs) has no actors to draw.
    gantt = (
        f'<img alt="Gantt chart of the schedule" '
        f'src="{_data_uri(_gantt_png(sched, report.title))}">'
        if sched.actors.actors
        else '<p class="note">No actors: the program runs no kernels.</p>'
    )
    peak = max(live_bytes(plan), default=0)
    g = report.graph
    items = len(drawing.items)
    collapsed = (
        f"{len(g.nodes)} nodes, drawn as {items} (repeated blocks and runs collapsed above "
        f"{report.collapse_above} nodes)"
        if drawing.collapsed_from
        else f"{len(g.nodes)} nodes"
    )
    stages = sorted({n.stage for n in g.nodes if n.stage is not None})
    notes = "".join(f'<p class="note">{_esc(n)}</p>' for n in report.notes)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        # No requests: this policy makes the browser refuse any that a future edit adds.
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "img-src data:; style-src 'unsafe-inline'\">",
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>flowc report: {_esc(report.title)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<header><h1>flowc report: {_esc(report.title)}</h1>",
        f"<p>graph {_esc(repr(g.name))}: {_esc(collapsed)}; arena {plan.arena_bytes} B, "
        f"lower bound {plan.lower_bound} B; {len(sched.actors.actors)} actors on "
        f"{sched.num_streams} stream(s), modeled makespan {sched.makespan_s * 1e6:.3f} us"
        + (f"; {report.ranks} ranks" if report.ranks > 1 else "")
        + "</p></header>",
        '<nav><a href="#graph">graph</a><a href="#memory">memory</a>'
        '<a href="#schedule">schedule</a><a href="#tables">tables</a></nav>',
        "<main>",
        notes,
        '<section id="graph"><h2>Graph</h2>',
        f'<p class="note">{_esc(collapsed)}. Boxes are coloured by op family; edges carry '
        "the value's type"
        + (" and nd-SBP layout" if report.sbp else "")
        + "; weights are not drawn. Hover a box or an edge for full names.</p>",
        _legend(drawing.families, bool(report.collectives), len(stages) > 1),
        f'<div class="graph" data-items="{items}" data-nodes="{len(g.nodes)}">{drawing.svg}</div>',
        "</section>",
        '<section id="memory"><h2>Memory over time</h2>',
        f'<p class="note">The arena of the compiled program: live bytes at each of the '
        f"{len(live_bytes(plan))} steps of the issue order (peak {peak} B; the plan's lower "
        f"bound {plan.lower_bound} B) "
        f"against the arena of {plan.arena_bytes} B "
        f"({plan.arena_bytes / max(plan.lower_bound, 1):.3f}x), and where each buffer "
        "sits.</p>",
        memory,
        "</section>",
        '<section id="schedule"><h2>Schedule</h2>',
        '<p class="note">The modeled actor schedule'
        + (
            f" of rank 0 (all {report.ranks} ranks run the same rank graph)"
            if report.ranks > 1
            else ""
        )
        + ": one row per stream; bars outlined in black are the critical path.</p>",
        gantt,
        "</section>",
        '<section id="tables"><h2>Tables</h2>',
        '<p class="note">What <code>flowc inspect</code> printed for this report.</p>',
        report.tables_html,
        "</section>",
        "</main></body></html>",
    ]
    return "\n".join(parts) + "\n", Written(Path(), drawing, peak)


def check_target(directory: Path) -> None:
    """Fail early (before compiling) when ``directory`` cannot be the report's folder or
    Graphviz's dot is missing."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise FlowcError(
            f"--report {directory}: a file is in the way, not a folder",
            hint="give a folder (made if missing) for index.html",
        )
    find_dot()


def write_report(
    directory: Path, report: Report, progress: Callable[[str], None] | None = None
) -> Written:
    """Write ``directory``/index.html (made if missing) atomically: a temporary file
    beside it, then renamed."""
    directory = Path(directory)
    check_target(directory)
    text, written = render(report, progress)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FlowcError(f"cannot write {directory / PAGE}: {e.strerror or e}") from None
    path = directory / PAGE
    write_file_atomic(path, text.encode("utf-8"))
    written.path = path
    return written


def rich_html(console: Any) -> str:
    """A recording rich Console's output as an HTML fragment with inline styles."""
    return str(
        console.export_html(
            inline_styles=True, code_format='<pre class="rich"><code>{code}</code></pre>'
        )
    )
