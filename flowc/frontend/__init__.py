"""Front ends: ONNX files and .flow DSL programs to the IR."""

from __future__ import annotations

import os
from pathlib import Path

from flowc.errors import ModelLoadError
from flowc.frontend.onnx import ImportOptions
from flowc.ir.graph import Graph


def load_graph(path: str | os.PathLike[str], opts: ImportOptions | None = None) -> Graph:
    """Read a model file into the IR, choosing the front end by the file's suffix."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".onnx":
        if opts is not None and opts.weights is not None:
            raise ModelLoadError(
                "--weights is for .flow programs; an ONNX model carries its own weights"
            )
        from flowc.frontend.onnx import import_onnx

        return import_onnx(p, opts)
    if suffix == ".flow":
        if opts is not None and (opts.shapes or opts.dims):
            raise ModelLoadError(
                f"{p}: --shape/--dim fix an ONNX model's dynamic dimensions; a .flow program's "
                "types are static",
                hint="edit the types in the program instead",
            )
        from flowc.frontend.dsl import load_program

        return load_program(
            p, opts.weights if opts is not None else None, opts.sizes if opts is not None else None
        )
    raise ModelLoadError(
        f"{p}: unknown model format {p.suffix or '(no suffix)'!r}",
        hint="flowc reads ONNX models (.onnx) and flowc DSL programs (.flow)",
    )


__all__ = ["ImportOptions", "load_graph"]
