"""Writing a generated project into OUT/ without touching what flowc did not write.

OUT/ may hold the user's own files and the build folders (build-host/, build-cuda/): a
compile owns only the files it writes, which ``flowc_model.json`` lists (``"files"``, paths
relative to OUT/, the manifest itself not included). The manifest is written last, so it
never names a file that is not there yet. A recompile:

- writes each file through a temporary file beside it and ``os.replace`` (never a half-written
  file), and leaves a file whose bytes are unchanged alone (its mtime too, so a rebuild after
  an identical recompile has nothing to do). Weights files are streamed into their temporary
  file constant by constant, the CRC computed as they go (codegen/weights.py), and compared
  with the old file block by block, so no weights file is ever whole in memory;
- deletes the files the old manifest lists that it no longer writes (``weights.rank1.bin``
  after going from a mesh to one device), after checking every listed path: relative, no
  ``..``, inside OUT/ once links are resolved, a regular file. Nothing else is ever deleted;
- refuses a non-empty OUT/ without a manifest unless ``force`` (which still deletes nothing);
- on failure removes what it created and names the path that could not be written.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import unicodedata
import zlib
from pathlib import Path, PurePosixPath
from typing import Any

from flowc.codegen.weights import WeightsLayout, header, same_file_bytes, write_weights_file
from flowc.errors import FlowcError
from flowc.resources import runtime_dir

MANIFEST = "flowc_model.json"

# Characters a project's absolute path may not hold, found by building a project at such a
# path with CMake + Make and CMake + Ninja, for the host and with nvcc: '"', ';' and '\'
# break CMake's own argument parsing; ':' and ',' split the build's RPATH
# (-Wl,-rpath,A:B); '|' breaks build.ninja; '[', ']' and '$(' break the Makefiles; "'" and
# '`' break nvcc's compile of the CUDA build. '$' is refused as a whole (${VAR} is read as
# a variable by CMake in some places), and so is every control character (line breaks,
# tabs, DEL, C1) and the Unicode line/paragraph separators.
UNSAFE_PATH_CHARS = frozenset("\"$;\\,|:[]'`")


class ProjectError(FlowcError):
    """OUT/ cannot be (over)written: the message names the path and what to do."""


def weights_file_name(rank: int, ranks: int) -> str:
    """``weights.bin`` for a one-device program, ``weights.rank<R>.bin`` per rank otherwise
    (model.cu.j2 derives the same names from the path it is given)."""
    return "weights.bin" if ranks == 1 else f"weights.rank{rank}.bin"


def weights_bytes(layout: WeightsLayout) -> bytes:
    """A weights file's bytes, joined (small layouts; files are written streamed)."""
    data = layout.data
    return header(layout, zlib.crc32(data)) + data


def write_weights(path: Path, layout: WeightsLayout) -> None:
    """Write a weights file for ``layout`` at ``path`` (atomically, streamed)."""
    try:
        _replace_weights(path, layout)
    except OSError as e:
        raise ProjectError(f"cannot write {e.filename or path}: {e.strerror or e}") from None


