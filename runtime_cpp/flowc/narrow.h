// Storage-only element types: float16, bfloat16, the float8/float6/float4 formats and the 2- and
// 4-bit integers. Kernels do not compute in these types: flowc's widen_types pass puts a cast to
// float32 (int32 for the integers) before every op that is not a cast or a view and a cast back
// after it, so these types only have to hold values and convert them. Conversions go through
// double, so every narrowing is one correctly rounded step (round to nearest, ties to even).
//
// A 2- or 4-bit integer takes one byte, as NumPy and ml_dtypes hold it; ONNX's packing is undone
// when the model is read.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "flowc/device.h"

namespace flowc {
namespace narrow {

// How a format spends its all-ones exponent and its negative zero.
enum class Special {
  kIEEE,    // all-ones exponent: infinity (mantissa 0) or NaN; float16, bfloat16, float8 E5M2
  kFN,      // no infinity; all-ones exponent and mantissa is NaN (float8 E4M3FN)
  kFNUZ,    // no infinity, no negative zero; the negative-zero pattern is the one NaN
  kFinite,  // neither infinity nor NaN (float4 E2M1, float6)
};

struct Format {
  int exp_bits;
  int man_bits;
  int bias;
  Special special;
};

__host__ __device__ __forceinline__ uint32_t sign_bit(Format f) { return 1u << (f.exp_bits + f.man_bits); }

// The largest finite magnitude of the format.
__host__ __device__ __forceinline__ double max_finite(Format f) {
  const int top = (1 << f.exp_bits) - 1 - f.bias;  // exponent of the all-ones field
  const double all_ones = 2.0 - ldexp(1.0, -f.man_bits);
  if (f.special == Special::kIEEE) return ldexp(all_ones, top - 1);
  if (f.special == Special::kFN) return ldexp(2.0 - ldexp(1.0, 1 - f.man_bits), top);
  return ldexp(all_ones, top);
}

__host__ __device__ __forceinline__ uint32_t nan_bits(Format f, bool negative) {
  const uint32_t exp_man = sign_bit(f) - 1;
  switch (f.special) {
    case Special::kIEEE:  // a quiet NaN: the top mantissa bit set
      return (negative ? sign_bit(f) : 0u) | (exp_man & ~((1u << (f.man_bits - 1)) - 1));
    case Special::kFN:
      return (negative ? sign_bit(f) : 0u) | exp_man;
    case Special::kFNUZ:
      return sign_bit(f);
    case Special::kFinite:  // no NaN to give; ml_dtypes stores a zero of the opposite sign
      return negative ? 0u : sign_bit(f);
  }
  return 0u;
}

__host__ __device__ __forceinline__ double decode(Format f, uint32_t bits) {
  const uint32_t sign = bits & sign_bit(f);
  const uint32_t e = (bits >> f.man_bits) & ((1u << f.exp_bits) - 1);
  const uint32_t m = bits & ((1u << f.man_bits) - 1);
  const uint32_t e_ones = (1u << f.exp_bits) - 1, m_ones = (1u << f.man_bits) - 1;
  if (f.special == Special::kFNUZ && bits == sign_bit(f)) return NAN;
  if (f.special == Special::kIEEE && e == e_ones) {
    if (m != 0) return sign ? -NAN : NAN;
    return sign ? -INFINITY : INFINITY;
  }
  if (f.special == Special::kFN && e == e_ones && m == m_ones) return sign ? -NAN : NAN;
  const double v =
      e == 0 ? ldexp(static_cast<double>(m), 1 - f.bias - f.man_bits)
             : ldexp(static_cast<double>(m + (1u << f.man_bits)), static_cast<int>(e) - f.bias - f.man_bits);
  return sign ? -v : v;
}

// x rounded to the format (nearest, ties to even). Out of range: the largest finite value when
// saturating or when the format has nothing else; otherwise infinity (IEEE formats) or NaN.
__host__ __device__ __forceinline__ uint32_t encode(Format f, double x, bool saturate) {
  const bool negative = copysign(1.0, x) < 0.0;
  if (x != x) return nan_bits(f, negative);
  const uint32_t sign = negative ? sign_bit(f) : 0u;
  const double top = max_finite(f);
  const uint32_t e_ones = (1u << f.exp_bits) - 1;
  double a = fabs(x);
  if (a != 0.0 && a != INFINITY) {
    int exp2 = 0;
    frexp(a, &exp2);
    const int emin = 1 - f.bias;  // exponent of the smallest normal
    const int quantum = (exp2 - 1 < emin ? emin : exp2 - 1) - f.man_bits;
    a = ldexp(rint(ldexp(a, -quantum)), quantum);
  }
  if (a > top) {
    if (saturate || f.special == Special::kFinite)
      a = top;
    else if (f.special == Special::kIEEE)
      return sign | (e_ones << f.man_bits);
    else
      return nan_bits(f, negative);
  }
  if (a == 0.0) return f.special == Special::kFNUZ ? 0u : sign;  // FNUZ has no -0
  int exp2 = 0;
  frexp(a, &exp2);
  const int emin = 1 - f.bias;
  if (exp2 - 1 < emin)  // subnormal
    return sign | static_cast<uint32_t>(ldexp(a, f.bias - 1 + f.man_bits));
  const uint32_t e = static_cast<uint32_t>(exp2 - 1 + f.bias);
  const uint32_t m = static_cast<uint32_t>(ldexp(a, f.man_bits - (exp2 - 1))) - (1u << f.man_bits);
  return sign | (e << f.man_bits) | m;
}

// float8 E8M0 (a power of two, 2^(bits - 127); 0xFF is NaN) the way ONNX's Cast makes it from a
// float32: the exponent field kept, rounded up / to nearest / down by the mantissa.
enum class E8M0Round { kUp, kNearest, kDown };

__host__ __device__ __forceinline__ uint32_t encode_e8m0(float x, bool saturate, E8M0Round mode) {
  uint32_t b = 0;
  memcpy(&b, &x, sizeof b);
  uint32_t e = (b >> 23) & 0xFFu;
  if (e == 0xFFu) return 0xFFu;
  bool up = false;
  if (mode == E8M0Round::kUp) {
    up = (b & 0x7FFFFFu) != 0;
  } else if (mode == E8M0Round::kNearest) {
    const bool g = b & 0x400000u, r = b & 0x200000u, s = b & 0x1FFFFFu;
    up = g && (r || s || e > 0);
  }
  if (saturate && e == 0xFEu) up = false;
  return (e + (up ? 1u : 0u)) & 0xFFu;
}

__host__ __device__ __forceinline__ double decode_e8m0(uint32_t bits) {
  return bits == 0xFFu ? NAN : ldexp(1.0, static_cast<int>(bits) - 127);
}

template <class U>
__host__ __device__ __forceinline__ double to_double(const U& x) {
  if constexpr (std::is_arithmetic_v<U>) {
    return static_cast<double>(x);
  } else {
    return static_cast<double>(static_cast<float>(x));
  }
}

template <class U>
__host__ __device__ __forceinline__ int64_t to_int64(const U& x) {
  if constexpr (std::is_integral_v<U>) {
    return static_cast<int64_t>(x);
  } else if constexpr (std::is_floating_point_v<U>) {
    return static_cast<int64_t>(x);  // truncates, like every float -> integer Cast
  } else {
    return static_cast<int64_t>(static_cast<float>(x));
  }
}

}  // namespace narrow

// A floating-point storage type: conversion from any number rounds (ml_dtypes' astype: no
// saturation); reading gives float.
template <int E, int M, int B, narrow::Special S, class Bits>
struct NarrowFloat {
  static constexpr narrow::Format kFormat{E, M, B, S};
  Bits bits;
  NarrowFloat() = default;
  template <class U>
  __host__ __device__ NarrowFloat(const U& x)  // NOLINT: implicit, as for the built-in types
      : bits(static_cast<Bits>(narrow::encode(kFormat, narrow::to_double(x), false))) {}
  __host__ __device__ operator float() const { return static_cast<float>(narrow::decode(kFormat, bits)); }
  // ONNX Cast to a float8 type saturates by default.
  __host__ __device__ static NarrowFloat saturating(double x, bool saturate) {
    NarrowFloat r;
    r.bits = static_cast<Bits>(narrow::encode(kFormat, x, saturate));
    return r;
  }
};

using f16 = NarrowFloat<5, 10, 15, narrow::Special::kIEEE, uint16_t>;
using bf16 = NarrowFloat<8, 7, 127, narrow::Special::kIEEE, uint16_t>;
using f8e4m3fn = NarrowFloat<4, 3, 7, narrow::Special::kFN, uint8_t>;
using f8e4m3fnuz = NarrowFloat<4, 3, 8, narrow::Special::kFNUZ, uint8_t>;
using f8e5m2 = NarrowFloat<5, 2, 15, narrow::Special::kIEEE, uint8_t>;
using f8e5m2fnuz = NarrowFloat<5, 2, 16, narrow::Special::kFNUZ, uint8_t>;
using f4e2m1 = NarrowFloat<2, 1, 1, narrow::Special::kFinite, uint8_t>;
using f6e2m3 = NarrowFloat<2, 3, 1, narrow::Special::kFinite, uint8_t>;
using f6e3m2 = NarrowFloat<3, 2, 3, narrow::Special::kFinite, uint8_t>;

struct f8e8m0 {
  uint8_t bits;
  f8e8m0() = default;
  template <class U>
  __host__ __device__ f8e8m0(const U& x)  // NOLINT: implicit, as for the built-in types
      : bits(static_cast<uint8_t>(
            narrow::encode_e8m0(static_cast<float>(narrow::to_double(x)), true, narrow::E8M0Round::kUp))) {}
  __host__ __device__ operator float() const { return static_cast<float>(narrow::decode_e8m0(bits)); }
  __host__ __device__ static f8e8m0 rounded(float x, bool saturate, narrow::E8M0Round mode) {
    f8e8m0 r;
    r.bits = static_cast<uint8_t>(narrow::encode_e8m0(x, saturate, mode));
    return r;
  }
};

// A 2- or 4-bit integer in one byte: the low bits hold the two's complement value and the high
// bits are zero, as ml_dtypes stores it. From a wider integer: the low bits (ONNX's rule for
// integer narrowing); from a float: truncated, and 0 when that is outside the type's range
// (NaN and infinities too), as ONNX's test data (and ml_dtypes 0.7) have it.
template <int Bits, bool Signed>
struct NarrowInt {
  static constexpr int64_t kMin = Signed ? -(int64_t{1} << (Bits - 1)) : 0;
  static constexpr int64_t kMax = Signed ? (int64_t{1} << (Bits - 1)) - 1 : (int64_t{1} << Bits) - 1;
  uint8_t bits;
  NarrowInt() = default;
  template <class U>
  __host__ __device__ NarrowInt(const U& x)  // NOLINT: implicit, as for the built-in types
      : bits(low_bits(x)) {}
  template <class U>
  __host__ __device__ static uint8_t low_bits(const U& x) {
    int64_t v = 0;
    if constexpr (std::is_integral_v<U>) {
      v = static_cast<int64_t>(x);
    } else {
      const double d = narrow::to_double(x);
      if (!(d > static_cast<double>(kMin) - 1.0 && d < static_cast<double>(kMax) + 1.0)) return 0;
      v = static_cast<int64_t>(d);  // truncates toward zero
    }
    return static_cast<uint8_t>(static_cast<uint64_t>(v) & ((1u << Bits) - 1));
  }
  __host__ __device__ operator int32_t() const {
    const int32_t v = bits;
    return Signed && (v & (1 << (Bits - 1))) ? v - (1 << Bits) : v;
  }
};

using i4 = NarrowInt<4, true>;
using u4 = NarrowInt<4, false>;
using i2 = NarrowInt<2, true>;
using u2 = NarrowInt<2, false>;

// Cast's conversions, with its saturate and round_mode attributes.
template <class T, class U>
__host__ __device__ __forceinline__ T saturate_cast(const U& x, bool saturate) {
  if constexpr (std::is_same_v<T, f8e8m0>) {
    return f8e8m0::rounded(static_cast<float>(narrow::to_double(x)), saturate, narrow::E8M0Round::kUp);
  } else {
    return T::saturating(narrow::to_double(x), saturate);
  }
}

template <class U>
__host__ __device__ __forceinline__ f8e8m0 e8m0_cast(const U& x, bool saturate, narrow::E8M0Round mode) {
  return f8e8m0::rounded(static_cast<float>(narrow::to_double(x)), saturate, mode);
}

}  // namespace flowc
