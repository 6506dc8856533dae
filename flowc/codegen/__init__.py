"""Code generation: a rank graph, its schedule and its memory plan -> a standalone C++
project (program.py writes the text; project.py writes OUT/). flowc.compiler drives it."""

from __future__ import annotations

from flowc.codegen.program import generate
from flowc.codegen.project import check_project_dir, write_project

__all__ = ["check_project_dir", "generate", "write_project"]
