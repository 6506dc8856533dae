"""The generated driver (model_main) and the C API's synchronize, on one small host build:
--help, outputs named after the model's outputs with an outputs.json map, all-or-nothing
output folders, a C99 caller that waits for run() through P_synchronize, and flowc's rules
for what the driver reads: special files refused (never waited on), FLOWC_* variables parsed
strictly, .npy headers checked, one rule for raw void arrays."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from flowc.compiler import compile_graph
from flowc.frontend.onnx import import_model
from flowc.harness.build import build, build_dir, run
from flowc.passes.manager import COMPILE_PIPELINE, PassManager

# Output names that are no file names: a path, one differing from it only in case once
# sanitized, a terminal escape, and "..".
ESC = "y\x1b[31m"
NAMES = [ESC, "Y/a", "y/A", ".."]
FILES = ["y__31m.npy", "Y_a.npy", "y_A_2.npy", "_..npy"]
SHAPES = [(3, 16), (8, 300), (8, 16), (8, 16)]
# Output 1 is 9600 bytes of data, the others under 1 KiB: a 4 KiB file size limit makes the
# second file the driver writes fail after the first succeeded.
FSIZE_LIMIT = 4096


def _model() -> onnx.ModelProto:
    w = np.random.default_rng(1).standard_normal((16, 300)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["x", "idx"], [ESC], axis=0),
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Relu", ["h"], ["Y/a"]),
        helper.make_node("Neg", ["x"], ["y/A"]),
        helper.make_node("Cast", ["x"], [".."], to=TensorProto.BFLOAT16),
    ]
    types = [TensorProto.FLOAT] * 3 + [TensorProto.BFLOAT16]
    graph = helper.make_graph(
        nodes,
        "drv",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16]),
            helper.make_tensor_value_info("idx", TensorProto.INT64, [3]),
        ],
        [
            helper.make_tensor_value_info(n, t, list(s))
            for n, t, s in zip(NAMES, types, SHAPES, strict=True)
        ],
        initializer=[numpy_helper.from_array(w, "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


FEEDS = {
    "x": np.random.default_rng(2).standard_normal((8, 16)).astype(np.float32),
    "idx": np.array([7, 0, -2], np.int64),  # a negative index counts from the end
}


def _reference() -> list[np.ndarray]:
    """onnxruntime's outputs for the float ones; the bfloat16 cast through ml_dtypes."""
    model = _model()
    model.graph.output.pop()  # onnxruntime's Python API returns no bfloat16 arrays
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(NAMES[:3], FEEDS)
    return [*got, FEEDS["x"].astype(ml_dtypes.bfloat16)]


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    return bool(got.dtype == want.dtype and got.shape == want.shape) and np.allclose(
        got.astype(np.float32), want.astype(np.float32), rtol=1e-5, atol=1e-5
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("driver") / "out"
    compile_graph(PassManager(COMPILE_PIPELINE).run(import_model(_model())), out, poison=True)
    bdir = build(out, "host", quick=True)  # -O1: a third less compile time
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
    for name, a in FEEDS.items():
        np.save(out / f"{name}.npy", a)
    return out


def _driver(
    project: Path, out_dir: Path, *extra: str, fsize: int = 0
) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        # Past the limit a write fails with EFBIG instead of killing the process.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    cmd = [
        str(build_dir(project, "host") / "model_main"),
        "--weights",
        str(project / "weights.bin"),
    ]
    for name in FEEDS:
        cmd += ["--input", f"{name}={project / f'{name}.npy'}"]
    return subprocess.run(
        [*cmd, "--out-dir", str(out_dir), *extra],
        capture_output=True,
        text=True,
        preexec_fn=limit if fsize else None,
    )


