"""Child processes that end with flowc: compilers, CMake, the compiled driver, mpirun.

Each child starts in a process group of its own, so a Ctrl-C at the terminal reaches flowc
alone (make would otherwise print its own "Interrupt" lines and exit 2 before flowc could
say anything), and flowc ends the whole group itself: CMake, make, every g++ or nvcc they
started, mpirun's ranks. Python's subprocess.run kills only the child it started, which
leaves a compiler two levels down writing objects after flowc has exited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence

# How long the group gets to leave after SIGTERM (gcc and make remove the files they were
# writing on SIGTERM) before SIGKILL.
GRACE_S = 3.0


def run_group(
    cmd: Sequence[str],
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``cmd`` run to its end with its output captured, in its own process group; if the
    wait is interrupted (KeyboardInterrupt, or any other exception) the whole group is ended
    before the exception goes on."""
    p = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        cwd=cwd,
        env=None if env is None else dict(env),
        start_new_session=True,
    )
    try:
        stdout, stderr = p.communicate()
    except BaseException:
        end_group(p)
        raise
    return subprocess.CompletedProcess(list(cmd), p.returncode, stdout, stderr)


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the group; False when no process of it is left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member that changed its user: nothing flowc may stop
        return False
    return True


def end_group(p: subprocess.Popen[str]) -> None:
    """End ``p``'s process group: SIGTERM, then SIGKILL to whatever is left after GRACE_S.
    Returns once ``p`` itself is reaped and no process of the group answers a signal."""
    pgid = p.pid  # start_new_session: the child leads a group of its own id
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        if p.poll() is not None and not _signal_group(pgid, 0):
            break
        time.sleep(0.05)
    _signal_group(pgid, signal.SIGKILL)
    # Ctrl-C pressed again while waiting must not leave a zombie or a live compiler.
    while True:
        try:
            p.wait()
            break
        except KeyboardInterrupt:
            _signal_group(pgid, signal.SIGKILL)
    # Members reparented to init die on SIGKILL at once; wait until none answers.
    for _ in range(100):
        if not _signal_group(pgid, 0):
            break
        time.sleep(0.02)
    for stream in (p.stdout, p.stderr):
        if stream is not None:
            stream.close()
