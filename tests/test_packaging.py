"""grammar/, templates/ and runtime_cpp/ ship inside the wheel and are found from a plain
(non-editable) install, where no checkout sits beside the package; the CMake package
(flowc/cmake/) ships as the wheel's shared data and lands in <prefix>/share/cmake/flowc,
beside the <prefix>/bin/flowc it finds and calls."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
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

    # The CMake package: shared data, not a part of the Python package.
    data = f"flowc-{out_version(names)}.data/data/share/cmake/flowc"
    for f in ("flowcConfig.cmake", "flowcConfigVersion.cmake", "flowc-check-project.cmake"):
        assert f"{data}/{f}" in names, f
        assert (site / data / f).read_bytes() == (REPO / "flowc" / "cmake" / f).read_bytes()
    runtime_cmake = (REPO / "runtime_cpp" / "flowc" / "flowc.cmake").read_bytes()
    assert (site / data / "flowc-runtime.cmake").read_bytes() == runtime_cmake
    assert not [n for n in names if n.startswith("flowc/cmake/")]

    # Installed under a prefix: <prefix>/share/cmake/flowc, which `flowc --cmake-dir` names
    # and whose flowcConfig.cmake finds <prefix>/bin/flowc without PATH.
    prefix = tmp_path / "prefix"
    # --ignore-installed: else pip replaces the flowc of the environment running the tests
    # (the checkout's editable install), uninstalling it there.
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    pip += ["--ignore-installed", "--no-warn-script-location", "--prefix", str(prefix), str(wheel)]
    subprocess.run(pip, check=True, capture_output=True)
    purelib = sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)})
    env = {"PYTHONPATH": purelib, "PATH": "/usr/bin:/bin"}
    printed = subprocess.run(
        [str(prefix / "bin" / "flowc"), "--cmake-dir"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    ).stdout.strip()
    assert printed == str(prefix / "share" / "cmake" / "flowc")
    project = tmp_path / "consumer"
    project.mkdir()
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.20)\nproject(consumer NONE)\n"
        "find_package(flowc CONFIG REQUIRED)\n"
        'message(STATUS "flowc: ${FLOWC_EXECUTABLE} ${flowc_VERSION}")\n'
    )
    configured = subprocess.run(
        ["cmake", "-S", str(project), "-B", str(project / "build"), f"-Dflowc_DIR={printed}"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    assert f"flowc: {prefix / 'bin' / 'flowc'} {out_version(names)}" in configured


def out_version(names: set[str]) -> str:
    """The wheel's version, from its .dist-info folder's name."""
    info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
    return info.removesuffix(".dist-info").split("-")[1]
