// Scalar functions the generated element-wise kernels call, for float, double and integers.
// One definition serves both builds.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "flowc/device.h"

namespace flowc {
namespace ew {

// Cast to T: static_cast, except from a floating type to an integer one, which C++ leaves
// undefined out of range and which flowc defines the same on both targets: truncated toward
// zero, saturated to T's range (what the GPU's cvt.rzi.sat does), and NaN -> 0.
template <class T, class S>
__host__ __device__ inline T cast(S x) {
  if constexpr (std::is_integral<T>::value && !std::is_same<T, bool>::value && !std::is_integral<S>::value) {
    using U = typename std::make_unsigned<T>::type;
    constexpr T kMax = std::is_signed<T>::value ? T(U(~U(0)) >> 1) : T(~U(0));
    constexpr T kMin = std::is_signed<T>::value ? T(-kMax - 1) : T(0);
    double v;
    if constexpr (std::is_same<S, double>::value) {
      v = x;
    } else {
      v = static_cast<double>(static_cast<float>(x));
    }
    if (v != v) return T(0);
    // double(kMax) of a 64-bit type rounds up to 2^63 or 2^64, which is itself out of range.
    if (v >= static_cast<double>(kMax)) return kMax;
    if (v <= static_cast<double>(kMin)) return kMin;
    return static_cast<T>(v);
  } else {
    return static_cast<T>(x);
  }
}

// Four elements moved as one aligned unit: one 128-bit load or store for float.
template <class T>
struct alignas(4 * sizeof(T)) Vec4 {
  T v[4];
};

// May every pointer be read as Vec4 of its element type?
template <class... P>
__device__ __forceinline__ bool vec4_aligned(const P*... p) {
  return ((reinterpret_cast<uintptr_t>(p) % (4 * sizeof(P)) == 0) && ...);
}

template <class T>
__device__ __forceinline__ T abs_(T x) {
  return x < T(0) ? T(-x) : x;
}
__device__ __forceinline__ float abs_(float x) { return fabsf(x); }
__device__ __forceinline__ double abs_(double x) { return fabs(x); }

#define FLOWC_UNARY_MATH(name, ff, df)                             \
  __device__ __forceinline__ float name(float x) { return ff(x); } \
  __device__ __forceinline__ double name(double x) { return df(x); }
FLOWC_UNARY_MATH(exp_, expf, exp)
FLOWC_UNARY_MATH(log_, logf, log)
FLOWC_UNARY_MATH(sqrt_, sqrtf, sqrt)
FLOWC_UNARY_MATH(erf_, erff, erf)
FLOWC_UNARY_MATH(tanh_, tanhf, tanh)
FLOWC_UNARY_MATH(floor_, floorf, floor)
FLOWC_UNARY_MATH(ceil_, ceilf, ceil)
FLOWC_UNARY_MATH(rint_, rintf, rint)
FLOWC_UNARY_MATH(sin_, sinf, sin)
FLOWC_UNARY_MATH(cos_, cosf, cos)
FLOWC_UNARY_MATH(tan_, tanf, tan)
FLOWC_UNARY_MATH(asin_, asinf, asin)
FLOWC_UNARY_MATH(acos_, acosf, acos)
FLOWC_UNARY_MATH(atan_, atanf, atan)
FLOWC_UNARY_MATH(sinh_, sinhf, sinh)
FLOWC_UNARY_MATH(cosh_, coshf, cosh)
FLOWC_UNARY_MATH(asinh_, asinhf, asinh)
FLOWC_UNARY_MATH(acosh_, acoshf, acosh)
FLOWC_UNARY_MATH(atanh_, atanhf, atanh)
FLOWC_UNARY_MATH(log1p_, log1pf, log1p)
FLOWC_UNARY_MATH(expm1_, expm1f, expm1)
#undef FLOWC_UNARY_MATH

__device__ __forceinline__ float pow_(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double pow_(double x, double y) { return pow(x, y); }
template <class T>
__device__ __forceinline__ T pow_(T x, T y) {
  return static_cast<T>(pow(static_cast<double>(x), static_cast<double>(y)));
}

template <class T>
__device__ __forceinline__ T fmod_(T x, T y) {
  return y == T(0) ? T(0) : T(x % y);
}
__device__ __forceinline__ float fmod_(float x, float y) { return fmodf(x, y); }

// ONNX Pow lets the exponent have another type: compute in floating point, return the base's.
template <class T, class U>
__device__ __forceinline__ T pow2_(T x, U y) {
  return static_cast<T>(pow(static_cast<double>(x), static_cast<double>(y)));
}
__device__ __forceinline__ float pow2_(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double fmod_(double x, double y) { return fmod(x, y); }

template <class T>
__device__ __forceinline__ bool isnan_(T x) {
  return x != x;
}
template <class T>
__device__ __forceinline__ bool isinf_(T x, bool pos, bool neg) {
  return (pos && x == T(INFINITY)) || (neg && x == T(-INFINITY));
}

// NaN-propagating max/min, as ONNX Max/Min/Relu and NumPy's maximum/minimum behave.
template <class T>
__device__ __forceinline__ T max_(T a, T b) {
  return (a != a || a > b) ? a : b;
}
template <class T>
__device__ __forceinline__ T min_(T a, T b) {
  return (a != a || a < b) ? a : b;
}

template <class T>
__device__ __forceinline__ T relu(T x) {
  return x < T(0) ? T(0) : x;
}
template <class T>
__device__ __forceinline__ T sigmoid(T x) {
  return T(1) / (T(1) + exp_(-x));
}
template <class T>
__device__ __forceinline__ T softplus(T x) {
  return x > T(0) ? x + log1p_(exp_(-x)) : log1p_(exp_(x));
}
template <class T>
__device__ __forceinline__ T sign_(T x) {
  return x > T(0) ? T(1) : (x < T(0) ? T(-1) : T(0));
}
template <class T>
__device__ __forceinline__ T clip(T x, T lo, T hi) {
  return min_(max_(x, lo), hi);
}
template <class T>
__device__ __forceinline__ T gelu(T x) {
  return T(0.5) * x * (T(1) + erf_(x * T(0.70710678118654752440)));
}
template <class T>
__device__ __forceinline__ T gelu_tanh(T x) {
  return T(0.5) * x * (T(1) + tanh_(T(0.79788456080286535588) * (x + T(0.044715) * x * x * x)));
}

// C division truncates toward zero, as ONNX integer Div does; floats divide as usual.
template <class T>
__device__ __forceinline__ T div_(T a, T b) {
  return b == T(0) ? T(0) : a / b;
}
__device__ __forceinline__ float div_(float a, float b) { return a / b; }
__device__ __forceinline__ double div_(double a, double b) { return a / b; }

// Python-style integer modulo (the sign of the divisor), ONNX Mod with fmod=0.
template <class T>
__device__ __forceinline__ T mod_(T a, T b) {
  if (b == T(0)) return T(0);
  T r = a % b;
  return (r != T(0) && ((r < T(0)) != (b < T(0)))) ? T(r + b) : r;
}
// A product rounded on its own, never fused with a following add into an FMA (nvcc contracts
// a * b - c by default; g++ for x86-64 does not), where a kernel must round as a reference
// that multiplies and subtracts in two steps does.
#if defined(FLOWC_HOST)
__device__ __forceinline__ float mul_rn(float a, float b) { return a * b; }
__device__ __forceinline__ double mul_rn(double a, double b) { return a * b; }
#else
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
#endif

// ONNX BitShift: a shift by the type's width or more (a negative amount counts as a huge
// unsigned one) empties a left shift and leaves only the sign after a right shift, as NumPy
// does; C++ leaves those undefined.
template <class T, class U>
__device__ __forceinline__ T shl_(T x, U y) {
  using UT = std::make_unsigned_t<T>;
  const auto n = static_cast<std::make_unsigned_t<U>>(y);
  return n >= sizeof(T) * 8 ? T(0) : static_cast<T>(static_cast<UT>(x) << n);
}
template <class T, class U>
__device__ __forceinline__ T shr_(T x, U y) {
  const auto n = static_cast<std::make_unsigned_t<U>>(y);
  if (n >= sizeof(T) * 8) return x < T(0) ? T(-1) : T(0);
  return static_cast<T>(x >> n);
}

// Floats: NumPy's np.mod (ONNX Mod with fmod=0), infinities and zeros included.
template <class F>
__device__ __forceinline__ F float_mod_(F a, F b) {
  const F r = fmod(a, b);
  if (b == F(0)) return r;  // NaN
  if (r != F(0)) return (b < F(0)) != (r < F(0)) ? F(r + b) : r;
  return copysign(F(0), b);
}
__device__ __forceinline__ float mod_(float a, float b) { return float_mod_(a, b); }
__device__ __forceinline__ double mod_(double a, double b) { return float_mod_(a, b); }

}  // namespace ew
}  // namespace flowc
