// Tests for flowc/npy.h, flowc/weights.h, flowc/file_io.h and flowc/env.h. Usage: io DIR,
// where DIR holds the .npy files tests/test_runtime_io.py writes with numpy; out_*.npy, w.bin
// and w_bad.bin are written there, and the special files (FIFOs) the tests make. Prints
// "PASS name" or "FAIL name: why", then "N passed, M failed". A test that blocks (a FIFO
// opened the blocking way) ends the program after 20 s (SIGALRM), which fails the test too.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "flowc/device.h"
#include "flowc/env.h"
#include "flowc/file_io.h"
#include "flowc/npy.h"
#include "flowc/weights.h"

static std::string dir;

static std::string at(const char* name) { return dir + "/" + name; }

static std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? "," : "") + std::to_string(s[i]);
  return r + "]";
}

// Reads DIR/name and checks dtype and shape; returns "" or why not.
static std::string load(const char* name, const char* dtype, const std::vector<int64_t>& shape,
                        flowc::npy::Array* a) {
  flowc::Status st = flowc::npy::read(at(name), a);
  if (!st.ok()) return st.message();
  if (a->dtype != dtype) return std::string(name) + ": dtype " + a->dtype + ", want " + dtype;
  if (a->shape != shape)
    return std::string(name) + ": shape " + shape_str(a->shape) + ", want " + shape_str(shape);
  return "";
}

template <typename T>
static std::vector<T> values(const flowc::npy::Array& a) {
  std::vector<T> v(a.data.size() / sizeof(T));
  std::memcpy(v.data(), a.data.data(), v.size() * sizeof(T));
  return v;
}

// The call must fail with InvalidArgument and a message holding every one of `needles`.
static std::string expect_error(const flowc::Status& st, const std::vector<std::string>& needles) {
  if (st.ok()) return "accepted";
  if (st.code() != flowc::StatusCode::kInvalidArgument) return "wrong status code: " + st.message();
  for (const std::string& n : needles)
    if (st.message().find(n) == std::string::npos) return "message lacks '" + n + "': " + st.message();
  return "";
}

static std::string test_read_f32() {
  flowc::npy::Array a;
  std::string why = load("f32.npy", "f4", {3, 4}, &a);
  if (!why.empty()) return why;
  auto v = values<float>(a);
  for (int i = 0; i < 12; ++i)
    if (v[i] != i / 4.0f) return "element " + std::to_string(i) + " = " + std::to_string(v[i]);
  return "";
}

static std::string test_read_i64() {
  flowc::npy::Array a;
  std::string why = load("i64.npy", "i8", {1, 2}, &a);
  if (!why.empty()) return why;
  auto v = values<int64_t>(a);
  if (v[0] != -5 || v[1] != 7) return "values " + std::to_string(v[0]) + ", " + std::to_string(v[1]);
  return "";
}

static std::string test_read_b1() {
  flowc::npy::Array a;
  std::string why = load("b1.npy", "b1", {3}, &a);
  if (!why.empty()) return why;
  if (a.data != std::vector<unsigned char>{1, 0, 1}) return "values";
  return "";
}

static std::string test_read_scalar() {
  flowc::npy::Array a;
  std::string why = load("scalar.npy", "f8", {}, &a);
  if (!why.empty()) return why;
  auto v = values<double>(a);
  if (v.size() != 1 || v[0] != 2.5) return "value";
  return "";
}

static std::string test_read_v2() {
  flowc::npy::Array a;
  std::string why = load("v2.npy", "f4", {2, 2}, &a);
  if (!why.empty()) return why;
  auto v = values<float>(a);
  for (int i = 0; i < 4; ++i)
    if (v[i] != 1.5f * i - 1.0f) return "element " + std::to_string(i);
  return "";
}

static std::string test_rejects_fortran() {
  flowc::npy::Array a;
  return expect_error(flowc::npy::read(at("fortran.npy"), &a),
                      {at("fortran.npy"), "fortran_order", "C-order"});
}

