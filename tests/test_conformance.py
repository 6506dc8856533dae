"""ONNX conformance: the node test cases of the pinned onnx package, run through flowc, must
fail exactly as tests/conformance/expected_failures_<target>.txt lists (both ways)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from flowc import conformance as conf

HERE = Path(__file__).parent
LISTS = HERE / "conformance"


def flowc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flowc", *args], capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def cases() -> tuple[Path, list[conf.CaseInfo]]:
    return conf.materialize()


def _check_list(target: str, results: list[conf.Result], full: bool) -> None:
    expected = conf.read_expected_failures(LISTS / f"expected_failures_{target}.txt")
    new, fixed = conf.check_expected(expected, results, full=full)
    by = {r.name: r for r in results}
    msg = [f"unexpected failure: {n}: {by[n].status}: {by[n].message}" for n in new]
    msg += [f"listed as failing but passes: {n}" for n in fixed]
    assert not msg, (
        "\n".join(msg) + f"\n(update: flowc conformance --target {target} --update-expected "
        f"tests/conformance/expected_failures_{target}.txt)"
    )


@pytest.fixture(scope="module")
def ref_results(cases: tuple[Path, list[conf.CaseInfo]]) -> list[conf.Result]:
    root, infos = cases
    return conf.run_cases(root, infos, "ref", jobs=2)


def _host_results(infos: list[conf.CaseInfo], root: Path) -> tuple[list[conf.Result], bool]:
    """Every case compiled, built and run on the host (about 6 minutes on 2 cores, cases
    sharing builds 120 at a time). FLOWC_CONFORMANCE_HOST=sample runs a sample instead, for a
    quick local check; CI always runs everything."""
    full = os.environ.get("CI") == "true" or os.environ.get("FLOWC_CONFORMANCE_HOST") != "sample"
    pattern = None if full else r"^test_(relu|abs|add|reduce_sum_default_axes|cast_FLOAT_to|mod_)"
    chosen = conf.select(infos, pattern)
    return conf.run_cases(root, chosen, "host", jobs=2, group_size=120), full


def test_ref_conformance_matches_the_expected_failures(
    cases: tuple[Path, list[conf.CaseInfo]], ref_results: list[conf.Result]
) -> None:
    _, infos = cases
    assert len(infos) == 1884
    s = conf.summarize(ref_results)
    assert s.total == 1884 and s.passed >= 1750
    _check_list("ref", ref_results, full=True)


def test_host_conformance(
    cases: tuple[Path, list[conf.CaseInfo]], ref_results: list[conf.Result]
) -> None:
    """One test, so the long host run happens once whatever the xdist scheduling: the
    expected-failure list both ways, the overall count, the claim (an op type flowc claims
    passes 95% of its cases on the host; every other op type in the suite has its reason in
    conformance.GAPS, and no reason is stale) and the checked-in table."""
    root, infos = cases
    results, full = _host_results(infos, root)
    assert any(r.status == "pass" for r in results)
    _check_list("host", results, full=full)
    if not full:
        return  # the rest is about every case; a sample says nothing about it
    assert conf.summarize(results).passed >= 1750
    short = conf.host_shortfalls(infos, results)
    assert not sorted(set(short) - set(conf.GAPS)), "op types below the claim without a reason"
    assert not sorted(set(conf.GAPS) - set(short)), "reasons for op types that now pass"
    text = (HERE.parent / "docs" / "ONNX_SUPPORT.md").read_text()
    assert text == conf.support_table(infos, ref_results, results), (
        "docs/ONNX_SUPPORT.md is stale: run flowc conformance --target host, then "
        "flowc conformance --write-table docs/ONNX_SUPPORT.md"
    )


def test_cuda_build_of_every_op_type(
    cases: tuple[Path, list[conf.CaseInfo]], tmp_path: Path
) -> None:
    """One case of every op type that passes on the host, all in one program, compiled and
    linked with nvcc: every kind of kernel the conformance programs use builds for CUDA
    (warning-free). Running it needs a GPU."""
    from test_runtime import CUDA

    missing = CUDA.missing(["cublasLt", "cudnn"])
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"missing {', '.join(missing)} (CI must have them)")
        pytest.skip(f"no {', '.join(missing)} here: the CUDA build is not checked")
    root, infos = cases
    failing = conf.read_expected_failures(LISTS / "expected_failures_host.txt")
    one: dict[str, conf.CaseInfo] = {}
    for info in sorted(infos, key=lambda i: i.name):
        if info.name not in failing and info.op not in one:
            one[info.op] = info
    bdir = conf.cuda_build(root, list(one.values()), tmp_path / "out")
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
    assert (bdir / "model_main").is_file()


def test_compare_output_follows_the_backend_tolerances() -> None:
    e = np.array([1.0, 2.0, np.nan], np.float32)
    assert conf.compare_output(e + 1e-4, e, rtol=1e-3, atol=1e-7) is None
    assert "Mismatched" in (conf.compare_output(e + 1e-2, e, rtol=1e-3, atol=1e-7) or "")
    # atol alone can accept a difference.
    assert conf.compare_output(e + 1e-2, e, rtol=0, atol=0.02) is None
    # Integers are exact, whatever the tolerances.
    i = np.array([100, 200], np.int64)
    assert conf.compare_output(i, i, rtol=0.1, atol=5) is None
    assert "1 of 2" in (conf.compare_output(i + np.array([0, 1]), i, rtol=0.1, atol=5) or "")
    b = np.array([True, False])
    assert conf.compare_output(~b, b, 1, 1) is not None
    assert "dtype" in (conf.compare_output(i.astype(np.int32), i, 1e-3, 1e-7) or "")
    assert "shape" in (conf.compare_output(i[:1], i, 1e-3, 1e-7) or "")
    bf = np.array([1.0, 2.0], ml_dtypes.bfloat16)
    assert conf.compare_output(bf, bf, 1e-3, 1e-7) is None
    assert conf.compare_output(bf * 2, bf, 1e-3, 1e-7) is not None


def test_expected_failure_list_is_enforced_both_ways() -> None:
    rs = [
        conf.Result("a", "Add", "pass"),
        conf.Result("b", "Add", "mismatch", "x"),
        conf.Result("c", "Add", "unsupported", "y"),
    ]
    assert conf.check_expected({"b", "c"}, rs, full=True) == ([], [])
    assert conf.check_expected({"c"}, rs, full=True) == (["b"], [])
    assert conf.check_expected({"a", "b", "c"}, rs, full=True) == ([], ["a"])
    # A stale name fails a full run, not a filtered one.
    assert conf.check_expected({"b", "c", "gone"}, rs, full=True) == ([], ["gone"])
    assert conf.check_expected({"b", "c", "gone"}, rs, full=False) == ([], [])


def test_support_table_has_the_overall_lines() -> None:
    infos = [conf.CaseInfo("test_a", "Add", 1e-3, 1e-7, [], []) for _ in range(1)]
    text = conf.support_table(infos, [conf.Result("test_a", "Add", "pass")], None)
    assert "- ref: 1 / 1 passed" in text and "- host: not run" in text
    assert "| Add | 1 | 1 | not run |" in text


def test_cli_rejects_a_bad_filter_or_target() -> None:
    r = flowc("conformance", "--filter", "test_(")
    assert r.returncode == 2 and "error:" in r.stderr and "not a regular expression" in r.stderr
    r = flowc("conformance", "--filter", "^no_such_case$")
    assert r.returncode == 2 and "matches none of the 1884 cases" in r.stderr
    r = flowc("conformance", "--target", "tpu")
    assert r.returncode == 2 and "tpu" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_runs_a_filtered_ref_run(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    r = flowc("conformance", "--filter", "^test_relu$", "-j", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "ref: 1 / 1 passed" in r.stdout
    assert out.is_file()
