"""Philox4x32-10 (flowc/ops/random.py, the NumPy twin of runtime_cpp/flowc/philox.h) against
Random123's published known-answer vectors (its tests/kat_vectors: counter, key, result); the
C++ header is checked on the same vectors, on the host and the GPU, by tests/runtime/kernels.cu
(test_runtime.py)."""

from __future__ import annotations

import numpy as np
import pytest

from flowc.ops.random import philox4x32_10, to_unit_float

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
