"""Names a person reads: how the schedule views, the Gantt charts and the report label a
node or an actor.

A label is the model's name for the node (the ONNX node's name, or in a .flow program the
name the value it computes is bound to), shortened so that a view stays readable, and
unique within the view. Three rules decide it (``model_name``):

- A name that holds nothing but an index (``n62``, ``node_12``, ``Conv_3``, the DSL's
  temporaries ``_t5``, or no name at all) gives way to the node's first output when that one
  is a real name (a .flow program names values, not nodes), then to the layer its weights
  name (the ONNX test models call their nodes ``n0``, ``n1``, ... and their values ``r0``,
  ``r1``, ..., but their weights ``conv1/7x7_s2_w_0``: the label is ``conv1/7x7_s2``).
  Failing all, the node's name, its output's, or its op.
- A node flowc inserted has no model name: a boxing step (``box/VALUE/K`` from
  flowc.parallel.lower) is labelled by its op and the value it moves, ``AllGather(VALUE)``.
- A pipeline's unrolled copy keeps its micro-batch suffix (``@mb1``) whatever the above.

Shortening (``short_name``, the one place it is done): one line (control characters shown
as U+FFFD), no leading ``/`` (ONNX exporters root every scope there), and, past the limit,
whole ``/`` components left out, each run of them an ellipsis: the most common in the view
first (``model``, ``self_attn``, ``encoder`` occur in many names and tell them apart least),
never the last (the op, or the innermost module); a name with one long component loses its
middle instead, a third of the room kept for the head. In a view (``unique_labels``), the
scope the path-like names share (``/model/``, ``/m/``) is dropped first, and labels that
still collide get their id appended (``MatMul #4``), so no two bars, rows or boxes of a view
read the same.

Labels are plain text: each view escapes them for what it writes (rich markup, matplotlib
with math text off, HTML, DOT).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flowc.ir.graph import Node

ELLIPSIS = "\u2026"
# Longest label in a printed view (a schedule row stays one line) and in a picture.
TEXT_LIMIT = 56
PICTURE_LIMIT = 40
# What an empty or blank name shows as (a label is never empty).
UNNAMED = "(unnamed)"

# A name that is only an index: n62, r7, node_12, _t5, 17 (an op followed by a number is
# checked against the node's op in is_placeholder).
_INDEX_ONLY = re.compile(r"(?:[a-z]{1,2}|node|_t)?[_.:-]?\d+", re.IGNORECASE)
# A name that says nothing at all: the .flow front end's temporaries (_t5).
_TEMPORARY = re.compile(r"_t\d+")
# A parameter's role at the end of its name (conv1/7x7_s2_w_0, layer1.0.conv1.weight): what
# is left names the layer.
_PARAM_ROLE = re.compile(r"[._/:-](?:weights?|bias|kernel|filter|w|b)(?:[_:]\d+)?$", re.IGNORECASE)
# A boxing step flowc.parallel.lower inserts: box/VALUE/K, with /reshape or /transpose for
# the view around a gather or scatter and /round for the cast after a narrow sum; and the
# ops it is made of ("": a schedule's actor whose op is not known).
_BOXING = re.compile(r"box/(?P<value>.+)/\d+(?:/(?:reshape|transpose|round))?", re.DOTALL)
_BOXING_OPS = frozenset(
    {"AllReduce", "AllGather", "ReduceScatter", "AllToAll", "ShardZero", "ShardSlice"}
    | {"Reshape", "Transpose", "Cast", ""}
)
# The micro-batch copy flowc.schedule.unroll makes: NAME@mbM.
_MICROBATCH = re.compile(r"(?P<base>.*)(?P<mb>@mb\d+)", re.DOTALL)


@dataclass(frozen=True)
class Name:
    """What a label is made of: ``text``, the model's name (shortened, its shared scope
    dropped), between ``before`` and ``after``, which are kept whole (``AllGather(``,
    ``)@mb1``)."""

    text: str
    before: str = ""
    after: str = ""


def one_line(text: str) -> str:
    """``text`` as one line of text: control characters (newlines included) shown as
    U+FFFD, lone surrogates replaced."""
    text = text.encode("utf-8", "replace").decode("utf-8")
    return "".join("\ufffd" if ord(c) < 32 or 0x7F <= ord(c) < 0xA0 else c for c in text)


def is_placeholder(name: str, op: str = "") -> bool:
    """Whether ``name`` tells a reader nothing beyond the node's op and position: blank, the
    op itself, an index (``n62``, ``r7``, ``node_12``, ``_t5``) or the op and an index
    (``Conv_3``)."""
    s = name.strip()
    if not s or s == op or _INDEX_ONLY.fullmatch(s):
        return True
    return bool(op) and re.fullmatch(re.escape(op) + r"[_.:-]?\d+", s, re.IGNORECASE) is not None


def _meaningless(name: str, op: str) -> bool:
    """Blank, the op, or a front end's temporary: not even worth showing as a last resort."""
    s = name.strip()
    return not s or s == op or _TEMPORARY.fullmatch(s) is not None


