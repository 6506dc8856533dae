"""Communication ops: what boxing lowers to in a rank's (physical) graph.

The four collectives work on the group of devices along one mesh axis with NCCL's
contiguous-buffer semantics, over a leading "member" axis of size p (the group size):

- ``AllReduce(x)``: every member gets the sum of all members' x. With several inputs (a
  bucket, flowc.parallel.buckets) output i is input i's sum, all of them one collective
  step: one NCCL group on the GPU, one packed MPI call on the host, one latency.
- ``AllGather(x)``: out[k] = member k's x; out has shape [p, *x.shape].
- ``ReduceScatter(x)``: x has shape [p, *rest]; member k gets the sum over members of x[k].
- ``AllToAll(x)``: x has shape [p, *rest]; out[m] on member k = member m's x[k].

Boxing along a tensor axis other than the first wraps these in Reshape/Transpose nodes (see
flowc.parallel.lower), so the wire format is always contiguous. Two local ops depend on the
device's coordinate along the mesh axis: ``ShardSlice`` keeps chunk k of a tensor axis (B to
S), ``ShardZero`` keeps x on coordinate 0 and zeros elsewhere (B to P).

Every comm op has the attributes ``mesh`` (the mesh shape) and ``mesh_axis``. The
collectives have no per-rank reference (they need every member's data): the NumPy
simulator (flowc.parallel.simulate) runs them; the local ops read the device's coordinates
from the ``coords`` attribute the simulator adds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from flowc.codegen.cpp import c_int
from flowc.errors import FlowcError
from flowc.ir.graph import Attrs
from flowc.ir.types import TensorType
from flowc.ops.registry import InferCtx, defop, first

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.graph import Node

FAMILY = "comm"
COMM_ATTRS = {"mesh": None, "mesh_axis": 0}
COLLECTIVES = ("AllReduce", "AllGather", "ReduceScatter", "AllToAll")


def group_size(ctx: InferCtx | Attrs) -> int:
    attrs = ctx.attrs if isinstance(ctx, InferCtx) else ctx
    mesh = attrs["mesh"]
    axis = int(attrs["mesh_axis"])
    if mesh is None or not 0 <= axis < len(mesh):
        raise ValueError(f"mesh axis {axis} is not an axis of mesh {mesh}")
    return int(mesh[axis])


def _collective_ref(xs: list[np.ndarray | None], attrs: Attrs) -> np.ndarray:
    raise FlowcError(
        "a collective needs every device's data, so one device's reference cannot run it",
        hint="evaluate the parallel program with `flowc eval MODEL --mesh ...` (the "
        "multi-rank simulator)",
    )


def _same_infer(ctx: InferCtx) -> list[TensorType]:
    group_size(ctx)
    return [ctx.type(0)]


def _gather_infer(ctx: InferCtx) -> list[TensorType]:
    p = group_size(ctx)
    t = ctx.type(0)
    return [t.with_shape((p, *t.shape))]


def _stacked_infer(ctx: InferCtx) -> list[TensorType]:
    p = group_size(ctx)
    t = ctx.type(0)
    if not t.shape or t.shape[0] != p:
        raise ctx.fail(f"input shape {list(t.shape)} must start with the group size {p}")
    return [t.with_shape(t.shape[1:])]


def _all_to_all_infer(ctx: InferCtx) -> list[TensorType]:
    p = group_size(ctx)
    t = ctx.type(0)
    if not t.shape or t.shape[0] != p:
        raise ctx.fail(f"input shape {list(t.shape)} must start with the group size {p}")
    return [t]


def _bucket_infer(ctx: InferCtx) -> list[TensorType]:
    group_size(ctx)
    types = [ctx.type(i) for i in range(ctx.num_inputs)]
    if any(t.dtype != types[0].dtype for t in types):
        raise ctx.fail("the parts of an all-reduce bucket are of one element type")
    return types


def _emit_bucket(prog: Program, node: Node) -> None:
    parts = []
    for x, y in zip(node.inputs, node.outputs, strict=True):
        assert x is not None
        parts.append({"src": prog.cptr_void(x), "dst": prog.ptr_void(y), "count": y.type.numel})
    x0 = node.inputs[0]
    assert x0 is not None
    prog.call(
        "comm.cu.j2",
        "bucket",
        f"{node.op} {node.name}",
        axis=int(node.attrs["mesh_axis"]),
        parts=parts,
        dtype=x0.type.dtype.onnx,
        stream=prog.stream,
    )


def _elements(prog: Program, t: TensorType) -> int | str:
    """The elements a transfer of ``t`` moves: its count, or with symbolic dims (never the
    split ones) the run's, packed, as host C++ (the stacked axis of a gather or scatter is
    the first, of fixed size)."""
    return t.numel if t.sym is None else prog.numel(t)


def _emit_collective(prog: Program, node: Node) -> None:
    if node.op == "AllReduce" and len(node.inputs) > 1:
        if prog.is_sized(node):
            raise prog.fail("an all-reduce bucket of tensors with symbolic dims has no kernel")
        _emit_bucket(prog, node)
        return
    x, y = node.inputs[0], node.outputs[0]
    assert x is not None
    attrs = node.attrs
    ways = group_size(attrs)
    sent = _elements(prog, x.type)
    fn: dict[str, tuple[str, int | str]] = {
        "AllReduce": ("all_reduce", _elements(prog, y.type)),
        "AllGather": ("all_gather", sent),
        "ReduceScatter": ("reduce_scatter", _elements(prog, y.type)),
        "AllToAll": ("all_to_all", sent // ways if isinstance(sent, int) else f"{sent} / {ways}"),
    }
    prog.call(
        "comm.cu.j2",
        "collective",
        f"{node.op} {node.name}",
        fn=fn[node.op][0],
        axis=int(attrs["mesh_axis"]),
        src=prog.cptr_void(x),
        dst=prog.ptr_void(y),
        count=fn[node.op][1],
        dtype=x.type.dtype.onnx,
        stream=prog.stream,
    )


# An all-reduce bucket's parts: as many as a step has gradients (the counts are NCCL's and
# MPI's, not a kernel's parameters).
MAX_BUCKET_PARTS = 4096

for _name, _infer, _arity in (
    ("AllReduce", _bucket_infer, (1, MAX_BUCKET_PARTS)),
    ("AllGather", _gather_infer, (1, 1)),
    ("ReduceScatter", _stacked_infer, (1, 1)),
    ("AllToAll", _all_to_all_infer, (1, 1)),
):
    defop(
        _name,
        FAMILY,
        infer=_infer,
        reference=_collective_ref,
        attrs=COMM_ATTRS,
        emit=_emit_collective,
        inputs=_arity,
        outputs=_arity,
        sized=True,
    )


# -- local, coordinate-dependent ops -----------------------------------------------------------


def _shard_slice_infer(ctx: InferCtx) -> list[TensorType]:
    p = group_size(ctx)
    t = ctx.type(0)
    axis = ctx.axis(int(ctx.attr("axis")), t.rank)
    if t.shape[axis] % p:
        raise ctx.fail(f"axis {axis} of size {t.shape[axis]} does not split into {p} equal parts")
    shape = list(t.shape)
    shape[axis] //= p
    return [t.with_shape(tuple(shape))]


def _coord(attrs: Attrs) -> int:
    coords = attrs.get("coords")
    if coords is None:
        raise ValueError("this op depends on the device's coordinates (attribute coords)")
    return int(coords[int(attrs["mesh_axis"])])


def _shard_slice_ref(xs: list[np.ndarray | None], attrs: Attrs) -> np.ndarray:
    x = first(xs)
    axis = int(attrs["axis"]) % x.ndim
    size = x.shape[axis] // group_size(attrs)
    k = _coord(attrs)
    return np.array(np.take(x, range(k * size, (k + 1) * size), axis=axis), order="C")


def _shard_zero_ref(xs: list[np.ndarray | None], attrs: Attrs) -> np.ndarray:
    x = first(xs)
    return x.copy() if _coord(attrs) == 0 else np.zeros_like(x)


def _emit_shard_slice(prog: Program, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    assert x is not None
    axis = int(node.attrs["axis"]) % x.type.rank
    outer = int(np.prod(x.type.shape[:axis], dtype=np.int64))
    inner = int(np.prod(x.type.shape[axis + 1 :], dtype=np.int64))
    local = y.type.shape[axis]
    coord = prog.mesh_coord(int(node.attrs["mesh_axis"]))
    k = prog.kernel("comm.cu.j2", "shard_slice", ctype=prog.ctype(x))
    prog.launch(
        k,
        y.type.numel,
        [
            prog.cptr(x),
            prog.ptr(y),
            c_int(outer, "int64_t"),
            c_int(local, "int64_t"),
            c_int(inner, "int64_t"),
            f"(int64_t){coord} * {c_int(local, 'int64_t')}",
            c_int(x.type.shape[axis], "int64_t"),
        ],
    )


def _emit_shard_zero(prog: Program, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    assert x is not None
    n = y.type.nbytes
    coord = prog.mesh_coord(int(node.attrs["mesh_axis"]))
    prog.emit(
        "comm.cu.j2",
        "shard_zero",
        coord=coord,
        dst=prog.ptr_void(y),
        src=prog.cptr_void(x),
        nbytes=n,
        stream=prog.stream,
    )


defop(
    "ShardSlice",
    FAMILY,
    infer=_shard_slice_infer,
    reference=_shard_slice_ref,
    attrs={**COMM_ATTRS, "axis": 0, "microbatch": 0},
    emit=_emit_shard_slice,
)
defop(
    "ShardZero",
    FAMILY,
    infer=_same_infer,
    reference=_shard_zero_ref,
    attrs=COMM_ATTRS,
    emit=_emit_shard_zero,
)


# -- point-to-point: pipeline stage boundaries -------------------------------------------------
#
# A stage boundary is one Send on the earlier stage's ranks and one Recv on the later one's:
# every value crossing the cut travels in one exchange (an NCCL group / nonblocking MPI
# calls), in the cut's order on both sides, so the two ranks always issue matching transfers.
# ``peer`` is the world-rank offset of the partner (the next stage's rank with the same
# coordinates in its stage: +k for a send, -k for a recv, k ranks per stage). When the two
# stages' layouts differ, the cut is an N:M reshard (flowc.parallel.pipeline): each input
# (output) is one piece, and ``peers`` gives per transfer the partner's world rank for each
# rank of the stage, indexed by the rank's place in it (world rank - ``base``). Both sides
# list their transfers by value, then partner, then box, so every pair of ranks issues
# matching sequences.


def _recv_infer(ctx: InferCtx) -> list[TensorType]:
    from flowc.ir.dtype import DType

    shapes, dtypes = ctx.attr("shapes"), ctx.attr("dtypes")
    if shapes is None or dtypes is None or len(shapes) != len(dtypes):
        raise ctx.fail("Recv needs matching 'shapes' and 'dtypes' attributes")
    by_code = {d.onnx: d for d in DType}
    return [
        TensorType(tuple(int(d) for d in s), by_code[int(t)])
        for s, t in zip(shapes, dtypes, strict=True)
    ]


def _send_infer(ctx: InferCtx) -> list[TensorType]:
    return []


def _p2p_ref(xs: list[np.ndarray | None], attrs: Attrs) -> np.ndarray:
    raise FlowcError(
        "a pipeline transfer needs the partner stage's data, so one device's reference cannot run it",
        hint="compare the compiled pipeline with the one-device program (flowc verify --pipeline)",
    )


def _emit_exchange(prog: Program, node: Node) -> None:
    if node.op == "Send":
        parts = [(v, "kSend") for v in node.inputs if v is not None]
    elif node.op == "Recv":
        parts = [(v, "kRecv") for v in node.outputs]
    else:
        parts = [(v, "kSend") for v in node.inputs if v is not None]
        parts += [(v, "kRecv") for v in node.outputs]
    peers = node.attrs.get("peers")
    rows = None
    offsets = None
    if node.op == "Exchange":
        # A training pipeline's exchange: each transfer's partner is this rank plus its
        # stage offset times the ranks per stage.
        k = int(node.attrs.get("ranks_per_stage", 1))
        offsets = [int(d) * k for d in [*node.attrs["send_to"], *node.attrs["recv_from"]]]
    if peers is not None:
        # A reshard: per transfer, each rank of the stage has its own partner (world ranks,
        # indexed by the rank's place in its stage), from a table fixed at compile time.
        rows = [[int(p) for p in row] for row in peers]
        if len(rows) != len(parts):
            raise AssertionError(
                f"{node.op} {node.name}: {len(rows)} peer rows, {len(parts)} transfers"
            )
    transfers = [
        {
            "kind": kind,
            "ptr": prog.ptr_void(v),
            "count": _elements(prog, v.type),
            "dtype": v.type.dtype.onnx,
        }
        for v, kind in parts
    ]
    prog.call(
        "comm.cu.j2",
        "exchange",
        f"{node.op} {node.name}",
        transfers=transfers,
        peer=int(node.attrs.get("peer", 0)),
        offsets=offsets,
        peers=rows,
        base=int(node.attrs.get("base", 0)),
        stream=prog.stream,
    )


defop(
    "Recv",
    FAMILY,
    infer=_recv_infer,
    reference=_p2p_ref,
    attrs={"peer": 0, "shapes": None, "dtypes": None, "peers": None, "base": 0},
    emit=_emit_exchange,
    sized=True,
)
defop(
    "Send",
    FAMILY,
    infer=_send_infer,
    reference=_p2p_ref,
    attrs={"peer": 0, "peers": None, "base": 0},
    emit=_emit_exchange,
    sized=True,
)


def _exchange_infer(ctx: InferCtx) -> list[TensorType]:
    sends, recvs = ctx.attr("send_to"), ctx.attr("recv_from")
    if sends is None or recvs is None or len(sends) != ctx.num_inputs:
        raise ctx.fail("Exchange needs a 'send_to' stage offset per input and 'recv_from'")
    types = _recv_infer(ctx)
    if len(types) != len(recvs):
        raise ctx.fail("Exchange needs a 'recv_from' stage offset per output")
    return types


# A training pipeline's transfers between two groups of a stage (flowc.schedule.
# train_pipeline): its inputs go to stages send_to (offsets from this one), its outputs come
# from stages recv_from, all in one exchange, so two stages sending to each other never both
# wait for the other's receive.
defop(
    "Exchange",
    FAMILY,
    infer=_exchange_infer,
    reference=_p2p_ref,
    attrs={
        "send_to": None,
        "recv_from": None,
        "shapes": None,
        "dtypes": None,
        "ranks_per_stage": 1,
    },
    emit=_emit_exchange,
)
