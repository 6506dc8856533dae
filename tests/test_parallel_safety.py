"""Multi-rank programs fail safely (issue 12, defect 7), on host ranks under mpirun: a rank
refuses another rank's weights file, a job in which any rank failed writes no output, and with
FLOWC_TIMEOUT_S a rank stopped with SIGSTOP ends the job within the deadline, named by the
ranks that wait for it, while a rank stopped for a while that resumes neither times out on the
time it was stopped nor blames the peers that waited for it (issue 23).

One program serves every test: the MLP on a 2x2 mesh with a Megatron-style plan on mesh axis
1, so its collectives run within the groups {0, 1} and {2, 3}: rank 0 does not depend on rank
3 at all until the end, which is what let a failed rank 3 leave rank 0's outputs behind."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_parallel_models import check_outputs, logical, reference, tensor_parallel

from flowc.codegen.program import layout_weights
from flowc.compiler import compile_graph, parallelize
from flowc.harness.build import build, launcher, run
from flowc.ir.layout import all_coords
from flowc.ir.types import Mesh
from flowc.parallel import ParallelOptions

pytestmark = pytest.mark.skipif(
    shutil.which("mpirun") is None and os.environ.get("CI") != "true",
    reason="needs Open MPI (mpirun) to start several ranks",
)

MESH = (2, 2)
RANKS = 4
COLLECTIVE = r"(all-reduce|all-gather|reduce-scatter|all-to-all) axis=1"


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    m = Mesh("gpus", MESH)
    g = logical("mlp")
    result = parallelize(g, ParallelOptions(m, "auto", sbp=tensor_parallel(g, m)))
    out = tmp_path_factory.mktemp("safety") / "mlp"
    compile_graph(result.physical.graph, out, prefix="mlp", physical=result.physical)
    build(out, "host", quick=True)
    assert "warning" not in (out / "build-host" / "flowc-build.log").read_text().lower()
    return out


def weights_copy(project: Path, where: Path) -> Path:
    """A private copy of the ranks' weights files (tests then damage them); returns the
    weights.bin path the program takes."""
    where.mkdir(parents=True, exist_ok=True)
    for r in range(RANKS):
        shutil.copy(project / f"weights.rank{r}.bin", where / f"weights.rank{r}.bin")
    return where / "weights.bin"


def command(project: Path, weights: Path, out_dir: Path, *extra: str) -> list[str]:
    feeds, _ = reference("mlp")
    args = []
    for name, a in feeds.items():
        path = out_dir.parent / f"{name}.npy"
        np.save(path, a)
        args += ["--input", f"{name}={path}"]
    exe = project / "build-host" / "model_main"
    prefix, _ = launcher(RANKS, "host")
    out_dir.mkdir(parents=True, exist_ok=True)
    return [*prefix, str(exe), "--weights", str(weights), "--out-dir", str(out_dir), *args, *extra]


def job_env(**extra: str) -> dict[str, str]:
    _, env = launcher(RANKS, "host")
    base = {k: v for k, v in os.environ.items() if k not in ("FLOWC_TIMEOUT_S", "FLOWC_COMM_LOG")}
    return {**base, **env, **extra}


def run_job(
    cmd: list[str], env: dict[str, str], limit: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=limit)


def test_ranks_have_their_own_layout_ids(project: Path) -> None:
    """Every rank's file records its own id, and a 4-rank mesh of another shape gives other
    ids again."""
    ids = [
        int.from_bytes((project / f"weights.rank{r}.bin").read_bytes()[32:40], "little")
        for r in range(RANKS)
    ]
    assert len(set(ids)) == RANKS
    g = logical("mlp")
    line = parallelize(g, ParallelOptions(Mesh("gpus", (4,)), "none")).physical
    square = parallelize(g, ParallelOptions(Mesh("gpus", MESH), "none")).physical
    ids_line = [
        layout_weights(line.graph, physical=line, coords=c).layout_id for c in all_coords(line.mesh)
    ]
    ids_square = [
        layout_weights(square.graph, physical=square, coords=c).layout_id
        for c in all_coords(square.mesh)
    ]
    assert len(set(ids_line) | set(ids_square)) == 2 * RANKS
    # The same data on every rank (all broadcast), still one id per rank.
    assert (
        len(
            {layout_weights(line.graph, physical=line, coords=c).crc for c in all_coords(line.mesh)}
        )
        == 1
    )


def test_a_rank_refuses_another_ranks_weights(project: Path, tmp_path: Path) -> None:
    weights = weights_copy(project, tmp_path / "w")
    shutil.copy(project / "weights.rank1.bin", tmp_path / "w" / "weights.rank2.bin")
    out = tmp_path / "out"
    r = run_job(command(project, weights, out), job_env())
    assert r.returncode != 0
    assert "weights.rank2.bin is for rank 1 of mesh 2x2, and this is rank 2" in r.stderr, r.stderr
    assert list(out.iterdir()) == []


def test_a_failed_rank_leaves_no_output(project: Path, tmp_path: Path) -> None:
    """Rank 3's weights are corrupt: it fails in create() while ranks 0 and 1, which never
    need it, finish their run; rank 0 must not write."""
    weights = weights_copy(project, tmp_path / "w")
    bad = tmp_path / "w" / "weights.rank3.bin"
    data = bytearray(bad.read_bytes())
    data[64 + 100] ^= 0xFF
    bad.write_bytes(bytes(data))
    for k in range(3):
        out = tmp_path / f"out{k}"
        r = run_job(command(project, weights, out), job_env())
        assert r.returncode != 0
        assert "weights.rank3.bin is corrupt" in r.stderr, r.stderr
        assert list(out.iterdir()) == [], f"run {k} left rank 0's outputs"


@pytest.mark.parametrize("value", ["0", "soon", "0x10"])
def test_bad_timeout_values_are_refused(project: Path, tmp_path: Path, value: str) -> None:
    out = tmp_path / "out"
    r = run_job(command(project, project / "weights.bin", out), job_env(FLOWC_TIMEOUT_S=value))
    assert r.returncode != 0
    assert (
        f"FLOWC_TIMEOUT_S='{value}': expected a decimal number of seconds from 0.001 to 31536000"
        in r.stderr
    ), r.stderr
    assert list(out.iterdir()) == []


def test_timeout_set_gives_the_same_results(project: Path) -> None:
    feeds, ref = reference("mlp")
    got, _ = run(project, feeds, target="host", env={"FLOWC_TIMEOUT_S": "30"})
    check_outputs("mlp", [got[o.name] for o in logical("mlp").outputs], ref)


def rank_pids(mpirun: int, count: int, limit: float = 30) -> dict[int, int]:
    """World rank -> pid of mpirun's rank processes, from their environment."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        pids: dict[int, int] = {}
        for child in Path(f"/proc/{mpirun}/task/{mpirun}/children").read_text().split():
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in env:
                if item.startswith(b"OMPI_COMM_WORLD_RANK="):
                    pids[int(item.split(b"=", 1)[1])] = int(child)
        if len(pids) == count:
            return pids
        time.sleep(0.01)
    raise AssertionError("the rank processes did not start")


