"""The graph picture of the report: DOT text for Graphviz ``dot``, and the SVG it draws.

Every node is a box coloured by its op's family (flowc.ops.registry), showing its op and its
label (the model's name for it, shortened: flowc.schedule.labels); every edge a value,
labelled with its type and, on a mesh, its nd-SBP layout. Edges where the parallel plan
inserts a collective are red and named; edges that cross a pipeline stage (``Node.stage``)
are dashed purple. Weights are not drawn (a model has hundreds), graph inputs and outputs are
ellipses.

Above ``limit`` nodes the graph is collapsed so ``dot`` stays fast (its layout is worse
than linear in nodes and edge labels): runs of a repeated op sequence in the topological
order (a transformer's layers, a dense block's layers) become one node "k x [ops]", then
runs of nodes sharing a name prefix, then, if that is not enough, consecutive chunks. A
contiguous range of a topological order is convex (every path between two of its nodes
stays inside it), so collapsing ranges never makes a cycle.

Model strings are hostile input: names reach DOT only inside quoted strings with ``\\`` and
``"`` escaped and control characters replaced; node ids are our own (``n12``), never names.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flowc.errors import FlowcError
from flowc.ir.graph import Graph, Node, Value
from flowc.ops.registry import find_op
from flowc.schedule.labels import PICTURE_LIMIT, node_labels, one_line, short_name

# Nodes above which the graph is collapsed (the compiled DenseNet-121 has 308, GPT-2 small
# 172: dot lays out a few hundred labelled nodes in about a second).
COLLAPSE_ABOVE = 200
# A repeated block must cover at least this many nodes to be worth a cluster node.
MIN_REPEAT_COVER = 6
# Longest block (in nodes) the repeat search tries.
MAX_PERIOD = 160
# Longest label line taken from a model string.
MAX_NAME = PICTURE_LIMIT
DOT_TIMEOUT_S = 120

# Fill colours by op family (pale, so black text reads); unknown families get grey.
FAMILY_COLORS: dict[str, str] = {
    "matmul": "#9ecae1",
    "attention": "#6baed6",
    "conv": "#a1d99b",
    "pool": "#c7e9c0",
    "elementwise": "#fdd0a2",
    "norm": "#dadaeb",
    "softmax": "#bcbddc",
    "reduce": "#fcbba1",
    "shape": "#e5e5e5",
    "index": "#d9d9d9",
    "comm": "#fb6a4a",
    "quant": "#fee391",
    "rnn": "#c6dbef",
    "linalg": "#9ecae1",
    "sample": "#d4b9da",
    "signal": "#fdae6b",
    "ml": "#ccebc5",
    "training": "#f2f0f7",
}
OTHER_COLOR = "#f0f0f0"
COLLECTIVE_COLOR = "#cb181d"
STAGE_COLOR = "#6a3d9a"


def family_of(op: str) -> str:
    opdef = find_op(op)  # an op unknown to the registry is still drawn
    return opdef.family if opdef is not None else "other"


def printable(text: str, limit: int = MAX_NAME) -> str:
    """A model string as one line: control characters (newlines included) shown as U+FFFD,
    lone surrogates replaced; whole when it fits ``limit``, else shortened as every label is
    (flowc.schedule.labels.short_name: its middle goes, its tail stays)."""
    line = one_line(text)
    return line if len(line) <= limit else short_name(line, limit)


def dot_quote(text: str) -> str:
    """``text`` as a DOT quoted string; ``\\n`` in it (ours, between lines) is a line break,
    every backslash, quote and ampersand of the text itself is literal (dot reads ``&amp;``
    in a label as an entity: a name holding one would show as ``&``)."""
    lines = text.split("\n")
    body = "\\n".join(
        ln.replace("\\", "\\\\").replace('"', '\\"').replace("&", "&amp;") for ln in lines
    )
    return f'"{body}"'


@dataclass
class Item:
    """A node of the drawn graph: one graph node, or a collapsed range of them."""

    id: str
    nodes: list[Node]
    kind: str = "node"  # node | repeat | prefix | chunk
    repeats: int = 1  # for "repeat": how many times the block occurs
    period: int = 1  # for "repeat": nodes per block
    prefix: str = ""

    @property
    def collapsed(self) -> bool:
        return self.kind != "node"


@dataclass
class Drawing:
    """What ``draw`` made: the DOT text, the SVG, and the collapsed graph's size."""

    items: list[Item]
    dot: str
    svg: str = ""
    collapsed_from: int = 0  # the graph's node count when collapsed (0: not collapsed)
    edges: int = 0
    seconds: float = 0.0
    families: list[str] = field(default_factory=list)


