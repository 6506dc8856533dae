"""Every output option against every kind of path (flowc/atomic_file.py's rules): a new
path or a regular file is written whole (the file replaced, its permission bits kept); a
symbolic link is followed and its target written the same way; a FIFO or character device
is written through and stays what it is (a FIFO with no reader is exit 2); a folder, a
socket or a block device is refused with exit 2 and left alone. Nothing here ever touches
the machine's /dev: device nodes are made by mknod in a temp folder (as root only)."""

from __future__ import annotations

import io
import os
import socket
import stat
import threading
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_cli
from onnx import TensorProto, helper, numpy_helper

from flowc.codegen import project

ROOT = os.geteuid() == 0
NULL, FULL = os.makedev(1, 3), os.makedev(1, 7)  # the numbers of /dev/null and /dev/full


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    w = np.linspace(-1, 1, 12).astype(np.float32).reshape(3, 4)
    g = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["m"]), helper.make_node("Tanh", ["m"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    path = tmp_path_factory.mktemp("model") / "tiny.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _npz(data: bytes) -> None:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert z.namelist() == ["y.npy"]


def _fake_run(monkeypatch: pytest.MonkeyPatch, tmp: Path) -> Path:
    """`flowc run` without a build: the harness answers as a built driver would (the
    option's writing is what is tested here)."""
    from flowc.harness import build

    info = {"inputs": [{"name": "x", "dtype": "f32"}], "outputs": [{"name": "y"}]}
    monkeypatch.setattr(build, "project_info", lambda out: info)
    monkeypatch.setattr(build, "run", lambda *a, **k: ({"y": np.ones((3, 4), np.float32)}, ""))
    monkeypatch.setattr(build, "check_built", lambda *a, **k: None)
    return tmp


@pytest.fixture(scope="module")
def csv_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("csv") / "b.csv"
    path.write_text("id,lower,upper,size\n0,0,2,64\n1,1,3,32\n2,2,4,64\n")
    return path


# name -> (the file name the option wants, its arguments given the path, what its bytes are)
Output = tuple[str, Callable[[Path, Path, Path], list[str]], Callable[[bytes], None]]
OUTPUTS: dict[str, Output] = {
    "eval -o": (
        "out.npz",
        lambda p, m, c: ["eval", str(m), "--random-inputs", "-o", str(p)],
        _npz,
    ),
    "run -o": (
        "out.npz",
        lambda p, m, c: ["run", str(m.parent), "--target", "host", "-o", str(p)],
        _npz,
    ),
    "convert -o": (
        "out.flow",
        lambda p, m, c: ["convert", str(m), "-o", str(p)],
        lambda b: b.decode().index("graph"),
    ),
    "inspect --gantt": (
        "out.png",
        lambda p, m, c: ["inspect", str(m), "--gantt", str(p)],
        lambda b: b.startswith(b"\x89PNG"),
    ),
    "inspect --report": (
        "index.html",  # the page inside the folder given
        lambda p, m, c: ["inspect", str(m), "--report", str(p.parent)],
        lambda b: b.lstrip().lower().startswith(b"<!doctype html"),
    ),
    "plan-memory --offsets": (
        "offsets.csv",
        lambda p, m, c: ["plan-memory", str(c), "--offsets", str(p)],
        lambda b: b.startswith(b"id,lower,upper,size,offset\n"),
    ),
    "conformance --json": (
        "results.json",
        lambda p, m, c: ["conformance", "--filter", "^test_abs$", "-j", "1", "--json", str(p)],
        lambda b: b'"test_abs"' in b,
    ),
}


@pytest.fixture
def call(
    tiny: Path,
    csv_file: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> Callable[[str, Path], tuple[int, str]]:
    def run(output: str, path: Path) -> tuple[int, str]:
        if output == "run -o":
            _fake_run(monkeypatch, tmp_path)
        return run_cli(OUTPUTS[output][1](path, tiny, csv_file), capsys)

    return run


def _check(output: str, data: bytes) -> None:
    assert OUTPUTS[output][2](data) is not False, data[:200]


def _folder(tmp_path: Path, output: str) -> Path:
    d = tmp_path / "outdir"
    d.mkdir()
    return d / OUTPUTS[output][0]


class Reader:
    """The read end of a FIFO, opened before the writer comes (so the writer finds a
    reader), drained by a thread until the writer closes it."""

    def __init__(self, fifo: Path) -> None:
        self.fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        os.set_blocking(self.fd, True)
        self.data = b""
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        chunks = []
        while True:
            # Read before the check: a writer that came and went before close() set done
            # left its bytes in the pipe, and this read still gets them (checking done after
            # an EOF read instead loses them when the thread is preempted in between).
            finished = self.done
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                # EOF: no writer. Wait for the first one (the command may not have opened
                # the FIFO yet) unless data came already.
                if chunks or finished:
                    break
                threading.Event().wait(0.01)
                continue
            chunks.append(chunk)
        self.data = b"".join(chunks)

    done = False

    def close(self) -> bytes:
        self.done = True
        self.thread.join(10)
        os.close(self.fd)
        return self.data


@pytest.fixture
def reader() -> Iterator[Callable[[Path], Reader]]:
    made: list[Reader] = []

    def make(fifo: Path) -> Reader:
        made.append(Reader(fifo))
        return made[-1]

    yield make
    for r in made:
        if not r.done:
            r.close()


@pytest.mark.parametrize("output", OUTPUTS)
def test_new_and_regular_files_are_written_whole(
    output: str, call: Callable[[str, Path], tuple[int, str]], tmp_path: Path
) -> None:
    path = _folder(tmp_path, output)
    code, text = call(output, path)
    assert code == 0, text
    _check(output, path.read_bytes())
    path.write_bytes(b"old bytes")
    path.chmod(0o640)
    code, text = call(output, path)
    assert code == 0, text
    _check(output, path.read_bytes())
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # the replaced file's bits kept
    assert sorted(p.name for p in path.parent.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("output", OUTPUTS)
def test_a_link_is_followed_and_stays_a_link(
    output: str, call: Callable[[str, Path], tuple[int, str]], tmp_path: Path
) -> None:
    path = _folder(tmp_path, output)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / OUTPUTS[output][0]
    target.write_bytes(b"old")
    path.symlink_to(target)
    code, text = call(output, path)
    assert code == 0, text
    assert path.is_symlink() and os.readlink(path) == str(target)
    _check(output, target.read_bytes())
    target.unlink()  # dangling: the target is created, the link kept
    code, text = call(output, path)
    assert code == 0, text
    assert path.is_symlink()
    _check(output, target.read_bytes())


@pytest.mark.parametrize("output", OUTPUTS)
def test_a_fifo_is_written_through(
    output: str,
    call: Callable[[str, Path], tuple[int, str]],
    tmp_path: Path,
    reader: Callable[[Path], Reader],
) -> None:
    path = _folder(tmp_path, output)
    os.mkfifo(path)
    code, text = call(output, path)  # nobody reads it: refused, not a hang
    assert code == 2, text
    assert "no process is reading" in text and "Traceback" not in text, text
    assert stat.S_ISFIFO(path.lstat().st_mode)
    r = reader(path)
    code, text = call(output, path)
    data = r.close()
    assert code == 0, text
    _check(output, data)
    assert stat.S_ISFIFO(path.lstat().st_mode)
    beside = {"convert -o": ["out.weights.npz"]}.get(output, [])  # the program's weights
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, *beside])


@pytest.mark.skipif(not ROOT, reason="mknod of a character device needs root")
@pytest.mark.parametrize("output", OUTPUTS)
def test_a_character_device_is_written_through_and_stays(
    output: str, call: Callable[[str, Path], tuple[int, str]], tmp_path: Path
) -> None:
    path = _folder(tmp_path, output)
    os.mknod(path, 0o666 | stat.S_IFCHR, NULL)
    code, text = call(output, path)
    assert code == 0, text
    st = path.lstat()
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == NULL
    full = path.with_name("full_" + path.name)
    os.mknod(full, 0o666 | stat.S_IFCHR, FULL)
    if output == "inspect --report":  # the page's name is fixed: a folder of its own
        other = tmp_path / "fulldir"
        other.mkdir()
        full = other / "index.html"
        os.mknod(full, 0o666 | stat.S_IFCHR, FULL)
    code, text = call(output, full)
    assert code == 2, text
    assert "No space left on device" in text and "Traceback" not in text, text
    assert stat.S_ISCHR(full.lstat().st_mode) and full.lstat().st_rdev == FULL


def _refused_kinds(tmp_path: Path, path: Path) -> Iterator[tuple[str, Callable[[], None]]]:
    def sock() -> None:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()

    yield "a socket", sock
    yield "a directory", lambda: path.mkdir()
    if ROOT:
        # A device number no driver has: were it opened, it could not be written.
        yield "a block device", lambda: os.mknod(path, 0o600 | stat.S_IFBLK, os.makedev(250, 250))


@pytest.mark.parametrize("output", OUTPUTS)
def test_folders_sockets_and_block_devices_are_refused(
    output: str, call: Callable[[str, Path], tuple[int, str]], tmp_path: Path
) -> None:
    path = _folder(tmp_path, output)
    for kind, make in _refused_kinds(tmp_path, path):
        if output == "inspect --report" and kind == "a directory":
            continue  # --report takes a folder: its page is what may not be one
        make()
        before = path.lstat()
        code, text = call(output, path)
        assert code == 2, (kind, text)
        assert "Traceback" not in text and "internal error" not in text, text
        assert kind in text or "not a folder" in text or "a file is in the way" in text, text
        after = path.lstat()
        assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino), kind
        if stat.S_ISDIR(after.st_mode):
            path.rmdir()
        else:
            path.unlink()


# -- the files of a project ------------------------------------------------------------------------


def _special_kinds(path: Path) -> Iterator[tuple[str, Callable[[], None]]]:
    yield "a FIFO (named pipe)", lambda: os.mkfifo(path)
    yield "a symbolic link", lambda: path.symlink_to(path.with_name("elsewhere"))
    yield "a directory", lambda: path.mkdir()
    if ROOT:
        yield "a character device", lambda: os.mknod(path, 0o666 | stat.S_IFCHR, NULL)


def test_special_files_in_a_project_are_never_replaced(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO, link, folder or device node where a compile writes a file: refused without
    --force (nothing written), moved aside with it (still what it was)."""
    out = tmp_path / "p"
    code, text = run_cli(["compile", str(tiny), "-o", str(out)], capsys)
    assert code == 0, text
    for kind, make in _special_kinds(out / "model.cu"):
        (out / "model.cu").unlink()
        make()
        before = (out / "model.cu").lstat()
        code, text = run_cli(["compile", str(tiny), "-o", str(out)], capsys)
        # Refused: as a file of the user's where flowc writes one, or, the manifest listing
        # it, as a path flowc cannot own.
        assert code == 2, text
        assert (
            f"model.cu ({kind} where flowc writes a file)" in text
            or "lists 'model.cu' (not a regular file)" in text
        ), text
        assert (out / "model.cu").lstat().st_ino == before.st_ino
        code, text = run_cli(["compile", str(tiny), "-o", str(out), "--force"], capsys)
        assert code == 0, text
        moved = out / "model.cu.user-1"
        assert (moved.lstat().st_mode, moved.lstat().st_ino) == (before.st_mode, before.st_ino)
        assert (out / "model.cu").is_file() and not (out / "model.cu").is_symlink()
        if moved.is_dir() and not moved.is_symlink():
            moved.rmdir()
        else:
            moved.unlink()
    assert not [n for n in os.listdir(out) if n.startswith(".flowc")]


def test_a_project_folder_that_is_a_special_file_is_refused(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p"
    os.mkfifo(out)
    code, text = run_cli(["compile", str(tiny), "-o", str(out)], capsys)
    assert code == 2 and "a FIFO (named pipe), not a folder" in text, text
    assert stat.S_ISFIFO(out.lstat().st_mode)
    assert project.LOCK not in os.listdir(tmp_path)


def test_convert_keeps_the_old_program_and_weights_when_the_program_fails(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weights are renamed into place before the program: when the program then cannot
    be, the weights file they replaced comes back, so the old pair still loads."""
    out = tmp_path / "m.flow"
    weights = tmp_path / "m.weights.npz"
    out.write_text("the old program")
    weights.write_bytes(b"the old weights")
    real = os.replace

    def failing(src: str, dst: str) -> None:
        if str(dst).endswith(".flow"):
            raise OSError(28, "No space left on device", str(dst))
        real(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    code, text = run_cli(["convert", str(tiny), "-o", str(out)], capsys)
    assert code == 2 and "No space left on device" in text, text
    assert out.read_text() == "the old program"
    assert weights.read_bytes() == b"the old weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.flow", "m.weights.npz"]
