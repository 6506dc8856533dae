"""`flowc train`: compile MODEL's training step (forward, loss, backward, optimizer update as
one program), build it, and run it over a dataset."""

from __future__ import annotations

from pathlib import Path

import click
from rich.markup import escape

from flowc.cli.common import out, progress
from flowc.cli.options import (
    GroupedCommand,
    ModelArgs,
    count_option,
    flag_option,
    model_options,
    path_option,
    seed_option,
    target_option,
    text_option,
)


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
@text_option(
    "--loss",
    "KIND:PRED[,TARGET]",
    "cross_entropy:LOGITS,LABELS (class axis last, integer labels), mse:PRED,TARGET, "
    "l1:..., bce_with_logits:..., or output:VALUE (a scalar of the model is the loss). PRED "
    "names any value of the model; TARGET becomes a new input, read from --data.",
)
@text_option(
    "--optimizer",
    "KIND:k=v,...",
    "sgd:lr=..,momentum=..,dampening=..,nesterov=..,weight_decay=.. | "
    "adam:lr=..,beta1=..,beta2=..,eps=..,weight_decay=.. | adamw:... (PyTorch's defaults "
    "for what is not given; lr is required).",
)
@path_option(
    "--data", help="DATA.npz: one array per model input and the target, examples on axis 0."
)
@count_option("--steps", "N", "Steps to run.", low=1)
@count_option("--batch", "B", "Examples per step (binds axis 0 of every model input).", low=1)
@flag_option("--no-shuffle", "Take the rows in file order (step s: rows sB..sB+B-1, wrapping).")
@seed_option("Seed of the per-epoch shuffle.")
@text_option(
    "--lr-schedule",
    "KIND:k=v,...",
    "constant[:warmup=W] | cosine:warmup=W,total=T,min_lr=F | linear:... (the rate of step "
    "t, from 1, computed in the step).",
)
@click.option(
    "--clip-norm",
    type=float,
    default=None,
    metavar="X",
    help="Clip the gradients' global norm to X.",
)
@text_option("--freeze", "REGEX", "Parameters (initializers) whose names match stay as they are.")
@text_option("--no-decay", "REGEX", "Parameters whose names match get no weight decay.")
@click.option(
    "--ignore-index",
    type=int,
    default=None,
    metavar="I",
    help="cross_entropy: labels equal to I count for nothing.",
)
@click.option(
    "--label-smoothing",
    type=float,
    default=0.0,
    metavar="E",
    help="cross_entropy: smooth the targets by E.",
)
@flag_option("--skip-nonfinite", "Skip a step whose loss is NaN or infinite instead of stopping.")
@target_option(["host", "cuda"], "Default: cuda where a GPU is present, else host.")
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
def train_cmd(
    model: ModelArgs,
    loss: str | None,
    optimizer: str | None,
    data: Path | None,
    steps: int | None,
    batch: int | None,
    no_shuffle: bool,
    seed: int,
    lr_schedule: str | None,
    clip_norm: float | None,
    freeze: str | None,
    no_decay: str | None,
    ignore_index: int | None,
    label_smoothing: float,
    skip_nonfinite: bool,
    target: str | None,
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
    from flowc.trainer import train

    missing = [
        name
        for name, value in (
            ("--loss", loss),
            ("--optimizer", optimizer),
            ("--data", data),
            ("--steps", steps),
            ("--batch", batch),
        )
        if value is None
    ]
    if missing:
        raise InputError(
            f"flowc train needs {', '.join(missing)}",
            hint="e.g. flowc train model.onnx --loss cross_entropy:logits,labels "
            "--optimizer adamw:lr=0.001 --data train.npz --steps 100 --batch 32",
        )
    assert loss and optimizer and data and steps and batch
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
        lr_schedule=lr_schedule,
        clip_norm=clip_norm,
        freeze=freeze,
        no_decay=no_decay,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        skip_nonfinite=skip_nonfinite,
        checkpoint_dir=checkpoint_dir,
        save_every=save_every,
        resume=resume,
        progress=progress,
        shape=list(model.shapes),
        dim=list(model.dims),
        weights=model.weights,
    )
    out.print(
        f"trained {steps} steps: loss {result.losses[0]:.6g} -> {result.losses[-1]:.6g} "
        f"({result.steps_per_s:.1f} steps/s)"
        + (f"; wrote {escape(str(export))}" if export is not None else "")
    )
