"""Whole models through import + the NumPy reference, against references nobody here wrote:
the PyTorch outputs stored with the shared models (tests/data/models), onnxruntime, and the expected outputs the
onnx package ships with its light models (ResNet-50, VGG-19, DenseNet-121, ...)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import SHARED_MODELS
from onnx import numpy_helper

from flowc.frontend.onnx import ImportOptions, import_model, import_onnx
from flowc.harness.compare import max_rel_error
from flowc.harness.ort import inference_mode, run_onnxruntime
from flowc.interpreter import evaluate
from flowc.ir.graph import is_splat
from flowc.ir.verify import verify_graph

TOL = 1e-4
LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
LIGHT_MODELS = sorted(p.stem for p in LIGHT_DIR.glob("*.onnx"))
SHARED = ["mlp", "bert_tiny", "gpt2_tiny", "resnet_tiny", "vit_tiny"]


def _shared_io(name: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    io = np.load(SHARED_MODELS / f"{name}.io.npz")
    ins = {k[3:]: io[k] for k in io.files if k.startswith("in:")}
    outs = {k[4:]: io[k] for k in io.files if k.startswith("out:")}
    return ins, outs


def test_training_mode_dropout_is_identity_with_one_warning() -> None:
    from flowc.errors import FlowcWarning

    with pytest.warns(FlowcWarning, match=r"training_mode=true.*\(5 node\(s\), first: ") as rec:
        graph = import_onnx(SHARED_MODELS / "gpt2_tiny.onnx")
    assert len([w for w in rec if issubclass(w.category, FlowcWarning)]) == 1
    assert "Dropout" not in graph.op_counts()


def _shapes_of(feeds: dict[str, np.ndarray]) -> ImportOptions:
    return ImportOptions(shapes={k: v.shape for k, v in feeds.items()})


def test_shared_models_are_present() -> None:
    # The repository carries them (tests/data/models); without them these tests would
    # silently shrink.
    missing = [n for n in SHARED if not (SHARED_MODELS / f"{n}.onnx").exists()]
    assert not missing, f"missing {missing} in {SHARED_MODELS}"
    assert len(LIGHT_MODELS) == 9, LIGHT_MODELS


@pytest.mark.filterwarnings("ignore::flowc.errors.FlowcWarning")  # gpt2's Dropout, tested below
@pytest.mark.parametrize("name", SHARED)
def test_shared_model_matches_pytorch_and_onnxruntime(name: str) -> None:
    feeds, expected = _shared_io(name)
    path = SHARED_MODELS / f"{name}.onnx"
    graph = import_onnx(path, _shapes_of(feeds))
    verify_graph(graph)
    got = evaluate(graph, feeds)
    ref = run_onnxruntime(inference_mode(onnx.load(str(path))), feeds)
    assert set(got) == set(ref) == set(expected)
    for out in expected:
        assert got[out].dtype == ref[out].dtype and got[out].shape == ref[out].shape
        assert max_rel_error(got[out], expected[out]) <= TOL, out
        assert max_rel_error(got[out], ref[out]) <= TOL, out


def test_dynamic_dims_by_symbol_give_the_same_graph() -> None:
    feeds, expected = _shared_io("bert_tiny")
    graph = import_onnx(
        SHARED_MODELS / "bert_tiny.onnx", ImportOptions(dims={"batch": 2, "seq": 32})
    )
    # Shape subgraphs fold away once the dims are known: no Shape/Gather-of-shape remains.
    assert "Shape" not in graph.op_counts() and "Range" not in graph.op_counts()
    got = evaluate(graph, feeds)
    for out in expected:
        assert max_rel_error(got[out], expected[out]) <= TOL


def _light_input(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The input the onnx backend runner feeds light models: arange(n) / n (float32)."""
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        shape = tuple(d.dim_value or 1 for d in vi.type.tensor_type.shape.dim)
        n = int(np.prod(shape))
        feeds[vi.name] = (np.arange(n).reshape(shape) / n).astype(np.float32)
    return feeds


