"""What a training run is asked: the loss, the optimizer with every hyperparameter, the
learning-rate schedule, clipping, which parameters train. Parsed from the command line's
strings (``cross_entropy:logits,labels``, ``adamw:lr=0.01,weight_decay=0.01``); defaults are
PyTorch's, so a spec means what it means there."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields

from flowc.errors import InputError

LOSSES = ("cross_entropy", "mse", "l1", "bce_with_logits", "output")
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class LossSpec:
    """``kind``: cross_entropy (class axis last; integer labels), mse, l1, bce_with_logits
    (float targets), or output (the value named ``prediction`` is the loss itself, reduced
    by its mean when it has several elements). ``prediction`` names a value of the model (not
    only an output); ``target`` becomes a new input of the step, named as given."""

    kind: str
    prediction: str
    target: str | None = None
    ignore_index: int | None = None
    label_smoothing: float = 0.0
    # cross_entropy on a mesh: its log-sum-exp in this many blocks of classes (the mesh's
    # size), so a classifier split by classes keeps its logits split (flowc/ops/loss.py).
    class_blocks: int = 1


@dataclass(frozen=True)
class OptimizerSpec:
    """PyTorch's optimizers and their defaults: SGD (momentum, dampening, nesterov, coupled
    weight decay ``g += wd p``), Adam (coupled weight decay), AdamW (decoupled: ``p -= lr wd
    p`` before the step); Adam's eps is added to the bias-corrected sqrt(v)."""

    kind: str
    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    @property
    def state_names(self) -> tuple[str, ...]:
        """The per-parameter state the optimizer keeps (each of the parameter's shape)."""
        if self.kind == "sgd":
            return ("momentum",) if self.momentum else ()
        return ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class ScheduleSpec:
    """The learning rate of step t (counted from 1): a linear warm-up over ``warmup`` steps,
    then constant, or a cosine or linear decay to ``min_lr`` x lr at step ``total``."""

    kind: str = "constant"
    warmup: int = 0
    total: int = 0
    min_lr: float = 0.0


@dataclass(frozen=True)
class LossScaling:
    """fp16's dynamic loss scaling, PyTorch's GradScaler defaults: the loss's gradient is
    multiplied by ``init`` at first; a step whose gradients are not all finite is skipped and
    halves it; ``interval`` finite steps in a row double it."""

    init: float = 65536.0
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000


@dataclass(frozen=True)
class TrainSpec:
    loss: LossSpec
    optimizer: OptimizerSpec
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    clip_norm: float | None = None
    freeze: str | None = None
    no_decay: str | None = None
    untie: str | None = None
    # Gradient accumulation: the step runs this many micro-batches of --batch examples (each
    # forward and backward in turn) and updates once, the loss normalized by all their labels.
    accumulate: int = 1
    # The training's seed: what keys the dropout masks (with the step and the element).
    seed: int = 0
    # --recompute none|auto|all (flowc/training/recompute.py) and --mem-limit in bytes: the
    # step's device memory (state, constants and arena) must fit it.
    recompute: str = "none"
    mem_limit: int | None = None
    # --precision: fp32 / tf32 (the GEMMs' math), bf16 / fp16 (mixed: the model's values and
    # their gradients narrow; master weights, optimizer state, gradient sums and the loss
    # float32; fp16 with dynamic loss scaling, ``scaling``).
    precision: str = "fp32"
    scaling: LossScaling = field(default_factory=lambda: LossScaling())
    # A micro-batch's rows spread over this many data-parallel ranks (a pipeline's stages on
    # K devices each): micro-batch k is rows k*b/K.. of each rank's contiguous K-th of the
    # step's rows, so that a rank's rows of every micro-batch are its own part of the batch.
    microbatch_ranks: int = 1


def _split(text: str, what: str) -> tuple[str, str]:
    kind, _, rest = text.partition(":")
    return kind.strip().lower(), rest.strip()


