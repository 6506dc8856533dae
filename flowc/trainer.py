"""`flowc train` and flowc.train(): compile a model's training step, build it, and run it over a
dataset, step after step.

The step is one compiled program (flowc.training.step: forward, loss, backward, update);
this module feeds it batches and carries its state (parameters, optimizer state, step
counter, learning rate) from one step's outputs to the next step's inputs. The data: one
array per batch input (the model's inputs and the loss's target) with the examples on axis
0. Step s takes the rows at positions [s B, (s+1) B) of one stream of rows: with shuffling,
epoch e's rows in the order of a permutation seeded by (seed, e); without, in file order,
wrapping around at the end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from flowc import checkpoint
from flowc.api import Model, Project, compile_options, resolve_target
from flowc.errors import FlowcError, InputError
from flowc.options import TrainArgs, parse_bytes
from flowc.training.spec import (
    LossScaling,
    TrainSpec,
    parse_loss,
    parse_optimizer,
    parse_schedule,
)
from flowc.training.step import TrainingStep
from flowc.training.zero import STAGES as ZERO_STAGES
from flowc.training.zero import rank_state_bytes, state_choices, zero_formula, zero_layouts

if TYPE_CHECKING:
    from flowc.compiler import PipelineSpec
    from flowc.options import CompileOptions
    from flowc.parallel.plan import Plan

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# -- data ---------------------------------------------------------------------------------------


def load_data(path: Path, step: TrainingStep) -> dict[str, np.ndarray]:
    """DATA.npz's arrays for the step's batch inputs, checked: every input present, one
    row count, each row of the input's shape and type (labels: integers in range)."""
    if not path.is_file():
        raise InputError(f"--data {path}: no such file", hint="give an .npz of one array per input")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: np.asarray(z[k]) for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise InputError(f"--data {path}: not a readable .npz ({e})") from None
    specs = {v.name: v for v in step.graph.inputs}
    missing = [n for n in step.batch if n not in arrays]
    if missing:
        raise InputError(
            f"--data {path}: no array for input {missing[0]!r}",
            hint="it holds "
            + (", ".join(map(repr, sorted(arrays))) or "no arrays")
            + "; the step needs "
            + ", ".join(map(repr, step.batch)),
        )
    rows = {n: arrays[n].shape[0] if arrays[n].ndim else 0 for n in step.batch}
    if len(set(rows.values())) != 1:
        listed = ", ".join(f"{n}: {r}" for n, r in rows.items())
        raise InputError(f"--data {path}: the arrays have different row counts ({listed})")
    out = {}
    for n in step.batch:
        a, v = arrays[n], specs[n]
        want_row = tuple(v.type.shape[1:])
        if a.ndim == 0 or tuple(a.shape[1:]) != want_row:
            raise InputError(
                f"--data {path}: array {n!r} has shape {list(a.shape)}; each row of input {n!r} "
                f"is {list(want_row)}",
                hint="the examples on axis 0, each of the input's shape without its batch axis",
            )
        want = v.type.dtype.np
        if v.type.dtype.is_int and a.dtype.kind not in "iu":
            raise InputError(f"--data {path}: array {n!r} is {a.dtype}; input {n!r} takes integers")
        if v.type.dtype.is_float and a.dtype.kind != "f":
            raise InputError(f"--data {path}: array {n!r} is {a.dtype}; input {n!r} takes floats")
        out[n] = np.ascontiguousarray(a.astype(want, copy=False))
    if next(iter(rows.values())) == 0:
        raise InputError(f"--data {path}: the arrays hold no rows")
    return out


def batch_rows(s: int, batch: int, rows: int, shuffle: bool, seed: int) -> np.ndarray:
    """The row indices of step ``s`` (from 0)."""
    positions = np.arange(s * batch, (s + 1) * batch, dtype=np.int64)
    within = positions % rows
    if not shuffle:
        return within
    epochs = positions // rows
    out = np.empty_like(within)
    for e in np.unique(epochs):
        perm = np.random.default_rng([seed, int(e)]).permutation(rows)
        sel = epochs == e
        out[sel] = perm[within[sel]]
    return out


def check_labels(
    step: TrainingStep, batch: Mapping[str, np.ndarray], classes: int | None, s: int
) -> None:
    """cross_entropy's labels (the loss's target, not the model's own integer inputs such as
    token ids) within [0, classes), or the ignored index."""
    if classes is None or step.target is None or step.target not in batch:
        return
    for name, a in ((step.target, batch[step.target]),):
        if a.dtype.kind not in "iu":
            continue
        bad = (a < 0) | (a >= classes)
        if step.ignore_index is not None:
            bad &= a != step.ignore_index
        if bad.any():
            raise InputError(
                f"step {s + 1}: label {int(a[bad].flat[0])} in {name!r} is outside [0, {classes})",
                hint="labels are class indices (or --ignore-index)",
            )


