"""How flowc prints quantities: byte counts, FLOPs and shapes, the same in every command and
report.

A leaf module (no flowc imports), so reports in any layer may use it without importing the
command line.
"""

from __future__ import annotations

from collections.abc import Iterable


def human_bytes(n: int) -> str:
    """``512`` -> ``512 B``, ``1536`` -> ``1.50 KiB``; GiB is the largest unit."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    raise AssertionError("unreachable: GiB returns")


def human_flops(n: int) -> str:
    """``2_500_000`` -> ``2.500 MFLOP``; below 1000, plain FLOP."""
    for unit, scale in (("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n} FLOP"


def dims_text(dims: Iterable[int]) -> str:
    """``(2, 4)`` -> ``2x4``: a mesh or shape as the command line writes it (--mesh 2x4)."""
    return "x".join(map(str, dims))
