"""The compiled training step against JAX and optax (float64, on the CPU): losses step by step
and the parameters after 50 steps, for AdamW and SGD with Nesterov momentum on mlp.onnx; the
run's determinism, and bad input (issue 28)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import optax
import pytest
from conftest import SHARED_MODELS
from jax_reference import cross_entropy, forward

from flowc.errors import InputError
from flowc.harness.compare import max_rel_error
from flowc.trainer import (
    batch_rows,
    compile_step,
    load_checkpoint,
    load_data,
    run_steps,
    save_checkpoint,
    spec_from,
)

MODEL = SHARED_MODELS / "mlp.onnx"
LOGITS = "/m/m.2/Gemm_output_0"
STEPS, BATCH = 50, 8


def _data(path: Path, rows: int = 40) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    # Labels a linear map of x gives, one in four replaced at random: the loss falls but
    # stays far from 0, where float32's rounding of a near-certain log-probability would
    # dominate a relative comparison.
    labels = (x @ rng.standard_normal((64, 10))).argmax(1).astype(np.int64)
    noisy = rng.random(rows) < 0.25
    labels[noisy] = rng.integers(0, 10, int(noisy.sum()))
    np.savez(path, x=x, labels=labels)
    return {"x": x, "labels": labels}


def _built(tmp: Path, optimizer: str, **kw: Any) -> tuple[Any, Any, Any]:
    spec = spec_from(f"cross_entropy:{LOGITS},labels", optimizer, **kw)
    step, project = compile_step(MODEL, spec, tmp / "step", batch=BATCH, target="host")
    project.build("host", quick=True)
    return step, project, spec


def test_the_jax_translation_matches_onnxruntime() -> None:
    import onnxruntime as ort

    model = onnx.load(str(MODEL))
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    sess = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    (want,) = sess.run(None, {"x": x})
    got = forward(model)({}, {"x": jnp.asarray(x, jnp.float64)})
    assert max_rel_error(np.asarray(got["y"]), want) < 1e-5


def _jax_run(
    tx: Any, data: dict[str, np.ndarray], steps: int = STEPS
) -> tuple[list[float], dict[str, np.ndarray]]:
    model = onnx.load(str(MODEL))
    f = forward(model, LOGITS)
    params = {
        t.name: jnp.asarray(onnx.numpy_helper.to_array(t), jnp.float64)
        for t in model.graph.initializer
    }

    def loss_fn(p: Any, x: Any, y: Any) -> Any:
        return cross_entropy(f(p, {"x": x})[LOGITS], y)

    opt_state = tx.init(params)
    losses = []
    grad_fn = jax.value_and_grad(loss_fn)
    rows = data["x"].shape[0]
    for s in range(steps):
        idx = np.arange(s * BATCH, (s + 1) * BATCH) % rows  # --no-shuffle: in file order
        loss, g = grad_fn(
            params, jnp.asarray(data["x"][idx], jnp.float64), jnp.asarray(data["labels"][idx])
        )
        updates, opt_state = tx.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return losses, {k: np.asarray(v) for k, v in params.items()}


@pytest.mark.parametrize(
    ("optimizer", "reference"),
    [
        ("adamw:lr=0.002,beta1=0.9,beta2=0.999,eps=1e-8,weight_decay=0.01",
         lambda: optax.adamw(0.002, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)),
        ("sgd:lr=0.01,momentum=0.9,nesterov=true",
         lambda: optax.sgd(0.01, momentum=0.9, nesterov=True)),
    ],
    ids=["adamw", "sgd-nesterov"],
)  # fmt: skip
def test_fifty_steps_match_jax_and_optax(tmp_path: Path, optimizer: str, reference: Any) -> None:
    data = _data(tmp_path / "data.npz")
    step, project, _ = _built(tmp_path, optimizer)
    arrays = load_data(tmp_path / "data.npz", step)
    with project.load("host") as model:
        got = run_steps(model, step, arrays, steps=STEPS, batch=BATCH, shuffle=False, classes=10)
        # The model keeps the state: it continues from the 50th step unless told.
        assert int(model.read_state(["train/step"])["train/step"]) == STEPS
        # The same run again from the first state: bit for bit.
        again = run_steps(
            model, step, arrays, steps=STEPS, batch=BATCH, shuffle=False, state=step.initial
        )
        # Half the run, a checkpoint, and the rest resumed from it: the same bits again.
        half = STEPS // 2
        first = run_steps(
            model, step, arrays, steps=half, batch=BATCH, shuffle=False, state=step.initial
        )
        save_checkpoint(tmp_path / "ckpt", step, first.state, half, {"batch": BATCH})
        state, info = load_checkpoint(tmp_path / "ckpt", step)
        assert info["step"] == half
        rest = run_steps(
            model,
            step,
            arrays,
            steps=STEPS - half,
            batch=BATCH,
            shuffle=False,
            state=state,
            first=half,
        )
    assert first.losses + rest.losses == got.losses
    for name in got.params:
        assert np.array_equal(rest.params[name], got.params[name])
    want_losses, want_params = _jax_run(reference(), data)
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(got.losses, want_losses, strict=True))
    assert worst_loss < 1e-5, worst_loss
    for name, ref in want_params.items():
        err = max_rel_error(got.params[name], ref)
        assert err < 1e-4, (name, err)
    assert got.losses == again.losses
    for name in got.params:
        assert np.array_equal(got.params[name], again.params[name])
    assert got.losses[-1] < got.losses[0] / 2  # it learns


def test_shuffled_batches_are_a_permutation_per_epoch() -> None:
    seen = np.concatenate([batch_rows(s, 4, 10, True, 7) for s in range(5)])  # 2 epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert not np.array_equal(seen[:10], seen[10:20])
    assert np.array_equal(batch_rows(3, 4, 10, False, 0), [2, 3, 4, 5])
    assert np.array_equal(batch_rows(2, 4, 10, True, 7), seen[8:12])  # a resume's position


def test_bad_training_input_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no value named 'nope'"):
        compile_step(
            MODEL, spec_from("cross_entropy:nope,labels", "sgd:lr=0.1"), tmp_path / "a", batch=BATCH
        )
    with pytest.raises(InputError, match="--freeze 'zzz' matches no parameter"):
        compile_step(
            MODEL,
            spec_from(f"cross_entropy:{LOGITS},labels", "sgd:lr=0.1", freeze="zzz"),
            tmp_path / "b",
            batch=BATCH,
        )
    with pytest.raises(InputError, match="no hyperparameter 'betas'"):
        spec_from("mse:y,t", "adam:lr=0.1,betas=0.9")
    with pytest.raises(InputError, match="give the learning rate"):
        spec_from("mse:y,t", "adam:beta1=0.8")
    with pytest.raises(InputError, match="unknown loss 'hinge'"):
        spec_from("hinge:y,t", "adam:lr=1")
    step, _, _ = _built_cheap(tmp_path)
    other = spec_from(f"cross_entropy:{LOGITS},labels", "adam:lr=0.1")
    other_step, _ = compile_step(MODEL, other, tmp_path / "other", batch=BATCH)
    save_checkpoint(tmp_path / "ck", other_step, other_step.initial, 3, {})
    with pytest.raises(InputError, match="a checkpoint of another model or training setup"):
        load_checkpoint(tmp_path / "ck", step)
    np.savez(tmp_path / "short.npz", x=np.zeros((5, 64), np.float32), labels=np.zeros(4, np.int64))
    with pytest.raises(InputError, match="different row counts"):
        load_data(tmp_path / "short.npz", step)
    np.savez(tmp_path / "float_labels.npz", x=np.zeros((4, 64), np.float32), labels=np.zeros(4))
    with pytest.raises(InputError, match="takes integers"):
        load_data(tmp_path / "float_labels.npz", step)


def _built_cheap(tmp: Path) -> tuple[Any, Any, Any]:
    """The step compiled, not built: enough for the data checks."""
    spec = spec_from(f"cross_entropy:{LOGITS},labels", "sgd:lr=0.1")
    step, project = compile_step(MODEL, spec, tmp / "cheap", batch=BATCH)
    return step, project, spec


def test_flowc_train_on_the_command_line(tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    import onnxruntime as ort

    data = _data(tmp_path / "data.npz")
    cmd = [
        sys.executable, "-m", "flowc", "train", str(MODEL),
        "--loss", f"cross_entropy:{LOGITS},labels", "--optimizer", "sgd:lr=0.005,momentum=0.9",
        "--data", str(tmp_path / "data.npz"), "--steps", "12", "--batch", str(BATCH),
        "--export", str(tmp_path / "trained.onnx"), "--log", str(tmp_path / "log.jsonl"),
        "--target", "host", "-o", str(tmp_path / "project"),
        "--checkpoint-dir", str(tmp_path / "ckpt"),
    ]  # fmt: skip
    r = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "FLOWC_GPU_COUNT": "0"}
    )
    assert r.returncode == 0, r.stderr
    assert "trained 12 steps: loss" in r.stdout and "step 12/12" in r.stderr
    lines = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 13))
    assert set(lines[0]) == {"step", "loss", "count", "lr", "examples_per_s"}

    # The export is the input model with new initializer data: same graph, same names.
    before, after = onnx.load(str(MODEL)), onnx.load(str(tmp_path / "trained.onnx"))
    assert [n.op_type for n in before.graph.node] == [n.op_type for n in after.graph.node]
    assert [t.name for t in before.graph.initializer] == [t.name for t in after.graph.initializer]

    def ce(model_path: Path) -> float:
        s = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
        losses = []
        for k in range(0, 40, 8):
            (probs,) = s.run(None, {"x": data["x"][k : k + 8]})
            losses.append(-np.log(probs[np.arange(8), data["labels"][k : k + 8]]).mean())
        return float(np.mean(losses))

    assert ce(tmp_path / "trained.onnx") < ce(MODEL)  # the trained weights fit the data better

    # A resumed run continues the step count (the kept project needs no new build), and
    # refuses another batch size before compiling anything.
    resumed = [*cmd[:-2], "--resume", str(tmp_path / "ckpt"), "--steps", "2"]
    resumed[resumed.index("--export") + 1] = str(tmp_path / "more.onnx")
    r = subprocess.run(resumed, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "resuming after step 12" in r.stderr and "step 14/14" in r.stderr
    r = subprocess.run([*resumed, "--batch", "4"], capture_output=True, text=True)
    assert r.returncode == 2 and "made with --batch 8" in r.stderr

    # Bad input: a clear error, exit 2, nothing written.
    bad = [*cmd[:5], "--loss", "cross_entropy:nope,labels", *cmd[7:]]
    (tmp_path / "trained.onnx").unlink()
    r = subprocess.run(bad, capture_output=True, text=True)
    assert r.returncode == 2 and "no value named 'nope'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "trained.onnx").exists()


GPT2 = SHARED_MODELS / "gpt2_tiny.onnx"


def test_gpt2_tiny_next_token_loss_matches_jax(tmp_path: Path) -> None:
    """A transformer: gpt2_tiny's next-token cross-entropy (the last position ignored, as
    padding is) under AdamW, 50 steps against JAX and optax, with its five dropouts on (the
    export's training_mode; p = 0.1): the JAX reference applies the masks flowc's NumPy
    Philox draws for each step. The JAX forward is translated from the graph flowc
    differentiates and checked against onnxruntime on the original model first (dropout off,
    as in inference)."""
    import onnxruntime as ort
    from jax_reference import ir_forward

    from flowc.compiler import TRAIN_PRE_PASSES
    from flowc.frontend import ImportOptions, load_graph
    from flowc.harness.ort import inference_mode
    from flowc.passes.manager import PassManager

    rng = np.random.default_rng(5)
    rows, seq, vocab = 6, 32, 1000
    ids = rng.integers(0, vocab, (rows, seq)).astype(np.int64)
    labels = np.concatenate([ids[:, 1:], np.full((rows, 1), -100)], axis=1)
    np.savez(tmp_path / "tokens.npz", input_ids=ids, labels=labels)

    graph = PassManager(TRAIN_PRE_PASSES).run(load_graph(GPT2, ImportOptions(trainable=True)))
    f = ir_forward(graph)
    params0 = {k: jnp.asarray(v, jnp.float64) for k, v in graph.params.items()}
    sess = ort.InferenceSession(
        inference_mode(onnx.load(str(GPT2))).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    (want,) = sess.run(None, {"input_ids": ids[:1]})
    assert max_rel_error(np.asarray(f(params0, {"input_ids": ids[:1]})["logits"]), want) < 1e-5

    # eps 1e-6: an update of a weight whose gradient is near float32's rounding noise is
    # noise divided by eps; 1e-8 turns it into a 1e-4 difference from float64 by step 50.
    optimizer = "adamw:lr=0.001,beta1=0.9,beta2=0.999,eps=1e-6,weight_decay=0.01"
    spec = spec_from("cross_entropy:logits,labels", optimizer, ignore_index=-100)
    step, project = compile_step(GPT2, spec, tmp_path / "step", batch=1, target="host")
    project.build("host", quick=True)
    arrays = load_data(tmp_path / "tokens.npz", step)
    with project.load("host") as model:
        got = run_steps(model, step, arrays, steps=STEPS, batch=1, shuffle=False, classes=vocab)

    def loss_fn(p: Any, x: Any, y: Any, s: int) -> Any:
        logits = f(p, {"input_ids": x, "train/step": np.asarray(s, np.int64)})["logits"]
        logp = jax.nn.log_softmax(logits, axis=-1)
        mask = y != -100
        picked = jnp.take_along_axis(logp, jnp.where(mask, y, 0)[..., None], axis=-1)[..., 0]
        return -(picked * mask).sum() / mask.sum()

    tx = optax.adamw(0.001, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01)
    params, state = params0, tx.init(params0)
    grad_fn = jax.value_and_grad(loss_fn)
    losses = []
    for s in range(STEPS):
        k = s % rows
        loss, g = grad_fn(params, jnp.asarray(ids[k : k + 1]), jnp.asarray(labels[k : k + 1]), s)
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    worst = max(abs(a - b) / abs(b) for a, b in zip(got.losses, losses, strict=True))
    assert worst < 1e-5, worst
    assert got.counts == [float(seq - 1)] * STEPS  # the ignored position is not counted
    for name, ref in params.items():
        assert max_rel_error(got.params[name], np.asarray(ref)) < 1e-4, name


def test_a_flow_program_trains_as_jax_does(tmp_path: Path) -> None:
    """examples/mlp.flow (its params made parameters after import) with SGD and momentum,
    compiled with `flowc compile --train`, 50 steps against JAX: the JAX forward comes from
    the program's graph (checked against NumPy's evaluation of the same formulas)."""
    import subprocess
    import sys

    from jax_reference import ir_forward

    from flowc.compiler import TRAIN_PRE_PASSES
    from flowc.frontend import load_graph
    from flowc.passes.manager import PassManager
    from flowc.training.step import make_trainable

    program = Path(__file__).resolve().parent.parent / "examples" / "mlp.flow"
    r = subprocess.run(
        [sys.executable, "-m", "flowc", "compile", str(program), "--train",
         "--loss", "cross_entropy:z,labels", "--optimizer", "sgd:lr=0.005,momentum=0.9",
         "-o", str(tmp_path / "step")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "the training step of mlp.flow (4 trained parameters; batch inputs x, labels" in r.stdout

    data = _data(tmp_path / "data.npz")
    spec = spec_from("cross_entropy:z,labels", "sgd:lr=0.005,momentum=0.9")
    step, project = compile_step(program, spec, tmp_path / "step")
    project.build("host", quick=True)
    arrays = load_data(tmp_path / "data.npz", step)
    with project.load("host") as model:
        got = run_steps(model, step, arrays, steps=STEPS, batch=BATCH, shuffle=False)

    graph = load_graph(program)
    make_trainable(graph)
    graph = PassManager(TRAIN_PRE_PASSES).run(graph)
    f = ir_forward(graph)
    params = {k: jnp.asarray(v, jnp.float64) for k, v in graph.params.items()}
    w1, b1, w2, b2 = (np.asarray(params[k]) for k in ("w1", "b1", "w2", "b2"))
    x0 = data["x"][:BATCH].astype(np.float64)
    z = np.maximum(x0 @ w1 + b1, 0) @ w2 + b2  # the program's formula, in NumPy
    assert max_rel_error(np.asarray(f(params, {"x": x0})["z"]), z) < 1e-12

    tx = optax.sgd(0.005, momentum=0.9)
    state = tx.init(params)
    grad_fn = jax.value_and_grad(lambda p, x, y: cross_entropy(f(p, {"x": x})["z"], y))
    losses = []
    for s in range(STEPS):
        idx = np.arange(s * BATCH, (s + 1) * BATCH) % data["x"].shape[0]
        loss, g = grad_fn(
            params, jnp.asarray(data["x"][idx], jnp.float64), jnp.asarray(data["labels"][idx])
        )
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    errors = [abs(a - b) / abs(b) for a, b in zip(got.losses, losses, strict=True)]
    assert max(errors) < 1e-5, (errors[::10], losses[::10])
    for name, ref in params.items():
        assert max_rel_error(got.params[name], np.asarray(ref)) < 1e-4, name


def test_inspect_train_reports_what_the_step_holds(tmp_path: Path) -> None:
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "flowc", "inspect", str(GPT2), "--train",
         "--loss", "cross_entropy:logits,labels", "--optimizer", "adamw:lr=1e-3", "--memory"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "training step" in text and "adamw on cross_entropy" in text
    assert "trained parameters │ 13 │ 2.06 MiB" in text  # gpt2_tiny's 538,880 float weights
    assert "optimizer state │ 26 │ 4.11 MiB" in text  # two moments each
    # An exporter's deduplication: one LayerNorm gain initializer shared by five norms.
    assert "m.transformer.h.0.ln_1.weight (5 uses)" in text
    assert "memory plan of the step: arena" in text and "lower bound" in text
    r = subprocess.run(
        [sys.executable, "-m", "flowc", "inspect", str(GPT2), "--loss", "x"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 2 and "need --train" in r.stderr
    # --untie: the shared gain becomes five parameters, trained apart.
    r = subprocess.run(
        [sys.executable, "-m", "flowc", "inspect", str(GPT2), "--train",
         "--loss", "cross_entropy:logits,labels", "--optimizer", "adamw:lr=1e-3",
         "--untie", "ln_1.weight"],
        capture_output=True, text=True,
    )  # fmt: skip
    text = " ".join(r.stdout.split())
    assert r.returncode == 0, r.stderr
    assert "trained parameters │ 17 │ 2.06 MiB" in text and "ln_1.weight (5 uses)" not in text
    r = subprocess.run(
        [sys.executable, "-m", "flowc", "inspect", str(GPT2), "--train",
         "--loss", "cross_entropy:logits,labels", "--optimizer", "adamw:lr=1e-3", "--untie", "zzz"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 2 and "--untie 'zzz' matches no initializer used by several" in r.stderr


@pytest.fixture(scope="module")
def sgd_mlp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    tmp = tmp_path_factory.mktemp("sgd")
    spec = spec_from(f"cross_entropy:{LOGITS},labels", "sgd:lr=0.1")
    step, project = compile_step(MODEL, spec, tmp / "step", batch=BATCH, target="host")
    project.build("host", quick=True)
    return step, project


def test_labels_out_of_range_and_a_nonfinite_loss_stop_the_run(sgd_mlp: tuple[Any, Any]) -> None:
    from flowc.errors import FlowcError

    step, project = sgd_mlp
    x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    labels = np.arange(16, dtype=np.int64) % 10
    with project.load("host") as model:
        bad = {"x": x, "labels": np.where(labels == 3, 10, labels)}
        with pytest.raises(InputError, match=r"step 1: label 10 in 'labels' is outside \[0, 10\)"):
            run_steps(model, step, bad, steps=2, batch=BATCH, shuffle=False, classes=10)
        x_nan = x.copy()
        x_nan[9, 5] = np.nan  # in the second batch
        data = {"x": x_nan, "labels": labels}
        with pytest.raises(FlowcError, match="step 2: the loss is nan; stopped"):
            run_steps(
                model, step, data, steps=3, batch=BATCH, shuffle=False, classes=10,
                state=step.initial,
            )  # fmt: skip
        # The step that met the NaN changed nothing the model keeps.
        kept = model.read_state()
        assert int(kept["train/step"]) == 1
        assert all(np.isfinite(a).all() for a in kept.values())
        skipped = run_steps(
            model, step, data, steps=3, batch=BATCH, shuffle=False, classes=10,
            skip_nonfinite=True, state=step.initial,
        )  # fmt: skip
    assert np.isnan(skipped.losses[1]) and np.isfinite(skipped.losses[2])
    assert int(skipped.state["train/step"]) == 2  # the skipped step did not count
    assert all(np.isfinite(p).all() for p in skipped.params.values())


def test_a_parameter_the_loss_does_not_reach_is_named(tmp_path: Path) -> None:
    # The loss on the first layer's output: the second layer's weights get no gradient.
    spec = spec_from("mse:/m/m.0/Gemm_output_0,target", "sgd:lr=0.1")
    with pytest.warns(Warning, match="parameter 'm.2.weight' gets no gradient"):
        step, _ = compile_step(MODEL, spec, tmp_path / "a", batch=BATCH)
    assert sorted(step.no_gradient) == ["m.2.bias", "m.2.weight"]
    assert sorted(step.params) == ["m.0.bias", "m.0.weight"]


def test_the_training_options_parse_anything_to_a_spec_or_a_clear_error() -> None:
    """Adversarial strings for --loss, --optimizer and --lr-schedule: a spec or an InputError,
    never another exception."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from flowc.training.spec import parse_loss, parse_optimizer, parse_schedule

    pieces = st.sampled_from(
        ["sgd", "adam", "adamw", "cross_entropy", "mse", "output", "cosine", "linear", "constant",
         ":", ",", "=", "lr", "momentum", "nesterov", "true", "nan", "inf", "-1", "1e400", "0.5",
         "warmup", "total", "min_lr", "beta2", "1", "\x00", "é", " ", "=="]
    )  # fmt: skip
    texts = st.one_of(st.text(max_size=40), st.lists(pieces, max_size=12).map("".join))

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(texts)
    def check(text: str) -> None:
        for parse in (parse_loss, parse_optimizer, parse_schedule):
            with contextlib.suppress(InputError):
                parse(text)

    check()
    spec = parse_optimizer("adamw:lr=1e-3")
    assert (spec.weight_decay, spec.beta1, spec.beta2, spec.eps) == (0.01, 0.9, 0.999, 1e-8)
    assert parse_optimizer("sgd:lr=0.1").momentum == 0.0
    for bad in ("nan", "inf", "1e400", "-0.1"):
        with pytest.raises(InputError, match="expected a finite number from 0"):
            parse_optimizer(f"sgd:lr={bad}")
    with pytest.raises(InputError, match="nesterov needs a momentum"):
        parse_optimizer("sgd:lr=0.1,nesterov=true")
    assert parse_schedule("cosine:warmup=10,total=100").total == 100
    with pytest.raises(InputError, match="needs total above warmup"):
        parse_schedule("cosine:warmup=10")


