// 2-D convolution forward, NCHW, through one descriptor: cuDNN on the GPU, im2col + CBLAS
// GEMM on the host. Weights are [k, c / groups, r, s]; padding is symmetric per axis (an
// asymmetric pad is an explicit Pad before the convolution).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flowc/gemm.h"

#if !defined(FLOWC_HOST)
#include <cudnn.h>
#endif

namespace flowc {

struct ConvDesc {
  int64_t n = 1, c = 0, h = 0, w = 0;  // input
  int64_t k = 0, r = 0, s = 0;         // output channels, kernel height and width
  int64_t groups = 1;
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_h = 0, pad_w = 0;
  int64_t dil_h = 1, dil_w = 1;
  DataType type = DataType::kF32;

  int64_t out_h() const { return (h + 2 * pad_h - dil_h * (r - 1) - 1) / stride_h + 1; }
  int64_t out_w() const { return (w + 2 * pad_w - dil_w * (s - 1) - 1) / stride_w + 1; }
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

#if defined(FLOWC_HOST)

struct ConvHandle {
  BlasHandle blas;
};

inline Status create_conv(ConvHandle*, void* = nullptr, size_t = 0) { return Status::Ok(); }
inline void destroy_conv(ConvHandle*) {}

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

inline Status conv2d_forward(ConvHandle&, const ConvDesc& d, const void* x, const void* w, void* y,
                             cudaStream_t stream) {
  if (Status s = validate(d); !s.ok()) return s;
  if (d.type != DataType::kF32) return NotSupported("conv2d: the host build computes fp32 only");
  const ConvDesc desc = d;
  const float* X = static_cast<const float*>(x);
  const float* W = static_cast<const float*>(w);
  float* Y = static_cast<float*>(y);
  cudaError_t e = sim::enqueue_host(stream, [desc, X, W, Y] {
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
  });
  return e == cudaSuccess ? Status::Ok() : InvalidArgument(std::string("conv2d: ") + cudaGetErrorString(e));
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
  if (cudnnCreate(&h->cudnn) != CUDNN_STATUS_SUCCESS) return LibraryError("cudnnCreate failed");
  h->workspace = workspace;
  h->workspace_bytes = workspace ? workspace_bytes : 0;
  return Status::Ok();
}

inline void destroy_conv(ConvHandle* h) {
  if (h->cudnn) cudnnDestroy(h->cudnn);
  *h = ConvHandle{};
}

// Owns the cuDNN descriptors of one call.
struct CudnnCall {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  ~CudnnCall() {
    if (conv) cudnnDestroyConvolutionDescriptor(conv);
    if (w) cudnnDestroyFilterDescriptor(w);
    if (y) cudnnDestroyTensorDescriptor(y);
    if (x) cudnnDestroyTensorDescriptor(x);
  }
};

inline Status conv2d_forward(ConvHandle& h, const ConvDesc& d, const void* x, const void* w, void* y,
                             cudaStream_t stream) {
  if (Status s = validate(d); !s.ok()) return s;
  const cudnnDataType_t t = d.type == DataType::kF16
                                ? CUDNN_DATA_HALF
                                : (d.type == DataType::kBF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT);
  const auto i = [](int64_t v) { return static_cast<int>(v); };
  CudnnCall call;
  bool ok = cudnnCreateTensorDescriptor(&call.x) == CUDNN_STATUS_SUCCESS &&
            cudnnCreateTensorDescriptor(&call.y) == CUDNN_STATUS_SUCCESS &&
            cudnnCreateFilterDescriptor(&call.w) == CUDNN_STATUS_SUCCESS &&
            cudnnCreateConvolutionDescriptor(&call.conv) == CUDNN_STATUS_SUCCESS;
  ok = ok && cudnnSetTensor4dDescriptor(call.x, CUDNN_TENSOR_NCHW, t, i(d.n), i(d.c), i(d.h), i(d.w)) ==
                 CUDNN_STATUS_SUCCESS;
  ok = ok && cudnnSetFilter4dDescriptor(call.w, t, CUDNN_TENSOR_NCHW, i(d.k), i(d.c / d.groups), i(d.r),
                                        i(d.s)) == CUDNN_STATUS_SUCCESS;
  ok = ok && cudnnSetConvolution2dDescriptor(call.conv, i(d.pad_h), i(d.pad_w), i(d.stride_h), i(d.stride_w),
                                             i(d.dil_h), i(d.dil_w), CUDNN_CROSS_CORRELATION,
                                             CUDNN_DATA_FLOAT) == CUDNN_STATUS_SUCCESS;
  ok = ok && cudnnSetConvolutionGroupCount(call.conv, i(d.groups)) == CUDNN_STATUS_SUCCESS;
  ok = ok && cudnnSetTensor4dDescriptor(call.y, CUDNN_TENSOR_NCHW, t, i(d.n), i(d.k), i(d.out_h()),
                                        i(d.out_w())) == CUDNN_STATUS_SUCCESS;
  if (!ok) return LibraryError("conv2d: cuDNN rejected a descriptor");
  cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
  int found = 0;
  if (cudnnGetConvolutionForwardAlgorithm_v7(h.cudnn, call.x, call.w, call.conv, call.y,
                                             CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &found,
                                             perf) != CUDNN_STATUS_SUCCESS) {
    return LibraryError("conv2d: cudnnGetConvolutionForwardAlgorithm_v7 failed");
  }
  int pick = -1;
  for (int a = 0; a < found && pick < 0; ++a) {
    if (perf[a].status == CUDNN_STATUS_SUCCESS && perf[a].memory <= h.workspace_bytes) pick = a;
  }
  if (pick < 0) return NotSupported("conv2d: no cuDNN algorithm fits the workspace");
  if (cudnnSetStream(h.cudnn, stream) != CUDNN_STATUS_SUCCESS)
    return LibraryError("conv2d: cudnnSetStream failed");
  const float alpha = 1.0f, beta = 0.0f;
  const cudnnStatus_t st =
      cudnnConvolutionForward(h.cudnn, &alpha, call.x, x, call.w, w, call.conv, perf[pick].algo, h.workspace,
                              h.workspace_bytes, &beta, call.y, y);
  if (st != CUDNN_STATUS_SUCCESS)
    return LibraryError(std::string("cudnnConvolutionForward: ") + cudnnGetErrorString(st));
  return Status::Ok();
}

#endif

}  // namespace flowc
