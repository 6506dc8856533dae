// 2-D convolution forward, NCHW, with an optional fused epilogue: y = act(conv(x, w) + bias + z),
// act ReLU or the identity, z a residual of y's shape. cuDNN on the GPU, im2col + CBLAS GEMM on
// the host. Weights are [k, c / groups, r, s]; padding is symmetric per axis (an asymmetric pad
// is an explicit Pad before the convolution).
//
// A ConvPlan holds everything about one call that does not depend on the data: cuDNN's tensor,
// filter, convolution and activation descriptors, the math mode and the chosen algorithm. The
// model makes its plans once in create() (plan_conv) and run() only executes them (run_conv);
// release() destroys them (destroy_plan). Algorithm choice: cuDNN's heuristic
// (cudnnGetConvolutionForwardAlgorithm_v7), or with FLOWC_TUNE=1 in the environment at create
// a timed search (cudnnFindConvolutionForwardAlgorithm); either way only algorithms whose
// workspace fits the stream's planned workspace.
//
// Precision: float32 tensors are exact fp32 by default (CUDNN_FMA_MATH: cuDNN's default math
// would allow TF32 on Ampere and later), TF32 tensor cores with ConvMath::kTF32; float16 and
// bfloat16 tensors run on tensor cores with float32 accumulation (compute type FLOAT). The host
// computes a narrow convolution in float and rounds its result once.
//
// The epilogue runs inside cudnnConvolutionBiasActivationForward when cuDNN supports the
// pattern (a bias is present; the identity activation only with the IMPLICIT_PRECOMP_GEMM
// algorithm, as cuDNN requires). Otherwise, or when FLOWC_CONV_UNFUSED=1 is set at create, or
// when cuDNN answers NOT_SUPPORTED at the first run, the plan takes the named fallback
// "conv+epilogue": the plain convolution, then conv_epilogue (one element-wise kernel for bias,
// residual and activation). plan_path() says which one a plan takes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "flowc/env.h"
#include "flowc/gemm.h"
#include "flowc/narrow.h"

#if !defined(FLOWC_HOST)
#include <cudnn.h>
#endif

namespace flowc {

// Float32 convolutions: exact (FMA only) or TF32 tensor cores. Narrow types ignore it.
enum class ConvMath { kExact, kTF32 };

struct ConvDesc {
  int64_t n = 1, c = 0, h = 0, w = 0;  // input
  int64_t k = 0, r = 0, s = 0;         // output channels, kernel height and width
  int64_t groups = 1;
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_h = 0, pad_w = 0;
  int64_t dil_h = 1, dil_w = 1;
  DataType type = DataType::kF32;  // of x, w, bias, z and y
  ConvMath math = ConvMath::kExact;
  // The epilogue: y = act(conv + bias[k] + z), in float, rounded once to `type`.
  bool has_bias = false;
  bool has_residual = false;
  bool relu = false;
  // The most workspace this call may use (bytes; its bound from the shapes, docs/runtime.md),
  // -1: whatever the handle has. The stream's handle must have at least this much.
  int64_t workspace = -1;

