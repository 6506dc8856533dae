"""The hand-written DSL programs in examples/ and the language reference docs/dsl.md.

Each example is read, evaluated with the NumPy reference and compared with an independent
NumPy computation of the same model from the same parameters, and compiled for the host and
checked by `flowc verify` (the MLP through its 4-rank copy). The mesh examples must keep
their in-program placements (no --mesh given: the program's mesh), simulate to the
single-device result, and mlp_mesh4 must run on 4 host ranks. Every program and every error
example in docs/dsl.md must still read (or fail) exactly as the document shows.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from scipy.special import erf

from flowc.errors import FlowcError
from flowc.frontend import ImportOptions, load_graph
from flowc.harness.compare import max_rel_error
from flowc.interpreter import evaluate, random_inputs
from flowc.ir.dtype import DType
from flowc.ir.verify import verify_graph

EXAMPLES = REPO / "examples"
DOC = REPO / "docs" / "dsl.md"
MESH = {"mlp_mesh4.flow": "mlp.flow", "transformer_block_mesh4.flow": "transformer_block.flow"}


def flowc(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flowc", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def run_example(name: str) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """(parameters by name, input x, output y) of an example, evaluated on seed-0 inputs."""
    g = load_graph(EXAMPLES / name)
    params = {c.name: np.asarray(c.const, dtype=np.float64) for c in g.constants}
    feeds = random_inputs(g, seed=0)
    (y,) = evaluate(g, feeds).values()
    return params, feeds["x"].astype(np.float64), y


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def layer_norm(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def test_mlp_matches_numpy() -> None:
    p, x, y = run_example("mlp.flow")
    assert y.shape == (8, 10) and y.dtype == np.float32
    h = np.maximum(x @ p["w1"] + p["b1"], 0)
    ref = softmax(h @ p["w2"] + p["b2"])
    assert max_rel_error(y, ref) <= 1e-5
    # The initializers did what they say: seeded normal with the given std, zeros, fill.
    assert 0.11 < p["w1"].std() < 0.14 and abs(p["w1"].mean()) < 0.01
    assert not p["b1"].any() and np.all(p["b2"] == np.float32(0.01))


def test_cnn_block_matches_numpy() -> None:
    p, x, y = run_example("cnn_block.flow")
    assert y.shape == (2, 8, 8, 8) and np.isfinite(y).all()

    def conv3x3(a: np.ndarray, w: np.ndarray) -> np.ndarray:
        n, _, hh, ww = a.shape
        padded = np.pad(a, ((0, 0), (0, 0), (1, 1), (1, 1)))
        out = np.zeros((n, w.shape[0], hh, ww))
        for i in range(3):
            for j in range(3):
                out += np.einsum(
                    "nchw,oc->nohw", padded[:, :, i : i + hh, j : j + ww], w[:, :, i, j]
                )
        return out

    def bn(a: np.ndarray, k: int) -> np.ndarray:
        s, b, m, v = (
            p[f"bn{k}_{f}"][None, :, None, None] for f in ("scale", "bias", "mean", "var")
        )
        return (a - m) / np.sqrt(v + 1e-5) * s + b

    c1 = conv3x3(x, p["conv1_w"]) + p["conv1_b"][None, :, None, None]
    a1 = np.maximum(bn(c1, 1), 0)
    r = np.maximum(bn(conv3x3(a1, p["conv2_w"]), 2) + x, 0)
    ref = r.reshape(2, 8, 8, 2, 8, 2).max(axis=(3, 5))
    assert max_rel_error(y, ref) <= 1e-5


def test_transformer_block_matches_numpy() -> None:
    p, x, y = run_example("transformer_block.flow")
    assert y.shape == (2, 16, 64) and np.isfinite(y).all()

    def heads(t: np.ndarray) -> np.ndarray:  # [2, 16, 64] -> [2, 4, 16, 16]
        return t.reshape(2, 16, 4, 16).transpose(0, 2, 1, 3)

    h = layer_norm(x, p["ln1_g"], p["ln1_b"])
    q, k, v = (heads(h @ p[w]) for w in ("w_q", "w_k", "w_v"))
    scores = q @ k.transpose(0, 1, 3, 2) / 4.0
    scores = np.where(np.tri(16, dtype=bool), scores, -1e9)  # causal
    att = (softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(2, 16, 64)
    x1 = x + att @ p["w_o"] + p["b_o"]
    u = layer_norm(x1, p["ln2_g"], p["ln2_b"]) @ p["w_fc"] + p["b_fc"]
    m = 0.5 * u * (1 + erf(u / np.sqrt(2)))  # exact GELU
    ref = x1 + m @ p["w_out"] + p["b_out"]
    assert max_rel_error(y, ref) <= 1e-5


def test_random_parameters_are_seeded_by_name() -> None:
    a, b = load_graph(EXAMPLES / "mlp.flow"), load_graph(EXAMPLES / "mlp.flow")
    mesh = load_graph(EXAMPLES / "mlp_mesh4.flow")
    consts = [{c.name: c.const for c in g.constants} for g in (a, b, mesh)]
    for name in ("w1", "w2"):
        assert consts[0][name] is not None
        np.testing.assert_array_equal(consts[0][name], consts[1][name])
        np.testing.assert_array_equal(consts[0][name], consts[2][name])
    # Different names, different draws (same std would otherwise hide it).
    assert not np.allclose(consts[0]["w1"][:, :10].ravel()[:100], consts[0]["w2"].ravel()[:100])


# One host build per model (each takes 10-20 s): mlp.flow's code is checked on 4 ranks by
# its mesh copy, transformer_block_mesh4.flow's plan in the simulator below.
@pytest.mark.parametrize("name", ["cnn_block.flow", "transformer_block.flow", "mlp_mesh4.flow"])
def test_verify_on_the_host(name: str, tmp_path: Path) -> None:
    """Compiled program vs the NumPy reference; the mesh example runs as 4 MPI ranks."""
    if name in MESH and shutil.which("mpirun") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the 4-rank example, but mpirun is missing")
        pytest.skip("needs Open MPI (mpirun) to start 4 ranks")
    r = flowc("verify", str(EXAMPLES / name), "--target", "host", "-o", str(tmp_path / "out"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout and "FAIL" not in r.stdout
    if name in MESH:
        assert "for 4 ranks" in r.stderr  # the program's own mesh, with no --mesh given
        assert len(list((tmp_path / "out").glob("weights.rank*.bin"))) == 4


def table(text: str, columns: int) -> list[list[str]]:
    """The rows of the printed tables that have this many columns, as lists of cells."""
    rows = ([c.strip() for c in line.split("│")] for line in text.splitlines())
    return [r for r in rows if len(r) == columns]


def layout_rows(text: str) -> dict[str, list[str]]:
    """The plan's 'layout per value' table: value name -> its cells."""
    return {r[0]: r for r in table(text, 5)}


