// Streams and events for the host build.
//
// Every asynchronous call queues an operation on its stream; nothing runs until a
// synchronization point (stream/event/device synchronize, a synchronous copy, cudaFree).
// There the engine repeatedly picks a stream whose next operation may run, as a GPU would:
// same-stream order, events across streams, and the legacy default stream's implicit
// ordering are honoured; everything else is left to FLOWC_SIM_ORDER. Under reverse and
// shuffle, kernels on different streams interleave block by block, so work that lacks an
// event runs before the work it should have waited for.
#pragma once

#include "flowc/host/emulator.h"

namespace flowc {
namespace sim {

struct Event {
  uint64_t recorded = 0;   // record calls so far
  uint64_t completed = 0;  // records that have run
  bool timing = true;
  std::chrono::steady_clock::time_point when{};
};

struct Op {
  enum Kind { kKernel, kHost, kRecord, kWait } kind = kHost;
  uint64_t seq = 0;  // global issue order
  std::shared_ptr<Launch> launch;
  std::function<void()> host;
  Event* event = nullptr;
  uint64_t generation = 0;  // record: which record this is; wait: which record to wait for
};

struct Stream {
  int id = 0;
  bool blocking = true;  // orders with the legacy default stream
  std::deque<Op> ops;
};

struct Engine {
  std::recursive_mutex mu;
  Stream legacy;  // stream 0
  std::vector<Stream*> streams;
  uint64_t seq = 0;
  uint64_t launches = 0;
  int next_id = 1;

  Engine() { streams.push_back(&legacy); }

  Stream* resolve(cudaStream_t s) { return (s == nullptr || s == cudaStreamLegacy) ? &legacy : s; }

  bool known(Stream* s) const { return std::find(streams.begin(), streams.end(), s) != streams.end(); }

  void enqueue(Stream* s, Op op) {
    op.seq = ++seq;
    s->ops.push_back(std::move(op));
  }

  // May the head of `s` run now?
  bool ready(const Stream* s) const {
    const Op& op = s->ops.front();
    if (op.kind == Op::kWait && op.event->completed < op.generation) return false;
    if (s == &legacy) {
      // The legacy stream waits for all earlier work on blocking streams.
      for (const Stream* o : streams) {
        if (o != s && o->blocking && !o->ops.empty() && o->ops.front().seq < op.seq) return false;
      }
    } else if (s->blocking && !legacy.ops.empty() && legacy.ops.front().seq < op.seq) {
      return false;
    }
    return true;
  }

  Stream* pick(uint64_t step) {
    std::vector<Stream*> ready_streams;
    for (Stream* s : streams) {
      if (!s->ops.empty() && ready(s)) ready_streams.push_back(s);
    }
    if (ready_streams.empty()) return nullptr;
    auto by_seq = [](const Stream* a, const Stream* b) { return a->ops.front().seq < b->ops.front().seq; };
    switch (policy().order) {
      case Order::kForward:
        return *std::min_element(ready_streams.begin(), ready_streams.end(), by_seq);
      case Order::kReverse:
        return *std::max_element(ready_streams.begin(), ready_streams.end(), by_seq);
      case Order::kShuffle:
        return ready_streams[mix(policy().seed ^ mix(step + 0x5151)) % ready_streams.size()];
    }
    return nullptr;
  }

  size_t busy_streams() const {
    size_t n = 0;
    for (const Stream* s : streams) n += s->ops.empty() ? 0 : 1;
    return n;
  }

  void run_head(Stream* s) {
    Op& op = s->ops.front();
    switch (op.kind) {
      case Op::kKernel: {
        Launch& L = *op.launch;
        // One stream with work: nothing to interleave with, so run the blocks in parallel.
        const bool interleave = policy().order != Order::kForward && busy_streams() > 1;
        run_blocks(L, interleave ? 1 : 0);
        if (L.next < L.nblocks) return;
        break;
      }
      case Op::kHost:
        op.host();
        break;
      case Op::kRecord:
        op.event->completed = std::max(op.event->completed, op.generation);
        op.event->when = std::chrono::steady_clock::now();
        break;
      case Op::kWait:
        break;
    }
    s->ops.pop_front();
  }

