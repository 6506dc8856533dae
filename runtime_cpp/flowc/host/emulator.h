// flowc SIMT emulator: runs CUDA kernels on the CPU with GPU semantics.
//
// Blocks run in parallel on OpenMP threads. The threads of a block run as cooperative fibers
// (Boost.Context's fcontext: a register-only switch, ~100x cheaper than ucontext), so barriers
// and warp-synchronous intrinsics behave as on a GPU. A launch whose block 0 (run first) crosses
// no barrier and uses no warp intrinsic runs its remaining blocks as plain loops over threads.
//
// Work on streams is deferred: launches, copies and event records queue up and run at the
// next synchronization point, in an order FLOWC_SIM_ORDER chooses (forward: issue order;
// reverse: latest issued first; shuffle:SEED: seeded random), so a missing barrier or a
// missing cross-stream event gives wrong results instead of hiding behind issue order.
#pragma once

#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/context/detail/fcontext.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "flowc/env.h"
#include "flowc/host/cuda_types.h"
#include "flowc/status.h"

// AddressSanitizer keeps one stack (and one fake stack, for use-after-return) per OS thread;
// a fiber switch it is not told about leaves it unwinding, unpoisoning and describing
// addresses against the wrong stack. FLOWC_SIM_ASAN: built with -fsanitize=address.
#if defined(__SANITIZE_ADDRESS__)
#define FLOWC_SIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FLOWC_SIM_ASAN 1
#endif
#endif
#ifndef FLOWC_SIM_ASAN
#define FLOWC_SIM_ASAN 0
#endif
#if FLOWC_SIM_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

