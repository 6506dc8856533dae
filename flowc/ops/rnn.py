"""Recurrent layers: RNN, GRU and LSTM.

flowc compiles static shapes, so the sequence length is known when a model is imported. The
ONNX import adapter therefore unrolls the recurrence into ops every backend already has: one
Gemm per direction projects the whole input sequence at once, then each time step is a Gemm
of the hidden state against R plus element-wise gate math. No recurrent kernel exists; the
unrolled graph is fused, planned and parallelized like any other.

``sequence_lens`` is handled with masks, so it may be computed at run time: a batch entry
whose sequence has ended keeps its state (Where) and writes zeros to Y. Running a reverse
direction from the last time step down to 0 under those masks is exactly ONNX's "reverse
each sequence within its own length". The specification leaves the final states of an
empty sequence open; flowc gives zeros, as onnxruntime does.

The NumPy reference (a plain loop over time) is what evaluates an RNN/GRU/LSTM node that was
not imported from ONNX, such as a DSL call, and what the tests compare the unrolling with.
Gate layouts follow the specification: GRU z, r, h; LSTM i, o, f, c; peepholes i, o, f.
``clip`` bounds the input of every gate activation (f and g), not the cell's h(C).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from flowc.ir.dtype import DType
from flowc.ir.graph import Attrs
from flowc.ir.types import TensorType
from flowc.ops.common import adapter_ctx, ref_params
from flowc.ops.conv import compute_dtype
from flowc.ops.registry import InferCtx, defop

if TYPE_CHECKING:
    from flowc.ir.builder import AdapterNode
    from flowc.ir.graph import Value

FAMILY = "rnn"


# -- activation functions -----------------------------------------------------------------------


@dataclass(frozen=True)
class _ActDef:
    """An activation an RNN attribute may name: its default alpha/beta (None: takes none)."""

    alpha: float | None
    beta: float | None
    ref: Callable[[np.ndarray, float, float], np.ndarray]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # Split by sign so neither branch overflows exp.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


# Keys are lower case: onnxruntime matches activation names without regard to case. Defaults
# are those of the ONNX ops of the same name, as the specification says (Affine: of the
# retired Affine op). onnxruntime instead takes 0 for any alpha/beta not listed except those
# of LeakyRelu, HardSigmoid and Elu, so it differs for ThresholdedRelu and Affine. The
# retired ScaledTanh op had no defaults: flowc asks for both values (nan: required).
_ACTS: dict[str, _ActDef] = {
    "relu": _ActDef(None, None, lambda x, a, b: np.maximum(x, 0)),
    "tanh": _ActDef(None, None, lambda x, a, b: np.tanh(x)),
    "sigmoid": _ActDef(None, None, lambda x, a, b: _sigmoid(x)),
    "affine": _ActDef(1.0, 0.0, lambda x, a, b: a * x + b),
    "leakyrelu": _ActDef(0.01, None, lambda x, a, b: np.where(x >= 0, x, a * x)),
    "thresholdedrelu": _ActDef(1.0, None, lambda x, a, b: np.where(x > a, x, 0)),
    "scaledtanh": _ActDef(math.nan, math.nan, lambda x, a, b: a * np.tanh(b * x)),
    "hardsigmoid": _ActDef(0.2, 0.5, lambda x, a, b: np.clip(a * x + b, 0, 1)),
    "elu": _ActDef(1.0, None, lambda x, a, b: np.where(x >= 0, x, a * np.expm1(x))),
    "softsign": _ActDef(None, None, lambda x, a, b: x / (1 + np.abs(x))),
    "softplus": _ActDef(None, None, lambda x, a, b: _softplus(x)),
}


@dataclass(frozen=True)
class _Act:
    """One activation with its parameters resolved."""

    name: str  # a key of _ACTS
    alpha: float
    beta: float

    def ref(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(_ACTS[self.name].ref(x, self.alpha, self.beta), dtype=x.dtype)


# -- the op kinds and their configuration -------------------------------------------------------


@dataclass(frozen=True)
class _Kind:
    gates: int  # gate blocks stacked in W, R and each half of B
    default_acts: tuple[str, ...]  # per direction
    max_inputs: int
    max_outputs: int


_KINDS = {
    "RNN": _Kind(1, ("tanh",), 6, 2),
    "GRU": _Kind(3, ("sigmoid", "tanh"), 6, 2),
    "LSTM": _Kind(4, ("sigmoid", "tanh", "tanh"), 8, 3),
}

# Input positions (the same in all three ops; initial_c and P only in LSTM).
X_, W_, R_, B_, LENS, H0, C0, P_ = range(8)
_INPUT_NAMES = ("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P")


@dataclass(frozen=True)
class _Config:
    kind: str
    reverse: tuple[bool, ...]  # per direction: runs from the last time step to the first
    seq: int
    batch: int
    input_size: int
    hidden: int
    layout: int
    clip: float | None
    acts: tuple[tuple[_Act, ...], ...]  # per direction
    linear_before_reset: bool
    input_forget: bool

    @property
    def dirs(self) -> int:
        return len(self.reverse)

    @property
    def gates(self) -> int:
        return _KINDS[self.kind].gates

    def state_shape(self) -> tuple[int, int, int]:
        """Shape of initial_h/initial_c and Y_h/Y_c."""
        if self.layout == 0:
            return (self.dirs, self.batch, self.hidden)
        return (self.batch, self.dirs, self.hidden)

    def y_shape(self) -> tuple[int, int, int, int]:
        if self.layout == 0:
            return (self.seq, self.dirs, self.batch, self.hidden)
        return (self.batch, self.seq, self.dirs, self.hidden)


def _activations(ctx: InferCtx, kind: _Kind, dirs: int) -> tuple[tuple[_Act, ...], ...]:
    per = len(kind.default_acts)
    given = ctx.attrs.get("activations")
    names = [str(s) for s in given] if given else list(kind.default_acts) * dirs
    if ctx.op == "RNN" and dirs == 1 and len(names) == 2:
        # RNN's schema once defaulted activations to [Tanh, Tanh] whatever the direction;
        # onnxruntime reads the first for a one-directional layer, and so does flowc.
        names = names[:1]
    if len(names) != per * dirs:
        raise ctx.fail(
            f"activations lists {len(names)} function(s); a {'bi' if dirs == 2 else 'uni'}"
            f"directional {ctx.op} takes {per * dirs} ({per} per direction)"
        )
    # alpha and beta values are consumed in order by the functions that take them.
    alphas = [float(v) for v in ctx.attrs.get("activation_alpha") or ()]
    betas = [float(v) for v in ctx.attrs.get("activation_beta") or ()]
    acts = []
    for name in names:
        d = _ACTS.get(name.lower())
        if d is None:
            raise ctx.fail(
                f"unknown activation {name!r}; expected one of "
                "Relu, Tanh, Sigmoid, Affine, LeakyRelu, ThresholdedRelu, ScaledTanh, "
                "HardSigmoid, Elu, Softsign, Softplus"
            )
        alpha = beta = 0.0
        if d.alpha is not None:
            alpha = alphas.pop(0) if alphas else d.alpha
        if d.beta is not None:
            beta = betas.pop(0) if betas else d.beta
        if math.isnan(alpha) or math.isnan(beta):
            raise ctx.fail(
                f"activation {name} has no default parameters: give its alpha and beta in "
                "activation_alpha and activation_beta (consumed in order by the functions "
                "that take them)"
            )
        acts.append(_Act(name.lower(), alpha, beta))
    return tuple(tuple(acts[k * per : (k + 1) * per]) for k in range(dirs))


def _config(ctx: InferCtx) -> _Config:
    """Check a node's inputs and attributes; the resolved configuration."""
    kind = _KINDS[ctx.op]
    x = ctx.type(X_)
    if not x.dtype.is_float:
        raise ctx.fail(f"X must be floating-point, got {x.dtype}")
    for i in (W_, R_, B_, H0, C0, P_):
        if ctx.has(i) and ctx.dtype(i) != x.dtype:
            raise ctx.fail(
                f"{_INPUT_NAMES[i]} has element type {ctx.dtype(i)}, expected {x.dtype} (as X)"
            )
    if ctx.num_inputs > kind.max_inputs:
        raise ctx.fail(f"takes at most {kind.max_inputs} inputs, got {ctx.num_inputs}")
    if ctx.num_outputs > kind.max_outputs:
        raise ctx.fail(f"has at most {kind.max_outputs} outputs, got {ctx.num_outputs}")
    for i in (X_, W_, R_):
        if len(ctx.shape(i)) != 3:
            raise ctx.fail(f"{_INPUT_NAMES[i]} must be 3-D, got shape {list(ctx.shape(i))}")

    direction = str(ctx.attrs.get("direction", "forward"))
    if direction not in ("forward", "reverse", "bidirectional"):
        raise ctx.fail(f"direction must be forward, reverse or bidirectional, got {direction!r}")
    dirs = 2 if direction == "bidirectional" else 1
    layout = int(ctx.attrs.get("layout", 0))
    if layout not in (0, 1):
        raise ctx.fail(f"layout must be 0 or 1, got {layout}")
    seq, batch, input_size = x.shape if layout == 0 else (x.shape[1], x.shape[0], x.shape[2])

    hidden = ctx.shape(R_)[2]
    if "hidden_size" in ctx.attrs and int(ctx.attr("hidden_size")) != hidden:
        raise ctx.fail(
            f"hidden_size is {ctx.attr('hidden_size')} but R of shape {list(ctx.shape(R_))} "
            f"gives {hidden}"
        )
    g = kind.gates
    expect = {
        W_: (dirs, g * hidden, input_size),
        R_: (dirs, g * hidden, hidden),
        B_: (dirs, 2 * g * hidden),
        P_: (dirs, 3 * hidden),
    }
    state = (dirs, batch, hidden) if layout == 0 else (batch, dirs, hidden)
    expect[H0] = expect[C0] = state
    for i, shape in expect.items():
        if ctx.has(i) and ctx.shape(i) != shape:
            raise ctx.fail(
                f"{_INPUT_NAMES[i]} must have shape {list(shape)} (direction={direction}, "
                f"hidden_size={hidden}, layout={layout}), got {list(ctx.shape(i))}"
            )
    if ctx.has(LENS):
        lens = ctx.type(LENS)
        if lens.shape != (batch,) or lens.dtype.is_float or lens.dtype == DType.BOOL:
            raise ctx.fail(
                f"sequence_lens must be an integer vector of shape [{batch}], got "
                f"{lens.dtype} {list(lens.shape)}"
            )
        c = ctx.maybe_const(LENS)
        if c is not None and np.any((c < 0) | (c > seq)):
            raise ctx.fail(f"sequence_lens {c.tolist()} must lie in [0, {seq}]")

    clip = ctx.attrs.get("clip")
    if clip is not None and not float(clip) > 0:
        raise ctx.fail(f"clip must be positive, got {clip}")
    lbr = int(ctx.attrs.get("linear_before_reset", 0))
    forget = int(ctx.attrs.get("input_forget", 0))
    for name, v in (("linear_before_reset", lbr), ("input_forget", forget)):
        if v not in (0, 1):
            raise ctx.fail(f"{name} must be 0 or 1, got {v}")
    return _Config(
        kind=ctx.op,
        reverse=(direction == "reverse",) if dirs == 1 else (False, True),
        seq=seq,
        batch=batch,
        input_size=input_size,
        hidden=hidden,
        layout=layout,
        clip=None if clip is None else float(clip),
        acts=_activations(ctx, kind, dirs),
        linear_before_reset=bool(lbr),
        input_forget=bool(forget),
    )