static std::string test_rejects_big_endian() {
  flowc::npy::Array a;
  return expect_error(flowc::npy::read(at("big_endian.npy"), &a),
                      {at("big_endian.npy"), "big-endian", ">f4"});
}

static std::string test_rejects_truncated() {
  flowc::npy::Array a;
  // f32 [3, 4]: 48 bytes expected, 44 left.
  return expect_error(flowc::npy::read(at("truncated.npy"), &a),
                      {at("truncated.npy"), "truncated", "48", "44"});
}

static std::string test_rejects_missing_and_garbage() {
  flowc::npy::Array a;
  std::string why = expect_error(flowc::npy::read(at("no_such.npy"), &a), {at("no_such.npy"), "cannot open"});
  if (!why.empty()) return why;
  // A weights file is not an NPY file.
  const unsigned char bytes[4] = {1, 2, 3, 4};
  flowc::Status st = flowc::weights::save(at("not_npy.bin"), bytes, 4);
  if (!st.ok()) return st.message();
  why = expect_error(flowc::npy::read(at("not_npy.bin"), &a), {at("not_npy.bin"), "not an NPY file"});
  std::remove(at("not_npy.bin").c_str());
  return why;
}

static std::string test_write_and_read_back() {
  float f[6];
  for (int i = 0; i < 6; ++i) f[i] = 0.5f * i;
  flowc::Status st = flowc::npy::write(at("out_f32.npy"), "f4", {2, 3}, f);
  if (!st.ok()) return st.message();
  const unsigned char b[4] = {1, 0, 1, 1};
  st = flowc::npy::write(at("out_b1.npy"), "b1", {4}, b);
  if (!st.ok()) return st.message();
  flowc::npy::Array a;
  std::string why = load("out_f32.npy", "f4", {2, 3}, &a);
  if (!why.empty()) return why;
  if (std::memcmp(a.data.data(), f, sizeof f) != 0) return "out_f32.npy contents";
  why = load("out_b1.npy", "b1", {4}, &a);
  if (!why.empty()) return why;
  if (std::memcmp(a.data.data(), b, sizeof b) != 0) return "out_b1.npy contents";
  // A 0-d array, and data starting at a multiple of 64 bytes.
  const double x = -3.25;
  st = flowc::npy::write(at("out_scalar.npy"), "f8", {}, &x);
  if (!st.ok()) return st.message();
  why = load("out_scalar.npy", "f8", {}, &a);
  if (!why.empty()) return why;
  if (values<double>(a) != std::vector<double>{x}) return "out_scalar.npy contents";
  std::FILE* fp = std::fopen(at("out_scalar.npy").c_str(), "rb");
  if (fp == nullptr) return "cannot reopen out_scalar.npy";
  std::fseek(fp, 0, SEEK_END);
  long size = std::ftell(fp);
  std::fclose(fp);
  if ((size - 8) % 64 != 0)
    return "data does not start at a multiple of 64 (file size " + std::to_string(size) + ")";
  std::remove(at("out_scalar.npy").c_str());
  return "";
}

static std::string test_write_errors() {
  const float f[1] = {0};
  std::string why = expect_error(flowc::npy::write(at("x.npy"), "c8", {1}, f), {"unknown dtype 'c8'"});
  if (!why.empty()) return why;
  why = expect_error(flowc::npy::write(at("x.npy"), "f4", {-1}, f), {"negative"});
  if (!why.empty()) return why;
  return expect_error(flowc::npy::write(at("no_such_dir/x.npy"), "f4", {1}, f),
                      {"no_such_dir/x.npy", "cannot create"});
}

