"""Linear quantization: QuantizeLinear and DequantizeLinear (per tensor, per axis and blocked,
every ONNX quantized type), and the integer products MatMulInteger, ConvInteger,
QLinearMatMul and QLinearConv.

QuantizeLinear and DequantizeLinear read and write the storage-only types (int4, float8, ...)
themselves, which is why widen_types leaves them alone: an output type chosen by an attribute
cannot be computed wide and cast back without a second rounding. Their kernels convert every
narrow operand through float (runtime_cpp/flowc/narrow.h).

The integer products are lowered when ONNX is imported, onto ops flowc already generates code
for: operands shifted by their zero points (int32 for the matrix product, float64 for the
convolution, both exact for 8-bit operands), the product, and for the QLinear forms a
multiplication by a_scale * b_scale / y_scale in float64 followed by a QuantizeLinear with
scale 1 (exact) and the output zero point: the rounding (half to even) and the saturation of
QuantizeLinear. The ops are declared here too, with their own NumPy references, so a program
may name them; code generation knows them only through that lowering.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import onnx.numpy_helper

from flowc.codegen.cpp import ctype
from flowc.errors import ShapeError
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs, Node
from flowc.ir.types import TensorType
from flowc.ops.common import ref_params
from flowc.ops.conv import _CONV_ATTRS  # ConvInteger and QLinearConv take Conv's attributes
from flowc.ops.norm import offset_expr
from flowc.ops.registry import (
    InferCtx,
    defop,
    elementwise_flops,
    get_op,
    node_attrs,
)

if TYPE_CHECKING:
    from flowc.codegen.program import Program
    from flowc.ir.builder import AdapterNode
    from flowc.ir.graph import Value

FAMILY = "quant"

# Integer quantized types and the range QuantizeLinear saturates to.
INT_RANGES: dict[DType, tuple[int, int]] = {
    DType.U8: (0, 255),
    DType.I8: (-128, 127),
    DType.U16: (0, 65535),
    DType.I16: (-32768, 32767),
    DType.U4: (0, 15),
    DType.I4: (-8, 7),
    DType.U2: (0, 3),
    DType.I2: (-2, 1),
}
# float8 outputs follow Cast's `saturate`; the zero point is not added (ONNX's reference and
# onnxruntime both leave it out: a float8 zero point is 0 in practice).
FLOAT8 = frozenset({DType.F8E4M3FN, DType.F8E4M3FNUZ, DType.F8E5M2, DType.F8E5M2FNUZ})
# float4/float6 have no infinity or NaN: the conversion saturates by itself.
SMALL_FLOATS = frozenset({DType.F4E2M1, DType.F6E2M3, DType.F6E3M2})
QUANTIZED = frozenset(INT_RANGES) | FLOAT8 | SMALL_FLOATS

_QUANTIZE_INPUTS = frozenset({DType.F32, DType.F16, DType.BF16, DType.I32, DType.F64})
_SCALES = frozenset({DType.F32, DType.F16, DType.BF16, DType.F64, DType.F8E8M0})
_DEQUANTIZED = frozenset({DType.F32, DType.F16, DType.BF16, DType.F64})


def _names(types: Sequence[DType]) -> str:
    return ", ".join(sorted(str(t) for t in types))


# -- quantization parameters: per tensor, per axis or blocked ------------------------------------


def _granularity(
    ctx: InferCtx, i: int, what: str, x: tuple[int, ...], axis: int, block: int
) -> str:
    """How parameter ``i`` (a scale or zero point) covers x: 'tensor' (one value), 'axis'
    (one per index of x's axis) or 'block' (x's shape with the axis cut into blocks)."""
    p = ctx.shape(i)
    if math.prod(p) == 1 and len(p) <= max(len(x), 1):
        return "tensor"
    if block < 0:
        raise ctx.fail(f"block_size must be positive, got {block}")
    if not x:
        raise ctx.fail(f"{what} of shape {list(p)} needs one value for a scalar input")
    a = ctx.axis(axis, len(x))
    if block == 0:
        if p != (x[a],):
            raise ctx.fail(
                f"{what} of shape {list(p)} is neither one value nor one per index of axis {a} "
                f"(size {x[a]}) of the input {list(x)}; blocked quantization needs block_size"
            )
        return "axis"
    want = tuple(-(-d // block) if k == a else d for k, d in enumerate(x))
    if p != want:
        raise ctx.fail(
            f"{what} of shape {list(p)} does not match blocked quantization of the input "
            f"{list(x)} along axis {a} with block_size {block}: expected {list(want)}"
        )
    return "block"


def _expand(p: np.ndarray, x: tuple[int, ...], axis: int, block: int) -> np.ndarray:
    """A parameter spread over x's shape (broadcastable to it)."""
    if p.size == 1:
        return p.reshape(())
    a = axis % len(x)
    if block == 0:
        return p.reshape([x[a] if k == a else 1 for k in range(len(x))])
    return np.repeat(p, block, axis=a).take(np.arange(x[a]), axis=a)


