"""The cost model of a parallel plan: compute, memory traffic and collectives on one machine.

Times come from a profile (a TOML file, see profiles/h200-nvlink.toml): a node runs for
max(local FLOPs / rate, local bytes / memory bandwidth) plus a launch overhead; a collective
along a mesh axis costs alpha + bytes sent per rank / link bandwidth (the alpha-beta model);
the local boxing steps (slicing, zeroing for B -> P) are small memory-bound kernels.
"""

from __future__ import annotations

import functools
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowc.errors import InputError
from flowc.ir.graph import Graph, Node, Value
from flowc.ir.layout import carried_type, local_type
from flowc.ir.types import Mesh, NdSbp, TensorType
from flowc.ops.registry import get_op
from flowc.parallel.boxing import (
    B_TO_P,
    LOCAL_SLICE,
    BoxingError,
    BoxingStep,
    Tree,
    checked_path,
    shortest_paths,
)
from flowc.parallel.plan import Plan
from flowc.parallel.strategies import Strategy

PROFILE_DIR = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = PROFILE_DIR / "h200-nvlink.toml"

# Ops whose FLOPs run on the matrix units (the profile's [matmul] rates).
MATMUL_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose"})
# flowc.ops.comm.COLLECTIVES, spelled out (that module imports code generation).
COLLECTIVE_OPS = frozenset({"AllReduce", "AllGather", "ReduceScatter", "AllToAll"})


@dataclass(frozen=True)
class Link:
    """The alpha-beta parameters of collectives along one mesh axis."""

    alpha: float  # seconds per collective
    bandwidth: float  # bytes per second one rank sends


@dataclass(frozen=True)
class Profile:
    # Hashable (the tables are left out of the hash) so boxing costs can be cached per profile.
    name: str
    compute: Mapping[str, float] = field(hash=False)  # FLOP/s of non-GEMM work per dtype
    matmul: Mapping[str, float] = field(hash=False)  # FLOP/s of GEMM-like work per dtype
    memory_bandwidth: float  # bytes read + written per second
    launch_overhead: float  # seconds per kernel
    link: Link  # collectives along any mesh axis without an override
    mesh_axis: Mapping[int, Link] = field(default_factory=dict, hash=False)
    # The device as the schedule's simulator shares it between concurrent kernels: its
    # streaming multiprocessors, the 256-thread blocks one SM holds at once, and what one
    # cross-stream event (record + wait) costs.
    sms: int = 132
    blocks_per_sm: int = 8
    event_overhead: float = 2e-6
    # Bytes of scratch each stream that calls cuBLASLt or cuDNN gets (one planned arena buffer
    # per stream, shared by both libraries): 32 MiB is cuBLAS's recommendation for Hopper.
    workspace: int = 32 << 20

    def flop_rate(self, dtype: str, matmul: bool) -> float:
        table = self.matmul if matmul else self.compute
        return table.get(dtype, table["default"])

    def axis_link(self, axis: int) -> Link:
        return self.mesh_axis.get(axis, self.link)


# What a profile's numbers may be. Rates (FLOP/s, bytes/s) and times (seconds) far past any
# machine's keep every modeled time finite and ordered (a rate of 1e-300 or a time of 1e308
# overflows sums to inf, and the schedule's simulation cannot order infinite times); the
# counts are whole numbers the simulator divides by, the workspace a byte count the arena
# holds per stream.
RATE_BOUNDS = (1.0, 1e21)
SECONDS_BOUNDS = (1e-12, 3600.0)
MAX_SMS = 1 << 16
MAX_BLOCKS_PER_SM = 1 << 10
MAX_WORKSPACE = 1 << 40


def load_profile(path: str | Path | None = None) -> Profile:
    """Read a cost profile; None gives the shipped H200 NVLink profile."""
    p = Path(path) if path is not None else DEFAULT_PROFILE
    hint = f"start from the shipped profile {DEFAULT_PROFILE}"
    try:
        data = tomllib.loads(p.read_text())
    except OSError as e:
        raise InputError(f"cannot read cost profile {p}: {e.strerror or e}", hint=hint) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"cost profile {p} is not valid TOML: {e}", hint=hint) from None
    return _parse_profile(data, p, hint)