  int64_t out_h() const { return (h + 2 * pad_h - dil_h * (r - 1) - 1) / stride_h + 1; }
  int64_t out_w() const { return (w + 2 * pad_w - dil_w * (s - 1) - 1) / stride_w + 1; }
  bool epilogue() const { return has_bias || has_residual || relu; }
};

inline Status validate(const ConvDesc& d) {
  if (d.n < 1 || d.c < 1 || d.h < 1 || d.w < 1 || d.k < 1 || d.r < 1 || d.s < 1 || d.groups < 1) {
    return InvalidArgument("conv2d: every extent must be positive");
  }
  if (d.c % d.groups != 0 || d.k % d.groups != 0) {
    return InvalidArgument("conv2d: channels (" + std::to_string(d.c) + " in, " + std::to_string(d.k) +
                           " out) must divide by groups (" + std::to_string(d.groups) + ")");
  }
  if (d.stride_h < 1 || d.stride_w < 1 || d.dil_h < 1 || d.dil_w < 1 || d.pad_h < 0 || d.pad_w < 0) {
    return InvalidArgument("conv2d: strides and dilations must be >= 1, pads >= 0");
  }
  if (d.out_h() < 1 || d.out_w() < 1)
    return InvalidArgument("conv2d: the kernel does not fit the padded input");
  return Status::Ok();
}

// cuDNN's forward algorithms (cudnnConvolutionFwdAlgo_t), named on both targets.
enum class ConvAlgo {
  kImplicitGemm,
  kImplicitPrecompGemm,
  kGemm,
  kDirect,
  kFft,
  kFftTiling,
  kWinograd,
  kWinogradNonfused
};

// Whether a plan may use `algo`. Exact float32 (FMA math) leaves out the transform algorithms:
// FFT and Winograd compute a different sum (rounded in the transformed domain), which cuDNN's
// math mode does not exclude; TF32 and the narrow types, already approximate, keep them.
inline bool conv_algorithm_allowed(const ConvDesc& d, ConvAlgo algo) {
  const bool transform = algo == ConvAlgo::kFft || algo == ConvAlgo::kFftTiling ||
                         algo == ConvAlgo::kWinograd || algo == ConvAlgo::kWinogradNonfused;
  return !(transform && d.type == DataType::kF32 && d.math == ConvMath::kExact);
}

// The activation's NaN option (cudnnSetActivationDescriptor's reluNanOpt): propagated, so a
// NaN stays NaN through ReLU as ONNX's Relu (max(x, 0)) keeps it. PyTorch asks for
// CUDNN_NOT_PROPAGATE_NAN, which turns NaN into 0; the emulator applies whichever a plan sets.
constexpr bool kConvReluPropagatesNan = true;

namespace detail {

// A 0/1 variable (flowc/env.h); a model's create() has refused any other value.
inline bool env_flag(const char* name) {
  bool on = false;
  return env::flag(name, &on).ok() && on;
}

// Every tensor pointer at least aligned to its element size, as cuDNN's kernels load them.
inline Status check_conv_pointers(const ConvDesc& d, const void* x, const void* w, const void* bias,
                                  const void* z, const void* y) {
  const uintptr_t elem = element_size(d.type);
  const void* ptrs[5] = {x, w, d.has_bias ? bias : nullptr, d.has_residual ? z : nullptr, y};
  const char* names[5] = {"x", "w", "bias", "z", "y"};
  for (int i = 0; i < 5; ++i) {
    if (ptrs[i] != nullptr && reinterpret_cast<uintptr_t>(ptrs[i]) % elem != 0)
      return LibraryError(std::string("conv2d: ") + names[i] + " is not aligned to its element size");
  }
  return Status::Ok();
}

// A call whose workspace bound exceeds its stream's handle's: refused at plan time
// (`what`: "conv2d" or "conv2d backward").
template <class Handle>
inline Status check_workspace(const Handle& h, const ConvDesc& d, const char* what) {
  if (d.workspace > 0 && h.workspace_bytes < static_cast<size_t>(d.workspace)) {
    return InvalidArgument(std::string(what) + ": the call may use " + std::to_string(d.workspace) +
                           " bytes of workspace but its stream's handle has " +
                           std::to_string(h.workspace_bytes));
  }
  return Status::Ok();
}

inline float load_as_float(const void* p, DataType t, int64_t i) {
  switch (t) {
    case DataType::kF16:
      return static_cast<float>(static_cast<const f16*>(p)[i]);
    case DataType::kBF16:
      return static_cast<float>(static_cast<const bf16*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

}  // namespace detail

// The fallback's epilogue over an N x K x inner output: y = act(y + bias[k] + z), in float.
template <class T>
__global__ void conv_epilogue(T* __restrict__ y, const T* __restrict__ bias, const T* __restrict__ z,
                              int64_t total, int64_t inner, int64_t channels, int relu) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    float v = static_cast<float>(y[i]);
    if (bias != nullptr) v += static_cast<float>(bias[(i / inner) % channels]);
    if (z != nullptr) v += static_cast<float>(z[i]);
    if (relu && !(v >= 0.0f) && v == v) v = 0.0f;  // NaN stays NaN, as ONNX Relu's
    y[i] = static_cast<T>(v);
  }
}

template <class T>
inline void launch_epilogue(const ConvDesc& d, void* y, const void* bias, const void* z,
                            cudaStream_t stream) {
  const int64_t total = d.n * d.k * d.out_h() * d.out_w();
  const int64_t blocks = (total + 255) / 256 < (1 << 20) ? (total + 255) / 256 : (1 << 20);
  FLOWC_LAUNCH(conv_epilogue<T>, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, stream,
               static_cast<T*>(y), d.has_bias ? static_cast<const T*>(bias) : nullptr,
               d.has_residual ? static_cast<const T*>(z) : nullptr, total, d.out_h() * d.out_w(), d.k,
               d.relu ? 1 : 0);
}

inline void run_epilogue(const ConvDesc& d, void* y, const void* bias, const void* z, cudaStream_t stream) {
  switch (d.type) {
    case DataType::kF16:
      launch_epilogue<f16>(d, y, bias, z, stream);
      break;
    case DataType::kBF16:
      launch_epilogue<bf16>(d, y, bias, z, stream);
      break;
    default:
      launch_epilogue<float>(d, y, bias, z, stream);
      break;
  }
}

#if defined(FLOWC_HOST)

// What cuDNN's handle holds that the emulator checks: the workspace size it was given (the
// host needs none), whether a call has run yet (sim::library_call), and the stream its last
// call ran on (cudnnSetStream), which must outlive the handle.
struct ConvHandle {
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  bool warm = false;
  cudaStream_t stream = nullptr;
};

inline Status create_conv(ConvHandle* h, void* workspace = nullptr, size_t workspace_bytes = 0) {
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
    return InvalidArgument("create_conv: the workspace must be 256-byte aligned");
  *h = ConvHandle{workspace, workspace_bytes, false, nullptr};
  return Status::Ok();
}

// cudnnDestroy with the handle's stream destroyed before it: the GPU's handle would still
// point at the freed stream. A program destroys its handles first.
inline void destroy_conv(ConvHandle* h) {
  if (!sim::stream_alive(h->stream)) {
    sim::fatal(
        "cudnnDestroy: the handle's stream (its last cudnnSetStream) was destroyed before the handle; "
        "destroy cuDNN handles before their streams");
  }
  *h = ConvHandle{};
}

// Points the handle at the legacy stream (cudnnSetStream(handle, 0)): before destroying it when
// its last stream was the caller's, which the caller may have destroyed already.
inline void release_conv_stream(ConvHandle* h) { h->stream = nullptr; }

struct ConvPlan {
  ConvDesc d;
  ConvHandle* handle = nullptr;
  bool fused = false;  // the epilogue runs in the convolution's own call (one library call)
  // The algorithm the GPU plan runs: the fused identity call's forced IMPLICIT_PRECOMP_GEMM,
  // else the plain convolution's choice (`plain_algo`; kImplicitGemm stands for the heuristic's
  // choice here, the host has none).
  ConvAlgo algo = ConvAlgo::kImplicitGemm;
  ConvAlgo plain_algo = ConvAlgo::kImplicitGemm;
};

inline Status plan_conv(ConvHandle& h, const ConvDesc& d, ConvPlan* p) {
  if (Status s = validate(d); !s.ok()) return s;
  if (Status s = detail::check_workspace(h, d, "conv2d"); !s.ok()) return s;
  p->d = d;
  p->handle = &h;
  // cuDNN's fused call needs a bias; its identity activation runs only with
  // IMPLICIT_PRECOMP_GEMM, which the plan then forces.
  p->fused = d.epilogue() && d.has_bias && !detail::env_flag("FLOWC_CONV_UNFUSED");
  p->plain_algo = ConvAlgo::kImplicitGemm;
  p->algo = p->fused && !d.relu ? ConvAlgo::kImplicitPrecompGemm : p->plain_algo;
  return Status::Ok();
}

inline void destroy_plan(ConvPlan* p) { *p = ConvPlan{}; }

// Lowers one image and one group to columns: [(c/g)*r*s] x [oh*ow].
inline void im2col(const ConvDesc& d, const float* x, int64_t group, float* col) {
  const int64_t cg = d.c / d.groups, oh = d.out_h(), ow = d.out_w();
  for (int64_t ci = 0; ci < cg; ++ci) {
    const float* plane = x + (group * cg + ci) * d.h * d.w;
    for (int64_t i = 0; i < d.r; ++i) {
      for (int64_t j = 0; j < d.s; ++j) {
        float* row = col + ((ci * d.r + i) * d.s + j) * oh * ow;
        for (int64_t y = 0; y < oh; ++y) {
          const int64_t iy = y * d.stride_h - d.pad_h + i * d.dil_h;
          for (int64_t xo = 0; xo < ow; ++xo) {
            const int64_t ix = xo * d.stride_w - d.pad_w + j * d.dil_w;
            row[y * ow + xo] = (iy >= 0 && iy < d.h && ix >= 0 && ix < d.w) ? plane[iy * d.w + ix] : 0.0f;
          }
        }
      }
    }
  }
}

// The float convolution of float x and w into Y.
inline void conv_float(const ConvDesc& desc, const float* X, const float* W, float* Y) {
  const int64_t cg = desc.c / desc.groups, kg = desc.k / desc.groups;
  const int64_t rows = cg * desc.r * desc.s, cols = desc.out_h() * desc.out_w();
  std::vector<float> col(static_cast<size_t>(rows * cols));
  for (int64_t img = 0; img < desc.n; ++img) {
    for (int64_t g = 0; g < desc.groups; ++g) {
      im2col(desc, X + img * desc.c * desc.h * desc.w, g, col.data());
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(kg), static_cast<int>(cols),
                  static_cast<int>(rows), 1.0f, W + g * kg * rows, static_cast<int>(rows), col.data(),
                  static_cast<int>(cols), 0.0f, Y + (img * desc.k + g * kg) * cols, static_cast<int>(cols));
    }
  }
}

inline std::vector<float> widened(const void* p, DataType t, int64_t count) {
  std::vector<float> out(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) out[static_cast<size_t>(i)] = detail::load_as_float(p, t, i);
  return out;
}

// The plan's call, emulated as the GPU does it: the convolution in float, then (fused) bias,
// residual and activation in float and one rounding to the storage type, all in one host
// callback (one library call); unfused, the callback stores the rounded convolution and
// conv_epilogue runs as a kernel after it.
inline Status run_conv(ConvPlan& p, const void* x, const void* w, const void* bias, const void* z, void* y,
                       cudaStream_t stream) {
  if (p.handle == nullptr) return InvalidArgument("conv2d: the plan was not made");
  if (Status s = detail::check_conv_pointers(p.d, x, w, bias, z, y); !s.ok()) return s;
  p.handle->stream = stream;  // cudnnSetStream
  if (p.fused && !p.d.relu && p.algo != ConvAlgo::kImplicitPrecompGemm) {
    return LibraryError(
        "cudnnConvolutionBiasActivationForward: CUDNN_STATUS_NOT_SUPPORTED (the identity activation runs "
        "only with IMPLICIT_PRECOMP_GEMM)");
  }
  if (p.fused && detail::env_flag("FLOWC_SIM_REFUSE_FUSED_CONV")) {
    // The emulated cuDNN has no kernel for the fused call (what cuDNN answers for a
    // configuration it lacks one for): the fallback from now on, as on the GPU, with the
    // plain convolution's own algorithm.
    p.fused = false;
    p.algo = p.plain_algo;
  }
  const ConvDesc desc = p.d;
  const bool fused = p.fused;
  const bool propagate_nan = kConvReluPropagatesNan;
  cudaError_t e = sim::library_call(stream, &p.handle->warm, [desc, fused, propagate_nan, x, w, bias, z, y] {
    const int64_t in = desc.n * desc.c * desc.h * desc.w,
                  wn = desc.k * (desc.c / desc.groups) * desc.r * desc.s;
    const int64_t inner = desc.out_h() * desc.out_w(), total = desc.n * desc.k * inner;
    const bool narrow = desc.type != DataType::kF32;
    std::vector<float> xf, wf, yf;
    const float* X = static_cast<const float*>(x);
    const float* W = static_cast<const float*>(w);
    float* Y = static_cast<float*>(y);
    if (narrow) {
      xf = widened(x, desc.type, in);
      wf = widened(w, desc.type, wn);
      yf.resize(static_cast<size_t>(total));
      X = xf.data();
      W = wf.data();
      Y = yf.data();
    }
    conv_float(desc, X, W, Y);
    if (fused) {
      for (int64_t i = 0; i < total; ++i) {
        float v = Y[i];
        if (desc.has_bias) v += detail::load_as_float(bias, desc.type, (i / inner) % desc.k);
        if (desc.has_residual) v += detail::load_as_float(z, desc.type, i);
        if (desc.relu && !(v >= 0.0f) && (v == v || !propagate_nan)) v = 0.0f;
        Y[i] = v;
      }
    }
    if (desc.type == DataType::kF16) {
      for (int64_t i = 0; i < total; ++i) static_cast<f16*>(y)[i] = f16(Y[i]);
    } else if (desc.type == DataType::kBF16) {
      for (int64_t i = 0; i < total; ++i) static_cast<bf16*>(y)[i] = bf16(Y[i]);
    }
  });
  if (e != cudaSuccess) return LibraryError(std::string("conv2d: ") + cudaGetErrorString(e));
  if (!fused && desc.epilogue()) run_epilogue(desc, y, bias, z, stream);
  return Status::Ok();
}

#else

struct ConvHandle {
  cudnnHandle_t cudnn = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// `workspace`: the caller's device memory for cuDNN's scratch (the stream's planned arena
// buffer, shared with its cuBLASLt handle: one stream runs one library call at a time).
inline Status create_conv(ConvHandle* h, void* workspace = nullptr, size_t workspace_bytes = 0) {
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
    return InvalidArgument("create_conv: the workspace must be 256-byte aligned");
  if (cudnnCreate(&h->cudnn) != CUDNN_STATUS_SUCCESS) return LibraryError("cudnnCreate failed");
  h->workspace = workspace;
  h->workspace_bytes = workspace ? workspace_bytes : 0;
  return Status::Ok();
}

inline void destroy_conv(ConvHandle* h) {
  if (h->cudnn) cudnnDestroy(h->cudnn);
  *h = ConvHandle{};
}

// Points the handle at the legacy stream: before destroying it when its last stream was the
// caller's, which the caller may have destroyed already.
inline void release_conv_stream(ConvHandle* h) {
  if (h->cudnn) cudnnSetStream(h->cudnn, nullptr);
}

struct ConvPlan {
  ConvDesc d;
  cudnnHandle_t cudnn = nullptr;  // the stream's handle and workspace (not owned)
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  cudnnTensorDescriptor_t x = nullptr, y = nullptr, bias = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  cudnnActivationDescriptor_t act = nullptr;
  cudnnConvolutionFwdAlgo_t algo = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;
  // The plain convolution's own choice: what the fallback runs (the fused identity call
  // forces IMPLICIT_PRECOMP_GEMM into `algo`).
  cudnnConvolutionFwdAlgo_t plain_algo = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;
  bool fused = false;  // the epilogue runs in cudnnConvolutionBiasActivationForward
};

inline void destroy_plan(ConvPlan* p) {
  if (p->act) cudnnDestroyActivationDescriptor(p->act);
  if (p->conv) cudnnDestroyConvolutionDescriptor(p->conv);
  if (p->w) cudnnDestroyFilterDescriptor(p->w);
  if (p->bias) cudnnDestroyTensorDescriptor(p->bias);
  if (p->y) cudnnDestroyTensorDescriptor(p->y);
  if (p->x) cudnnDestroyTensorDescriptor(p->x);
  *p = ConvPlan{};
}

inline cudnnDataType_t cudnn_type(DataType t) {
  return t == DataType::kF16 ? CUDNN_DATA_HALF
                             : (t == DataType::kBF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT);
}

inline ConvAlgo conv_algo(cudnnConvolutionFwdAlgo_t a) {
  switch (a) {
    case CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM:
      return ConvAlgo::kImplicitPrecompGemm;
    case CUDNN_CONVOLUTION_FWD_ALGO_GEMM:
      return ConvAlgo::kGemm;
    case CUDNN_CONVOLUTION_FWD_ALGO_DIRECT:
      return ConvAlgo::kDirect;
    case CUDNN_CONVOLUTION_FWD_ALGO_FFT:
      return ConvAlgo::kFft;
    case CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING:
      return ConvAlgo::kFftTiling;
    case CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD:
      return ConvAlgo::kWinograd;
    case CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED:
      return ConvAlgo::kWinogradNonfused;
    default:
      return ConvAlgo::kImplicitGemm;
  }
}

// The algorithm (heuristic or timed) that fits the workspace; `tensor_ok`: whether it may use
// tensor cores (everything but exact fp32).
inline Status choose_algorithm(ConvPlan* p, bool tensor_ok) {
  cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
  int found = 0;
  const bool tune = detail::env_flag("FLOWC_TUNE");
  const cudnnStatus_t st =
      tune ? cudnnFindConvolutionForwardAlgorithm(p->cudnn, p->x, p->w, p->conv, p->y,
                                                  CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &found, perf)
           : cudnnGetConvolutionForwardAlgorithm_v7(p->cudnn, p->x, p->w, p->conv, p->y,
                                                    CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &found, perf);
  if (st != CUDNN_STATUS_SUCCESS) {
    return LibraryError(std::string(tune ? "cudnnFindConvolutionForwardAlgorithm: "
                                         : "cudnnGetConvolutionForwardAlgorithm_v7: ") +
                        cudnnGetErrorString(st));
  }
  for (int a = 0; a < found; ++a) {
    const bool tensor =
        perf[a].mathType == CUDNN_TENSOR_OP_MATH || perf[a].mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION;
    if (perf[a].status != CUDNN_STATUS_SUCCESS || perf[a].memory > p->workspace_bytes) continue;
    if (tensor && !tensor_ok) continue;
    if (!conv_algorithm_allowed(p->d, conv_algo(perf[a].algo))) continue;
    p->algo = perf[a].algo;
    return Status::Ok();
  }
  return NotSupported("conv2d: no cuDNN algorithm fits the workspace (" + std::to_string(p->workspace_bytes) +
                      " bytes)");
}

// Whether a call may use tensor cores: everything but exact float32.
inline bool conv_tensor_ok(const ConvDesc& d) {
  return d.type != DataType::kF32 || d.math == ConvMath::kTF32;
}

// The call's workspace bound, not the whole stream's: algorithms are chosen within it.
inline size_t call_workspace(const ConvHandle& h, const ConvDesc& d) {
  return d.workspace >= 0 && static_cast<size_t>(d.workspace) < h.workspace_bytes
             ? static_cast<size_t>(d.workspace)
             : h.workspace_bytes;
}

// Creates and sets the descriptors of x, w, the convolution and y for `d` (forward and
// backward plans alike); false if cuDNN rejects one (the caller destroys what was made).
inline bool make_conv_descriptors(const ConvDesc& d, cudnnTensorDescriptor_t* x, cudnnFilterDescriptor_t* w,
                                  cudnnConvolutionDescriptor_t* conv, cudnnTensorDescriptor_t* y) {
  const cudnnDataType_t t = cudnn_type(d.type);
  const auto i = [](int64_t v) { return static_cast<int>(v); };
  bool ok = cudnnCreateTensorDescriptor(x) == CUDNN_STATUS_SUCCESS &&
            cudnnCreateTensorDescriptor(y) == CUDNN_STATUS_SUCCESS &&
            cudnnCreateFilterDescriptor(w) == CUDNN_STATUS_SUCCESS &&
            cudnnCreateConvolutionDescriptor(conv) == CUDNN_STATUS_SUCCESS;
  ok = ok && cudnnSetTensor4dDescriptor(*x, CUDNN_TENSOR_NCHW, t, i(d.n), i(d.c), i(d.h), i(d.w)) ==
                 CUDNN_STATUS_SUCCESS;
  ok = ok && cudnnSetFilter4dDescriptor(*w, t, CUDNN_TENSOR_NCHW, i(d.k), i(d.c / d.groups), i(d.r),
                                        i(d.s)) == CUDNN_STATUS_SUCCESS;
  // Float32 accumulation whatever the storage type (cuDNN's PSEUDO_HALF / PSEUDO_BFLOAT16).
  ok = ok && cudnnSetConvolution2dDescriptor(*conv, i(d.pad_h), i(d.pad_w), i(d.stride_h), i(d.stride_w),
                                             i(d.dil_h), i(d.dil_w), CUDNN_CROSS_CORRELATION,
                                             CUDNN_DATA_FLOAT) == CUDNN_STATUS_SUCCESS;
  ok = ok && cudnnSetConvolutionGroupCount(*conv, i(d.groups)) == CUDNN_STATUS_SUCCESS;
  ok = ok && cudnnSetTensor4dDescriptor(*y, CUDNN_TENSOR_NCHW, t, i(d.n), i(d.k), i(d.out_h()),
                                        i(d.out_w())) == CUDNN_STATUS_SUCCESS;
  // Exact fp32 must say so: cuDNN's default math lets float32 convolutions use TF32.
  return ok && cudnnSetConvolutionMathType(
                   *conv, conv_tensor_ok(d) ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH) == CUDNN_STATUS_SUCCESS;
}

inline Status plan_conv(ConvHandle& h, const ConvDesc& d, ConvPlan* p) {
  if (Status s = validate(d); !s.ok()) return s;
  destroy_plan(p);
  if (Status s = detail::check_workspace(h, d, "conv2d"); !s.ok()) return s;
  p->d = d;
  p->cudnn = h.cudnn;
  p->workspace = h.workspace;
  p->workspace_bytes = call_workspace(h, d);
  const cudnnDataType_t t = cudnn_type(d.type);
  bool ok = make_conv_descriptors(d, &p->x, &p->w, &p->conv, &p->y);
  ok = ok && cudnnCreateTensorDescriptor(&p->bias) == CUDNN_STATUS_SUCCESS &&
       cudnnCreateActivationDescriptor(&p->act) == CUDNN_STATUS_SUCCESS;
  ok = ok && cudnnSetTensor4dDescriptor(p->bias, CUDNN_TENSOR_NCHW, t, 1, static_cast<int>(d.k), 1, 1) ==
                 CUDNN_STATUS_SUCCESS;
  ok = ok &&
       cudnnSetActivationDescriptor(p->act, d.relu ? CUDNN_ACTIVATION_RELU : CUDNN_ACTIVATION_IDENTITY,
                                    kConvReluPropagatesNan ? CUDNN_PROPAGATE_NAN : CUDNN_NOT_PROPAGATE_NAN,
                                    0.0) == CUDNN_STATUS_SUCCESS;
  const bool tensor_ok = conv_tensor_ok(d);
  if (!ok) {
    destroy_plan(p);
    return LibraryError("conv2d: cuDNN rejected a descriptor");
  }
  p->fused = d.epilogue() && d.has_bias && !detail::env_flag("FLOWC_CONV_UNFUSED");
  // The plain convolution's algorithm, always: the fallback's, should the fused call be refused.
  Status s = choose_algorithm(p, tensor_ok);
  if (!s.ok()) {
    destroy_plan(p);
    return s;
  }
  p->plain_algo = p->algo;
  if (p->fused && !d.relu) {
    // cuDNN's fused call runs the identity activation only with IMPLICIT_PRECOMP_GEMM.
    size_t bytes = 0;
    if (cudnnGetConvolutionForwardWorkspaceSize(p->cudnn, p->x, p->w, p->conv, p->y,
                                                CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
                                                &bytes) == CUDNN_STATUS_SUCCESS &&
        bytes <= p->workspace_bytes) {
      p->algo = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;
    } else {
      p->fused = false;
    }
  }
  return Status::Ok();
}

inline Status run_conv(ConvPlan& p, const void* x, const void* w, const void* bias, const void* z, void* y,
                       cudaStream_t stream) {
  if (p.conv == nullptr) return InvalidArgument("conv2d: the plan was not made");
  if (Status s = detail::check_conv_pointers(p.d, x, w, bias, z, y); !s.ok()) return s;
  if (cudnnSetStream(p.cudnn, stream) != CUDNN_STATUS_SUCCESS)
    return LibraryError("conv2d: cudnnSetStream failed");
  const float one = 1.0f, zero = 0.0f;
  if (p.fused) {
    // Without a residual z is y with scale 0: cuDNN does not read a source whose scale is 0.
    const float alpha2 = p.d.has_residual ? 1.0f : 0.0f;
    const cudnnStatus_t st = cudnnConvolutionBiasActivationForward(
        p.cudnn, &one, p.x, x, p.w, w, p.conv, p.algo, p.workspace, p.workspace_bytes, &alpha2, p.y,
        p.d.has_residual ? z : y, p.bias, bias, p.act, p.y, y);
    if (st == CUDNN_STATUS_SUCCESS) return Status::Ok();
    if (CUDNN_STATUS_CATEGORY(st) != CUDNN_STATUS_NOT_SUPPORTED)
      return LibraryError(std::string("cudnnConvolutionBiasActivationForward: ") + cudnnGetErrorString(st));
    // The fallback from now on (plan_path says so), with the plain convolution's own
    // algorithm rather than the one forced for the fused identity call.
    p.fused = false;
    p.algo = p.plain_algo;
  }
  const cudnnStatus_t st = cudnnConvolutionForward(p.cudnn, &one, p.x, x, p.w, w, p.conv, p.algo, p.workspace,
                                                   p.workspace_bytes, &zero, p.y, y);
  if (st != CUDNN_STATUS_SUCCESS)
    return LibraryError(std::string("cudnnConvolutionForward: ") + cudnnGetErrorString(st));
  if (p.d.epilogue()) run_epilogue(p.d, y, bias, z, stream);
  return Status::Ok();
}

#endif

#if defined(FLOWC_HOST)
inline ConvAlgo plan_algorithm(const ConvPlan& p) { return p.algo; }
inline ConvAlgo plan_fallback_algorithm(const ConvPlan& p) { return p.plain_algo; }
#else
inline ConvAlgo plan_algorithm(const ConvPlan& p) { return conv_algo(p.algo); }
inline ConvAlgo plan_fallback_algorithm(const ConvPlan& p) { return conv_algo(p.plain_algo); }
#endif

// Which path a plan runs: one fused library call, or the fallback.
inline const char* plan_path(const ConvPlan& p) {
  return !p.d.epilogue() ? "conv" : (p.fused ? "fused" : "conv+epilogue");
}

// A convolution of a batch whose size is known only at run time (a program with symbolic dims,
// docs/dynamic.md): `plans[k]` is made for `sizes[k]` images (ascending: the powers of two up to
// the bound, and the bound). The first `n` images run as few calls as the sizes allow, the
// largest plan that fits the images left first: a planned size is one call. `x_image` and
// `y_image` are the bytes of one image of x and of y (z's are y's).
inline Status run_conv_batches(std::initializer_list<ConvPlan*> plans, std::initializer_list<int64_t> sizes,
                               int64_t n, int64_t x_image, int64_t y_image, const void* x, const void* w,
                               const void* bias, const void* z, void* y, cudaStream_t stream) {
  if (plans.size() != sizes.size() || plans.size() == 0)
    return InvalidArgument("conv2d: no plans for the batch");
  const auto* xb = static_cast<const unsigned char*>(x);
  const auto* zb = static_cast<const unsigned char*>(z);
  auto* yb = static_cast<unsigned char*>(y);
  int64_t done = 0;
  while (done < n) {
    const int64_t left = n - done;
    int k = static_cast<int>(sizes.size()) - 1;
    while (k > 0 && sizes.begin()[k] > left) --k;
    const int64_t take = sizes.begin()[k];
    if (take > left) return InvalidArgument("conv2d: no plan fits the batch's last images");
    ConvPlan& p = *plans.begin()[k];
    Status s = run_conv(p, xb + done * x_image, w, bias, zb == nullptr ? nullptr : zb + done * y_image,
                        yb + done * y_image, stream);
    if (!s.ok()) return s;
    done += take;
  }
  return Status::Ok();
}

// One call without a plan kept (tests, one-off use): plan, run, destroy.
inline Status conv2d_forward(ConvHandle& h, const ConvDesc& d, const void* x, const void* w, void* y,
                             cudaStream_t stream, const void* bias = nullptr, const void* z = nullptr) {
  ConvPlan p;
  Status s = plan_conv(h, d, &p);
  if (s.ok()) s = run_conv(p, x, w, bias, z, y, stream);
  destroy_plan(&p);
  return s;
}

// -- the backward: data and filter gradients (training) --------------------------------------
//
// A ConvBwdPlan computes one of a forward convolution's gradients, for the ConvDesc of that
// forward (no epilogue): the data's, dx = conv^T(dy, w) (cudnnConvolutionBackwardData), or
// the filter's, dw = sum over the batch of dy (x) x's windows (cudnnConvolutionBackwardFilter).
// Training must be reproducible, so only cuDNN's deterministic algorithms are taken (the
// heuristic's or FLOWC_TUNE's list, filtered by CUDNN_DETERMINISTIC and the workspace bound);
// exact float32 leaves out the transform algorithms as the forward does. The host computes
// the same sums with GEMMs over im2col's columns (col2im adds the data's back), in float,
// rounding narrow results once.

enum class ConvGrad { kData, kFilter };

#if defined(FLOWC_HOST)

struct ConvBwdPlan {
  ConvDesc d;
  ConvGrad which = ConvGrad::kData;
  ConvHandle* handle = nullptr;
};

inline Status plan_conv_backward(ConvHandle& h, const ConvDesc& d, ConvGrad which, ConvBwdPlan* p) {
  if (Status s = validate(d); !s.ok()) return s;
  if (d.epilogue()) return InvalidArgument("conv2d backward: a gradient has no epilogue");
  if (Status s = detail::check_workspace(h, d, "conv2d backward"); !s.ok()) return s;
  p->d = d;
  p->which = which;
  p->handle = &h;
  return Status::Ok();
}

inline void destroy_plan(ConvBwdPlan* p) { *p = ConvBwdPlan{}; }

// Adds one image's and one group's columns ([(c/g)*r*s] x [oh*ow]) back onto its input
// planes: im2col's adjoint.
inline void col2im_add(const ConvDesc& d, const float* col, int64_t group, float* x) {
  const int64_t cg = d.c / d.groups, oh = d.out_h(), ow = d.out_w();
  for (int64_t ci = 0; ci < cg; ++ci) {
    float* plane = x + (group * cg + ci) * d.h * d.w;
    for (int64_t i = 0; i < d.r; ++i) {
      for (int64_t j = 0; j < d.s; ++j) {
        const float* row = col + ((ci * d.r + i) * d.s + j) * oh * ow;
        for (int64_t y = 0; y < oh; ++y) {
          const int64_t iy = y * d.stride_h - d.pad_h + i * d.dil_h;
          if (iy < 0 || iy >= d.h) continue;
          for (int64_t xo = 0; xo < ow; ++xo) {
            const int64_t ix = xo * d.stride_w - d.pad_w + j * d.dil_w;
            if (ix >= 0 && ix < d.w) plane[iy * d.w + ix] += row[y * ow + xo];
          }
        }
      }
    }
  }
}

// dx from dy and w (float): per image and group, W_g^T dY_g into columns, then col2im.
inline void conv_backward_data_float(const ConvDesc& d, const float* W, const float* DY, float* DX) {
  const int64_t cg = d.c / d.groups, kg = d.k / d.groups;
  const int64_t rows = cg * d.r * d.s, cols = d.out_h() * d.out_w();
  std::vector<float> col(static_cast<size_t>(rows * cols));
  std::fill(DX, DX + d.n * d.c * d.h * d.w, 0.0f);
  for (int64_t img = 0; img < d.n; ++img) {
    for (int64_t g = 0; g < d.groups; ++g) {
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(rows), static_cast<int>(cols),
                  static_cast<int>(kg), 1.0f, W + g * kg * rows, static_cast<int>(rows),
                  DY + (img * d.k + g * kg) * cols, static_cast<int>(cols), 0.0f, col.data(),
                  static_cast<int>(cols));
      col2im_add(d, col.data(), g, DX + img * d.c * d.h * d.w);
    }
  }
}

// dw from x and dy (float): per group, the sum over images of dY_g im2col(x)^T.
inline void conv_backward_filter_float(const ConvDesc& d, const float* X, const float* DY, float* DW) {
  const int64_t cg = d.c / d.groups, kg = d.k / d.groups;
  const int64_t rows = cg * d.r * d.s, cols = d.out_h() * d.out_w();
  std::vector<float> col(static_cast<size_t>(rows * cols));
  std::fill(DW, DW + d.k * rows, 0.0f);
  for (int64_t img = 0; img < d.n; ++img) {
    for (int64_t g = 0; g < d.groups; ++g) {
      im2col(d, X + img * d.c * d.h * d.w, g, col.data());
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(kg), static_cast<int>(rows),
                  static_cast<int>(cols), 1.0f, DY + (img * d.k + g * kg) * cols, static_cast<int>(cols),
                  col.data(), static_cast<int>(cols), 1.0f, DW + g * kg * rows, static_cast<int>(rows));
    }
  }
}

