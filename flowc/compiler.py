"""The compile driver: frontend -> passes -> parallel -> schedule -> memory -> codegen ->
write, in that order, each stage handed the previous one's result.

It owns the whole road for every device count: the command line (and any script) fills an
options record (flowc.options) and calls ``compile_model``, ``load_model``,
``placement_target`` and ``place`` here; no caller picks passes or runs a stage itself.
One pass list (``pass_list``) runs before placement for one device, a mesh and a pipeline
alike, so a mesh places the fused graph (FusedGemm with its epilogue, FusedConv, the fused
attention op), whose ops declare their SBP signatures like any other.

Nothing downstream calls back up: code generation gets the schedule and the memory plan it
writes down, the memory planner gets the schedule's happens-before order, the schedule gets
the (rank) graph. Each stage is timed for ``--print-pass-times``.

Placement under a memory limit is a loop of the driver's too (``parallelize``): it re-plans
until the compiled program fits, measured with the later stages, which parallel/ never
imports.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from flowc.codegen.cpp import MAX_PREFIX, c_ident
from flowc.codegen.program import (
    WeightsLayout,
    generate,
    generate_pipeline,
    generate_train_pipeline,
    layout_weights,
)
from flowc.codegen.project import project_writer
from flowc.errors import FlowcWarning, InputError
from flowc.formatting import dims_text
from flowc.frontend import ImportOptions, load_graph
from flowc.ir.fit_dims import annotate_symbols, at_sizes
from flowc.ir.graph import Graph, Node
from flowc.ir.symbolic import DimRange
from flowc.ir.types import Mesh
from flowc.ir.verify import verify_graph
from flowc.memory.plan import MemoryPlan, Order, plan_memory
from flowc.options import (
    CompileOptions,
    ModelArgs,
    ParallelArgs,
    parse_bounds,
    parse_bytes,
    parse_dim_ranges,
    parse_dim_values,
    parse_shape_ranges,
    parse_shapes,
)
from flowc.parallel import (
    METHODS,
    Memory,
    Parallelized,
    ParallelOptions,
    make_plan,
    parse_mesh,
    parse_sbp,
    workspace_within,
)
from flowc.parallel.buckets import CAPS as BUCKET_CAPS
from flowc.parallel.buckets import bucket_all_reduces
from flowc.parallel.cost import Profile, evaluate_plan, load_profile
from flowc.parallel.lower import lower
from flowc.parallel.pipeline import (
    Pipelined,
    Reshard,
    StagePlacement,
    build_placed_stages,
    build_stages,
    microbatch_graph,
    stage_node_costs,
)
from flowc.parallel.search import ParamLimitError
from flowc.parallel.simulate import simulate
from flowc.passes.fuse_elementwise import fuse_elementwise
from flowc.passes.manager import DEFAULT_PIPELINE, PassManager
from flowc.passes.manager import compile_pipeline as compile_passes
from flowc.passes.precision import STORAGE_PASS
from flowc.schedule.actors import build_actor_graph
from flowc.schedule.memory_order import memory_order
from flowc.schedule.partition import Partition, parse_stage_boundaries, partition
from flowc.schedule.pipeline import PipelineRun, gpipe, one_f_one_b
from flowc.schedule.pipeline import simulate as simulate_order
from flowc.schedule.program import Schedule, StreamOp
from flowc.schedule.streams import schedule_actors
from flowc.schedule.train_pipeline import TrainPipeline, auto_boundaries, build_train_pipeline
from flowc.schedule.unroll import Unrolled, schedule_stages, unroll
from flowc.training.recompute import RecomputeReport, recompute, saved_bytes
from flowc.training.recompute import apply as recompute_apply
from flowc.training.spec import TrainSpec
from flowc.training.step import (
    COUNT,
    LOSS,
    LR,
    STEP,
    TrainingStep,
    build_step,
    inference_graph,
    make_trainable,
)

if TYPE_CHECKING:
    from flowc.parallel.lower import Physical

T = TypeVar("T")
# Where the driver says what it is doing (the command line prints it; scripts pass nothing).
Progress = Callable[[str], None]
# Where the IR printed after a pass goes (--dump-after): the pass's name and the text.
Dump = Callable[[str, str], None]


def _quiet(_: str) -> None:
    pass


@dataclass
class StageTimes:
    """Seconds per stage, in the order they ran (a stage run twice adds up)."""

    stages: list[tuple[str, float]] = field(default_factory=list)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stages.append((name, time.perf_counter() - t0))

    def run(self, name: str, fn: Callable[[], T]) -> T:
        with self.stage(name):
            return fn()

    def lines(self) -> list[str]:
        total = sum(s for _, s in self.stages)
        out = [f"  {name}: {s * 1e3:.1f} ms" for name, s in self.stages]
        return [*out, f"  total: {total * 1e3:.1f} ms"]


@dataclass
class Compiled:
    graph: Graph
    physical: Physical | None
    schedule: Schedule
    memory: MemoryPlan
    files: dict[str, str]
    weights: list[WeightsLayout]
    program: list[StreamOp]  # the emitted stream operations (the memory checker's input)
    # A training program's inference schedule (run() beside train_step()), when it has one.
    inference: CompiledInference | None = None


@dataclass
class CompiledInference:
    graph: Graph
    schedule: Schedule
    memory: MemoryPlan
    program: list[StreamOp]


def schedule_graph(
    graph: Graph,
    profile: Profile | None = None,
    streams: int | None = None,
    schedule_for: str = "latency",
) -> Schedule:
    """A rank graph's actors, simulated on ``streams`` compute streams (None: the
    simulator's choice). ``schedule_for="memory"``: the actors in the order of least peak
    memory (flowc.schedule.memory_order), on one compute stream unless ``streams`` asks for
    more -- a second stream overlaps branches, whose buffers are then live together, which
    is what the order avoids; with more, the list scheduler takes the order as its
    priority, and the plan follows the simulated happens-before order as always.
    ``schedule_for="order"``: the graph's node order on one stream, as it stands."""
    if schedule_for not in ("latency", "memory", "order"):
        raise ValueError(
            f"schedule_for must be 'latency', 'memory' or 'order', not {schedule_for!r}"
        )
    profile = load_profile() if profile is None else profile
    ag = build_actor_graph(graph, profile)
    if schedule_for == "latency":
        return schedule_actors(ag, profile, streams)
    if schedule_for == "order":
        # The graph's own order (a pipeline stage's: its exchanges between its groups).
        order = [-float(k) for k in range(len(ag.actors))]
        return schedule_actors(ag, profile, 1, order, comm_stream=False)
    nodes = memory_order(graph, workspace_bytes=profile.workspace).nodes
    runs = {id(a.node) for a in ag.actors}
    if [id(n) for n in nodes if id(n) in runs] != [id(n) for n in graph.nodes if id(n) in runs]:
        # The search counts no Concat/Split/Slice aliases, which the plan makes where they
        # are free: the plan has the last word, the exporter's order where it needs less.
        def arena(order: list[Node]) -> int:
            linear = Order.linear(graph, order)
            return plan_memory(graph, linear, workspace_bytes=profile.workspace).arena_bytes

        if arena(list(graph.nodes)) < arena(nodes):
            nodes = list(graph.nodes)
    position = {id(node): k for k, node in enumerate(nodes)}
    # Earliest in the order first: on one stream, the order itself.
    rank = [-float(position[id(a.node)]) for a in ag.actors]
    return schedule_actors(ag, profile, 1 if streams is None else streams, rank)


