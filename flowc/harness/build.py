"""Build a generated project with CMake and run its driver on .npy inputs."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flowc.atomic_file import write_file_atomic
from flowc.codegen.project import open_project
from flowc.errors import FlowcError, InputError
from flowc.harness.processes import run_group
from flowc.ir.dtype import DType
from flowc.toolchain import find_cuda

# Written into a build folder when its build succeeded: what the build was made from.
STAMP = "flowc-build.json"


class BuildError(FlowcError):
    """The generated project did not build; the compiler's output is in the message."""


def raw_npy(a: np.ndarray) -> np.ndarray:
    """``a`` as the driver reads it: ml_dtypes arrays (bfloat16, float8, int4, ...) have no
    NumPy descr, so they travel as raw bytes (V1/V2), one item per element."""
    try:
        if np.dtype(a.dtype.str) == a.dtype:
            return a
    except TypeError:  # float8_e5m2 says '<f1', which NumPy cannot read back
        pass
    return a.view(f"V{a.dtype.itemsize}")


def from_raw_npy(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """An array the driver wrote, viewed as the output's declared type (see raw_npy)."""
    return a.view(dtype) if a.dtype.kind == "V" else a


def shown(out: Path) -> str:
    """OUT as a command line the user can paste spells it."""
    return shlex.quote(str(out))


def sources_digest(out: Path) -> str:
    """What a build of OUT is made from: the SHA-256 of its manifest and of every file the
    manifest lists but the weights (those are read when the program starts, not compiled
    in). A recompile that changes the program, or a hand edit of model.cu, changes it."""
    h = hashlib.sha256()
    manifest_path = out / "flowc_model.json"
    manifest = manifest_path.read_bytes()
    h.update(manifest)
    try:
        listed = sorted(json.loads(manifest).get("sha256", {}))
    except (ValueError, AttributeError):
        listed = []
    for name in listed:
        h.update(b"\0" + name.encode("utf-8") + b"\0")
        try:
            h.update(hashlib.sha256((out / name).read_bytes()).digest())
        except OSError:
            h.update(b"missing")
    return h.hexdigest()


def _target_label(target: str, sanitize: Sequence[str]) -> str:
    return "-".join([target, *(SANITIZERS[s] for s in sanitize)])


def _build_command(out: Path, target: str, sanitize: Sequence[str]) -> str:
    flags = f" --sanitize {','.join(sanitize)}" if sanitize else ""
    return f"flowc build {shown(out)} --target {target}{flags}"


def check_built(out: Path, target: str, sanitize: str | Sequence[str] | None = None) -> None:
    """Refuse to run OUT's ``target`` build when there is none, when it is incomplete (an
    interrupted build) or when the project changed since (a recompile without a rebuild):
    each says which, and the command that fixes it."""
    sanitizers = parse_sanitize(sanitize)
    bdir = build_dir(out, target, sanitizers)
    fix = _build_command(out, target, sanitizers)
    label = _target_label(target, sanitizers)
    if not (bdir / "model_main").is_file():
        others = [
            t for t in ("host", "cuda") if t != target and (build_dir(out, t) / STAMP).is_file()
        ]
        if others:
            raise InputError(
                f"{shown(out)} is built for {others[0]} only, not for {label}",
                hint=f"run it with --target {others[0]}, or build it for {label}: {fix}",
            )
        raise InputError(f"{shown(out)} is not built for {label}", hint=f"build it: {fix}")
    try:
        stamp = json.loads((bdir / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        stamp = None
    if not isinstance(stamp, dict) or "sources" not in stamp:
        raise InputError(
            f"{shown(out)}: its {label} build is incomplete (interrupted) or from an older flowc",
            hint=f"rebuild it: {fix}",
        )
    if stamp["sources"] != sources_digest(out):
        raise StaleBuild(
            f"{shown(out)} changed since its {label} build (recompiled or edited)",
            hint=f"rebuild it: {fix} (or run with --rebuild)",
        )


class StaleBuild(InputError):
    """The project changed since its build: `flowc build` it again."""


SANITIZERS = {"address": "asan", "undefined": "ubsan"}


def parse_sanitize(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """The sanitizers named by ``value`` ("address", "undefined", "address,undefined" or a
    sequence of those), in a canonical order; () for none."""
    if not value:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    names = [s.strip() for s in items]
    unknown = [s for s in names if s not in SANITIZERS]
    if unknown:
        raise InputError(
            f"--sanitize {','.join(names)}: unknown sanitizer {unknown[0]!r}",
            hint="use address, undefined, or address,undefined",
        )
    return tuple(s for s in SANITIZERS if s in names)


def build_dir(out: Path, target: str, sanitize: str | Sequence[str] | None = None) -> Path:
    """Where OUT is built for ``target``: a sanitized build has its own directory
    (build-host-asan, build-host-ubsan, build-host-asan-ubsan), so it never mixes with the
    normal one."""
    tags = [SANITIZERS[s] for s in parse_sanitize(sanitize)]
    return out / "-".join([f"build-{target}", *tags])


# Sanitizer settings for running a sanitized build: every report ends the run with a failure
# and leaks are reported. Whatever the user's own ASAN_OPTIONS/UBSAN_OPTIONS say comes after
# these, and the sanitizers read options left to right, so the user's win.
_SANITIZER_OPTIONS = {
    "address": (
        "ASAN_OPTIONS",
        "halt_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:abort_on_error=0",
    ),
    "undefined": ("UBSAN_OPTIONS", "halt_on_error=1:print_stacktrace=1"),
}


def sanitizer_env(sanitize: str | Sequence[str] | None, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the options a run of a build sanitized with ``sanitize`` needs."""
    result = dict(env)
    for s in parse_sanitize(sanitize):
        var, ours = _SANITIZER_OPTIONS[s]
        user = env.get(var, "")
        result[var] = f"{ours}:{user}" if user else ours
    return result


def build(
    out: Path,
    target: str = "host",
    progress: Callable[[str], None] | None = None,
    jobs: int = 2,
    quick: bool = False,
    sanitize: str | Sequence[str] | None = None,
) -> Path:
    """Configure and build OUT for ``target``; returns the build directory. ``quick`` builds
    host code with -O1 instead of the Release flags (about a third less compile time), for
    programs that are run once to check their results (the conformance runner) or only
    compiled and linked (a CUDA build: nvcc's host-side code at -O1, most of its time; the
    device code keeps nvcc's optimization). ``sanitize``
    ("address", "undefined" or both, comma-separated) builds the host program with those
    sanitizers, at -O1, into its own directory (see build_dir). A swap an interrupted
    compile left in OUT/ is finished or rolled back first (codegen/project.py).

    A build that ends early (Ctrl-C, a compiler error) leaves no STAMP, so nothing runs what
    it left; an interrupted build also removes what it wrote (the whole build folder when it
    made it, else its objects and binaries), so a rerun starts clean."""
    recover(out)
    if not (out / "CMakeLists.txt").is_file():
        raise InputError(f"{out}: no CMakeLists.txt here; create the project with `flowc compile`")
    if target not in ("host", "cuda"):
        raise InputError(f"--target {target}: expected host or cuda")
    sanitizers = parse_sanitize(sanitize)
    if sanitizers and target != "host":
        raise InputError(
            f"--sanitize {','.join(sanitizers)} works on the host target only, not {target}",
            hint=f"build with --target host --sanitize {','.join(sanitizers)}",
        )
    bdir = build_dir(out, target, sanitizers)
    fresh = not bdir.exists()
    (bdir / STAMP).unlink(missing_ok=True)  # from here until the end, not a finished build
    args = [
        "cmake",
        "-S",
        str(out),
        "-B",
        str(bdir),
        f"-DFLOWC_TARGET={target}",
        # A configuration of its own: an empty CMAKE_BUILD_TYPE would become Release in the
        # generated CMakeLists.txt, whose -O3 then follows (and beats) an -O1 in CXX_FLAGS.
        *(
            ["-DCMAKE_BUILD_TYPE=Quick", "-DCMAKE_CXX_FLAGS_QUICK=-O1"]
            + (["-DCMAKE_CUDA_FLAGS_QUICK=-O1"] if target == "cuda" else [])
            if quick
            else ["-DCMAKE_BUILD_TYPE=Release"]
        ),
        # Always given, so reconfiguring an existing directory cannot keep a stale value.
        f"-DFLOWC_SANITIZE={','.join(sanitizers)}",
    ]
    if target == "cuda":
        tk = find_cuda()
        needed = ["cublasLt", "cudnn"] + (["nccl"] if num_ranks(out) > 1 else [])
        missing = tk.missing(needed)
        if missing:
            raise BuildError(
                f"the CUDA build needs {', '.join(missing)}, not found on this machine"
            )
        assert tk.nvcc is not None
        libdirs = sorted({str(tk.libs[n].lib_dir) for n in needed})
        incdirs = sorted({str(tk.libs[n].include_dir) for n in needed})
        args += [
            f"-DCMAKE_CUDA_COMPILER={tk.nvcc}",
            f"-DFLOWC_CUDA_LIB_DIRS={';'.join(libdirs)}",
            f"-DFLOWC_CUDA_INCLUDE_DIRS={';'.join(incdirs)}",
        ]
    steps = [
        ("configure", args),
        ("compile and link", ["cmake", "--build", str(bdir), "-j", str(jobs)]),
    ]
    log = []
    digest = sources_digest(out)  # before the compilers read the sources
    try:
        for what, cmd in steps:
            if progress:
                progress(f"{what} ({_target_label(target, sanitizers)})")
            t0 = time.perf_counter()
            r = run_group(cmd)
            log.append(r.stdout + r.stderr)
            if r.returncode != 0:
                tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-40:])
                raise BuildError(f"{what} of {shown(out)} for {target} failed:\n{tail}")
            if progress:
                progress(f"{what} done in {time.perf_counter() - t0:.1f} s")
    except KeyboardInterrupt:
        _remove_partial_build(bdir, fresh)
        raise
    # The compiler's full output, kept so warnings can be read (tests require none).
    write_file_atomic(bdir / "flowc-build.log", "\n".join(log).encode("utf-8"))
    stamp = {"version": 1, "sources": digest, "target": target, "sanitize": list(sanitizers)}
    write_file_atomic(bdir / STAMP, (json.dumps(stamp, indent=1) + "\n").encode("utf-8"))
    return bdir


def _remove_partial_build(bdir: Path, fresh: bool) -> None:
    """What an interrupted build wrote: the build folder when this build made it; else the
    objects, libraries and programs in it (a compiler killed mid-write can leave an object
    newer than its source, which make would then link)."""
    if fresh:
        shutil.rmtree(bdir, ignore_errors=True)
        return
    for path in bdir.rglob("*"):
        if path.is_file() and (path.suffix in (".o", ".so", ".a") or path.name == "model_main"):
            path.unlink(missing_ok=True)


def recover(out: Path) -> None:
    """Finish or roll back a swap an interrupted compile left in OUT/, under OUT/'s lock
    (released before the build or run: those only read the project)."""
    with open_project(out):
        pass


def project_info(out: Path) -> dict[str, object]:
    """The project's flowc_model.json; a clear error for a folder that is no flowc project."""
    path = out / "flowc_model.json"
    if not out.is_dir():
        raise InputError(
            f"{out}: no such project folder", hint="create one with `flowc compile MODEL -o DIR`"
        )
    if not path.is_file():
        raise InputError(
            f"{out}: not a flowc project (no flowc_model.json)",
            hint="create one with `flowc compile MODEL -o DIR`",
        )
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(
            f"{path}: unreadable ({e})", hint="recreate the project with `flowc compile`"
        ) from None
    if not isinstance(info, dict) or not all(
        isinstance(info.get(k), list) for k in ("inputs", "outputs")
    ):
        raise InputError(
            f"{path}: not a flowc project description (no inputs/outputs lists)",
            hint="recreate the project with `flowc compile`",
        )
    return info


def num_ranks(out: Path) -> int:
    mesh = project_info(out).get("mesh") or []
    assert isinstance(mesh, list)
    return math.prod(int(d) for d in mesh)


def launcher(ranks: int, target: str) -> tuple[list[str], dict[str, str]]:
    """The mpirun prefix and environment for a program of ``ranks`` ranks ([] for one).
    On the host target ranks share the machine's cores: oversubscribe, one thread each."""
    if ranks <= 1:
        return [], {}
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise InputError(
            f"this program runs on {ranks} ranks and needs mpirun, which is not on PATH",
            hint="install Open MPI (Debian: openmpi-bin)",
        )
    cmd = [mpirun, "-np", str(ranks)]
    env = {}
    if target == "host":
        cmd.append("--oversubscribe")
        env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    if os.geteuid() == 0:
        # Open MPI refuses to start as root without both of these.
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return cmd, env


def _output_files(results_dir: Path, outputs: list[dict[str, object]]) -> list[str]:
    """The file of each output, in order, from the driver's outputs.json (files are named
    after the outputs, sanitized, so only the map says which is which)."""
    try:
        listed = json.loads((results_dir / "outputs.json").read_text(encoding="utf-8"))["outputs"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FlowcError(
            f"the compiled model wrote no readable {results_dir / 'outputs.json'} ({e})",
            hint="a project from an older flowc writes none; recreate it with `flowc compile`",
        ) from None
    files = {}
    for entry in listed:
        k = entry["index"]
        if not 0 <= k < len(outputs) or entry["name"] != outputs[k]["name"]:
            raise FlowcError(
                f"{results_dir / 'outputs.json'}: entry {entry!r} does not match the project's "
                "outputs (flowc_model.json)",
                hint="rebuild the project: `flowc build`",
            )
        files[k] = str(entry["file"])
    if sorted(files) != list(range(len(outputs))):
        raise FlowcError(f"{results_dir / 'outputs.json'} does not list every output")
    return [files[k] for k in range(len(outputs))]


def bench_figures(stdout: str) -> dict[str, Any]:
    """The figures of ``model_main --bench N`` from its stdout: the object of its JSON line
    ``{"bench": {...}}`` (docs/codegen.md, "The driver")."""
    for line in stdout.splitlines():
        if line.startswith('{"bench":'):
            try:
                figures = json.loads(line)["bench"]
            except (ValueError, KeyError, TypeError):
                break
            if isinstance(figures, dict) and figures.get("version") == 1:
                return figures
            break
    raise FlowcError(
        "the compiled model printed no benchmark figures flowc can read",
        hint="a project built by an older flowc prints others; rebuild it with `flowc build`",
    )


def check_feeds(
    feeds: Mapping[str, Any],
    inputs: Sequence[Mapping[str, Any]],
    symbols: Sequence[Mapping[str, Any]] = (),
) -> None:
    """Every input given, of its declared type and shape (array-likes with ``dtype`` and
    ``shape``); the messages the command line and the Python API share. A program with
    symbolic dims (``symbols``, flowc_model.json's) takes any size in range where an input's
    ``dims`` names a symbol, the same size wherever the symbol appears."""
    ranges = {str(s["name"]): (int(s["min"]), int(s["max"])) for s in symbols}
    sizes: dict[str, tuple[int, str]] = {}
    for spec in inputs:
        name = spec["name"]
        if name not in feeds:
            raise InputError(
                f"input {name!r} is not given",
                hint="the model's inputs are: " + ", ".join(repr(s["name"]) for s in inputs),
            )
        a = feeds[name]
        if not hasattr(a, "dtype") or not hasattr(a, "shape"):
            a = np.asarray(a)
        want = DType.from_short(spec["dtype"]).np
        got = np.dtype(a.dtype) if isinstance(a, np.ndarray) else a.dtype
        try:
            same_type = np.dtype(got).newbyteorder("=") == want
        except TypeError:
            same_type = False
        dims = spec.get("dims")
        if dims is not None and same_type:
            _check_dims(name, spec, list(a.shape), ranges, sizes)
            continue
        if not same_type or list(a.shape) != list(spec["shape"]):
            raise InputError(
                f"input {name!r}: expected {spec['dtype']}{list(spec['shape'])}, got "
                f"{got}{list(a.shape)}",
                hint=f"give the array as {want} with shape {list(spec['shape'])}",
            )


def _check_dims(
    name: str,
    spec: Mapping[str, Any],
    shape: list[int],
    ranges: Mapping[str, tuple[int, int]],
    sizes: dict[str, tuple[int, str]],
) -> None:
    """An input of symbolic dims: its rank, fixed dims, ranges, and the sizes other inputs
    gave the same symbols."""
    dims = list(spec["dims"])
    want = ", ".join(
        str(n) if d is None else f"{d}:{ranges[d][0]}..{ranges[d][1]}"
        for n, d in zip(spec["shape"], dims, strict=True)
    )
    expected = f"expected {spec['dtype']}[{want}], got {list(shape)}"
    if len(shape) != len(dims):
        raise InputError(f"input {name!r}: {expected}")
    for k, (n, d, got) in enumerate(zip(spec["shape"], dims, shape, strict=True)):
        if d is None:
            if got != n:
                raise InputError(f"input {name!r}: {expected} (dim {k} is fixed to {n})")
            continue
        lo, hi = ranges[d]
        if not lo <= got <= hi:
            raise InputError(
                f"input {name!r}: {expected} (dim {k}, {d}, is {got}: outside {lo}..{hi})",
                hint=f"the program was compiled for {d} in {lo}..{hi}",
            )
        prev = sizes.setdefault(d, (got, name))
        if prev[0] != got:
            raise InputError(
                f"input {name!r}: dim {k} ({d}) is {got}, but input {prev[1]!r} makes it {prev[0]}",
                hint="inputs that share a symbolic dim agree on its size",
            )


def run(
    out: Path,
    feeds: Mapping[str, np.ndarray],
    *,
    target: str = "host",
    weights: Path | None = None,
    env: Mapping[str, str] | None = None,
    bench: int = 0,
    sanitize: str | Sequence[str] | None = None,
    rebuild: bool = False,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict[str, np.ndarray], str]:
    """Run the built driver on ``feeds``; returns the outputs by name and the driver's stdout.
    A build that is missing, incomplete or older than the project is refused (check_built),
    or, with ``rebuild``, built first when the project changed since."""
    recover(out)
    info = project_info(out)
    try:
        check_built(out, target, sanitize)
    except StaleBuild:
        if not rebuild:
            raise
        if progress:
            progress(f"{shown(out)} changed since its {target} build: rebuilding")
        build(out, target, progress=progress, sanitize=sanitize)
    exe = build_dir(out, target, sanitize) / "model_main"
    inputs = info["inputs"]
    outputs = info["outputs"]
    assert isinstance(inputs, list) and isinstance(outputs, list)
    with tempfile.TemporaryDirectory(prefix="flowc-run-") as tmp:
        # A folder that does not exist yet: the driver makes it whole, or not at all.
        results_dir = Path(tmp) / "outputs"
        args = [
            str(exe),
            "--weights",
            str(weights or out / "weights.bin"),
            "--out-dir",
            str(results_dir),
        ]
        symbols = info.get("symbols") or []
        assert isinstance(symbols, list)
        check_feeds(feeds, inputs, symbols)
        # Paths the user never gave: the driver's messages name the input instead.
        scrub = {str(results_dir): "the outputs folder"}
        for k, spec in enumerate(inputs):
            name = spec["name"]
            a = np.asarray(feeds[name])
            want = DType.from_short(spec["dtype"]).np
            # The driver reads C-order little-endian .npy only.
            path = Path(tmp) / f"input_{k}.npy"
            np.save(path, raw_npy(np.array(a, dtype=want.newbyteorder("<"), order="C")))
            args += ["--input", f"{name}={path}"]
            scrub[str(path)] = f"(input {name!r})"
        if bench:
            args += ["--bench", str(bench)]
        prefix, launch_env = launcher(num_ranks(out), target)
        r = run_group(
            prefix + args, env=sanitizer_env(sanitize, {**os.environ, **launch_env, **(env or {})})
        )
        if r.returncode != 0:
            message = r.stderr.strip()
            for path_text, name_text in sorted(scrub.items(), key=lambda kv: -len(kv[0])):
                message = message.replace(path_text, name_text)
            raise FlowcError(f"the compiled model failed (exit {r.returncode}):\n{message}")
        files = _output_files(results_dir, outputs)
        results = {
            spec["name"]: from_raw_npy(
                np.load(results_dir / files[k]), DType.from_short(spec["dtype"]).np
            )
            for k, spec in enumerate(outputs)
        }
    return results, r.stdout