def _param_index(p: tuple[int, ...], x: tuple[int, ...], axis: int, block: int) -> str:
    """The C++ offset, in parameter p, of the value for x's flat element ``i``."""
    if math.prod(p) == 1:
        return "0"
    a = axis % len(x)
    if block == 0:
        strides = [1 if k == a else 0 for k in range(len(x))]
        return offset_expr("i", list(zip(x, strides, strict=True)))
    outer, inner, d = math.prod(x[:a]), math.prod(x[a + 1 :]), x[a]
    blocks = p[a]
    coord = "i" if inner == 1 else f"i / {inner}"
    along = coord if outer == 1 else f"{coord} % {d}" if inner == 1 else f"({coord}) % {d}"
    idx = f"({along}) / {block}"
    if outer > 1:
        idx = f"i / {d * inner} * {blocks} + {idx}"
    if inner > 1:
        idx = f"({idx}) * {inner} + i % {inner}"
    return idx


def _dtype_attr(ctx: InferCtx, name: str) -> DType | None:
    """The element type an attribute names by its ONNX code (None for 0: not given)."""
    if not ctx.attr(name):
        return None
    try:
        return DType.from_onnx(int(ctx.attr(name)))
    except ValueError as e:
        raise ctx.fail(f"bad {name}: {e}") from None


def _linear_result(ctx: InferCtx, out: DType, prefix: str) -> list[TensorType]:
    """x's shape in ``out``, once the scale (input 1) and the zero point (input 2, optional)
    are seen to cover x; ``prefix`` names them (y for QuantizeLinear, x for Dequantize)."""
    x = ctx.shape(0)
    axis, block = int(ctx.attr("axis")), int(ctx.attr("block_size"))
    _granularity(ctx, 1, f"{prefix}_scale", x, axis, block)
    if ctx.has(2):
        _granularity(ctx, 2, f"{prefix}_zero_point", x, axis, block)
    return [ctx.type(0).with_dtype(out)]


def _ref_operands(
    xs: list[np.ndarray | None], a: Attrs
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, Callable[[np.ndarray], np.ndarray]]:
    """A reference call's x, scale and zero point (None when omitted), and the function that
    spreads a parameter over x's shape."""
    x, scale, zp = xs[0], xs[1], xs[2] if len(xs) > 2 else None
    assert x is not None and scale is not None
    axis, block = int(a["axis"]), int(a["block_size"])
    return x, scale, zp, lambda p: _expand(p, x.shape, axis, block)


class _Linear:
    """What the kernels of quant.cu.j2 need of a Quantize/DequantizeLinear node: x, the scale,
    the zero point (None when omitted), y, the attributes and the parameters' axis and block
    size."""

    def __init__(self, node: Node) -> None:
        x, scale = node.inputs[0], node.inputs[1]
        assert x is not None and scale is not None
        self.x, self.scale = x, scale
        self.zp = node.inputs[2] if len(node.inputs) > 2 else None
        self.y = node.outputs[0]
        self.attrs = node_attrs(node)
        self.axis, self.block = int(self.attrs["axis"]), int(self.attrs["block_size"])

    def index(self, p: Value) -> str:
        return _param_index(p.type.shape, self.x.type.shape, self.axis, self.block)

    def launch(self, prog: Program, macro: str, zp: Value | None, **params: str) -> None:
        """Render ``macro`` and launch it over y's elements; ``zp``: the zero point the
        kernel reads (None: it reads none)."""
        x, scale, y = self.x, self.scale, self.y
        name = prog.kernel(
            "quant.cu.j2",
            macro,
            xt=prog.ctype(x),
            st=prog.ctype(scale),
            zt=prog.ctype(zp) if zp is not None else "",
            yt=prog.ctype(y),
            scale_index=self.index(scale),
            zp_index=self.index(zp) if zp is not None else "",
            **params,
        )
        args = [prog.cptr(x), prog.cptr(scale), *([prog.cptr(zp)] if zp is not None else [])]
        n = y.type.numel
        prog.launch(name, n, [*args, prog.ptr(y), f"(int64_t){n}"])


