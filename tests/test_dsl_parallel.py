"""A .flow program's mesh and @ placements drive parallel compilation: the program's mesh
when no --mesh is given, its placements as constraints of the search."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from test_cli import assert_clean_error, flowc

PROGRAM = """\
mesh gpus[4]
graph mlp(x: f32[8, 64]) -> (y: f32[8, 64]) {
    param w1: f32[64, 256] @ S(1) = normal(0.0, 0.1)   # Megatron: columns, then rows
    param w2: f32[256, 64] @ S(0) = normal(0.0, 0.1)
    h = relu(x @ w1)
    y = h @ w2
    return y
}
"""


def write(tmp_path: Path) -> Path:
    p = tmp_path / "mlp.flow"
    p.write_text(PROGRAM)
    return p


def test_program_placements_are_the_plan(tmp_path: Path) -> None:
    r = flowc("inspect", str(write(tmp_path)))
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.strip()}
    assert "S(1)" in rows["w1"] and "f32[64, 64]" in rows["w1"]
    assert "S(0)" in rows["w2"] and "f32[64, 64]" in rows["w2"]
    assert "all-reduce" in r.stdout  # the one collective of the Megatron layout


def test_sbp_option_overrides_one_placement(tmp_path: Path) -> None:
    r = flowc("inspect", str(write(tmp_path)), "--mesh", "4", "--sbp", "w2=B")
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.strip().startswith("w2 "))
    assert " B " in row


def test_a_different_mesh_is_refused(tmp_path: Path) -> None:
    assert_clean_error(
        flowc("inspect", str(write(tmp_path)), "--mesh", "2x2"),
        "placements are for mesh 4",
        "--mesh is 2x2",
    )


def test_simulated_and_compiled_ranks_match_one_device(tmp_path: Path) -> None:
    prog = write(tmp_path)
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32))
    single = tmp_path / "single.flow"
    single.write_text(
        PROGRAM.replace("mesh gpus[4]\n", "").replace(" @ S(1)", "").replace(" @ S(0)", "")
    )
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    assert flowc("eval", str(single), "--input", f"x={x}", "-o", str(a)).returncode == 0
    r = flowc("eval", str(prog), "--input", f"x={x}", "-o", str(b))
    assert r.returncode == 0, r.stderr
    assert "simulated on 4 ranks" in r.stdout
    np.testing.assert_allclose(np.load(b)["y"], np.load(a)["y"], rtol=1e-5, atol=1e-6)
    r = flowc("verify", str(prog), "--target", "host", "--input", f"x={x}")
    assert r.returncode == 0, r.stderr
    assert "PASS" in r.stdout
