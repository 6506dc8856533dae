// flowc/trace.h on two streams, as a generated model uses it: a run forks stream 1 from stream 0
// after the base event, issues actors on both (the last one on stream 0 waits for stream 1's
// last), and flushes after synchronizing. tests/test_bench_trace.py reads the trace file.
//
// Usage: trace [RANK] — with RANK, the recorder is told it is that rank of a multi-rank
// program (the file name gets ".rank<RANK>"). Runs 0 and 1 are synchronized and flushed one by
// one; runs 2 and 3 are queued together and flushed once (only run 3 can be written).
#include <cstdio>
#include <cstdlib>

#include "flowc/device.h"
#include "flowc/trace.h"

// Enough arithmetic per thread that an actor takes a measurable time in the emulator too.
static __global__ void busy(float* x, int n, int iters) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v = x[i];
  for (int k = 0; k < iters; ++k) v = v * 0.999f + 0.001f;
  x[i] = v;
}

static const int kNumActors = 6;
// A quote, a backslash, a tab, é (U+00E9), 😀 (U+1F600) and a stray byte: escaped on output.
static const char* const kNames[kNumActors] = {
    "a0", "b0", "a1", "b1 \"q\" \\ \t \xc3\xa9 \xf0\x9f\x98\x80 \xff", "a2", "join",
};
static const int kStreams[kNumActors] = {0, 1, 0, 1, 0, 0};
// The order the host issues the actors in, not their id order: stream 0 runs a1 a0 a2 join,
// stream 1 runs b0 b1.
static const int kIssue[kNumActors] = {1, 2, 0, 3, 4, 5};

static void one_run(flowc::trace::Recorder& tr, cudaStream_t s[2], cudaEvent_t fork, cudaEvent_t join,
                    float* x[2], int n) {
  tr.begin_run(s[0]);
  FLOWC_CHECK(cudaEventRecord(fork, s[0]));
  FLOWC_CHECK(cudaStreamWaitEvent(s[1], fork, 0));
  for (int k = 0; k < kNumActors; ++k) {
    const int a = kIssue[k], st = kStreams[a];
    if (a == 5) FLOWC_CHECK(cudaStreamWaitEvent(s[0], join, 0));
    tr.begin(a, s[st]);
    FLOWC_LAUNCH(busy, dim3((n + 127) / 128), dim3(128), 0, s[st], x[st], n, 64 * (a + 1));
    tr.end(a, s[st]);
    if (a == 3) FLOWC_CHECK(cudaEventRecord(join, s[1]));
  }
}

int main(int argc, char** argv) {
  const int rank = argc > 1 ? std::atoi(argv[1]) : 0;
  const int n = 4096;
  cudaStream_t s[2];
  cudaEvent_t fork, join;
  float* x[2];
  for (int k = 0; k < 2; ++k) {
    FLOWC_CHECK(cudaStreamCreateWithFlags(&s[k], cudaStreamNonBlocking));
    FLOWC_CHECK(cudaMalloc(&x[k], n * sizeof(float)));
    FLOWC_CHECK(cudaMemset(x[k], 0, n * sizeof(float)));
  }
  FLOWC_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  FLOWC_CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  flowc::trace::Recorder tr;
  const flowc::Status st = tr.open(kNames, kStreams, kNumActors, rank, argc > 1);
  if (!st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.message().c_str());
    return 1;
  }
  std::printf("enabled=%d\n", tr.enabled() ? 1 : 0);
  for (int r = 0; r < 4; ++r) {
    one_run(tr, s, fork, join, x, n);
    if (r == 2) continue;  // run 2 stays queued under run 3
    FLOWC_CHECK(cudaStreamSynchronize(s[0]));
    flowc::Status fs = tr.flush();
    if (fs.ok()) fs = tr.flush();  // nothing new: writes nothing
    if (!fs.ok()) {
      std::fprintf(stderr, "error: %s\n", fs.message().c_str());
      return 1;
    }
  }
  tr.close();
  for (int k = 0; k < 2; ++k) {
    FLOWC_CHECK(cudaFree(x[k]));
    FLOWC_CHECK(cudaStreamDestroy(s[k]));
  }
  FLOWC_CHECK(cudaEventDestroy(fork));
  FLOWC_CHECK(cudaEventDestroy(join));
  std::printf("done\n");
  return 0;
}
