// flowc weights files: the parameters of a compiled model, checked against the program.
//
// Layout (all integers little-endian):
//   bytes  0..7   magic "FLOWCWT1"
//   bytes  8..15  uint64 version (1)
//   bytes 16..23  uint64 data_bytes
//   bytes 24..31  uint64 CRC-32 (zlib) of the data bytes, zero-extended
//   bytes 32..39  uint64 layout id: a hash of the tensors' names, types and offsets, and in a
//                 multi-rank program of the rank, the mesh and every tensor's shard layout
//   bytes 40..63  reserved, zero
//   bytes 64..    the data bytes
//
// A generated program knows its layout id and how many bytes of weights it expects; load()
// refuses a file of another layout or size (another model), or whose data does not hash to
// the value its header records (corruption). Any values in the right layout are accepted: one
// build runs with any weights file written for it. Each rank of a multi-rank program has its
// own id, so one rank's file given to another is refused too (load_rank says whose it is).
// Only a regular file is read: a FIFO or a device is refused without blocking
// (flowc/file_io.h).
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <new>
#include <string>
#include <vector>

#include "flowc/file_io.h"
#include "flowc/status.h"

namespace flowc {
namespace weights {

constexpr char kMagic[9] = "FLOWCWT1";
constexpr uint64_t kVersion = 1;
constexpr size_t kHeaderBytes = 64;

// CRC-32 (zlib's polynomial, so Python's zlib.crc32 computes the same value). Pass the
// previous result as crc to hash data in pieces.
inline uint32_t crc32(const void* data, size_t n, uint32_t crc = 0) {
  static const auto table = [] {
    struct Table {
      uint32_t v[256];
    } t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t.v[i] = c;
    }
    return t;
  }();
  const unsigned char* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table.v[(crc ^ p[i]) & 0xffu] ^ (crc >> 8);
  return ~crc;
}

namespace detail {

inline uint64_t get_u64(const unsigned char* p) {
  uint64_t v = 0;
  for (int k = 7; k >= 0; --k) v = (v << 8) | p[k];
  return v;
}

inline void put_u64(unsigned char* p, uint64_t v) {
  for (int k = 0; k < 8; ++k) p[k] = (unsigned char)((v >> (8 * k)) & 0xff);
}

inline std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%016llx", (unsigned long long)v);
  return buf;
}

// `other_layout` explains a file whose layout is not the expected one, or returns "".
inline Status load_checked(const std::string& path, uint64_t expected_bytes, uint64_t expected_layout,
                           const std::function<std::string(uint64_t)>& other_layout,
                           std::vector<unsigned char>* out, const std::string& what = "weights file") {
  const std::string name = what + " " + path;
  io::File file;
  if (Status st = io::open_for_reading(path, what, &file); !st.ok()) return st;

  if (fseeko(file.f, 0, SEEK_END) != 0)
    return InvalidArgument(name + ": cannot seek: " + std::strerror(errno));
  const off_t length = ftello(file.f);
  if (length < 0) return InvalidArgument(name + ": cannot tell its size: " + std::strerror(errno));
  if (fseeko(file.f, 0, SEEK_SET) != 0)
    return InvalidArgument(name + ": cannot seek: " + std::strerror(errno));

  unsigned char head[kHeaderBytes];
  if (uint64_t(length) < kHeaderBytes || std::fread(head, 1, kHeaderBytes, file.f) != kHeaderBytes ||
      std::memcmp(head, kMagic, 8) != 0)
    return InvalidArgument(name + " is not a flowc " + what + " (no FLOWCWT1 header)");
  const uint64_t version = detail::get_u64(head + 8);
  const uint64_t data_bytes = detail::get_u64(head + 16);
  const uint64_t stored_hash = detail::get_u64(head + 24);
  const uint64_t layout = detail::get_u64(head + 32);
  if (version != kVersion)
    return InvalidArgument(name + " has format version " + std::to_string(version) +
                           "; this runtime reads version " + std::to_string(kVersion));
  if (data_bytes != expected_bytes)
    return InvalidArgument(name + " holds " + std::to_string(data_bytes) +
                           " bytes of data; this program expects " + std::to_string(expected_bytes) +
                           ": it was compiled for another model or layout");
  const uint64_t file_data = uint64_t(length) - kHeaderBytes;
  if (file_data != data_bytes)
    return InvalidArgument(name + " is " +
                           (file_data < data_bytes ? "truncated" : "longer than its header says") +
                           ": its header records " + std::to_string(data_bytes) +
                           " bytes of data, the file holds " + std::to_string(file_data));
  if (layout != expected_layout && other_layout) {
    const std::string why = other_layout(layout);
    if (!why.empty()) return InvalidArgument(name + " " + why);
  }
  if (layout != expected_layout)
    return InvalidArgument(name + " has layout " + detail::hex(layout) + "; this program expects " +
                           detail::hex(expected_layout) +
                           ": it was written for another model (same size, other tensors)");

  std::vector<unsigned char> data;
  try {
    data.resize(size_t(data_bytes));
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory,
                  name + ": cannot allocate " + std::to_string(data_bytes) + " bytes");
  }
  uint32_t h = crc32(nullptr, 0);
  size_t done = 0;
  while (done < data.size()) {
    const size_t n = std::min(io::kChunk, data.size() - done);
    const size_t r = std::fread(data.data() + done, 1, n, file.f);
    h = crc32(data.data() + done, r, h);
    done += r;
    if (r != n) break;
  }
  if (done != data.size())
    return InvalidArgument(name + ": read error after " + std::to_string(done) + " of " +
                           std::to_string(data_bytes) + " data bytes");
  if (h != stored_hash)
    return InvalidArgument(name + " is corrupt: hash mismatch (its header records " +
                           detail::hex(stored_hash) + ", the data hashes to " + detail::hex(h) + ")");
  *out = std::move(data);
  return Status::Ok();
}

}  // namespace detail