static std::string test_dtype_tables() {
  const char* names[] = {"f4", "f8", "i8", "i4", "i2", "i1", "u1", "u2", "u4", "u8", "b1", "f2"};
  const int64_t sizes[] = {4, 8, 8, 4, 2, 1, 1, 2, 4, 8, 1, 2};
  const int onnx[] = {1, 11, 7, 6, 5, 3, 2, 4, 12, 13, 9, 10};
  for (int i = 0; i < 12; ++i) {
    if (flowc::npy::itemsize(names[i]) != sizes[i]) return std::string("itemsize ") + names[i];
    if (flowc::npy::onnx_of_descr(names[i]) != onnx[i]) return std::string("onnx_of_descr ") + names[i];
    const char* d = flowc::npy::descr_of_onnx(onnx[i]);
    if (d == nullptr || std::strcmp(d, names[i]) != 0) return "descr_of_onnx " + std::to_string(onnx[i]);
  }
  if (flowc::npy::itemsize("c8") != -1 || flowc::npy::itemsize("<f4") != -1) return "itemsize of unknown";
  if (flowc::npy::descr_of_onnx(8) != nullptr || flowc::npy::descr_of_onnx(0) != nullptr)
    return "onnx 8 (string)";
  if (flowc::npy::onnx_of_descr("c8") != -1) return "onnx_of_descr of unknown";
  return "";
}

static std::string test_crc32() {
  // Published CRC-32 check values (zlib's polynomial).
  if (flowc::weights::crc32("", 0) != 0u) return "empty";
  if (flowc::weights::crc32("123456789", 9) != 0xCBF43926u) return "\"123456789\"";
  uint32_t h = flowc::weights::crc32("12345", 5);
  if (flowc::weights::crc32("6789", 4, h) != 0xCBF43926u) return "in pieces";
  return "";
}

static std::string test_weights() {
  unsigned char w[64];
  for (int i = 0; i < 64; ++i) w[i] = (unsigned char)i;
  const uint64_t hash = 0x1234abcdULL;  // the layout id the program expects
  const std::string path = at("w.bin");
  flowc::Status st = flowc::weights::save(path, w, 64, hash);
  if (!st.ok()) return st.message();
  std::vector<unsigned char> got;
  st = flowc::weights::load(path, 64, hash, &got);
  if (!st.ok()) return st.message();
  if (got != std::vector<unsigned char>(w, w + 64)) return "contents";

  std::string why = expect_error(flowc::weights::load(path, 128, hash, &got),
                                 {"weights file " + path +
                                  " holds 64 bytes of data; this program expects 128: "
                                  "it was compiled for another model or layout"});
  if (!why.empty()) return "wrong size: " + why;
  why = expect_error(flowc::weights::load(path, 64, hash ^ 1, &got), {path, "another model"});
  if (!why.empty()) return "wrong layout: " + why;
  if (flowc::weights::load(path, 64, hash ^ 1, &got).message().find("corrupt") != std::string::npos)
    return "wrong layout: reported as corruption";

  // The same file with one data byte flipped: right size and header hash, wrong data.
  std::FILE* in = std::fopen(path.c_str(), "rb");
  if (in == nullptr) return "cannot reopen w.bin";
  std::vector<unsigned char> bytes(64 + 64);
  size_t n = std::fread(bytes.data(), 1, bytes.size(), in);
  std::fclose(in);
  if (n != bytes.size()) return "w.bin is " + std::to_string(n) + " bytes, want 128";
  if (std::memcmp(bytes.data(), "FLOWCWT1", 8) != 0) return "w.bin magic";
  bytes[64 + 17] ^= 0x40;
  const std::string bad = at("w_bad.bin");
  std::FILE* o = std::fopen(bad.c_str(), "wb");
  if (o == nullptr) return "cannot write w_bad.bin";
  std::fwrite(bytes.data(), 1, bytes.size(), o);
  std::fclose(o);
  why = expect_error(flowc::weights::load(bad, 64, hash, &got), {bad, "corrupt: hash mismatch"});
  if (!why.empty()) return "flipped byte: " + why;

  // Truncated, not a weights file, missing.
  o = std::fopen(bad.c_str(), "wb");
  std::fwrite(bytes.data(), 1, bytes.size() - 1, o);
  std::fclose(o);
  why = expect_error(flowc::weights::load(bad, 64, hash, &got), {bad, "truncated"});
  if (!why.empty()) return "truncated: " + why;
  why = expect_error(flowc::weights::load(at("f32.npy"), 64, hash, &got), {"not a flowc weights file"});
  if (!why.empty()) return "npy file: " + why;
  why = expect_error(flowc::weights::load(at("no_such.bin"), 64, hash, &got), {"no_such.bin", "cannot open"});
  if (!why.empty()) return "missing: " + why;
  std::remove(bad.c_str());
  // An empty weights file is valid.
  st = flowc::weights::save(at("w_empty.bin"), nullptr, 0);
  if (st.ok()) st = flowc::weights::load(at("w_empty.bin"), 0, 0, &got);
  std::remove(at("w_empty.bin").c_str());
  if (!st.ok()) return "empty: " + st.message();
  return got.empty() ? "" : "empty: got data";
}

