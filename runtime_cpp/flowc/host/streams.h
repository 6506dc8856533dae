// Streams and events for the host build.
//
// Every asynchronous call queues an operation on its stream; nothing runs until a
// synchronization point (stream/event/device synchronize, a synchronous copy, cudaFree).
// There the engine repeatedly picks a stream whose next operation may run, as a GPU would:
// same-stream order, events across streams, and the legacy default stream's implicit
// ordering are honoured; everything else is left to FLOWC_SIM_ORDER. Under reverse and
// shuffle, kernels on different streams interleave block by block, so work that lacks an
// event runs before the work it should have waited for.
//
// Stream capture (CUDA Graphs): while a stream captures, what is issued to it becomes graph
// nodes instead of queued operations, each depending on the stream's capture frontier (its
// last nodes); an event recorded in the capture carries the frontier to whichever stream
// waits on it, which joins the capture (a fork). A launched graph is one queued operation
// that runs its nodes in a topological order FLOWC_SIM_ORDER picks, so an edge the capture
// missed shows as wrong results.
#pragma once

#include <thread>

#include "flowc/host/emulator.h"

namespace flowc {
namespace sim {

struct Event {
  uint64_t recorded = 0;   // record calls so far
  uint64_t completed = 0;  // records that have run
  bool timing = true;
  std::chrono::steady_clock::time_point when{};
  // Last recorded inside a capture: which one (0: not) and the nodes the record stands for.
  uint64_t capture_id = 0;
  std::vector<size_t> capture_nodes;
};

// One node of a captured graph; `deps` index earlier nodes of the same graph.
struct GraphNode {
  enum Kind { kKernel, kHost, kMemcpy, kMemset, kGraph } kind = kHost;
  std::shared_ptr<const Launch> launch;  // kernel: the launch as issued (its state is copied per run)
  std::function<void()> host;            // host function, copy, set
  std::shared_ptr<const std::vector<GraphNode>> child;  // a graph launched into the capture
  std::vector<size_t> deps;
  bool library = false;  // host: a library call (library_call), counted as a launch
};

using Nodes = std::vector<GraphNode>;

struct Graph {
  Nodes nodes;
};

struct GraphExec {
  // Shared with launches still queued, so cudaGraphExecUpdate and cudaGraphExecDestroy leave
  // them running what they were launched with.
  std::shared_ptr<const Nodes> nodes;
};

struct Op {
  enum Kind { kKernel, kHost, kRecord, kWait, kGraph } kind = kHost;
  uint64_t seq = 0;  // global issue order
  std::shared_ptr<Launch> launch;
  std::function<void()> host;
  Event* event = nullptr;
  uint64_t generation = 0;  // record: which record this is; wait: which record to wait for
  std::shared_ptr<const Nodes> graph;
  GraphNode::Kind node = GraphNode::kHost;  // what it is as work (a copy, a set, ...): for the counters
  bool library = false;                     // see GraphNode::library
};

struct Capture;

struct Stream {
  int id = 0;
  bool blocking = true;  // orders with the legacy default stream
  std::deque<Op> ops;
  Capture* capture = nullptr;    // the capture this stream takes part in
  std::vector<size_t> frontier;  // while capturing: the nodes the next one depends on
};

// One capture sequence, from cudaStreamBeginCapture on `origin` to cudaStreamEndCapture.
struct Capture {
  uint64_t id = 0;
  Stream* origin = nullptr;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id thread;
  bool invalid = false;
  std::vector<Stream*> streams;  // origin first, then the streams that joined
  Nodes nodes;
};

// The calling thread's capture interaction mode (cudaThreadExchangeStreamCaptureMode).
inline thread_local cudaStreamCaptureMode tl_capture_mode = cudaStreamCaptureModeGlobal;

// What flowc::sim::counters() reports: kernel launches queued on streams (not captured),
// cudaGraphLaunch calls, and kernel nodes run by launched graphs; then the work that has run,
// by kind, wherever it came from: a replayed graph's nodes count one by one, as the GPU
// runs them (a captured operation counts when the graph runs it, not when captured).
// `kernels + library_calls` is what a GPU would launch: GEMMs and convolutions (the users of
// library_call) are library calls, one or more kernels each on the GPU. Host functions are
// cudaLaunchHostFunc's (the host build's collectives), not launches.
struct Counters {
  uint64_t stream_kernel_launches = 0;
  uint64_t graph_launches = 0;
  uint64_t graph_kernels = 0;
  uint64_t kernels = 0;
  uint64_t library_calls = 0;
  uint64_t copies = 0;
  uint64_t memsets = 0;
  uint64_t host_functions = 0;
};

struct Engine {
  std::recursive_mutex mu;
  Stream legacy;  // stream 0
  std::vector<Stream*> streams;
  uint64_t seq = 0;
  uint64_t launches = 0;
  int next_id = 1;
  Counters counts;
  std::vector<std::unique_ptr<Capture>> captures;  // live ones
  uint64_t next_capture = 0;

