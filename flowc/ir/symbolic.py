"""Symbolic dimensions: a size known only as a range at compile time.

A *symbol* (``batch``, ``seq``) is a dimension the caller picks at run time within a range
``lo..hi`` (``DimRange``). A tensor dimension that depends on symbols is a ``SymDim``: an
integer polynomial of them, multilinear (each symbol to the first power at most): ``batch``,
``2*seq``, ``batch*seq``, ``seq+1``. That covers what models do with a dynamic size (carry
it, flatten it with others, concatenate two of it); what falls outside (``seq/2``, ``seq*seq``)
is refused where it appears.

Every tensor keeps its size *at the bound* (every symbol at ``hi``) in ``TensorType.shape``:
memory, cost and placement are planned for the largest run, and a smaller run uses a prefix
of each buffer. ``TensorType.sym`` says which dims are symbolic and how.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from itertools import product

# The most symbols one program may have: symbolic types are found by building the graph at
# 2^n sizes (see ir/fit_dims.py), and the run-time size table holds them all.
MAX_SYMBOLS = 4

_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class DimRange:
    """The sizes a symbol takes: ``lo..hi``, both ends included; ``typical``: the size the
    schedule and the placement cost weigh (``--dim batch=1..64@8``), the bound when None."""

    lo: int
    hi: int
    typical: int | None = None
    # A size the program computes (a data-dependent output's row count: NonZero, NonMaxSuppression),
    # 0..hi, hi the output buffer's bound; not one the caller gives.
    computed: bool = False

    def __post_init__(self) -> None:
        if self.lo < (0 if self.computed else 1):
            raise ValueError(f"a range starts at 1 or more, got {self.lo}")
        if self.lo > self.hi:
            raise ValueError(f"the range {self.lo}..{self.hi} is empty (its min is above its max)")
        if self.typical is not None and not self.lo <= self.typical <= self.hi:
            raise ValueError(f"the typical size {self.typical} is outside {self.lo}..{self.hi}")

    @property
    def weighed(self) -> int:
        """The size costs are modeled at."""
        return self.hi if self.typical is None else self.typical

    def __str__(self) -> str:
        at = f"@{self.typical}" if self.typical is not None else ""
        return f"{self.lo}..{self.hi}{at}" + (" computed" if self.computed else "")


def parse_range(text: str, what: str) -> DimRange | int:
    """``8`` -> 8; ``1..64`` or ``1..64@8`` -> a DimRange; a ValueError saying what is wrong."""
    m = re.fullmatch(r"\s*(\d{1,18})\s*(?:\.\.\s*(\d{1,18})\s*(?:@\s*(\d{1,18})\s*)?)?", text)
    if m is None:
        raise ValueError(f"{what}: {text!r} is neither a size (8) nor a range (1..64, 1..64@8)")
    lo = int(m.group(1))
    if m.group(2) is None:
        return lo
    typical = int(m.group(3)) if m.group(3) is not None else None
    try:
        return DimRange(lo, int(m.group(2)), typical)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


Term = tuple[tuple[str, ...], int]  # (sorted symbols, coefficient); () is the constant


@dataclass(frozen=True)
class SymDim:
    """An integer multilinear polynomial of symbols: ``terms`` sorted, no zero coefficient,
    at least one symbol."""

    terms: tuple[Term, ...]

    @staticmethod
    def of(name: str) -> SymDim:
        return SymDim((((name,), 1),))

    @staticmethod
    def from_terms(terms: Mapping[tuple[str, ...], int]) -> SymDim | int:
        """The polynomial of ``terms``, or the int it is when no symbol remains."""
        kept = tuple(sorted((tuple(sorted(k)), int(c)) for k, c in terms.items() if c))
        if all(not k for k, _ in kept):
            return sum(c for _, c in kept)
        return SymDim(kept)

    @property
    def symbols(self) -> frozenset[str]:
        return frozenset(s for k, _ in self.terms for s in k)

    @property
    def name(self) -> str | None:
        """The symbol this dim is, when it is exactly one symbol."""
        if len(self.terms) == 1 and len(self.terms[0][0]) == 1 and self.terms[0][1] == 1:
            return self.terms[0][0][0]
        return None

    def renamed(self, names: Mapping[str, str]) -> SymDim:
        """This polynomial with its symbols renamed (those ``names`` maps)."""
        terms = {tuple(names.get(x, x) for x in k): c for k, c in self.terms}
        out = SymDim.from_terms(terms)
        assert isinstance(out, SymDim)
        return out

    def evaluate(self, values: Mapping[str, int]) -> int:
        return sum(c * math.prod(values[s] for s in k) for k, c in self.terms)

    def c_expr(self, slot: Mapping[str, int], table: str = "dims") -> str:
        """The C++ int64 expression of this dim over the run's size table ``table``
        (``table[slot[symbol]]``)."""
        parts = []
        for k, c in self.terms:
            factors = [f"{table}[{slot[s]}]" for s in k]
            if c != 1 or not factors:
                factors.insert(0, f"INT64_C({c})")
            parts.append(" * ".join(factors))
        return "(" + " + ".join(parts) + ")"

    def __str__(self) -> str:
        parts = []
        for k, c in self.terms:
            if not k:
                parts.append(str(c))
            elif c == 1:
                parts.append("*".join(k))
            else:
                parts.append(f"{c}*" + "*".join(k))
        # (a negative constant prints as +-1: the DSL reads signed factors, not minus)
        return "+".join(parts)


Dim = int | SymDim

# The symbol an op's shape inference gives a data-dependent dim (a count it computes): the
# graph names it after the node's output when the node is added (Graph.add_node), with the
# range 0..bound.
COUNT = "?"


def count_dim() -> SymDim:
    return SymDim.of(COUNT)


def evaluate(d: SymDim | int, values: Mapping[str, int]) -> int:
    return d.evaluate(values) if isinstance(d, SymDim) else d


def dims_text(shape: Iterable[int], sym: Iterable[SymDim | None] | None) -> list[str]:
    """Each dim as the printer writes it: its polynomial where symbolic, else its size."""
    if sym is None:
        return [str(d) for d in shape]
    return [str(s) if s is not None else str(d) for d, s in zip(shape, sym, strict=True)]


def check_symbol_name(name: str, what: str) -> None:
    if not _SYMBOL.match(name):
        raise ValueError(f"{what}: {name!r} is not a symbol name (letters, digits, _)")


def probe_points(ranges: Mapping[str, DimRange]) -> list[dict[str, int]]:
    """The 2^n assignments multilinear fitting reads: each symbol at two sizes of its range
    below the bound (the bound itself checks the fit), avoiding 1 where the range allows, as
    a size of 1 broadcasts. A range of fewer than three sizes is covered whole."""
    per: list[tuple[int, int]] = []
    for r in ranges.values():
        sizes = list(range(max(r.lo, 2 if r.hi - r.lo >= 3 else r.lo), r.hi + 1))
        if len(sizes) >= 3:
            # two sizes below the bound, apart from each other and from it
            a, b = sizes[len(sizes) // 3], sizes[(2 * len(sizes)) // 3]
            if b == r.hi:
                b = sizes[-2]
            if a == b:
                a = sizes[0]
        else:
            a, b = sizes[0], sizes[-1]
        per.append((a, b))
    names = list(ranges)
    return [dict(zip(names, pick, strict=True)) for pick in product(*per)]


def fit(names: list[str], points: list[dict[str, int]], sizes: list[int]) -> SymDim | int | None:
    """The multilinear polynomial of ``names`` through ``sizes`` at the 2^n ``points`` (in
    probe_points' order), or None when its coefficients are not integers."""
    n = len(names)
    pairs = []
    for j, s in enumerate(names):
        # probe_points varies the last symbol fastest
        stride = 2 ** (n - 1 - j)
        pairs.append((points[0][s], points[stride][s]))
    terms: dict[tuple[str, ...], int] = {}
    for subset in product((0, 1), repeat=n):
        # Newton's divided differences in each symbol: the coefficient of prod(s in subset)
        # after expanding (s - a) into s and -a.
        coef = Fraction(0)
        for corner in product((0, 1), repeat=n):
            value = Fraction(sizes[int("".join(map(str, corner)), 2)] if n else sizes[0])
            w = Fraction(1)
            for j, (a, b) in enumerate(pairs):
                if a == b:
                    # this symbol has one size: it is a constant
                    w *= 0 if subset[j] else (1 if corner[j] == 0 else 0)
                    continue
                if subset[j]:
                    w *= Fraction(1 if corner[j] else -1, b - a)
                else:
                    w *= Fraction(-a, b - a) if corner[j] else Fraction(b, b - a)
            coef += value * w
        if coef.denominator != 1:
            return None
        if coef:
            terms[tuple(s for s, on in zip(names, subset, strict=True) if on)] = int(coef)
    return SymDim.from_terms(terms)


def fit_grid(names: list[str], grid: list[list[int]], sizes: list[int]) -> SymDim | int | None:
    """The integer polynomial of ``names`` of degree len(grid[j]) - 1 in symbol j through
    ``sizes`` at every point of the grid (product order: the last symbol fastest), or None
    when its coefficients are not integers. Each axis's Vandermonde system is solved
    exactly, one axis after another (the tensor-product interpolation)."""
    n = len(names)
    values: dict[tuple[int, ...], Fraction] = {}
    for idx, s in zip(product(*(range(len(g)) for g in grid)), sizes, strict=True):
        values[idx] = Fraction(s)
    for j in range(n):
        inv = _vandermonde_inverse(grid[j])
        out: dict[tuple[int, ...], Fraction] = {}
        for idx in values:
            if idx[j] != 0:
                continue
            line = [values[(*idx[:j], r, *idx[j + 1 :])] for r in range(len(grid[j]))]
            for power, row in enumerate(inv):
                out[(*idx[:j], power, *idx[j + 1 :])] = sum(
                    (w * v for w, v in zip(row, line, strict=True)), Fraction(0)
                )
        values = out
    terms: dict[tuple[str, ...], int] = {}
    for powers, coef in values.items():
        if coef.denominator != 1:
            return None
        if coef:
            key = tuple(s for s, p in zip(names, powers, strict=True) for _ in range(p))
            terms[key] = int(coef)
    return SymDim.from_terms(terms)


def _vandermonde_inverse(xs: list[int]) -> list[list[Fraction]]:
    """The inverse of [[x^p for p] for x in xs] (distinct xs), exactly: coefficient p of the
    interpolating polynomial is row p times the values."""
    m = len(xs)
    a = [
        [Fraction(x) ** p for p in range(m)] + [Fraction(int(i == r)) for i in range(m)]
        for r, x in enumerate(xs)
    ]
    for col in range(m):
        pivot = next(r for r in range(col, m) if a[r][col] != 0)
        a[col], a[pivot] = a[pivot], a[col]
        lead = a[col][col]
        a[col] = [v / lead for v in a[col]]
        for r in range(m):
            if r != col and a[r][col] != 0:
                f = a[r][col]
                a[r] = [v - f * w for v, w in zip(a[r], a[col], strict=True)]
    # rows of [I | V^-1]: V^-1 maps values to coefficients
    return [row[m:] for row in a]
