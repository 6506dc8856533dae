import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

REPO = Path(__file__).resolve().parent.parent
SHARED_MODELS = REPO / "tests" / "data" / "models"  # the project's shared models, carried here
os.environ.setdefault("OMP_NUM_THREADS", "1")


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``flowc ARGS`` in this process: its exit code and what it printed."""
    from flowc import cli

    try:
        cli.main(args)
    except SystemExit as e:
        code = int(e.code or 0)
    else:
        code = 0
    out = capsys.readouterr()
    return code, out.out + out.err


def require_cuda_build_toolchain() -> None:
    """Skip (on a user's machine) or fail (under CI=true) a test that builds a multi-rank
    CUDA program when nvcc, cuBLASLt, cuDNN or NCCL is missing."""
    from flowc.toolchain import find_cuda

    tk = find_cuda()
    missing = tk.missing(["cublasLt", "cudnn", "nccl"]) if tk.nvcc else ["nvcc"]
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must build the CUDA program, but {missing} are missing")
        pytest.skip(f"no CUDA toolchain here ({', '.join(missing)} missing)")
