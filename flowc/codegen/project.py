"""Writing a generated project into OUT/: the folder holds the old project or the new one,
whatever fails, and flowc never overwrites or deletes what it did not write.

OUT/ may hold the user's own files and the build folders (build-host/, build-cuda/): a
compile owns only the files it writes, which ``flowc_model.json`` lists (``"files"``, paths
relative to OUT/, the manifest itself not included, and the SHA-256 of each but the weights).
A compile into OUT/:

- holds OUT/'s lock (``.flowc.lock``, an flock naming its holder, removed at the end) from
  before its generation until its files are in place; a second compile waits a little, then
  is refused naming the first. `flowc build` and `flowc run` take it too when OUT/ holds
  something to settle (a journal, a staging folder, a lock file);
- stages every file that changes under a transaction folder in OUT/ (``.flowc-tx-*``),
  written and synced, so a full disk fails there with OUT/ untouched. A file whose bytes
  are unchanged is left alone (its mtime too: a rebuild after an identical recompile has
  nothing to do). Weights files are streamed constant by constant and compared with the old
  file block by block, so no weights file is ever whole in memory;
- writes a journal (``.flowc-journal.json``) naming every move, then swaps by renames only:
  each old file into the transaction folder, each new one into place, the manifest last.
  A failed swap is rolled back at once; one cut short (a killed process, a disk gone
  read-only) is finished or rolled back by the next compile, build or run, which says so;
- deletes the old files the new project no longer has (``weights.rank1.bin`` after going
  from a mesh to one device) only when they are flowc's: listed, regular, inside OUT/ and
  unchanged since written;
- refuses to overwrite what it did not write: a file the old manifest does not list, one the
  user changed since, a link, folder or node where a file goes. With ``--force`` (also the
  way into a non-empty folder that is no project) those are moved aside inside OUT/ as
  ``NAME.user-N`` and named in a warning: no byte of the user's is lost.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import socket
import stat
import sys
import tempfile
import time
import unicodedata
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from flowc.atomic_file import file_kind
from flowc.codegen.weights import WeightsLayout, header, same_file_bytes, write_weights_file
from flowc.errors import FlowcError, FlowcWarning
from flowc.resources import runtime_dir

MANIFEST = "flowc_model.json"
LOCK = ".flowc.lock"
JOURNAL = ".flowc-journal.json"
TX_PREFIX = ".flowc-tx-"
# How long a compile, build or run waits for another flowc to release OUT/ before refusing.
LOCK_WAIT_S = 10.0

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


@dataclass(frozen=True)
class OldProject:
    """What OUT/ held before a compile: the files the last compile wrote (``listed``: None
    when unknown, a folder that is no project written into with --force), their SHA-256,
    and whether its manifest is from before the file list (``legacy``: files at the names
    flowc writes are taken as flowc's, none is deleted)."""

    listed: frozenset[str] | None = None
    sha256: dict[str, str] = field(default_factory=dict)
    legacy: bool = False

    def owns(self, name: str, path: Path) -> bool:
        """Whether the regular file ``path`` (at ``name`` in OUT/) is flowc's to replace
        or delete: listed and unchanged since written."""
        if self.legacy:
            return True
        if self.listed is None or name not in self.listed:
            return False
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                return False  # hashing a FIFO would block; a link is never flowc's
        except FileNotFoundError:
            return False
        want = self.sha256.get(name)
        return want is None or _sha256(path) == want


def _own_entry(name: str) -> bool:
    """An entry of OUT/ that a compile in progress (or a killed one) made."""
    return name in (LOCK, JOURNAL) or name.startswith(TX_PREFIX)


def check_project_dir(out: Path, force: bool = False) -> OldProject:
    """Whether a compile may write OUT/, checked before any work and again under the lock;
    returns what the last compile wrote there (each listed path validated: safe to
    replace or delete)."""
    check_output_path(out)
    full = Path(os.path.abspath(out))
    # The deepest part of the path that exists must be a folder we can write into.
    top = full
    while not os.path.lexists(top) and top != top.parent:
        top = top.parent
    if not top.is_dir():
        if not top.exists():
            what = "a broken link"
        else:
            what = "a file" if top.is_file() else file_kind(os.stat(top).st_mode)
        raise ProjectError(
            f"-o {out}: {top} is {what}, not a folder",
            hint="choose a path under an existing folder",
        )
    if not os.access(top, os.W_OK | os.X_OK):
        raise ProjectError(
            f"-o {out}: {top} is not writable",
            hint="choose a folder you can write to",
        )
    if top != full:
        return OldProject()  # OUT/ does not exist yet
    try:
        entries = [n for n in os.listdir(full) if not _own_entry(n)]
    except OSError as e:
        raise ProjectError(f"-o {out}: cannot list the folder ({e.strerror})") from None
    if os.path.lexists(full / JOURNAL):
        return OldProject()  # an unfinished swap: judged after its recovery, under the lock
    if not entries:
        return OldProject()
    if MANIFEST not in entries:
        if force:
            return OldProject()
        raise ProjectError(
            f"-o {out}: the folder is not empty and holds no {MANIFEST}, so it is not a "
            "flowc project",
            hint="choose a new or empty folder, or pass --force to write into it "
            "(flowc then moves aside, as NAME.user-N, any file of yours it would replace)",
        )
    try:
        manifest = _read_manifest(full)
    except ProjectError:
        if force:
            return OldProject()
        raise
    if "files" not in manifest:
        return OldProject(legacy=True)  # from before the list: delete nothing
    listed = manifest["files"]
    if not isinstance(listed, list):
        listed = [listed]
    out_real = os.path.realpath(full)
    problems = [(n, why) for n in listed if (why := _invalid_entry(out_real, n)) is not None]
    if problems:
        if force:
            return OldProject()
        name, why = problems[0]
        raise ProjectError(
            f"{full / MANIFEST} lists {name!r} ({why}): flowc deletes only regular files "
            "inside the project folder, so it will not touch this folder",
            hint="pass --force to write into it anyway (it then deletes nothing), or remove "
            f"{MANIFEST}",
        )
    hashes = manifest.get("sha256", {})
    if not isinstance(hashes, dict):
        hashes = {}
    old = OldProject(
        frozenset(n for n in listed if isinstance(n, str)),
        {k: v for k, v in hashes.items() if isinstance(k, str) and isinstance(v, str)},
    )
    if not force:
        # A file of flowc's the user edited since is theirs now: refused before any work.
        changed = [
            n
            for n in sorted(old.listed or ())
            if (p := full / n).is_file() and not p.is_symlink() and not old.owns(n, p)
        ]
        if changed:
            shown = ", ".join(changed[:8]) + (" ..." if len(changed) > 8 else "")
            them = "them" if len(changed) > 1 else "it"
            raise ProjectError(
                f"-o {out}: {shown} changed since flowc wrote {them}",
                hint="pass --force to move your version aside (renamed NAME.user-N, nothing "
                "deleted), or remove it",
            )
    return old


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


def project_files(
    files: dict[str, str], weights: list[WeightsLayout]
) -> tuple[dict[str, bytes | WeightsLayout], bytes]:
    """Everything a compile writes into OUT/ (relative path -> bytes, or the layout a
    weights file is streamed from), and the manifest: the files it lists, and the SHA-256
    of each one but the weights (so a later compile can tell a file the user changed)."""
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
    manifest["sha256"] = {
        n: hashlib.sha256(d).hexdigest() for n, d in sorted(new.items()) if isinstance(d, bytes)
    }
    return new, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")


# -- the disk ------------------------------------------------------------------------------------


class Disk:
    """Every change a project write makes on disk, one method each: the points where a
    full disk, a read-only remount or a killed process can strike (the tests make each one
    fail in turn)."""

    def mkdir(self, path: Path) -> None:
        os.mkdir(path)

    def create(self, path: Path, data: bytes | WeightsLayout) -> None:
        """A new file (never an existing one) holding ``data``, synced."""
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            with os.fdopen(fd, "w+b") as f:
                if isinstance(data, WeightsLayout):
                    write_weights_file(f, data)
                else:
                    f.write(data)
                os.fchmod(f.fileno(), file_mode())
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise

    def rename(self, src: Path, dst: Path) -> None:
        os.rename(src, dst)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    def rmdir(self, path: Path) -> None:
        os.rmdir(path)

    def sync(self, folder: Path) -> None:
        """Make the renames in ``folder`` durable."""
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


DISK = Disk()


def _remove_tree(root: Path) -> None:
    """Remove a transaction folder flowc made (files and folders only, through DISK)."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            DISK.unlink(Path(dirpath) / name)
        for name in dirnames:
            p = Path(dirpath) / name
            if p.is_symlink():
                DISK.unlink(p)
            else:
                DISK.rmdir(p)
    DISK.rmdir(root)


# -- the folder lock -----------------------------------------------------------------------------


def _holder(fd: int) -> str:
    """Who holds a lock, as its lock file says."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        return (
            f"pid {int(data['pid'])} on {data['host']}, `{data['command']}`, since {data['since']}"
        )
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not said who it is yet"


