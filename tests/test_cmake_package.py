"""flowc's CMake package (flowc/cmake/, installed as <prefix>/share/cmake/flowc) and
flowc_add_model, on the example consumer examples/cmake/ (two models, one program): built
from a clean folder without the virtualenv on PATH, its outputs checked against NumPy and
onnxruntime, one model touched and edited (only it recompiles), installed under a prefix,
and the libraries' exports (the C API only; the library `flowc build` makes too). The CUDA
build of the example compiles and links with nvcc (it runs on no GPU here)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from conftest import REPO, require_cuda_build_toolchain, run_cli

from flowc.frontend import load_graph
from flowc.interpreter import evaluate
from flowc.version import __version__

EXAMPLES = REPO / "examples"
# What the example reads, by its path under examples/ (CMakeLists.txt names them ../...).
EXAMPLE_FILES = ("cmake/CMakeLists.txt", "cmake/main.cpp", "mlp.flow", "models/resnet_tiny.onnx")
QUICK = ["-DCMAKE_BUILD_TYPE=Quick", "-DCMAKE_CXX_FLAGS_QUICK=-O1"]
# No virtualenv on PATH: the package must find its flowc by itself.
ENV = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "LC_ALL": "C"}


def run(
    cmd: Sequence[str | Path], ok: bool = True, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=300
    )
    if ok:
        assert r.returncode == 0, f"{' '.join(map(str, cmd))}\n{r.stdout}\n{r.stderr}"
    return r


def cmake_dir() -> Path:
    """`flowc --cmake-dir`, checked to be this checkout's package (an editable install
    copies it: a stale copy is reinstalled by `make setup` / `pip install -e .`)."""
    r = subprocess.run(
        [sys.executable, "-m", "flowc", "--cmake-dir"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    d = Path(r.stdout.strip())
    source = {f.name: f for f in (REPO / "flowc" / "cmake").iterdir() if f.is_file()}
    source["flowc-runtime.cmake"] = REPO / "runtime_cpp" / "flowc" / "flowc.cmake"
    stale = [
        n
        for n, f in sorted(source.items())
        if not (d / n).is_file() or (d / n).read_bytes() != f.read_bytes()
    ]
    assert not stale, (
        f"{d} is not this checkout's CMake package ({', '.join(stale)} differ): reinstall "
        "flowc (`make setup`, or `pip install -e .`)"
    )
    return d


def copy_example(root: Path) -> Path:
    """The example and its models under root/examples/, laid out as in the repository."""
    for name in EXAMPLE_FILES:
        (root / "examples" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(EXAMPLES / name, root / "examples" / name)
    return root / "examples"


def app_input(shape: tuple[int, ...], k: int) -> np.ndarray:
    """Input k as main.cpp makes it."""
    i = np.arange(int(np.prod(shape)), dtype=np.int64)
    x = ((i * 37 + k * 11) % 101).astype(np.float32) / np.float32(101) - np.float32(0.5)
    return x.reshape(shape)


def parse_app(text: str) -> dict[str, dict[str, np.ndarray]]:
    """app's stdout: model -> output name -> array."""
    models: dict[str, dict[str, np.ndarray]] = {}
    lines = iter(text.splitlines())
    current: dict[str, np.ndarray] = {}
    for line in lines:
        words = line.split()
        if words[0] == "model":
            current = models.setdefault(words[1], {})
        else:
            assert words[0] == "output", line
            shape = tuple(int(d) for d in words[2].split("x"))
            current[words[1]] = np.array(next(lines).split(), np.float32).reshape(shape)
    return models


def reference(mlp: Path, resnet: Path) -> dict[str, dict[str, np.ndarray]]:
    """What app prints, computed by flowc's NumPy interpreter (the .flow program) and by
    onnxruntime (the ONNX model), on app's inputs."""
    g = load_graph(mlp)
    mlp_out = evaluate(g, {"x": app_input((8, 64), 0)})
    sess = ort.InferenceSession(str(resnet), providers=["CPUExecutionProvider"])
    feeds = {i.name: app_input(tuple(i.shape), k) for k, i in enumerate(sess.get_inputs())}
    names = [o.name for o in sess.get_outputs()]
    return {
        "mlp": {k: np.asarray(v, np.float32) for k, v in mlp_out.items()},
        "resnet": dict(zip(names, sess.run(names, feeds), strict=True)),
    }


