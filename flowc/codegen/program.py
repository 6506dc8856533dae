"""Code generation: a planned graph to a standalone C++ project (OUT/).

The Program is what an op's ``emit`` hook writes into: kernels (rendered from the op
family's template under templates/kernels/, deduplicated by text so identical kernels are
emitted once), statements of the run() function in schedule order, and fills that
initialize splat constants at create time. Pointers come from the memory plan: graph inputs
and outputs are the caller's, constants live in the weights buffer, intermediates in the
arena.

(Over 800 lines: the Program API, the schedule's emission and the project's rendering share
one module's private helpers; splitting _render out is issue 16's next step.)

One idea: a planned graph to its C++ project; kept whole because the single-device and
pipeline generators share the Program, its template environment and the weight layout.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from itertools import product
from typing import TYPE_CHECKING, Any

import jinja2
import numpy as np

from flowc.codegen.cpp import (
    BLOCK,
    MAX_GRID,
    MAX_PREFIX,
    CodegenError,
    c_comment,
    c_float,
    c_ident,
    c_int,
    c_literal,
    c_string,
    cmake_comment,
    cmake_string,
    ctype,
    is_c_ident,
)
from flowc.codegen.elementwise import emit_broadcast_sized, emit_elementwise, emit_fused
from flowc.codegen.weights import WEIGHTS_MAGIC as WEIGHTS_MAGIC  # re-exported
from flowc.codegen.weights import WeightsLayout as WeightsLayout  # re-exported
from flowc.ir.dtype import DType
from flowc.ir.graph import Graph, Node, Value, is_splat
from flowc.ir.symbolic import DimRange, SymDim, evaluate, fit_grid
from flowc.ir.types import Mesh, NdSbp, TensorType
from flowc.memory.plan import ALIGN, Buffer, MemoryPlan
from flowc.ops.registry import get_op, is_view
from flowc.resources import templates_dir
from flowc.schedule.program import Schedule, StreamOp
from flowc.version import __version__

if TYPE_CHECKING:
    from flowc.parallel.lower import Physical
    from flowc.parallel.pipeline import Pipelined
    from flowc.schedule.unroll import Unrolled

# The alignment run() requires of the caller's input and output pointers (model.h): what
# 128-bit loads and the GEMM plans' CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES assume.
POINTER_ALIGNMENT = 16
# Library plan kinds (Program.library_plan) -> their C++ types (runtime_cpp/flowc/gemm.h, conv.h).
PLAN_TYPES = {
    "gemm": "flowc::GemmPlan",
    "conv": "flowc::ConvPlan",
    "conv_bwd": "flowc::ConvBwdPlan",
}


def template_env() -> jinja2.Environment:
    """Templates' environment. Text from the model or the command line reaches a generated
    file only through one of its filters, one per context: ``c_string`` (a C/C++ string
    literal, exact), ``c_comment`` (inside a C/C++ comment), ``cmake_comment`` and
    ``cmake_string``."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters.update(
        c_float=c_float,
        c_int=c_int,
        c_string=c_string,
        c_comment=c_comment,
        cmake_comment=cmake_comment,
        cmake_string=cmake_string,
    )
    return env


def layout_weights(
    graph: Graph,
    data_of: Callable[[Value], np.ndarray] | None = None,
    *,
    physical: Physical | None = None,
    coords: tuple[int, ...] | None = None,
    identity: str = "",
    inference: Graph | None = None,
) -> WeightsLayout:
    """Stored constants first (256-aligned), then room for splats, which stay fills.
    ``data_of`` gives a constant's bytes when they are not its own. With ``physical`` and
    ``coords``, the layout is rank ``coords``'s of that multi-rank program: its shards are the
    data (unless ``data_of`` says otherwise), and the rank, the mesh and each constant's shard
    layout enter the layout id, so that a rank refuses another rank's file. ``inference``: a training program's
    inference graph, whose constants are stored after the step's and whose state inputs (the
    trained parameters, by name) lie on the step's bytes of them."""
    if physical is not None and coords is not None and data_of is None:

        def data_of(v: Value) -> np.ndarray:
            return physical.constant_for(v, coords)

    offsets: dict[Value, int] = {}
    # The data is read when the file is written (codegen/weights.py), never joined here.
    parts: list[tuple[int, Callable[[], np.ndarray]]] = []
    pos = 0
    # The constants, then the state (Graph.state: a training step's parameters, optimizer
    # state, step counter): stored ones first, splats after them, as fills.
    held = [(c, _const_data(c)) for c in graph.constants]
    if inference is not None:
        held += [(c, _const_data(c)) for c in inference.constants]
    if physical is not None and coords is not None:
        held += [(v, physical.state_for(v.name, a, coords)) for v, a in state_inputs(graph)]
    else:
        held += state_inputs(graph)
    for c, a in held:
        if is_splat(a):
            continue
        offsets[c] = pos
        source = partial(_held, a) if c.const is None else partial(_const_data, c)
        parts.append((pos, source if data_of is None or c.const is None else partial(data_of, c)))
        nbytes = c.type.nbytes
        pos += nbytes + (-nbytes) % ALIGN
    stored = pos
    for c, a in held:
        if is_splat(a):
            offsets[c] = pos
            pos += (c.type.nbytes + ALIGN - 1) // ALIGN * ALIGN
    # A state output is written over its input.
    for x, xn in graph.state_pairs():
        offsets[xn] = offsets[x]
    if inference is not None:
        step_state = {v.name: offsets[v] for v, _ in state_inputs(graph)}
        for v, _ in state_inputs(inference):
            offsets[v] = step_state[v.name]
    desc = ";".join(f"{c.name}:{c.type}:{offsets[c]}" for c, a in held if not is_splat(a))
    if graph.state:
        desc += "|state " + ";".join(f"{c.name}:{c.type}" for c, _ in state_inputs(graph))
    if physical is not None and coords is not None:
        from flowc.ir.layout import rank_of

        mesh = physical.mesh
        shards = ";".join(
            f"{c.name}:{physical.shards[c][1]}:{list(physical.shards[c][0].shape)}"
            for c in graph.constants
            if c in physical.shards
        )
        desc += (
            f"|rank {rank_of(mesh, coords)} {list(coords)} of mesh "
            f"{'x'.join(map(str, mesh.shape))}|{shards}"
        )
    if identity:
        desc += f"|{identity}"  # e.g. a pipeline rank's stage, rank and mesh
    layout_id = zlib.crc32(desc.encode()) | (stored << 32)
    return WeightsLayout(offsets, stored, pos, layout_id & 0xFFFFFFFFFFFFFFFF, parts)


def _const_data(c: Value) -> np.ndarray:
    assert c.const is not None
    return c.const


def _held(a: np.ndarray) -> np.ndarray:
    return a


def state_inputs(graph: Graph) -> list[tuple[Value, np.ndarray]]:
    """The state the model keeps (Graph.state), each input with its first value."""
    inputs = {v.name: v for v in graph.inputs}
    return [(inputs[n], np.asarray(graph.params[n])) for n in graph.state]


def api_inputs(graph: Graph) -> list[Value]:
    """run()'s inputs: the graph's, but the state the model keeps."""
    return [v for v in graph.inputs if v.name not in graph.state]


def api_outputs(graph: Graph) -> list[Value]:
    """run()'s outputs: the graph's, but the state written in place."""
    written = set(graph.state.values())
    return [v for v in graph.outputs if v.name not in written]


# The highest power of one symbol in the sizes an emitter computes (sized_ints): a mask of
# [batch, 1, seq, seq] steps seq^2 elements per batch.
SIZED_DEGREE = 3


