"""`flowc build`: build a project made by `flowc compile`."""

from __future__ import annotations

from pathlib import Path

import click
from rich.markup import escape

from flowc.cli.common import choose_target, out, progress
from flowc.cli.options import project_argument, sanitize_option, target_option


@click.command(name="build", short_help="Build a project made by `flowc compile` (CMake).")
@project_argument
@target_option(["cuda", "host"], "Default: cuda where nvcc is found, else host.")
@sanitize_option(
    "Host target only: build with AddressSanitizer and/or UBSan, comma-separated "
    "(into build-host-asan, ...; run it with `flowc run --sanitize`)."
)
def build_cmd(project: Path, target: str | None, sanitize: str | None) -> None:
    """Build a project made by `flowc compile` (CMake; the compiler's errors are shown)."""
    from flowc.harness.build import build

    # Sanitizers exist on the host build only: asking for them picks it.
    target = choose_target(target, "build", sanitize=bool(sanitize))
    bdir = build(project, target, progress=progress, sanitize=sanitize)
    out.print(f"built {escape(str(bdir))}/model_main")