def _layer_of(param: str) -> str:
    """A parameter's name without its role (``conv1/7x7_s2_w_0`` -> ``conv1/7x7_s2``)."""
    m = _PARAM_ROLE.search(param)
    return param[: m.start()] if m and m.start() > 0 else param


def model_name(
    name: str, outputs: Sequence[str] = (), op: str = "", params: Sequence[str] = ()
) -> Name:
    """The model's name for a node called ``name`` computing ``outputs`` (value names) with
    ``op`` from the weights ``params`` (their names), before shortening: the first of its
    name, its first output's and the layer its weights name that is more than an index;
    failing those its name, its output's (even an index) or its op (the module docstring)."""
    m = _MICROBATCH.fullmatch(name)
    if m and m["base"]:
        suffix = m["mb"]
        base = [o[: -len(suffix)] if o.endswith(suffix) else o for o in outputs]
        inner = model_name(m["base"], base, op, params)
        return Name(inner.text, inner.before, inner.after + suffix)
    box = _BOXING.fullmatch(name) if op in _BOXING_OPS else None
    if box:
        return Name(box["value"], f"{op or 'box'}(", ")")
    first = outputs[0] if outputs else ""
    if not is_placeholder(name, op):
        return Name(name)
    if not is_placeholder(first, op):
        return Name(first)
    for p in params:
        layer = _layer_of(p)
        if not is_placeholder(layer, op):
            return Name(layer)
    for candidate in (name, first):
        if not _meaningless(candidate, op):
            return Name(candidate)
    return Name(op or name)


def node_name(node: Node) -> Name:
    """``model_name`` of an IR node (its constant inputs are its weights)."""
    params = [v.name for v in node.inputs if v is not None and v.const is not None]
    return model_name(node.name, [o.name for o in node.outputs], node.op, params)


def _cut(s: str, n: int, tail: bool) -> str:
    """At most ``n`` characters from the end (``tail``) or the start of ``s``, cut at a
    ``/`` when that keeps at least half of them."""
    if n <= 0:
        return ""
    if len(s) <= n:
        return s
    if tail:
        k = s.find("/", len(s) - n)
        return s[k:] if k >= 0 and len(s) - k >= n / 2 else s[len(s) - n :]
    k = s.rfind("/", 0, n)
    return s[: k + 1] if k >= 0 and k + 1 >= n / 2 else s[:n]


def _drop_components(parts: list[str], limit: int, common: Mapping[str, int]) -> str | None:
    """``parts`` joined by ``/`` with whole components left out (each run of them an
    ellipsis) until it fits ``limit``: the most common first (``common``: in how many names
    of the view a component occurs), the leftmost of equals; never the last. None when even
    the last alone does not fit."""
    kept = [True] * len(parts)

    def text() -> str:
        out: list[str] = []
        for part, keep in zip(parts, kept, strict=True):
            if keep:
                out.append(part)
            elif not out or out[-1] != ELLIPSIS:
                out.append(ELLIPSIS)
        return "/".join(out)

    s = text()
    while len(s) > limit:
        left = [i for i in range(len(parts) - 1) if kept[i]]
        if not left:
            return None
        kept[max(left, key=lambda i: (common.get(parts[i], 0), -i))] = False
        s = text()
    return s


