// Exceptions thrown and caught inside kernels that cross barriers, for AddressSanitizer.
//
// A throw unwinds frames without running their epilogues, so ASan unpoisons the stack below
// the catch itself (__asan_handle_no_return). On a fiber it must know which stack it is on:
// unannotated, it refuses ("ASan is ignoring requested __asan_handle_no_return"), the
// thrower's redzones stay poisoned, and the next frame on that memory (big() after the
// barrier, or the next block's fiber on the same stack) is reported as a stack overflow.
// Prints "PASS fiber_exceptions" when every thread computed what it should. With the argument
// `overflow`, a kernel writes one element past its buffer after a barrier: a real bug ASan
// must report.
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "flowc/device.h"

static __device__ __noinline__ int thrower(int i) {
  volatile char tmp[64];
  for (int j = 0; j < 64; ++j) tmp[j] = static_cast<char>(i + j);
  if (i % 3 == 0) throw std::runtime_error("multiple of three");
  return tmp[5];
}

static __device__ __noinline__ int parse(int i) {
  try {
    return thrower(i);
  } catch (const std::exception&) {
    return -1;
  }
}

static __device__ __noinline__ int big(int i) {
  volatile char buf[1024];
  for (int j = 0; j < 1024; ++j) buf[j] = static_cast<char>(i ^ j);
  return buf[i % 1024];
}

static __global__ void exceptions_across_barriers(int* out) {
  __shared__ int s[256];
  s[threadIdx.x] = parse(threadIdx.x);
  __syncthreads();
  const int next = (threadIdx.x + 1) % blockDim.x;
  out[blockIdx.x * blockDim.x + threadIdx.x] = s[next] + big(threadIdx.x);
}

static __global__ void out_of_bounds_after_barrier(int* out, int n) {
  __shared__ int s[256];
  s[threadIdx.x] = threadIdx.x;
  __syncthreads();
  if (threadIdx.x == 5) out[n] = s[0];
}

int main(int argc, char** argv) {
  const int blocks = 16, threads = 256;
  int* d = nullptr;
  FLOWC_CHECK(cudaMalloc(&d, blocks * threads * sizeof(int)));
  if (argc > 1 && std::strcmp(argv[1], "overflow") == 0) {
    FLOWC_LAUNCH(out_of_bounds_after_barrier, dim3(blocks), dim3(threads), 0, 0, d, blocks * threads);
    FLOWC_CHECK(cudaDeviceSynchronize());
    std::printf("no report\n");
    return 0;
  }
  FLOWC_LAUNCH(exceptions_across_barriers, dim3(blocks), dim3(threads), 0, 0, d);
  FLOWC_CHECK(cudaDeviceSynchronize());
  static int h[blocks * threads];
  FLOWC_CHECK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
  FLOWC_CHECK(cudaFree(d));
  int wrong = 0;
  for (int b = 0; b < blocks; ++b) {
    for (int t = 0; t < threads; ++t) {
      const int next = (t + 1) % threads;
      const int parsed = next % 3 == 0 ? -1 : static_cast<char>(next + 5);
      const int want = parsed + static_cast<char>(t ^ (t % 1024));
      wrong += h[b * threads + t] != want;
    }
  }
  std::printf("%s fiber_exceptions\n", wrong == 0 ? "PASS" : "FAIL");
  return wrong == 0 ? 0 : 1;
}