  // Run queued work until `done()` holds.
  template <class Done>
  void drain(Done done) {
    uint64_t step = 0;
    while (!done()) {
      Stream* s = pick(step++);
      if (s == nullptr) {
        fatal("streams wait on each other forever (an event wait that can never complete)");
      }
      run_head(s);
    }
  }

  void drain_all() {
    drain([this] { return busy_streams() == 0; });
  }
};

inline Engine& engine() {
  static Engine* e = new Engine();  // never destroyed: kernels may still be queued at exit
  return *e;
}

inline thread_local cudaError_t tl_last_error = cudaSuccess;

inline cudaError_t set_error(cudaError_t e) {
  if (e != cudaSuccess) tl_last_error = e;
  return e;
}

inline std::mutex& attr_mutex() {
  static std::mutex m;
  return m;
}

inline std::map<const void*, int>& max_dynamic_shared() {
  static std::map<const void*, int> m;
  return m;
}

constexpr size_t kDefaultSharedLimit = 48 * 1024;
constexpr int kMaxSharedOptIn = 232448;  // H100/H200: 227 KiB per block

inline cudaError_t check_launch(const void* kernel, dim3 grid, dim3 block, size_t shared) {
  const unsigned long long threads = 1ULL * block.x * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0) return cudaErrorInvalidConfiguration;
  if (grid.x > 2147483647u || grid.y > 65535u || grid.z > 65535u) return cudaErrorInvalidConfiguration;
  if (block.x > 1024u || block.y > 1024u || block.z > 64u || threads > 1024u)
    return cudaErrorInvalidConfiguration;
  size_t limit = kDefaultSharedLimit;
  {
    std::lock_guard<std::mutex> lock(attr_mutex());
    auto it = max_dynamic_shared().find(kernel);
    if (it != max_dynamic_shared().end()) limit = static_cast<size_t>(it->second);
  }
  if (shared > limit) return cudaErrorInvalidConfiguration;
  return cudaSuccess;
}

// Queue host work on a stream, in order with its kernels (what cudaLaunchHostFunc does; the
// library wrappers use it for their CPU backends).
inline cudaError_t enqueue_host(cudaStream_t stream, std::function<void()> fn) {
  Engine& E = engine();
  std::lock_guard<std::recursive_mutex> lock(E.mu);
  Stream* s = E.resolve(stream);
  if (!E.known(s)) return set_error(cudaErrorInvalidResourceHandle);
  Op op;
  op.host = std::move(fn);
  E.enqueue(s, std::move(op));
  return cudaSuccess;
}

template <auto Kernel, class... Args>
inline void launch(const char* name, dim3 grid, dim3 block, size_t shared, cudaStream_t stream,
                   Args&&... args) {
  const void* key = reinterpret_cast<const void*>(Kernel);
  if (cudaError_t e = check_launch(key, grid, block, shared); e != cudaSuccess) {
    set_error(e);
    return;
  }
  Engine& E = engine();
  std::lock_guard<std::recursive_mutex> lock(E.mu);
  Stream* s = E.resolve(stream);
  if (!E.known(s)) {
    set_error(cudaErrorInvalidResourceHandle);
    return;
  }
  auto L = std::make_shared<Launch>();
  L->name = name;
  L->grid = grid;
  L->block = block;
  L->shared_bytes = shared;
  L->nblocks = grid.x * grid.y * grid.z;
  L->id = ++E.launches;
  L->stats = stats_for(name);
  using Tuple = decltype(std::tuple(std::forward<Args>(args)...));
  L->args = std::make_shared<Tuple>(std::forward<Args>(args)...);
  L->invoke = &Invoker<Kernel, Tuple>::invoke;
  L->run_plain = &Invoker<Kernel, Tuple>::run_plain;
  Op op;
  op.kind = Op::kKernel;
  op.launch = std::move(L);
  E.enqueue(s, std::move(op));
}

}  // namespace sim
}  // namespace flowc
