"""Code generation: graph + plans -> a standalone C++ project (see program.py)."""

from __future__ import annotations

from pathlib import Path

from flowc.codegen.program import generate, write_project
from flowc.ir.graph import Graph


def compile_graph(
    graph: Graph, out: Path, prefix: str | None = None, source: str = "", arch: str = "90"
) -> dict[str, str]:
    """Write OUT/ for ``graph``; returns the generated text files."""
    files, weights = generate(graph, prefix=prefix, source=source, arch=arch)
    write_project(out, files, weights)
    return files


__all__ = ["compile_graph"]