def test_help_lists_inputs_and_outputs(project: Path) -> None:
    r = subprocess.run(
        [str(build_dir(project, "host") / "model_main"), "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: ") and "--out-dir DIR" in r.stdout
    assert "  x: f32[8, 16]\n  idx: i64[3]\n" in r.stdout
    assert "  y\\x1b[31m: f32[3, 16] -> y__31m.npy\n" in r.stdout
    assert "  ..: bf16[8, 16] -> _..npy\n" in r.stdout
    assert "\x1b" not in r.stdout  # the name's escape never reaches the terminal
    bad = subprocess.run(
        [str(build_dir(project, "host") / "model_main"), "--frobnicate"], capture_output=True
    )
    assert bad.returncode == 2 and b"--help" in bad.stderr


def test_outputs_are_named_files_with_a_map(project: Path, tmp_path: Path) -> None:
    ref = _reference()
    got, _ = run(project, FEEDS)  # reads outputs.json
    assert list(got) == NAMES
    for name, want in zip(NAMES, ref, strict=True):
        assert _close(got[name], want), name

    r = _driver(project, tmp_path / "res")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "res").iterdir()) == sorted([*FILES, "outputs.json"])
    listed = json.loads((tmp_path / "res" / "outputs.json").read_text())["outputs"]
    assert [(e["index"], e["name"], e["file"]) for e in listed] == list(
        zip(range(4), NAMES, FILES, strict=True)
    )
    assert [e["dtype"] for e in listed] == ["f32", "f32", "f32", "bf16"]
    assert [tuple(e["shape"]) for e in listed] == SHAPES
    assert np.array_equal(np.load(tmp_path / "res" / "y__31m.npy"), ref[0])
    assert (tmp_path / "res").stat().st_mode & 0o777 != 0o700  # not mkdtemp's mode


def test_a_failed_output_leaves_no_files(project: Path, tmp_path: Path) -> None:
    # A folder to be made: it does not appear, and no temporary folder is left beside it.
    r = _driver(project, tmp_path / "new", fsize=FSIZE_LIMIT)
    assert r.returncode == 1 and "nothing was written" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []

    # An existing folder keeps exactly what it held (here an earlier run's outputs).
    old = tmp_path / "old"
    old.mkdir()
    (old / "notes.txt").write_text("mine")
    (old / "outputs.json").write_text("{}")
    r = _driver(project, old, fsize=FSIZE_LIMIT)
    assert r.returncode == 1 and "nothing was written" in r.stderr, r.stderr
    assert sorted(p.name for p in old.iterdir()) == ["notes.txt", "outputs.json"]
    assert (old / "outputs.json").read_text() == "{}"

    # A name taken by a folder is refused before anything is written.
    (old / "Y_a.npy").mkdir()
    r = _driver(project, old)
    assert r.returncode == 2 and "Y_a.npy is in the way" in r.stderr, r.stderr
    assert sorted(p.name for p in old.iterdir()) == ["Y_a.npy", "notes.txt", "outputs.json"]
    (old / "Y_a.npy").rmdir()

    # Without the limit the outputs join what is there, and the map is the new one.
    r = _driver(project, old)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in old.iterdir()) == sorted([*FILES, "notes.txt", "outputs.json"])
    assert len(json.loads((old / "outputs.json").read_text())["outputs"]) == 4


C_CALLER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"

static void* load(const char* path, size_t* bytes) {
  FILE* f = fopen(path, "rb");
  void* p;
  if (f == NULL) return NULL;
  fseek(f, 0, SEEK_END);
  *bytes = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  p = malloc(*bytes);
  if (fread(p, 1, *bytes, f) != *bytes) return NULL;
  fclose(f);
  return p;
}

static int all_poison(const unsigned char* p, size_t n) {
  size_t i;
  for (i = 0; i < n; ++i) {
    if (p[i] != 0xff) return 0;
  }
  return 1;
}

