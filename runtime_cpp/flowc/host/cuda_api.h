// The CUDA runtime API subset flowc's programs use, under CUDA's own names, for host builds.
#pragma once

#include "flowc/host/streams.h"

namespace flowc {
namespace sim {

inline bool valid_kind(cudaMemcpyKind k) { return k >= cudaMemcpyHostToHost && k <= cudaMemcpyDefault; }

// Every call that takes the engine's lock goes through here.
template <class F>
inline auto locked(F f) {
  Engine& E = engine();
  std::lock_guard<std::recursive_mutex> lock(E.mu);
  return f(E);
}

}  // namespace sim
}  // namespace flowc

inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer:
      return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection:
      return "invalid copy direction for memcpy";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotReady:
      return "device not ready";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure";
    case cudaErrorIllegalState:
      return "the operation cannot be performed in the present state";
    case cudaErrorStreamCaptureUnsupported:
      return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
      return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureMerge:
      return "operation would result in a merge of separate capture sequences";
    case cudaErrorStreamCaptureUnmatched:
      return "capture was not ended in the same stream as it began";
    case cudaErrorStreamCaptureUnjoined:
      return "capturing stream has unjoined work";
    case cudaErrorStreamCaptureIsolation:
      return "dependency created on uncaptured work in another stream";
    case cudaErrorStreamCaptureImplicit:
      return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorCapturedEvent:
      return "operation not permitted on an event last recorded in a capturing stream";
    case cudaErrorStreamCaptureWrongThread:
      return "attempt to terminate a thread-local capture sequence from another thread";
    case cudaErrorGraphExecUpdateFailure:
      return "the graph update was not performed because it included changes which violated constraints "
             "specific to instantiated graph update";
  }
  return "unrecognized error code";
}

inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer:
      return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection:
      return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorIllegalState:
      return "cudaErrorIllegalState";
    case cudaErrorStreamCaptureUnsupported:
      return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated:
      return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureMerge:
      return "cudaErrorStreamCaptureMerge";
    case cudaErrorStreamCaptureUnmatched:
      return "cudaErrorStreamCaptureUnmatched";
    case cudaErrorStreamCaptureUnjoined:
      return "cudaErrorStreamCaptureUnjoined";
    case cudaErrorStreamCaptureIsolation:
      return "cudaErrorStreamCaptureIsolation";
    case cudaErrorStreamCaptureImplicit:
      return "cudaErrorStreamCaptureImplicit";
    case cudaErrorCapturedEvent:
      return "cudaErrorCapturedEvent";
    case cudaErrorStreamCaptureWrongThread:
      return "cudaErrorStreamCaptureWrongThread";
    case cudaErrorGraphExecUpdateFailure:
      return "cudaErrorGraphExecUpdateFailure";
  }
  return "cudaErrorUnknown";
}

inline cudaError_t cudaGetLastError() {
  cudaError_t e = flowc::sim::tl_last_error;
  flowc::sim::tl_last_error = cudaSuccess;
  return e;
}

inline cudaError_t cudaPeekAtLastError() { return flowc::sim::tl_last_error; }

inline cudaError_t cudaGetDeviceCount(int* n) {
  if (n == nullptr) return flowc::sim::set_error(cudaErrorInvalidValue);
  *n = 1;
  return cudaSuccess;
}

inline cudaError_t cudaSetDevice(int d) {
  return d == 0 ? cudaSuccess : flowc::sim::set_error(cudaErrorInvalidDevice);
}

inline cudaError_t cudaGetDevice(int* d) {
  if (d == nullptr) return flowc::sim::set_error(cudaErrorInvalidValue);
  *d = 0;
  return cudaSuccess;
}

// -- memory -------------------------------------------------------------------------------------

inline cudaError_t cudaMalloc(void** p, size_t bytes) {
  if (p == nullptr) return flowc::sim::set_error(cudaErrorInvalidValue);
  if (cudaError_t e = flowc::sim::locked([](flowc::sim::Engine& E) { return E.check_unsafe(); });
      e != cudaSuccess)
    return flowc::sim::set_error(e);
  // 256-byte alignment, as cudaMalloc guarantees; never null, even for 0 bytes.
  *p = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + (bytes == 0 ? 256 : 0));
  return *p ? cudaSuccess : flowc::sim::set_error(cudaErrorMemoryAllocation);
}

