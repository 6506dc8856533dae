// NumPy .npy files: read (format versions 1.0, 2.0, 3.0) and write (1.0), C order, little-endian.
//
//   flowc::npy::Array a;
//   flowc::Status st = flowc::npy::read("x.npy", &a);  // a.dtype "f4", a.shape {3, 4}, a.data bytes
//   st = flowc::npy::write("y.npy", "f4", {2, 3}, ptr);  // via "y.npy.tmp.<pid>", then rename
//
// dtypes are numpy descrs without the byte-order character: f2 f4 f8 i1 i2 i4 i8 u1 u2 u4 u8 b1,
// and Vn (raw n-byte items, no fields): what np.save writes for the ml_dtypes types NumPy has
// no descr for (bfloat16 as V2, the float8 types and int4/uint4 as V1). type_mismatch() says
// which descr may feed which type. Files that are not regular files (a FIFO, a device) are
// refused without blocking (flowc/file_io.h). Fortran-order arrays, big-endian data,
// structured and other dtypes, and headers that are not what NumPy writes (a malformed dict, a
// dimension past int64, a shape that is not a tuple of non-negative integers) are rejected with
// a message naming the file. The host is assumed little-endian (checked at run time).
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "flowc/file_io.h"
#include "flowc/status.h"

namespace flowc {
namespace npy {

// The most dimensions an array may have (NumPy 2's limit).
constexpr size_t kMaxDims = 64;

struct Array {
  std::string dtype;                // numpy descr without byte order: "f4", "i8", "b1", ...
  std::vector<int64_t> shape;       // empty for a 0-d array
  std::vector<unsigned char> data;  // prod(shape) * itemsize(dtype) bytes, C order
};

// The largest raw void item read or written (NumPy's own limit is far larger; no flowc type
// comes near it).
constexpr int64_t kMaxVoidItem = int64_t(1) << 20;

// Whether a dtype is a raw void one: "V" and a item size ("V2").
inline bool is_void(const std::string& dtype) { return !dtype.empty() && dtype[0] == 'V'; }

// Bytes per element of a dtype, -1 if flowc does not know it. Vn: n, for n from 1 to
// kMaxVoidItem written without leading zeros.
inline int64_t itemsize(const std::string& dtype) {
  static const struct {
    const char* name;
    int64_t size;
  } kTypes[] = {{"f2", 2}, {"f4", 4}, {"f8", 8}, {"i1", 1}, {"i2", 2}, {"i4", 4},
                {"i8", 8}, {"u1", 1}, {"u2", 2}, {"u4", 4}, {"u8", 8}, {"b1", 1}};
  for (const auto& t : kTypes)
    if (dtype == t.name) return t.size;
  if (is_void(dtype) && dtype.size() >= 2 && dtype.size() <= 8 && dtype[1] != '0') {
    int64_t n = 0;
    for (size_t k = 1; k < dtype.size(); ++k) {
      if (dtype[k] < '0' || dtype[k] > '9') return -1;
      n = n * 10 + (dtype[k] - '0');
    }
    return n <= kMaxVoidItem ? n : -1;
  }
  return -1;
}

// A descr as NumPy spells it, with its byte-order character: '<f4', '|b1', '|V2'.
inline std::string full_descr(const std::string& dtype) {
  return (itemsize(dtype) == 1 || is_void(dtype) ? "|" : "<") + dtype;
}

// ONNX TensorProto element types <-> descrs.
inline const char* descr_of_onnx(int onnx_type) {
  switch (onnx_type) {
    case 1:
      return "f4";
    case 2:
      return "u1";
    case 3:
      return "i1";
    case 4:
      return "u2";
    case 5:
      return "i2";
    case 6:
      return "i4";
    case 7:
      return "i8";
    case 9:
      return "b1";
    case 10:
      return "f2";
    case 11:
      return "f8";
    case 12:
      return "u4";
    case 13:
      return "u8";
    // NumPy has no descr for bfloat16, float8/6/4 or 2/4-bit integers (ml_dtypes types): they
    // travel as raw bytes, one element per V1/V2 item, and the reader views them as the type.
    case 16:
      return "V2";
    case 17:
    case 18:
    case 19:
    case 20:
    case 21:
    case 22:
    case 23:
    case 24:
    case 25:
    case 26:
    case 27:
    case 28:
      return "V1";
    default:
      return nullptr;
  }
}

inline int onnx_of_descr(const std::string& dtype) {
  for (int t = 1; t <= 13; ++t) {
    const char* d = descr_of_onnx(t);
    if (d != nullptr && dtype == d) return t;
  }
  return -1;
}

// Whether an array of dtype `got` (as read() gives it) may feed a tensor whose descr is `want`
// (descr_of_onnx of its type), the rule `flowc run` and `flowc eval` apply too: the dtypes are
// the same, where a raw void array (Vn, no fields) stands only for a type NumPy has no descr of
// its own for (bfloat16, the float8 types, int4/uint4: V2 or V1), with the same item size; a
// void array is never read as the bytes of a type that has a descr (float32 has '<f4'). Returns
// "" when it may, else why not (after "got <descr>: ").
inline std::string type_mismatch(const std::string& got, const std::string& want) {
  if (got == want) return "";
  const std::string g = "'" + full_descr(got) + "'", w = "'" + full_descr(want) + "'";
  if (is_void(got) && !is_void(want)) {
    return "a raw void array (" + g +
           ", no fields) is taken only for a type NumPy has no dtype of its own for (bfloat16, "
           "the float8 types, int4, uint4); this type has one: save the array as " +
           w;
  }
  if (is_void(got)) {
    return "a raw void array of " + std::to_string(itemsize(got)) + "-byte items (" + g +
           ") does not fit this type's " + std::to_string(itemsize(want)) + "-byte items (" + w + ")";
  }
  if (is_void(want)) {
    return "this type has no NumPy dtype of its own: save its values as raw " +
           std::to_string(itemsize(want)) + "-byte items (" + w + "), as np.save does for an ml_dtypes array";
  }
  return "the dtype " + g + " is not " + w;
}

namespace detail {

inline bool host_is_little_endian() {
  const uint16_t one = 1;
  unsigned char b;
  std::memcpy(&b, &one, 1);
  return b == 1;
}

inline std::string errno_text() { return std::strerror(errno); }

// A header byte for a message: itself when printable ASCII, else \xNN.
inline std::string byte_text(char c) {
  const unsigned char u = static_cast<unsigned char>(c);
  if (u >= 0x20 && u < 0x7f) return std::string(1, c);
  char buf[8];
  std::snprintf(buf, sizeof buf, "\\x%02x", unsigned(u));
  return buf;
}

inline std::string printable(const std::string& s) {
  std::string out;
  for (char c : s) out += byte_text(c);
  return out;
}

inline std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

// prod(shape) * item, or -1 on a negative dimension or overflow past 2^62.
inline int64_t byte_count(const std::vector<int64_t>& shape, int64_t item) {
  const int64_t kLimit = int64_t(1) << 62;
  int64_t n = item;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && n > kLimit / d) return -1;
    n *= d;
  }
  return n;
}

// The subset of Python literals numpy writes in a header: a dict of str keys to str,
// True/False/None, ints (that fit int64), and tuples/lists of those. As in Python, "(3)" is
// the number 3, not a tuple; a tuple of one item is "(3,)".
struct Value {
  enum Kind { kStr, kBool, kNone, kInt, kTuple, kList, kDict } kind = kNone;
  std::string str;
  int64_t i = 0;
  bool b = false;
  std::vector<Value> items;       // tuple/list elements, or dict values
  std::vector<std::string> keys;  // dict keys, parallel to items
};

class Parser {
 public:
  explicit Parser(const std::string& s) : s_(s) {}