# -- QuantizeLinear -------------------------------------------------------------------------------


def _quantize_out(ctx: InferCtx) -> DType:
    attr = _dtype_attr(ctx, "output_dtype")
    if ctx.has(2):
        zp = ctx.dtype(2)
        if attr is not None and attr != zp:
            raise ctx.fail(f"output_dtype {attr} differs from the zero point's type {zp}")
        out = zp
    else:
        out = attr or DType.U8
    if out not in QUANTIZED:
        raise ctx.fail(f"cannot quantize to {out} (quantized types: {_names(list(QUANTIZED))})")
    return out


def _division_type(scale: DType, precision: int) -> DType:
    """The type x / y_scale is computed in: `precision` when given, else the scale's type
    (ONNX's rule); an integer or float8 E8M0 scale divides in float64 / float32."""
    dt = DType.from_onnx(precision) if precision else scale
    if dt.is_int:
        return DType.F64
    return DType.F32 if dt == DType.F8E8M0 else dt


def _quantize_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    if x.dtype not in _QUANTIZE_INPUTS:
        raise ctx.fail(f"input x must be one of {_names(list(_QUANTIZE_INPUTS))}, got {x.dtype}")
    scale = ctx.dtype(1)
    if scale not in _SCALES | {DType.I32}:
        raise ctx.fail(f"y_scale must be one of {_names([*_SCALES, DType.I32])}, got {scale}")
    p = _dtype_attr(ctx, "precision")
    if p is not None and p not in _DEQUANTIZED:
        raise ctx.fail(f"precision must be one of {_names(list(_DEQUANTIZED))}, got {p}")
    return _linear_result(ctx, _quantize_out(ctx), "y")


def _quantize_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, scale, zp, expand = _ref_operands(xs, a)
    out = ref_params(_quantize_out, "QuantizeLinear", xs, a)
    div = _division_type(DType.from_numpy(scale.dtype), int(a["precision"]))
    wide = np.float64 if div == DType.F64 else np.float32
    s = expand(scale)
    with np.errstate(all="ignore"):
        # Divide in the division type (NumPy rounds float16/bfloat16 results to the type).
        q = (x.astype(div.np) / s.astype(div.np)).astype(wide)
        if out in INT_RANGES:
            v = np.rint(q.astype(np.float64))
            if zp is not None:
                v = v + expand(zp).astype(np.float64)
            lo, hi = INT_RANGES[out]
            # NaN saturates to the low end, as fmax does in the kernel.
            return np.clip(np.where(np.isnan(v), lo, v), lo, hi).astype(out.np)
        if out in FLOAT8:
            if a["saturate"]:
                return onnx.numpy_helper.saturate_cast(q.astype(np.float32), out.np)
            return q.astype(out.np)
        if zp is not None:
            q = q + expand(zp).astype(wide)
        return q.astype(out.np)


def _quantize_emit(prog: Program, node: Node) -> None:
    q = _Linear(node)
    if q.y.type.numel == 0:
        return
    a = q.attrs
    div = _division_type(q.scale.type.dtype, int(a["precision"]))
    wide = "double" if div == DType.F64 else "float"
    out = q.y.type.dtype
    if out in INT_RANGES:
        kind = "int"
    elif out in FLOAT8:
        kind = "float8"
    else:
        kind = "float"
    lo, hi = INT_RANGES.get(out, (0, 0))
    q.launch(
        prog,
        "quantize_linear",
        q.zp if kind != "float8" else None,  # a float8 result adds no zero point
        wide=wide,
        div_t=ctype(div) if ctype(div) != wide else "",
        kind=kind,
        lo=f"{float(lo)!r}",
        hi=f"{float(hi)!r}",
        saturate="true" if int(a["saturate"]) else "false",
    )