# -- checkpoints --------------------------------------------------------------------------------


def _signature(step: TrainingStep) -> dict[str, list[Any]]:
    """What makes a checkpoint this model's: every state input's name, shape and type."""
    specs = {v.name: v for v in step.graph.inputs}
    return {
        n: [list(specs[n].type.shape), specs[n].type.dtype.short]
        for n, _ in step.state
        if n in specs
    }


def save_checkpoint(
    folder: Path,
    step: TrainingStep,
    state: Mapping[str, np.ndarray],
    done: int,
    meta: Mapping[str, Any],
) -> Path:
    """``state`` (whole host arrays) after ``done`` steps as a checkpoint in FOLDER (see
    flowc.checkpoint), keyed by the state inputs' names (the model's initializer names for
    the parameters), with what a resume needs (the data position is the step count; the
    shuffle is seeded by the seed and the epoch). A training run's ranks save their own
    slices instead (checkpoint.save_model)."""
    names = [n for n, _ in step.state] + ["train/lr"]
    return checkpoint.save_whole(
        folder, {n: np.asarray(state[n]) for n in names}, done, _checkpoint_info(step, meta)
    )


def _checkpoint_info(step: TrainingStep, meta: Mapping[str, Any]) -> dict[str, Any]:
    return {"signature": _signature(step), **meta}


def checkpoint_info(folder: Path) -> dict[str, Any]:
    """A checkpoint's metadata alone (step, batch, seed, shuffle, signature)."""
    return checkpoint.read(folder).info


def _checked(folder: Path, step: TrainingStep) -> checkpoint.Checkpoint:
    """FOLDER's checkpoint, after checking it is this model's."""
    ckpt = checkpoint.read(folder)
    info = ckpt.info
    if info.get("signature") != _signature(step):
        theirs, ours = set(info.get("signature", {})), set(_signature(step))
        diff = sorted(theirs ^ ours)[:3]
        raise InputError(
            f"--resume {folder}: a checkpoint of another model or training setup"
            + (
                f" (state {', '.join(map(repr, diff))} differs)"
                if diff
                else " (shapes or types differ)"
            ),
            hint="resume with the model, loss and optimizer the checkpoint was made with",
        )
    return ckpt


def load_checkpoint(
    folder: Path, step: TrainingStep
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The state (whole) and metadata a checkpoint holds, after checking it is this
    model's."""
    ckpt = _checked(folder, step)
    return checkpoint.load_whole(ckpt), ckpt.info


# -- the run -----------------------------------------------------------------------------------


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)  # the rate each step used
    # fp16: each step's loss scale and whether it was skipped (non-finite gradients).
    scales: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    state: dict[str, np.ndarray] = field(default_factory=dict)
    params: dict[str, np.ndarray] = field(default_factory=dict)
    steps_per_s: float = 0.0


