"""flowc/npy.h and flowc/weights.h: tests/runtime/io.cu reads .npy files numpy wrote, rejects
Fortran-order, big-endian and truncated ones, writes .npy files numpy must read back, and
round-trips a weights file; built for the host and run, and built with nvcc."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import pytest
from test_runtime import CUDA, SOURCES, run

from flowc.toolchain import cuda_compile_command, host_compile_command

IO_SOURCE = SOURCES / "io.cu"


def _write_inputs(d: Path) -> None:
    np.save(d / "f32.npy", np.arange(12, dtype=np.float32).reshape(3, 4) / 4)
    np.save(d / "i64.npy", np.array([[-5, 7]], np.int64))
    np.save(d / "b1.npy", np.array([True, False, True]))
    np.save(d / "scalar.npy", np.array(np.float64(2.5)))
    with open(d / "v2.npy", "wb") as f:
        np.lib.format.write_array(
            f, np.array([[-1.0, 0.5], [2.0, 3.5]], np.float32), version=(2, 0)
        )
    np.save(d / "fortran.npy", np.asfortranarray(np.ones((2, 3), np.float32)))
    np.save(d / "big_endian.npy", np.ones(3, dtype=">f4"))
    np.save(d / "truncated.npy", np.arange(12, dtype=np.float32).reshape(3, 4))
    data = (d / "truncated.npy").read_bytes()
    (d / "truncated.npy").write_bytes(data[:-4])


def test_npy_and_weights_on_the_host(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    _write_inputs(data)
    # The fixtures are what the C++ side expects them to be.
    assert np.load(data / "scalar.npy").shape == ()
    with open(data / "v2.npy", "rb") as f:
        assert np.lib.format.read_magic(f) == (2, 0)
    assert np.load(data / "fortran.npy").flags.f_contiguous

    exe = tmp_path / "io"
    r = run(host_compile_command([IO_SOURCE], exe), check=False)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr, r.stderr

    r = run([str(exe), str(data)], check=False)
    lines = r.stdout.strip().splitlines()
    assert lines and lines[-1].endswith(" 0 failed"), r.stdout + r.stderr
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout, r.stdout

    out_f32 = np.load(data / "out_f32.npy")
    assert out_f32.dtype == np.float32 and out_f32.shape == (2, 3)
    np.testing.assert_array_equal(out_f32, np.arange(6, dtype=np.float32).reshape(2, 3) * 0.5)
    out_b1 = np.load(data / "out_b1.npy")
    assert out_b1.dtype == np.bool_
    np.testing.assert_array_equal(out_b1, np.array([True, False, True, True]))
    for name in ("out_f32.npy", "out_b1.npy"):
        with open(data / name, "rb") as f:
            assert np.lib.format.read_magic(f) == (1, 0)
            np.lib.format.read_array_header_1_0(f)
            assert f.tell() % 64 == 0, (name, f.tell())

    # The weights file: header fields as documented, data 0..63.
    raw = (data / "w.bin").read_bytes()
    assert raw[:8] == b"FLOWCWT1" and len(raw) == 128
    version, nbytes, digest = np.frombuffer(raw[8:32], "<u8")
    assert (version, nbytes) == (1, 64) and raw[40:64] == bytes(24)
    assert int(np.frombuffer(raw[32:40], "<u8")[0]) == 0x1234ABCD  # the layout id
    assert raw[64:] == bytes(range(64))
    assert int(digest) == zlib.crc32(bytes(range(64)))

    assert not list(data.glob("*.tmp.*")), list(data.glob("*.tmp.*"))


def test_cuda_build_of_io_compiles_and_links(tmp_path: Path) -> None:
    missing = CUDA.missing([])
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CUDA build of io: missing {', '.join(missing)} (CI must have them)")
        pytest.skip(f"no {', '.join(missing)} on this machine: the CUDA build is not checked")
    exe = tmp_path / "io"
    r = run(cuda_compile_command(CUDA, [IO_SOURCE], exe, libs=[]), check=False)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr.lower(), r.stderr
