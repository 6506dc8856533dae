// Every collective of flowc/comm.h on every mesh axis, for several element types, checked on
// each rank against values computed here from the fill rule.
//
//   mpirun -np 4 comm_collectives 2x2     (the mesh: sizes joined by 'x')
//
// Prints "OK rank R: N checks" or FAIL lines and exits non-zero on a failure. With
// FLOWC_COMM_LOG=PREFIX, also checks that PREFIX.rank<R> lists exactly the collectives issued.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "flowc/comm.h"
#include "flowc/device.h"

namespace {

constexpr int kF32 = 1, kU8 = 2, kI8 = 3, kI32 = 6, kI64 = 7, kBool = 9, kF16 = 10, kF64 = 11, kBF16 = 16;
constexpr int kTypes[] = {kF32, kF16, kBF16, kF64, kI64, kI32, kI8, kU8, kBool};
constexpr size_t kChunk = 37;  // elements per chunk: odd, so no chunk boundary is aligned by luck

int failures = 0;
int checks = 0;
std::vector<std::string> issued;  // the log lines this rank should have written

size_t elem_bytes(int dtype) {
  switch (dtype) {
    case kF64:
    case kI64:
      return 8;
    case kF32:
    case kI32:
      return 4;
    case kF16:
    case kBF16:
      return 2;
    default:
      return 1;
  }
}

// The value a rank puts at index i: small integers, exact in every type and in every sum here.
long long fill_value(int rank, size_t i, int dtype) {
  if (dtype == kBool) return static_cast<long long>((static_cast<size_t>(rank) + i) % 2);
  if (dtype == kU8) return static_cast<long long>((static_cast<size_t>(rank) * 3 + i) % 7);
  return static_cast<long long>((static_cast<size_t>(rank) * 5 + i * 3) % 11) - 5;
}

// IEEE binary16 bits of a small integer (|v| < 2048), built from its binary expansion.
uint16_t f16_of_int(long long v) {
  if (v == 0) return 0;
  const uint16_t sign = v < 0 ? 0x8000 : 0;
  unsigned long long a = static_cast<unsigned long long>(v < 0 ? -v : v);
  int e = 0;
  while ((a >> (e + 1)) != 0) ++e;
  const unsigned long long mantissa = (a << (10 - e)) & 0x3ff;
  return static_cast<uint16_t>(sign | ((e + 15) << 10) | mantissa);
}

// bfloat16 bits of a small integer: the upper half of its float32 bits, exact for |v| <= 256.
uint16_t bf16_of_int(long long v) {
  const float f = static_cast<float>(v);
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return static_cast<uint16_t>(bits >> 16);
}

void store(std::vector<unsigned char>& buf, size_t i, long long v, int dtype) {
  unsigned char* p = buf.data() + i * elem_bytes(dtype);
  auto put = [p](auto x) { std::memcpy(p, &x, sizeof(x)); };
  switch (dtype) {
    case kF32:
      put(static_cast<float>(v));
      break;
    case kF64:
      put(static_cast<double>(v));
      break;
    case kF16:
      put(f16_of_int(v));
      break;
    case kBF16:
      put(bf16_of_int(v));
      break;
    case kI64:
      put(static_cast<int64_t>(v));
      break;
    case kI32:
      put(static_cast<int32_t>(v));
      break;
    case kI8:
      put(static_cast<int8_t>(v));
      break;
    default:
      put(static_cast<uint8_t>(v));
      break;
  }
}

struct Group {
  std::vector<int> members;  // world ranks, in group order
  int me = 0;                // this rank's index
};

Group group_along(const flowc::comm::World& w, int axis) {
  int stride = 1;
  for (int a = w.mesh.ndim - 1; a > axis; --a) stride *= w.mesh.shape[a];
  Group g;
  g.me = w.coords[axis];
  for (int j = 0; j < w.mesh.shape[axis]; ++j) g.members.push_back(w.rank + (j - g.me) * stride);
  return g;
}

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) { FLOWC_CHECK(cudaMalloc(&p, bytes)); }
  ~DeviceBuffer() { cudaFree(p); }
  char* at(size_t offset) const { return static_cast<char*>(p) + offset; }
};

void report(const flowc::comm::World& w, const char* what, int axis, int dtype, const flowc::Status& s) {
  ++checks;
  if (!s.ok()) {
    ++failures;
    std::printf("FAIL rank %d %s axis=%d dtype=%d: %s\n", w.rank, what, axis, dtype, s.message().c_str());
  }
}

void compare(const flowc::comm::World& w, const char* what, int axis, int dtype,
             const std::vector<unsigned char>& got, const std::vector<unsigned char>& want) {
  ++checks;
  if (got != want) {
    ++failures;
    size_t first = 0;
    while (got[first] == want[first]) ++first;
    std::printf("FAIL rank %d %s axis=%d dtype=%d: byte %zu differs\n", w.rank, what, axis, dtype, first);
  }
}

void note(const char* what, int axis, size_t bytes, int dtype) {
  issued.push_back(std::string(what) + " axis=" + std::to_string(axis) + " bytes=" + std::to_string(bytes) +
                   " dtype=" + std::to_string(dtype));
}

