// CUDA's kernel-side vocabulary for host builds: qualifiers, built-in indices, barriers, warp
// intrinsics, atomics and device math, all mapped onto the emulator.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "flowc/host/emulator.h"

#define __global__
#define __device__
#define __host__
#define __noinline__ __attribute__((noinline))
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __constant__
// One OS thread runs one block at a time and all of that block's fibers, so thread-local
// storage is exactly per-block storage.
#define __shared__ static thread_local
#define __align__(n) __attribute__((aligned(n)))

#define threadIdx (::flowc::sim::tl_cur->thread_idx)
#define blockIdx (::flowc::sim::tl_cur->block_idx)
#define blockDim (::flowc::sim::tl_cur->block_dim)
#define gridDim (::flowc::sim::tl_cur->grid_dim)
#define warpSize 32

__attribute__((noinline)) inline void __syncthreads() { ::flowc::sim::syncthreads(); }
__attribute__((noinline)) inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::flowc::sim::syncwarp(mask);
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// -- warp intrinsics ----------------------------------------------------------------------------

template <class T>
__attribute__((noinline)) T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  return ::flowc::sim::shfl_from("__shfl_sync()", mask, var, src_lane, width);
}

template <class T>
__attribute__((noinline)) T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  const int lane = static_cast<int>(::flowc::sim::lane_id());
  return ::flowc::sim::shfl_rel("__shfl_xor_sync()", mask, var, lane ^ lane_mask, width);
}

template <class T>
__attribute__((noinline)) T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  const int lane = static_cast<int>(::flowc::sim::lane_id());
  return ::flowc::sim::shfl_rel("__shfl_down_sync()", mask, var, lane + static_cast<int>(delta), width);
}

template <class T>
__attribute__((noinline)) T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  const int lane = static_cast<int>(::flowc::sim::lane_id());
  return ::flowc::sim::shfl_rel("__shfl_up_sync()", mask, var, lane - static_cast<int>(delta), width);
}

__attribute__((noinline)) inline unsigned __ballot_sync(unsigned mask, int pred) {
  return ::flowc::sim::exchange("__ballot_sync()", mask, pred != 0,
                                [](const uint64_t* slots, unsigned lanes) {
                                  unsigned bits = 0;
                                  for (unsigned l = 0; l < 32; ++l) {
                                    if (((lanes >> l) & 1u) && slots[l]) bits |= 1u << l;
                                  }
                                  return bits;
                                });
}

inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }

inline int __all_sync(unsigned mask, int pred) {
  const unsigned live = ::flowc::sim::tl_cur->block->warps[::flowc::sim::tl_cur->linear / 32].live_mask;
  const unsigned bits = __ballot_sync(mask, pred);
  return bits == (mask & live);
}

inline unsigned __activemask() { return 0xffffffffu; }

// -- atomics (real atomics: blocks run concurrently) -------------------------------------------

template <class T>
inline T flowc_atomic_rmw_cas(T* addr, T (*op)(T, T), T val) {
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  U* a = reinterpret_cast<U*>(addr);
  U old = __atomic_load_n(a, __ATOMIC_RELAXED);
  for (;;) {
    T cur;
    std::memcpy(&cur, &old, sizeof(T));
    T next = op(cur, val);
    U nbits;
    std::memcpy(&nbits, &next, sizeof(T));
    if (__atomic_compare_exchange_n(a, &old, nbits, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) return cur;
  }
}

#define FLOWC_INT_ATOMICS(T)                                                                       \
  inline T atomicAdd(T* a, T v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }             \
  inline T atomicSub(T* a, T v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }             \
  inline T atomicAnd(T* a, T v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }             \
  inline T atomicOr(T* a, T v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }               \
  inline T atomicXor(T* a, T v) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); }             \
  inline T atomicExch(T* a, T v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }           \
  inline T atomicMax(T* a, T v) {                                                                  \
    return flowc_atomic_rmw_cas<T>(                                                                \
        a, [](T x, T y) { return x > y ? x : y; }, v);                                             \
  }                                                                                                \
  inline T atomicMin(T* a, T v) {                                                                  \
    return flowc_atomic_rmw_cas<T>(                                                                \
        a, [](T x, T y) { return x < y ? x : y; }, v);                                             \
  }                                                                                                \
  inline T atomicCAS(T* a, T expected, T desired) {                                                \
    __atomic_compare_exchange_n(a, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
    return expected;                                                                               \
  }

FLOWC_INT_ATOMICS(int)
FLOWC_INT_ATOMICS(unsigned)
FLOWC_INT_ATOMICS(unsigned long long)
FLOWC_INT_ATOMICS(long long)
#undef FLOWC_INT_ATOMICS

inline float atomicAdd(float* a, float v) {
  return flowc_atomic_rmw_cas<float>(
      a, [](float x, float y) { return x + y; }, v);
}
inline double atomicAdd(double* a, double v) {
  return flowc_atomic_rmw_cas<double>(
      a, [](double x, double y) { return x + y; }, v);
}
inline float atomicExch(float* a, float v) {
  return flowc_atomic_rmw_cas<float>(
      a, [](float, float y) { return y; }, v);
}
inline float atomicMax(float* a, float v) {
  return flowc_atomic_rmw_cas<float>(
      a, [](float x, float y) { return x > y ? x : y; }, v);
}
inline float atomicMin(float* a, float v) {
  return flowc_atomic_rmw_cas<float>(
      a, [](float x, float y) { return x < y ? x : y; }, v);
}

// -- device math --------------------------------------------------------------------------------

inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __tanf(float x) { return std::tan(x); }
inline float __powf(float x, float y) { return std::pow(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fmaf_rn(float x, float y, float z) { return std::fma(x, y, z); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.0f / std::sqrt(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline int __float2int_rn(float x) { return static_cast<int>(std::nearbyint(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline float __int2float_rn(int x) { return static_cast<float>(x); }
inline int __float_as_int(float x) {
  int i;
  std::memcpy(&i, &x, 4);
  return i;
}
inline unsigned __float_as_uint(float x) {
  unsigned i;
  std::memcpy(&i, &x, 4);
  return i;
}
inline float __int_as_float(int i) {
  float x;
  std::memcpy(&x, &i, 4);
  return x;
}
inline float __uint_as_float(unsigned i) {
  float x;
  std::memcpy(&x, &i, 4);
  return x;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
  return (x >> 16) | (x << 16);
}
template <class T>
inline T __ldg(const T* p) {
  return *p;
}

// CUDA's global min/max overloads for mixed device code.
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