def run_steps(
    model: Model,
    step: TrainingStep,
    data: Mapping[str, np.ndarray],
    *,
    steps: int,
    batch: int,
    shuffle: bool = True,
    seed: int = 0,
    state: Mapping[str, np.ndarray] | None = None,
    restore: Callable[[Model], None] | None = None,
    first: int = 0,
    classes: int | None = None,
    skip_nonfinite: bool = False,
    log: Callable[[dict[str, Any]], None] | None = None,
    progress: Progress = _quiet,
    on_step: Callable[[int, Model], None] | None = None,
) -> TrainResult:
    """``steps`` steps of the compiled ``model`` from step ``first`` (a resumed run's
    position). The model keeps the state on its device and updates it in place; ``state``
    (whole arrays) replaces it first, or ``restore`` sets it (each rank its part of a
    checkpoint). Only the batches cross to the device, and only the loss, the label count
    and the rate come back."""
    if state is not None:
        model.write_state(state)
    if restore is not None:
        restore(model)
    rows = next(iter(data.values())).shape[0]
    batch *= step.micro_batches  # a step takes K micro-batches' rows
    result = TrainResult()
    scaled = step.loss_scaled
    t0 = time.perf_counter()
    last_print = 0.0
    for k in range(first, first + steps):
        idx = batch_rows(k, batch, rows, shuffle, seed)
        feeds = {n: data[n][idx] for n in step.batch}
        check_labels(step, feeds, classes, k)
        loss, count, lr = model.train_step(feeds)
        if not math.isfinite(loss) and not skip_nonfinite:
            # The step changed nothing (the state's update is guarded by the loss).
            raise FlowcError(
                f"step {k + 1}: the loss is {loss}; stopped (the state is that of step {k})",
                hint="lower the learning rate, clip gradients (--clip-norm), or --skip-nonfinite",
            )
        result.losses.append(loss)
        result.counts.append(count)
        result.lrs.append(lr)
        record: dict[str, Any] = {"step": k + 1, "loss": loss, "count": count, "lr": lr}
        if scaled:
            scale, skipped = model.loss_scaling()
            result.scales.append(scale)
            result.skipped.append(skipped)
            record.update(loss_scale=scale, skipped=skipped)
        if on_step is not None:
            on_step(k + 1, model)
        elapsed = time.perf_counter() - t0
        done = k - first + 1
        rate = done * batch / elapsed if elapsed > 0 else 0.0
        if log is not None:
            log({**record, "examples_per_s": rate})
        if elapsed - last_print >= 1.0 or done == steps:
            last_print = elapsed
            left = (steps - done) * elapsed / done
            scaling = (
                f", loss scale {result.scales[-1]:g} ({sum(result.skipped)} skipped)"
                if scaled
                else ""
            )
            progress(
                f"step {k + 1}/{first + steps}: loss {loss:.6g}{scaling}, {rate:.1f} examples/s, "
                f"{left:.0f} s left"
            )
    elapsed = time.perf_counter() - t0
    result.steps_per_s = steps / elapsed if elapsed > 0 else 0.0
    result.state = model.read_state()
    # What --export writes: the trained parameters and the batch norms' running statistics.
    result.params = {p: result.state[p] for p in [*step.params, *step.buffers]}
    return result


def spec_from(
    loss: str,
    optimizer: str,
    *,
    lr_schedule: str | None = None,
    clip_norm: float | None = None,
    freeze: str | None = None,
    no_decay: str | None = None,
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    untie: str | None = None,
    accumulate: int = 1,
    seed: int = 0,
    recompute: str = "none",
    mem_limit: str | int | None = None,
    scaling: LossScaling | None = None,
) -> TrainSpec:
    if clip_norm is not None and not clip_norm > 0:
        raise InputError(f"--clip-norm {clip_norm}: expected a positive norm")
    if not 1 <= accumulate <= 4096:
        raise InputError(f"--accumulate {accumulate}: expected 1 to 4096 micro-batches")
    return TrainSpec(
        parse_loss(loss, ignore_index, label_smoothing),
        parse_optimizer(optimizer),
        parse_schedule(lr_schedule),
        clip_norm,
        freeze,
        no_decay,
        untie,
        accumulate,
        seed,
        _recompute_mode(recompute),
        None
        if mem_limit is None
        else mem_limit
        if isinstance(mem_limit, int)
        else parse_bytes(mem_limit, "--mem-limit"),
        scaling=scaling or LossScaling(),
    )


def _recompute_mode(mode: str) -> str:
    from flowc.training.recompute import MODES

    if mode not in MODES:
        raise InputError(f"--recompute {mode!r}: expected one of {', '.join(MODES)}")
    return mode


# Train block setting -> (TrainArgs field, how its text reads).
_BLOCK_FIELDS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "loss": ("loss", str),
    "optimizer": ("optimizer", str),
    "lr_schedule": ("lr_schedule", str),
    "clip_norm": ("clip_norm", float),
    "freeze": ("freeze", str),
    "no_decay": ("no_decay", str),
    "untie": ("untie", str),
    "ignore_index": ("ignore_index", int),
    "label_smoothing": ("label_smoothing", float),
    "accumulate": ("accumulate", int),
    "recompute": ("recompute", str),
    "mem_limit": ("mem_limit", str),
    "batch": ("batch", int),
}


def with_train_block(model: str | os.PathLike[str], args: TrainArgs) -> TrainArgs:
    """The training options: the command line's, and for what it leaves out, a .flow
    program's train block's."""
    import dataclasses

    from flowc.frontend.dsl import read_train_block

    path = Path(model)
    if path.suffix.lower() != ".flow" or not path.is_file():
        return args
    block = read_train_block(path)
    defaults = TrainArgs()
    given: dict[str, Any] = {}
    for key, text in block.items():
        field_name, read = _BLOCK_FIELDS[key]
        if getattr(args, field_name) != getattr(defaults, field_name):
            continue  # the command line's wins
        try:
            given[field_name] = read(text)
        except ValueError:
            raise InputError(
                f"{path.name}: train block: {key} = {text} is not a {read.__name__}"
            ) from None
    return dataclasses.replace(args, **given)


