"""The one definition of numerical error used everywhere in flowc (verify, tests, benches).

error = max|got - ref| / max|ref|, with an absolute floor for an all-zero reference. An
element-wise relative error is not used: it explodes at zeros (ReLU outputs) and on large
logits. Non-finite values must match in place (NaN where the reference has NaN, the same
infinities); integers and bools must match exactly (the error is then 0 or 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ABS_FLOOR = 1e-6


@dataclass(frozen=True)
class Comparison:
    name: str
    shape: tuple[int, ...]
    error: float
    ok: bool
    reason: str = ""


def max_rel_error(got: np.ndarray, ref: np.ndarray, floor: float = ABS_FLOOR) -> float:
    """max|got - ref| / max(max|ref|, floor) over the finite reference entries."""
    g = np.asarray(got)
    r = np.asarray(ref)
    if g.shape != r.shape:
        return float("inf")
    if r.size == 0:
        return 0.0
    if r.dtype.kind in "biu" or r.dtype == np.bool_:
        return 0.0 if np.array_equal(g, r) else 1.0
    g64 = g.astype(np.complex128 if r.dtype.kind == "c" else np.float64)
    r64 = r.astype(g64.dtype)
    finite = np.isfinite(r64)
    # Non-finite reference values must be reproduced exactly (NaN for NaN, same infinities).
    if not finite.all():
        rn, gn = r64[~finite], g64[~finite]
        same = (np.isnan(rn) & np.isnan(gn)) | (rn == gn)
        if not same.all():
            return float("inf")
    if not finite.any():
        return 0.0
    gf, rf = g64[finite], r64[finite]
    if not np.isfinite(gf).all():
        return float("inf")
    scale = max(float(np.max(np.abs(rf))), floor)
    return float(np.max(np.abs(gf - rf))) / scale


def compare(name: str, got: np.ndarray, ref: np.ndarray, tol: float = 1e-4) -> Comparison:
    g, r = np.asarray(got), np.asarray(ref)
    if g.shape != r.shape:
        return Comparison(
            name, tuple(r.shape), float("inf"), False, f"shape {list(g.shape)} != {list(r.shape)}"
        )
    if g.dtype != r.dtype:
        return Comparison(
            name, tuple(r.shape), float("inf"), False, f"dtype {g.dtype} != {r.dtype}"
        )
    err = max_rel_error(g, r)
    return Comparison(name, tuple(r.shape), err, err <= tol)
