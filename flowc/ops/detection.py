"""Object detection post-processing: NonMaxSuppression.

The number of boxes selected depends on the scores, so the output (selected_indices,
[count, 3] of batch, class and box) holds its bound -- batches x classes x the smaller of
max_output_boxes_per_class (when it is a constant) and the boxes, or --bound -- and the
kernel writes the run's count into the size table (a computed symbol, ir/symbolic.py).

The rules are onnxruntime's, to the bit: per batch and class, the boxes whose score is above
score_threshold (strictly; every box without that input) in order of decreasing score (the
lower index first among equal scores, which a heap does not promise but no real input
notices), each kept unless its float32 IoU with a kept box is above iou_threshold, at most
max_output_boxes_per_class of them (max(value, 0); 0 or absent: none). center_point_box 0
reads [y1, x1, y2, x2] (either corner first), 1 reads [x_center, y_center, width, height].

The kernel needs scratch (each batch and class's candidates in order, then its kept ones):
the ONNX adapter gives the node a second output for it, int32, which the memory plan places
like any value. Kernels: templates/kernels/detection.cu.j2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node
from flowc.ir.symbolic import count_dim
from flowc.ir.types import TensorType
from flowc.ops.movement import arg
from flowc.ops.registry import InferCtx, defop
from flowc.ops.selection import output_bound

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.builder import AdapterNode
    from flowc.ir.graph import Value

FAMILY = "detection"
OP = "NonMaxSuppression"
# Threads per block of the selection kernel: one thread per (batch, class).
THREADS = 64


def _scalar(x: np.ndarray | None, default: float) -> float:
    return default if x is None else float(np.asarray(x).reshape(-1)[0])


def _iou_above(b1: np.ndarray, b2: np.ndarray, center: int, threshold: np.float32) -> bool:
    """onnxruntime's SuppressByIOU in float32: whether the boxes overlap more than allowed."""
    f = np.float32
    if center == 0:
        x1_min, x1_max = sorted((f(b1[1]), f(b1[3])))
        x2_min, x2_max = sorted((f(b2[1]), f(b2[3])))
        ix_min, ix_max = max(x1_min, x2_min), min(x1_max, x2_max)
        if ix_max <= ix_min:
            return False
        y1_min, y1_max = sorted((f(b1[0]), f(b1[2])))
        y2_min, y2_max = sorted((f(b2[0]), f(b2[2])))
    else:
        w1, h1, w2, h2 = f(b1[2]) / f(2), f(b1[3]) / f(2), f(b2[2]) / f(2), f(b2[3]) / f(2)
        x1_min, x1_max = f(b1[0]) - w1, f(b1[0]) + w1
        x2_min, x2_max = f(b2[0]) - w2, f(b2[0]) + w2
        ix_min, ix_max = max(x1_min, x2_min), min(x1_max, x2_max)
        if ix_max <= ix_min:
            return False
        y1_min, y1_max = f(b1[1]) - h1, f(b1[1]) + h1
        y2_min, y2_max = f(b2[1]) - h2, f(b2[1]) + h2
    iy_min, iy_max = max(y1_min, y2_min), min(y1_max, y2_max)
    if iy_max <= iy_min:
        return False
    inter = f((ix_max - ix_min) * (iy_max - iy_min))
    if inter <= 0:
        return False
    a1 = f((x1_max - x1_min) * (y1_max - y1_min))
    a2 = f((x2_max - x2_min) * (y2_max - y2_min))
    union = f(a1 + a2 - inter)
    if a1 <= 0 or a2 <= 0 or union <= 0:
        return False
    return bool(f(inter / union) > threshold)


def _reference(xs: list[np.ndarray | None], a: Attrs) -> list[np.ndarray]:
    boxes = np.asarray(arg(xs, 0), dtype=np.float32)
    scores = np.asarray(arg(xs, 1), dtype=np.float32)
    k = max(int(_scalar(xs[2] if len(xs) > 2 else None, 0)), 0)
    iou = np.float32(_scalar(xs[3] if len(xs) > 3 else None, 0.0))
    has_score = len(xs) > 4 and xs[4] is not None
    score_thr = np.float32(_scalar(xs[4] if has_score else None, 0.0))
    center = int(a["center_point_box"])
    out: list[tuple[int, int, int]] = []
    if k > 0:
        for b in range(scores.shape[0]):
            for c in range(scores.shape[1]):
                s = scores[b, c]
                cand = [i for i in range(s.shape[0]) if not has_score or s[i] > score_thr]
                cand.sort(key=lambda i: (-float(s[i]), i))
                kept: list[int] = []
                for i in cand:
                    if any(_iou_above(boxes[b, j], boxes[b, i], center, iou) for j in kept):
                        continue
                    if len(kept) >= k:
                        break
                    kept.append(i)
                    out.append((b, c, i))
    selected = np.array(out, dtype=np.int64).reshape(-1, 3)
    return [selected, np.zeros(_scratch_len(boxes.shape, scores.shape), np.int32)]


def _scratch_len(boxes: tuple[int, ...], scores: tuple[int, ...]) -> int:
    """Per (batch, class): its candidates in order (the kept ones moved to the front), then
    one count each."""
    bc = scores[0] * scores[1]
    return bc * boxes[1] + bc


