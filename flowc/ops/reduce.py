"""Reductions: the Reduce* family, ArgMax/ArgMin, CumSum and CumProd.

Canonical Reduce* take ``axes`` as optional input 1 (opset 18; ReduceSum since 13); older
opsets give it as an attribute, which the adapter moves to the input. Empty or absent axes
reduce every axis unless ``noop_with_empty_axes`` is set; then the reduction runs over an
empty set of axes, so each element is reduced alone (ReduceL1 gives |x|, ReduceSumSquare
x², ReduceLogSum log x), which is what onnxruntime computes.

Reducing an empty set gives ONNX's identities (0 for sums, 1 for Prod, -inf or the type's
minimum for Max, LogSum and LogSumExp, +inf or the maximum for Min); the mean of nothing,
undefined in ONNX, is onnxruntime's 0.

Float reductions accumulate in float64 and round once at the end. Integer reductions
follow onnxruntime's CPU kernels: Sum, Prod, L1 and SumSquare accumulate in the input type
(wrapping as C does), Mean divides an int64 sum with truncation, L2 and LogSum go through
float64, LogSumExp sums truncated exponentials, and float results truncate toward zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from flowc.codegen.cpp import BLOCK, MAX_GRID, CodegenError, c_float, ctype
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node, Value
from flowc.ir.types import TensorType
from flowc.ops import grad
from flowc.ops import sbp_rules as sr
from flowc.ops.registry import (
    InferCtx,
    SbpFn,
    SbpSignature,
    defop,
    first,
    get_op,
    ints,
    set_vjp,
)

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.builder import AdapterNode

FAMILY = "reduce"

Axes = tuple[int, ...]


def _input_flops(ins: list[TensorType | None], outs: list[TensorType], attrs: Attrs) -> int:
    """One operation per input element: every element is read and combined once."""
    t = ins[0]
    return t.numel if t is not None else 0


def _check_numeric(ctx: InferCtx, allow_bool: bool = False) -> DType:
    dt = ctx.dtype(0)
    if not (dt.is_float or dt.is_int or (allow_bool and dt == DType.BOOL)):
        kinds = "a numeric or bool" if allow_bool else "a numeric"
        raise ctx.fail(f"needs {kinds} input, got {dt}")
    return dt


def _float_to_int(r: np.ndarray, dt: np.dtype) -> np.ndarray:
    """Truncate float64 results toward zero. -inf and NaN (log 0, log of a negative sum) give
    the type's minimum, as the C cast in onnxruntime's kernels does on x86; values above the
    range (an L2 norm past the int64 maximum) saturate instead of wrapping."""
    info = np.iinfo(dt)
    bad_low = np.isnan(r) | (r <= float(info.min))
    bad_high = r >= float(info.max)
    safe = np.where(bad_low | bad_high, 0.0, np.trunc(r)).astype(dt)
    return np.where(bad_low, info.min, np.where(bad_high, info.max, safe)).astype(dt)


def _to(r: np.ndarray, dt: np.dtype) -> np.ndarray:
    if dt.kind in "iu" and r.dtype.kind == "f":
        return _float_to_int(r, dt)
    return np.asarray(r).astype(dt, copy=False)


def _acc(x: np.ndarray) -> np.ndarray:
    """The array to accumulate floats in: float64 (float64 inputs and integers stay as is)."""
    return x.astype(np.float64) if x.dtype.kind not in "iub" else x


# -- code generation --------------------------------------------------------------------------
# Kernels are in templates/kernels/reduce.cu.j2. A reduction whose reduced axes are the
# innermost ones (after dropping size-1 axes and merging neighbours) reduces contiguous rows:
# a block-cooperative kernel, the threads of a row meeting through warp shuffles (sizes are
# arguments: one kernel per op, type and vector width). Any other layout gets one thread per
# output element, walking the reduced axes.

TEMPLATE = "reduce.cu.j2"
WARP = 32


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class RowLayout:
    """How a block-cooperative kernel covers ``rows`` rows of ``cols`` elements: ``width``
    threads per row (a power of two, so the shuffles halve evenly), ``per_block`` rows per
    block (short rows share a block instead of leaving most of it idle; a block is at least
    one whole warp, as the full-mask shuffles need), ``blocks`` blocks (each loops over
    further rows when there are more than the grid covers). The kernels take the width as
    its log2 at run time, so one kernel serves every layout."""

    width: int
    per_block: int
    blocks: int

    @property
    def threads(self) -> int:
        return self.width * self.per_block

    @property
    def log2w(self) -> int:
        return self.width.bit_length() - 1


def row_layout(rows: int, cols: int, vec: int = 1) -> RowLayout:
    """``vec``: elements each thread takes per load (4 for the 16-byte loads)."""
    width = min(BLOCK, next_pow2(max(-(-cols // vec), 1)))
    per_block = max(min(BLOCK // width, next_pow2(max(rows, 1))), WARP // width)
    blocks = min(-(-rows // per_block), MAX_GRID)
    return RowLayout(width, per_block, blocks)


def launch_rows(
    prog: Program, kernel: str, x: Value, y: Value, rows: int, cols: int, vec: int = 1
) -> None:
    """Launch a row kernel (rows x cols, the reduced axis innermost) under ``row_layout``:
    the kernels of reduce.cu.j2 and softmax.cu.j2 take (in, out, rows, cols, log2 width).
    In a program with symbolic dims whose only symbolic dim is the first (Program.
    leading_only, the rows' count), the rows are this run's: the layout is the bound's, the
    grid and the row count the run's."""
    lay = row_layout(rows, cols, vec)
    if y.type.sym is None:
        args = [prog.cptr(x), prog.ptr(y), f"(int64_t){rows}", f"(int64_t){cols}", str(lay.log2w)]
        prog.launch_blocks(kernel, lay.blocks, lay.threads, 0, args)
        return
    run_rows = prog.numel(y.type)
    args = [prog.cptr(x), prog.ptr(y), f"(int64_t){run_rows}", f"(int64_t){cols}", str(lay.log2w)]
    prog.launch_grid(kernel, [prog.grid(run_rows, lay.per_block)], lay.threads, args)


def launch_rows_sized(
    prog: Program, kernel: str, x: Value, y: Value, rows: str, layout: RowLayout
) -> None:
    """launch_rows for a program with symbolic dims: the kernel reads rows and cols from the
    run's size table; ``layout`` is the bound's, the grid covers this run's ``rows`` (host
    C++)."""
    args = [prog.cptr(x), prog.ptr(y), "ddims", str(layout.log2w)]
    grid = prog.grid(rows, layout.per_block)
    prog.launch_grid(kernel, [grid], layout.threads, args)


def vec_width(dtype: DType, cols: int) -> int:
    """4 when rows of ``cols`` elements of ``dtype`` can be read 16 bytes at a time (float32
    rows of a multiple of 4 elements; the kernels check the pointers' alignment at run time),
    else 1. A compile-time choice: the variant without the vector path is smaller."""
    return 4 if dtype == DType.F32 and cols % 4 == 0 else 1


def kernel_ctype(prog: Program, v: Value) -> str:
    """The C++ element type of ``v``, or a clear error naming the node."""
    try:
        return ctype(v.type.dtype)
    except CodegenError as e:
        raise prog.fail(str(e)) from None


def outer_inner(shape: tuple[int, ...], axis: int) -> tuple[int, int, int]:
    """The [outer, extent, inner] view of ``shape`` around ``axis``."""
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :])