template <class T>
inline cudaError_t cudaMalloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}

inline cudaError_t cudaMallocHost(void** p, size_t bytes) { return cudaMalloc(p, bytes); }

template <class T>
inline cudaError_t cudaMallocHost(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}

inline cudaError_t cudaFree(void* p) {
  // cudaFree waits for all work, which may still read the buffer.
  cudaError_t e = flowc::sim::locked([](flowc::sim::Engine& E) {
    cudaError_t u = E.check_unsafe();
    if (u == cudaSuccess) E.drain_all();
    return u;
  });
  if (e != cudaSuccess) return flowc::sim::set_error(e);
  std::free(p);
  return cudaSuccess;
}

inline cudaError_t cudaFreeHost(void* p) { return cudaFree(p); }

inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                                   cudaStream_t stream = nullptr) {
  using namespace flowc::sim;
  if (!valid_kind(kind)) return set_error(cudaErrorInvalidMemcpyDirection);
  if (bytes > 0 && (dst == nullptr || src == nullptr)) return set_error(cudaErrorInvalidValue);
  return locked([&](Engine& E) {
    Stream* s = E.resolve(stream);
    if (!E.known(s)) return set_error(cudaErrorInvalidResourceHandle);
    Op op;
    op.host = [dst, src, bytes] { std::memmove(dst, src, bytes); };
    return set_error(E.submit(s, std::move(op), GraphNode::kMemcpy));
  });
}

inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  using namespace flowc::sim;
  // A synchronous call would wait for work being captured, which never runs as such.
  if (cudaError_t u = locked([](Engine& E) { return E.check_unsafe(); }); u != cudaSuccess)
    return set_error(u);
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, nullptr);
  if (e != cudaSuccess) return e;
  return locked([](Engine& E) {
    E.drain_all();
    return cudaSuccess;
  });
}

inline cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t stream = nullptr) {
  using namespace flowc::sim;
  if (bytes > 0 && dst == nullptr) return set_error(cudaErrorInvalidValue);
  return locked([&](Engine& E) {
    Stream* s = E.resolve(stream);
    if (!E.known(s)) return set_error(cudaErrorInvalidResourceHandle);
    Op op;
    op.host = [dst, value, bytes] { std::memset(dst, value, bytes); };
    return set_error(E.submit(s, std::move(op), GraphNode::kMemset));
  });
}

inline cudaError_t cudaMemset(void* dst, int value, size_t bytes) {
  using namespace flowc::sim;
  // A synchronous call would wait for work being captured, which never runs as such.
  if (cudaError_t u = locked([](Engine& E) { return E.check_unsafe(); }); u != cudaSuccess)
    return set_error(u);
  cudaError_t e = cudaMemsetAsync(dst, value, bytes, nullptr);
  if (e != cudaSuccess) return e;
  return locked([](Engine& E) {
    E.drain_all();
    return cudaSuccess;
  });
}

inline cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* user_data) {
  using namespace flowc::sim;
  if (fn == nullptr) return set_error(cudaErrorInvalidValue);
  return locked([&](Engine& E) {
    Stream* s = E.resolve(stream);
    if (!E.known(s)) return set_error(cudaErrorInvalidResourceHandle);
    Op op;
    op.host = [fn, user_data] { fn(user_data); };
    return set_error(E.submit(s, std::move(op), GraphNode::kHost));
  });
}

// -- streams ------------------------------------------------------------------------------------

inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* out, unsigned flags) {
  using namespace flowc::sim;
  if (out == nullptr || (flags & ~1u) != 0) return set_error(cudaErrorInvalidValue);
  return locked([&](Engine& E) {
    auto* s = new Stream();
    s->id = E.next_id++;
    s->blocking = (flags & cudaStreamNonBlocking) == 0;
    E.streams.push_back(s);
    *out = s;
    return cudaSuccess;
  });
}

inline cudaError_t cudaStreamCreate(cudaStream_t* out) {
  return cudaStreamCreateWithFlags(out, cudaStreamDefault);
}

