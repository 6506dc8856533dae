"""Bad inputs end in a clear error (exit 2), and only genuine bugs in exit 70.

Special files (a FIFO, a link to /dev/zero) as a model, a weights file or an --input array
are refused without being opened; folding and --random-inputs have size bounds; the
validation at import rejects what the importer would trip over, but a bug flowc has is still
reported as an internal error, not disguised as the user's.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_cli
from onnx import TensorProto, helper

from flowc.errors import FlowcError, InputError, ModelLoadError, ShapeError
from flowc.frontend.onnx import import_model
from flowc.interpreter import MAX_RANDOM_INPUT_BYTES, random_inputs
from flowc.ir.builder import MAX_FOLD_BYTES, GraphBuilder
from flowc.ir.dtype import DType
from flowc.ir.graph import Graph, make_splat
from flowc.ir.types import TensorType

RELU = helper.make_model(
    helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    ),
    opset_imports=[helper.make_opsetid("", 17)],
)
PROGRAM = "graph g(x: f32[2]) -> (y: f32[2]) {\n    y = relu(x)\n    return y\n}\n"


@pytest.fixture(autouse=True)
def no_hang() -> Iterator[None]:
    """A FIFO that is opened blocks forever: fail the test instead of hanging the suite."""

    def alarm(*_: object) -> None:
        raise TimeoutError("hung (a FIFO was opened?)")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("suffix", [".onnx", ".flow"])
@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_special_file_as_model_is_refused(
    suffix: str, kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / f"model{suffix}"
    if kind == "fifo":
        os.mkfifo(p)
    else:
        p.symlink_to("/dev/zero")
    code, text = run_cli(["inspect", str(p)], capsys)
    assert code == 2, text
    assert str(p) in text and "not a regular file" in text
    assert ("FIFO" if kind == "fifo" else "character device") in text


def test_special_weights_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = tmp_path / "p.flow"
    prog.write_text(
        'graph g(x: f32[2]) -> (y: f32[2]) {\n    param w: f32[2] = load("w")\n'
        "    y = x + w\n    return y\n}\n"
    )
    w = tmp_path / "w.npz"
    os.mkfifo(w)
    code, text = run_cli(["inspect", str(prog), "--weights", str(w)], capsys)
    assert code == 2 and "weights file" in text and "FIFO" in text, text


def test_special_input_array_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prog = tmp_path / "p.flow"
    prog.write_text(PROGRAM)
    x = tmp_path / "x.npy"
    x.symlink_to("/dev/zero")
    out = tmp_path / "o.npz"
    code, text = run_cli(["eval", str(prog), "--input", f"x={x}", "-o", str(out)], capsys)
    assert code == 2 and "--input x" in text and "character device" in text, text


def test_regular_files_through_links_still_work(tmp_path: Path) -> None:
    from flowc.frontend import load_graph

    real = tmp_path / "real.onnx"
    onnx.save(RELU, real)
    link = tmp_path / "link.onnx"
    link.symlink_to(real)
    assert [v.name for v in load_graph(link).outputs] == ["y"]


def test_a_genuine_bug_still_exits_70(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Validation must not turn flowc's own bugs into user errors: an op's inference that
    raises ZeroDivisionError on a valid model is an internal error."""
    import dataclasses

    from flowc.ops import registry

    relu = registry.get_op("Relu")

    def broken(ctx: registry.InferCtx) -> list[TensorType]:
        return [ctx.type(0).with_shape([1 // 0])]

    monkeypatch.setitem(registry._REGISTRY, "Relu", dataclasses.replace(relu, infer=broken))
    p = tmp_path / "m.onnx"
    onnx.save(RELU, p)
    code, text = run_cli(["inspect", str(p)], capsys)
    assert code == 70, text
    assert "internal error" in text and "ZeroDivisionError" in text


def _with(mutate: object) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(RELU)
    mutate(m)  # type: ignore[operator]
    return m


def _attr(m: onnx.ModelProto) -> None:
    m.graph.node[0].attribute.append(helper.make_attribute("alpha", 0.5))


def _string_init(m: onnx.ModelProto) -> None:
    m.graph.initializer.append(helper.make_tensor("x", TensorProto.STRING, [2, 3], [b"a"] * 6))


def _short_init(m: onnx.ModelProto) -> None:
    t = onnx.numpy_helper.from_array(np.zeros((2, 3), np.float32), "x")
    t.raw_data = t.raw_data[:-4]
    m.graph.initializer.append(t)


def _bad_opset(m: onnx.ModelProto) -> None:
    m.opset_import[0].version = 0


def _no_input(m: onnx.ModelProto) -> None:
    del m.graph.node[0].input[:]


@pytest.mark.parametrize(
    ("mutate", "error", "names"),
    [
        (_attr, ShapeError, "node 'relu' (Relu): 'alpha' is not an attribute of Relu"),
        (_string_init, ModelLoadError, "initializer 'x' is a string tensor"),
        (_short_init, ModelLoadError, "initializer 'x' holds 20 bytes"),
        (_bad_opset, ModelLoadError, "opset version 0"),
        (_no_input, ShapeError, "node 'relu' (Relu): the required input 0 ('X') is missing"),
    ],
)
def test_import_validation_names_the_culprit(
    mutate: object, error: type[FlowcError], names: str
) -> None:
    with pytest.raises(error) as e:
        import_model(_with(mutate))
    assert names in str(e.value)


def test_valid_models_keep_their_attributes_and_optional_inputs() -> None:
    """What the schema allows passes: optional inputs left out, attributes at their types."""
    m = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("Clip", ["x", "", "hi"], ["c"], name="clip"),
                helper.make_node("LeakyRelu", ["c"], ["y"], name="lr", alpha=0.25),
            ],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
            [onnx.numpy_helper.from_array(np.array(1.0, np.float32), "hi")],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    from flowc.interpreter import evaluate

    g = import_model(m)
    x = np.array([-2.0, 0.5, 3.0], np.float32)
    np.testing.assert_allclose(
        evaluate(g, {"x": x})["y"], np.where(x < 0, 0.25 * x, np.minimum(x, 1))
    )


def test_folding_leaves_results_over_the_bound_to_run_time() -> None:
    g = Graph("g")
    b = GraphBuilder(g)
    n = MAX_FOLD_BYTES // 4 + 1
    big = b.constant("w", make_splat(2.0, (n,), np.dtype(np.float32)))
    (y,) = b.emit("Relu", [big], name="relu")
    assert y.const is None and y.producer is not None and y.producer.op == "Relu"
    small = b.constant("s", np.full(4, -1.0, np.float32))
    (z,) = b.emit("Relu", [small], name="relu_small")
    assert z.const is not None and (z.const == 0).all()


def test_random_inputs_refuse_more_than_the_bound_naming_the_input() -> None:
    g = Graph("g")
    g.add_input("small", TensorType((2,), DType.F32))
    g.add_input("huge", TensorType((1 << 20, 1 << 20), DType.F32))
    with pytest.raises(InputError, match=r"input 'huge' .*4.00 TiB"):
        random_inputs(g)
    ok = Graph("g")
    ok.add_input("x", TensorType((MAX_RANDOM_INPUT_BYTES // (1 << 30), 3), DType.F32))
    assert random_inputs(ok)["x"].shape == (4, 3)
