// The point-to-point transfers of flowc/comm.h (send, recv, exchange), checked byte for byte on
// every rank against the fill rule of the sender.
//
//   mpirun -np 4 comm_p2p 4          ring, pairwise multi-buffer, relay chain, rejections
//   mpirun -np 2 comm_p2p 2 --hang   rank 0 waits for a value rank 1 never sends (a deadline test)
//
// Prints "OK rank R: N checks" or FAIL lines and exits non-zero on a failure. With
// FLOWC_COMM_LOG=PREFIX, also checks that PREFIX.rank<R> lists exactly the transfers issued.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "flowc/comm.h"
#include "flowc/device.h"

namespace {

namespace comm = flowc::comm;

constexpr int kF32 = 1, kU8 = 2, kI64 = 7, kF16 = 10;

int failures = 0;
int checks = 0;
std::vector<std::string> issued;  // the log lines this rank should have written

size_t elem_bytes(int dtype) { return dtype == kI64 ? 8 : dtype == kF32 ? 4 : dtype == kF16 ? 2 : 1; }

// The bytes rank `from` sends as its buffer `tag`: distinct per sender, buffer and offset.
std::vector<unsigned char> pattern(int from, int tag, size_t bytes) {
  std::vector<unsigned char> v(bytes);
  for (size_t i = 0; i < bytes; ++i)
    v[i] = static_cast<unsigned char>((from * 131 + tag * 29 + i * 7 + 1) % 251);
  return v;
}

struct DeviceBuffer {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) { FLOWC_CHECK(cudaMalloc(&p, n ? n : 1)); }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void fill(const std::vector<unsigned char>& v) const {
    FLOWC_CHECK(cudaMemcpy(p, v.data(), v.size(), cudaMemcpyHostToDevice));
  }
  std::vector<unsigned char> read() const {
    std::vector<unsigned char> v(bytes);
    FLOWC_CHECK(cudaMemcpy(v.data(), p, bytes, cudaMemcpyDeviceToHost));
    return v;
  }
};

comm::Transfer transfer(comm::Transfer::Kind kind, int peer, const DeviceBuffer& b, int dtype) {
  comm::Transfer t;
  t.kind = kind;
  t.peer = peer;
  t.buffer = b.p;
  t.count = b.bytes / elem_bytes(dtype);
  t.dtype = dtype;
  return t;
}

void note(const comm::Transfer& t) {
  issued.push_back(
      std::string(t.kind == comm::Transfer::kSend ? "send" : "recv") + " peer=" + std::to_string(t.peer) +
      " bytes=" + std::to_string(t.count * elem_bytes(t.dtype)) + " dtype=" + std::to_string(t.dtype));
}

void expect_ok(const comm::World& w, const char* what, const flowc::Status& s) {
  ++checks;
  if (!s.ok()) {
    ++failures;
    std::printf("FAIL rank %d %s: %s\n", w.rank, what, s.message().c_str());
  }
}

void expect_bytes(const comm::World& w, const char* what, const DeviceBuffer& b, int from, int tag) {
  ++checks;
  if (b.read() != pattern(from, tag, b.bytes)) {
    ++failures;
    std::printf("FAIL rank %d %s: %zu bytes differ from rank %d's buffer %d\n", w.rank, what, b.bytes, from,
                tag);
  }
}

// Each rank sends to the next and receives from the one before, in one exchange per type.
void check_ring(comm::World& w, cudaStream_t s) {
  const int next = (w.rank + 1) % w.size, prev = (w.rank + w.size - 1) % w.size;
  const int types[] = {kF32, kF16, kI64, kU8};
  for (int k = 0; k < 4; ++k) {
    const int dtype = types[k];
    const size_t bytes = 37 * elem_bytes(dtype);  // odd element count: nothing aligned by luck
    DeviceBuffer out(bytes), in(bytes);
    out.fill(pattern(w.rank, k, bytes));
    const comm::Transfer ts[] = {transfer(comm::Transfer::kSend, next, out, dtype),
                                 transfer(comm::Transfer::kRecv, prev, in, dtype)};
    for (const comm::Transfer& t : ts) note(t);
    expect_ok(w, "ring exchange", comm::exchange(w, ts, 2, s));
    FLOWC_CHECK(cudaStreamSynchronize(s));
    expect_bytes(w, "ring exchange", in, prev, k);
  }
}

