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
2. The placement search on the stage sub-mesh (``flowc.parallel.parallelize``), when a
   stage has more than one device: one plan for every stage, so a value crossing a cut has
   the same layout on both sides and rank j of stage s sends to rank j of stage s+1 (its
   world rank + k). The layouts at the cuts are thereby chosen together, and no N:M
   reshard is ever needed.
3. The partition into stages (``flowc.schedule.partition``).
4. ``build_stages``: each stage's own graph. Every value crossing a cut -- skip connections
   included, relayed through the stages between -- travels in one Send on the earlier side
   and one Recv on the later side, in the same order; graph outputs made early are relayed
   to the last stage, whose rank 0 writes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from flowc.errors import InputError
from flowc.ir.graph import Attrs, Graph, Value
from flowc.ir.types import Mesh, NdSbp, Sbp
from flowc.parallel.boxing import LOCAL_SLICE
from flowc.parallel.cost import Profile
from flowc.parallel.lower import Physical, lower

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
    if microbatches < 1:
        raise InputError(f"--microbatches {microbatches}: expected at least 1")
    if microbatches == 1:
        return Microbatched(
            graph, [v.type.nbytes for v in graph.inputs], [v.type.nbytes for v in graph.outputs]
        )
    import dataclasses

    from flowc.parallel.cost import Link
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


@dataclass
class Pipelined:
    logical: Graph  # the model's whole-batch inputs and outputs
    stages: list[Stage]
    microbatches: int
    mesh: Mesh  # (P, *stage mesh)
    ranks_per_stage: int
    input_strides: list[int]
    output_strides: list[int]
    physical: Physical | None  # the stage sub-mesh's rank program (sharded constants)

    def constant_data(self, stage: Stage, coords: tuple[int, ...]) -> Callable[[Value], np.ndarray]:
        """Rank ``coords``' (whole-mesh coordinates) data for ``stage``'s constants."""
        phys = self.physical

        def data(v: Value) -> np.ndarray:
            src = stage.origin[v]
            if phys is None:
                assert src.const is not None
                return src.const
            return phys.constant_for(src, coords[1:])

        return data


def build_stages(
    rank_graph: Graph, node_stage: list[int], stages: int, ranks_per_stage: int, mesh: Mesh
) -> list[Stage]:
    """Each stage's graph from the rank graph and each node's stage (see the module
    docstring). Collectives of a stage act on the whole-mesh axis after the pipeline axis."""
    nodes = rank_graph.nodes
    stage_of_value: dict[Value, int] = {}
    order: dict[Value, int] = {}
    for k, (node, s) in enumerate(zip(nodes, node_stage, strict=True)):
        for j, o in enumerate(node.outputs):
            stage_of_value[o] = s
            order[o] = k * 1024 + j
    last_reader: dict[Value, int] = {}
    for node, s in zip(nodes, node_stage, strict=True):
        for i in node.inputs:
            if i is not None and i in stage_of_value:
                last_reader[i] = max(last_reader.get(i, -1), s)
    for o in rank_graph.outputs:
        if o in stage_of_value:
            last_reader[o] = stages - 1
    # Values over cut c (between stages c and c+1), in production order.
    crossing: list[list[Value]] = [
        sorted(
            (v for v, s in stage_of_value.items() if s <= c < last_reader.get(v, -1)),
            key=lambda v: order[v],
        )
        for c in range(stages - 1)
    ]
    result = []
    for s in range(stages):
        g = Graph(f"{rank_graph.name}_stage{s}")
        g.meta = dict(rank_graph.meta)
        stage = Stage(s, g)
        vmap: dict[Value, Value] = {}
        for v in rank_graph.inputs:
            vmap[v] = g.add_input(v.name, v.type)

        def get(
            v: Value, g: Graph = g, stage: Stage = stage, vmap: dict[Value, Value] = vmap
        ) -> Value:
            if v not in vmap:
                assert v.const is not None, f"value {v.name!r} is not available in its stage"
                c = g.add_constant(v.name, v.const)
                stage.origin[c] = v
                vmap[v] = c
            return vmap[v]

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
        for node, ns in zip(nodes, node_stage, strict=True):
            if ns != s:
                continue
            attrs = dict(node.attrs.items())
            if node.op in _MESH_OPS and ranks_per_stage > 1:
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
            copy.stage = s
            for o, c in zip(node.outputs, copy.outputs, strict=True):
                vmap[o] = c
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
        g.verify()
        result.append(stage)
    return result
