"""The training step's state kept by the model and updated in place (Graph.state): the
writes ordered after their readers, in the schedule and in the memory checker; the C API's
train_step, state access, learning rate, save and load, against the same step run with its
state fed from the host (flowc's interpreter in float64 is not needed: the host-fed run is
the same program)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from conftest import SHARED_MODELS

from flowc.compiler import generate_program
from flowc.errors import FlowcError
from flowc.harness.compare import max_rel_error
from flowc.ir.dtype import DType
from flowc.ir.graph import Graph
from flowc.ir.types import TensorType
from flowc.memory.check import PlanError, check_memory_plan
from flowc.passes.order_state import order_state_writes
from flowc.schedule.program import StreamOp
from flowc.trainer import compile_step, spec_from

MODEL = SHARED_MODELS / "mlp.onnx"
BATCH = 8


def _data(rows: int = 32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    return {"x": x, "labels": (np.arange(rows) * 7 % 10).astype(np.int64)}


@pytest.fixture(scope="module")
def adam_step(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    tmp = tmp_path_factory.mktemp("state")
    spec = spec_from("cross_entropy:y,labels", "adamw:lr=0.003,weight_decay=0.01")
    step, project = compile_step(MODEL, spec, tmp / "step", batch=BATCH, target="host")
    project.build("host", quick=True)
    return step, project


@pytest.mark.parametrize("streams", [1, 3])
def test_state_writes_follow_their_readers_in_the_emitted_program(streams: int) -> None:
    from flowc.compiler import load_training
    from flowc.options import ModelArgs

    spec = spec_from("cross_entropy:y,labels", "adamw:lr=0.003,weight_decay=0.01")
    step = load_training(ModelArgs(MODEL), spec, batch=BATCH)
    graph = step.graph
    assert step.inference is not None
    compiled = generate_program(graph, streams=streams, inference=step.inference)
    check_memory_plan(graph, compiled.memory, compiled.program)
    # run()'s schedule, the inference, only reads the state: checked on its own.
    assert compiled.inference is not None
    check_memory_plan(step.inference, compiled.inference.memory, compiled.inference.program)
    # The state is the model's: neither train_step()'s inputs nor its outputs; run()'s are
    # the model's own.
    import json

    info = json.loads(compiled.files["flowc_model.json"])
    assert [i["name"] for i in info["train_inputs"]] == ["x", "labels"]
    assert [o["name"] for o in info["train_outputs"]] == [
        "train/loss",
        "train/count",
        "train/lr_used",
    ]
    assert [i["name"] for i in info["inputs"]] == ["x"]
    assert [o["name"] for o in info["outputs"]] == ["y"]
    assert {s["name"] for s in info["state"]} == set(graph.state)
    # Each weight's update runs after the weight's every other reader.
    position = {id(op.node): k for k, op in enumerate(compiled.program) if op.kind == "run"}
    readers = {
        id(n)
        for n in graph.nodes
        if any(i is not None and i.name == "m.2.weight" for i in n.inputs)
    }
    writer = dict((x.name, xn) for x, xn in graph.state_pairs())["m.2.weight"].producer
    assert readers - {id(writer)}
    assert all(position[r] < position[id(writer)] for r in readers - {id(writer)})


def test_the_checker_catches_a_state_write_before_a_reader() -> None:
    g = Graph()
    t = TensorType((64,), DType.F32)
    x = g.add_input("x", t)
    reader = g.add_node("Relu", [x], [t], name="reader")
    one = g.add_constant("one", np.ones(64, np.float32))
    writer = g.add_node("Add", [x, one], [t], name="update")
    g.outputs = [reader.outputs[0], writer.outputs[0]]
    g.params["x"] = np.zeros(64, np.float32)
    g.state = {"x": writer.outputs[0].name}
    order_state_writes(g)
    compiled = generate_program(g)
    check_memory_plan(g, compiled.memory, compiled.program)
    swapped = [StreamOp("run", 0, writer), StreamOp("run", 0, reader)]
    with pytest.raises(PlanError, match=r"Add 'update' may overwrite 'x'.*before Relu 'reader'"):
        check_memory_plan(g, compiled.memory, swapped)


def test_a_state_write_that_reads_its_input_whole_gets_a_copy() -> None:
    # x -> x @ x: the MatMul reads all of x while writing, so it may not write over x; the
    # pass gives it a result of its own and copies that over x after x's other reader.
    g = Graph()
    t = TensorType((4, 4), DType.F32)
    x = g.add_input("x", t)
    (y,) = g.add_node("Relu", [x], [t], name="reader").outputs
    (xn,) = g.add_node("MatMul", [x, x], [t], name="square").outputs
    g.outputs = [y, xn]
    g.params["x"] = np.eye(4, dtype=np.float32)
    g.state = {"x": xn.name}
    order_state_writes(g)
    copy = xn.producer
    assert copy is not None and copy.op == "Identity"
    assert copy.inputs[0] is not None and copy.inputs[0].producer is not None
    assert copy.inputs[0].producer.op == "MatMul"
    names = [n.name for n in g.nodes]
    assert names.index(copy.name) > names.index("reader")
    compiled = generate_program(g)
    check_memory_plan(g, compiled.memory, compiled.program)


def test_train_step_keeps_the_state_on_the_device(adam_step: tuple[Any, Any]) -> None:
    from flowc.trainer import batch_rows

    step, project = adam_step
    data = _data()
    with project.load("host") as model:
        assert model.lr == pytest.approx(0.003)
        first = model.read_state()
        assert int(first["train/step"]) == 0
        np.testing.assert_array_equal(first["m.0.weight"], step.initial["m.0.weight"])
        assert not first["m.0.weight.exp_avg"].any()
        losses = []
        for s in range(4):
            idx = batch_rows(s, BATCH, 32, False, 0)
            loss, count, lr = model.train_step({k: v[idx] for k, v in data.items()})
            losses.append(loss)
            assert count == BATCH and lr == pytest.approx(0.003)
        after = model.read_state()
        assert int(after["train/step"]) == 4
        assert not np.array_equal(after["m.0.weight"], first["m.0.weight"])
        # run() infers with the parameters the latest step left, read where the step keeps
        # them: onnxruntime with those parameters gives the same outputs.
        x = data["x"][:BATCH]
        np.testing.assert_allclose(
            model.run({"x": x})["y"], _onnxruntime_with(after, x), rtol=1e-5, atol=1e-5
        )
        # From the first state again, the same losses bit for bit.
        model.write_state(first)
        np.testing.assert_allclose(
            model.run({"x": x})["y"], _onnxruntime_with(first, x), rtol=1e-5, atol=1e-5
        )
        again = []
        for s in range(4):
            idx = batch_rows(s, BATCH, 32, False, 0)
            again.append(model.train_step({k: v[idx] for k, v in data.items()})[0])
        assert again == losses
        for name, a in model.read_state().items():
            np.testing.assert_array_equal(a, after[name], err_msg=name)
        # The base rate is the model's: a step after set_lr uses the new one.
        model.lr = 0.0
        frozen = model.read_state(["m.0.weight"])["m.0.weight"]
        _, _, used = model.train_step({k: v[:BATCH] for k, v in data.items()})
        assert used == 0.0
        np.testing.assert_array_equal(model.read_state(["m.0.weight"])["m.0.weight"], frozen)
        with pytest.raises(FlowcError, match="not a learning rate"):
            model.lr = float("nan")


def _onnxruntime_with(params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """onnxruntime's output of MODEL with its initializers replaced by ``params``."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(MODEL))
    for init in model.graph.initializer:
        if init.name in params:
            init.CopyFrom(numpy_helper.from_array(np.asarray(params[init.name]), init.name))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"x": x})
    return np.asarray(y)