// `a` is w (data) or x (filter), `dy` the output's gradient, `out` dx or dw.
inline Status run_conv_backward(ConvBwdPlan& p, const void* a, const void* dy, void* out,
                                cudaStream_t stream) {
  if (p.handle == nullptr) return InvalidArgument("conv2d backward: the plan was not made");
  const ConvDesc d = p.d;
  const uintptr_t elem = element_size(d.type);
  const void* ptrs[3] = {a, dy, out};
  for (const void* q : ptrs) {
    if (q == nullptr || reinterpret_cast<uintptr_t>(q) % elem != 0)
      return LibraryError("conv2d backward: a tensor is null or not aligned to its element size");
  }
  p.handle->stream = stream;  // cudnnSetStream
  const ConvGrad which = p.which;
  cudaError_t e = sim::library_call(stream, &p.handle->warm, [d, which, a, dy, out] {
    const int64_t xn = d.n * d.c * d.h * d.w, wn = d.k * (d.c / d.groups) * d.r * d.s;
    const int64_t yn = d.n * d.k * d.out_h() * d.out_w();
    const int64_t an = which == ConvGrad::kData ? wn : xn, on = which == ConvGrad::kData ? xn : wn;
    const bool narrow = d.type != DataType::kF32;
    std::vector<float> af, yf, of;
    const float* A = static_cast<const float*>(a);
    const float* DY = static_cast<const float*>(dy);
    float* O = static_cast<float*>(out);
    if (narrow) {
      af = widened(a, d.type, an);
      yf = widened(dy, d.type, yn);
      of.resize(static_cast<size_t>(on));
      A = af.data();
      DY = yf.data();
      O = of.data();
    }
    if (which == ConvGrad::kData) {
      conv_backward_data_float(d, A, DY, O);
    } else {
      conv_backward_filter_float(d, A, DY, O);
    }
    if (d.type == DataType::kF16) {
      for (int64_t i = 0; i < on; ++i) static_cast<f16*>(out)[i] = f16(O[i]);
    } else if (d.type == DataType::kBF16) {
      for (int64_t i = 0; i < on; ++i) static_cast<bf16*>(out)[i] = bf16(O[i]);
    }
  });
  if (e != cudaSuccess) return LibraryError(std::string("conv2d backward: ") + cudaGetErrorString(e));
  return Status::Ok();
}