@dataclass
class BucketChoice:
    """The gradient buckets a rank graph got (flowc.parallel.buckets): the cap, the
    all-reduces before and after, and the modeled step time of each cap tried."""

    cap: int
    before: int
    after: int
    tried: dict[int, float]  # cap -> modeled makespan (seconds)

    def line(self) -> str:
        if not self.tried:
            return f"gradient buckets: none ({self.before} all-reduce{'s' * (self.before != 1)})"
        alone = self.tried.get(0, 0.0) * 1e6
        best = self.tried[self.cap] * 1e6
        if self.after == self.before:
            return (
                f"gradient buckets: none ({self.before} all-reduces, each alone: modeled "
                f"{alone:.1f} us, no cap tried does better)"
            )
        return (
            f"gradient buckets: {self.before} all-reduces in {self.after} (up to "
            f"{self.cap / 2**20:g} MiB each): modeled step {alone:.1f} -> {best:.1f} us"
        )


def bucket_gradients(
    graph: Graph,
    profile: Profile | None = None,
    streams: int | None = None,
    schedule_for: str = "latency",
    caps: Sequence[int] = BUCKET_CAPS,
) -> BucketChoice:
    """``graph``'s all-reduces bucketed (in place) by the cap of ``caps`` whose schedule
    the simulator models fastest (ties: the fewer collectives); the rank graph of a step
    on a mesh, before it is scheduled."""
    profile = load_profile() if profile is None else profile
    before = sum(n.op == "AllReduce" for n in graph.nodes)
    if before < 2:
        return BucketChoice(0, before, before, {})
    tried: dict[int, float] = {}
    merged: dict[int, int] = {}
    for cap in caps:
        trial = graph.copy()
        merged[cap] = bucket_all_reduces(trial, cap)
        if cap and merged[cap] == 0:
            continue
        if cap and any(merged.get(c) == merged[cap] and c in tried for c in caps if c < cap):
            continue  # as many merged as a smaller cap: taken as the same buckets
        tried[cap] = schedule_graph(trial, profile, streams, schedule_for).makespan_s
    best = min(tried, key=lambda c: (tried[c], -merged[c]))
    bucket_all_reduces(graph, best)
    return BucketChoice(best, before, before - merged[best], tried)


def plan_schedule(schedule: Schedule) -> MemoryPlan:
    """The memory plan along ``schedule``'s happens-before order."""
    return plan_memory(
        schedule.actors.graph, Order.of(schedule), workspace_bytes=schedule.workspace_bytes
    )


def arena_bytes(graph: Graph, profile: Profile | None = None, streams: int | None = None) -> int:
    """The arena a rank graph needs as compiled on ``streams`` compute streams (for the
    placement search's memory limit)."""
    return plan_schedule(schedule_graph(graph, profile, streams)).arena_bytes


def measure(
    physical: Physical, profile: Profile | None = None, streams: int | None = None
) -> Memory:
    """Per-device bytes of the program as compiled: weights (incl. fills) and the arena
    under the rank's schedule (boxing buffers are arena values). Fuses ``physical.graph``
    in place, as compilation would."""
    # The memory limit is a fact about the compiled program, so the driver measures it
    # with the later stages (placement comes before them and never imports them).
    g = fuse_elementwise(physical.graph)
    physical.graph = g
    return Memory(layout_weights(g).device_bytes, arena_bytes(g, profile, streams))


def parallelize(graph: Graph, opts: ParallelOptions, max_attempts: int = 6) -> Parallelized:
    """Plan, lower and measure; under ``mem_limit``, re-plan with a tighter parameter budget
    until the real per-device bytes (parameters + arena) fit."""
    if opts.method not in METHODS:
        raise InputError(f"--parallel {opts.method!r}: expected one of {', '.join(METHODS)}")
    profile = workspace_within(load_profile(opts.profile), opts.mem_limit)
    param_limit = opts.mem_limit
    last: Memory | None = None
    tried_least = False
    for attempt in range(1, max_attempts + 1):
        try:
            plan = make_plan(graph, opts, profile, opts.method, param_limit)
        except InputError as e:
            if last is None:
                raise
            if isinstance(e, ParamLimitError) and not tried_least:
                # The excess came off the parameters alone, though the arena shrinks with
                # them: the plan that stores least is still worth measuring.
                tried_least, param_limit = True, e.least
                continue
            # The parameters fit the limit alone, but not beside the arena the plans need.
            raise InputError(
                f"no plan fits --mem-limit {opts.mem_limit} bytes per device: the last one "
                f"tried needed {last.total} bytes ({last.params} parameters + {last.arena} "
                f"arena), and the parameters cannot be split further ({e.message})",
                hint="raise the limit or use a larger mesh",
            ) from None
        physical = lower(graph, plan, profile)
        memory = measure(physical, profile, opts.stream_count())
        last = memory
        cost = evaluate_plan(graph, plan, profile)
        if opts.mem_limit is None or memory.total <= opts.mem_limit:
            return Parallelized(plan, physical, cost, memory, profile, attempt)
        if opts.method != "auto":
            raise InputError(
                f"the {opts.method} plan needs {memory.total} bytes per device "
                f"({memory.params} parameters + {memory.arena} arena), over --mem-limit {opts.mem_limit}",
                hint="use --parallel auto, a larger mesh, or a higher limit",
            )
        # The parameter budget is what the search controls: take the excess off it.
        excess = memory.total - opts.mem_limit
        param_limit = max(0, min(cost.param_bytes, param_limit or cost.param_bytes) - excess)
    raise InputError(
        f"no plan found within --mem-limit {opts.mem_limit} bytes per device after {max_attempts} attempts "
        f"(the last needed {memory.total}: {memory.params} parameters + {memory.arena} arena)",
        hint="raise the limit or use a larger mesh",
    )


