"""Training on a mesh (issue 30): the step placed by SBP, one MPI rank per device on the host
target. Data parallel on 2 and 4 ranks trains the single-device run's weights (1e-5 over 20
AdamW steps), the same bits run to run; the plan's collectives are the gradients'
all-reduces, and each rank's communication log matches the plan."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_MODELS

from flowc import checkpoint
from flowc.harness.build import launcher
from flowc.trainer import compile_step, spec_from

MLP = SHARED_MODELS / "mlp.onnx"
LOGITS = "/m/m.2/Gemm_output_0"
STEPS, BATCH = 20, 8
ARGS = ["--loss", f"cross_entropy:{LOGITS},labels", "--optimizer", "adamw:lr=0.01"]


def _data(path: Path) -> Path:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 64)).astype(np.float32)
    labels = (x @ rng.standard_normal((64, 10))).argmax(1).astype(np.int64)
    np.savez(path, x=x, labels=labels)
    np.save(path.with_name("x.npy"), x)
    np.save(path.with_name("labels.npy"), labels)
    return path


def _flowc_train(
    tmp: Path, name: str, *extra: str, steps: int = STEPS, said: list[str] | None = None
) -> dict[str, np.ndarray]:
    data = tmp / "data.npz"
    if not data.is_file():
        _data(data)
    r = subprocess.run(
        [sys.executable, "-m", "flowc", "train", str(MLP), *ARGS, "--data", str(data),
         "--steps", str(steps), "--batch", str(BATCH), "--target", "host",
         "--checkpoint-dir", str(tmp / name), *extra],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    if said is not None:
        said.extend(r.stderr.splitlines())
    ckpt = checkpoint.read(tmp / name)
    return {f"state/{k}": v for k, v in checkpoint.load_whole(ckpt).items()}


def _worst(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    floats = [k for k in a if k.startswith("state/") and a[k].dtype.kind == "f"]
    assert floats and set(a) == set(b)
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in floats)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    tmp = tmp_path_factory.mktemp("dp")
    return tmp, _flowc_train(tmp, "one")


def test_data_parallel_trains_the_single_device_weights(
    single: tuple[Path, dict[str, np.ndarray]],
) -> None:
    """`flowc train --mesh 2` (mpirun starts the ranks; shuffled batches, a checkpoint):
    every parameter and optimizer moment within 1e-5 of the one-device run (4 ranks: ZeRO-3
    and data x tensor below)."""
    tmp, want = single
    ranks = 2
    got = _flowc_train(tmp, f"mesh{ranks}", "--mesh", str(ranks))
    assert int(got["state/train/step"]) == STEPS
    assert _worst(want, got) < 1e-5


def test_the_data_plan_all_reduces_the_gradients_and_the_ranks_log_it(tmp_path: Path) -> None:
    """The data plan on 2 ranks: the batch split, every weight's and bias's gradient
    all-reduced (and the loss), in one bucket (one collective step), nothing gathered but
    the logits' rows the loss's GatherElements reads whole. Built once, the C++ driver
    (`model_main train` under mpirun) trains the same bits twice, and each rank's
    collective log matches the plan."""
    from flowc.harness.build import build

    _data(tmp_path / "data.npz")
    spec = spec_from(f"cross_entropy:{LOGITS},labels", "adamw:lr=0.01")
    said: list[str] = []
    step, project = compile_step(
        MLP, spec, tmp_path / "p", batch=BATCH, target="host", mesh="2", parallel="data",
        progress=said.append,
    )  # fmt: skip
    assert any("gradient buckets: 5 all-reduces in 1" in line for line in said), said
    assert project.ranks == 2
    bdir = build(project.path, "host", quick=True)
    cmd, env = launcher(2, "host")
    saved = []
    for k in range(2):
        log = tmp_path / f"comm{k}"
        r = subprocess.run(
            [*cmd, str(bdir / "model_main"), "train", "--weights", str(project.path / "weights.bin"),
             "--data", f"x={tmp_path / 'x.npy'}", "--data", f"labels={tmp_path / 'labels.npy'}",
             "--steps", "3", "--batch", str(BATCH), "--save", str(tmp_path / f"s{k}.bin")],
            env={**os.environ, **env, "FLOWC_COMM_LOG": str(log)},
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        saved.append((tmp_path / f"s{k}.bin").read_bytes())
    assert saved[0] == saved[1]
    # Per step one bucket: the gradients (two weights, two biases) and the loss.
    for rank in range(2):
        lines = Path(f"{tmp_path / 'comm0'}.rank{rank}").read_text().splitlines()
        reduced = sorted(
            int(m.group(1))
            for line in lines
            if (m := re.fullmatch(r"all-reduce axis=0 bytes=(\d+) dtype=1", line))
        )
        assert reduced == [256 * 64 * 4 + 256 * 4 + 10 * 256 * 4 + 10 * 4 + 4] * 3, reduced
        assert not any(line.startswith(("all-to-all", "reduce-scatter")) for line in lines)
    del step


def test_compile_train_on_a_mesh_from_the_command_line(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "flowc", "compile", str(MLP), "--train", *ARGS, "--batch", "8",
         "--mesh", "4", "--parallel", "data", "-o", str(tmp_path / "p"), "--target", "host"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "p").glob("weights.rank*.bin")) == [
        f"weights.rank{k}.bin" for k in range(4)
    ]
    bad = subprocess.run(
        [sys.executable, "-m", "flowc", "compile", str(MLP), "--train", *ARGS, "--batch", "6",
         "--mesh", "4", "--parallel", "data", "-o", str(tmp_path / "q")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "use a --batch that divides by 4" in bad.stderr, bad.stderr


def test_zero_1_trains_the_single_device_weights(
    single: tuple[Path, dict[str, np.ndarray]],
) -> None:
    """--zero 1 on 2 ranks (the moments split): the same weights, the checkpoint whole."""
    tmp, want = single
    assert _worst(want, _flowc_train(tmp, "zero1", "--mesh", "2", "--zero", "1")) < 1e-5


def test_a_zero_3_checkpoint_resumes_data_parallel_on_another_mesh(
    single: tuple[Path, dict[str, np.ndarray]],
) -> None:
    """10 steps under ZeRO-3 on 4 ranks (parameters and moments split; the second layer's
    10 rows do not split by 4 and stay whole), saved, then 10 more data parallel on 2 ranks
    from that checkpoint: the uninterrupted one-device run's weights after 20."""
    tmp, want = single
    half = _flowc_train(tmp, "zero3", "--mesh", "4", "--zero", "3", steps=STEPS // 2)
    assert int(half["state/train/step"]) == STEPS // 2
    resume = ("--resume", str(tmp / "zero3"))
    got = _flowc_train(tmp, "resumed", "--mesh", "2", *resume, steps=STEPS - STEPS // 2)
    assert int(got["state/train/step"]) == STEPS
    assert _worst(want, got) < 1e-5


def test_tensor_parallel_by_sbp_trains_the_single_device_weights(
    single: tuple[Path, dict[str, np.ndarray]],
) -> None:
    """Megatron's MLP on 2 ranks by --sbp, under the search: the first layer's weight and
    bias split by output features (S(0) of Gemm's transB weight), the second's weight by
    input features (S(1)); the split state gathered along its axis into the checkpoint."""
    tmp, want = single
    sbp = ["--sbp", "m.0.weight=S0", "--sbp", "m.0.bias=S0", "--sbp", "m.2.weight=S1"]
    got = _flowc_train(tmp, "tp", "--mesh", "2", "--parallel", "auto", *sbp)
    assert _worst(want, got) < 1e-5


def test_data_by_tensor_on_2x2_trains_the_single_device_weights(
    single: tuple[Path, dict[str, np.ndarray]],
) -> None:
    """A 2-D mesh: the batch split over mesh axis 0, Megatron's MLP over axis 1 (each weight
    whole along the data axis, so its state is gathered along the tensor axis alone)."""
    tmp, want = single
    sbp = ["m.0.weight=B,S0", "m.0.bias=B,S0", "m.2.weight=B,S1", "x=S0,B", "labels=S0,B"]
    flags = [a for t in sbp for a in ("--sbp", t)]
    got = _flowc_train(tmp, "2x2", "--mesh", "2x2", "--parallel", "auto", *flags)
    assert _worst(want, got) < 1e-5


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_trains_the_single_device_weights(
    single: tuple[Path, dict[str, np.ndarray]], schedule: str
) -> None:
    """The MLP cut into 2 stages (a rank each), the batch of 8 in 4 micro-batches of 2, in
    1F1B and GPipe order: the backward flows back through the stages, the gradients sum over
    the micro-batches, one update after the last; every parameter and moment within 1e-5 of
    the one-device run, the checkpoint whole (each stage saves its own layers)."""
    tmp, want = single
    said: list[str] = []
    pipe = ["--pipeline", "2", "--microbatches", "4", "--pipeline-schedule", schedule]
    got = _flowc_train(tmp, f"pipe-{schedule}", *pipe, said=said)
    assert int(got["state/train/step"]) == STEPS
    assert _worst(want, got) < 1e-5
    text = "\n".join(said)
    assert "stage cuts: /m/m.0/Gemm_output_0" in text, text
    assert f"modeled bubble ({schedule}, 2 stages, 4 micro-batches)" in text, text
    # 1F1B keeps at most P micro-batches in flight on the first stage; GPipe all of them.
    assert f"in flight per stage: {[2, 1] if schedule == '1f1b' else [4, 4]}" in text, text


def test_a_pipeline_by_data_checkpoint_resumes_on_one_device(
    single: tuple[Path, dict[str, np.ndarray]],
) -> None:
    """Pipeline x data on 2x2 (2 stages of 2 data-parallel ranks, 2 micro-batches): 10
    steps saved (each stage's first rank writes its layers), then 10 more on one device
    from that checkpoint: the uninterrupted one-device run's weights."""
    tmp, want = single
    pipe = ["--pipeline", "2", "--microbatches", "2", "--mesh", "2x2"]
    half = _flowc_train(tmp, "pipe2x2", *pipe, steps=STEPS // 2)
    assert int(half["state/train/step"]) == STEPS // 2
    resume = ("--resume", str(tmp / "pipe2x2"))
    got = _flowc_train(tmp, "pipe-resumed", *resume, steps=STEPS - STEPS // 2)
    assert _worst(want, got) < 1e-5


BERT_ARGS = [
    "--loss", "mse:pooler_output,target", "--optimizer", "adamw:lr=0.001,eps=1e-6",
    "--batch", "4", "--dim", "seq=16", "--steps", "6", "--target", "host",
]  # fmt: skip


def _bert_train(tmp: Path, name: str, *extra: str) -> dict[str, np.ndarray]:
    r = subprocess.run(
        [sys.executable, "-m", "flowc", "train", str(tmp / "bert.onnx"), *BERT_ARGS,
         "--data", str(tmp / "bert.npz"), "--checkpoint-dir", str(tmp / name), *extra],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return {f"state/{k}": v for k, v in checkpoint.load_whole(checkpoint.read(tmp / name)).items()}


@pytest.fixture(scope="module")
def bert_single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """bert_tiny with training-mode dropout after every norm and softmax (p = 0.1), its
    padding mask, an MSE on the pooled output: 6 AdamW steps of batch 4 on one device."""
    import onnx
    from test_training import _with_dropouts

    tmp = tmp_path_factory.mktemp("bert")
    model = onnx.load(str(SHARED_MODELS / "bert_tiny.onnx"))
    onnx.save(_with_dropouts(model, 0.1), str(tmp / "bert.onnx"))
    rng = np.random.default_rng(8)
    mask = np.ones((8, 16), np.int64)
    mask[:, 11:] = 0
    np.savez(
        tmp / "bert.npz",
        input_ids=rng.integers(0, 1000, (8, 16)).astype(np.int64),
        attention_mask=mask,
        target=rng.standard_normal((8, 128)).astype(np.float32),
    )
    return tmp, _bert_train(tmp, "one")


@pytest.mark.parametrize("plan", ["data", "zero1"])
def test_bert_tiny_with_dropout_trains_the_single_device_weights(
    bert_single: tuple[Path, dict[str, np.ndarray]], plan: str
) -> None:
    """The transformer on two plans, 2 ranks: data parallel and ZeRO-1. The dropout masks
    are keyed by the element's index in the global batch, so each rank draws its rows'
    masks of the one-device run; every parameter and moment within 1e-5 of it."""
    tmp, want = bert_single
    extra = ["--zero", "1"] if plan == "zero1" else []
    assert _worst(want, _bert_train(tmp, plan, "--mesh", "2", *extra)) < 1e-5


def test_bert_tiny_with_dropout_on_a_pipeline_trains_the_single_device_weights(
    bert_single: tuple[Path, dict[str, np.ndarray]],
) -> None:
    """The transformer cut into 2 stages (the automatic cut balances the forward), its
    batch of 4 in 2 micro-batches under 1F1B: micro-batch k's dropouts (after the norms,
    in the fused attention, and their backward) draw the masks of rows 2k.. of the
    one-device batch, so the pipeline trains the one-device weights within 1e-5."""
    tmp, want = bert_single
    got = _bert_train(tmp, "pipe", "--pipeline", "2", "--microbatches", "2")
    assert _worst(want, got) < 1e-5


HUGE = {
    # example: (model, data, optimizer, batch, the search's line for the split layer)
    "embedding": (
        "huge_embedding", "embedding_bag.onnx", "clicks.npz", "adamw:lr=0.05", "16",
        "tensor parallel (parameter S(0), used split): table",
    ),
    "classifier": (
        "huge_classifier", "classifier.onnx", "faces.npz", "adamw:lr=0.01", "64",
        "tensor parallel (parameter S(1), used split): fc.weight",
    ),
}  # fmt: skip


@pytest.mark.parametrize("layer", sorted(HUGE))
def test_a_layer_too_large_for_one_device_trains_on_four(tmp_path: Path, layer: str) -> None:
    """The seeds' huge layers, each refused on one device under --mem-limit 4MB and
    placed by the search on 4 ranks within it, 20 AdamW steps ending at the one-device run's
    weights (1e-5). examples/huge_embedding.py: the table and its moments split by rows,
    each rank looking up its rows (a partial sum) and its gradient landing in its own rows
    (ScatterNDShard: no dense gradient of the table anywhere). examples/huge_classifier.py:
    the classifier split by classes, its logits never gathered (only the loss's per-block
    row maxima are; its sums are all-reduced)."""
    module, onnx_name, data_name, optimizer, batch, split = HUGE[layer]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    __import__(module).main([str(tmp_path)])
    base = [
        sys.executable, "-m", "flowc", "train", str(tmp_path / onnx_name),
        "--loss", "cross_entropy:logits,labels", "--optimizer", optimizer,
        "--data", str(tmp_path / data_name), "--steps", "20", "--batch", batch,
        "--target", "host",
    ]  # fmt: skip

    def train(name: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, "--checkpoint-dir", str(tmp_path / name), *extra],
            capture_output=True, text=True, check=False,
        )  # fmt: skip

    refused = train("refused", "--mem-limit", "4MB")
    assert refused.returncode == 2 and "--mem-limit 4,000,000 B" in refused.stderr, refused.stderr
    one, four = (
        train("one"),
        train("four", "--mesh", "4", "--parallel", "auto", "--mem-limit", "4MB"),
    )
    assert one.returncode == 0, one.stderr
    assert four.returncode == 0, four.stderr
    assert split in four.stderr, four.stderr
    per_rank = next(line for line in four.stderr.splitlines() if "per rank:" in line)
    params, moments, arena = (
        int(m.replace(",", "")) for m in re.findall(r"([\d,]+) B", per_rank)[:3]
    )
    assert params + moments + arena <= 4_000_000, per_rank
    if layer == "classifier":
        log = tmp_path / "comm"
        env = {**os.environ, "FLOWC_COMM_LOG": str(log)}
        r = subprocess.run(
            [*base, "--steps", "1", "--mesh", "4", "--parallel", "auto", "--mem-limit", "4MB"],
            capture_output=True, text=True, check=False, env=env,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        # Nothing the size of the logits ([64, 16384] floats) crosses a link.
        sent = [int(b) for b in re.findall(r"bytes=(\d+)", Path(f"{log}.rank0").read_text())]
        assert sent and max(sent) < 64 * 16384 * 4 // 8, sent
    want, got = (checkpoint.load_whole(checkpoint.read(tmp_path / n)) for n in ("one", "four"))
    assert (
        max(float(np.abs(want[k] - got[k]).max()) for k in want if want[k].dtype.kind == "f") < 1e-5
    )
    ((first, last),) = re.findall(r"loss ([\d.]+) -> ([\d.]+)", four.stdout)
    assert float(last) < float(first), four.stdout


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (from /proc: this test's job alone, never another's)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _rank_process(job: int, rank: int) -> int:
    for pid in _descendants(job):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ and b"train_rank" in cmdline:
            return pid
    raise AssertionError(f"no rank {rank} under the job")


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_rank_that_dies_ends_the_job_and_its_last_checkpoint_resumes(
    single: tuple[Path, dict[str, np.ndarray]], how: str
) -> None:
    """Data parallel on 2 ranks saving every 5 steps, with far more steps to go: once a
    checkpoint is there, rank 1 is killed (SIGKILL: mpirun ends the job) or stopped
    (SIGSTOP: rank 0 waits in a collective until FLOWC_TIMEOUT_S ends it). `flowc train`
    fails naming the last complete checkpoint, which is whole (every part of its step, a
    save cut short leaving it as it was), and resuming from it on one device reaches the
    uninterrupted one-device run's weights."""
    tmp, want = single
    folder = tmp / f"dead-{how}"
    env = {**os.environ, "FLOWC_TIMEOUT_S": "3"}
    job = subprocess.Popen(
        [sys.executable, "-m", "flowc", "train", str(MLP), *ARGS, "--data", str(tmp / "data.npz"),
         "--steps", "100000", "--batch", str(BATCH), "--target", "host", "--mesh", "2",
         "--checkpoint-dir", str(folder), "--save-every", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (folder / checkpoint.MANIFEST).is_file():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.01)
        os.kill(_rank_process(job.pid, 1), signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        _, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    if how == "stopped":
        assert "after 3.0 s; aborting (FLOWC_TIMEOUT_S=3" in err, err
    done = checkpoint.read(folder).step
    assert done % 5 == 0 and f"holds the checkpoint of step {done}: continue with --resume" in err
    state = checkpoint.load_whole(checkpoint.read(folder))
    assert int(state["train/step"]) == done
    # Continue on one device to step STEPS (or, the job having gone past it, 5 steps more,
    # compared with a longer run).
    total = STEPS if done < STEPS else done + 5
    got = _flowc_train(tmp, f"resumed-{how}", "--resume", str(folder), steps=total - done)
    if total != STEPS:
        want = _flowc_train(tmp, f"one-{total}", steps=total)
    assert _worst(want, got) < 1e-5


def test_the_search_splits_the_state_to_fit_a_memory_limit(
    single: tuple[Path, dict[str, np.ndarray]],
) -> None:
    """--parallel auto under --mem-limit 300KB on 2 ranks (the whole state and arena need
    about 410 KB): the search counts the state's bytes per rank and chooses each tensor's
    layout, prints the choice per parameter group, keeps every rank within the limit, and
    trains the one-device weights."""
    tmp, want = single
    said: list[str] = []
    limit = ["--mesh", "2", "--parallel", "auto", "--mem-limit", "300KB"]
    got = _flowc_train(tmp, "memlimit", *limit, said=said)
    assert _worst(want, got) < 1e-5
    at = said.index("flowc: state placement (the search's):")
    groups = [line for line in said[at + 1 :] if line.startswith("flowc:   ")]
    assert groups and not any(line.startswith("flowc:   whole: m.0.weight") for line in groups)
    per_rank = next(line for line in said if line.startswith("flowc: per rank:"))
    params, moments, arena = (
        int(m.replace(",", "")) for m in re.findall(r"([\d,]+) B", per_rank)[:3]
    )
    assert params + moments + arena <= 300_000, per_rank
    assert moments < 153_680  # the moments of at least the first layer are split


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_state_per_rank_is_the_zero_formula(tmp_path: Path, zero: int) -> None:
    """A GELU MLP whose every tensor splits by 4, AdamW on 4 ranks: each rank keeps
    parameters 4n (stage 3: 4n/N) and moments 8n (stages 1-3: 8n/N) bytes, which with the
    gradients ZeRO's paper keeps beside them (4n; 4n/N from stage 2) is its 16 bytes per
    parameter: 16n, 8n + 8n/N, 4n + 12n/N, 16n/N. flowc keeps no gradient between steps:
    they live in the arena from their product to their reduction."""
    from test_backward_epilogues import _gelu_mlp

    from flowc.compiler import load_training, parallelize
    from flowc.options import ModelArgs
    from flowc.parallel import ParallelOptions, parse_mesh
    from flowc.training.zero import rank_state_bytes, zero_formula, zero_layouts

    spec = spec_from("mse:y,y_true", "adamw:lr=0.01")
    step = load_training(ModelArgs(_gelu_mlp(tmp_path / "mlp.onnx")), spec, batch=4)
    mesh = parse_mesh("4")
    layouts, whole = zero_layouts(step, mesh, zero) if zero else ({}, [])
    assert not whole
    placed = parallelize(step.graph, ParallelOptions(mesh, "data", layouts))
    params, moments = rank_state_bytes(placed.physical.graph, step)
    n = sum(int(np.prod(step.graph.params[p].shape)) for p in step.params)
    assert params == (4 * n if zero < 3 else n)
    assert moments == (8 * n if zero == 0 else 2 * n)
    grads = 4 * n if zero < 2 else n
    assert params + moments + grads == zero_formula(4 * n, 8 * n, 4, zero)
    assert (
        zero_formula(4 * n, 8 * n, 4, zero) == [16 * n, 8 * n + 2 * n, 4 * n + 3 * n, 4 * n][zero]
    )


def test_a_boolean_is_never_a_partial_sum() -> None:
    """A view of a mask is linear, so its signatures pass P through; a boolean has no sum
    to reduce to, so no strategy holds one partial (bert_tiny's data plan once read its
    padding mask as P and reduce-scattered it)."""
    from flowc.ir.builder import GraphBuilder
    from flowc.ir.dtype import DType
    from flowc.ir.graph import Graph
    from flowc.ir.layout import has_partial
    from flowc.ir.types import TensorType
    from flowc.parallel import parse_mesh
    from flowc.parallel.strategies import strategies

    partial = {}
    for dtype in (DType.BOOL, DType.F32):
        g = Graph("mask")
        x = g.add_input("x", TensorType((4, 8), dtype))
        shape = g.add_constant("shape", np.array([8, 4], np.int64))
        GraphBuilder(g, fold=False).emit("Reshape", [x, shape])
        made = strategies(g.nodes[-1], parse_mesh("2"))
        partial[dtype] = any(has_partial(s.output(0)) for s in made)
    assert partial == {DType.BOOL: False, DType.F32: True}