def spec_of(args: TrainArgs, command: str) -> TrainSpec:
    """The training specification the command line's training options spell."""
    if args.loss is None or args.optimizer is None:
        raise InputError(
            f"{command} needs --loss and --optimizer",
            hint="e.g. --loss cross_entropy:logits,labels --optimizer adamw:lr=0.001",
        )
    return spec_from(
        args.loss,
        args.optimizer,
        lr_schedule=args.lr_schedule,
        clip_norm=args.clip_norm,
        freeze=args.freeze,
        no_decay=args.no_decay,
        ignore_index=args.ignore_index,
        label_smoothing=args.label_smoothing,
        untie=args.untie,
        recompute=args.recompute,
        mem_limit=args.mem_limit,
        accumulate=args.accumulate,
    )


def compile_step(
    model_path: str | os.PathLike[str],
    spec: TrainSpec,
    out: Path,
    *,
    batch: int | None = None,
    target: str | None = None,
    progress: Progress = _quiet,
    zero: int = 0,
    **options: Any,
) -> tuple[TrainingStep, Project]:
    """The training step of MODEL compiled into project OUT (not built). ``zero``: ZeRO's
    stage on a mesh (flowc.training.zero)."""
    from flowc.codegen.project import check_project_dir
    from flowc.compiler import (
        PipelineSpec,
        bucket_gradients,
        compile_graph,
        load_training,
        parallelize,
        placement_target,
    )

    opts = compile_options(model_path, target=target, **options)
    precision = opts.schedule.precision
    spec = dataclasses.replace(spec, precision=precision)
    check_project_dir(out, opts.force)
    placement = placement_target(opts.model, opts.parallel)
    if isinstance(placement, PipelineSpec):
        return _compile_pipeline_step(
            model_path, spec, out, opts, placement, batch, target, progress, zero
        ), Project(out)
    if placement is not None:
        spec = mesh_spec(spec, placement.mesh.size)
    if placement is not None and spec.recompute != "none":
        raise InputError(
            f"--recompute {spec.recompute} applies to one-device steps for now",
            hint="leave --recompute out with --mesh",
        )
    if placement is not None:
        # On a mesh --mem-limit bounds each device's bytes, which the placement measures.
        spec = dataclasses.replace(spec, mem_limit=None)
    if zero and placement is None:
        raise InputError(f"--zero {zero} splits the state over a mesh", hint="add --mesh N")
    if zero not in (0, *ZERO_STAGES):
        raise InputError(f"--zero {zero}: expected 1, 2 or 3")
    if spec.mem_limit is not None and opts.schedule.streams is not None:
        raise InputError(
            "--mem-limit is checked on the step's order of least peak memory, which --streams "
            "replaces by the latency schedule",
            hint="leave --streams out with --mem-limit",
        )
    progress(f"building the training step of {Path(model_path).name}")
    step = load_training(opts.model, spec, batch=batch)
    if step.recompute is not None:
        for line in step.recompute.lines():
            progress(line)
    # A training step keeps activations, gradients and their updates: memory is what binds
    # it, so it runs in the order of least peak memory (with accumulation, each micro-batch's
    # backward before the next one's forward), on one stream unless --streams asks for the
    # latency schedule on more (gpt2_tiny: 2.3 MB of arena against 7.9 MB on four streams).
    streams = opts.schedule.streams
    schedule_for = "memory" if streams is None or step.micro_batches > 1 else "latency"
    graph, physical, inference = step.graph, None, step.inference
    if placement is not None and zero:
        layouts, whole = zero_layouts(step, placement.mesh, zero)
        # --sbp wins over ZeRO's layout for the same value.
        sbp = {**{k: v for k, v in layouts.items()}, **placement.sbp}
        placement = dataclasses.replace(placement, sbp=sbp)
        progress(f"ZeRO stage {zero}: {len(layouts)} state tensors split over the mesh")
        if whole:
            progress(
                f"  whole (axis 0 does not divide by {placement.mesh.size}): {', '.join(whole)}"
            )
    if placement is not None:
        progress(f"placing the step on mesh {placement.mesh} ({placement.method})")
        placed = parallelize(step.graph, dataclasses.replace(placement, streams=1))
        graph, physical = placed.physical.graph, placed.physical
        if placement.method == "auto":
            # The search placed the state (under --mem-limit, ZeRO per tensor): say how.
            progress("state placement (the search's):")
            for line in state_placement(step, placed.plan):
                progress(f"  {line}")
        params, moments = rank_state_bytes(graph, step)
        whole_params, whole_moments = rank_state_bytes(step.graph, step)
        progress(
            f"per rank: parameters {params:,} B, optimizer state {moments:,} B, arena "
            f"{placed.memory.arena:,} B (gradients live there, from their product to their "
            f"reduction); ZeRO's count for stage {zero} on {placement.mesh.size} ranks, "
            f"gradients kept: "
            f"{zero_formula(whole_params, whole_moments, placement.mesh.size, zero):,} B"
        )
        # run() of a training program on a mesh infers nothing yet: its forward would need
        # its own placement.
        inference = None
        progress(bucket_gradients(graph, streams=streams, schedule_for=schedule_for).line())
    progress(f"generating {out}/ ({len(graph.nodes)} nodes, {len(step.params)} parameters)")
    compile_graph(
        graph,
        out,
        prefix=opts.prefix,
        source=Path(model_path).name,
        build_target=target,
        force=opts.force,
        cuda_graph=not opts.schedule.no_cuda_graph,
        streams=streams,
        schedule_for=schedule_for,
        precision=precision,
        inference=inference,
        physical=physical,
    )
    return step, Project(out)


