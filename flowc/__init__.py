"""flowc: an ahead-of-time compiler from ONNX (and a small DSL) to standalone CUDA C++.

``import flowc`` is light: the Python API (flowc.api: compile, Project, Model and the
errors; flowc.trainer: train) is imported on first use of one of its names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowc.version import __version__

if TYPE_CHECKING:
    from flowc.api import BuildError as BuildError
    from flowc.api import FlowcError as FlowcError
    from flowc.api import InputError as InputError
    from flowc.api import Model as Model
    from flowc.api import Project as Project
    from flowc.api import TensorSpec as TensorSpec
    from flowc.api import compile as compile
    from flowc.trainer import train as train

_API = ("BuildError", "FlowcError", "InputError", "Model", "Project", "TensorSpec", "compile")
_TRAINER = ("train",)

__all__ = ["__version__", *_API, *_TRAINER]


def __getattr__(name: str) -> Any:
    if name in _API:
        from flowc import api

        return getattr(api, name)
    if name in _TRAINER:
        from flowc import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'flowc' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API, *_TRAINER])
