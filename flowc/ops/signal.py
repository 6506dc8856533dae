"""Signal processing: DFT, STFT and MelWeightMatrix; and BitCast.

flowc's shapes are static, so a DFT of length L along one axis is a fixed linear map: the
importer lowers DFT and STFT to a MatMul with a constant matrix of cosines and sines (real and
imaginary parts side by side), between the Transposes/Reshapes that bring the transformed axis
and the complex pair last; STFT first gathers its overlapping frames with a constant-index
Gather. No kernel of their own is needed, and the matrix is exact where it should be (the
angles are reduced modulo L in integers, so cos/sin at multiples of pi/2 are exactly 0 and
+-1). The product runs in float64 for float32/float64 signals, which keeps near-zero bins
within the ONNX tests' 1e-7 absolute tolerance (and out of the GPU's TF32 path). The dense
product is O(L^2) per transformed row: fine for the frame sizes of audio front ends.

MelWeightMatrix only ever depends on its (scalar) inputs: they must be known at compile time,
and the node folds to a constant.

BitCast reinterprets the bytes of a tensor as another type of the same bit width: a view, like
Reshape (memory planning aliases it, no kernel runs).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from flowc.errors import ShapeError
from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs
from flowc.ir.types import TensorType
from flowc.ops.common import adapter_ctx, ref_params
from flowc.ops.registry import InferCtx, defop, first

if TYPE_CHECKING:
    from flowc.ir.builder import AdapterNode
    from flowc.ir.graph import Value

FAMILY = "signal"

_SIGNAL_TYPES = (DType.F32, DType.F64, DType.F16, DType.BF16)
# The largest DFT matrix the importer builds (bytes); past it the dense product is the wrong
# tool and the error says so rather than writing a huge weights file.
MAX_DFT_MATRIX_BYTES = 1 << 28


def _flag(ctx: InferCtx, name: str) -> bool:
    v = ctx.attrs.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) not in (0, 1):
        raise ctx.fail(f"attribute {name} must be 0 or 1, got {v!r}")
    return bool(v)


def _scalar_int(ctx: InferCtx, i: int, what: str) -> int:
    c = ctx.const(i, what)
    if c.size != 1 or c.dtype.kind not in "iu":
        raise ctx.fail(f"{what} must be an integer scalar, got {c.dtype} of shape {list(c.shape)}")
    return int(c.reshape(-1)[0])


def _signal(ctx: InferCtx, min_rank: int = 2) -> TensorType:
    x = ctx.type(0)
    if x.dtype not in _SIGNAL_TYPES:
        raise ctx.fail(f"the signal must be float32, float64, float16 or bfloat16, got {x.dtype}")
    if x.rank < min_rank or x.shape[-1] not in (1, 2):
        raise ctx.fail(
            "the signal's last axis holds [real] or [real, imaginary] (size 1 or 2), got "
            f"shape {list(x.shape)}"
        )
    return x


# -- DFT --------------------------------------------------------------------------------------


class _DftParams:
    """A DFT node's resolved parameters: the transformed axis (non-negative), the DFT length,
    and the shapes in and out."""

    def __init__(self, ctx: InferCtx) -> None:
        x = _signal(ctx)
        self.x = x
        self.inverse = _flag(ctx, "inverse")
        self.onesided = _flag(ctx, "onesided")
        r = x.rank
        axis = _scalar_int(ctx, 2, "axis") if ctx.has(2) else -2
        if not (-r <= axis <= -2 or 0 <= axis <= r - 2):
            raise ctx.fail(
                f"axis {axis} is out of range for a rank-{r} signal (the last axis holds the "
                "complex pair): valid are "
                f"[{-r}, -2] and [0, {r - 2}]"
            )
        self.axis = axis % r
        n = x.shape[self.axis]
        if ctx.has(1):
            length = _scalar_int(ctx, 1, "dft_length")
        elif self.inverse and self.onesided:
            length = 2 * (n - 1)
        else:
            length = n
        if length < 1:
            raise ctx.fail(f"the DFT length must be positive, got {length}")
        self.length = length
        self.n = n
        if self.inverse and self.onesided:
            k, parts = length, 1
        elif self.onesided:
            k, parts = length // 2 + 1, 2
        else:
            k, parts = length, 2
        out = list(x.shape)
        out[self.axis] = k
        out[-1] = parts
        self.out = TensorType(tuple(out), x.dtype)


def _dft_infer(ctx: InferCtx) -> list[TensorType]:
    return [_DftParams(ctx).out]


def _as_complex(x: np.ndarray) -> np.ndarray:
    z = x[..., 0].astype(np.complex128)
    if x.shape[-1] == 2:
        z = z + 1j * x[..., 1].astype(np.float64)
    return z


def _pack(z: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return np.stack([z.real, z.imag], axis=-1).astype(dtype)


def _dft_numpy(x: np.ndarray, axis: int, length: int, inverse: bool, onesided: bool) -> np.ndarray:
    z = _as_complex(x)
    if inverse and onesided:
        return np.fft.irfft(z, n=length, axis=axis)[..., None].astype(x.dtype)
    if inverse:
        return _pack(np.fft.ifft(z, n=length, axis=axis), x.dtype)
    y = np.fft.fft(z, n=length, axis=axis)
    if onesided:
        y = np.take(y, np.arange(length // 2 + 1), axis=axis)
    return _pack(y, x.dtype)


def _dft_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = first(xs)
    p = ref_params(_DftParams, "DFT", xs, a)
    return _dft_numpy(x, p.axis, p.length, p.inverse, p.onesided)


def _unit_circle(k: np.ndarray, n: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of 2 pi k n / length for every (k, n), with the product reduced modulo
    ``length`` in integers and the quarter turns exact."""
    m = np.outer(k, n) % length
    c = np.cos(2 * np.pi * m / length)
    s = np.sin(2 * np.pi * m / length)
    quarter = (4 * m) % length == 0
    q = (4 * m // length) % 4
    c = np.where(quarter, np.array([1.0, 0.0, -1.0, 0.0])[q], c)
    s = np.where(quarter, np.array([0.0, 1.0, 0.0, -1.0])[q], s)
    return c, s


def dft_matrix(
    n: int, parts_in: int, length: int, inverse: bool, onesided: bool, window: np.ndarray | None
) -> np.ndarray:
    """The real matrix W (float64) with y = x @ W, where x holds n input samples (one row per
    sample and [re] or [re, im] per part, flattened sample-major) and y the transform's
    output the same way. Samples past ``length`` are dropped (dft_length truncates), missing
    ones are zeros (it pads); ``window`` scales each input sample."""
    used = min(n, length)
    if inverse and onesided:
        # IRFFT: bins 0..length//2 of a Hermitian spectrum; the others are their conjugates,
        # so each inner bin counts twice, and the DC and Nyquist bins' imaginary parts drop.
        bins = np.arange(min(n, length // 2 + 1))
        out = np.arange(length)
        c, s = _unit_circle(bins, out, length)  # [bins, out]
        weight = np.full(len(bins), 2.0)
        weight[0] = 1.0
        if length % 2 == 0 and len(bins) > length // 2:
            weight[length // 2] = 1.0
        w = np.zeros((n, parts_in, length, 1))
        w[: len(bins), 0, :, 0] = weight[:, None] * c / length
        if parts_in == 2:
            w[: len(bins), 1, :, 0] = -weight[:, None] * s / length
    else:
        k = length // 2 + 1 if onesided else length
        c, s = _unit_circle(np.arange(used), np.arange(k), length)  # [samples, k]
        sign = 1.0 if inverse else -1.0
        scale = 1.0 / length if inverse else 1.0
        w = np.zeros((n, parts_in, k, 2))
        # (re + i im)(cos + i sign sin) = re cos - sign im sin + i (sign re sin + im cos)
        w[:used, 0, :, 0] = c * scale
        w[:used, 0, :, 1] = sign * s * scale
        if parts_in == 2:
            w[:used, 1, :, 0] = -sign * s * scale
            w[:used, 1, :, 1] = c * scale
    if window is not None:
        w = w * window.astype(np.float64).reshape(-1, 1, 1, 1)
    return w.reshape(n * parts_in, -1)


def _compute_type(dt: DType) -> DType:
    return DType.F64 if dt in (DType.F32, DType.F64) else DType.F32


def lower_dft(
    n: AdapterNode,
    x: Value,
    axis: int,
    length: int,
    inverse: bool,
    onesided: bool,
    window: np.ndarray | None = None,
    output_names: list[str] | None = None,
) -> Value:
    """Emit the DFT of ``x`` along ``axis`` (its last axis holding the complex parts) as a
    MatMul with a constant matrix; ``window`` (constant) scales the samples first."""
    shape = x.type.shape
    rank = len(shape)
    samples, parts_in = shape[axis], shape[-1]
    parts_out = 1 if inverse and onesided else 2
    k = length // 2 + 1 if onesided and not inverse else length
    cdt = _compute_type(x.type.dtype)
    rows, cols = samples * parts_in, k * parts_out
    if rows * cols * cdt.itemsize > MAX_DFT_MATRIX_BYTES:
        raise ShapeError(
            f"{n.op_type} node {n.name!r}: a DFT of length {length} over {samples} samples needs "
            f"a {rows} x {cols} matrix ({rows * cols * cdt.itemsize >> 20} MiB); flowc "
            "computes DFTs as dense products and supports up to "
            f"{MAX_DFT_MATRIX_BYTES >> 20} MiB"
        )
    w = dft_matrix(samples, parts_in, length, inverse, onesided, window)
    assert w.shape == (rows, cols)
    others = [d for d in range(rank - 1) if d != axis]
    perm = [*others, axis, rank - 1]
    v = x
    if perm != list(range(rank)):
        v = n.emit("Transpose", [v], {"perm": perm}, suffix="to_last")[0]
    lead = [shape[d] for d in others]
    v = n.emit(
        "Reshape", [v, n.const("rows_shape", [*lead, samples * parts_in], np.int64)], suffix="rows"
    )[0]
    if cdt != x.type.dtype:
        v = n.emit("Cast", [v], {"to": cdt.onnx}, suffix="wide")[0]
    v = n.emit("MatMul", [v, n.const("dft_matrix", w.astype(cdt.np))], suffix="dft")[0]
    if cdt != x.type.dtype:
        v = n.emit("Cast", [v], {"to": x.type.dtype.onnx}, suffix="narrow")[0]
    inv = [perm.index(d) for d in range(rank)]
    last = inv == list(range(rank))
    v = n.emit(
        "Reshape",
        [v, n.const("out_shape", [*lead, k, parts_out], np.int64)],
        suffix="out",
        output_names=output_names if last else None,
    )[0]
    if not last:
        (v,) = n.emit(
            "Transpose", [v], {"perm": inv}, suffix="from_last", output_names=output_names
        )
    return v


def _dft_import(n: AdapterNode) -> list[Value]:
    if n.opset < 20:
        # Opsets 17-19 give the axis as an attribute (default 1); 20 made it input 2.
        axis = n.attrs.pop("axis", 1)
        n.set_input(2, n.const("axis", axis, np.int64))
    p = _DftParams(adapter_ctx(n, len(n.output_names)))
    x = n.inputs[0]
    assert x is not None
    return [
        lower_dft(n, x, p.axis, p.length, p.inverse, p.onesided, output_names=n.output_names[:1])
    ]


defop(
    "DFT",
    FAMILY,
    infer=_dft_infer,
    reference=_dft_ref,
    attrs={"inverse": 0, "onesided": 0},
    inputs=(1, 3),
    onnx_import=_dft_import,
    dsl_name="dft",
)


# -- STFT -------------------------------------------------------------------------------------


class _StftParams:
    def __init__(self, ctx: InferCtx) -> None:
        x = _signal(ctx, 3)
        if x.rank != 3:
            raise ctx.fail(f"the signal must be [batch, length, 1 or 2], got shape {list(x.shape)}")
        self.onesided = _flag(ctx, "onesided")
        size = x.shape[1]
        step = _scalar_int(ctx, 1, "frame_step")
        if step < 1:
            raise ctx.fail(f"frame_step must be positive, got {step}")
        window = ctx.type(2) if ctx.has(2) else None
        if window is not None:
            if window.rank != 1:
                raise ctx.fail(f"the window must be 1-D, got shape {list(window.shape)}")
            if window.dtype != x.dtype:
                raise ctx.fail(f"the window is {window.dtype}, the signal {x.dtype}")
        if ctx.has(3):
            length = _scalar_int(ctx, 3, "frame_length")
            if window is not None and window.shape[0] != length:
                raise ctx.fail(
                    f"the window has {window.shape[0]} samples but frame_length is {length}"
                )
        else:
            length = window.shape[0] if window is not None else size
        if not 1 <= length <= size:
            raise ctx.fail(f"frame_length {length} must be in [1, {size}] (the signal length)")
        self.step, self.length = step, length
        self.frames = (size - length) // step + 1
        bins = length // 2 + 1 if self.onesided else length
        self.out = TensorType((x.shape[0], self.frames, bins, 2), x.dtype)


def _stft_infer(ctx: InferCtx) -> list[TensorType]:
    return [_StftParams(ctx).out]


def _frame_index(frames: int, step: int, length: int) -> np.ndarray:
    return np.arange(frames)[:, None] * step + np.arange(length)[None, :]


def _stft_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = first(xs)
    p = ref_params(_StftParams, "STFT", xs, a)
    frames = x[:, _frame_index(p.frames, p.step, p.length), :]  # [batch, frames, length, parts]
    window = xs[2] if len(xs) > 2 else None
    if window is not None:
        frames = frames.astype(np.float64) * window.astype(np.float64)[:, None]
    return _dft_numpy(frames, 2, p.length, False, p.onesided).astype(x.dtype)


def _stft_import(n: AdapterNode) -> list[Value]:
    p = _StftParams(adapter_ctx(n, len(n.output_names)))
    x, window = n.inputs[0], n.input(2)
    assert x is not None
    index = n.const("frame_index", _frame_index(p.frames, p.step, p.length), np.int64)
    v = n.emit("Gather", [x, index], {"axis": 1}, suffix="frames")[0]
    const_window = None
    if window is not None:
        if window.const is not None:
            const_window = window.const  # folded into the DFT matrix
        else:
            w = n.emit(
                "Reshape",
                [window, n.const("window_shape", [p.length, 1], np.int64)],
                suffix="window",
            )[0]
            v = n.emit("Mul", [v, w], suffix="windowed")[0]
    return [
        lower_dft(
            n, v, 2, p.length, False, p.onesided, const_window, output_names=n.output_names[:1]
        )
    ]


defop(
    "STFT",
    FAMILY,
    infer=_stft_infer,
    reference=_stft_ref,
    attrs={"onesided": 1},
    inputs=(2, 4),
    onnx_import=_stft_import,
    dsl_name="stft",
)


# -- MelWeightMatrix --------------------------------------------------------------------------

_MEL_OUTPUT_TYPES = (
    DType.U8,
    DType.U16,
    DType.U32,
    DType.U64,
    DType.I8,
    DType.I16,
    DType.I32,
    DType.I64,
    DType.F16,
    DType.F32,
    DType.F64,
    DType.BF16,
)


class _MelParams:
    """The mel filter bank's resolved inputs and the spectrogram bin of each band edge."""

    def __init__(self, ctx: InferCtx) -> None:
        for i, what in enumerate(("num_mel_bins", "dft_length", "sample_rate")):
            if ctx.dtype(i) not in (DType.I32, DType.I64):
                raise ctx.fail(f"{what} must be int32 or int64, got {ctx.dtype(i)}")
        for i, what in ((3, "lower_edge_hertz"), (4, "upper_edge_hertz")):
            if not ctx.dtype(i).is_float:
                raise ctx.fail(f"{what} must be floating-point, got {ctx.dtype(i)}")
        self.bands = _scalar_int(ctx, 0, "num_mel_bins")
        self.dft_length = _scalar_int(ctx, 1, "dft_length")
        rate = _scalar_int(ctx, 2, "sample_rate")
        lo, hi = (self._scalar_float(ctx, i, w) for i, w in ((3, "lower"), (4, "upper")))
        if self.bands < 1 or self.dft_length < 1 or rate < 1:
            raise ctx.fail(
                "num_mel_bins, dft_length and sample_rate must be positive, got "
                f"{self.bands}, {self.dft_length} and {rate}"
            )
        if not 0 <= lo < hi:
            raise ctx.fail(f"the band edges must satisfy 0 <= lower < upper, got {lo} and {hi}")
        self.spectrum = self.dft_length // 2 + 1
        code = ctx.attrs.get("output_datatype")
        dt = None
        if isinstance(code, (int, np.integer)) and not isinstance(code, bool):
            dt = next((d for d in _MEL_OUTPUT_TYPES if d.onnx == int(code)), None)
        if dt is None:
            raise ctx.fail(f"output_datatype {code!r} is not the code of a numeric ONNX type")
        self.dtype = dt
        # Band edges equally spaced on the mel scale (num_mel_bins + 2 of them, the step
        # dividing the range by that count), mapped back to hertz and then to the spectrogram
        # bin: floor((dft_length + 1) * f / sample_rate).
        lo_mel = 2595.0 * math.log10(1.0 + lo / 700.0)
        hi_mel = 2595.0 * math.log10(1.0 + hi / 700.0)
        edges = lo_mel + np.arange(self.bands + 2) * ((hi_mel - lo_mel) / (self.bands + 2))
        hertz = 700.0 * (np.power(10.0, edges / 2595.0) - 1.0)
        self.bins = np.floor_divide((self.dft_length + 1) * hertz, float(rate)).astype(np.int64)
        if self.bins[-2] >= self.spectrum or self.bins[-1] > self.spectrum:
            raise ctx.fail(
                f"upper_edge_hertz {hi} lies above the spectrum of a {self.dft_length}-point "
                f"DFT at {rate} Hz (Nyquist: {rate / 2} Hz)"
            )

    @staticmethod
    def _scalar_float(ctx: InferCtx, i: int, which: str) -> float:
        c = ctx.const(i, f"{which}_edge_hertz")
        if c.size != 1:
            raise ctx.fail(f"{which}_edge_hertz must be a scalar, got shape {list(c.shape)}")
        return float(c.reshape(-1)[0])

    def matrix(self) -> np.ndarray:
        """[spectrum bins, bands]: band i rises linearly from its left edge to 1 at its
        centre and falls to 0 at its right edge (a band whose left edge and centre share a
        bin is 1 there)."""
        out = np.zeros((self.spectrum, self.bands))
        j = np.arange(self.spectrum)
        for i in range(self.bands):
            left, centre, right = (int(b) for b in self.bins[i : i + 3])
            if centre == left:
                out[centre, i] = 1.0
            else:
                rising = (j >= left) & (j <= centre)
                out[rising, i] = (j[rising] - left) / (centre - left)
            if right > centre:
                falling = (j >= centre) & (j < right)
                out[falling, i] = (right - j[falling]) / (right - centre)
        return out


def _mel_infer(ctx: InferCtx) -> list[TensorType]:
    p = _MelParams(ctx)
    return [TensorType((p.spectrum, p.bands), p.dtype)]


def _mel_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    p = ref_params(_MelParams, "MelWeightMatrix", xs, a)
    return p.matrix().astype(p.dtype.np)


defop(
    "MelWeightMatrix",
    FAMILY,
    infer=_mel_infer,
    reference=_mel_ref,
    attrs={"output_datatype": DType.F32.onnx},
    inputs=5,
    dsl_name="mel_weight_matrix",
)


# -- BitCast ----------------------------------------------------------------------------------


def bit_width(dt: DType) -> int:
    """Bits of one element as ONNX counts them (sub-byte types are held one per byte)."""
    if dt in (DType.I4, DType.U4, DType.F4E2M1):
        return 4
    if dt in (DType.I2, DType.U2):
        return 2
    if dt in (DType.F6E2M3, DType.F6E3M2):
        return 6
    return dt.itemsize * 8


def _bitcast_target(ctx: InferCtx) -> DType:
    to = ctx.attrs.get("to")
    try:
        if isinstance(to, bool) or not isinstance(to, (int, np.integer)):
            raise ValueError(f"'to' must be an ONNX element type code, got {to!r}")
        dt = DType.from_onnx(int(to))
    except ValueError as e:
        raise ctx.fail(str(e)) from None
    src = ctx.dtype(0)
    if bit_width(dt) != bit_width(src):
        raise ctx.fail(
            f"BitCast keeps the bits, so both types need the same width: {src} has "
            f"{bit_width(src)} bits, {dt} has {bit_width(dt)}"
        )
    return dt


def _bitcast_infer(ctx: InferCtx) -> list[TensorType]:
    return [ctx.type(0).with_dtype(_bitcast_target(ctx))]


def _bitcast_ref(xs: list[np.ndarray | None], a: Attrs) -> np.ndarray:
    x = first(xs)
    return x.view(DType.from_onnx(int(a["to"])).np)


defop(
    "BitCast",
    "shape",
    infer=_bitcast_infer,
    reference=_bitcast_ref,
    attrs={"to": None},
    view=True,
    dsl_name="bit_cast",
)
