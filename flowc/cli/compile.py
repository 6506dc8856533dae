"""`flowc compile`: MODEL to a standalone C++ project; compile_model() is what compile and
verify share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from flowc.cli.common import choose_target, out, progress
from flowc.cli.loading import dump_ir, print_stage_times
from flowc.cli.options import (
    GroupedCommand,
    ModelArgs,
    ParallelArgs,
    ScheduleArgs,
    TrainArgs,
    model_options,
    output_option,
    parallel_options,
    schedule_options,
    target_option,
    training_options,
)
from flowc.errors import InputError


@click.command(
    name="compile",
    cls=GroupedCommand,
    short_help="Compile MODEL (ONNX or .flow) into a standalone C++ project.",
    examples=[
        "flowc compile model.onnx -o out/ && flowc build out/",
        "flowc compile bert.onnx -o out/ --shape input_ids=2x32 --precision bf16 --mesh 4",
    ],
)
@model_options
@output_option("project", "Project directory OUT/.", directory=True, required=True)
@target_option(
    ["cuda", "host"],
    "Record the target that build, run and verify use for this project unless told "
    "(default: none recorded; they use cuda where a GPU is present, else host).",
)
@click.option(
    "--arch", default="sm_90", show_default=True, help="CUDA architecture for the CUDA build."
)
@click.option("--prefix", default=None, help="C symbol prefix (default: from the model's name).")
@click.option(
    "--force",
    is_flag=True,
    help="Write into a non-empty OUT/ that is no flowc project (still deletes nothing).",
)
@schedule_options
@parallel_options
@click.option(
    "--train",
    is_flag=True,
    help="Compile MODEL's training step (forward, loss, backward, update; `flowc train` "
    "runs it) instead of its inference; takes the training options.",
)
@training_options
def compile_cmd(
    model: ModelArgs,
    project: Path,
    target: str | None,
    arch: str,
    prefix: str | None,
    force: bool,
    schedule: ScheduleArgs,
    parallel: ParallelArgs,
    train: bool,
    training: TrainArgs,
) -> None:
    """Compile MODEL into a standalone C++ project OUT/ (model.cu, model.h, main.cu, weights,
    CMake). OUT/ keeps every file flowc did not write (flowc_model.json lists those it did);
    a non-empty OUT/ that is no flowc project is refused unless --force."""
    import shlex

    from flowc.api import compile_project
    from flowc.compiler import StageTimes
    from flowc.options import CompileOptions

    if train or training != TrainArgs():
        import dataclasses

        if parallel.mesh is None and parallel.pipeline is None:
            training = dataclasses.replace(training, mem_limit=parallel.mem_limit)
        _compile_training(
            model, project, target, arch, prefix, force, schedule, train, training, parallel
        )
        return
    if parallel.zero is not None:
        raise InputError(
            f"--zero {parallel.zero} splits a training step's state: it needs --train",
            hint="flowc compile MODEL --train ... --mesh N --zero K",
        )
    opts = CompileOptions(
        model, schedule, parallel, prefix=prefix, arch=arch, force=force, target=target
    )
    chosen = choose_target(target)
    times = StageTimes()
    # compile_project checks every option before the (slow) model work.
    compile_project(opts, project, progress=progress, dump=dump_ir, times=times)
    if model.print_times:
        print_stage_times(times)
    shown = shlex.quote(str(project))
    how = f" --target {chosen}" if target is None and chosen != "host" else ""
    out.print(f"wrote {shown}/; build it with: flowc build {shown}{how}", markup=False)


def compile_model(
    model: ModelArgs,
    project: Path,
    popts: Any,
    schedule: ScheduleArgs,
    prefix: str | None = None,
    arch: str = "sm_90",
    force: bool = False,
    parallel: ParallelArgs | None = None,
    target: str | None = None,
) -> None:
    """What verify compiles with (``popts``: the placement target, checked before), through
    the API's compile_project; --print-pass-times prints every stage's time at the end."""
    from flowc.api import compile_project
    from flowc.compiler import StageTimes
    from flowc.options import CompileOptions

    times = StageTimes()
    opts = CompileOptions(
        model,
        schedule,
        parallel or ParallelArgs(),
        prefix=prefix,
        arch=arch,
        force=force,
        target=target,
    )
    compile_project(opts, project, progress=progress, dump=dump_ir, times=times, placement=popts)
    if model.print_times:
        print_stage_times(times)


def _placement_options(parallel: ParallelArgs) -> dict[str, Any]:
    """compile_step's keywords for the placement options given (none without --mesh or
    --pipeline)."""
    if parallel.pipeline is not None:
        return {
            "zero": parallel.zero or 0,
            "mesh": parallel.mesh,
            "pipeline": parallel.pipeline,
            "microbatches": parallel.microbatches,
            "stage_boundary": parallel.stage_boundary,
            "pipeline_schedule": parallel.pipeline_schedule,
        }
    if parallel.mesh is None:
        return {"zero": parallel.zero or 0}
    return {
        "zero": parallel.zero or 0,
        "mesh": parallel.mesh,
        "parallel": parallel.parallel,
        "sbp": list(parallel.sbps),
        "mem_limit": parallel.mem_limit,
        "cost_profile": parallel.cost_profile,
        "search_nodes": parallel.search_nodes,
    }


def _compile_training(
    model: ModelArgs,
    project: Path,
    target: str | None,
    arch: str,
    prefix: str | None,
    force: bool,
    schedule: ScheduleArgs,
    train: bool,
    training: TrainArgs,
    parallel: ParallelArgs,
) -> None:
    """`flowc compile --train`: the training step's project, not run (on a mesh: placed,
    each rank's program in one project)."""
    import shlex

    from flowc.errors import InputError
    from flowc.trainer import compile_step, spec_of, with_train_block

    if not train:
        raise InputError(
            "--loss, --optimizer and the other training options need --train",
            hint="flowc compile MODEL --train --loss ... --optimizer ... -o OUT",
        )
    training = with_train_block(model.path, training)
    spec = spec_of(training, "flowc compile --train")
    chosen = choose_target(target)
    step, _ = compile_step(
        model.path,
        spec,
        project,
        batch=training.batch,
        target=target,
        progress=progress,
        shape=list(model.shapes),
        dim=list(model.dims),
        weights=model.weights,
        prefix=prefix,
        arch=arch,
        force=force,
        no_cuda_graph=schedule.no_cuda_graph,
        precision=schedule.precision,
        streams=schedule.streams,
        schedule_for=schedule.schedule_for,
        **_placement_options(parallel),
    )
    shown = shlex.quote(str(project))
    # run() of a program placed on several devices infers nothing yet.
    one_device = parallel.mesh is None and parallel.pipeline is None
    out.print(
        f"wrote {shown}/: the training step of {model.path.name} ({len(step.params)} trained "
        f"parameters; batch inputs {', '.join(step.batch)}; the model keeps "
        f"{len(step.graph.state)} state tensors on the device, updated in place: "
        f"model.h's train_step{'; run() infers with them' if one_device else ''}); build it "
        "with: flowc build "
        f"{shown}" + (f" --target {chosen}" if target is None and chosen != "host" else ""),
        markup=False,
    )
