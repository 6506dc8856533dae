"""Pipeline training's stage programs (flowc.schedule.train_pipeline), without building
them: where the nodes and the state go, the exchanges' order, the memory the schedules
need, and the errors. The trained weights against one device are checked under mpirun in
test_distributed_training.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_MODELS

from flowc.compiler import PipelineSpec, compile_train_pipeline, load_training
from flowc.ir.dtype import DType
from flowc.ir.graph import Value
from flowc.ir.types import Mesh, TensorType
from flowc.options import ModelArgs
from flowc.schedule.train_pipeline import _Transfer, check_exchanges
from flowc.trainer import compile_step, pipeline_step_spec, spec_from

MLP = SHARED_MODELS / "mlp.onnx"
LOSS = "cross_entropy:/m/m.2/Gemm_output_0,labels"
CUT = "/m/m.0/Gemm_output_0"


def _compiled(tmp: Path, microbatches: int, schedule: str, mesh: tuple[int, ...] = (2,)):
    k = int(np.prod(mesh[1:])) if len(mesh) > 1 else 1
    spec, micro = pipeline_step_spec(spec_from(LOSS, "adamw:lr=0.01"), 16, microbatches, k)
    step = load_training(ModelArgs(MLP), spec, batch=micro)
    pipe = PipelineSpec(2, Mesh("m", mesh), microbatches=microbatches, schedule=schedule)
    return step, compile_train_pipeline(step, spec.loss.prediction, tmp / "proj", pipe)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_each_stage_holds_its_layers_and_the_gradients_flow_back(
    tmp_path: Path, schedule: str
) -> None:
    """Stage 0 holds the first layer's weight, bias and their moments, stage 1 the second's;
    both keep a step counter. Activations go forward and their gradients back, each in an
    exchange between two groups of the stage's order, one per micro-batch each way."""
    step, c = _compiled(tmp_path, 4, schedule)
    first, second = (st.graph for st in c.pipeline.stages)
    held = [set(st.state) for st in c.pipeline.stages]
    assert {"m.0.weight", "m.0.weight.exp_avg", "m.0.bias.exp_avg_sq"} <= held[0]
    assert {"m.2.weight", "m.2.bias", "m.2.weight.exp_avg"} <= held[1]
    assert not held[0] & {"m.2.weight", "m.2.bias"} and not held[1] & {"m.0.weight"}
    assert "train/step" in held[0] & held[1]
    assert held[0] | held[1] == set(step.graph.state)
    sent_forward = [v for n in first.nodes if n.op == "Exchange" for v in n.inputs]
    sent_back = [v for n in second.nodes if n.op == "Exchange" for v in n.inputs]
    # Each micro-batch's cut value goes forward and its gradient comes back; the loss goes
    # to stage 0 (whose updates apply only on a finite loss, and which reports it; the
    # label count is a constant every stage has).
    assert sorted(v.name for v in sent_forward) == sorted(
        ["/m/m.0/Gemm_output_0"] + [f"/m/m.0/Gemm_output_0@mb{k}" for k in (1, 2, 3)]
    )
    grads = [v for v in sent_back if v.name != "train/loss"]
    assert len(grads) == 4 and all("/grad/" in v.name for v in grads)
    assert len(sent_back) == 5
    # The results every rank reports, in one order.
    for g in (first, second):
        assert [v.name for v in g.outputs][:3] == ["train/loss", "train/count", "train/lr_used"]


def test_1f1b_keeps_fewer_micro_batches_than_gpipe(tmp_path: Path) -> None:
    """8 micro-batches on 2 stages: 1F1B holds at most 2 on the first stage (the model
    says so, and the memory plan of its stage program is smaller), GPipe all 8."""
    _, one_f = _compiled(tmp_path / "a", 8, "1f1b")
    _, gp = _compiled(tmp_path / "b", 8, "gpipe")
    assert one_f.pipeline.modeled is not None and gp.pipeline.modeled is not None
    assert one_f.pipeline.modeled.max_in_flight == [2, 1]
    assert gp.pipeline.modeled.max_in_flight == [8, 8]
    assert one_f.memory[0].arena_bytes < gp.memory[0].arena_bytes
    # The modeled bubble is the formula's (P-1)/(M+P-1) at best: uneven stages add to it.
    assert one_f.pipeline.modeled.bubble >= (2 - 1) / (8 + 2 - 1) - 1e-9


