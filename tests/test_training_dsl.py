"""The DSL and training: a program's train block (the training options written in the
program), and the whole step printed as a .flow program (`flowc inspect --train
--print-ir`, state declarations included) that reads back to the same graph and compiles
to the same training program."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_MODELS

from flowc.errors import FlowcError
from flowc.frontend.dsl import parse_program
from flowc.ir.graph import is_splat
from flowc.ir.printer import INLINE_MAX, print_graph

REPO = Path(__file__).resolve().parent.parent
MLP_FLOW = (REPO / "examples" / "mlp.flow").read_text()
BLOCK = """
train {
    loss = cross_entropy(z, labels, label_smoothing=0.1)
    optimizer = sgd(lr=0.005, momentum=0.9)
    schedule = cosine(warmup=1, total=6)
    clip_norm = 5.0
    batch = 8
}
"""


def _flowc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flowc", *args], capture_output=True, text=True, cwd=REPO
    )


def _weights_of(graph: object, path: Path) -> None:
    """What the printed program's load(...) names: stored constants and state."""
    g = graph
    stored = {
        c.name: c.const  # type: ignore[attr-defined]
        for c in g.constants  # type: ignore[attr-defined]
        if not is_splat(c.const) and c.const.size > INLINE_MAX
    }
    for name, a in g.params.items():  # type: ignore[attr-defined]
        a = np.asarray(a)
        if a.ndim and not is_splat(a):
            stored[name] = a
    np.savez(path, **stored)


@pytest.mark.parametrize("model", ["mlp.onnx", "gpt2_tiny.onnx"])
def test_the_printed_step_reads_back_to_the_same_graph(model: str, tmp_path: Path) -> None:
    from flowc.compiler import load_training
    from flowc.options import ModelArgs
    from flowc.trainer import spec_from

    logits = "y" if model == "mlp.onnx" else "logits"
    spec = spec_from(
        f"cross_entropy:{logits},labels",
        "adamw:lr=0.01,weight_decay=0.01",
        lr_schedule="cosine:warmup=2,total=10",
        clip_norm=1.0,
        ignore_index=-100,
    )
    step = load_training(ModelArgs(SHARED_MODELS / model), spec, batch=1)
    g = step.graph
    _weights_of(g, tmp_path / "w.npz")
    text = print_graph(g, weights="w.npz")
    assert 'state "train/step" = fill(0) -> "train/step.next"' in text
    back = parse_program(text, str(tmp_path / "step.flow"), base_dir=tmp_path)
    assert print_graph(back, weights="w.npz") == text
    assert back.state == g.state
    for name, a in g.params.items():
        np.testing.assert_array_equal(np.asarray(back.params[name]), np.asarray(a), name)