def _repeats(ops: Sequence[str], i: int) -> tuple[int, int]:
    """The repeated block starting at ``i`` with the most repetitions, of those the one
    covering the most nodes: (period, count). Most repetitions first: DenseNet's dense
    layer (5 nodes, 6 times) rather than two copies of a 64-node stretch that spans a dense
    block and a transition."""
    n = len(ops)
    best = (0, 0)
    for p in range(1, min(MAX_PERIOD, (n - i) // 2) + 1):
        if ops[i] != ops[i + p] or ops[i : i + p] != ops[i + p : i + 2 * p]:
            continue
        k = 2
        while i + (k + 1) * p <= n and ops[i + k * p : i + (k + 1) * p] == ops[i : i + p]:
            k += 1
        if k * p >= MIN_REPEAT_COVER and (k, k * p) > (best[1], best[0] * best[1]):
            best = (p, k)
    return best


def _prefix(name: str) -> str:
    """A name without its last component (``/h.3/attn/MatMul`` -> ``/h.3/attn``): nodes of
    one layer share it in exporters that name nodes by module path."""
    for sep in ("/", ".", ":"):
        if sep in name.strip(sep):
            return name.rstrip(sep).rsplit(sep, 1)[0]
    return ""


def collapse(graph: Graph, limit: int = COLLAPSE_ABOVE) -> list[Item]:
    """The items to draw: every node alone up to ``limit`` nodes, else collapsed ranges."""
    nodes = list(graph.nodes)
    if len(nodes) <= limit:
        return [Item(f"n{k}", [n]) for k, n in enumerate(nodes)]
    ops = [n.op for n in nodes]
    # 1. Repeated blocks: at each position the repeat covering the most nodes, greedily.
    ranges: list[tuple[int, int, str, int, int]] = []  # start, end, kind, repeats, period
    best = [_repeats(ops, i) for i in range(len(nodes))]
    i = 0
    while i < len(nodes):
        p, k = best[i]
        # A block that starts inside this one and repeats more often wins (the layers after
        # a transition, not one copy of transition-and-layers beside another).
        if k >= 2 and any(best[j][1] > k for j in range(i + 1, i + p * k)):
            k = 0
        if k >= 2:
            ranges.append((i, i + p * k, "repeat", k, p))
            i += p * k
        else:
            ranges.append((i, i + 1, "node", 1, 1))
            i += 1
    # 2. Runs of single nodes sharing a name prefix (at least 3 of them).
    if len(ranges) > limit:
        merged: list[tuple[int, int, str, int, int]] = []
        for r in ranges:
            last = merged[-1] if merged else None
            if (
                r[2] == "node"
                and last is not None
                and last[2] in ("node", "prefix")
                and _prefix(nodes[r[0]].name)
                and _prefix(nodes[r[0]].name) == _prefix(nodes[last[0]].name)
            ):
                merged[-1] = (last[0], r[1], "prefix", 1, 1)
            else:
                merged.append(r)
        ranges = [
            (s, e, "node", 1, 1) if kind == "prefix" and e - s < 3 else (s, e, kind, k, p)
            for s, e, kind, k, p in merged
        ]
        # A prefix run shorter than 3 was split back into single nodes above only as a range;
        # expand it so each node is drawn alone.
        ranges = [
            r
            for s, e, kind, k, p in ranges
            for r in (
                [(j, j + 1, "node", 1, 1) for j in range(s, e)]
                if kind == "node" and e - s > 1
                else [(s, e, kind, k, p)]
            )
        ]
    # 3. Still too many: consecutive single nodes in chunks, as few as bring it under limit.
    if len(ranges) > limit:
        singles = sum(1 for r in ranges if r[2] == "node")
        others = len(ranges) - singles
        room = max(limit - others, 1)
        size = max(2, -(-singles // room))
        chunked: list[tuple[int, int, str, int, int]] = []
        run: list[tuple[int, int, str, int, int]] = []

        def flush() -> None:
            for j in range(0, len(run), size):
                part = run[j : j + size]
                if len(part) == 1:
                    chunked.append(part[0])
                else:
                    chunked.append((part[0][0], part[-1][1], "chunk", 1, 1))
            run.clear()

        for r in ranges:
            if r[2] == "node":
                run.append(r)
            else:
                flush()
                chunked.append(r)
        flush()
        ranges = chunked
    items = []
    for k, (s, e, kind, reps, period) in enumerate(ranges):
        items.append(
            Item(
                f"n{k}" if kind == "node" else f"g{k}",
                nodes[s:e],
                kind,
                reps,
                period,
                _prefix(nodes[s].name) if kind == "prefix" else "",
            )
        )
    return items


def _shape(v: Value) -> str:
    return printable(str(v.type), 60)


def _item_label(
    item: Item, labels: Mapping[Node, str], ends: Mapping[Node, str]
) -> tuple[str, str]:
    """(label, tooltip) of an item; both plain text with ``\\n`` between lines. ``labels``:
    each node's label in the drawing (flowc.schedule.labels), ``ends``: the shorter one a
    collapsed item names its first and last node by."""
    if not item.collapsed:
        n = item.nodes[0]
        name = labels[n]
        label = n.op + (f"\n{name}" if name != n.op else "")
        tip = f"{n.op} {printable(n.name, 200)}\n" + "\n".join(
            f"-> {printable(o.name, 200)}: {_shape(o)}" for o in n.outputs
        )
        return label, tip
    counts = Counter(n.op for n in item.nodes[: item.period] if item.kind == "repeat")
    if item.kind != "repeat":
        counts = Counter(n.op for n in item.nodes)
    top = ", ".join(f"{op} x{c}" if c > 1 else op for op, c in counts.most_common(5)) + (
        f", +{len(counts) - 5} kinds" if len(counts) > 5 else ""
    )
    first, last = ends[item.nodes[0]], ends[item.nodes[-1]]
    if item.kind == "repeat":
        head = f"{item.repeats} x block of {item.period} nodes"
        body = f"each: {top}"
    elif item.kind == "prefix":
        head = f"{len(item.nodes)} nodes  {printable(item.prefix, 30)}/*"
        body = top
    else:
        head = f"{len(item.nodes)} nodes"
        body = top
    label = f"{head}\n{body}\n{first} .. {last}"
    tip = f"{head}: {len(item.nodes)} nodes in all, {first} .. {last}\n" + ", ".join(
        f"{op} x{c}" for op, c in Counter(n.op for n in item.nodes).most_common()
    )
    return label, tip


def _dominant_family(item: Item) -> str:
    weights: Counter[str] = Counter()
    for n in item.nodes:
        fam = family_of(n.op)
        # Shape ops are views and bookkeeping: let the compute ops colour a block.
        weights[fam] += 1 if fam not in ("shape", "index") else 0
    if not weights or weights.most_common(1)[0][1] == 0:
        return family_of(item.nodes[0].op)
    return weights.most_common(1)[0][0]


def to_dot(
    graph: Graph,
    items: list[Item],
    sbp: Mapping[Value, Any] | None = None,
    collectives: Mapping[tuple[Value, Node | None], list[str]] | None = None,
) -> tuple[str, int, list[str]]:
    """DOT text for ``items``; also the edge count and the families drawn."""
    sbp = sbp or {}
    collectives = collectives or {}
    lines = [
        "digraph G {",
        '  graph [rankdir=TB, nodesep=0.25, ranksep=0.35, fontname="Helvetica", fontsize=10];',
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=9, '
        'margin="0.08,0.03", height=0.3];',
        '  edge [fontname="Helvetica", fontsize=7, color="#555555", arrowsize=0.6];',
    ]
    families: set[str] = set()
    stages = {n.stage for n in graph.nodes if n.stage is not None}
    by_stage: dict[int, list[str]] = {}
    labels = node_labels(graph.nodes, MAX_NAME)
    ends = node_labels(graph.nodes, 30)
    for it in items:
        label, tip = _item_label(it, labels, ends)
        fam = _dominant_family(it)
        families.add(fam)
        attrs = [
            f"label={dot_quote(label)}",
            f"tooltip={dot_quote(tip)}",
            f'fillcolor="{FAMILY_COLORS.get(fam, OTHER_COLOR)}"',
            f'class="flowc-node family-{fam}"',
        ]
        if it.collapsed:
            attrs.append("peripheries=2")
        if fam == "comm":
            attrs += ["shape=octagon", 'color="#67000d"', "penwidth=1.5"]
        lines.append(f"  {it.id} [{', '.join(attrs)}];")
        st = {n.stage for n in it.nodes}
        if len(stages) > 1 and len(st) == 1 and None not in st:
            by_stage.setdefault(next(iter(st)), []).append(it.id)  # type: ignore[arg-type]
    for s in sorted(by_stage):
        lines.append(f"  subgraph cluster_stage{s} {{")
        lines.append(
            f'    label="stage {s}"; style="dashed"; color="{STAGE_COLOR}"; fontcolor="{STAGE_COLOR}";'
        )
        lines.append("    " + " ".join(f"{i};" for i in by_stage[s]))
        lines.append("  }")
    for k, v in enumerate(graph.inputs):
        lines.append(
            f"  i{k} [shape=ellipse, style=filled, fillcolor=white, "
            f"label={dot_quote('input ' + printable(v.name))}, "
            f"tooltip={dot_quote(printable(v.name, 200) + ': ' + _shape(v))}, "
            f'class="flowc-node graph-input"];'
        )
    for k, v in enumerate(graph.outputs):
        lines.append(
            f"  o{k} [shape=ellipse, style=filled, fillcolor=white, "
            f"label={dot_quote('output ' + printable(v.name))}, "
            f"tooltip={dot_quote(printable(v.name, 200) + ': ' + _shape(v))}, "
            f'class="flowc-node graph-output"];'
        )
    source: dict[Value, str] = {v: f"i{k}" for k, v in enumerate(graph.inputs)}
    for it in items:
        for n in it.nodes:
            for o in n.outputs:
                source.setdefault(o, it.id)
    # One edge per (from, to) pair: several values between two collapsed items are one
    # arrow, labelled with the first and how many more.
    edges: dict[tuple[str, str], list[tuple[Value, Node | None]]] = {}
    for it in items:
        for n in it.nodes:
            for x in n.inputs:
                if x is None or x not in source or source[x] == it.id:
                    continue
                pair = (source[x], it.id)
                if all(u is not x for u, _ in edges.get(pair, [])):
                    edges.setdefault(pair, []).append((x, n))
    for k, out in enumerate(graph.outputs):
        if out in source:
            edges.setdefault((source[out], f"o{k}"), []).append((out, None))
    for (a, b), vals in edges.items():
        v, consumer = vals[0]
        text = _shape(v)
        if v in sbp:
            text += f"\n{sbp[v]}"
        colls = [c for u, who in vals for c in collectives.get((u, who), [])]
        if len(vals) > 1:
            text += f"\n+{len(vals) - 1} more"
        attrs = []
        if colls:
            text += "\n" + ", ".join(dict.fromkeys(colls))
            attrs += [
                f'color="{COLLECTIVE_COLOR}"',
                f'fontcolor="{COLLECTIVE_COLOR}"',
                "penwidth=2",
            ]
        src_node = v.producer
        sa = src_node.stage if src_node is not None else None
        sb = consumer.stage if consumer is not None else None
        if sa is not None and sb is not None and sa != sb:
            text += f"\nstage {sa} -> {sb}"
            attrs += ["style=dashed", f'color="{STAGE_COLOR}"', "penwidth=2"]
        tip = "\n".join(f"{printable(u.name, 200)}: {_shape(u)}" for u, _ in vals)
        attrs = [f"label={dot_quote(text)}", f"tooltip={dot_quote(tip)}", *attrs]
        lines.append(f"  {a} -> {b} [{', '.join(attrs)}];")
    lines.append("}")
    return "\n".join(lines) + "\n", len(edges), sorted(families)


def find_dot() -> str:
    path = shutil.which("dot")
    if path is None:
        raise FlowcError(
            "cannot draw the graph for --report: Graphviz's `dot` is not on PATH",
            hint="install Graphviz (Debian/Ubuntu: apt-get install graphviz; macOS: brew "
            "install graphviz), or run `make setup`",
        )
    return path


def run_dot(text: str) -> str:
    """The SVG ``dot`` draws for ``text``, without the XML prolog (it goes inline in HTML)."""
    dot = find_dot()
    try:
        done = subprocess.run(
            [dot, "-Tsvg"],
            input=text.encode("utf-8"),
            capture_output=True,
            timeout=DOT_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise FlowcError(
            f"Graphviz dot took more than {DOT_TIMEOUT_S} s to lay out the graph",
            hint="the report collapses graphs above a few hundred nodes; please report this model",
        ) from None
    if done.returncode != 0:
        raise FlowcError(
            f"Graphviz dot failed (exit {done.returncode}): "
            f"{done.stderr.decode('utf-8', 'replace').strip()[:500]}"
        )
    svg = done.stdout.decode("utf-8", "replace")
    start = svg.find("<svg")
    if start < 0:
        raise FlowcError("Graphviz dot wrote no SVG")
    return svg[start:]


def draw(
    graph: Graph,
    sbp: Mapping[Value, Any] | None = None,
    collectives: Mapping[tuple[Value, Node | None], list[str]] | None = None,
    limit: int = COLLAPSE_ABOVE,
    progress: Callable[[str], None] | None = None,
) -> Drawing:
    import time

    items = collapse(graph, limit)
    text, n_edges, families = to_dot(graph, items, sbp, collectives)
    collapsed_from = len(graph.nodes) if len(items) != len(graph.nodes) else 0
    if progress is not None:
        progress(
            f"laying out {len(items)} nodes, {n_edges} edges with Graphviz dot"
            + (f" (collapsed from {collapsed_from} nodes)" if collapsed_from else "")
        )
    t0 = time.perf_counter()
    svg = run_dot(text)
    return Drawing(items, text, svg, collapsed_from, n_edges, time.perf_counter() - t0, families)
