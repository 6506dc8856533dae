"""Weights that are views of a mapped model file are copied into the weights file by the
kernel (os.copy_file_range, flowc/codegen/weights.py); the file must hold the same bytes as
one written through user space, and where the kernel refuses (or stops part-way) the writer
must fall back to writing without losing or repeating a byte. The reference is onnx.load's
arrays of the initializers and zlib's CRC of the data."""

from __future__ import annotations

import errno
import os
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from flowc.codegen.program import layout_weights
from flowc.codegen.project import write_weights
from flowc.codegen.weights import WeightsLayout, write_weights_file
from flowc.frontend.onnx import import_onnx
from flowc.passes.manager import COMPILE_PIPELINE, PassManager

HEADER = 64


def _save(tmp_path: Path, external: bool) -> Path:
    rng = np.random.default_rng(3)
    # Sizes that are not multiples of 256 (padding between them) and one above the writer's
    # 8 MiB piece, so a copy spans pieces.
    inits = {
        "big": rng.standard_normal((1100, 2000)).astype(np.float32),
        "odd": rng.standard_normal((37, 3)).astype(np.float32),
        "h": rng.integers(-1000, 1000, (5, 7)).astype(np.int32),
    }
    nodes = [
        helper.make_node("Add", ["x", "big"], ["y"]),
        helper.make_node("Mul", ["s", "odd"], ["t"]),
        helper.make_node("Add", ["i", "h"], ["z"]),
    ]
    g = helper.make_graph(
        nodes,
        "copy",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1100, 2000]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, [37, 3]),
            helper.make_tensor_value_info("i", TensorProto.INT32, [5, 7]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1100, 2000]),
            helper.make_tensor_value_info("t", TensorProto.FLOAT, [37, 3]),
            helper.make_tensor_value_info("z", TensorProto.INT32, [5, 7]),
        ],
        initializer=[numpy_helper.from_array(a, n) for n, a in inits.items()],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "m.onnx"
    if external:
        onnx.save(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location="m.onnx.data",
            size_threshold=0,
        )
    else:
        onnx.save(model, str(path))
    return path


def _check(path: Path, weights: Path, offsets: dict[str, int]) -> None:
    data = weights.read_bytes()
    assert int(np.frombuffer(data[8:HEADER], "<u8")[2]) == zlib.crc32(data[HEADER:])
    for t in onnx.load(str(path)).graph.initializer:
        want = numpy_helper.to_array(t)
        at = HEADER + offsets[t.name]
        assert data[at : at + want.nbytes] == want.tobytes(), t.name
    # Between and after the constants: zeros.
    ends = sorted((o, o + n) for o, n in _extents(path, offsets))
    pos = 0
    for lo, hi in ends:
        assert data[HEADER + pos : HEADER + lo] == bytes(lo - pos)
        pos = hi
    assert data[HEADER + pos :] == bytes(len(data) - HEADER - pos)


def _extents(path: Path, offsets: dict[str, int]) -> list[tuple[int, int]]:
    sizes = {
        t.name: numpy_helper.to_array(t).nbytes for t in onnx.load(str(path)).graph.initializer
    }
    return [(offsets[n], sizes[n]) for n in offsets if n in sizes]


def _counting(
    real: Callable[..., int], fail_after: int | None, calls: list[int]
) -> Callable[..., int]:
    def copy(src: int, dst: int, count: int, offset_src: int | None = None) -> int:
        calls.append(count)
        if fail_after is not None and len(calls) > fail_after:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        # A short copy (half of what was asked) exercises the caller's loop.
        return real(src, dst, max(count // 2, 1), offset_src)

    return copy


@pytest.mark.parametrize("external", [False, True], ids=["embedded", "external"])
@pytest.mark.parametrize("fail_after", [None, 0, 3], ids=["copied", "refused", "part-way"])
def test_mapped_weights_are_copied_file_to_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, external: bool, fail_after: int | None
) -> None:
    path = _save(tmp_path, external)
    graph = PassManager(COMPILE_PIPELINE).run(import_onnx(path))
    layout = layout_weights(graph)
    calls: list[int] = []
    monkeypatch.setattr(os, "copy_file_range", _counting(os.copy_file_range, fail_after, calls))
    target = tmp_path / "weights.bin"
    write_weights(target, layout)
    assert calls, "the mapped constants were not copied by the kernel"
    offsets = {v.name: o for v, o in layout.offsets.items()}
    _check(path, target, offsets)
    assert target.stat().st_size == HEADER + layout.stored_bytes


def test_shards_of_mapped_weights_are_copied_from_their_offsets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank's row shard is a view at an offset inside the mapped constant (copied from
    there); a column shard is not contiguous (written from a copy): both as sliced."""
    path = _save(tmp_path, external=True)
    big = next(c for c in import_onnx(path).constants if c.name == "big")
    assert big.const is not None
    arr = big.const
    shards = [arr[550:], arr[:, 1000:], arr[3:4]]  # rows, columns, one row
    parts: list[tuple[int, Callable[[], np.ndarray]]] = []
    pos = 0
    for s in shards:
        parts.append((pos, lambda s=s: s))
        pos += s.nbytes + (-s.nbytes) % 256
    layout = WeightsLayout({}, pos, pos, 0, parts)
    calls: list[int] = []
    monkeypatch.setattr(os, "copy_file_range", _counting(os.copy_file_range, None, calls))
    with open(tmp_path / "w.bin", "w+b") as f:
        crc = write_weights_file(f, layout)
    data = (tmp_path / "w.bin").read_bytes()[HEADER:]
    assert calls and crc == zlib.crc32(data)
    for (at, _), s in zip(parts, shards, strict=True):
        assert data[at : at + s.nbytes] == np.ascontiguousarray(s).tobytes()
