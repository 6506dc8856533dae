"""Pipeline parallelism: a graph cut into stages on disjoint groups of devices, with the
batch streamed through them in micro-batches.

The devices: mesh axis 0 is the pipeline axis (its size is the number of stages P); stage s
is the sub-mesh of the remaining axes, world ranks [s*k, (s+1)*k). The compile driver builds
the program in four steps, each a function here or one it calls:

1. ``microbatch_graph``: the graph for one micro-batch. It is the data-parallel lowering of
   the graph over M "devices" that are really the M micro-batches (inputs and outputs
   S(0), parameters whole), with each rank's inputs and outputs its own part: the same
   shard/localize machinery as S(0) rewrites the shape constants of Reshape and friends.
   An op that is not separable along the batch would need a collective there: refused.
2. The partition into stages (``flowc.schedule.partition``), on the micro-batch graph. With
   K > 1 devices per stage its node times and value bytes are per device, under one
   placement of the whole graph on the stage mesh (``stage_node_costs``).
3. With K > 1, each stage's own plan (``plan_stages``): the stage's nodes as a graph of
   their own (inputs: the model's inputs and the values received over the cut before it),
   placed on the stage mesh by the search, stage by stage left to right. The layouts of a
   stage's received values are chosen together with the sender's: the search with them
   pinned to the layouts the sender produced (a 1:1 transfer) against freer layouts (the
   search's own pick, then value by value each other layout, within ``SEARCH_BUDGET``
   searches), each priced as the plan's modeled time plus the cut's modeled transfer time
   (``transfer_time``: per rank, the pipeline link's alpha per piece plus bytes over its
   bandwidth); the cheapest wins, ties keeping 1:1. A value made as a partial sum is
   reduced before it crosses (``unpartial``). When the two sides' layouts differ the cut
   reshards N:M (``reshard_pieces``, ``plan_reshard``): each receiving rank gets from the
   sending ranks exactly the pieces its shard needs (the intersections of the boxes; a
   replicated box from one holder, spread over them), after a sender holding a value whole
   on a mesh axis the receiver splits has kept only the receiver's part (``presliced``).
   Every rank of a stage runs one program, so a reshard is used only when the pieces' local
   boxes are the same on every rank: always on a 1-D stage mesh, for every S/B pair; on a
   mesh of several axes all but a few pairs, the exceptions being a tensor axis split over
   one mesh axis but not divisible over all (a piece would then sit at a rank-dependent
   offset). The partners may differ, from a per-rank table (``peers`` on Send/Recv). A value
   whose reshard has no such form keeps the sender's layout (1:1). With one device per
   stage there is no placement.
4. The stage graphs: ``build_stages`` (one device per stage) or ``build_placed_stages``
   (each stage lowered by its own plan, its constants sharded by it: ``Stage.physical``).
   Every value crossing a cut -- skip connections included, relayed through the stages
   between -- travels in one Send on the earlier side and one Recv on the later side, in
   the same order (a resharded value as its pieces: Slice nodes before the Send, Concat
   nodes assembling the shard after the Recv); graph outputs made early are relayed to the
   last stage, whose rank 0 writes them.

One idea: pipeline stages from one graph; kept whole because micro-batching, stage cuts
and the reshards between stages are steps of one driver sharing the Stage records.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from flowc.errors import InputError
from flowc.ir.graph import Attrs, Graph, Node, Value, is_splat, make_splat
from flowc.ir.layout import (
    Coords,
    all_coords,
    broadcast,
    chunk_index,
    fits,
    local_shape,
    local_type,
    nd_sbps,
    shard,
)
from flowc.ir.types import MAX_MICROBATCHES, Mesh, NdSbp, Sbp, TensorType
from flowc.ir.verify import verify_graph
from flowc.parallel.boxing import LOCAL_SLICE
from flowc.parallel.cost import Link, Profile, boxing_time, evaluate_plan
from flowc.parallel.lower import Physical, lower
from flowc.parallel.plan import Plan

if TYPE_CHECKING:
    from flowc.parallel import ParallelOptions

# Ops a micro-batch graph may not contain: they would mean micro-batches talk to each other.
_COMM_OPS = frozenset(
    {"AllReduce", "AllGather", "ReduceScatter", "AllToAll", "ShardSlice", "ShardZero"}
)
_MESH_OPS = _COMM_OPS


@dataclass
class Microbatched:
    graph: Graph  # one micro-batch's graph
    input_strides: list[int]  # bytes between consecutive micro-batches of each input (0: whole)
    output_strides: list[int]


def microbatch_graph(graph: Graph, microbatches: int, profile: Profile) -> Microbatched:
    if not 1 <= microbatches <= MAX_MICROBATCHES:
        raise InputError(
            f"--microbatches {microbatches}: expected a count from 1 to {MAX_MICROBATCHES}"
        )
    if microbatches == 1:
        return Microbatched(
            graph, [v.type.nbytes for v in graph.inputs], [v.type.nbytes for v in graph.outputs]
        )
    from flowc.parallel.search import search

    mesh = Mesh("microbatch", (microbatches,))
    split = NdSbp((Sbp("S", 0),))
    whole = NdSbp((Sbp("B"),))
    # Every micro-batch runs the same code on the same weights: constants whole, outputs
    # split on the batch; an input may be whole (each micro-batch reads all of it, as a mask
    # expanded by a cross-sample gather must be). Micro-batches cannot talk to each other:
    # priced out of reach, a collective in the plan means there is no separable one.
    fixed: dict[Value, NdSbp] = {c: whole for c in graph.constants}
    for o in graph.outputs:
        if o.producer is None:
            continue
        if o.type.rank == 0 or o.type.shape[0] % microbatches:
            raise InputError(
                f"--microbatches {microbatches}: output {o.name!r} ({o.type}) does not split "
                f"into {microbatches} micro-batches along axis 0",
                hint="use a micro-batch count that divides the batch (set it with --dim or "
                "--shape)",
            )
        fixed[o] = split
    isolated = dataclasses.replace(profile, link=Link(1e6, 1.0), mesh_axis={})
    # Inputs split first: for a small model the cost model may prefer recomputing the whole
    # batch in every micro-batch (launches dominate), which would defeat micro-batching.
    inputs_split = {
        v: split for v in graph.inputs if v.type.rank and v.type.shape[0] % microbatches == 0
    }
    phys = None
    for attempt in (inputs_split, {}):
        try:
            plan = search(graph, mesh, isolated, fixed={**fixed, **attempt}, baselines=False)
        except InputError as e:
            if attempt:
                continue
            raise InputError(
                f"--microbatches {microbatches}: the graph does not split into micro-batches "
                f"({e.message})",
                hint="use --microbatches 1",
            ) from None
        phys = lower(graph, plan, profile, local_io=True)
        if all(step.collective == LOCAL_SLICE for _, _, step in phys.boxing):
            break
    assert phys is not None
    for logical, consumer, step in phys.boxing:
        if step.collective == LOCAL_SLICE:
            continue  # a whole-batch value's micro-batch part: a slice at the micro-batch
        who = f"{consumer.op} node {consumer.name!r}" if consumer is not None else "graph output"
        raise InputError(
            f"--microbatches {microbatches}: {who} needs {logical.name!r} across the whole batch "
            "(its micro-batches would have to exchange data), so the graph is not separable "
            "along the batch",
            hint="use --microbatches 1 (the pipeline still runs, one batch at a time)",
        )
    for node in phys.graph.nodes:
        if node.op in ("ShardSlice", "GatherShard"):
            # Split over the micro-batches being run, not over devices.
            node.attrs = Attrs({**dict(node.attrs.items()), "microbatch": 1})
        elif node.op in _COMM_OPS:
            raise InputError(
                f"--microbatches {microbatches}: node {node.name!r} ({node.op}) would combine "
                "micro-batches, so the graph is not separable along the batch",
                hint="use --microbatches 1",
            )

    def stride(v: Value, local: Value) -> int:
        return local.type.nbytes if plan.value_sbp[v] == split else 0

    for o in graph.outputs:
        if plan.value_sbp[o] not in (split, NdSbp((Sbp("B"),))):
            raise InputError(
                f"--microbatches {microbatches}: output {o.name!r} would be a partial sum over "
                "micro-batches",
                hint="use --microbatches 1",
            )
    return Microbatched(
        phys.graph,
        [stride(v, x) for v, x in zip(graph.inputs, phys.graph.inputs, strict=True)],
        [stride(v, x) for v, x in zip(graph.outputs, phys.graph.outputs, strict=True)],
    )


@dataclass
class Stage:
    index: int
    graph: Graph
    # The stage's constant -> the rank graph's, whose data (or shards) it holds.
    origin: dict[Value, Value] = field(default_factory=dict)
    recv: list[str] = field(default_factory=list)  # values received, in transfer order
    send: list[str] = field(default_factory=list)  # values sent, in transfer order
    # The stage's own rank program under its own plan (None: the pipeline's shared one).
    physical: Physical | None = None


@dataclass
class Pipelined:
    logical: Graph  # the model's whole-batch inputs and outputs
    stages: list[Stage]
    microbatches: int
    mesh: Mesh  # (P, *stage mesh)
    ranks_per_stage: int
    input_strides: list[int]
    output_strides: list[int]
    physical: Physical | None  # one rank program shared by every stage (None: per stage)
    # With K > 1 devices per stage: each stage's plan, and per cut each value's transfer.
    placements: list[StagePlacement] = field(default_factory=list)
    cuts: list[list[Reshard]] = field(default_factory=list)
    # The graph of one micro-batch, each node marked with its stage (Node.stage): what the
    # report draws.
    microbatch_graph: Graph | None = None

    def placement_summary(self, limit: int = 8) -> str:
        """Each stage's plan (its modeled time, the layouts of its parameters and of the values
        it sends) and, per cut, whether the transfer is 1:1 or an N:M reshard, with the bytes
        it moves per micro-batch (all ranks together). Empty with one device per stage."""
        if not self.placements:
            return ""
        k = self.ranks_per_stage
        lines = [f"stage plans ({k} devices per stage, each stage placed on its own):"]

        def listing(items: list[str]) -> str:
            more = len(items) - limit
            return ", ".join(items[:limit]) + (f", +{more} more" if more > 0 else "")

        for s, pl in enumerate(self.placements):
            plan = pl.plan
            params = [
                f"{v.name} {plan.value_sbp[v]}"
                for v in plan.value_sbp
                if v.is_const and v.type.rank > 0 and v.type.numel > 1 and v.type.dtype.is_float
            ]
            lines.append(
                f"  stage {s}: modeled {pl.modeled_s * 1e6:.2f} us per micro-batch; parameters: "
                + (listing(params) or "none")
            )
            if s > 0:
                free = (
                    "no other candidate" if math.isnan(pl.free_s) else f"{pl.free_s * 1e6:.2f} us"
                )
                lines.append(
                    f"    receives {pl.choice} (candidates: pinned to the sender's layouts "
                    f"{pl.pinned_s * 1e6:.2f} us, best reshard {free}; plan + transfer)"
                )
        for c, cut in enumerate(self.cuts):
            total = sum(r.nbytes for r in cut)
            mode = "1:1" if all(r.one_to_one for r in cut) else "N:M reshard"
            items = [
                f"{r.value} {r.src} -> {r.dst}"
                + ("" if r.one_to_one else f" ({len(r.pieces)} pieces)")
                for r in cut
            ]
            lines.append(f"  cut {c} -> {c + 1}: {mode}, {total} B moved: " + listing(items))
        return "\n".join(lines)

    def constant_data(self, stage: Stage, coords: tuple[int, ...]) -> Callable[[Value], np.ndarray]:
        """Rank ``coords``' (whole-mesh coordinates) data for ``stage``'s constants: its shard
        under the plan of the stage's own program (``stage.physical``, else the shared one).
        Constants the stage graph made itself (a reshard's slice bounds) are the same on
        every rank."""
        phys = stage.physical or self.physical

        def data(v: Value) -> np.ndarray:
            src = stage.origin.get(v)
            if src is None:
                assert v.const is not None
                return v.const
            if phys is None:
                assert src.const is not None
                return src.const
            return phys.constant_for(src, coords[1:])

        return data


def _stage_values(g: Graph, stage: Stage, vmap: dict[Value, Value]) -> Callable[[Value], Value]:
    """Stage graph ``g``'s value for a rank-graph value: mapped already, or a constant the
    stage takes its own copy of (remembering where its data comes from)."""

    def get(v: Value) -> Value:
        if v not in vmap:
            assert v.const is not None, f"value {v.name!r} is not available in its stage"
            c = g.add_constant(v.name, v.const)
            c.type = v.type  # (a constant of symbolic dims keeps them: a prefix of the data)
            stage.origin[c] = v
            vmap[v] = c
        return vmap[v]

    return get


def _copy_to_stage(
    g: Graph,
    node: Node,
    stage: int,
    get: Callable[[Value], Value],
    vmap: dict[Value, Value],
    mesh: Mesh | None,
) -> None:
    """``node`` copied into stage graph ``g`` (its inputs through ``get``, its outputs
    recorded in ``vmap``). With the whole ``mesh`` given, a collective acts along the whole
    mesh's axis after the pipeline axis (a micro-batch slice stays what it is)."""
    attrs = dict(node.attrs.items())
    if mesh is not None and node.op in _MESH_OPS and not attrs.get("microbatch"):
        attrs["mesh"] = list(mesh.shape)
        attrs["mesh_axis"] = int(attrs["mesh_axis"]) + 1
    copy = g.add_node(
        node.op,
        [get(i) if i is not None else None for i in node.inputs],
        [o.type for o in node.outputs],
        attrs,
        name=node.name,
        output_names=[o.name for o in node.outputs],
    )
    copy.stage = stage
    copy.sym_attrs = dict(node.sym_attrs)
    for o, c in zip(node.outputs, copy.outputs, strict=True):
        vmap[o] = c


def build_stages(
    rank_graph: Graph, node_stage: list[int], stages: int, ranks_per_stage: int, mesh: Mesh
) -> list[Stage]:
    """Each stage's graph from the rank graph and each node's stage (see the module
    docstring). Collectives of a stage act on the whole-mesh axis after the pipeline axis."""
    # Values over cut c (between stages c and c+1), in production order.
    crossing = crossing_values(rank_graph, node_stage, stages)
    result = []
    for s in range(stages):
        g = Graph(f"{rank_graph.name}_stage{s}")
        g.meta = dict(rank_graph.meta)
        stage = Stage(s, g)
        vmap: dict[Value, Value] = {}
        for v in rank_graph.inputs:
            vmap[v] = g.add_input(v.name, v.type)

        get = _stage_values(g, stage, vmap)

        if s > 0 and crossing[s - 1]:
            vals = crossing[s - 1]
            recv = g.add_node(
                "Recv",
                [],
                [v.type for v in vals],
                {
                    "peer": -ranks_per_stage,
                    "shapes": [list(v.type.shape) for v in vals],
                    "dtypes": [v.type.dtype.onnx for v in vals],
                },
                name=f"recv_from_stage{s - 1}",
                output_names=[v.name for v in vals],
            )
            for v, r in zip(vals, recv.outputs, strict=True):
                vmap[v] = r
            stage.recv = [v.name for v in vals]
        for node, ns in zip(rank_graph.nodes, node_stage, strict=True):
            if ns == s:
                _copy_to_stage(g, node, s, get, vmap, mesh if ranks_per_stage > 1 else None)
        if s < stages - 1 and crossing[s]:
            vals = crossing[s]
            g.add_node(
                "Send",
                [vmap[v] for v in vals],
                [],
                {"peer": ranks_per_stage},
                name=f"send_to_stage{s + 1}",
            )
            stage.send = [v.name for v in vals]
        if s == stages - 1:
            g.outputs = [get(o) for o in rank_graph.outputs]
        verify_graph(g)
        result.append(stage)
    return result


# -- per-stage placement plans and the N:M reshard at a cut -----------------------------------

Box = tuple[tuple[int, int], ...]  # [start, stop) per tensor axis of a logical tensor


def layout_box(shape: tuple[int, ...], sbp: NdSbp, mesh: Mesh, coords: Coords) -> Box:
    """The region of a logical tensor of ``shape`` that the device at ``coords`` holds under
    ``sbp`` (no P): what ``shard`` cuts."""
    local = local_shape(shape, sbp, mesh)
    return tuple(
        (chunk_index(sbp, mesh, coords, d) * n, (chunk_index(sbp, mesh, coords, d) + 1) * n)
        for d, n in enumerate(local)
    )


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def _shift(box: Box, origin: Box) -> Box:
    return tuple((lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin, strict=True))


def _box_elems(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


@dataclass(frozen=True)
class Piece:
    """One transfer of a reshard: the logical ``box`` from rank ``src`` of the sending stage
    to rank ``dst`` of the receiving one (ranks numbered row-major within their stage)."""

    src: int
    dst: int
    box: Box


# How a receiver picks among the senders holding a replicated box (see reshard_pieces).
RULES = ("nearest", "balanced")


def reshard_pieces(
    shape: tuple[int, ...], src: NdSbp, dst: NdSbp, mesh: Mesh, rule: str = "nearest"
) -> list[Piece]:
    """What each receiving rank (layout ``dst``) needs from the sending ranks (layout ``src``),
    both stages shaped ``mesh``, neither layout partial: the intersections of its box with
    the senders' boxes. A box that several senders hold (replicated) comes from one of them,
    the receiver's own index when that one holds it (so equal layouts are 1:1); else, by
    ``rule``: "nearest", the holder whose mesh coordinates agree with the receiver's on the
    most axes (across a replicated axis a row serves its own row), ties taken in turn by the
    receiver's index; "balanced", receiver by receiver the holder with the fewest pieces to
    send so far, ties to the nearest, then the lowest index. Either spreads the load over
    the holders. Sorted by (dst, src, box)."""
    coords = all_coords(mesh)
    holders: dict[Box, list[int]] = {}
    for i, c in enumerate(coords):
        holders.setdefault(layout_box(shape, src, mesh, c), []).append(i)
    needs: list[tuple[int, Box, list[int]]] = []
    for r, rc in enumerate(coords):
        want = layout_box(shape, dst, mesh, rc)
        for box, who in holders.items():
            inter = _intersect(want, box)
            if inter is not None:
                needs.append((r, inter, who))
    load = [0] * len(coords)
    pieces = [Piece(r, r, inter) for r, inter, who in needs if r in who]
    for p in pieces:
        load[p.src] += 1
    for r, inter, who in needs:
        if r in who:
            continue
        agree = {h: sum(a == b for a, b in zip(coords[h], coords[r], strict=True)) for h in who}
        if rule == "nearest":
            near = [h for h in who if agree[h] == max(agree.values())]
            h = near[r % len(near)]
        else:
            h = min(who, key=lambda h: (load[h], -agree[h], h))
        pieces.append(Piece(h, r, inter))
        load[h] += 1
    return sorted(pieces, key=lambda p: (p.dst, p.src, p.box))


@dataclass(frozen=True)
class Slot:
    """One transfer as all ranks of a stage issue it: the same box of the local shard on every
    rank (one SPMD program), with each rank's partner (its index in the other stage)."""

    box: Box  # local coordinates of this side's shard
    peers: tuple[int, ...]  # per rank of this stage


def _slots(pieces: list[Piece], boxes: list[Box], side: str) -> list[Slot] | None:
    """The transfers of each rank of one side (``side``: "src" or "dst"; ``boxes``: each rank's
    shard), in the order both sides agree on: by partner, then by logical box. None when the
    ranks' lists differ in length or boxes: then one program cannot issue them on all."""
    other = "dst" if side == "src" else "src"
    per_rank: list[list[tuple[Box, int]]] = []
    for k, origin in enumerate(boxes):
        own = sorted((getattr(p, other), p.box) for p in pieces if getattr(p, side) == k)
        per_rank.append([(_shift(b, origin), partner) for partner, b in own])
    first = [b for b, _ in per_rank[0]]
    if any([b for b, _ in r] != first for r in per_rank):
        return None
    return [Slot(box, tuple(r[j][1] for r in per_rank)) for j, box in enumerate(first)]


@dataclass(frozen=True)
class Reshard:
    """How one value crosses a cut: sent in layout ``src``, received in ``dst``, as ``pieces``;
    ``send_slots`` / ``recv_slots`` are the transfers each side's ranks issue, in order."""

    value: str
    shape: tuple[int, ...]
    itemsize: int
    src: NdSbp
    dst: NdSbp
    pieces: tuple[Piece, ...]
    send_slots: tuple[Slot, ...]
    recv_slots: tuple[Slot, ...]

    @property
    def one_to_one(self) -> bool:
        return self.src == self.dst

    @property
    def nbytes(self) -> int:
        """Bytes over the cut per micro-batch, all ranks together."""
        return sum(_box_elems(p.box) for p in self.pieces) * self.itemsize


def plan_reshard(v: Value, src: NdSbp, dst: NdSbp, mesh: Mesh) -> Reshard | None:
    """The transfer of logical value ``v`` from layout ``src`` to ``dst`` between two stages
    shaped ``mesh``, or None when the pieces' boxes differ from rank to rank (a case this
    SPMD form does not cover; the caller keeps the layouts equal instead)."""
    shape = v.type.shape
    coords = all_coords(mesh)
    for rule in RULES:  # the first whose transfers are the same on every rank
        pieces = reshard_pieces(shape, src, dst, mesh, rule)
        send = _slots(pieces, [layout_box(shape, src, mesh, c) for c in coords], "src")
        recv = _slots(pieces, [layout_box(shape, dst, mesh, c) for c in coords], "dst")
        if send is not None and recv is not None:
            return Reshard(
                v.name,
                shape,
                v.type.dtype.itemsize,
                src,
                dst,
                tuple(pieces),
                tuple(send),
                tuple(recv),
            )
    return None


def transfer_time(reshards: Sequence[Reshard], link: Link, ranks: int) -> float:
    """Modeled seconds of a cut: every rank's sends and receives run at once; a rank pays the
    link's alpha per piece and its bytes over the bandwidth; the slowest rank decides."""
    sent = [0.0] * ranks
    got = [0.0] * ranks
    for r in reshards:
        for p in r.pieces:
            t = link.alpha + _box_elems(p.box) * r.itemsize / link.bandwidth
            sent[p.src] += t
            got[p.dst] += t
    return max([*sent, *got], default=0.0)


def unpartial(t: TensorType, sbp: NdSbp, mesh: Mesh, profile: Profile) -> NdSbp:
    """The layout a value crosses a cut in when it is made as ``sbp``: a partial sum is reduced
    first (each P axis to B or to S(d), the cheapest boxing), anything else as it is."""
    if all(p.kind != "P" for p in sbp.parts):
        return sbp
    options = [
        [Sbp("B"), *(Sbp("S", d) for d in range(t.rank))] if p.kind == "P" else [p]
        for p in sbp.parts
    ]
    best: tuple[float, int, NdSbp] | None = None
    for k, parts in enumerate(itertools.product(*options)):
        cand = NdSbp(tuple(parts))
        if not fits(t.shape, cand, mesh):
            continue
        cost = boxing_time(t, mesh, sbp, cand, profile)
        if best is None or (cost, k) < best[:2]:
            best = (cost, k, cand)
    assert best is not None  # all-B always fits
    return best[2]


def presliced(t: TensorType, have: NdSbp, want: NdSbp, mesh: Mesh) -> NdSbp:
    """The layout the sender puts a value in before sending it to a receiver wanting ``want``:
    where the sender holds it whole (B) on a mesh axis that the receiver splits, it keeps only
    the receiver's part locally (a free slice), so nobody sends what the receiver drops."""
    parts = list(have.parts)
    for a, (h, w) in enumerate(zip(have.parts, want.parts, strict=True)):
        if h.kind == "B" and w.kind == "S":
            trial = NdSbp((*parts[:a], w, *parts[a + 1 :]))
            if fits(t.shape, trial, mesh):
                parts[a] = w
    return NdSbp(tuple(parts))


@dataclass
class StagePlacement:
    """A stage's own plan on its sub-mesh and how it was chosen."""

    plan: Plan
    modeled_s: float  # the plan's modeled time (compute + boxing) on one micro-batch
    # For a stage after the first: "1:1" (its inputs pinned to the sender's layouts) or
    # "N:M" (chosen freely, the reshard's time included), with both candidates' times.
    choice: str = ""
    pinned_s: float = math.nan  # the pinned candidate: plan + 1:1 transfer
    free_s: float = math.nan  # the free one: plan + reshard transfer


def crossing_values(graph: Graph, node_stage: Sequence[int], stages: int) -> list[list[Value]]:
    """Per cut c (stages c -> c+1): the values that cross it, in production order. A value
    read several stages later, or a graph output made before the last stage, crosses every
    cut in between (relayed)."""
    stage_of: dict[Value, int] = {}
    order: dict[Value, int] = {}
    for k, (node, s) in enumerate(zip(graph.nodes, node_stage, strict=True)):
        for j, o in enumerate(node.outputs):
            stage_of[o] = s
            order[o] = k * 1024 + j
    last: dict[Value, int] = {}
    for node, s in zip(graph.nodes, node_stage, strict=True):
        for i in node.inputs:
            if i is not None and i in stage_of:
                last[i] = max(last.get(i, -1), s)
    for o in graph.outputs:
        if o in stage_of:
            last[o] = stages - 1
    return [
        sorted((v for v, s in stage_of.items() if s <= c < last.get(v, -1)), key=lambda v: order[v])
        for c in range(stages - 1)
    ]


def _stage_logical(
    graph: Graph, node_stage: Sequence[int], s: int, received: list[Value], last: bool
) -> tuple[Graph, dict[Value, Value]]:
    """Stage ``s``'s part of the (micro-batch) graph as a graph of its own: the model's inputs,
    then the values received over the cut before it as inputs; its nodes; the model's
    outputs if it is the last stage. The values it sends stay unread node outputs (the
    placement search then charges nothing for them; the reshard is priced separately)."""
    g = Graph(f"{graph.name}_stage{s}")
    g.meta = dict(graph.meta)
    vmap: dict[Value, Value] = {}
    for v in graph.inputs:
        vmap[v] = g.add_input(v.name, v.type)
    for v in received:
        vmap[v] = g.add_input(v.name, v.type)

    def get(v: Value) -> Value:
        if v not in vmap:
            assert v.const is not None, f"value {v.name!r} is not available in stage {s}"
            vmap[v] = g.add_constant(v.name, v.const)
        return vmap[v]

    for node, ns in zip(graph.nodes, node_stage, strict=True):
        if ns != s:
            continue
        copy = g.add_node(
            node.op,
            [get(i) if i is not None else None for i in node.inputs],
            [o.type for o in node.outputs],
            dict(node.attrs.items()),
            name=node.name,
            output_names=[o.name for o in node.outputs],
        )
        copy.stage = node.stage
        for o, c in zip(node.outputs, copy.outputs, strict=True):
            vmap[o] = c
    if last:
        g.outputs = [get(o) for o in graph.outputs]
    return g, vmap


def _stage_plan(
    g: Graph, opts: ParallelOptions, profile: Profile, pins: dict[str, NdSbp]
) -> tuple[Plan, float]:
    from flowc.parallel import make_plan
    from flowc.parallel.search import broadcast_plan

    if opts.method == "none":
        plan = broadcast_plan(g, opts.mesh)
    else:
        names = {v.name for v in g.values()}
        sbp = {n: x for n, x in opts.sbp.items() if n in names}
        local = dataclasses.replace(opts, sbp={**sbp, **pins})
        plan = make_plan(g, local, profile, opts.method, opts.mem_limit)
    return plan, evaluate_plan(g, plan, profile).total_s


# How many extra searches a stage may spend trying other layouts for its received values.
SEARCH_BUDGET = 16


def _choose_received(
    g: Graph,
    vmap: dict[Value, Value],
    received: list[Value],
    base: dict[Value, NdSbp],
    opts: ParallelOptions,
    profile: Profile,
    link: Link,
) -> tuple[StagePlacement, list[Reshard]]:
    """The plan of a stage that receives ``received`` (sent in layouts ``base``) and how each
    arrives. Candidates, each priced as the plan's modeled time plus the cut's transfer time:
    (a) every received value pinned to its sender's layout (1:1 transfers); (b) the layouts
    the search picks when they are free (it takes an input's layout as free, so its pick is
    priced again with the reshard); then, value by value, each other layout it could take,
    the rest kept, while the budget of searches lasts (coordinate descent: a better one is
    kept). The cheapest wins; ties keep the earlier candidate (1:1 first)."""
    mesh = opts.mesh
    k = mesh.size

    def reshards(layouts: dict[Value, NdSbp]) -> list[Reshard] | None:
        out = []
        for v in received:
            want = layouts[v]
            r = plan_reshard(v, presliced(v.type, base[v], want, mesh), want, mesh)
            if r is None:
                return None
            out.append(r)
        return out

    def price(layouts: dict[Value, NdSbp]) -> tuple[float, Plan, float, list[Reshard]] | None:
        rs = reshards(layouts)
        if rs is None:
            return None
        plan, t = _stage_plan(g, opts, profile, {v.name: layouts[v] for v in received})
        return t + transfer_time(rs, link, k), plan, t, rs

    first = price(base)
    assert first is not None  # equal layouts: every rank to its peer, always one program
    best, best_layouts = first, dict(base)
    pinned_s, free_s = first[0], math.nan
    if opts.method != "none":
        tried: list[dict[Value, NdSbp]] = [dict(base)]
        free_plan, _ = _stage_plan(g, opts, profile, {})
        trials = [{v: free_plan.value_sbp[vmap[v]] for v in received}]
        for v in received:
            for cand in nd_sbps(v.type.rank, mesh, partial=False):
                if fits(v.type.shape, cand, mesh):
                    trials.append({v: cand})  # merged into the best so far when tried
        budget = SEARCH_BUDGET
        for trial in trials:
            layouts = {**best_layouts, **trial}
            if layouts in tried or budget == 0:
                continue
            tried.append(layouts)
            got = price(layouts)
            if got is None:
                continue
            budget -= 1
            if not all(r.one_to_one for r in got[3]):
                free_s = got[0] if math.isnan(free_s) else min(free_s, got[0])
            if got[0] < best[0] * (1 - 1e-9):
                best, best_layouts = got, layouts
    _, plan, t, chosen = best
    choice = "1:1" if all(r.one_to_one for r in chosen) else "N:M"
    return StagePlacement(plan, t, choice, pinned_s, free_s), chosen


def plan_stages(
    graph: Graph,
    node_stage: Sequence[int],
    stages: int,
    opts: ParallelOptions,
    profile: Profile,
) -> tuple[list[StagePlacement], list[list[Reshard]], list[tuple[Graph, dict[Value, Value]]]]:
    """Each stage's plan on its sub-mesh, left to right, and the reshard of every value over
    every cut (the module docstring says how the two candidates are compared)."""
    mesh = opts.mesh
    link = profile.axis_link(0)
    profile = stage_profile(profile)
    crossing = crossing_values(graph, node_stage, stages)
    placements: list[StagePlacement] = []
    cuts: list[list[Reshard]] = []
    logicals = []
    sent_as: dict[Value, NdSbp] = {}  # crossing value -> its layout on the sending side
    for s in range(stages):
        received = crossing[s - 1] if s > 0 else []
        g, vmap = _stage_logical(graph, node_stage, s, received, s == stages - 1)
        logicals.append((g, vmap))
        if not received:
            plan, t = _stage_plan(g, opts, profile, {})
            placements.append(StagePlacement(plan, t))
        else:
            base = {v: sent_as[v] for v in received}
            placement, chosen = _choose_received(g, vmap, received, base, opts, profile, link)
            plan = placement.plan
            placements.append(placement)
            cuts.append(chosen)
        if s < stages - 1:
            for v in crossing[s]:
                made = plan.value_sbp[vmap[v]]
                sent_as[v] = unpartial(v.type, made, mesh, profile)
    return placements, cuts, logicals


def _lower_stage(
    g: Graph,
    plan: Plan,
    profile: Profile,
    received: dict[Value, NdSbp],
    send: list[tuple[Value, NdSbp]],
) -> tuple[Physical, list[Value], list[Value]]:
    """Stage graph ``g`` lowered to one rank's program under ``plan``: the model's inputs whole
    (each rank keeps its part), the ``received`` values as inputs holding the local shard of
    their layout, and the values to ``send`` boxed into their transfer layouts. Returns the
    program, its received inputs and the values to send, in order."""
    from flowc.parallel.lower import _Lowerer

    low = _Lowerer(g, plan, profile)
    mesh = plan.mesh
    whole = broadcast(mesh)
    recv_vals = []
    for v in g.inputs:
        layout = plan.value_sbp[v]
        if v in received:
            x = low.g.add_input(v.name, local_type(v.type, layout, mesh))
            low.held[(v, layout)] = x
            recv_vals.append(x)
            continue
        x = low.g.add_input(v.name, v.type)
        low.held[(v, whole)] = x
        if layout != whole:
            low.box(v, layout, None, have=whole)
    for c in g.constants:
        assert c.const is not None
        layout = plan.value_sbp[c]
        if layout == whole:
            pc = low.const(c.name, c.const)
        else:
            t = local_type(c.type, layout, mesh)
            piece = (
                make_splat(c.const.reshape(-1)[0] if c.const.size else 0, t.shape, c.const.dtype)
                if is_splat(c.const)
                else shard(c.const, layout, mesh, (0,) * mesh.ndim)
            )
            pc = low.const(c.name, piece)
            low.phys.shards[pc] = (c.const, layout)
        low.held[(c, layout)] = pc
    for node in g.nodes:
        low.lower_node(node)
    sent = [low.box(v, layout, None) for v, layout in send]
    outs = [low.box(o, whole, None) for o in g.outputs]
    for o, x in zip(g.outputs, outs, strict=True):
        low.rename_output(x, o.name)
    low.g.outputs = [*sent, *outs]
    return low.phys, recv_vals, sent


def _slice_box(g: Graph, x: Value, box: Box, name: str) -> Value:
    """``x``'s region ``box`` (local coordinates), a Slice node unless it is all of ``x``."""
    axes = [d for d, (lo, hi) in enumerate(box) if (lo, hi) != (0, x.type.shape[d])]
    if not axes:
        return x
    consts = [
        g.add_constant(f"{name}/{what}", np.array(vals, dtype=np.int64))
        for what, vals in (
            ("starts", [box[d][0] for d in axes]),
            ("ends", [box[d][1] for d in axes]),
            ("axes", axes),
        )
    ]
    shape = tuple(hi - lo for lo, hi in box)
    node = g.add_node("Slice", [x, *consts], [x.type.with_shape(shape)], {}, name=name)
    return node.outputs[0]


def _assemble(
    g: Graph, parts: list[tuple[Box, Value]], axis: int, name: str, final: str | None
) -> Value:
    """The tensor whose regions (local boxes forming a grid) are ``parts``: Concat nodes, the
    last axis innermost. ``final`` names the result."""
    rank = len(parts[0][0])
    if axis == rank:
        assert len(parts) == 1
        return parts[0][1]
    groups: dict[int, list[tuple[Box, Value]]] = {}
    for box, v in parts:
        groups.setdefault(box[axis][0], []).append((box, v))
    if len(groups) == 1:
        return _assemble(g, parts, axis + 1, name, final)
    rows = [_assemble(g, groups[k], axis + 1, f"{name}/{k}", None) for k in sorted(groups)]
    shape = list(rows[0].type.shape)
    shape[axis] = sum(r.type.shape[axis] for r in rows)
    node = g.add_node(
        "Concat",
        list(rows),
        [rows[0].type.with_shape(tuple(shape))],
        {"axis": axis},
        name=f"{name}/concat{axis}",
        output_names=[final] if final else None,
    )
    return node.outputs[0]


def _peer_attrs(slots: list[Slot], other_stage: int, k: int, own_stage: int) -> dict[str, Any]:
    """Send/Recv attributes for ``slots``: ``peer`` alone (a world-rank offset) when every
    transfer goes to the rank with the same index in the other stage; else also ``peers``,
    per transfer the partner's world rank for each rank of this stage (``base`` is this
    stage's first world rank, which turns a world rank into an index)."""
    attrs: dict[str, Any] = {"peer": (other_stage - own_stage) * k}
    if any(p != i for slot in slots for i, p in enumerate(slot.peers)):
        attrs["peers"] = [[other_stage * k + p for p in slot.peers] for slot in slots]
        attrs["base"] = own_stage * k
    return attrs


def build_placed_stages(
    graph: Graph,
    node_stage: Sequence[int],
    stages: int,
    opts: ParallelOptions,
    profile: Profile,
    mesh: Mesh,
) -> tuple[list[Stage], list[StagePlacement], list[list[Reshard]]]:
    """Per-stage plans (``plan_stages``) and each stage's program: its plan's rank program
    between the Recv of its cut's pieces (assembled with Concat) and the Send of the next
    cut's (cut with Slice). ``mesh`` is the whole (P, *stage mesh)."""
    placements, cuts, logicals = plan_stages(graph, node_stage, stages, opts, profile)
    profile = stage_profile(profile)  # the boxing inside a stage is on the stage's axes
    k = opts.mesh.size
    crossing = crossing_values(graph, node_stage, stages)
    result = []
    for s in range(stages):
        lg, vmap = logicals[s]
        received = crossing[s - 1] if s > 0 else []
        recv_rs = cuts[s - 1] if s > 0 else []
        send_rs = cuts[s] if s < stages - 1 else []
        by_name = {v.name: v for v in crossing[s]} if s < stages - 1 else {}
        phys, recv_inputs, sent = _lower_stage(
            lg,
            placements[s].plan,
            profile,
            {vmap[v]: r.dst for v, r in zip(received, recv_rs, strict=True)},
            [(vmap[by_name[r.value]], r.src) for r in send_rs],
        )
        pg = phys.graph
        g = Graph(f"{graph.name}_stage{s}")
        g.meta = dict(graph.meta)
        stage = Stage(s, g, physical=phys)
        pmap: dict[Value, Value] = {}
        recv_set = set(recv_inputs)
        for v in pg.inputs:
            if v not in recv_set:
                pmap[v] = g.add_input(v.name, v.type)

        get = _stage_values(g, stage, pmap)

        if recv_rs:
            slots = [slot for r in recv_rs for slot in r.recv_slots]
            types, names = [], []
            for r, x in zip(recv_rs, recv_inputs, strict=True):
                for j, slot in enumerate(r.recv_slots):
                    shape = tuple(hi - lo for lo, hi in slot.box)
                    types.append(x.type.with_shape(shape))
                    names.append(r.value if len(r.recv_slots) == 1 else f"{r.value}/piece{j}")
            recv = g.add_node(
                "Recv",
                [],
                types,
                {
                    **_peer_attrs(slots, s - 1, k, s),
                    "shapes": [list(t.shape) for t in types],
                    "dtypes": [t.dtype.onnx for t in types],
                },
                name=f"recv_from_stage{s - 1}",
                output_names=names,
            )
            outs = iter(recv.outputs)
            for r, x in zip(recv_rs, recv_inputs, strict=True):
                parts = [(slot.box, next(outs)) for slot in r.recv_slots]
                pmap[x] = _assemble(g, parts, 0, f"{r.value}/assemble", r.value)
            stage.recv = [r.value for r in recv_rs]
        for node in pg.nodes:
            _copy_to_stage(g, node, s, get, pmap, mesh)
        if send_rs:
            out_slots: list[Slot] = []
            inputs: list[Value | None] = []
            for r, x in zip(send_rs, sent, strict=True):
                local = pmap[x] if x in pmap else get(x)
                cut: dict[Box, Value] = {}
                for j, slot in enumerate(r.send_slots):
                    if slot.box not in cut:
                        cut[slot.box] = _slice_box(
                            g, local, slot.box, f"{r.value}/to_stage{s + 1}/{j}"
                        )
                    out_slots.append(slot)
                    inputs.append(cut[slot.box])
            g.add_node(
                "Send",
                inputs,
                [],
                _peer_attrs(out_slots, s + 1, k, s),
                name=f"send_to_stage{s + 1}",
            )
            stage.send = [r.value for r in send_rs]
        if s == stages - 1:
            g.outputs = [pmap[o] if o in pmap else get(o) for o in pg.outputs]
        verify_graph(g)
        result.append(stage)
    return result, placements, cuts


def stage_profile(profile: Profile) -> Profile:
    """The profile as a stage's search sees it: its mesh is the whole mesh's axes after the
    pipeline axis, so stage axis i is the whole mesh's axis i + 1 (a [mesh_axis.N] override
    of the profile names the whole mesh's axis N; axis 0 is the pipeline link)."""
    return dataclasses.replace(
        profile, mesh_axis={a - 1: link for a, link in profile.mesh_axis.items() if a > 0}
    )


def stage_node_costs(
    graph: Graph, opts: ParallelOptions, profile: Profile
) -> tuple[Callable[[Node], float], Callable[[Value], int]]:
    """Each node's modeled time and each value's bytes on one device of a stage of
    ``opts.mesh``, for the partition: under one plan of the whole graph on the stage mesh.
    (The stages' own plans come after the partition, which needs costs first; the whole-graph
    plan is what a stage's plan mostly picks, and unlike time / K it knows which nodes do not
    split.)"""
    from flowc.parallel.cost import node_time

    inner = stage_profile(profile)
    plan, _ = _stage_plan(graph, opts, inner, {})

    def time_of(node: Node) -> float:
        return node_time(node, plan.node_strategy[node], opts.mesh, inner)

    def bytes_of(v: Value) -> int:
        sbp = plan.value_sbp.get(v)
        if sbp is None or any(p.kind == "P" for p in sbp.parts):
            return v.type.nbytes  # a partial sum crosses reduced, at most whole
        return local_type(v.type, sbp, opts.mesh).nbytes

    return time_of, bytes_of