class Program:
    """What emit hooks write into; see the module docstring."""

    def __init__(
        self,
        graph: Graph,
        schedule: Schedule,
        plan: MemoryPlan,
        weights: WeightsLayout,
        prefix: str,
        kernels: dict[str, str] | None = None,
        precision: str = "fp32",
        caller_offsets: dict[Value, int] | None = None,
        inference: bool = False,
    ) -> None:
        self.graph = graph
        # A training program's inference schedule (run() beside the step): its library
        # handles and plans are fields of their own (suffix "_infer"), it is not traced, and
        # its state inputs are the step's parameters, which the step's program fills.
        self.inference = inference
        self.suffix = "_infer" if inference else ""
        # Byte offsets of inputs and outputs into the caller's buffers (a pipeline stage's
        # micro-batch slices): what alignment their pointers keep (caller_align).
        self.caller_offsets = caller_offsets or {}
        self.precision = precision
        self.schedule = schedule
        self.plan = plan
        self.weights = weights
        self.prefix = prefix
        self.env = template_env()
        # source -> name; the stages of a pipeline share one table (one model.cu).
        self._kernels: dict[str, str] = {} if kernels is None else kernels
        self.statements: list[str] = []
        self.fills: list[str] = []
        self._inputs = {v: k for k, v in enumerate(api_inputs(graph))}
        self._outputs: dict[Value, int] = {}
        for k, v in enumerate(api_outputs(graph)):
            self._outputs.setdefault(v, k)
        self._view_base: dict[Value, Value] = {}
        for node in graph.nodes:
            if is_view(graph, node) and node.inputs and node.inputs[0] is not None:
                self._view_base[node.outputs[0]] = node.inputs[0]
        self.node: Node | None = None
        self.current_stream = 0
        self.microbatch = 0  # the micro-batch of the actor being emitted (pipelines)
        # The emitted program's stream operations, for the memory checker.
        self.ops: list[StreamOp] = []
        self.blas_streams: set[int] = set()
        self.conv_streams: set[int] = set()
        # Library plans made once in create() (kind -> the C++ statements that make them, in
        # index order); run() only executes them. See library_plan().
        self.plans: dict[str, list[tuple[str, str]]] = {}
        self._modules: dict[str, Any] = {}  # template -> its module (see _macro)
        # Symbolic dims: each symbol's slot in the run's size table (the device copy `ddims`,
        # which kernels take as `sizes`, and the host copy `hdims` for grids and library
        # calls; docs/dynamic.md).
        self.slots = {s: k for k, s in enumerate(graph.symbols)}
        self.counts = frozenset(s for s, r in graph.symbols.items() if r.computed)

    # -- symbolic dims ---------------------------------------------------------------------

    def is_sized(self, node: Node) -> bool:
        """Whether ``node`` reads or writes a tensor of symbolic type: its code reads the
        run's sizes."""
        return any(v is not None and v.type.sym is not None for v in (*node.inputs, *node.outputs))

    def leading_only(self, node: Node) -> bool:
        """Whether only the first dim of ``node``'s tensors is symbolic: a kernel that walks
        the flat elements of its output, with every other dim fixed, then serves every size
        once it is given the run's element count (launch_numel)."""
        return all(
            v is None or v.type.sym is None or not any(v.type.sym[1:])
            for v in (*node.inputs, *node.outputs)
        )

    def dim(self, t: TensorType, axis: int, table: str = "sizes") -> str:
        """Dim ``axis`` of ``t`` as C++: its size, or its polynomial over ``table`` (a kernel's
        ``sizes``, run()'s device ``ddims`` or host ``hdims``)."""
        sym = t.sym[axis] if t.sym is not None else None
        if sym is None or (table == "hdims" and sym.symbols & self.counts):
            # (a count the device computes is not known on the host during the run: grids
            # and copies there cover its bound, the kernels read the count)
            return str(t.shape[axis])
        return sym.c_expr(self.slots, table)

    def numel(self, t: TensorType, table: str = "hdims") -> str:
        """The element count of ``t`` in this run, as C++ over ``table``."""
        return self.count(t, 0, t.rank, table)

    def around(self, t: TensorType, axis: int, table: str = "sizes") -> tuple[str, str, str]:
        """The [outer, extent, inner] view of ``t`` around ``axis`` in this run (the lines
        along it, its length, their step), as C++ over ``table``."""
        return (
            self.count(t, 0, axis, table),
            self.dim(t, axis, table),
            self.count(t, axis + 1, t.rank, table),
        )

    def count(self, t: TensorType, start: int, stop: int, table: str = "hdims") -> str:
        """The product of dims ``start`` .. ``stop`` - 1 of ``t`` in this run, as C++ over
        ``table`` (a literal where none is symbolic)."""
        if t.sym is None or not any(t.sym[start:stop]):
            return str(math.prod(t.shape[start:stop]))
        return "(" + " * ".join(self.dim(t, k, table) for k in range(start, stop)) + ")"

    def nbytes(self, t: TensorType) -> str:
        """The byte size of ``t`` in this run (host C++ for run()'s statements)."""
        if t.sym is None:
            return str(t.nbytes)
        return f"({self.numel(t)}) * {t.dtype.itemsize}"

    def sized_ints(
        self, at: Callable[[Mapping[str, int]], list[int]], table: str = "hdims"
    ) -> list[str]:
        """Integers an emitter computes from its tensors' shapes (strides, offsets, counts),
        as C++ over ``table`` (run()'s ``hdims``, a kernel's ``sizes``): ``at`` gives them
        for given sizes of the symbols, and
        each is fitted as a polynomial of the symbols (ir/symbolic.py) and checked at the
        bound. An emitter written for one size so serves every size in range. The fit reads
        sizes above the ranges (hi + 2, hi + 5, ...): at a size of 1 a stride is moot (the
        emitters write 0 for it), which no polynomial matches."""
        ranges = self.graph.symbols
        names = list(ranges)
        bound = {s: r.hi for s, r in ranges.items()}
        grid = [[r.hi + 2 + 3 * k for k in range(SIZED_DEGREE + 1)] for r in ranges.values()]
        points = [dict(zip(names, pick, strict=True)) for pick in product(*grid)]
        seen = [at(p) for p in points]
        want = at(bound)
        out = []
        for j, x in enumerate(want):
            f = fit_grid(names, grid, [v[j] for v in seen])
            if f is None or evaluate(f, bound) != x:
                raise self.fail(
                    "a size the kernel takes is no polynomial of the symbols "
                    f"({', '.join(names)}) of degree {SIZED_DEGREE} at most; fix the dims "
                    "with --dim NAME=N"
                )
            out.append(f.c_expr(self.slots, table) if isinstance(f, SymDim) else str(f))
        return out

    def grid(self, total: str, block: int = BLOCK, most: int = MAX_GRID) -> str:
        """The grid-stride launch's block count for ``total`` (host C++) work items, at
        most ``most``."""
        return f"flowc_grid({total}, {block}, {most})"

    # -- streams ---------------------------------------------------------------------------

    @property
    def stream(self) -> str:
        """The C++ expression of the stream the current node runs on."""
        return f"streams[{self.current_stream}]"

    @property
    def blas(self) -> str:
        """The current stream's cuBLAS handle (each stream has its own, and its workspace)."""
        self._needs_workspace()
        self.blas_streams.add(self.current_stream)
        return f"m->blas{self.suffix}[{self.current_stream}]"

    @property
    def conv(self) -> str:
        """The current stream's cuDNN handle (and workspace)."""
        self._needs_workspace()
        self.conv_streams.add(self.current_stream)
        return f"m->conv{self.suffix}[{self.current_stream}]"

    def _needs_workspace(self) -> None:
        node = self.node
        if node is None or not get_op(node.op).library:
            # An internal inconsistency (exit 70), not a problem with the user's model.
            raise AssertionError(
                f"{node.op if node else 'a fill'} calls a library but its op declares no "
                "`library`, so the memory plan gave its stream no workspace (a flowc bug)"
            )

    def library_handles(self) -> list[dict[str, Any]]:
        """The handles the emitted code uses (library, stream) and each one's workspace: the
        stream's planned arena buffer (offset, bytes; shared by both libraries)."""
        plan = self.plan
        out = []
        for lib, streams in (("blas", self.blas_streams), ("conv", self.conv_streams)):
            for s in sorted(streams):
                planned = s in plan.workspaces
                out.append(
                    {
                        "lib": lib,
                        "stream": s,
                        "offset": plan.workspace_offset(s) if planned else -1,
                        "bytes": plan.workspace_size(s),
                    }
                )
        return out

    def library_workspace(self, node: Node) -> int:
        """The most workspace ``node``'s library call may use: its op's bound, at most the
        plan's cap; its stream's workspace holds at least that much."""
        return get_op(node.op).workspace_bytes(node, self.plan.workspace_cap)

    @property
    def tf32(self) -> bool:
        """Whether float32 GEMMs and convolutions may round their inputs to TF32 (tensor
        cores): only at --precision tf32. fp32 is exact (cuBLASLt CUBLAS_COMPUTE_32F, cuDNN
        FMA math); bf16/fp16 programs store narrow types and accumulate in float32."""
        return self.precision == "tf32"

    def library_plan(self, kind: str, template: str, macro: str, **values: Any) -> str:
        """A library plan of ``kind`` (flowc::GemmPlan for "gemm", flowc::ConvPlan for
        "conv": descriptors, layouts and the chosen algorithm) made once in create() by the
        flowc::Status expression macro ``macro`` of templates/kernels/<template> renders with
        ``values`` and ``plan``, the plan's address; returns the C++ expression of the plan
        for run(). Identical plans are made once. Each plan type has a
        ``flowc::destroy_plan(T*)`` that release() calls."""
        if kind not in PLAN_TYPES:
            raise AssertionError(f"unknown library plan kind {kind!r}")
        self._needs_workspace()
        # Rendered with a placeholder address, which plan_inits replaces: equal text, one plan.
        make = self.render(template, macro, plan="{plan}", **values)
        made = self.plans.setdefault(kind, [])
        for k, (existing, _) in enumerate(made):
            if existing == make:
                return f"m->{kind}_plans{self.suffix}[{k}]"
        what = f"{self.node.op} {self.node.name}" if self.node is not None else "a fill"
        made.append((make, what))
        return f"m->{kind}_plans{self.suffix}[{len(made) - 1}]"

    def plan_inits(self) -> list[dict[str, str]]:
        """The create()-time statements of this program's plans (C++), each with a string
        literal naming the node it is for (create's error message)."""
        return [
            {
                "make": make.replace("{plan}", f"&m->{kind}_plans{self.suffix}[{i}]"),
                "what": c_string(what),
            }
            for kind in sorted(self.plans)
            for i, (make, what) in enumerate(self.plans[kind])
        ]

    # -- pointers --------------------------------------------------------------------------

    def ctype(self, v: Value) -> str:
        return ctype(v.type.dtype)

    def ptr(self, v: Value) -> str:
        """A C++ expression for the device address of ``v``'s first element, typed."""
        t = self.ctype(v)
        if v in self._view_base and v not in self.plan.value_buffer:
            return f"reinterpret_cast<{t}*>({self._raw(self._view_base[v])})"
        return f"reinterpret_cast<{t}*>({self._raw(v)})"

    def cptr(self, v: Value) -> str:
        return f"reinterpret_cast<const {self.ctype(v)}*>({self._raw(v)})"

    def ptr_void(self, v: Value) -> str:
        return f"static_cast<void*>({self.ptr(v)})"

    def cptr_void(self, v: Value) -> str:
        return f"static_cast<const void*>({self.cptr(v)})"

    def mesh_coord(self, axis: int) -> str:
        """This rank's coordinate on mesh axis ``axis``, a C++ int expression in run(). In a
        pipeline's micro-batch graph, a node marked ``microbatch`` was split over the
        micro-batches, not over devices: its coordinate is its actor's micro-batch."""
        if self.node is not None and self.node.attrs.get("microbatch"):
            return str(self.microbatch)
        return f"m->coords[{int(axis)}]"

    def root(self, v: Value) -> Value:
        while v in self._view_base:
            v = self._view_base[v]
        return v

    def _raw(self, v: Value) -> str:
        if v in self._view_base and v not in self.plan.value_buffer and v not in self._outputs:
            return self._raw(self._view_base[v])
        if v in self._inputs and v not in self._outputs:
            return f"const_cast<void*>(inputs[{self._inputs[v]}])"
        if v in self._outputs and v.producer is not None:
            return f"outputs[{self._outputs[v]}]"
        if v in self.weights.offsets:
            return f"(weights + {self.weights.offsets[v]})"
        if v in self.plan.value_buffer:
            return f"(arena + {self.plan.offset(v)})"
        if v in self._inputs:
            return f"const_cast<void*>(inputs[{self._inputs[v]}])"
        raise CodegenError(f"internal: value {v.name!r} has no storage")

    # -- code -----------------------------------------------------------------------------

    def kernel(self, template: str, macro: str, **params: Any) -> str:
        """Render a kernel from templates/kernels/<template>; returns its (unique) name."""
        body = str(self._macro(f"kernels/{template}", macro)(name="KERNEL_NAME", **params))
        name = self._kernels.get(body)
        if name is None:
            name = f"k{len(self._kernels)}_{macro}"
            self._kernels[body] = name
        return name

    def _macro(self, template: str, macro: str) -> Any:
        """Macro ``macro`` of templates/<template> (modules cached: a statement per call)."""
        mod = self._modules.get(template)
        if mod is None:
            mod = self._modules[template] = self.env.get_template(template).module
        return getattr(mod, macro)

    def render(self, template: str, macro: str, **values: Any) -> str:
        """The C++ text of macro ``macro`` of templates/kernels/<template> with ``values``
        (an expression or statements for an op to pass on; see emit)."""
        return str(self._macro(f"kernels/{template}", macro)(**values))

    def emit(self, template: str, macro: str, **values: Any) -> None:
        """Append the run() statement(s) macro ``macro`` of templates/kernels/<template>
        renders with ``values`` (pointer expressions from ptr/cptr, sizes, literals)."""
        self.statements.append(self.render(template, macro, **values))

    def _run(self, macro: str, **values: Any) -> str:
        return str(self._macro("run.cu.j2", macro)(**values))

    def launch(
        self, kernel: str, total: int, args: list[str], *, block: int = BLOCK, shared: int = 0
    ) -> None:
        """Launch a grid-stride kernel over ``total`` work items."""
        if total > 0:
            self.launch_grid(
                kernel, [min((total + block - 1) // block, MAX_GRID)], block, args, shared
            )

    def launch_sized(self, kernel: str, total: str, args: list[str]) -> None:
        """Launch a grid-stride kernel of a program with symbolic dims over ``total`` (host
        C++ over hdims) work items; its last argument is the device size table."""
        self.launch_grid(kernel, [self.grid(total)], BLOCK, [*args, "ddims"])

    def launch_numel(
        self, kernel: str, t: TensorType, args: list[str], stop: int | None = None
    ) -> None:
        """A grid-stride kernel over the elements of ``t`` in this run (or of its dims before
        ``stop``), whose last argument is that count (a literal for a static type)."""
        stop = t.rank if stop is None else stop
        if t.sym is None:
            total = math.prod(t.shape[:stop])
            self.launch(kernel, total, [*args, f"(int64_t){total}"])
            return
        run_total = self.count(t, 0, stop)
        self.launch_grid(kernel, [self.grid(run_total)], BLOCK, [*args, f"(int64_t){run_total}"])

    def launch_blocks(
        self, kernel: str, blocks: int, block: int, shared: int, args: list[str]
    ) -> None:
        """Launch one block per item (block-cooperative kernels)."""
        if blocks > 0:
            self.launch_grid(kernel, [blocks], block, args, shared)

    def launch_grid(
        self, kernel: str, grid: list[int] | list[str], block: int, args: list[str], shared: int = 0
    ) -> None:
        """Launch ``grid`` (x, and y when given) blocks of ``block`` threads (counts, or host
        C++ expressions of them in a program with symbolic dims)."""
        self.statements.append(
            self._run(
                "launch",
                kernel=kernel,
                grid=grid,
                block=block,
                shared=shared,
                stream=self.stream,
                args=args,
            )
        )

    def call(self, template: str, macro: str, what: str, **values: Any) -> None:
        """A library call, the flowc::Status expression macro ``macro`` of
        templates/kernels/<template> renders; failure makes run() return its message,
        headed by ``what``."""
        expr = self.render(template, macro, **values)
        self.statements.append(self._run("call", expr=expr, what=what))

    def copy(self, dst: Value, src: Value) -> None:
        """``src``'s bytes to ``dst`` (the same size) on the current stream."""
        self.memcpy(self._raw(dst), self._raw(src), self.nbytes(dst.type))

    def memcpy(self, dst: str, src: str, nbytes: int | str) -> None:
        """``nbytes`` bytes from the address ``src`` to ``dst`` (pointer expressions: ptr,
        cptr, maybe plus an element offset) on the current stream."""
        self.statements.append(
            self._run("memcpy", dst=dst, src=src, nbytes=nbytes, stream=self.stream)
        )

    def zero(self, dst: str, nbytes: int) -> None:
        """``nbytes`` zero bytes at the address ``dst`` (ptr/ptr_void) on the current stream."""
        self.statements.append(self._run("zero", dst=dst, nbytes=nbytes, stream=self.stream))

    def elementwise(self, node: Node) -> None:
        """An element-wise node (its op's cexpr) as one broadcasting kernel."""
        emit_elementwise(self, node)

    def broadcast_sized(self, x: Value, out: Value) -> None:
        """``x`` broadcast to ``out``'s shape, in a program with symbolic dims."""
        emit_broadcast_sized(self, x, out)

    def fused(self, node: Node) -> None:
        """A FusedElementwise chain as one kernel (codegen/elementwise.py)."""
        emit_fused(self, node)

    def fail(self, message: str) -> CodegenError:
        node = self.node
        where = f"{node.op} node {node.name!r}: " if node is not None else ""
        return CodegenError(where + message)

    def render_kernels(self, fills: list[str]) -> list[str]:
        """The kernels some statement launches (a zero-size launch is skipped, and its kernel
        with it: an unused static function would warn)."""
        code = "\n".join([*self.statements, *fills])
        return [
            body.replace("KERNEL_NAME", name)
            for body, name in self._kernels.items()
            if re.search(rf"\b{name}\b", code)
        ]


def _fill_statements(prog: Program) -> list[str]:
    fills = []
    held = [(c, c.const) for c in prog.graph.constants]
    if not prog.inference:  # an inference schedule's state is the step's, filled by it
        held += state_inputs(prog.graph)
    for c, a in held:
        if a is None or not is_splat(a):
            continue
        t = ctype(c.type.dtype)
        value = a.reshape(-1)[0]
        lit = c_literal(value, c.type.dtype, t)
        k = prog.kernel("common.cu.j2", "fill", ctype=t)
        n = c.type.numel
        grid = min((n + BLOCK - 1) // BLOCK, MAX_GRID)
        offset = prog.weights.offsets[c]
        fills.append(
            prog._run(
                "fill", kernel=k, grid=grid, block=BLOCK, ctype=t, offset=offset, value=lit, n=n
            )
        )
    return fills


def _tensor_info(v: Value, name: str) -> dict[str, Any]:
    shape = ", ".join(str(d) for d in v.type.shape) or "0"
    return {"name": c_string(name), "rank": v.type.rank, "shape": shape, "dtype": v.type.dtype.onnx}


def emit_schedule(prog: Program, poison: bool) -> int:
    """Write ``prog``'s schedule as run_schedule() statements: per actor in issue order, its
    event waits, its code on its stream, its event records; then every stream joined into
    stream 0. Returns the number of events used."""
    schedule, plan = prog.schedule, prog.plan
    unsupported: dict[str, list[str]] = {}
    unsized: dict[str, list[str]] = {}
    ns = schedule.num_streams
    fork = len(schedule.events)
    num_events = fork + (ns if ns > 1 else 0)  # the actors' events, then fork and joins

    def wait(stream: int, event: int) -> None:
        # Debug builds: FLOWC_DROP_EVENT=k leaves event k's wait out (the mutation tests).
        prog.statements.append(prog._run("wait", stream=stream, event=event, guard=poison))
        prog.ops.append(StreamOp("wait", stream, event=event))

    def record(stream: int, event: int) -> None:
        prog.statements.append(prog._run("record", stream=stream, event=event))
        prog.ops.append(StreamOp("record", stream, event=event))

    first_write, death = _poison_points(plan) if poison else ({}, {})
    if poison and plan.host_arena_bytes:
        # Debug builds: every value byte of the arena starts as NaN (0xff..); a buffer is
        # poisoned again right before its first write and once its last access ran, so a read
        # from a wrong offset, or one no event orders, shows up as NaN. (The workspaces above
        # the values are the libraries' own.)
        prog.statements.append(
            prog._run("poison", offset=None, nbytes=plan.host_arena_bytes, stream="streams[0]")
        )
    # Every stream starts after what the caller queued before run() (the inputs), and is
    # joined back into the caller's stream -- each by an event of its own only where the
    # schedule's events do not order it already (a redundant wait only costs time).
    forked = [st for st in range(1, ns) if schedule.needs_fork(st)]
    if forked:
        record(0, fork)
        for st in forked:
            wait(st, fork)
    ag = schedule.actors
    for t, a in enumerate(schedule.issue):
        actor = ag.actors[a]
        node = actor.node
        prog.current_stream = st = schedule.stream_of[a]
        prog.microbatch = actor.microbatch
        for e in schedule.waits.get(a, []):
            wait(st, e.id)
        for at, nbytes in first_write.get(t, []):
            prog.statements.append(
                prog._run("poison", offset=at, nbytes=nbytes, stream=prog.stream)
            )
        if not prog.inference:  # FLOWC_TRACE records the step's actors
            prog.statements.append(prog._run("trace", mark="begin", actor=a, stream=prog.stream))
        opdef = get_op(node.op)
        if node in plan.elided:
            pass  # its results are aliases of its inputs' bytes (the memory plan's): no code
        elif opdef.view:
            # A view whose result is a graph output: copy the bytes.
            src = node.inputs[0]
            assert src is not None
            prog.copy(node.outputs[0], src)
        elif opdef.emit is None:
            unsupported.setdefault(node.op, []).append(node.name)
        elif (
            prog.is_sized(node)
            and not opdef.sized
            and not (opdef.sized_leading and prog.leading_only(node))
        ):
            unsized.setdefault(node.op, []).append(node.name or node.outputs[0].name)
        else:
            prog.node = node
            opdef.emit(prog, node)
            prog.node = None
        prog.ops.append(StreamOp("run", st, node))
        if not prog.inference:
            prog.statements.append(prog._run("trace", mark="end", actor=a, stream=prog.stream))
        for b in death.get(t, []):
            prog.statements.append(
                prog._run("poison", offset=b.offset, nbytes=b.size, stream=prog.stream)
            )
        for e in schedule.records.get(a, []):
            record(st, e.id)
    prog.current_stream = 0
    if unsupported:
        raise CodegenError(
            f"code generation does not support {len(unsupported)} op type(s) yet:\n"
            + _by_op(unsupported),
            hint="flowc eval runs these models with the NumPy reference",
        )
    if unsized:
        raise CodegenError(
            f"{len(unsized)} op type(s) have no size-generic kernel yet, for tensors of "
            "symbolic dims:\n" + _by_op(unsized),
            hint="fix the dims with --dim NAME=N for a program of one size; "
            "docs/dynamic.md lists the ops that take symbolic dims",
        )
    for st in range(1, ns):
        if schedule.needs_join(st):
            # The run ends when all streams have: the caller's stream waits for this one.
            record(st, fork + st)
            wait(0, fork + st)
    return num_events


def _by_op(nodes: Mapping[str, list[str]]) -> str:
    """Lines of op type, node count and first node, for an error listing refused nodes."""
    return "\n".join(
        f"  {op}: {len(names)} node(s), first: {names[0]!r}" for op, names in sorted(nodes.items())
    )


def _output_copies(prog: Program) -> None:
    """Outputs that repeat an earlier output, or are an input or a constant themselves."""
    graph = prog.graph
    first_index: dict[Value, int] = {}
    for k, o in enumerate(api_outputs(graph)):
        if o in first_index or o.producer is None:  # an input or a constant is an output
            src = first_index[o] if o in first_index else prog._raw(o)
            prog.statements.append(
                prog._run("output_copy", k=k, src=src, nbytes=prog.nbytes(o.type))
            )
        first_index.setdefault(o, k)


def generate(
    graph: Graph,
    schedule: Schedule,
    plan: MemoryPlan,
    prefix: str | None = None,
    source: str = "",
    arch: str = "90",
    build_target: str | None = None,
    poison: bool = False,
    physical: Physical | None = None,
    cuda_graph: bool = True,
    precision: str = "fp32",
    inference: tuple[Graph, Schedule, MemoryPlan] | None = None,
) -> tuple[dict[str, str], list[WeightsLayout], list[StreamOp], list[StreamOp]]:
    """The project's text files (name -> content), the weights (one per rank), the
    emitted program's stream operations and its inference schedule's (``inference``: a
    training step's forward, which run() issues beside train_step(); else none), for ``graph`` run by ``schedule`` in the memory of
    ``plan`` (both computed before: code generation only writes them down). With
    ``physical`` (a multi-rank program), ``graph`` is its rank graph. ``cuda_graph``: run()
    replays one CUDA Graph of the schedule (not for a mesh; docs/codegen.md). ``precision``:
    the --precision the graph was prepared for (its float32 GEMMs' and convolutions' math:
    exact, or TF32 at "tf32"; bf16/fp16 graphs already hold the narrow types)."""
    prefix = _prefix(prefix, graph)
    mesh = physical.mesh if physical is not None else None
    if physical is None:
        all_weights = [layout_weights(graph, inference=inference[0] if inference else None)]
    else:
        from flowc.ir.layout import all_coords

        all_weights = [
            layout_weights(graph, physical=physical, coords=c) for c in all_coords(physical.mesh)
        ]
    weights = all_weights[0]
    prog = Program(graph, schedule, plan, weights, prefix, precision=precision)
    num_events = emit_schedule(prog, poison)
    _output_copies(prog)
    stage = StageCode(0, prog, _fill_statements(prog), num_events)
    infer = None
    if inference is not None:
        # The same kernels table: one model.cu, each kernel once.
        iprog = Program(
            *inference, weights, prefix, kernels=prog._kernels, precision=precision, inference=True
        )
        n = emit_schedule(iprog, poison)
        _output_copies(iprog)
        infer = StageCode(0, iprog, _fill_statements(iprog), n)
    ranks = mesh.size if mesh is not None else 1
    timeline = {"version": 1, "ranks": [schedule.to_json(rank=r) for r in range(ranks)]}
    files = _render(
        graph,
        [stage],
        all_weights,
        prefix,
        source=source,
        arch=arch,
        build_target=build_target,
        poison=poison,
        mesh=mesh,
        cuda_graph=cuda_graph,
        timeline=timeline,
        infer=infer,
        state_layouts=physical.state_layouts if physical is not None else {},
    )
    return files, all_weights, prog.ops, infer.prog.ops if infer is not None else []


@dataclass
class StageCode:
    """One stage's emitted program (a one-stage program has one)."""

    index: int
    prog: Program
    fills: list[str]
    num_events: int
    unrolled: Unrolled | None = None  # a pipeline stage: its micro-batches in one program


def _render(
    graph: Graph,
    stages: list[StageCode],
    all_weights: list[WeightsLayout],
    prefix: str,
    *,
    source: str,
    arch: str,
    build_target: str | None,
    poison: bool,
    mesh: Mesh | None,
    cuda_graph: bool,
    timeline: dict[str, Any],
    pipeline: dict[str, Any] | None = None,
    infer: StageCode | None = None,
    state_layouts: Mapping[str, NdSbp] | None = None,
    state_override: tuple[list[dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, str]:
    """The project's text files: ``graph`` gives the program's inputs and outputs (the
    whole batch), ``stages`` the code (one per pipeline stage; the rank's stage picks);
    ``infer``, a training program's inference schedule, run()'s."""
    prog = stages[0].prog
    schedule, plan, weights = prog.schedule, prog.plan, all_weights[0]
    ag = schedule.actors
    fills = stages[0].fills
    # Every schedule of the model (the step and the inference of a training program) runs in
    # the same arena, streams and events, one at a time.
    every = [*stages, *([infer] if infer is not None else [])]
    num_events = max(st.num_events for st in every)
    ns = max(st.prog.schedule.num_streams for st in every)
    arena_bytes = max(st.prog.plan.arena_bytes for st in every)
    host_arena_bytes = max(st.prog.plan.host_arena_bytes for st in every)
    all_fills = [f for st in every for f in st.fills]
    all_statements = [x for st in every for x in st.prog.statements]

    inputs, outputs = api_inputs(graph), api_outputs(graph)
    state = state_table(graph, weights, state_layouts or {})
    state_stages = None
    if state_override is not None:
        # A training pipeline: the state of every stage, each tensor on its own stage.
        state, state_stages = state_override
    infer_io = (api_inputs(infer.prog.graph), api_outputs(infer.prog.graph)) if infer else ([], [])
    max_rank = max(
        [1, *(v.type.rank for v in [*inputs, *outputs, *graph.inputs, *infer_io[0], *infer_io[1]])]
    )
    input_bytes = [v.type.nbytes for v in inputs]
    output_bytes = [v.type.nbytes for v in outputs]
    staging = _staging_offsets([*input_bytes, *output_bytes])
    # run()'s inputs and outputs: a training program's are its inference schedule's (a printed
    # step, which holds none, has none); the step's are train_step()'s.
    run_io = infer_io if graph.state else (inputs, outputs)
    ctx = {
        "version": __version__,
        "source": source or graph.name,
        "p": prefix,
        "project": c_ident(graph.name),
        "arch_number": arch,
        "kernels": prog.render_kernels([*all_statements, *all_fills]),
        "statements": prog.statements,
        "fills": fills,
        "arena_bytes": arena_bytes,
        "host_arena_bytes": host_arena_bytes,
        "weight_bytes": weights.stored_bytes,
        "weight_layout": weights.layout_id,
        # Multi-rank: every rank's id (rank order); model.cu picks its own by its world rank.
        "weight_layouts": [w.layout_id for w in all_weights],
        "device_weight_bytes": weights.device_bytes,
        "max_rank": max_rank,
        "inputs": [_tensor_info(v, v.name) for v in inputs],
        "outputs": [_tensor_info(v, v.name) for v in outputs],
        # A training step's state (the model keeps it; train_step, save, load).
        "state": state,
        "state_stages": state_stages,
        "state_layout": _state_layout(state),
        "train_outputs": [
            next((k for k, v in enumerate(outputs) if v.name == name), -1) for name in TRAIN_RESULTS
        ],
        "output_ctypes": [ctype(v.type.dtype) for v in outputs],
        "loss_ctype": next(
            (ctype(v.type.dtype) for v in outputs if v.name == TRAIN_RESULTS[0]), "float"
        ),
        "lr_ctype": next(
            (ctype(v.type.dtype) for v in graph.inputs if v.name == "train/lr"), "float"
        ),
        "mesh": list(mesh.shape) if mesh is not None else [],
        "mesh_size": mesh.size if mesh is not None else 1,
        "num_events": num_events,
        "num_streams": ns,
        "event_mask": poison and num_events > 0,
        "actor_names": [c_string(a.name) for a in ag.actors],
        "actor_streams": [schedule.stream_of[a.id] for a in ag.actors],
        # A mesh's collectives act when issued (logged, counted for the deadline; on the
        # host a one-shot MPI call), so a replayed graph would skip them: direct launches.
        "cuda_graph": cuda_graph and mesh is None,
        "input_bytes": input_bytes,
        "output_bytes": output_bytes,
        "staging_inputs": staging[: len(input_bytes)],
        "staging_outputs": staging[len(input_bytes) : -1],
        "staging_bytes": staging[-1],
        # Pipelines: every stage's code, chosen by the rank's coordinate on mesh axis 0.
        "stages": [
            {
                "index": st.index,
                "statements": st.prog.statements,
                "fills": st.fills,
                "num_streams": st.prog.schedule.num_streams,
                "handles": st.prog.library_handles(),
                "plans": st.prog.plan_inits(),
                # Per input (output) of the stage's unrolled program: the model's input
                # index and the micro-batch whose slice it is (-1: the whole tensor).
                "input_slices": st.unrolled.inputs if st.unrolled else [],
                "output_slices": st.unrolled.outputs if st.unrolled else [],
                "actor_names": [c_string(a.name) for a in st.prog.schedule.actors.actors],
                "actor_streams": [
                    st.prog.schedule.stream_of[a.id] for a in st.prog.schedule.actors.actors
                ],
            }
            for st in stages
        ],
        "pipeline": pipeline,
        "infer": _infer_context(infer) if infer is not None else None,
        # Library plan arrays in the model (sized for the stage with the most).
        "plan_types": [
            {
                "ctype": ctype_,
                "field": f"{kind}_plans",
                "count": max(len(st.prog.plans.get(kind, [])) for st in stages),
            }
            for kind, ctype_ in sorted(PLAN_TYPES.items())
            if any(st.prog.plans.get(kind) for st in stages)
        ],
        "precision": prog.precision,
        "pointer_alignment": POINTER_ALIGNMENT,
        "rank_weight_bytes": [w.stored_bytes for w in all_weights],
        "rank_device_weight_bytes": [w.device_bytes for w in all_weights],
        # The driver spells types as flowc does (f32, bf16, ...); C only sees ONNX codes.
        "dtype_names": sorted((d.onnx, d.short) for d in DType),
        "symbols": _symbols_context(prog, run_io[0], run_io[1], max_rank),
    }
    env = prog.env
    files = {
        "model.cu": env.get_template("model.cu.j2").render(**ctx),
        "model.h": env.get_template("model.h.j2").render(**ctx),
        "main.cu": env.get_template("main.cu.j2").render(**ctx),
        "CMakeLists.txt": env.get_template("CMakeLists.txt.j2").render(**ctx),
        "flowc_model.json": json.dumps(
            {
                "prefix": prefix,
                "inputs": _io_json(run_io[0]),
                "outputs": _io_json(run_io[1]),
                # A training program's step: train_step()'s inputs (the batch and labels) and
                # the step's results (loss, label count, learning rate used).
                **(
                    {"train_inputs": _io_json(inputs), "train_outputs": _io_json(outputs)}
                    if graph.state
                    else {}
                ),
                # A split state's entry has its layout and whole shape (shape: a rank's).
                "state": [
                    {
                        "name": t["raw_name"],
                        "shape": t["shape_list"],
                        "dtype": t["short"],
                        "offset": t["ckpt_offset"],
                        "written": t["written"],
                        **_split_state(t["raw_name"], state_layouts or {}, graph),
                        # A training pipeline: the stage holding it (-1: every stage).
                        **({"stage": t["stage"]} if state_stages is not None else {}),
                    }
                    for t in state
                ],
                "arena_bytes": arena_bytes,
                "lower_bound": plan.lower_bound,
                "naive_bytes": plan.naive_bytes,
                "weights_bytes": weights.stored_bytes,
                "mesh": list(mesh.shape) if mesh is not None else [],
                **({"pipeline": pipeline} if pipeline is not None else {}),
                "precision": prog.precision,
                **(
                    {
                        "symbols": [
                            {"name": n, "min": r.lo, "max": r.hi, "typical": r.weighed}
                            for n, r in graph.symbols.items()
                        ]
                    }
                    if graph.symbols
                    else {}
                ),
                # `flowc compile --target`: what build, run and verify use when not told.
                "target": build_target,
            },
            indent=2,
            sort_keys=True,
        )
        + "\n",
    }
    files["schedule.json"] = json.dumps(timeline, indent=1, sort_keys=True) + "\n"
    return files


def _io_json(values: list[Value]) -> list[dict[str, Any]]:
    return [
        {
            "name": v.name,
            "shape": list(v.type.shape),
            "dtype": v.type.dtype.short,
            # symbolic dims: each dim's polynomial of the symbols (null: a fixed size)
            **(
                {"dims": [None if d is None else str(d) for d in v.type.sym]}
                if v.type.sym is not None
                else {}
            ),
        }
        for v in values
    ]


# The CUDA Graphs a program with symbolic dims keeps at most: one per size bucket, the product
# of each symbol's bucket count (docs/dynamic.md).
MAX_BUCKETS = 64


def size_buckets(ranges: Mapping[str, DimRange]) -> dict[str, list[int]]:
    """Each symbol's bucket ends: the powers of two within its range and its max (a computed
    count: its bound alone). A run's sizes go to the first end at or above each; when the
    buckets' product passes MAX_BUCKETS the ends are powers of 4, 8, ... instead, until it
    fits (a graph per bucket: their number is capped, not the range)."""

    def powers(r: DimRange, base: int) -> list[int]:
        out, p = [], 1
        while p < r.hi and not r.computed:
            if p >= r.lo:
                out.append(p)
            p *= base
        return [*out, r.hi]

    base = 2
    while True:
        ends = {s: powers(r, base) for s, r in ranges.items()}
        if math.prod(len(e) for e in ends.values()) <= MAX_BUCKETS:
            return ends
        base *= 2


def _symbols_context(
    prog: Program, inputs: list[Value], outputs: list[Value], max_rank: int
) -> dict[str, Any] | None:
    """What model.cu and model.h say of a program's symbolic dims (None: it has none): the
    symbols and ranges, which symbol each input dim is, each output dim over hdims."""
    graph = prog.graph
    if not graph.symbols:
        return None
    buckets = size_buckets(graph.symbols)
    rows = []
    for v in inputs:
        row = []
        for k in range(v.type.rank):
            sym = v.type.sym[k] if v.type.sym is not None else None
            if sym is not None and sym.name is None:
                raise CodegenError(
                    f"input {v.name!r} has the dim {sym}: an input's symbolic dims must be "
                    "symbols themselves (batch, not 2*batch), so a caller's sizes name them"
                )
            row.append(prog.slots[sym.name] if sym is not None and sym.name is not None else -1)
        rows.append(row + [-1] * (max_rank - len(row)) if row else [-1])
    return {
        "names": [c_string(s) for s in graph.symbols],
        "raw": [{"name": c_comment(s), "lo": r.lo, "hi": r.hi} for s, r in graph.symbols.items()],
        "lo": [r.lo for r in graph.symbols.values()],
        "hi": [r.hi for r in graph.symbols.values()],
        "inputs": rows,
        "outputs": [[prog.dim(v.type, k, "d") for k in range(v.type.rank)] for v in outputs],
        "computed": [int(r.computed) for r in graph.symbols.values()],
        "counts": bool(prog.counts),
        "buckets": list(buckets.values()),
        "max_buckets": max(len(e) for e in buckets.values()),
        "num_buckets": math.prod(len(e) for e in buckets.values()),
        # each output's bytes at the run's sizes `d` (a computed count at its bound)
        "output_bytes": [
            " * ".join(
                [
                    f"{v.type.dtype.itemsize}ULL",
                    *(f"uint64_t({prog.dim(v.type, k, 'd')})" for k in range(v.type.rank)),
                ]
            )
            for v in outputs
        ],
    }


def _infer_context(infer: StageCode) -> dict[str, Any]:
    """model.cu's view of a training program's inference schedule (run())."""
    prog = infer.prog
    ins, outs = api_inputs(prog.graph), api_outputs(prog.graph)
    in_bytes = [v.type.nbytes for v in ins]
    out_bytes = [v.type.nbytes for v in outs]
    staging = _staging_offsets([*in_bytes, *out_bytes])
    return {
        "statements": prog.statements,
        "fills": infer.fills,
        "num_streams": prog.schedule.num_streams,
        "handles": prog.library_handles(),
        "plans": prog.plan_inits(),
        "inputs": [_tensor_info(v, v.name) for v in ins],
        "outputs": [_tensor_info(v, v.name) for v in outs],
        "input_bytes": in_bytes,
        "output_bytes": out_bytes,
        "staging_inputs": staging[: len(in_bytes)],
        "staging_outputs": staging[len(in_bytes) : -1],
        "staging_bytes": staging[-1],
        "plan_types": [
            {"ctype": ctype_, "field": f"{kind}_plans{prog.suffix}", "count": len(prog.plans[kind])}
            for kind, ctype_ in sorted(PLAN_TYPES.items())
            if prog.plans.get(kind)
        ],
    }


# A training step's results, in the order train_step() reports them (flowc.training.step
# names these outputs; a program without them reports zeros).
TRAIN_RESULTS = (
    "train/loss",
    "train/count",
    "train/lr_used",
    # fp16's loss scaling (train_scaling()): the scale the step used, 1 if it was skipped.
    "train/loss_scale_used",
    "train/skipped",
)


def state_table(
    graph: Graph, weights: WeightsLayout, layouts: Mapping[str, NdSbp] | None = None
) -> list[dict[str, Any]]:
    """The state the model keeps, as model.cu's kState table: each tensor's place in the
    weights buffer and in a checkpoint (the tensors one after another, 256-aligned). A
    state split over a mesh (``layouts``: S(d) on every mesh axis, rank r holding chunk r
    along axis d) is listed whole: state_read/state_write and checkpoints see the whole
    tensor (its local bytes are ``local_nbytes``, ``split_axis`` d), so a checkpoint is the
    same on any mesh and plan."""
    table = []
    pos = 0
    for v, first in state_inputs(graph):
        whole = TensorType(tuple(np.asarray(first).shape), v.type.dtype)
        t = _tensor_info(Value(v.name, whole), v.name)
        t.update(
            raw_name=v.name,
            short=v.type.dtype.short,
            shape_list=list(whole.shape),
            offset=weights.offsets[v],
            nbytes=whole.nbytes,
            local_nbytes=v.type.nbytes,
            split_axis=_split_axis((layouts or {}).get(v.name)),
            split_mesh_axes=_split_mesh_axes((layouts or {}).get(v.name)),
            ckpt_offset=pos,
            written=graph.state[v.name] is not None,
        )
        table.append(t)
        pos += (whole.nbytes + ALIGN - 1) // ALIGN * ALIGN
    return table


def _split_axis(layout: NdSbp | None) -> int:
    """The tensor axis a state's layout splits (-1: whole)."""
    if layout is None or all(p.kind == "B" for p in layout.parts):
        return -1
    axes = {p.axis for p in layout.parts if p.kind == "S"}
    if len(axes) != 1 or any(p.kind == "P" for p in layout.parts):
        raise AssertionError(f"state layout {layout}: one split tensor axis, B elsewhere")
    (axis,) = axes
    assert axis is not None
    return axis


def _split_mesh_axes(layout: NdSbp | None) -> int:
    """The mesh axes a state's layout splits over, as a bitmask."""
    if layout is None:
        return 0
    return sum(1 << a for a, p in enumerate(layout.parts) if p.kind == "S")


def _split_state(name: str, layouts: Mapping[str, NdSbp], graph: Graph) -> dict[str, Any]:
    layout = layouts.get(name)
    if layout is None:
        return {}
    whole = graph.params[name]
    return {
        "layout": str(layout),
        "whole_shape": list(np.asarray(whole).shape),
        # As model.cu's StateInfo: which axis, and over which mesh axes (a bitmask).
        "split_axis": _split_axis(layout),
        "split_mesh_axes": _split_mesh_axes(layout),
    }


def _state_layout(table: list[dict[str, Any]]) -> dict[str, int]:
    """A checkpoint's bytes and layout id (names, types and offsets of the state)."""
    if not table:
        return {"bytes": 0, "id": 0}
    last = table[-1]
    nbytes = last["ckpt_offset"] + (last["nbytes"] + ALIGN - 1) // ALIGN * ALIGN
    desc = "checkpoint|" + ";".join(
        f"{t['raw_name']}:{t['short']}{t['shape_list']}:{t['ckpt_offset']}" for t in table
    )
    return {"bytes": nbytes, "id": zlib.crc32(desc.encode()) | (nbytes << 32) & (2**64 - 1)}


def _staging_offsets(sizes: list[int]) -> list[int]:
    """Each buffer's offset in the graph's staging allocation, ALIGN-aligned, then the
    total."""
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + (n + ALIGN - 1) // ALIGN * ALIGN)
    return offsets


def _poison_points(
    plan: MemoryPlan,
) -> tuple[dict[int, list[tuple[int, int]]], dict[int, list[Buffer]]]:
    """Where a debug build poisons each buffer: its bytes (offset, size) before the step of
    its first write -- a buffer several steps write (a Concat's inputs written in place,
    maybe on several streams) each value's own bytes before its own write -- and after the
    access every other one happens before (when one exists: with accesses on several
    streams that no event joins, there is none)."""
    order = plan.order
    at = {(order.stream[t], order.pos[t]): t for t in range(len(order.steps))}
    first: dict[int, list[tuple[int, int]]] = {}
    death: dict[int, list[Buffer]] = {}
    step_of = {id(n): t for t, n in enumerate(order.steps)}
    for b in plan.buffers:
        if b.workspace >= 0:
            continue  # scratch the library writes before it reads: nothing to catch
        if len(b.writers) <= 1:
            first.setdefault(b.writer, []).append((b.offset, b.size))
        else:
            for node, k in sorted(plan.concat_inputs, key=lambda c: (step_of[id(c[0])], c[1])):
                v = node.inputs[k]
                if v is not None and plan.value_buffer.get(v) == b.id and v.producer is not None:
                    first.setdefault(step_of[id(v.producer)], []).append(
                        (plan.offset(v), v.type.nbytes)
                    )
        for s, p in enumerate(b.last):
            if p == 0:
                continue
            t = at[(s, p)]
            if all(last <= order.clock[t][k] for k, last in enumerate(b.last)):
                death.setdefault(t, []).append(b)
                break
    return first, death


def generate_pipeline(
    pipe: Pipelined,
    unrolled: list[Unrolled],
    schedules: list[Schedule],
    plans: list[MemoryPlan],
    prefix: str | None = None,
    source: str = "",
    arch: str = "90",
    build_target: str | None = None,
    poison: bool = False,
    precision: str = "fp32",
) -> tuple[dict[str, str], list[WeightsLayout], list[list[StreamOp]]]:
    """The project of a pipeline: one model.cu holding every stage's schedule (each rank
    runs its stage's: the stage's micro-batches unrolled, ``unrolled``), a weights file per
    rank holding its stage's constants (the stage is part of its layout id), and
    schedule.json with every rank's modeled timeline. Returns the files, the weights and
    each stage's stream operations."""
    from flowc.ir.layout import all_coords, rank_of

    io = pipe.logical
    prefix = _prefix(prefix, io)
    p, k = len(pipe.stages), pipe.ranks_per_stage
    shape = "x".join(map(str, pipe.mesh.shape))
    all_weights: list[WeightsLayout] = []
    for coords in all_coords(pipe.mesh):
        stage = pipe.stages[coords[0]]
        r = rank_of(pipe.mesh, coords)
        all_weights.append(
            layout_weights(
                stage.graph,
                pipe.constant_data(stage, coords),
                identity=f"pipeline stage {coords[0]} of {p}, rank {r} {list(coords)} of mesh {shape}",
            )
        )
    kernels: dict[str, str] = {}
    codes = []
    for s, (u, sched, plan) in enumerate(zip(unrolled, schedules, plans, strict=True)):
        # Every stage reads the run's sizes of the whole program's symbols (one table).
        u.graph.symbols = dict(io.symbols)
        offsets = {
            **{
                u.graph.inputs[j]: mb * pipe.input_strides[i]
                for j, (i, mb) in enumerate(u.inputs)
                if mb > 0
            },
            **{
                u.graph.outputs[j]: mb * pipe.output_strides[i]
                for j, (i, mb) in enumerate(u.outputs)
                if mb > 0
            },
        }
        prog = Program(
            u.graph,
            sched,
            plan,
            all_weights[s * k],
            prefix,
            kernels=kernels,
            precision=precision,
            caller_offsets=offsets,
        )
        n_events = emit_schedule(prog, poison)
        _output_copies(prog)
        codes.append(StageCode(s, prog, _fill_statements(prog), n_events, u))
    timeline = {
        "version": 1,
        "ranks": [
            schedules[s].to_json(rank=s * k + j, stage=s) for s in range(p) for j in range(k)
        ],
    }
    files = _render(
        io,
        codes,
        all_weights,
        prefix,
        source=source,
        arch=arch,
        build_target=build_target,
        poison=poison,
        mesh=pipe.mesh,
        cuda_graph=False,  # the transfers act when issued, like a mesh's collectives
        timeline=timeline,
        pipeline={
            "stages": p,
            "microbatches": pipe.microbatches,
            "ranks_per_stage": k,
            "input_strides": pipe.input_strides,
            "output_strides": pipe.output_strides,
            # Rank 0 of the last stage holds the outputs and writes them.
            "output_rank": (p - 1) * k,
            "train": False,
        },
    )
    return files, all_weights, [c.prog.ops for c in codes]


def generate_train_pipeline(
    whole: Graph,
    stage_graphs: list[Graph],
    schedules: list[Schedule],
    plans: list[MemoryPlan],
    mesh: Mesh,
    microbatches: int,
    prefix: str | None = None,
    source: str = "",
    arch: str = "90",
    build_target: str | None = None,
    poison: bool = False,
    precision: str = "fp32",
) -> tuple[dict[str, str], list[WeightsLayout], list[list[StreamOp]]]:
    """The project of a training pipeline (flowc.schedule.train_pipeline): one model.cu with
    every stage's step program (a rank runs its stage's), a weights file per rank holding
    its stage's constants and state, and one state table listing the whole step's state in
    the one-device program's order (so checkpoints are the same), each tensor with the
    stage holding it. ``whole``: the step graph the stages were cut from."""
    from flowc.ir.layout import all_coords, rank_of

    p, k = len(stage_graphs), mesh.size // len(stage_graphs)
    io = stage_graphs[0]
    prefix = _prefix(prefix, whole)
    for g in stage_graphs[1:]:
        same_in = [(v.name, v.type) for v in api_inputs(g)] == [
            (v.name, v.type) for v in api_inputs(io)
        ]
        same_out = [(v.name, v.type) for v in api_outputs(g)] == [
            (v.name, v.type) for v in api_outputs(io)
        ]
        assert same_in and same_out, (
            f"{g.name}: the stages' steps differ in their inputs or results"
        )
    shape = "x".join(map(str, mesh.shape))
    all_weights = []
    for coords in all_coords(mesh):
        r = rank_of(mesh, coords)
        all_weights.append(
            layout_weights(
                stage_graphs[coords[0]],
                identity=f"training pipeline stage {coords[0]} of {p}, rank {r} of mesh {shape}",
            )
        )
    kernels: dict[str, str] = {}
    codes = []
    for s, (g, sched, plan) in enumerate(zip(stage_graphs, schedules, plans, strict=True)):
        prog = Program(
            g, sched, plan, all_weights[s * k], prefix, kernels=kernels, precision=precision
        )
        n_events = emit_schedule(prog, poison)
        _output_copies(prog)
        codes.append(StageCode(s, prog, _fill_statements(prog), n_events))
    # The state table: the whole step's state, each tensor's offset on each stage.
    table = []
    places: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    owner = []
    pos = 0
    for v, _ in state_inputs(whole):
        t = _tensor_info(Value(v.name, v.type), v.name)
        holders = [s for s, g in enumerate(stage_graphs) if v.name in g.state]
        assert holders, f"no stage holds state {v.name!r}"
        stage = -1 if len(holders) == p and p > 1 else holders[0]
        for s, g in enumerate(stage_graphs):
            mine = next((x for x in g.inputs if x.name == v.name), None)
            held = mine is not None and v.name in g.state
            w = all_weights[s * k]
            places[s].append(
                (w.offsets[mine] if held and mine is not None else 0, v.type.nbytes if held else 0)
            )
        owner.append(stage)
        t.update(
            raw_name=v.name,
            short=v.type.dtype.short,
            shape_list=list(v.type.shape),
            offset=places[max(stage, 0)][-1][0],
            nbytes=v.type.nbytes,
            local_nbytes=v.type.nbytes,
            split_axis=-1,
            split_mesh_axes=0,
            ckpt_offset=pos,
            written=whole.state[v.name] is not None,
            stage=stage,
        )
        table.append(t)
        pos += (v.type.nbytes + ALIGN - 1) // ALIGN * ALIGN
    timeline = {
        "version": 1,
        "ranks": [
            schedules[s].to_json(rank=s * k + j, stage=s) for s in range(p) for j in range(k)
        ],
    }
    files = _render(
        io,
        codes,
        all_weights,
        prefix,
        source=source,
        arch=arch,
        build_target=build_target,
        poison=poison,
        mesh=mesh,
        cuda_graph=False,
        timeline=timeline,
        pipeline={
            "stages": p,
            "microbatches": microbatches,
            "ranks_per_stage": k,
            "input_strides": [],
            "output_strides": [],
            # Every rank reports the step's results (the last stage sends them around).
            "output_rank": 0,
            "train": True,
        },
        state_override=(table, {"places": places, "owner": owner, "ranks_per_stage": k}),
    )
    return files, all_weights, [c.prog.ops for c in codes]


def _prefix(prefix: str | None, graph: Graph) -> str:
    if prefix is not None and not is_c_ident(prefix):
        raise CodegenError(
            f"--prefix {prefix!r} is not a C identifier",
            hint="use letters, digits and underscores, not starting with a digit",
        )
    if prefix is not None and len(prefix) > MAX_PREFIX:
        raise CodegenError(
            f"--prefix: {len(prefix)} characters; a prefix has at most {MAX_PREFIX} (it names "
            f"the library file lib<prefix>_model.so)",
        )
    # A model's name may be longer than a file name holds: its prefix is cut short.
    return (prefix or c_ident(graph.name)[:MAX_PREFIX]) + "_"
