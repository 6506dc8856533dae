// flowc's device layer: the one header kernels and drivers include.
//
// Kernels are ordinary CUDA C++. Launches go through FLOWC_LAUNCH and dynamic shared memory
// through FLOWC_DYNAMIC_SHARED; everything that differs between the CUDA build (nvcc) and the
// host build (g++ -DFLOWC_HOST, the SIMT emulator) lives in the runtime headers, so kernel
// sources never test FLOWC_HOST or __CUDA_ARCH__.
#pragma once

#include <cstdio>
#include <cstdlib>

#if defined(FLOWC_HOST)

#include "flowc/host/cuda_api.h"
#include "flowc/host/device_functions.h"

// A template kernel goes in parentheses: FLOWC_LAUNCH((scale<float, 4>), grid, block, 0, s, ...).
#define FLOWC_LAUNCH(kernel, grid, block, shared_bytes, stream, ...) \
  ::flowc::sim::launch<&kernel>(#kernel, (grid), (block), (shared_bytes), (stream), ##__VA_ARGS__)
#define FLOWC_DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(::flowc::sim::dynamic_shared())
#define FLOWC_TARGET_NAME "host"
#define FLOWC_UNROLL

namespace flowc {
// Whether this is the host emulator's build: for what a program decides by target without an
// #if of its own (the host's GEMMs and convolutions need no library workspace).
constexpr bool kHostTarget = true;
}  // namespace flowc
#else

#include <cuda_runtime.h>

#define FLOWC_LAUNCH(kernel, grid, block, shared_bytes, stream, ...) \
  kernel<<<(grid), (block), (shared_bytes), (stream)>>>(__VA_ARGS__)
#define FLOWC_DYNAMIC_SHARED(T, name)                                 \
  extern __shared__ __align__(16) unsigned char flowc_dynamic_smem[]; \
  T* name = reinterpret_cast<T*>(flowc_dynamic_smem)
#define FLOWC_TARGET_NAME "cuda"
namespace flowc {
constexpr bool kHostTarget = false;
}  // namespace flowc
   // `#pragma unroll` for a loop in a kernel (per-lane arrays then stay in registers); only in
   // nvcc's device pass, since the host compiler would warn about an unknown pragma.
#if defined(__CUDA_ARCH__)
#define FLOWC_UNROLL _Pragma("unroll")
#else
#define FLOWC_UNROLL
#endif

#endif

// For drivers and tests: report file:line and CUDA's error string, then exit non-zero.
// Library code returns a status instead and never exits the process.
#define FLOWC_CHECK(call)                                                                     \
  do {                                                                                        \
    cudaError_t flowc_check_err_ = (call);                                                    \
    if (flowc_check_err_ != cudaSuccess) {                                                    \
      std::fprintf(stderr, "%s:%d: %s failed: %s (%s)\n", __FILE__, __LINE__, #call,          \
                   cudaGetErrorString(flowc_check_err_), cudaGetErrorName(flowc_check_err_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)
