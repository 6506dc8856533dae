"""Lean compile (issue 15, point 5): weights read as views over the mapped model and
external data files, weights files streamed with a running CRC, atomic writes.

References are onnx's own: ``numpy_helper.to_array`` of the initializers loaded with
``onnx.load`` (external data included), zlib over the written file, and a compile of the
same model through ``onnx.load`` + ``import_model`` (the path that copies everything)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_parallel_models import logical, tensor_parallel

from flowc.codegen.program import layout_weights
from flowc.codegen.project import ProjectError, write_project, write_weights
from flowc.compiler import compile_graph, parallelize
from flowc.errors import ModelLoadError
from flowc.frontend.onnx import import_model, import_onnx
from flowc.ir.graph import Value
from flowc.ir.layout import all_coords, shard
from flowc.ir.types import Mesh
from flowc.parallel import ParallelOptions
from flowc.passes.manager import COMPILE_PIPELINE, PassManager

HEADER = 64


def _model() -> onnx.ModelProto:
    """Element-wise ops only, so every initializer reaches the weights file unchanged."""
    rng = np.random.default_rng(7)
    inits = {
        "w": rng.standard_normal((64, 48)).astype(np.float32),
        "v": rng.standard_normal((64, 48)).astype(np.float32),
        "b": rng.standard_normal((48,)).astype(np.float32),
        "h": rng.integers(-1000, 1000, (64, 48)).astype(np.int32),
    }
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["m"]),
        helper.make_node("Add", ["m", "v"], ["a"]),
        helper.make_node("Add", ["a", "b"], ["y"]),
        helper.make_node("Cast", ["x"], ["xi"], to=TensorProto.INT32),
        helper.make_node("Add", ["xi", "h"], ["z"]),
    ]
    g = helper.make_graph(
        nodes,
        "lean",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 48])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 48]),
            helper.make_tensor_value_info("z", TensorProto.INT32, [64, 48]),
        ],
        initializer=[numpy_helper.from_array(a, n) for n, a in inits.items()],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _save(tmp_path: Path, external: bool) -> Path:
    path = tmp_path / "m.onnx"
    if external:
        onnx.save(
            _model(),
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location="m.onnx.data",
            size_threshold=0,
        )
    else:
        onnx.save(_model(), str(path))
    return path


def _root(a: np.ndarray) -> object:
    root: object = a
    while isinstance(root, np.ndarray) and root.base is not None:
        root = root.base
    return root.obj if isinstance(root, memoryview) else root


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("external", [False, True], ids=["embedded", "external"])
def test_weights_file_holds_the_initializers(tmp_path: Path, external: bool) -> None:
    path = _save(tmp_path, external)
    graph = import_onnx(path)
    consts = {c.name: c for c in graph.constants}
    for name in ("w", "v", "b", "h"):
        assert consts[name].const is not None
        # A view over the mapped file: the weights are not copied into the IR.
        assert isinstance(_root(consts[name].const), mmap.mmap), name
    compiled = compile_graph(PassManager(COMPILE_PIPELINE).run(graph), tmp_path / "out")
    data = (tmp_path / "out" / "weights.bin").read_bytes()
    magic, fields = data[:8], np.frombuffer(data[8:HEADER], "<u8")
    assert magic == b"FLOWCWT1" and fields[0] == 1 and fields[1] == len(data) - HEADER
    assert int(fields[2]) == zlib.crc32(data[HEADER:])  # the streamed CRC is zlib's
    reference = onnx.load(str(path))  # external data loaded by onnx itself
    offsets = {v.name: o for v, o in compiled.weights[0].offsets.items()}
    for t in reference.graph.initializer:
        want = numpy_helper.to_array(t)
        at = HEADER + offsets[t.name]
        assert data[at : at + want.nbytes] == want.tobytes(), t.name
    # Byte for byte what the copying path (onnx.load, then import) writes.
    copied = PassManager(COMPILE_PIPELINE).run(import_model(reference, name="m"))
    compile_graph(copied, tmp_path / "copied")
    assert _files(tmp_path / "out") == _files(tmp_path / "copied")


def test_truncated_external_data_is_a_clear_error(tmp_path: Path) -> None:
    path = _save(tmp_path, external=True)
    data = tmp_path / "m.onnx.data"
    full = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(full - 100)
    with pytest.raises(ModelLoadError) as e:
        import_onnx(path)
    msg = e.value.message
    last = max(onnx.load(str(path), load_external_data=False).graph.initializer, key=_offset)
    need = int(next(x.value for x in last.external_data if x.key == "length"))
    assert str(data) in msg and repr(last.name) in msg, msg
    assert f"holds {full - 100} bytes" in msg and f"needs {need} bytes" in msg, msg
    r = subprocess.run(
        [sys.executable, "-m", "flowc", "compile", str(path), "-o", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert repr(last.name) in r.stderr and "truncated" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def _offset(t: onnx.TensorProto) -> int:
    return int(next((x.value for x in t.external_data if x.key == "offset"), 0))


def test_embedded_data_of_the_wrong_size_is_refused(tmp_path: Path) -> None:
    m = _model()
    t = m.graph.initializer[2]  # b: float32 [48]
    t.raw_data = t.raw_data[:-8]
    path = tmp_path / "bad.onnx"
    onnx.save(m, str(path))
    with pytest.raises(ModelLoadError, match=r"'b' holds 184 bytes of data, .* need 192"):
        import_onnx(path)


def _no_temp_files(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob("*") if p.name.endswith(".tmp")]


def test_failed_writes_leave_no_temp_files(tmp_path: Path) -> None:
    graph = PassManager(COMPILE_PIPELINE).run(import_onnx(_save(tmp_path, external=True)))
    calls = []

    def failing(v: Value) -> np.ndarray:
        calls.append(v)
        if len(calls) == 3:  # after two constants are written: the disk is full
            raise OSError(28, "No space left on device")
        assert v.const is not None
        return v.const

    target = tmp_path / "w" / "weights.bin"
    target.parent.mkdir()
    target.write_bytes(b"old")
    with pytest.raises(ProjectError, match="No space left"):
        write_weights(target, layout_weights(graph, failing))
    assert target.read_bytes() == b"old" and _no_temp_files(target.parent) == []

    calls.clear()
    files = {"flowc_model.json": "{}", "model.cu": "// text\n"}
    out = tmp_path / "project"
    with pytest.raises(ProjectError, match="is as it was before this compile"):
        write_project(out, files, [layout_weights(graph, failing)])
    assert not out.exists()

    # An unchanged recompile leaves the weights file alone (its mtime too).
    good = layout_weights(graph)
    write_project(out, files, [good])
    before = (out / "weights.bin").stat().st_mtime_ns
    write_project(out, files, [good])
    assert (out / "weights.bin").stat().st_mtime_ns == before and _no_temp_files(out) == []
    assert os.listdir(out) and (out / "weights.bin").stat().st_size == HEADER + good.stored_bytes


def test_rank_shards_are_streamed_as_sliced() -> None:
    """Each rank's weights are its shards of the logical constants (sliced at write time)."""
    g = logical("mlp")
    mesh = Mesh("gpus", (2,))
    physical = parallelize(g, ParallelOptions(mesh, "auto", sbp=tensor_parallel(g, mesh))).physical
    assert physical.shards, "the plan splits no weight"
    for coords in all_coords(mesh):
        layout = layout_weights(physical.graph, physical=physical, coords=coords)
        data = layout.data
        assert len(data) == layout.stored_bytes and layout.crc == zlib.crc32(data)
        for c, at in layout.offsets.items():
            if c not in physical.shards:
                continue
            array, sbp = physical.shards[c]
            want = shard(array, sbp, mesh, coords).tobytes()
            assert data[at : at + len(want)] == want, c.name
