"""flowc's Python API: compile a model into a project, build it, and run it from Python.

    import flowc

    project = flowc.compile("model.onnx", "out/", precision="bf16")
    project.build()                       # the host build unless a GPU is present
    model = project.load()                # the built library, through ctypes
    outputs = model.run({"x": x})         # {output name: NumPy array}

The keyword arguments are the command line's long options with underscores (``--mem-limit``
is ``mem_limit=``); errors are flowc.InputError (the user's input) or flowc.FlowcError,
with the messages the command line prints. The command line is a thin layer over this
module: `flowc compile`, `flowc build`, `flowc run` and `flowc verify` call it.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from flowc.errors import FlowcError, InputError
from flowc.harness.build import (
    BuildError,
    build_dir,
    check_built,
    check_feeds,
    project_info,
    recover,
    shown,
)
from flowc.ir.dtype import DType
from flowc.options import CompileOptions, ModelArgs, ParallelArgs, ScheduleArgs

if TYPE_CHECKING:
    from flowc.compiler import StageTimes

__all__ = [
    "BuildError",
    "FlowcError",
    "InputError",
    "Model",
    "Project",
    "StateShard",
    "TensorSpec",
    "compile",
    "compile_project",
    "resolve_target",
]

Progress = Callable[[str], None]

TARGETS = ("host", "cuda")
# The oldest CUDA architecture --arch takes: Maxwell, the oldest CUDA 12 builds for (CUDA 13
# starts at sm_75; its nvcc says so when the build asks for less).
MIN_ARCH = 50


def _quiet(_: str) -> None:
    pass


# -- the target ---------------------------------------------------------------------------------


def resolve_target(
    target: str | None, project: str | os.PathLike[str] | None = None, sanitize: bool = False
) -> tuple[str, str]:
    """The target to use and why (one line): ``target`` when given; a sanitized build is a
    host build; else the one rule of flowc.toolchain.default_target (``project``'s recorded
    target, else cuda where a GPU is present, else host)."""
    from flowc.toolchain import default_target

    if target is not None:
        if target not in TARGETS:
            raise InputError(f"--target {target!r}: expected host or cuda")
        return target, "given by --target"
    if sanitize:
        return "host", "sanitizers build for the host"
    recorded = None
    if project is not None and (Path(project) / "flowc_model.json").is_file():
        value = project_info(Path(project)).get("target")
        recorded = value if value in TARGETS else None
    chosen, why = default_target(recorded)
    return chosen, f"{why}; --target to choose"


# -- compile ------------------------------------------------------------------------------------


def _items(value: Any, what: str) -> tuple[str, ...]:
    """A repeatable option given as a mapping ({"x": (1, 3)}), one "NAME=VALUE" string, or
    a sequence of them, as the command line's strings."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        out = []
        for k, v in value.items():
            if isinstance(v, Iterable) and not isinstance(v, str):
                v = "x".join(str(int(d)) for d in v)
            out.append(f"{k}={v}")
        return tuple(out)
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Iterable):
        return tuple(str(v) for v in value)
    raise InputError(f"{what}={value!r}: expected a mapping or a list of NAME=VALUE strings")


def _count(name: str, value: Any, low: int, high: int | None = None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"--{name.replace('_', '-')} {value!r}: expected a whole number")
    if value < low or (high is not None and value > high):
        bound = f"from {low}" + (f" to {high}" if high is not None else "")
        raise InputError(f"--{name.replace('_', '-')} {value}: expected a number {bound}")
    return value