def test_pipeline_by_data_all_reduces_each_gradient_once_per_step(tmp_path: Path) -> None:
    """2x2: each stage's rank program is the data plan's; its layer's gradients sum over
    the 4 micro-batches on the rank and cross the stage's data axis (mesh axis 1) once."""
    _, c = _compiled(tmp_path, 4, "1f1b", (2, 2))
    first = c.pipeline.stages[0].graph
    reduces = [n for n in first.nodes if n.op == "AllReduce"]
    assert sorted(tuple(n.inputs[0].type.shape) for n in reduces) == [(256,), (256, 64)]
    assert all(n.attrs["mesh_axis"] == 1 and list(n.attrs["mesh"]) == [2, 2] for n in reduces)
    # The cut value crosses as each rank's half of the micro-batch's 4 rows.
    sent = [v for n in first.nodes if n.op == "Exchange" for v in n.inputs]
    assert {tuple(v.type.shape) for v in sent} == {(16 // 4 // 2, 256)}


def _t(name: str, src: int, dst: int, send: int, recv: int) -> _Transfer:
    t = _Transfer(Value(name, TensorType((1,), DType.F32)), src, dst, send, recv)
    t.recv_slot = recv
    return t


def test_exchanges_that_would_wait_on_each_other_are_refused() -> None:
    """Two stages each sending first and receiving after (blocking sends of rendezvous
    size): refused; the same transfers in one exchange each: fine."""
    crossed = [_t("a", 0, 1, 0, 1), _t("g", 1, 0, 0, 1)]
    with pytest.raises(AssertionError, match="deadlock"):
        check_exchanges(crossed, 2, 1)
    check_exchanges([_t("a", 0, 1, 0, 0), _t("g", 1, 0, 0, 0)], 2, 1)


def _train(tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    data = tmp / "d.npz"
    rng = np.random.default_rng(0)
    np.savez(
        data, x=rng.standard_normal((16, 64)).astype(np.float32), labels=np.zeros(16, np.int64)
    )
    return subprocess.run(
        [sys.executable, "-m", "flowc", "train", str(MLP), "--loss", LOSS, "--optimizer",
         "adamw:lr=0.01", "--data", str(data), "--steps", "1", "--target", "host", *extra],
        capture_output=True, text=True, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--batch", "8", "--pipeline", "2", "--accumulate", "2"], "are the accumulation"),
        (["--batch", "6", "--pipeline", "2", "--microbatches", "4"], "does not split"),
        (["--batch", "8", "--pipeline", "5", "--microbatches", "2"], "too few for 5 stages"),
        (
            ["--batch", "8", "--pipeline", "3", "--stage-boundary", f"{CUT},{CUT}"],
            "would have no work",
        ),
        (
            ["--batch", "8", "--pipeline", "2", "--stage-boundary", "nope"],
            "not a value of the training step",
        ),
        (["--batch", "8", "--microbatches", "2"], "need --pipeline"),
        (["--batch", "8", "--pipeline", "2", "--mesh", "4"], "mesh axis 0 is the pipeline"),
    ],
)
def test_pipeline_mistakes_are_refused_clearly(tmp_path: Path, extra: list[str], says: str) -> None:
    r = _train(tmp_path, *extra)
    assert r.returncode != 0
    assert says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_zero_with_a_pipeline_is_refused(tmp_path: Path) -> None:
    spec = spec_from(LOSS, "adamw:lr=0.01")
    with pytest.raises(Exception, match="ZeRO splits state over a data axis"):
        compile_step(MLP, spec, tmp_path / "p", batch=8, zero=1, pipeline=2, microbatches=2)


def test_a_pipeline_step_builds_for_cuda_without_a_warning(tmp_path: Path) -> None:
    """The pipeline x data program's CUDA build (NCCL exchanges between the stages,
    all-reduces within them): compiled and linked warning-free."""
    from conftest import require_cuda_build_toolchain

    from flowc.harness.build import build

    require_cuda_build_toolchain()
    spec = spec_from(LOSS, "adamw:lr=0.01")
    _, project = compile_step(
        MLP, spec, tmp_path / "step", batch=8, target="cuda", pipeline=2, microbatches=2,
        mesh="2x2",
    )  # fmt: skip
    bdir = build(project.path, "cuda", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()


def test_inspect_train_refuses_a_placement_it_would_not_show() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "flowc", "inspect", str(MLP), "--train", "--loss", LOSS,
         "--optimizer", "adamw:lr=0.01", "--batch", "8", "--pipeline", "2"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert r.returncode == 2 and "shows the step on one device" in r.stderr, r.stderr