// Partners (rank ^ 1) swap three buffers of different sizes and types in one exchange, the
// receives listed before the sends on one side, after on the other; then a large one with lone
// calls, ordered so that they meet (the even rank sends first).
void check_pairs(comm::World& w, cudaStream_t s) {
  const int peer = w.rank ^ 1;
  if (peer >= w.size) return;
  const int types[] = {kF32, kU8, kI64};
  const size_t counts[] = {1000, 3, 0};  // an empty one is checked and logged, moves nothing
  std::vector<DeviceBuffer*> outs, ins;
  std::vector<comm::Transfer> ts;
  for (int k = 0; k < 3; ++k) {
    const size_t bytes = counts[k] * elem_bytes(types[k]);
    outs.push_back(new DeviceBuffer(bytes));
    ins.push_back(new DeviceBuffer(bytes));
    outs.back()->fill(pattern(w.rank, 10 + k, bytes));
    ts.push_back(transfer(comm::Transfer::kSend, peer, *outs.back(), types[k]));
  }
  for (int k = 0; k < 3; ++k) {
    const comm::Transfer r = transfer(comm::Transfer::kRecv, peer, *ins[k], types[k]);
    if (w.rank % 2) {
      ts.insert(ts.begin() + k, r);
    } else {
      ts.push_back(r);
    }
  }
  for (const comm::Transfer& t : ts) note(t);
  expect_ok(w, "pairwise exchange", comm::exchange(w, ts.data(), static_cast<int>(ts.size()), s));
  FLOWC_CHECK(cudaStreamSynchronize(s));
  for (int k = 0; k < 3; ++k) expect_bytes(w, "pairwise exchange", *ins[k], peer, 10 + k);
  for (DeviceBuffer* b : outs) delete b;
  for (DeviceBuffer* b : ins) delete b;

  const size_t big = 1 << 20;  // past MPI's eager limit: a lone send really waits for its recv
  DeviceBuffer out(big), in(big);
  out.fill(pattern(w.rank, 20, big));
  const comm::Transfer snd = transfer(comm::Transfer::kSend, peer, out, kF32);
  const comm::Transfer rcv = transfer(comm::Transfer::kRecv, peer, in, kF32);
  if (w.rank % 2 == 0) {
    note(snd);
    note(rcv);
    expect_ok(w, "send", comm::send(w, peer, out.p, snd.count, kF32, s));
    expect_ok(w, "recv", comm::recv(w, peer, in.p, rcv.count, kF32, s));
  } else {
    note(rcv);
    note(snd);
    expect_ok(w, "recv", comm::recv(w, peer, in.p, rcv.count, kF32, s));
    expect_ok(w, "send", comm::send(w, peer, out.p, snd.count, kF32, s));
  }
  FLOWC_CHECK(cudaStreamSynchronize(s));
  expect_bytes(w, "send/recv", in, peer, 20);
}

// A pipeline's relay: rank 0's buffer passes through every rank to the last, received and sent
// on from the same buffer, ordered by the stream alone.
void check_relay(comm::World& w, cudaStream_t s) {
  if (w.size < 2) return;
  const size_t bytes = 4 * 4099;
  DeviceBuffer buf(bytes);
  if (w.rank == 0) buf.fill(pattern(0, 30, bytes));
  if (w.rank > 0) {
    note(transfer(comm::Transfer::kRecv, w.rank - 1, buf, kF32));
    expect_ok(w, "relay recv", comm::recv(w, w.rank - 1, buf.p, bytes / 4, kF32, s));
  }
  if (w.rank < w.size - 1) {
    note(transfer(comm::Transfer::kSend, w.rank + 1, buf, kF32));
    expect_ok(w, "relay send", comm::send(w, w.rank + 1, buf.p, bytes / 4, kF32, s));
  }
  FLOWC_CHECK(cudaStreamSynchronize(s));
  expect_bytes(w, "relay", buf, 0, 30);
}