namespace flowc {
namespace sim {

namespace bctx = boost::context::detail;

// A kernel or configuration error the emulator cannot turn into a status (a GPU would trap).
[[noreturn]] inline void fatal(const std::string& msg) {
  std::fprintf(stderr, "flowc sim: %s\n", msg.c_str());
  std::fflush(stderr);
  std::abort();
}

// -- scheduling policy ----------------------------------------------------------------------------

enum class Order { kForward, kReverse, kShuffle };

struct Policy {
  Order order = Order::kForward;
  uint64_t seed = 0;
  bool stats = false;
  bool force_fibers = false;
  size_t stack_bytes = kMinStackKb * 1024;
  // ASan's redzones make frames several times larger: 64 KiB fibers overflow in ordinary
  // kernels, so sanitized builds get (at least) 256 KiB.
  static constexpr long kMinStackKb = FLOWC_SIM_ASAN ? 256 : 64;
};

// A FLOWC_SIM_* variable with a value it does not take: there is no caller to return a status
// to (a generated model's create() checks them first, flowc/env.h), so the program ends here,
// cleanly, with the message.
[[noreturn]] inline void bad_environment(const Status& st) {
  std::fflush(stdout);
  std::fprintf(stderr, "error: %s\n", st.message().c_str());
  std::fflush(stderr);
  std::_Exit(2);
}

inline Policy read_policy() {
  Policy p;
  env::SimOrder order;
  if (Status st = env::sim_order(&order); !st.ok()) bad_environment(st);
  p.order = order.which == env::SimOrder::kReverse   ? Order::kReverse
            : order.which == env::SimOrder::kShuffle ? Order::kShuffle
                                                     : Order::kForward;
  p.seed = order.seed;
  if (Status st = env::flag("FLOWC_SIM_STATS", &p.stats); !st.ok()) bad_environment(st);
  if (Status st = env::flag("FLOWC_SIM_FIBERS", &p.force_fibers); !st.ok()) bad_environment(st);
  int64_t kb = Policy::kMinStackKb;
  if (Status st = env::integer("FLOWC_SIM_STACK_KB", &kb); !st.ok()) bad_environment(st);
  p.stack_bytes = static_cast<size_t>(std::max<int64_t>(kb, Policy::kMinStackKb)) * 1024;
  return p;
}

inline const Policy& policy() {
  static const Policy p = read_policy();
  return p;
}

// splitmix64: cheap, well-mixed, and a pure function of its input, so every block and every
// round gets its own reproducible random stream whatever thread runs it.
inline uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The order in which n items run, per the policy; `salt` tells apart the decisions.
inline void fill_order(std::vector<unsigned>& order, unsigned n, uint64_t salt) {
  order.resize(n);
  std::iota(order.begin(), order.end(), 0u);
  switch (policy().order) {
    case Order::kForward:
      break;
    case Order::kReverse:
      std::reverse(order.begin(), order.end());
      break;
    case Order::kShuffle: {
      uint64_t state = mix(policy().seed ^ mix(salt));
      for (unsigned i = n; i > 1; --i) {
        state = mix(state);
        std::swap(order[i - 1], order[state % i]);
      }
      break;
    }
  }
}

// -- statistics -----------------------------------------------------------------------------------

struct KernelStats {
  std::atomic<uint64_t> launches_plain{0}, launches_fibers{0}, blocks_plain{0}, blocks_fibers{0};
  std::atomic<uint64_t> barriers{0}, warp_syncs{0};
};

inline std::mutex& stats_mutex() {
  static std::mutex m;
  return m;
}

inline std::map<std::string, std::unique_ptr<KernelStats>>& stats_table() {
  static std::map<std::string, std::unique_ptr<KernelStats>> t;
  return t;
}

inline void print_stats() {
  std::lock_guard<std::mutex> lock(stats_mutex());
  std::fprintf(stderr, "flowc sim stats (%zu kernels)\n", stats_table().size());
  std::fprintf(stderr, "  %-32s %10s %10s %12s %12s %12s %12s\n", "kernel", "plain", "fibers", "blocks",
               "fiber blks", "barriers", "warp syncs");
  for (auto& kv : stats_table()) {
    const KernelStats& s = *kv.second;
    std::fprintf(stderr, "  %-32s %10llu %10llu %12llu %12llu %12llu %12llu\n", kv.first.c_str(),
                 (unsigned long long)s.launches_plain, (unsigned long long)s.launches_fibers,
                 (unsigned long long)(s.blocks_plain + s.blocks_fibers), (unsigned long long)s.blocks_fibers,
                 (unsigned long long)s.barriers, (unsigned long long)s.warp_syncs);
  }
}

inline KernelStats* stats_for(const char* name) {
  std::lock_guard<std::mutex> lock(stats_mutex());
  auto& t = stats_table();
  if (t.empty() && policy().stats) std::atexit(print_stats);
  auto it = t.find(name);
  if (it == t.end()) it = t.emplace(name, std::make_unique<KernelStats>()).first;
  return it->second.get();
}

// -- per-thread context ---------------------------------------------------------------------------

struct Block;

struct ThreadCtx {
  uint3 thread_idx{0, 0, 0};
  uint3 block_idx{0, 0, 0};
  dim3 block_dim;
  dim3 grid_dim;
  unsigned linear = 0;     // linear thread index within the block
  Block* block = nullptr;  // null on the plain path
  const char* kernel = "";
};

inline thread_local ThreadCtx* tl_cur = nullptr;
inline thread_local std::vector<unsigned char> tl_dynamic_shared;

inline unsigned char* dynamic_shared() { return tl_dynamic_shared.data(); }

// -- fibers ---------------------------------------------------------------------------------------

struct Stack {
  void* base = nullptr;  // lowest mapped address (guard page)
  size_t bytes = 0;
  void* top() const { return static_cast<char*>(base) + bytes; }
  // The usable part, above the guard page.
  const void* bottom() const { return static_cast<char*>(base) + static_cast<size_t>(sysconf(_SC_PAGESIZE)); }
  size_t usable() const { return bytes - static_cast<size_t>(sysconf(_SC_PAGESIZE)); }
};

// Tells ASan about a switch to the stack [bottom, bottom + size). `fake_save` receives the
// fake stack of the context being left, to hand back to asan_finish_switch when it resumes;
// null means the context never resumes (its fake stack is freed). Nothing without ASan.
inline void asan_start_switch(void** fake_save, const void* bottom, size_t size) {
#if FLOWC_SIM_ASAN
  __sanitizer_start_switch_fiber(fake_save, bottom, size);
#else
  (void)fake_save, (void)bottom, (void)size;
#endif
}

// First thing after a switch lands: `fake` is what asan_start_switch saved when this context
// left (null on a fiber's first entry); `*bottom_old`/`*size_old` get the stack switched from.
inline void asan_finish_switch(void* fake, const void** bottom_old, size_t* size_old) {
#if FLOWC_SIM_ASAN
  __sanitizer_finish_switch_fiber(fake, bottom_old, size_old);
#else
  (void)fake, (void)bottom_old, (void)size_old;
#endif
}

// Stacks are reused across blocks and launches; each OS thread keeps its own.
struct StackPool {
  std::vector<Stack> stacks;
  ~StackPool() {
    for (auto& s : stacks) munmap(s.base, s.bytes);
  }
  Stack& get(size_t i) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    while (stacks.size() <= i) {
      Stack s;
      s.bytes = (policy().stack_bytes + page - 1) / page * page + page;
      s.base =
          mmap(nullptr, s.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (s.base == MAP_FAILED) fatal("cannot map a fiber stack (out of memory?)");
      mprotect(s.base, page, PROT_NONE);  // overflow faults instead of corrupting a neighbour
      stacks.push_back(s);
    }
    return stacks[i];
  }
};

inline thread_local StackPool tl_stacks;

enum class FiberState { kReady, kBlockBarrier, kWarpBarrier, kDone };

struct Fiber {
  bctx::fcontext_t ctx = nullptr;
  const void* stack_bottom = nullptr;  // the usable stack, for ASan
  size_t stack_size = 0;
  void* asan_fake = nullptr;  // the fiber's ASan fake stack while it is suspended
  ThreadCtx tctx;
  FiberState state = FiberState::kReady;
  unsigned wait_gen = 0;
  unsigned exchanges = 0;  // warp data exchanges so far: picks the slot parity
};

struct Warp {
  unsigned arrived = 0;
  unsigned gen = 0;
  unsigned live_mask = 0;
  uint64_t slots[2][32] = {};
};

struct Block {
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::vector<unsigned> order;
  bctx::fcontext_t sched = nullptr;
  // The scheduler's (OS thread's) stack and saved fake stack, for ASan (see asan_start_switch).
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
  void* sched_asan_fake = nullptr;
  Fiber* cur = nullptr;
  unsigned live = 0;
  unsigned barrier_arrived = 0;
  unsigned barrier_gen = 0;
  bool used_sync = false;
  KernelStats* stats = nullptr;
  void (*invoke)(const void*) = nullptr;
  const void* args = nullptr;
};

inline void release_block_barrier_if_complete(Block* b) {
  if (b->barrier_arrived > 0 && b->barrier_arrived == b->live) {
    b->barrier_arrived = 0;
    b->barrier_gen++;
    b->stats->barriers.fetch_add(1, std::memory_order_relaxed);
  }
}

inline void release_warp_if_complete(Block* b, Warp& w, unsigned expected) {
  if (w.arrived > 0 && w.arrived >= expected) {
    w.arrived = 0;
    w.gen++;
    b->stats->warp_syncs.fetch_add(1, std::memory_order_relaxed);
  }
}

// Back to the block's scheduler; returns when this fiber is resumed.
inline void yield_to_scheduler(Block* b) {
  Fiber* f = b->cur;
  asan_start_switch(&f->asan_fake, b->sched_bottom, b->sched_size);
  bctx::transfer_t t = bctx::jump_fcontext(b->sched, nullptr);
  asan_finish_switch(f->asan_fake, nullptr, nullptr);
  b->sched = t.fctx;
  tl_cur = &b->cur->tctx;
}

[[noreturn]] inline void sync_on_plain_path(const char* what) {
  fatal(std::string("kernel '") + (tl_cur ? tl_cur->kernel : "?") + "' called " + what +
        " in a block run as a plain loop: its block 0 crossed no barrier, so the launch "
        "took the barrier-free path. Make barrier use uniform across blocks, or set "
        "FLOWC_SIM_FIBERS=1 to run every block on fibers");
}

inline Block* current_block(const char* what) {
  Block* b = tl_cur ? tl_cur->block : nullptr;
  if (b == nullptr) sync_on_plain_path(what);
  b->used_sync = true;
  return b;
}

inline void syncthreads() {
  Block* b = current_block("__syncthreads()");
  Fiber* f = b->cur;
  f->wait_gen = b->barrier_gen;
  b->barrier_arrived++;
  release_block_barrier_if_complete(b);
  if (b->barrier_gen == f->wait_gen) {
    f->state = FiberState::kBlockBarrier;
    yield_to_scheduler(b);
  }
}

inline unsigned lane_id() { return tl_cur->linear & 31u; }

// All lanes of `mask` that are still running meet here.
inline void warp_barrier(Block* b, unsigned mask) {
  Fiber* f = b->cur;
  Warp& w = b->warps[f->tctx.linear / 32];
  const unsigned expected = static_cast<unsigned>(__builtin_popcount(mask & w.live_mask));
  f->wait_gen = w.gen;
  w.arrived++;
  release_warp_if_complete(b, w, expected);
  if (w.gen == f->wait_gen) {
    f->state = FiberState::kWarpBarrier;
    yield_to_scheduler(b);
  }
}

inline void syncwarp(unsigned mask) { warp_barrier(current_block("__syncwarp()"), mask); }

// One data exchange among the lanes of `mask`: each lane publishes `mine`, then reads the
// published values. Two slot sets alternate, so one barrier per exchange suffices: a lane can
// only overwrite a set after every lane has passed the next exchange's barrier.
template <class Read>
inline auto exchange(const char* what, unsigned mask, uint64_t mine, Read read) {
  Block* b = current_block(what);
  Fiber* f = b->cur;
  Warp& w = b->warps[f->tctx.linear / 32];
  const unsigned parity = f->exchanges++ & 1u;
  w.slots[parity][lane_id()] = mine;
  warp_barrier(b, mask);
  return read(w.slots[parity], w.live_mask & mask);
}

template <class T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8, "warp shuffles move at most 8 bytes");
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}