def _with_dropouts(model: onnx.ModelProto, ratio: float) -> onnx.ModelProto:
    """``model`` with a training-mode Dropout after every LayerNormalization and Softmax (the
    embeddings', the attention probabilities' and the sublayers' places in BERT), as an
    exporter writes them for a model not put in eval mode."""
    from onnx import helper, numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    g.initializer.extend(
        [
            numpy_helper.from_array(np.asarray(ratio, np.float32), "dropout.ratio"),
            numpy_helper.from_array(np.asarray(True), "dropout.training"),
        ]
    )
    nodes = []
    for node in g.node:
        nodes.append(node)
        if node.op_type in ("LayerNormalization", "Softmax"):
            y = node.output[0]
            node.output[0] = y + ".pre_dropout"
            nodes.append(
                helper.make_node(
                    "Dropout",
                    [node.output[0], "dropout.ratio", "dropout.training"],
                    [y],
                    name=f"{node.name or y}.dropout",
                )
            )
    del g.node[:]
    g.node.extend(nodes)
    return out


def test_bert_tiny_with_a_padding_mask_trains_as_jax_does(tmp_path: Path) -> None:
    """bert_tiny (its attention mask through Where/Expand/Cast, GELU through Erf) with dropout
    on (p = 0.1 after every norm and softmax, inserted as an exporter writes it): an MSE on
    the pooled output, 50 AdamW steps against JAX and optax with flowc's dropout masks
    injected; the JAX forward checked against onnxruntime on the original model first
    (dropout off, as in inference)."""
    import onnxruntime as ort
    from jax_reference import ir_forward

    from flowc.compiler import TRAIN_PRE_PASSES
    from flowc.frontend import ImportOptions, load_graph
    from flowc.passes.manager import PassManager

    bert = tmp_path / "bert_tiny_dropout.onnx"
    onnx.save(_with_dropouts(onnx.load(str(SHARED_MODELS / "bert_tiny.onnx")), 0.1), str(bert))
    rng = np.random.default_rng(8)
    ids = rng.integers(0, 1000, (4, 16)).astype(np.int64)
    mask = np.ones((4, 16), np.int64)
    mask[:, 11:] = 0  # padding
    target = rng.standard_normal((4, 128)).astype(np.float32)
    np.savez(tmp_path / "d.npz", input_ids=ids, attention_mask=mask, target=target)

    opts = ImportOptions(trainable=True, batch=2, dims={"seq": 16})
    graph = PassManager(TRAIN_PRE_PASSES).run(load_graph(bert, opts))
    f = ir_forward(graph)
    params = {k: jnp.asarray(v, jnp.float64) for k, v in graph.params.items()}
    assert sum(n.op == "TrainDropout" for n in graph.nodes) == 7
    sess = ort.InferenceSession(
        str(SHARED_MODELS / "bert_tiny.onnx"), providers=["CPUExecutionProvider"]
    )
    feeds = {"input_ids": ids[:2], "attention_mask": mask[:2]}
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))
    got_fwd = f(params, feeds)
    assert max_rel_error(np.asarray(got_fwd["pooler_output"]), want["pooler_output"]) < 1e-5

    steps = 50
    spec = spec_from("mse:pooler_output,target", "adamw:lr=0.001,eps=1e-6")
    step, project = compile_step(bert, spec, tmp_path / "step", batch=2, dim=["seq=16"])
    project.build("host", quick=True)
    arrays = load_data(tmp_path / "d.npz", step)
    with project.load("host") as model:
        got = run_steps(model, step, arrays, steps=steps, batch=2, shuffle=False)

    def loss_fn(p: Any, b: dict[str, Any], s: int) -> Any:
        feeds = {k: b[k] for k in ("input_ids", "attention_mask")}
        pooled = f(p, {**feeds, "train/step": np.asarray(s, np.int64)})
        return ((pooled["pooler_output"] - b["target"]) ** 2).mean()

    tx = optax.adamw(0.001, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01)
    state, losses = tx.init(params), []
    grad_fn = jax.value_and_grad(loss_fn)
    for s in range(steps):
        idx = np.arange(s * 2, s * 2 + 2) % 4
        loss, g = grad_fn(params, {k: jnp.asarray(v[idx]) for k, v in arrays.items()}, s)
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    assert max(abs(a - b) / abs(b) for a, b in zip(got.losses, losses, strict=True)) < 1e-5
    for name, ref in params.items():
        assert max_rel_error(got.params[name], np.asarray(ref)) < 1e-4, name


