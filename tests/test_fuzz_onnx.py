"""Fuzzing the front ends, bounded for CI (the generators are tests/fuzzing.py; bench/fuzz.py
runs them for longer).

* The committed corpus (tests/fuzz_corpus/): one small model per defect found, each of which
  once ended in an internal error (exit 70), a hang or an allocation of gigabytes (or, like
  a mesh of 2**31 devices, tens of gigabytes of compile); each must now exit 2 with a
  message naming the culprit (cases.json: the command and that name).
* A fixed set of seeded mutants of the ONNX test models and of DSL programs, each in a
  forked child under a 4 GiB address-space limit and a 20 s timeout: every one must be
  accepted (import, random inputs, the reference interpreter where the graph is small,
  compile passes, code generation) or rejected with a FlowcError of exit code 2; no
  internal error, crash, hang or MemoryError.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import fuzzing
import pytest
from conftest import run_cli

CORPUS = Path(__file__).parent / "fuzz_corpus"
CASES = json.loads((CORPUS / "cases.json").read_text())

# Cases in the CI run: 10-20 ms each on two cores (the DSL share is in test_dsl_fuzz.py).
N_ONNX = 1000


@pytest.mark.parametrize("name", sorted(CASES))
def test_corpus_reproducer_exits_2_naming_the_culprit(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    case = CASES[name]
    cmd = case["args"][0]
    out = ["-o", str(tmp_path / ("out.npz" if cmd == "eval" else "proj"))]
    args = [cmd, str(CORPUS / name), *case["args"][1:], *out]
    code, text = run_cli(args, capsys)
    assert code == 2, text
    assert "internal error" not in text and "Traceback" not in text, text
    assert case["expect"] in text, text


def test_corpus_reproducers_also_pass_the_fuzz_check() -> None:
    """The same files through the fuzzer's own check (import, passes, codegen), bounded."""
    # every file is rejected, in the child's bounded memory
    for name in sorted(CASES):
        outcome, message = fuzzing.check_file(CORPUS / name, {})
        if CASES[name]["args"][0] == "eval":
            continue  # refused by --random-inputs only, checked above
        assert outcome == "rejected", f"{name}: {outcome}: {message}"


def _run(gen: str, n: int, start: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    bad = []
    for r in fuzzing.run_cases(((gen, start + k) for k in range(n)), jobs=2):
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
        if r.outcome not in fuzzing.GOOD:
            bad.append(f"{gen} seed {r.seed}: {r.outcome}: {r.message[-1500:]}")
    assert not bad, f"{len(bad)} bad case(s); reproduce with bench/fuzz.py:\n" + "\n".join(bad[:5])
    return counts


def test_fuzz_onnx_mutants_exit_0_or_2() -> None:
    t0 = time.monotonic()
    counts = _run("onnx", N_ONNX, 0)
    # the mutants exercise both sides: some compile, most are refused
    assert counts.get("accepted", 0) > N_ONNX // 20 and counts.get("rejected", 0) > N_ONNX // 2
    print(f"{counts} in {time.monotonic() - t0:.1f} s", file=sys.stderr)


def test_fuzz_runner_reports_internal_errors_memory_and_hangs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The runner itself: a bug, an allocation past the limit and a hang are each seen as
    what they are (not as a pass)."""
    import numpy as np

    def bug(path: Path, shapes: object) -> tuple[str, str]:
        raise ZeroDivisionError("injected")

    def hog(path: Path, shapes: object) -> tuple[str, str]:
        np.ones(8 << 30, np.uint8)
        return "accepted", ""

    def sleep(path: Path, shapes: object) -> tuple[str, str]:
        time.sleep(60)
        return "accepted", ""

    outcomes = []
    for fn in (bug, hog, sleep):
        monkeypatch.setattr(fuzzing, "check_file", fn)
        outcomes += [r.outcome for r in fuzzing.run_cases([("dsl", 1)], timeout=2, warm=False)]
    assert outcomes == ["internal", "memory", "hang"]
