"""`flowc compile`: MODEL to a standalone C++ project; compile_model() is what compile and
verify share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from flowc.cli.common import choose_target, out, progress
from flowc.cli.loading import dump_ir, parallel_settings, print_stage_times
from flowc.cli.options import (
    ModelArgs,
    ParallelArgs,
    ScheduleArgs,
    model_options,
    output_option,
    parallel_options,
    schedule_options,
    target_option,
)
from flowc.errors import InputError

# The oldest CUDA architecture --arch takes: Maxwell, the oldest CUDA 12 builds for (CUDA 13
# starts at sm_75; its nvcc says so when the build asks for less).
MIN_ARCH = 50


@click.command(
    name="compile", short_help="Compile MODEL (ONNX or .flow) into a standalone C++ project."
)
@model_options
@output_option("project", "Project directory OUT/.", directory=True, required=True)
@target_option(
    ["cuda", "host"],
    "The build to suggest; both build from the same OUT/ (default: cuda where nvcc is found, "
    "else host).",
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
def compile_cmd(
    model: ModelArgs,
    project: Path,
    target: str | None,
    arch: str,
    prefix: str | None,
    force: bool,
    schedule: ScheduleArgs,
    parallel: ParallelArgs,
) -> None:
    """Compile MODEL into a standalone C++ project OUT/ (model.cu, model.h, main.cu, weights,
    CMake). OUT/ keeps every file flowc did not write (flowc_model.json lists those it did);
    a non-empty OUT/ that is no flowc project is refused unless --force."""
    import re
    import shlex

    from flowc.codegen.cpp import MAX_PREFIX, is_c_ident
    from flowc.codegen.project import check_project_dir

    # Everything the command line decides is checked before the (slow) model work.
    number = re.fullmatch(r"sm_([0-9]{2,3})", arch)
    if number is None or int(number.group(1)) < MIN_ARCH:
        shown = arch if len(arch) <= 20 else arch[:17] + "..."
        raise InputError(
            f"--arch {shown}: expected a CUDA architecture sm_NN from sm_{MIN_ARCH}, e.g. sm_90",
            hint="sm_80 for an A100, sm_90 for an H100 or H200 (nvcc --list-gpu-arch lists "
            "those your CUDA builds for)",
        )
    if prefix is not None and not is_c_ident(prefix):
        raise InputError(
            f"--prefix {prefix[:40]!r} is not a C identifier",
            hint="use ASCII letters, digits and underscores, not starting with a digit",
        )
    if prefix is not None and len(prefix) > MAX_PREFIX:
        raise InputError(
            f"--prefix: {len(prefix)} characters; a prefix has at most {MAX_PREFIX}",
            hint="it names the library file, lib<prefix>_model.so, and a file name holds 255 bytes",
        )
    check_project_dir(project, force)
    popts = parallel_settings(model, parallel)
    target = choose_target(target, "build")
    compile_model(
        model,
        project,
        popts,
        schedule,
        prefix=prefix,
        arch=arch[3:],
        force=force,
        parallel=parallel,
    )
    shown = shlex.quote(str(project))
    out.print(
        f"wrote {shown}/; build it with: flowc build {shown} --target {target}",
        markup=False,
    )


def compile_model(
    model: ModelArgs,
    project: Path,
    popts: Any,
    schedule: ScheduleArgs,
    prefix: str | None = None,
    arch: str = "90",
    force: bool = False,
    parallel: ParallelArgs | None = None,
) -> None:
    """The driver's compile_model for the command line's options (``popts``: the placement
    target, checked before): what compile and verify share. --print-pass-times prints every
    stage's time at the end."""
    from flowc.compiler import StageTimes
    from flowc.compiler import compile_model as drive
    from flowc.options import CompileOptions

    times = StageTimes()
    opts = CompileOptions(
        model, schedule, parallel or ParallelArgs(), prefix=prefix, arch=arch, force=force
    )
    drive(opts, project, target=popts, progress=progress, dump=dump_ir, times=times)
    if model.print_times:
        print_stage_times(times)