@contextmanager
def project_lock(out: Path, wait_s: float | None = None) -> Iterator[None]:
    """Hold OUT/'s lock for the block: one flowc at a time compiles, builds or recovers a
    project. The lock is an flock on OUT/.flowc.lock, which names its holder and is removed
    when the block ends (one left by a killed process holds no lock and is taken over). A
    second flowc waits ``wait_s`` (default LOCK_WAIT_S), then is refused naming the holder."""
    path = out / LOCK
    deadline = time.monotonic() + (LOCK_WAIT_S if wait_s is None else wait_s)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ProjectError(
                f"cannot lock {out}: {path} cannot be opened ({e.strerror or e})",
                hint=f"remove {path} if it is not a file flowc made",
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ProjectError(
                f"cannot lock {out}: {path} is not a regular file",
                hint=f"remove {path}",
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            if time.monotonic() >= deadline:
                raise ProjectError(
                    f"{out} is being written by another flowc ({holder})",
                    hint="wait for it to finish, or compile into another folder",
                ) from None
            time.sleep(0.05)
            continue
        # The holder before may have removed the file between our open and our lock.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": shlex.join(["flowc", *sys.argv[1:]])[:500],
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        with contextlib.suppress(OSError):  # who holds it is for messages only
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode("utf-8"), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


# -- the journal ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One move of a project swap. ``put``: the staged file goes to ``path`` (the file
    there before, when ``old``, into the transaction's old/ first); ``drop``: the file at
    ``path`` goes into old/; ``aside``: the user's ``path`` is renamed to ``to``;
    ``mkdir``: a folder the new files need."""

    op: str
    path: str
    old: bool = False
    to: str = ""

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"op": self.op, "path": self.path}
        if self.op == "put":
            d["old"] = self.old
        if self.op == "aside":
            d["to"] = self.to
        return d


def _safe_rel(name: object) -> str | None:
    """``name`` if it is a plain relative path (what a journal may name), else None."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        return None
    if PurePosixPath(name).is_absolute() or any(
        part in ("", ".", "..") for part in name.split("/")
    ):
        return None
    return name


def _read_journal(out: Path) -> tuple[Path, list[Step]]:
    path = out / JOURNAL
    bad = ProjectError(
        f"{path} is not a journal flowc can follow, so it cannot tell whether {out} holds "
        "the previous project or the new one",
        hint=f"check the folder, then remove {JOURNAL} and any {TX_PREFIX}* folder, and "
        "compile again",
    )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        tx = data["tx"]
        if not (isinstance(tx, str) and tx.startswith(TX_PREFIX) and _safe_rel(tx) == tx):
            raise bad
        if "/" in tx:
            raise bad
        steps = []
        for s in data["steps"]:
            op, rel = s["op"], _safe_rel(s["path"])
            if op not in ("put", "drop", "aside", "mkdir") or rel is None:
                raise bad
            to = _safe_rel(s.get("to", "x")) if op == "aside" else ""
            if to is None:
                raise bad
            steps.append(Step(op, rel, bool(s.get("old", False)), to))
    except (OSError, ValueError, KeyError, TypeError):
        raise bad from None
    return out / tx, steps


def _done(out: Path, tx: Path) -> bool:
    """Whether the swap of ``tx`` reached its end: the manifest, moved last, is in place."""
    return not os.path.lexists(tx / "new" / MANIFEST) and os.path.lexists(out / MANIFEST)


def _roll_back(out: Path, tx: Path, steps: list[Step]) -> None:
    """Undo the steps of a swap, last first, each as far as it went (renames only)."""
    for step in reversed(steps):
        here, new, old = out / step.path, tx / "new" / step.path, tx / "old" / step.path
        if step.op == "put":
            if not os.path.lexists(new) and os.path.lexists(here):
                DISK.rename(here, new)
            if step.old and os.path.lexists(old) and not os.path.lexists(here):
                DISK.rename(old, here)
        elif step.op == "drop":
            if os.path.lexists(old) and not os.path.lexists(here):
                DISK.rename(old, here)
        elif step.op == "aside":
            moved = out / step.to
            if os.path.lexists(moved) and not os.path.lexists(here):
                DISK.rename(moved, here)
        elif step.op == "mkdir":
            with contextlib.suppress(OSError):  # not empty: something not ours is in it
                DISK.rmdir(here)
    DISK.sync(out)


def _finish(out: Path, tx: Path, steps: list[Step]) -> None:
    """After a swap (or its roll-back): the transaction folder, emptied folders of dropped
    files, then the journal go."""
    if tx.exists():
        _remove_tree(tx)
    for step in steps:
        if step.op == "drop":
            _remove_empty_parents(out, out / step.path)
    if os.path.lexists(out / JOURNAL):
        DISK.unlink(out / JOURNAL)
    DISK.sync(out)


def recover_project(out: Path) -> str | None:
    """Finish or roll back a swap a flowc left unfinished in OUT/ (killed, or its disk
    failed), and remove the transaction folders of compiles that died while staging.
    Call with the lock held; returns what it did (also warned), or None."""
    out = Path(out)
    said = None
    if os.path.lexists(out / JOURNAL):
        tx, steps = _read_journal(out)
        try:
            if _done(out, tx):
                _finish(out, tx, steps)
                said = (
                    f"{out}: finished the swap an earlier compile left unfinished; the folder "
                    "holds the project that compile wrote"
                )
            else:
                _roll_back(out, tx, steps)
                _finish(out, tx, steps)
                said = (
                    f"{out}: rolled back the swap an earlier compile left unfinished; the "
                    "folder holds the project from before that compile"
                )
        except OSError as e:
            raise ProjectError(
                f"{out} holds an unfinished swap ({JOURNAL}) that cannot be completed: "
                f"{e.filename or out}: {e.strerror or e}",
                hint="free some space or make the folder writable, then run the command again",
            ) from None
        warnings.warn(FlowcWarning(said), stacklevel=2)
    try:
        strays = [out / n for n in os.listdir(out) if n.startswith(TX_PREFIX)]
    except OSError:
        strays = []
    for tx in strays:
        # A compile killed while staging: its folder holds new/, old/ and perhaps the
        # journal it was about to move into place, nothing else.
        if tx.is_dir() and not tx.is_symlink() and set(os.listdir(tx)) <= {"new", "old", JOURNAL}:
            with contextlib.suppress(OSError):
                _remove_tree(tx)
    return said


@contextmanager
def open_project(out: Path, wait_s: float | None = None) -> Iterator[None]:
    """The lock on an existing project folder, with any unfinished swap recovered first:
    what `flowc build` and `flowc run` hold while they read OUT/. A folder with nothing to
    recover is not locked (nor written: a project on a read-only disk still runs); one
    with a lock file waits for the compile holding it, or takes over a killed one's."""
    out = Path(os.path.abspath(out))
    try:
        pending = [n for n in os.listdir(out) if _own_entry(n)]
    except OSError:
        pending = []  # not a folder: the command's own checks say so
    if not pending:
        yield
        return
    with project_lock(out, wait_s):
        recover_project(out)
        yield


# -- writing a project ----------------------------------------------------------------------------


def _aside_name(out: Path, name: str, taken: set[str]) -> str:
    """``name.user-N`` with the first N not in use."""
    n = 1
    while f"{name}.user-{n}" in taken or os.path.lexists(out / f"{name}.user-{n}"):
        n += 1
    taken.add(f"{name}.user-{n}")
    return f"{name}.user-{n}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


@dataclass
class _Plan:
    steps: list[Step] = field(default_factory=list)  # in order, the manifest's put not yet
    stage: dict[str, bytes | WeightsLayout] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # old files not deleted: the user changed them
    moved: dict[str, str] = field(default_factory=dict)  # moved aside: why


def _plan(out: Path, old: OldProject, new: dict[str, bytes | WeightsLayout], force: bool) -> _Plan:
    """The steps that turn OUT/ into the new project, and what refuses them (without
    --force: a file of the user's where flowc writes one)."""
    plan = _Plan()
    taken: set[str] = set()
    made: set[str] = set()
    asides: set[str] = set()

    def user_thing(rel: str, what: str) -> None:
        if force:
            to = _aside_name(out, rel, taken)
            plan.steps.append(Step("aside", rel, to=to))
            plan.moved[rel] = what
            asides.add(rel)
        else:
            plan.refused.append(f"{rel} ({what})")

    for name in sorted(new):
        parts = name.split("/")
        for i in range(1, len(parts)):
            folder = "/".join(parts[:i])
            if folder in made or any(folder == a or folder.startswith(a + "/") for a in asides):
                if folder not in made:
                    plan.steps.append(Step("mkdir", folder))
                    made.add(folder)
                continue
            try:
                fst = os.lstat(out / folder)
            except FileNotFoundError:
                plan.steps.append(Step("mkdir", folder))
                made.add(folder)
                continue
            if not stat.S_ISDIR(fst.st_mode):
                user_thing(folder, f"{file_kind(fst.st_mode)} where flowc needs a folder")
                if force:
                    plan.steps.append(Step("mkdir", folder))
                made.add(folder)
        here = out / name
        parent_new = any(name.startswith(m + "/") for m in made)
        st: os.stat_result | None
        try:
            st = None if parent_new else os.lstat(here)
        except FileNotFoundError:
            st = None
        data = new[name]
        if st is None:
            plan.steps.append(Step("put", name))
        elif not stat.S_ISREG(st.st_mode):
            user_thing(name, f"{file_kind(st.st_mode)} where flowc writes a file")
            plan.steps.append(Step("put", name))
        elif isinstance(data, bytes) and st.st_size == len(data) and here.read_bytes() == data:
            continue  # the same bytes: nothing to do, whoever wrote them
        elif old.owns(name, here):
            plan.steps.append(Step("put", name, old=True))
        else:
            why = (
                "changed since flowc wrote it"
                if old.listed is not None and name in old.listed
                else "a file flowc did not write"
            )
            user_thing(name, why)
            plan.steps.append(Step("put", name))
        plan.stage[name] = data
    for name in sorted(set(old.listed or ()) - set(new)):
        here = out / name
        if not os.path.lexists(here):
            continue
        if old.owns(name, here):
            plan.steps.append(Step("drop", name))
        else:
            plan.kept.append(name)
    return plan


def _same_weights(here: Path, staged: Path) -> bool:
    try:
        st = os.lstat(here)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and same_file_bytes(here, staged)


def write_project(
    out: Path,
    files: dict[str, str],
    weights: list[WeightsLayout],
    force: bool = False,
    wait_s: float | None = None,
) -> None:
    """Write the project into OUT/ as the module docstring says; ``files`` are generate()'s
    text files (flowc_model.json among them), ``weights`` one layout per rank."""
    with project_writer(out, force, wait_s) as write:
        write(files, weights)


@contextmanager
def project_writer(
    out: Path, force: bool = False, wait_s: float | None = None
) -> Iterator[Callable[[dict[str, str], list[WeightsLayout]], None]]:
    """Lock OUT/ (made if missing) for the block and yield the function that writes the
    project into it: a compile holds the folder from before its (slow) generation until
    its files are in place, so a second compile into the same folder is refused."""
    check_output_path(out)
    out = Path(os.path.abspath(out))
    check_project_dir(out, force)
    created: list[Path] = []
    try:
        for path in reversed([p for p in (out, *out.parents) if not os.path.lexists(p)]):
            DISK.mkdir(path)
            created.append(path)
    except OSError as e:
        _remove_created(created)
        raise ProjectError(
            f"cannot write {e.filename or out}: {e.strerror or e}",
            hint="check the folder's permissions and free space; nothing was created",
        ) from None
    try:
        with project_lock(out, wait_s):
            recover_project(out)
            old = check_project_dir(out, force)
            yield lambda files, weights: _write(out, old, files, weights, force)
    finally:
        _remove_created(created)


def _remove_created(created: list[Path]) -> None:
    """The folders a compile made for OUT/, when they are still empty (it failed)."""
    for path in reversed(created):
        try:
            os.rmdir(path)
        except OSError:
            return  # not empty: the project is in it


def _write(
    out: Path,
    old: OldProject,
    files: dict[str, str],
    weights: list[WeightsLayout],
    force: bool,
) -> None:
    new, manifest = project_files(files, weights)
    plan = _plan(out, old, new, force)
    if plan.refused:
        shown = ", ".join(plan.refused[:8]) + (" ..." if len(plan.refused) > 8 else "")
        raise ProjectError(
            f"{out}: flowc would overwrite what it did not write: {shown}",
            hint="pass --force to move them aside (renamed NAME.user-N, nothing deleted), "
            "or remove them",
        )
    tx: Path | None = None
    current = out
    try:
        # 1. Stage: every new file under the transaction folder, written and synced. A
        # full disk fails here, with OUT/ as it was.
        tx = Path(tempfile.mkdtemp(prefix=TX_PREFIX, dir=out))
        for sub in ("new", "old"):
            DISK.mkdir(tx / sub)
        folders = {str(PurePosixPath(s.path).parent) for s in plan.steps if s.op != "mkdir"}
        for folder in sorted(folders | {"."}):
            for sub in ("new", "old"):
                path = tx / sub
                for part in PurePosixPath(folder).parts:
                    path = path / part
                    if not path.is_dir():
                        current = path
                        DISK.mkdir(path)
        for name, data in plan.stage.items():
            current = out / name
            DISK.create(tx / "new" / name, data)
            if isinstance(data, WeightsLayout) and _same_weights(out / name, tx / "new" / name):
                # The same bytes as the file there: keep that one (and its mtime).
                DISK.unlink(tx / "new" / name)
                plan.steps = [s for s in plan.steps if s.path != name]
        steps = plan.steps
        if not steps:
            manifest_same = (out / MANIFEST).is_file() and (out / MANIFEST).read_bytes() == manifest
            if manifest_same:
                _remove_tree(tx)
                _note(out, plan)
                return
        current = out / MANIFEST
        DISK.create(tx / "new" / MANIFEST, manifest)
        steps = [*steps, Step("put", MANIFEST, old=os.path.lexists(out / MANIFEST))]
        # 2. The journal, durable before anything in OUT/ moves.
        journal = {"flowc_journal": 1, "tx": tx.name, "steps": [s.to_json() for s in steps]}
        current = out / JOURNAL
        DISK.create(tx / JOURNAL, (json.dumps(journal, indent=1) + "\n").encode("utf-8"))
        DISK.rename(tx / JOURNAL, out / JOURNAL)
        DISK.sync(out)
    except OSError as e:
        left = ""
        if tx is not None:
            try:
                if os.path.lexists(out / JOURNAL):
                    DISK.unlink(out / JOURNAL)
                _remove_tree(tx)
            except OSError:
                left = (
                    f" but for flowc's staging files ({TX_PREFIX}*, {JOURNAL}), which the next "
                    "flowc command on it removes"
                )
        raise ProjectError(
            f"cannot write {e.filename or current}: {e.strerror or e}",
            hint=f"check the folder's permissions and free space; {out} is as it was before "
            f"this compile{left}",
        ) from None
    # 3. The swap: renames only, the manifest last.
    try:
        for step in steps:
            current = out / step.path
            _apply(out, tx, step)
        DISK.sync(out)
    except BaseException as e:
        reason = f"{e.strerror or e}" if isinstance(e, OSError) else type(e).__name__
        where = (e.filename if isinstance(e, OSError) else None) or current
        try:
            _roll_back(out, tx, steps)
            _finish(out, tx, steps)
        except OSError as e2:
            raise ProjectError(
                f"cannot write {where}: {reason}; rolling back failed too "
                f"({e2.filename or out}: {e2.strerror or e2})",
                hint=f"{out} holds an unfinished swap ({JOURNAL}): the next flowc compile, "
                "build or run on it finishes or rolls it back",
            ) from None
        if not isinstance(e, OSError):
            raise
        raise ProjectError(
            f"cannot write {where}: {reason}",
            hint=f"check the folder's permissions and free space; the swap was rolled back: "
            f"{out} is as it was before this compile",
        ) from None
    # 4. Committed (the manifest is in place): the old files go.
    try:
        _finish(out, tx, steps)
    except OSError as e:
        warnings.warn(
            FlowcWarning(
                f"{out}: the new project is in place, but cleaning up failed "
                f"({e.filename or out}: {e.strerror or e}); the next flowc command on it "
                "finishes the clean-up"
            ),
            stacklevel=2,
        )
    _note(out, plan)


def _apply(out: Path, tx: Path, step: Step) -> None:
    here = out / step.path
    if step.op == "mkdir":
        DISK.mkdir(here)
    elif step.op == "aside":
        DISK.rename(here, out / step.to)
    elif step.op == "drop":
        DISK.rename(here, tx / "old" / step.path)
    else:
        if step.old:
            DISK.rename(here, tx / "old" / step.path)
        DISK.rename(tx / "new" / step.path, here)


def _note(out: Path, plan: _Plan) -> None:
    """Say what was done to the user's files."""
    for step in plan.steps:
        if step.op == "aside":
            warnings.warn(
                FlowcWarning(
                    f"moved {out / step.path} ({plan.moved.get(step.path, 'not flowc')}) "
                    f"aside to {out / step.to}"
                ),
                stacklevel=3,
            )
    for name in plan.kept:
        warnings.warn(
            FlowcWarning(
                f"kept {out / name}: the project no longer uses it, but it changed since "
                "flowc wrote it"
            ),
            stacklevel=3,
        )


def _remove_empty_parents(out: Path, path: Path) -> None:
    """After deleting ``path``: its folders inside OUT/ that are now empty (flowc/host/ when
    a runtime header folder goes away), never OUT/ itself."""
    parent = path.parent
    while parent != out and out in parent.parents:
        try:
            DISK.rmdir(parent)
        except OSError:
            return  # not empty (or not ours to remove): stop
        parent = parent.parent
