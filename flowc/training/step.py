"""One training step as one graph: the model's forward, the loss, the backward (flowc.autodiff)
and the optimizer's update, so that every later stage (schedule, memory, code generation)
compiles the whole step as it compiles inference.

The step's inputs are the batch (the model's inputs and the loss's target) and the state:
the trained parameters, the optimizer's per-parameter state, the step counter and the base
learning rate. Its outputs are the loss, the count of examples (labels) the loss averages
over, and the next value of every updated state input (``TrainingStep.state`` pairs them).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np

from flowc.autodiff import gradients
from flowc.errors import FlowcWarning, InputError
from flowc.ir.builder import AdapterNode, GraphBuilder
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Graph, Node, Value, make_splat
from flowc.ir.types import TensorType
from flowc.ops.norm import TRAIN_BN_ATTRS, lower_train_batchnorm
from flowc.ops.random import STEP_INPUT
from flowc.training.recompute import RecomputeReport, saved_bytes
from flowc.training.spec import LossSpec, OptimizerSpec, ScheduleSpec, TrainSpec, check_regex

STEP = STEP_INPUT  # the step counter (a model's training dropouts read it too)
LR = "train/lr"
LOSS = "train/loss"
COUNT = "train/count"
# The learning rate the step used (the schedule's value at this step), for the log.
LR_USED = "train/lr_used"
# fp16's loss scaling: the scale (state), the finite steps since it last changed (state), and
# for the log the scale the step used and whether its gradients were not finite (1: skipped).
SCALE = "train/loss_scale"
GROWTH = "train/scale_growth"
SCALE_USED = "train/loss_scale_used"
SKIPPED = "train/skipped"


@dataclass
class TrainingStep:
    graph: Graph
    # (input name, output name): the output is the input's value for the next step.
    state: list[tuple[str, str]] = field(default_factory=list)
    # Every state input's value before the first step.
    initial: dict[str, np.ndarray] = field(default_factory=dict)
    # The batch inputs: the model's own, then the loss's target (if any).
    batch: list[str] = field(default_factory=list)
    # The trained parameters, and each one's optimizer state inputs.
    params: list[str] = field(default_factory=list)
    optimizer_state: dict[str, list[str]] = field(default_factory=dict)
    # Parameters that train by the spec but get no gradient from the loss (kept constant).
    no_gradient: list[str] = field(default_factory=list)
    # Initializers used by several nodes (a tie, or an exporter's deduplication).
    shared: dict[str, int] = field(default_factory=dict)
    # cross_entropy's ignored label, which the label range check lets through.
    ignore_index: int | None = None
    # The loss's target input (the labels), if the loss has one.
    target: str | None = None
    # Micro-batches per step (--accumulate): a step takes this many times --batch rows.
    micro_batches: int = 1
    # The model's forward as the step starts from it (ties undone by --untie), for the
    # inference program beside the step (inference_graph).
    forward: Graph | None = None
    # That forward as a graph of its own, through the inference passes (the compiler's).
    inference: Graph | None = None
    # Batch norms' running statistics: state the step updates (with momentum), not trained.
    buffers: list[str] = field(default_factory=list)
    # What --recompute did (the driver fills it in).
    recompute: RecomputeReport | None = None

    @property
    def loss_scaled(self) -> bool:
        """fp16's dynamic loss scaling is on (the scale is state)."""
        return any(name == SCALE for name, _ in self.state)

    def saved_activation_bytes(self) -> int:
        """Bytes of the forward's values the backward reads: the activations kept for it
        (by storage: a view's are its base's; a fusion of the step may have merged some)."""
        return saved_bytes(self.graph)


def make_trainable(graph: Graph) -> None:
    """A graph imported without ``trainable`` (a .flow program): its float constants of rank
    >= 1 become parameters, as the ONNX import makes its initializers; they keep their
    names (checkpoints and export use them)."""
    made: list[tuple[Value, str, np.ndarray]] = []
    for c in list(graph.constants):
        assert c.const is not None
        if c.type.dtype.is_float and c.type.rank >= 1:
            v = graph.add_input(graph.unique_name(c.name + ".param"), c.type)
            graph.replace_uses(c, v)
            made.append((v, c.name, np.asarray(c.const)))
    graph.remove_unused()  # the constants go, and their names are free again
    for v, name, data in made:
        graph.rename(v, name)
        graph.params[name] = data


def _find_value(graph: Graph, name: str, what: str) -> Value:
    for v in graph.values():
        if v.name == name:
            return v
    outs = ", ".join(repr(o.name) for o in graph.outputs)
    raise InputError(
        f"{what}: the model has no value named {name!r}",
        hint=f"its outputs are {outs}; any value of the model may be named "
        "(`flowc inspect MODEL --print-ir` lists them)",
    )


