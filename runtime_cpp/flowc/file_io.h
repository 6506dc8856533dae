// Files for the runtime's readers and writers (.npy, weights, traces, logs): an owning FILE
// handle; opening with flowc's rules for special files; and writing a whole file under a
// temporary name then renaming it, so no reader ever sees a half-written file.
//
// The rules (flowc/frontend/files.py applies the same to what the Python side reads):
// - A file that is read must be a regular file (symbolic links followed). A FIFO would block
//   the read forever and a device such as /dev/zero never ends, so they are refused, with
//   what they are ("weights file w.bin is a FIFO (named pipe), not a regular file"), and
//   never opened in a way that can block: the open is non-blocking, and the type is checked
//   on the opened file (fstat), so one swapped in after a first check is refused too.
// - A file that is written (a trace, a log) may be a regular file (made if missing), a
//   character device (/dev/null, a terminal) or a FIFO that has a reader (/dev/stdout into a
//   pipe). A FIFO with no reader is refused at once instead of waited on (the non-blocking
//   open fails with ENXIO), and so are directories, block devices and sockets.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "flowc/status.h"

namespace flowc {
namespace io {

// Large files move in chunks of this size.
constexpr size_t kChunk = size_t(64) << 20;

struct File {
  std::FILE* f = nullptr;
  File() = default;
  ~File() {
    if (f != nullptr) std::fclose(f);
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
};

// What a file that is not a regular one is, for messages.
inline const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "a special file";
}

// " (a link to TARGET)" when `path` is a symbolic link, else "".
inline std::string link_note(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return "";
  char* real = realpath(path.c_str(), nullptr);
  if (real == nullptr) return " (a symbolic link)";
  const std::string note = std::string(" (a link to ") + real + ")";
  std::free(real);
  return note;
}

namespace detail {

// `fd` (open, O_NONBLOCK) as a stdio stream in blocking mode, or closed and null.
inline std::FILE* stream_of(int fd, const char* mode) {
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int saved = errno;
    close(fd);
    errno = saved;
    return nullptr;
  }
  std::FILE* f = fdopen(fd, mode);
  if (f == nullptr) {
    const int saved = errno;
    close(fd);
    errno = saved;
  }
  return f;
}

inline bool writable_kind(mode_t mode) { return S_ISREG(mode) || S_ISCHR(mode) || S_ISFIFO(mode); }

}  // namespace detail

// Opens `path` for reading if it is a regular file. Messages start with `what` and the path:
// "npy file x.npy: cannot open: No such file or directory", "npy file x.npy is a FIFO (named
// pipe), not a regular file: give the path of a file on disk".
inline Status open_for_reading(const std::string& path, const std::string& what, File* file) {
  const std::string name = what + " " + path;
  const auto refuse = [&](mode_t mode) {
    return InvalidArgument(name + link_note(path) + " is " + kind_of(mode) +
                           ", not a regular file: give the path of a file on disk");
  };
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return InvalidArgument(name + ": cannot open: " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return refuse(st.st_mode);
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return InvalidArgument(name + ": cannot open: " + std::strerror(errno));
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int saved = errno;
    close(fd);
    if (!S_ISREG(st.st_mode)) return refuse(st.st_mode);
    return InvalidArgument(name + ": cannot open: " + std::strerror(saved));
  }
  file->f = detail::stream_of(fd, "rb");
  if (file->f == nullptr) return InvalidArgument(name + ": cannot open: " + std::strerror(errno));
  return Status::Ok();
}

// Opens `path` for writing (appending, or truncating it): a regular file, made if missing, a
// character device, or a FIFO with a reader. On failure returns false with why in *why:
// "No such file or directory", "it is a FIFO (named pipe) with no reader", "it is a directory".
inline bool open_for_writing(const std::string& path, bool append, File* file, std::string* why) {
  const auto refuse = [&](mode_t mode) {
    *why = std::string("it is ") + kind_of(mode) + link_note(path) +
           ", not a regular file, a character device or a FIFO with a reader";
    return false;
  };
  struct stat st;
  const bool exists = stat(path.c_str(), &st) == 0;
  if (exists && !detail::writable_kind(st.st_mode)) return refuse(st.st_mode);
  const int fd =
      ::open(path.c_str(), O_WRONLY | O_CREAT | O_NONBLOCK | O_CLOEXEC | (append ? O_APPEND : O_TRUNC), 0666);
  if (fd < 0) {
    const int saved = errno;
    if (saved == ENXIO && stat(path.c_str(), &st) == 0 && S_ISFIFO(st.st_mode)) {
      *why = "it is a FIFO (named pipe) with no reader" + link_note(path) + "; start its reader first";
    } else if (saved == ENXIO && stat(path.c_str(), &st) == 0) {
      return refuse(st.st_mode);
    } else {
      *why = std::strerror(saved);
    }
    return false;
  }
  if (fstat(fd, &st) != 0 || !detail::writable_kind(st.st_mode)) {
    const int saved = errno;
    close(fd);
    if (!detail::writable_kind(st.st_mode)) return refuse(st.st_mode);
    *why = std::strerror(saved);
    return false;
  }
  file->f = detail::stream_of(fd, append ? "a" : "w");
  if (file->f == nullptr) {
    *why = std::strerror(errno);
    return false;
  }
  return true;
}

// Writes head, then data, to `path` through `path.tmp.<pid>`; messages start with `what`.
inline Status write_atomic(const std::string& path, const std::string& what, const void* head,
                           size_t head_bytes, const void* data, uint64_t bytes) {
  const std::string tmp = path + ".tmp." + std::to_string(long(getpid()));
  bool ok;
  int saved_errno = 0;
  {
    // A fresh regular file: whatever has the name (a stale temporary, or a FIFO, which would
    // block the open) is removed first, and O_EXCL makes sure nothing took it since.
    if (unlink(tmp.c_str()) != 0 && errno != ENOENT)
      return InvalidArgument(what + ": cannot create " + tmp + ": " + std::strerror(errno));
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    File file;
    if (fd >= 0) file.f = detail::stream_of(fd, "wb");
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