  bool parse(Value* v, std::string* err) {
    if (!value(v, 0)) {
      *err = err_;
      return false;
    }
    skip();
    if (p_ != s_.size()) {
      *err = "unexpected text after the header dict (at offset " + std::to_string(p_) + " of the header)";
      return false;
    }
    return true;
  }

 private:
  void skip() {
    while (p_ < s_.size() && (s_[p_] == ' ' || s_[p_] == '\t' || s_[p_] == '\n' || s_[p_] == '\r')) ++p_;
  }
  bool fail(const std::string& m) {
    if (err_.empty()) err_ = m + " (at offset " + std::to_string(p_) + " of the header)";
    return false;
  }
  bool word(const char* w) {
    size_t n = std::strlen(w);
    if (s_.compare(p_, n, w) != 0) return false;
    p_ += n;
    return true;
  }

  bool value(Value* v, int depth) {
    if (depth > 32) return fail("header nested too deeply");
    skip();
    if (p_ >= s_.size()) return fail("header ends early");
    char c = s_[p_];
    if (c == '\'' || c == '"') return string(v);
    if (c == '{') return container(v, '}', Value::kDict, depth);
    if (c == '(') return container(v, ')', Value::kTuple, depth);
    if (c == '[') return container(v, ']', Value::kList, depth);
    if (word("True")) {
      v->kind = Value::kBool;
      v->b = true;
      return true;
    }
    if (word("False")) {
      v->kind = Value::kBool;
      v->b = false;
      return true;
    }
    if (word("None")) {
      v->kind = Value::kNone;
      return true;
    }
    if (c == '-' || (c >= '0' && c <= '9')) return integer(v);
    return fail("unexpected character '" + byte_text(c) + "' in header");
  }

