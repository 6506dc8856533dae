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
// arguments are not logged.
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

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flowc/device.h"
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

inline void log_call(const World& w, const char* collective, int axis, size_t bytes, int dtype) {
  State& s = state();
  if (!s.log_opened) {
    s.log_opened = true;
    if (const char* prefix = std::getenv("FLOWC_COMM_LOG"); prefix && *prefix) {
      const std::string path = std::string(prefix) + ".rank" + std::to_string(w.rank);
      s.log = std::fopen(path.c_str(), "a");
      if (s.log == nullptr)
        std::fprintf(stderr, "flowc: cannot open the communication log %s\n", path.c_str());
    }
  }
  if (s.log == nullptr) return;
  std::fprintf(s.log, "%s axis=%d bytes=%zu dtype=%d\n", collective, axis, bytes, dtype);
  std::fflush(s.log);
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

inline void free_world(World* w) {
#if !defined(FLOWC_HOST)
  for (int a = 0; a < w->mesh.ndim; ++a) {
    if (w->axis_nccl[a]) ncclCommDestroy(w->axis_nccl[a]);
  }
  if (w->nccl) ncclCommDestroy(w->nccl);
#endif
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
  for (World* w : s.worlds) detail::free_world(w);
  s.worlds.clear();
  if (s.log) std::fclose(s.log);
  s.log = nullptr;
  s.log_opened = false;
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

// recv = the element-wise sum of every group member's send (count elements each).
inline Status all_reduce(World& w, int mesh_axis, const void* send, void* recv, size_t count, int dtype,
                         cudaStream_t stream) {
  const char* what = "all-reduce";
  size_t eb = 0;
  if (Status st = detail::check(w, what, mesh_axis, dtype, count, true, &eb); !st.ok()) return st;
  const size_t bytes = count * eb;
  if (send != recv && !detail::disjoint(send, bytes, recv, bytes))
    return detail::overlap_error(what, ", or equal");
  detail::log_call(w, what, mesh_axis, bytes, dtype);
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
          FLOWC_COMM_MPI(what, MPI_Allreduce(MPI_IN_PLACE, wide.data(), n, MPI_FLOAT, MPI_SUM, comm));
          detail::narrow(wide.data(), count, dtype, recv);
          return Status::Ok();
        }
        const void* src = send == recv ? MPI_IN_PLACE : send;
        FLOWC_COMM_MPI(what, MPI_Allreduce(src, recv, n, detail::mpi_type(dtype), MPI_SUM, comm));
        return Status::Ok();
      },
      stream, what);
#else
  ncclComm_t comm = w.axis_nccl[mesh_axis];
  FLOWC_COMM_NCCL(what, comm,
                  ncclAllReduce(send, recv, count, detail::nccl_type(dtype), ncclSum, comm, stream));
#endif
  return Status::Ok();
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
  detail::log_call(w, what, mesh_axis, bytes, dtype);
  if (send_count == 0) return Status::Ok();
#if defined(FLOWC_HOST)
  // Deferred into the stream like any other work, so the emulator's stream orders
  // exercise the events around it.
  return detail::host_enqueue(
      [=, &w]() -> Status {
        const int n = static_cast<int>(send_count);
        const MPI_Datatype t = detail::mpi_type(dtype);
        if (in_place) {
          FLOWC_COMM_MPI(
              what, MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, n, t, w.axis_mpi[mesh_axis]));
        } else {
          FLOWC_COMM_MPI(what, MPI_Allgather(send, n, t, recv, n, t, w.axis_mpi[mesh_axis]));
        }
        return Status::Ok();
      },
      stream, what);
#else
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
  detail::log_call(w, what, mesh_axis, bytes * p, dtype);
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
          FLOWC_COMM_MPI(what,
                         MPI_Reduce_scatter_block(MPI_IN_PLACE, wide.data(), n, MPI_FLOAT, MPI_SUM, comm));
          detail::narrow(wide.data(), recv_count, dtype, recv);  // MPI leaves the result at the start
          return Status::Ok();
        }
        // MPI's in-place form puts the result at the start of the buffer, not at chunk k: copy instead.
        std::vector<char> copy;
        if (in_place) copy.assign(static_cast<const char*>(send), static_cast<const char*>(send) + bytes * p);
        const void* src = in_place ? copy.data() : send;
        FLOWC_COMM_MPI(what, MPI_Reduce_scatter_block(src, recv, n, detail::mpi_type(dtype), MPI_SUM, comm));
        return Status::Ok();
      },
      stream, what);
#else
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
  detail::log_call(w, what, mesh_axis, bytes, dtype);
  if (count_per_peer == 0) return Status::Ok();
#if defined(FLOWC_HOST)
  // Deferred into the stream like any other work, so the emulator's stream orders
  // exercise the events around it.
  return detail::host_enqueue(
      [=, &w]() -> Status {
        const int n = static_cast<int>(count_per_peer);
        const MPI_Datatype t = detail::mpi_type(dtype);
        FLOWC_COMM_MPI(what, MPI_Alltoall(send, n, t, recv, n, t, w.axis_mpi[mesh_axis]));
        return Status::Ok();
      },
      stream, what);
#else
  // Grouped point-to-point calls: the all-to-all every NCCL release has.
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

}  // namespace comm
}  // namespace flowc

#undef FLOWC_COMM_MPI
#if !defined(FLOWC_HOST)
#undef FLOWC_COMM_NCCL
#endif