def file_mode() -> int:
    """Permissions a new file gets under the process's umask (mkstemp makes them 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _unsafe_chars(text: str) -> list[str]:
    return sorted(
        {
            ch
            for ch in text
            if ch in UNSAFE_PATH_CHARS or unicodedata.category(ch) in ("Cc", "Zl", "Zp")
        }
    )


def check_output_path(out: Path) -> None:
    """Refuse an OUT/ whose absolute path CMake, Make or Ninja cannot handle."""
    for full in dict.fromkeys([os.path.abspath(out), os.path.realpath(out)]):
        try:
            full.encode("utf-8")
        except UnicodeEncodeError:
            raise ProjectError(
                f"-o {full!r}: the path is not valid UTF-8, which CMake cannot handle",
                hint="choose a folder whose path is plain text",
            ) from None
        bad = _unsafe_chars(full)
        if bad:
            shown = " ".join(repr(c) for c in bad)
            raise ProjectError(
                f"-o {full!r}: the path holds {shown}, which CMake, Make or Ninja cannot handle",
                hint="choose a folder whose path has none of \" $ ; \\ , | : [ ] ' ` "
                "or control characters (spaces are fine)",
            )


def _invalid_entry(out_real: str, name: object) -> str | None:
    """Why ``name`` (from an old manifest) is not a file flowc may delete, or None."""
    if not isinstance(name, str) or not name:
        return "not a file name"
    if "\\" in name or "\0" in name or PurePosixPath(name).is_absolute():
        return "not a relative path"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "not a plain relative path"
    if name == MANIFEST:
        return "the manifest itself"
    full = os.path.join(out_real, *name.split("/"))
    parent = os.path.realpath(os.path.dirname(full))
    if parent != out_real and not parent.startswith(out_real + os.sep):
        return "outside the project folder"
    try:
        st = os.lstat(full)
    except FileNotFoundError:
        return None  # already gone: nothing to delete
    except OSError as e:
        return f"cannot be inspected ({e.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    return None


def _read_manifest(out: Path) -> dict[str, Any]:
    path = out / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ProjectError(
            f"{path}: not a readable flowc manifest ({e})",
            hint="pass --force to write into the folder anyway (it deletes nothing flowc "
            "did not write), or choose another folder",
        ) from None
    if not isinstance(data, dict):
        raise ProjectError(f"{path}: not a flowc manifest (expected a JSON object)")
    return data


def check_project_dir(out: Path, force: bool = False) -> list[str]:
    """Whether a compile may write OUT/, checked before any work; returns the files the last
    compile wrote there (validated: each one is safe to delete) to replace or remove."""
    check_output_path(out)
    full = Path(os.path.abspath(out))
    # The deepest part of the path that exists must be a folder we can write into.
    top = full
    while not os.path.lexists(top) and top != top.parent:
        top = top.parent
    if not top.is_dir():
        raise ProjectError(
            f"-o {out}: {top} is {'a file' if top.exists() else 'a broken link'}, not a folder",
            hint="choose a path under an existing folder",
        )
    if not os.access(top, os.W_OK | os.X_OK):
        raise ProjectError(
            f"-o {out}: {top} is not writable",
            hint="choose a folder you can write to",
        )
    if top != full:
        return []  # OUT/ does not exist yet
    try:
        entries = os.listdir(full)
    except OSError as e:
        raise ProjectError(f"-o {out}: cannot list the folder ({e.strerror})") from None
    if not entries:
        return []
    if MANIFEST not in entries:
        if force:
            return []
        raise ProjectError(
            f"-o {out}: the folder is not empty and holds no {MANIFEST}, so it is not a "
            "flowc project",
            hint="choose a new or empty folder, or pass --force to write into it "
            "(flowc then replaces only the files it writes and deletes nothing)",
        )
    try:
        manifest = _read_manifest(full)
    except ProjectError:
        if force:
            return []
        raise
    listed = manifest.get("files", [])  # projects from before the list: delete nothing
    if not isinstance(listed, list):
        listed = [listed]
    out_real = os.path.realpath(full)
    problems = [(n, why) for n in listed if (why := _invalid_entry(out_real, n)) is not None]
    if problems:
        if force:
            return []
        name, why = problems[0]
        raise ProjectError(
            f"{full / MANIFEST} lists {name!r} ({why}): flowc deletes only regular files "
            "inside the project folder, so it will not touch this folder",
            hint="pass --force to write into it anyway (it then deletes nothing), or remove "
            f"{MANIFEST}",
        )
    return [n for n in listed if isinstance(n, str)]


def _replace(path: Path, data: bytes) -> bool:
    """Write ``data`` at ``path`` through a temporary file beside it; returns False (and
    writes nothing) when the file already holds exactly these bytes."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISREG(st.st_mode) and st.st_size == len(data):
        with open(path, "rb") as f:
            if f.read() == data:
                return False
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def _replace_weights(path: Path, layout: WeightsLayout) -> bool:
    """As ``_replace`` for a weights file streamed from ``layout``: the temporary file is
    written first (the bytes are not known before), then kept only when they differ."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w+b") as f:
            write_weights_file(f, layout)
            os.fchmod(f.fileno(), file_mode())
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode) and same_file_bytes(path, tmp):
            os.unlink(tmp)
            return False
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def _mkdirs(out: Path, rel: PurePosixPath, created: list[Path]) -> None:
    """Make OUT/rel's folders (umask permissions); refuses a link where a folder goes, so
    nothing is written outside OUT/."""
    path = out
    for part in rel.parts:
        path = path / part
        if path.is_symlink():
            raise ProjectError(
                f"{path} is a link: flowc writes its files only into real folders inside the "
                "project folder",
                hint="remove the link",
            )
        if not path.is_dir():
            os.mkdir(path)
            created.append(path)


def project_files(
    files: dict[str, str], weights: list[WeightsLayout]
) -> tuple[dict[str, bytes | WeightsLayout], bytes]:
    """Everything a compile writes into OUT/ (relative path -> bytes, or the layout a
    weights file is streamed from), and the manifest."""
    new: dict[str, bytes | WeightsLayout] = {
        n: t.encode("utf-8") for n, t in files.items() if n != MANIFEST
    }
    for r, w in enumerate(weights):
        new[weights_file_name(r, len(weights))] = w
    headers = runtime_dir() / "flowc"
    for p in sorted(headers.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            new[f"flowc/{p.relative_to(headers).as_posix()}"] = p.read_bytes()
    manifest = json.loads(files[MANIFEST])
    manifest["files"] = sorted(new)
    return new, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")


def write_project(
    out: Path, files: dict[str, str], weights: list[WeightsLayout], force: bool = False
) -> None:
    """Write the project into OUT/ as the module docstring says; ``files`` are generate()'s
    text files (flowc_model.json among them), ``weights`` one layout per rank."""
    old = check_project_dir(out, force)
    out = Path(os.path.abspath(out))
    new, manifest = project_files(files, weights)
    created: list[Path] = []
    current = out
    try:
        # OUT/ and the folders above it that are missing, top down.
        for path in reversed([p for p in (out, *out.parents) if not os.path.lexists(p)]):
            os.mkdir(path)
            created.append(path)
        for name in sorted(new):
            rel = PurePosixPath(name)
            current = out.joinpath(*rel.parts)
            _mkdirs(out, rel.parent, created)
            existed = os.path.lexists(current)
            data = new[name]
            if isinstance(data, WeightsLayout):
                _replace_weights(current, data)
            else:
                _replace(current, data)
            if not existed:
                created.append(current)
        for name in sorted(set(old) - set(new)):
            current = out.joinpath(*name.split("/"))
            current.unlink(missing_ok=True)
            _remove_empty_parents(out, current)
        current = out / MANIFEST
        _replace(current, manifest)
    except OSError as e:
        _undo(created)
        where = e.filename or current
        raise ProjectError(
            f"cannot write {where}: {e.strerror or e}",
            hint="check the folder's permissions and free space; nothing flowc created was "
            "left behind",
        ) from None
    except BaseException:
        _undo(created)
        raise


def _remove_empty_parents(out: Path, path: Path) -> None:
    """After deleting ``path``: its folders inside OUT/ that are now empty (flowc/host/ when
    a runtime header folder goes away), never OUT/ itself."""
    parent = path.parent
    while parent != out and out in parent.parents:
        try:
            parent.rmdir()
        except OSError:
            return  # not empty (or not ours to remove): stop
        parent = parent.parent


def _undo(created: list[Path]) -> None:
    """Remove what a failed write created (files, then folders, deepest first)."""
    for path in reversed(created):
        try:
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink()
        except OSError:
            pass  # best effort: the original error is the one to report