def pipeline_step_spec(
    spec: TrainSpec, batch: int | None, microbatches: int, ranks_per_stage: int = 1
) -> tuple[TrainSpec, int]:
    """A pipeline's training step: ``batch`` (the global batch) in ``microbatches`` micro-
    batches, unrolled in the step as --accumulate unrolls them. Returns the step's spec and
    the micro-batch."""
    if spec.accumulate != 1:
        raise InputError(
            f"--accumulate {spec.accumulate} with --pipeline: the pipeline's micro-batches "
            "are the accumulation (--microbatches)",
            hint="leave --accumulate out; --batch is the global batch",
        )
    if batch is None:
        raise InputError(
            "a training pipeline needs --batch B: the global batch, split into --microbatches",
        )
    if batch % microbatches:
        raise InputError(
            f"--batch {batch} does not split into --microbatches {microbatches}",
            hint="use a micro-batch count that divides the batch",
        )
    spec = dataclasses.replace(spec, accumulate=microbatches, microbatch_ranks=ranks_per_stage)
    return spec, batch // microbatches


def _compile_pipeline_step(
    model_path: str | os.PathLike[str],
    spec: TrainSpec,
    out: Path,
    opts: CompileOptions,
    placement: PipelineSpec,
    batch: int | None,
    target: str | None,
    progress: Progress,
    zero: int,
) -> TrainingStep:
    """compile_step's pipeline: the step with its micro-batches unrolled, cut into stages."""
    from flowc.compiler import compile_train_pipeline, load_training

    if zero:
        raise InputError(
            f"--zero {zero} with --pipeline: ZeRO splits state over a data axis, which a "
            "training pipeline has not yet",
            hint="leave --zero out",
        )
    if spec.precision == "fp16":
        raise InputError(
            "--precision fp16 with --pipeline: the loss scale is one decision over every "
            "stage's gradients, which the pipeline does not make yet",
            hint="use --precision bf16 or fp32",
        )
    if spec.recompute != "none":
        raise InputError(
            f"--recompute {spec.recompute} applies to one-device steps for now",
            hint="leave --recompute out with --pipeline",
        )
    k = placement.mesh.size // placement.stages
    spec, micro = pipeline_step_spec(spec, batch, placement.microbatches, k)
    spec = dataclasses.replace(spec, mem_limit=None)
    progress(
        f"building the training step of {Path(model_path).name}: {placement.microbatches} "
        f"micro-batches of {micro}"
    )
    step = load_training(opts.model, spec, batch=micro)
    progress(
        f"cutting the step into {placement.stages} pipeline stages "
        f"({placement.schedule or '1f1b'}, "
        + ("one device each)" if k == 1 else f"{k} devices each, data parallel)")
    )
    compiled = compile_train_pipeline(
        step,
        spec.loss.prediction,
        out,
        placement,
        prefix=opts.prefix,
        source=Path(model_path).name,
        build_target=target,
        force=opts.force,
        precision=spec.precision,
    )
    progress(f"stage cuts: {', '.join(compiled.boundaries)}")
    for line in compiled.pipeline.lines():
        progress(f"  {line}")
    arenas = ", ".join(f"{p.arena_bytes:,}" for p in compiled.memory)
    progress(f"arena per stage: {arenas} B")
    return step