  bool string(Value* v) {
    char q = s_[p_++];
    v->kind = Value::kStr;
    v->str.clear();
    while (p_ < s_.size() && s_[p_] != q) {
      if (s_[p_] == '\\' && p_ + 1 < s_.size()) ++p_;
      v->str += s_[p_++];
    }
    if (p_ >= s_.size()) return fail("unterminated string in header");
    ++p_;
    return true;
  }

  // A decimal integer that fits int64 (Python 3 has no leading zeros but 0 itself).
  bool integer(Value* v) {
    const size_t start = p_;
    bool neg = s_[p_] == '-';
    if (neg) ++p_;
    if (p_ >= s_.size() || s_[p_] < '0' || s_[p_] > '9') return fail("bad number in header");
    const size_t first = p_;
    uint64_t n = 0;
    bool too_large = false;
    while (p_ < s_.size() && s_[p_] >= '0' && s_[p_] <= '9') {
      const uint64_t d = uint64_t(s_[p_++] - '0');
      const uint64_t limit = uint64_t(INT64_MAX) + (neg ? 1 : 0);
      if (n > (limit - d) / 10) too_large = true;
      if (!too_large) n = n * 10 + d;
    }
    if (too_large) {
      const size_t len = p_ - start;
      p_ = start;
      return fail("the number " + s_.substr(start, std::min<size_t>(len, 40)) + (len > 40 ? "..." : "") +
                  " does not fit int64");
    }
    if (s_[first] == '0' && p_ - first > 1) {
      p_ = first;
      return fail("bad number in header (a leading zero)");
    }
    if (p_ < s_.size() && (s_[p_] == 'L' || s_[p_] == 'l')) ++p_;  // Python 2 longs, as NumPy reads them
    v->kind = Value::kInt;
    v->i = neg ? int64_t(0 - n) : int64_t(n);
    return true;
  }

  bool container(Value* v, char close, Value::Kind kind, int depth) {
    ++p_;
    v->kind = kind;
    v->items.clear();
    v->keys.clear();
    bool comma = false;
    for (;;) {
      skip();
      if (p_ < s_.size() && s_[p_] == close) {
        ++p_;
        if (kind == Value::kTuple && v->items.size() == 1 && !comma) {
          Value inner = std::move(v->items[0]);  // "(x)" is x
          *v = std::move(inner);
        }
        return true;
      }
      if (kind == Value::kDict) {
        Value key;
        const size_t at = p_;
        if (!value(&key, depth + 1)) return false;
        if (key.kind != Value::kStr) return fail("header dict key is not a string");
        if (std::find(v->keys.begin(), v->keys.end(), key.str) != v->keys.end()) {
          p_ = at;
          return fail("header dict key '" + printable(key.str) + "' appears twice");
        }
        skip();
        if (p_ >= s_.size() || s_[p_] != ':') return fail("expected ':' in header dict");
        ++p_;
        v->keys.push_back(key.str);
      }
      Value item;
      if (!value(&item, depth + 1)) return false;
      v->items.push_back(std::move(item));
      skip();
      if (p_ < s_.size() && s_[p_] == ',') {
        ++p_;
        comma = true;
        continue;
      }
      if (p_ < s_.size() && s_[p_] == close) continue;
      return fail(std::string("expected ',' or '") + close + "' in header");
    }
  }