def generate_program(
    graph: Graph,
    *,
    physical: Physical | None = None,
    prefix: str | None = None,
    source: str = "",
    arch: str = "90",
    build_target: str | None = None,
    poison: bool = False,
    streams: int | None = None,
    profile: Profile | None = None,
    times: StageTimes | None = None,
    cuda_graph: bool = True,
    precision: str = "fp32",
    schedule_for: str = "latency",
    inference: Graph | None = None,
) -> Compiled:
    """Schedule, plan memory for, and generate the program of ``graph`` (for a multi-rank
    program, its rank graph with ``physical``). ``cuda_graph``: run() replays a CUDA Graph
    of the schedule (False: --no-cuda-graph, direct launches). ``schedule_for``: as in
    schedule_graph. ``inference``: a training step's forward (training.step.inference_graph),
    scheduled for latency and planned on its own, which run() issues."""
    times = StageTimes() if times is None else times
    profile = load_profile() if profile is None else profile
    sched = times.run("schedule", lambda: schedule_graph(graph, profile, streams, schedule_for))
    memory = times.run("memory plan", lambda: plan_schedule(sched))
    infer = None
    if inference is not None:
        isched = times.run(
            "inference schedule", lambda: schedule_graph(inference, profile, streams)
        )
        infer = (inference, isched, times.run("memory plan", lambda: plan_schedule(isched)))
    files, weights, ops, infer_ops = times.run(
        "code generation",
        lambda: generate(
            graph,
            sched,
            memory,
            prefix=prefix,
            source=source,
            arch=arch,
            build_target=build_target,
            poison=poison,
            physical=physical,
            cuda_graph=cuda_graph,
            precision=precision,
            inference=infer,
        ),
    )
    compiled_inference = None
    if infer is not None:
        compiled_inference = CompiledInference(*infer, infer_ops)
    return Compiled(graph, physical, sched, memory, files, weights, ops, compiled_inference)


def compile_graph(
    graph: Graph,
    out: Path,
    prefix: str | None = None,
    source: str = "",
    arch: str = "90",
    build_target: str | None = None,
    poison: bool = False,
    physical: Physical | None = None,
    force: bool = False,
    streams: int | None = None,
    times: StageTimes | None = None,
    cuda_graph: bool = True,
    profile: Profile | None = None,
    precision: str = "fp32",
    schedule_for: str = "latency",
    inference: Graph | None = None,
) -> Compiled:
    """Write OUT/ for ``graph`` (``inference``: as in generate_program). ``poison`` fills dead arena bytes with NaN between uses and
    lets FLOWC_DROP_EVENT drop an event (debugging aids the tests use). OUT/ keeps what
    flowc did not write (see codegen/project.py); ``force`` allows a non-empty OUT/ that is
    no flowc project."""
    times = StageTimes() if times is None else times
    # OUT/ is checked and locked before the (slow) generation, and stays locked until the
    # new project is in place.
    with project_writer(out, force) as write:
        compiled = generate_program(
            graph,
            physical=physical,
            prefix=prefix,
            source=source,
            arch=arch,
            build_target=build_target,
            poison=poison,
            streams=streams,
            times=times,
            cuda_graph=cuda_graph,
            profile=profile,
            precision=precision,
            schedule_for=schedule_for,
            inference=inference,
        )
        times.run("write", lambda: write(compiled.files, compiled.weights))
    return compiled


@dataclass
class PipelineSpec:
    """What the command line asks of a pipeline: P stages over mesh axis 0 of ``mesh``, M
    micro-batches, and the cuts (``boundaries``: the last value of each stage but the last;
    None: the program's stage blocks if it has any, else the automatic partition)."""

    stages: int
    mesh: Mesh  # (P, *stage mesh)
    microbatches: int = 1
    boundaries: list[str] | None = None
    mem_limit: int | None = None
    # The placement search's options on the stage mesh (its mesh is mesh.shape[1:]).
    stage_options: ParallelOptions | None = None
    # The micro-batches' order (--pipeline-schedule; None: not given).
    schedule: str | None = None


@dataclass
class CompiledPipeline:
    pipeline: Pipelined
    partition: Partition
    schedules: list[Schedule]
    memory: list[MemoryPlan]
    files: dict[str, str]
    weights: list[WeightsLayout]
    programs: list[list[StreamOp]]  # per stage
    unrolled: list[Unrolled] = field(default_factory=list)  # per stage: its micro-batches


def check_pipeline_mesh(spec: PipelineSpec) -> None:
    p, shape = spec.stages, spec.mesh.shape
    if p < 1:
        raise InputError(f"--pipeline {p}: expected at least 1 stage")
    if shape[0] != p:
        raise InputError(
            f"--pipeline {p} on mesh {'x'.join(map(str, shape))}: mesh axis 0 is the pipeline "
            f"axis, so it must have {p} devices",
            hint=f"use --mesh {p} (one device per stage) or --mesh {p}xK (K devices per stage)",
        )


def build_pipeline(
    graph: Graph, spec: PipelineSpec, profile: Profile, times: StageTimes
) -> tuple[Pipelined, Partition]:
    """Micro-batch graph -> stage partition -> each stage's placement on its own sub-mesh
    (left to right, the cut's transfer priced in) -> stage graphs (flowc.parallel.pipeline's
    module docstring)."""
    check_pipeline_mesh(spec)
    mb = times.run("micro-batches", lambda: microbatch_graph(graph, spec.microbatches, profile))
    per_stage = math.prod(spec.mesh.shape[1:])
    node_stages = spec.boundaries is None and any(n.stage is not None for n in mb.graph.nodes)
    opts = None
    node_time_fn = value_bytes_fn = None
    if per_stage > 1:
        opts = spec.stage_options or ParallelOptions(Mesh("stage", spec.mesh.shape[1:]))
        placed = opts
        # The partition balances stages of K devices: each node's time and each value's
        # bytes on one of them, under one placement of the whole micro-batch graph.
        node_time_fn, value_bytes_fn = times.run(
            "parallel placement", lambda: stage_node_costs(mb.graph, placed, profile)
        )
    part = times.run(
        "stage partition",
        lambda: partition(
            mb.graph,
            spec.stages,
            profile,
            mem_limit=spec.mem_limit,
            boundaries=spec.boundaries,
            node_stages=node_stages,
            node_time_fn=node_time_fn,
            value_bytes_fn=value_bytes_fn,
        ),
    )
    for node, stage in zip(mb.graph.nodes, part.node_stage, strict=True):
        node.stage = stage
    placements: list[StagePlacement] = []
    cuts: list[list[Reshard]] = []
    if opts is None:
        stages = build_stages(mb.graph, part.node_stage, spec.stages, per_stage, spec.mesh)
    else:
        stage_opts = opts
        stages, placements, cuts = times.run(
            "stage placement",
            lambda: build_placed_stages(
                mb.graph, part.node_stage, spec.stages, stage_opts, profile, spec.mesh
            ),
        )
    pipe = Pipelined(
        graph,
        stages,
        spec.microbatches,
        spec.mesh,
        per_stage,
        mb.input_strides,
        mb.output_strides,
        None,
        placements,
        cuts,
        mb.graph,
    )
    return pipe, part


