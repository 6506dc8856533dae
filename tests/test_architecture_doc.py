"""docs/architecture.md's picture of the layers is generated from the code and the
import-linter contract (docs/import_graph.py); the checked-in one must still match both."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_layers_picture_matches_the_code() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "import_graph.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_architecture_doc_shows_the_picture() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert "](images/layers.svg)" in text
    svg = (ROOT / "docs" / "images" / "layers.svg").read_text()
    # Every box of the dot file is drawn in the SVG (same generation, not a stale drawing).
    dot = (ROOT / "docs" / "images" / "layers.dot").read_text()
    boxes = [line.split('"')[1] for line in dot.splitlines() if "[label=" in line]
    assert boxes
    for box in boxes:
        assert f"<title>{box}</title>" in svg, box
