"""Code generation: graph + plans -> a standalone C++ project (see program.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from flowc.codegen.program import generate, write_project
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
) -> dict[str, str]:
    """Write OUT/ for ``graph``; returns the generated text files. ``poison`` fills dead arena
    bytes with NaN between uses (a debugging aid the tests use)."""
    files, weights = generate(
        graph, prefix=prefix, source=source, arch=arch, poison=poison, physical=physical
    )
    write_project(out, files, weights)
    return files


__all__ = ["compile_graph"]
