"""Code generation: graph + plans -> a standalone C++ project (program.py; project.py writes it)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from flowc.codegen.program import generate
from flowc.codegen.project import check_project_dir, write_project
from flowc.ir.graph import Graph

if TYPE_CHECKING:
    from flowc.parallel.lower import Physical


def compile_graph(
    graph: Graph,
    out: Path,
    prefix: str | None = None,
    source: str = "",
    arch: str = "90",
    poison: bool = False,
    physical: Physical | None = None,
    force: bool = False,
) -> dict[str, str]:
    """Write OUT/ for ``graph``; returns the generated text files. ``poison`` fills dead arena
    bytes with NaN between uses (a debugging aid the tests use). OUT/ keeps what flowc did
    not write (see project.py); ``force`` allows a non-empty OUT/ that is no flowc project."""
    check_project_dir(out, force)  # before the (slow) generation
    files, weights = generate(
        graph, prefix=prefix, source=source, arch=arch, poison=poison, physical=physical
    )
    write_project(out, files, weights, force=force)
    return files


__all__ = ["check_project_dir", "compile_graph"]