// Queues the copy of `host` into device memory at `dst` on the stream, so a collective that did not
// wait for its stream would read stale data. The emulator copies when the stream runs: `host`
// must outlive the next synchronization.
void upload(void* dst, const std::vector<unsigned char>& host, cudaStream_t s) {
  FLOWC_CHECK(cudaMemcpyAsync(dst, host.data(), host.size(), cudaMemcpyHostToDevice, s));
}

std::vector<unsigned char> download(const void* src, size_t bytes, cudaStream_t s) {
  std::vector<unsigned char> out(bytes);
  FLOWC_CHECK(cudaMemcpyAsync(out.data(), src, bytes, cudaMemcpyDeviceToHost, s));
  FLOWC_CHECK(cudaStreamSynchronize(s));
  return out;
}

void check_axis_type(flowc::comm::World& w, int axis, int dtype, cudaStream_t s) {
  namespace comm = flowc::comm;
  const Group g = group_along(w, axis);
  const size_t p = g.members.size(), eb = elem_bytes(dtype), n = kChunk;
  const bool sums = dtype != kBool;

  // Rank r's buffer of m elements, and the sum of those buffers over the group.
  auto mine = [&](size_t m, size_t from) {
    std::vector<unsigned char> b(m * eb);
    for (size_t i = 0; i < m; ++i) store(b, i, fill_value(w.rank, from + i, dtype), dtype);
    return b;
  };
  auto summed = [&](size_t m, size_t from) {
    std::vector<unsigned char> b(m * eb);
    for (size_t i = 0; i < m; ++i) {
      long long v = 0;
      for (int r : g.members) v += fill_value(r, from + i, dtype);
      store(b, i, v, dtype);
    }
    return b;
  };

  const size_t n2 = 5;  // a bucket's second part
  DeviceBuffer send(std::max(p * n, n + n2) * eb), recv(std::max(p * n, n + n2) * eb);
  const std::vector<unsigned char> one_chunk = mine(n, 0), all_chunks = mine(p * n, 0);
  if (sums) {
    upload(send.p, one_chunk, s);
    report(w, "all_reduce", axis, dtype, comm::all_reduce(w, axis, send.p, recv.p, n, dtype, s));
    note("all-reduce", axis, n * eb, dtype);
    compare(w, "all_reduce", axis, dtype, download(recv.p, n * eb, s), summed(n, 0));

    upload(recv.p, one_chunk, s);
    report(w, "all_reduce in place", axis, dtype, comm::all_reduce(w, axis, recv.p, recv.p, n, dtype, s));
    note("all-reduce", axis, n * eb, dtype);
    compare(w, "all_reduce in place", axis, dtype, download(recv.p, n * eb, s), summed(n, 0));

    // A bucket: two parts (and an empty one) as one collective step, logged as one.
    const std::vector<unsigned char> bucket_in = mine(n + n2, 0);  // lives until the copy runs
    upload(send.p, bucket_in, s);
    const comm::BucketPart parts[] = {
        {send.p, recv.p, n}, {send.at(n * eb), recv.at(n * eb), n2}, {send.p, recv.p, 0}};
    report(w, "all_reduce_bucket", axis, dtype, comm::all_reduce_bucket(w, axis, parts, 3, dtype, s));
    note("all-reduce", axis, (n + n2) * eb, dtype);
    compare(w, "all_reduce_bucket", axis, dtype, download(recv.p, (n + n2) * eb, s), summed(n + n2, 0));

    upload(send.p, all_chunks, s);
    report(w, "reduce_scatter", axis, dtype, comm::reduce_scatter(w, axis, send.p, recv.p, n, dtype, s));
    note("reduce-scatter", axis, p * n * eb, dtype);
    compare(w, "reduce_scatter", axis, dtype, download(recv.p, n * eb, s), summed(n, g.me * n));

    upload(send.p, all_chunks, s);
    char* own_chunk = send.at(g.me * n * eb);
    report(w, "reduce_scatter in place", axis, dtype,
           comm::reduce_scatter(w, axis, send.p, own_chunk, n, dtype, s));
    note("reduce-scatter", axis, p * n * eb, dtype);
    compare(w, "reduce_scatter in place", axis, dtype, download(own_chunk, n * eb, s), summed(n, g.me * n));
  }

  // all-gather: member j contributes its values at [0, n); recv chunk j holds them.
  std::vector<unsigned char> gathered(p * n * eb);
  for (size_t j = 0; j < p; ++j) {
    for (size_t i = 0; i < n; ++i) store(gathered, j * n + i, fill_value(g.members[j], i, dtype), dtype);
  }
  upload(send.p, one_chunk, s);
  report(w, "all_gather", axis, dtype, comm::all_gather(w, axis, send.p, recv.p, n, dtype, s));
  note("all-gather", axis, n * eb, dtype);
  compare(w, "all_gather", axis, dtype, download(recv.p, p * n * eb, s), gathered);

  upload(recv.at(g.me * n * eb), one_chunk, s);
  report(w, "all_gather in place", axis, dtype,
         comm::all_gather(w, axis, recv.at(g.me * n * eb), recv.p, n, dtype, s));
  note("all-gather", axis, n * eb, dtype);
  compare(w, "all_gather in place", axis, dtype, download(recv.p, p * n * eb, s), gathered);

  // all-to-all: recv chunk j is chunk me of member j's send.
  std::vector<unsigned char> exchanged(p * n * eb);
  for (size_t j = 0; j < p; ++j) {
    for (size_t i = 0; i < n; ++i) {
      store(exchanged, j * n + i, fill_value(g.members[j], g.me * n + i, dtype), dtype);
    }
  }
  upload(send.p, all_chunks, s);
  report(w, "all_to_all", axis, dtype, comm::all_to_all(w, axis, send.p, recv.p, n, dtype, s));
  note("all-to-all", axis, p * n * eb, dtype);
  compare(w, "all_to_all", axis, dtype, download(recv.p, p * n * eb, s), exchanged);
}

