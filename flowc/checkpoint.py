"""Training checkpoints: one part file per saving rank, and a manifest written last.

    FOLDER/checkpoint.json               the manifest
    FOLDER/step-<N>-<run>/rank-<R>.npz   the slices of the state rank R saved after step N

The manifest (format 2) holds the step, what makes the checkpoint a model's (the state's
names, shapes and types: ``signature``), the run's data position (batch, seed, shuffle, ...)
and, per state tensor, its whole shape and type, how it was cut when saved (``axis``,
``chunks``: equal slices) and the part file holding each slice. Each slice is saved by one
rank: a rank holding a slice other ranks hold too (a mesh axis the tensor is not split
over) saves it only at coordinate 0 of that axis, so no byte is written twice and no rank
gathers anything.

A checkpoint is complete only with its manifest: every rank writes its part (a temporary
file renamed), the ranks agree that all parts are written (one all-reduce), and only then
rank 0 writes the manifest (a temporary file renamed over the old one) and removes the
parts the old manifest named. A crash at any point leaves the previous manifest and its
parts as they were; the part folder carries a run id, so a new save never writes into a
folder a manifest names. A part folder without a manifest (a save that did not finish) is
left where it is.

Loading on another mesh or plan is a boxing plan computed at load: each rank's part of a
tensor (its box in the whole) is assembled from the saved slices that overlap it, the
overlaps read from the part files that hold them. So a checkpoint from 4 ranks under ZeRO-3
continues data parallel on 2 or on one device, and tensor parallel on 2 continues on 1.
The one-file checkpoint of earlier versions (checkpoint.npz, format 1) still loads.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from flowc.api import slice_box
from flowc.atomic_file import atomic_write
from flowc.errors import InputError
from flowc.ir.dtype import DType

if TYPE_CHECKING:
    from flowc.api import Model

MANIFEST = "checkpoint.json"
LEGACY = "checkpoint.npz"  # format 1: the whole state in one file
FORMAT = 2


def new_run_id() -> str:
    """The id that keeps one run's part folders apart from every other run's (all ranks of
    a job share it)."""
    return secrets.token_hex(4)


def part_file(rank: int) -> str:
    return f"rank-{rank:05d}.npz"


@dataclass(frozen=True)
class Saved:
    """How a tensor was saved: its whole shape and type, cut into ``chunks`` equal slices
    along ``axis`` (-1: whole), slice c in part file ``files[c]``."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    axis: int
    files: tuple[str, ...]

    @property
    def chunks(self) -> int:
        return len(self.files)

    def box(self, chunk: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return slice_box(self.shape, self.axis, self.chunks, chunk)


@dataclass
class Checkpoint:
    """A checkpoint folder's manifest, read and checked (or a format-1 file's metadata)."""

    folder: Path
    info: dict[str, Any]  # step, signature and the run's data position
    tensors: dict[str, Saved]
    parts: str  # the part folder's name ("" for a format-1 file)

    @property
    def step(self) -> int:
        return int(self.info["step"])


# -- saving -----------------------------------------------------------------------------------


def _mkdir(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--checkpoint-dir {folder}: cannot create it ({e.strerror})") from None


def _cannot_write(folder: Path) -> Any:
    def error(e: OSError) -> Exception:
        return InputError(f"--checkpoint-dir {folder}: writing failed ({e.strerror or e})")

    return error


def write_part(
    folder: Path, tag: str, rank: int, step: int, slices: Mapping[str, np.ndarray]
) -> None:
    """One rank's part: the slices it saves, after ``step`` steps."""
    _mkdir(folder / tag)
    arrays = {f"state/{n}": np.asarray(a) for n, a in slices.items()}
    arrays["__meta__"] = np.asarray(json.dumps({"step": step, "rank": rank}))
    error = _cannot_write(folder)
    with atomic_write(folder / tag / part_file(rank), cannot_open=error, cannot_write=error) as f:
        # Keys are state names, not savez's options (NumPy's stubs type them as these).
        np.savez(f, **arrays)  # type: ignore[arg-type]


def commit(
    folder: Path,
    tag: str,
    step: int,
    info: Mapping[str, Any],
    tensors: Mapping[str, Saved],
) -> Path:
    """The manifest of the parts in FOLDER/TAG, written once all of them are: each part
    file it names is checked to be there and of ``step``. Then the parts the replaced
    manifest named go (those files alone, and their folder if that empties it)."""
    for f in sorted({f for t in tensors.values() for f in t.files}):
        meta = _part_meta(folder / tag / f, folder)
        if meta.get("step") != step:
            raise InputError(
                f"--checkpoint-dir {folder}: {tag}/{f} holds step {meta.get('step')}, not {step}"
            )
    old = None
    with contextlib.suppress(InputError):
        old = read(folder)
    manifest = {
        "format": FORMAT,
        **info,
        "step": step,
        "parts": tag,
        "tensors": {
            n: {
                "shape": list(t.shape),
                "dtype": DType.from_numpy(t.dtype).short,
                "axis": t.axis,
                "files": list(t.files),
            }
            for n, t in tensors.items()
        },
    }
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    path = folder / MANIFEST
    error = _cannot_write(folder)
    with atomic_write(path, cannot_open=error, cannot_write=error) as out:
        out.write(data)
    if old is not None and old.parts and old.parts != tag:
        _remove_parts(folder, old)
    return path


def _remove_parts(folder: Path, old: Checkpoint) -> None:
    """The part files a replaced manifest named, and their folder once empty; nothing
    else there is touched."""
    parts = folder / old.parts
    for f in sorted({f for t in old.tensors.values() for f in t.files}):
        (parts / f).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        parts.rmdir()  # fails where something else is there: not flowc's to remove


def save_model(
    folder: Path, model: Model, step: int, info: Mapping[str, Any], run_id: str
) -> Path | None:
    """Every rank of ``model`` saves its slices; rank 0 then writes the manifest (returned;
    None on other ranks). Every rank calls this together."""
    tag = f"step-{step:08d}-{run_id}"
    mine = [n for n in model.state_names() if model.shards[n].saves]
    failure: InputError | None = None
    try:
        if mine:  # a rank holding only copies of others' slices writes no part
            write_part(folder, tag, model.rank, step, model.read_local(mine))
    except InputError as e:
        failure = e
    # A part that could not be written (a full disk) fails the checkpoint on every rank; the
    # previous manifest stays.
    if not model.all_ok(failure is None):
        raise failure or InputError(
            f"--checkpoint-dir {folder}: another rank could not write its part of step {step}",
            hint="its message is above; the previous checkpoint there is intact",
        )
    if model.rank != 0:
        return None
    tensors = {}
    for n in model.state_names():
        shard = model.shards[n]
        files = [""] * shard.chunks
        for r in range(model.ranks):
            s = model.shard_on(n, r)
            if s.saves:
                files[s.chunk] = part_file(r)
        tensors[n] = Saved(shard.shape, shard.dtype, shard.axis, tuple(files))
    return commit(folder, tag, step, info, tensors)


def save_whole(
    folder: Path, state: Mapping[str, np.ndarray], step: int, info: Mapping[str, Any]
) -> Path:
    """A checkpoint of whole tensors (one part), from host arrays."""
    tag = f"step-{step:08d}-{new_run_id()}"
    write_part(folder, tag, 0, step, state)
    tensors = {
        n: Saved(np.shape(a), np.asarray(a).dtype, -1, (part_file(0),)) for n, a in state.items()
    }
    return commit(folder, tag, step, info, tensors)


# -- loading ----------------------------------------------------------------------------------


def _part_meta(path: Path, folder: Path) -> dict[str, Any]:
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["__meta__"]))
    except FileNotFoundError:
        raise InputError(
            f"--resume {folder}: {path.relative_to(folder)} is missing",
            hint="the checkpoint's manifest names it; restore the file or use an older checkpoint",
        ) from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise InputError(
            f"--resume {folder}: {path.relative_to(folder)} is not readable ({e})"
        ) from None
    if not isinstance(meta, dict):
        raise InputError(f"--resume {folder}: {path.relative_to(folder)} is not a flowc part")
    return meta


