"""What `flowc compile -o DIR` does to DIR and to the text it writes there: it keeps every
file it did not write, replaces its own files only when their bytes change (so a rebuild
after an identical recompile does nothing), never deletes outside DIR whatever the old
manifest says, refuses paths the build tools cannot take, and lets no name from the model or
the command line run as code in model.cu, model.h, main.cu or CMakeLists.txt."""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from flowc.cli import main
from flowc.codegen import project
from flowc.codegen.cpp import c_comment, cmake_comment

SENTINEL = "flowc_sentinel"
# Each name holds what would end a C string or comment, start a preprocessor line or a CMake
# command, expand a variable in CMake, Make or a shell, or reorder text (bidi); the input's
# name ends in a backslash, which would continue a // comment onto the next line.
IN_NAME = "in\n#error in */ /* ${HOME} $(touch x) ; \"q\" 's' \\ \t\x01\u202e end\\"
OUT_NAME = f"out\nexecute_process(COMMAND touch {SENTINEL}) */ /* # ; $(id) ${{X}} \\"
GRAPH_NAME = (
    f"g\n#error graph */ /* ${{X}} $(id) ; \"q\" 's' \x01\u2066 "
    f"execute_process(COMMAND touch {SENTINEL})\\"
)
# The model's file name (no '/': no file name holds one): a line break followed by a CMake
# command that would create the sentinel in the project folder at configure time, then C
# preprocessor lines. The last line starts with '#' so that, were the name pasted raw,
# CMakeLists.txt would still parse and run the command.
FILE_NAME = (
    "m * ; $(touch x) \"q\" 's' \t\x01\u202e \\\n"
    f"execute_process(COMMAND touch {SENTINEL} WORKING_DIRECTORY ${{CMAKE_CURRENT_SOURCE_DIR}})\n"
    "#error file\n#x.onnx"
)
W = np.linspace(-1, 1, 12).astype(np.float32).reshape(3, 4)


def _model(path: Path, x: str = "x", y: str = "y", graph: str = "tiny") -> Path:
    g = helper.make_graph(
        [helper.make_node("Mul", [x, "w"], ["m"]), helper.make_node("Tanh", ["m"], [y])],
        graph,
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, [3, 4])],
        initializer=[numpy_helper.from_array(W, "w")],
        doc_string=GRAPH_NAME,
    )
    m = helper.make_model(
        g,
        opset_imports=[helper.make_opsetid("", 17)],
        producer_name=GRAPH_NAME,
        doc_string=OUT_NAME,
    )
    onnx.save(m, str(path))
    return path