// Calls the runtime must refuse, with the reason in the message; none of them is logged.
void check_rejections(flowc::comm::World& w, cudaStream_t s) {
  namespace comm = flowc::comm;
  DeviceBuffer buf(1024);
  const comm::BucketPart bad_parts[] = {{buf.p, buf.at(512), 4}, {buf.at(64), buf.at(68), 4}};
  struct Case {
    const char* name;
    flowc::Status status;
    flowc::StatusCode code;
    const char* says;
  };
  const Case cases[] = {
      {"axis out of range", comm::all_reduce(w, w.mesh.ndim, buf.p, buf.p, 4, kF32, s),
       flowc::StatusCode::kInvalidArgument, "is not an axis of the"},
      {"unknown dtype", comm::all_gather(w, 0, buf.p, buf.at(512), 4, 8, s),
       flowc::StatusCode::kInvalidArgument, "ONNX element type 8"},
      {"bool sum", comm::all_reduce(w, 0, buf.p, buf.at(512), 4, kBool, s), flowc::StatusCode::kNotSupported,
       "bool tensors cannot be summed"},
      {"partial overlap", comm::all_reduce(w, 0, buf.p, buf.at(4), 4, kF32, s),
       flowc::StatusCode::kInvalidArgument, "overlap"},
      {"bucket part overlap", comm::all_reduce_bucket(w, 0, bad_parts, 2, kF32, s),
       flowc::StatusCode::kInvalidArgument, "overlap"},
      {"bucket of bools", comm::all_reduce_bucket(w, 0, bad_parts, 1, kBool, s),
       flowc::StatusCode::kNotSupported, "bool tensors cannot be summed"},
      {"all-to-all in place", comm::all_to_all(w, 0, buf.p, buf.p, 4, kF32, s),
       flowc::StatusCode::kInvalidArgument, "overlap"},
      {"gather from inside a chunk", comm::all_gather(w, 0, buf.at(4), buf.p, 4, kF32, s),
       flowc::StatusCode::kInvalidArgument, "overlap"},
  };
  for (const Case& c : cases) {
    ++checks;
    if (c.status.code() != c.code || c.status.message().find(c.says) == std::string::npos) {
      ++failures;
      std::printf("FAIL rank %d rejects %s: got '%s'\n", w.rank, c.name, c.status.message().c_str());
    }
  }
}

void check_log(const flowc::comm::World& w) {
  const char* prefix = std::getenv("FLOWC_COMM_LOG");
  if (prefix == nullptr) return;
  std::ifstream in(std::string(prefix) + ".rank" + std::to_string(w.rank));
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ++checks;
  if (lines != issued) {
    ++failures;
    std::printf("FAIL rank %d log: %zu lines, %zu collectives issued\n", w.rank, lines.size(), issued.size());
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s MESH (e.g. 4 or 2x2)\n", argv[0]);
    return 2;
  }
  std::vector<int> shape;
  for (const char* c = argv[1]; *c;) {
    char* end = nullptr;
    shape.push_back(static_cast<int>(std::strtol(c, &end, 10)));
    c = *end == 'x' ? end + 1 : end;
  }
  flowc::comm::World* world = nullptr;
  const flowc::Status st = flowc::comm::init(shape.data(), static_cast<int>(shape.size()), &world);
  if (!st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.message().c_str());
    flowc::comm::finalize();
    return 1;
  }
  flowc::comm::World* again = nullptr;
  ++checks;
  if (!flowc::comm::init(shape.data(), static_cast<int>(shape.size()), &again).ok() || again != world) {
    ++failures;
    std::printf("FAIL rank %d: a second init of the same mesh gave another World\n", world->rank);
  }
  cudaStream_t stream;
  FLOWC_CHECK(cudaStreamCreate(&stream));
  for (int axis = 0; axis < world->mesh.ndim; ++axis) {
    for (int dtype : kTypes) check_axis_type(*world, axis, dtype, stream);
  }
  check_rejections(*world, stream);
  check_log(*world);
  FLOWC_CHECK(cudaStreamDestroy(stream));
  if (failures == 0) std::printf("OK rank %d: %d checks\n", world->rank, checks);
  std::fflush(stdout);
  flowc::comm::finalize();
  return failures == 0 ? 0 : 1;
}