def _int_lit(value: int, t: str) -> str:
    if value == -(1 << 63):
        return f"static_cast<{t}>(-9223372036854775807LL - 1)"
    return f"static_cast<{t}>({value}{'ULL' if value >= 1 << 63 else 'LL'})"


def _merged_axes(shape: tuple[int, ...], axes: Axes) -> list[tuple[int, bool]]:
    """(size, reduced) for runs of neighbouring axes that are all reduced or all kept; size-1
    axes are dropped (they change no offset)."""
    groups: list[tuple[int, bool]] = []
    for k, d in enumerate(shape):
        if d == 1:
            continue
        red = k in axes
        if groups and groups[-1][1] == red:
            groups[-1] = (groups[-1][0] * d, red)
        else:
            groups.append((d, red))
    return groups


def _reduce_spec(op: str, dt: DType) -> dict[str, Any]:
    """The template parameters that say what a Reduce* kernel computes for this dtype (see the
    template's header). Mean divides by ``count_``, the finish helper's argument. Floats accumulate in their own type (as onnxruntime does; the
    reference's float64 is too slow on a GPU), integers as the module docstring says, with an
    unsigned accumulator where they wrap so that overflow is well defined in C++."""
    t = ctype(dt)
    kind = op.removeprefix("Reduce")
    spec: dict[str, Any] = {
        "in_t": t,
        "out_t": t,
        "acc": t,
        "combine": "a + b",
        "finish": "a",
        "shift": "",
        "saturate": False,
        "low": "0",
        "high": "0",
        "lowest": "0",
        "highest": "0",
    }
    if dt.is_float:
        zero = f"static_cast<{t}>(0)"
        steps = {
            "Sum": ("a + v", "a"),
            "Mean": ("a + v", f"a / static_cast<{t}>(count_)"),
            "L1": ("a + flowc::ew::abs_(v)", "a"),
            "L2": ("a + v * v", "flowc::ew::sqrt_(a)"),
            "LogSum": ("a + v", "flowc::ew::log_(a)"),
            "SumSquare": ("a + v * v", "a"),
            "LogSumExp": ("a + flowc::ew::exp_(v - m)", "flowc::ew::log_(a) + m"),
        }
        if kind in steps:
            step, finish = steps[kind]
            spec.update(init=zero, step=step, finish=finish)
            if kind == "LogSumExp":
                spec["shift"] = t
        elif kind == "Prod":
            spec.update(init=f"static_cast<{t}>(1)", step="a * v", combine="a * b")
        else:
            fn = "max_" if kind == "Max" else "min_"
            ident = c_float(-math.inf if kind == "Max" else math.inf, t)
            spec.update(init=ident, step=f"flowc::ew::{fn}(a, v)", combine=f"flowc::ew::{fn}(a, b)")
        return spec
    if dt == DType.BOOL:  # Max and Min only: any and all
        op_ = "||" if kind == "Max" else "&&"
        spec.update(
            init="false" if kind == "Max" else "true", step=f"a {op_} v", combine=f"a {op_} b"
        )
        return spec
    info = np.iinfo(dt.np)
    u = "uint64_t" if dt.itemsize == 8 else "uint32_t"
    cv = f"static_cast<{u}>(v)"
    wrapped = {
        "Sum": ("0", f"a + {cv}", "a + b"),
        "Prod": ("1", f"a * {cv}", "a * b"),
        "L1": (
            "0",
            f"a + (v < 0 ? static_cast<{u}>(0) - {cv} : {cv})" if dt.is_signed else f"a + {cv}",
            "a + b",
        ),
        "SumSquare": ("0", f"a + {cv} * {cv}", "a + b"),
    }
    if kind in wrapped:
        init, step, combine = wrapped[kind]
        spec.update(
            acc=u,
            init=f"static_cast<{u}>({init})",
            step=step,
            combine=combine,
            finish=f"static_cast<{t}>(a)",
        )
    elif kind == "Mean":
        # An int64 sum divided with C's truncation, as onnxruntime does.
        spec.update(
            acc="uint64_t",
            init="static_cast<uint64_t>(0)",
            step="a + static_cast<uint64_t>(static_cast<int64_t>(v))",
            finish=f"static_cast<{t}>(static_cast<int64_t>(a) / count_)",
        )
    elif kind in ("Max", "Min"):
        cmp = ">" if kind == "Max" else "<"
        spec.update(
            init=_int_lit(int(info.min if kind == "Max" else info.max), t),
            step=f"(v {cmp} a ? v : a)",
            combine=f"(b {cmp} a ? b : a)",
        )
    else:
        # L2, LogSum and LogSumExp go through float64 and convert back with saturation.
        sat = "$sat"  # the template names the conversion helper
        finish = {
            "L2": f"{sat}(flowc::ew::sqrt_(a))",
            "LogSum": f"{sat}(flowc::ew::log_(a))",
            "LogSumExp": f"{sat}(flowc::ew::log_(a) + m)",
        }[kind]
        step = {
            "L2": "a + static_cast<double>(v) * static_cast<double>(v)",
            "LogSum": "a + static_cast<double>(v)",
            # onnxruntime sums the exponentials in the integer type: each term truncates.
            # After the shift each lies in [0, 1], so an int64 cast truncates safely.
            "LogSumExp": (
                "a + static_cast<double>(static_cast<int64_t>("
                "flowc::ew::exp_(static_cast<double>(v) - m)))"
            ),
        }[kind]
        spec.update(
            acc="double",
            init="0.0",
            step=step,
            finish=finish,
            shift="double" if kind == "LogSumExp" else "",
            saturate=True,
            low=c_float(float(info.min), "double"),
            high=c_float(float(info.max), "double"),
            lowest=_int_lit(int(info.min), t),
            highest=_int_lit(int(info.max), t),
        )
    return spec