  const std::string& s_;
  size_t p_ = 0;
  std::string err_;
};

inline uint64_t le(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int k = n - 1; k >= 0; --k) v = (v << 8) | p[k];
  return v;
}

}  // namespace detail

inline Status read(const std::string& path, Array* out) {
  const std::string where = "npy file " + path + ": ";
  if (!detail::host_is_little_endian())
    return NotSupported(where + "reading .npy needs a little-endian host");
  io::File file;
  if (Status st = io::open_for_reading(path, "npy file", &file); !st.ok()) return st;

  unsigned char pre[12];
  size_t got = std::fread(pre, 1, 10, file.f);
  if (got < 10 || std::memcmp(pre, "\x93NUMPY", 6) != 0)
    return InvalidArgument(where + "not an NPY file (no \\x93NUMPY magic)");
  const int major = pre[6], minor = pre[7];
  size_t prefix = 10;
  uint64_t header_len;
  if (major == 1 && minor == 0) {
    header_len = detail::le(pre + 8, 2);
  } else if ((major == 2 || major == 3) && minor == 0) {
    if (std::fread(pre + 10, 1, 2, file.f) != 2)
      return InvalidArgument(where + "file ends inside the header");
    header_len = detail::le(pre + 8, 4);
    prefix = 12;
  } else {
    return InvalidArgument(where + "NPY format version " + std::to_string(major) + "." +
                           std::to_string(minor) + " is not supported (1.0, 2.0 and 3.0 are)");
  }
  if (header_len > (uint64_t(1) << 24)) return InvalidArgument(where + "header length is implausible");
  std::string header(header_len, '\0');
  if (header_len > 0 && std::fread(&header[0], 1, header_len, file.f) != header_len)
    return InvalidArgument(where + "file ends inside the header (" + std::to_string(header_len) +
                           " header bytes announced)");

  detail::Value dict;
  std::string err;
  if (!detail::Parser(header).parse(&dict, &err)) return InvalidArgument(where + "bad header: " + err);
  if (dict.kind != detail::Value::kDict) return InvalidArgument(where + "bad header: not a dict");
  const detail::Value *descr = nullptr, *fortran = nullptr, *shape = nullptr;
  for (size_t k = 0; k < dict.keys.size(); ++k) {
    if (dict.keys[k] == "descr") {
      descr = &dict.items[k];
    } else if (dict.keys[k] == "fortran_order") {
      fortran = &dict.items[k];
    } else if (dict.keys[k] == "shape") {
      shape = &dict.items[k];
    } else {
      return InvalidArgument(where + "bad header: unexpected key '" + detail::printable(dict.keys[k]) + "'");
    }
  }
  if (descr == nullptr || fortran == nullptr || shape == nullptr)
    return InvalidArgument(where + "bad header: needs the keys 'descr', 'fortran_order' and 'shape'");

  if (descr->kind != detail::Value::kStr)
    return InvalidArgument(where + "structured dtypes are not supported (descr is not a plain type string)");
  const std::string d = detail::printable(descr->str);
  std::string dtype = descr->str;
  char order = '=';
  if (!dtype.empty() && (dtype[0] == '<' || dtype[0] == '>' || dtype[0] == '|' || dtype[0] == '=')) {
    order = dtype[0];
    dtype = dtype.substr(1);
  }
  if (dtype == "?") dtype = "b1";
  const int64_t item = itemsize(dtype);
  if (item < 0)
    return InvalidArgument(where + "dtype '" + d +
                           "' is not supported (supported: f2 f4 f8 i1 i2 i4 i8 u1 u2 u4 u8 b1, and Vn: raw "
                           "n-byte items)");
  // Raw bytes have no byte order (ml_dtypes' arrays say '<V2', NumPy's own '|V2').
  if (order == '>' && item > 1 && !is_void(dtype))
    return InvalidArgument(where + "dtype '" + d + "' is big-endian; only little-endian data is supported " +
                           "(convert with a.astype(a.dtype.newbyteorder('<')))");

  if (fortran->kind != detail::Value::kBool)
    return InvalidArgument(where + "bad header: fortran_order is not a bool");
  if (fortran->b)
    return InvalidArgument(where + "fortran_order is True; only C-order arrays are supported " +
                           "(save np.ascontiguousarray(a) instead)");

  if (shape->kind != detail::Value::kTuple)
    return InvalidArgument(where +
                           "bad header: shape is not a tuple (such as (3, 4), or (3,) for one dimension)");
  if (shape->items.size() > kMaxDims)
    return InvalidArgument(where + "bad header: the shape has " + std::to_string(shape->items.size()) +
                           " dimensions; at most " + std::to_string(kMaxDims) + " are supported");
  std::vector<int64_t> dims;
  for (const detail::Value& v : shape->items) {
    if (v.kind != detail::Value::kInt || v.i < 0)
      return InvalidArgument(where + "bad header: shape entries must be non-negative integers");
    dims.push_back(v.i);
  }
  const int64_t want = detail::byte_count(dims, item);
  if (want < 0) return InvalidArgument(where + "shape " + detail::shape_text(dims) + " is too large");

  // Data length: everything after the header.
  const off_t data_start = off_t(prefix + header_len);
  if (fseeko(file.f, 0, SEEK_END) != 0)
    return InvalidArgument(where + "cannot seek: " + detail::errno_text());
  const off_t end = ftello(file.f);
  if (end < 0) return InvalidArgument(where + "cannot tell the file size: " + detail::errno_text());
  const int64_t have = int64_t(end - data_start);
  if (have != want)
    return InvalidArgument(where + (have < want ? "truncated: " : "unexpected trailing bytes: ") + "shape " +
                           detail::shape_text(dims) + " of " + dtype + " needs " + std::to_string(want) +
                           " bytes of data, the file holds " + std::to_string(have));
  if (fseeko(file.f, data_start, SEEK_SET) != 0)
    return InvalidArgument(where + "cannot seek: " + detail::errno_text());

  std::vector<unsigned char> data;
  try {
    data.resize(size_t(want));
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kOutOfMemory, where + "cannot allocate " + std::to_string(want) + " bytes");
  }
  size_t done = 0;
  while (done < data.size()) {
    size_t n = std::min(io::kChunk, data.size() - done);
    size_t r = std::fread(data.data() + done, 1, n, file.f);
    done += r;
    if (r != n) break;
  }
  if (done != data.size())
    return InvalidArgument(where + "read error after " + std::to_string(done) + " of " +
                           std::to_string(want) + " data bytes");

  out->dtype = dtype;
  out->shape = std::move(dims);
  out->data = std::move(data);
  return Status::Ok();
}

