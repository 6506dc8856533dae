"""The pass registry and a runner that can time passes and dump the IR after any of them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flowc.ir.graph import Graph
from flowc.ir.printer import print_graph
from flowc.ir.verify import verify_graph

PassFn = Callable[[Graph], Graph]
PASSES: dict[str, PassFn] = {}


def register_pass(name: str) -> Callable[[PassFn], PassFn]:
    def deco(fn: PassFn) -> PassFn:
        if name in PASSES:
            raise ValueError(f"pass {name!r} is registered twice")
        PASSES[name] = fn
        return fn

    return deco


def _load() -> None:
    from flowc.passes import (  # noqa: F401
        fold_batchnorm,
        fold_constants,
        fuse_attention,
        fuse_conv,
        fuse_elementwise,
        fuse_gelu,
        fuse_gemm,
        lower_ops,
        order_state,
        precision,
        simplify,
        split_projections,
        widen_types,
    )


@dataclass
class PassManager:
    pipeline: Sequence[str]
    dump_after: set[str] = field(default_factory=set)
    verify: bool = True
    timings: list[tuple[str, float]] = field(default_factory=list)
    dumps: list[tuple[str, str]] = field(default_factory=list)

    def run(self, graph: Graph) -> Graph:
        _load()
        unknown = [p for p in [*self.pipeline, *self.dump_after] if p not in PASSES]
        if unknown:
            from flowc.errors import FlowcError

            raise FlowcError(
                f"unknown pass(es): {', '.join(unknown)}",
                hint="passes: " + ", ".join(sorted(PASSES)),
            )
        for name in self.pipeline:
            t0 = time.perf_counter()
            graph = PASSES[name](graph)
            self.timings.append((name, time.perf_counter() - t0))
            if self.verify:
                verify_graph(graph)
            if name in self.dump_after:
                self.dumps.append((name, print_graph(graph)))
        return graph


DEFAULT_PIPELINE = ("fold_constants", "simplify")
# What `flowc compile` runs before placement and code generation, for one device and for
# many alike: the fusions come before placement, so a mesh places the fused ops.
COMPILE_PIPELINE = (
    *DEFAULT_PIPELINE,
    "lower_ops",
    "fold_batchnorm",
    "fuse_conv",
    "widen_types",
    "fuse_attention",
    "fuse_gemm",
    "fuse_elementwise",
    # A training step's state writes after their readers (nothing to do without state).
    "order_state_writes",
)


def compile_pipeline(
    precision: str = "fp32", placed: bool = False, symbolic: bool = False
) -> tuple[str, ...]:
    """What `flowc compile --precision P` runs: COMPILE_PIPELINE, with the narrow storage
    pass (passes/precision.py) before widen_types for bf16 and fp16. ``placed`` (a graph
    that the placement search will split over devices): split_projections first, so each of
    q, k and v is a projection whose weight columns split by heads (on one device the fused
    projection stays one GEMM, whose output attention reads as three views), and GEMM
    operands read packed (fuse_gemm_packed: a strided view cannot split). ``symbolic`` (a
    program with symbolic dims) reads them packed too: a view's strides would change with
    the sizes (the Transpose it would absorb runs as a size-generic kernel instead)."""
    passes: tuple[str, ...] = COMPILE_PIPELINE
    if precision in ("bf16", "fp16"):
        at = passes.index("widen_types")
        passes = (*passes[:at], f"store_{precision}", *passes[at:])
    if placed:
        at = len(DEFAULT_PIPELINE)
        passes = (*passes[:at], "split_projections", *passes[at:])
    if placed or symbolic:
        passes = tuple("fuse_gemm_packed" if p == "fuse_gemm" else p for p in passes)
    return passes
