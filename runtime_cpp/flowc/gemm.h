// GEMM through one call descriptor: cuBLASLt on the GPU, CBLAS (OpenBLAS) on the host.
//
// Row-major throughout: C[m x n] = alpha * op(A)[m x k] * op(B)[k x n] + beta * C, with leading
// dimensions counted in elements between rows, and `batch` problems `stride_*` elements apart.
// The call is ordered on `stream` like a kernel launch.
#pragma once

#include <cstdint>
#include <string>

#include "flowc/device.h"
#include "flowc/status.h"

#if defined(FLOWC_HOST)
#include <cblas.h>
#else
#include <cublasLt.h>
#endif

namespace flowc {

struct GemmDesc {
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  float alpha = 1.0f;
  float beta = 0.0f;
  DataType type = DataType::kF32;  // of A, B and C; accumulation is fp32
};

// A packed row-major problem: leading dimensions and batch strides follow from the shapes.
inline GemmDesc packed_gemm(int64_t m, int64_t n, int64_t k, bool trans_a = false, bool trans_b = false,
                            int64_t batch = 1) {
  GemmDesc d;
  d.trans_a = trans_a;
  d.trans_b = trans_b;
  d.m = m;
  d.n = n;
  d.k = k;
  d.lda = trans_a ? m : k;
  d.ldb = trans_b ? k : n;
  d.ldc = n;
  d.batch = batch;
  d.stride_a = m * k;
  d.stride_b = k * n;
  d.stride_c = m * n;
  return d;
}

inline Status validate(const GemmDesc& d) {
  if (d.m < 0 || d.n < 0 || d.k < 1 || d.batch < 1) {
    return InvalidArgument("gemm: m, n >= 0 and k, batch >= 1 required, got m=" + std::to_string(d.m) +
                           " n=" + std::to_string(d.n) + " k=" + std::to_string(d.k) +
                           " batch=" + std::to_string(d.batch));
  }
  const int64_t min_lda = d.trans_a ? d.m : d.k;
  const int64_t min_ldb = d.trans_b ? d.k : d.n;
  if (d.lda < min_lda || d.ldb < min_ldb || d.ldc < d.n) {
    return InvalidArgument(
        "gemm: a leading dimension is smaller than its row (lda >= " + std::to_string(min_lda) +
        ", ldb >= " + std::to_string(min_ldb) + ", ldc >= " + std::to_string(d.n) + ")");
  }
  return Status::Ok();
}

#if defined(FLOWC_HOST)

struct BlasHandle {};

inline Status create_blas(BlasHandle*, void* = nullptr, size_t = 0) { return Status::Ok(); }
inline void destroy_blas(BlasHandle*) {}

inline Status gemm(BlasHandle&, const GemmDesc& d, const void* a, const void* b, void* c,
                   cudaStream_t stream) {
  if (Status s = validate(d); !s.ok()) return s;
  if (d.type != DataType::kF32) return NotSupported("gemm: the host build computes fp32 only");
  if (d.m == 0 || d.n == 0) return Status::Ok();
  const GemmDesc desc = d;
  const float* A = static_cast<const float*>(a);
  const float* B = static_cast<const float*>(b);
  float* C = static_cast<float*>(c);
  cudaError_t e = sim::enqueue_host(stream, [desc, A, B, C] {
    for (int64_t i = 0; i < desc.batch; ++i) {
      cblas_sgemm(CblasRowMajor, desc.trans_a ? CblasTrans : CblasNoTrans,
                  desc.trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(desc.m),
                  static_cast<int>(desc.n), static_cast<int>(desc.k), desc.alpha, A + i * desc.stride_a,
                  static_cast<int>(desc.lda), B + i * desc.stride_b, static_cast<int>(desc.ldb), desc.beta,
                  C + i * desc.stride_c, static_cast<int>(desc.ldc));
    }
  });
  return e == cudaSuccess ? Status::Ok() : InvalidArgument(std::string("gemm: ") + cudaGetErrorString(e));
}

#else

struct BlasHandle {
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// `workspace`: the caller's device memory for cuBLASLt's scratch (flowc's programs give each
// stream a planned arena buffer); cuBLASLt only picks algorithms that fit in it (0: none).
inline Status create_blas(BlasHandle* h, void* workspace = nullptr, size_t workspace_bytes = 0) {
  if (cublasLtCreate(&h->lt) != CUBLAS_STATUS_SUCCESS) return LibraryError("cublasLtCreate failed");
  h->workspace = workspace;
  h->workspace_bytes = workspace ? workspace_bytes : 0;
  return Status::Ok();
}

inline void destroy_blas(BlasHandle* h) {
  if (h->lt) cublasLtDestroy(h->lt);
  *h = BlasHandle{};
}

inline cudaDataType_t cuda_type(DataType t) {
  switch (t) {
    case DataType::kF16:
      return CUDA_R_16F;
    case DataType::kBF16:
      return CUDA_R_16BF;
    case DataType::kF32:
      break;
  }
  return CUDA_R_32F;
}

// Owns the cuBLASLt descriptors of one call.
struct LtCall {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtCall() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

inline bool lt_layout(cublasLtMatrixLayout_t* out, cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld,
                      int64_t batch, int64_t stride) {
  if (cublasLtMatrixLayoutCreate(out, t, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld) !=
      CUBLAS_STATUS_SUCCESS) {
    return false;
  }
  int32_t count = static_cast<int32_t>(batch);
  return cublasLtMatrixLayoutSetAttribute(*out, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)) ==
             CUBLAS_STATUS_SUCCESS &&
         cublasLtMatrixLayoutSetAttribute(*out, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                          sizeof(stride)) == CUBLAS_STATUS_SUCCESS;
}

inline Status gemm(BlasHandle& h, const GemmDesc& d, const void* a, const void* b, void* c,
                   cudaStream_t stream) {
  if (Status s = validate(d); !s.ok()) return s;
  if (d.m == 0 || d.n == 0) return Status::Ok();
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: hand cuBLASLt the B
  // buffer first. A row-major buffer read column-major is its transpose.
  const cudaDataType_t t = cuda_type(d.type);
  LtCall call;
  if (cublasLtMatmulDescCreate(&call.op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) {
    return LibraryError("cublasLtMatmulDescCreate failed");
  }
  const cublasOperation_t op_first = d.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = d.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(call.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first));
  cublasLtMatmulDescSetAttribute(call.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second));
  const bool ok =
      lt_layout(&call.a, t, d.trans_b ? d.k : d.n, d.trans_b ? d.n : d.k, d.ldb, d.batch, d.stride_b) &&
      lt_layout(&call.b, t, d.trans_a ? d.m : d.k, d.trans_a ? d.k : d.m, d.lda, d.batch, d.stride_a) &&
      lt_layout(&call.c, t, d.n, d.m, d.ldc, d.batch, d.stride_c);
  if (!ok) return LibraryError("gemm: cuBLASLt rejected a matrix layout");
  cublasLtMatmulPreferenceCreate(&call.pref);
  cublasLtMatmulPreferenceSetAttribute(call.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                       &h.workspace_bytes, sizeof(h.workspace_bytes));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (cublasLtMatmulAlgoGetHeuristic(h.lt, call.op, call.a, call.b, call.c, call.c, call.pref, 1, &result,
                                     &found) != CUBLAS_STATUS_SUCCESS ||
      found == 0) {
    return NotSupported("gemm: cuBLASLt has no algorithm for this problem");
  }
  const cublasStatus_t st = cublasLtMatmul(h.lt, call.op, &d.alpha, b, call.a, a, call.b, &d.beta, c, call.c,
                                           c, call.c, &result.algo, h.workspace, h.workspace_bytes, stream);
  if (st != CUBLAS_STATUS_SUCCESS)
    return LibraryError("cublasLtMatmul failed with status " + std::to_string(st));
  return Status::Ok();
}

#endif

}  // namespace flowc
