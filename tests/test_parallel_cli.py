"""The parallel options on the command line: printed plans, eval through the simulator,
verify on host ranks, and clean errors for bad meshes, layouts and limits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_MODELS
from test_cli import assert_clean_error, flowc

MLP = str(SHARED_MODELS / "mlp.onnx")
BERT = str(SHARED_MODELS / "bert_tiny.onnx")


def test_inspect_prints_the_plan_beside_the_baselines() -> None:
    r = flowc("inspect", MLP, "--mesh", "4", "--sbp", "x=S0")
    assert r.returncode == 0, r.stderr
    text = r.stdout
    for fragment in (
        "plan (auto) on mesh 4",
        "layout per value",
        "collectives",
        "per rank:",
        "memory per device:",
        "compared with",
        "data",
        "none",
    ):
        assert fragment in text, fragment
    # x was fixed to S(0): its row says so, with the per-device shape.
    row = next(line for line in text.splitlines() if line.strip().startswith("x "))
    assert "S(0)" in row and "f32[2, 64]" in row


def test_inspect_on_a_2d_mesh_with_a_tuple_layout() -> None:
    # A fixed layout overrides what `data` would choose for that input.
    r = flowc("inspect", MLP, "--mesh", "2x2", "--sbp", "x=(S(0), B)", "--parallel", "data")
    assert r.returncode == 0, r.stderr
    assert "plan (data) on mesh 2x2 (4 devices)" in r.stdout
    row = next(line for line in r.stdout.splitlines() if line.strip().startswith("x "))
    assert "(S(0), B)" in row and "f32[4, 64]" in row


def test_eval_with_a_mesh_simulates_every_rank(tmp_path: Path) -> None:
    io = np.load(SHARED_MODELS / "mlp.io.npz")
    x = tmp_path / "x.npy"
    np.save(x, io["in:x"])
    one, four = tmp_path / "one.npz", tmp_path / "four.npz"
    assert flowc("eval", MLP, "--input", f"x={x}", "-o", str(one)).returncode == 0
    r = flowc(
        "eval",
        MLP,
        "--input",
        f"x={x}",
        "-o",
        str(four),
        "--mesh",
        "4",
        "--sbp",
        "m.0.weight=S0",
        "--sbp",
        "m.2.weight=S1",
    )
    assert r.returncode == 0, r.stderr
    assert "simulated on 4 ranks" in r.stdout
    a, b = np.load(one), np.load(four)
    assert np.allclose(a["y"], b["y"], rtol=1e-5, atol=1e-6)
    assert np.allclose(b["y"], io["out:y"], rtol=1e-4, atol=1e-5)


def test_verify_runs_the_program_on_two_host_ranks() -> None:
    r = flowc("verify", MLP, "--mesh", "2", "--sbp", "m.0.weight=S(0)", "--sbp", "m.2.weight=S(1)")
    assert r.returncode == 0, r.stderr
    assert "PASS" in r.stdout


@pytest.mark.parametrize(
    "args,fragments",
    [
        (["--mesh", "0"], ["--mesh", "like 4 or 2x4"]),
        (["--mesh", "2xa"], ["--mesh", "like 4 or 2x4"]),
        (["--mesh", "4", "--sbp", "nosuch=S0"], ["no value named 'nosuch'"]),
        (["--mesh", "4", "--sbp", "x=S(5)"], ["does not split", "evenly"]),
        (["--mesh", "4", "--sbp", "x=(S0,B)"], ["2 entries", "1 axes"]),
        (["--mesh", "4", "--sbp", "x=Q"], ["'Q' is not a layout"]),
        (["--mesh", "4", "--sbp", "x"], ["expected NAME=SBP"]),
        (["--mesh", "4", "--sbp", "x=P"], ["cannot be partial"]),
        (["--mesh", "4", "--mem-limit", "10"], ["keeps the parameters within 10 bytes"]),
        (["--mesh", "4", "--mem-limit", "lots"], ["expected a byte count"]),
        (["--sbp", "x=S0"], ["--sbp needs --mesh"]),
        (["--mem-limit", "1MB"], ["--mem-limit needs --mesh"]),
        (["--mesh", "4", "--cost-profile", "/nonexistent.toml"], ["cannot read cost profile"]),
        (["--mesh", "3", "--parallel", "data"], ["batch is 8", "divides by 3"]),
    ],
)
def test_bad_parallel_options_give_clean_errors(args: list[str], fragments: list[str]) -> None:
    assert_clean_error(flowc("inspect", MLP, *args), *fragments)


def test_data_parallel_needs_a_batch_that_divides() -> None:
    r = flowc(
        "inspect", BERT, "--dim", "batch=2", "--dim", "seq=8", "--mesh", "4", "--parallel", "data"
    )
    assert_clean_error(r, "input_ids", "batch is 2", "mesh gpus[4]")


def test_bad_cost_profile_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("name = 'x'\n[compute]\ndefault = 'fast'\n")
    assert_clean_error(flowc("inspect", MLP, "--mesh", "2", "--cost-profile", str(bad)), "bad.toml")


def test_multi_rank_compile_is_deterministic(tmp_path: Path) -> None:
    gpt2 = str(SHARED_MODELS / "gpt2_tiny.onnx")
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        r = flowc("compile", gpt2, "--mesh", "4", "--mem-limit", "1.2MB", "-o", str(d))
        assert r.returncode == 0, r.stderr
    files = sorted(p.relative_to(dirs[0]) for p in dirs[0].rglob("*") if p.is_file())
    assert len([f for f in files if f.name.startswith("weights.rank")]) == 4
    for f in files:
        assert (dirs[0] / f).read_bytes() == (dirs[1] / f).read_bytes(), f