// DIR/name: an NPY 1.0 file with `header` as its header dict (padded as numpy pads it) and
// `data_bytes` zero bytes of data.
static std::string npy_with_header(const char* name, const std::string& header, size_t data_bytes) {
  std::string dict = header;
  const size_t total = 10 + dict.size() + 1;
  dict.append((total + 63) / 64 * 64 - total, ' ');
  dict += '\n';
  std::string bytes = "\x93NUMPY";
  bytes += char(1);
  bytes += char(0);
  bytes += char(dict.size() & 0xff);
  bytes += char(dict.size() >> 8);
  bytes += dict;
  bytes.append(data_bytes, '\0');
  std::FILE* f = std::fopen(at(name).c_str(), "wb");
  if (f != nullptr) {
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
  }
  return at(name);
}

static std::string test_rejects_bad_headers() {
  flowc::npy::Array a;
  const struct {
    const char* header;
    size_t data;
    std::vector<std::string> needles;
  } cases[] = {
      // A dimension past int64 used to wrap (2^64 read as 0).
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (18446744073709551616, 16), }",
       0,
       {"18446744073709551616 does not fit int64"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (9223372036854775808,), }",
       0,
       {"9223372036854775808 does not fit int64"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (9223372036854775807,), }",
       0,
       {"(9223372036854775807,) is too large"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999999999999999999999999999,), }",
       0,
       {"the number 9999999999999999999999999999999999999999... does not fit int64"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }", 0, {"non-negative"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': [3], }", 12, {"shape is not a tuple"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (3), }", 12, {"shape is not a tuple"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (03,), }", 12, {"leading zero"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (3,), 'shape': (3,), }",
       12,
       {"'shape' appears twice"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (3,), 'x': 1, }", 12, {"unexpected key 'x'"}},
      {"{'descr': '<f4', 'fortran_order': False, }", 0, {"needs the keys"}},
      {"{'descr': '<f4', 'fortran_order': 0, 'shape': (3,), }", 12, {"fortran_order is not a bool"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (3,), \x1b[2J}",
       12,
       {"unexpected character '\\x1b'"}},
      {"{'descr': '<f4\x1b', 'fortran_order': False, 'shape': (3,), }", 12, {"'<f4\\x1b' is not supported"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (3,), } junk", 12, {"unexpected text after"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (3,", 12, {"bad header"}},
      {"{'descr': '|V0', 'fortran_order': False, 'shape': (3,), }", 0, {"'|V0' is not supported"}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, "
       "1, 1, 1, "
       "1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, "
       "1, 1, 1, 1, "
       "1, 1, 1, 1, 1, 1, 1, 1, 1), }",
       4,
       {"65 dimensions; at most 64"}},
  };
  int k = 0;
  for (const auto& c : cases) {
    const std::string path =
        npy_with_header(("bad_header" + std::to_string(k++) + ".npy").c_str(), c.header, c.data);
    std::vector<std::string> needles = c.needles;
    needles.push_back(path);
    const std::string why = expect_error(flowc::npy::read(path, &a), needles);
    std::remove(path.c_str());
    if (!why.empty()) return "case " + std::to_string(k - 1) + ": " + why;
  }
  // What NumPy accepts still reads: a Python 2 long, a list-free nested dict order, spaces.
  const std::string ok =
      npy_with_header("good_header.npy", "{'shape': (2L, 3), 'fortran_order': False, 'descr': '<i2'}", 12);
  flowc::Status st = flowc::npy::read(ok, &a);
  std::remove(ok.c_str());
  if (!st.ok()) return "a valid header: " + st.message();
  if (a.dtype != "i2" || a.shape != std::vector<int64_t>{2, 3})
    return "a valid header: " + a.dtype + shape_str(a.shape);
  return "";
}

