"""`flowc train`: compile MODEL's training step (forward, loss, backward, optimizer update as
one program), build it, and run it over a dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from flowc.cli.common import out, progress
from flowc.cli.options import (
    GroupedCommand,
    ModelArgs,
    TrainArgs,
    choice_option,
    count_option,
    flag_option,
    model_options,
    path_option,
    seed_option,
    target_option,
    text_option,
    training_options,
)
from flowc.ir.types import MAX_MESH_DEVICES, MAX_MICROBATCHES


@click.command(
    name="train",
    cls=GroupedCommand,
    short_help="Train MODEL (one compiled step: forward, backward, update).",
    examples=[
        "flowc train model.onnx --loss cross_entropy:logits,labels "
        "--optimizer adamw:lr=0.001 --data train.npz --steps 100 --batch 32",
        "flowc train mlp.flow --loss mse:y,y_true --optimizer sgd:lr=0.05,momentum=0.9 "
        "--data data.npz --steps 50 --batch 8 --export trained.onnx",
    ],
)
@model_options
@training_options
@path_option(
    "--data", help="DATA.npz: one array per model input and the target, examples on axis 0."
)
@count_option("--steps", "N", "Steps to run.", low=1)
@flag_option("--no-shuffle", "Take the rows in file order (step s: rows sB..sB+B-1, wrapping).")
@seed_option("Seed of the per-epoch shuffle and of the dropout masks.")
@flag_option("--skip-nonfinite", "Skip a step whose loss is NaN or infinite instead of stopping.")
@target_option(["host", "cuda"], "Default: cuda where a GPU is present, else host.")
@choice_option(
    "--precision",
    ["fp32", "tf32", "bf16", "fp16"],
    "fp32: exact float32 GEMMs; tf32: the step's GEMMs on tensor cores with TF32 inputs; "
    "bf16, fp16: mixed precision (activations and their gradients narrow; master weights, "
    "optimizer state, gradient sums and the loss float32; fp16 with dynamic loss scaling).",
    default="fp32",
)
@text_option(
    "--mem-limit",
    "BYTES",
    "The step's device memory (state, constants, arena) must fit this, e.g. 64MiB; "
    "with --recompute auto, what recomputation aims at.",
)
@text_option(
    "--mesh",
    "N|AxB",
    "Train on N devices (one MPI rank each; mpirun starts them): 4, or 2x2 for a 2-D mesh.",
)
@choice_option(
    "--parallel",
    ["data", "auto", "none"],
    "With --mesh: data: the batch split over the devices, the state whole, the gradients "
    "all-reduced; auto: the placement search chooses; none: every device computes all.",
    default="data",
)
@text_option(
    "--sbp",
    "NAME=SBP",
    "With --mesh: fix the layout of a value of the step, e.g. w=S(0).",
    dest="sbps",
    multiple=True,
)
@count_option(
    "--zero",
    "K",
    "With --mesh: ZeRO stage K (1, 2: each parameter's optimizer state split on axis 0 over "
    "the devices; 3: the parameters too), the collectives following from the layouts.",
    low=1,
    high=3,
)
@path_option("--export", help="Write MODEL with its trained initializers (an ONNX model).")
@path_option("--log", help="LOG.jsonl: one line per step (step, loss, count, lr, examples/s).")
@path_option(
    "-o", "--output", "project", help="Keep the compiled step's project here.", directory=True
)
@path_option(
    "--checkpoint-dir",
    help="Save the state (parameters, optimizer state, step) here at the end.",
    directory=True,
)
@count_option("--save-every", "K", "With --checkpoint-dir: also save every K steps.", low=1)
@path_option(
    "--resume",
    help="Continue from the checkpoint in this folder: --steps more steps, bit for bit as "
    "an uninterrupted run.",
    directory=True,
)
@count_option(
    "--pipeline",
    "P",
    "Pipeline training: the step cut into P stages, one device each (mpirun starts them); "
    "the backward flows back through the stages, one update after the last micro-batch.",
    low=1,
    high=MAX_MESH_DEVICES,
)
@count_option(
    "--microbatches",
    "M",
    "With --pipeline: the global batch (--batch) in M micro-batches.",
    low=1,
    high=MAX_MICROBATCHES,
    default=1,
)
@text_option(
    "--stage-boundary",
    "VALUE,...",
    "With --pipeline P: the last value of each stage but the last (P-1 names of the "
    "forward); default: the cuts balancing the forward's modeled time.",
)
@choice_option(
    "--pipeline-schedule",
    ["1f1b", "gpipe"],
    "With --pipeline: the micro-batches' order (1f1b keeps at most P in flight on the first "
    "stage; gpipe runs every forward first).",
    default="1f1b",
)
def train_cmd(
    model: ModelArgs,
    training: TrainArgs,
    data: Path | None,
    steps: int | None,
    no_shuffle: bool,
    seed: int,
    skip_nonfinite: bool,
    target: str | None,
    precision: str,
    mem_limit: str | None,
    mesh: str | None,
    parallel: str,
    sbps: tuple[str, ...],
    zero: int | None,
    pipeline: int | None,
    microbatches: int,
    stage_boundary: str | None,
    pipeline_schedule: str,
    export: Path | None,
    log: Path | None,
    project: Path | None,
    checkpoint_dir: Path | None,
    save_every: int | None,
    resume: Path | None,
) -> None:
    """Train MODEL (ONNX or .flow): its forward, the loss, the backward and the optimizer's
    update compile into one step program, built and run over the rows of --data."""
    from flowc.errors import InputError
    from flowc.trainer import train, with_train_block

    training = with_train_block(model.path, training)
    missing = [
        name
        for name, value in (
            ("--loss", training.loss),
            ("--optimizer", training.optimizer),
            ("--data", data),
            ("--steps", steps),
            # A .flow program's batch is its inputs' static axis 0.
            ("--batch", training.batch if model.path.suffix.lower() != ".flow" else 0),
        )
        if value is None
    ]
    if missing:
        raise InputError(
            f"flowc train needs {', '.join(missing)}",
            hint="e.g. flowc train model.onnx --loss cross_entropy:logits,labels "
            "--optimizer adamw:lr=0.001 --data train.npz --steps 100 --batch 32 (a .flow "
            "program's train block may give the training options)",
        )
    loss, optimizer, batch = training.loss, training.optimizer, training.batch
    assert loss and optimizer and data and steps
    placement: dict[str, Any] = {}
    if mesh is not None:
        placement = {"mesh": mesh, "parallel": parallel, "sbp": list(sbps), "zero": zero or 0}
    elif sbps or parallel != "data" or zero is not None:
        raise InputError("--parallel, --sbp and --zero need --mesh", hint="e.g. --mesh 4")
    if pipeline is not None:
        placement.update(
            pipeline=pipeline,
            microbatches=microbatches,
            stage_boundary=stage_boundary,
            pipeline_schedule=pipeline_schedule,
        )
        placement.pop("parallel", None)
    elif microbatches != 1 or stage_boundary is not None or pipeline_schedule != "1f1b":
        raise InputError(
            "--microbatches, --stage-boundary and --pipeline-schedule need --pipeline P",
            hint="e.g. --pipeline 2 --microbatches 4",
        )
    result = train(
        model.path,
        loss=loss,
        optimizer=optimizer,
        data=data,
        steps=steps,
        batch=batch,
        shuffle=not no_shuffle,
        seed=seed,
        target=target,
        project=project,
        export=export,
        log=log,
        lr_schedule=training.lr_schedule,
        clip_norm=training.clip_norm,
        freeze=training.freeze,
        no_decay=training.no_decay,
        untie=training.untie,
        ignore_index=training.ignore_index,
        label_smoothing=training.label_smoothing,
        accumulate=training.accumulate,
        recompute=training.recompute,
        mem_limit=mem_limit if mem_limit is not None else training.mem_limit,
        skip_nonfinite=skip_nonfinite,
        checkpoint_dir=checkpoint_dir,
        save_every=save_every,
        resume=resume,
        progress=progress,
        precision=precision,
        shape=list(model.shapes),
        dim=list(model.dims),
        weights=model.weights,
        **placement,
    )
    out.print(
        f"trained {steps} steps: loss {result.losses[0]:.6g} -> {result.losses[-1]:.6g} "
        f"({result.steps_per_s:.1f} steps/s)"
        + (f"; wrote {escape(str(export))}" if export is not None else "")
    )
