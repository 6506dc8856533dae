"""Generated C++ lives in templates: no flowc module spells a C++ statement in Python.

Every statement of the generated run() and create() comes from a Jinja macro (templates/run.cu.j2
or an op family's templates/kernels/*.cu.j2); Python passes values: pointer expressions,
sizes, literals spelled by codegen/cpp.py's helpers. This test parses every flowc/**/*.py and
fails on a string literal or f-string holding a ``;``-terminated C++ line or a ``{ ...; }``
block, outside docstrings and the allowlist below.
"""

from __future__ import annotations

import ast
import re
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "flowc"

# A statement: a line ending in ';', or a block closing after one ('...; }').
_STATEMENT = re.compile(r";\s*$|;\s*\}")
# What tells C++ from English prose that ends in ';': a call ending the statement, a
# flowc:: name, a CUDA API or flowc macro, an assignment, or a member access through a pointer.
_CXX = re.compile(r"\)\s*;|\bflowc::|\bcuda[A-Z]|\bFLOWC_|\w\s*[-+*/]?=\s*[^=\s]|->")

# (path under flowc/ (a glob), enclosing function or "*") -> why its text stays in Python.
ALLOWED: dict[tuple[str, str], str] = {
    ("harness/gpu.py", "*"): "harness source, moving to templates",
    ("report/graph.py", "to_dot"): "Graphviz DOT statements for the report, not C++",
}


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):  # the f-string's literal parts; {} for each field
        return "".join(
            v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else "{}"
            for v in node.values
        )
    return None


def cxx_lines(path: Path) -> list[tuple[int, str, str]]:
    """(line, enclosing function, text) of each C++ statement line in ``path``'s strings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and n.body
        and isinstance(n.body[0], ast.Expr)
    }
    found: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            func = node.name
        text = None if id(node) in docstrings else _text(node)
        if text is not None:
            for line in text.splitlines() or [text]:
                if _STATEMENT.search(line) and _CXX.search(line):
                    found.append((getattr(node, "lineno", 0), func, line.strip()))
            return  # an f-string's parts are inside it
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, "<module>")
    return found


def _allowed(rel: str, func: str) -> bool:
    return any(fnmatch(rel, path) and f in ("*", func) for path, f in ALLOWED)


def test_the_rule_tells_cxx_from_prose() -> None:
    assert _STATEMENT.search("cudaMemsetAsync(p, 0, 4, s);") and _CXX.search(
        "cudaMemsetAsync(p, 0, 4, s);"
    )
    assert _CXX.search("d.lda = 4;") and _CXX.search("{ flowc::Status st = f(); }")
    for prose in ("start, limit and delta must share one type;", "  has no output;", " inputs;"):
        assert not (_STATEMENT.search(prose) and _CXX.search(prose)), prose


def test_no_cxx_statements_in_python() -> None:
    hits = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for lineno, func, line in cxx_lines(path):
            if not _allowed(rel, func):
                hits.append(f"flowc/{rel}:{lineno} ({func}): {line}")
    assert not hits, (
        "C++ statements spelled in Python (move them into a template macro and pass values; "
        "see Program.emit / call / library_plan):\n" + "\n".join(hits)
    )


@pytest.mark.parametrize(("rel", "func"), sorted(ALLOWED))
def test_allowlist_entries_are_still_needed(rel: str, func: str) -> None:
    """An allowlisted place that no longer spells a statement leaves the list."""
    used = [
        path
        for path in sorted(ROOT.rglob("*.py"))
        if fnmatch(path.relative_to(ROOT).as_posix(), rel)
        and any(func in ("*", f) for _, f, _ in cxx_lines(path))
    ]
    assert used, f"flowc/{rel} ({func}) spells no statement any more: drop it from ALLOWED"