void check_rejections(comm::World& w, cudaStream_t s) {
  DeviceBuffer buf(1024);
  comm::Transfer overlap[2] = {transfer(comm::Transfer::kRecv, 0, buf, kF32),
                               transfer(comm::Transfer::kSend, 0, buf, kF32)};
  overlap[1].buffer = static_cast<char*>(buf.p) + 16;
  overlap[1].count = 4;
  struct Case {
    const char* name;
    flowc::Status status;
    const char* says;
  };
  const Case cases[] = {
      {"peer out of range", comm::send(w, w.size, buf.p, 4, kF32, s), "is not a rank of the"},
      {"negative peer", comm::recv(w, -1, buf.p, 4, kF32, s), "is not a rank of the"},
      {"unknown dtype", comm::send(w, 0, buf.p, 4, 8, s), "ONNX element type 8"},
      {"null buffer", comm::recv(w, 0, nullptr, 4, kF32, s), "the buffer is null"},
      {"recv overlapping a send", comm::exchange(w, overlap, 2, s), "overlaps the buffer of transfer 1"},
  };
  for (const Case& c : cases) {
    ++checks;
    if (c.status.code() != flowc::StatusCode::kInvalidArgument ||
        c.status.message().find(c.says) == std::string::npos) {
      ++failures;
      std::printf("FAIL rank %d rejection %s: got \"%s\"\n", w.rank, c.name, c.status.message().c_str());
    }
  }
}

void check_log(const comm::World& w) {
  const char* prefix = std::getenv("FLOWC_COMM_LOG");
  if (prefix == nullptr) return;
  std::ifstream in(std::string(prefix) + ".rank" + std::to_string(w.rank));
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ++checks;
  if (lines != issued) {
    ++failures;
    std::printf("FAIL rank %d log: %zu lines, %zu transfers issued\n", w.rank, lines.size(), issued.size());
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool hang = argc == 3 && std::strcmp(argv[2], "--hang") == 0;
  if (argc < 2 || argc > 3 || (argc == 3 && !hang)) {
    std::fprintf(stderr, "usage: %s RANKS [--hang]\n", argv[0]);
    return 2;
  }
  int size = std::atoi(argv[1]);
  comm::World* world = nullptr;
  const flowc::Status st = comm::init(&size, 1, &world);
  if (!st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.message().c_str());
    comm::finalize();
    return 1;
  }
  cudaStream_t stream;
  FLOWC_CHECK(cudaStreamCreate(&stream));
  if (hang) {
    // Rank 0 waits for a value that never comes; the deadline must end the job.
    DeviceBuffer buf(64);
    if (world->rank == 0) {
      expect_ok(*world, "recv", comm::recv(*world, 1, buf.p, 16, kF32, stream));
      FLOWC_CHECK(cudaStreamSynchronize(stream));
      std::printf("FAIL rank 0: a recv nobody sends to returned\n");
    } else {
      // Busy elsewhere, in no step: rank 0's deadline ends the job first.
      std::this_thread::sleep_for(std::chrono::seconds(10));
    }
  } else {
    check_ring(*world, stream);
    check_pairs(*world, stream);
    check_relay(*world, stream);
    check_rejections(*world, stream);
    check_log(*world);
  }
  FLOWC_CHECK(cudaStreamDestroy(stream));
  if (failures == 0 && !hang) std::printf("OK rank %d: %d checks\n", world->rank, checks);
  std::fflush(stdout);
  comm::finalize();
  return failures == 0 ? 0 : 1;
}