inline Status load(const std::string& path, uint64_t expected_bytes, uint64_t expected_layout,
                   std::vector<unsigned char>* out) {
  return detail::load_checked(path, expected_bytes, expected_layout, nullptr, out);
}

// A training program's checkpoint (its state: parameters, optimizer state, step counter,
// learning rate): a file of this format whose layout id names the state's tensors.
inline Status load_checkpoint(const std::string& path, uint64_t expected_bytes, uint64_t expected_layout,
                              std::vector<unsigned char>* out) {
  return detail::load_checked(path, expected_bytes, expected_layout, nullptr, out, "checkpoint");
}

// One rank's file of a multi-rank program: layouts[r] is rank r's id (ranks of them), `mesh` the
// mesh as text ("2x2"). A file written for another rank is refused with the rank it is for.
inline Status load_rank(const std::string& path, uint64_t expected_bytes, const uint64_t* layouts, int ranks,
                        int rank, const std::string& mesh, std::vector<unsigned char>* out) {
  if (rank < 0 || rank >= ranks)
    return InvalidArgument("weights: rank " + std::to_string(rank) + " is not a rank of mesh " + mesh);
  const auto other_rank = [&](uint64_t layout) -> std::string {
    for (int r = 0; r < ranks; ++r) {
      if (layouts[r] == layout) {
        return "is for rank " + std::to_string(r) + " of mesh " + mesh + ", and this is rank " +
               std::to_string(rank) + ": give each rank the file flowc wrote for it (weights.rank" +
               std::to_string(rank) + ".bin)";
      }
    }
    return "";
  };
  return detail::load_checked(path, expected_bytes, layouts[rank], other_rank, out);
}

inline Status save(const std::string& path, const void* data, uint64_t bytes, uint64_t layout = 0,
                   const std::string& what = "weights file") {
  const std::string name = what + " " + path;
  if (bytes > 0 && data == nullptr) return InvalidArgument(name + ": no data (null pointer)");
  unsigned char head[kHeaderBytes] = {};
  std::memcpy(head, kMagic, 8);
  detail::put_u64(head + 8, kVersion);
  detail::put_u64(head + 16, bytes);
  detail::put_u64(head + 24, crc32(data, size_t(bytes)));
  detail::put_u64(head + 32, layout);

  return io::write_atomic(path, name, head, kHeaderBytes, data, bytes);
}

}  // namespace weights
}  // namespace flowc