def schedule_pipeline(
    pipe: Pipelined, profile: Profile, streams: int | None = None
) -> tuple[list[Unrolled], list[Schedule]]:
    """Each stage's micro-batches unrolled into one program, and the stages' schedules
    (simulated in stage order: a receive waits for its sender's modeled send)."""
    unrolled = [
        unroll(
            s.graph,
            pipe.microbatches,
            pipe.input_strides,
            pipe.output_strides if s.graph.outputs else [],
        )
        for s in pipe.stages
    ]
    return unrolled, schedule_stages(unrolled, profile, streams)


def compile_pipeline(
    graph: Graph,
    out: Path,
    spec: PipelineSpec,
    prefix: str | None = None,
    source: str = "",
    arch: str = "90",
    build_target: str | None = None,
    poison: bool = False,
    force: bool = False,
    streams: int | None = None,
    times: StageTimes | None = None,
    precision: str = "fp32",
) -> CompiledPipeline:
    """Write OUT/ for ``graph`` run as the pipeline ``spec``: one program for every rank of
    the mesh, which runs its own stage's schedule: the stage's micro-batches unrolled into
    one actor program (flowc.schedule.unroll), simulated stage after stage."""
    times = StageTimes() if times is None else times
    with project_writer(out, force) as write:
        profile = workspace_within(
            load_profile(spec.stage_options.profile if spec.stage_options else None), spec.mem_limit
        )
        pipe, part = build_pipeline(graph, spec, profile, times)
        unrolled, scheds = times.run("schedule", lambda: schedule_pipeline(pipe, profile, streams))
        plans = times.run("memory plan", lambda: [plan_schedule(s) for s in scheds])
        files, weights, programs = times.run(
            "code generation",
            lambda: generate_pipeline(
                pipe,
                unrolled,
                scheds,
                plans,
                prefix=prefix,
                source=source,
                arch=arch,
                build_target=build_target,
                poison=poison,
                precision=precision,
            ),
        )
        times.run("write", lambda: write(files, weights))
    return CompiledPipeline(pipe, part, scheds, plans, files, weights, programs, unrolled)


@dataclass
class CompiledTrainPipeline:
    pipeline: TrainPipeline
    boundaries: list[str]
    schedules: list[Schedule]
    memory: list[MemoryPlan]
    files: dict[str, str]
    weights: list[WeightsLayout]


def compile_train_pipeline(
    step: TrainingStep,
    prediction: str,
    out: Path,
    spec: PipelineSpec,
    *,
    prefix: str | None = None,
    source: str = "",
    arch: str = "90",
    build_target: str | None = None,
    force: bool = False,
    precision: str = "fp32",
    times: StageTimes | None = None,
) -> CompiledTrainPipeline:
    """Write OUT/ for training step ``step`` (its micro-batches unrolled, spec.microbatches
    of them) as the pipeline ``spec``: the stage programs (flowc.schedule.train_pipeline),
    each scheduled in its own order on one stream and planned, then one project whose rank
    runs its stage's. ``prediction``: the loss's input, before which the automatic cuts
    fall."""
    times = StageTimes() if times is None else times
    per_stage = math.prod(spec.mesh.shape[1:])
    if len(spec.mesh.shape) > 2:
        raise InputError(
            f"--pipeline {spec.stages} on mesh {dims_text(spec.mesh.shape)}: a training "
            "pipeline's stages are data parallel over one more mesh axis at most",
            hint=f"use --mesh {spec.stages}xK",
        )
    with project_writer(out, force) as write:
        profile = load_profile(spec.stage_options.profile if spec.stage_options else None)
        graph = step.graph
        if per_stage > 1:
            # Pipeline x data: the step placed by the data plan on one stage's K devices
            # (each micro-batch's rows split, the state whole, the gradients all-reduced),
            # then its rank program cut into stages, whose collectives act along mesh axis
            # 1 of the whole mesh.
            # The step's micro-batches take their rows from every rank's part of the batch
            # (TrainSpec.microbatch_ranks), so a gradient sums its micro-batches' partial
            # sums on the rank and is all-reduced once per step.
            opts = ParallelOptions(Mesh("data", (per_stage,)), "data")
            placed = times.run("parallel placement", lambda: parallelize(graph, opts))
            graph = placed.physical.graph
        cuts = spec.boundaries
        if cuts is None:
            cuts = auto_boundaries(graph, spec.stages, prediction, profile, {STEP, LR})
        owned = {m: p for p, ms in step.optimizer_state.items() for m in ms}
        boundaries, placed_graph = cuts, graph
        pipe = times.run(
            "stage partition",
            lambda: build_train_pipeline(
                placed_graph,
                spec.stages,
                spec.microbatches,
                boundaries,
                schedule=spec.schedule or "1f1b",
                owned=owned,
                global_inputs={STEP, LR},
                batch=step.batch,
                loss=LOSS,
                broadcast=[LOSS, COUNT],
                profile=profile,
                mesh=spec.mesh,
            ),
        )
        scheds = times.run(
            "schedule",
            lambda: [schedule_graph(st.graph, profile, 1, "order") for st in pipe.stages],
        )
        plans = times.run("memory plan", lambda: [plan_schedule(sc) for sc in scheds])
        files, weights, _ = times.run(
            "code generation",
            lambda: generate_train_pipeline(
                placed_graph,
                [st.graph for st in pipe.stages],
                scheds,
                plans,
                spec.mesh,
                spec.microbatches,
                prefix=prefix,
                source=source,
                arch=arch,
                build_target=build_target,
                precision=precision,
            ),
        )
        times.run("write", lambda: write(files, weights))
    return CompiledTrainPipeline(pipe, list(cuts), scheds, plans, files, weights)


