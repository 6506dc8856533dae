// Runtime API semantics: stream order, events, the legacy default stream, host functions,
// launch-limit errors, error strings, FLOWC_CHECK. Usage: streams [check-fails|plain-sync].
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "flowc/device.h"

static __global__ void add_one(int* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1;
}

static __global__ void times_two(int* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= 2;
}

static __global__ void big_shared(float* out) {
  FLOWC_DYNAMIC_SHARED(float, s);
  s[threadIdx.x] = (float)threadIdx.x;
  __syncthreads();
  out[threadIdx.x] = s[blockDim.x - 1 - threadIdx.x];
}

// Only blocks after the first cross a barrier: not allowed on the barrier-free path.
static __global__ void late_barrier(int* x) {
  if (blockIdx.x > 0) __syncthreads();
  x[blockIdx.x] = 1;
}

static void host_append(void* p) { static_cast<std::vector<int>*>(p)->push_back(7); }

static int failures = 0;
static void expect(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  failures += ok ? 0 : 1;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "check-fails") == 0) {
    void* p = nullptr;
    FLOWC_CHECK(cudaMalloc(&p, 16));
    FLOWC_CHECK(cudaMemcpy(p, p, 16, static_cast<cudaMemcpyKind>(42)));
    return 0;
  }
  if (argc > 1 && std::strcmp(argv[1], "plain-sync") == 0) {
    int* x;
    FLOWC_CHECK(cudaMalloc(&x, 8 * sizeof(int)));
    FLOWC_LAUNCH(late_barrier, dim3(8), dim3(32), 0, nullptr, x);
    FLOWC_CHECK(cudaDeviceSynchronize());
    return 0;
  }
  const int n = 4096;
  int* d;
  FLOWC_CHECK(cudaMalloc(&d, n * sizeof(int)));
  std::vector<int> h(n, 1);

  // One stream runs in order: (1 + 1) * 2 + 1 = 5, never 4 or 6.
  cudaStream_t s1, s2;
  FLOWC_CHECK(cudaStreamCreate(&s1));
  FLOWC_CHECK(cudaStreamCreate(&s2));
  FLOWC_CHECK(cudaMemcpyAsync(d, h.data(), n * sizeof(int), cudaMemcpyHostToDevice, s1));
  FLOWC_LAUNCH(add_one, dim3(n / 256), dim3(256), 0, s1, d, n);
  FLOWC_LAUNCH(times_two, dim3(n / 256), dim3(256), 0, s1, d, n);
  FLOWC_LAUNCH(add_one, dim3(n / 256), dim3(256), 0, s1, d, n);
  std::vector<int> got(n, 0);
  FLOWC_CHECK(cudaMemcpyAsync(got.data(), d, n * sizeof(int), cudaMemcpyDeviceToHost, s1));
  FLOWC_CHECK(cudaStreamSynchronize(s1));
  bool all5 = true;
  for (int v : got) all5 &= v == 5;
  expect(all5, "stream order");

  // Cross-stream order through an event, timed.
  cudaEvent_t start, done;
  FLOWC_CHECK(cudaEventCreate(&start));
  FLOWC_CHECK(cudaEventCreate(&done));
  FLOWC_CHECK(cudaEventRecord(start, s1));
  FLOWC_LAUNCH(times_two, dim3(n / 256), dim3(256), 0, s1, d, n);  // 10
  FLOWC_CHECK(cudaEventRecord(done, s1));
  FLOWC_CHECK(cudaStreamWaitEvent(s2, done, 0));
  FLOWC_LAUNCH(add_one, dim3(n / 256), dim3(256), 0, s2, d, n);  // 11
  float ms = -1;
  expect(cudaEventElapsedTime(&ms, start, done) == cudaErrorNotReady,
         "elapsed time before completion is not ready");
  FLOWC_CHECK(cudaGetLastError());
  FLOWC_CHECK(cudaEventSynchronize(done));
  FLOWC_CHECK(cudaEventElapsedTime(&ms, start, done));
  expect(ms >= 0.0f, "elapsed time");
  FLOWC_CHECK(cudaStreamSynchronize(s2));
  FLOWC_CHECK(cudaMemcpy(got.data(), d, n * sizeof(int), cudaMemcpyDeviceToHost));
  bool all11 = true;
  for (int v : got) all11 &= v == 11;
  expect(all11, "event orders streams");

  // The legacy default stream orders with blocking streams both ways.
  FLOWC_LAUNCH(add_one, dim3(n / 256), dim3(256), 0, s1, d, n);         // 12
  FLOWC_LAUNCH(times_two, dim3(n / 256), dim3(256), 0, nullptr, d, n);  // 24
  FLOWC_LAUNCH(add_one, dim3(n / 256), dim3(256), 0, s2, d, n);         // 25
  FLOWC_CHECK(cudaDeviceSynchronize());
  FLOWC_CHECK(cudaMemcpy(got.data(), d, n * sizeof(int), cudaMemcpyDeviceToHost));
  bool all25 = true;
  for (int v : got) all25 &= v == 25;
  expect(all25, "legacy default stream");

  // Waiting on an event that was never recorded does not wait; host functions run in order.
  cudaEvent_t never;
  FLOWC_CHECK(cudaEventCreate(&never));
  FLOWC_CHECK(cudaStreamWaitEvent(s1, never, 0));
  std::vector<int> trace;
  FLOWC_CHECK(cudaLaunchHostFunc(s1, host_append, &trace));
  expect(trace.empty(), "host function deferred until synchronization");
  FLOWC_CHECK(cudaStreamSynchronize(s1));
  expect(trace.size() == 1 && trace[0] == 7, "host function ran");

  // Launch limits, reported as CUDA reports them.
  FLOWC_LAUNCH(add_one, dim3(1), dim3(1025), 0, s1, d, n);
  cudaError_t e = cudaGetLastError();
  expect(e == cudaErrorInvalidConfiguration, std::string("1025 threads: ") + cudaGetErrorString(e));
  expect(cudaGetLastError() == cudaSuccess, "cudaGetLastError resets");
  FLOWC_LAUNCH(add_one, dim3(0), dim3(32), 0, s1, d, n);
  expect(cudaGetLastError() == cudaErrorInvalidConfiguration, "empty grid");
  FLOWC_LAUNCH(add_one, dim3(1, 65536), dim3(32), 0, s1, d, n);
  expect(cudaGetLastError() == cudaErrorInvalidConfiguration, "grid.y > 65535");
  FLOWC_LAUNCH(add_one, dim3(1), dim3(8, 8, 65), 0, s1, d, n);
  expect(cudaGetLastError() == cudaErrorInvalidConfiguration, "block.z > 64");
  float* out;
  FLOWC_CHECK(cudaMalloc(&out, 1024 * sizeof(float)));
  const size_t big = 64 * 1024;
  FLOWC_LAUNCH(big_shared, dim3(1), dim3(1024), big, s1, out);
  expect(cudaGetLastError() == cudaErrorInvalidConfiguration,
         "64 KiB dynamic shared memory without opting in");
  expect(cudaFuncSetAttribute(big_shared, cudaFuncAttributeMaxDynamicSharedMemorySize, 300 * 1024) ==
             cudaErrorInvalidValue,
         "more than 227 KiB cannot be opted in");
  expect(cudaGetLastError() == cudaErrorInvalidValue, "a failed call is the last error");
  FLOWC_CHECK(cudaFuncSetAttribute(big_shared, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)big));
  FLOWC_LAUNCH(big_shared, dim3(1), dim3(1024), big, s1, out);
  FLOWC_CHECK(cudaGetLastError());
  std::vector<float> hout(1024);
  FLOWC_CHECK(cudaMemcpy(hout.data(), out, 1024 * sizeof(float), cudaMemcpyDeviceToHost));
  expect(hout[0] == 1023.0f && hout[1023] == 0.0f, "64 KiB dynamic shared memory after opting in");
  expect(std::string(cudaGetErrorString(cudaErrorInvalidValue)) == "invalid argument", "error strings");
  expect(cudaStreamDestroy(nullptr) == cudaErrorInvalidResourceHandle,
         "the default stream cannot be destroyed");
  cudaGetLastError();

  FLOWC_CHECK(cudaEventDestroy(start));
  FLOWC_CHECK(cudaEventDestroy(done));
  FLOWC_CHECK(cudaEventDestroy(never));
  FLOWC_CHECK(cudaStreamDestroy(s1));
  FLOWC_CHECK(cudaStreamDestroy(s2));
  FLOWC_CHECK(cudaFree(d));
  FLOWC_CHECK(cudaFree(out));
  std::printf("%d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