/* usage: caller WEIGHTS X.bin IDX.bin OUTPREFIX */
int main(int argc, char** argv) {
  drv_model* m = NULL;
  const void* in[2];
  void* out[4];
  size_t bytes[4], in_bytes;
  int k, d, poisoned = 1, rc;
  (void)argc;
  if (drv_create(argv[1], &m) != 0) {
    printf("create: %s\n", drv_last_error(NULL));
    return 1;
  }
  in[0] = load(argv[2], &in_bytes);
  in[1] = load(argv[3], &in_bytes);
  for (k = 0; k < drv_num_outputs(); ++k) {
    bytes[k] = drv_output_dtype(k) == 16 ? 2 : 4;
    for (d = 0; d < drv_output_rank(k); ++d) bytes[k] *= (size_t)drv_output_shape(k)[d];
    out[k] = malloc(bytes[k]);
    memset(out[k], 0xff, bytes[k]);
  }
  rc = drv_run(m, in, out, NULL);
  for (k = 0; k < 4; ++k) poisoned = poisoned && all_poison(out[k], bytes[k]);
  printf("run=%d poisoned_after_run=%d\n", rc, poisoned);
  rc = drv_synchronize(m);
  printf("synchronize=%d error=[%s]\n", rc, drv_last_error(m));
  for (k = 0; k < 4; ++k) {
    char path[4096];
    FILE* f;
    snprintf(path, sizeof path, "%s%d.bin", argv[4], k);
    f = fopen(path, "wb");
    fwrite(out[k], 1, bytes[k], f);
    fclose(f);
  }
  /* A second run whose index is out of range: run() cannot know, synchronize() does. */
  ((long long*)in[1])[1] = 99;
  rc = drv_run(m, in, out, NULL);
  printf("bad run=%d\n", rc);
  rc = drv_synchronize(m);
  printf("bad synchronize=%d error=[%s]\n", rc, drv_last_error(m));
  printf("idle synchronize=%d\n", drv_synchronize(m));
  drv_destroy(m);
  return 0;
}
"""


def test_c_caller_waits_with_synchronize(project: Path, tmp_path: Path) -> None:
    bdir = build_dir(project, "host")
    src = tmp_path / "caller.c"
    src.write_text(C_CALLER)
    exe = tmp_path / "caller"
    cc = subprocess.run(
        [
            "gcc",
            "-x",
            "c",
            "-std=c99",
            "-Wall",
            "-Werror",
            f"-I{project}",
            str(src),
            "-o",
            str(exe),
            f"-L{bdir}",
            "-ldrv_model",
            f"-Wl,-rpath,{bdir}",
        ],
        capture_output=True,
        text=True,
    )
    assert cc.returncode == 0, cc.stderr
    FEEDS["x"].tofile(tmp_path / "x.bin")
    FEEDS["idx"].tofile(tmp_path / "idx.bin")
    ref = _reference()
    types = [np.float32] * 3 + [ml_dtypes.bfloat16]
    for order in ("forward", "shuffle:5"):
        r = subprocess.run(
            [
                str(exe),
                str(project / "weights.bin"),
                str(tmp_path / "x.bin"),
                str(tmp_path / "idx.bin"),
                str(tmp_path / f"{order[:4]}_"),
            ],
            capture_output=True,
            text=True,
            env={"FLOWC_SIM_ORDER": order, "PATH": "/usr/bin:/bin"},
        )
        assert r.returncode == 0, r.stdout + r.stderr
        lines = r.stdout.splitlines()
        # run() queued the work: the caller's buffers are untouched until synchronize().
        assert lines[0] == "run=0 poisoned_after_run=1", (order, r.stdout)
        assert lines[1] == "synchronize=0 error=[]", (order, r.stdout)
        for k in range(4):
            got = np.fromfile(tmp_path / f"{order[:4]}_{k}.bin", types[k]).reshape(SHAPES[k])
            assert _close(got, ref[k]), (order, NAMES[k])
        assert lines[2] == "bad run=0", r.stdout
        assert lines[3].startswith("bad synchronize=1 error=[an index was out of range"), r.stdout
        assert lines[4] == "idle synchronize=1", r.stdout


# -- files and environment: flowc's rules in the driver and the runtime (issue 23, point 7) -----


def _main(
    project: Path,
    out_dir: Path,
    weights: Path | None = None,
    inputs: dict[str, Path] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """model_main with the project's weights and inputs unless others are given; a run that
    would block (a FIFO opened for reading) fails the test after 30 s instead of hanging it."""
    cmd = [
        str(build_dir(project, "host") / "model_main"),
        "--weights",
        str(weights or project / "weights.bin"),
    ]
    for name in FEEDS:
        path = (inputs or {}).get(name, project / f"{name}.npy")
        cmd += ["--input", f"{name}={path}"]
    try:
        return subprocess.run(
            [*cmd, "--out-dir", str(out_dir)],
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the driver blocked: {cmd}") from None


def test_special_files_are_refused_not_waited_on(project: Path, tmp_path: Path) -> None:
    """A FIFO given as --weights, as an --input .npy or as FLOWC_TRACE blocked the driver for
    ever; it is refused at once, saying what it is. Devices and folders are no inputs either;
    a character device is a fine trace (/dev/null)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    r = _main(project, out, weights=fifo)
    assert r.returncode == 1, r.stderr
    assert f"weights file {fifo} is a FIFO (named pipe), not a regular file" in r.stderr
    r = _main(project, out, inputs={"x": fifo})
    assert r.returncode == 2, r.stderr
    assert f"input 'x': npy file {fifo} is a FIFO (named pipe), not a regular file" in r.stderr
    r = _main(project, out, inputs={"idx": Path("/dev/zero")})
    assert r.returncode == 2 and "/dev/zero is a character device, not a regular file" in r.stderr
    r = _main(project, out, weights=tmp_path)
    assert r.returncode == 1 and f"{tmp_path} is a directory, not a regular file" in r.stderr
    r = _main(project, out, env={"FLOWC_TRACE": str(fifo)})
    assert r.returncode == 1, r.stderr
    assert f"cannot open {fifo} for writing: it is a FIFO (named pipe) with no reader" in r.stderr
    assert not out.exists()  # nothing was written by the failed runs
    r = _main(project, out, env={"FLOWC_TRACE": "/dev/null"})
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    ("name", "value", "accepted"),
    [
        # Used to overflow into a huge stack size and crash (SIGSEGV, no message).
        ("FLOWC_SIM_STACK_KB", "99999999999999999999", "a whole number of KiB from 64 to 1048576"),
        ("FLOWC_SIM_STACK_KB", "32", "a whole number of KiB from 64 to 1048576"),
        # strtod took these: a space, hexadecimal, a number too small to be a deadline.
        ("FLOWC_TIMEOUT_S", " 5", "a decimal number of seconds from 0.001 to 31536000"),
        ("FLOWC_TIMEOUT_S", "0x10", "a decimal number of seconds from 0.001 to 31536000"),
        ("FLOWC_TIMEOUT_S", "1e-300", "a decimal number of seconds from 0.001 to 31536000"),
        ("FLOWC_STATS", "yes", "0 or 1"),
        ("FLOWC_SIM_ORDER", "shuffle:-1", "forward, reverse or shuffle:SEED"),
    ],
)
def test_flowc_variables_are_parsed_strictly(
    project: Path, tmp_path: Path, name: str, value: str, accepted: str
) -> None:
    r = _main(project, tmp_path / "out", env={name: value})
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert f"error: {name}='{value}': expected {accepted}" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def _npy_with_header(path: Path, header: str, data: bytes = b"") -> Path:
    """An NPY 1.0 file with ``header`` as its header dict, padded as NumPy pads it."""
    total = 10 + len(header) + 1
    text = header + " " * ((total + 63) // 64 * 64 - total) + "\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode() + data)
    return path


def test_npy_headers_past_int64_or_malformed_are_refused(project: Path, tmp_path: Path) -> None:
    """A dimension of 2**64 wrapped to 0 (the driver then said it got f32[0, 16]); such
    headers, and others NumPy would not write, are refused saying why."""
    cases = {
        "(18446744073709551616, 16)": "the number 18446744073709551616 does not fit int64",
        "(9223372036854775808, 16)": "the number 9223372036854775808 does not fit int64",
        "[8, 16]": "shape is not a tuple",
    }
    for k, (shape, why) in enumerate(cases.items()):
        header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}"
        path = _npy_with_header(tmp_path / f"x{k}.npy", header, bytes(8 * 16 * 4))
        r = _main(project, tmp_path / "out", inputs={"x": path})
        assert r.returncode == 2, r.stderr
        assert f"input 'x': npy file {path}: bad header: {why}" in r.stderr, r.stderr


def test_a_raw_void_array_feeds_only_types_numpy_has_no_dtype_for(
    project: Path, tmp_path: Path
) -> None:
    """x is float32 ('<f4'): its bytes as a raw void array ('|V4') are refused with the rule
    the Python side applies too (a void array stands only for bfloat16, float8, int4...)."""
    path = tmp_path / "x_void.npy"
    np.save(path, FEEDS["x"].view("V4"))
    assert np.load(path).dtype.str == "|V4"
    r = _main(project, tmp_path / "out", inputs={"x": path})
    assert r.returncode == 2, r.stderr
    assert (
        "input 'x': expected f32[8, 16] (npy dtype '<f4'), got '|V4' [8, 16]" in r.stderr
        and "a raw void array ('|V4', no fields) is taken only for a type NumPy has no dtype "
        "of its own for (bfloat16, the float8 types, int4, uint4); this type has one: save the "
        "array as '<f4'"
        in r.stderr
    ), r.stderr
