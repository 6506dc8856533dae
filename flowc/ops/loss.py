"""SoftmaxCrossEntropy: cross-entropy of logits (classes on the last axis) against integer
labels, per row, with the log-softmax fused in: no probability (or log-probability) tensor
is made, in the forward or the backward. flowc's training step builds it for
``--loss cross_entropy`` (flowc/training/step.py); it is no ONNX op.

Inputs: logits [..., C] (float), labels [...] (int64). Attributes: ``ignore_index`` with
``has_ignore`` (a label equal to it counts for nothing: its row's loss is 0), and
``label_smoothing`` eps (the target is (1 - eps) one-hot + eps / C). Outputs: the per-row
loss ``lse - (1 - eps) x[label] - eps/C sum(x)`` (0 for an ignored row) and ``lse``, the
row's log-sum-exp, which the backward reads instead of the probabilities.

No kernel of its own: lower_ops rewrites it to ReduceLogSumExp, a GatherElements of the
label's logit (an ignored label reads class 0, then masked) and element-wise ops. Its VJP is
the fused form: d logits = g (exp(x - lse) - target), one element-wise expression over the
logits that the element-wise fusion makes one kernel, the one-hot target computed in it
from the labels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node
from flowc.ir.types import TensorType
from flowc.ops import grad
from flowc.ops import sbp_rules as sr
from flowc.ops.registry import InferCtx, SbpSignature, defop

if TYPE_CHECKING:
    from flowc.ir.builder import AdapterNode
    from flowc.ir.graph import Value

FAMILY = "loss"
ATTRS = {"has_ignore": 0, "ignore_index": -100, "label_smoothing": 0.0, "class_blocks": 1}


def _infer(ctx: InferCtx) -> list[TensorType]:
    x, labels = ctx.type(0), ctx.type(1)
    if not x.dtype.is_float:
        raise ctx.fail(f"needs float logits, got {x.dtype}")
    if x.rank < 1:
        raise ctx.fail("needs logits of rank >= 1 (classes on the last axis)")
    if labels.dtype != DType.I64 or tuple(labels.shape) != tuple(x.shape[:-1]):
        raise ctx.fail(
            f"labels must be int64 of shape {list(x.shape[:-1])} (the logits' without the "
            f"class axis), got {labels}"
        )
    eps = float(ctx.attr("label_smoothing"))
    if not 0.0 <= eps <= 1.0:
        raise ctx.fail(f"label_smoothing {eps} is outside [0, 1]")
    row = TensorType(x.shape[:-1], x.dtype)
    return [row, row]


def _sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    # Rows are independent: logits and labels split alike along a batch axis.
    return [sr.sig(ctx, {0: sr.S(i), 1: sr.S(i)}, sr.S(i), 2) for i in range(outs[0].rank)]


def _flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    # Per logit: the log-sum-exp's max, subtract, exp and add; the label's pick per row.
    x = ins[0]
    return 6 * (x.numel if x is not None else 0) + outs[0].numel


def _reference(xs: list[np.ndarray | None], a: Attrs) -> list[np.ndarray]:
    x, labels = xs[0], xs[1]
    assert x is not None and labels is not None
    work = x.astype(np.float64)
    classes = x.shape[-1]
    m = work.max(axis=-1, keepdims=True) if classes else np.zeros((*x.shape[:-1], 1))
    lse = (np.log(np.exp(work - m).sum(axis=-1, keepdims=True)) + m)[..., 0]
    ignored = (
        (labels == int(a["ignore_index"])) if int(a["has_ignore"]) else np.zeros_like(labels, bool)
    )
    safe = np.where(ignored, 0, labels)
    if ((safe < 0) | (safe >= classes)).any():
        raise ValueError(f"a label is outside [0, {classes})")
    picked = np.take_along_axis(work, safe[..., None], axis=-1)[..., 0]
    eps = float(a["label_smoothing"])
    loss = lse - (1 - eps) * picked - (eps / classes) * work.sum(axis=-1)
    loss = np.where(ignored, 0.0, loss)
    return [loss.astype(x.dtype), lse.astype(x.dtype)]


def _lower(n: AdapterNode) -> list[Value] | None:
    x, labels = n.input(0), n.input(1)
    if x is None or labels is None:
        return None
    a = Attrs(n.attrs).merged(ATTRS)
    dt = x.type.dtype
    classes = x.type.shape[-1]
    last = n.const("last", [-1], np.int64)
    blocks = int(a["class_blocks"])
    if blocks > 1 and classes % blocks == 0:
        return _lower_blocked(n, x, labels, a, blocks)
    (lse,) = n.emit(
        "ReduceLogSumExp",
        [x, last],
        {"keepdims": 0},
        suffix="lse",
        output_names=n.output_names[1:2],
    )
    safe, keep = labels, None
    if int(a["has_ignore"]):
        (ignored,) = n.emit("Equal", [labels, n.const("ignore", int(a["ignore_index"]), np.int64)])
        (safe,) = n.emit("Where", [ignored, n.const("zero", 0, np.int64), labels])
        (not_ignored,) = n.emit("Not", [ignored])
        (keep,) = n.emit("Cast", [not_ignored], {"to": dt.onnx})
    (index,) = n.emit("Unsqueeze", [safe, last])
    (picked,) = n.emit("GatherElements", [x, index], {"axis": -1}, suffix="picked")
    (picked,) = n.emit("Squeeze", [picked, last])
    eps = float(a["label_smoothing"])
    if eps:
        (picked,) = n.emit("Mul", [picked, n.const("keep_weight", 1 - eps, dt.np)])
        (total,) = n.emit("ReduceSum", [x, last], {"keepdims": 0})
        (spread,) = n.emit("Mul", [total, n.const("spread_weight", eps / classes, dt.np)])
        (picked,) = n.emit("Add", [picked, spread])
    if keep is None:
        return [*n.emit("Sub", [lse, picked], output_names=n.output_names[:1]), lse]
    (loss,) = n.emit("Sub", [lse, picked])
    return [*n.emit("Mul", [loss, keep], output_names=n.output_names[:1]), lse]


def _lower_blocked(n: AdapterNode, x: Value, labels: Value, a: Attrs, blocks: int) -> list[Value]:
    """The model-parallel form (OneFlow's and partial FC's), for logits that may be split by
    classes over ``blocks`` devices: every reduction over the classes a sum (a partial sum of
    the ranks' parts, all-reduced) but the row's max, taken per block of C / blocks classes
    first, so only the blocks' maxima ([..., blocks]) are gathered. The label's logit is
    picked by a one-hot product (zero outside a rank's classes), not a gather."""
    dt = x.type.dtype
    lead, classes = x.type.shape[:-1], x.type.shape[-1]
    last = n.const("last", [-1], np.int64)
    shape = n.const("blocked", [*lead, blocks, classes // blocks], np.int64)
    (xb,) = n.emit("Reshape", [x, shape], suffix="blocked")
    (block_max,) = n.emit("ReduceMax", [xb, last], {"keepdims": 0}, suffix="block_max")
    (m,) = n.emit("ReduceMax", [block_max, last], {"keepdims": 1}, suffix="max")
    (e,) = n.emit("Exp", [n.emit("Sub", [x, m])[0]])
    (total,) = n.emit("ReduceSum", [e, last], {"keepdims": 0}, suffix="sum")
    (m_row,) = n.emit("Squeeze", [m, last])
    (lse,) = n.emit(
        "Add", [n.emit("Log", [total])[0], m_row], suffix="lse", output_names=n.output_names[1:2]
    )
    safe, keep = labels, None
    if int(a["has_ignore"]):
        (ignored,) = n.emit("Equal", [labels, n.const("ignore", int(a["ignore_index"]), np.int64)])
        (safe,) = n.emit("Where", [ignored, n.const("zero", 0, np.int64), labels])
        (keep,) = n.emit("Cast", [n.emit("Not", [ignored])[0]], {"to": dt.onnx})
    cls = n.const("classes", np.arange(classes, dtype=np.int64), np.int64)
    (hot,) = n.emit("Equal", [n.emit("Unsqueeze", [safe, last])[0], cls])
    (hot,) = n.emit("Cast", [hot], {"to": dt.onnx})
    eps = float(a["label_smoothing"])
    if eps:
        # The smoothed target: (1 - eps) one-hot + eps / C, one product with the logits.
        (hot,) = n.emit("Mul", [hot, n.const("keep_weight", 1 - eps, dt.np)])
        (hot,) = n.emit("Add", [hot, n.const("spread_weight", eps / classes, dt.np)])
    (picked,) = n.emit("ReduceSum", [n.emit("Mul", [x, hot])[0], last], {"keepdims": 0})
    if keep is None:
        return [*n.emit("Sub", [lse, picked], output_names=n.output_names[:1]), lse]
    (loss,) = n.emit("Sub", [lse, picked])
    return [*n.emit("Mul", [loss, keep], output_names=n.output_names[:1]), lse]


def _vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    """d logits = g (exp(x - lse) - target), the target (1 - eps) one-hot(label) + eps/C,
    zero on ignored rows; labels get none. The lse output's own gradient (the step never
    uses it) would be g softmax(x): added when one flows."""
    g, g_lse = gouts[0], gouts[1]
    x, labels = node.inputs[0], node.inputs[1]
    lse = node.outputs[1]
    if x is None or labels is None or not need[0] or (g is None and g_lse is None):
        return [None, None]
    a = node.attrs.merged(ATTRS)
    dt = x.type.dtype
    classes = x.type.shape[-1]
    last = grad.ints(b, [-1])
    p = grad.op1(b, "Exp", grad.op1(b, "Sub", x, grad.op1(b, "Unsqueeze", lse, last)))
    out: Value | None = None
    if g is not None:
        cls = b.const(np.arange(classes, dtype=np.int64), "classes")
        hot = grad.op1(
            b, "Cast", grad.op1(b, "Equal", grad.op1(b, "Unsqueeze", labels, last), cls), to=dt.onnx
        )
        eps = float(a["label_smoothing"])
        target = hot
        if eps:
            target = grad.op1(
                b,
                "Add",
                grad.op1(b, "Mul", hot, grad.scalar(b, 1 - eps, x)),
                grad.scalar(b, eps / classes, x),
            )
        row = g
        if int(a["has_ignore"]):
            ignored = grad.op1(
                b, "Equal", labels, b.const(np.asarray(int(a["ignore_index"]), np.int64), "ignore")
            )
            row = grad.op1(b, "Where", ignored, grad.scalar(b, 0.0, g), g)
        out = grad.op1(b, "Mul", grad.op1(b, "Sub", p, target), grad.op1(b, "Unsqueeze", row, last))
    if g_lse is not None:
        extra = grad.op1(b, "Mul", p, grad.op1(b, "Unsqueeze", g_lse, last))
        out = extra if out is None else grad.op1(b, "Add", out, extra)
    return [out, None]


defop(
    "SoftmaxCrossEntropy",
    FAMILY,
    infer=_infer,
    reference=_reference,
    attrs=ATTRS,
    inputs=2,
    outputs=2,
    flops=_flops,
    sbp=_sbp,
    onnx_import=_lower,
    vjp=_vjp,
)
