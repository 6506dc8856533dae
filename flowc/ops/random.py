"""Philox4x32-10 in NumPy: the twin of runtime_cpp/flowc/philox.h, vectorized over counters.

Salmon, Moraes, Dror and Shaw's counter-based generator (SC 2011; Random123): four 32-bit
words from a 128-bit counter and a 64-bit key in ten rounds of two 32x32->64 multiplies, the
key bumped by a Weyl sequence between rounds. Random bits that are a pure function of
(key, counter) are what training needs: a dropout mask keyed by seed, step and the element's
logical index is the same on the host and the GPU, in the forward and when the backward
computes it again, and under any later split of the tensor over devices. Tested against
Random123's published known-answer vectors (tests/test_philox.py).
"""

from __future__ import annotations

import numpy as np

M0, M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
W0, W1 = 0x9E3779B9, 0xBB67AE85
_LOW = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


def philox4x32_10(counter: np.ndarray, key: tuple[int, int]) -> np.ndarray:
    """The generator's blocks: ``counter`` (..., 4) uint32 words, ``key`` two 32-bit words;
    returns (..., 4) uint32."""
    c = np.asarray(counter, dtype=np.uint32).astype(np.uint64)
    if c.shape[-1:] != (4,):
        raise ValueError(f"a Philox counter is 4 words, got shape {c.shape}")
    c0, c1, c2, c3 = (c[..., i] for i in range(4))
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for r in range(10):
        if r > 0:
            k0, k1 = (k0 + W0) & 0xFFFFFFFF, (k1 + W1) & 0xFFFFFFFF
        p0, p1 = M0 * c0, M1 * c2
        hi0, lo0 = p0 >> _SHIFT, p0 & _LOW
        hi1, lo1 = p1 >> _SHIFT, p1 & _LOW
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def to_unit_float(words: np.ndarray) -> np.ndarray:
    """Words' top 24 bits as float32 in [0, 1) (philox.h's to_unit_float: exact)."""
    return (np.asarray(words, dtype=np.uint32) >> np.uint32(8)).astype(np.float32) * np.float32(
        1.0 / 16777216.0
    )