def _parse_profile(data: dict[str, Any], path: Path, hint: str) -> Profile:
    def table(key: str) -> dict[str, Any]:
        t = data.get(key)
        if not isinstance(t, dict):
            raise InputError(f"cost profile {path}: missing table [{key}]", hint=hint)
        return t

    def number(t: dict[str, Any], key: str, where: str, bounds: tuple[float, float]) -> float:
        v = t.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InputError(
                f"cost profile {path}: [{where}] needs a number {key!r}"
                + ("" if v is None else f", got {v!r}"),
                hint=hint,
            )
        lo, hi = bounds
        if not lo <= v <= hi:  # nan too
            raise InputError(
                f"cost profile {path}: [{where}] {key} must be a number from {lo:g} to {hi:g}, "
                f"got {v:g}",
                hint=hint,
            )
        return float(v)

    def whole(t: dict[str, Any], key: str, where: str, lo: int, hi: int, unit: str) -> int:
        # A count is not rounded: sms = 0.5 is a mistake, not 0 (or 1) SMs.
        v = t[key]
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise InputError(
                f"cost profile {path}: [{where}] {key} must be a whole number of {unit} from "
                f"{lo} to {hi}, got {v!r}",
                hint=hint,
            )
        return v

    def rates(key: str) -> dict[str, float]:
        t = table(key)
        number(t, "default", key, RATE_BOUNDS)
        return {k: number(t, k, key, RATE_BOUNDS) for k in t}

    def link(t: dict[str, Any], where: str) -> Link:
        return Link(
            number(t, "alpha", where, SECONDS_BOUNDS), number(t, "bandwidth", where, RATE_BOUNDS)
        )

    compute, matmul = rates("compute"), rates("matmul")
    memory = table("memory")
    overrides = data.get("mesh_axis", {})
    if not isinstance(overrides, dict):
        raise InputError(f"cost profile {path}: mesh_axis must be a table", hint=hint)
    axes: dict[int, Link] = {}
    for k, t in overrides.items():
        if not (k.isascii() and k.isdigit() and len(k) <= 9) or not isinstance(t, dict):
            raise InputError(
                f"cost profile {path}: [mesh_axis.{k}] must be a table named by a mesh axis "
                "number, e.g. [mesh_axis.0]",
                hint=hint,
            )
        axes[int(k)] = link(t, f"mesh_axis.{k}")
    device = data.get("device", {})
    if not isinstance(device, dict):
        raise InputError(f"cost profile {path}: [device] must be a table", hint=hint)
    extra: dict[str, Any] = {}
    if "sms" in device:
        extra["sms"] = whole(device, "sms", "device", 1, MAX_SMS, "streaming multiprocessors")
    if "blocks_per_sm" in device:
        extra["blocks_per_sm"] = whole(
            device, "blocks_per_sm", "device", 1, MAX_BLOCKS_PER_SM, "blocks"
        )
    if "workspace" in device:
        extra["workspace"] = whole(device, "workspace", "device", 0, MAX_WORKSPACE, "bytes")
    if "event_overhead" in device:
        extra["event_overhead"] = number(device, "event_overhead", "device", SECONDS_BOUNDS)
    return Profile(
        **extra,
        name=str(data.get("name", path.stem)),
        compute=compute,
        matmul=matmul,
        memory_bandwidth=number(memory, "bandwidth", "memory", RATE_BOUNDS),
        launch_overhead=number(memory, "launch_overhead", "memory", SECONDS_BOUNDS),
        link=link(table("collective"), "collective"),
        mesh_axis=axes,
    )


def memory_time(nbytes: int, profile: Profile) -> float:
    """One memory-bound kernel moving ``nbytes`` (read plus written)."""
    return profile.launch_overhead + nbytes / profile.memory_bandwidth