# -- the driver: from an options record to a project -------------------------------------------


def pass_list(
    precision: str = "fp32", compiled: bool = True, placed: bool = False, symbolic: bool = False
) -> tuple[str, ...]:
    """The passes a graph goes through before placement and code generation: one list for
    one device, a mesh and a pipeline, the fusions included; ``placed`` (the graph is to be
    split over devices) adds split_projections in front of them; ``placed`` and
    ``symbolic`` (symbolic dims) read GEMM operands packed. ``compiled=False``: the import
    clean-up alone, what eval and convert read."""
    return compile_passes(precision, placed, symbolic) if compiled else DEFAULT_PIPELINE


def load_model(
    model: ModelArgs,
    *,
    compiled: bool = True,
    precision: str = "fp32",
    placed: bool = False,
    on_mesh: bool = False,
    times: StageTimes | None = None,
    dump: Dump | None = None,
) -> Graph:
    """MODEL imported and put through ``pass_list``; the import and each pass are timed
    into ``times``, and the IR after each pass --dump-after names goes to ``dump``. A
    ``.flow`` program's placements (``@ S(1)``) are kept only for a graph to be ``placed``
    (the passes keep such values as they are); elsewhere they do not apply. Symbolic dims
    are for one device, or (``on_mesh``) a graph compile_model places on a mesh, whose
    placement splits none of them."""
    times = StageTimes() if times is None else times
    static_dims, ranges = parse_dim_ranges(model.dims)
    shapes, shape_ranges = parse_shape_ranges(model.shapes)
    by_shape = _shape_symbols(model, shape_ranges, ranges)
    bounds = parse_bounds(model.bounds)
    decisions: dict[str, bool] = {}  # the bound build's constant folding, for the probes
    if bounds and model.path.suffix.lower() == ".flow":
        raise InputError(
            "--bound is for ONNX models; a .flow program gives an op its bound attribute",
            hint="write bound=K in the call: non_zero(x, bound=100)",
        )

    def build(sizes: Mapping[str, int], record: bool) -> Graph:
        if record:
            return build_at(sizes, True)
        # The probe builds repeat what the bound's build has said: its warnings once.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FlowcWarning)
            return build_at(sizes, False)

    # the computed counts' bounds in the build at the bound, kept by the probe builds
    count_bounds: dict[str, int] = {}

    def build_at(sizes: Mapping[str, int], record: bool) -> Graph:
        at_shapes = {n: list(d) for n, d in shapes.items()}
        for (n, k), sym in by_shape.items():
            at_shapes[n][k] = sizes[sym]
        is_flow = model.path.suffix.lower() == ".flow"
        given = {k: v for k, v in sizes.items() if k in ranges}
        opts = ImportOptions(
            shapes={n: tuple(d) for n, d in at_shapes.items()},
            dims={**static_dims, **({} if is_flow else given)},
            weights=model.weights,
            sizes=sizes if is_flow else {},
            bounds=bounds,
            counts={k: v for k, v in sizes.items() if k not in ranges},
            count_bounds=count_bounds,
            fold_as=None if record else decisions,
        )
        graph = load_graph(model.path, opts)
        graph.fold_as = None if record else dict(decisions)  # (the passes fold too)
        if graph.state and (placed or precision != "fp32"):
            # A training step (a printed step's `state` declarations) runs on one device in fp32.
            raise InputError(
                f"{model.path.name} is a training step (it declares state): it compiles for one "
                "device in fp32 for now",
                hint="leave out --mesh, --pipeline and --precision",
            )
        if not placed:
            for v in graph.values():
                v.sbp = None
        dump_after = set(model.dump_after) if record else set()
        symbolic = bool(ranges) or bool(graph.symbols)
        pm = PassManager(pass_list(precision, compiled, placed, symbolic), dump_after=dump_after)
        graph = pm.run(graph)
        if record:
            decisions.update(graph.fold_decisions)
            times.stages.extend((f"pass {name}", seconds) for name, seconds in pm.timings)
            for name, text in pm.dumps:
                if dump is not None:
                    dump(name, text)
        return graph

    if model.path.suffix.lower() == ".flow":
        # a program declares its own symbols (dim batch: 1..64), each read at its bound
        graph = times.run("import", lambda: build({}, True))
        ranges = {k: r for k, r in graph.symbols.items() if not r.computed}
    elif ranges:
        graph = times.run("import", lambda: build({s: r.hi for s, r in ranges.items()}, True))
    else:
        graph = times.run("import", lambda: build({}, True))
    if placed and (ranges or graph.symbols) and not on_mesh:
        raise InputError(
            "symbolic dims ("
            + ", ".join(f"{s}={r}" for s, r in {**ranges, **graph.symbols}.items())
            + ") compile for one device, a mesh (`flowc compile --mesh`, which splits none of "
            "them) or a pipeline of one device per stage running one micro-batch; stage "
            "meshes, and placing the graph here, take one size for now",
            hint="fix the dims with --dim NAME=N",
        )
    # the computed counts (NonZero, NonMaxSuppression, ...) are fitted like the given sizes
    every = {**ranges, **{k: r for k, r in graph.symbols.items() if r.computed}}
    count_bounds.update({k: r.hi for k, r in every.items() if r.computed})
    if not every:
        return graph
    counts = [s for s, r in graph.symbols.items() if r.computed]
    if placed and counts:
        raise InputError(
            "a data-dependent output's count ("
            + ", ".join(counts)
            + ") is for one device for now: a mesh splits a program of fixed sizes",
            hint="compile it for one device",
        )
    return times.run(
        "symbolic dims", lambda: annotate_symbols(graph, every, lambda p: build(p, False))
    )


