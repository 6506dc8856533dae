"""Where flowc's data directories live: inside the installed wheel (flowc/_data/...) or, in
a checkout or editable install, at the repository's top level."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def _find(name: str) -> Path:
    for candidate in (_PKG / "_data" / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"flowc's {name}/ directory is missing (looked in {_PKG / '_data'} and {_PKG.parent}); "
        "reinstall flowc"
    )


def grammar_file() -> Path:
    return _find("grammar") / "flow.lark"


def templates_dir() -> Path:
    return _find("templates")


def runtime_dir() -> Path:
    return _find("runtime_cpp")