_QUANTIZE_DEFAULTS = Attrs(
    {"axis": 1, "saturate": 1, "block_size": 0, "output_dtype": 0, "precision": 0}
)

defop(
    "QuantizeLinear",
    FAMILY,
    infer=_quantize_infer,
    reference=_quantize_ref,
    attrs=_QUANTIZE_DEFAULTS,
    inputs=(2, 3),
    flops=elementwise_flops(3),
    emit=_quantize_emit,
)


# -- DequantizeLinear -----------------------------------------------------------------------------


def _dequantize_out(ctx: InferCtx) -> DType:
    out = _dtype_attr(ctx, "output_dtype") or ctx.dtype(1)
    if out not in _DEQUANTIZED:
        raise ctx.fail(
            f"cannot dequantize to {out} (give output_dtype, one of {_names(list(_DEQUANTIZED))})"
        )
    return out


def _dequantize_infer(ctx: InferCtx) -> list[TensorType]:
    x = ctx.type(0)
    if x.dtype not in QUANTIZED | {DType.I32}:
        raise ctx.fail(
            f"input x must be a quantized type ({_names([*QUANTIZED, DType.I32])}), got {x.dtype}"
        )
    if ctx.dtype(1) not in _SCALES:
        raise ctx.fail(f"x_scale must be one of {_names(list(_SCALES))}, got {ctx.dtype(1)}")
    if ctx.has(2) and ctx.dtype(2) != x.dtype:
        raise ctx.fail(f"x_zero_point has type {ctx.dtype(2)}, expected x's type {x.dtype}")
    return _linear_result(ctx, _dequantize_out(ctx), "x")


def _dequantize_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, scale, zp, expand = _ref_operands(xs, a)
    out = ref_params(_dequantize_out, "DequantizeLinear", xs, a)
    wide = np.float64 if out == DType.F64 else np.float32
    with np.errstate(all="ignore"):
        v = x.astype(wide)
        if zp is not None:
            v = v - expand(zp).astype(wide)
        v = v * expand(scale).astype(wide)
        return v.astype(out.np)


def _dequantize_emit(prog: Program, node: Node) -> None:
    q = _Linear(node)
    if q.y.type.numel == 0:
        return
    wide = "double" if q.y.type.dtype == DType.F64 else "float"
    q.launch(prog, "dequantize_linear", q.zp, wide=wide)


defop(
    "DequantizeLinear",
    FAMILY,
    infer=_dequantize_infer,
    reference=_dequantize_ref,
    attrs={"axis": 1, "block_size": 0, "output_dtype": 0},
    inputs=(2, 3),
    flops=elementwise_flops(2),
    emit=_dequantize_emit,
)


# -- the integer products: shared pieces ----------------------------------------------------------

_INT8 = frozenset({DType.I8, DType.U8})


def _check_int8(ctx: InferCtx, idx: Sequence[int], names: Sequence[str]) -> None:
    for i, name in zip(idx, names, strict=True):
        if ctx.has(i) and ctx.dtype(i) not in _INT8:
            raise ctx.fail(f"{name} must be int8 or uint8, got {ctx.dtype(i)}")


def _check_pair(ctx: InferCtx, data: int, zp: int, names: tuple[str, str]) -> None:
    if ctx.has(zp) and ctx.dtype(zp) != ctx.dtype(data):
        raise ctx.fail(
            f"{names[1]} has type {ctx.dtype(zp)}, expected {names[0]}'s type {ctx.dtype(data)}"
        )


def _rows(p: np.ndarray, data_rank: int) -> np.ndarray:
    """A per-row parameter of a matrix product's first operand as a column: a 1-D vector of
    M values (M > 1) for an [..., M, K] operand broadcasts along M, not along K."""
    if p.ndim == 1 and p.size > 1 and data_rank >= 2:
        return p.reshape(-1, 1)
    return p