  Engine() {
    streams.push_back(&legacy);
    if (policy().stats) std::atexit(print_counters);
  }

  static void print_counters();

  // One operation of `kind` has run.
  void tally(GraphNode::Kind kind, bool library) {
    switch (kind) {
      case GraphNode::kKernel:
        ++counts.kernels;
        break;
      case GraphNode::kHost:
        ++(library ? counts.library_calls : counts.host_functions);
        break;
      case GraphNode::kMemcpy:
        ++counts.copies;
        break;
      case GraphNode::kMemset:
        ++counts.memsets;
        break;
      case GraphNode::kGraph:
        break;  // its nodes count as they run
    }
  }

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
      case Op::kGraph:
        run_graph(*op.graph, op.generation);
        break;
    }
    if (op.kind == Op::kKernel || op.kind == Op::kHost) tally(op.node, op.library);
    s->ops.pop_front();
  }

  // Runs a launched graph's nodes to completion, one at a time, in a topological order:
  // capture order under forward, the latest-captured ready node first under reverse, a
  // seeded pick among the ready nodes under shuffle.
  void run_graph(const Nodes& nodes, uint64_t salt) {
    std::vector<size_t> waiting(nodes.size());
    std::vector<std::vector<size_t>> users(nodes.size());
    std::vector<size_t> ready;
    for (size_t i = 0; i < nodes.size(); ++i) {
      waiting[i] = nodes[i].deps.size();
      for (size_t d : nodes[i].deps) users[d].push_back(i);
      if (waiting[i] == 0) ready.push_back(i);
    }
    uint64_t state = mix(policy().seed ^ mix(salt * 0x2545f491ULL + 0x6a09));
    while (!ready.empty()) {
      size_t k = 0;
      switch (policy().order) {
        case Order::kForward:
          k = static_cast<size_t>(std::min_element(ready.begin(), ready.end()) - ready.begin());
          break;
        case Order::kReverse:
          k = static_cast<size_t>(std::max_element(ready.begin(), ready.end()) - ready.begin());
          break;
        case Order::kShuffle:
          state = mix(state);
          k = static_cast<size_t>(state % ready.size());
          break;
      }
      const size_t i = ready[k];
      ready.erase(ready.begin() + static_cast<std::ptrdiff_t>(k));
      const GraphNode& n = nodes[i];
      switch (n.kind) {
        case GraphNode::kKernel: {
          Launch L = *n.launch;  // a fresh run: block order, progress and id are per launch
          L.next = 0;
          L.order.clear();
          L.id = ++launches;
          ++counts.graph_kernels;
          run_blocks(L, 0);
          break;
        }
        case GraphNode::kHost:
        case GraphNode::kMemcpy:
        case GraphNode::kMemset:
          n.host();
          break;
        case GraphNode::kGraph:
          run_graph(*n.child, mix(salt + i));
          break;
      }
      tally(n.kind, n.library);
      for (size_t u : users[i]) {
        if (--waiting[u] == 0) ready.push_back(u);
      }
    }
  }

  // -- capture ------------------------------------------------------------------------------