def _shape_symbols(
    model: ModelArgs,
    shape_ranges: Mapping[tuple[str, int], DimRange],
    ranges: dict[str, DimRange],
) -> dict[tuple[str, int], str]:
    """The symbol each range in --shape sets (the model's name for that dim), added to
    ``ranges``."""
    if not shape_ranges:
        return {}
    if model.path.suffix.lower() != ".onnx":
        raise InputError("a range in --shape is for ONNX models")
    from flowc.frontend.onnx import input_dim_symbols

    named = input_dim_symbols(model.path)
    found: dict[tuple[str, int], str] = {}
    for (name, k), r in shape_ranges.items():
        dims = named.get(name)
        sym = dims[k] if dims is not None and k < len(dims) else None
        if sym is None:
            raise InputError(
                f"--shape {name}: dim {k} is a range, but the model gives that dim no name "
                "(a dim_param) to make it a symbol",
                hint="rewrite the model with named dynamic axes, or give the dim one size",
            )
        if sym in ranges and ranges[sym] != r:
            raise InputError(
                f"--shape {name}: dim {k} ({sym!r}) is {r} but {ranges[sym]} elsewhere",
                hint="inputs that share a symbolic dimension share its range",
            )
        ranges[sym] = r
        found[(name, k)] = sym
    return found


Target = ParallelOptions | PipelineSpec | None


def is_placed(target: Target) -> bool:
    """Whether the placement search splits the graph over devices: a mesh, or a pipeline
    whose stages have several devices each."""
    if isinstance(target, PipelineSpec):
        return math.prod(target.mesh.shape[1:]) > 1
    return target is not None


def _program_graph(model: ModelArgs) -> Graph:
    """A .flow program as written (its mesh and placements), before any pass."""
    return load_graph(model.path, ImportOptions(weights=model.weights))


def placement_target(model: ModelArgs, par: ParallelArgs) -> Target:
    """Where the program runs: None for one device, ParallelOptions for a mesh, a
    PipelineSpec for --pipeline. A .flow program's own mesh applies when no --mesh is given,
    and its placements are constraints like --sbp (which wins for the same value). Every
    option is checked here, before the slow work."""
    if par.pipeline is not None:
        return _pipeline_target(model, par)
    alone = [
        o
        for o, given in (
            ("--microbatches", par.microbatches != 1),
            ("--stage-boundary", par.stage_boundary is not None),
            ("--pipeline-schedule", par.pipeline_schedule is not None),
        )
        if given
    ]
    if alone:
        raise InputError(f"{', '.join(alone)} need{'s' if len(alone) == 1 else ''} --pipeline P")
    m = parse_mesh(par.mesh) if par.mesh is not None else None
    program_mesh, placed = None, False
    if model.path.suffix.lower() == ".flow":
        graph = _program_graph(model)
        program_mesh = graph.mesh
        placed = any(v.sbp is not None for v in graph.values())
    if m is None:
        m = program_mesh
    if m is None:
        given = [o for o, v in (("--sbp", par.sbps), ("--mem-limit", par.mem_limit)) if v]
        if par.parallel != "auto":
            given.append("--parallel")
        if par.cost_profile is not None:
            given.append("--cost-profile")
        if par.search_nodes is not None:
            given.append("--search-nodes")
        if given:
            raise InputError(
                f"{', '.join(given)} need{'s' if len(given) == 1 else ''} --mesh",
                hint="e.g. --mesh 4 or --mesh 2x2 (or a mesh declaration in the program)",
            )
        return None
    if placed and program_mesh is not None and program_mesh.shape != m.shape:
        shape = dims_text(program_mesh.shape)
        raise InputError(
            f"{model.path}: its placements are for mesh {shape}, but --mesh is "
            f"{dims_text(m.shape)}",
            hint=f"use --mesh {shape}, or remove the program's @ annotations",
        )
    fixed = dict(parse_sbp(t, m) for t in par.sbps)
    if m.size == 1:
        # One device: every layout is whole; the program is the ordinary one.
        return None
    # The program's own placements are on its values (Value.sbp): place() adds them under
    # these, from the graph the passes leave (a placed value is kept as it is).
    limit = parse_bytes(par.mem_limit, "--mem-limit") if par.mem_limit is not None else None
    return ParallelOptions(
        m, par.parallel, fixed, limit, par.cost_profile, node_limit=par.search_nodes
    )


def _pipeline_target(model: ModelArgs, par: ParallelArgs) -> PipelineSpec:
    """A PipelineSpec from --pipeline P [--mesh PxK] [--microbatches M] [--stage-boundary]
    [--sbp ...: layouts on each stage's K devices]."""
    assert par.pipeline is not None
    stages = int(par.pipeline)
    if par.mesh is not None:
        m = parse_mesh(par.mesh)
    else:
        program_mesh = None
        if model.path.suffix.lower() == ".flow":
            program_mesh = _program_graph(model).mesh
        m = program_mesh or Mesh("gpus", (stages,))
    text = par.stage_boundary
    spec = PipelineSpec(
        stages,
        m,
        microbatches=int(par.microbatches),
        boundaries=parse_stage_boundaries(text) if text is not None else None,
        mem_limit=parse_bytes(par.mem_limit, "--mem-limit") if par.mem_limit is not None else None,
        schedule=par.pipeline_schedule,
    )
    check_pipeline_mesh(spec)
    per_stage = math.prod(m.shape[1:])
    if par.sbps and per_stage == 1:
        raise InputError(
            f"--sbp with --pipeline {stages} on mesh {dims_text(m.shape)}: each stage runs on "
            "one device, so every value is whole there",
            hint=f"give each stage devices to split over, e.g. --mesh {stages}x2",
        )
    if per_stage > 1:
        stage_mesh = Mesh("stage", m.shape[1:])
        # --sbp layouts are on the stage mesh (the axes after the pipeline axis); each stage
        # takes those of the values it holds.
        fixed = dict(parse_sbp(t, stage_mesh) for t in par.sbps)
        spec.stage_options = ParallelOptions(
            stage_mesh, par.parallel, fixed, None, par.cost_profile, node_limit=par.search_nodes
        )
    elif par.cost_profile is not None:
        spec.stage_options = ParallelOptions(
            Mesh("stage", (1,)), "none", {}, None, par.cost_profile
        )
    return spec


def place(
    graph: Graph,
    popts: ParallelOptions,
    times: StageTimes | None = None,
    progress: Progress = _quiet,
) -> Parallelized:
    """The placement of ``graph`` (after ``pass_list``) on ``popts.mesh``: the plan, the
    rank graph, its cost and memory."""
    times = StageTimes() if times is None else times
    verify_graph(graph)
    program = {v.name: v.sbp for v in graph.values() if v.sbp is not None}
    if program and popts.method != "none":
        # A program's placements bind the search like --sbp, which wins for the same value
        # (`none` keeps every value whole: they do not apply).
        popts = dataclasses.replace(popts, sbp={**program, **popts.sbp})
    progress(
        f"placing {len(graph.nodes)} nodes on mesh {dims_text(popts.mesh.shape)} ({popts.method})"
    )
    t0 = time.perf_counter()
    result = times.run("parallel placement", lambda: parallelize(graph, popts))
    progress(f"plan ready in {time.perf_counter() - t0:.2f} s")
    return result