#else

struct ConvBwdPlan {
  ConvDesc d;
  ConvGrad which = ConvGrad::kData;
  cudnnHandle_t cudnn = nullptr;  // the stream's handle and workspace (not owned)
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  cudnnConvolutionBwdDataAlgo_t data_algo = CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
  cudnnConvolutionBwdFilterAlgo_t filter_algo = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1;
};

inline void destroy_plan(ConvBwdPlan* p) {
  if (p->conv) cudnnDestroyConvolutionDescriptor(p->conv);
  if (p->w) cudnnDestroyFilterDescriptor(p->w);
  if (p->y) cudnnDestroyTensorDescriptor(p->y);
  if (p->x) cudnnDestroyTensorDescriptor(p->x);
  *p = ConvBwdPlan{};
}

// Whether a backward algorithm is a transform one (excluded from exact float32).
inline bool conv_bwd_transform(cudnnConvolutionBwdDataAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT || a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD ||
         a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED;
}
inline bool conv_bwd_transform(cudnnConvolutionBwdFilterAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT || a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED;
}

// The first of cuDNN's ranked algorithms that is deterministic, fits the workspace, keeps
// tensor cores out of exact float32 and transforms out of it too.
template <class Perf>
inline bool pick_backward(const Perf* perf, int found, const ConvBwdPlan& p, bool tensor_ok, int* chosen) {
  const bool exact = p.d.type == DataType::kF32 && p.d.math == ConvMath::kExact;
  for (int a = 0; a < found; ++a) {
    const bool tensor =
        perf[a].mathType == CUDNN_TENSOR_OP_MATH || perf[a].mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION;
    if (perf[a].status != CUDNN_STATUS_SUCCESS || perf[a].memory > p.workspace_bytes) continue;
    if (perf[a].determinism != CUDNN_DETERMINISTIC) continue;
    if ((tensor && !tensor_ok) || (exact && conv_bwd_transform(perf[a].algo))) continue;
    *chosen = static_cast<int>(perf[a].algo);
    return true;
  }
  return false;
}