  Capture* live_capture(uint64_t id) {
    for (auto& c : captures) {
      if (c->id == id) return c.get();
    }
    return nullptr;
  }

  void invalidate(Capture* c) { c->invalid = true; }

  // Leaves every stream of `c` out of capture and forgets `c`.
  void finish(Capture* c) {
    for (Stream* s : c->streams) {
      s->capture = nullptr;
      s->frontier.clear();
    }
    captures.erase(std::find_if(captures.begin(), captures.end(), [c](auto& p) { return p.get() == c; }));
  }

  // A "potentially unsafe" call (cudaMalloc, cudaFree, a synchronous copy): prohibited, and
  // the captures that prohibit it invalidated, as CUDA's capture interaction modes say.
  cudaError_t check_unsafe() {
    if (tl_capture_mode == cudaStreamCaptureModeRelaxed) return cudaSuccess;
    bool conflict = false;
    for (auto& c : captures) {
      const bool mine = c->thread == std::this_thread::get_id() && c->mode != cudaStreamCaptureModeRelaxed;
      const bool global =
          tl_capture_mode == cudaStreamCaptureModeGlobal && c->mode == cudaStreamCaptureModeGlobal;
      if (mine || global) {
        invalidate(c.get());
        conflict = true;
      }
    }
    return conflict ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
  }

  // Work on the legacy stream would wait for every blocking stream, a capturing one included.
  cudaError_t check_legacy(Stream* s) {
    if (s != &legacy) return cudaSuccess;
    bool conflict = false;
    for (auto& c : captures) {
      for (Stream* o : c->streams) {
        if (o->blocking) {
          invalidate(c.get());
          conflict = true;
          break;
        }
      }
    }
    return conflict ? cudaErrorStreamCaptureImplicit : cudaSuccess;
  }

  // Issues `op` to `s`: queued, or, while `s` captures, added as a node of kind `kind`.
  cudaError_t submit(Stream* s, Op op, GraphNode::Kind kind) {
    if (Capture* c = s->capture) {
      if (c->invalid) return cudaErrorStreamCaptureInvalidated;
      GraphNode n;
      n.kind = kind;
      n.launch = std::move(op.launch);
      n.host = std::move(op.host);
      n.child = std::move(op.graph);
      n.library = op.library;
      n.deps = s->frontier;
      c->nodes.push_back(std::move(n));
      s->frontier.assign(1, c->nodes.size() - 1);
      return cudaSuccess;
    }
    if (cudaError_t e = check_legacy(s); e != cudaSuccess) return e;
    if (op.kind == Op::kKernel) ++counts.stream_kernel_launches;
    if (op.kind == Op::kGraph) op.generation = ++counts.graph_launches;  // also the order's salt
    op.node = kind;
    enqueue(s, std::move(op));
    return cudaSuccess;
  }

  cudaError_t record(Event* ev, Stream* s) {
    if (Capture* c = s->capture) {
      if (c->invalid) return cudaErrorStreamCaptureInvalidated;
      ev->capture_id = c->id;
      ev->capture_nodes = s->frontier;
      return cudaSuccess;
    }
    if (cudaError_t e = check_legacy(s); e != cudaSuccess) return e;
    ev->capture_id = 0;
    ev->capture_nodes.clear();
    Op op;
    op.kind = Op::kRecord;
    op.event = ev;
    op.generation = ++ev->recorded;
    enqueue(s, std::move(op));
    return cudaSuccess;
  }