def test_mlp_mesh4_plan_keeps_the_program_placements() -> None:
    # Without the annotations the search keeps this small model whole on every device.
    plain = flowc("inspect", str(EXAMPLES / "mlp.flow"), "--mesh", "4")
    assert plain.returncode == 0, plain.stderr
    assert layout_rows(plain.stdout)["w1"][3] == "B" and "collectives: none" in plain.stdout
    # With them (and no --mesh: the program's mesh), the Megatron layout.
    for extra in ([], ["--mesh", "4"]):
        r = flowc("inspect", str(EXAMPLES / "mlp_mesh4.flow"), *extra)
        assert r.returncode == 0, r.stderr
        assert "plan (auto) on mesh 4 (4 devices)" in r.stdout
        rows = layout_rows(r.stdout)
        assert rows["w1"][3:] == ["S(1)", "f32[64, 64]"]
        assert rows["b1"][3:] == ["S(0)", "f32[64]"]
        assert rows["w2"][3:] == ["S(0)", "f32[64, 10]"]
        assert rows["h"][3] == "S(1)" and rows["p"][3] == "P"
        assert "per rank: 1 collectives" in r.stdout
        assert any(c[0] == "p" and c[2] == "all-reduce" for c in table(r.stdout, 7))
    # --sbp overrides the program for the same value.
    r = flowc("inspect", str(EXAMPLES / "mlp_mesh4.flow"), "--mesh", "4", "--sbp", "w1=B")
    assert r.returncode == 0, r.stderr
    assert layout_rows(r.stdout)["w1"][3] == "B"
    # A --mesh of another shape than the placements were written for is refused.
    r = flowc("inspect", str(EXAMPLES / "mlp_mesh4.flow"), "--mesh", "2")
    assert r.returncode == 2 and "its placements are for mesh 4, but --mesh is 2" in r.stderr