def test_flowc_compiles_a_printed_step_as_the_training_program(tmp_path: Path) -> None:
    common = ["--loss", "cross_entropy:y,labels", "--optimizer", "adamw:lr=0.01", "--batch", "8"]
    r = _flowc("inspect", str(SHARED_MODELS / "mlp.onnx"), "--train", *common, "--print-ir")
    assert r.returncode == 0, r.stderr
    from flowc.compiler import load_training
    from flowc.options import ModelArgs
    from flowc.trainer import spec_from

    step = load_training(
        ModelArgs(SHARED_MODELS / "mlp.onnx"),
        spec_from("cross_entropy:y,labels", "adamw:lr=0.01"),
        batch=8,
    )
    _weights_of(step.graph, tmp_path / "w.npz")
    (tmp_path / "step.flow").write_text(r.stdout)
    printed = _flowc(
        "compile", str(tmp_path / "step.flow"), "--weights", str(tmp_path / "w.npz"),
        "-o", str(tmp_path / "a"), "--target", "host",
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    direct = _flowc(
        "compile", str(SHARED_MODELS / "mlp.onnx"), "--train", *common,
        "-o", str(tmp_path / "b"), "--target", "host",
    )  # fmt: skip
    assert direct.returncode == 0, direct.stderr
    a = json.loads((tmp_path / "a" / "flowc_model.json").read_text())
    b = json.loads((tmp_path / "b" / "flowc_model.json").read_text())
    for key in ("train_inputs", "train_outputs", "state"):
        assert a[key] == b[key], key
    # The printed step holds no inference graph: its run() has no inputs (and fails).
    assert a["inputs"] == [] and [i["name"] for i in b["inputs"]] == ["x"]
    # The printed step is no model to train again.
    r = _flowc("train", str(tmp_path / "step.flow"), "--weights", str(tmp_path / "w.npz"),
               *common, "--data", "x.npz", "--steps", "1")  # fmt: skip
    assert r.returncode == 2 and "is a training step already" in r.stderr, r.stderr


def test_a_train_block_gives_the_training_options(tmp_path: Path) -> None:
    prog = tmp_path / "mlp.flow"
    prog.write_text(MLP_FLOW + BLOCK)
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "d.npz",
        x=rng.standard_normal((16, 64)).astype(np.float32),
        labels=rng.integers(0, 10, 16),
    )
    # The block's options are the command line's ones (spelled as it spells them)...
    from flowc.options import TrainArgs
    from flowc.trainer import with_train_block

    assert with_train_block(prog, TrainArgs()) == TrainArgs(
        loss="cross_entropy:z,labels",
        label_smoothing=0.1,
        optimizer="sgd:lr=0.005,momentum=0.9",
        lr_schedule="cosine:warmup=1,total=6",
        clip_norm=5.0,
        batch=8,
    )
    # ...and `flowc train` needs nothing else (without the block's batch too: a .flow
    # program's batch is its inputs' static axis 0).
    prog.write_text(MLP_FLOW + BLOCK.replace("    batch = 8\n", ""))
    run = ["--data", str(tmp_path / "d.npz"), "--steps", "4", "--no-shuffle", "--target", "host"]
    r = _flowc("train", str(prog), *run, "--log", str(tmp_path / "a.jsonl"))
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert lines[0]["lr"] == pytest.approx(0.005)  # the block's schedule: warm-up of 1 step
    assert lines[-1]["loss"] < lines[0]["loss"]
    # The command line wins over the block.
    r = _flowc("inspect", str(prog), "--train", "--optimizer", "adam:lr=0.1")
    assert r.returncode == 0 and "adam on cross_entropy" in r.stdout, r.stderr + r.stdout
    # The block prints back as it was read.
    g = parse_program(prog.read_text(), str(prog))
    assert "train {\n    loss = cross_entropy(z, labels, label_smoothing=0.1)" in print_graph(g)
    printed = print_graph(g)
    tiny = "graph t(x: f32[2]) -> (y: f32[2]) {\n    y = relu(x)\n    return y\n}\n"
    assert parse_program(tiny + printed[printed.index("train {") :], "again.flow").train == g.train


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ("train {\n    speed = 3\n}\n", "train: no setting 'speed'"),
        ("train {\n    loss = 3\n}\n", "train: loss takes a call"),
        ("train {\n    optimizer = sgd(0.1)\n}\n", "optimizer's arguments are name=value"),
        ("train {\n    clip_norm = 1.0\n    clip_norm = 2.0\n}\n", "clip_norm is given twice"),
    ],
)
def test_a_bad_train_block_is_a_clear_error(block: str, message: str) -> None:
    with pytest.raises(FlowcError, match=message):
        parse_program(MLP_FLOW + block, "bad.flow")


def test_state_declarations_are_checked() -> None:
    base = "graph g(x: f32[4], s: f32[4]) -> (y: f32[4], s2: f32[4]) {\n"
    tail = "    y = relu(x)\n    s2 = s + x\n    return y, s2\n}\n"
    ok = parse_program(base + "    state s = fill(0.0) -> s2\n" + tail, "ok.flow")
    assert ok.state == {"s": "s2"} and ok.state_pairs()[0][1].name == "s2"
    for decl, message in [
        ("    state q = fill(0.0)\n", "state 'q' is not an input"),
        ("    state s = fill(0.0) -> nope\n", "'nope' is not exactly one of the graph's outputs"),
        ("    state s = fill(0.0)\n    state s = fill(1.0)\n", "declared twice"),
    ]:
        with pytest.raises(FlowcError, match=message):
            parse_program(base + decl + tail, "bad.flow")
