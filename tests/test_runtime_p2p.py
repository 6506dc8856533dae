"""flowc/comm.h's point-to-point transfers (send, recv, exchange) for pipeline stages: a ring
exchange, a pairwise multi-buffer exchange, lone send/recv pairs and a relay chain under
mpirun with 2 and 4 host ranks (MPI), byte for byte and against the communication log; the
FLOWC_TIMEOUT_S deadline on a receive nobody sends to; and the CUDA build (NCCL), compiled
and linked."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from test_runtime_comm import CUDA, CUDA_LIBS, cmake_build, run

P2P_LINE = re.compile(r"(send|recv) peer=\d+ bytes=\d+ dtype=\d+")


@pytest.fixture(scope="module")
def host_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cmake_build(tmp_path_factory.mktemp("p2p-host"), "host", ["comm_p2p"], []) / "comm_p2p"


@pytest.mark.parametrize(("ranks", "timeout"), [(2, "30"), (4, None)])
def test_transfers_deliver_the_bytes(
    host_exe: Path, tmp_path: Path, ranks: int, timeout: str | None
) -> None:
    prefix = tmp_path / "comm"
    env = {"FLOWC_COMM_LOG": str(prefix)}
    if timeout:
        env["FLOWC_TIMEOUT_S"] = timeout  # the polled path: nonblocking calls under a deadline
    r = run(["mpirun", "--oversubscribe", "-np", str(ranks), str(host_exe), str(ranks)], env)
    # Each rank compares what it received with the sender's bytes, and its log with the
    # transfers it issued.
    assert sorted(re.findall(r"^OK rank (\d+)", r.stdout, re.M)) == [str(k) for k in range(ranks)]
    assert "FAIL" not in r.stdout
    for rank in range(ranks):
        lines = Path(f"{prefix}.rank{rank}").read_text().splitlines()
        assert lines and all(P2P_LINE.fullmatch(line) for line in lines), lines
        nxt, prev = (rank + 1) % ranks, (rank - 1) % ranks
        # The ring's first exchange: 37 f32 to the next rank, 37 from the one before.
        assert lines[:2] == [
            f"send peer={nxt} bytes=148 dtype=1",
            f"recv peer={prev} bytes=148 dtype=1",
        ]


def test_a_receive_nobody_sends_to_ends_at_the_deadline(host_exe: Path) -> None:
    t0 = time.monotonic()
    r = run(
        ["mpirun", "--oversubscribe", "-np", "2", str(host_exe), "2", "--hang"],
        {"FLOWC_TIMEOUT_S": "1"},
        check=False,
    )
    assert r.returncode != 0
    assert time.monotonic() - t0 < 60
    # The message names the transfer and what its peer is doing (rank 1 sleeps, in no step).
    assert (
        "error: step 1 (recv from rank 1) did not finish after 1.0 s; rank 1 is in no transfer "
        "or collective (it has finished 0 steps), so it has not issued the matching transfer "
        "yet; aborting (FLOWC_TIMEOUT_S=1, seen by rank 0)" in r.stderr
    ), r.stderr
    assert "FAIL" not in r.stdout


def test_cuda_build_compiles_and_links_nccl_p2p(tmp_path: Path) -> None:
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
        ["comm_p2p"],
        [
            f"-DCMAKE_CUDA_COMPILER={CUDA.nvcc}",
            f"-DFLOWC_CUDA_LIB_DIRS={';'.join(sorted({str(lib.lib_dir) for lib in libs}))}",
            f"-DFLOWC_CUDA_INCLUDE_DIRS={';'.join(sorted({str(lib.include_dir) for lib in libs}))}",
        ],
    )
    undefined = run(["nm", "-D", "--undefined-only", str(bdir / "comm_p2p")]).stdout
    for symbol in ("ncclSend", "ncclRecv", "ncclGroupStart", "ncclGroupEnd"):
        assert re.search(rf"\b{symbol}\b", undefined), symbol