def _infer(ctx: InferCtx) -> list[TensorType]:
    boxes, scores = ctx.type(0), ctx.type(1)
    if boxes.rank != 3 or boxes.shape[2] != 4:
        raise ctx.fail(f"boxes must be [batches, boxes, 4], got {boxes}")
    if scores.rank != 3:
        raise ctx.fail(f"scores must be [batches, classes, boxes], got {scores}")
    if boxes.shape[0] != scores.shape[0] or boxes.shape[1] != scores.shape[2]:
        raise ctx.fail(f"boxes {boxes} and scores {scores} disagree on batches or boxes")
    if boxes.dtype != DType.F32 or scores.dtype != DType.F32:
        raise ctx.fail("boxes and scores are float32")
    if int(ctx.attrs["center_point_box"]) not in (0, 1):
        raise ctx.fail("center_point_box is 0 or 1")
    for i, what, dt in (
        (2, "max_output_boxes_per_class", DType.I64),
        (3, "iou_threshold", DType.F32),
        (4, "score_threshold", DType.F32),
    ):
        if ctx.has(i) and (ctx.type(i).numel != 1 or ctx.dtype(i) != dt):
            raise ctx.fail(f"{what} is one {dt.short}, got {ctx.type(i)}")
    if boxes.shape[1] >= 1 << 31:
        raise ctx.fail("more than 2^31 - 1 boxes")
    scratch = TensorType((_scratch_len(boxes.shape, scores.shape),), DType.I32)
    known = [ctx.maybe_const(i) for i in range(ctx.num_inputs)]
    if all(known[i] is not None for i in range(ctx.num_inputs) if ctx.has(i)):
        # every input known: the exact selection (the node folds)
        rows = _reference(known, ctx.attrs)[0].shape[0]
        return [TensorType((rows, 3), DType.I64), scratch][: max(ctx.num_outputs, 1)]
    k = ctx.maybe_const(2) if ctx.has(2) else np.zeros((), np.int64)
    per_class = (
        boxes.shape[1]
        if k is None
        else min(max(int(np.asarray(k).reshape(-1)[0]), 0), boxes.shape[1])
    )
    bound = output_bound(ctx, scores.shape[0] * scores.shape[1] * per_class)
    selected = TensorType((bound, 3), DType.I64, (count_dim(), None))
    return [selected, scratch][: max(ctx.num_outputs, 1)]


def _emit(prog: Program, node: Node) -> None:
    if len(node.outputs) < 2:
        raise prog.fail("needs its scratch output (the ONNX adapter gives it one)")
    boxes, scores = node.inputs[0], node.inputs[1]
    assert boxes is not None and scores is not None
    out, scratch = node.outputs[0], node.outputs[1]
    count = out.type.sym[0] if out.type.sym is not None else None
    if count is None or count.name is None:
        raise prog.fail("the selection's count is not computed")
    st = scores.type
    if st.sym is not None and (st.sym[0] is not None or st.sym[1] is not None):
        raise prog.fail("batches and classes of fixed size (the boxes may vary)")
    b, c, _ = st.shape
    n = prog.dim(st, 2)  # the boxes of this run (sizes: the run's size table)
    opt: list[Value | None] = [node.inputs[i] if len(node.inputs) > i else None for i in (2, 3, 4)]
    select = prog.kernel(
        "detection.cu.j2",
        "nms_select",
        center=int(node.attrs.merged({"center_point_box": 0})["center_point_box"]),
        has_k=opt[0] is not None,
        has_iou=opt[1] is not None,
        has_score=opt[2] is not None,
        classes=c,
        boxes=n,
    )
    args = [prog.cptr(boxes), prog.cptr(scores)]
    args += [prog.cptr(v) for v in opt if v is not None]
    args += [prog.ptr(scratch), f"(int64_t){b * c}", "ddims"]
    prog.launch_grid(select, [max(-(-(b * c) // THREADS), 1)], THREADS, args)
    gather = prog.kernel(
        "detection.cu.j2",
        "nms_gather",
        classes=c,
        boxes=n,
        bound=out.type.shape[0],
        slot=prog.slots[count.name],
    )
    args = [prog.cptr(scratch), prog.ptr(out), f"(int64_t){b * c}", "error_flag", "ddims"]
    prog.launch_grid(gather, [1], 1, args)


def _import(n: AdapterNode) -> list[Value] | None:
    """Give the node its scratch output (and its bound from --bound)."""
    name = n.output_names[0] if n.output_names else ""
    attrs = dict(n.attrs)
    bound = n.builder.bounds.get(name)
    if bound is not None:
        attrs["bound"] = bound
    outs = n.emit(
        OP,
        n.inputs,
        attrs,
        output_names=[name or f"{n.name or OP}:0", f"{name or n.name or OP}:scratch"],
    )
    return outs[:1]


defop(
    OP,
    FAMILY,
    infer=_infer,
    reference=_reference,
    attrs={"center_point_box": 0, "bound": None},
    inputs=(2, 5),
    outputs=(1, 2),
    emit=_emit,
    sized=True,
    onnx_import=_import,
)
