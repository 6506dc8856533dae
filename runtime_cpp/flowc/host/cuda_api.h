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
  flowc::sim::locked([](flowc::sim::Engine& E) {
    E.drain_all();
    return 0;
  });
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
    E.enqueue(s, std::move(op));
    return cudaSuccess;
  });
}

inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  using namespace flowc::sim;
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
    E.enqueue(s, std::move(op));
    return cudaSuccess;
  });
}

inline cudaError_t cudaMemset(void* dst, int value, size_t bytes) {
  using namespace flowc::sim;
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
    E.enqueue(s, std::move(op));
    return cudaSuccess;
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
    E.drain([s] { return s->ops.empty(); });  // CUDA finishes a destroyed stream's work
    E.streams.erase(std::find(E.streams.begin(), E.streams.end(), s));
    delete s;
    return cudaSuccess;
  });
}

inline cudaError_t cudaDeviceSynchronize() {
  return flowc::sim::locked([](flowc::sim::Engine& E) {
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
    Op op;
    op.kind = Op::kRecord;
    op.event = ev;
    op.generation = ++ev->recorded;
    E.enqueue(s, std::move(op));
    return cudaSuccess;
  });
}

inline cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t ev, unsigned flags = 0) {
  using namespace flowc::sim;
  if (ev == nullptr) return set_error(cudaErrorInvalidResourceHandle);
  if (flags != 0) return set_error(cudaErrorInvalidValue);
  return locked([&](Engine& E) {
    Stream* s = E.resolve(stream);
    if (!E.known(s)) return set_error(cudaErrorInvalidResourceHandle);
    // Waits for the most recent record issued before this call (none: no wait), as CUDA does.
    Op op;
    op.kind = Op::kWait;
    op.event = ev;
    op.generation = ev->recorded;
    E.enqueue(s, std::move(op));
    return cudaSuccess;
  });
}

inline cudaError_t cudaEventSynchronize(cudaEvent_t ev) {
  using namespace flowc::sim;
  if (ev == nullptr) return set_error(cudaErrorInvalidResourceHandle);
  return locked([&](Engine& E) {
    E.drain([ev] { return ev->completed >= ev->recorded; });
    return cudaSuccess;
  });
}

inline cudaError_t cudaEventQuery(cudaEvent_t ev) { return cudaEventSynchronize(ev); }

inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  using namespace flowc::sim;
  if (ms == nullptr) return set_error(cudaErrorInvalidValue);
  if (start == nullptr || end == nullptr) return set_error(cudaErrorInvalidResourceHandle);
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
