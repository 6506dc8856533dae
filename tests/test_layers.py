"""The pipeline's stages import in any order: each module of the driver's path loads on its
own in a fresh interpreter state (an import circle shows as a partially initialized module
when the wrong one is imported first)."""

from __future__ import annotations

import importlib
import sys

import pytest

MODULES = [
    "flowc.compiler",
    "flowc.codegen.cpp",
    "flowc.codegen.elementwise",
    "flowc.codegen.program",
    "flowc.codegen.project",
    "flowc.memory.plan",
    "flowc.memory.check",
    "flowc.schedule.actors",
    "flowc.schedule.simulate",
    "flowc.schedule.streams",
    "flowc.schedule.program",
    "flowc.schedule.partition",
    "flowc.schedule.pipeline",
    "flowc.schedule.gantt",
    "flowc.parallel",
    "flowc.parallel.boxing",
    "flowc.parallel.cost",
    "flowc.parallel.pipeline",
    "flowc.ops.registry",
    "flowc.passes.manager",
]


@pytest.mark.parametrize("name", MODULES)
def test_module_imports_first(name: str) -> None:
    saved = {k: v for k, v in sys.modules.items() if k == "flowc" or k.startswith("flowc.")}
    for k in saved:
        del sys.modules[k]
    try:
        importlib.import_module(name)
    finally:
        for k in [k for k in sys.modules if k == "flowc" or k.startswith("flowc.")]:
            del sys.modules[k]
        sys.modules.update(saved)
