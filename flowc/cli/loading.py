"""From the command line to a graph: importing MODEL and running the passes, and the mesh or
pipeline the parallel options ask for."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flowc.cli.common import err, progress
from flowc.cli.options import (
    ModelArgs,
    ParallelArgs,
    parse_bytes,
    parse_dim_values,
    parse_shapes,
)
from flowc.errors import InputError
from flowc.formatting import dims_text
from flowc.ir.verify import verify_graph


def load(
    model: Path,
    shapes: Sequence[str],
    dims: Sequence[str],
    *,
    for_compile: bool = False,
    times: Any = None,
    precision: str = "fp32",
    weights: str | None = None,
    dump_after: Sequence[str] = (),
    print_times: bool = False,
) -> Any:
    """Import and run the passes. With ``times`` (a StageTimes), the import and each pass
    are added to it for the caller to print with the later stages; otherwise
    ``print_times`` (--print-pass-times) prints them here."""
    from flowc.frontend import ImportOptions, load_graph
    from flowc.passes.manager import DEFAULT_PIPELINE, PassManager, compile_pipeline

    opts = ImportOptions(shapes=parse_shapes(shapes), dims=parse_dim_values(dims), weights=weights)
    t0 = time.perf_counter()
    graph = load_graph(model, opts)
    import_seconds = time.perf_counter() - t0
    pm = PassManager(
        compile_pipeline(precision) if for_compile else DEFAULT_PIPELINE,
        dump_after=set(dump_after),
    )
    graph = pm.run(graph)
    for name, text in pm.dumps:
        sys.stderr.write(f"# IR after {name}\n{text}")
    if times is not None:
        times.stages.append(("import", import_seconds))
        times.stages.extend((f"pass {name}", seconds) for name, seconds in pm.timings)
    elif print_times:
        err.print(f"pass times: import {import_seconds * 1e3:.1f} ms", markup=False)
        for name, seconds in pm.timings:
            err.print(f"  {name}: {seconds * 1e3:.1f} ms", markup=False)
    return graph


def load_model(
    model: ModelArgs, *, for_compile: bool = False, times: Any = None, precision: str = "fp32"
) -> Any:
    """load() with the model options of the command line."""
    return load(
        model.path,
        model.shapes,
        model.dims,
        for_compile=for_compile,
        times=times,
        precision=precision,
        weights=model.weights,
        dump_after=model.dump_after,
        print_times=model.print_times,
    )


def _program_graph(model: ModelArgs) -> Any:
    """A .flow program as written (its mesh and placements), before any pass."""
    from flowc.frontend import ImportOptions, load_graph

    return load_graph(model.path, ImportOptions(weights=model.weights))


def parallel_settings(model: ModelArgs, par: ParallelArgs) -> Any:
    """ParallelOptions from the command line and, for a .flow program, its own mesh and
    placements (its mesh when no --mesh is given; its placements are constraints like
    --sbp, which wins for the same value); None for a one-device program."""
    from flowc.parallel import ParallelOptions, parse_mesh, parse_sbp

    if par.pipeline is not None:
        return pipeline_settings(model, par)
    alone = [
        o
        for o, given in (
            ("--microbatches", par.microbatches != 1),
            ("--stage-boundary", par.stage_boundary is not None),
        )
        if given
    ]
    if alone:
        raise InputError(f"{', '.join(alone)} need{'s' if len(alone) == 1 else ''} --pipeline P")
    m = parse_mesh(par.mesh) if par.mesh is not None else None
    program_mesh, placed = None, {}
    if model.path.suffix.lower() == ".flow":
        graph = _program_graph(model)
        program_mesh = graph.mesh
        placed = {v.name: v.sbp for v in graph.values() if v.sbp is not None}
    if m is None:
        m = program_mesh
    if m is None:
        given = [o for o, v in (("--sbp", par.sbps), ("--mem-limit", par.mem_limit)) if v]
        if par.parallel != "auto":
            given.append("--parallel")
        if par.cost_profile is not None:
            given.append("--cost-profile")
        if par.search_nodes is not None:
            given.append("--search-nodes")
        if given:
            raise InputError(
                f"{', '.join(given)} need{'s' if len(given) == 1 else ''} --mesh",
                hint="e.g. --mesh 4 or --mesh 2x2 (or a mesh declaration in the program)",
            )
        return None
    if placed and program_mesh is not None and program_mesh.shape != m.shape:
        shape = dims_text(program_mesh.shape)
        raise InputError(
            f"{model.path}: its placements are for mesh {shape}, but --mesh is "
            f"{dims_text(m.shape)}",
            hint=f"use --mesh {shape}, or remove the program's @ annotations",
        )
    fixed = dict(parse_sbp(t, m) for t in par.sbps)
    if m.size == 1:
        # One device: every layout is whole; the program is the ordinary one.
        return None
    if par.parallel != "none":
        # `none` keeps every value whole: the program's placements do not apply.
        fixed = {**placed, **fixed}
    limit = parse_bytes(par.mem_limit, "--mem-limit") if par.mem_limit is not None else None
    return ParallelOptions(
        m, par.parallel, fixed, limit, par.cost_profile, node_limit=par.search_nodes
    )


def pipeline_settings(model: ModelArgs, par: ParallelArgs) -> Any:
    """A PipelineSpec from --pipeline P [--mesh PxK] [--microbatches M] [--stage-boundary]."""
    import math

    from flowc.compiler import PipelineSpec, check_pipeline_mesh
    from flowc.ir.types import Mesh
    from flowc.parallel import ParallelOptions, parse_mesh
    from flowc.schedule.partition import parse_stage_boundaries

    assert par.pipeline is not None
    stages = int(par.pipeline)
    if par.sbps:
        raise InputError(
            "--sbp is not supported with --pipeline yet",
            hint="leave the layouts to the search on each stage's devices",
        )
    if par.mesh is not None:
        m = parse_mesh(par.mesh)
    else:
        program_mesh = None
        if model.path.suffix.lower() == ".flow":
            program_mesh = _program_graph(model).mesh
        m = program_mesh or Mesh("gpus", (stages,))
    text = par.stage_boundary
    spec = PipelineSpec(
        stages,
        m,
        microbatches=int(par.microbatches),
        boundaries=parse_stage_boundaries(text) if text is not None else None,
        mem_limit=parse_bytes(par.mem_limit, "--mem-limit") if par.mem_limit is not None else None,
    )
    check_pipeline_mesh(spec)
    if math.prod(m.shape[1:]) > 1:
        spec.stage_options = ParallelOptions(
            Mesh("stage", m.shape[1:]),
            par.parallel,
            {},
            None,
            par.cost_profile,
            node_limit=par.search_nodes,
        )
    elif par.cost_profile is not None:
        spec.stage_options = ParallelOptions(
            Mesh("stage", (1,)), "none", {}, None, par.cost_profile
        )
    return spec


def load_parallel(model: ModelArgs, popts: Any, times: Any = None) -> tuple[Any, Any]:
    """The logical graph and its parallelized form (plan, rank graph, cost, memory)."""
    from flowc.compiler import parallelize
    from flowc.passes.split_projections import split_projections

    graph = split_projections(load_model(model, times=times))
    verify_graph(graph)
    progress(
        f"placing {len(graph.nodes)} nodes on mesh {dims_text(popts.mesh.shape)} ({popts.method})"
    )
    t0 = time.perf_counter()
    result = (
        parallelize(graph, popts)
        if times is None
        else times.run("parallel placement", lambda: parallelize(graph, popts))
    )
    progress(f"plan ready in {time.perf_counter() - t0:.2f} s")
    return graph, result