def _sum_all(b: GraphBuilder, v: Value) -> Value:
    return b.emit("ReduceSum", [v], {"keepdims": 0})[0]


def _scalar(b: GraphBuilder, value: float, dtype: DType) -> Value:
    return b.constant("train/c", np.asarray(value, dtype.np))


def _target_input(graph: Graph, spec: LossSpec, pred: Value, rows: int) -> Value | None:
    """The loss's target as a new input, ``rows`` examples on axis 0 (all micro-batches'),
    or None for a loss that is an output of the model."""
    if spec.kind == "output":
        return None
    assert spec.target is not None
    if graph.has_name(spec.target):
        raise InputError(
            f"--loss: the target {spec.target!r} is already a value of the model",
            hint="name the labels input something the model does not use",
        )
    if spec.kind == "cross_entropy":
        if pred.type.rank < 1:
            raise InputError(f"--loss cross_entropy: {spec.prediction!r} is a scalar, not logits")
        shape, dtype = pred.type.shape[:-1], DType.I64
    else:
        shape, dtype = pred.type.shape, pred.type.dtype
    if shape and rows != shape[0]:
        shape = (rows, *shape[1:])  # K micro-batches' labels
    return graph.add_input(spec.target, TensorType(shape, dtype))


def _label_count(b: GraphBuilder, spec: LossSpec, pred: Value, target: Value | None) -> Value:
    """How many labels the loss averages over: cross_entropy's labels but the ignored ones
    (counted over all the step's rows), else the elements of the prediction (or 1 for a
    model's own loss), times the micro-batches ``target`` holds."""
    dt = pred.type.dtype
    if spec.kind == "output":
        return _scalar(b, 1.0, dt)
    assert target is not None
    if spec.kind == "cross_entropy" and spec.ignore_index is not None:
        ignored = b.emit(
            "Equal", [target, b.constant("train/ignore", np.asarray(spec.ignore_index, np.int64))]
        )[0]
        return _sum_all(b, b.emit("Cast", [b.emit("Not", [ignored])[0]], {"to": dt.onnx})[0])
    return _scalar(b, float(max(1, target.type.numel)), dt)


def _loss_sum(b: GraphBuilder, spec: LossSpec, pred: Value, target: Value | None) -> Value:
    """The sum of the per-label losses of one micro-batch (a model's own loss: its mean)."""
    if spec.kind == "output":
        loss = pred if pred.type.numel == 1 else b.emit("ReduceMean", [pred], {"keepdims": 0})[0]
        if loss.type.rank:
            loss = b.emit("Reshape", [loss, b.constant("train/shape", np.zeros(0, np.int64))])[0]
        return loss
    assert target is not None
    if spec.kind == "cross_entropy":
        # The fused form (flowc/ops/loss.py): no probability tensor, forward or backward.
        attrs: dict[str, object] = {"label_smoothing": spec.label_smoothing}
        classes = pred.type.shape[-1] if pred.type.rank else 0
        if spec.class_blocks > 1 and classes % spec.class_blocks == 0:
            attrs["class_blocks"] = spec.class_blocks
        if spec.ignore_index is not None:
            attrs.update(has_ignore=1, ignore_index=spec.ignore_index)
        per = b.emit(
            "SoftmaxCrossEntropy", [pred, target], attrs, name="train/cross_entropy", num_outputs=2
        )[0]
        return _sum_all(b, per)
    if spec.kind == "mse":
        d = b.emit("Sub", [pred, target])[0]
        per = b.emit("Mul", [d, d])[0]
    elif spec.kind == "l1":
        per = b.emit("Abs", [b.emit("Sub", [pred, target])[0]])[0]
    else:  # bce_with_logits, as PyTorch: max(x, 0) - x t + log(1 + exp(-|x|))
        pos = b.emit("Relu", [pred])[0]
        xt = b.emit("Mul", [pred, target])[0]
        soft = b.emit("Softplus", [b.emit("Neg", [b.emit("Abs", [pred])[0]])[0]])[0]
        per = b.emit("Add", [b.emit("Sub", [pos, xt])[0], soft])[0]
    return _sum_all(b, per)