def _choice(name: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise InputError(
            f"--{name.replace('_', '-')} {value!r}: expected one of {', '.join(choices)}"
        )
    return str(value)


def compile_options(model: str | os.PathLike[str], **options: Any) -> CompileOptions:
    """The options record of `flowc compile MODEL` for keyword options named as the
    command line's (``precision="bf16"``, ``mesh="2x2"``, ``shape={"x": (1, 3)}``, ...)."""
    from flowc.ir.types import MAX_MESH_DEVICES, MAX_MICROBATCHES

    o = dict(options)
    known = set(COMPILE_OPTIONS)
    unknown = sorted(set(o) - known)
    if unknown:
        raise InputError(
            f"flowc.compile: no option {unknown[0]!r}",
            hint="options: " + ", ".join(sorted(known)),
        )
    given_mesh = o.get("mesh")
    mesh: str | None = None
    if isinstance(given_mesh, int) and not isinstance(given_mesh, bool):
        mesh = str(given_mesh)
    elif isinstance(given_mesh, Sequence) and not isinstance(given_mesh, str):
        mesh = "x".join(str(int(d)) for d in given_mesh)
    elif given_mesh is not None:
        mesh = str(given_mesh)
    mem_limit = o.get("mem_limit")
    stage_boundary = o.get("stage_boundary")
    if isinstance(stage_boundary, Sequence) and not isinstance(stage_boundary, str):
        stage_boundary = ",".join(stage_boundary)
    weights = o.get("weights")
    cost_profile = o.get("cost_profile")
    model_args = ModelArgs(
        Path(model),
        shapes=_items(o.get("shape"), "shape"),
        dims=_items(o.get("dim"), "dim"),
        bounds=_items(o.get("bound"), "bound"),
        weights=None if weights is None else str(weights),
        dump_after=_items(o.get("dump_ir_after"), "dump_ir_after"),
        print_times=bool(o.get("print_pass_times", False)),
    )
    schedule = ScheduleArgs(
        streams=_count("streams", o.get("streams"), 1, 32),
        no_cuda_graph=bool(o.get("no_cuda_graph", False)),
        schedule_for=_choice("schedule_for", o.get("schedule_for", "latency"), SCHEDULE_FOR),
        precision=_choice("precision", o.get("precision", "fp32"), PRECISIONS),
    )
    parallel = ParallelArgs(
        mesh=mesh,
        parallel=_choice("parallel", o.get("parallel", "auto"), PARALLEL),
        sbps=_items(o.get("sbp"), "sbp"),
        mem_limit=None if mem_limit is None else str(mem_limit),
        cost_profile=None if cost_profile is None else Path(cost_profile),
        search_nodes=_count("search_nodes", o.get("search_nodes"), 0, (1 << 31) - 1),
        pipeline=_count("pipeline", o.get("pipeline"), 1, MAX_MESH_DEVICES),
        microbatches=_count("microbatches", o.get("microbatches", 1), 1, MAX_MICROBATCHES) or 1,
        stage_boundary=stage_boundary,
        pipeline_schedule=(
            None
            if o.get("pipeline_schedule") is None
            else _choice("pipeline_schedule", o.get("pipeline_schedule"), ("1f1b", "gpipe"))
        ),
    )
    target = o.get("target")
    if target is not None:
        _choice("target", target, TARGETS)
    return CompileOptions(
        model_args,
        schedule,
        parallel,
        prefix=o.get("prefix"),
        arch=str(o.get("arch", "sm_90")),
        force=bool(o.get("force", False)),
        target=target,
    )


PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
SCHEDULE_FOR = ("latency", "memory")
PARALLEL = ("auto", "data", "none")
# flowc.compile's keyword options: `flowc compile`'s long options, with underscores.
COMPILE_OPTIONS = (
    "shape",
    "dim",
    "bound",
    "weights",
    "dump_ir_after",
    "print_pass_times",
    "streams",
    "no_cuda_graph",
    "schedule_for",
    "precision",
    "mesh",
    "parallel",
    "sbp",
    "mem_limit",
    "cost_profile",
    "search_nodes",
    "pipeline",
    "microbatches",
    "stage_boundary",
    "pipeline_schedule",
    "target",
    "arch",
    "prefix",
    "force",
)


def compile(
    model: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
    **options: Any,
) -> Project:
    """`flowc compile MODEL -o OUT` with the command line's options as keywords; returns the
    project. ``progress`` gets the ``flowc: ...`` lines (none by default)."""
    opts = compile_options(model, **options)
    return compile_project(opts, Path(out), progress=progress or _quiet)


def compile_project(
    opts: CompileOptions,
    out: Path,
    *,
    progress: Progress = _quiet,
    dump: Callable[[str, str], None] | None = None,
    times: StageTimes | None = None,
    placement: Any = "from options",
) -> Project:
    """The compile both the command line and compile() run: every option checked before
    the (slow) model work, then the driver (flowc.compiler.compile_model). ``placement``:
    flowc.compiler.placement_target's result when the caller checked it already."""
    import dataclasses
    import re

    from flowc.codegen.cpp import MAX_PREFIX, is_c_ident
    from flowc.codegen.project import check_project_dir
    from flowc.compiler import compile_model, placement_target

    number = re.fullmatch(r"sm_([0-9]{2,3})", opts.arch)
    if number is None or int(number.group(1)) < MIN_ARCH:
        arch_shown = opts.arch if len(opts.arch) <= 20 else opts.arch[:17] + "..."
        raise InputError(
            f"--arch {arch_shown}: expected a CUDA architecture sm_NN from sm_{MIN_ARCH}, "
            "e.g. sm_90",
            hint="sm_80 for an A100, sm_90 for an H100 or H200 (nvcc --list-gpu-arch lists "
            "those your CUDA builds for)",
        )
    prefix = opts.prefix
    if prefix is not None and not is_c_ident(prefix):
        raise InputError(
            f"--prefix {prefix[:40]!r} is not a C identifier",
            hint="use ASCII letters, digits and underscores, not starting with a digit",
        )
    if prefix is not None and len(prefix) > MAX_PREFIX:
        raise InputError(
            f"--prefix: {len(prefix)} characters; a prefix has at most {MAX_PREFIX}",
            hint="it names the library file, lib<prefix>_model.so, and a file name holds 255 bytes",
        )
    check_project_dir(out, opts.force)
    if isinstance(placement, str):
        placement = placement_target(opts.model, opts.parallel)

    driven = dataclasses.replace(opts, arch=number.group(1))
    compile_model(driven, out, target=placement, progress=progress, dump=dump, times=times)
    return Project(out)


# -- a project ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """An input or output of a compiled model: its name (byte for byte as in the model),
    shape and NumPy element type."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class StateShard:
    """This rank's part of a state tensor: slice ``chunk`` of ``chunks`` equal slices of the
    whole tensor (``shape``) along ``axis`` (-1 and one chunk: whole). Where several ranks
    hold the same slice (a mesh axis the tensor is not split over), one of them ``saves``
    it in a sharded checkpoint. A training pipeline's stage ``held`` only the state of its
    own layers (and the step counter)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    axis: int
    chunks: int
    chunk: int
    saves: bool
    held: bool = True

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.box(self.chunk)[1]

    def box(self, chunk: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Where slice ``chunk`` sits in the whole tensor: (start, size) per axis."""
        return slice_box(self.shape, self.axis, self.chunks, chunk)


def slice_box(
    shape: Sequence[int], axis: int, chunks: int, chunk: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Slice ``chunk`` of ``chunks`` equal slices of a tensor of ``shape`` along ``axis``
    (-1: the whole tensor) as (start, size) per axis."""
    start, size = [0] * len(shape), list(shape)
    if axis >= 0:
        size[axis] = shape[axis] // chunks
        start[axis] = chunk * size[axis]
    return tuple(start), tuple(size)


def state_shard(entry: Mapping[str, Any], mesh: Sequence[int], rank: int) -> StateShard:
    """A project's state entry as rank ``rank`` of ``mesh`` holds it (model.cu's
    chunk_of: the chunk counts row-major over the mesh axes in the split's mask; the rank
    at coordinate 0 on the others saves it)."""
    axis, mask = int(entry.get("split_axis", -1)), int(entry.get("split_mesh_axes", 0))
    coords, r = [], rank
    for size in reversed(mesh):
        coords.append(r % size)
        r //= size
    coords.reverse()
    chunks, chunk, saves = 1, 0, True
    for a, size in enumerate(mesh):
        if mask & (1 << a):
            chunks, chunk = chunks * size, chunk * size + coords[a]
        elif coords[a]:
            saves = False
    shape = tuple(int(d) for d in entry.get("whole_shape", entry["shape"]))
    if axis < 0:
        chunks, chunk = 1, 0
    # A training pipeline's: the stage holding it (-1: every stage), whose rank at
    # coordinate 0 on the other axes saves it.
    stage = int(entry.get("stage", -1))
    held = stage < 0 or coords[0] == stage
    if stage >= 0:
        saves = held and not any(coords[1:])
    return StateShard(
        str(entry["name"]),
        shape,
        DType.from_short(entry["dtype"]).np,
        axis,
        chunks,
        chunk,
        saves,
        held,
    )


def _specs(entries: Any) -> list[TensorSpec]:
    return [
        TensorSpec(
            str(e["name"]), tuple(int(d) for d in e["shape"]), DType.from_short(e["dtype"]).np
        )
        for e in entries
    ]


class Project:
    """A folder made by `flowc compile` (or compile()): build it, run it, load it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            recover(self.path)  # a swap an interrupted compile left is finished or undone
        self.info = project_info(self.path)  # a clear error for a folder that is no project

    def __repr__(self) -> str:
        return f"flowc.Project({str(self.path)!r})"

    @property
    def prefix(self) -> str:
        return str(self.info.get("prefix", ""))

    @property
    def inputs(self) -> list[TensorSpec]:
        return _specs(self.info["inputs"])

    @property
    def outputs(self) -> list[TensorSpec]:
        return _specs(self.info["outputs"])

    @property
    def ranks(self) -> int:
        mesh = self.info.get("mesh") or []
        assert isinstance(mesh, list)
        return math.prod(int(d) for d in mesh)

    @property
    def target(self) -> str | None:
        """The target recorded by `flowc compile --target` (None: chosen where it runs)."""
        value = self.info.get("target")
        return value if value in TARGETS else None

    def default_target(self) -> tuple[str, str]:
        """The target build(), run() and load() use when not told, and why."""
        return resolve_target(None, self.path)

    def build(
        self,
        target: str | None = None,
        *,
        sanitize: str | Sequence[str] | None = None,
        progress: Progress | None = None,
        quick: bool = False,
    ) -> Path:
        """`flowc build`: configure and build with CMake; returns the build folder."""
        from flowc.harness.build import build

        chosen, _ = resolve_target(target, self.path, sanitize=bool(sanitize))
        return build(self.path, chosen, progress=progress, sanitize=sanitize, quick=quick)

    def run(
        self,
        inputs: Mapping[str, Any],
        *,
        target: str | None = None,
        weights: str | os.PathLike[str] | None = None,
        rebuild: bool = False,
        env: Mapping[str, str] | None = None,
        progress: Progress | None = None,
    ) -> dict[str, np.ndarray]:
        """`flowc run`: the built driver program (through mpirun on a mesh) on NumPy inputs;
        returns the outputs by name. ``rebuild``: build first if the project changed since
        its build."""
        from flowc.harness.build import run

        chosen, _ = resolve_target(target, self.path)
        feeds = {k: np.asarray(v) for k, v in inputs.items()}
        specs = self.info["inputs"]
        assert isinstance(specs, list)
        _check_names(feeds, specs)
        results, _ = run(
            self.path,
            feeds,
            target=chosen,
            weights=None if weights is None else Path(weights),
            env=env,
            rebuild=rebuild,
            progress=progress,
        )
        return results

    def load(
        self, target: str | None = None, *, weights: str | os.PathLike[str] | None = None
    ) -> Model:
        """The built library loaded into this process: a Model whose run() takes arrays and
        returns arrays. A multi-rank project loads only in a process mpirun started as one
        of its ranks (every rank loads it and makes the same calls; `flowc train --mesh`
        drives its ranks so)."""
        chosen, _ = resolve_target(target, self.path)
        if self.ranks > 1 and launched_ranks() != self.ranks:
            raise InputError(
                f"{shown(self.path)} runs on {self.ranks} ranks: load() takes one-device projects, "
                f"or runs in each of {self.ranks} processes mpirun starts",
                hint="run it with Project.run() or `flowc run` (mpirun starts the ranks)",
            )
        check_built(self.path, chosen)
        library = build_dir(self.path, chosen) / f"lib{self.prefix}model.so"
        return Model(
            library,
            Path(weights) if weights is not None else self.path / "weights.bin",
            prefix=self.prefix,
            inputs=self.inputs,
            outputs=self.outputs,
            target=chosen,
            state=_specs(self.info.get("state", [])),
            train_inputs=_specs(self.info.get("train_inputs", [])),
            ranks=self.ranks,
            state_entries=cast(list[dict[str, Any]], self.info.get("state", [])),
            mesh=cast(list[int], self.info.get("mesh", [])),
            symbols=cast(list[dict[str, Any]], self.info.get("symbols", [])),
            input_entries=cast(list[dict[str, Any]], self.info.get("inputs", [])),
        )


def launched_ranks() -> int:
    """How many ranks the MPI job this process is one of has (1: none), from the launcher's
    environment (Open MPI's, or PMI's)."""
    for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return 1


def _check_names(feeds: Mapping[str, Any], inputs: Sequence[Mapping[str, Any]]) -> None:
    names = [str(s["name"]) for s in inputs]
    for k in feeds:
        if k not in names:
            raise InputError(
                f"the model has no input named {k!r}",
                hint="its inputs are: " + ", ".join(map(repr, names)),
            )


# -- a loaded model -----------------------------------------------------------------------------

# The alignment run() requires of every buffer (templates/model.h.j2; cudaMalloc gives 256).
ALIGN = 256

# DLPack's device types (dlpack.h): CPU memory, CUDA device memory, CUDA managed memory.
_DL_CPU, _DL_CUDA, _DL_CUDA_MANAGED = 1, 2, 13


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


# DLPack's type codes (kDLInt, kDLUInt, kDLFloat, kDLBfloat, kDLBool) with the bits.
_DL_TYPES = {
    (0, 8): "int8",
    (0, 16): "int16",
    (0, 32): "int32",
    (0, 64): "int64",
    (1, 8): "uint8",
    (1, 16): "uint16",
    (1, 32): "uint32",
    (1, 64): "uint64",
    (2, 16): "float16",
    (2, 32): "float32",
    (2, 64): "float64",
    (4, 16): "bfloat16",
    (6, 8): "bool",
}


@dataclass
class _Buffer:
    """One argument of the C API's run(): its address, and what keeps the memory alive."""

    ptr: int
    keep: Any = None
    device: bool = False  # device memory (a CUDA allocation of the caller's)


def _aligned_empty(spec: TensorSpec) -> np.ndarray:
    """An array of ``spec`` whose data is ALIGN-aligned (NumPy promises 16 or 64)."""
    raw = np.empty(spec.nbytes + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip : skip + spec.nbytes].view(spec.dtype).reshape(spec.shape)


def _interface_pointer(
    obj: Any, spec: TensorSpec, what: str, writable: bool
) -> tuple[int, bool] | None:
    """(address, is device memory) of an array exposing ``__cuda_array_interface__`` or
    ``__dlpack__``, after checking its type, shape and layout; None for anything else."""
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        ptr, readonly = cai["data"]
        got = np.dtype(cai["typestr"])
        shape = tuple(cai["shape"])
        strides = cai.get("strides")
        _check_layout(what, spec, got, shape, strides)
        if writable and readonly:
            raise InputError(f"{what}: the array is read-only")
        return int(ptr or 0), True
    if hasattr(obj, "__dlpack__") and not isinstance(obj, np.ndarray):
        capsule = obj.__dlpack__()
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype = ctypes.c_void_p
        get.argtypes = [ctypes.py_object, ctypes.c_char_p]
        t = _DLTensor.from_address(get(capsule, b"dltensor"))
        name = _DL_TYPES.get((t.dtype.code, t.dtype.bits)) if t.dtype.lanes == 1 else None
        if name is None:
            raise InputError(f"{what}: a DLPack type flowc has no name for")
        got = np.dtype(name) if name != "bfloat16" else DType.from_short("bf16").np
        shape = tuple(t.shape[i] for i in range(t.ndim))
        strides = (
            None if not t.strides else tuple(t.strides[i] * got.itemsize for i in range(t.ndim))
        )
        _check_layout(what, spec, got, shape, strides)
        device = t.device.device_type in (_DL_CUDA, _DL_CUDA_MANAGED)
        if not device and t.device.device_type != _DL_CPU:
            raise InputError(
                f"{what}: DLPack device type {t.device.device_type} is not CPU or CUDA"
            )
        return int(t.data or 0) + int(t.byte_offset), device
    return None


def _check_layout(
    what: str, spec: TensorSpec, got: np.dtype[Any], shape: tuple[int, ...], strides: Any
) -> None:
    if np.dtype(got).newbyteorder("=") != spec.dtype or shape != spec.shape:
        raise InputError(
            f"{what}: expected {DType.from_numpy(spec.dtype).short}{list(spec.shape)}, got "
            f"{got}{list(shape)}",
            hint=f"give the array as {spec.dtype} with shape {list(spec.shape)}",
        )
    if strides is not None:
        dense, step = [], spec.dtype.itemsize
        for d in reversed(shape):
            dense.append(step)
            step *= d
        if tuple(s for s, d in zip(strides, shape, strict=True) if d > 1) != tuple(
            s for s, d in zip(reversed(dense), shape, strict=True) if d > 1
        ):
            raise InputError(
                f"{what}: the array is not dense in C order",
                hint="pass a contiguous copy (x.contiguous(), cupy.ascontiguousarray(x))",
            )


# Each library this process loaded: (inode, mtime, size) when it did.
_LOADED_LIBRARIES: dict[str, tuple[int, int, int]] = {}


def _load_library(library: Path) -> ctypes.CDLL:
    """``library`` loaded into this process. The dynamic loader keys what it loaded by the
    path, so a project recompiled and rebuilt in place would hand back the code loaded
    before (with the new weights: a failed create, or worse); a library changed since this
    process loaded it is loaded from a private copy instead (removed at exit)."""
    path = library.resolve()
    st = path.stat()
    ident = (st.st_ino, st.st_mtime_ns, st.st_size)
    seen = _LOADED_LIBRARIES.setdefault(str(path), ident)
    if seen == ident:
        return ctypes.CDLL(str(path))
    import atexit
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="flowc-lib-"))
    atexit.register(shutil.rmtree, folder, True)
    copy = folder / path.name
    shutil.copy2(path, copy)
    return ctypes.CDLL(str(copy))