def assert_close(
    got: dict[str, dict[str, np.ndarray]], want: dict[str, dict[str, np.ndarray]]
) -> None:
    assert got.keys() == want.keys()
    for model, outputs in want.items():
        assert got[model].keys() == outputs.keys(), model
        for name, w in outputs.items():
            g = got[model][name]
            assert g.shape == w.shape, (model, name)
            err = float(np.abs(g - w).max()) / max(1e-6, float(np.abs(w).max()))
            assert err <= 1e-4, (model, name, err)


def exports(lib: Path) -> list[str]:
    """The names a shared library exports (defined dynamic symbols)."""
    out = run(["nm", "-D", "--defined-only", lib]).stdout
    return [line.split()[-1] for line in out.splitlines() if line.strip()]


def assert_exports_only(lib: Path, prefix: str) -> None:
    names = exports(lib)
    assert f"{prefix}create" in names and f"{prefix}run" in names, names
    assert [n for n in names if not n.startswith(prefix)] == [], lib


def compiles(log: str) -> set[str]:
    """The models whose flowc compile ran in a build's log."""
    return set(re.findall(r"flowc: compiling model (\S+) from", log))


def test_cmake_dir_is_the_installed_package(capsys: pytest.CaptureFixture[str]) -> None:
    d = cmake_dir()
    code, text = run_cli(["--cmake-dir"], capsys)
    assert code == 0 and text.strip() == str(d)
    # <prefix>/share/cmake/flowc beside <prefix>/bin/flowc, the command the package calls.
    assert d.parts[-3:] == ("share", "cmake", "flowc")
    assert (d.parent.parent.parent / "bin" / "flowc").is_file()
    version = (d / "flowcConfigVersion.cmake").read_text()
    assert f'set(PACKAGE_VERSION "{__version__}")' in version


def test_cmake_dir_says_when_the_package_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import flowc.resources

    monkeypatch.setattr(flowc.resources, "_cmake_dir_candidates", lambda: iter([tmp_path]))
    code, text = run_cli(["--cmake-dir"], capsys)
    assert code == 2
    assert "CMake package is not installed" in text and str(tmp_path) in text