def short_name(text: str, limit: int = TEXT_LIMIT, common: Mapping[str, int] | None = None) -> str:
    """``text`` (a model name) as a label of at most ``limit`` characters: one line, without
    the leading ``/`` of an exporter's scope. Longer than ``limit``, a path-like name loses
    whole components, each run of them shown as an ellipsis: the most common first
    (``common``: how many names of the view hold each component, so ``layers.3`` and
    ``q_proj`` outlast ``model`` and ``self_attn``), the leftmost of equals, never the last
    (the op, or the innermost module). A name that still does not fit keeps its head (a third
    of the room) and its tail and loses its middle. Never empty."""
    s = one_line(text).strip()
    s = s.lstrip("/") or s
    if not s:
        return UNNAMED if limit >= len(UNNAMED) else "?"
    limit = max(limit, 2)
    if len(s) <= limit:
        return s
    parts = s.split("/")
    if len(parts) > 1:
        dropped = _drop_components(parts, limit, common or {})
        if dropped is not None:
            return dropped
    room = limit - 1
    # Below 16 characters a head is too short to tell anything: all of it for the tail.
    tail = _cut(s, room - (room // 3 if limit >= 16 else 0), tail=True)
    head = _cut(s, room - len(tail), tail=False)
    return head + ELLIPSIS + tail


def _scope(texts: Sequence[str]) -> str:
    """The leading ``/``-separated components every path-like text shares (``m/`` of
    ``/m/encoder/...`` and ``/m/pooler/...``), leaving each at least one component; "" unless
    at least two texts, and half of all, are path-like (two scoped names among many plain
    ones share a layer, not the model's root)."""
    paths = [t.lstrip("/").split("/") for t in texts if "/" in t.strip("/")]
    if len(paths) < 2 or 2 * len(paths) < len(texts):
        return ""
    common: list[str] = []
    for parts in zip(*[p[:-1] for p in paths], strict=False):
        if any(x != parts[0] for x in parts) or not parts[0]:
            break
        common.append(parts[0])
    # zip stops at the shortest path (less its last component): each keeps one at least.
    return "/".join(common) + "/" if common else ""


def _in_scope(text: str, scope: str) -> str:
    """``text`` without the view's shared ``scope``."""
    inner = text.lstrip("/")
    return inner[len(scope) :] if scope and inner.startswith(scope) else text


def _render(name: Name, scope: str, limit: int, common: Mapping[str, int]) -> str:
    room = limit - len(name.before) - len(name.after)
    return name.before + short_name(_in_scope(name.text, scope), max(room, 8), common) + name.after


def unique_labels(names: Mapping[int, Name | str], limit: int = TEXT_LIMIT) -> dict[int, str]:
    """A label per id for one view: each name shortened to ``limit`` (``short_name``) after
    the scope all path-like names share is dropped; labels that collide get `` #id``
    appended, so every label in the view is distinct and none is empty."""
    parts = {k: v if isinstance(v, Name) else Name(v) for k, v in names.items()}
    scope = _scope([p.text for p in parts.values()])
    common: Counter[str] = Counter()
    for p in parts.values():
        common.update(set(_in_scope(p.text, scope).strip("/").split("/")))
    labels = {k: _render(p, scope, limit, common) for k, p in parts.items()}
    for _ in range(len(labels) + 1):
        counts = Counter(labels.values())
        clashing = [k for k, text in labels.items() if counts[text] > 1]
        if not clashing:
            break
        for k in clashing:
            suffix = f" #{k}"
            text = labels[k]
            # First round: make room for the id within the limit; after that (a name that
            # itself ends in " #N") just append.
            if not text.endswith(suffix):
                text = _render(parts[k], scope, limit - len(suffix), common)
            labels[k] = text + suffix
    return labels


def node_labels(nodes: Sequence[Node], limit: int = TEXT_LIMIT) -> dict[Node, str]:
    """``unique_labels`` of ``nodes`` (a graph's, a schedule's actors' in id order), the id
    of each its index in ``nodes``."""
    labels = unique_labels({k: node_name(n) for k, n in enumerate(nodes)}, limit)
    return {n: labels[k] for k, n in enumerate(nodes)}
