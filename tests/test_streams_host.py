"""Multi-stream programs run on the host target: the shared models and Inception v1/v2
compiled with --streams 2 match onnxruntime, also under the emulator's shuffled order; and
event mutation: in a poison build (dead arena bytes are NaN) every event the program waits
on is needed -- dropping it (FLOWC_DROP_EVENT=k, one build) either makes the independent
memory checker object to the emitted program or makes a run under a perturbed order give
wrong outputs."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import SHARED_MODELS
from test_models import LIGHT_DIR, _light_input, _shared_io, _with_random_weights

from flowc.compiler import Compiled, compile_graph, generate_program
from flowc.errors import FlowcError
from flowc.frontend.dsl import parse_program
from flowc.frontend.onnx import ImportOptions, import_model, import_onnx
from flowc.harness.build import build, run
from flowc.harness.compare import max_rel_error
from flowc.harness.ort import inference_mode, run_onnxruntime
from flowc.ir.graph import Graph
from flowc.memory.check import PlanError, check_memory_plan
from flowc.passes.manager import COMPILE_PIPELINE, PassManager

TOL = 1e-4
SHARED = ["mlp", "bert_tiny", "gpt2_tiny", "resnet_tiny", "vit_tiny"]
# The perturbed orders a dropped event is tried under, until one shows it.
MUTATION_ORDERS = ("reverse", "shuffle:1", "shuffle:2", "shuffle:3")

# Four branches off a shared trunk, joined at the end: a 2-stream schedule forks after the
# trunk and joins before the sum.
BRANCHES = """graph branches(x: f32[32, 64]) -> (y: f32[32, 64]) {
    param w0: f32[64, 64] = load("w0")
    param w1: f32[64, 64] = load("w1")
    param w2: f32[64, 64] = load("w2")
    param w3: f32[64, 64] = load("w3")
    param w4: f32[64, 64] = load("w4")
    param w5: f32[64, 64] = load("w5")
    param w6: f32[64, 64] = load("w6")
    h = relu(x @ w0)
    a = softmax(tanh(h @ w1) @ w2, axis=-1)
    b = sigmoid(h @ w3) @ w4
    c = relu(h @ w5) @ w6
    d = tanh(h)
    y = a * b + c - d
    return y
}
"""


def branches_weights(tmp: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    w = {f"w{k}": (rng.standard_normal((64, 64)) / 8).astype(np.float32) for k in range(7)}
    path = tmp / "branches.npz"
    np.savez(path, **w)
    return path, w


def branches_numpy(x: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    def softmax(z: np.ndarray) -> np.ndarray:
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    h = np.maximum(x @ w["w0"], 0)
    a = softmax(np.tanh(h @ w["w1"]) @ w["w2"])
    b = (1 / (1 + np.exp(-(h @ w["w3"])))) @ w["w4"]
    c = np.maximum(h @ w["w5"], 0) @ w["w6"]
    return a * b + c - np.tanh(h)


@dataclass
class Built:
    graph: Graph
    compiled: Compiled
    out: Path
    feeds: dict[str, np.ndarray]
    ref: dict[str, np.ndarray]


def build_two_streams(graph: Graph, out: Path) -> Compiled:
    """A poison build on (at most) two compute streams, built for the host warning-free."""
    compiled = compile_graph(graph, out, poison=True, streams=2)
    bdir = build(out, "host", quick=True)
    assert "warning" not in (bdir / "flowc-build.log").read_text().lower()
    return compiled


def differs(
    out: Path, feeds: dict[str, np.ndarray], ref: dict[str, np.ndarray], env: dict[str, str]
) -> bool:
    try:
        got, _ = run(out, feeds, env=env)
    except FlowcError:
        return True  # the run failed: that shows the missing event too
    # `not <=`: a NaN error (poisoned bytes read) counts as a difference.
    return any(not max_rel_error(got[k], r) <= TOL for k, r in ref.items())


def assert_matches(b: Built, orders: tuple[str, ...] = ("forward", "shuffle:5")) -> None:
    for order in orders:
        assert not differs(b.out, b.feeds, b.ref, {"FLOWC_SIM_ORDER": order}), order


@pytest.fixture(scope="module")
def dsl_build(tmp_path_factory: pytest.TempPathFactory) -> Built:
    tmp = tmp_path_factory.mktemp("branches")
    wpath, w = branches_weights(tmp)
    graph = PassManager(COMPILE_PIPELINE).run(parse_program(BRANCHES, weights=wpath))
    compiled = build_two_streams(graph, tmp / "out")
    x = np.random.default_rng(3).standard_normal((32, 64)).astype(np.float32)
    return Built(graph, compiled, tmp / "out", {"x": x}, {"y": branches_numpy(x, w)})


def _light_build(name: str, tmp: Path) -> Built:
    model = _with_random_weights(onnx.load(str(LIGHT_DIR / f"{name}.onnx")), seed=len(name))
    graph = PassManager(COMPILE_PIPELINE).run(import_model(model))
    compiled = build_two_streams(graph, tmp / "out")
    rng = np.random.default_rng(1)
    feeds = {
        k: rng.standard_normal(v.shape).astype(np.float32) for k, v in _light_input(model).items()
    }
    return Built(graph, compiled, tmp / "out", feeds, run_onnxruntime(model, feeds))


@pytest.fixture(scope="module")
def inception_v1_build(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return _light_build("light_inception_v1", tmp_path_factory.mktemp("inception_v1"))


def test_branches_on_two_streams_match_numpy(dsl_build: Built) -> None:
    assert dsl_build.compiled.schedule.num_streams == 2
    assert_matches(dsl_build, ("forward", "reverse", "shuffle:5"))


def test_inception_v1_on_two_streams_matches_onnxruntime(inception_v1_build: Built) -> None:
    assert inception_v1_build.compiled.schedule.num_streams == 2
    assert_matches(inception_v1_build)


def test_inception_v2_on_two_streams_matches_onnxruntime(tmp_path: Path) -> None:
    b = _light_build("light_inception_v2", tmp_path)
    assert b.compiled.schedule.num_streams == 2
    assert_matches(b)


@pytest.mark.parametrize("name", SHARED)
def test_shared_model_on_two_streams_matches_onnxruntime(name: str, tmp_path: Path) -> None:
    feeds, expected = _shared_io(name)
    path = SHARED_MODELS / f"{name}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gpt2_tiny's training-mode Dropout
        # bert_tiny's batch and seq dims are symbolic: the stored inputs fix them.
        graph = import_onnx(path, ImportOptions(shapes={k: v.shape for k, v in feeds.items()}))
    graph = PassManager(COMPILE_PIPELINE).run(graph)
    if generate_program(graph, streams=2, poison=True).files == (
        generate_program(graph, poison=True).files
    ):
        # The simulator's choice is this very program (one stream for mlp, two for gpt2_tiny
        # and resnet_tiny): test_codegen_models builds and runs it against onnxruntime under
        # the forward and a shuffled order, so it is not built twice.
        return
    compiled = build_two_streams(graph, tmp_path / "out")
    ref = run_onnxruntime(inference_mode(onnx.load(str(path))), feeds)
    assert set(ref) == set(expected)
    assert compiled.schedule.num_streams <= 2
    assert_matches(Built(graph, compiled, tmp_path / "out", feeds, ref))


def waited_events(c: Compiled) -> list[int]:
    return sorted({op.event for op in c.program if op.kind == "wait"})


def checker_objects(b: Built, k: int) -> bool:
    ops = [op for op in b.compiled.program if not (op.kind == "wait" and op.event == k)]
    try:
        check_memory_plan(b.graph, b.compiled.memory, ops)
    except PlanError:
        return True
    return False


def runtime_shows(b: Built, k: int) -> bool:
    return any(
        differs(b.out, b.feeds, b.ref, {"FLOWC_DROP_EVENT": str(k), "FLOWC_SIM_ORDER": order})
        for order in MUTATION_ORDERS
    )


def assert_every_event_needed(b: Built) -> None:
    # The unmutated program passes the checker and runs right under the perturbed orders.
    check_memory_plan(b.graph, b.compiled.memory, b.compiled.program)
    assert not any(differs(b.out, b.feeds, b.ref, {"FLOWC_SIM_ORDER": o}) for o in MUTATION_ORDERS)
    events = waited_events(b.compiled)
    # Every event of the schedule is waited on (and the fork and joins it needs).
    assert set(range(len(b.compiled.schedule.events))) <= set(events)
    # The checker is cheap: the run is tried for what it lets through.
    missed = [k for k in events if not checker_objects(b, k) and not runtime_shows(b, k)]
    assert not missed, f"dropping event(s) {missed} goes unnoticed"


def test_every_event_of_the_branches_is_needed(dsl_build: Built) -> None:
    assert_every_event_needed(dsl_build)


def test_every_event_of_inception_v1_is_needed(inception_v1_build: Built) -> None:
    assert_every_event_needed(inception_v1_build)
