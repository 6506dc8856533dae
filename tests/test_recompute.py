"""Activation recomputation (--recompute none|auto|all, --mem-limit): the same steps bit for
bit whatever is recomputed, dropout masks included (counter-based: a recomputed mask is the
mask), with less kept for the backward; auto fits the limit it is given; the errors."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from flowc.compiler import load_training
from flowc.errors import InputError
from flowc.options import ModelArgs
from flowc.trainer import compile_step, load_data, run_steps, spec_from

D, F, SEQ, BATCH = 32, 64, 8, 4


def _blocks(path: Path, blocks: int = 3) -> Path:
    """A residual MLP tower as an exporter writes one: per block LayerNormalization, MatMul,
    GELU through Erf, a training-mode Dropout, MatMul, the residual Add."""
    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array(np.asarray(0.1, np.float32), "ratio"),
        numpy_helper.from_array(np.asarray(True), "training"),
        numpy_helper.from_array(np.asarray(2**-0.5, np.float32), "rsqrt2"),
        numpy_helper.from_array(np.asarray(1.0, np.float32), "one"),
        numpy_helper.from_array(np.asarray(0.5, np.float32), "half"),
    ]
    nodes, h = [], "x"
    for i in range(blocks):
        inits += [
            numpy_helper.from_array(np.ones(D, np.float32), f"ln{i}.g"),
            numpy_helper.from_array(np.zeros(D, np.float32), f"ln{i}.b"),
            numpy_helper.from_array(
                rng.standard_normal((D, F)).astype(np.float32) * 0.2, f"w1.{i}"
            ),
            numpy_helper.from_array(
                rng.standard_normal((F, D)).astype(np.float32) * 0.2, f"w2.{i}"
            ),
        ]
        p = f"b{i}."
        out = "y" if i == blocks - 1 else f"h{i + 1}"
        nodes += [
            helper.make_node("LayerNormalization", [h, f"ln{i}.g", f"ln{i}.b"], [p + "n"], axis=-1),
            helper.make_node("MatMul", [p + "n", f"w1.{i}"], [p + "a"]),
            helper.make_node("Mul", [p + "a", "rsqrt2"], [p + "s"]),
            helper.make_node("Erf", [p + "s"], [p + "e"]),
            helper.make_node("Add", [p + "e", "one"], [p + "e1"]),
            helper.make_node("Mul", [p + "a", p + "e1"], [p + "ae"]),
            helper.make_node("Mul", [p + "ae", "half"], [p + "g"]),
            helper.make_node("Dropout", [p + "g", "ratio", "training"], [p + "d"]),
            helper.make_node("MatMul", [p + "d", f"w2.{i}"], [p + "o"]),
            helper.make_node("Add", [h, p + "o"], [out]),
        ]
        h = out
    shape = ["batch", SEQ, D]
    graph = helper.make_graph(
        nodes,
        "tower",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


LOSS, OPT = "mse:y,y_true", "adamw:lr=0.01"


def _step(model: Path, mode: str, limit: str | None = None):  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Dropouts' training mode
        spec = spec_from(LOSS, OPT, recompute=mode, mem_limit=limit)
        return load_training(ModelArgs(model), spec, batch=BATCH)


def test_every_mode_trains_the_same_bits_and_keeps_less(tmp_path: Path) -> None:
    model = _blocks(tmp_path / "tower.onnx")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3 * BATCH, SEQ, D)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, y_true=np.tanh(x))
    steps, results, arenas = {}, {}, {}

    def train(mode: str, limit: str | None = None) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the Dropouts' training mode
            spec = spec_from(LOSS, OPT, recompute=mode, mem_limit=limit)
            step, project = compile_step(model, spec, tmp_path / mode, batch=BATCH, target="host")
        steps[mode], arenas[mode] = step, step_arena_of(step)
        project.build("host", quick=True)
        arrays = load_data(tmp_path / "d.npz", step)
        with project.load("host") as m:
            results[mode] = run_steps(m, step, arrays, steps=3, batch=BATCH, shuffle=False)

    train("none")
    train("all")
    full = steps["all"].recompute
    assert full is not None and full.recomputed and full.flops_added > 0
    assert full.saved_after < full.saved_before / 4, full.lines()
    assert full.saved_after == steps["all"].saved_activation_bytes()
    assert full.saved_before == steps["none"].saved_activation_bytes()
    assert arenas["all"] < arenas["none"]
    # auto, given half way between the two: it recomputes part of what all does, and fits.
    graph = steps["none"].graph
    state = sum(v.type.nbytes for v in graph.inputs) + sum(c.type.nbytes for c in graph.constants)
    limit = state + (arenas["none"] + arenas["all"]) // 2
    train("auto", str(limit))
    auto = steps["auto"].recompute
    assert auto is not None and auto.arena_after == arenas["auto"] <= limit - state
    assert 0 < auto.flops_added < full.flops_added, auto.lines()
    for mode in ("all", "auto"):
        assert results[mode].losses == results["none"].losses, mode
        for name, p in results["none"].params.items():
            assert np.array_equal(results[mode].params[name], p), (mode, name)


def step_arena_of(step) -> int:  # type: ignore[no-untyped-def]
    """The compiled arena of a loaded step (already fused: planned as compile_step does)."""
    from flowc.compiler import plan_schedule, schedule_graph

    return plan_schedule(schedule_graph(step.graph, schedule_for="memory")).arena_bytes


def test_auto_needs_a_limit_and_says_what_cannot_fit(tmp_path: Path) -> None:
    model = _blocks(tmp_path / "tower.onnx", blocks=2)
    with pytest.raises(InputError, match="--recompute auto needs --mem-limit"):
        _step(model, "auto")
    with pytest.raises(InputError, match="state, batch and constants alone take"):
        _step(model, "auto", "1000")
    none = _step(model, "none")
    state = sum(v.type.nbytes for v in none.graph.inputs) + sum(
        c.type.nbytes for c in none.graph.constants
    )
    with pytest.raises(InputError, match="recomputation cannot bring it to"):
        _step(model, "auto", str(state + 4096))
    with pytest.raises(InputError, match=r"--recompute auto finds what to recompute"):
        _step(model, "none", str(state + 4096))


def test_the_cli_refuses_auto_without_a_limit_cleanly(tmp_path: Path) -> None:
    model = _blocks(tmp_path / "tower.onnx", blocks=1)
    r = subprocess.run(
        [sys.executable, "-m", "flowc", "compile", str(model), "--train", "--loss", LOSS,
         "--optimizer", OPT, "--batch", "2", "--recompute", "auto", "-o", str(tmp_path / "o")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "--recompute auto needs --mem-limit" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()


def test_a_train_block_may_ask_for_recomputation(tmp_path: Path) -> None:
    from flowc.options import TrainArgs
    from flowc.trainer import spec_of, with_train_block

    repo = Path(__file__).resolve().parent.parent
    program = tmp_path / "mlp.flow"
    program.write_text(
        (repo / "examples" / "mlp.flow").read_text()
        + "\ntrain {\n    loss = cross_entropy(z, labels)\n    optimizer = sgd(lr=0.005)\n"
        + '    recompute = "auto"\n    mem_limit = "64MiB"\n}\n'
    )
    spec = spec_of(with_train_block(program, TrainArgs()), "flowc train")
    assert (spec.recompute, spec.mem_limit) == ("auto", 64 << 20)
    # The command line wins.
    spec = spec_of(with_train_block(program, TrainArgs(recompute="all")), "flowc train")
    assert spec.recompute == "all"


def test_a_long_recomputed_chain_is_copied_without_recursion() -> None:
    """3,000 Tanh in a row, every one recomputed: the copies are made in dependency order
    (each before its readers), with no recursion through the chain."""
    from flowc.autodiff import gradients
    from flowc.ir.builder import GraphBuilder
    from flowc.ir.dtype import DType
    from flowc.ir.graph import Graph
    from flowc.ir.types import TensorType
    from flowc.training.recompute import StepParts, apply

    g = Graph("chain")
    b = GraphBuilder(g, fold=False)
    x = g.add_input("x", TensorType((4,), DType.F32))
    h = x
    for _ in range(3000):
        h = b.emit("Tanh", [h])[0]
    loss = b.emit("ReduceSum", [h], {"keepdims": 0})[0]
    grads = gradients(g, loss, [x])
    g.outputs = [loss, grads[x]]  # type: ignore[list-item]
    forward = [n for n in StepParts.of(g).forward if n.op == "Tanh"]
    copied = apply(g, set(forward[1:]))
    assert len(copied) == 2999
    seen = set(g.inputs)
    for node in g.nodes:
        assert all(i is None or i in seen or i.const is not None for i in node.inputs)
        seen.update(node.outputs)
