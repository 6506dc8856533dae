// Files for the runtime's readers and writers (.npy, weights): an owning FILE handle, and
// writing a whole file under a temporary name then renaming it, so no reader ever sees a
// half-written file.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "flowc/status.h"

namespace flowc {
namespace io {

// Large files move in chunks of this size.
constexpr size_t kChunk = size_t(64) << 20;

struct File {
  std::FILE* f = nullptr;
  File(const std::string& path, const char* mode) : f(std::fopen(path.c_str(), mode)) {}
  ~File() {
    if (f != nullptr) std::fclose(f);
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
};

// Writes head, then data, to `path` through `path.tmp.<pid>`; messages start with `what`.
inline Status write_atomic(const std::string& path, const std::string& what, const void* head,
                           size_t head_bytes, const void* data, uint64_t bytes) {
  const std::string tmp = path + ".tmp." + std::to_string(long(getpid()));
  bool ok;
  int saved_errno = 0;
  {
    File file(tmp, "wb");
    if (file.f == nullptr)
      return InvalidArgument(what + ": cannot create " + tmp + ": " + std::strerror(errno));
    ok = std::fwrite(head, 1, head_bytes, file.f) == head_bytes;
    const unsigned char* p = static_cast<const unsigned char*>(data);
    for (uint64_t done = 0; ok && done < bytes;) {
      const size_t n = size_t(std::min<uint64_t>(kChunk, bytes - done));
      ok = std::fwrite(p + done, 1, n, file.f) == n;
      done += n;
    }
    ok = ok && std::fflush(file.f) == 0;
    if (!ok) saved_errno = errno;
    ok = std::fclose(file.f) == 0 && ok;
    if (!ok && saved_errno == 0) saved_errno = errno;
    file.f = nullptr;
  }
  if (!ok) {
    std::remove(tmp.c_str());
    return InvalidArgument(what + ": write to " + tmp + " failed: " + std::strerror(saved_errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    saved_errno = errno;
    std::remove(tmp.c_str());
    return InvalidArgument(what + ": cannot rename " + tmp + " onto it: " + std::strerror(saved_errno));
  }
  return Status::Ok();
}

}  // namespace io
}  // namespace flowc