def flowc(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """Run the CLI in this process (one import for all the tests); returns exit code, out, err."""
    code: int | str | None = 0
    try:
        main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    r = capsys.readouterr()
    return int(code or 0), r.out, r.err


def clean_error(result: tuple[int, str, str], *fragments: str) -> None:
    code, stdout, stderr = result
    assert code == 2, stdout + stderr
    assert "Traceback" not in stderr and "internal error" not in stderr
    assert stderr.startswith("error: ") or "\nerror: " in stderr, stderr
    for f in fragments:
        assert f in stderr, f"{f!r} not in {stderr!r}"


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` (build folders too): relative path -> (mtime_ns, size)."""
    return {
        str(p.relative_to(root)): (p.lstat().st_mtime_ns, p.lstat().st_size)
        for p in sorted(root.rglob("*"))
        if not p.is_dir() or p.is_symlink()
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model(tmp_path_factory.mktemp("model") / "tiny.onnx")


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The hostile model compiled (no --prefix: it is made from the model's name) into a
    folder whose path holds characters the build tools take (space, #, parentheses, &, é,
    =, %, ~), and built for the host: shared by the tests below, the one build of this file."""
    root = tmp_path_factory.mktemp("hostile")
    model = _model(root / FILE_NAME, IN_NAME, OUT_NAME, GRAPH_NAME)
    out = root / "out dir #1 (é) &x=%~"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()) as err:
        main(["compile", str(model), "-o", str(out), "--target", "host"])
        # The hint is a command a shell takes back as it is.
        # (compile --target host recorded the target: build takes it without the flag.)
        assert stdout.getvalue().endswith(f"build it with: flowc build {shlex.quote(str(out))}\n")
        main(["build", str(out), "--target", "host"])
    assert (out / "build-host" / "model_main").is_file(), err.getvalue()
    return model, out


def test_hostile_names_stay_text(hostile: tuple[Path, Path], tmp_path: Path) -> None:
    model, out = hostile
    # Nothing the names say ran: not at configure time, not at build time.
    assert not list(model.parent.rglob(f"{SENTINEL}*")), "a name ran as a CMake command"
    assert not Path(SENTINEL).exists()
    for name in ("model.cu", "model.h", "main.cu", "CMakeLists.txt"):
        text = (out / name).read_text(encoding="utf-8")
        first, second = text.split("\n", 2)[:2]
        assert first.endswith(". Do not edit."), (name, first)  # the comment stayed one line
        assert "*/" not in first and "/*" not in first and "\u202e" not in text
        assert not second.startswith(("execute_process", "#error")), (name, second)
        assert not re.search(r"^\s*#\s*error|^\s*execute_process", text, re.M), name
    # Names come back byte for byte through the C API.
    info = json.loads((out / "flowc_model.json").read_text())
    p = info["prefix"]
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", p), p
    lib = ctypes.CDLL(str(out / "build-host" / f"lib{p}model.so"))
    for fn in ("input_name", "output_name"):
        getattr(lib, p + fn).restype = ctypes.c_char_p
    assert getattr(lib, p + "input_name")(0).hex() == IN_NAME.encode().hex()
    assert getattr(lib, p + "output_name")(0).hex() == OUT_NAME.encode().hex()


def test_hostile_names_run(
    hostile: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out = hostile
    x = np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    res = tmp_path / "y.npz"
    code, _, err = flowc(
        capsys, "run", out, "--input", f"{IN_NAME}={tmp_path / 'x.npy'}", "-o", res,
        "--target", "host",
    )  # fmt: skip
    assert code == 0, err
    got = np.load(res)
    assert list(got.files) == [OUT_NAME]
    np.testing.assert_allclose(got[OUT_NAME], np.tanh(x * W), rtol=1e-6, atol=1e-6)


def test_identical_recompile_touches_nothing(
    hostile: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model, out = hostile
    (out / "keep.txt").write_text("mine")
    (out / "notes").mkdir()
    (out / "notes" / "a.txt").write_text("mine too")
    before = snapshot(out)
    code, _, err = flowc(capsys, "compile", model, "-o", out, "--target", "host")
    assert code == 0, err
    assert snapshot(out) == before  # no file rewritten, none deleted, no temp file left
    r = subprocess.run(
        ["cmake", "--build", str(out / "build-host")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Building" not in r.stdout and "Linking" not in r.stdout, r.stdout
    # Nothing was rebuilt (Make updates only its own dependency notes, compiler_depend.*).
    after = snapshot(out)
    built = [n for n in before if n.endswith((".o", ".so", "model_main"))]
    assert len(built) >= 4 and all(after[n] == before[n] for n in built)


def test_recompile_replaces_own_files_and_keeps_the_rest(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p"
    code, _, err = flowc(capsys, "compile", tiny, "-o", out, "--mesh", "2", "--target", "host")
    assert code == 0, err
    assert (out / "weights.rank1.bin").is_file() and not (out / "weights.bin").exists()
    (out / "keep.txt").write_text("mine")
    (out / "build-host").mkdir()
    (out / "build-host" / "CMakeCache.txt").write_text("cache")
    code, _, err = flowc(capsys, "compile", tiny, "-o", out, "--target", "host")
    assert code == 0, err
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    listed = json.loads((out / "flowc_model.json").read_text())["files"]
    # The rank files went; the user's files and the build folder stayed.
    assert on_disk == {*listed, "flowc_model.json", "keep.txt", "build-host/CMakeCache.txt"}
    assert "weights.bin" in listed and not [n for n in on_disk if "rank" in n]
    assert "flowc/flowc.cmake" in listed and "flowc/host/emulator.h" in listed
    assert (out / "keep.txt").read_text() == "mine"


def test_non_empty_folder_is_refused_and_force_loses_nothing(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    here = tmp_path / "here"
    here.mkdir()
    (here / "keep.txt").write_text("mine")
    (here / "model.h").write_text("my own header")  # a name flowc writes too
    monkeypatch.chdir(here)
    for target in (here, "."):
        clean_error(flowc(capsys, "compile", tiny, "-o", target), "not empty", "--force")
        assert sorted(os.listdir(here)) == ["keep.txt", "model.h"]
    code, _, err = flowc(capsys, "compile", tiny, "-o", ".", "--force", "--target", "host")
    assert code == 0, err
    assert (here / "keep.txt").read_text() == "mine"
    assert (here / "model.h").read_text().startswith("// Generated by flowc")
    # The user's header was not lost: moved aside, and the warning names where.
    assert (here / "model.h.user-1").read_text() == "my own header"
    assert "model.h.user-1" in " ".join(err.split())
    assert "keep.txt" not in json.loads((here / "flowc_model.json").read_text())["files"]


def test_hostile_manifest_deletes_nothing(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    victims = tmp_path / "victims"
    victims.mkdir()
    for n in ("a.txt", "b.txt", "c.txt", "d.txt"):
        (victims / n).write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / "link.txt").symlink_to(victims / "b.txt")
    (out / "sub").symlink_to(victims, target_is_directory=True)
    (out / "dir").mkdir()
    entries = [
        "../victims/a.txt",
        str(victims / "a.txt"),
        "dir/../../victims/a.txt",
        "link.txt",
        "sub/c.txt",
        "dir",
        "./d.txt",
    ]
    for entry in entries:
        (out / "flowc_model.json").write_text(json.dumps({"files": ["model.cu", entry]}))
        clean_error(flowc(capsys, "compile", tiny, "-o", out), "flowc_model.json lists")
    # With --force the list is not trusted at all: flowc writes its files, deletes nothing.
    code, _, err = flowc(capsys, "compile", tiny, "-o", out, "--force", "--target", "host")
    assert code == 0, err
    assert sorted(p.name for p in victims.iterdir()) == ["a.txt", "b.txt", "c.txt", "d.txt"]
    assert all(p.read_text() == "precious" for p in victims.iterdir())
    assert (out / "link.txt").is_symlink() and (out / "sub").is_symlink() and (out / "dir").is_dir()


def test_prefix_and_unbuildable_paths_are_refused_before_work(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p"
    clean_error(
        flowc(capsys, "compile", tiny, "-o", out, "--prefix", "a b); /*"), "not a C identifier"
    )
    clean_error(flowc(capsys, "compile", tiny, "-o", out, "--arch", "sm_٩٠"), "--arch")
    for ch in ['"', "'", "`", "$", ";", "\\", ",", "|", ":", "[", "]", "\n", "\t", "\x7f", "\x85"]:
        clean_error(
            flowc(capsys, "compile", tiny, "-o", tmp_path / f"a{ch}b" / "o"), "cannot handle"
        )
    assert sorted(os.listdir(tmp_path)) == []  # nothing made, not even the folder


def test_unwritable_targets_are_clean_errors(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile").write_text("x")
    clean_error(flowc(capsys, "compile", tiny, "-o", tmp_path / "afile" / "out"), "is a file")
    code, _, err = flowc(capsys, "compile", tiny, "-o", tmp_path / "afile")
    assert code == 2 and "afile" in err and "Traceback" not in err, err
    clean_error(flowc(capsys, "compile", tiny, "-o", "/proc/flowc-out"), "/proc")
    assert sorted(os.listdir(tmp_path)) == ["afile"]


def test_failed_write_leaves_nothing_behind(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only file system seen from Python (root ignores permission bits): moving one
    file into place fails. Exit 2 naming it, no temp file or half project, the next compile
    works. (tests/test_project_transaction.py fails every write point in turn.)"""
    real_rename = project.DISK.rename
    fail_on = "weights.bin"

    def failing(src: Path, dst: Path) -> None:
        if os.path.basename(dst) == fail_on:
            raise PermissionError(13, "Permission denied", str(dst))
        real_rename(src, dst)

    fresh = tmp_path / "new" / "fresh"
    monkeypatch.setattr(project.DISK, "rename", failing)
    clean_error(flowc(capsys, "compile", tiny, "-o", fresh), str(fresh / "weights.bin"))
    assert sorted(os.listdir(tmp_path)) == []  # the folders it made went too
    monkeypatch.setattr(project.DISK, "rename", real_rename)
    code, _, err = flowc(capsys, "compile", tiny, "-o", fresh, "--target", "host")
    assert code == 0, err
    (fresh / "keep.txt").write_text("mine")
    (fresh / "model.h").unlink()  # so the recompile must write it
    before = sorted(os.listdir(fresh))
    fail_on = "weights.rank1.bin"  # after model.h and weights.rank0.bin were put in place
    monkeypatch.setattr(project.DISK, "rename", failing)
    clean_error(
        flowc(capsys, "compile", tiny, "-o", fresh, "--mesh", "2"),
        "weights.rank1.bin",
        "rolled back",
    )
    # Nothing this attempt created stays (weights.rank*.bin), nothing else was touched.
    assert sorted(os.listdir(fresh)) == before
    assert sorted(os.listdir(fresh.parent)) == ["fresh"]
    monkeypatch.setattr(project.DISK, "rename", real_rename)
    code, _, err = flowc(capsys, "compile", tiny, "-o", fresh, "--target", "host")
    assert code == 0, err
    assert (fresh / "model.h").is_file() and (fresh / "keep.txt").read_text() == "mine"


def test_files_get_the_umask_mode(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = os.umask(0o027)
    try:
        code, _, err = flowc(capsys, "compile", tiny, "-o", tmp_path / "p", "--target", "host")
    finally:
        os.umask(old)
    assert code == 0, err
    out = tmp_path / "p"
    assert out.stat().st_mode & 0o777 == 0o750
    assert (out / "flowc" / "host").stat().st_mode & 0o777 == 0o750
    for name in ("model.cu", "weights.bin", "flowc_model.json", "flowc/host/emulator.h"):
        assert (out / name).stat().st_mode & 0o777 == 0o640, name


def test_file_name_that_is_not_utf8(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # '\udcff' is how Python spells the file name's byte 0xff: the comments show '?'.
    model = tmp_path / "m\udcff.onnx"
    model.write_bytes(tiny.read_bytes())
    code, _, err = flowc(capsys, "compile", model, "-o", tmp_path / "p", "--target", "host")
    assert code == 0, err
    first = (tmp_path / "p" / "model.cu").read_text(encoding="utf-8").split("\n")[0]
    assert first.endswith("from m?.onnx. Do not edit."), first


def test_comment_filters_end_where_the_template_ends_them() -> None:
    # A trailing backslash would splice the next line into a // comment; '??/' is one too.
    assert c_comment("a\\\\") == "a"
    assert "??" not in c_comment("x ??/") and "*/" not in c_comment("*/*/") + c_comment("**//")
    assert c_comment("a\ud800\u2028b") == "a??b".replace("??", "? ?")
    assert "\n" not in cmake_comment("a\nb\rc\x85d") and "[" not in cmake_comment("#[[x")
