// Kernel tests for the device layer: each runs the kernel and checks it against a plain C++
// reference. Usage: kernels [NAME ...] (default: all). Prints "PASS name" or "FAIL name: why".
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "flowc/device.h"
#include "flowc/philox.h"

static __global__ void vector_add(const float* __restrict__ a, const float* __restrict__ b,
                                  float* __restrict__ c, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) c[i] = a[i] + b[i];
}

// Tree reduction in shared memory, one barrier per level.
static __global__ void block_sum(const float* x, float* out, int n) {
  __shared__ float s[256];
  int t = threadIdx.x;
  int i = blockIdx.x * blockDim.x + t;
  s[t] = i < n ? x[i] : 0.0f;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (t < stride) s[t] += s[t + stride];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = s[0];
}

static __device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

// Warp-shuffle reduction: each warp reduces with shuffles, warp 0 reduces the partials.
static __global__ void warp_shuffle_sum(const float* x, float* out, int n) {
  __shared__ float partial[32];
  int t = threadIdx.x;
  int i = blockIdx.x * blockDim.x + t;
  float v = warp_sum(i < n ? x[i] : 0.0f);
  if ((t & 31) == 0) partial[t / 32] = v;
  __syncthreads();
  if (t < 32) {
    v = t < (int)(blockDim.x / 32) ? partial[t] : 0.0f;
    v = warp_sum(v);
    if (t == 0) out[blockIdx.x] = v;
  }
}

// Broadcast, xor butterfly and ballot/any/all in one warp.
static __global__ void warp_intrinsics(const int* x, int* out) {
  int lane = threadIdx.x;
  int v = x[lane];
  int first = __shfl_sync(0xffffffffu, v, 0);
  int butterfly = v;
  for (int m = 16; m > 0; m /= 2) butterfly += __shfl_xor_sync(0xffffffffu, butterfly, m);
  int up = __shfl_up_sync(0xffffffffu, v, 1);
  int seg = __shfl_sync(0xffffffffu, v, 0, 8);  // width 8: lane 0 of each group of 8
  unsigned ballot = __ballot_sync(0xffffffffu, v > 0);
  int any = __any_sync(0xffffffffu, v > 100);
  int all = __all_sync(0xffffffffu, v > -1000);
  __syncwarp();
  out[lane * 7 + 0] = first;
  out[lane * 7 + 1] = butterfly;
  out[lane * 7 + 2] = up;
  out[lane * 7 + 3] = seg;
  out[lane * 7 + 4] = (int)ballot;
  out[lane * 7 + 5] = any;
  out[lane * 7 + 6] = all;
}

// 32x32 tiles through padded shared memory, 32x8 threads each doing four rows.
constexpr int kTile = 32;
static __global__ void transpose(const float* in, float* out, int rows, int cols) {
  __shared__ float tile[kTile][kTile + 1];
  int x = blockIdx.x * kTile + threadIdx.x;
  int y = blockIdx.y * kTile + threadIdx.y;
  for (int j = 0; j < kTile; j += 8) {
    if (x < cols && y + j < rows) tile[threadIdx.y + j][threadIdx.x] = in[(y + j) * cols + x];
  }
  __syncthreads();
  x = blockIdx.y * kTile + threadIdx.x;
  y = blockIdx.x * kTile + threadIdx.y;
  for (int j = 0; j < kTile; j += 8) {
    if (x < rows && y + j < cols) out[(y + j) * rows + x] = tile[threadIdx.x][threadIdx.y + j];
  }
}

// One block per row: max and sum reduced cooperatively in dynamic shared memory.
static __global__ void softmax_rows(const float* x, float* y, int cols) {
  FLOWC_DYNAMIC_SHARED(float, red);
  const float* row = x + (size_t)blockIdx.x * cols;
  float* out = y + (size_t)blockIdx.x * cols;
  int t = threadIdx.x;
  float m = -INFINITY;
  for (int c = t; c < cols; c += blockDim.x) m = fmaxf(m, row[c]);
  red[t] = m;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s /= 2) {
    if (t < s) red[t] = fmaxf(red[t], red[t + s]);
    __syncthreads();
  }
  m = red[0];
  __syncthreads();
  float sum = 0.0f;
  for (int c = t; c < cols; c += blockDim.x) sum += __expf(row[c] - m);
  red[t] = sum;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s /= 2) {
    if (t < s) red[t] += red[t + s];
    __syncthreads();
  }
  float inv = 1.0f / red[0];
  for (int c = t; c < cols; c += blockDim.x) out[c] = __expf(row[c] - m) * inv;
}

