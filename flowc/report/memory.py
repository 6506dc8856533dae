"""Memory over time for the report: the arena's live bytes per step of the issue order
against the arena size and the lower bound, and each buffer as a rectangle at its offset
over its live steps (the placement), the largest named.

Both come from the compiled program's MemoryPlan: a buffer is live on the closed step range
[start, end] of ``plan.steps``, as flowc.memory.plan.live_bytes_bound counts (the plan's
lower bound is drawn as the plan states it).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from flowc.ir.graph import Node
from flowc.memory.plan import Buffer, MemoryPlan
from flowc.report.graph import printable
from flowc.schedule.labels import node_labels, short_name

# Buffers named in the picture and listed in the table.
NAMED = 8
DPI = 100
WIDTH_IN = 12.0
HEIGHT_IN = 7.0


@dataclass
class BufferRow:
    """One of the largest buffers, for the page's table."""

    name: str
    size: int
    offset: int
    first: str  # the step that first writes it
    last: str  # the step that last reads it
    start: int
    end: int


def buffer_name(plan: MemoryPlan, b: Buffer) -> str:
    if b.workspace >= 0:
        return f"library workspace (stream {b.workspace})"
    if not b.values:
        return f"buffer {b.id}"
    more = f" (+{len(b.values) - 1} in place)" if len(b.values) > 1 else ""
    return short_name(b.values[0].name, 32) + more


def step_labels(plan: MemoryPlan) -> dict[Node, str]:
    """The label of each node the plan's steps run (flowc.schedule.labels), unique among them."""
    return node_labels(list(dict.fromkeys(plan.steps)), 30)


def live_bytes(plan: MemoryPlan) -> list[int]:
    """Bytes of the arena in use at each step of the issue order."""
    steps = max(len(plan.steps), max((b.end + 1 for b in plan.buffers), default=0))
    delta = [0] * (steps + 1)
    for b in plan.buffers:
        delta[b.start] += b.size
        delta[b.end + 1] -= b.size
    live, out = 0, []
    for d in delta[:steps]:
        live += d
        out.append(live)
    return out


def largest(plan: MemoryPlan, count: int = NAMED) -> list[BufferRow]:
    labels = step_labels(plan)

    def step_name(t: int) -> str:
        if 0 <= t < len(plan.steps):
            n = plan.steps[t]
            return f"{t}: {labels[n]} [{n.op}]"
        return str(t)

    ranked = sorted(plan.buffers, key=lambda b: (-b.size, b.start, b.id))[:count]
    return [
        BufferRow(
            buffer_name(plan, b),
            b.size,
            b.offset,
            step_name(b.start),
            step_name(b.end),
            b.start,
            b.end,
        )
        for b in ranked
    ]


def _mib(n: float) -> float:
    return n / (1 << 20)


def draw_memory(plan: MemoryPlan, title: str) -> bytes:
    """The PNG (bytes) of live bytes per step and the placement, largest buffers named."""
    import matplotlib
    import matplotlib.style
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    from flowc.schedule.gantt import PALETTE, _glyphs, _printable

    glyphs = _glyphs()
    live = live_bytes(plan)
    steps = len(live)
    named = sorted(plan.buffers, key=lambda b: (-b.size, b.start, b.id))[:NAMED]
    named_ids = {b.id: k for k, b in enumerate(named)}
    scale, unit = (1 << 20, "MiB") if plan.arena_bytes >= 1 << 20 else (1 << 10, "KiB")
    with (
        matplotlib.style.context("default"),
        matplotlib.rc_context({"font.family": "DejaVu Sans", "font.size": 8.0}),
    ):
        fig = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI)
        FigureCanvasAgg(fig)
        fig.subplots_adjust(left=0.07, right=0.70, top=0.93, bottom=0.08, hspace=0.25)
        ax1 = fig.add_subplot(2, 1, 1)
        ax2 = fig.add_subplot(2, 1, 2, sharex=ax1)
        xs = list(range(steps))
        ys = [v / scale for v in live]
        ax1.fill_between(xs, ys, step="mid", color="#9ecae1", alpha=0.8, label="live bytes")
        ax1.step(xs, ys, where="mid", color="#08519c", linewidth=1.0)
        ax1.axhline(plan.arena_bytes / scale, color="#cb181d", linewidth=1.2, label="arena")
        ax1.axhline(
            plan.lower_bound / scale,
            color="#636363",
            linewidth=1.0,
            linestyle="--",
            label="lower bound",
        )
        if live:
            peak = max(range(steps), key=lambda t: (live[t], -t))
            node = plan.steps[peak] if peak < len(plan.steps) else None
            what = _printable(step_labels(plan)[node], glyphs) if node else ""
            ax1.annotate(
                f"peak at step {peak}: {what}",
                xy=(peak, live[peak] / scale),
                xytext=(0.02, 0.9),
                textcoords="axes fraction",
                arrowprops={"arrowstyle": "->", "color": "#333333", "lw": 0.6},
                fontsize=8,
                annotation_clip=False,
                parse_math=False,
            )
        ax1.set_ylabel(f"live ({unit})")
        ax1.set_ylim(0, max(plan.arena_bytes, plan.lower_bound, 1) / scale * 1.15)
        ax1.set_title(
            _printable(printable(title, 60), glyphs)
            + f": arena {_mib(plan.arena_bytes):.2f} MiB, lower bound "
            f"{_mib(plan.lower_bound):.2f} MiB, {len(plan.buffers)} buffers over {steps} steps",
            fontsize=10,
            parse_math=False,
        )
        ax1.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        ax1.grid(axis="y", color="#dddddd", linewidth=0.5)
        handles = []
        for b in plan.buffers:
            k = named_ids.get(b.id)
            color = PALETTE[k] if k is not None else "#d9d9d9"
            rect = Rectangle(
                (b.start - 0.45, b.offset / scale),
                b.end - b.start + 0.9,
                b.size / scale,
                facecolor=color,
                edgecolor="#ffffff" if k is None else "#333333",
                linewidth=0.3,
            )
            ax2.add_patch(rect)
        for k, b in enumerate(named):
            # A "$" in a name is a dollar sign, not mathtext (legend labels have no parse_math).
            label = _printable(f"{buffer_name(plan, b)}  {_mib(b.size):.2f} MiB", glyphs)
            label = label.replace("$", r"\$")
            handles.append(Rectangle((0, 0), 1, 1, facecolor=PALETTE[k], label=label))
        ax2.set_xlim(-0.5, max(steps, 1) - 0.5)
        ax2.set_ylim(0, max(plan.arena_bytes, 1) / scale * 1.02)
        ax2.set_xlabel("step (issue order)")
        ax2.set_ylabel(f"offset ({unit})")
        ax2.set_title("placement: each buffer at its offset over its live steps", fontsize=9)
        ax2.legend(
            handles=handles,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            frameon=False,
            title=f"the {len(named)} largest",
            fontsize=7,
        )
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()
