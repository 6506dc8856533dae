"""Where flowc's data directories live: inside the installed wheel (flowc/_data/...) or, in
a checkout or editable install, at the repository's top level; and where the CMake package
was installed (`flowc --cmake-dir`)."""

from __future__ import annotations

import importlib.metadata
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from flowc.errors import FlowcError

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


# Where the wheel's shared data puts the CMake package (flowc/cmake/ in the source tree),
# relative to the installation's prefix: <prefix>/bin/flowc is the command it calls.
CMAKE_PACKAGE = "share/cmake/flowc"


def _cmake_dir_candidates() -> Iterator[Path]:
    # The files the installer recorded (an editable install copies the package too).
    try:
        dist = importlib.metadata.distribution("flowc")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        for f in dist.files or []:
            if f.as_posix().endswith(f"{CMAKE_PACKAGE}/flowcConfig.cmake"):
                yield Path(os.path.normpath(os.path.abspath(str(dist.locate_file(f))))).parent
    # The installation scheme of this interpreter, and the user's.
    yield Path(sysconfig.get_paths()["data"]) / CMAKE_PACKAGE
    yield Path(sys.prefix) / CMAKE_PACKAGE
    user = f"{os.name}_user"
    if user in sysconfig.get_scheme_names():
        yield Path(sysconfig.get_paths(user)["data"]) / CMAKE_PACKAGE


def cmake_dir() -> Path:
    """The folder of flowc's CMake package, to give CMake as ``flowc_DIR``:
    ``<prefix>/share/cmake/flowc``, installed with flowc (from the wheel, or by an editable
    install) beside the ``<prefix>/bin/flowc`` that it calls."""
    looked: list[str] = []
    for path in _cmake_dir_candidates():
        if (path / "flowcConfig.cmake").is_file():
            return path
        if str(path) not in looked:
            looked.append(str(path))
    raise FlowcError(
        f"flowc's CMake package is not installed (looked in {', '.join(looked)})",
        hint="install flowc with pip (a wheel, or `pip install -e .` in a checkout: "
        "`make setup`), which puts it in <prefix>/share/cmake/flowc",
    )