def test_save_and_load_a_checkpoint(adam_step: tuple[Any, Any], tmp_path: Path) -> None:
    _, project = adam_step
    data = _data()
    ckpt = tmp_path / "state.ckpt"
    with project.load("host") as model:
        for s in range(3):
            model.train_step({k: v[s * BATCH : (s + 1) * BATCH] for k, v in data.items()})
        model.save_checkpoint(ckpt)
        assert not list(tmp_path.glob("*.tmp*"))  # written whole, then renamed
        saved = model.read_state()
        tail = [model.train_step({k: v[BATCH : 2 * BATCH] for k, v in data.items()})[0]]
        model.load_checkpoint(ckpt)
        for name, a in model.read_state().items():
            np.testing.assert_array_equal(a, saved[name], err_msg=name)
        assert [model.train_step({k: v[BATCH : 2 * BATCH] for k, v in data.items()})[0]] == tail
        # A damaged checkpoint changes nothing and says what is wrong.
        before = model.read_state()
        raw = bytearray(ckpt.read_bytes())
        raw[-5] ^= 0xFF
        (tmp_path / "bad.ckpt").write_bytes(bytes(raw))
        with pytest.raises(FlowcError, match=r"checkpoint .*bad\.ckpt is corrupt"):
            model.load_checkpoint(tmp_path / "bad.ckpt")
        (tmp_path / "short.ckpt").write_bytes(bytes(raw[:100]))
        with pytest.raises(FlowcError, match="truncated"):
            model.load_checkpoint(tmp_path / "short.ckpt")
        with pytest.raises(FlowcError, match="not a flowc checkpoint"):
            model.load_checkpoint(project.path / "model.cu")
        for name, a in model.read_state().items():
            np.testing.assert_array_equal(a, before[name], err_msg=name)


