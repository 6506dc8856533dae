"""flowc/comm.h, the collectives of multi-rank programs: every collective on every mesh axis under
mpirun on the host build (MPI), the communication log, the launch with the wrong number of
ranks, the f16/bf16 conversions of the host sums; and the CUDA build (NCCL), compiled and
linked. Both build through flowc.cmake's flowc_target_comm(), as generated projects do."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import REPO

from flowc.resources import runtime_dir
from flowc.toolchain import find_cuda

# Open MPI refuses root without these; more ranks than cores needs one thread per rank.
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
}
LOG_LINE = re.compile(
    r"(all-reduce|all-gather|reduce-scatter|all-to-all) axis=\d bytes=\d+ dtype=\d+"
)


def run(
    cmd: list[str], env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env={**os.environ, **MPI_ENV, **(env or {})},
        timeout=300,
    )
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def cmake_build(root: Path, build: str, programs: list[str], configure_args: list[str]) -> Path:
    """Builds `programs` for `build` (host or cuda) in a project like a generated one; returns
    the build directory."""
    runtime = runtime_dir()
    languages = "CXX CUDA" if build == "cuda" else "CXX"
    targets = "".join(
        f"""add_executable({name} "{REPO / "tests" / "runtime" / f"{name}.cu"}")
target_include_directories({name} PRIVATE "{runtime}")
flowc_target({name} {build})
flowc_target_comm({name} {build})
"""
        for name in programs
    )
    (root / "CMakeLists.txt").write_text(
        f"""cmake_minimum_required(VERSION 3.18)
set(CMAKE_CUDA_ARCHITECTURES 90)
project(comm_test LANGUAGES {languages})
set(CMAKE_CXX_STANDARD 17)
set(CMAKE_CUDA_STANDARD 17)
include("{runtime}/flowc/flowc.cmake")
{targets}"""
    )
    bdir = root / "build"
    configure = ["cmake", "-S", str(root), "-B", str(bdir), "-DCMAKE_BUILD_TYPE=Release"]
    out = ""
    for cmd in ([*configure, *configure_args], ["cmake", "--build", str(bdir), "-j", "2"]):
        r = run(cmd)
        out += r.stdout + r.stderr
    assert "warning" not in out.lower(), out
    return bdir


@pytest.fixture(scope="module")
def host_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cmake_build(
        tmp_path_factory.mktemp("comm-host"), "host", ["comm_collectives", "comm_halves"], []
    )


@pytest.fixture(scope="module")
def host_exe(host_bin: Path) -> Path:
    return host_bin / "comm_collectives"


@pytest.mark.parametrize(("ranks", "mesh"), [(4, "4"), (4, "2x2"), (2, "2"), (4, "2x1x2")])
def test_collectives_on_every_mesh_axis(
    host_exe: Path, tmp_path: Path, ranks: int, mesh: str
) -> None:
    prefix = tmp_path / "comm"
    r = run(
        ["mpirun", "--oversubscribe", "-np", str(ranks), str(host_exe), mesh],
        {"FLOWC_COMM_LOG": str(prefix)},
    )
    # Each rank also compares its log with the collectives it issued.
    assert sorted(re.findall(r"^OK rank (\d+)", r.stdout, re.M)) == [str(k) for k in range(ranks)]
    assert "FAIL" not in r.stdout
    for rank in range(ranks):
        lines = Path(f"{prefix}.rank{rank}").read_text().splitlines()
        assert lines and all(LOG_LINE.fullmatch(line) for line in lines), lines
        # 37 f32 elements summed over mesh axis 0, then the same in place.
        assert lines[:2] == ["all-reduce axis=0 bytes=148 dtype=1"] * 2


def test_wrong_number_of_ranks_is_reported(host_exe: Path) -> None:
    r = run(["mpirun", "--oversubscribe", "-np", "3", str(host_exe), "2x2"], check=False)
    assert r.returncode != 0
    assert (
        "this program was compiled for a mesh of 4 devices (2x2) but was started with 3 ranks; "
        "run it with mpirun -np 4" in r.stderr
    ), r.stderr
    alone = run([str(host_exe), "2"], check=False)
    assert alone.returncode != 0
    assert "started with 1 rank; run it with mpirun -np 2" in alone.stderr, alone.stderr


def test_half_conversions_match_numpy_and_ml_dtypes(host_bin: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    f16 = np.arange(0x7C01, dtype=np.uint16).view(np.float16).astype(np.float64)
    values = np.concatenate(
        [
            # every exponent, infinities and NaNs included
            rng.integers(0, 2**32, 1 << 18, dtype=np.uint64).astype(np.uint32).view(np.float32),
            # exact ties between neighbouring f16 values, normal and subnormal
            ((f16[:-1] + f16[1:]) / 2).astype(np.float32),
            # exact ties between neighbouring bf16 values
            ((rng.integers(0, 2**16, 1 << 14, dtype=np.uint32) << 16) | 0x8000).view(np.float32),
            np.linspace(-70000, 70000, 1 << 14, dtype=np.float32),  # around f16's overflow
        ]
    )
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    values.tofile(src)
    run([str(host_bin / "comm_halves"), str(src), str(dst)])
    raw = np.fromfile(dst, dtype=np.uint8)
    bits = raw[: values.size * 4].view(np.uint16).reshape(-1, 2)
    decoded = raw[values.size * 4 :].view(np.float32).reshape(-1, 2)
    nan = np.isnan(values)
    with np.errstate(over="ignore", invalid="ignore"):  # infinities and NaNs are wanted here
        want_f16 = values.astype(np.float16).view(np.uint16)
        want_bf16 = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(bits[~nan, 0], want_f16[~nan])
    assert np.array_equal(bits[~nan, 1], want_bf16[~nan])
    assert np.isnan(bits[nan, 0].view(np.float16)).all()
    assert np.isnan(bits[nan, 1].view(ml_dtypes.bfloat16)).all()
    codes = np.arange(1 << 16, dtype=np.uint16)
    for column, dtype in ((0, np.float16), (1, ml_dtypes.bfloat16)):
        want = codes.view(dtype).astype(np.float32)
        got = decoded[:, column]
        assert np.array_equal(got, want, equal_nan=True), dtype


CUDA = find_cuda()
CUDA_LIBS = ["cublasLt", "cudnn", "nccl"]


def test_cuda_build_compiles_and_links_nccl(tmp_path: Path) -> None:
    missing = CUDA.missing(CUDA_LIBS)
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CUDA build of comm.h: missing {', '.join(missing)} (CI must have them)")
        pytest.skip(f"no {', '.join(missing)} on this machine: the NCCL build is not checked")
    assert CUDA.nvcc is not None
    libs = [CUDA.libs[name] for name in CUDA_LIBS]
    bdir = cmake_build(
        tmp_path,
        "cuda",
        ["comm_collectives"],
        [
            f"-DCMAKE_CUDA_COMPILER={CUDA.nvcc}",
            f"-DFLOWC_CUDA_LIB_DIRS={';'.join(sorted({str(lib.lib_dir) for lib in libs}))}",
            f"-DFLOWC_CUDA_INCLUDE_DIRS={';'.join(sorted({str(lib.include_dir) for lib in libs}))}",
        ],
    )
    undefined = run(["nm", "-D", "--undefined-only", str(bdir / "comm_collectives")]).stdout
    for symbol in (
        "ncclAllReduce",
        "ncclReduceScatter",
        "ncclAllGather",
        "ncclSend",
        "ncclCommSplit",
    ):
        assert re.search(rf"\b{symbol}\b", undefined), symbol
    assert re.search(r"\bMPI_Bcast\b", undefined), undefined
