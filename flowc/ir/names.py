"""Suggestions for a misspelt name in a command-line option (--sbp, --stage-boundary)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: str, names: Iterable[str], otherwise: str) -> str:
    """The hint for an unknown ``name``: the closest of ``names`` (up to three), or
    ``otherwise`` when none is close."""
    close = difflib.get_close_matches(name, list(names), n=3)
    if close:
        return "did you mean " + ", ".join(repr(c) for c in close) + "?"
    return otherwise