def test_a_checkpoint_of_another_setup_is_refused(
    adam_step: tuple[Any, Any], tmp_path: Path
) -> None:
    """Another program's checkpoint (SGD's state, whose layout this step's is not) and a
    weights file (the same format, another layout) are refused with the state unchanged."""
    import zlib

    _, project = adam_step
    spec = spec_from("cross_entropy:y,labels", "sgd:lr=0.1,momentum=0.9")
    _, other = compile_step(MODEL, spec, tmp_path / "sgd", batch=BATCH, target="host")
    # SGD's checkpoint as its save() writes it: the same header, its own layout and size.
    state = other.info["state"]
    size = state[-1]["offset"] + -(-np.prod(state[-1]["shape"] or [1]) * 4 // 256) * 256
    data = np.zeros(int(size), np.uint8).tobytes()
    code = (other.path / "model.cu").read_text()
    layout = int(code.split("kCheckpointLayout = ")[1].split("ULL")[0])
    head = (
        b"FLOWCWT1" + np.array([1, len(data), zlib.crc32(data), layout, 0, 0, 0], "<u8").tobytes()
    )
    (tmp_path / "sgd.ckpt").write_bytes(head + data)
    with project.load("host") as model:
        before = model.read_state()
        for path in (tmp_path / "sgd.ckpt", project.path / "weights.bin"):
            with pytest.raises(FlowcError, match="another model"):
                model.load_checkpoint(path)
        for name, a in model.read_state().items():
            np.testing.assert_array_equal(a, before[name], err_msg=name)


def test_training_steps_build_for_cuda_without_a_warning(tmp_path: Path) -> None:
    """gpt2_tiny's step (embeddings' scatter-add, attention's and LayerNorm's backward, AdamW
    with clipping and a warm-up schedule: every training kernel flowc has), in mixed precision
    fp16 (half GEMMs, the casts fused, dynamic loss scaling), built with nvcc against
    cuBLASLt: compiled and linked warning-free (it runs where a GPU is)."""
    from conftest import require_cuda_build_toolchain

    from flowc.harness.build import build

    require_cuda_build_toolchain()
    spec = spec_from(
        "cross_entropy:logits,labels",
        "adamw:lr=0.001,weight_decay=0.01",
        lr_schedule="cosine:warmup=2,total=10",
        clip_norm=1.0,
        ignore_index=-100,
    )
    _, project = compile_step(
        SHARED_MODELS / "gpt2_tiny.onnx",
        spec,
        tmp_path / "step",
        batch=1,
        target="cuda",
        precision="fp16",
    )
    bdir = build(project.path, "cuda", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
    # The training API is exported from the library.
    import subprocess

    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", str(bdir / f"lib{project.prefix}model.so")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for fn in (
        "train_step",
        "train_result",
        "train_scaling",
        "save",
        "load",
        "get_lr",
        "set_lr",
        "state_read",
    ):
        assert f" {project.prefix}{fn}\n" in symbols, fn


def test_the_driver_trains_as_the_library_does(adam_step: tuple[Any, Any], tmp_path: Path) -> None:
    """`model_main train`: rows in order from .npy files, the same losses and final state as
    train_step() from Python, a checkpoint that resumes where it stopped."""
    import json
    import subprocess

    from flowc.harness.build import build_dir

    _, project = adam_step
    data = _data()
    args = []
    for name, a in data.items():
        np.save(tmp_path / f"{name}.npy", a)
        args += ["--data", f"{name}={tmp_path / f'{name}.npy'}"]
    exe = build_dir(project.path, "host") / "model_main"
    weights = str(project.path / "weights.bin")
    ckpt, log = tmp_path / "run.ckpt", tmp_path / "log.jsonl"
    cmd = [str(exe), "train", "--weights", weights, *args, "--batch", str(BATCH)]
    r = subprocess.run(
        [*cmd, "--steps", "6", "--save", str(ckpt), "--log", str(log)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "step 6/6: loss" in r.stderr and "examples/s" in r.stderr
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
    r = subprocess.run(
        [*cmd, "--steps", "2", "--resume", str(ckpt), "--log", str(log)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    lines += [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5, 6, 7, 8]
    with project.load("host") as model:
        want = []
        for s in range(8):
            rows = np.arange(s * BATCH, (s + 1) * BATCH) % 32
            want.append(model.train_step({k: v[rows] for k, v in data.items()})[0])
            if s == 5:
                six = model.read_state()
        # Printed with 9 digits: float32's values exactly.
        assert [np.float32(x["loss"]) for x in lines] == [np.float32(w) for w in want]
        model.load_checkpoint(ckpt)
        for name, a in model.read_state().items():
            np.testing.assert_array_equal(a, six[name], err_msg=name)
        predicted = model.run({"x": data["x"][:BATCH]})["y"]
    # The driver's inference with the checkpoint's parameters: run() after load().
    np.save(tmp_path / "x8.npy", data["x"][:BATCH])
    r = subprocess.run(
        [str(exe), "--weights", weights, "--checkpoint", str(ckpt),
         "--input", f"x={tmp_path / 'x8.npy'}", "--out-dir", str(tmp_path / "pred")],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "pred" / "y.npy"), predicted)
    np.testing.assert_allclose(predicted, _onnxruntime_with(six, data["x"][:BATCH]), atol=1e-5)
    r = subprocess.run(
        [str(exe), "--weights", weights, "--checkpoint", str(tmp_path / "x8.npy"),
         "--input", f"x={tmp_path / 'x8.npy'}", "--out-dir", str(tmp_path / "pred2")],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert r.returncode == 2 and "--checkpoint" in r.stderr, r.stderr
    # Bad data: a clear error, exit 2.
    np.save(tmp_path / "short.npy", data["labels"][:5])
    short = ["--data", f"x={tmp_path / 'x.npy'}", "--data", f"labels={tmp_path / 'short.npy'}"]
    r = subprocess.run(
        [str(exe), "train", "--weights", weights, *short, "--batch", "8", "--steps", "1"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "one row count for all" in r.stderr, r.stderr
    r = subprocess.run([*cmd, *short, "--steps", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and "is given twice" in r.stderr, r.stderr


def test_accumulated_micro_batches_equal_one_large_batch(tmp_path: Path) -> None:
    """--accumulate 4 of 4 rows against one step of 16 rows: the same update (the loss
    normalized by all the step's counted labels, not a mean of the micro-batches' means: the
    ignored labels are spread unevenly), its first loss that of NumPy over onnxruntime's
    logits; and a smaller arena for a large batch."""

    from flowc.trainer import load_data, run_steps

    rows = 32
    data = _data(rows)
    data["labels"][[0, 1, 2, 5, 17]] = -100  # 3 of micro-batch 0's 4 labels, none of some
    np.savez(tmp_path / "d.npz", **data)
    results = {}
    for k, b in [(1, 16), (4, 4)]:
        spec = spec_from(
            "cross_entropy:y,labels", "sgd:lr=0.05,momentum=0.9", ignore_index=-100, accumulate=k
        )
        step, project = compile_step(MODEL, spec, tmp_path / f"k{k}", batch=b, target="host")
        assert step.micro_batches == k
        project.build("host", quick=True)
        arrays = load_data(tmp_path / "d.npz", step)
        with project.load("host") as model:
            assert [s.shape for s in model.train_inputs] == [(16, 64), (16,)]
            assert [s.shape for s in model.inputs] == [(b, 64)]  # run(): one micro-batch
            results[k] = run_steps(model, step, arrays, steps=6, batch=b, shuffle=False)
    one, acc = results[1], results[4]
    assert one.counts[0] == acc.counts[0] == 16 - 4  # the first 16 rows hold 4 ignored labels
    for a, c in zip(acc.losses, one.losses, strict=True):
        assert abs(a - c) <= 1e-6 * abs(c), (a, c)
    # SGD: the update is linear in the gradient, so the sums' rounding stays that small
    # (Adam's division by sqrt(v) would turn a near-zero gradient's last bit into lr).
    for name, p in one.params.items():
        assert max_rel_error(acc.params[name], p) < 1e-5, name
    sess = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    logits = np.concatenate([sess.run(None, {"x": data["x"][r : r + 8]})[0] for r in (0, 8)])
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    logp -= logits.max(-1, keepdims=True)
    labels = data["labels"][:16]
    kept = labels != -100
    want = -logp[kept, labels[kept]].sum() / kept.sum()
    assert abs(acc.losses[0] - want) <= 1e-5 * abs(want)
    # Memory: 256 examples a step as 4 micro-batches of 64 need a smaller arena (the
    # activations of one micro-batch at a time) than one batch of 256.
    arenas = {}
    for k, b in [(1, 256), (4, 64)]:
        spec = spec_from("cross_entropy:y,labels", "sgd:lr=0.05", accumulate=k)
        _, project = compile_step(MODEL, spec, tmp_path / f"big{k}", batch=b, target="host")
        arenas[k] = project.info["arena_bytes"]
    assert arenas[4] < 0.7 * arenas[1], arenas


def test_a_tf32_step_plans_every_gemm_on_tf32(tmp_path: Path) -> None:
    """--precision tf32: every GEMM of the step (forward and backward) is planned with TF32
    inputs; the parameters and optimizer state stay float32 (the state table is fp32's).
    The host's GEMMs compute exact float32 either way (TF32's rounding shows on a GPU: make
    gpu-check), so this checks the plans, not a run."""
    spec = spec_from("cross_entropy:y,labels", "sgd:lr=0.05,momentum=0.9")
    text, info = {}, {}
    for precision in ("fp32", "tf32"):
        _, project = compile_step(
            MODEL, spec, tmp_path / precision, batch=BATCH, target="host", precision=precision
        )
        assert project.info["precision"] == precision
        text[precision] = (tmp_path / precision / "model.cu").read_text()
        info[precision] = project.info
    # The step's 2 forward and 3 backward, and run()'s inference's 2.
    assert text["fp32"].count("flowc::plan_gemm(") == 7
    assert text["tf32"].count("flowc::plan_gemm(") == text["tf32"].count("d.tf32 = true;") == 7
    assert "d.tf32 = true;" not in text["fp32"]
    assert info["tf32"]["state"] == info["fp32"]["state"]
    # Mixed precision keeps the same state too: float32 master weights and momentum.
    _, bf16 = compile_step(MODEL, spec, tmp_path / "bf16", batch=BATCH, precision="bf16")
    assert bf16.info["state"] == info["fp32"]["state"]


def test_each_step_is_one_graph_launch(adam_step: tuple[Any, Any], tmp_path: Path) -> None:
    """The step is one CUDA Graph: captured at the first step and replayed whole after it
    (the step counter, the learning rate and the dropout keys are device state, so nothing
    is re-captured from step to step); the host emulator's counters (FLOWC_SIM_STATS) show
    one graph launch per step and no kernel launched on a stream by a step."""
    import re
    import subprocess

    from flowc.harness.build import build_dir

    _, project = adam_step
    args = []
    for name, a in _data().items():
        np.save(tmp_path / f"{name}.npy", a)
        args += ["--data", f"{name}={tmp_path / f'{name}.npy'}"]
    exe = build_dir(project.path, "host") / "model_main"
    cmd = [str(exe), "train", "--weights", str(project.path / "weights.bin"), *args]
    counts = []
    for steps in (1, 5):
        r = subprocess.run(
            [*cmd, "--batch", str(BATCH), "--steps", str(steps)],
            capture_output=True,
            text=True,
            env={**os.environ, "FLOWC_SIM_STATS": "1"},
        )
        assert r.returncode == 0, r.stderr
        m = re.search(r"(\d+) stream kernels, (\d+) graph launches, (\d+) graph kernels", r.stderr)
        assert m is not None, r.stderr
        counts.append(tuple(int(x) for x in m.groups()))
    (s1, g1, k1), (s5, g5, k5) = counts
    assert (g1, g5) == (1, 5), counts
    assert s5 == s1, counts  # create()'s fills and warm-up only
    assert k1 > 0 and k5 == 5 * k1, counts