  cudaError_t wait(Stream* s, Event* ev) {
    Capture* from = ev->capture_id != 0 ? live_capture(ev->capture_id) : nullptr;
    if (from != nullptr) {
      if (from->invalid) return cudaErrorStreamCaptureInvalidated;
      if (s->capture == nullptr) {
        if (s == &legacy) {
          invalidate(from);
          return cudaErrorStreamCaptureImplicit;
        }
        // The fork: `s` joins the capture, its next node depending on the recorded ones.
        s->capture = from;
        s->frontier = ev->capture_nodes;
        from->streams.push_back(s);
        return cudaSuccess;
      }
      if (s->capture != from) {
        invalidate(from);
        invalidate(s->capture);
        return cudaErrorStreamCaptureMerge;
      }
      for (size_t n : ev->capture_nodes) {
        if (std::find(s->frontier.begin(), s->frontier.end(), n) == s->frontier.end())
          s->frontier.push_back(n);
      }
      return cudaSuccess;
    }
    if (Capture* c = s->capture) {
      if (c->invalid) return cudaErrorStreamCaptureInvalidated;
      // Only the stream's own order may cross into a capture; a record outside it may not.
      if (ev->recorded == 0 || ev->capture_id != 0) return cudaSuccess;  // nothing to wait for
      invalidate(c);
      return cudaErrorStreamCaptureIsolation;
    }
    if (cudaError_t e = check_legacy(s); e != cudaSuccess) return e;
    if (ev->capture_id != 0) return cudaSuccess;  // recorded in a capture that has ended
    // Waits for the most recent record issued before this call (none: no wait), as CUDA does.
    Op op;
    op.kind = Op::kWait;
    op.event = ev;
    op.generation = ev->recorded;
    enqueue(s, std::move(op));
    return cudaSuccess;
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

// Launch counts so far (see Counters); FLOWC_SIM_STATS=1 prints them at exit too.
inline Counters counters() {
  Engine& E = engine();
  std::lock_guard<std::recursive_mutex> lock(E.mu);
  return E.counts;
}

inline void Engine::print_counters() {
  const Counters c = flowc::sim::counters();
  std::fprintf(stderr, "flowc sim launches: %llu stream kernels, %llu graph launches, %llu graph kernels\n",
               (unsigned long long)c.stream_kernel_launches, (unsigned long long)c.graph_launches,
               (unsigned long long)c.graph_kernels);
  std::fprintf(stderr,
               "flowc sim work run: %llu kernels, %llu library calls, %llu copies, %llu memsets, "
               "%llu host functions\n",
               (unsigned long long)c.kernels, (unsigned long long)c.library_calls,
               (unsigned long long)c.copies, (unsigned long long)c.memsets,
               (unsigned long long)c.host_functions);
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

// A library call (cuBLASLt, cuDNN) queued as host work on a stream, in order with its kernels
// (what cudaLaunchHostFunc does; the library wrappers' CPU backends use it); each counts as a
// library call (Counters::library_calls): what a GPU build launches through cuBLASLt or
// cuDNN instead. `*warm` (may be null) is the
// handle's: whether it has made a call yet. A handle's first call does what the GPU libraries
// do lazily (load their kernel modules, set up their state, allocate), which a stream capture
// does not allow; the emulator treats that first call as it treats cudaMalloc during a capture
// (cudaErrorStreamCaptureUnsupported, the capture invalidated) so that a program warms its
// libraries up before it captures.
inline cudaError_t library_call(cudaStream_t stream, bool* warm, std::function<void()> fn) {
  Engine& E = engine();
  std::lock_guard<std::recursive_mutex> lock(E.mu);
  Stream* s = E.resolve(stream);
  if (!E.known(s)) return set_error(cudaErrorInvalidResourceHandle);
  if (warm != nullptr && !*warm) {
    if (s->capture != nullptr) {
      E.invalidate(s->capture);
      return set_error(cudaErrorStreamCaptureUnsupported);
    }
    *warm = true;
  }
  Op op;
  op.host = std::move(fn);
  op.library = true;
  return set_error(E.submit(s, std::move(op), GraphNode::kHost));
}

// Whether `stream` exists (the legacy stream always does): what a library handle that was
// given a stream (cudnnSetStream) may still use.
inline bool stream_alive(cudaStream_t stream) {
  Engine& E = engine();
  std::lock_guard<std::recursive_mutex> lock(E.mu);
  return E.known(E.resolve(stream));
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
  set_error(E.submit(s, std::move(op), GraphNode::kKernel));
}

}  // namespace sim
}  // namespace flowc
