// CUDA Graphs through stream capture: fork/join capture and replay against direct launches,
// CUDA's capture errors, cudaGraphExecUpdate, a captured library call (gemm), flowc::GraphRunner.
// Usage: graphs                  the semantic checks (PASS/FAIL lines, then "N failures")
//        graphs missing-edge     one replay of a graph whose capture misses an edge, one of
//                                the same graph with the edge: "WRONG|CORRECT missing_edge" etc.
//        graphs runner N         N runs through one GraphRunner (for the launch counters)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "flowc/device.h"
#include "flowc/gemm.h"
#include "flowc/graph.h"

static __global__ void add_scalar(const int* x, int* y, int v, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] + v;
}

static __global__ void scale(const int* x, int* y, int v, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * v;
}

static __global__ void combine(const int* b, const int* c, int* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = b[i] + 3 * c[i];
}

static __global__ void fill(int* x, int v, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = v;
}

// Page-locked host memory: what a captured copy to or from the host should use (only copies
// of pinned memory are stream-ordered asynchronous copies in CUDA).
template <class T>
struct Pinned {
  T* p = nullptr;
  size_t n = 0;
  explicit Pinned(size_t count, T v = T()) : n(count) {
    FLOWC_CHECK(cudaMallocHost(&p, n * sizeof(T)));
    std::fill(p, p + n, v);
  }
  ~Pinned() { cudaFreeHost(p); }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  T* data() const { return p; }
  T* begin() const { return p; }
  T* end() const { return p + n; }
  size_t size() const { return n; }
  T& operator[](size_t i) const { return p[i]; }
  bool operator==(const Pinned& o) const { return n == o.n && std::equal(p, p + n, o.p); }
};

static int failures = 0;
static void expect(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  failures += ok ? 0 : 1;
}

static void expect_err(cudaError_t got, cudaError_t want, const std::string& what) {
  expect(got == want, what + ": " + cudaGetErrorName(got) +
                          (got == want ? "" : " (want " + std::string(cudaGetErrorName(want)) + ")"));
}

constexpr int kN = 2048;
constexpr int kBlock = 128;

struct Buffers {
  int* in = nullptr;  // device copy of the host input
  int* b = nullptr;
  int* c = nullptr;
  int* out = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
  cudaStream_t side = nullptr;
};

// The work under test: out = (in + 1) + 3 * (in * 2), its two halves on two streams.
static int fork_join(Buffers& B, cudaStream_t s, const int* host_in, int* host_out) {
  if (cudaMemcpyAsync(B.in, host_in, kN * sizeof(int), cudaMemcpyHostToDevice, s) != cudaSuccess) return 1;
  if (cudaEventRecord(B.fork, s) != cudaSuccess) return 2;
  if (cudaStreamWaitEvent(B.side, B.fork, 0) != cudaSuccess) return 3;
  FLOWC_LAUNCH(add_scalar, dim3(kN / kBlock), dim3(kBlock), 0, s, B.in, B.b, 1, kN);
  FLOWC_LAUNCH(scale, dim3(kN / kBlock), dim3(kBlock), 0, B.side, B.in, B.c, 2, kN);
  if (cudaEventRecord(B.join, B.side) != cudaSuccess) return 4;
  if (cudaStreamWaitEvent(s, B.join, 0) != cudaSuccess) return 5;
  FLOWC_LAUNCH(combine, dim3(kN / kBlock), dim3(kBlock), 0, s, B.b, B.c, B.out, kN);
  if (cudaMemcpyAsync(host_out, B.out, kN * sizeof(int), cudaMemcpyDeviceToHost, s) != cudaSuccess) return 6;
  return cudaGetLastError() == cudaSuccess ? 0 : 7;
}

static Buffers make_buffers() {
  Buffers B;
  FLOWC_CHECK(cudaMalloc(&B.in, kN * sizeof(int)));
  FLOWC_CHECK(cudaMalloc(&B.b, kN * sizeof(int)));
  FLOWC_CHECK(cudaMalloc(&B.c, kN * sizeof(int)));
  FLOWC_CHECK(cudaMalloc(&B.out, kN * sizeof(int)));
  FLOWC_CHECK(cudaEventCreateWithFlags(&B.fork, cudaEventDisableTiming));
  FLOWC_CHECK(cudaEventCreateWithFlags(&B.join, cudaEventDisableTiming));
  FLOWC_CHECK(cudaStreamCreateWithFlags(&B.side, cudaStreamNonBlocking));
  return B;
}