def simulate_ranks(result: Parallelized, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Every rank of ``result``'s program in the multi-rank NumPy simulator (collectives
    simulated); the whole outputs, in the graph's order."""
    return simulate(result.physical, feeds)


def stage_profile(spec: PipelineSpec) -> Profile:
    """The cost profile a pipeline's stages are scheduled with."""
    return workspace_within(
        load_profile(spec.stage_options.profile if spec.stage_options else None), spec.mem_limit
    )


def compile_model(
    opts: CompileOptions,
    project: Path,
    *,
    target: Target | str = "from options",
    progress: Progress = _quiet,
    dump: Dump | None = None,
    times: StageTimes | None = None,
) -> Compiled | CompiledPipeline:
    """The whole road for one options record: load and run ``pass_list``, then (on a mesh)
    placement or (with --pipeline) the stage partition and placements, then schedule,
    memory, code generation, and OUT/ written as one transaction. ``target``: what
    placement_target gave, when the caller checked the options before."""
    sch = opts.schedule
    times = StageTimes() if times is None else times
    popts = placement_target(opts.model, opts.parallel) if isinstance(target, str) else target
    if isinstance(popts, PipelineSpec) and sch.schedule_for != "latency":
        raise InputError(
            "--schedule-for memory with --pipeline: a pipeline's stages are scheduled for "
            "latency only (the micro-batches of a stage overlap by design)",
            hint="leave out --schedule-for, or compile without --pipeline",
        )
    graph = load_model(
        opts.model,
        precision=sch.precision,
        placed=is_placed(popts),
        on_mesh=isinstance(popts, ParallelOptions),
        times=times,
        dump=dump,
    )
    if isinstance(popts, PipelineSpec) and any(r.computed for r in graph.symbols.values()):
        raise InputError(
            "a data-dependent output's count ("
            + ", ".join(s for s, r in graph.symbols.items() if r.computed)
            + ") is for one device for now: a later stage would not know the count",
            hint="compile it for one device",
        )
    if (
        isinstance(popts, PipelineSpec)
        and graph.symbols
        and (popts.microbatches > 1 or math.prod(popts.mesh.shape[1:]) > 1)
    ):
        raise InputError(
            f"symbolic dims ({', '.join(f'{s}={r}' for s, r in graph.symbols.items())}): a "
            "pipeline with symbolic dims runs one micro-batch on one device per stage for now "
            "(micro-batches would split the batch, stage meshes a rank graph of one size)",
            hint="leave out --microbatches and give the mesh one device per stage, or fix "
            "the dims with --dim NAME=N",
        )
    # What every kind of program is generated with.
    shared: dict[str, Any] = dict(
        source=opts.model.path.name,
        arch=opts.arch,
        build_target=opts.target,
        force=opts.force,
        times=times,
        precision=sch.precision,
    )
    if isinstance(popts, PipelineSpec):
        spec = popts
        if spec.schedule is not None:
            raise InputError(
                "--pipeline-schedule orders a training pipeline's forwards and backwards; an "
                "inference pipeline streams its micro-batches forward",
                hint="leave --pipeline-schedule out, or compile the training step (--train)",
            )
        _check_stage_layouts(graph, spec)
        progress(
            f"cutting {len(graph.nodes)} nodes into {spec.stages} pipeline stages on mesh "
            f"{dims_text(spec.mesh.shape)}, {spec.microbatches} micro-batch"
            + ("es" if spec.microbatches != 1 else "")
        )
        compiled_pipe = compile_pipeline(
            graph, project, spec, prefix=opts.prefix, streams=sch.streams, **shared
        )
        progress(compiled_pipe.partition.summary().splitlines()[0])
        return compiled_pipe
    cuda_graph = not sch.no_cuda_graph
    if popts is None:
        progress(f"generating {project}/")
        return compile_graph(
            graph,
            project,
            prefix=opts.prefix,
            streams=sch.streams,
            cuda_graph=cuda_graph,
            schedule_for=sch.schedule_for,
            **shared,
        )
    # The memory limit counts the arena of the program as compiled: the same streams.
    popts = dataclasses.replace(popts, streams=sch.streams)
    result = place(graph, popts, times, progress)
    if graph.symbols:
        # The rank graph's symbolic types: fitted like the model's (ir/fit_dims.py), from
        # the model's graph at other sizes placed by the same plan.
        probe = partial(_placed_at, graph, result)
        result.physical.graph = times.run(
            "symbolic dims on the mesh",
            lambda: annotate_symbols(result.physical.graph, dict(graph.symbols), probe),
        )
    progress(
        f"generating {project}/ for {popts.mesh.size} ranks "
        f"({result.memory.total} bytes per device)"
    )
    return compile_graph(
        result.physical.graph,
        project,
        prefix=opts.prefix or c_ident(graph.name)[:MAX_PREFIX],
        physical=result.physical,
        streams=popts.stream_count(),
        cuda_graph=cuda_graph,
        profile=result.profile,  # the one the memory limit was measured with
        schedule_for=sch.schedule_for,
        **shared,
    )


def _placed_at(graph: Graph, result: Parallelized, sizes: dict[str, int]) -> Graph:
    """The rank graph of ``graph`` (with symbolic dims) at ``sizes``, placed by
    ``result``'s plan (each node's strategy and each value's layout), lowered and fused as
    place() does."""
    at = at_sizes(graph, sizes)
    plan = result.plan
    values = {v.name: v for v in at.values()}
    placed = dataclasses.replace(
        plan,
        node_strategy={
            n: plan.node_strategy[b]
            for b, n in zip(graph.nodes, at.nodes, strict=True)
            if b in plan.node_strategy
        },
        value_sbp={values[v.name]: s for v, s in plan.value_sbp.items()},
    )
    return fuse_elementwise(lower(at, placed, result.profile).graph)


def _check_stage_layouts(graph: Graph, spec: PipelineSpec) -> None:
    """--sbp with --pipeline names values of the model: a name no stage holds is a typo."""
    if spec.stage_options is None or not spec.stage_options.sbp:
        return
    names = {v.name for v in graph.values()}
    for name in spec.stage_options.sbp:
        if name not in names:
            raise InputError(
                f"--sbp {name}=...: the graph has no value named {name!r}",
                hint="`flowc inspect MODEL --print-ir` lists the value names",
            )