static __global__ void histogram(const unsigned char* data, int n, unsigned* bins) {
  __shared__ unsigned local[256];
  for (int b = threadIdx.x; b < 256; b += blockDim.x) local[b] = 0;
  __syncthreads();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    atomicAdd(&local[data[i]], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < 256; b += blockDim.x) atomicAdd(&bins[b], local[b]);
}

static __global__ void atomic_max_min(const int* x, int n, int* mx, int* mn, float* fsum) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    atomicMax(mx, x[i]);
    atomicMin(mn, x[i]);
    atomicAdd(fsum, 0.5f);
  }
}

// Device math as kernels call it; compared with the host's libm in double.
static __global__ void device_math(const float* x, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v = x[i];
  float* o = out + 10 * i;
  o[0] = expf(v);
  o[1] = __expf(v);
  o[2] = rsqrtf(v + 4.0f);
  o[3] = erff(v);
  o[4] = tanhf(v);
  o[5] = fmaf(v, 2.0f, 1.0f);
  o[6] = __fdividef(v, 3.0f);
  o[7] = max(v, 0.25f) + min(i, 3);
  o[8] = sqrtf(v + 4.0f) + logf(v + 4.0f);
  o[9] = __saturatef(v) + (float)__float2int_rn(v * 2.0f);
}

// -- harness -------------------------------------------------------------------------------------

static unsigned rng_state = 12345u;
static float frand() {
  rng_state = rng_state * 1664525u + 1013904223u;
  return (float)((rng_state >> 8) & 0xffff) / 65536.0f * 2.0f - 1.0f;
}

