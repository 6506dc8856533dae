"""grammar/, templates/ and runtime_cpp/ ship inside the wheel and are found from a plain
(non-editable) install, where no checkout sits beside the package."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import REPO


def test_wheel_carries_the_data_dirs_and_finds_them(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("flowc-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "flowc = flowc.entry:main" in z.read(entry_points).decode()
        site = tmp_path / "site"
        z.extractall(site)
    for f in (
        "flowc/_data/grammar/flow.lark",
        "flowc/_data/templates/README.md",
        "flowc/_data/runtime_cpp/README.md",
    ):
        assert f in names, f
    probe = (
        "import flowc, flowc.resources as r; "
        "print(flowc.__file__); print(r.grammar_file()); print(r.templates_dir()); print(r.runtime_dir())"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    ).stdout.split("\n")
    assert out[0].startswith(str(site))
    for line in out[1:4]:
        assert line.startswith(str(site / "flowc" / "_data")), line
    assert Path(out[1]).read_text() == (REPO / "grammar" / "flow.lark").read_text()