// Raw void arrays: read as Vn (any byte-order character: ml_dtypes writes '<V2', NumPy '|V2'),
// and the one rule for what they may feed (type_mismatch).
static std::string test_void_arrays_and_the_type_rule() {
  flowc::npy::Array a;
  const char* descrs[] = {"|V4", "<V2", ">V2", "|V1"};
  const int64_t sizes[] = {4, 2, 2, 1};
  for (int k = 0; k < 4; ++k) {
    const std::string path = npy_with_header(
        "void.npy", std::string("{'descr': '") + descrs[k] + "', 'fortran_order': False, 'shape': (3,), }",
        size_t(3 * sizes[k]));
    flowc::Status st = flowc::npy::read(path, &a);
    std::remove(path.c_str());
    if (!st.ok()) return std::string(descrs[k]) + ": " + st.message();
    if (a.dtype != "V" + std::to_string(sizes[k]) || a.data.size() != size_t(3 * sizes[k]))
      return std::string(descrs[k]) + " read as " + a.dtype;
  }
  using flowc::npy::type_mismatch;
  // bfloat16 (V2) and float8 (V1) have no NumPy descr: a void array of their size feeds them.
  if (!type_mismatch("V2", flowc::npy::descr_of_onnx(16)).empty()) return "V2 for bfloat16";
  if (!type_mismatch("V1", flowc::npy::descr_of_onnx(17)).empty()) return "V1 for float8";
  if (!type_mismatch("f4", "f4").empty()) return "f4 for float32";
  struct {
    const char *got, *want, *needle;
  } refused[] = {
      {"V4", "f4",
       "a raw void array ('|V4', no fields) is taken only for a type NumPy has no dtype of its own"},
      {"V2", "f2", "save the array as '<f2'"},
      {"V1", "V2", "a raw void array of 1-byte items ('|V1') does not fit this type's 2-byte items ('|V2')"},
      {"f2", "V2", "this type has no NumPy dtype of its own: save its values as raw 2-byte items ('|V2')"},
      {"i8", "f4", "the dtype '<i8' is not '<f4'"},
  };
  for (const auto& r : refused) {
    const std::string why = type_mismatch(r.got, r.want);
    if (why.find(r.needle) == std::string::npos)
      return std::string(r.got) + " for " + r.want + ": '" + why + "' lacks '" + r.needle + "'";
  }
  return "";
}

