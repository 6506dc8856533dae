// Collectives between the ranks of a device mesh: NCCL on the GPU, MPI on the host (where device
// memory is host memory). MPI starts the ranks and builds the communicators in both builds.
//
// Ranks are numbered row-major over the mesh shape, mesh axis 0 outermost. The group of a rank
// along mesh axis `a` is the ranks that differ from it only in coordinate `a`, ordered by that
// coordinate, so member k of a group is the rank whose coordinate `a` is k.
//
// Collectives take device buffers, element counts and an ONNX element type (TensorProto: 1 f32,
// 10 f16, 16 bf16, 11 f64, 7 i64, 6 i32, 3 i8, 2 u8, 9 bool) and are ordered on the caller's
// stream like a kernel: NCCL enqueues them; the host build drains the stream and then makes the
// blocking MPI call, so every rank issues its collectives in program order. Reductions are sums
// (not for bool). Buffers must be disjoint except the in-place forms NCCL allows: all_reduce with
// send == recv, all_gather with send == recv + k * send_count, reduce_scatter with recv == send +
// k * recv_count (k: this rank's index in the group); all_to_all is never in place.
//
// Communication log: with FLOWC_COMM_LOG=PREFIX in the environment, every rank appends one line
// per collective it issues to PREFIX.rank<world rank>, flushed at once:
//     <collective> axis=<mesh axis> bytes=<bytes of this rank's send buffer> dtype=<ONNX type>
// e.g. "all-reduce axis=0 bytes=32768 dtype=1"; collectives are all-reduce, all-gather,
// reduce-scatter and all-to-all (the names of flowc's boxing steps). Calls rejected for bad
// arguments are not logged. A log that cannot be opened (flowc/file_io.h's rules for files
// written: a FIFO with no reader is refused, not waited on) fails the first collective.
//
// Deadline: with FLOWC_TIMEOUT_S=SECONDS (a decimal number from 0.001 to 31536000, flowc/env.h)
// in the environment, a rank that waits longer than that for the others at one collective ends
// the job instead of hanging (a peer stopped, deadlocked or gone). Every rank counts the
// collectives it enters (its step, from 1) and publishes the count in an MPI window before each
// one, with a heartbeat while it waits; the rank that runs out of time reads them all, names
// the member of the step's group that holds it up ("rank 1 has not reached step 3 (all-reduce
// axis=0) after 5.0 s; aborting"), aborts NCCL and calls MPI_Abort. A rank counts only the time
// it runs: one that was stopped (SIGSTOP, a debugger) while it waited does not blame its peers
// for that time when it resumes, and publishes how long it was stopped, so that a peer that ran
// out of time meanwhile names it. On the host the collectives are then nonblocking MPI calls
// polled with MPI_Test; on the GPU, wait_event() polls the end of a run with cudaEventQuery
// under the same deadline. Without the variable every call is the blocking one, as fast as
// before.
#pragma once

#if !defined(FLOWC_MULTI_RANK)
#error "flowc/comm.h needs MPI: build the target with flowc_target_comm() from flowc.cmake"
#endif

// Only MPI's C API is used; Open MPI's and MPICH's C++ bindings would bring warnings with them.
#if !defined(OMPI_SKIP_MPICXX)
#define OMPI_SKIP_MPICXX 1
#endif
#if !defined(MPICH_SKIP_MPICXX)
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "flowc/device.h"
#include "flowc/env.h"
#include "flowc/file_io.h"
#include "flowc/status.h"

#if !defined(FLOWC_HOST)
#include <nccl.h>
#endif

namespace flowc {
namespace comm {

constexpr int kMaxMeshDims = 8;

struct Mesh {
  int ndim = 0;
  int shape[kMaxMeshDims] = {};
};

// Notices that this process was stopped (SIGSTOP stops every thread; a debugger; the machine
// suspended): a thread, started with the deadline, wakes every kPeriod; a wake that comes
// kStoppedGap or more after the one before means the process did not run meanwhile, and the
// gap is added to `stopped_ns`. The thread makes no MPI call (MPI runs at
// MPI_THREAD_FUNNELED); the rank's own thread publishes what it finds (see note_stops).
struct StopWatch {
  static constexpr std::chrono::milliseconds kPeriod{20};
  static constexpr std::chrono::milliseconds kStoppedGap{200};
  std::atomic<int64_t> stopped_ns{0};
  std::atomic<int64_t> wakes{0};  // counted after stopped_ns is updated
  std::atomic<bool> quit{false};
  std::thread thread;

  void start() {
    thread = std::thread([this] {
      auto last = std::chrono::steady_clock::now();
      while (!quit.load()) {
        std::this_thread::sleep_for(kPeriod);
        const auto now = std::chrono::steady_clock::now();
        if (now - last >= kStoppedGap) {
          stopped_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(now - last - kPeriod).count();
        }
        last = now;
        ++wakes;
      }
    });
  }