inline Status write(const std::string& path, const std::string& dtype, const std::vector<int64_t>& shape,
                    const void* data) {
  const std::string where = "npy file " + path + ": ";
  if (!detail::host_is_little_endian())
    return NotSupported(where + "writing .npy needs a little-endian host");
  const int64_t item = itemsize(dtype);
  if (item < 0) return InvalidArgument(where + "unknown dtype '" + dtype + "'");
  const int64_t bytes = detail::byte_count(shape, item);
  if (bytes < 0)
    return InvalidArgument(where + "shape " + detail::shape_text(shape) +
                           " has a negative dimension or is too large");
  if (bytes > 0 && data == nullptr) return InvalidArgument(where + "no data (null pointer)");

  std::string dict = std::string("{'descr': '") + (item == 1 ? "|" : "<") + dtype +
                     "', 'fortran_order': False, 'shape': " + detail::shape_text(shape) + ", }";
  // Pad with spaces and end with '\n' so the data starts at a multiple of 64 bytes.
  size_t prefix = 10;
  size_t total = prefix + dict.size() + 1;
  size_t padded = (total + 63) / 64 * 64;
  int major = 1;
  if (padded - prefix > 65535) {  // only with thousands of dimensions; numpy switches to 2.0 too
    major = 2;
    prefix = 12;
    total = prefix + dict.size() + 1;
    padded = (total + 63) / 64 * 64;
  }
  const size_t header_len = padded - prefix;
  std::string head = "\x93NUMPY";
  head += char(major);
  head += char(0);
  for (size_t k = 0; k < prefix - 8; ++k) head += char((header_len >> (8 * k)) & 0xff);
  head += dict;
  head.append(padded - total, ' ');
  head += '\n';

  // `where` ends in ": " for the messages above; write_atomic adds its own separator.
  return io::write_atomic(path, where.substr(0, where.size() - 2), head.data(), head.size(), data,
                          uint64_t(bytes));
}

}  // namespace npy
}  // namespace flowc