static bool matches(const Pinned<int>& in, const Pinned<int>& out) {
  for (int i = 0; i < kN; ++i) {
    if (out[i] != (in[i] + 1) + 3 * (in[i] * 2)) return false;
  }
  return true;
}

static void set_input(Pinned<int>& in, int round) {
  for (int i = 0; i < kN; ++i) in[i] = (i * 7 + round * 13) % 101 - 50;
}

// A graph whose side branch reads `a` without an edge to the kernel that writes it.
static int missing_edge() {
  int *a, *c;
  FLOWC_CHECK(cudaMalloc(&a, kN * sizeof(int)));
  FLOWC_CHECK(cudaMalloc(&c, kN * sizeof(int)));
  cudaStream_t s, side;
  FLOWC_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  FLOWC_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaEvent_t fork, join;
  FLOWC_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  FLOWC_CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  Pinned<int> host(kN);
  for (int with_edge = 0; with_edge < 2; ++with_edge) {
    FLOWC_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    FLOWC_CHECK(cudaMemsetAsync(a, 0, kN * sizeof(int), s));
    FLOWC_CHECK(cudaMemsetAsync(c, 0, kN * sizeof(int), s));
    if (with_edge == 0) FLOWC_CHECK(cudaEventRecord(fork, s));  // too early: before a is written
    FLOWC_LAUNCH(fill, dim3(kN / kBlock), dim3(kBlock), 0, s, a, 7, kN);
    if (with_edge == 1) FLOWC_CHECK(cudaEventRecord(fork, s));
    FLOWC_CHECK(cudaStreamWaitEvent(side, fork, 0));
    FLOWC_LAUNCH(add_scalar, dim3(kN / kBlock), dim3(kBlock), 0, side, a, c, 1, kN);
    FLOWC_CHECK(cudaEventRecord(join, side));
    FLOWC_CHECK(cudaStreamWaitEvent(s, join, 0));
    FLOWC_CHECK(cudaMemcpyAsync(host.data(), c, kN * sizeof(int), cudaMemcpyDeviceToHost, s));
    cudaGraph_t g;
    FLOWC_CHECK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t x;
    FLOWC_CHECK(cudaGraphInstantiate(&x, g, 0));
    FLOWC_CHECK(cudaGraphLaunch(x, s));
    FLOWC_CHECK(cudaStreamSynchronize(s));
    bool ok = true;
    for (int v : host) ok &= v == 8;
    std::printf("%s %s\n", ok ? "CORRECT" : "WRONG", with_edge ? "with_edge" : "missing_edge");
    FLOWC_CHECK(cudaGraphExecDestroy(x));
    FLOWC_CHECK(cudaGraphDestroy(g));
  }
  return 0;
}

static int runner_runs(int runs) {
  Buffers B = make_buffers();
  cudaStream_t caller;
  FLOWC_CHECK(cudaStreamCreateWithFlags(&caller, cudaStreamNonBlocking));
  Pinned<int> in(kN), out(kN);
  flowc::GraphRunner runner;
  for (int r = 0; r < runs; ++r) {
    set_input(in, r);
    int ws = 0;
    flowc::Status st = runner.run(
        caller, [&](cudaStream_t s) { return fork_join(B, s, in.data(), out.data()); }, &ws);
    FLOWC_CHECK(cudaStreamSynchronize(caller));
    // The first run is the warm-up (issued directly); the second captures.
    expect(st.ok() && ws == 0 && runner.captured() == (r > 0) && matches(in, out),
           "runner run " + std::to_string(r) + " " + st.message());
  }
  runner.release();
  std::printf("%d failures\n", failures);
  return failures == 0 ? 0 : 1;
}