template <class T>
inline T from_bits(uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

template <class T>
inline T shfl_from(const char* what, unsigned mask, T var, int src, int width) {
  const int lane = static_cast<int>(lane_id());
  const int seg = lane & ~(width - 1);
  return exchange(what, mask, to_bits(var), [&](const uint64_t* slots, unsigned) {
    const int s = seg + (src & (width - 1));
    return from_bits<T>(slots[s]);
  });
}

template <class T>
inline T shfl_rel(const char* what, unsigned mask, T var, int src, int width) {
  // src is already absolute; out of the segment means "keep your own value".
  const int lane = static_cast<int>(lane_id());
  const int seg = lane & ~(width - 1);
  const uint64_t mine = to_bits(var);
  return exchange(what, mask, mine, [&](const uint64_t* slots, unsigned) {
    if (src < seg || src >= seg + width) return from_bits<T>(mine);
    return from_bits<T>(slots[src]);
  });
}

// -- kernel launches ------------------------------------------------------------------------------

struct Launch {
  const char* name = "";
  dim3 grid, block;
  size_t shared_bytes = 0;
  unsigned nblocks = 0;
  unsigned next = 0;  // blocks started so far, in `order`
  std::vector<unsigned> order;
  bool fibers = false;  // decided by the first block
  uint64_t id = 0;
  KernelStats* stats = nullptr;
  std::shared_ptr<void> args;
  void (*invoke)(const void*) = nullptr;
  void (*run_plain)(const Launch&, unsigned block) = nullptr;
};

inline uint3 unflatten(unsigned i, dim3 d) { return uint3{i % d.x, (i / d.x) % d.y, i / (d.x * d.y)}; }

inline void fiber_entry(bctx::transfer_t t) {
  Block* b = static_cast<Block*>(t.data);
  asan_finish_switch(nullptr, &b->sched_bottom, &b->sched_size);
  b->sched = t.fctx;
  tl_cur = &b->cur->tctx;
  b->invoke(b->args);
  Fiber* f = b->cur;
  f->state = FiberState::kDone;
  b->live--;
  b->warps[f->tctx.linear / 32].live_mask &= ~(1u << (f->tctx.linear & 31u));
  release_block_barrier_if_complete(b);
  for (auto& w : b->warps)
    release_warp_if_complete(b, w, static_cast<unsigned>(__builtin_popcount(w.live_mask)));
  asan_start_switch(nullptr, b->sched_bottom, b->sched_size);  // this fiber is over
  bctx::jump_fcontext(b->sched, nullptr);
  fatal("internal error: a finished fiber was resumed");
}

inline void prepare_shared(size_t bytes) {
  if (tl_dynamic_shared.size() < bytes) tl_dynamic_shared.resize(bytes);
}

inline ThreadCtx make_ctx(const Launch& L, unsigned block, unsigned t) {
  ThreadCtx c;
  c.block_idx = unflatten(block, L.grid);
  c.thread_idx = unflatten(t, L.block);
  c.block_dim = L.block;
  c.grid_dim = L.grid;
  c.linear = t;
  c.kernel = L.name;
  return c;
}

// Runs one block on fibers; returns whether any thread used a barrier or warp intrinsic.
inline bool run_block_fibers(const Launch& L, unsigned block) {
  const unsigned n = L.block.x * L.block.y * L.block.z;
  prepare_shared(L.shared_bytes);
  Block b;
  b.stats = L.stats;
  b.invoke = L.invoke;
  b.args = L.args.get();
  b.fibers.resize(n);
  b.warps.resize((n + 31) / 32);
  for (unsigned w = 0; w < b.warps.size(); ++w) {
    const unsigned lanes = std::min(32u, n - 32 * w);
    b.warps[w].live_mask = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1);
  }
  for (unsigned t = 0; t < n; ++t) {
    Fiber& f = b.fibers[t];
    f.tctx = make_ctx(L, block, t);
    f.tctx.block = &b;
    Stack& s = tl_stacks.get(t);
    f.stack_bottom = s.bottom();
    f.stack_size = s.usable();
    f.ctx = bctx::make_fcontext(s.top(), f.stack_size, fiber_entry);
  }
  b.live = n;
  ThreadCtx* saved = tl_cur;
  uint64_t round = 0;
  while (b.live > 0) {
    fill_order(b.order, n, L.id * 0x100000001b3ULL + block * 0x9e37ULL + round++);
    bool progressed = false;
    for (unsigned i : b.order) {
      Fiber& f = b.fibers[i];
      if (f.state == FiberState::kDone) continue;
      if (f.state == FiberState::kBlockBarrier) {
        if (b.barrier_gen == f.wait_gen) continue;
      } else if (f.state == FiberState::kWarpBarrier) {
        if (b.warps[i / 32].gen == f.wait_gen) continue;
      }
      f.state = FiberState::kReady;
      b.cur = &f;
      tl_cur = &f.tctx;
      asan_start_switch(&b.sched_asan_fake, f.stack_bottom, f.stack_size);
      bctx::transfer_t t = bctx::jump_fcontext(f.ctx, &b);
      asan_finish_switch(b.sched_asan_fake, nullptr, nullptr);
      f.ctx = t.fctx;
      progressed = true;
    }
    if (!progressed) {
      fatal(std::string("kernel '") + L.name +
            "': the threads of a block wait on each other forever (a barrier or warp "
            "intrinsic that not every thread reaches)");
    }
  }
  tl_cur = saved;
  return b.used_sync;
}