inline Status plan_conv_backward(ConvHandle& h, const ConvDesc& d, ConvGrad which, ConvBwdPlan* p) {
  if (Status s = validate(d); !s.ok()) return s;
  if (d.epilogue()) return InvalidArgument("conv2d backward: a gradient has no epilogue");
  destroy_plan(p);
  if (Status s = detail::check_workspace(h, d, "conv2d backward"); !s.ok()) return s;
  p->d = d;
  p->which = which;
  p->cudnn = h.cudnn;
  p->workspace = h.workspace;
  p->workspace_bytes = call_workspace(h, d);
  const bool ok = make_conv_descriptors(d, &p->x, &p->w, &p->conv, &p->y);
  const bool tensor_ok = conv_tensor_ok(d);
  if (!ok) {
    destroy_plan(p);
    return LibraryError("conv2d backward: cuDNN rejected a descriptor");
  }
  const bool tune = detail::env_flag("FLOWC_TUNE");
  int found = 0, chosen = -1;
  cudnnStatus_t st;
  if (which == ConvGrad::kData) {
    cudnnConvolutionBwdDataAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT];
    st = tune ? cudnnFindConvolutionBackwardDataAlgorithm(p->cudnn, p->w, p->y, p->conv, p->x,
                                                          CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &found, perf)
              : cudnnGetConvolutionBackwardDataAlgorithm_v7(
                    p->cudnn, p->w, p->y, p->conv, p->x, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &found, perf);
    if (st == CUDNN_STATUS_SUCCESS && pick_backward(perf, found, *p, tensor_ok, &chosen))
      p->data_algo = static_cast<cudnnConvolutionBwdDataAlgo_t>(chosen);
  } else {
    cudnnConvolutionBwdFilterAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
    st =
        tune
            ? cudnnFindConvolutionBackwardFilterAlgorithm(
                  p->cudnn, p->x, p->y, p->conv, p->w, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &found, perf)
            : cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                  p->cudnn, p->x, p->y, p->conv, p->w, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &found, perf);
    if (st == CUDNN_STATUS_SUCCESS && pick_backward(perf, found, *p, tensor_ok, &chosen))
      p->filter_algo = static_cast<cudnnConvolutionBwdFilterAlgo_t>(chosen);
  }
  if (st != CUDNN_STATUS_SUCCESS) {
    destroy_plan(p);
    return LibraryError(std::string("conv2d backward: choosing an algorithm: ") + cudnnGetErrorString(st));
  }
  if (chosen < 0) {
    destroy_plan(p);
    return NotSupported("conv2d backward: no deterministic cuDNN algorithm fits the workspace (" +
                        std::to_string(p->workspace_bytes) + " bytes)");
  }
  return Status::Ok();
}