inline cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  using namespace flowc::sim;
  return locked([&](Engine& E) {
    Stream* s = E.resolve(stream);
    if (!E.known(s)) return set_error(cudaErrorInvalidResourceHandle);
    if (s->capture != nullptr) {
      E.invalidate(s->capture);
      return set_error(cudaErrorStreamCaptureUnsupported);
    }
    if (cudaError_t e = E.check_legacy(s); e != cudaSuccess) return set_error(e);
    E.drain([s] { return s->ops.empty(); });
    return cudaSuccess;
  });
}

inline cudaError_t cudaStreamQuery(cudaStream_t stream) {
  // Deferred work only moves at synchronization points; a query is one, so polling loops end.
  return cudaStreamSynchronize(stream);
}

inline cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  using namespace flowc::sim;
  return locked([&](Engine& E) {
    Stream* s = E.resolve(stream);
    if (s == &E.legacy || !E.known(s)) return set_error(cudaErrorInvalidResourceHandle);
    if (s->capture != nullptr) {  // its capture would lose a stream it may still need joined
      E.invalidate(s->capture);
      return set_error(cudaErrorStreamCaptureUnsupported);
    }
    E.drain([s] { return s->ops.empty(); });  // CUDA finishes a destroyed stream's work
    E.streams.erase(std::find(E.streams.begin(), E.streams.end(), s));
    delete s;
    return cudaSuccess;
  });
}

inline cudaError_t cudaDeviceSynchronize() {
  using namespace flowc::sim;
  return locked([](Engine& E) {
    // It would wait for the capturing streams, whose work never runs as such.
    if (!E.captures.empty()) {
      for (auto& c : E.captures) E.invalidate(c.get());
      return set_error(cudaErrorStreamCaptureUnsupported);
    }
    E.drain_all();
    return cudaSuccess;
  });
}

// -- events -------------------------------------------------------------------------------------

inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* out, unsigned flags) {
  using namespace flowc::sim;
  if (out == nullptr || (flags & ~3u) != 0) return set_error(cudaErrorInvalidValue);
  auto* e = new Event();
  e->timing = (flags & cudaEventDisableTiming) == 0;
  *out = e;
  return cudaSuccess;
}

inline cudaError_t cudaEventCreate(cudaEvent_t* out) {
  return cudaEventCreateWithFlags(out, cudaEventDefault);
}

inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  if (e == nullptr) return flowc::sim::set_error(cudaErrorInvalidResourceHandle);
  flowc::sim::locked([e](flowc::sim::Engine& E) {
    E.drain([e] { return e->completed >= e->recorded; });
    return 0;
  });
  delete e;
  return cudaSuccess;
}

inline cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t stream = nullptr) {
  using namespace flowc::sim;
  if (ev == nullptr) return set_error(cudaErrorInvalidResourceHandle);
  return locked([&](Engine& E) {
    Stream* s = E.resolve(stream);
    if (!E.known(s)) return set_error(cudaErrorInvalidResourceHandle);
    return set_error(E.record(ev, s));
  });
}

inline cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t ev, unsigned flags = 0) {
  using namespace flowc::sim;
  if (ev == nullptr) return set_error(cudaErrorInvalidResourceHandle);
  if (flags != 0) return set_error(cudaErrorInvalidValue);
  return locked([&](Engine& E) {
    Stream* s = E.resolve(stream);
    if (!E.known(s)) return set_error(cudaErrorInvalidResourceHandle);
    return set_error(E.wait(s, ev));
  });
}

inline cudaError_t cudaEventSynchronize(cudaEvent_t ev) {
  using namespace flowc::sim;
  if (ev == nullptr) return set_error(cudaErrorInvalidResourceHandle);
  return locked([&](Engine& E) {
    // An event whose last record was inside a capture stands for graph nodes, not for work
    // on a stream, even after the capture has ended: CUDA refuses to wait for it
    // (cudaErrorCapturedEvent) until it is recorded again outside a capture.
    if (ev->capture_id != 0) return set_error(cudaErrorCapturedEvent);
    E.drain([ev] { return ev->completed >= ev->recorded; });
    return cudaSuccess;
  });
}

inline cudaError_t cudaEventQuery(cudaEvent_t ev) { return cudaEventSynchronize(ev); }

inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  using namespace flowc::sim;
  if (ms == nullptr) return set_error(cudaErrorInvalidValue);
  if (start == nullptr || end == nullptr) return set_error(cudaErrorInvalidResourceHandle);
  if (start->capture_id != 0 || end->capture_id != 0) return set_error(cudaErrorCapturedEvent);
  if (!start->timing || !end->timing || start->recorded == 0 || end->recorded == 0) {
    return set_error(cudaErrorInvalidResourceHandle);
  }
  // "Not ready" is a state, not an error: CUDA does not make it the last error either.
  if (start->completed < start->recorded || end->completed < end->recorded) return cudaErrorNotReady;
  *ms = std::chrono::duration<float, std::milli>(end->when - start->when).count();
  return cudaSuccess;
}

// -- kernel attributes --------------------------------------------------------------------------

template <class F>
inline cudaError_t cudaFuncSetAttribute(F* kernel, cudaFuncAttribute attr, int value) {
  using namespace flowc::sim;
  if (kernel == nullptr) return set_error(cudaErrorInvalidValue);
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || value > kMaxSharedOptIn) return set_error(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> lock(attr_mutex());
    max_dynamic_shared()[reinterpret_cast<const void*>(kernel)] = value;
    return cudaSuccess;
  }
  if (attr == cudaFuncAttributePreferredSharedMemoryCarveout) return cudaSuccess;
  return set_error(cudaErrorInvalidValue);
}

// -- stream capture and CUDA Graphs -------------------------------------------------------------

inline cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  using namespace flowc::sim;
  if (mode == nullptr || *mode < cudaStreamCaptureModeGlobal || *mode > cudaStreamCaptureModeRelaxed)
    return set_error(cudaErrorInvalidValue);
  std::swap(*mode, tl_capture_mode);
  return cudaSuccess;
}

inline cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  using namespace flowc::sim;
  if (mode < cudaStreamCaptureModeGlobal || mode > cudaStreamCaptureModeRelaxed)
    return set_error(cudaErrorInvalidValue);
  return locked([&](Engine& E) {
    Stream* s = E.resolve(stream);
    if (!E.known(s)) return set_error(cudaErrorInvalidResourceHandle);
    if (s == &E.legacy) return set_error(cudaErrorStreamCaptureUnsupported);  // CUDA cannot capture it
    if (s->capture != nullptr) return set_error(cudaErrorIllegalState);
    auto c = std::make_unique<Capture>();
    c->id = ++E.next_capture;
    c->origin = s;
    c->mode = mode;
    c->thread = std::this_thread::get_id();
    c->streams.push_back(s);
    s->capture = c.get();
    s->frontier.clear();
    E.captures.push_back(std::move(c));
    return cudaSuccess;
  });
}

inline cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  using namespace flowc::sim;
  if (graph == nullptr) return set_error(cudaErrorInvalidValue);
  return locked([&](Engine& E) {
    Stream* s = E.resolve(stream);
    if (!E.known(s)) return set_error(cudaErrorInvalidResourceHandle);
    Capture* c = s->capture;
    if (c == nullptr) return set_error(cudaErrorIllegalState);
    if (c->origin != s) {
      E.invalidate(c);
      return set_error(cudaErrorStreamCaptureUnmatched);
    }
    if (c->mode != cudaStreamCaptureModeRelaxed && c->thread != std::this_thread::get_id())
      return set_error(cudaErrorStreamCaptureWrongThread);
    *graph = nullptr;
    // Joined back means: every node that nothing depends on is one the origin ends with.
    std::vector<bool> used(c->nodes.size(), false);
    for (const GraphNode& n : c->nodes) {
      for (size_t d : n.deps) used[d] = true;
    }
    bool unjoined = false;
    for (size_t i = 0; i < c->nodes.size(); ++i) {
      if (!used[i] && std::find(s->frontier.begin(), s->frontier.end(), i) == s->frontier.end())
        unjoined = true;
    }
    const bool invalid = c->invalid;
    Nodes nodes = std::move(c->nodes);
    E.finish(c);
    if (invalid) return set_error(cudaErrorStreamCaptureInvalidated);
    if (unjoined) return set_error(cudaErrorStreamCaptureUnjoined);
    *graph = new Graph{std::move(nodes)};
    return cudaSuccess;
  });
}

