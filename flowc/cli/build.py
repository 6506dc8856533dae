"""`flowc build`: build a project made by `flowc compile`."""

from __future__ import annotations

from pathlib import Path

import click
from rich.markup import escape

from flowc.cli.common import choose_target, out, progress
from flowc.cli.options import project_argument, sanitize_option, target_option


@click.command(name="build", short_help="Build a project made by `flowc compile` (CMake).")
@project_argument
@target_option(
    ["cuda", "host"],
    "Default: the project's recorded target (compile --target), else cuda where a GPU is "
    "present, else host: what `flowc run` uses.",
)
@sanitize_option(
    "Host target only: build with AddressSanitizer and/or UBSan, comma-separated "
    "(into build-host-asan, ...; run it with `flowc run --sanitize`)."
)
def build_cmd(project: Path, target: str | None, sanitize: str | None) -> None:
    """Build a project made by `flowc compile` (CMake; the compiler's errors are shown).
    Ctrl-C stops every compiler it started and removes what the build wrote."""
    from flowc.api import Project

    proj = Project(project)
    # Sanitizers exist on the host build only: asking for them picks it.
    target = choose_target(target, project, sanitize=bool(sanitize))
    bdir = proj.build(target, sanitize=sanitize, progress=progress)
    out.print(f"built {escape(str(bdir))}/model_main")