def _channels(p: np.ndarray, rank: int) -> np.ndarray:
    """A per-output-channel parameter (1-D, M values) shaped to broadcast over [M, C, k...]
    (weights) or, with ``rank`` counting from the batch axis, over [N, M, spatial...]."""
    if p.ndim == 1 and p.size > 1:
        return p.reshape(-1, *([1] * (rank - 1)))
    return p


def _shift_ref(v: np.ndarray, zp: np.ndarray | None) -> np.ndarray:
    out = v.astype(np.int32)
    return out if zp is None else out - zp.astype(np.int32)


def _requantize_ref(acc: np.ndarray, multiplier: np.ndarray, zp: np.ndarray) -> np.ndarray:
    """acc * multiplier (float64) rounded half to even, shifted by zp and saturated."""
    d = acc.astype(np.float64) * multiplier.astype(np.float64)
    return _quantize_ref([d, np.array(1.0), zp], _QUANTIZE_DEFAULTS)


def _matmul_types(ctx: InferCtx, a: int, b: int) -> TensorType:
    """The MatMul result type (shapes checked by MatMul's own inference) of inputs a and b
    taken as int32."""
    sub = InferCtx(
        "MatMul",
        ctx.node_name,
        [ctx.type(a).with_dtype(DType.I32), ctx.type(b).with_dtype(DType.I32)],
        [None, None],
        Attrs(),
        1,
    )
    return get_op("MatMul").infer(sub)[0]


def _qlinear_check(ctx: InferCtx, a: str, b: str) -> None:
    """A QLinear product's 8-bit inputs (a and its zero point at 0 and 2, b and its zero point
    at 3 and 5, y_zero_point at 7), each zero point of its operand's type; ``a``, ``b``: the
    operands' names."""
    za, zb = f"{a}_zero_point", f"{b}_zero_point"
    _check_int8(ctx, (0, 2, 3, 5, 7), (a, za, b, zb, "y_zero_point"))
    _check_pair(ctx, 0, 2, (a, za))
    _check_pair(ctx, 3, 5, (b, zb))


def _conv_types(ctx: InferCtx, x: TensorType, w: TensorType) -> TensorType:
    """The Conv result type (geometry checked by Conv's own inference) for x and w."""
    conv = get_op("Conv")
    sub = InferCtx(
        "Conv",
        ctx.node_name,
        [x.with_dtype(DType.F64), w.with_dtype(DType.F64)],
        [None, None],
        ctx.attrs.merged(conv.attrs),
        1,
    )
    try:
        return conv.infer(sub)[0]
    except ShapeError as e:
        raise ctx.fail(str(e).split(": ", 1)[-1]) from None


def _conv_ref(x: np.ndarray, w: np.ndarray, a: Attrs) -> np.ndarray:
    conv = get_op("Conv")
    keys = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
    attrs = Attrs({k: a[k] for k in keys if k in a}).merged(conv.attrs)
    return np.asarray(conv.reference([x.astype(np.float64), w.astype(np.float64)], attrs))


def _per_channel_check(ctx: InferCtx, i: int, name: str, channels: int) -> None:
    if ctx.has(i):
        p = ctx.shape(i)
        if math.prod(p) != 1 and p != (channels,):
            raise ctx.fail(
                f"{name} must be one value or one per output channel ({channels}), "
                f"got shape {list(p)}"
            )


# -- import lowering ------------------------------------------------------------------------------


def _required(n: AdapterNode, i: int, what: str) -> Value:
    v = n.input(i)
    if v is None:
        raise ShapeError(f"{n.op_type} node {n.name!r}: input {i} ({what}) is required")
    return v


def _check(n: AdapterNode, ok: bool, msg: str) -> None:
    if not ok:
        raise ShapeError(f"{n.op_type} node {n.name!r}: {msg}")


def _cast(n: AdapterNode, v: Value, dt: DType, suffix: str) -> Value:
    if v.type.dtype == dt:
        return v
    return n.emit("Cast", [v], {"to": dt.onnx}, suffix=suffix)[0]


def _reshape(n: AdapterNode, v: Value, shape: Sequence[int], suffix: str) -> Value:
    if v.type.shape == tuple(shape):
        return v
    return n.emit("Reshape", [v, n.const(f"{suffix}_shape", list(shape), np.int64)], {}, suffix)[0]