  // Returns once the thread has woken twice more (at most a second): by then a stop that
  // ended before the call is in stopped_ns. The rank's own thread can run first after a
  // SIGCONT and would otherwise see the whole stop as time waited.
  void catch_up() const {
    const int64_t from = wakes.load();
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (wakes.load() < from + 2 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  ~StopWatch() {
    quit = true;
    if (thread.joinable()) thread.join();
  }
};

// One process's place in a mesh and its communicators. Made by init(), shared by every caller
// that asks for the same mesh shape, freed by finalize().
struct World {
  Mesh mesh;
  int rank = 0;        // in MPI_COMM_WORLD
  int size = 0;        // the product of the mesh shape
  int local_rank = 0;  // among the ranks on this machine; picks the GPU
  int coords[kMaxMeshDims] = {};
  MPI_Comm mpi = MPI_COMM_NULL;  // MPI_COMM_WORLD, duplicated so its errors come back as codes
  MPI_Comm axis_mpi[kMaxMeshDims];
#if !defined(FLOWC_HOST)
  ncclComm_t nccl = nullptr;
  ncclComm_t axis_nccl[kMaxMeshDims] = {};
#endif
  // The deadline (FLOWC_TIMEOUT_S; 0: none) and what the ranks publish for it: a window of
  // four int64 per rank, {the step it entered, a heartbeat that moves while it waits, the
  // latest step in which (or on its way to which) it was stopped, for how many ms}.
  double timeout_s = 0;
  MPI_Win watch = MPI_WIN_NULL;
  int64_t step = 0;  // collectives this rank has entered
  int64_t beat = 0;
  std::unique_ptr<StopWatch> stopwatch;  // with the deadline
  int64_t stopped_seen_ns = 0;           // what this rank has published of stopwatch->stopped_ns
  int64_t stop_step = 0, stop_ms = 0;    // what it published (slots 2 and 3)
  std::string step_what;                 // the latest step, as messages name it: "all-reduce axis=0"
  World() { std::fill(axis_mpi, axis_mpi + kMaxMeshDims, MPI_COMM_NULL); }
  int group_size(int axis) const { return mesh.shape[axis]; }
  int group_rank(int axis) const { return coords[axis]; }
};

namespace detail {

struct State {
  std::vector<World*> worlds;
  bool started_mpi = false;
  bool log_opened = false;
  FILE* log = nullptr;
  std::string log_error;  // why the log could not be opened
};

inline State& state() {
  static State s;
  return s;
}

inline std::string mpi_error(const char* what, const char* call, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS)
    len = std::snprintf(text, sizeof(text), "code %d", code);
  return std::string(what) + ": " + call + " failed: " + std::string(text, static_cast<size_t>(len));
}

#define FLOWC_COMM_MPI(what, call)                                                                \
  do {                                                                                            \
    int flowc_mpi_rc_ = (call);                                                                   \
    if (flowc_mpi_rc_ != MPI_SUCCESS) {                                                           \
      return ::flowc::LibraryError(::flowc::comm::detail::mpi_error(what, #call, flowc_mpi_rc_)); \
    }                                                                                             \
  } while (0)

#if !defined(FLOWC_HOST)
inline std::string nccl_error(const char* what, const char* call, ncclResult_t r, ncclComm_t comm) {
  std::string m = std::string(what) + ": " + call + " failed: " + ncclGetErrorString(r);
  const char* last = comm ? ncclGetLastError(comm) : nullptr;
  if (last && *last) m += std::string(" (") + last + ")";
  return m;
}

#define FLOWC_COMM_NCCL(what, handle, call)                                                                 \
  do {                                                                                                      \
    ncclResult_t flowc_nccl_rc_ = (call);                                                                   \
    if (flowc_nccl_rc_ != ncclSuccess) {                                                                    \
      return ::flowc::LibraryError(::flowc::comm::detail::nccl_error(what, #call, flowc_nccl_rc_, handle)); \
    }                                                                                                       \
  } while (0)
#endif

inline std::string mesh_text(const Mesh& m) {
  std::string s;
  for (int i = 0; i < m.ndim; ++i) s += (i ? "x" : "") + std::to_string(m.shape[i]);
  return s;
}

// Element size of an ONNX element type; 0 for types collectives do not take.
inline size_t element_bytes(int onnx_dtype) {
  switch (onnx_dtype) {
    case 11:  // f64
    case 7:   // i64
      return 8;
    case 1:  // f32
    case 6:  // i32
      return 4;
    case 10:  // f16
    case 16:  // bf16
      return 2;
    case 3:  // i8
    case 2:  // u8
    case 9:  // bool
      return 1;
    default:
      return 0;
  }
}

// Appends a line to the communication log (FLOWC_COMM_LOG=PREFIX: PREFIX.rank<world rank>,
// opened at the first line); an error when it cannot be opened.
inline Status log_line(const World& w, const std::string& line) {
  State& s = state();
  if (!s.log_opened) {
    s.log_opened = true;
    if (const char* prefix = env::path("FLOWC_COMM_LOG")) {
      const std::string path = std::string(prefix) + ".rank" + std::to_string(w.rank);
      io::File file;
      std::string why;
      if (io::open_for_writing(path, true, &file, &why)) {
        std::swap(s.log, file.f);
      } else {
        s.log_error = "FLOWC_COMM_LOG=" + std::string(prefix) + ": cannot open the communication log " +
                      path + " for appending: " + why;
      }
    }
  }
  if (!s.log_error.empty()) return InvalidArgument(s.log_error);
  if (s.log == nullptr) return Status::Ok();
  std::fputs(line.c_str(), s.log);
  std::fflush(s.log);
  return Status::Ok();
}

inline Status log_call(const World& w, const char* collective, int axis, size_t bytes, int dtype) {
  State& s = state();
  if (s.log_opened && s.log == nullptr && s.log_error.empty()) return Status::Ok();  // no log
  return log_line(w, std::string(collective) + " axis=" + std::to_string(axis) +
                         " bytes=" + std::to_string(bytes) + " dtype=" + std::to_string(dtype) + "\n");
}

inline bool disjoint(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return pa + a_bytes <= pb || pb + b_bytes <= pa;
}

// The checks every collective makes before it runs, the same on both builds.
inline Status check(const World& w, const char* what, int axis, int dtype, [[maybe_unused]] size_t count,
                    bool reduces, size_t* elem) {
  if (axis < 0 || axis >= w.mesh.ndim) {
    return InvalidArgument(std::string(what) + ": mesh axis " + std::to_string(axis) +
                           " is not an axis of the " + mesh_text(w.mesh) + " mesh");
  }
  *elem = element_bytes(dtype);
  if (*elem == 0) {
    return InvalidArgument(std::string(what) + ": ONNX element type " + std::to_string(dtype) +
                           " is not one of f32, f16, bf16, f64, i64, i32, i8, u8, bool");
  }
  if (reduces && dtype == 9) return NotSupported(std::string(what) + ": bool tensors cannot be summed");
#if defined(FLOWC_HOST)
  // MPI counts are int; a larger count would wrap.
  if (count * static_cast<size_t>(w.group_size(axis)) > static_cast<size_t>(INT_MAX)) {
    return NotSupported(std::string(what) + ": " + std::to_string(count) +
                        " elements per rank are more than MPI's int counts reach");
  }
#endif
  return Status::Ok();
}

inline Status overlap_error(const char* what, const char* allowed) {
  return InvalidArgument(std::string(what) + ": the send and receive buffers overlap (allowed: disjoint" +
                         allowed + ")");
}

// f16 and bf16 sums run in f32 on the host: one rounding per element, as NCCL's result has.
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {
    const float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  const uint32_t bits =
      exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // at least 65520 rounds to infinity
  if (ax < 0x38800000u) {                        // below 2^-14: subnormal, exact scaling by 2^24
    float a;
    std::memcpy(&a, &ax, sizeof(a));
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f));
  }
  uint32_t h = (((ax >> 23) - 112) << 10) | ((ax & 0x7fffffu) >> 13);
  const uint32_t rest = ax & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // to nearest even; may carry into the exponent
  return sign | static_cast<uint16_t>(h);
}

inline float bf16_to_f32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN stays NaN
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline std::vector<float> widen(const void* p, size_t n, int dtype) {
  std::vector<float> out(n);
  const auto* h = static_cast<const uint16_t*>(p);
  for (size_t i = 0; i < n; ++i) out[i] = dtype == 10 ? f16_to_f32(h[i]) : bf16_to_f32(h[i]);
  return out;
}

inline void narrow(const float* src, size_t n, int dtype, void* p) {
  auto* h = static_cast<uint16_t*>(p);
  for (size_t i = 0; i < n; ++i) h[i] = dtype == 10 ? f32_to_f16(src[i]) : f32_to_bf16(src[i]);
}

#if defined(FLOWC_HOST)
inline MPI_Datatype mpi_type(int dtype) {
  switch (dtype) {
    case 1:
      return MPI_FLOAT;
    case 11:
      return MPI_DOUBLE;
    case 7:
      return MPI_INT64_T;
    case 6:
      return MPI_INT32_T;
    case 3:
      return MPI_INT8_T;
    case 10:
    case 16:
      return MPI_UINT16_T;  // moved as bits; sums go through f32
    default:
      return MPI_UINT8_T;  // u8, and bool as its bytes
  }
}

// On the host a collective is a host function in the stream: it runs (a blocking MPI call)
// when the emulator reaches it in stream order, after the work the stream waits for. Every
// rank issues the same collectives in the same order on one stream, so the blocking calls
// meet. A failure there has no caller to return to: it stops the whole job.
struct HostCall {
  std::function<Status()> body;
};

inline void run_host_call(void* p) {
  std::unique_ptr<HostCall> call(static_cast<HostCall*>(p));
  const Status st = call->body();
  if (!st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.message().c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

inline Status host_enqueue(std::function<Status()> body, cudaStream_t stream, const char* what) {
  auto* call = new HostCall{std::move(body)};
  const cudaError_t e = cudaLaunchHostFunc(stream, run_host_call, call);
  if (e != cudaSuccess) {
    delete call;
    return LibraryError(std::string(what) + ": cudaLaunchHostFunc failed: " + cudaGetErrorString(e));
  }
  return Status::Ok();
}
#else
inline ncclDataType_t nccl_type(int dtype) {
  switch (dtype) {
    case 1:
      return ncclFloat32;
    case 10:
      return ncclFloat16;
    case 16:
      return ncclBfloat16;
    case 11:
      return ncclFloat64;
    case 7:
      return ncclInt64;
    case 6:
      return ncclInt32;
    case 3:
      return ncclInt8;
    default:
      return ncclUint8;  // u8, and bool as its bytes
  }
}
#endif

// -- the deadline (FLOWC_TIMEOUT_S) ----------------------------------------------------------

// FLOWC_TIMEOUT_S in seconds; 0 when it is unset or empty.
inline Status timeout_from_env(double* out) {
  *out = 0;
  return env::seconds("FLOWC_TIMEOUT_S", out);
}

// A rank's slots: 0 holds its state, 2s-1 while it is in step s and 2s once step s is done (0:
// none yet); 1 holds its heartbeat; 2 the latest step in which it found, once it ran again,
// that it had been stopped while it waited, and 3 for how many milliseconds in all (see
// WaitClock). Only this rank writes them, atomically, so readers see whole values. Failures are
// ignored: the slots only serve to explain a timeout.
constexpr int kSlots = 4;

inline void put_slot(World& w, int slot, int64_t value) {
  int64_t old = 0;
  MPI_Fetch_and_op(&value, &old, MPI_INT64_T, w.rank, slot, MPI_REPLACE, w.watch);
  MPI_Win_flush(w.rank, w.watch);
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Publishes the time this process was stopped since it last looked (StopWatch) as time
// stopped in, or on its way to, its current step (slots 2 and 3).
inline void note_stops(World& w) {
  const int64_t total = w.stopwatch ? w.stopwatch->stopped_ns.load() : 0;
  if (total == w.stopped_seen_ns) return;
  const int64_t ms = (total - w.stopped_seen_ns) / 1000000;
  w.stopped_seen_ns = total;
  w.stop_ms = (w.stop_step == w.step ? w.stop_ms : 0) + ms;
  w.stop_step = w.step;
  put_slot(w, 3, w.stop_ms);  // before the step, so a reader that sees this step sees its time
  put_slot(w, 2, w.stop_step);
}

// Enters the next step (a collective, or the all-succeeded check when axis < 0).
inline void enter(World& w, const char* what, int axis) {
  if (w.timeout_s <= 0) return;
  ++w.step;
  w.step_what = axis >= 0 ? std::string(what) + " axis=" + std::to_string(axis) : std::string(what);
  put_slot(w, 0, 2 * w.step - 1);
  note_stops(w);
}

inline void leave(World& w) {
  if (w.timeout_s > 0) put_slot(w, 0, 2 * w.step);
}

inline void heartbeat(World& w) { put_slot(w, 1, ++w.beat); }

// The time a rank has waited at its current step, counting only the time it ran. A rank that
// was stopped while it waited finds, once it runs again, that its clock has jumped: that time
// is not its peers' doing, so it does not count towards the deadline (else the rank that was
// stopped would time out first when it resumes, and blame the peers that waited for it), and
// it is published (note_stops), so that a peer that ran out of time meanwhile names it.
class WaitClock {
 public:
  explicit WaitClock(World& w)
      : w_(w), start_(std::chrono::steady_clock::now()), stopped_at_start_(stopped_ns()) {}

  // At each poll: the seconds waited so far, stopped time left out. Past the deadline it
  // looks again once the stop watch has caught up, so a stop that just ended is not counted.
  double waited() {
    double s = measure();
    if (w_.timeout_s > 0 && s > w_.timeout_s && w_.stopwatch) {
      w_.stopwatch->catch_up();
      s = measure();
    }
    return s;
  }

 private:
  double measure() {
    note_stops(w_);
    const double stopped = double(stopped_ns() - stopped_at_start_) / 1e9;
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count() - stopped;
  }
  int64_t stopped_ns() const { return w_.stopwatch ? w_.stopwatch->stopped_ns.load() : 0; }
  World& w_;
  std::chrono::steady_clock::time_point start_;
  int64_t stopped_at_start_;
};

// Sleeps `seconds`, beating every 10 ms, so that peers never take this rank for a stopped one
// while it explains a timeout.
inline void pause_beating(World& w, double seconds) {
  const auto t0 = std::chrono::steady_clock::now();
  while (seconds_since(t0) < seconds) {
    heartbeat(w);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Rank r's slots, or false when they do not arrive within `patience` seconds (the target
// may have to take part in the transfer, and a stopped process takes part in nothing).
inline bool read_slots(World& w, int r, int64_t got[kSlots], double patience) {
  int64_t unused[kSlots] = {};
  MPI_Request req = MPI_REQUEST_NULL;
  if (MPI_Rget_accumulate(unused, kSlots, MPI_INT64_T, got, kSlots, MPI_INT64_T, r, 0, kSlots, MPI_INT64_T,
                          MPI_NO_OP, w.watch, &req) != MPI_SUCCESS) {
    return false;
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto next_beat = t0;
  for (;;) {
    int done = 0;
    if (MPI_Test(&req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return false;
    if (done) return true;
    const auto now = std::chrono::steady_clock::now();
    if (seconds_since(t0) > patience) return false;  // the request is left behind: the job ends
    if (now >= next_beat) {
      heartbeat(w);
      next_beat = now + std::chrono::milliseconds(10);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

inline bool same_group(const World& w, int r, int axis) {
  if (axis < 0) return true;  // a step over all ranks
  int rest = r, stride = w.size;
  for (int a = 0; a < w.mesh.ndim; ++a) {
    stride /= w.mesh.shape[a];
    const int c = rest / stride;
    rest %= stride;
    if (a != axis && c != w.coords[a]) return false;
  }
  return true;
}

inline std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", s);
  return buf;
}

// "rank R was stopped for X s ..." when rank R's slots say it was stopped for at least half the
// deadline, and noticed it (once it ran again) in step `step` or later (a step it is still in,
// or went on to after it resumed: the stop held up `step`); with step < 0, in the step it is in
// now. Else "".
inline std::string stopped_text(const World& w, int r, const int64_t got[kSlots], int64_t step) {
  const int64_t current = (got[0] + 1) / 2;
  if (got[2] <= 0 || (step >= 0 ? got[2] < step : got[2] != current)) return "";
  // A stop shorter than half the deadline does not explain a timeout (and a process that
  // did not get the CPU for a moment on a crowded machine is no stopped one).
  if (double(got[3]) / 1e3 < 0.5 * w.timeout_s) return "";
  const std::string where = step >= 0 && got[2] == step ? "in this step or on its way to it"
                            : step >= 0                 ? "while this step waited for it"
                                        : "in its step " + std::to_string(got[2]) + " or on its way to it";
  return "rank " + std::to_string(r) + " was stopped for " + seconds_text(double(got[3]) / 1e3) + " " +
         where + " (it runs again)";
}

// Ends the job: this rank has waited `waited` seconds at its step (time it did not run left
// out). The message names the member of the step's group that holds it up, from what the
// members published: one that does not answer, one that has not reached the step, one that is
// in the step but has stopped (its heartbeat does not move), or one that was stopped in the
// step and runs again. Ranks outside the group cannot hold up the step and are not named.
// A rank that finds the member it waits for short of an earlier step than its own leaves the
// report to that step's waiters for a while (kDeferS): the member's group at that step is
// waiting for it there and names the step the member never reached, the cause; this rank's
// step is only held up behind it. Past the while it reports what it sees.
constexpr double kDeferS = 1.0;

[[noreturn]] inline void timed_out(World& w, int axis, double waited) {
  const int n = w.size;
  std::vector<int64_t> got(static_cast<size_t>(n) * kSlots);
  std::vector<char> answered(static_cast<size_t>(n));
  const auto slots = [&](int r) { return &got[static_cast<size_t>(r) * kSlots]; };
  const auto member = [&](int r) { return r != w.rank && same_group(w, r, axis); };
  std::string why;
  int lag = -1;
  const std::string step = "step " + std::to_string(w.step) + " (" + w.step_what + ")";
  const auto look = [&]() {
    why.clear();
    lag = -1;
    for (int r = 0; r < n; ++r) {
      int64_t* g = slots(r);
      g[0] = 2 * w.step - 1;
      g[1] = w.beat;
      answered[r] = r == w.rank || !same_group(w, r, axis) || read_slots(w, r, g, 0.5);
    }
    for (int r = 0; r < n && why.empty(); ++r) {
      if (!member(r)) continue;
      if (!answered[r]) {
        why = "rank " + std::to_string(r) + " does not answer (stopped or gone) at " + step;
      } else if (slots(r)[0] < 2 * w.step - 1 && (lag < 0 || slots(r)[0] < slots(lag)[0])) {
        lag = r;
      }
    }
  };
  look();
  // Slot 0 is 2s - 1 while in step s and 2s once it is done: a member at most 2(s - 1) - 1
  // has not finished the step before ours.
  if (why.empty() && lag >= 0 && slots(lag)[0] < 2 * (w.step - 1)) {
    pause_beating(w, kDeferS);
    look();
  }
  const std::string secs = seconds_text(waited);
  if (!why.empty()) why += " after " + secs;
  if (why.empty() && lag >= 0)
    why = "rank " + std::to_string(lag) + " has not reached " + step + " after " + secs;
  if (why.empty()) {
    // Every member got here. One that waits beats every 10 ms; one that does not is stopped
    // inside the step. One that was stopped and runs again says so in its slots (read again:
    // it may have resumed since, and even finished its part of the step and gone on).
    pause_beating(w, 0.2);
    std::vector<int64_t> again(static_cast<size_t>(n) * kSlots);
    for (int r = 0; r < n && why.empty(); ++r) {
      if (!member(r)) continue;
      int64_t* a = &again[static_cast<size_t>(r) * kSlots];
      const bool read = read_slots(w, r, a, 0.5);
      if (slots(r)[0] == 2 * w.step - 1 && (!read || (a[0] == slots(r)[0] && a[1] == slots(r)[1])))
        why = "rank " + std::to_string(r) + " stopped inside " + step + " and has not finished it after " +
              secs;
    }
    for (int r = 0; r < n && why.empty(); ++r) {
      if (!member(r)) continue;
      if (const std::string s = stopped_text(w, r, &again[static_cast<size_t>(r) * kSlots], w.step);
          !s.empty())
        why = step + " did not finish after " + secs + ": " + s;
    }
  }
  if (why.empty()) why = step + " did not finish after " + secs;
  std::fprintf(stderr, "error: %s; aborting (FLOWC_TIMEOUT_S=%g, seen by rank %d)\n", why.c_str(),
               w.timeout_s, w.rank);
  std::fflush(stderr);
#if !defined(FLOWC_HOST)
  // Kernels waiting for a peer would never end; aborting the communicators frees the device.
  for (int a = 0; a < w.mesh.ndim; ++a) {
    if (w.axis_nccl[a]) ncclCommAbort(w.axis_nccl[a]);
    w.axis_nccl[a] = nullptr;
  }
  if (w.nccl) ncclCommAbort(w.nccl);
  w.nccl = nullptr;
#endif
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

// Waits for a nonblocking MPI call of the current step, beating, until the deadline.
inline int wait_request(World& w, int axis, MPI_Request* req) {
  using clock = std::chrono::steady_clock;
  WaitClock waiting(w);
  auto next_beat = clock::now();
  for (long spin = 0;; ++spin) {
    int done = 0;
    const int rc = MPI_Test(req, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS || done) return rc;
    const double waited = waiting.waited();
    const auto now = clock::now();
    if (now >= next_beat) {
      heartbeat(w);
      next_beat = now + std::chrono::milliseconds(10);
    }
    if (waited > w.timeout_s) timed_out(w, axis, waited);
    // Ranks may share cores (the host target oversubscribes): give the others the CPU.
    if (spin < 1000) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

// One step over MPI: `call(nullptr)` makes the blocking call, `call(&request)` the nonblocking
// one, which runs under the deadline when there is one. Returns an MPI error code.
template <typename Call>
inline int mpi_step(World& w, const char* what, int axis, Call&& call) {
  if (w.timeout_s <= 0) return call(nullptr);
  enter(w, what, axis);
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = call(&req);
  if (rc == MPI_SUCCESS) rc = wait_request(w, axis, &req);
  leave(w);
  return rc;
}

// Publishing slots: collective over all ranks, only when there is a deadline.
inline Status open_watch(World* w) {
  const char* what = "flowc::comm::init";
  int64_t* base = nullptr;
  FLOWC_COMM_MPI(what, MPI_Win_allocate(static_cast<MPI_Aint>(kSlots * sizeof(int64_t)), sizeof(int64_t),
                                        MPI_INFO_NULL, w->mpi, &base, &w->watch));
  std::fill(base, base + kSlots, int64_t(0));
  FLOWC_COMM_MPI(what, MPI_Win_set_errhandler(w->watch, MPI_ERRORS_RETURN));
  FLOWC_COMM_MPI(what, MPI_Win_lock_all(0, w->watch));
  return Status::Ok();
}

inline void free_world(World* w) {
#if !defined(FLOWC_HOST)
  for (int a = 0; a < w->mesh.ndim; ++a) {
    if (w->axis_nccl[a]) ncclCommDestroy(w->axis_nccl[a]);
  }
  if (w->nccl) ncclCommDestroy(w->nccl);
#endif
  if (w->watch != MPI_WIN_NULL) {
    MPI_Win_unlock_all(w->watch);
    MPI_Win_free(&w->watch);
  }
  for (int a = 0; a < w->mesh.ndim; ++a) {
    if (w->axis_mpi[a] != MPI_COMM_NULL) MPI_Comm_free(&w->axis_mpi[a]);
  }
  if (w->mpi != MPI_COMM_NULL) MPI_Comm_free(&w->mpi);
  delete w;
}

// Builds the communicators of `w`, whose mesh, rank and size are set. Collective over all ranks.
inline Status connect(World* w) {
  const char* what = "flowc::comm::init";
  FLOWC_COMM_MPI(what, MPI_Comm_dup(MPI_COMM_WORLD, &w->mpi));
  FLOWC_COMM_MPI(what, MPI_Comm_set_errhandler(w->mpi, MPI_ERRORS_RETURN));
  if (w->timeout_s > 0) {
    if (Status st = open_watch(w); !st.ok()) return st;
    w->stopwatch = std::make_unique<StopWatch>();
    w->stopwatch->start();
  }
  int stride = w->size;
  int rest = w->rank;
  int strides[kMaxMeshDims];
  for (int a = 0; a < w->mesh.ndim; ++a) {
    stride /= w->mesh.shape[a];
    strides[a] = stride;
    w->coords[a] = rest / stride;
    rest %= stride;
  }
  for (int a = 0; a < w->mesh.ndim; ++a) {
    // The color names the group (the rank with coordinate a zeroed); the key orders it.
    const int color = w->rank - w->coords[a] * strides[a];
    FLOWC_COMM_MPI(what, MPI_Comm_split(w->mpi, color, w->coords[a], &w->axis_mpi[a]));
  }
  MPI_Comm node;
  FLOWC_COMM_MPI(what, MPI_Comm_split_type(w->mpi, MPI_COMM_TYPE_SHARED, w->rank, MPI_INFO_NULL, &node));
  const int rc = MPI_Comm_rank(node, &w->local_rank);
  MPI_Comm_free(&node);
  if (rc != MPI_SUCCESS) return LibraryError(mpi_error(what, "MPI_Comm_rank", rc));
  int devices = 0;
  cudaError_t e = cudaGetDeviceCount(&devices);
  if (e == cudaSuccess && devices == 0) e = cudaErrorInvalidDevice;
  if (e == cudaSuccess) e = cudaSetDevice(w->local_rank % devices);
  if (e != cudaSuccess)
    return LibraryError(std::string(what) + ": no device for this rank: " + cudaGetErrorString(e));
#if !defined(FLOWC_HOST)
  // Rank 0's result travels with the id, so a failure there does not leave the others waiting.
  struct {
    ncclUniqueId id;
    ncclResult_t result;
  } boot{};
  if (w->rank == 0) boot.result = ncclGetUniqueId(&boot.id);
  FLOWC_COMM_MPI(what, MPI_Bcast(&boot, sizeof(boot), MPI_BYTE, 0, w->mpi));
  if (boot.result != ncclSuccess) {
    return LibraryError(nccl_error(what, "ncclGetUniqueId (on rank 0)", boot.result, nullptr));
  }
  FLOWC_COMM_NCCL(what, nullptr, ncclCommInitRank(&w->nccl, w->size, boot.id, w->rank));
  for (int a = 0; a < w->mesh.ndim; ++a) {
    const int color = w->rank - w->coords[a] * strides[a];
    FLOWC_COMM_NCCL(what, w->nccl, ncclCommSplit(w->nccl, color, w->coords[a], &w->axis_nccl[a], nullptr));
  }
#endif
  return Status::Ok();
}

}  // namespace detail

// Joins the mesh `mesh_shape[0] x ... x mesh_shape[ndim-1]`: starts MPI unless the program did,
// checks that the job has exactly that many ranks, and builds one communicator per mesh axis
// (on the GPU also picks this rank's device and builds NCCL communicators). Collective: every
// rank calls it. Asking again for the same mesh returns the same World.
inline Status init(const int* mesh_shape, int ndim, World** out) {
  const char* what = "flowc::comm::init";
  if (ndim < 1 || ndim > kMaxMeshDims) {
    return InvalidArgument(std::string(what) + ": a mesh has 1 to " + std::to_string(kMaxMeshDims) +
                           " axes, not " + std::to_string(ndim));
  }
  Mesh mesh;
  mesh.ndim = ndim;
  long long devices = 1;
  for (int a = 0; a < ndim; ++a) {
    if (mesh_shape[a] < 1) return InvalidArgument(std::string(what) + ": mesh axis sizes must be positive");
    mesh.shape[a] = mesh_shape[a];
    devices *= mesh_shape[a];
  }
  detail::State& s = detail::state();
  int flag = 0;
  MPI_Finalized(&flag);
  if (flag) return InvalidArgument(std::string(what) + ": MPI was already finalized");
  MPI_Initialized(&flag);
  if (!flag) {
    int provided = 0;
    FLOWC_COMM_MPI(what, MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided));
    s.started_mpi = true;
  }
  for (World* w : s.worlds) {
    if (w->mesh.ndim == ndim && std::equal(mesh.shape, mesh.shape + ndim, w->mesh.shape)) {
      *out = w;
      return Status::Ok();
    }
  }
  double timeout_s = 0;
  if (Status st = detail::timeout_from_env(&timeout_s); !st.ok()) return st;
  int size = 0, rank = 0;
  FLOWC_COMM_MPI(what, MPI_Comm_size(MPI_COMM_WORLD, &size));
  FLOWC_COMM_MPI(what, MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  if (size != devices) {
    return InvalidArgument("this program was compiled for a mesh of " + std::to_string(devices) +
                           " devices (" + detail::mesh_text(mesh) + ") but was started with " +
                           std::to_string(size) + (size == 1 ? " rank" : " ranks") +
                           "; run it with mpirun -np " + std::to_string(devices));
  }
  World* w = new World;
  w->mesh = mesh;
  w->rank = rank;
  w->size = size;
  w->timeout_s = timeout_s;
  if (Status st = detail::connect(w); !st.ok()) {
    detail::free_world(w);
    return st;
  }
  s.worlds.push_back(w);
  *out = w;
  return Status::Ok();
}

// Frees every World and, if init() started MPI, finalizes it. Call once, at the end of the
// program, after the device work has finished (every rank calls it).
inline void finalize() {
  detail::State& s = detail::state();
  for (World* w : s.worlds) {
    // Freeing the window and MPI_Finalize wait for every rank without a deadline: meet first
    // under it, so a rank that stopped before the end does not hang the others here.
    if (w->timeout_s > 0) {
      detail::mpi_step(*w, "the end of the program", -1,
                       [&](MPI_Request* r) { return MPI_Ibarrier(w->mpi, r); });
    }
    detail::free_world(w);
  }
  s.worlds.clear();
  if (s.log) std::fclose(s.log);
  s.log = nullptr;
  s.log_opened = false;
  s.log_error.clear();
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (s.started_mpi && initialized && !finalized) MPI_Finalize();
  s.started_mpi = false;
}

// Ends every rank of the job (a rank that fails alone would leave the others waiting in a
// collective). Exits only this process when MPI is not running.
[[noreturn]] inline void abort_all(int exit_code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::exit(exit_code);
}

// True when every rank of the job passes ok = true: an all-reduce of the flag over the ranks of
// the first mesh joined, under the deadline. Call it before writing results, so that a job in
// which any rank failed writes none (a rank that fails before it ends the job with abort_all(),
// and the others never get past it). Without a mesh joined it returns ok.
inline bool all_succeeded(bool ok) {
  detail::State& s = detail::state();
  if (s.worlds.empty()) return ok;
  World& w = *s.worlds.front();
  int mine = ok ? 1 : 0, all = 0;
  const int rc = detail::mpi_step(w, "the check that every rank succeeded", -1, [&](MPI_Request* r) {
    return r ? MPI_Iallreduce(&mine, &all, 1, MPI_INT, MPI_MIN, w.mpi, r)
             : MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, w.mpi);
  });
  if (rc != MPI_SUCCESS) {
    std::fprintf(stderr, "error: %s\n", detail::mpi_error("all_succeeded", "MPI_Allreduce", rc).c_str());
    return false;
  }
  return all == 1;
}

// Waits for `event` (the end of a run): cudaEventSynchronize, or with FLOWC_TIMEOUT_S a poll
// of cudaEventQuery under the deadline, which ends the job naming the rank that holds up the
// collectives the device is waiting on.
inline Status wait_event(World& w, cudaEvent_t event) {
  if (w.timeout_s <= 0) {
    const cudaError_t e = cudaEventSynchronize(event);
    if (e != cudaSuccess)
      return LibraryError(std::string("cudaEventSynchronize failed: ") + cudaGetErrorString(e));
    return Status::Ok();
  }
  detail::WaitClock waiting(w);
  for (;;) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return Status::Ok();
    if (e != cudaErrorNotReady)
      return LibraryError(std::string("cudaEventQuery failed: ") + cudaGetErrorString(e));
    detail::heartbeat(w);
    const double waited = waiting.waited();
    if (waited > w.timeout_s) {
      if (w.step == 0) w.step_what = "the device work";
      detail::timed_out(w, -1, waited);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

// recv = the element-wise sum of every group member's send (count elements each).
inline Status all_reduce(World& w, int mesh_axis, const void* send, void* recv, size_t count, int dtype,
                         cudaStream_t stream) {
  const char* what = "all-reduce";
  size_t eb = 0;
  if (Status st = detail::check(w, what, mesh_axis, dtype, count, true, &eb); !st.ok()) return st;
  const size_t bytes = count * eb;
  if (send != recv && !detail::disjoint(send, bytes, recv, bytes))
    return detail::overlap_error(what, ", or equal");
  if (Status st = detail::log_call(w, what, mesh_axis, bytes, dtype); !st.ok()) return st;
  if (count == 0) return Status::Ok();
#if defined(FLOWC_HOST)
  // Deferred into the stream like any other work, so the emulator's stream orders
  // exercise the events around it.
  return detail::host_enqueue(
      [=, &w]() -> Status {
        const int n = static_cast<int>(count);
        MPI_Comm comm = w.axis_mpi[mesh_axis];
        if (dtype == 10 || dtype == 16) {
          std::vector<float> wide = detail::widen(send, count, dtype);
          FLOWC_COMM_MPI(what, detail::mpi_step(w, what, mesh_axis, [&](MPI_Request* r) {
                           return r ? MPI_Iallreduce(MPI_IN_PLACE, wide.data(), n, MPI_FLOAT, MPI_SUM, comm,
                                                     r)
                                    : MPI_Allreduce(MPI_IN_PLACE, wide.data(), n, MPI_FLOAT, MPI_SUM, comm);
                         }));
          detail::narrow(wide.data(), count, dtype, recv);
          return Status::Ok();
        }
        const void* src = send == recv ? MPI_IN_PLACE : send;
        const MPI_Datatype t = detail::mpi_type(dtype);
        FLOWC_COMM_MPI(what, detail::mpi_step(w, what, mesh_axis, [&](MPI_Request* r) {
                         return r ? MPI_Iallreduce(src, recv, n, t, MPI_SUM, comm, r)
                                  : MPI_Allreduce(src, recv, n, t, MPI_SUM, comm);
                       }));
        return Status::Ok();
      },
      stream, what);
#else
  detail::enter(w, what, mesh_axis);  // on the GPU a step is reached when it is queued
  ncclComm_t comm = w.axis_nccl[mesh_axis];
  FLOWC_COMM_NCCL(what, comm,
                  ncclAllReduce(send, recv, count, detail::nccl_type(dtype), ncclSum, comm, stream));
#endif
  return Status::Ok();
}

// One part of an all-reduce bucket: the sum over the group of `count` elements of `send`,
// into `recv` (equal to send, or disjoint from it).
struct BucketPart {
  const void* send;
  void* recv;
  size_t count;
};

// Several all-reduces over one mesh axis as one collective step (a bucket of gradients):
// each part as all_reduce() makes it. On the GPU the parts are one NCCL group, which NCCL
// runs as one launch; on the host they are packed into one buffer and summed by one MPI
// call (f16 and bf16 in f32, as all_reduce()). Either way a bucket pays one latency; it is
// logged as one all-reduce of all its bytes.
inline Status all_reduce_bucket(World& w, int mesh_axis, const BucketPart* parts, int n, int dtype,
                                cudaStream_t stream) {
  const char* what = "all-reduce";
  size_t eb = 0, total = 0;
  for (int i = 0; i < n; ++i) total += parts[i].count;
  if (Status st = detail::check(w, what, mesh_axis, dtype, total, true, &eb); !st.ok()) return st;
  for (int i = 0; i < n; ++i) {
    const size_t bytes = parts[i].count * eb;
    if (parts[i].send != parts[i].recv && !detail::disjoint(parts[i].send, bytes, parts[i].recv, bytes))
      return detail::overlap_error(what, ", or equal");
  }
  if (Status st = detail::log_call(w, what, mesh_axis, total * eb, dtype); !st.ok()) return st;
  if (total == 0) return Status::Ok();
#if defined(FLOWC_HOST)
  std::vector<BucketPart> live(parts, parts + n);
  return detail::host_enqueue(
      [live, total, eb, mesh_axis, dtype, what, &w]() -> Status {
        const bool half = dtype == 10 || dtype == 16;
        const size_t width = half ? sizeof(float) : eb;
        std::vector<unsigned char> packed(total * width);
        size_t at = 0;
        for (const BucketPart& part : live) {
          if (half) {
            const std::vector<float> wide = detail::widen(part.send, part.count, dtype);
            std::memcpy(packed.data() + at * width, wide.data(), part.count * width);
          } else {
            std::memcpy(packed.data() + at * width, part.send, part.count * width);
          }
          at += part.count;
        }
        MPI_Comm comm = w.axis_mpi[mesh_axis];
        const MPI_Datatype t = half ? MPI_FLOAT : detail::mpi_type(dtype);
        const int count = static_cast<int>(total);
        FLOWC_COMM_MPI(what, detail::mpi_step(w, what, mesh_axis, [&](MPI_Request* r) {
                         return r ? MPI_Iallreduce(MPI_IN_PLACE, packed.data(), count, t, MPI_SUM, comm, r)
                                  : MPI_Allreduce(MPI_IN_PLACE, packed.data(), count, t, MPI_SUM, comm);
                       }));
        at = 0;
        for (const BucketPart& part : live) {
          if (half) {
            detail::narrow(reinterpret_cast<const float*>(packed.data()) + at, part.count, dtype, part.recv);
          } else {
            std::memcpy(part.recv, packed.data() + at * width, part.count * width);
          }
          at += part.count;
        }
        return Status::Ok();
      },
      stream, what);
#else
  detail::enter(w, what, mesh_axis);  // on the GPU a step is reached when it is queued
  ncclComm_t comm = w.axis_nccl[mesh_axis];
  const ncclDataType_t type = detail::nccl_type(dtype);
  FLOWC_COMM_NCCL(what, comm, ncclGroupStart());
  for (int i = 0; i < n; ++i) {
    if (parts[i].count == 0) continue;
    const ncclResult_t r =
        ncclAllReduce(parts[i].send, parts[i].recv, parts[i].count, type, ncclSum, comm, stream);
    if (r != ncclSuccess) {
      ncclGroupEnd();
      return LibraryError(detail::nccl_error(what, "ncclAllReduce", r, comm));
    }
  }
  FLOWC_COMM_NCCL(what, comm, ncclGroupEnd());
  return Status::Ok();
#endif
}

// recv = the group members' send buffers (send_count elements each) concatenated in group order.
inline Status all_gather(World& w, int mesh_axis, const void* send, void* recv, size_t send_count, int dtype,
                         cudaStream_t stream) {
  const char* what = "all-gather";
  size_t eb = 0;
  if (Status st = detail::check(w, what, mesh_axis, dtype, send_count, false, &eb); !st.ok()) return st;
  const size_t bytes = send_count * eb;
  const int p = w.group_size(mesh_axis), k = w.group_rank(mesh_axis);
  const bool in_place = send == static_cast<const char*>(recv) + k * bytes;
  if (!in_place && !detail::disjoint(send, bytes, recv, bytes * p)) {
    return detail::overlap_error(what, ", or send at this member's chunk of recv");
  }
  if (Status st = detail::log_call(w, what, mesh_axis, bytes, dtype); !st.ok()) return st;
  if (send_count == 0) return Status::Ok();
#if defined(FLOWC_HOST)
  // Deferred into the stream like any other work, so the emulator's stream orders
  // exercise the events around it.
  return detail::host_enqueue(
      [=, &w]() -> Status {
        const int n = static_cast<int>(send_count);
        const MPI_Datatype t = detail::mpi_type(dtype);
        MPI_Comm comm = w.axis_mpi[mesh_axis];
        const void* src = in_place ? MPI_IN_PLACE : send;
        const int send_n = in_place ? 0 : n;
        const MPI_Datatype send_t = in_place ? MPI_DATATYPE_NULL : t;
        FLOWC_COMM_MPI(what, detail::mpi_step(w, what, mesh_axis, [&](MPI_Request* r) {
                         return r ? MPI_Iallgather(src, send_n, send_t, recv, n, t, comm, r)
                                  : MPI_Allgather(src, send_n, send_t, recv, n, t, comm);
                       }));
        return Status::Ok();
      },
      stream, what);
#else
  detail::enter(w, what, mesh_axis);
  ncclComm_t comm = w.axis_nccl[mesh_axis];
  FLOWC_COMM_NCCL(what, comm, ncclAllGather(send, recv, send_count, detail::nccl_type(dtype), comm, stream));
#endif
  return Status::Ok();
}

// Member k's recv = the sum over the group of chunk k (recv_count elements) of every member's send.
inline Status reduce_scatter(World& w, int mesh_axis, const void* send, void* recv, size_t recv_count,
                             int dtype, cudaStream_t stream) {
  const char* what = "reduce-scatter";
  size_t eb = 0;
  if (Status st = detail::check(w, what, mesh_axis, dtype, recv_count, true, &eb); !st.ok()) return st;
  const int p = w.group_size(mesh_axis), k = w.group_rank(mesh_axis);
  const size_t bytes = recv_count * eb;
  const bool in_place = recv == static_cast<const char*>(send) + k * bytes;
  if (!in_place && !detail::disjoint(send, bytes * p, recv, bytes)) {
    return detail::overlap_error(what, ", or recv at this member's chunk of send");
  }
  if (Status st = detail::log_call(w, what, mesh_axis, bytes * p, dtype); !st.ok()) return st;
  if (recv_count == 0) return Status::Ok();
#if defined(FLOWC_HOST)
  // Deferred into the stream like any other work, so the emulator's stream orders
  // exercise the events around it.
  return detail::host_enqueue(
      [=, &w]() -> Status {
        const int n = static_cast<int>(recv_count);
        MPI_Comm comm = w.axis_mpi[mesh_axis];
        if (dtype == 10 || dtype == 16) {
          std::vector<float> wide = detail::widen(send, recv_count * p, dtype);
          FLOWC_COMM_MPI(what, detail::mpi_step(w, what, mesh_axis, [&](MPI_Request* r) {
                           return r ? MPI_Ireduce_scatter_block(MPI_IN_PLACE, wide.data(), n, MPI_FLOAT,
                                                                MPI_SUM, comm, r)
                                    : MPI_Reduce_scatter_block(MPI_IN_PLACE, wide.data(), n, MPI_FLOAT,
                                                               MPI_SUM, comm);
                         }));
          detail::narrow(wide.data(), recv_count, dtype, recv);  // MPI leaves the result at the start
          return Status::Ok();
        }
        // MPI's in-place form puts the result at the start of the buffer, not at chunk k: copy instead.
        std::vector<char> copy;
        if (in_place) copy.assign(static_cast<const char*>(send), static_cast<const char*>(send) + bytes * p);
        const void* src = in_place ? copy.data() : send;
        const MPI_Datatype t = detail::mpi_type(dtype);
        FLOWC_COMM_MPI(what, detail::mpi_step(w, what, mesh_axis, [&](MPI_Request* r) {
                         return r ? MPI_Ireduce_scatter_block(src, recv, n, t, MPI_SUM, comm, r)
                                  : MPI_Reduce_scatter_block(src, recv, n, t, MPI_SUM, comm);
                       }));
        return Status::Ok();
      },
      stream, what);
#else
  detail::enter(w, what, mesh_axis);
  ncclComm_t comm = w.axis_nccl[mesh_axis];
  FLOWC_COMM_NCCL(what, comm,
                  ncclReduceScatter(send, recv, recv_count, detail::nccl_type(dtype), ncclSum, comm, stream));
#endif
  return Status::Ok();
}

// Chunk j of send (count_per_peer elements) goes to member j; chunk j of recv came from member j.
inline Status all_to_all(World& w, int mesh_axis, const void* send, void* recv, size_t count_per_peer,
                         int dtype, cudaStream_t stream) {
  const char* what = "all-to-all";
  size_t eb = 0;
  if (Status st = detail::check(w, what, mesh_axis, dtype, count_per_peer, false, &eb); !st.ok()) return st;
  const int p = w.group_size(mesh_axis);
  const size_t bytes = count_per_peer * eb * p;
  if (!detail::disjoint(send, bytes, recv, bytes)) return detail::overlap_error(what, "");
  if (Status st = detail::log_call(w, what, mesh_axis, bytes, dtype); !st.ok()) return st;
  if (count_per_peer == 0) return Status::Ok();
#if defined(FLOWC_HOST)
  // Deferred into the stream like any other work, so the emulator's stream orders
  // exercise the events around it.
  return detail::host_enqueue(
      [=, &w]() -> Status {
        const int n = static_cast<int>(count_per_peer);
        const MPI_Datatype t = detail::mpi_type(dtype);
        MPI_Comm comm = w.axis_mpi[mesh_axis];
        FLOWC_COMM_MPI(what, detail::mpi_step(w, what, mesh_axis, [&](MPI_Request* r) {
                         return r ? MPI_Ialltoall(send, n, t, recv, n, t, comm, r)
                                  : MPI_Alltoall(send, n, t, recv, n, t, comm);
                       }));
        return Status::Ok();
      },
      stream, what);
#else
  // Grouped point-to-point calls: the all-to-all every NCCL release has.
  detail::enter(w, what, mesh_axis);
  ncclComm_t comm = w.axis_nccl[mesh_axis];
  const ncclDataType_t t = detail::nccl_type(dtype);
  const size_t chunk = count_per_peer * eb;
  FLOWC_COMM_NCCL(what, comm, ncclGroupStart());
  for (int j = 0; j < p; ++j) {
    const ncclResult_t rs =
        ncclSend(static_cast<const char*>(send) + j * chunk, count_per_peer, t, j, comm, stream);
    const ncclResult_t rr =
        rs == ncclSuccess ? ncclRecv(static_cast<char*>(recv) + j * chunk, count_per_peer, t, j, comm, stream)
                          : rs;
    if (rr != ncclSuccess) {
      ncclGroupEnd();
      return LibraryError(detail::nccl_error(what, rs != ncclSuccess ? "ncclSend" : "ncclRecv", rr, comm));
    }
  }
  FLOWC_COMM_NCCL(what, comm, ncclGroupEnd());
#endif
  return Status::Ok();
}

// -- point-to-point transfers (pipeline stages) ---------------------------------------------
//
// send/recv move `count` elements of ONNX type `dtype` between this rank and `peer`, a rank of
// MPI_COMM_WORLD (the mesh's row-major numbering; a pipeline stage s of k ranks holds ranks
// [s*k, (s+1)*k)). They are ordered on `stream` like the collectives: NCCL enqueues them; the
// host build runs the MPI calls as a host function when the stream reaches them. Transfers
// between two ranks are matched in the order they are issued, so both sides must issue the
// same sequence. A lone send or recv waits for its peer, so a ring of lone sends would
// deadlock (on NCCL as on MPI): exchange() issues several at once, as one NCCL group
// (ncclGroupStart/End) or as nonblocking MPI calls waited on together, and is the form to use
// when a rank both sends and receives, or a stage boundary carries several values.
// Logged as "send peer=<rank> bytes=<bytes> dtype=<type>" / "recv ..." (one line per transfer,
// an exchange's in its order), under the FLOWC_TIMEOUT_S deadline like a collective.

struct Transfer {
  enum Kind { kSend, kRecv };
  Kind kind = kSend;
  int peer = 0;            // world rank
  void* buffer = nullptr;  // read by a send, written by a recv
  size_t count = 0;        // elements
  int dtype = 1;           // ONNX element type
};

namespace detail {

// The same file as the collectives' lines; a transfer's line names the peer instead of an axis.
inline Status log_transfer(const World& w, const Transfer& t, size_t bytes) {
  State& s = state();
  if (s.log_opened && s.log == nullptr && s.log_error.empty()) return Status::Ok();  // no log
  return log_line(w, std::string(t.kind == Transfer::kSend ? "send" : "recv") +
                         " peer=" + std::to_string(t.peer) + " bytes=" + std::to_string(bytes) +
                         " dtype=" + std::to_string(t.dtype) + "\n");
}

inline Status check_transfers(const World& w, const char* what, const Transfer* ts, int n) {
  if (n < 0 || (n > 0 && ts == nullptr)) return InvalidArgument(std::string(what) + ": no transfers given");
  for (int i = 0; i < n; ++i) {
    const Transfer& t = ts[i];
    const std::string which = std::string(what) + ": transfer " + std::to_string(i) + " (" +
                              (t.kind == Transfer::kSend ? "send to" : "recv from") + " rank " +
                              std::to_string(t.peer) + ")";
    if (t.kind != Transfer::kSend && t.kind != Transfer::kRecv)
      return InvalidArgument(which + ": unknown kind");
    if (t.peer < 0 || t.peer >= w.size) {
      return InvalidArgument(which + ": the peer is not a rank of the " + std::to_string(w.size) +
                             "-rank job");
    }
    if (element_bytes(t.dtype) == 0) {
      return InvalidArgument(which + ": ONNX element type " + std::to_string(t.dtype) +
                             " is not one of f32, f16, bf16, f64, i64, i32, i8, u8, bool");
    }
    if (t.count > 0 && t.buffer == nullptr) return InvalidArgument(which + ": the buffer is null");
#if defined(FLOWC_HOST)
    if (t.count > static_cast<size_t>(INT_MAX)) {
      return NotSupported(which + ": " + std::to_string(t.count) +
                          " elements are more than MPI's int counts reach");
    }
#endif
  }
  // A received buffer is written while the others are read or written: it must overlap none.
  for (int i = 0; i < n; ++i) {
    if (ts[i].kind != Transfer::kRecv) continue;
    const size_t bi = ts[i].count * element_bytes(ts[i].dtype);
    for (int j = 0; j < n; ++j) {
      const size_t bj = ts[j].count * element_bytes(ts[j].dtype);
      if (j != i && bi > 0 && bj > 0 && !disjoint(ts[i].buffer, bi, ts[j].buffer, bj)) {
        return InvalidArgument(std::string(what) + ": the buffer of transfer " + std::to_string(i) +
                               " (a recv) overlaps the buffer of transfer " + std::to_string(j));
      }
    }
  }
  return Status::Ok();
}

// Ends the job: a transfer of this rank has waited `waited` seconds. Unlike a collective's
// (timed_out), the ranks waited for are the peers, and their step numbers need not match this
// rank's (stages do different work): each peer is described by what it published.
[[noreturn]] inline void transfer_timed_out(World& w, const std::vector<int>& peers, double waited) {
  std::string why = "step " + std::to_string(w.step) + " (" + w.step_what + ") did not finish after " +
                    seconds_text(waited);
  std::vector<int> seen;
  for (int peer : peers) {
    if (peer == w.rank || std::find(seen.begin(), seen.end(), peer) != seen.end()) continue;
    seen.push_back(peer);
    int64_t got[kSlots] = {};
    const std::string r = "rank " + std::to_string(peer);
    if (!read_slots(w, peer, got, 0.5)) {
      why += "; " + r + " does not answer (stopped or gone)";
    } else if (const std::string stopped = stopped_text(w, peer, got, -1); !stopped.empty()) {
      why += "; " + stopped;
    } else if (got[0] % 2 == 1) {
      why += "; " + r + " is waiting in its step " + std::to_string((got[0] + 1) / 2);
    } else {
      why += "; " + r + " is in no transfer or collective (it has finished " + std::to_string(got[0] / 2) +
             " steps), so it has not issued the matching transfer yet";
    }
  }
  std::fprintf(stderr, "error: %s; aborting (FLOWC_TIMEOUT_S=%g, seen by rank %d)\n", why.c_str(),
               w.timeout_s, w.rank);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

// Waits for every request of the current step, beating, until the deadline (see wait_request).
inline int wait_requests(World& w, std::vector<MPI_Request>& reqs, const std::vector<int>& peers) {
  using clock = std::chrono::steady_clock;
  WaitClock waiting(w);
  auto next_beat = clock::now();
  for (long spin = 0;; ++spin) {
    int done = 0;
    const int rc = MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS || done) return rc;
    const double waited = waiting.waited();
    const auto now = clock::now();
    if (now >= next_beat) {
      heartbeat(w);
      next_beat = now + std::chrono::milliseconds(10);
    }
    if (waited > w.timeout_s) transfer_timed_out(w, peers, waited);
    if (spin < 1000) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

inline std::string transfers_text(const Transfer* ts, int n) {
  if (n == 1) {
    return std::string(ts[0].kind == Transfer::kSend ? "send to rank " : "recv from rank ") +
           std::to_string(ts[0].peer);
  }
  int sends = 0;
  for (int i = 0; i < n; ++i) sends += ts[i].kind == Transfer::kSend;
  return "exchange (" + std::to_string(sends) + " sends, " + std::to_string(n - sends) + " receives)";
}

}  // namespace detail

// Issues the `n` transfers of `ts` together (see above); they are all done when the stream
// passes this point. Empty transfers (count 0) are checked and logged but move nothing.
inline Status exchange(World& w, const Transfer* ts, int n, cudaStream_t stream) {
  const char* what = "exchange";
  if (Status st = detail::check_transfers(w, what, ts, n); !st.ok()) return st;
  std::vector<Transfer> live;
  for (int i = 0; i < n; ++i) {
    const size_t bytes = ts[i].count * detail::element_bytes(ts[i].dtype);
    if (Status st = detail::log_transfer(w, ts[i], bytes); !st.ok()) return st;
    if (bytes > 0) live.push_back(ts[i]);
  }
  if (live.empty()) return Status::Ok();
  const std::string step = detail::transfers_text(live.data(), static_cast<int>(live.size()));
#if defined(FLOWC_HOST)
  return detail::host_enqueue(
      [live, step, what, &w]() -> Status {
        // Receives first, so a peer's send always finds its match posted.
        std::vector<MPI_Request> reqs(live.size(), MPI_REQUEST_NULL);
        const bool watched = w.timeout_s > 0;
        if (watched) detail::enter(w, step.c_str(), -1);
        int k = 0;
        for (int pass = 0; pass < 2; ++pass) {
          for (const Transfer& t : live) {
            if ((t.kind == Transfer::kRecv) != (pass == 0)) continue;
            const int n_elems = static_cast<int>(t.count);
            const MPI_Datatype type = detail::mpi_type(t.dtype);
            const int rc = t.kind == Transfer::kRecv
                               ? MPI_Irecv(t.buffer, n_elems, type, t.peer, 0, w.mpi, &reqs[k])
                               : MPI_Isend(t.buffer, n_elems, type, t.peer, 0, w.mpi, &reqs[k]);
            if (rc != MPI_SUCCESS) {
              return LibraryError(
                  detail::mpi_error(what, t.kind == Transfer::kRecv ? "MPI_Irecv" : "MPI_Isend", rc));
            }
            ++k;
          }
        }
        std::vector<int> peers;
        for (const Transfer& t : live) peers.push_back(t.peer);
        const int rc = watched ? detail::wait_requests(w, reqs, peers)
                               : MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
        if (watched) detail::leave(w);
        if (rc != MPI_SUCCESS) return LibraryError(detail::mpi_error(what, "MPI_Waitall", rc));
        return Status::Ok();
      },
      stream, what);
#else
  detail::enter(w, step.c_str(), -1);  // on the GPU a step is reached when it is queued
  ncclComm_t comm = w.nccl;
  FLOWC_COMM_NCCL(what, comm, ncclGroupStart());
  for (const Transfer& t : live) {
    const ncclDataType_t type = detail::nccl_type(t.dtype);
    const ncclResult_t r = t.kind == Transfer::kSend
                               ? ncclSend(t.buffer, t.count, type, t.peer, comm, stream)
                               : ncclRecv(t.buffer, t.count, type, t.peer, comm, stream);
    if (r != ncclSuccess) {
      ncclGroupEnd();
      return LibraryError(
          detail::nccl_error(what, t.kind == Transfer::kSend ? "ncclSend" : "ncclRecv", r, comm));
    }
  }
  FLOWC_COMM_NCCL(what, comm, ncclGroupEnd());
  return Status::Ok();
#endif
}

// Sends `count` elements of `send` to world rank `peer` (see exchange() for a rank that also
// receives).
inline Status send(World& w, int peer, const void* buffer, size_t count, int dtype, cudaStream_t stream) {
  Transfer t;
  t.kind = Transfer::kSend;
  t.peer = peer;
  t.buffer = const_cast<void*>(buffer);  // only read
  t.count = count;
  t.dtype = dtype;
  return exchange(w, &t, 1, stream);
}

// Receives `count` elements from world rank `peer` into `buffer`.
inline Status recv(World& w, int peer, void* buffer, size_t count, int dtype, cudaStream_t stream) {
  Transfer t;
  t.kind = Transfer::kRecv;
  t.peer = peer;
  t.buffer = buffer;
  t.count = count;
  t.dtype = dtype;
  return exchange(w, &t, 1, stream);
}

}  // namespace comm
}  // namespace flowc

#undef FLOWC_COMM_MPI
#if !defined(FLOWC_HOST)
#undef FLOWC_COMM_NCCL
#endif