def train(
    model: str | os.PathLike[str],
    *,
    data: str | os.PathLike[str],
    steps: int,
    loss: str | None = None,
    optimizer: str | None = None,
    batch: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    target: str | None = None,
    project: str | os.PathLike[str] | None = None,
    export: str | os.PathLike[str] | None = None,
    log: str | os.PathLike[str] | None = None,
    lr_schedule: str | None = None,
    clip_norm: float | None = None,
    freeze: str | None = None,
    no_decay: str | None = None,
    untie: str | None = None,
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    accumulate: int = 1,
    recompute: str = "none",
    mem_limit: str | int | None = None,
    skip_nonfinite: bool = False,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    save_every: int | None = None,
    resume: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    rank_of: str | os.PathLike[str] | None = None,
    rank_result: str | os.PathLike[str] | None = None,
    run_id: str | None = None,
    **options: Any,
) -> TrainResult:
    """`flowc train`: compile MODEL's training step, build it, run ``steps`` steps over
    ``data`` (after those of the checkpoint ``resume`` names); with ``checkpoint_dir``, save
    at the end (and every ``save_every`` steps); with ``export``, write MODEL with its
    trained initializers.

    On a mesh (``mesh=``) the step is placed (``parallel=``: data, auto or none), compiled
    and built once, then mpirun starts one process per device, each running this function
    with ``rank_of`` (the built project): every rank makes the same steps on the same
    batches, rank 0 alone logs, each rank saves its slices of a checkpoint (``run_id``
    names the job's part folders), and rank 0's result comes back here (through the file
    ``rank_result``)."""
    call = {k: v for k, v in locals().items() if k not in ("progress", "options")}
    call.update(options)
    say = progress or _quiet
    if options.get("mesh") is not None and mem_limit is not None:
        # On a mesh the limit is each device's, which the placement keeps.
        options = {**options, "mem_limit": str(mem_limit)}
        mem_limit = None
    # What is not given, a .flow program's train block may give (the arguments win).
    given = with_train_block(
        model,
        TrainArgs(
            loss=loss,
            optimizer=optimizer,
            batch=batch,
            lr_schedule=lr_schedule,
            clip_norm=clip_norm,
            freeze=freeze,
            no_decay=no_decay,
            untie=untie,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            accumulate=accumulate,
            recompute=recompute,
            mem_limit=None if mem_limit is None else str(mem_limit),
        ),
    )
    loss, optimizer, batch = given.loss, given.optimizer, given.batch
    lr_schedule, clip_norm, freeze = given.lr_schedule, given.clip_norm, given.freeze
    no_decay, untie, ignore_index = given.no_decay, given.untie, given.ignore_index
    label_smoothing, accumulate = given.label_smoothing, given.accumulate
    recompute, mem_limit = given.recompute, given.mem_limit
    flow = Path(model).suffix.lower() == ".flow"
    if loss is None or optimizer is None or (batch is None and not flow):
        raise InputError(
            "train() needs loss, optimizer and batch (or a .flow program's train block)"
        )
    if steps < 1 or (batch is not None and batch < 1):
        raise InputError("--steps and --batch must be at least 1")
    spec = spec_from(
        loss,
        optimizer,
        lr_schedule=lr_schedule,
        clip_norm=clip_norm,
        freeze=freeze,
        no_decay=no_decay,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        untie=untie,
        accumulate=accumulate,
        seed=seed,
        recompute=recompute,
        mem_limit=mem_limit,
    )

    def check_resume(rows: int) -> None:
        # The data position only means the same rows with the same batch and shuffle.
        assert resume is not None
        info = checkpoint_info(Path(resume))
        if (
            info.get("batch") != rows
            or info.get("accumulate", 1) != accumulate
            or info.get("shuffle") != shuffle
            or info.get("seed") != seed
        ):
            raise InputError(
                f"--resume {resume}: the checkpoint was made with --batch {info.get('batch')}, "
                f"--accumulate {info.get('accumulate', 1)}, "
                f"{'shuffled' if info.get('shuffle') else '--no-shuffle'}, --seed {info.get('seed')}",
                hint="resume with the same --batch, --accumulate, --seed and shuffling",
            )

    if resume is not None and batch is not None:
        check_resume(batch)  # before the (slow) compile
    chosen, why = resolve_target(target)
    if rank_of is None:
        say(f"target {chosen} ({why})")
    with tempfile.TemporaryDirectory(prefix="flowc-train-") as tmp:
        out = Path(project) if project is not None else Path(tmp) / "step"
        if rank_of is not None:
            step, proj = _rank_step(model, spec, batch, target, options), Project(rank_of)
        else:
            step, proj = compile_step(
                model, spec, out, batch=batch, target=target, progress=say, **options
            )
        if batch is None:
            # A .flow program's types are static: its batch is its inputs' axis 0.
            first_input = next(v for v in step.graph.inputs if v.name in step.batch)
            batch = first_input.type.shape[0] // step.micro_batches if first_input.type.rank else 1
            if resume is not None:
                check_resume(batch)
        arrays = load_data(Path(data), step)
        if rank_of is None:
            proj.build(chosen, progress=say)
        logits = next((v for v in step.graph.values() if v.name == spec.loss.prediction), None)
        classes = None
        if spec.loss.kind == "cross_entropy" and logits is not None:
            classes = logits.type.shape[-1]
        restore, first = None, 0
        if resume is not None:
            ckpt = _checked(Path(resume), step)
            first = ckpt.step
            restore = lambda m: checkpoint.load_model(ckpt, m)  # noqa: E731
            if rank_of is None:
                say(f"resuming after step {first}")
        meta = {
            "batch": batch,
            "accumulate": accumulate,
            "shuffle": shuffle,
            "seed": seed,
            "model": Path(model).name,
        }
        folder = Path(checkpoint_dir) if checkpoint_dir is not None else None
        info = _checkpoint_info(step, meta)
        run_id = run_id or checkpoint.new_run_id()
        if proj.ranks > 1 and rank_of is None:
            result = _run_ranks(proj, chosen, {**call, "run_id": run_id}, Path(tmp), say)
        else:
            lead = True

            def save(done: int, current: Model) -> None:
                # Every rank saves its slices; rank 0 writes the manifest once all have.
                assert folder is not None
                saved = checkpoint.save_model(folder, current, done, info, run_id)
                if saved is not None:
                    say(f"saved {saved} (step {done})")

            def saver(done: int, current: Model) -> None:
                due = folder is not None and save_every and done % save_every == 0
                if due and done < first + steps:
                    save(done, current)

            writer = None
            try:
                with proj.load(chosen) as compiled:
                    # On a mesh every rank makes the same steps; rank 0 alone reports.
                    lead = compiled.rank == 0
                    if log is not None and lead:
                        writer = _LogWriter(Path(log))
                    result = run_steps(
                        compiled,
                        step,
                        arrays,
                        steps=steps,
                        # A pipeline's step unrolls its micro-batches of the global batch.
                        batch=batch * accumulate // step.micro_batches,
                        shuffle=shuffle,
                        seed=seed,
                        classes=classes,
                        skip_nonfinite=skip_nonfinite,
                        log=writer.write if writer else None,
                        progress=say if lead else _quiet,
                        restore=restore,
                        first=first,
                        on_step=saver,
                    )
                    if folder is not None:
                        save(first + steps, compiled)
            finally:
                if writer is not None:
                    writer.close()
            if rank_of is not None:
                if lead and rank_result is not None:
                    _save_result(Path(rank_result), result)
                return result
    if export is not None:
        export_onnx(Path(model), result.params, Path(export))
        say(f"wrote {export}")
    return result


