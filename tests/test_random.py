"""Philox4x32-10 (flowc/ops/random.py, the NumPy twin of runtime_cpp/flowc/philox.h) against
Random123's published known-answer vectors (its tests/kat_vectors: counter, key, result); the
C++ header is checked on the same vectors, on the host and the GPU, by tests/runtime/kernels.cu
(test_runtime.py). TrainDropout, the training dropout drawn from it: its masks, its VJP against
finite differences, its kernel compiled for the host against the NumPy reference bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flowc.ops.random import dropout_keep, philox4x32_10, to_unit_float

KNOWN_ANSWERS = [
    ("00000000 00000000 00000000 00000000", "00000000 00000000",
     "6627e8d5 e169c58d bc57ac4c 9b00dbd8"),
    ("ffffffff ffffffff ffffffff ffffffff", "ffffffff ffffffff",
     "408f276d 41c83b0e a20bc7c6 6d5451fd"),
    ("243f6a88 85a308d3 13198a2e 03707344", "a4093822 299f31d0",
     "d16cfe09 94fdcceb 5001e420 24126ea1"),
]  # fmt: skip


def _words(text: str) -> list[int]:
    return [int(w, 16) for w in text.split()]


@pytest.mark.parametrize(("counter", "key", "result"), KNOWN_ANSWERS)
def test_known_answers(counter: str, key: str, result: str) -> None:
    k0, k1 = _words(key)
    got = philox4x32_10(np.array(_words(counter), np.uint32), (k0, k1))
    assert got.tolist() == _words(result)


def test_blocks_are_computed_independently_per_counter() -> None:
    # A batch of counters gives each one's block, as one call per counter would.
    counters = np.array([_words(c) for c, _, _ in KNOWN_ANSWERS] * 2, np.uint32)
    counters[3:, 1] += 1
    batch = philox4x32_10(counters, (5, 9))
    for c, block in zip(counters, batch, strict=True):
        assert philox4x32_10(c, (5, 9)).tolist() == block.tolist()
    with pytest.raises(ValueError, match="4 words"):
        philox4x32_10(np.zeros(3, np.uint32), (0, 0))


def test_unit_floats_are_uniform_in_the_half_open_interval() -> None:
    counters = np.zeros((1 << 16, 4), np.uint32)
    counters[:, 0] = np.arange(1 << 16)
    u = to_unit_float(philox4x32_10(counters, (2026, 12)))
    assert u.dtype == np.float32 and u.min() >= 0.0 and u.max() < 1.0
    assert to_unit_float(np.array([0xFFFFFFFF], np.uint32))[0] < 1.0
    # 262,144 draws: the mean and each decile's share within a few standard errors.
    assert abs(float(u.mean()) - 0.5) < 0.003
    shares = np.histogram(u, bins=10, range=(0.0, 1.0))[0] / u.size
    assert np.all(np.abs(shares - 0.1) < 0.003)


def test_dropout_masks_are_keyed_by_seed_stream_step_and_element() -> None:
    shape = (64, 129)  # not a multiple of 4: the last block is cut short
    keep = dropout_keep(shape, 0.25, seed=3, stream=1, step=7)
    assert keep.shape == shape and keep.dtype == np.bool_
    assert abs(float(keep.mean()) - 0.75) < 0.01
    np.testing.assert_array_equal(keep, dropout_keep(shape, 0.25, seed=3, stream=1, step=7))
    for other in (
        dropout_keep(shape, 0.25, seed=4, stream=1, step=7),
        dropout_keep(shape, 0.25, seed=3, stream=2, step=7),
        dropout_keep(shape, 0.25, seed=3, stream=1, step=8),
    ):
        # Another key: about 3/8 of the elements differ (2 p (1 - p)).
        assert abs(float((keep != other).mean()) - 0.375) < 0.02
    # An element's draw depends on its index only, not on the tensor's shape.
    flat = dropout_keep((64 * 129,), 0.25, seed=3, stream=1, step=7)
    np.testing.assert_array_equal(flat, keep.reshape(-1))
    assert dropout_keep(shape, 0.0, seed=3, stream=1, step=7).all()


def test_train_dropout_reference_and_vjp() -> None:
    from test_autodiff import check_vjp

    from flowc.ir.graph import Attrs
    from flowc.ops.registry import get_op

    x = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    attrs = Attrs({"ratio": 0.3, "seed": 11, "stream": 2})
    (y,) = get_op("TrainDropout").evaluate([x, np.asarray(4, np.int64)], attrs)
    keep = dropout_keep(x.shape, 0.3, seed=11, stream=2, step=4)
    np.testing.assert_array_equal(y, np.where(keep, x * np.float32(1 / 0.7), np.float32(0)))
    # Linear in x for a given key: the gradient is the same op on the gradient.
    check_vjp(
        "TrainDropout",
        [x.astype(np.float64), np.asarray(4, np.int64)],
        {"ratio": 0.3, "seed": 11, "stream": 2},
    )


def test_train_dropout_kernel_on_the_host_equals_the_reference(tmp_path: Path) -> None:
    from flowc.compiler import compile_graph
    from flowc.harness.build import build, run
    from flowc.ir.builder import GraphBuilder
    from flowc.ir.dtype import DType
    from flowc.ir.graph import Graph
    from flowc.ir.types import TensorType

    g = Graph("drop")
    b = GraphBuilder(g)
    x = g.add_input("x", TensorType((3, 5, 7), DType.F32))
    step = g.add_input("step", TensorType((), DType.I64))
    attrs = {"ratio": 0.4, "seed": 2**40 + 5, "stream": 3}
    y = b.emit("TrainDropout", [x, step], attrs)[0]
    # Micro-batch 2 of a step's micro-batches of 3 rows: rows 6..8 of the step's masks (an
    # offset of 2 * 105 elements, not a whole Philox block of 4 from the start).
    z = b.emit("TrainDropout", [x, step], {**attrs, "offset": 2 * 105})[0]
    g.outputs = [y, z]
    compile_graph(g, tmp_path / "out")
    build(tmp_path / "out", "host", quick=True)
    xs = np.random.default_rng(1).standard_normal((3, 5, 7)).astype(np.float32)
    for s in (0, 9):
        got, _ = run(tmp_path / "out", {"x": xs, "step": np.asarray(s, np.int64)}, target="host")
        keep = dropout_keep(xs.shape, 0.4, seed=2**40 + 5, stream=3, step=s)
        want = np.where(keep, xs * np.float32(1 / 0.6), np.float32(0))
        np.testing.assert_array_equal(got[y.name], want)
        step_keep = dropout_keep((9, 5, 7), 0.4, seed=2**40 + 5, stream=3, step=s)[6:]
        want = np.where(step_keep, xs * np.float32(1 / 0.6), np.float32(0))
        np.testing.assert_array_equal(got[z.name], want)
        assert not np.array_equal(got[y.name], got[z.name])
