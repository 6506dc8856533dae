"""One rank of `flowc train --mesh`: mpirun starts this module in every process of the job
with the JSON file of train()'s arguments (the built project among them); see
flowc.trainer.train. A rank that fails exits non-zero, which ends the job."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flowc.errors import FlowcError


def main(argv: list[str]) -> int:
    from flowc.trainer import train

    args = json.loads(Path(argv[1]).read_text(encoding="utf-8"))
    try:
        train(**args, progress=lambda m: print(f"flowc: {m}", file=sys.stderr, flush=True))
    except FlowcError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
