"""Build and run bench/runtime_bench.cu on the host target; print its figures and keep a copy
in bench/results/runtime_host.txt."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from flowc.toolchain import host_compile_command

HERE = Path(__file__).resolve().parent


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "runtime_bench"
        subprocess.run(host_compile_command([HERE / "runtime_bench.cu"], exe), check=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, env=env).stdout
    header = f"# host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}\n"
    print(out, end="")
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "runtime_host.txt").write_text(header + out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
