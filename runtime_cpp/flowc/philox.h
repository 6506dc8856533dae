// Philox4x32-10, the counter-based random number generator of Salmon, Moraes, Dror and Shaw
// ("Parallel random numbers: as easy as 1, 2, 3", SC 2011; Random123). A block of four 32-bit
// words is a pure function of a 128-bit counter and a 64-bit key, so any element's random
// bits can be computed where and when it is needed: the same on the host target and the GPU,
// in the forward and again in the backward, under any placement or launch shape.
// flowc/ops/random.py is the NumPy twin (the reference and the tests' known answers).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLOWC_PHILOX_FN __host__ __device__ __forceinline__
#else
#define FLOWC_PHILOX_FN inline
#endif

namespace flowc {
namespace philox {

struct Block {
  uint32_t v[4];
};

// The round multipliers and the key schedule's increments (Weyl sequence: the golden ratio
// and sqrt(3) - 1 in 32-bit fixed point), as Random123 defines them.
constexpr uint32_t kM0 = 0xD2511F53u;
constexpr uint32_t kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u;
constexpr uint32_t kW1 = 0xBB67AE85u;

// The 64-bit product's high and low words (a 64-bit multiply: mul.wide on the GPU).
FLOWC_PHILOX_FN void mulhilo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

// Ten rounds; the key is bumped between rounds.
FLOWC_PHILOX_FN Block philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                    uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kM0, c0, &hi0, &lo0);
    mulhilo(kM1, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return Block{{c0, c1, c2, c3}};
}

// A word's top 24 bits as a float in [0, 1): every value exactly representable, so the host
// and the GPU agree on it bit for bit.
FLOWC_PHILOX_FN float to_unit_float(uint32_t word) {
  return static_cast<float>(word >> 8) * (1.0f / 16777216.0f);
}

}  // namespace philox
}  // namespace flowc