def _rank_step(
    model: str | os.PathLike[str],
    spec: TrainSpec,
    batch: int | None,
    target: str | None,
    options: Mapping[str, Any],
) -> TrainingStep:
    """A rank's training step: the one compile_step placed and generated (the same
    deterministic import, passes and backward), without generating it again."""
    from flowc.compiler import load_training
    from flowc.parallel import parse_mesh

    opts = compile_options(
        model, target=target, **{k: v for k, v in options.items() if k != "zero"}
    )
    spec = dataclasses.replace(spec, precision=opts.schedule.precision, mem_limit=None)
    if options.get("pipeline") is not None:
        stages = int(options["pipeline"])
        mesh = options.get("mesh")
        k = parse_mesh(str(mesh)).size // stages if mesh is not None else 1
        spec, micro = pipeline_step_spec(spec, batch, int(options.get("microbatches") or 1), k)
        return load_training(opts.model, spec, batch=micro)
    if options.get("mesh") is not None:
        spec = mesh_spec(spec, parse_mesh(str(options["mesh"])).size)
    return load_training(opts.model, spec, batch=batch)


def state_placement(step: TrainingStep, plan: Plan) -> list[str]:
    """What ``plan`` does with each trained parameter and its optimizer state, a line per
    group (flowc.training.zero.state_choices): a split parameter some reader wants in
    another layout is gathered for its uses (ZeRO-3), one every reader takes as it is
    is tensor parallel."""
    stored = {v.name: plan.value_sbp[v] for v in step.graph.inputs}
    gathered = {
        x.name
        for node in step.graph.nodes
        for i, x in enumerate(node.inputs)
        if x is not None
        and x.name in step.params
        and plan.wanted(node, i) not in (None, stored[x.name])
    }
    return state_choices(step, stored, gathered)