// Special files are refused, never waited on: a FIFO read as an input or a weights file (it
// used to block forever), a device, a folder; a FIFO written with no reader; a FIFO in the way
// of a temporary file.
static std::string test_special_files() {
  const std::string fifo = at("fifo");
  std::remove(fifo.c_str());
  if (mkfifo(fifo.c_str(), 0600) != 0) return "mkfifo failed";
  flowc::npy::Array a;
  std::vector<unsigned char> got;
  std::string why = expect_error(flowc::npy::read(fifo, &a),
                                 {"npy file " + fifo + " is a FIFO (named pipe), not a regular file"});
  if (why.empty())
    why = expect_error(flowc::weights::load(fifo, 0, 0, &got),
                       {"weights file " + fifo + " is a FIFO (named pipe), not a regular file"});
  if (why.empty())
    why = expect_error(flowc::npy::read("/dev/null", &a),
                       {"/dev/null is a character device, not a regular file"});
  if (why.empty())
    why = expect_error(flowc::npy::read(dir, &a), {dir + " is a directory, not a regular file"});
  if (why.empty()) {
    const std::string link = at("fifo_link");
    std::remove(link.c_str());
    if (symlink(fifo.c_str(), link.c_str()) != 0) return "symlink failed";
    why = expect_error(flowc::npy::read(link, &a), {" (a link to ", "/fifo) is a FIFO (named pipe)"});
    std::remove(link.c_str());
  }
  flowc::io::File file;
  std::string error;
  if (why.empty() && flowc::io::open_for_writing(fifo, false, &file, &error))
    why = "a FIFO with no reader was opened";
  if (why.empty() && error.find("FIFO (named pipe) with no reader") == std::string::npos)
    why = "message: " + error;
  if (why.empty() && flowc::io::open_for_writing(dir, true, &file, &error))
    why = "a folder was opened for writing";
  if (why.empty() && error.find("it is a directory") == std::string::npos) why = "message: " + error;
  if (why.empty() && !flowc::io::open_for_writing("/dev/null", false, &file, &error))
    why = "/dev/null: " + error;
  // A FIFO where write_atomic puts its temporary file is replaced, not opened.
  const std::string out = at("out_fifo.npy");
  const std::string tmp = out + ".tmp." + std::to_string(long(getpid()));
  if (why.empty() && mkfifo(tmp.c_str(), 0600) != 0) why = "mkfifo tmp failed";
  const float f[2] = {1, 2};
  if (why.empty()) {
    flowc::Status st = flowc::npy::write(out, "f4", {2}, f);
    struct stat sb;
    if (!st.ok()) {
      why = "write past a FIFO: " + st.message();
    } else if (stat(out.c_str(), &sb) != 0 || !S_ISREG(sb.st_mode) || stat(tmp.c_str(), &sb) == 0) {
      why = "write past a FIFO: not a regular file, or the temporary left";
    }
  }
  std::remove(tmp.c_str());
  std::remove(out.c_str());
  std::remove(fifo.c_str());
  return why;
}