def step_time(step: BoxingStep, profile: Profile, ttype: TensorType, mesh: Mesh) -> float:
    """One boxing step of a ``ttype`` tensor: a collective's alpha-beta time, or the small
    kernel of a local step (a slice reads and writes the new shard; B -> P zeroes it on all
    ranks but one)."""
    if step.collective == LOCAL_SLICE:
        return memory_time(2 * local_type(ttype, step.dst, mesh).nbytes, profile)
    if step.collective == B_TO_P:
        return memory_time(local_type(ttype, step.dst, mesh).nbytes, profile)
    link = profile.axis_link(step.mesh_axis)
    return link.alpha + step.bytes_per_rank / link.bandwidth


@functools.lru_cache(maxsize=1 << 14)
def _paths_from(ttype: TensorType, mesh: Mesh, src: NdSbp, profile: Profile) -> Tree:
    # One Dijkstra per (type, source layout) serves every target the search asks about.
    return shortest_paths(ttype, mesh, src, lambda s: step_time(s, profile, ttype, mesh))


@functools.lru_cache(maxsize=1 << 16)
def boxing_plan(
    ttype: TensorType, mesh: Mesh, src: NdSbp, dst: NdSbp, profile: Profile
) -> tuple[BoxingStep, ...]:
    """The cheapest steps from ``src`` to ``dst`` under ``profile`` (a narrow partial sum
    priced at the float32 bytes it is carried in)."""
    ttype = carried_type(ttype, src)
    return tuple(
        checked_path(ttype, mesh, src, dst, lambda: _paths_from(ttype, mesh, src, profile))
    )


@functools.lru_cache(maxsize=1 << 16)
def boxing_time(ttype: TensorType, mesh: Mesh, src: NdSbp, dst: NdSbp, profile: Profile) -> float:
    """Seconds to turn layout ``src`` into ``dst``; inf when no sequence of steps does."""
    try:
        steps = boxing_plan(ttype, mesh, src, dst, profile)
    except BoxingError:
        return math.inf
    ttype = carried_type(ttype, src)
    return sum(step_time(s, profile, ttype, mesh) for s in steps)


def node_time(node: Node, strategy: Strategy, mesh: Mesh, profile: Profile) -> float:
    """Seconds one rank spends on ``node`` under ``strategy``.

    FLOPs come from the op's own count on the local types, so a rank's share of the work
    follows from its shard sizes: an output split p ways is 1/p of the work, and so is a
    contraction split p ways into partial sums; a P operand is full-shape, hence full work.
    """
    opdef = get_op(node.op)
    if opdef.view:
        return 0.0
    ins: list[TensorType | None] = []
    for i, v in enumerate(node.inputs):
        sbp = strategy.input(i)
        ins.append(None if v is None or sbp is None else local_type(v.type, sbp, mesh))
    outs = [local_type(o.type, strategy.output(j), mesh) for j, o in enumerate(node.outputs)]
    flops = 0
    if opdef.flops is not None:
        flops = int(opdef.flops(ins, outs, node.attrs.merged(opdef.attrs)))
    nbytes = sum(t.nbytes for t in ins if t is not None) + sum(t.nbytes for t in outs)
    dtype = next((t.dtype for t in ins if t is not None), outs[0].dtype)
    rate = profile.flop_rate(dtype.short, node.op in MATMUL_OPS)
    return max(flops / rate, nbytes / profile.memory_bandwidth) + profile.launch_overhead


def kernel_time(node: Node, profile: Profile) -> float:
    """Seconds one device spends on ``node`` of a rank's graph, alone on the device (types
    are local already; a view is free)."""
    opdef = get_op(node.op)
    if opdef.view:
        return 0.0
    if node.op in COLLECTIVE_OPS:
        return collective_time(node, profile)
    if node.op == "Exchange":
        # A training pipeline's transfers over the pipeline axis: one alpha for the group.
        link = profile.axis_link(0)
        moved = sum(v.type.nbytes for v in [*node.inputs, *node.outputs] if v is not None)
        return link.alpha + moved / link.bandwidth
    ins = [v.type if v is not None else None for v in node.inputs]
    outs = [o.type for o in node.outputs]
    flops = opdef.count_flops(node) if opdef.flops is not None else 0
    nbytes = sum(t.nbytes for t in ins if t is not None) + sum(t.nbytes for t in outs)
    dtype = next((t.dtype for t in ins if t is not None), outs[0].dtype if outs else None)
    rate = profile.flop_rate(dtype.short if dtype is not None else "default", node.op in MATMUL_OPS)
    return max(flops / rate, nbytes / profile.memory_bandwidth) + profile.launch_overhead