def simulate_pipeline_order(
    stages: int, microbatches: int, forward_s: list[float], order: str
) -> PipelineRun:
    """The micro-batch order ``order`` ("gpipe" or "1f1b") fired over the stages' modeled
    forward times. Inference graphs have no backward: 1F1B is simulated on a synthetic
    backward of twice the forward, as a training step's would roughly be."""
    if order == "1f1b":
        return simulate_order(
            one_f_one_b(stages, microbatches),
            microbatches,
            forward_s,
            [2 * f for f in forward_s],
        )
    return simulate_order(gpipe(stages, microbatches), microbatches, forward_s)


# -- training ----------------------------------------------------------------------------------

# Before the loss and its backward: the import clean-up and the lowerings; after: the GEMM
# epilogues (the backward's among them) and the element-wise fusion of the whole step.
TRAIN_PRE_PASSES = (*DEFAULT_PIPELINE, "lower_ops")
# lower_ops again: the loss's SoftmaxCrossEntropy, which build_step adds, has no kernel.
TRAIN_POST_PASSES = (
    *DEFAULT_PIPELINE,
    "lower_ops",
    "fuse_gemm",
    "fuse_elementwise",
    "order_state_writes",
)
# The fusions whose ops have VJP rules, run on the model before the step is built.
TRAIN_FUSIONS = ("fuse_gelu", "fuse_attention")
# Mixed precision: the storage pass on the model before the step is built (activations and
# their gradients narrow, the parameters' float32 master copies cast at their use), then
# widen_types after: what is not a GEMM or a convolution computes in float32.
NARROW_TRAIN_POST_PASSES = (
    *DEFAULT_PIPELINE,
    "lower_ops",
    "widen_types",
    "fuse_gemm",
    "fuse_elementwise",
    "order_state_writes",
)


def train_post_passes(precision: str) -> tuple[str, ...]:
    return NARROW_TRAIN_POST_PASSES if precision in STORAGE_PASS else TRAIN_POST_PASSES


def step_arena(graph: Graph, precision: str = "fp32") -> int:
    """The arena of a training step (``graph``, before its fusions; left as it is) as
    compile_step compiles it: fused, in the order of least peak memory, planned."""
    fused = PassManager(train_post_passes(precision)).run(graph.copy())
    return plan_schedule(schedule_graph(fused, schedule_for="memory")).arena_bytes


def _recompute(step: TrainingStep, spec: TrainSpec) -> RecomputeReport:
    """--recompute and --mem-limit on the step: the limit covers the state and constants
    (fixed) and the arena, which recomputation shrinks; auto measures candidate choices by
    compiling them (step_arena)."""
    graph = step.graph
    fixed = sum(v.type.nbytes for v in graph.inputs) + sum(c.type.nbytes for c in graph.constants)
    limit = None if spec.mem_limit is None else spec.mem_limit - fixed
    if limit is not None and limit <= 0:
        raise InputError(
            f"--mem-limit {spec.mem_limit:,} B: the step's state, batch and constants alone "
            f"take {fixed:,} B",
            hint="raise --mem-limit or lower --batch",
        )

    def arena_of(indices: set[int]) -> int:
        g = graph.copy()
        recompute_apply(g, {g.nodes[k] for k in indices})
        return step_arena(g, spec.precision)

    def fused_saved(g: Graph) -> int:
        return saved_bytes(PassManager(train_post_passes(spec.precision)).run(g))

    before = graph.copy() if spec.recompute != "none" else None
    report = recompute(graph, spec.recompute, arena_limit=limit, arena_of=arena_of)
    if before is not None:
        # As compiled: the fusions merge element-wise chains, and what they keep.
        report.saved_before, report.saved_after = fused_saved(before), fused_saved(graph.copy())
    if limit is not None and spec.recompute != "auto":
        report.arena_after = step_arena(graph, spec.precision)
        if report.arena_after > limit:
            raise InputError(
                f"--mem-limit {spec.mem_limit:,} B: the step needs {fixed + report.arena_after:,} B "
                f"({fixed:,} of state, batch and constants, {report.arena_after:,} of arena)",
                hint="--recompute auto finds what to recompute to fit; or raise --mem-limit",
            )
    return report


def load_training(
    model: ModelArgs,
    spec: TrainSpec,
    *,
    batch: int | None = None,
    times: StageTimes | None = None,
) -> TrainingStep:
    """MODEL as a training step under ``spec``: imported with its initializers as
    parameters (a .flow program's float constants likewise), cleaned up, the loss, the
    backward and the update added, then the element-wise fusion. ``batch`` binds axis 0 of
    every model input."""
    times = StageTimes() if times is None else times
    opts = ImportOptions(
        shapes=parse_shapes(model.shapes),
        dims=parse_dim_values(model.dims),
        weights=model.weights,
        trainable=True,
        batch=batch,
    )
    graph = times.run("import", lambda: load_graph(model.path, opts))
    if graph.state:
        raise InputError(
            f"{model.path.name} is a training step already (it declares state)",
            hint=f"compile it as it is: flowc compile {model.path.name} -o OUT",
        )
    for v in graph.values():
        v.sbp = None
    if model.path.suffix.lower() == ".flow":
        if batch is not None and any(
            v.type.rank == 0 or v.type.shape[0] != batch for v in graph.inputs
        ):
            raise InputError(
                f"--batch {batch}: {model.path.name}'s inputs have their own batch "
                f"({', '.join(f'{v.name}: {list(v.type.shape)}' for v in graph.inputs)})",
                hint="a .flow program's types are static: edit them, or leave --batch out",
            )
        make_trainable(graph)
    graph = PassManager(TRAIN_PRE_PASSES).run(graph)
    # Attention fused before the backward exists: its VJP is the flash-style backward
    # (FusedAttentionGrad), which keeps no [Sq, Sk] probabilities for it.
    graph = PassManager(TRAIN_FUSIONS).run(graph)
    if spec.precision in STORAGE_PASS:
        graph = PassManager([STORAGE_PASS[spec.precision]]).run(graph)
    step = times.run("training step", lambda: build_step(graph, spec))
    step.recompute = times.run("recompute", lambda: _recompute(step, spec))
    step.graph = PassManager(train_post_passes(spec.precision)).run(step.graph)
    # run() of the training program: the forward alone, with the inference fusions.
    step.inference = times.run(
        "inference program", lambda: PassManager(compile_passes()).run(inference_graph(step))
    )
    return step
