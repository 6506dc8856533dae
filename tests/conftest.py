import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

REPO = Path(__file__).resolve().parent.parent
SHARED_MODELS = REPO.parent / "shared" / "models"
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
