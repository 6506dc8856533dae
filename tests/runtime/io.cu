// Tests for flowc/npy.h and flowc/weights.h. Usage: io DIR, where DIR holds the .npy files
// tests/test_runtime_io.py writes with numpy; out_*.npy, w.bin and w_bad.bin are written
// there. Prints "PASS name" or "FAIL name: why", then "N passed, M failed".
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "flowc/device.h"
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