def _rows(b: GraphBuilder, v: Value, k: int, per: int, ranks: int = 1) -> Value:
    """Micro-batch k of ``v``'s rows: rows [k per, (k+1) per) (axis 0); with ``ranks`` R,
    rows [k per/R, (k+1) per/R) of each of the R equal parts of the rows (see
    TrainSpec.microbatch_ranks)."""
    if ranks > 1:
        if per % ranks:
            raise InputError(
                f"a micro-batch of {per} rows does not split over {ranks} data-parallel ranks",
                hint=f"use a --batch whose micro-batches divide by {ranks}",
            )
        rest = list(v.type.shape[1:])
        parts = v.type.shape[0] // per
        shape = b.constant("train/rank_rows", np.asarray([ranks, parts, per // ranks, *rest]))
        grid = b.emit("Reshape", [v, shape])[0]
        one = b.emit(
            "Slice",
            [
                grid,
                b.constant("train/starts", np.asarray([k], np.int64)),
                b.constant("train/ends", np.asarray([k + 1], np.int64)),
                b.constant("train/axes", np.asarray([1], np.int64)),
            ],
        )[0]
        flat = b.constant("train/micro_rows", np.asarray([per, *rest]))
        return b.emit("Reshape", [one, flat])[0]
    return b.emit(
        "Slice",
        [
            v,
            b.constant("train/starts", np.asarray([k * per], np.int64)),
            b.constant("train/ends", np.asarray([(k + 1) * per], np.int64)),
            b.constant("train/axes", np.asarray([0], np.int64)),
        ],
    )[0]


def _lower_batchnorms(graph: Graph) -> dict[Value, Value]:
    """Every TrainBatchNorm of ``graph`` as its reductions and element-wise ops, in place
    (ops/norm.py); returns each running statistic's input -> its next value."""
    nexts: dict[Value, Value] = {}
    if not any(node.op == "TrainBatchNorm" for node in graph.nodes):
        return nexts
    nodes, graph.nodes = graph.nodes, []
    builder = GraphBuilder(graph, fold=False)
    replaced: dict[Value, Value] = {}
    for node in nodes:
        node.inputs = [replaced.get(i, i) if i is not None else None for i in node.inputs]
        if node.op != "TrainBatchNorm":
            graph.nodes.append(node)
            continue
        adapter = AdapterNode(
            builder,
            "BatchNormalization",
            15,
            node.name,
            list(node.inputs),
            dict(node.attrs),
            [f"{o.name}.lowered" for o in node.outputs],
        )
        lowered = lower_train_batchnorm(adapter)
        for old, new in zip(node.outputs, lowered, strict=True):
            replaced[old] = new
        mean, var = (_stored(v) for v in (node.inputs[3], node.inputs[4]))
        nexts[mean], nexts[var] = lowered[1], lowered[2]
    graph.outputs = [replaced.get(o, o) for o in graph.outputs]
    return nexts


def _stored(v: Value | None) -> Value:
    """The state input a running statistic is read from: itself, or under mixed precision
    the float32 input its narrow Cast reads."""
    assert v is not None
    p = v.producer
    if (
        p is not None
        and p.op == "Cast"
        and p.inputs[0] is not None
        and p.inputs[0].producer is None
    ):
        return p.inputs[0]
    return v


def _step_counter(graph: Graph, spec: TrainSpec) -> Value:
    """The step counter input (the model's training dropouts made it at import, else made
    here); each TrainDropout gets the training's seed (the key of its masks, with the step:
    micro-batch k of K draws the elements after the k before it, _copy_forward)."""
    step_in = next((v for v in graph.inputs if v.name == STEP), None)
    if step_in is None:
        return graph.add_input(STEP, TensorType((), DType.I64))
    graph.inputs.remove(step_in)
    graph.inputs.append(step_in)  # after the batch, as a step without dropout has it
    for node in graph.nodes:
        if node.op == "TrainDropout" or _fused_dropout(node):
            node.attrs = Attrs({**node.attrs, "seed": spec.seed})
    return step_in


def _fused_dropout(node: Node) -> bool:
    """A FusedAttention that draws a dropout of its probabilities (its key: input 5)."""
    return node.op == "FusedAttention" and float(node.attrs.get("dropout", 0.0)) > 0.0


def _loss_and_gradients(
    graph: Graph,
    b: GraphBuilder,
    spec: TrainSpec,
    step: TrainingStep,
    params: list[Value],
    buffers: dict[Value, Value],
    scale: Value | None = None,
) -> tuple[Value, Value, dict[Value, Value | None]]:
    """The step's loss (the sum of the per-label losses over the count of labels), that
    count, and each parameter's gradient. With K micro-batches the batch inputs take K times
    the rows; each micro-batch's forward (micro-batch 0: the model's own nodes, the others
    copies of them) is followed by its backward, whose seed 1/count needs only the labels, so
    a micro-batch's activations can die before the next one's forward; the gradients add up
    in micro-batch order. ``buffers`` (running statistic -> its next value) are updated in
    place to their values after the last micro-batch: each micro-batch's update starts from
    the one before's, as K forward passes would leave them."""
    k_count = spec.accumulate
    model_pred = _find_value(graph, spec.loss.prediction, "--loss")
    if not model_pred.type.dtype.is_float:
        raise InputError(
            f"--loss: {spec.loss.prediction!r} is {model_pred.type.dtype}, not a float value"
        )
    pred = _wide(b, model_pred)
    batch_inputs = [v for v in graph.inputs if v.name in step.batch]
    rows = pred.type.shape[0] if pred.type.rank else 1
    if k_count > 1:
        for v in batch_inputs:
            if v.type.rank == 0 or (pred.type.rank and v.type.shape[0] != rows):
                raise InputError(
                    f"--accumulate: input {v.name!r} {list(v.type.shape)} has no batch axis 0 "
                    f"of {rows} examples, as {spec.loss.prediction!r} has",
                    hint="micro-batches split axis 0 of every input and of the prediction",
                )
    forward = list(graph.nodes)
    # The batch inputs, K micro-batches each: a new input under the input's name; the
    # model's own reads micro-batch 0's rows.
    micro: list[dict[Value, Value]] = [{} for _ in range(k_count)]
    if k_count > 1:
        first_new = len(graph.nodes)
        for v in batch_inputs:
            name = v.name
            graph.rename(v, graph.unique_name(name + "@mb0"))
            big = graph.add_input(
                name, TensorType((rows * k_count, *v.type.shape[1:]), v.type.dtype)
            )
            graph.inputs.remove(big)
            graph.inputs[graph.inputs.index(v)] = big
            first = _rows(b, big, 0, rows, spec.microbatch_ranks)
            graph.replace_uses(v, first)
            for k in range(1, k_count):
                micro[k][first] = _rows(b, big, k, rows, spec.microbatch_ranks)
        # The slices run before the model's nodes that read them.
        graph.nodes = graph.nodes[first_new:] + graph.nodes[:first_new]
    target = _target_input(graph, spec.loss, pred, rows * k_count)
    if target is not None:
        step.batch.append(target.name)
    count = _label_count(b, spec.loss, pred, target)
    if spec.loss.kind == "output":
        count = b.emit("Mul", [count, _scalar(b, float(k_count), pred.type.dtype)])[0]
    denom = b.emit("Max", [count, _scalar(b, 1.0, pred.type.dtype)])[0]
    grads: dict[Value, Value | None] = {p: None for p in params}
    total: Value | None = None
    first_nexts = dict(buffers)
    for k in range(k_count):
        if k == 0:
            pred_k = pred
        else:
            copies = _copy_forward(graph, forward, {**micro[k], **buffers}, k)
            pred_k = _wide(b, copies[model_pred])
            for r in buffers:
                buffers[r] = copies[first_nexts[r]]
        target_k = (
            target
            if target is None or k_count == 1
            else _rows(b, target, k, rows, spec.microbatch_ranks)
        )
        s_k = _loss_sum(b, spec.loss, pred_k, target_k)
        total = s_k if total is None else b.emit("Add", [total, s_k])[0]
        seed = b.emit("Div", [s_k, denom])[0]
        if scale is not None:
            # fp16: the loss scaled before its backward, so that small gradients stay
            # above float16's smallest normal; the sums are unscaled in float32 after.
            seed = b.emit("Mul", [seed, scale], name="train/scaled_loss")[0]
        g_k = gradients(graph, seed, params)
        for p in params:
            gk = g_k[p]
            if gk is not None:
                prev = grads[p]
                grads[p] = gk if prev is None else b.emit("Add", [prev, gk])[0]
    assert total is not None
    loss = b.emit("Div", [total, denom])[0]
    return loss, count, grads


def _wide(b: GraphBuilder, v: Value) -> Value:
    """``v`` in float32 (mixed precision: the loss is computed from a narrow prediction cast
    up, so its value and the seed of the backward are float32)."""
    if v.type.dtype in (DType.BF16, DType.F16):
        return b.emit("Cast", [v], {"to": DType.F32.onnx}, name="train/prediction_f32")[0]
    return v


def _copy_forward(
    graph: Graph, forward: list[Node], inputs: dict[Value, Value], k: int
) -> dict[Value, Value]:
    """The nodes ``forward`` once more for micro-batch ``k``, reading ``inputs`` in place of
    the batch inputs (parameters and constants shared): original value -> its copy. A
    training dropout of the copy draws the masks of the elements after the k micro-batches
    before it (rows k*B.. on a batch axis 0): one step of K*B rows draws the same, and no
    two micro-batches draw alike; its backward (the same op) follows."""
    copies = dict(inputs)
    for n in forward:
        attrs = n.attrs
        x = n.inputs[0] if n.inputs else None
        if n.op == "TrainDropout" and x is not None:
            attrs = Attrs({**dict(n.attrs.items()), "offset": k * x.type.numel})
        elif _fused_dropout(n):
            batch = int(n.attrs["sizes"][0])
            attrs = Attrs({**dict(n.attrs.items()), "dropout_batch0": k * batch})
        node = graph.add_node(
            n.op,
            [None if i is None else copies.get(i, i) for i in n.inputs],
            [o.type for o in n.outputs],
            attrs,
            name=f"{n.name}@mb{k}" if n.name else "",
            output_names=[f"{o.name}@mb{k}" for o in n.outputs],
        )
        for o, c in zip(n.outputs, node.outputs, strict=True):
            copies[o] = c
    return copies


def _lr(b: GraphBuilder, base: Value, t: Value, s: ScheduleSpec) -> Value:
    """The learning rate of step t (a float counted from 1) under schedule ``s``."""
    dt = base.type.dtype
    one = _scalar(b, 1.0, dt)
    factor: Value | None = None
    if s.warmup:
        factor = b.emit("Min", [one, b.emit("Div", [t, _scalar(b, float(s.warmup), dt)])[0]])[0]
    if s.kind != "constant":
        span = float(s.total - s.warmup)
        progress = b.emit(
            "Div", [b.emit("Sub", [t, _scalar(b, float(s.warmup), dt)])[0], _scalar(b, span, dt)]
        )[0]
        progress = b.emit("Clip", [progress, _scalar(b, 0.0, dt), one])[0]
        if s.kind == "cosine":
            cos = b.emit("Cos", [b.emit("Mul", [progress, _scalar(b, math.pi, dt)])[0]])[0]
            shape = b.emit("Mul", [b.emit("Add", [one, cos])[0], _scalar(b, 0.5, dt)])[0]
        else:
            shape = b.emit("Sub", [one, progress])[0]
        decay = b.emit(
            "Add",
            [_scalar(b, s.min_lr, dt), b.emit("Mul", [shape, _scalar(b, 1 - s.min_lr, dt)])[0]],
        )[0]
        if factor is not None:
            in_warmup = b.emit("LessOrEqual", [t, _scalar(b, float(s.warmup), dt)])[0]
            factor = b.emit("Where", [in_warmup, factor, decay])[0]
        else:
            factor = decay
    return base if factor is None else b.emit("Mul", [base, factor])[0]


def build_step(graph: Graph, spec: TrainSpec) -> TrainingStep:
    """The training step of ``graph`` (its parameters in Graph.params, as the trainable
    import leaves them) under ``spec``; rewrites ``graph`` into the step."""
    b = GraphBuilder(graph, fold=True)
    step = TrainingStep(graph, ignore_index=spec.loss.ignore_index, target=spec.loss.target)
    step.batch = [v.name for v in graph.inputs if v.name not in graph.params and v.name != STEP]
    users = graph.users()
    step.shared = {
        v.name: len(users.get(v, []))
        for v in graph.inputs
        if v.name in graph.params and len(users.get(v, [])) > 1
    }
    if spec.untie is not None:
        _untie(graph, spec.untie, users, step)
    step.forward = graph.copy()
    buffers = _lower_batchnorms(graph)
    freeze = check_regex(spec.freeze, "--freeze")
    no_decay = check_regex(spec.no_decay, "--no-decay")
    params = [v for v in graph.inputs if v.name in graph.params and v not in buffers]
    if freeze is not None:
        frozen = [v for v in params if freeze.search(v.name)]
        if not frozen:
            raise InputError(
                f"--freeze {spec.freeze!r} matches no parameter",
                hint="the parameters are: "
                + ", ".join(repr(v.name) for v in params[:8])
                + (" ..." if len(params) > 8 else ""),
            )
        for v in frozen:
            _to_constant(graph, b, v)
        params = [v for v in params if v not in frozen]
    step.micro_batches = spec.accumulate
    step_in = _step_counter(graph, spec)
    scale_in = growth_in = None
    if spec.precision == "fp16":
        scale_in = graph.add_input(SCALE, TensorType((), DType.F32))
        growth_in = graph.add_input(GROWTH, TensorType((), DType.I64))
    loss, count, grads = _loss_and_gradients(graph, b, spec, step, params, buffers, scale_in)
    trained = []
    for v in params:
        if grads[v] is None:
            step.no_gradient.append(v.name)
            _to_constant(graph, b, v)
        else:
            trained.append(v)
    for name in step.no_gradient:
        warnings.warn(
            FlowcWarning(f"parameter {name!r} gets no gradient from the loss: it stays as it is"),
            stacklevel=2,
        )
    if not trained:
        raise InputError("no parameter gets a gradient from the loss: nothing would train")
    gs = {v: grads[v] for v in trained}
    opt = spec.optimizer
    dt = trained[0].type.dtype
    lr_in = graph.add_input(LR, TensorType((), dt))
    step_next = b.emit(
        "Add", [step_in, b.constant("train/one", np.asarray(1, np.int64))], name="train/next_step"
    )[0]
    t = b.emit("Cast", [step_next], {"to": dt.onnx})[0]
    lr = _lr(b, lr_in, t, spec.schedule)
    grads_finite: Value | None = None
    if scale_in is not None:
        # Unscaled (before clipping), then checked: a sum of every element is NaN or
        # infinite if any element is.
        inv = b.emit("Reciprocal", [scale_in], name="train/unscale")[0]
        gs = {v: b.emit("Mul", [g, inv])[0] for v, g in gs.items()}
        sums = [b.emit("ReduceSum", [g], {"keepdims": 0})[0] for g in gs.values()]
        total_g = sums[0]
        for sm in sums[1:]:
            total_g = b.emit("Add", [total_g, sm])[0]
        zero = _scalar(b, 0.0, total_g.type.dtype)
        grads_finite = b.emit(
            "Equal", [b.emit("Mul", [total_g, zero])[0], zero], name="train/grads_finite"
        )[0]
    if spec.clip_norm is not None:
        squares = [b.emit("ReduceSumSquare", [g], {"keepdims": 0})[0] for g in gs.values()]
        total = squares[0]
        for sq in squares[1:]:
            total = b.emit("Add", [total, sq])[0]
        norm = b.emit("Sqrt", [total])[0]
        coef = b.emit(
            "Div", [_scalar(b, spec.clip_norm, dt), b.emit("Add", [norm, _scalar(b, 1e-6, dt)])[0]]
        )[0]
        coef = b.emit("Min", [coef, _scalar(b, 1.0, dt)])[0]
        gs = {v: b.emit("Mul", [g, coef])[0] for v, g in gs.items()}
    outputs: list[Value] = [
        _named(graph, b, loss, LOSS),
        _named(graph, b, count, COUNT),
        _named(graph, b, lr, LR_USED),
    ]
    factors = _adam_factors(b, step_next, lr, opt) if opt.kind != "sgd" else None
    ldt = loss.type.dtype
    # A step whose loss is not finite changes no state (x * 0 == 0 fails for NaN and inf):
    # the run stops, or skips the batch (--skip-nonfinite), with the state of the step before.
    finite = b.emit(
        "Equal", [b.emit("Mul", [loss, _scalar(b, 0.0, ldt)])[0], _scalar(b, 0.0, ldt)]
    )[0]
    if grads_finite is not None:
        # fp16: a step whose gradients overflowed is skipped the same way: no update, and
        # Adam's step count stays.
        finite = b.emit("And", [finite, grads_finite])[0]

    def guarded(old: Value, new: Value) -> Value:
        return b.emit("Where", [finite, new, old])[0]

    for v in trained:
        g = gs[v]
        assert g is not None
        decay = 0.0 if no_decay is not None and no_decay.search(v.name) else opt.weight_decay
        nexts = _update(graph, b, opt, v, g, lr, t, decay, factors)
        step.params.append(v.name)
        step.initial[v.name] = np.asarray(graph.params[v.name])
        names = []
        for state_in, new in nexts:
            if state_in is not v:
                # Zeros as a splat: the program fills them rather than storing them.
                step.initial[state_in.name] = make_splat(0, v.type.shape, v.type.dtype.np)
                names.append(state_in.name)
            out = _named(graph, b, guarded(state_in, new), f"{state_in.name}.next")
            outputs.append(out)
            step.state.append((state_in.name, out.name))
        step.optimizer_state[v.name] = names
    for r, new in buffers.items():
        # A running statistic: its momentum update, never decayed nor clipped (computed in
        # the model's precision, kept in float32).
        if new.type.dtype != r.type.dtype:
            new = b.emit("Cast", [new], {"to": r.type.dtype.onnx})[0]
        out = _named(graph, b, guarded(r, new), f"{r.name}.next")
        outputs.append(out)
        step.state.append((r.name, out.name))
        step.initial[r.name] = np.asarray(graph.params[r.name])
        step.buffers.append(r.name)
    outputs.append(_named(graph, b, guarded(step_in, step_next), f"{STEP}.next"))
    step.state.append((STEP, f"{STEP}.next"))
    if scale_in is not None and growth_in is not None and grads_finite is not None:
        outputs += _scale_update(graph, b, spec, step, scale_in, growth_in, grads_finite)
    step.initial[STEP] = np.asarray(0, np.int64)
    step.initial[LR] = np.asarray(opt.lr, dt.np)
    graph.outputs = outputs
    graph.remove_unused()
    # The state stays in the program's memory from step to step, updated in place.
    graph.state = {**dict(step.state), LR: None}
    graph.params = dict(step.initial)
    return step


def _scale_update(
    graph: Graph,
    b: GraphBuilder,
    spec: TrainSpec,
    step: TrainingStep,
    scale: Value,
    growth: Value,
    grads_finite: Value,
) -> list[Value]:
    """fp16's dynamic loss scale: halved (backoff) after a step with non-finite gradients,
    doubled (growth) after ``interval`` finite steps in a row, as PyTorch's GradScaler; the
    scale and the count are state. Also the log's outputs: the scale used, the skip."""
    s = spec.scaling
    f32, i64 = DType.F32, DType.I64
    g1 = b.emit("Add", [growth, b.constant("train/one", np.asarray(1, np.int64))])[0]
    grow = b.emit(
        "GreaterOrEqual", [g1, b.constant("train/interval", np.asarray(s.interval, np.int64))]
    )[0]
    grown = b.emit("Where", [grow, b.emit("Mul", [scale, _scalar(b, s.growth, f32)])[0], scale])[0]
    backed = b.emit("Mul", [scale, _scalar(b, s.backoff, f32)])[0]
    zero = b.constant("train/zero", np.asarray(0, np.int64))
    next_scale = b.emit("Where", [grads_finite, grown, backed], name="train/next_scale")[0]
    next_growth = b.emit(
        "Where",
        [grads_finite, b.emit("Where", [grow, zero, g1])[0], zero],
        name="train/next_growth",
    )[0]
    skipped = b.emit("Cast", [b.emit("Not", [grads_finite])[0]], {"to": f32.onnx})[0]
    outs = [
        _named(graph, b, scale, SCALE_USED),
        _named(graph, b, skipped, SKIPPED),
        _named(graph, b, next_scale, f"{SCALE}.next"),
        _named(graph, b, next_growth, f"{GROWTH}.next"),
    ]
    step.state += [(SCALE, f"{SCALE}.next"), (GROWTH, f"{GROWTH}.next")]
    step.initial[SCALE] = np.asarray(s.init, f32.np)
    step.initial[GROWTH] = np.asarray(0, i64.np)
    return outs


def inference_graph(step: TrainingStep) -> Graph:
    """The model's forward for run() of the training program (inference with the current
    weights): the model's inputs (no labels) and outputs; each trained parameter a read-only
    state input under its name, which the program places on the step's bytes of it, so run()
    reads what the latest step wrote; every other parameter a constant, as the step holds it."""
    assert step.forward is not None, "build_step keeps the forward"
    g = step.forward.copy()
    # No dropout at inference: each TrainDropout passes its input, and the step counter goes.
    for node in [n for n in g.nodes if n.op == "TrainDropout"]:
        x = node.inputs[0]
        assert x is not None
        g.replace_uses(node.outputs[0], x)
        g.nodes.remove(node)
    # A dropout fused into attention: none at inference either (its key input goes).
    for node in g.nodes:
        if _fused_dropout(node):
            node.attrs = Attrs({**node.attrs, "dropout": 0.0})
            node.inputs = node.inputs[:5]
            while node.inputs and node.inputs[-1] is None:
                node.inputs.pop()
    g.inputs = [v for v in g.inputs if v.name != STEP]
    # Batch norms normalize with the running statistics, which the step keeps.
    for node in g.nodes:
        if node.op == "TrainBatchNorm":
            node.op = "BatchNormalization"
            node.outputs = node.outputs[:1]
            node.attrs = Attrs({"epsilon": node.attrs.merged(TRAIN_BN_ATTRS)["epsilon"]})
    trained = set(step.params) | set(step.buffers)
    for v in list(g.inputs):
        if v.name in g.params and v.name not in trained:
            c = g.add_constant(v.name + ".frozen", g.params[v.name])
            g.replace_uses(v, c)
            g.inputs.remove(v)
    g.params = {v.name: step.initial[v.name] for v in g.inputs if v.name in trained}
    g.state = dict.fromkeys(g.params)
    g.train = {}
    g.remove_unused()
    return g


def _untie(graph: Graph, pattern: str, users: dict[Value, list[Node]], step: TrainingStep) -> None:
    """--untie: each node using a shared parameter the pattern matches gets a copy of its
    own (``NAME#k``, the same initial data), trained apart; the first keeps the name."""
    regex = check_regex(pattern, "--untie")
    assert regex is not None
    shared = [v for v in graph.inputs if v.name in step.shared and regex.search(v.name)]
    if not shared:
        raise InputError(
            f"--untie {pattern!r} matches no initializer used by several nodes",
            hint="the shared ones are: " + (", ".join(map(repr, sorted(step.shared))) or "none"),
        )
    for v in shared:
        for k, node in enumerate(users[v][1:], start=1):
            copy = graph.add_input(graph.unique_name(f"{v.name}#{k}"), v.type)
            graph.params[copy.name] = np.array(graph.params[v.name], copy=True)
            node.inputs = [copy if i is v else i for i in node.inputs]
        del step.shared[v.name]


def _named(graph: Graph, b: GraphBuilder, v: Value, name: str) -> Value:
    """``v`` under ``name`` (an Identity when ``v`` already is something else's output, an
    input or a constant)."""
    if v.producer is None or v in graph.outputs:
        v = b.emit("Identity", [v])[0]
    graph.rename(v, graph.unique_name(name))
    return v


def _to_constant(graph: Graph, b: GraphBuilder, v: Value) -> None:
    c = b.constant(v.name + ".frozen", graph.params.pop(v.name))
    graph.replace_uses(v, c)
    graph.inputs.remove(v)


def _adam_factors(
    b: GraphBuilder, step_next: Value, lr: Value, opt: OptimizerSpec
) -> tuple[Value, Value]:
    """Adam's step size lr / (1 - beta1^t) and 1 / sqrt(1 - beta2^t), computed once per step
    in float64 and rounded once: 1 - beta2^t is small for many steps, and float32's beta2
    (0.999 is 0.99900001287) would bias every update the same way (a 1e-5 drift by step 50)."""
    f64 = DType.F64
    t = b.emit("Cast", [step_next], {"to": f64.onnx})[0]
    one = _scalar(b, 1.0, f64)
    bc1 = b.emit("Sub", [one, b.emit("Pow", [_scalar(b, opt.beta1, f64), t])[0]])[0]
    bc2 = b.emit("Sub", [one, b.emit("Pow", [_scalar(b, opt.beta2, f64), t])[0]])[0]
    lr64 = b.emit("Cast", [lr], {"to": f64.onnx})[0]
    dt = lr.type.dtype
    step_size = b.emit("Cast", [b.emit("Div", [lr64, bc1])[0]], {"to": dt.onnx})[0]
    inv_sqrt_bc2 = b.emit(
        "Cast", [b.emit("Reciprocal", [b.emit("Sqrt", [bc2])[0]])[0]], {"to": dt.onnx}
    )[0]
    return step_size, inv_sqrt_bc2


def _update(
    graph: Graph,
    b: GraphBuilder,
    opt: OptimizerSpec,
    p: Value,
    g: Value,
    lr: Value,
    t: Value,
    decay: float,
    factors: tuple[Value, Value] | None,
) -> list[tuple[Value, Value]]:
    """The update of parameter ``p`` with gradient ``g``: (state input, its next value),
    the parameter first."""
    dt = p.type.dtype

    def c(x: float) -> Value:
        return _scalar(b, x, dt)

    def op(name: str, *ins: Value) -> Value:
        return b.emit(name, list(ins))[0]

    def state(suffix: str) -> Value:
        return graph.add_input(graph.unique_name(f"{p.name}.{suffix}"), p.type)

    if opt.kind == "sgd":
        if decay:
            g = op("Add", g, op("Mul", p, c(decay)))
        result: list[tuple[Value, Value]] = []
        update = g
        if opt.momentum:
            buf = state("momentum")
            damped = g if opt.dampening == 0 else op("Mul", g, c(1 - opt.dampening))
            nxt = op("Add", op("Mul", buf, c(opt.momentum)), damped)
            if opt.dampening:
                # PyTorch starts the buffer at the first gradient, undamped.
                first = op("Equal", t, c(1.0))
                nxt = op("Where", first, g, nxt)
            result.append((buf, nxt))
            update = op("Add", g, op("Mul", nxt, c(opt.momentum))) if opt.nesterov else nxt
        new_p = op("Sub", p, op("Mul", update, lr))
        return [(p, new_p), *result]
    # Adam / AdamW
    if opt.kind == "adamw" and decay:
        # p - (lr wd) p, not p (1 - lr wd): 1 - lr wd rounded to float32 loses most of lr wd
        # (2e-5 has 1e-3 of its value below the ulp of 1), the same way every step.
        p_decayed = op("Sub", p, op("Mul", p, op("Mul", lr, c(decay))))
    else:
        p_decayed = p
        if decay:
            g = op("Add", g, op("Mul", p, c(decay)))
    m, v = state("exp_avg"), state("exp_avg_sq")
    m_next = op("Add", op("Mul", m, c(opt.beta1)), op("Mul", g, c(1 - opt.beta1)))
    v_next = op("Add", op("Mul", v, c(opt.beta2)), op("Mul", op("Mul", g, g), c(1 - opt.beta2)))
    assert factors is not None
    step_size, inv_sqrt_bc2 = factors
    denom = op("Add", op("Mul", op("Sqrt", v_next), inv_sqrt_bc2), c(opt.eps))
    new_p = op("Sub", p_decayed, op("Mul", step_size, op("Div", m_next, denom)))
    return [(p, new_p), (m, m_next), (v, v_next)]
