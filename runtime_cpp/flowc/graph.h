// flowc::GraphRunner: runs a piece of stream work as one CUDA Graph, on both targets (nvcc with
// CUDA's runtime, and the host emulator, which implements the same capture API).
//
// How a generated model uses it:
//
//   struct model { ...; flowc::GraphRunner graph; };             // one per model
//
//   // run(): the work is everything one run queues, written against the stream it is given
//   // (other compute streams fork from it and join back into it by events). Its pointers are
//   // baked into the graph, so it must read and write the same buffers every run: the
//   // caller's inputs are copied into staging buffers before, outputs copied out after.
//   // Copies to or from host memory inside the work should use pinned (cudaMallocHost)
//   // memory: only those are stream-ordered asynchronous copies in CUDA, which is what a
//   // graph's copy node replays.
//   int work_status = 0;
//   flowc::Status st = m->graph.run(stream, [&](cudaStream_t s) { return run_schedule(m, s); },
//                                   &work_status);
//   if (work_status != 0) return work_status;                  // the work's own failure
//   if (!st.ok()) return fail(m, st.message());                // capture / instantiate / launch
//
//   // destroy(): m->graph.release() (or let the destructor do it) before the streams and
//   // buffers the graph uses are freed.
//
// The first run() issues the work directly on the caller's stream: a warm-up, so that what
// the libraries do on their first call (cuBLASLt's and cuDNN's lazy initialization, loading
// kernel modules, allocating) happens outside any capture. The second run() captures the work
// on a private non-blocking stream (ThreadLocal capture mode: this thread's unsafe calls, such
// as cudaMalloc, fail the capture; other threads are not disturbed), instantiates it once and
// launches it on the caller's stream; later runs only launch it (one cudaGraphLaunch, no kernel
// launches). A capture that fails for a reason other than the work's own failure is not tried
// again: that run and every later one issue the work directly, and fallback() says why. When
// the caller's stream is itself capturing (the caller builds its own graph), the work is issued
// directly on that stream so that it becomes part of the caller's capture. With
// `enabled = false` (flowc's --no-cuda-graph) run() always issues the work directly.
#pragma once

#include <string>
#include <utility>

#include "flowc/device.h"
#include "flowc/status.h"

namespace flowc {

class GraphRunner {
 public:
  explicit GraphRunner(bool enabled = true) : enabled_(enabled) {}
  GraphRunner(const GraphRunner&) = delete;
  GraphRunner& operator=(const GraphRunner&) = delete;
  ~GraphRunner() { release(); }

  // Queues `work` (callable as int(cudaStream_t), 0 meaning success) on `stream`, through the
  // graph. `*work_status` (if given) receives work's result when it ran this call, else 0; a
  // failing work is not kept as a graph, so the next call captures again.
  template <class Work>
  Status run(cudaStream_t stream, Work&& work, int* work_status = nullptr) {
    if (work_status != nullptr) *work_status = 0;
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    if (cudaError_t e = cudaStreamIsCapturing(stream, &capturing); e != cudaSuccess) {
      return fail("querying the capture state of the caller's stream", e);
    }
    if (!enabled_ || !fallback_.empty() || capturing != cudaStreamCaptureStatusNone || !warm_) {
      Status st = direct(stream, work, work_status);
      // A warm-up counts once the work has run without failing.
      if (st.ok() && capturing == cudaStreamCaptureStatusNone) warm_ = true;
      return st;
    }
    if (exec_ == nullptr) {
      Status st = capture(work, work_status);
      if (work_status != nullptr && *work_status != 0) return st;
      if (!st.ok()) {
        // The graph is given up, not the run: the work goes out directly from now on.
        fallback_ = st.message();
        return direct(stream, work, work_status);
      }
    }
    if (cudaError_t e = cudaGraphLaunch(exec_, stream); e != cudaSuccess) {
      return fail("launching the CUDA graph", e);
    }
    return Status::Ok();
  }

  // Whether a graph has been captured and instantiated.
  bool captured() const { return exec_ != nullptr; }
  // The work has run outside a capture already (the owner warmed its libraries up): the next
  // run() may capture at once.
  void mark_warm() { warm_ = true; }
  // Why the runner gave up its graph and issues the work directly ("" while it has not).
  const std::string& fallback() const { return fallback_; }

  // Drops the graph (the next run captures again) and the private stream. Launches already
  // queued still complete: CUDA (and the emulator) defer freeing an executing graph.
  void release() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    exec_ = nullptr;
    if (capture_stream_ != nullptr) cudaStreamDestroy(capture_stream_);
    capture_stream_ = nullptr;
  }

 private:
  template <class Work>
  static Status direct(cudaStream_t stream, Work& work, int* work_status) {
    const int rc = work(stream);
    if (work_status != nullptr) *work_status = rc;
    if (rc != 0) return LibraryError("the work failed with status " + std::to_string(rc));
    return Status::Ok();
  }

  template <class Work>
  Status capture(Work& work, int* work_status) {
    if (capture_stream_ == nullptr) {
      if (cudaError_t e = cudaStreamCreateWithFlags(&capture_stream_, cudaStreamNonBlocking);
          e != cudaSuccess) {
        capture_stream_ = nullptr;
        return fail("creating the capture stream", e);
      }
    }
    if (cudaError_t e = cudaStreamBeginCapture(capture_stream_, cudaStreamCaptureModeThreadLocal);
        e != cudaSuccess) {
      return fail("beginning the capture", e);
    }
    const int rc = work(capture_stream_);
    if (work_status != nullptr) *work_status = rc;
    // Always ended, so the stream leaves capture mode whatever the work did.
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(capture_stream_, &graph);
    if (rc != 0 || ended != cudaSuccess) {
      if (graph != nullptr) cudaGraphDestroy(graph);
      // The capture's errors are reported here, not left for the caller's next
      // cudaGetLastError to mistake for a kernel's.
      (void)cudaGetLastError();
      if (rc != 0)
        return LibraryError("the work failed with status " + std::to_string(rc) + " while captured");
      return fail(
          "capturing the run into a CUDA graph (a synchronizing call, an allocation, "
          "the legacy default stream or a stream not joined back during the run?)",
          ended);
    }
    const cudaError_t made = cudaGraphInstantiate(&exec_, graph, 0);
    cudaGraphDestroy(graph);  // the executable graph keeps its own copy
    if (made != cudaSuccess) {
      exec_ = nullptr;
      return fail("instantiating the CUDA graph", made);
    }
    return Status::Ok();
  }

  static Status fail(const char* what, cudaError_t e) {
    (void)cudaGetLastError();
    return LibraryError(std::string(what) + " failed: " + cudaGetErrorString(e) + " (" + cudaGetErrorName(e) +
                        ")");
  }

  bool enabled_ = true;
  bool warm_ = false;     // the work has run once outside a capture
  std::string fallback_;  // why captures stopped (a failed capture), "" while they go on
  cudaStream_t capture_stream_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace flowc