def test_warmup_cosine_schedule_and_clipping_match_optax(tmp_path: Path) -> None:
    """A linear warm-up then a cosine decay (the rate of step t, from 1) and clipping by the
    global norm, against optax's join_schedules and clip_by_global_norm, 30 AdamW steps."""
    data = _data(tmp_path / "data.npz")
    steps, warmup, lr, floor, clip = 30, 5, 0.003, 0.1, 0.5
    step, project, _ = _built(
        tmp_path,
        f"adamw:lr={lr},weight_decay=0.01",
        lr_schedule=f"cosine:warmup={warmup},total={steps},min_lr={floor}",
        clip_norm=clip,
    )
    arrays = load_data(tmp_path / "data.npz", step)
    with project.load("host") as model:
        got = run_steps(model, step, arrays, steps=steps, batch=BATCH, shuffle=False)
    schedule = optax.join_schedules(
        [
            optax.linear_schedule(0.0, lr, warmup),
            optax.cosine_decay_schedule(lr, steps - warmup, alpha=floor),
        ],
        [warmup],
    )
    want_lrs = [float(schedule(t)) for t in range(1, steps + 1)]
    assert max(abs(a - b) / b for a, b in zip(got.lrs, want_lrs, strict=True)) < 1e-6
    tx = optax.chain(
        optax.clip_by_global_norm(clip),
        optax.adamw(
            lambda count: schedule(count + 1), b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01
        ),
    )
    want_losses, want_params = _jax_run(tx, data, steps)
    assert max(abs(a - b) / abs(b) for a, b in zip(got.losses, want_losses, strict=True)) < 1e-5
    for name, ref in want_params.items():
        assert max_rel_error(got.params[name], ref) < 1e-4, name