def _shifted(
    n: AdapterNode, data: Value, zp: Value | None, dt: DType, what: str, shape: Sequence[int] | None
) -> Value:
    """Cast(data) - Cast(zp) in ``dt``; zp reshaped to ``shape`` when it is a vector there."""
    _check(n, data.type.dtype in _INT8, f"{what} must be int8 or uint8, got {data.type.dtype}")
    v = _cast(n, data, dt, f"{what}_wide")
    if zp is None:
        return v
    _check(
        n,
        zp.type.dtype == data.type.dtype,
        f"{what}'s zero point has type {zp.type.dtype}, expected {data.type.dtype}",
    )
    z = _cast(n, zp, dt, f"{what}_zero_point_wide")
    if shape is not None:
        z = _reshape(n, z, shape, f"{what}_zero_point")
    return n.emit("Sub", [v, z], {}, suffix=f"{what}_shifted")[0]


def _row_shape(v: Value, data: Value) -> list[int] | None:
    """[M, 1] for a per-row vector of an [..., M, K] operand (see _rows)."""
    s = v.type.shape
    if len(s) == 1 and s[0] > 1 and data.type.rank >= 2:
        return [s[0], 1]
    return None


def _channel_shape(v: Value, rank: int) -> list[int] | None:
    s = v.type.shape
    if len(s) == 1 and s[0] > 1:
        return [s[0], *([1] * (rank - 1))]
    return None


def _requantize(
    n: AdapterNode, acc: Value, multiplier: Value, y_zp: Value | None, out: DType
) -> list[Value]:
    """QuantizeLinear(acc * multiplier) in float64 with the output zero point."""
    d = n.emit(
        "Mul",
        [_cast(n, acc, DType.F64, "acc_f64"), _cast(n, multiplier, DType.F64, "multiplier_f64")],
        {},
        suffix="scaled",
    )[0]
    one = n.const("one", 1.0, np.float64)
    ins = [d, one] if y_zp is None else [d, one, y_zp]
    return n.emit(
        "QuantizeLinear", ins, {"output_dtype": out.onnx}, output_names=n.output_names[:1]
    )


class _QLinearInputs(NamedTuple):
    a: Value
    a_scale: Value
    a_zp: Value | None
    b: Value
    b_scale: Value
    b_zp: Value | None
    y_scale: Value
    y_zp: Value | None
    out: DType  # the result's type: y_zero_point's (a's when it is omitted)


def _qlinear_inputs(n: AdapterNode, a: str, b: str) -> _QLinearInputs:
    """A QLinear product's inputs (``a``, ``b``: the operands' names), the required ones
    checked present, and its 8-bit result type."""
    va, sa = _required(n, 0, a), _required(n, 1, f"{a}_scale")
    vb, sb = _required(n, 3, b), _required(n, 4, f"{b}_scale")
    sy = _required(n, 6, "y_scale")
    za, zb, zy = n.input(2), n.input(5), n.input(7)
    out = zy.type.dtype if zy is not None else va.type.dtype
    _check(n, out in _INT8, f"y_zero_point must be int8 or uint8, got {out}")
    return _QLinearInputs(va, sa, za, vb, sb, zb, sy, zy, out)


def _multiplier(
    n: AdapterNode, scales: Sequence[tuple[Value, list[int] | None]], y_scale: Value
) -> Value:
    """scale_a * scale_b / y_scale in the scales' type (each reshaped where given)."""
    parts = [
        v if shape is None else _reshape(n, v, shape, f"scale{k}")
        for k, (v, shape) in enumerate(scales)
    ]
    prod = n.emit("Mul", parts, {}, suffix="scale_product")[0]
    return n.emit("Div", [prod, y_scale], {}, suffix="multiplier")[0]


# -- MatMulInteger --------------------------------------------------------------------------------


def _matmul_integer_infer(ctx: InferCtx) -> list[TensorType]:
    _check_int8(ctx, (0, 1, 2, 3), ("A", "B", "a_zero_point", "b_zero_point"))
    _check_pair(ctx, 0, 2, ("A", "a_zero_point"))
    _check_pair(ctx, 1, 3, ("B", "b_zero_point"))
    return [_matmul_types(ctx, 0, 1)]