def collective_time(node: Node, profile: Profile) -> float:
    """Alpha-beta time of a collective node of a rank's graph: ring algorithms send
    (p-1)/p of the buffer per rank, twice for an all-reduce; a bucket (an all-reduce of
    several parts) pays one alpha for all of them."""
    mesh = node.attrs.get("mesh") or (1,)
    axis = int(node.attrs.get("mesh_axis", 0))
    p = int(mesh[axis]) if 0 <= axis < len(mesh) else 1
    nbytes = sum(
        max(x.type.nbytes if x is not None else 0, y.type.nbytes)
        for x, y in zip(node.inputs, node.outputs, strict=True)
    )
    share = (p - 1) / p if p > 1 else 0.0
    sent = nbytes * share * (2 if node.op == "AllReduce" else 1)
    link = profile.axis_link(axis)
    return link.alpha + sent / link.bandwidth


def device_share(node: Node, profile: Profile) -> float:
    """The fraction of the device ``node``'s kernel can occupy alone: its blocks (one per 256
    elements of its largest output, the grid-stride launch flowc emits) against what the
    SMs hold at once. Concurrent kernels whose shares sum past 1 slow each other down."""
    if node.op in COLLECTIVE_OPS:
        return 0.1  # NCCL uses a few SMs' worth of channels
    numel = max((o.type.numel for o in node.outputs), default=0)
    if node.op in MATMUL_OPS:
        numel = max(numel, 1) * 4  # library kernels tile the output and split K
    blocks = max(1, -(-numel // 256))
    return min(1.0, blocks / (profile.sms * profile.blocks_per_sm))


@dataclass
class PlanCost:
    """The modeled time of a plan on one rank and what it stores.

    ``boxing`` lists every step as (value, consumer node or None for the graph output, step);
    a value boxed to one layout for several consumers is boxed once, listed under the first.
    """

    compute_s: float
    comm_s: float
    param_bytes: int  # per rank: every stored value's local bytes under its layout (stored())
    boxing: list[tuple[Value, Node | None, BoxingStep]]

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


def value_targets(graph: Graph, plan: Plan) -> dict[Value, list[tuple[NdSbp, Node | None]]]:
    """For every value, the distinct layouts its consumers want other than the one it is
    produced in, each with the first consumer wanting it (None: a graph output, made B)."""
    out: dict[Value, list[tuple[NdSbp, Node | None]]] = {}

    def want(v: Value, sbp: NdSbp, who: Node | None) -> None:
        targets = out.setdefault(v, [])
        if sbp != plan.value_sbp[v] and all(sbp != t for t, _ in targets):
            targets.append((sbp, who))

    for node in graph.nodes:
        for i, v in enumerate(node.inputs):
            sbp = plan.wanted(node, i)
            if v is not None and sbp is not None:
                want(v, sbp, node)
    for v in graph.outputs:
        want(v, plan.leaves_as(graph, v), None)
    return out


def evaluate_plan(graph: Graph, plan: Plan, profile: Profile) -> PlanCost:
    mesh = plan.mesh
    compute = sum(node_time(n, plan.node_strategy[n], mesh, profile) for n in graph.nodes)
    comm = 0.0
    boxing: list[tuple[Value, Node | None, BoxingStep]] = []
    for v, targets in value_targets(graph, plan).items():
        for sbp, who in targets:
            carried = carried_type(v.type, plan.value_sbp[v])
            for step in boxing_plan(v.type, mesh, plan.value_sbp[v], sbp, profile):
                comm += step_time(step, profile, carried, mesh)
                boxing.append((v, who, step))
    params = sum(local_type(c.type, plan.value_sbp[c], mesh).nbytes for c in stored(graph))
    return PlanCost(compute, comm, params, boxing)


def stored(graph: Graph) -> list[Value]:
    """What a rank keeps in its weights buffer: the constants, and the state a training
    step carries from step to step (parameters, optimizer state), both as placed."""
    return [*graph.constants, *(v for v in graph.inputs if v.name in graph.state)]