inline Status run_conv_backward(ConvBwdPlan& p, const void* a, const void* dy, void* out,
                                cudaStream_t stream) {
  if (p.conv == nullptr) return InvalidArgument("conv2d backward: the plan was not made");
  if (cudnnSetStream(p.cudnn, stream) != CUDNN_STATUS_SUCCESS)
    return LibraryError("conv2d backward: cudnnSetStream failed");
  const float one = 1.0f, zero = 0.0f;
  const cudnnStatus_t st =
      p.which == ConvGrad::kData
          ? cudnnConvolutionBackwardData(p.cudnn, &one, p.w, a, p.y, dy, p.conv, p.data_algo, p.workspace,
                                         p.workspace_bytes, &zero, p.x, out)
          : cudnnConvolutionBackwardFilter(p.cudnn, &one, p.x, a, p.y, dy, p.conv, p.filter_algo, p.workspace,
                                           p.workspace_bytes, &zero, p.w, out);
  if (st != CUDNN_STATUS_SUCCESS) {
    return LibraryError(std::string(p.which == ConvGrad::kData ? "cudnnConvolutionBackwardData: "
                                                               : "cudnnConvolutionBackwardFilter: ") +
                        cudnnGetErrorString(st));
  }
  return Status::Ok();
}

#endif

}  // namespace flowc