// Runs one block as a plain loop over its threads (no barriers allowed). Instantiated per
// kernel, so the kernel body inlines into the loop: this is the fast path.
template <auto Kernel, class Tuple>
struct Invoker {
  static void invoke(const void* args) { std::apply(Kernel, *static_cast<const Tuple*>(args)); }

  static void run_plain(const Launch& L, unsigned block) {
    const Tuple& args = *static_cast<const Tuple*>(L.args.get());
    prepare_shared(L.shared_bytes);
    ThreadCtx c = make_ctx(L, block, 0);
    ThreadCtx* saved = tl_cur;
    tl_cur = &c;
    if (policy().order == Order::kForward) {
      unsigned t = 0;
      for (unsigned z = 0; z < L.block.z; ++z) {
        for (unsigned y = 0; y < L.block.y; ++y) {
          for (unsigned x = 0; x < L.block.x; ++x, ++t) {
            c.thread_idx = uint3{x, y, z};
            c.linear = t;
            std::apply(Kernel, args);
          }
        }
      }
    } else {
      static thread_local std::vector<unsigned> order;
      fill_order(order, L.block.x * L.block.y * L.block.z, L.id * 0x100000001b3ULL + block * 0x9e37ULL);
      for (unsigned t : order) {
        c.thread_idx = unflatten(t, L.block);
        c.linear = t;
        std::apply(Kernel, args);
      }
    }
    tl_cur = saved;
  }
};