inline cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  using namespace flowc::sim;
  if (status == nullptr) return set_error(cudaErrorInvalidValue);
  return locked([&](Engine& E) {
    Stream* s = E.resolve(stream);
    if (!E.known(s)) return set_error(cudaErrorInvalidResourceHandle);
    *status = s->capture == nullptr ? cudaStreamCaptureStatusNone
              : s->capture->invalid ? cudaStreamCaptureStatusInvalidated
                                    : cudaStreamCaptureStatusActive;
    if (s == &E.legacy) {
      // CUDA's answer for the legacy stream while a blocking stream captures (which it leaves valid).
      for (auto& c : E.captures) {
        for (Stream* o : c->streams) {
          if (o->blocking) return set_error(cudaErrorStreamCaptureImplicit);
        }
      }
    }
    return cudaSuccess;
  });
}

inline cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph,
                                        unsigned long long flags = 0) {
  using namespace flowc::sim;
  if (exec == nullptr || graph == nullptr || (flags & ~15ULL) != 0) return set_error(cudaErrorInvalidValue);
  // The flags ask for what the emulator does anyway (nothing to upload, no graph allocations
  // to free, no device launch or priorities to honour).
  return locked([&](Engine&) {
    *exec = new GraphExec{std::make_shared<const Nodes>(graph->nodes)};
    return cudaSuccess;
  });
}

inline cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t* exec, cudaGraph_t graph,
                                                 unsigned long long flags = 0) {
  return cudaGraphInstantiate(exec, graph, flags);
}

inline cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  using namespace flowc::sim;
  if (exec == nullptr) return set_error(cudaErrorInvalidValue);
  return locked([&](Engine& E) {
    Stream* s = E.resolve(stream);
    if (!E.known(s)) return set_error(cudaErrorInvalidResourceHandle);
    // One operation on the stream; launched into a capture, one child-graph node.
    Op op;
    op.kind = Op::kGraph;
    op.graph = exec->nodes;
    return set_error(E.submit(s, std::move(op), GraphNode::kGraph));
  });
}

// Replaces an executable graph's nodes by `graph`'s when only their parameters differ (same
// topology, node kinds and kernel functions), as CUDA allows; launches already queued keep
// what they were launched with.
inline cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph,
                                       cudaGraphExecUpdateResultInfo* info) {
  using namespace flowc::sim;
  if (exec == nullptr || graph == nullptr || info == nullptr) return set_error(cudaErrorInvalidValue);
  return locked([&](Engine&) {
    info->errorNode = nullptr;
    info->errorFromNode = nullptr;
    const Nodes& a = *exec->nodes;
    const Nodes& b = graph->nodes;
    info->result = cudaGraphExecUpdateSuccess;
    if (a.size() != b.size()) info->result = cudaGraphExecUpdateErrorTopologyChanged;
    for (size_t i = 0; i < a.size() && info->result == cudaGraphExecUpdateSuccess; ++i) {
      if (a[i].deps != b[i].deps) {
        info->result = cudaGraphExecUpdateErrorTopologyChanged;
      } else if (a[i].kind != b[i].kind) {
        info->result = cudaGraphExecUpdateErrorNodeTypeChanged;
      } else if (a[i].kind == GraphNode::kKernel && a[i].launch->invoke != b[i].launch->invoke) {
        info->result = cudaGraphExecUpdateErrorUnsupportedFunctionChange;
      } else if (a[i].kind == GraphNode::kGraph || a[i].kind == GraphNode::kHost) {
        // CUDA updates neither child graphs by structure nor host functions we cannot compare.
        info->result = cudaGraphExecUpdateErrorNotSupported;
      }
    }
    if (info->result != cudaGraphExecUpdateSuccess) return set_error(cudaErrorGraphExecUpdateFailure);
    exec->nodes = std::make_shared<const Nodes>(b);
    return cudaSuccess;
  });
}

inline cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  if (exec == nullptr) return flowc::sim::set_error(cudaErrorInvalidValue);
  flowc::sim::locked([exec](flowc::sim::Engine&) {
    delete exec;  // queued launches hold the nodes
    return 0;
  });
  return cudaSuccess;
}

inline cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  if (graph == nullptr) return flowc::sim::set_error(cudaErrorInvalidValue);
  delete graph;
  return cudaSuccess;
}
