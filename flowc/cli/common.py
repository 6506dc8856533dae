"""What the commands share besides their options: the consoles and progress lines, the
choice of target, reading --input arrays and writing OUT.npz."""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape

from flowc.atomic_file import Kind, atomic_write, check_output
from flowc.errors import FlowcError, InputError

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def progress(msg: str) -> None:
    """A ``flowc: ...`` line on stderr: what the command is doing now."""
    err.print(f"[dim]flowc:[/] {escape(msg)}")


def recording(base: Console) -> Console:
    """A console printing where ``base`` does and keeping the text for a report page (wide
    when not a terminal: tables are not squeezed to 80 columns)."""
    return Console(
        file=base.file,
        width=base.width if base.is_terminal else 160,
        highlight=False,
        soft_wrap=True,
        record=True,
    )


# -- the target --------------------------------------------------------------------------------


def choose_target(target: str | None, project: Path | None = None, sanitize: bool = False) -> str:
    """``target`` as given, or the one rule's default (flowc.toolchain.default_target: the
    ``project``'s recorded target, else cuda where a GPU is present, else host; a sanitized
    build is a host build); says which it chose, and why, in one line."""
    from flowc.api import resolve_target

    chosen, why = resolve_target(target, project, sanitize=sanitize)
    progress(f"target {chosen} ({why})")
    return chosen


def require_gpu(what: str) -> None:
    """Refuse to run a CUDA build on a machine the driver reports no GPU on, before any
    device call could fail with a misleading message (out of memory, no device)."""
    from flowc.toolchain import gpu_count

    if gpu_count() == 0:
        raise FlowcError(
            f"{what}: this machine has no GPU to run the CUDA build on",
            hint="use --target host here, or run on a machine with a GPU",
        )


# -- --input NAME=PATH.npy ---------------------------------------------------------------------


def _split_input(item: str, names: Sequence[str]) -> tuple[str, str]:
    # Names may contain '=', paths too: take the split whose left side names an input.
    for i, ch in enumerate(item):
        if ch == "=" and item[:i] in names:
            return item[:i], item[i + 1 :]
    name, sep, _ = item.partition("=")
    if not sep:
        raise InputError(f"--input {item!r}: expected NAME=PATH.npy")
    raise InputError(
        f"--input {item!r}: the model has no input named {name!r}",
        hint="its inputs are: " + ", ".join(map(repr, names)),
    )


def _read_npy(path: str, name: str) -> np.ndarray:
    from flowc.frontend.files import check_regular_file
    from flowc.frontend.npy import load_npy

    p = Path(path)
    if not p.exists():
        raise InputError(f"--input {name}: {p}: no such file")
    check_regular_file(p, f"--input {name}:", InputError)  # not a FIFO or /dev/zero
    if zipfile.is_zipfile(p):
        raise InputError(f"--input {name}: {p} holds several arrays; give one .npy per input")
    try:
        # The header is checked before NumPy reads it (dims past int64, a call in it, a
        # shape larger than the file).
        return load_npy(p, f"--input {name}: {p}")
    except OSError as e:
        raise InputError(f"--input {name}: {p} cannot be read ({e.strerror or e})") from None


def as_declared_type(name: str, a: np.ndarray, specs: Sequence[Any]) -> np.ndarray:
    """An input array read as its declared element type where NumPy could not say it: a
    bfloat16, float8 or int4 array saved by NumPy has no type descr of its own and comes
    back as raw bytes (``|V2``, ``|V1``); those are taken as the model's declared type
    when the item size matches and the type is one NumPy has no name for (raw bytes for a
    float32 input are refused, as by the generated driver). Every other array is returned
    unchanged."""
    from flowc.ir.dtype import DType

    if a.dtype.kind != "V" or a.dtype.fields is not None:
        return a
    spec = next((s for s in specs if str(s["name"]) == name), None)
    if spec is None:
        return a
    want = DType.from_short(str(spec["dtype"])).np
    if want.kind != "V":
        # A type NumPy names (float32 is '<f4'): raw bytes are not taken for it, as the
        # generated driver does not take them either (runtime_cpp/flowc/npy.h).
        raise InputError(
            f"--input {name}: raw {a.dtype.itemsize}-byte items ({a.dtype.str}) are not "
            f"{spec['dtype']}: only a type NumPy has no name for (bfloat16, float8, int4) "
            "is read from raw bytes",
            hint=f"save the array as {spec['dtype']} (np.asarray(a, np.{want.name}))",
        )
    if a.dtype.itemsize != want.itemsize:
        raise InputError(
            f"--input {name}: raw {a.dtype.itemsize}-byte items cannot be "
            f"{spec['dtype']} ({want.itemsize} byte(s) each)",
            hint=f"save the array as {spec['dtype']} (ml_dtypes.{want.name})",
        )
    return a.view(want)


def read_inputs(items: Sequence[str], specs: Sequence[Any]) -> dict[str, np.ndarray]:
    """--input NAME=PATH.npy options as arrays by input name; ``specs`` are the inputs'
    ``{"name", "dtype"}`` (raw-byte arrays are taken as their declared types)."""
    names = [str(spec["name"]) for spec in specs]
    feeds = {}
    for item in items:
        name, path = _split_input(item, names)
        feeds[name] = _read_npy(path, name)
    # Every file is read before any type is judged: a missing file is the error to see.
    return {k: as_declared_type(k, a, specs) for k, a in feeds.items()}


def read_graph_inputs(
    items: Sequence[str], graph: Any, random_seed: int | None = None
) -> dict[str, np.ndarray]:
    """--input options for ``graph``'s inputs; with ``random_seed``, the inputs not given
    filled with that seed's random data."""
    specs = [{"name": v.name, "dtype": v.type.dtype.short} for v in graph.inputs]
    feeds = read_inputs(items, specs)
    if random_seed is not None:
        from flowc.interpreter import random_inputs

        for k, v in random_inputs(graph, random_seed).items():
            feeds.setdefault(k, v)
    return feeds


# -- -o OUT.npz --------------------------------------------------------------------------------


def check_output_path(path: Path, what: str = "-o") -> Path:
    """Fail before any work when the output cannot be written (flowc.atomic_file's rules: a
    character device or FIFO is written through, a directory or socket refused). A file
    the output creates or replaces must end in .npz."""
    target = check_output(path, what)
    if target.kind is not Kind.STREAM and not path.name.endswith(".npz"):
        raise InputError(f"{what} {path}: the output file must end in .npz")
    return path


def write_npz_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """An .npz keyed by name, never half-written (flowc.atomic_file). Written member by
    member (not np.savez(**arrays)) so any output name works as a key."""
    from flowc.harness import build

    with (
        atomic_write(
            path,
            cannot_open=lambda e: InputError(f"-o {path}: cannot write there ({e.strerror})"),
            cannot_write=lambda e: InputError(f"-o {path}: writing failed ({e.strerror or e})"),
        ) as f,
        zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as z,
    ):
        for name, a in arrays.items():
            with z.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(
                    member, build.raw_npy(np.asanyarray(a)), allow_pickle=False
                )