// Runs up to `count` more blocks of the launch (all of them, in parallel, when count == 0).
inline void run_blocks(Launch& L, unsigned count) {
  if (L.next == 0) {
    fill_order(L.order, L.nblocks, L.id);
    // Block 0 decides fibers or plain loops, whatever the order: under a grid that covers
    // more than the work (a size bucket's, docs/dynamic.md) a later block may have nothing to
    // do and cross no barrier, but block 0 has the first of the work.
    if (!L.order.empty()) std::iter_swap(L.order.begin(), std::find(L.order.begin(), L.order.end(), 0u));
    const bool sync = run_block_fibers(L, L.order[0]) || policy().force_fibers;
    L.fibers = sync;
    (sync ? L.stats->launches_fibers : L.stats->launches_plain).fetch_add(1);
    L.stats->blocks_fibers.fetch_add(1);
    L.next = 1;
    if (count == 1) return;
    if (count > 0) --count;
  }
  const unsigned end = count == 0 ? L.nblocks : std::min(L.nblocks, L.next + count);
  const unsigned begin = L.next;
  L.next = end;
  if (end <= begin) return;
  (L.fibers ? L.stats->blocks_fibers : L.stats->blocks_plain).fetch_add(end - begin);
  if (end - begin == 1) {
    if (L.fibers) {
      run_block_fibers(L, L.order[begin]);
    } else {
      L.run_plain(L, L.order[begin]);
    }
    return;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (long k = static_cast<long>(begin); k < static_cast<long>(end); ++k) {
    if (L.fibers) {
      run_block_fibers(L, L.order[static_cast<size_t>(k)]);
    } else {
      L.run_plain(L, L.order[static_cast<size_t>(k)]);
    }
  }
}

}  // namespace sim
}  // namespace flowc