// Begins a capture of `s` in `mode`, issues one kernel, lets `act` do something, ends the capture.
template <class Act>
static void capture_error(const char* what, cudaStreamCaptureMode mode, cudaError_t act_want,
                          cudaError_t end_want, Act act) {
  int* x;
  FLOWC_CHECK(cudaMalloc(&x, kN * sizeof(int)));
  cudaStream_t s;
  FLOWC_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  FLOWC_CHECK(cudaStreamBeginCapture(s, mode));
  FLOWC_LAUNCH(fill, dim3(kN / kBlock), dim3(kBlock), 0, s, x, 1, kN);
  expect_err(act(s, x), act_want, std::string(what));
  cudaGraph_t g = nullptr;
  const cudaError_t end = cudaStreamEndCapture(s, &g);
  expect_err(end, end_want, std::string(what) + ", then cudaStreamEndCapture");
  if (end_want != cudaSuccess) expect(g == nullptr, std::string(what) + ": no graph");
  if (g != nullptr) FLOWC_CHECK(cudaGraphDestroy(g));
  (void)cudaGetLastError();
  FLOWC_CHECK(cudaStreamDestroy(s));
  FLOWC_CHECK(cudaFree(x));
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "missing-edge") == 0) return missing_edge();
  if (argc > 2 && std::strcmp(argv[1], "runner") == 0) return runner_runs(std::atoi(argv[2]));

  Buffers B = make_buffers();
  cudaStream_t s;
  FLOWC_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Pinned<int> in(kN), direct(kN), replay(kN);

  // Capture once, replay with new inputs (the copy node reads the same host buffer each time).
  FLOWC_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  FLOWC_CHECK(cudaStreamIsCapturing(s, &st));
  expect(st == cudaStreamCaptureStatusActive, "capturing stream reports Active");
  expect(fork_join(B, s, in.data(), replay.data()) == 0, "fork/join work captured");
  FLOWC_CHECK(cudaStreamIsCapturing(B.side, &st));
  expect(st == cudaStreamCaptureStatusActive, "forked stream joined the capture");
  cudaGraph_t graph;
  FLOWC_CHECK(cudaStreamEndCapture(s, &graph));
  FLOWC_CHECK(cudaStreamIsCapturing(B.side, &st));
  expect(st == cudaStreamCaptureStatusNone, "forked stream leaves capture with its origin");
  cudaGraphExec_t exec;
  FLOWC_CHECK(cudaGraphInstantiateWithFlags(&exec, graph, 0));
  bool same = true;
  for (int r = 0; r < 3; ++r) {
    set_input(in, r);
    expect(fork_join(B, s, in.data(), direct.data()) == 0, "direct launches");
    FLOWC_CHECK(cudaStreamSynchronize(s));
    std::fill(replay.begin(), replay.end(), -1);
    FLOWC_CHECK(cudaGraphLaunch(exec, s));
    FLOWC_CHECK(cudaStreamSynchronize(s));
    same &= matches(in, direct) && direct == replay;
  }
  expect(same, "graph replay equals direct launches over 2 streams, 3 inputs");

  // cudaGraphExecUpdate: same topology, other pointers (updates); a different topology (fails).
  {
    Pinned<int> other(kN, 0);
    FLOWC_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    fork_join(B, s, in.data(), other.data());
    cudaGraph_t g2;
    FLOWC_CHECK(cudaStreamEndCapture(s, &g2));
    cudaGraphExecUpdateResultInfo info;
    expect_err(cudaGraphExecUpdate(exec, g2, &info), cudaSuccess, "cudaGraphExecUpdate, same topology");
    FLOWC_CHECK(cudaGraphLaunch(exec, s));
    FLOWC_CHECK(cudaStreamSynchronize(s));
    expect(matches(in, other), "the updated graph writes to the new output");
    FLOWC_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    FLOWC_LAUNCH(fill, dim3(kN / kBlock), dim3(kBlock), 0, s, B.b, 1, kN);
    cudaGraph_t g3;
    FLOWC_CHECK(cudaStreamEndCapture(s, &g3));
    expect_err(cudaGraphExecUpdate(exec, g3, &info), cudaErrorGraphExecUpdateFailure,
               "cudaGraphExecUpdate, other topology");
    expect(info.result == cudaGraphExecUpdateErrorTopologyChanged, "update result: topology changed");
    (void)cudaGetLastError();
    FLOWC_CHECK(cudaGraphDestroy(g2));
    FLOWC_CHECK(cudaGraphDestroy(g3));
  }
  FLOWC_CHECK(cudaGraphExecDestroy(exec));
  FLOWC_CHECK(cudaGraphDestroy(graph));

  // A library call (flowc::gemm) is captured like a kernel: C = A B replays with new A.
  {
    constexpr int m = 3, n = 4, k = 5;
    Pinned<float> a(m * k), b(k * n), c(m * n, -1.0f);
    for (size_t i = 0; i < b.size(); ++i) b[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
    float *da, *db, *dc;
    FLOWC_CHECK(cudaMalloc(&da, a.size() * sizeof(float)));
    FLOWC_CHECK(cudaMalloc(&db, b.size() * sizeof(float)));
    FLOWC_CHECK(cudaMalloc(&dc, c.size() * sizeof(float)));
    FLOWC_CHECK(cudaMemcpy(db, b.data(), b.size() * sizeof(float), cudaMemcpyHostToDevice));
    flowc::BlasHandle h;
    expect(flowc::create_blas(&h).ok(), "create_blas");
    // A handle's first call may not be captured (the libraries initialize lazily): the
    // emulator fails the capture as a cudaMalloc in it would.
    FLOWC_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    flowc::Status cold = flowc::gemm(h, flowc::packed_gemm(m, n, k), da, db, dc, s);
    cudaGraph_t g0 = nullptr;
    expect_err(cudaStreamEndCapture(s, &g0), cudaErrorStreamCaptureInvalidated,
               "a library handle's first call inside a capture");
    expect(!cold.ok() &&
               cold.message().find("operation not permitted when stream is capturing") != std::string::npos,
           "the first call says why: " + cold.message());
    (void)cudaGetLastError();
    // Once warmed up outside a capture, its calls are captured like kernels.
    expect(flowc::gemm(h, flowc::packed_gemm(m, n, k), da, db, dc, s).ok(), "warm-up call");
    FLOWC_CHECK(cudaStreamSynchronize(s));
    FLOWC_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    FLOWC_CHECK(cudaMemcpyAsync(da, a.data(), a.size() * sizeof(float), cudaMemcpyHostToDevice, s));
    flowc::Status gs = flowc::gemm(h, flowc::packed_gemm(m, n, k), da, db, dc, s);
    FLOWC_CHECK(cudaMemcpyAsync(c.data(), dc, c.size() * sizeof(float), cudaMemcpyDeviceToHost, s));
    cudaGraph_t g;
    FLOWC_CHECK(cudaStreamEndCapture(s, &g));
    expect(gs.ok(), "gemm captured " + gs.message());
    cudaGraphExec_t x;
    FLOWC_CHECK(cudaGraphInstantiate(&x, g, 0));
    bool right = true;
    for (int r = 0; r < 2; ++r) {
      for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>((static_cast<int>(i) + r) % 5) - 2.0f;
      FLOWC_CHECK(cudaGraphLaunch(x, s));
      FLOWC_CHECK(cudaStreamSynchronize(s));
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
          float want = 0.0f;
          for (int l = 0; l < k; ++l) want += a[i * k + l] * b[l * n + j];
          right &= std::fabs(c[i * n + j] - want) < 1e-4f;
        }
      }
    }
    expect(right, "captured gemm replays with new inputs");
    FLOWC_CHECK(cudaGraphExecDestroy(x));
    FLOWC_CHECK(cudaGraphDestroy(g));
    flowc::destroy_blas(&h);
  }

  // An unjoined fork.
  {
    FLOWC_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    FLOWC_CHECK(cudaEventRecord(B.fork, s));
    FLOWC_CHECK(cudaStreamWaitEvent(B.side, B.fork, 0));
    FLOWC_LAUNCH(fill, dim3(kN / kBlock), dim3(kBlock), 0, B.side, B.b, 1, kN);
    FLOWC_LAUNCH(fill, dim3(kN / kBlock), dim3(kBlock), 0, s, B.c, 1, kN);
    cudaGraph_t g = nullptr;
    expect_err(cudaStreamEndCapture(s, &g), cudaErrorStreamCaptureUnjoined, "a fork not joined back");
    expect(g == nullptr, "unjoined: no graph");
    FLOWC_CHECK(cudaStreamIsCapturing(B.side, &st));
    expect(st == cudaStreamCaptureStatusNone, "unjoined: the forked stream left the capture");
    (void)cudaGetLastError();
  }
  // Ending the capture on a stream that joined it, not the origin.
  {
    FLOWC_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    FLOWC_CHECK(cudaEventRecord(B.fork, s));
    FLOWC_CHECK(cudaStreamWaitEvent(B.side, B.fork, 0));
    cudaGraph_t g = nullptr;
    expect_err(cudaStreamEndCapture(B.side, &g), cudaErrorStreamCaptureUnmatched,
               "EndCapture on a forked stream");
    expect_err(cudaStreamEndCapture(s, &g), cudaErrorStreamCaptureInvalidated, "then on the origin");
    (void)cudaGetLastError();
  }

  capture_error("cudaStreamSynchronize", cudaStreamCaptureModeGlobal, cudaErrorStreamCaptureUnsupported,
                cudaErrorStreamCaptureInvalidated,
                [](cudaStream_t cs, int*) { return cudaStreamSynchronize(cs); });
  capture_error("cudaDeviceSynchronize", cudaStreamCaptureModeGlobal, cudaErrorStreamCaptureUnsupported,
                cudaErrorStreamCaptureInvalidated,
                [](cudaStream_t, int*) { return cudaDeviceSynchronize(); });
  capture_error("cudaMalloc", cudaStreamCaptureModeGlobal, cudaErrorStreamCaptureUnsupported,
                cudaErrorStreamCaptureInvalidated, [](cudaStream_t, int*) {
                  void* p = nullptr;
                  return cudaMalloc(&p, 64);
                });
  capture_error("cudaFree", cudaStreamCaptureModeGlobal, cudaErrorStreamCaptureUnsupported,
                cudaErrorStreamCaptureInvalidated, [](cudaStream_t, int* x) { return cudaFree(x + 1024); });
  capture_error("cudaMemcpy", cudaStreamCaptureModeGlobal, cudaErrorStreamCaptureUnsupported,
                cudaErrorStreamCaptureInvalidated, [](cudaStream_t, int* x) {
                  int h = 0;
                  return cudaMemcpy(&h, x, sizeof(int), cudaMemcpyDeviceToHost);
                });
  capture_error("a kernel after the capture is invalidated", cudaStreamCaptureModeGlobal,
                cudaErrorStreamCaptureInvalidated, cudaErrorStreamCaptureInvalidated,
                [](cudaStream_t cs, int* x) {
                  (void)cudaStreamSynchronize(cs);
                  (void)cudaGetLastError();
                  FLOWC_LAUNCH(fill, dim3(kN / kBlock), dim3(kBlock), 0, cs, x, 2, kN);
                  return cudaGetLastError();
                });
  capture_error("cudaMalloc in a relaxed capture", cudaStreamCaptureModeRelaxed, cudaSuccess, cudaSuccess,
                [](cudaStream_t, int*) {
                  void* p = nullptr;
                  return cudaMalloc(&p, 64);
                });
  capture_error("cudaMalloc in another thread during a thread-local capture",
                cudaStreamCaptureModeThreadLocal, cudaSuccess, cudaSuccess, [](cudaStream_t, int*) {
                  cudaError_t e = cudaErrorInvalidValue;
                  std::thread t([&e] {
                    void* p = nullptr;
                    e = cudaMalloc(&p, 64);
                  });
                  t.join();
                  return e;
                });
  capture_error("cudaMalloc in another thread during a global capture", cudaStreamCaptureModeGlobal,
                cudaErrorStreamCaptureUnsupported, cudaErrorStreamCaptureInvalidated, [](cudaStream_t, int*) {
                  cudaError_t e = cudaSuccess;
                  std::thread t([&e] {
                    void* p = nullptr;
                    e = cudaMalloc(&p, 64);
                  });
                  t.join();
                  return e;
                });
  capture_error("waiting on an event recorded outside the capture", cudaStreamCaptureModeGlobal,
                cudaErrorStreamCaptureIsolation, cudaErrorStreamCaptureInvalidated,
                [&B](cudaStream_t cs, int*) {
                  FLOWC_CHECK(cudaEventRecord(B.join, B.side));
                  return cudaStreamWaitEvent(cs, B.join, 0);
                });
  capture_error("cudaEventSynchronize on an event recorded in the capture", cudaStreamCaptureModeGlobal,
                cudaErrorCapturedEvent, cudaSuccess, [&B](cudaStream_t cs, int*) {
                  FLOWC_CHECK(cudaEventRecord(B.fork, cs));
                  return cudaEventSynchronize(B.fork);
                });
  // After the capture has ended the event still stands for a graph node: waiting on it or
  // querying it stays an error until it is recorded again outside a capture.
  {
    FLOWC_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    FLOWC_LAUNCH(fill, dim3(kN / kBlock), dim3(kBlock), 0, s, B.b, 1, kN);
    FLOWC_CHECK(cudaEventRecord(B.fork, s));
    cudaGraph_t g = nullptr;
    FLOWC_CHECK(cudaStreamEndCapture(s, &g));
    expect_err(cudaEventSynchronize(B.fork), cudaErrorCapturedEvent,
               "cudaEventSynchronize on an event recorded in a capture that has ended");
    expect_err(cudaEventQuery(B.fork), cudaErrorCapturedEvent,
               "cudaEventQuery on an event recorded in a capture that has ended");
    (void)cudaGetLastError();
    FLOWC_CHECK(cudaEventRecord(B.fork, s));
    expect_err(cudaEventSynchronize(B.fork), cudaSuccess, "the same event recorded again outside a capture");
    FLOWC_CHECK(cudaGraphDestroy(g));
  }
  capture_error("capturing the legacy stream", cudaStreamCaptureModeGlobal, cudaErrorStreamCaptureUnsupported,
                cudaSuccess, [](cudaStream_t, int*) {
                  return cudaStreamBeginCapture(nullptr, cudaStreamCaptureModeGlobal);
                });

  // The legacy default stream while a blocking stream captures.
  {
    cudaStream_t blocking;
    FLOWC_CHECK(cudaStreamCreate(&blocking));
    FLOWC_CHECK(cudaStreamBeginCapture(blocking, cudaStreamCaptureModeGlobal));
    FLOWC_LAUNCH(fill, dim3(kN / kBlock), dim3(kBlock), 0, blocking, B.b, 1, kN);
    expect_err(cudaStreamIsCapturing(nullptr, &st), cudaErrorStreamCaptureImplicit,
               "cudaStreamIsCapturing(legacy) during a blocking capture");
    FLOWC_CHECK(cudaStreamIsCapturing(blocking, &st));
    expect(st == cudaStreamCaptureStatusActive, "which leaves the capture valid");
    (void)cudaGetLastError();
    FLOWC_LAUNCH(fill, dim3(kN / kBlock), dim3(kBlock), 0, nullptr, B.c, 1, kN);
    expect_err(cudaGetLastError(), cudaErrorStreamCaptureImplicit, "a kernel on the legacy stream");
    FLOWC_CHECK(cudaStreamIsCapturing(blocking, &st));
    expect(st == cudaStreamCaptureStatusInvalidated, "invalidates the capture");
    cudaGraph_t g = nullptr;
    expect_err(cudaStreamEndCapture(blocking, &g), cudaErrorStreamCaptureInvalidated,
               "legacy stream, then EndCapture");
    (void)cudaGetLastError();
    FLOWC_CHECK(cudaStreamDestroy(blocking));
  }

  // GraphRunner inside the caller's own capture: the work joins that capture.
  {
    flowc::GraphRunner runner;
    set_input(in, 5);
    FLOWC_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    int ws = 0;
    flowc::Status rs = runner.run(
        s, [&](cudaStream_t cs) { return fork_join(B, cs, in.data(), replay.data()); }, &ws);
    cudaGraph_t g;
    FLOWC_CHECK(cudaStreamEndCapture(s, &g));
    expect(rs.ok() && ws == 0 && !runner.captured(), "runner on a capturing stream issues the work directly");
    cudaGraphExec_t x;
    FLOWC_CHECK(cudaGraphInstantiate(&x, g, 0));
    std::fill(replay.begin(), replay.end(), -1);
    FLOWC_CHECK(cudaGraphLaunch(x, s));
    FLOWC_CHECK(cudaStreamSynchronize(s));
    expect(matches(in, replay), "the caller's graph runs the runner's work");
    FLOWC_CHECK(cudaGraphExecDestroy(x));
    FLOWC_CHECK(cudaGraphDestroy(g));
    // A work that synchronizes cannot be captured: the runner gives the graph up, says why,
    // and issues the work directly, then and on every later run.
    int calls = 0;
    const auto careless = [&calls](cudaStream_t cs) {
      ++calls;
      (void)cudaStreamSynchronize(cs);  // ignored, as careless code would
      return 0;
    };
    flowc::GraphRunner fresh;
    rs = fresh.run(s, careless, &ws);  // the warm-up: direct
    expect(rs.ok() && calls == 1 && fresh.fallback().empty(), "runner's first run is direct");
    rs = fresh.run(s, careless, &ws);  // the capture fails: this run goes out directly
    expect(rs.ok() && !fresh.captured() && cudaGetLastError() == cudaSuccess && calls == 3 &&
               fresh.fallback().find("cudaErrorStreamCaptureInvalidated") != std::string::npos,
           "runner reports a failed capture: " + fresh.fallback());
    rs = fresh.run(s, careless, &ws);
    expect(rs.ok() && calls == 4 && !fresh.captured(), "runner falls back to direct launches");
  }

  std::printf("%d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
