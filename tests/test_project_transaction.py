"""A compile into a folder that holds a project is a transaction: after any failure at any
write, and after a process killed at any write, the folder holds the old project or the new
one, whole, and flowc says which. Also: one compile at a time per folder (the lock), and
--force loses no byte of the user's.

The old and the new project are two real programs (mlp and resnet_tiny: different files,
weights and runtime headers); each write point of codegen/project.py's DISK is failed in
turn (once, as a full disk; from there on, as a disk gone read-only; and by killing the
process there), and the folder is compared byte by byte with both projects."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, SHARED_MODELS, run_cli

from flowc.codegen import project
from flowc.codegen.project import ProjectError, project_lock, recover_project, write_project
from flowc.codegen.weights import WeightsLayout
from flowc.compiler import generate_program
from flowc.frontend.onnx import import_onnx
from flowc.passes.manager import COMPILE_PIPELINE, PassManager

Files = tuple[dict[str, str], list[WeightsLayout]]
OURS = (project.LOCK, project.JOURNAL)


def _generate(model: Path) -> Files:
    compiled = generate_program(PassManager(COMPILE_PIPELINE).run(import_onnx(model)))
    return compiled.files, compiled.weights


@pytest.fixture(scope="module")
def programs() -> tuple[Files, Files]:
    return _generate(SHARED_MODELS / "mlp.onnx"), _generate(
        REPO / "examples" / "models" / "resnet_tiny.onnx"
    )


def contents(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root``: files by bytes, links by target, folders as 'dir'."""
    found: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            found[rel] = f"link -> {os.readlink(p)}"
        elif p.is_dir():
            found[rel] = "dir"
        else:
            found[rel] = p.read_bytes()
    return found


@pytest.fixture(scope="module")
def projects(tmp_path_factory: pytest.TempPathFactory, programs: tuple[Files, Files]) -> Any:
    """The old project (mlp) with a file of the user's beside it, and what the folder holds
    once the new project (resnet_tiny) replaced it."""
    (old_files, old_w), (new_files, new_w) = programs
    root = tmp_path_factory.mktemp("projects")
    old = root / "old"
    write_project(old, old_files, old_w)
    (old / "notes.txt").write_text("the user's own notes")
    (old / "build-host").mkdir()
    (old / "build-host" / "CMakeCache.txt").write_text("a build folder")
    new = root / "new"
    shutil.copytree(old, new, symlinks=True)
    write_project(new, new_files, new_w)
    return old, contents(old), contents(new)


def _state(out: Path, old: dict[str, Any], new: dict[str, Any]) -> str:
    now = contents(out)
    if now == old:
        return "old"
    if now == new:
        return "new"
    diff = sorted(k for k in set(now) | set(old) if now.get(k) != old.get(k))
    raise AssertionError(f"{out} holds neither project: differs from the old in {diff[:10]}")


class Counting:
    """DISK with its calls counted, the ``fail_at``-th (1-based) and, with ``sticky``, every
    later one failing with ``error``; or ``then`` run instead of it."""

    METHODS = ("mkdir", "create", "rename", "unlink", "rmdir", "sync")

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        fail_at: int = 0,
        sticky: bool = False,
        error: int = errno.ENOSPC,
        then: Callable[[], None] | None = None,
    ) -> None:
        self.calls = 0
        real = project.Disk()
        for name in self.METHODS:
            monkeypatch.setattr(project.DISK, name, self._wrap(getattr(real, name)))
        self.fail_at, self.sticky, self.error, self.then = fail_at, sticky, error, then

    def _wrap(self, fn: Callable[..., None]) -> Callable[..., None]:
        def call(*args: Any) -> None:
            self.calls += 1
            if self.fail_at and (
                self.calls == self.fail_at or (self.sticky and self.calls > self.fail_at)
            ):
                if self.then is not None:
                    self.then()
                raise OSError(self.error, os.strerror(self.error), str(args[-1]))
            fn(*args)

        return call


