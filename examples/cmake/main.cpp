// Runs two models compiled by flowc_add_model (CMakeLists.txt) through their C APIs, on
// inputs computed here, and prints every output:
//
//   model NAME
//   output NAME DIMS
//   VALUES...
//
// usage: app [MLP_WEIGHTS RESNET_WEIGHTS] (default: the build tree's weights files)
//
// Input k's element i is ((37 i + 11 k) mod 101) / 101 - 1/2, in float32: a test computes
// the same inputs and the models' outputs in NumPy and onnxruntime, and compares.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mlp/model.h"
#include "resnet/model.h"

#ifdef APP_CUDA
#include <cuda_runtime_api.h>
// The CUDA build: run() reads and writes device memory.
static void* device_alloc(size_t bytes) {
  void* p = nullptr;
  return cudaMalloc(&p, bytes) == cudaSuccess ? p : nullptr;
}
static void device_free(void* p) { cudaFree(p); }
static bool to_device(void* dst, const void* src, size_t bytes) {
  return cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice) == cudaSuccess;
}
static bool to_host(void* dst, const void* src, size_t bytes) {
  return cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost) == cudaSuccess;
}
#else
// The host build (flowc's CPU emulator): device memory is host memory, 256-byte aligned.
static void* device_alloc(size_t bytes) { return std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256); }
static void device_free(void* p) { std::free(p); }
static bool to_device(void* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
  return true;
}
static bool to_host(void* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
  return true;
}
#endif

// One model's C API: the same functions under each model's prefix.
template <class M>
struct Api {
  const char* name;
  int (*create)(const char*, M**);
  int (*run)(M*, const void* const*, void* const*, void*);
  int (*synchronize)(M*);
  void (*destroy)(M*);
  const char* (*last_error)(M*);
  int (*num_inputs)(void);
  int (*num_outputs)(void);
  const char* (*input_name)(int);
  const char* (*output_name)(int);
  int (*input_rank)(int);
  int (*output_rank)(int);
  const int64_t* (*input_shape)(int);
  const int64_t* (*output_shape)(int);
  int (*input_dtype)(int);
  int (*output_dtype)(int);
};

#define APP_API(P, NAME)                                                                               \
  Api<P##model> {                                                                                      \
    NAME, P##create, P##run, P##synchronize, P##destroy, P##last_error, P##num_inputs, P##num_outputs, \
        P##input_name, P##output_name, P##input_rank, P##output_rank, P##input_shape, P##output_shape, \
        P##input_dtype, P##output_dtype                                                                \
  }

static size_t elements(int rank, const int64_t* shape) {
  size_t n = 1;
  for (int d = 0; d < rank; ++d) n *= (size_t)shape[d];
  return n;
}

template <class M>
static int run_model(const Api<M>& api, const char* weights) {
  M* model = nullptr;
  if (api.create(weights, &model) != 0) {
    std::fprintf(stderr, "%s: %s\n", api.name, api.last_error(nullptr));
    return 1;
  }
  const int n_in = api.num_inputs(), n_out = api.num_outputs();
  std::vector<void*> in(n_in), out(n_out);
  std::vector<size_t> out_bytes(n_out);
  int rc = 0;
  for (int k = 0; k < n_in && rc == 0; ++k) {
    if (api.input_dtype(k) != 1) {  // ONNX's FLOAT
      std::fprintf(stderr, "%s: input %s is not float32\n", api.name, api.input_name(k));
      rc = 1;
      break;
    }
    std::vector<float> x(elements(api.input_rank(k), api.input_shape(k)));
    for (size_t i = 0; i < x.size(); ++i) x[i] = (float)((i * 37 + (size_t)k * 11) % 101) / 101.0f - 0.5f;
    in[k] = device_alloc(x.size() * sizeof(float));
    if (in[k] == nullptr || !to_device(in[k], x.data(), x.size() * sizeof(float))) rc = 1;
  }
  for (int k = 0; k < n_out && rc == 0; ++k) {
    if (api.output_dtype(k) != 1) {
      std::fprintf(stderr, "%s: output %s is not float32\n", api.name, api.output_name(k));
      rc = 1;
      break;
    }
    out_bytes[k] = elements(api.output_rank(k), api.output_shape(k)) * sizeof(float);
    out[k] = device_alloc(out_bytes[k]);
    if (out[k] == nullptr) rc = 1;
  }
  // run() queues the work (NULL: the default stream); synchronize() waits for it.
  if (rc == 0 && (api.run(model, in.data(), out.data(), nullptr) != 0 || api.synchronize(model) != 0)) {
    std::fprintf(stderr, "%s: %s\n", api.name, api.last_error(model));
    rc = 1;
  }
  if (rc == 0) std::printf("model %s\n", api.name);
  for (int k = 0; k < n_out && rc == 0; ++k) {
    std::vector<float> y(out_bytes[k] / sizeof(float));
    if (!to_host(y.data(), out[k], out_bytes[k])) {
      rc = 1;
      break;
    }
    std::string dims;
    for (int d = 0; d < api.output_rank(k); ++d)
      dims += (d ? "x" : "") + std::to_string(api.output_shape(k)[d]);
    std::printf("output %s %s\n", api.output_name(k), dims.c_str());
    for (size_t i = 0; i < y.size(); ++i) std::printf("%s%.9g", i ? " " : "", y[i]);
    std::printf("\n");
  }
  for (void* p : in) device_free(p);
  for (void* p : out) device_free(p);
  api.destroy(model);
  return rc;
}

int main(int argc, char** argv) {
  if (argc != 1 && argc != 3) {
    std::fprintf(stderr, "usage: %s [MLP_WEIGHTS RESNET_WEIGHTS]\n", argv[0]);
    return 2;
  }
  const char* mlp_weights = argc == 3 ? argv[1] : MLP_WEIGHTS;
  const char* resnet_weights = argc == 3 ? argv[2] : RESNET_WEIGHTS;
  if (run_model(APP_API(mlp_, "mlp"), mlp_weights) != 0) return 1;
  if (run_model(APP_API(resnet_, "resnet"), resnet_weights) != 0) return 1;
  return 0;
}
