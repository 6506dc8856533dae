"""The commands the README and docs/python.md show are run as written: every fenced block
marked ``<!-- runnable -->`` (sh through bash -e, python through this interpreter) and every
block marked ``<!-- file: NAME -->`` (written to NAME first), in order, in a fresh folder
where ``examples/`` is the repository's. The README links nowhere outside the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

BLOCK = re.compile(r"<!-- (runnable|file: ([\w.-]+)) -->\n```(\w+)\n(.*?)```", re.S)


def blocks(doc: Path) -> list[tuple[str, str, str]]:
    """(kind, language, text) of each marked block, in order; kind is 'run' or a file name."""
    return [
        ("run" if m.group(1) == "runnable" else m.group(2), m.group(3), m.group(4))
        for m in BLOCK.finditer(doc.read_text(encoding="utf-8"))
    ]


def run_blocks(doc: Path, cwd: Path) -> list[str]:
    (cwd / "examples").symlink_to(REPO / "examples")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    outputs = []
    for kind, lang, text in blocks(doc):
        if kind != "run":
            (cwd / kind).write_text(text, encoding="utf-8")
            continue
        cmd = ["bash", "-e", "-c", text] if lang == "sh" else [sys.executable, "-c", text]
        assert lang in ("sh", "python"), lang
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{doc.name} block failed:\n{text}\n{r.stdout}\n{r.stderr}"
        outputs.append(r.stdout)
    return outputs


def test_the_readmes_commands_run_as_written(tmp_path: Path) -> None:
    readme = REPO / "README.md"
    kinds = [k for k, _, _ in blocks(readme)]
    assert kinds.count("run") == 3 and "app.c" in kinds  # the shell, C and Python blocks
    outs = run_blocks(readme, tmp_path)
    assert "PASS" in outs[0] and "FAIL" not in outs[0]  # flowc verify's table
    # The C program and the driver computed the same first output from the same input.
    y = np.load(tmp_path / "y.npz")["y"]
    assert f"y[0] = {y[0, 0]:.6f}" in outs[1]
    assert "(8, 10)" in outs[2]


def test_the_python_api_page_runs_as_written(tmp_path: Path) -> None:
    outs = run_blocks(REPO / "docs" / "python.md", tmp_path)
    assert outs == ["(8, 10) (8, 10)\n"]


@pytest.mark.parametrize(
    "doc", ["README.md", *sorted(p.name for p in (REPO / "docs").glob("*.md"))]
)
def test_docs_link_only_inside_the_repository(doc: str) -> None:
    path = REPO / doc if doc == "README.md" else REPO / "docs" / doc
    for target in re.findall(r"\]\(([^)#\s]+)", path.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "mailto:")):
            assert doc != "README.md", f"the README links outside the repository: {target}"
            continue
        resolved = (path.parent / target).resolve()
        assert resolved.is_relative_to(REPO), f"{doc} links outside the repository: {target}"
        assert resolved.exists(), f"{doc} links to a missing file: {target}"