def _infer(ctx: InferCtx) -> list[TensorType]:
    cfg = _config(ctx)
    dt = ctx.dtype(X_)
    outs = [TensorType(cfg.y_shape(), dt)] + [TensorType(cfg.state_shape(), dt)] * 2
    return outs[: ctx.num_outputs]


def _flops(ins: list[TensorType | None], outs: list[TensorType], a: Attrs) -> int:
    x, w, r = ins[X_], ins[W_], ins[R_]
    if x is None or w is None or r is None:
        return 0
    dirs, gh, input_size = w.shape
    steps = x.shape[0] * x.shape[1]  # seq x batch, in either layout
    # The two products per step and direction, plus a handful of element-wise ops per gate.
    return dirs * steps * gh * (2 * input_size + 2 * r.shape[2] + 8)


# -- the NumPy reference ------------------------------------------------------------------------


def _reference(op: str) -> Callable[[list[np.ndarray | None], Attrs], list[np.ndarray]]:
    def ref(xs: list[np.ndarray | None], a: Attrs) -> list[np.ndarray]:
        cfg = ref_params(_config, op, xs, a)
        x = xs[X_]
        assert x is not None
        ct = compute_dtype(x.dtype)

        def get(i: int) -> np.ndarray | None:
            v = xs[i] if i < len(xs) else None
            return None if v is None else v.astype(ct)

        xt = get(X_)
        w, r = get(W_), get(R_)
        assert xt is not None and w is not None and r is not None
        h0, c0 = get(H0), get(C0)
        if cfg.layout == 1:
            # Work in layout 0: X [seq, batch, input], states [dirs, batch, hidden].
            xt = xt.transpose(1, 0, 2)
            h0 = None if h0 is None else h0.transpose(1, 0, 2)
            c0 = None if c0 is None else c0.transpose(1, 0, 2)
        g, hs = cfg.gates, cfg.hidden
        b = get(B_)
        if b is None:
            b = np.zeros((cfg.dirs, 2 * g * hs), ct)
        p = get(P_)
        if p is None:
            p = np.zeros((cfg.dirs, 3 * hs), ct)
        lens_in = xs[LENS] if len(xs) > LENS else None
        lens = np.full(cfg.batch, cfg.seq) if lens_in is None else lens_in.astype(np.int64)
        zeros = np.zeros((cfg.dirs, cfg.batch, hs), ct)
        h0 = zeros if h0 is None else h0
        c0 = zeros if c0 is None else c0

        y = np.zeros((cfg.seq, cfg.dirs, cfg.batch, hs), ct)
        yh, yc = zeros.copy(), zeros.copy()
        for d in range(cfg.dirs):
            step = _STEPS[op]
            cell = _Cell(cfg, cfg.acts[d], w[d], r[d], b[d], p[d])
            h, c = h0[d], c0[d]
            times = range(cfg.seq - 1, -1, -1) if cfg.reverse[d] else range(cfg.seq)
            for t in times:
                nh, nc = step(cell, xt[t], h, c)
                live = (t < lens)[:, None]
                y[t, d] = np.where(live, nh, 0)
                h, c = np.where(live, nh, h), np.where(live, nc, c)
            # onnxruntime's convention: an empty sequence ends in zero states, not the initial.
            some = (lens > 0)[:, None]
            yh[d], yc[d] = np.where(some, h, 0), np.where(some, c, 0)
        if cfg.layout == 1:
            y = y.transpose(2, 0, 1, 3)
            yh, yc = yh.transpose(1, 0, 2), yc.transpose(1, 0, 2)
        return [o.astype(x.dtype) for o in (y, yh, yc)][: _KINDS[op].max_outputs]

    return ref