def _matmul_integer_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, w = xs[0], xs[1]
    assert x is not None and w is not None
    za = _rows(xs[2], x.ndim) if len(xs) > 2 and xs[2] is not None else None
    zb = xs[3] if len(xs) > 3 else None
    return np.matmul(_shift_ref(x, za), _shift_ref(w, zb))


def _matmul_integer_import(n: AdapterNode) -> list[Value]:
    a, b = _required(n, 0, "A"), _required(n, 1, "B")
    za, zb = n.input(2), n.input(3)
    sa = _shifted(n, a, za, DType.I32, "A", _row_shape(za, a) if za is not None else None)
    sb = _shifted(n, b, zb, DType.I32, "B", None)
    return n.emit("MatMul", [sa, sb], {}, output_names=n.output_names)


# -- QLinearMatMul --------------------------------------------------------------------------------


def _qlinear_matmul_infer(ctx: InferCtx) -> list[TensorType]:
    _qlinear_check(ctx, "a", "b")
    for i, name in ((1, "a_scale"), (4, "b_scale"), (6, "y_scale")):
        if ctx.dtype(i) not in (DType.F32, DType.F16, DType.BF16):
            raise ctx.fail(f"{name} must be float32, float16 or bfloat16, got {ctx.dtype(i)}")
    return [_matmul_types(ctx, 0, 3).with_dtype(ctx.dtype(7))]


def _qlinear_matmul_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, sx, zx, w, sw, zw, sy, zy = xs[:8]
    assert x is not None and w is not None and sx is not None and sw is not None
    assert sy is not None and zy is not None
    acc = np.matmul(_shift_ref(x, _rows(zx, x.ndim) if zx is not None else None), _shift_ref(w, zw))
    with np.errstate(all="ignore"):
        m = _rows(sx, x.ndim) * sw / sy
    return _requantize_ref(acc, m, zy)


def _qlinear_matmul_import(n: AdapterNode) -> list[Value]:
    a, sa, za, b, sb, zb, sy, zy, out = _qlinear_inputs(n, "a", "b")
    acc = n.emit(
        "MatMul",
        [
            _shifted(n, a, za, DType.I32, "a", _row_shape(za, a) if za is not None else None),
            _shifted(n, b, zb, DType.I32, "b", None),
        ],
        {},
        suffix="acc",
    )[0]
    m = _multiplier(n, [(sa, _row_shape(sa, a)), (sb, None)], sy)
    return _requantize(n, acc, m, zy, out)


# -- ConvInteger ----------------------------------------------------------------------------------


def _conv_integer_infer(ctx: InferCtx) -> list[TensorType]:
    _check_int8(ctx, (0, 1, 2, 3), ("x", "w", "x_zero_point", "w_zero_point"))
    _check_pair(ctx, 0, 2, ("x", "x_zero_point"))
    _check_pair(ctx, 1, 3, ("w", "w_zero_point"))
    if ctx.has(2) and math.prod(ctx.shape(2)) != 1:
        raise ctx.fail(f"x_zero_point must be one value, got shape {list(ctx.shape(2))}")
    y = _conv_types(ctx, ctx.type(0), ctx.type(1))
    _per_channel_check(ctx, 3, "w_zero_point", ctx.shape(1)[0])
    return [y.with_dtype(DType.I32)]


def _conv_integer_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, w = xs[0], xs[1]
    assert x is not None and w is not None
    zx = xs[2] if len(xs) > 2 else None
    zw = _channels(xs[3], w.ndim) if len(xs) > 3 and xs[3] is not None else None
    y = _conv_ref(_shift_ref(x, zx), _shift_ref(w, zw), a)
    return y.astype(np.int64).astype(np.int32)


def _conv_integer_import(n: AdapterNode) -> list[Value]:
    x, w = _required(n, 0, "x"), _required(n, 1, "w")
    zx, zw = n.input(2), n.input(3)
    sx = _shifted(n, x, zx, DType.F64, "x", None)
    sw = _shifted(
        n, w, zw, DType.F64, "w", _channel_shape(zw, w.type.rank) if zw is not None else None
    )
    acc = n.emit("Conv", [sx, sw], n.attrs, suffix="acc")[0]
    return n.emit("Cast", [acc], {"to": DType.I32.onnx}, output_names=n.output_names)


