// The f16 and bf16 conversions the host build sums through (flowc/comm.h sums in f32 and rounds
// once), for comparison with NumPy and ml_dtypes:
//
//   comm_halves IN OUT
//
// IN holds float32 values; OUT gets, per value, its f16 bits and its bf16 bits (uint16 each),
// then, for every 16-bit code 0..65535, its value read as f16 and as bf16 (float32 each).
#include <cstdint>
#include <cstdio>
#include <vector>

#include "flowc/comm.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s IN OUT\n", argv[0]);
    return 2;
  }
  FILE* in = std::fopen(argv[1], "rb");
  FILE* out = std::fopen(argv[2], "wb");
  if (in == nullptr || out == nullptr) {
    std::fprintf(stderr, "cannot open %s or %s\n", argv[1], argv[2]);
    return 1;
  }
  namespace d = flowc::comm::detail;
  std::vector<float> values;
  for (float v; std::fread(&v, sizeof(v), 1, in) == 1;) values.push_back(v);
  std::vector<uint16_t> bits;
  for (float v : values) {
    bits.push_back(d::f32_to_f16(v));
    bits.push_back(d::f32_to_bf16(v));
  }
  std::vector<float> decoded;
  for (uint32_t code = 0; code < 65536; ++code) {
    decoded.push_back(d::f16_to_f32(static_cast<uint16_t>(code)));
    decoded.push_back(d::bf16_to_f32(static_cast<uint16_t>(code)));
  }
  const bool ok = std::fwrite(bits.data(), sizeof(uint16_t), bits.size(), out) == bits.size() &&
                  std::fwrite(decoded.data(), sizeof(float), decoded.size(), out) == decoded.size();
  std::fclose(in);
  return std::fclose(out) == 0 && ok ? 0 : 1;
}
