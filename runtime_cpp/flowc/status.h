// Status values returned by flowc's library code (which never exits the process).
#pragma once

#include <cstddef>
#include <string>
#include <utility>

namespace flowc {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument = 1,
  kNotSupported = 2,
  kLibraryError = 3,
  kOutOfMemory = 4
};

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) { return Status(StatusCode::kInvalidArgument, std::move(m)); }
inline Status NotSupported(std::string m) { return Status(StatusCode::kNotSupported, std::move(m)); }
inline Status LibraryError(std::string m) { return Status(StatusCode::kLibraryError, std::move(m)); }

// Element types the library wrappers take.
enum class DataType { kF32, kF16, kBF16 };

inline size_t element_size(DataType t) { return t == DataType::kF32 ? 4 : 2; }

}  // namespace flowc