// flowc/env.h: decimal values in range only, with the variable, the value and the range named.
static std::string test_env_is_strict() {
  struct {
    const char *name, *value, *needle;
  } bad[] = {
      {"FLOWC_TIMEOUT_S", " 5",
       "FLOWC_TIMEOUT_S=' 5': expected a decimal number of seconds from 0.001 to 31536000"},
      {"FLOWC_TIMEOUT_S", "0x10", "FLOWC_TIMEOUT_S='0x10': expected"},
      {"FLOWC_TIMEOUT_S", "1e-300", "FLOWC_TIMEOUT_S='1e-300': expected"},
      {"FLOWC_TIMEOUT_S", "5 ", "FLOWC_TIMEOUT_S='5 ': expected"},
      {"FLOWC_TIMEOUT_S", "0", "FLOWC_TIMEOUT_S='0': expected"},
      {"FLOWC_TIMEOUT_S", "inf", "FLOWC_TIMEOUT_S='inf': expected"},
      {"FLOWC_TIMEOUT_S", "99999999", "FLOWC_TIMEOUT_S='99999999': expected"},
      {"FLOWC_SIM_STACK_KB", "99999999999999999999",
       "FLOWC_SIM_STACK_KB='99999999999999999999': expected a whole number of KiB from 64 to 1048576"},
      {"FLOWC_SIM_STACK_KB", "63", "from 64 to 1048576"},
      {"FLOWC_SIM_STACK_KB", "+128", "FLOWC_SIM_STACK_KB='+128'"},
      {"FLOWC_SIM_STACK_KB", "128k", "FLOWC_SIM_STACK_KB='128k'"},
      {"FLOWC_STATS", "yes", "FLOWC_STATS='yes': expected 0 or 1"},
      {"FLOWC_STATS", "2", "FLOWC_STATS='2': expected 0 or 1"},
      {"FLOWC_SIM_ORDER", "shuffle:-1",
       "FLOWC_SIM_ORDER='shuffle:-1': expected forward, reverse or shuffle:SEED"},
      {"FLOWC_SIM_ORDER", "shuffle:18446744073709551616", "expected forward, reverse or shuffle:SEED"},
      {"FLOWC_DROP_EVENT", "-1", "FLOWC_DROP_EVENT='-1': expected an event number from 0 to 2147483647"},
      {"FLOWC_TRACE", "", ""},  // a path: anything (empty: unset)
      {"FLOWC_STATS", "1\x1b[2J", "FLOWC_STATS='1\\x1b[2J'"},
  };
  for (const auto& b : bad) {
    setenv(b.name, b.value, 1);
    const flowc::Status st = flowc::env::check_all();
    unsetenv(b.name);
    if (*b.needle == '\0') {
      if (!st.ok()) return std::string(b.name) + "=" + b.value + " refused: " + st.message();
      continue;
    }
    const std::string why = expect_error(st, {b.needle});
    if (!why.empty()) return std::string(b.name) + "=" + b.value + ": " + why;
  }
  struct {
    const char *name, *value;
  } good[] = {{"FLOWC_TIMEOUT_S", "30"},
              {"FLOWC_TIMEOUT_S", "2.5"},
              {"FLOWC_TIMEOUT_S", ".5"},
              {"FLOWC_TIMEOUT_S", "0.001"},
              {"FLOWC_TIMEOUT_S", "31536000"},
              {"FLOWC_SIM_STACK_KB", "64"},
              {"FLOWC_SIM_STACK_KB", "1048576"},
              {"FLOWC_STATS", "0"},
              {"FLOWC_STATS", ""},
              {"FLOWC_SIM_ORDER", "shuffle:18446744073709551615"},
              {"FLOWC_SIM_ORDER", "reverse"}};
  for (const auto& g : good) {
    setenv(g.name, g.value, 1);
    const flowc::Status st = flowc::env::check_all();
    unsetenv(g.name);
    if (!st.ok()) return std::string(g.name) + "=" + g.value + " refused: " + st.message();
  }
  double t = 0;
  setenv("FLOWC_TIMEOUT_S", "2.5", 1);
  const flowc::Status st = flowc::env::seconds("FLOWC_TIMEOUT_S", &t);
  unsetenv("FLOWC_TIMEOUT_S");
  if (!st.ok() || t != 2.5) return "FLOWC_TIMEOUT_S=2.5 read as " + std::to_string(t);
  return "";
}

struct Test {
  const char* name;
  std::string (*fn)();
};

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  dir = argv[1];
  alarm(20);
  const Test tests[] = {
      {"read_f32", test_read_f32},
      {"read_i64", test_read_i64},
      {"read_b1", test_read_b1},
      {"read_scalar", test_read_scalar},
      {"read_v2", test_read_v2},
      {"rejects_fortran", test_rejects_fortran},
      {"rejects_big_endian", test_rejects_big_endian},
      {"rejects_truncated", test_rejects_truncated},
      {"rejects_missing_and_garbage", test_rejects_missing_and_garbage},
      {"write_and_read_back", test_write_and_read_back},
      {"write_errors", test_write_errors},
      {"dtype_tables", test_dtype_tables},
      {"crc32", test_crc32},
      {"weights", test_weights},
      {"rejects_bad_headers", test_rejects_bad_headers},
      {"void_arrays_and_the_type_rule", test_void_arrays_and_the_type_rule},
      {"special_files", test_special_files},
      {"env_is_strict", test_env_is_strict},
  };
  int failed = 0, ran = 0;
  for (const Test& t : tests) {
    ++ran;
    std::string why = t.fn();
    if (why.empty()) {
      std::printf("PASS %s\n", t.name);
    } else {
      std::printf("FAIL %s: %s\n", t.name, why.c_str());
      ++failed;
    }
  }
  std::printf("%d passed, %d failed\n", ran - failed, failed);
  return failed == 0 ? 0 : 1;
}