def test_example_builds_rebuilds_one_model_and_installs(tmp_path: Path) -> None:
    flowc_dir = cmake_dir()
    src = copy_example(tmp_path / "src")
    build = tmp_path / "build"
    run(["cmake", "-S", src / "cmake", "-B", build, f"-Dflowc_DIR={flowc_dir}", *QUICK])
    log = run(["cmake", "--build", build, "-j", "2"])
    text = log.stdout + log.stderr
    assert compiles(text) == {"mlp", "resnet"}
    assert "warning:" not in text.lower(), text
    want = reference(src / "mlp.flow", src / "models" / "resnet_tiny.onnx")
    first = run([build / "app"]).stdout
    assert_close(parse_app(first), want)

    # The libraries export the C API only: mlp_*, resnet_* (flowc_add_model's default
    # prefix is the name).
    assert_exports_only(build / "libmlp.so", "mlp_")
    assert_exports_only(build / "libresnet.so", "resnet_")

    # Touching one model runs its flowc compile and nothing else: the same files come out,
    # so no library is rebuilt; the other model's compile does not run at all.
    out = {m: build / "flowc" / m for m in ("mlp", "resnet")}
    files = ("model.cu", "model.h", "weights.bin")
    watched = [build / "libmlp.so", build / "libresnet.so"]
    watched += [out[m] / f for m in out for f in files]
    before = {p: p.stat().st_mtime_ns for p in watched}
    stamp = build / "flowc" / "mlp.stamp"
    t = max(os.stat(src / "mlp.flow").st_mtime_ns, stamp.stat().st_mtime_ns) + 10_000_000
    os.utime(src / "mlp.flow", ns=(t, t))
    r = run(["cmake", "--build", build, "-j", "2"])
    assert compiles(r.stdout + r.stderr) == {"mlp"}, r.stdout
    assert {p: p.stat().st_mtime_ns for p in watched} == before
    r = run(["cmake", "--build", build, "-j", "2"])
    assert compiles(r.stdout + r.stderr) == set(), r.stdout

    # Editing it (the second layer's weights twice as large) recompiles it alone, and the
    # program computes the new model.
    flow = (src / "mlp.flow").read_text()
    w2 = "param w2: f32[256, 10] = normal(0.0, "
    edited = flow.replace(w2 + "0.0625)", w2 + "0.125)")
    assert edited != flow
    (src / "mlp.flow").write_text(edited)
    r = run(["cmake", "--build", build, "-j", "2"])
    assert compiles(r.stdout + r.stderr) == {"mlp"}, r.stdout
    for p in watched:
        if "resnet" in p.name or p.parent == out["resnet"]:
            assert p.stat().st_mtime_ns == before[p], p
    assert (out["mlp"] / "weights.bin").stat().st_mtime_ns != before[out["mlp"] / "weights.bin"]
    want = reference(src / "mlp.flow", src / "models" / "resnet_tiny.onnx")
    second = run([build / "app"]).stdout
    assert_close(parse_app(second), want)
    assert not np.allclose(parse_app(first)["mlp"]["y"], parse_app(second)["mlp"]["y"])

    # cmake --install: the libraries, include/<name>/model.h, share/<name>/weights.bin, and
    # the example's app, which runs from there on the installed weights.
    prefix = tmp_path / "prefix"
    run(["cmake", "--install", build, "--prefix", prefix])
    for m in ("mlp", "resnet"):
        (lib,) = prefix.glob(f"lib*/lib{m}.so")
        assert_exports_only(lib, f"{m}_")
        assert (prefix / "include" / m / "model.h").read_bytes() == (
            out[m] / "model.h"
        ).read_bytes()
        weights = prefix / "share" / m / "weights.bin"
        assert weights.read_bytes() == (out[m] / "weights.bin").read_bytes()
    installed = [prefix / "bin" / "app"]
    installed += [prefix / "share" / m / "weights.bin" for m in ("mlp", "resnet")]
    assert run(installed, cwd=tmp_path).stdout == second
    # Both headers in one C99 translation unit, linked against the installed libraries.
    (tmp_path / "both.c").write_text(
        '#include "mlp/model.h"\n#include "resnet/model.h"\n'
        "int main(void) { return mlp_num_inputs() + resnet_num_inputs() == 2 ? 0 : 1; }\n"
    )
    libdir = lib.parent
    c99: list[str | Path] = [
        "cc",
        "-std=c99",
        "-Wall",
        "-Werror",
        "-I",
        prefix / "include",
        tmp_path / "both.c",
    ]
    link = [f"-L{libdir}", "-lmlp", "-lresnet", f"-Wl,-rpath,{libdir}"]
    run([*c99, "-o", tmp_path / "both", *link])
    run([tmp_path / "both"])


def test_example_cuda_build_compiles_and_links(tmp_path: Path) -> None:
    require_cuda_build_toolchain()
    from flowc.toolchain import find_cuda

    tk = find_cuda()
    assert tk.nvcc is not None
    libs = ["cublasLt", "cudnn"]
    src = copy_example(tmp_path / "src")
    build = tmp_path / "build-cuda"
    lib_dirs = ";".join(sorted({str(tk.libs[n].lib_dir) for n in libs}))
    include_dirs = ";".join(sorted({str(tk.libs[n].include_dir) for n in libs}))
    cuda = [
        "-DFLOWC_TARGET=cuda",
        f"-DCMAKE_CUDA_COMPILER={tk.nvcc}",
        "-DCMAKE_CUDA_FLAGS_QUICK=-O1",
    ]
    cuda += [f"-DFLOWC_CUDA_LIB_DIRS={lib_dirs}", f"-DFLOWC_CUDA_INCLUDE_DIRS={include_dirs}"]
    run(["cmake", "-S", src / "cmake", "-B", build, f"-Dflowc_DIR={cmake_dir()}", *QUICK, *cuda])
    r = run(["cmake", "--build", build, "-j", "2"])
    text = r.stdout + r.stderr
    assert "Building CUDA object" in text and "warning:" not in text.lower(), text
    assert (build / "app").is_file()
    flags = (build / "CMakeFiles" / "mlp_objects.dir" / "flags.make").read_text()
    assert "sm_90" in flags and "-fvisibility=hidden" in flags
    assert_exports_only(build / "libmlp.so", "mlp_")
    assert_exports_only(build / "libresnet.so", "resnet_")