def read(folder: Path) -> Checkpoint:
    """FOLDER's checkpoint: its manifest (or a format-1 file), checked for form."""
    manifest = folder / MANIFEST
    if manifest.is_file():
        try:
            info = json.loads(manifest.read_text(encoding="utf-8"))
            if not isinstance(info, dict) or info.get("format") != FORMAT:
                raise ValueError(f"not a flowc checkpoint manifest of format {FORMAT}")
            parts = str(info.pop("parts"))
            if not parts or Path(parts).name != parts or parts.startswith("."):
                raise ValueError(f"part folder {parts!r} is not a name in {folder}")
            tensors = {}
            for name, t in info.pop("tensors").items():
                files = tuple(str(f) for f in t["files"])
                if any(Path(f).name != f or not f.endswith(".npz") for f in files):
                    raise ValueError(f"{name}: part files {list(files)} are not names")
                saved = Saved(
                    tuple(int(d) for d in t["shape"]),
                    DType.from_short(str(t["dtype"])).np,
                    int(t["axis"]),
                    files,
                )
                if not files or (
                    saved.axis >= 0
                    and (saved.axis >= len(saved.shape) or saved.shape[saved.axis] % saved.chunks)
                ):
                    raise ValueError(f"{name}: {len(files)} slices of {list(saved.shape)}")
                tensors[str(name)] = saved
            int(info["step"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise InputError(f"--resume {folder}: {MANIFEST} is not readable ({e})") from None
        return Checkpoint(folder, info, tensors, parts)
    legacy = folder / LEGACY
    if not legacy.is_file():
        raise InputError(
            f"--resume {folder}: no checkpoint there (no {MANIFEST})",
            hint="give a --checkpoint-dir of an earlier run; a save that did not finish "
            "writes no manifest",
        )
    try:
        with np.load(legacy, allow_pickle=False) as z:
            info = json.loads(str(z["__meta__"]))
            tensors = {
                k[len("state/") :] if k.startswith("state/") else k: Saved(
                    z[k].shape, z[k].dtype, -1, (LEGACY,)
                )
                for k in z.files
                if k.startswith("state/") or k == "train/lr"
            }
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise InputError(f"--resume {folder}: {LEGACY} is not readable ({e})") from None
    if not isinstance(info, dict) or info.get("format") != 1:
        raise InputError(f"--resume {folder}: {LEGACY} is not a flowc checkpoint")
    return Checkpoint(folder, info, tensors, "")


class _Parts:
    """The part files a load reads, each opened once (np.load reads a member when asked)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self.open: dict[str, Any] = {}

    def slice_of(self, name: str, chunk: int) -> np.ndarray:
        saved = self.ckpt.tensors[name]
        f = saved.files[chunk]
        folder = self.ckpt.folder
        if f not in self.open:
            if self.ckpt.parts:
                meta = _part_meta(folder / self.ckpt.parts / f, folder)
                if meta.get("step") != self.ckpt.step:
                    raise InputError(
                        f"--resume {folder}: {self.ckpt.parts}/{f} holds step "
                        f"{meta.get('step')}, the manifest step {self.ckpt.step}",
                        hint="the parts of one checkpoint are all of one step",
                    )
                self.open[f] = np.load(folder / self.ckpt.parts / f, allow_pickle=False)
            else:
                self.open[f] = np.load(folder / LEGACY, allow_pickle=False)
        key = f"state/{name}" if name != "train/lr" or self.ckpt.parts else name
        try:
            a = np.asarray(self.open[f][key])
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
            raise InputError(f"--resume {folder}: {name!r} in {f} is not readable ({e})") from None
        want = saved.box(chunk)[1]
        if a.shape != want or a.dtype != saved.dtype:
            raise InputError(
                f"--resume {folder}: {name!r} in {f} is {a.dtype}{list(a.shape)}, "
                f"the manifest says {saved.dtype}{list(want)}"
            )
        return a

    def close(self) -> None:
        for z in self.open.values():
            z.close()
        self.open.clear()


def assemble(parts: _Parts, name: str, start: Sequence[int], size: Sequence[int]) -> np.ndarray:
    """The box (start, size) of saved tensor ``name``: the overlap of each saved slice
    with it, copied in."""
    saved = parts.ckpt.tensors[name]
    out = np.empty(tuple(size), saved.dtype)
    for c in range(saved.chunks):
        s0, s1 = saved.box(c)
        lo = [max(a, b) for a, b in zip(start, s0, strict=True)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(start, size, s0, s1, strict=True)]
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            continue
        piece = parts.slice_of(name, c)
        src = tuple(slice(low - b, h - b) for low, h, b in zip(lo, hi, s0, strict=True))
        dst = tuple(slice(low - a, h - a) for low, h, a in zip(lo, hi, start, strict=True))
        out[dst] = piece[src]
    return out


def load_model(ckpt: Checkpoint, model: Model) -> None:
    """Each rank's part of every state tensor from the checkpoint (every rank calls this;
    no rank communicates: each reads the slices that overlap its part)."""
    if not ckpt.parts:
        # A format-1 file: whole tensors, the state it has (each rank cuts its part).
        model.write_state(load_whole(ckpt, model.state_names()))
        return
    missing = [n for n in model.state_names() if n not in ckpt.tensors]
    if missing:
        raise InputError(
            f"--resume {ckpt.folder}: the checkpoint has no {missing[0]!r}",
            hint="resume with the model, loss and optimizer the checkpoint was made with",
        )
    parts = _Parts(ckpt)
    try:
        for n in model.state_names():
            shard, saved = model.shards[n], ckpt.tensors[n]
            if saved.shape != shard.shape or saved.dtype != shard.dtype:
                raise InputError(
                    f"--resume {ckpt.folder}: {n!r} is {saved.dtype}{list(saved.shape)} there, "
                    f"{shard.dtype}{list(shard.shape)} in this model"
                )
            if not shard.held:
                continue  # another pipeline stage's
            start, size = shard.box(shard.chunk)
            model.write_local({n: assemble(parts, n, start, size)})
    finally:
        parts.close()


def load_whole(ckpt: Checkpoint, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """The checkpoint's tensors whole, as host arrays."""
    parts = _Parts(ckpt)
    try:
        return {
            n: assemble(parts, n, (0,) * len(t.shape), t.shape)
            for n, t in ckpt.tensors.items()
            if names is None or n in names
        }
    finally:
        parts.close()


__all__ = [
    "LEGACY",
    "MANIFEST",
    "Checkpoint",
    "Saved",
    "commit",
    "load_model",
    "load_whole",
    "new_run_id",
    "read",
    "save_model",
    "save_whole",
    "write_part",
]