@pytest.mark.slow
@pytest.mark.parametrize("name", LIGHT_MODELS)
def test_light_model_matches_its_expected_output(name: str) -> None:
    model = onnx.load(str(LIGHT_DIR / f"{name}.onnx"))
    feeds = _light_input(model)
    graph = import_model(model)
    verify_graph(graph)
    # The weights are ConstantOfShape fills: they must stay splats, not 100s of MB of data.
    held = [c.const for c in graph.constants if c.const is not None]
    assert any(is_splat(a) for a in held)
    # nbytes of a splat is its logical size; what it holds is one element.
    assert sum(a.nbytes for a in held if not is_splat(a)) < 1 << 20
    got = evaluate(graph, feeds)
    for i, vo in enumerate(model.graph.output):
        expected = numpy_helper.to_array(onnx.load_tensor(str(LIGHT_DIR / f"{name}_output_{i}.pb")))
        assert max_rel_error(got[vo.name], expected) <= TOL, vo.name


def _with_random_weights(model: onnx.ModelProto, seed: int) -> onnx.ModelProto:
    """Replace every ConstantOfShape weight by random data: a fill hides transposed weights."""
    rng = np.random.default_rng(seed)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    m = onnx.ModelProto()
    m.CopyFrom(model)
    keep = []
    new_inits = []
    for node in m.graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in inits:
            shape = tuple(int(d) for d in inits[node.input[0]])
            if len(shape) >= 2:
                std = np.sqrt(2.0 / max(1, int(np.prod(shape[1:]))))
                w = (rng.standard_normal(shape) * std).astype(np.float32)
            else:
                w = rng.uniform(0.5, 1.5, shape).astype(np.float32)
            new_inits.append(numpy_helper.from_array(w, node.output[0]))
        else:
            keep.append(node)
    del m.graph.node[:]
    m.graph.node.extend(keep)
    m.graph.initializer.extend(new_inits)
    # Random weights saturate the final softmax to one-hot, which would hide most errors:
    # compare the logits too.
    for node in keep:
        if node.op_type == "Softmax":
            m.graph.output.append(
                onnx.helper.make_tensor_value_info(node.input[0], onnx.TensorProto.FLOAT, None)
            )
    return m


@pytest.mark.slow
@pytest.mark.parametrize("name", LIGHT_MODELS)
def test_light_model_with_random_weights_matches_onnxruntime(name: str) -> None:
    model = _with_random_weights(onnx.load(str(LIGHT_DIR / f"{name}.onnx")), seed=len(name))
    rng = np.random.default_rng(1)
    feeds = {
        k: rng.standard_normal(v.shape).astype(np.float32) for k, v in _light_input(model).items()
    }
    ref = run_onnxruntime(model, feeds)
    graph = import_model(model)
    got = evaluate(graph, feeds)
    assert len(ref) == len(model.graph.output)
    for out, r in ref.items():
        assert max_rel_error(got[out], r) <= TOL, out


def test_no_tracked_file_names_the_shared_folder_beside_the_clone() -> None:
    """A fresh clone with nothing beside it tests itself: no tracked file (but CI's own
    scripts) reads or names the project's shared folder outside the repository."""
    import re
    import subprocess

    from conftest import REPO

    r = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True)
    if r.returncode == 0:
        files = r.stdout.splitlines()
    else:
        # Not a git checkout (an unpacked archive): the source files, without dot-folders
        # (.venv, caches) and build outputs.
        files = [
            str(f.relative_to(REPO))
            for f in REPO.rglob("*")
            if f.is_file()
            and not any(
                p.startswith(".") or p.startswith("build") or p == "__pycache__"
                for p in f.relative_to(REPO).parts[:-1]
            )
        ]
    q = '"' + "shared" + '"'  # spelled apart, so that this file does not match itself
    outside = re.compile(r"\.\./" + "shared|/work/" + "shared|" + q + " /|/ " + q)
    found = []
    for rel in files:
        if rel.startswith(".ci/"):
            continue
        try:
            text = (REPO / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue  # a model, an image
        found += [f"{rel}: {m.group(0)}" for m in outside.finditer(text)]
    assert not found, found
