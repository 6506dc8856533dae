// Races the emulator must expose. Each case prints "CORRECT name" or "WRONG name"; under
// FLOWC_SIM_ORDER=reverse or shuffle:SEED the buggy variants must come out WRONG every time,
// the fixed variants CORRECT.
#include <cstdio>
#include <cstring>
#include <vector>

#include "flowc/device.h"

// Sum of 256 values; `with_barrier` selects the correct version.
static __global__ void reduce256(const float* x, float* out, int with_barrier) {
  __shared__ float s[256];
  int t = threadIdx.x;
  s[t] = x[t];
  if (with_barrier) __syncthreads();
  for (int stride = 128; stride > 0; stride /= 2) {
    if (t < stride) s[t] += s[t + stride];
    __syncthreads();
  }
  if (t == 0) *out = s[0];
}

static __global__ void fill(float* buf, int n, float value) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) buf[i] = value;
}

static __global__ void scale_into(const float* src, float* dst, int n, float k) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = src[i] * k;
}

static bool barrier_case(int with_barrier) {
  std::vector<float> x(256);
  for (int i = 0; i < 256; ++i) x[i] = (float)(i + 1);
  float *dx, *dout;
  FLOWC_CHECK(cudaMalloc(&dx, 256 * sizeof(float)));
  FLOWC_CHECK(cudaMalloc(&dout, sizeof(float)));
  FLOWC_CHECK(cudaMemcpy(dx, x.data(), 256 * sizeof(float), cudaMemcpyHostToDevice));
  FLOWC_LAUNCH(reduce256, dim3(1), dim3(256), 0, nullptr, dx, dout, with_barrier);
  float got = 0;
  FLOWC_CHECK(cudaMemcpy(&got, dout, sizeof(float), cudaMemcpyDeviceToHost));
  FLOWC_CHECK(cudaFree(dx));
  FLOWC_CHECK(cudaFree(dout));
  return got == 256.0f * 257.0f / 2.0f;
}

// Producer on stream a fills a buffer; consumer on stream b reads it. With the event, b waits.
static bool event_case(int with_event) {
  const int n = 1 << 14;
  float *buf, *out;
  FLOWC_CHECK(cudaMalloc(&buf, n * sizeof(float)));
  FLOWC_CHECK(cudaMalloc(&out, n * sizeof(float)));
  FLOWC_CHECK(cudaMemset(buf, 0, n * sizeof(float)));
  cudaStream_t a, b;
  cudaEvent_t produced;
  FLOWC_CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  FLOWC_CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  FLOWC_CHECK(cudaEventCreateWithFlags(&produced, cudaEventDisableTiming));
  FLOWC_LAUNCH(fill, dim3(n / 256), dim3(256), 0, a, buf, n, 3.0f);
  FLOWC_CHECK(cudaEventRecord(produced, a));
  if (with_event) FLOWC_CHECK(cudaStreamWaitEvent(b, produced, 0));
  FLOWC_LAUNCH(scale_into, dim3(n / 256), dim3(256), 0, b, buf, out, n, 2.0f);
  FLOWC_CHECK(cudaDeviceSynchronize());
  std::vector<float> h(n);
  FLOWC_CHECK(cudaMemcpy(h.data(), out, n * sizeof(float), cudaMemcpyDeviceToHost));
  bool ok = true;
  for (float v : h) ok &= v == 6.0f;
  FLOWC_CHECK(cudaEventDestroy(produced));
  FLOWC_CHECK(cudaStreamDestroy(a));
  FLOWC_CHECK(cudaStreamDestroy(b));
  FLOWC_CHECK(cudaFree(buf));
  FLOWC_CHECK(cudaFree(out));
  return ok;
}

int main(int argc, char** argv) {
  const char* which = argc > 1 ? argv[1] : "all";
  auto report = [](const char* name, bool ok) { std::printf("%s %s\n", ok ? "CORRECT" : "WRONG", name); };
  if (!std::strcmp(which, "all") || !std::strcmp(which, "barrier")) {
    report("missing_barrier", barrier_case(0));
    report("with_barrier", barrier_case(1));
  }
  if (!std::strcmp(which, "all") || !std::strcmp(which, "event")) {
    report("missing_event", event_case(0));
    report("with_event", event_case(1));
  }
  return 0;
}