class Model:
    """A compiled model's library loaded with ctypes (Project.load()). Calls are not
    thread-safe; close() (or a with-block) frees the model's device memory."""

    def __init__(
        self,
        library: Path,
        weights: Path,
        *,
        prefix: str,
        inputs: list[TensorSpec],
        outputs: list[TensorSpec],
        target: str,
        state: list[TensorSpec] | None = None,
        train_inputs: list[TensorSpec] | None = None,
        ranks: int = 1,
        state_entries: Sequence[Mapping[str, Any]] = (),
        mesh: Sequence[int] = (),
        symbols: Sequence[Mapping[str, Any]] = (),
        input_entries: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        # run()'s inputs and outputs (a training program's: its inference with the current
        # parameters), and train_step()'s inputs (the batch and the labels).
        self.inputs, self.outputs, self.target = inputs, outputs, target
        self.train_inputs = list(train_inputs or [])
        # A training step's state, which the model keeps (read_state, save_checkpoint, ...).
        self.state = list(state or [])
        self._handle: ctypes.c_void_p | None = None
        self.ranks = ranks
        # A multi-rank program's create() reads weights.rank<R>.bin beside the name given.
        shown_weights = weights.with_name(f"{weights.stem}.rank0{weights.suffix}")
        if not (weights if ranks == 1 else shown_weights).is_file():
            raise InputError(
                f"{weights}: no such weights file", hint="give a weights file flowc wrote"
            )
        try:
            lib = _load_library(library)
        except OSError as e:
            raise FlowcError(f"{library}: cannot be loaded ({e})") from None
        fn = lambda name: getattr(lib, prefix + name)  # noqa: E731
        self._create = fn("create")
        self._create.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
        self._run = fn("run")
        self._run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._sync = fn("synchronize")
        self._sync.argtypes = [ctypes.c_void_p]
        self._destroy = fn("destroy")
        self._destroy.argtypes = [ctypes.c_void_p]
        self._destroy.restype = None
        self._last_error = fn("last_error")
        self._last_error.argtypes = [ctypes.c_void_p]
        self._last_error.restype = ctypes.c_char_p
        names = fn("input_name")
        names.restype = ctypes.c_char_p
        out_names = fn("output_name")
        out_names.restype = ctypes.c_char_p
        if [names(i).decode() for i in range(fn("num_inputs")())] != [s.name for s in inputs] or [
            out_names(i).decode() for i in range(fn("num_outputs")())
        ] != [s.name for s in outputs]:
            raise FlowcError(
                f"{library}: its inputs and outputs are not the project's",
                hint="rebuild the project: `flowc build`",
            )
        self._lib = lib
        self._prefix = prefix
        if self.state:
            state_name = fn("state_name")
            state_name.restype = ctypes.c_char_p
            train_name = fn("train_input_name")
            train_name.restype = ctypes.c_char_p
            if [state_name(i).decode() for i in range(fn("num_state")())] != [
                s.name for s in self.state
            ] or [train_name(i).decode() for i in range(fn("num_train_inputs")())] != [
                s.name for s in self.train_inputs
            ]:
                raise FlowcError(
                    f"{library}: its training state is not the project's",
                    hint="rebuild the project: `flowc build`",
                )
        handle = ctypes.c_void_p()
        status = self._create(os.fsencode(weights), ctypes.byref(handle))
        if status != 0:
            text = self._last_error(handle) if handle else None
            raise FlowcError(
                "the compiled model could not be created: "
                + (text.decode("utf-8", "replace") if text else f"status {status}")
            )
        self._handle = handle
        self._cuda = _CudaRuntime() if target == "cuda" else None
        rank = fn("rank")
        rank.argtypes = [ctypes.c_void_p]
        self.rank = int(rank(handle))
        # A library from before these calls has one rank and needs neither.
        self._finish = getattr(lib, prefix + "finish", None)
        self._abort_all = getattr(lib, prefix + "abort_all", None)
        if self._abort_all is not None:
            self._abort_all.argtypes = [ctypes.c_int]
        self._all_ok = getattr(lib, prefix + "all_ok", None)
        if self._all_ok is not None:
            self._all_ok.argtypes = [ctypes.c_int]
        # Each state tensor as this rank holds it (read_local, sharded checkpoints).
        self._state_entries = {str(e["name"]): e for e in state_entries}
        self.mesh = tuple(int(d) for d in mesh)
        self.shards = {s.name: self.shard_on(s.name, self.rank) for s in self.state}
        # A program with symbolic dims (docs/dynamic.md): run() takes each input at its own
        # size in range (run_shaped) and gives each output at the run's (output_dims);
        # ``inputs``/``outputs`` above are at the bound.
        self.symbols = [dict(s) for s in symbols]
        self._input_entries = [dict(e) for e in input_entries]
        if self.symbols:
            self._run_shaped = fn("run_shaped")
            self._run_shaped.argtypes = [ctypes.c_void_p] * 5
            self._output_dims = fn("output_dims")
            self._output_dims.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]

    def shard_on(self, name: str, rank: int) -> StateShard:
        """State tensor ``name`` as rank ``rank`` holds it."""
        entry = self._state_entries.get(name)
        if entry is None:
            spec = self.state[self._state_index(name)]
            return StateShard(name, spec.shape, spec.dtype, -1, 1, 0, rank == 0)
        return state_shard(entry, self.mesh, rank)

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank's ``ok`` is true (an all-reduce every rank makes; one rank:
        ``ok``)."""
        if self.ranks == 1 or self._all_ok is None:
            return ok
        return bool(self._all_ok(1 if ok else 0))

    def abort_all(self, exit_code: int) -> None:
        """End every rank of a multi-rank job (this process too)."""
        if self._abort_all is not None:
            self._abort_all(exit_code)
        raise SystemExit(exit_code)

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Free the model (waits for its latest run first)."""
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._destroy(handle)
            if self.ranks > 1 and self._finish is not None:
                self._finish()  # the communicators, and MPI if create() started it

    def _error(self, what: str) -> FlowcError:
        text = self._last_error(self._handle) or b""
        return FlowcError(f"{what}: {text.decode('utf-8', 'replace')}")

    def run(
        self,
        inputs: Mapping[str, Any],
        *,
        outputs: Mapping[str, Any] | None = None,
        stream: int | None = None,
    ) -> dict[str, Any]:
        """Run the model once and wait for it; returns {output name: array}. A training
        program's run() is the model's inference with the parameters as the latest step (or
        load_checkpoint, write_state) left them.

        ``inputs``: an array per input name: NumPy arrays (copied as needed), or arrays in
        the device's memory exposing ``__cuda_array_interface__`` or ``__dlpack__`` (CuPy,
        PyTorch; on the host target device memory is host memory, so CPU DLPack arrays
        qualify), used in place: dense in C order, aligned to 256 bytes, of the declared
        type and shape. ``outputs``: optional device arrays to write the outputs into
        (returned as given); without them the outputs come back as NumPy arrays. ``stream``:
        the cudaStream_t (an int) the run is queued on (None: the default stream); the
        caller orders the work that produced device inputs before it (the same stream, or an
        event)."""
        if self._handle is None:
            raise FlowcError("the model is closed")
        _check_names(inputs, [{"name": s.name} for s in self.inputs])
        if self.symbols:
            return self._run_sized(inputs, outputs, stream)
        keep: list[Any] = []
        in_ptrs = [self._input(spec, inputs, keep) for spec in self.inputs]
        if outputs is not None:
            unknown = [k for k in outputs if k not in {s.name for s in self.outputs}]
            if unknown:
                raise InputError(f"outputs: the model has no output named {unknown[0]!r}")
        out_bufs = [self._output(spec, outputs, keep) for spec in self.outputs]
        in_array = (ctypes.c_void_p * max(1, len(in_ptrs)))(*in_ptrs)
        out_array = (ctypes.c_void_p * max(1, len(out_bufs)))(*(b.ptr for b in out_bufs))
        self._wait(self._run(self._handle, in_array, out_array, ctypes.c_void_p(stream or 0)))
        results: dict[str, Any] = {}
        for spec, buf in zip(self.outputs, out_bufs, strict=True):
            if outputs is not None and spec.name in outputs:
                results[spec.name] = outputs[spec.name]
            elif buf.device and self._cuda is not None:
                host = np.empty(spec.shape, spec.dtype)
                self._cuda.copy_to_host(host, buf.ptr)
                results[spec.name] = host
            else:
                results[spec.name] = buf.keep
        _free_device(keep)
        return results

    def _wait(self, status: int) -> None:
        """After run()'s call: its status, then the run's own (synchronize)."""
        if status != 0:
            raise self._error("run() refused")
        if self._sync(self._handle) != 0:
            raise self._error("the compiled model failed")

    def cuda_graph_status(self) -> str:
        """How the latest run() went out: "captured" (one CUDA Graph launch; a program with
        symbolic dims: its size bucket's graph), "not captured yet", "direct: WHY" or "off"
        (compiled with --no-cuda-graph, or on a mesh)."""
        if self._handle is None:
            raise FlowcError("the model is closed")
        status = getattr(self._lib, self._prefix + "cuda_graph_status")
        status.argtypes = [ctypes.c_void_p]
        status.restype = ctypes.c_char_p
        return (status(self._handle) or b"").decode("utf-8", "replace")

    def _run_sized(
        self, inputs: Mapping[str, Any], outputs: Mapping[str, Any] | None, stream: int | None
    ) -> dict[str, Any]:
        """run() of a program with symbolic dims: each input at its own size (in range, the
        same size wherever a symbol appears), the outputs at the run's."""
        if outputs:
            raise InputError(
                "outputs=: a model with symbolic dims gives its outputs back as arrays (their "
                "sizes are the run's)",
                hint="leave out outputs=",
            )
        host = {k: v for k, v in inputs.items() if isinstance(v, np.ndarray | list | tuple)}
        check_feeds(
            {k: np.asarray(v) for k, v in host.items()},
            [e for e in self._input_entries if e["name"] in host],
            self.symbols,
        )
        keep: list[Any] = []
        dims = []
        for spec in self.inputs:
            value = inputs[spec.name]
            shape = tuple(int(d) for d in getattr(value, "shape", np.shape(value)))
            if len(shape) != len(spec.shape):
                raise InputError(
                    f"input {spec.name!r}: expected {len(spec.shape)} dims, got {list(shape)}"
                )
            dims.append((ctypes.c_int64 * max(1, len(shape)))(*shape))
            keep.append(dims[-1])
        in_ptrs = [
            self._input(
                TensorSpec(spec.name, tuple(d[: len(spec.shape)]), spec.dtype), inputs, keep
            )
            for spec, d in zip(self.inputs, dims, strict=True)
        ]
        # (the outputs' buffers hold the bound; the run fills a prefix)
        out_bufs = [self._output(spec, None, keep) for spec in self.outputs]
        in_array = (ctypes.c_void_p * max(1, len(in_ptrs)))(*in_ptrs)
        dim_array = (ctypes.c_void_p * max(1, len(dims)))(
            *(ctypes.cast(d, ctypes.c_void_p) for d in dims)
        )
        out_array = (ctypes.c_void_p * max(1, len(out_bufs)))(*(b.ptr for b in out_bufs))
        self._wait(
            self._run_shaped(
                self._handle, in_array, dim_array, out_array, ctypes.c_void_p(stream or 0)
            )
        )
        results: dict[str, Any] = {}
        for k, (spec, buf) in enumerate(zip(self.outputs, out_bufs, strict=True)):
            got = (ctypes.c_int64 * max(1, len(spec.shape)))()
            rank = self._output_dims(self._handle, k, got)
            if rank != len(spec.shape):
                raise self._error(f"output_dims({k})")
            shape = tuple(got[:rank])
            n = math.prod(shape)
            if buf.device and self._cuda is not None:
                out = np.empty(shape, spec.dtype)
                self._cuda.copy_to_host(out, buf.ptr)
                results[spec.name] = out
            else:
                results[spec.name] = np.asarray(buf.keep).reshape(-1)[:n].reshape(shape).copy()
        _free_device(keep)
        return results

    # -- training (a program compiled with --train; model.h's training section) -----------

    def _train_fn(self, name: str, *argtypes: Any) -> Any:
        if self._handle is None:
            raise FlowcError("the model is closed")
        if not self.state:
            raise InputError(
                f"{name}: the model is no training step",
                hint="compile it with `flowc compile --train`",
            )
        f = getattr(self._lib, self._prefix + name)
        f.argtypes = [ctypes.c_void_p, *argtypes]
        return f

    def _state_index(self, name: str) -> int:
        for k, s in enumerate(self.state):
            if s.name == name:
                return k
        raise InputError(
            f"the model keeps no state named {name!r}",
            hint="its state: " + ", ".join(repr(s.name) for s in self.state[:6]) + " ...",
        )

    def read_state(self, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """The state the model keeps (all of it, or the tensors ``names``), copied to host
        arrays after the latest step has ended."""
        f = self._train_fn("state_read", ctypes.c_int, ctypes.c_void_p)
        out = {}
        for name in self.state_names() if names is None else names:
            spec = self.state[self._state_index(name)]
            a = np.empty(spec.shape, spec.dtype)
            if f(self._handle, self._state_index(name), a.ctypes.data) != 0:
                raise self._error("reading the state")
            out[name] = a
        return out

    def write_state(self, values: Mapping[str, Any]) -> None:
        """Set state tensors (by name) from host arrays of their shapes and types."""
        f = self._train_fn("state_write", ctypes.c_int, ctypes.c_void_p)
        for name, value in values.items():
            k = self._state_index(name)
            spec = self.state[k]
            # np.array, not ascontiguousarray, which makes a scalar 1-D.
            a = np.array(value, dtype=spec.dtype, order="C")
            if a.shape != spec.shape:
                raise InputError(
                    f"state {name!r}: expected shape {list(spec.shape)}, got {list(a.shape)}"
                )
            if f(self._handle, k, a.ctypes.data) != 0:
                raise self._error("writing the state")

    def read_local(self, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """This rank's part of each state tensor (``shards``: where it sits in the whole),
        with no communication: a sharded checkpoint's writes."""
        f = self._train_fn("state_read_local", ctypes.c_int, ctypes.c_void_p)
        out = {}
        for name in self.state_names() if names is None else names:
            shard = self.shards[name]
            a = np.empty(shard.local_shape, shard.dtype)
            self._check_local(name, a.nbytes)
            if f(self._handle, self._state_index(name), a.ctypes.data) != 0:
                raise self._error("reading the state")
            out[name] = a
        return out

    def write_local(self, values: Mapping[str, Any]) -> None:
        """Set this rank's part of state tensors (by name; arrays of ``local_shape``)."""
        f = self._train_fn("state_write_local", ctypes.c_int, ctypes.c_void_p)
        for name, value in values.items():
            k = self._state_index(name)
            shard = self.shards[name]
            a = np.array(value, dtype=shard.dtype, order="C")
            if a.shape != shard.local_shape:
                raise InputError(
                    f"state {name!r}: this rank's part is {list(shard.local_shape)}, "
                    f"got {list(a.shape)}"
                )
            self._check_local(name, a.nbytes)
            if f(self._handle, k, a.ctypes.data) != 0:
                raise self._error("writing the state")

    def _check_local(self, name: str, nbytes: int) -> None:
        if not self.shards[name].held:
            raise InputError(f"state {name!r} is held by another pipeline stage than this rank's")
        held = getattr(self._lib, self._prefix + "state_held_nbytes", None)
        if held is not None:
            # This rank's bytes of it (a pipeline stage's program holds its own).
            held.argtypes, held.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_ulonglong
            have = int(held(self._handle, self._state_index(name)))
        else:
            f = getattr(self._lib, self._prefix + "state_local_nbytes")
            f.argtypes, f.restype = [ctypes.c_int], ctypes.c_ulonglong
            have = int(f(self._state_index(name)))
        if have != nbytes:
            raise FlowcError(
                f"state {name!r}: the library's part is {have} bytes, the project's {nbytes}",
                hint="rebuild the project: `flowc build`",
            )

    def train_step(self, inputs: Mapping[str, Any]) -> tuple[float, float, float]:
        """One training step on a batch (model.h's train_step(), then synchronize()): the
        state is updated in place on the device; returns (loss, label count, learning rate
        used). ``inputs``: the batch, as run()'s, and the loss's labels (``train_inputs``)."""
        f = self._train_fn("train_step", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        _check_names(inputs, [{"name": s.name} for s in self.train_inputs])
        keep: list[Any] = []
        try:
            ptrs = [self._input(spec, inputs, keep) for spec in self.train_inputs]
            array = (ctypes.c_void_p * max(1, len(ptrs)))(*ptrs)
            if f(self._handle, array, None, None) != 0:
                raise self._error("train_step() refused")
            if self._sync(self._handle) != 0:
                raise self._error("the training step failed")
        finally:
            _free_device(keep)
        result = self._train_fn("train_result", *[ctypes.POINTER(ctypes.c_double)] * 3)
        loss, count, lr = ctypes.c_double(), ctypes.c_double(), ctypes.c_double()
        result(self._handle, ctypes.byref(loss), ctypes.byref(count), ctypes.byref(lr))
        return loss.value, count.value, lr.value

    def loss_scaling(self) -> tuple[float, bool]:
        """fp16's loss scaling at the latest step: the scale it used, and whether it was
        skipped (gradients not all finite); (0.0, False) without loss scaling."""
        f = self._train_fn("train_scaling", *[ctypes.POINTER(ctypes.c_double)] * 2)
        scale, skipped = ctypes.c_double(), ctypes.c_double()
        f(self._handle, ctypes.byref(scale), ctypes.byref(skipped))
        return scale.value, skipped.value != 0.0

    def state_names(self) -> list[str]:
        return [s.name for s in self.state]

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """All the state into one file (model.h's save(): temporary file, then rename)."""
        f = self._train_fn("save", ctypes.c_char_p)
        if f(self._handle, os.fsencode(path)) != 0:
            raise self._error("saving the checkpoint")

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """The state from a file save_checkpoint() (or the C API's save()) wrote for this
        program; another model's, or a damaged file, is refused and changes nothing."""
        f = self._train_fn("load", ctypes.c_char_p)
        if f(self._handle, os.fsencode(path)) != 0:
            raise self._error("loading the checkpoint")

    @property
    def lr(self) -> float:
        """The base learning rate (the schedule scales it each step); settable."""
        f = self._train_fn("get_lr", ctypes.POINTER(ctypes.c_double))
        v = ctypes.c_double()
        if f(self._handle, ctypes.byref(v)) != 0:
            raise self._error("reading the learning rate")
        return v.value

    @lr.setter
    def lr(self, value: float) -> None:
        f = self._train_fn("set_lr", ctypes.c_double)
        if f(self._handle, float(value)) != 0:
            raise self._error("setting the learning rate")

    def _inputs_with(self, spec: TensorSpec) -> list[TensorSpec]:
        """run()'s inputs, or train_step()'s when ``spec`` is only one of those."""
        return self.inputs if spec in self.inputs else self.train_inputs

    def _input(self, spec: TensorSpec, inputs: Mapping[str, Any], keep: list[Any]) -> int:
        what = f"input {spec.name!r}"
        if spec.name not in inputs:
            raise InputError(
                f"{what} is not given",
                hint="the model's inputs are: "
                + ", ".join(repr(s.name) for s in self._inputs_with(spec)),
            )
        value = inputs[spec.name]
        if not isinstance(value, np.ndarray):
            found = _interface_pointer(value, spec, what, writable=False)
            if found is not None:
                keep.append(value)
                return self._device_pointer(found, what)
        a = np.asarray(value)
        check_feeds(
            {spec.name: a},
            [
                {
                    "name": spec.name,
                    "shape": list(spec.shape),
                    "dtype": DType.from_numpy(spec.dtype).short,
                }
            ],
        )
        staged = _aligned_empty(spec)
        staged[...] = a
        keep.append(staged)
        if self._cuda is None:
            return int(staged.ctypes.data)
        device = self._cuda.alloc(spec.nbytes)
        keep.append(device)
        self._cuda.copy_to_device(device.ptr, staged)
        return device.ptr

    def _output(
        self, spec: TensorSpec, outputs: Mapping[str, Any] | None, keep: list[Any]
    ) -> _Buffer:
        if outputs is not None and spec.name in outputs:
            what = f"output {spec.name!r}"
            value = outputs[spec.name]
            if isinstance(value, np.ndarray):
                if self._cuda is not None:
                    raise InputError(f"{what}: a NumPy array is not device memory")
                _check_layout(what, spec, value.dtype, value.shape, value.strides)
                if not value.flags.writeable:
                    raise InputError(f"{what}: the array is read-only")
                return _Buffer(self._device_pointer((int(value.ctypes.data), False), what), value)
            found = _interface_pointer(value, spec, what, writable=True)
            if found is None:
                raise InputError(
                    f"{what}: expected an array exposing __cuda_array_interface__ or __dlpack__"
                )
            return _Buffer(self._device_pointer(found, what), value, device=True)
        if self._cuda is None:
            staged = _aligned_empty(spec)
            return _Buffer(int(staged.ctypes.data), staged)
        device = self._cuda.alloc(spec.nbytes)
        keep.append(device)
        return _Buffer(device.ptr, device, device=True)

    def _device_pointer(self, found: tuple[int, bool], what: str) -> int:
        ptr, on_device = found
        if self._cuda is not None and not on_device:
            raise InputError(
                f"{what}: the array is in host memory; this model runs on the GPU",
                hint="pass a NumPy array (copied for you) or a CUDA array",
            )
        if ptr % ALIGN:
            raise InputError(
                f"{what}: the array's memory is {ptr % ALIGN} bytes past a {ALIGN}-byte "
                "boundary; run() takes 256-byte aligned buffers",
                hint="pass a fresh allocation (cudaMalloc, CuPy and PyTorch give 256)",
            )
        return ptr


class _DeviceAllocation:
    def __init__(self, runtime: _CudaRuntime, ptr: int) -> None:
        self.runtime, self.ptr = runtime, ptr

    def free(self) -> None:
        if self.ptr:
            self.runtime.lib.cudaFree(ctypes.c_void_p(self.ptr))
            self.ptr = 0


def _free_device(keep: list[Any]) -> None:
    """The device buffers a run() allocated for NumPy inputs and outputs."""
    for item in keep:
        if isinstance(item, _DeviceAllocation):
            item.free()


class _CudaRuntime:
    """The CUDA runtime's allocation and copy calls, through ctypes (the NumPy inputs and
    outputs of a cuda model; device arrays are used in place)."""

    def __init__(self) -> None:
        from flowc.toolchain import cudart_library

        path = cudart_library()
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as e:
            raise FlowcError(f"the CUDA runtime ({path}) cannot be loaded ({e})") from None

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            name = self.lib.cudaGetErrorString
            name.restype = ctypes.c_char_p
            raise FlowcError(f"{what} failed: {name(status).decode()}")

    def alloc(self, nbytes: int) -> _DeviceAllocation:
        ptr = ctypes.c_void_p()
        self._check(
            self.lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(max(1, nbytes))), "cudaMalloc"
        )
        return _DeviceAllocation(self, int(ptr.value or 0))

    def copy_to_device(self, dst: int, src: np.ndarray) -> None:
        self._check(
            self.lib.cudaMemcpy(
                ctypes.c_void_p(dst),
                ctypes.c_void_p(src.ctypes.data),
                ctypes.c_size_t(src.nbytes),
                1,
            ),
            "cudaMemcpy to the device",
        )

    def copy_to_host(self, dst: np.ndarray, src: int) -> None:
        self._check(
            self.lib.cudaMemcpy(
                ctypes.c_void_p(dst.ctypes.data),
                ctypes.c_void_p(src),
                ctypes.c_size_t(dst.nbytes),
                2,
            ),
            "cudaMemcpy to the host",
        )