def _keyvalues(text: str, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InputError(f"{what}: {item!r} is not NAME=VALUE", hint=f"e.g. {what} sgd:lr=0.1")
        out[key.strip().lower()] = value.strip()
    return out


def _number(value: str, what: str, low: float = -math.inf, high: float = math.inf) -> float:
    try:
        x = float(value)
    except ValueError:
        raise InputError(f"{what}: {value!r} is not a number") from None
    if not math.isfinite(x) or not low <= x <= high:
        span = f"from {low:g}" + (f" to {high:g}" if math.isfinite(high) else "")
        raise InputError(f"{what} {value}: expected a finite number {span}")
    return x


def parse_loss(text: str, ignore_index: int | None = None, smoothing: float = 0.0) -> LossSpec:
    """``KIND:PREDICTION[,TARGET]``: ``cross_entropy:logits,labels``, ``mse:y,y_true``,
    ``output:loss``."""
    kind, rest = _split(text, "--loss")
    if kind not in LOSSES:
        raise InputError(
            f"--loss {text!r}: unknown loss {kind!r}",
            hint="one of " + ", ".join(LOSSES) + " (e.g. --loss cross_entropy:logits,labels)",
        )
    names = [n.strip() for n in rest.split(",")] if rest else []
    want = 1 if kind == "output" else 2
    if len(names) != want or not all(names):
        shape = "output:VALUE" if kind == "output" else f"{kind}:PREDICTION,TARGET"
        raise InputError(f"--loss {text!r}: expected {shape}")
    if not 0.0 <= smoothing < 1.0:
        raise InputError(f"--label-smoothing {smoothing}: expected a number in [0, 1)")
    if kind != "cross_entropy" and (ignore_index is not None or smoothing):
        raise InputError("--ignore-index and --label-smoothing are for cross_entropy")
    return LossSpec(kind, names[0], names[1] if want == 2 else None, ignore_index, smoothing)


_OPT_KEYS = {
    "sgd": ("lr", "momentum", "dampening", "nesterov", "weight_decay"),
    "adam": ("lr", "beta1", "beta2", "eps", "weight_decay"),
    "adamw": ("lr", "beta1", "beta2", "eps", "weight_decay"),
}


def parse_optimizer(text: str) -> OptimizerSpec:
    """``sgd:lr=0.05,momentum=0.9``, ``adamw:lr=1e-3,weight_decay=0.01``; lr is required,
    the rest default as in PyTorch (AdamW's weight decay 0.01, the others' 0)."""
    kind, rest = _split(text, "--optimizer")
    if kind not in OPTIMIZERS:
        raise InputError(
            f"--optimizer {text!r}: unknown optimizer {kind!r}",
            hint="sgd, adam or adamw, e.g. --optimizer adamw:lr=0.001",
        )
    kv = _keyvalues(rest, "--optimizer")
    unknown = sorted(set(kv) - set(_OPT_KEYS[kind]))
    if unknown:
        raise InputError(
            f"--optimizer {kind}: no hyperparameter {unknown[0]!r}",
            hint=f"{kind} takes " + ", ".join(_OPT_KEYS[kind]),
        )
    if "lr" not in kv:
        raise InputError(f"--optimizer {text!r}: give the learning rate", hint=f"{kind}:lr=0.01")
    values: dict[str, float | bool] = {}
    for key, value in kv.items():
        what = f"--optimizer {kind} {key}"
        if key == "nesterov":
            if value.lower() not in ("0", "1", "true", "false"):
                raise InputError(f"{what}: expected true or false")
            values[key] = value.lower() in ("1", "true")
        elif key in ("beta1", "beta2", "momentum", "dampening"):
            values[key] = _number(value, what, 0.0, 1.0 if key != "momentum" else math.inf)
            if key.startswith("beta") and values[key] >= 1.0:
                raise InputError(f"{what} {value}: expected a number in [0, 1)")
        else:
            values[key] = _number(value, what, 0.0)
    if kind == "adamw":
        values.setdefault("weight_decay", 0.01)
    spec = OptimizerSpec(kind, **values)  # type: ignore[arg-type]
    if spec.nesterov and (spec.momentum <= 0 or spec.dampening != 0):
        raise InputError("--optimizer sgd: nesterov needs a momentum and zero dampening")
    return spec


def parse_schedule(text: str | None) -> ScheduleSpec:
    """``constant``, ``constant:warmup=100``, ``cosine:warmup=100,total=10000,min_lr=0.1``,
    ``linear:total=1000``."""
    if not text:
        return ScheduleSpec()
    kind, rest = _split(text, "--lr-schedule")
    if kind not in SCHEDULES:
        raise InputError(
            f"--lr-schedule {text!r}: unknown schedule {kind!r}", hint="constant, cosine or linear"
        )
    kv = _keyvalues(rest, "--lr-schedule")
    allowed = {f.name for f in fields(ScheduleSpec)} - {"kind"}
    unknown = sorted(set(kv) - allowed)
    if unknown:
        raise InputError(f"--lr-schedule: no setting {unknown[0]!r}", hint="warmup, total, min_lr")
    warmup = int(_number(kv.get("warmup", "0"), "--lr-schedule warmup", 0, 1e12))
    total = int(_number(kv.get("total", "0"), "--lr-schedule total", 0, 1e12))
    min_lr = _number(kv.get("min_lr", "0"), "--lr-schedule min_lr", 0.0, 1.0)
    if kind != "constant" and total <= warmup:
        raise InputError(
            f"--lr-schedule {text!r}: a {kind} decay needs total above warmup",
            hint=f"{kind}:warmup=100,total=10000",
        )
    return ScheduleSpec(kind, warmup, total, min_lr)


def check_regex(pattern: str | None, what: str) -> re.Pattern[str] | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as e:
        raise InputError(f"{what} {pattern!r}: not a regular expression ({e})") from None
