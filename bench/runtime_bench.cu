// Emulator figures (host build, one core): barrier-free kernel throughput against a plain C++
// loop doing the same work, measured in the same run, and block barriers per second for a
// 256-thread block reduction.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "flowc/device.h"

static __global__ void saxpy(int n, float a, const float* __restrict__ x, float* __restrict__ y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

static __global__ void block_sum(const float* x, float* out) {
  __shared__ float s[256];
  int t = threadIdx.x;
  s[t] = x[blockIdx.x * blockDim.x + t];
  __syncthreads();
  for (int stride = 128; stride > 0; stride /= 2) {
    if (t < stride) s[t] += s[t + stride];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = s[0];
}

template <class F>
static double best_seconds(int reps, F f) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

int main() {
  omp_set_num_threads(1);
  const int n = 1 << 24;
  std::vector<float> hx(n, 1.0f), hy(n, 2.0f);
  float *x, *y;
  FLOWC_CHECK(cudaMalloc(&x, n * sizeof(float)));
  FLOWC_CHECK(cudaMalloc(&y, n * sizeof(float)));
  FLOWC_CHECK(cudaMemcpy(x, hx.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  FLOWC_CHECK(cudaMemcpy(y, hy.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  const double t_kernel = best_seconds(5, [&] {
    FLOWC_LAUNCH(saxpy, dim3((n + 255) / 256), dim3(256), 0, nullptr, n, 0.5f, x, y);
    FLOWC_CHECK(cudaDeviceSynchronize());
  });
  float* px = hx.data();
  float* py = hy.data();
  const double t_loop = best_seconds(5, [&] {
    for (int i = 0; i < n; ++i) py[i] = 0.5f * px[i] + py[i];
    asm volatile("" : : "r"(py) : "memory");  // keep the loop
  });
  std::printf("barrier-free kernel (saxpy, %d elements, 256-thread blocks, 1 core):\n", n);
  std::printf("  emulator %.2f ms, plain C++ loop %.2f ms, ratio %.2fx\n", t_kernel * 1e3, t_loop * 1e3,
              t_kernel / t_loop);

  const int blocks = 4096;
  float* out;
  FLOWC_CHECK(cudaMalloc(&out, blocks * sizeof(float)));
  const double t_red = best_seconds(3, [&] {
    FLOWC_LAUNCH(block_sum, dim3(blocks), dim3(256), 0, nullptr, x, out);
    FLOWC_CHECK(cudaDeviceSynchronize());
  });
  const double barriers = blocks * 9.0;  // one after the load, eight tree levels
  std::printf("256-thread block reduction (%d blocks, 9 barriers each, 1 core):\n", blocks);
  std::printf("  %.0f block barriers per second (%.2f us per barrier)\n", barriers / t_red,
              t_red / barriers * 1e6);
  cudaFree(x);
  cudaFree(y);
  cudaFree(out);
  return 0;
}
