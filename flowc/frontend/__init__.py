"""Front ends: ONNX files (and, later, .flow DSL programs) to the IR."""

from __future__ import annotations

import os
from pathlib import Path

from flowc.errors import ModelLoadError
from flowc.frontend.onnx import ImportOptions
from flowc.ir.graph import Graph


def load_graph(path: str | os.PathLike[str], opts: ImportOptions | None = None) -> Graph:
    """Read a model file into the IR, choosing the front end by the file's suffix."""
    p = Path(path)
    if p.suffix.lower() == ".onnx":
        from flowc.frontend.onnx import import_onnx

        return import_onnx(p, opts)
    raise ModelLoadError(
        f"{p}: unknown model format {p.suffix or '(no suffix)'!r}",
        hint="flowc reads ONNX models (.onnx)",
    )


__all__ = ["ImportOptions", "load_graph"]