def writing_full_pipe(pid: int) -> bool:
    """Whether process ``pid`` waits in write() for room in a full pipe."""
    if Path(f"/proc/{pid}/wchan").read_text() == "pipe_write":
        return True
    # Kernels that hide wchan: the system call it sleeps in (x86-64 write).
    try:
        call = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "S" and call[:1] == ["1"]


def full_fifo(path: Path) -> int:
    """A FIFO at ``path`` whose pipe is full, with a reader that has not read yet (returned):
    whoever opens it to write (a reader exists, so the open succeeds) blocks at its first
    write until the reader reads."""
    os.mkfifo(path)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    writer = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(writer, bytes(4096))
    os.close(writer)
    return reader


def drain(reader: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(reader, 65536):
            pass


@pytest.fixture
def job() -> Iterator[list[subprocess.Popen[str]]]:
    """Jobs started in a session of their own; whatever is left of them is continued and
    killed at the end, so no stopped process outlives the test."""
    jobs: list[subprocess.Popen[str]] = []
    yield jobs
    for p in jobs:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        p.wait(timeout=30)


def start(
    cmd: list[str], env: dict[str, str], jobs: list[subprocess.Popen[str]]
) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    jobs.append(p)
    return p


def finish(p: subprocess.Popen[str], stopped_at: float) -> tuple[str, float]:
    """Waits for the job; returns its stderr and the seconds it took after the stop."""
    try:
        _, err = p.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        raise AssertionError("the job with a stopped rank did not end within 10 s") from None
    elapsed = time.monotonic() - stopped_at
    assert p.returncode != 0
    return err, elapsed


def assert_no_rank_left(pids: dict[int, int]) -> None:
    def alive(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return False
        return state not in "ZX"  # a zombie of the exited mpirun is gone in all but name

    # A killed rank that was stopped is continued to die: on a loaded machine it may still be
    # running its exit for a moment after mpirun returns. Left is what outlives 5 s.
    deadline = time.monotonic() + 5
    for r, pid in pids.items():
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(pid), f"rank {r} ({pid}) is left"


def test_a_rank_stopped_before_its_first_collective_ends_the_job(
    project: Path, tmp_path: Path, job: list[subprocess.Popen[str]]
) -> None:
    """Rank 1 is SIGSTOPped on its way to its first collective: its communication log is a
    FIFO whose pipe is full and whose reader does not read yet, so rank 1 waits writing its
    first line there (the first collective logs before it runs); once stopped, the pipe is
    drained, so only the stop holds rank 1. Rank 0 waits for rank 1 in that collective, runs
    out of time, says so and ends the job, without writing outputs."""
    logs = tmp_path / "logs"
    logs.mkdir()
    reader = full_fifo(logs / "comm.rank1")
    try:
        out = tmp_path / "out"
        cmd = command(project, project / "weights.bin", out)
        p = start(cmd, job_env(FLOWC_TIMEOUT_S="1", FLOWC_COMM_LOG=str(logs / "comm")), job)
        pids = rank_pids(p.pid, RANKS)
        t0 = time.monotonic()
        while not writing_full_pipe(pids[1]):
            assert time.monotonic() - t0 < 30 and p.poll() is None, (
                "rank 1 did not reach its first collective"
            )
            time.sleep(0.005)
        os.kill(pids[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        drain(reader)
        err, elapsed = finish(p, stopped_at)
    finally:
        os.close(reader)
    assert re.search(rf"rank 1 has not reached step 1 \({COLLECTIVE}\) after 1\.\d s", err), err
    assert elapsed < 10
    assert list(out.iterdir()) == []
    assert_no_rank_left(pids)


def test_a_rank_stopped_while_running_ends_the_job(
    project: Path, tmp_path: Path, job: list[subprocess.Popen[str]]
) -> None:
    """Rank 1 is SIGSTOPped at whatever point of a long benchmark loop it is in; rank 0, its
    partner in every collective, ends the job within the deadline, naming it."""
    logs = tmp_path / "logs"
    logs.mkdir()
    out = tmp_path / "out"
    cmd = command(project, project / "weights.bin", out, "--bench", "1000000")
    p = start(cmd, job_env(FLOWC_TIMEOUT_S="1", FLOWC_COMM_LOG=str(logs / "comm")), job)
    pids = rank_pids(p.pid, RANKS)
    log1 = logs / "comm.rank1"
    t0 = time.monotonic()
    # In the loop: rank 1 has queued the collectives of a few dozen runs.
    while not log1.exists() or log1.stat().st_size < 4000:
        assert time.monotonic() - t0 < 30 and p.poll() is None, "rank 1 did not start the loop"
        time.sleep(0.005)
    os.kill(pids[1], signal.SIGSTOP)
    err, elapsed = finish(p, time.monotonic())
    assert re.search(
        rf"rank 1 (has not reached|stopped inside|does not answer).* step \d+ \({COLLECTIVE}\)", err
    ), err
    assert "seen by rank 0" in err
    assert elapsed < 10
    assert_no_rank_left(pids)


def test_a_rank_stopped_for_a_while_blames_no_peer_when_it_resumes(
    project: Path, tmp_path: Path, job: list[subprocess.Popen[str]]
) -> None:
    """Rank 1 is stopped inside a collective for less than the deadline, but long enough that
    its own wait, from when it began, passes it: rank 0 is held first (SIGSTOP) so that rank 1
    waits for it; then rank 1 is stopped and rank 0 continued, and rank 0 waits for rank 1 for
    2.2 s of the 3 s deadline. Rank 1 resumed, found it had waited over 3 s, and ended the job
    blaming its healthy peer ("rank 0 stopped inside step ..." or "step ... did not finish",
    seen by rank 1). A rank does not count time in which it did not run: the job goes on."""
    logs = tmp_path / "logs"
    logs.mkdir()
    out = tmp_path / "out"
    cmd = command(project, project / "weights.bin", out, "--bench", "1000000")
    p = start(cmd, job_env(FLOWC_TIMEOUT_S="3", FLOWC_COMM_LOG=str(logs / "comm")), job)
    pids = rank_pids(p.pid, RANKS)
    log1 = logs / "comm.rank1"
    t0 = time.monotonic()
    while not log1.exists() or log1.stat().st_size < 4000:
        assert time.monotonic() - t0 < 30 and p.poll() is None, "rank 1 did not start the loop"
        time.sleep(0.005)
    os.kill(pids[0], signal.SIGSTOP)
    # Rank 1 issues nothing more once it waits for rank 0 (every collective it runs needs
    # rank 0): its log stays as it is for a second.
    size, since = log1.stat().st_size, time.monotonic()
    while time.monotonic() - since < 1.0:
        assert time.monotonic() - t0 < 30 and p.poll() is None, "rank 1 did not wait for rank 0"
        if log1.stat().st_size != size:
            size, since = log1.stat().st_size, time.monotonic()
        time.sleep(0.01)
    os.kill(pids[1], signal.SIGSTOP)
    os.kill(pids[0], signal.SIGCONT)
    time.sleep(2.2)
    os.kill(pids[1], signal.SIGCONT)
    resumed = time.monotonic()
    while time.monotonic() - resumed < 1.5 and p.poll() is None:
        time.sleep(0.05)
    running = p.poll() is None
    grew = log1.stat().st_size > size
    for sig in (signal.SIGCONT, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)
    _, err = p.communicate(timeout=30)
    assert running and "error" not in err, err
    assert grew, "rank 1 made no progress after it resumed"