def test_transformer_mesh4_plan_is_megatron() -> None:
    r = flowc("inspect", str(EXAMPLES / "transformer_block_mesh4.flow"))
    assert r.returncode == 0, r.stderr
    rows = layout_rows(r.stdout)
    for w in ("w_q", "w_k", "w_v", "w_fc"):
        assert rows[w][3] == "S(1)", w
    for w in ("w_o", "w_out"):
        assert rows[w][3] == "S(0)", w
    assert rows["p"][3:] == ["S(1)", "f32[2, 1, 16, 16]"]  # one head per device
    assert r.stdout.count("│ all-reduce │") == 2 and "per rank: 2 collectives" in r.stdout


@pytest.mark.parametrize("name", list(MESH))
def test_mesh_eval_equals_the_single_device_program(name: str, tmp_path: Path) -> None:
    _, _, single = run_example(MESH[name])  # same parameter names: same values
    for extra in ([], ["--mesh", "4"]):
        out = tmp_path / f"out{len(extra)}.npz"
        r = flowc(
            "eval", str(EXAMPLES / name), "--random-inputs", "--seed", "0", "-o", str(out), *extra
        )
        assert r.returncode == 0, r.stderr
        assert "simulated on 4 ranks" in r.stdout
        assert max_rel_error(np.load(out)["y"], single) <= 1e-5


# -- docs/dsl.md -------------------------------------------------------------------------------

ERROR_EXAMPLE = re.compile(
    r"```flow\n# (?P<file>[\w.]+\.flow)\n(?P<src>.*?)```\n\n"
    r"```console\n\$ flowc (?P<args>[^\n]*)\n(?P<out>.*?)```",
    re.S,
)


def test_docs_error_examples_print_what_the_document_shows(tmp_path: Path) -> None:
    text = DOC.read_text()
    examples = list(ERROR_EXAMPLE.finditer(text))
    assert len(examples) >= 20
    np.savez(tmp_path / "w.npz", w=np.zeros((8, 4), np.float32))
    for m in examples:
        (tmp_path / m["file"]).write_text(m["src"])
        args = m["args"].split()
        if args == ["inspect", m["file"]]:
            try:  # most errors come from reading the program: no process needed
                load_graph(tmp_path / m["file"])
            except FlowcError as e:
                rel = str(e).replace(str(tmp_path) + "/", "")
                assert "error: " + rel + "\n" == m["out"], m["file"]
                continue
        r = flowc(*args, cwd=tmp_path)
        assert r.returncode == 2, (m["file"], r.stderr)
        lines = r.stderr.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("error:"))
        assert "\n".join(lines[start:]) + "\n" == m["out"], m["file"]


LOAD = re.compile(r': (\w+)\[([^\]]*)\][^=\n]*= load\("([^"]+)"\)')


def test_docs_programs_read(tmp_path: Path) -> None:
    """Every complete program in the document (a graph with a return) reads and verifies;
    its load("...") params get arrays of the declared types from a --weights file."""
    text = DOC.read_text()
    error_examples = {f"# {m['file']}\n{m['src']}" for m in ERROR_EXAMPLE.finditer(text)}
    programs = [
        b
        for b in re.findall(r"```flow\n(.*?)```", text, re.S)
        if re.search(r"^graph ", b, re.M) and "return" in b and b not in error_examples
    ]
    assert len(programs) >= 6
    for k, src in enumerate(programs):
        path = tmp_path / f"doc{k}.flow"
        path.write_text(src)
        arrays = {
            key: np.zeros([int(d) for d in dims.split(",") if d.strip()], DType.from_short(dt).np)
            for dt, dims, key in re.findall(LOAD, src)
        }
        opts = None
        if arrays:
            np.savez(tmp_path / f"doc{k}.npz", **arrays)
            opts = ImportOptions(weights=tmp_path / f"doc{k}.npz")
        verify_graph(load_graph(path, opts))