# -- QLinearConv ----------------------------------------------------------------------------------


def _qlinear_conv_infer(ctx: InferCtx) -> list[TensorType]:
    _qlinear_check(ctx, "x", "w")
    for i, name in ((1, "x_scale"), (4, "w_scale"), (6, "y_scale")):
        if ctx.dtype(i) != DType.F32:
            raise ctx.fail(f"{name} must be float32, got {ctx.dtype(i)}")
    for i, name in ((1, "x_scale"), (2, "x_zero_point"), (6, "y_scale"), (7, "y_zero_point")):
        if math.prod(ctx.shape(i)) != 1:
            raise ctx.fail(f"{name} must be one value, got shape {list(ctx.shape(i))}")
    y = _conv_types(ctx, ctx.type(0), ctx.type(3))
    channels = ctx.shape(3)[0]
    _per_channel_check(ctx, 4, "w_scale", channels)
    _per_channel_check(ctx, 5, "w_zero_point", channels)
    if ctx.has(8) and (ctx.dtype(8) != DType.I32 or ctx.shape(8) != (channels,)):
        raise ctx.fail(f"B must be int32[{channels}], got {ctx.type(8)}")
    return [y.with_dtype(ctx.dtype(7))]


def _qlinear_conv_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x, sx, zx, w, sw, zw, sy, zy = xs[:8]
    assert x is not None and w is not None and sx is not None and sw is not None
    assert sy is not None and zy is not None
    b = xs[8] if len(xs) > 8 else None
    zw = _channels(zw, w.ndim) if zw is not None else None
    acc = _conv_ref(_shift_ref(x, zx), _shift_ref(w, zw), a)
    if b is not None:
        acc = acc + b.astype(np.float64).reshape(-1, *([1] * (acc.ndim - 2)))
    with np.errstate(all="ignore"):
        m = (sx * sw / sy).reshape(-1)
    m = m.reshape(-1, *([1] * (acc.ndim - 2))) if m.size > 1 else m.reshape(())
    return _requantize_ref(acc, m, zy)


def _qlinear_conv_import(n: AdapterNode) -> list[Value]:
    x, sx, zx, w, sw, zw, sy, zy, out = _qlinear_inputs(n, "x", "w")
    b = n.input(8)
    rank = w.type.rank
    ins = [
        _shifted(n, x, zx, DType.F64, "x", None),
        _shifted(n, w, zw, DType.F64, "w", _channel_shape(zw, rank) if zw is not None else None),
    ]
    if b is not None:
        _check(n, b.type.dtype == DType.I32, f"B must be int32, got {b.type.dtype}")
        ins.append(_cast(n, b, DType.F64, "bias_f64"))
    acc = n.emit("Conv", ins, n.attrs, suffix="acc")[0]
    # Per-channel w_scale: [M] -> [M, 1, ...] against the [N, M, spatial...] result.
    m = _multiplier(n, [(sx, None), (sw, _channel_shape(sw, rank - 1))], sy)
    return _requantize(n, acc, m, zy, out)


# -- registration of the integer products ---------------------------------------------------------

for _op, _infer, _ref, _import, _inputs, _attrs, _dsl in (
    (
        "MatMulInteger",
        _matmul_integer_infer,
        _matmul_integer_ref,
        _matmul_integer_import,
        (2, 4),
        None,
        "matmul_integer",
    ),
    (
        "QLinearMatMul",
        _qlinear_matmul_infer,
        _qlinear_matmul_ref,
        _qlinear_matmul_import,
        (8, 8),
        None,
        "qlinear_matmul",
    ),
    (
        "ConvInteger",
        _conv_integer_infer,
        _conv_integer_ref,
        _conv_integer_import,
        (2, 4),
        _CONV_ATTRS,
        "",
    ),
    (
        "QLinearConv",
        _qlinear_conv_infer,
        _qlinear_conv_ref,
        _qlinear_conv_import,
        (8, 9),
        _CONV_ATTRS,
        "qlinear_conv",
    ),
):
    defop(
        _op,
        FAMILY,
        infer=_infer,
        reference=_ref,
        attrs=_attrs,
        inputs=_inputs,
        onnx_import=_import,
        dsl_name=_dsl,
    )