def test_flowc_build_library_exports_only_the_api(tmp_path: Path) -> None:
    from flowc.harness.build import build

    out = tmp_path / "p"
    compile_ = [sys.executable, "-m", "flowc", "compile", str(EXAMPLES / "mlp.flow")]
    compile_ += ["-o", str(out), "--target", "host", "--prefix", "tiny"]
    r = subprocess.run(compile_, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    bdir = build(out, "host", quick=True)
    assert_exports_only(bdir / "libtiny_model.so", "tiny_")
    assert (bdir / "model_main").is_file()
    prefix = tmp_path / "prefix"
    run(["cmake", "--install", bdir, "--prefix", prefix])
    (lib,) = prefix.glob("lib*/libtiny_model.so")
    assert_exports_only(lib, "tiny_")
    assert (prefix / "include" / "tiny_model" / "model.h").is_file()
    assert (prefix / "share" / "tiny_model" / "weights.bin").is_file()
    assert not list(prefix.rglob("model_main"))


def consumer(root: Path, body: str, languages: str = "CXX") -> Path:
    """A CMake project root/app whose CMakeLists.txt is find_package(flowc) and ``body``,
    beside the example's models."""
    copy_example(root)
    major_minor = ".".join(__version__.split(".")[:2])
    app = root / "examples" / "app"
    app.mkdir()
    (app / "CMakeLists.txt").write_text(
        f"cmake_minimum_required(VERSION 3.20)\nproject(app {languages})\n"
        f"find_package(flowc {major_minor} CONFIG REQUIRED)\n{body}\n"
    )
    return app


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ("flowc_add_model(m MODEL nosuch.onnx)", "MODEL nosuch.onnx: no such file"),
        ("flowc_add_model(MODEL ../mlp.flow)", "no name"),
        ("flowc_add_model(m MODEL ../mlp.flow OPTIONS --mesh 4)", "OPTIONS --mesh"),
        ("flowc_add_model(m MODEL ../mlp.flow TARGET gpu)", "TARGET must be host or cuda"),
        ("flowc_add_model(m MODEL ../mlp.flow MESH 2y2)", "MESH must be N or AxB"),
        ("flowc_add_model(my-model MODEL ../mlp.flow)", "is not a C identifier"),
    ],
)
def test_flowc_add_model_refuses_at_configure(tmp_path: Path, call: str, message: str) -> None:
    app = consumer(tmp_path, call, languages="NONE")
    r = run(["cmake", "-S", app, "-B", tmp_path / "b", f"-Dflowc_DIR={cmake_dir()}"], ok=False)
    assert r.returncode != 0
    assert message in " ".join(r.stderr.split()), r.stderr


def test_a_program_mesh_must_be_given(tmp_path: Path) -> None:
    # mlp_mesh4.flow names its own mesh of 4 devices: CMake must know it (the weights files).
    app = consumer(tmp_path, "flowc_add_model(m MODEL ../mlp_mesh4.flow ${MESH_ARGS})")
    shutil.copy2(EXAMPLES / "mlp_mesh4.flow", tmp_path / "examples" / "mlp_mesh4.flow")
    b = tmp_path / "b"
    run(["cmake", "-S", app, "-B", b, f"-Dflowc_DIR={cmake_dir()}", *QUICK])
    r = run(["cmake", "--build", b, "--target", "m_objects"], ok=False)
    assert r.returncode != 0
    assert (
        "compiled for 4 device(s)" in r.stdout + r.stderr
        and "give it MESH 4" in r.stdout + r.stderr
    )
    run(["cmake", b, "-DMESH_ARGS=MESH;4"])
    run(["cmake", "--build", b, "-j", "2"])
    assert_exports_only(b / "libm.so", "m_")
    prefix = tmp_path / "prefix"
    run(["cmake", "--install", b, "--prefix", prefix])
    assert sorted(p.name for p in (prefix / "share" / "m").iterdir()) == [
        f"weights.rank{r}.bin" for r in range(4)
    ]