def _write_points(
    tmp_path: Path, projects: Any, programs: tuple[Files, Files], mp: pytest.MonkeyPatch
) -> int:
    old_dir, _, new = projects
    out = tmp_path / "count"
    shutil.copytree(old_dir, out, symlinks=True)
    counter = Counting(mp)
    write_project(out, *programs[1])
    assert contents(out) == new
    mp.undo()
    return counter.calls


def test_a_failure_at_any_write_leaves_the_old_project_or_the_new(
    tmp_path: Path, projects: Any, programs: tuple[Files, Files]
) -> None:
    old_dir, old, new = projects
    with pytest.MonkeyPatch.context() as mp:
        points = _write_points(tmp_path, projects, programs, mp)
    assert points > 25  # staging, journal, swap and clean-up all count
    seen = {"old": 0, "new": 0}
    for n in range(1, points + 1):
        out = tmp_path / f"once{n}"
        shutil.copytree(old_dir, out, symlinks=True)
        with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Counting(mp, fail_at=n)
            try:
                write_project(out, *programs[1])
                failed = None
            except ProjectError as e:
                failed = str(e)
        if failed is None and any("cleaning up failed" in str(w.message) for w in caught):
            # The new project is in place; the next command on the folder (here the
            # recovery they all start with) removes what the clean-up left.
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                said = recover_project(out)
            assert said is None or "finished" in said, said
        state = _state(out, old, new)
        seen[state] += 1
        if failed is not None:
            # Failed: the message says the folder is as it was.
            assert state == "old" and "as it was before this compile" in failed, failed
            assert "No space left on device" in failed
        else:
            # Only the clean-up after the swap may fail without failing the compile.
            assert state == "new"
        shutil.rmtree(out)
    assert seen["old"] > 20 and seen["new"] >= 1, seen


def test_a_disk_that_dies_at_any_write_is_recovered_by_the_next_command(
    tmp_path: Path, projects: Any, programs: tuple[Files, Files], capsys: pytest.CaptureFixture[str]
) -> None:
    """Every write from the n-th on fails (the roll-back's too): the compile fails; the
    folder may hold an unfinished swap, which the next command (here `flowc build`)
    finishes or rolls back, saying which."""
    old_dir, old, new = projects
    with pytest.MonkeyPatch.context() as mp:
        points = _write_points(tmp_path, projects, programs, mp)
    unfinished = 0
    for n in range(1, points + 1):
        out = tmp_path / f"dead{n}"
        shutil.copytree(old_dir, out, symlinks=True)
        with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Counting(mp, fail_at=n, sticky=True, error=errno.EROFS)
            try:
                write_project(out, *programs[1])
                message = "ok: " + " ".join(str(w.message) for w in caught)
            except ProjectError as e:
                message = str(e)
        if (out / project.JOURNAL).exists():
            unfinished += 1
            assert "unfinished swap" in message or "next flowc command" in message, message
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                said = recover_project(out)
            assert said is not None and any(said == str(w.message) for w in caught)
            state = _state(out, old, new)
            assert ("rolled back" in said) == (state == "old"), said
        else:
            if "which the next flowc command on it removes" in message:
                recover_project(out)  # a staging folder the dead disk kept
            state = _state(out, old, new)
            assert (state == "old") == ("as it was before" in message), message
        shutil.rmtree(out)
    assert unfinished > 10