def mesh_spec(spec: TrainSpec, devices: int) -> TrainSpec:
    """The step's spec on a mesh of ``devices``: cross-entropy's log-sum-exp in as many
    blocks of classes, so a classifier the plan splits by classes keeps its logits split."""
    if spec.loss.kind != "cross_entropy" or devices < 2:
        return spec
    return dataclasses.replace(spec, loss=dataclasses.replace(spec.loss, class_blocks=devices))


def _run_ranks(
    proj: Project, target: str, call: dict[str, Any], tmp: Path, say: Progress
) -> TrainResult:
    """mpirun's ranks of ``proj``, each running train() on the built project; rank 0's
    result. The job is one process group: an interrupt or a failure ends every rank."""
    import subprocess
    import sys

    from flowc.harness.build import launcher
    from flowc.harness.processes import end_group

    args = {**call, "rank_of": str(proj.path), "rank_result": str(tmp / "result.npz")}
    # The export is the caller's, from rank 0's result; the ranks save the checkpoints.
    args.update(project=None, export=None)
    (tmp / "train.json").write_text(json.dumps(args, default=str), encoding="utf-8")
    cmd, env = launcher(proj.ranks, target)
    say(f"starting {proj.ranks} ranks")
    child = subprocess.Popen(
        [*cmd, sys.executable, "-m", "flowc.cli.train_rank", str(tmp / "train.json")],
        env={**os.environ, **env},
        start_new_session=True,
        text=True,
    )
    try:
        code = child.wait()
    except BaseException:
        end_group(child)
        raise
    if code != 0 or not (tmp / "result.npz").is_file():
        hint = "the ranks' messages are above"
        folder = call.get("checkpoint_dir")
        if folder is not None:
            try:
                last = checkpoint.read(Path(folder)).step
                hint += f"; {folder} holds the checkpoint of step {last}: continue with --resume {folder}"
            except InputError:
                hint += f"; {folder} holds no complete checkpoint"
        raise FlowcError(f"the training job's ranks failed (mpirun exit status {code})", hint=hint)
    return _load_result(tmp / "result.npz")


def _save_result(path: Path, result: TrainResult) -> None:
    lists = {k: getattr(result, k) for k in ("losses", "counts", "lrs", "scales", "skipped")}
    arrays = {f"state/{k}": v for k, v in result.state.items()}
    arrays.update({f"params/{k}": v for k, v in result.params.items()})
    meta = {**lists, "steps_per_s": result.steps_per_s}
    tmp = path.with_name(f".{path.name}.tmp.npz")
    np.savez(tmp, meta=np.array(json.dumps(meta)), **arrays)  # type: ignore[arg-type]
    os.replace(tmp, path)


def _load_result(path: Path) -> TrainResult:
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        result = TrainResult(
            losses=meta["losses"],
            counts=meta["counts"],
            lrs=meta["lrs"],
            scales=meta["scales"],
            skipped=meta["skipped"],
            steps_per_s=meta["steps_per_s"],
        )
        for k in z.files:
            if k.startswith("state/"):
                result.state[k[len("state/") :]] = np.asarray(z[k])
            elif k.startswith("params/"):
                result.params[k[len("params/") :]] = np.asarray(z[k])
    return result


class _LogWriter:
    """--log: one JSON line per step, written to a temporary file renamed at the end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            self.f = open(self.tmp, "w", encoding="utf-8")  # noqa: SIM115 (closed by close())
        except OSError as e:
            raise InputError(f"--log {path}: cannot write there ({e.strerror})") from None

    def write(self, record: dict[str, Any]) -> None:
        self.f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.f.close()
        os.replace(self.tmp, self.path)


def export_onnx(model: Path, params: Mapping[str, np.ndarray], out: Path) -> None:
    """MODEL with the data of its trained initializers replaced (same names, shapes, graph),
    written to a temporary file and renamed; flowc's rewritten IR is never written."""
    import onnx
    from onnx import numpy_helper

    if model.suffix.lower() != ".onnx":
        raise InputError(
            f"--export: {model.name} is not an ONNX model",
            hint="export writes an ONNX model's trained initializers; a .flow program's "
            "parameters come from its weights file",
        )
    proto = onnx.load(str(model))
    for t in proto.graph.initializer:
        if t.name in params:
            new = numpy_helper.from_array(
                np.asarray(params[t.name]).astype(numpy_helper.to_array(t).dtype), t.name
            )
            t.CopyFrom(new)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        onnx.save(proto, str(tmp))
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise InputError(f"--export {out}: cannot write there ({e.strerror or e})") from None