@dataclass(frozen=True)
class _Cell:
    """One direction of a layer, as a reference step sees it: weights and activations."""

    cfg: _Config
    acts: tuple[_Act, ...]
    w: np.ndarray  # [G*H, input]
    r: np.ndarray  # [G*H, H]
    b: np.ndarray  # [2*G*H]: Wb, then Rb
    p: np.ndarray  # [3*H]: LSTM's peepholes i, o, f (zeros when P is omitted)

    def gate(self, fn: _Act, v: np.ndarray) -> np.ndarray:
        """``fn`` of a gate's input, after the clip every gate input gets."""
        clip = self.cfg.clip
        return fn.ref(v if clip is None else np.clip(v, -clip, clip))


# One time step: (cell, x_t, h, c) -> (new h, new c).
StepFn = Callable[[_Cell, np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def _rnn_step(
    cell: _Cell, x: np.ndarray, h: np.ndarray, c: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    hs = cell.cfg.hidden
    b = cell.b
    pre = x @ cell.w.T + h @ cell.r.T + b[:hs] + b[hs:]
    return cell.gate(cell.acts[0], pre), c


def _gru_step(
    cell: _Cell, x: np.ndarray, h: np.ndarray, c: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    hs = cell.cfg.hidden
    f, g = cell.acts
    r = cell.r
    wb, rb = cell.b[: 3 * hs], cell.b[3 * hs :]
    xw = x @ cell.w.T + wb
    hr = h @ r.T + rb
    z = cell.gate(f, xw[:, :hs] + hr[:, :hs])
    rr = cell.gate(f, xw[:, hs : 2 * hs] + hr[:, hs : 2 * hs])
    if cell.cfg.linear_before_reset:
        pre = xw[:, 2 * hs :] + rr * hr[:, 2 * hs :]
    else:
        pre = xw[:, 2 * hs :] + (rr * h) @ r[2 * hs :].T + rb[2 * hs :]
    cand = cell.gate(g, pre)
    return (1 - z) * cand + z * h, c


def _lstm_step(
    cell: _Cell, x: np.ndarray, h: np.ndarray, c: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    hs = cell.cfg.hidden
    f, g, hact = cell.acts
    b, p = cell.b, cell.p
    gates = x @ cell.w.T + h @ cell.r.T + b[: 4 * hs] + b[4 * hs :]
    gi, go, gf, gc = (gates[:, k * hs : (k + 1) * hs] for k in range(4))
    pi, po, pf = p[:hs], p[hs : 2 * hs], p[2 * hs :]
    i = cell.gate(f, gi + pi * c)
    fg = 1 - i if cell.cfg.input_forget else cell.gate(f, gf + pf * c)
    new_c = fg * c + i * cell.gate(g, gc)
    o = cell.gate(f, go + po * new_c)
    return o * hact.ref(new_c), new_c


_STEPS: dict[str, StepFn] = {"RNN": _rnn_step, "GRU": _gru_step, "LSTM": _lstm_step}


# -- the ONNX import: unrolling -----------------------------------------------------------------


class _Unroll:
    """Emits one node's recurrence, step by step, into the importing graph."""

    def __init__(self, n: AdapterNode, cfg: _Config, dtype: np.dtype) -> None:
        self.n = n
        self.cfg = cfg
        self.dtype = dtype
        self.tag = ""  # the direction/time step the nodes being emitted belong to

    # small emitters ----------------------------------------------------------------------

    def op(self, op: str, inputs: Sequence[Value | None], what: str, **attrs: Any) -> Value:
        return self.n.emit(op, inputs, attrs, suffix=f"{self.tag}{what}")[0]

    def ints(self, what: str, values: Sequence[int] | int) -> Value:
        return self.n.const(f"{self.tag}{what}", values, np.int64)

    def scalar(self, what: str, value: float) -> Value:
        return self.n.const(f"{self.tag}{what}", np.array(value, self.dtype))

    def add(self, a: Value, b: Value, what: str) -> Value:
        return self.op("Add", [a, b], what)

    def mul(self, a: Value, b: Value, what: str) -> Value:
        return self.op("Mul", [a, b], what)

    def take(self, v: Value, index: int, axis: int, what: str) -> Value:
        """``v[index]`` along ``axis`` (the axis dropped)."""
        return self.op("Gather", [v, self.ints(f"{what}_index", index)], what, axis=axis)

    def split(self, v: Value, sizes: Sequence[int], what: str, axis: int = -1) -> list[Value]:
        """Cut an axis (the last by default) into pieces of ``sizes``."""
        return self.n.emit(
            "Split",
            [v, self.ints(f"{what}_sizes", list(sizes))],
            {"axis": axis % v.type.rank},
            suffix=f"{self.tag}{what}",
            num_outputs=len(sizes),
        )

    def reshape(self, v: Value, shape: Sequence[int], what: str) -> Value:
        return self.op("Reshape", [v, self.ints(f"{what}_shape", list(shape))], what)

    def unsqueeze(self, v: Value, axes: Sequence[int], what: str) -> Value:
        return self.op("Unsqueeze", [v, self.ints(f"{what}_axes", list(axes))], what)

    def concat(self, vs: Sequence[Value], axis: int, what: str) -> Value:
        return vs[0] if len(vs) == 1 else self.op("Concat", list(vs), what, axis=axis)

    def gemm(self, a: Value, b: Value, c: Value | None, what: str) -> Value:
        """a @ b^T (+ c)."""
        return self.op("Gemm", [a, b, c], what, transB=1)

    def act(self, fn: _Act, v: Value, what: str) -> Value:
        """The activation ``fn`` of v, after the clip every gate input gets."""
        if self.cfg.clip is not None:
            lim = self.cfg.clip
            lo, hi = self.scalar(f"{what}_clip_lo", -lim), self.scalar(f"{what}_clip_hi", lim)
            v = self.op("Clip", [v, lo, hi], f"{what}_clip")
        return self.activation(fn, v, what)

    def activation(self, fn: _Act, v: Value, what: str) -> Value:
        simple = {
            "relu": "Relu",
            "tanh": "Tanh",
            "sigmoid": "Sigmoid",
            "softsign": "Softsign",
            "softplus": "Softplus",
        }
        if fn.name in simple:
            return self.op(simple[fn.name], [v], what)
        if fn.name in ("leakyrelu", "thresholdedrelu", "elu"):
            op = {"leakyrelu": "LeakyRelu", "thresholdedrelu": "ThresholdedRelu", "elu": "Elu"}
            return self.op(op[fn.name], [v], what, alpha=fn.alpha)
        if fn.name == "hardsigmoid":
            return self.op("HardSigmoid", [v], what, alpha=fn.alpha, beta=fn.beta)
        if fn.name == "affine":
            scaled = self.mul(v, self.scalar(f"{what}_alpha", fn.alpha), f"{what}_scaled")
            return self.add(scaled, self.scalar(f"{what}_beta", fn.beta), what)
        assert fn.name == "scaledtanh"
        inner = self.mul(v, self.scalar(f"{what}_beta", fn.beta), f"{what}_inner")
        t = self.op("Tanh", [inner], f"{what}_tanh")
        return self.mul(t, self.scalar(f"{what}_alpha", fn.alpha), what)

    # the recurrence ----------------------------------------------------------------------

    def run(self) -> list[Value]:
        cfg, n = self.cfg, self.n
        names = n.output_names
        want_y = bool(names) and bool(names[0])
        time_axis = 0 if cfg.layout == 0 else 1  # of X, and of the projected X
        state_axis = 0 if cfg.layout == 0 else 1  # the direction axis of the states
        ys: list[Value] = []
        hs_final: list[Value] = []
        cs_final: list[Value] = []
        lens = self.lengths()
        for d in range(cfg.dirs):
            self.tag = f"d{d}_"
            ws = self.weights(d)
            h = self.initial(H0, d, state_axis, "h0")
            c = self.initial(C0, d, state_axis, "c0") if cfg.kind == "LSTM" else h
            outs: list[Value | None] = [None] * cfg.seq
            times = range(cfg.seq - 1, -1, -1) if cfg.reverse[d] else range(cfg.seq)
            for t in times:
                self.tag = f"d{d}_t{t}_"
                xw = self.take(ws.xw, t, time_axis, "xw")
                nh, nc = self.step(d, ws, xw, h, c)
                live = self.live(lens, t)
                y_t = nh
                if live is None:
                    h, c = nh, nc
                else:
                    if want_y:
                        zero = self.scalar("zero", 0.0)
                        y_t = self.op("Where", [live, nh, zero], "y")
                    h = self.op("Where", [live, nh, h], "h")
                    if cfg.kind == "LSTM":
                        c = self.op("Where", [live, nc, c], "c")
                if want_y:
                    # [batch, hidden] -> Y's layout with seq and dirs of size 1.
                    axes = [0, 1] if cfg.layout == 0 else [1, 2]
                    outs[t] = self.unsqueeze(y_t, axes, "y_item")
            self.tag = f"d{d}_"
            nonempty = self.live(lens, 0, "nonempty")  # step 0 is in every non-empty sequence
            if nonempty is not None:
                zero = self.scalar("zero", 0.0)
                h = self.op("Where", [nonempty, h, zero], "h_last")
                c = self.op("Where", [nonempty, c, zero], "c_last")
            if want_y and cfg.seq:
                ys.append(self.concat([v for v in outs if v is not None], time_axis, "y"))
            hs_final.append(self.unsqueeze(h, [state_axis], "h_final"))
            cs_final.append(self.unsqueeze(c, [state_axis], "c_final"))
        self.tag = ""
        if not want_y:
            y = hs_final[0]  # a stand-in: the node's Y output is omitted
        elif cfg.seq == 0:
            y = n.const("Y", np.zeros(cfg.y_shape(), self.dtype))
        else:
            y = self.concat(ys, 1 if cfg.layout == 0 else 2, "Y")
        yh = self.concat(hs_final, state_axis, "Y_h")
        yc = self.concat(cs_final, state_axis, "Y_c")
        return [y, yh, yc][: max(len(names), 1)]

    @dataclass
    class _Weights:
        xw: Value  # X @ W^T + biases for every time step: [seq, batch, G*H] (layout 1: b, s)
        r: Value  # [G*H, H]
        r_h: Value | None  # GRU: the rows of R for the candidate gate
        r_zr: Value | None  # GRU: the rows for the update and reset gates
        rb_h: Value | None  # GRU with linear_before_reset: Rbh, applied inside the reset
        p: list[Value]  # LSTM peepholes i, o, f (empty when P is omitted)

    def weights(self, d: int) -> _Unroll._Weights:
        cfg, n = self.cfg, self.n
        hs, gh = cfg.hidden, cfg.gates * cfg.hidden
        w_in, r_in, b_in = n.input(W_), n.input(R_), n.input(B_)
        assert w_in is not None and r_in is not None
        w = self.take(w_in, d, 0, "W")
        r = self.take(r_in, d, 0, "R")
        bias: Value | None = None
        rb_h = None
        if b_in is not None:
            wb, rb = self.split(self.take(b_in, d, 0, "B"), [gh, gh], "B_parts")
            if cfg.kind == "GRU" and cfg.linear_before_reset:
                # Rbh is added to H @ Rh^T before the reset gate scales it.
                wzr, wh = self.split(wb, [2 * hs, hs], "Wb_parts")
                rzr, rb_h = self.split(rb, [2 * hs, hs], "Rb_parts")
                bias = self.concat([self.add(wzr, rzr, "bias_zr"), wh], 0, "bias")
            else:
                bias = self.add(wb, rb, "bias")
        x = n.input(X_)
        assert x is not None
        a, b = x.type.shape[0], x.type.shape[1]
        if a * b:
            flat = self.reshape(x, [a * b, cfg.input_size], "X_rows")
            xw = self.reshape(self.gemm(flat, w, bias, "XW_rows"), [a, b, gh], "XW")
        else:
            xw = n.const(f"{self.tag}XW", np.zeros((a, b, gh), self.dtype))
        r_h = r_zr = None
        if cfg.kind == "GRU":
            r_zr, r_h = self.split(r, [2 * hs, hs], "R_parts", axis=0)
        p: list[Value] = []
        p_in = n.input(P_) if cfg.kind == "LSTM" else None
        if p_in is not None:
            p = self.split(self.take(p_in, d, 0, "P"), [hs, hs, hs], "P_parts")
        return self._Weights(xw, r, r_h, r_zr, rb_h, p)

    def initial(self, i: int, d: int, axis: int, what: str) -> Value:
        v = self.n.input(i)
        if v is None:
            return self.n.const(
                f"{self.tag}{what}", np.zeros((self.cfg.batch, self.cfg.hidden), self.dtype)
            )
        return self.take(v, d, axis, what)

    def lengths(self) -> Value | np.ndarray | None:
        """sequence_lens: None when every sequence is full, an array when known, else the
        value as a [batch, 1] column."""
        v = self.n.input(LENS)
        if v is None:
            return None
        if v.const is not None:
            lens = np.asarray(v.const).astype(np.int64)
            return None if bool(np.all(lens >= self.cfg.seq)) else lens
        return self.unsqueeze(v, [1], "lens_column")

    def live(self, lens: Value | np.ndarray | None, t: int, what: str = "live") -> Value | None:
        """A [batch, 1] mask of the batch entries whose sequence includes step t; None when
        that is all of them."""
        if lens is None:
            return None
        if isinstance(lens, np.ndarray):
            mask = (t < lens)[:, None]
            return None if bool(mask.all()) else self.n.const(f"{self.tag}{what}", mask)
        step = self.n.const(f"{self.tag}{what}_step", np.array(t, lens.type.dtype.np))
        return self.op("Less", [step, lens], what)

    def recurrent(self, h: Value, r: Value, c: Value, what: str) -> Value:
        """h @ r^T + c; just c while h is known to be zero (no initial state, first step)."""
        return c if _is_zero(h) else self.gemm(h, r, c, what)

    def step(
        self, d: int, ws: _Unroll._Weights, xw: Value, h: Value, c: Value
    ) -> tuple[Value, Value]:
        cfg = self.cfg
        acts = cfg.acts[d]
        hs = cfg.hidden
        if cfg.kind == "RNN":
            pre = self.recurrent(h, ws.r, xw, "pre")
            return self.act(acts[0], pre, "h"), c
        if cfg.kind == "GRU":
            assert ws.r_zr is not None and ws.r_h is not None
            f, g = acts
            xzr, xh = self.split(xw, [2 * hs, hs], "xw_parts")
            zr = self.recurrent(h, ws.r_zr, xzr, "zr_pre")
            z_pre, r_pre = self.split(zr, [hs, hs], "zr_parts")
            z = self.act(f, z_pre, "z")
            r = self.act(f, r_pre, "r")
            if _is_zero(h):
                # The reset gate scales a zero state (plus Rbh under linear_before_reset).
                rb = ws.rb_h if cfg.linear_before_reset else None
                pre = xh if rb is None else self.add(xh, self.mul(r, rb, "reset"), "h_pre")
            elif cfg.linear_before_reset:
                hr = self.gemm(h, ws.r_h, ws.rb_h, "hr")
                pre = self.add(xh, self.mul(r, hr, "reset"), "h_pre")
            else:
                pre = self.gemm(self.mul(r, h, "reset"), ws.r_h, xh, "h_pre")
            cand = self.act(g, pre, "cand")
            # H = (1 - z) * cand + z * H = cand + z * (H - cand)
            return self.add(cand, self.mul(z, self.op("Sub", [h, cand], "diff"), "keep"), "h"), c
        f, g, hact = acts
        gates = self.recurrent(h, ws.r, xw, "gates")
        gi, go, gf, gc = self.split(gates, [hs] * 4, "gate_parts")
        pi, po, pf = ws.p if ws.p else (None, None, None)
        if pi is not None and not _is_zero(c):
            gi = self.add(gi, self.mul(pi, c, "peep_i"), "i_pre")
        i = self.act(f, gi, "i")
        if cfg.input_forget:
            fg = self.op("Sub", [self.scalar("one", 1.0), i], "f")
        else:
            if pf is not None and not _is_zero(c):
                gf = self.add(gf, self.mul(pf, c, "peep_f"), "f_pre")
            fg = self.act(f, gf, "f")
        new_c = self.mul(i, self.act(g, gc, "cell_in"), "c_in")
        if not _is_zero(c):
            new_c = self.add(self.mul(fg, c, "c_keep"), new_c, "c")
        if po is not None:
            go = self.add(go, self.mul(po, new_c, "peep_o"), "o_pre")
        o = self.act(f, go, "o")
        return self.mul(o, self.activation(hact, new_c, "c_act"), "h"), new_c


def _is_zero(v: Value) -> bool:
    return v.const is not None and not np.any(v.const)


def _import(n: AdapterNode) -> list[Value]:
    # Opset 1 named whether Y is produced; the output list says that in every opset.
    n.attrs.pop("output_sequence", None)
    cfg = _config(adapter_ctx(n, max(len(n.output_names), 1)))
    x = n.input(X_)
    assert x is not None
    return _Unroll(n, cfg, x.type.dtype.np).run()


_COMMON_ATTRS: Mapping[str, Any] = {
    "activation_alpha": None,
    "activation_beta": None,
    "activations": None,
    "clip": None,
    "direction": "forward",
    "hidden_size": None,
    "layout": 0,
}

for _op, _extra in (
    ("RNN", {}),
    ("GRU", {"linear_before_reset": 0}),
    ("LSTM", {"input_forget": 0}),
):
    defop(
        _op,
        FAMILY,
        infer=_infer,
        reference=_reference(_op),
        attrs={**_COMMON_ATTRS, **_extra},
        inputs=(3, _KINDS[_op].max_inputs),
        outputs=(1, _KINDS[_op].max_outputs),
        flops=_flops,
        onnx_import=_import,
    )