template <class T>
struct DeviceBuffer {
  T* p = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) { FLOWC_CHECK(cudaMalloc(&p, count * sizeof(T))); }
  ~DeviceBuffer() { cudaFree(p); }
  void upload(const std::vector<T>& h) {
    FLOWC_CHECK(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n);
    FLOWC_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

static bool close(double got, double want, double tol) {
  return std::fabs(got - want) <= tol * (1.0 + std::fabs(want));
}

static std::string test_vector_add() {
  const int n = 100003;
  std::vector<float> a(n), b(n);
  for (int i = 0; i < n; ++i) {
    a[i] = frand();
    b[i] = frand();
  }
  DeviceBuffer<float> da(n), db(n), dc(n);
  da.upload(a);
  db.upload(b);
  FLOWC_LAUNCH(vector_add, dim3((n + 255) / 256), dim3(256), 0, nullptr, da.p, db.p, dc.p, n);
  FLOWC_CHECK(cudaGetLastError());
  auto c = dc.download();
  for (int i = 0; i < n; ++i)
    if (c[i] != a[i] + b[i]) return "mismatch at " + std::to_string(i);
  return "";
}

template <class Launcher>
static std::string check_block_sums(Launcher launch, int n, int threads) {
  std::vector<float> x(n);
  for (auto& v : x) v = frand();
  const int blocks = (n + threads - 1) / threads;
  DeviceBuffer<float> dx(n), dout(blocks);
  dx.upload(x);
  launch(dx.p, dout.p, n, blocks, threads);
  FLOWC_CHECK(cudaGetLastError());
  auto out = dout.download();
  for (int b = 0; b < blocks; ++b) {
    double want = 0;
    for (int i = b * threads; i < std::min(n, (b + 1) * threads); ++i) want += x[i];
    if (!close(out[b], want, 1e-4))
      return "block " + std::to_string(b) + ": " + std::to_string(out[b]) + " != " + std::to_string(want);
  }
  return "";
}

static std::string test_block_reduction() {
  return check_block_sums(
      [](float* x, float* o, int n, int blocks, int threads) {
        FLOWC_LAUNCH(block_sum, dim3(blocks), dim3(threads), 0, nullptr, x, o, n);
      },
      256 * 37 + 11, 256);
}

static std::string test_warp_reduction() {
  return check_block_sums(
      [](float* x, float* o, int n, int blocks, int threads) {
        FLOWC_LAUNCH(warp_shuffle_sum, dim3(blocks), dim3(threads), 0, nullptr, x, o, n);
      },
      512 * 19 + 5, 512);
}

static std::string test_warp_intrinsics() {
  std::vector<int> x(32);
  for (int i = 0; i < 32; ++i) x[i] = (i % 3 == 0) ? -i : i * 2 + 1;
  DeviceBuffer<int> dx(32), dout(32 * 7);
  dx.upload(x);
  FLOWC_LAUNCH(warp_intrinsics, dim3(1), dim3(32), 0, nullptr, dx.p, dout.p);
  auto out = dout.download();
  int total = 0;
  unsigned ballot = 0;
  for (int i = 0; i < 32; ++i) {
    total += x[i];
    if (x[i] > 0) ballot |= 1u << i;
  }
  for (int l = 0; l < 32; ++l) {
    const int* o = &out[l * 7];
    int want[7] = {x[0], total, l == 0 ? x[0] : x[l - 1], x[l & ~7], (int)ballot, 0, 1};
    for (int k = 0; k < 7; ++k) {
      if (o[k] != want[k])
        return "lane " + std::to_string(l) + " item " + std::to_string(k) + ": " + std::to_string(o[k]) +
               " != " + std::to_string(want[k]);
    }
  }
  return "";
}

static std::string test_transpose() {
  const int rows = 77, cols = 45;
  std::vector<float> in(rows * cols);
  for (auto& v : in) v = frand();
  DeviceBuffer<float> din(rows * cols), dout(rows * cols);
  din.upload(in);
  dim3 grid((cols + kTile - 1) / kTile, (rows + kTile - 1) / kTile);
  FLOWC_LAUNCH(transpose, grid, dim3(kTile, 8), 0, nullptr, din.p, dout.p, rows, cols);
  auto out = dout.download();
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      if (out[c * rows + r] != in[r * cols + c])
        return "mismatch at " + std::to_string(r) + "," + std::to_string(c);
  return "";
}

static std::string test_softmax() {
  const int rows = 13, cols = 1000, threads = 128;
  std::vector<float> x(rows * cols);
  for (auto& v : x) v = frand() * 8;
  DeviceBuffer<float> dx(rows * cols), dy(rows * cols);
  dx.upload(x);
  FLOWC_LAUNCH(softmax_rows, dim3(rows), dim3(threads), threads * sizeof(float), nullptr, dx.p, dy.p, cols);
  FLOWC_CHECK(cudaGetLastError());
  auto y = dy.download();
  for (int r = 0; r < rows; ++r) {
    double m = -1e30, s = 0;
    for (int c = 0; c < cols; ++c) m = std::max(m, (double)x[r * cols + c]);
    for (int c = 0; c < cols; ++c) s += std::exp(x[r * cols + c] - m);
    for (int c = 0; c < cols; ++c) {
      double want = std::exp(x[r * cols + c] - m) / s;
      if (std::fabs(y[r * cols + c] - want) > 1e-6)
        return "row " + std::to_string(r) + " col " + std::to_string(c);
    }
  }
  return "";
}

static std::string test_histogram() {
  const int n = 1 << 18;
  std::vector<unsigned char> data(n);
  std::vector<unsigned> want(256, 0);
  for (int i = 0; i < n; ++i) {
    data[i] = (unsigned char)((i * 2654435761u) >> 13);
    want[data[i]]++;
  }
  DeviceBuffer<unsigned char> dd(n);
  DeviceBuffer<unsigned> dbins(256);
  dd.upload(data);
  FLOWC_CHECK(cudaMemset(dbins.p, 0, 256 * sizeof(unsigned)));
  FLOWC_LAUNCH(histogram, dim3(64), dim3(256), 0, nullptr, dd.p, n, dbins.p);
  auto bins = dbins.download();
  for (int b = 0; b < 256; ++b)
    if (bins[b] != want[b]) return "bin " + std::to_string(b);
  const int m = 5000;
  std::vector<int> x(m);
  for (int i = 0; i < m; ++i) x[i] = (int)((i * 7919) % 10007) - 5000;
  DeviceBuffer<int> dx(m), dmx(1), dmn(1);
  DeviceBuffer<float> dsum(1);
  dx.upload(x);
  dmx.upload({-(1 << 30)});
  dmn.upload({1 << 30});
  dsum.upload({0.0f});
  FLOWC_LAUNCH(atomic_max_min, dim3((m + 127) / 128), dim3(128), 0, nullptr, dx.p, m, dmx.p, dmn.p, dsum.p);
  int mx = *std::max_element(x.begin(), x.end()), mn = *std::min_element(x.begin(), x.end());
  if (dmx.download()[0] != mx || dmn.download()[0] != mn) return "atomicMax/atomicMin";
  if (dsum.download()[0] != 0.5f * m) return "atomicAdd(float)";
  return "";
}

static std::string test_device_math() {
  const int n = 200;
  std::vector<float> x(n);
  for (int i = 0; i < n; ++i) x[i] = -3.0f + 6.0f * i / (n - 1);
  DeviceBuffer<float> dx(n), dout(10 * n);
  dx.upload(x);
  FLOWC_LAUNCH(device_math, dim3(2), dim3(128), 0, nullptr, dx.p, dout.p, n);
  auto o = dout.download();
  for (int i = 0; i < n; ++i) {
    double v = x[i];
    double want[10] = {std::exp(v),
                       std::exp(v),
                       1.0 / std::sqrt(v + 4.0),
                       std::erf(v),
                       std::tanh(v),
                       v * 2.0 + 1.0,
                       v / 3.0,
                       std::max(v, 0.25) + std::min(i, 3),
                       std::sqrt(v + 4.0) + std::log(v + 4.0),
                       std::min(std::max(v, 0.0), 1.0) + std::nearbyint(x[i] * 2.0f)};
    for (int k = 0; k < 10; ++k) {
      if (!close(o[10 * i + k], want[k], 1e-5))
        return "x=" + std::to_string(v) + " function " + std::to_string(k);
    }
  }
  return "";
}

// Philox4x32-10 on the device: Random123's known answers (kat_vectors: counter, key, result),
// and 4096 blocks equal to the host's computation of the same function.
static __global__ void philox_blocks(const uint32_t* in, uint32_t* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const uint32_t* c = in + 6 * i;
  const flowc::philox::Block b = flowc::philox::philox4x32_10(c[0], c[1], c[2], c[3], c[4], c[5]);
  for (int k = 0; k < 4; ++k) out[4 * i + k] = b.v[k];
}

static std::string test_philox() {
  const uint32_t known[3][10] = {
      {0, 0, 0, 0, 0, 0, 0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u},
      {~0u, ~0u, ~0u, ~0u, ~0u, ~0u, 0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu},
      {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u, 0xd16cfe09u, 0x94fdccebu,
       0x5001e420u, 0x24126ea1u},
  };
  const int n = 4096 + 3;
  std::vector<uint32_t> in(6 * n), want(4 * n);
  for (int i = 0; i < n; ++i) {
    uint32_t* c = &in[6 * i];
    if (i < 3) {
      for (int k = 0; k < 6; ++k) c[k] = known[i][k];
      for (int k = 0; k < 4; ++k) want[4 * i + k] = known[i][6 + k];
      continue;
    }
    const uint32_t words[6] = {uint32_t(i), 7u, uint32_t(i) * 2654435761u, 0u, 0x1234u, uint32_t(i >> 3)};
    for (int k = 0; k < 6; ++k) c[k] = words[k];
    const flowc::philox::Block b = flowc::philox::philox4x32_10(c[0], c[1], c[2], c[3], c[4], c[5]);
    for (int k = 0; k < 4; ++k) want[4 * i + k] = b.v[k];
  }
  DeviceBuffer<uint32_t> din(6 * n), dout(4 * n);
  din.upload(in);
  FLOWC_LAUNCH(philox_blocks, dim3((n + 127) / 128), dim3(128), 0, nullptr, din.p, dout.p, n);
  const std::vector<uint32_t> got = dout.download();
  for (int i = 0; i < 4 * n; ++i) {
    if (got[i] != want[i]) return (i < 12 ? "known answer " : "block ") + std::to_string(i / 4);
  }
  if (flowc::philox::to_unit_float(~0u) >= 1.0f || flowc::philox::to_unit_float(0u) != 0.0f)
    return "to_unit_float";
  return "";
}

struct Test {
  const char* name;
  std::string (*fn)();
};

int main(int argc, char** argv) {
  const Test tests[] = {
      {"vector_add", test_vector_add},
      {"block_reduction", test_block_reduction},
      {"warp_reduction", test_warp_reduction},
      {"warp_intrinsics", test_warp_intrinsics},
      {"transpose", test_transpose},
      {"softmax", test_softmax},
      {"histogram", test_histogram},
      {"device_math", test_device_math},
      {"philox", test_philox},
  };
  int failed = 0, ran = 0;
  for (const Test& t : tests) {
    bool selected = argc < 2;
    for (int i = 1; i < argc; ++i) selected |= std::strcmp(argv[i], t.name) == 0;
    if (!selected) continue;
    ++ran;
    std::string why = t.fn();
    if (why.empty()) {
      std::printf("PASS %s\n", t.name);
    } else {
      std::printf("FAIL %s: %s\n", t.name, why.c_str());
      ++failed;
    }
  }
  std::printf("%d passed, %d failed\n", ran - failed, failed);
  return failed == 0 && ran > 0 ? 0 : 1;
}