def _killed_at(n: int, out: Path, files: Files) -> int:
    """Write ``files`` into ``out`` in a forked child that dies at the n-th write (no
    roll-back, no clean-up: as if killed there); returns its exit status."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            real = project.Disk()
            calls = [0]

            def wrap(fn: Callable[..., None]) -> Callable[..., None]:
                def call(*args: Any) -> None:
                    calls[0] += 1
                    if calls[0] == n:
                        os._exit(9)
                    fn(*args)

                return call

            for name in Counting.METHODS:
                setattr(project.DISK, name, wrap(getattr(real, name)))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                write_project(out, *files)
        finally:
            os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_compile_killed_at_any_write_is_finished_or_rolled_back(
    tmp_path: Path, projects: Any, programs: tuple[Files, Files], capsys: pytest.CaptureFixture[str]
) -> None:
    """The process dies at the n-th write; the lock it held dies with it, and `flowc build`
    on the folder finishes or rolls back what it left, saying which."""
    old_dir, old, new = projects
    with pytest.MonkeyPatch.context() as mp:
        points = _write_points(tmp_path, projects, programs, mp)
    states = {"old": 0, "new": 0}
    for n in range(1, points + 1):
        out = tmp_path / f"killed{n}"
        shutil.copytree(old_dir, out, symlinks=True)
        assert _killed_at(n, out, programs[1]) == 9
        # Recovers, then refuses (sanitizers are for host builds): no build is made.
        code, err = run_cli(
            ["build", str(out), "--target", "cuda", "--sanitize", "address"], capsys
        )
        assert code == 2 and "--sanitize" in err, err
        state = _state(out, old, new)
        states[state] += 1
        if "unfinished" in err:
            assert ("rolled back" in err) == (state == "old"), err
        shutil.rmtree(out)
    assert states["old"] and states["new"], states


def test_on_a_full_tmpfs_the_old_project_stays(tmp_path: Path) -> None:
    """A real file system that fills up: a small tmpfs (in a mount namespace of its own),
    an mlp project on it, then a recompile as vit_tiny, which does not fit."""
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is needed to mount a private tmpfs")
    mount = tmp_path / "small"
    mount.mkdir()
    script = textwrap.dedent(
        f"""
        import json, os, subprocess, sys
        from pathlib import Path
        out = Path({str(mount)!r}) / "p"
        def flowc(model):
            return subprocess.run(
                [sys.executable, "-m", "flowc", "compile", model, "-o", str(out),
                 "--target", "host"], capture_output=True, text=True)
        def files():
            return {{str(p.relative_to(out)): p.read_bytes().hex() for p in sorted(out.rglob("*"))
                    if p.is_file()}}
        first = flowc({str(SHARED_MODELS / "mlp.onnx")!r})
        before = files()
        st = os.statvfs(out)
        second = flowc({str(SHARED_MODELS / "vit_tiny.onnx")!r})
        print(json.dumps({{"first": first.returncode, "second": second.returncode,
                           "err": second.stderr, "same": files() == before,
                           "entries": sorted(os.listdir(out)),
                           "free": st.f_bavail * st.f_frsize}}))
        """
    )
    # As root: mount in a namespace of its own; otherwise as root of a user namespace.
    ns = ["unshare", "--mount"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    size_kb = 600  # the mlp project takes about 420 KiB, the files vit_tiny stages about 410
    r = subprocess.run(
        [
            *ns,
            "sh",
            "-c",
            f'mount -t tmpfs -o size={size_kb}k tmpfs "$1" && exec "$2" -c "$3"',
            "sh",
            str(mount),
            sys.executable,
            script,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if r.returncode != 0 and "mount" in r.stderr and os.geteuid() != 0:
        pytest.skip(f"cannot mount a tmpfs here (not root, no user namespaces): {r.stderr}")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.splitlines()[-1])
    assert result["first"] == 0
    assert result["second"] == 2, result["err"]
    assert "No space left on device" in result["err"], result["err"]
    assert "as it was before this compile" in " ".join(result["err"].split())
    assert "Traceback" not in result["err"]
    assert result["same"], "the old project changed"
    assert not [n for n in result["entries"] if n.startswith(".flowc")], result["entries"]


# -- the lock ----------------------------------------------------------------------------------


@pytest.fixture
def held(tmp_path: Path) -> Iterator[Path]:
    out = tmp_path / "p"
    out.mkdir()
    with project_lock(out):
        yield out


def test_a_second_compile_waits_then_is_refused_naming_the_first(
    held: Path, programs: tuple[Files, Files], monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    monkeypatch.setattr(project, "LOCK_WAIT_S", 0.3)
    t0 = time.monotonic()
    with pytest.raises(ProjectError, match=rf"being written by another flowc \(pid {os.getpid()} "):
        write_project(held, *programs[0])
    assert time.monotonic() - t0 >= 0.3
    assert sorted(os.listdir(held)) == [project.LOCK]  # nothing written


def test_a_lock_left_by_a_killed_compile_is_taken_over(
    tmp_path: Path, programs: tuple[Files, Files]
) -> None:
    out = tmp_path / "p"
    out.mkdir()
    (out / project.LOCK).write_text('{"pid": 99999999, "host": "gone"}')  # no flock on it
    write_project(out, *programs[0])
    assert not [n for n in os.listdir(out) if n.startswith(".flowc")]  # no lock file left


def test_two_compiles_at_once_leave_one_whole_project(tmp_path: Path) -> None:
    """Two real `flowc compile` processes into one folder: each exits 0 (the second waited
    for the first) or 2 naming the other; the folder holds one of the two projects, whole."""
    out = tmp_path / "p"
    cmds = [
        [sys.executable, "-m", "flowc", "compile", str(m), "-o", str(out), "--target", "host"]
        for m in (SHARED_MODELS / "mlp.onnx", SHARED_MODELS / "vit_tiny.onnx")
    ]
    procs = [subprocess.Popen(c, stderr=subprocess.PIPE, text=True) for c in cmds]
    results = [(p.wait(), p.stderr.read() if p.stderr else "") for p in procs]
    for code, err in results:
        assert code == 0 or (code == 2 and "being written by another flowc" in err), err
        assert "Traceback" not in err
    manifest = json.loads((out / project.MANIFEST).read_text())
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert on_disk == {*manifest["files"], project.MANIFEST}
    for name, digest in manifest["sha256"].items():
        import hashlib

        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name


# -- --force and the user's files -------------------------------------------------------------------


def test_force_moves_the_users_files_aside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "main.cu").write_text("int main() { return 42; }\n")
    (out / "CMakeLists.txt").write_text("project(mine)\n")
    (out / "main.cu.user-1").write_text("an older one")  # taken: the next number is used
    victim = tmp_path / "victim.h"
    victim.write_text("precious")
    (out / "model.h").symlink_to(victim)
    code, err = run_cli(
        ["compile", str(SHARED_MODELS / "mlp.onnx"), "-o", str(out), "--force"], capsys
    )
    assert code == 0, err
    err = " ".join(err.split())
    assert (out / "main.cu.user-2").read_text() == "int main() { return 42; }\n"
    assert (out / "main.cu.user-1").read_text() == "an older one"
    assert (out / "CMakeLists.txt.user-1").read_text() == "project(mine)\n"
    assert (out / "model.h.user-1").is_symlink() and victim.read_text() == "precious"
    assert not (out / "model.h").is_symlink()
    for name in ("main.cu.user-2", "CMakeLists.txt.user-1", "model.h.user-1"):
        assert name in err, err
    assert (out / "main.cu").read_text().startswith("// Generated by flowc")


def test_a_file_the_user_changed_is_not_replaced_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p"
    model = str(SHARED_MODELS / "mlp.onnx")
    code, err = run_cli(["compile", model, "-o", str(out)], capsys)
    assert code == 0, err
    edited = (out / "main.cu").read_text() + "// my change\n"
    (out / "main.cu").write_text(edited)
    code, err = run_cli(["compile", model, "-o", str(out)], capsys)
    assert code == 2
    assert "main.cu changed since flowc wrote it" in err and "--force" in err
    assert (out / "main.cu").read_text() == edited
    code, err = run_cli(["compile", model, "-o", str(out), "--force"], capsys)
    assert code == 0, err
    assert (out / "main.cu.user-1").read_text() == edited


def test_build_and_run_lock_only_a_folder_with_something_to_recover(
    tmp_path: Path, programs: tuple[Files, Files], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A project with no unfinished swap is only read by build and run: no lock file is
    made in it (a project on a read-only disk still runs)."""
    from flowc.harness.build import recover

    out = tmp_path / "p"
    write_project(out, *programs[0])
    before = contents(out)

    def no_lock(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("locked a folder with nothing to recover")

    monkeypatch.setattr(project, "project_lock", no_lock)
    recover(out)
    assert contents(out) == before