def _node_axes(node: Node, rank: int, noop: bool) -> Axes:
    given: list[int] = []
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        a = node.inputs[1].const
        assert a is not None, "inference requires constant axes"
        given = ints(a)
    if not given:
        return () if noop else tuple(range(rank))
    return tuple(sorted({k % rank for k in given}))


def emit_reduce(prog: Program, node: Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    assert x is not None
    attrs = node.attrs.merged(get_op(node.op).attrs)
    kernel_ctype(prog, x)
    n_out = y.type.numel
    if n_out == 0:
        return
    shape = x.type.shape
    axes = _node_axes(node, len(shape), bool(attrs["noop_with_empty_axes"]))
    # The mean of nothing is onnxruntime's 0: divide the zero sum by 1.
    count = math.prod(shape[k] for k in axes) or 1
    groups = _merged_axes(shape, axes)
    rows_only = bool(groups) and groups[-1][1] and not any(red for _, red in groups[:-1])
    if prog.is_sized(node):
        sized = _sized_groups(prog, x.type, axes)
        # rows of fixed length (the reduced axes trailing and fixed): the row kernel over
        # the run's rows; else one thread per output walks the run's reduced axes
        rows_only = sized[-1][1] and isinstance(sized[-1][0], int)
        rows_only = rows_only and not any(red for _, red in sized[:-1])
        if not rows_only:
            _emit_reduce_sized(prog, node, sized)
            return
    if rows_only:
        spec = _reduce_spec(node.op, x.type.dtype)
        cols = groups[-1][0]
        vec = vec_width(x.type.dtype, cols)
        k = prog.kernel(TEMPLATE, "reduce_rows", **spec, vec=vec)
        launch_rows(prog, k, x, y, n_out, cols, vec)
        return
    spec = _reduce_spec(node.op, x.type.dtype)
    kept: list[dict[str, int]] = []
    reduced: list[dict[str, int]] = []
    stride = 1
    for size, red in reversed(groups):
        (reduced if red else kept).insert(0, {"size": size, "stride": stride})
        stride *= size
    k = prog.kernel(TEMPLATE, "reduce_strided", **spec, kept=kept, reduced=reduced, count=count)
    prog.launch(k, n_out, [prog.cptr(x), prog.ptr(y), f"(int64_t){n_out}"])


Size = int | str  # a dim's size, or its C++ over a kernel's run-time `sizes`


def _sized_groups(prog: Program, t: TensorType, axes: Axes) -> list[tuple[Size, bool]]:
    """_merged_axes for a type with symbolic dims: each run's size a number where its dims
    are fixed, else C++ over the kernel's ``sizes``."""
    groups: list[tuple[Size, bool]] = []
    for k, d in enumerate(t.shape):
        symbolic = t.sym is not None and t.sym[k] is not None
        if d == 1 and not symbolic:
            continue
        size: Size = prog.dim(t, k) if symbolic else d
        red = k in axes
        if groups and groups[-1][1] == red:
            size = _times(groups[-1][0], size)
            groups[-1] = (size, red)
        else:
            groups.append((size, red))
    return groups


def _times(a: Size, b: Size) -> Size:
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    return f"({a} * {b})"


def _emit_reduce_sized(prog: Program, node: Node, groups: list[tuple[Size, bool]]) -> None:
    """The strided kernel with the run's sizes: its output count, strides and (Mean) the
    reduced count read from the device table, so a captured launch serves every size."""
    x, y = node.inputs[0], node.outputs[0]
    assert x is not None
    spec = _reduce_spec(node.op, x.type.dtype)
    kept: list[dict[str, Size]] = []
    reduced: list[dict[str, Size]] = []
    stride: Size = 1
    total: Size = 1
    count: Size = 1
    for size, red in reversed(groups):
        (reduced if red else kept).insert(0, {"size": size, "stride": stride})
        stride = _times(stride, size)
        if red:
            count = _times(count, size)
        else:
            total = _times(total, size)
    # the mean of nothing (a count of 0 rows) is 0: divide the zero sum by 1
    count_text = str(count or 1) if isinstance(count, int) else f"({count} > 0 ? {count} : 1)"
    k = prog.kernel(
        TEMPLATE,
        "reduce_strided",
        **spec,
        kept=kept,
        reduced=reduced,
        count=count_text,
        total=str(total),
    )
    prog.launch_sized(k, prog.numel(y.type), [prog.cptr(x), prog.ptr(y)])


def emit_arg(largest: bool) -> Callable[[Program, Node], None]:
    def emit(prog: Program, node: Node) -> None:
        x, y = node.inputs[0], node.outputs[0]
        assert x is not None
        attrs = node.attrs.merged(get_op(node.op).attrs)
        t = kernel_ctype(prog, x)
        shape = x.type.shape
        outer, extent, inner = outer_inner(shape, int(attrs["axis"]) % len(shape))
        n_out = outer * inner
        if n_out == 0:
            return
        params: dict[str, Any] = {
            "in_t": t,
            "is_float": x.type.dtype.is_float,
            "better": ">" if largest else "<",
            "last": bool(attrs["select_last_index"]),
        }
        axis = int(attrs["axis"]) % len(shape)
        sym = x.type.sym or (None,) * len(shape)
        if prog.is_sized(node) and (inner != 1 or sym[axis] is not None):
            # one thread per output walks the axis, all three extents the run's
            _, length, step = prog.around(x.type, axis)
            k = prog.kernel(
                TEMPLATE,
                "arg_strided",
                **params,
                extent=length,
                inner=step,
                total=prog.numel(y.type, "sizes"),
            )
            prog.launch_sized(k, prog.numel(y.type), [prog.cptr(x), prog.ptr(y)])
            return
        if inner == 1:
            k = prog.kernel(TEMPLATE, "arg_rows", **params)
            launch_rows(prog, k, x, y, outer, extent)
        else:
            k = prog.kernel(TEMPLATE, "arg_strided", **params, extent=extent, inner=inner)
            prog.launch(k, n_out, [prog.cptr(x), prog.ptr(y), f"(int64_t){n_out}"])

    return emit


def emit_cumulative(prog: Program, node: Node) -> None:
    """CumSum and CumProd: one thread per line along the axis."""
    x, ax, y = node.inputs[0], node.inputs[1], node.outputs[0]
    assert x is not None and ax is not None and ax.const is not None
    attrs = node.attrs.merged(get_op(node.op).attrs)
    t = kernel_ctype(prog, x)
    if y.type.numel == 0:
        return
    shape = x.type.shape
    axis = ints(ax.const)[0] % len(shape)
    outer, extent, inner = outer_inner(shape, axis)
    dt = x.type.dtype
    acc = t if dt.is_float else ("uint64_t" if dt.itemsize == 8 else "uint32_t")
    params = {
        "ctype": t,
        "acc": acc,
        "product": node.op == "CumProd",
        "reverse": bool(attrs["reverse"]),
        "exclusive": bool(attrs["exclusive"]),
    }
    if prog.is_sized(node):
        # the lines, their length and their step: the run's (a position count over seq)
        lines, length, step = prog.around(x.type, axis)
        k = prog.kernel(
            TEMPLATE,
            "cumulative",
            **params,
            extent=length,
            inner=step,
            total=f"{lines} * {step}",
        )
        host_lines, _, host_step = prog.around(x.type, axis, "hdims")
        prog.launch_sized(k, f"{host_lines} * {host_step}", [prog.cptr(x), prog.ptr(y)])
        return
    k = prog.kernel(TEMPLATE, "cumulative", **params, extent=extent, inner=inner)
    n = outer * inner
    prog.launch(k, n, [prog.cptr(x), prog.ptr(y), f"(int64_t){n}"])


# -- Reduce* ----------------------------------------------------------------------------------

# Each kernel reduces x over ``axes`` (a tuple of non-negative axes, possibly empty) with
# keepdims=True; the caller drops the reduced axes afterwards when keepdims is 0.
Kernel = Callable[[np.ndarray, Axes], np.ndarray]


def _sum(x: np.ndarray, axes: Axes) -> np.ndarray:
    a = _acc(x)
    return np.sum(a, axis=axes, keepdims=True, dtype=a.dtype)


def _mean(x: np.ndarray, axes: Axes) -> np.ndarray:
    # The mean of nothing is undefined in ONNX and 0 in onnxruntime: dividing the zero sum
    # by 1 instead of 0 gives that.
    count = math.prod(x.shape[k] for k in axes) or 1
    if x.dtype.kind in "iu":
        s = np.asarray(np.sum(x.astype(np.int64), axis=axes, keepdims=True, dtype=np.int64))
        q = s // count
        # // floors; onnxruntime divides as C does, truncating toward zero.
        return np.asarray(np.where((s % count != 0) & (s < 0), q + 1, q))
    return np.asarray(np.sum(_acc(x), axis=axes, keepdims=True) / count)


def _extreme(largest: bool) -> Kernel:
    def run(x: np.ndarray, axes: Axes) -> np.ndarray:
        ident: bool | int | float
        if x.dtype == np.bool_:
            ident = not largest
        elif x.dtype.kind in "iu":
            info = np.iinfo(x.dtype)
            ident = info.min if largest else info.max
        else:
            ident = -np.inf if largest else np.inf
        fn = np.max if largest else np.min
        return np.asarray(fn(x, axis=axes, keepdims=True, initial=ident))

    return run


def _prod(x: np.ndarray, axes: Axes) -> np.ndarray:
    a = _acc(x)
    return np.prod(a, axis=axes, keepdims=True, dtype=a.dtype)


def _l1(x: np.ndarray, axes: Axes) -> np.ndarray:
    a = _acc(x)
    return np.sum(np.abs(a), axis=axes, keepdims=True, dtype=a.dtype)


def _l2(x: np.ndarray, axes: Axes) -> np.ndarray:
    a = x.astype(np.float64)
    return np.sqrt(np.sum(a * a, axis=axes, keepdims=True))


def _log_sum(x: np.ndarray, axes: Axes) -> np.ndarray:
    return np.log(np.sum(x.astype(np.float64), axis=axes, keepdims=True))


def _log_sum_exp(x: np.ndarray, axes: Axes) -> np.ndarray:
    a = x.astype(np.float64)
    m = np.max(a, axis=axes, keepdims=True, initial=-np.inf)
    # Shift by the max for stability; an infinite max (all -inf, or +inf present) would give
    # inf - inf, so shift by 0 there: the result is then the right infinity anyway.
    m = np.where(np.isfinite(m), m, 0.0)
    terms = np.exp(a - m)
    if x.dtype.kind in "iu":
        # onnxruntime accumulates the exponentials in the integer input type.
        terms = np.trunc(terms)
    return np.log(np.sum(terms, axis=axes, keepdims=True)) + m


def _sum_square(x: np.ndarray, axes: Axes) -> np.ndarray:
    a = _acc(x)
    return np.sum(a * a, axis=axes, keepdims=True, dtype=a.dtype)


def _reduce_axes(ctx: InferCtx, rank: int) -> Axes:
    """The sorted, de-duplicated axes to reduce (onnxruntime accepts repeats)."""
    if "axes" in ctx.attrs:
        raise ctx.fail("'axes' is an input (input 1) in this opset, not an attribute")
    given: list[int] = []
    if ctx.has(1):
        a = ctx.const(1, "axes")
        if a.dtype.kind not in "iu" or a.ndim > 1:
            raise ctx.fail(
                f"axes must be a 1-D integer tensor, got {a.dtype} of shape {list(a.shape)}"
            )
        given = ints(a)
    if not given:
        return () if ctx.attr("noop_with_empty_axes") else tuple(range(rank))
    return tuple(sorted({ctx.axis(k, rank, "axes entry") for k in given}))


def _ref_axes(xs: list[np.ndarray | None], a: Attrs) -> Axes:
    """The reference's view of the axes (already validated by inference)."""
    x = first(xs)
    given = ints(xs[1]) if len(xs) > 1 and xs[1] is not None else []
    if not given:
        return () if a["noop_with_empty_axes"] else tuple(range(x.ndim))
    return tuple(sorted({k % x.ndim for k in given}))


Linear = Literal["none", "all", "float"]


def _reduce_sbp(linear: Linear) -> SbpFn:
    """Kept axes split through. A sum over a split axis is the sum of the parts' sums (P);
    no other reduction combines that way (a mean would need the global count, a max a
    partial max), so they never split a reduced axis. ``linear`` says which reductions are
    linear (P -> P): "all" for Sum, "float" for Mean (an integer mean truncates each part)."""

    def sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
        rank = len(ctx.shape(0))
        axes = _reduce_axes(ctx, rank)
        sigs = sr.splits(ctx, outs, sr.kept_axes(rank, axes, bool(ctx.attr("keepdims"))))
        if linear == "all" or (linear == "float" and outs[0].dtype.is_float):
            sigs.append(sr.partial(ctx, outs))
        if linear == "all":
            sigs += [sr.sig(ctx, {0: sr.S(a)}, sr.P, 1) for a in axes]
        return sigs

    return sbp


def reduction(
    name: str,
    kernel: Kernel,
    allow_bool: bool = False,
    new_since: int = 18,
    linear: Linear = "none",
) -> None:
    def infer(ctx: InferCtx) -> list[TensorType]:
        dt = _check_numeric(ctx, allow_bool)
        shape = ctx.shape(0)
        axes = _reduce_axes(ctx, len(shape))
        keep = bool(ctx.attr("keepdims"))
        out = [1 if k in axes else d for k, d in enumerate(shape) if keep or k not in axes]
        return [TensorType(tuple(out), dt)]

    def ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
        x = first(xs)
        axes = _ref_axes(xs, a)
        with np.errstate(all="ignore"):
            r = kernel(x, axes)
        if not a["keepdims"]:
            r = r.reshape([d for k, d in enumerate(r.shape) if k not in axes])
        return _to(r, x.dtype)

    def adapt(n: AdapterNode) -> None:
        if n.opset < new_since:
            n.attr_to_input("axes", 1)

    defop(
        name,
        FAMILY,
        infer=infer,
        reference=ref,
        attrs={"keepdims": 1, "noop_with_empty_axes": 0},
        inputs=(1, 2),
        flops=_input_flops,
        onnx_import=adapt,
        sbp=_reduce_sbp(linear),
        emit=emit_reduce,
        sized=True,
    )


reduction("ReduceSum", _sum, new_since=13, linear="all")
reduction("ReduceMean", _mean, linear="float")
reduction("ReduceMax", _extreme(largest=True), allow_bool=True)
reduction("ReduceMin", _extreme(largest=False), allow_bool=True)
reduction("ReduceProd", _prod)
reduction("ReduceL1", _l1)
reduction("ReduceL2", _l2)
reduction("ReduceLogSum", _log_sum)
reduction("ReduceLogSumExp", _log_sum_exp)
reduction("ReduceSumSquare", _sum_square)


# -- ArgMax / ArgMin --------------------------------------------------------------------------


def _arg_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    rank = len(ctx.shape(0))
    axis = ctx.axis(int(ctx.attr("axis")), rank)
    return sr.splits(ctx, outs, sr.kept_axes(rank, (axis,), bool(ctx.attr("keepdims"))))


def arg_reduction(name: str, largest: bool) -> None:
    def infer(ctx: InferCtx) -> list[TensorType]:
        _check_numeric(ctx)
        shape = ctx.shape(0)
        if not shape:
            raise ctx.fail("needs an input of rank >= 1, got a scalar")
        axis = ctx.axis(int(ctx.attr("axis")), len(shape))
        if shape[axis] == 0:
            raise ctx.fail(f"axis {axis} has size 0: there is no element to pick")
        out = list(shape)
        if ctx.attr("keepdims"):
            out[axis] = 1
        else:
            del out[axis]
        return [TensorType(tuple(out), DType.I64)]

    def ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
        x = first(xs)
        axis = int(a["axis"]) % x.ndim
        pick = np.argmax if largest else np.argmin
        if a["select_last_index"]:
            # NumPy picks the first of tied values; pick it in the reversed axis instead.
            idx = x.shape[axis] - 1 - pick(np.flip(x, axis), axis=axis, keepdims=True)
        else:
            idx = pick(x, axis=axis, keepdims=True)
        if not a["keepdims"]:
            idx = np.squeeze(idx, axis=axis)
        return np.asarray(idx, dtype=np.int64)

    defop(
        name,
        FAMILY,
        infer=infer,
        reference=ref,
        attrs={"axis": 0, "keepdims": 1, "select_last_index": 0},
        flops=_input_flops,
        sbp=_arg_sbp,
        emit=emit_arg(largest),
        sized=True,
    )


arg_reduction("ArgMax", largest=True)
arg_reduction("ArgMin", largest=False)


# -- CumSum and CumProd ------------------------------------------------------------------------


def _cumsum_axis(ctx: InferCtx) -> int:
    a = ctx.const(1, "axis")
    if a.dtype.kind not in "iu" or a.size != 1 or a.ndim > 1:
        raise ctx.fail(
            f"axis must be one integer (a scalar or a 1-element 1-D tensor), got {a.dtype} "
            f"of shape {list(a.shape)}"
        )
    return ctx.axis(ints(a)[0], ctx.type(0).rank)


def _cumsum_infer(ctx: InferCtx) -> list[TensorType]:
    t = ctx.type(0)
    if not (t.dtype.is_float or t.dtype.is_int):
        raise ctx.fail(f"needs a numeric input, got {t.dtype}")
    if t.rank == 0:
        raise ctx.fail("needs an input of rank >= 1, got a scalar")
    _cumsum_axis(ctx)
    return [t]


def _cumsum_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    # Lines along the axis are independent, and a running sum is linear.
    axis = _cumsum_axis(ctx)
    others = (d for d in range(outs[0].rank) if d != axis)
    return [*sr.same_axes(ctx, outs, others), sr.partial(ctx, outs)]


def _cumprod_sbp(ctx: InferCtx, outs: list[TensorType]) -> list[SbpSignature]:
    # Lines along the axis are independent; a running product is not linear (no P).
    axis = _cumsum_axis(ctx)
    return sr.same_axes(ctx, outs, (d for d in range(outs[0].rank) if d != axis))


def _cumulative_ref(product: bool) -> Callable[[list[np.ndarray | None], Attrs], np.ndarray]:
    def ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
        x, ax = xs[0], xs[1]
        assert x is not None and ax is not None
        axis = ints(ax)[0] % x.ndim
        v = np.flip(x, axis) if a["reverse"] else x
        acc = _acc(v)
        # Integers run in their own type and wrap on overflow, as onnxruntime's do.
        with np.errstate(over="ignore"):
            if product:
                r = np.cumprod(acc, axis=axis, dtype=acc.dtype)
            else:
                r = np.cumsum(acc, axis=axis, dtype=acc.dtype)
        if a["exclusive"]:
            # Each position combines only the elements strictly before it: shift by one,
            # with the identity (0 or 1) first.
            dst = [slice(None)] * r.ndim
            src = [slice(None)] * r.ndim
            dst[axis], src[axis] = slice(1, None), slice(None, -1)
            shifted = np.ones_like(r) if product else np.zeros_like(r)
            shifted[tuple(dst)] = r[tuple(src)]
            r = shifted
        if a["reverse"]:
            r = np.flip(r, axis)
        return np.ascontiguousarray(r).astype(x.dtype, copy=False)

    return ref


defop(
    "CumSum",
    FAMILY,
    infer=_cumsum_infer,
    reference=_cumulative_ref(product=False),
    attrs={"exclusive": 0, "reverse": 0},
    inputs=2,
    flops=_input_flops,
    sbp=_cumsum_sbp,
    emit=emit_cumulative,
    sized=True,
)

defop(
    "CumProd",
    FAMILY,
    infer=_cumsum_infer,
    reference=_cumulative_ref(product=True),
    attrs={"exclusive": 0, "reverse": 0},
    inputs=2,
    flops=_input_flops,
    sbp=_cumprod_sbp,
    emit=emit_cumulative,
    sized=True,
)


# -- gradients (VJP rules: flowc/ops/grad.py) ---------------------------------------------------


def reduced_axes(node: Node) -> list[int] | None:
    """The axes a ReduceSum/ReduceMean node reduces, normalized; None when it is the
    identity (no axes and noop_with_empty_axes)."""
    x = node.inputs[0]
    assert x is not None
    rank = x.type.rank
    given = grad.const_int_input(node, 1, default=[])
    assert given is not None, "the axes of a reduction are constant after import"
    if not given:
        return None if node.attrs.get("noop_with_empty_axes", 0) else list(range(rank))
    return sorted(a % rank for a in given)


def _reduce_vjp(mean: bool) -> grad.VjpFn:
    def vjp(
        b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
    ) -> list[Value | None]:
        g, x = gouts[0], node.inputs[0]
        grads: list[Value | None] = [None] * len(node.inputs)
        if g is None or x is None or not need[0]:
            return grads
        axes = reduced_axes(node)
        if axes is None:
            grads[0] = g
            return grads
        kept = [1 if k in axes else d for k, d in enumerate(x.type.shape)]
        spread = grad.expand_to(b, grad.reshape(b, g, kept), x.type.shape)
        if mean:
            count = math.prod(x.type.shape[k] for k in axes)
            spread = grad.op1(b, "Div", spread, grad.scalar(b, float(max(count, 1)), g))
        grads[0] = spread
        return grads

    return vjp


def _sum_square_vjp(
    b: grad.GradBuilder, node: Node, gouts: list[Value | None], need: list[bool]
) -> list[Value | None]:
    # d/dx sum x^2 = 2x
    x = node.inputs[0]
    assert x is not None
    first_pass = _reduce_vjp(mean=False)(b, node, gouts, need)
    if first_pass[0] is not None:
        twice = grad.op1(b, "Mul", x, grad.scalar(b, 2.0, x))
        first_pass[0] = grad.op1(b, "Mul", first_pass[0], twice)
    return first_pass


set_vjp("ReduceSum", _reduce_vjp(mean=False))
set_vjp("ReduceMean", _reduce_vjp(mean=True))
set_vjp("ReduceSumSquare", _sum_square_vjp)
