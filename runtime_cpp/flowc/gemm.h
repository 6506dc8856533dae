// GEMM through plans made once: cuBLASLt on the GPU, CBLAS (OpenBLAS) on the host.
//
// Row-major throughout: D[m x n] = act(alpha * op(A)[m x k] * op(B)[k x n] + beta * C + bias),
// with leading dimensions counted in elements between rows, and `batch` problems `stride_*`
// elements apart. C and D share one layout and may be different buffers (C = nullptr: D is C,
// as in BLAS). bias has n elements, one per column, shared by the batch.
//
// Training's backward products take cuBLASLt's backward epilogues (GemmEpilogue::kDGelu and the
// bias gradients): the extra operands travel in a GemmEpilogueIo.
//
// plan_gemm() makes a call's descriptors, layouts, preference and algorithm once (a program's
// create()); run_gemm() only executes it, ordered on `stream` like a kernel launch. A plan is
// tied to the handle (and so the workspace) it was made with: one stream's. Where cuBLASLt has
// no algorithm with the epilogue for a problem, the plan runs the product without it and a
// kernel of this header applies bias and activation after it (GemmPlan::epilogue_kernel).
//
// Precision: fp32 A/B/C computes exactly in fp32 (CUBLAS_COMPUTE_32F) unless the desc asks for
// tf32 (CUBLAS_COMPUTE_32F_FAST_TF32: inputs rounded to TF32 on tensor cores). float16 and
// bfloat16 A/B/C run on tensor cores with fp32 accumulation and fp32 alpha/beta; the result is
// rounded to the narrow type once. The host build does the same: narrow operands are read as
// float, sgemm accumulates, the epilogue is applied in float, and D is rounded once.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "flowc/device.h"
#include "flowc/narrow.h"
#include "flowc/status.h"

#if defined(FLOWC_HOST)
#include <cblas.h>
#else
#include <cublasLt.h>
#endif

namespace flowc {

// What happens to alpha * A B + beta * C before it is stored; bias is one value per column of D.
// The GELU is the tanh approximation (cuBLASLt's): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
//
// The backward epilogues (one product: batch 1, alpha 1, beta 0):
// - kDGelu: D = op(A) op(B) * GELU'(aux), aux being the GELU's input saved by the forward (an
//   m x n matrix, ld_aux elements between its rows): the gradient through a GELU of the
//   product's gradient. kDGeluBgrad also writes the bias gradient, the sums of D's columns
//   (n values).
// - kBgradA writes the sums of op(A) over k (m values: the bias gradient beside dW^T = dY^T X,
//   whose A is the output gradient); kBgradB the sums of op(B) over k (n values: beside
//   dW = X^T dY).
// cuBLASLt names the bias gradients by its own operands, which are flowc's swapped (plan_gemm):
// kBgradA is CUBLASLT_EPILOGUE_BGRADB. A bias gradient has D's element type; it is summed in
// float and rounded once.
enum class GemmEpilogue {
  kNone,
  kBias,
  kReluBias,
  kGeluBias,
  kRelu,
  kGelu,
  kDGelu,
  kDGeluBgrad,
  kBgradA,
  kBgradB
};

inline bool epilogue_has_bias(GemmEpilogue e) {
  return e == GemmEpilogue::kBias || e == GemmEpilogue::kReluBias || e == GemmEpilogue::kGeluBias;
}
inline bool epilogue_reads_aux(GemmEpilogue e) {
  return e == GemmEpilogue::kDGelu || e == GemmEpilogue::kDGeluBgrad;
}
inline bool epilogue_writes_bias_grad(GemmEpilogue e) {
  return e == GemmEpilogue::kDGeluBgrad || e == GemmEpilogue::kBgradA || e == GemmEpilogue::kBgradB;
}
inline bool epilogue_is_backward(GemmEpilogue e) {
  return epilogue_reads_aux(e) || epilogue_writes_bias_grad(e);
}

// The epilogue's operands beside A, B, C and D.
struct GemmEpilogueIo {
  const void* bias = nullptr;  // read: kBias, kReluBias, kGeluBias
  const void* aux = nullptr;   // read: the GELU's input (kDGelu, kDGeluBgrad)
  void* bias_grad = nullptr;   // written: kDGeluBgrad, kBgradA, kBgradB
};

struct GemmDesc {
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  float alpha = 1.0f;
  float beta = 0.0f;
  DataType type = DataType::kF32;  // of A, B, C, D and bias; accumulation is fp32
  bool tf32 = false;               // fp32 only: let the library round inputs to TF32
  GemmEpilogue epilogue = GemmEpilogue::kNone;
  int64_t ld_aux = 0;  // kDGelu*: elements between the aux matrix's rows
  // The alignment (bytes) every pointer run_gemm gets for A, B, C/D is known to have: the
  // library may pick algorithms that need it (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES; an
  // algorithm chosen for an alignment the pointers lack fails). Powers of two, at least the
  // element size; batch strides keep them.
  int align_a = 16, align_b = 16, align_c = 16;
  // The most workspace this call may use (bytes; its bound from the shapes, docs/runtime.md),
  // -1: whatever the handle has. The stream's handle must have at least this much.
  int64_t workspace = -1;
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
  if (epilogue_is_backward(d.epilogue) && (d.batch != 1 || d.alpha != 1.0f || d.beta != 0.0f)) {
    return InvalidArgument(
        "gemm: a backward epilogue (GELU or bias gradient) takes one product with alpha 1 and beta 0");
  }
  // CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: at least the rows of cuBLASLt's column-major D (flowc's
  // columns) and divisible by 8.
  if (epilogue_reads_aux(d.epilogue) && (d.ld_aux < d.n || d.ld_aux % 8 != 0)) {
    return InvalidArgument("gemm: the GELU input's leading dimension (" + std::to_string(d.ld_aux) +
                           ") must be at least n (" + std::to_string(d.n) +
                           ") and a multiple of 8 (cuBLASLt's EPILOGUE_AUX_LD)");
  }
  // cuBLASLt's type table: CUBLAS_COMPUTE_32F_FAST_TF32 takes 32F A/B/C only.
  if (d.tf32 && d.type != DataType::kF32)
    return InvalidArgument("gemm: tf32 applies to float32 operands only");
  const int elem = static_cast<int>(element_size(d.type));
  const int64_t strides[3] = {d.stride_a, d.stride_b, d.stride_c};
  const int aligns[3] = {d.align_a, d.align_b, d.align_c};
  const char* names[3] = {"A", "B", "C/D"};
  for (int i = 0; i < 3; ++i) {
    const int al = aligns[i];
    if (al < elem || (al & (al - 1)) != 0) {
      return InvalidArgument(
          std::string("gemm: the alignment declared for ") + names[i] + " (" + std::to_string(al) +
          " bytes) is not a power of two of at least the element size (" + std::to_string(elem) + ")");
    }
    if (d.batch > 1 && (strides[i] * elem) % al != 0) {
      return InvalidArgument(std::string("gemm: the batch stride of ") + names[i] + " (" +
                             std::to_string(strides[i] * elem) + " bytes) breaks its declared " +
                             std::to_string(al) + "-byte alignment");
    }
  }
  return Status::Ok();
}

// cuBLASLt's split-K reductions a plan allows (CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, the
// values of cublasLtReductionScheme_t): INPLACE adds the partial sums into D in D's type,
// OUTPUT_TYPE keeps them in D's type in the workspace, COMPUTE_TYPE in float32. A float16 or
// bfloat16 D would add partial sums in 16 bits with the first two, so narrow plans allow only
// COMPUTE_TYPE: the result is rounded once, as without a split.
enum : uint32_t { kReduceInPlace = 1, kReduceComputeType = 2, kReduceOutputType = 4, kReduceAll = 7 };

inline uint32_t reduction_schemes(const GemmDesc& d) {
  return d.type == DataType::kF32 ? kReduceAll : kReduceComputeType;
}

// The emulator's contract checks at a call (docs/runtime.md, "What the emulator enforces"):
// every pointer as aligned as the plan declared, the bias at least element-aligned.
inline Status check_pointers(const GemmDesc& d, const void* a, const void* b, const void* c, const void* out,
                             const GemmEpilogueIo& io) {
  const auto misaligned = [](const void* p, int al) {
    return reinterpret_cast<uintptr_t>(p) % unsigned(al) != 0;
  };
  const struct {
    const void* p;
    int align;
    const char* name;
    const char* pref;
  } ops[4] = {{a, d.align_a, "A", "B"},  // cuBLASLt sees flowc's A as its B (see plan_gemm)
              {b, d.align_b, "B", "A"},
              {c, d.align_c, "C", "C"},
              {out, d.align_c, "D", "D"}};
  for (const auto& op : ops) {
    if (op.p != nullptr && misaligned(op.p, op.align)) {
      const uintptr_t v = reinterpret_cast<uintptr_t>(op.p);
      return LibraryError(std::string("gemm: operand ") + op.name + " is only " +
                          std::to_string(v & (~v + 1)) + "-byte aligned, below the " +
                          std::to_string(op.align) +
                          " bytes its plan declared to cuBLASLt (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_" +
                          op.pref + "_BYTES): the algorithm chosen for it would fail on the GPU");
    }
  }
  const int elem = static_cast<int>(element_size(d.type));
  if (io.bias != nullptr && misaligned(io.bias, elem))
    return LibraryError("gemm: the bias pointer is not aligned to its element size");
  if (io.aux != nullptr && misaligned(io.aux, elem))
    return LibraryError("gemm: the GELU input (aux) pointer is not aligned to its element size");
  if (io.bias_grad != nullptr && misaligned(io.bias_grad, elem))
    return LibraryError("gemm: the bias gradient pointer is not aligned to its element size");
  return Status::Ok();
}

inline Status check_epilogue_io(const GemmDesc& d, const GemmEpilogueIo& io) {
  if (epilogue_has_bias(d.epilogue) && io.bias == nullptr)
    return InvalidArgument("gemm: the epilogue needs a bias");
  if (epilogue_reads_aux(d.epilogue) && io.aux == nullptr)
    return InvalidArgument("gemm: the GELU gradient epilogue needs the GELU's input (aux)");
  if (epilogue_writes_bias_grad(d.epilogue) && io.bias_grad == nullptr)
    return InvalidArgument("gemm: the epilogue writes a bias gradient but has no buffer for it");
  return Status::Ok();
}

namespace detail {

// The epilogue of one element, in float: what cuBLASLt computes, what the host emulates and
// what the GPU's fallback kernel applies.
__host__ __device__ inline float gelu_tanh(float x) {
  const float kSqrt2OverPi = 0.7978845608028654f;
  return 0.5f * x * (1.0f + tanhf(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
}

// d/dx of gelu_tanh: 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2).
__host__ __device__ inline float gelu_tanh_grad(float x) {
  const float kSqrt2OverPi = 0.7978845608028654f;
  const float t = tanhf(kSqrt2OverPi * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * 0.044715f * x * x);
}

// aux: the GELU's input at this element (kDGelu*); a bias gradient leaves D as the product.
__host__ __device__ inline float epilogue(GemmEpilogue e, float x, float b, float aux = 0.0f) {
  switch (e) {
    case GemmEpilogue::kNone:
      return x;
    case GemmEpilogue::kBias:
      return x + b;
    case GemmEpilogue::kReluBias:
      return fmaxf(x + b, 0.0f);
    case GemmEpilogue::kGeluBias:
      return gelu_tanh(x + b);
    case GemmEpilogue::kRelu:
      return fmaxf(x, 0.0f);
    case GemmEpilogue::kGelu:
      return gelu_tanh(x);
    case GemmEpilogue::kDGelu:
    case GemmEpilogue::kDGeluBgrad:
      return x * gelu_tanh_grad(aux);
    case GemmEpilogue::kBgradA:
    case GemmEpilogue::kBgradB:
      return x;
  }
  return x;
}

}  // namespace detail

#if defined(FLOWC_HOST)

// The handle keeps what cuBLASLt's would: the caller's workspace (only its size matters on the
// host, where the library needs none; the generated program passes no memory for it), and
// whether a call has run yet (the first call outside any capture: see sim::library_call).
struct BlasHandle {
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  bool warm = false;
};

inline Status create_blas(BlasHandle* h, void* workspace = nullptr, size_t workspace_bytes = 0) {
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
    return InvalidArgument("create_blas: cuBLASLt's workspace must be 256-byte aligned");
  *h = BlasHandle{workspace, workspace_bytes, false};
  return Status::Ok();
}
inline void destroy_blas(BlasHandle* h) { *h = BlasHandle{}; }

// The host's plan is the problem itself: CBLAS has nothing to prepare.
struct GemmPlan {
  GemmDesc desc;
  BlasHandle* handle = nullptr;
  uint32_t reductions = kReduceAll;  // the split-K reductions the GPU plan allows
  bool made = false;
};

inline Status plan_gemm(BlasHandle& h, const GemmDesc& d, GemmPlan* p) {
  if (Status s = validate(d); !s.ok()) return s;
  // The GPU plan asks the heuristic for an algorithm within the call's workspace bound; a
  // handle with less would make it choose from fewer, or none.
  if (d.workspace > 0 && h.workspace_bytes < static_cast<size_t>(d.workspace)) {
    return InvalidArgument("gemm: the call may use " + std::to_string(d.workspace) +
                           " bytes of workspace but its stream's handle has " +
                           std::to_string(h.workspace_bytes));
  }
  p->desc = d;
  p->handle = &h;
  p->reductions = reduction_schemes(d);
  p->made = true;
  return Status::Ok();
}

inline void destroy_plan(GemmPlan* p) { *p = GemmPlan{}; }

namespace detail {

// A rows x cols matrix of T (leading dimension ld) read as packed float.
template <class T>
void to_float(const T* src, int64_t rows, int64_t cols, int64_t ld, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = static_cast<float>(src[r * ld + c]);
}

// One batch of the problem, element type T; float needs no conversion, so A and B are read in place.
// A narrow product whose split-K partial sums may be added in 16 bits (a plan that allows the
// INPLACE or OUTPUT_TYPE reduction): the emulator takes the GPU's worst case, K in four parts
// whose products are each rounded to T and added into D in T.
template <class T>
void split_k_in_narrow(const GemmDesc& d, const float* a, int64_t lda, const float* b, int64_t ldb,
                       float* out) {
  const int64_t parts = 4, chunk = (d.k + parts - 1) / parts;
  std::vector<float> part(static_cast<size_t>(d.m * d.n));
  std::vector<T> acc(static_cast<size_t>(d.m * d.n), T(0.0f));
  for (int64_t p0 = 0; p0 < d.k; p0 += chunk) {
    const int64_t kk = std::min(chunk, d.k - p0);
    const float* ap = d.trans_a ? a + p0 * lda : a + p0;
    const float* bp = d.trans_b ? b + p0 : b + p0 * ldb;
    cblas_sgemm(CblasRowMajor, d.trans_a ? CblasTrans : CblasNoTrans, d.trans_b ? CblasTrans : CblasNoTrans,
                static_cast<int>(d.m), static_cast<int>(d.n), static_cast<int>(kk), d.alpha, ap,
                static_cast<int>(lda), bp, static_cast<int>(ldb), 0.0f, part.data(), static_cast<int>(d.n));
    for (size_t i = 0; i < part.size(); ++i)
      acc[i] = T(static_cast<float>(acc[i]) + static_cast<float>(T(part[i])));
  }
  for (size_t i = 0; i < part.size(); ++i) out[i] = d.beta * out[i] + static_cast<float>(acc[i]);
}

// The bias gradient of kBgradA / kBgradB: op(A) summed over k (m values) or op(B) (n values), in
// float, rounded once.
template <class T>
void host_operand_sums(const GemmDesc& d, const T* A, const T* B, T* out) {
  const bool of_a = d.epilogue == GemmEpilogue::kBgradA;
  const int64_t len = of_a ? d.m : d.n;
  for (int64_t j = 0; j < len; ++j) {
    float s = 0.0f;
    for (int64_t kk = 0; kk < d.k; ++kk) {
      const T v = of_a ? (d.trans_a ? A[kk * d.lda + j] : A[j * d.lda + kk])
                       : (d.trans_b ? B[j * d.ldb + kk] : B[kk * d.ldb + j]);
      s += static_cast<float>(v);
    }
    out[j] = T(s);
  }
}

template <class T>
void host_gemm(const GemmDesc& d, uint32_t reductions, const T* A, const T* B, const T* C, T* D,
               const T* bias, const T* aux, T* bias_grad) {
  const int64_t a_rows = d.trans_a ? d.k : d.m, a_cols = d.trans_a ? d.m : d.k;
  const int64_t b_rows = d.trans_b ? d.n : d.k, b_cols = d.trans_b ? d.k : d.n;
  const bool wide = std::is_same<T, float>::value;
  std::vector<float> af, bf, df;
  for (int64_t i = 0; i < d.batch; ++i) {
    const T* a = A + i * d.stride_a;
    const T* b = B + i * d.stride_b;
    T* out = D + i * d.stride_c;
    const T* c = C ? C + i * d.stride_c : out;
    const float* pa;
    const float* pb;
    int64_t lda = d.lda, ldb = d.ldb;
    float* pd;
    int64_t ldd;
    if constexpr (std::is_same<T, float>::value) {
      pa = a;
      pb = b;
      pd = out;
      ldd = d.ldc;
      if (d.beta != 0.0f && c != out) {
        for (int64_t r = 0; r < d.m; ++r) std::memcpy(out + r * d.ldc, c + r * d.ldc, d.n * sizeof(float));
      }
    } else {
      af.resize(a_rows * a_cols);
      bf.resize(b_rows * b_cols);
      df.assign(d.m * d.n, 0.0f);
      to_float(a, a_rows, a_cols, d.lda, af.data());
      to_float(b, b_rows, b_cols, d.ldb, bf.data());
      if (d.beta != 0.0f) to_float(c, d.m, d.n, d.ldc, df.data());
      pa = af.data();
      pb = bf.data();
      pd = df.data();
      lda = a_cols;
      ldb = b_cols;
      ldd = d.n;
    }
    if (!wide && (reductions & (kReduceInPlace | kReduceOutputType)) != 0 && d.k >= 64) {
      if constexpr (!std::is_same<T, float>::value) split_k_in_narrow<T>(d, pa, lda, pb, ldb, pd);
    } else {
      cblas_sgemm(CblasRowMajor, d.trans_a ? CblasTrans : CblasNoTrans, d.trans_b ? CblasTrans : CblasNoTrans,
                  static_cast<int>(d.m), static_cast<int>(d.n), static_cast<int>(d.k), d.alpha, pa,
                  static_cast<int>(lda), pb, static_cast<int>(ldb), d.beta, pd, static_cast<int>(ldd));
    }
    if (d.epilogue != GemmEpilogue::kNone || !wide) {
      const bool has_bias = epilogue_has_bias(d.epilogue);
      const bool column_sums = d.epilogue == GemmEpilogue::kDGeluBgrad;
      std::vector<float> sums(column_sums ? static_cast<size_t>(d.n) : 0, 0.0f);
      for (int64_t r = 0; r < d.m; ++r) {
        for (int64_t col = 0; col < d.n; ++col) {
          const float bv = has_bias ? static_cast<float>(bias[col]) : 0.0f;
          const float av = aux != nullptr ? static_cast<float>(aux[r * d.ld_aux + col]) : 0.0f;
          const float v = epilogue(d.epilogue, pd[r * ldd + col], bv, av);
          if (column_sums) sums[col] += v;
          // The one rounding of a narrow result.
          out[r * d.ldc + col] = T(v);
        }
      }
      for (size_t col = 0; col < sums.size(); ++col) bias_grad[col] = T(sums[col]);
    }
    if (d.epilogue == GemmEpilogue::kBgradA || d.epilogue == GemmEpilogue::kBgradB)
      host_operand_sums(d, a, b, bias_grad);
  }
}

template <class T>
Status enqueue_gemm(const GemmPlan& p, const void* a, const void* b, const void* c, void* out,
                    const GemmEpilogueIo& io, cudaStream_t stream) {
  const T* A = static_cast<const T*>(a);
  const T* B = static_cast<const T*>(b);
  const T* C = static_cast<const T*>(c);
  T* D = static_cast<T*>(out);
  const T* bias = static_cast<const T*>(io.bias);
  const T* aux = static_cast<const T*>(io.aux);
  T* bias_grad = static_cast<T*>(io.bias_grad);
  const GemmDesc desc = p.desc;
  const uint32_t reductions = p.reductions;
  // One library call, one queued host operation (the emulator counts it as a launch).
  cudaError_t e =
      sim::library_call(stream, &p.handle->warm, [desc, reductions, A, B, C, D, bias, aux, bias_grad] {
        host_gemm(desc, reductions, A, B, C, D, bias, aux, bias_grad);
      });
  return e == cudaSuccess ? Status::Ok() : LibraryError(std::string("gemm: ") + cudaGetErrorString(e));
}

}  // namespace detail

// D = epilogue(alpha op(A) op(B) + beta C); c = nullptr reads C from d.
inline Status run_gemm(const GemmPlan& p, const void* a, const void* b, const void* c, void* d,
                       const GemmEpilogueIo& io, cudaStream_t stream) {
  if (!p.made) return InvalidArgument("gemm: the plan was not made");
  const GemmDesc& desc = p.desc;
  if (Status s = check_epilogue_io(desc, io); !s.ok()) return s;
  if (desc.m == 0 || desc.n == 0) return Status::Ok();
  if (Status s = check_pointers(desc, a, b, c, d, io); !s.ok()) return s;
  switch (desc.type) {
    case DataType::kF32:
      return detail::enqueue_gemm<float>(p, a, b, c, d, io, stream);
    case DataType::kF16:
      return detail::enqueue_gemm<f16>(p, a, b, c, d, io, stream);
    case DataType::kBF16:
      return detail::enqueue_gemm<bf16>(p, a, b, c, d, io, stream);
  }
  return NotSupported("gemm: unknown element type");
}

// A plan made for m rows run on the first `rows` of them (a program with symbolic dims: the
// rows of a packed A and D are the run's, one product, no batch): the same problem with m =
// rows, which CBLAS takes as it is.
inline Status run_gemm_rows(const GemmPlan& p, int64_t rows, const void* a, const void* b, const void* c,
                            void* d, const void* bias, cudaStream_t stream) {
  if (rows < 0 || rows > p.desc.m || p.desc.batch != 1 || p.desc.trans_a) {
    return InvalidArgument("gemm: " + std::to_string(rows) + " rows of a plan for " +
                           std::to_string(p.desc.m) + " (untransposed, unbatched)");
  }
  GemmPlan q = p;
  q.desc.m = rows;
  q.desc.stride_a = rows * q.desc.k;
  q.desc.stride_c = rows * q.desc.n;
  GemmEpilogueIo io;
  io.bias = bias;
  return run_gemm(q, a, b, c, d, io, stream);
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
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
    return InvalidArgument("create_blas: cuBLASLt's workspace must be 256-byte aligned");
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

inline cublasLtEpilogue_t lt_epilogue(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::kNone:
      break;
    case GemmEpilogue::kBias:
      return CUBLASLT_EPILOGUE_BIAS;
    case GemmEpilogue::kReluBias:
      return CUBLASLT_EPILOGUE_RELU_BIAS;
    case GemmEpilogue::kGeluBias:
      return CUBLASLT_EPILOGUE_GELU_BIAS;
    case GemmEpilogue::kRelu:
      return CUBLASLT_EPILOGUE_RELU;
    case GemmEpilogue::kGelu:
      return CUBLASLT_EPILOGUE_GELU;
    case GemmEpilogue::kDGelu:
      return CUBLASLT_EPILOGUE_DGELU;
    case GemmEpilogue::kDGeluBgrad:
      return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case GemmEpilogue::kBgradA:  // flowc's A is cuBLASLt's B
      return CUBLASLT_EPILOGUE_BGRADB;
    case GemmEpilogue::kBgradB:
      return CUBLASLT_EPILOGUE_BGRADA;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

// One call's descriptors and chosen algorithm, made by plan_gemm, freed by destroy_plan.
// run_gemm_rows' plan for a row count other than its plan's (a program with symbolic dims,
// docs/dynamic.md): the layouts of B and C at that many rows, and the algorithm.
struct GemmRowsPlan {
  int64_t rows = -1;
  cublasLtMatrixLayout_t b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};
constexpr int kMaxRowsPlans = 16;

struct GemmPlan {
  GemmDesc desc;
  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  // cuBLASLt's A is flowc's B (see plan_gemm); C and D share `c`.
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  cublasLtMatmulAlgo_t algo{};
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // No algorithm had the epilogue: the library computes alpha A B + beta C, a kernel of ours
  // applies the bias and the activation after it (the named fallback).
  bool epilogue_kernel = false;
  bool made = false;
  // run_gemm_rows' plans per row count, each made on the count's first use (a CUDA Graph's
  // size bucket: its first run, which goes out directly, before the capture) and kept until
  // destroy_plan; past kMaxRowsPlans counts each call makes and drops its own.
  mutable GemmRowsPlan rows_plans[kMaxRowsPlans];
  mutable int num_rows_plans = 0;
};

namespace detail {

template <class T>
__global__ void gemm_epilogue(T* d, const T* bias, const T* aux, GemmEpilogue e, int64_t m, int64_t n,
                              int64_t ldc, int64_t ld_aux, int64_t batch, int64_t stride_c) {
  const int64_t total = batch * m * n;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t col = i % n, row = (i / n) % m, b = i / (m * n);
    T& out = d[b * stride_c + row * ldc + col];
    const float bv = bias ? static_cast<float>(bias[col]) : 0.0f;
    const float av = aux ? static_cast<float>(aux[row * ld_aux + col]) : 0.0f;
    out = T(epilogue(e, static_cast<float>(out), bv, av));
  }
}

// out[j] = sum over i < count of x[i * step_i + j * step_j], j < len, in float: the fallback's
// bias gradients (D's columns; op(A) or op(B) over k). One thread per sum, in a fixed order.
template <class T>
__global__ void gemm_sums(const T* x, T* out, int64_t len, int64_t count, int64_t step_j, int64_t step_i) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < len;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int64_t i = 0; i < count; ++i) s += static_cast<float>(x[i * step_i + j * step_j]);
    out[j] = T(s);
  }
}

inline int64_t fallback_blocks(int64_t total) {
  return (total + 255) / 256 < 4096 ? (total + 255) / 256 : 4096;
}

template <class T>
cudaError_t launch_epilogue(const GemmDesc& desc, const void* a, const void* b, void* d,
                            const GemmEpilogueIo& io, cudaStream_t stream) {
  const int64_t total = desc.batch * desc.m * desc.n;
  if (desc.epilogue != GemmEpilogue::kBgradA && desc.epilogue != GemmEpilogue::kBgradB) {
    FLOWC_LAUNCH((gemm_epilogue<T>), dim3(static_cast<unsigned>(fallback_blocks(total))), dim3(256), 0,
                 stream, static_cast<T*>(d), static_cast<const T*>(io.bias), static_cast<const T*>(io.aux),
                 desc.epilogue, desc.m, desc.n, desc.ldc, desc.ld_aux, desc.batch, desc.stride_c);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  if (!epilogue_writes_bias_grad(desc.epilogue)) return cudaSuccess;
  // The sums' source: D's columns (its rounded values), or op(A) / op(B) along k.
  const T* x = static_cast<const T*>(d);
  int64_t len = desc.n, count = desc.m, step_j = 1, step_i = desc.ldc;
  if (desc.epilogue == GemmEpilogue::kBgradA) {
    x = static_cast<const T*>(a);
    len = desc.m;
    count = desc.k;
    step_j = desc.trans_a ? 1 : desc.lda;
    step_i = desc.trans_a ? desc.lda : 1;
  } else if (desc.epilogue == GemmEpilogue::kBgradB) {
    x = static_cast<const T*>(b);
    count = desc.k;
    step_j = desc.trans_b ? desc.ldb : 1;
    step_i = desc.trans_b ? 1 : desc.ldb;
  }
  FLOWC_LAUNCH((gemm_sums<T>), dim3(static_cast<unsigned>(fallback_blocks(len))), dim3(256), 0, stream, x,
               static_cast<T*>(io.bias_grad), len, count, step_j, step_i);
  return cudaGetLastError();
}

}  // namespace detail

inline void destroy_plan(GemmPlan* p) {
  for (int i = 0; i < p->num_rows_plans; ++i) {
    if (p->rows_plans[i].c) cublasLtMatrixLayoutDestroy(p->rows_plans[i].c);
    if (p->rows_plans[i].b) cublasLtMatrixLayoutDestroy(p->rows_plans[i].b);
  }
  if (p->pref) cublasLtMatmulPreferenceDestroy(p->pref);
  if (p->c) cublasLtMatrixLayoutDestroy(p->c);
  if (p->b) cublasLtMatrixLayoutDestroy(p->b);
  if (p->a) cublasLtMatrixLayoutDestroy(p->a);
  if (p->op) cublasLtMatmulDescDestroy(p->op);
  *p = GemmPlan{};
}

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

template <class V>
inline bool lt_set(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attr, const V& value) {
  return cublasLtMatmulDescSetAttribute(op, attr, &value, sizeof(value)) == CUBLAS_STATUS_SUCCESS;
}

template <class V>
inline bool lt_pref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
                    const V& value) {
  return cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)) == CUBLAS_STATUS_SUCCESS;
}

inline Status plan_gemm(BlasHandle& h, const GemmDesc& d, GemmPlan* p) {
  if (Status s = validate(d); !s.ok()) return s;
  destroy_plan(p);
  if (d.workspace > 0 && h.workspace_bytes < static_cast<size_t>(d.workspace)) {
    return InvalidArgument("gemm: the call may use " + std::to_string(d.workspace) +
                           " bytes of workspace but its stream's handle has " +
                           std::to_string(h.workspace_bytes));
  }
  p->desc = d;
  p->lt = h.lt;
  p->workspace = h.workspace;
  // The call's bound, not the whole stream's workspace: the heuristic picks within it.
  p->workspace_bytes = d.workspace >= 0 && static_cast<size_t>(d.workspace) < h.workspace_bytes
                           ? static_cast<size_t>(d.workspace)
                           : h.workspace_bytes;
  if (d.m == 0 || d.n == 0) {
    p->made = true;  // nothing to compute, nothing to ask the library
    return Status::Ok();
  }
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: hand cuBLASLt the B
  // buffer first. A row-major buffer read column-major is its transpose.
  const cudaDataType_t t = cuda_type(d.type);
  const cublasComputeType_t compute = d.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  if (cublasLtMatmulDescCreate(&p->op, compute, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) {
    destroy_plan(p);
    return LibraryError("cublasLtMatmulDescCreate failed");
  }
  const cublasOperation_t op_first = d.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = d.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const uint32_t epilogue = lt_epilogue(d.epilogue);
  bool ok = lt_set(p->op, CUBLASLT_MATMUL_DESC_TRANSA, op_first) &&
            lt_set(p->op, CUBLASLT_MATMUL_DESC_TRANSB, op_second) &&
            lt_set(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
  if (epilogue_reads_aux(d.epilogue))
    ok = ok && lt_set(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, d.ld_aux);
  ok = ok && lt_layout(&p->a, t, d.trans_b ? d.k : d.n, d.trans_b ? d.n : d.k, d.ldb, d.batch, d.stride_b) &&
       lt_layout(&p->b, t, d.trans_a ? d.m : d.k, d.trans_a ? d.k : d.m, d.lda, d.batch, d.stride_a) &&
       lt_layout(&p->c, t, d.n, d.m, d.ldc, d.batch, d.stride_c);
  if (!ok) {
    destroy_plan(p);
    return LibraryError("gemm: cuBLASLt rejected a matrix layout or an attribute");
  }
  const uint32_t align_first = static_cast<uint32_t>(d.align_b),
                 align_second = static_cast<uint32_t>(d.align_a), align_c = static_cast<uint32_t>(d.align_c);
  ok = cublasLtMatmulPreferenceCreate(&p->pref) == CUBLAS_STATUS_SUCCESS &&
       lt_pref(p->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, p->workspace_bytes) &&
       lt_pref(p->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_first) &&
       lt_pref(p->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_second) &&
       lt_pref(p->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c) &&
       lt_pref(p->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c) &&
       lt_pref(p->pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, reduction_schemes(d));
  if (!ok) {
    destroy_plan(p);
    return LibraryError("gemm: cuBLASLt rejected a preference");
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  auto heuristic = [&] {
    found = 0;
    return cublasLtMatmulAlgoGetHeuristic(h.lt, p->op, p->a, p->b, p->c, p->c, p->pref, 1, &result, &found) ==
               CUBLAS_STATUS_SUCCESS &&
           found > 0;
  };
  bool have = heuristic();
  if (!have && d.epilogue != GemmEpilogue::kNone) {
    const uint32_t none = CUBLASLT_EPILOGUE_DEFAULT;
    p->epilogue_kernel = lt_set(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, none) && (have = heuristic());
  }
  if (!have) {
    destroy_plan(p);
    return NotSupported("gemm: cuBLASLt has no algorithm for this problem");
  }
  p->algo = result.algo;
  p->made = true;
  return Status::Ok();
}

// D = epilogue(alpha op(A) op(B) + beta C); c = nullptr reads C from d.
inline Status run_gemm(const GemmPlan& p, const void* a, const void* b, const void* c, void* d,
                       const GemmEpilogueIo& io, cudaStream_t stream) {
  if (!p.made) return InvalidArgument("gemm: the plan was not made");
  if (Status s = check_epilogue_io(p.desc, io); !s.ok()) return s;
  if (p.desc.m == 0 || p.desc.n == 0) return Status::Ok();
  if (Status s = check_pointers(p.desc, a, b, c, d, io); !s.ok()) return s;
  // The bias, aux and bias-gradient addresses are a call's, not the plan's (plans are shared by
  // identical calls); setting one is a host-side store into the descriptor, read when the call
  // is queued. The bias gradient takes the bias's pointer attribute.
  const void* bias_ptr = io.bias_grad != nullptr ? io.bias_grad : io.bias;
  if (bias_ptr != nullptr && !p.epilogue_kernel &&
      !lt_set(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias_ptr)) {
    return LibraryError("gemm: cuBLASLt rejected the bias pointer");
  }
  if (io.aux != nullptr && !p.epilogue_kernel &&
      !lt_set(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, io.aux)) {
    return LibraryError("gemm: cuBLASLt rejected the GELU input (aux) pointer");
  }
  const cublasStatus_t st = cublasLtMatmul(p.lt, p.op, &p.desc.alpha, b, p.a, a, p.b, &p.desc.beta, c ? c : d,
                                           p.c, d, p.c, &p.algo, p.workspace, p.workspace_bytes, stream);
  if (st != CUBLAS_STATUS_SUCCESS)
    return LibraryError("cublasLtMatmul failed with status " + std::to_string(st));
  if (p.epilogue_kernel) {
    cudaError_t e = cudaSuccess;
    switch (p.desc.type) {
      case DataType::kF32:
        e = detail::launch_epilogue<float>(p.desc, a, b, d, io, stream);
        break;
      case DataType::kF16:
        e = detail::launch_epilogue<f16>(p.desc, a, b, d, io, stream);
        break;
      case DataType::kBF16:
        e = detail::launch_epilogue<bf16>(p.desc, a, b, d, io, stream);
        break;
    }
    if (e != cudaSuccess)
      return LibraryError(std::string("gemm: the epilogue kernel: ") + cudaGetErrorString(e));
  }
  return Status::Ok();
}

// A plan made for m rows run on the first `rows` of them (a program with symbolic dims: the
// rows of a packed A and D are the run's, one product, no batch). cuBLASLt's layouts hold the
// rows, so the call gets layouts of its own (host-side descriptors, made outside any capture);
// the plan's algorithm serves when the library accepts it for these rows, else the heuristic
// chooses for them.
inline Status run_gemm_rows(const GemmPlan& p, int64_t rows, const void* a, const void* b, const void* c,
                            void* d, const void* bias, cudaStream_t stream) {
  const GemmDesc& pd = p.desc;
  if (rows < 0 || rows > pd.m || pd.batch != 1 || pd.trans_a) {
    return InvalidArgument("gemm: " + std::to_string(rows) + " rows of a plan for " + std::to_string(pd.m) +
                           " (untransposed, unbatched)");
  }
  GemmEpilogueIo io;
  io.bias = bias;
  if (rows == pd.m || pd.n == 0) return run_gemm(p, a, b, c, d, io, stream);
  if (rows == 0) return Status::Ok();
  GemmPlan q = p;
  q.desc.m = rows;
  q.desc.stride_a = rows * pd.k;
  q.desc.stride_c = rows * pd.n;
  for (int i = 0; i < p.num_rows_plans; ++i) {
    const GemmRowsPlan& r = p.rows_plans[i];
    if (r.rows == rows) {
      q.b = r.b;
      q.c = r.c;
      q.algo = r.algo;
      return run_gemm(q, a, b, c, d, io, stream);
    }
  }
  q.b = nullptr;
  q.c = nullptr;
  const cudaDataType_t t = cuda_type(pd.type);
  Status s = Status::Ok();
  if (!lt_layout(&q.b, t, pd.k, rows, pd.lda, 1, 0) || !lt_layout(&q.c, t, pd.n, rows, pd.ldc, 1, 0)) {
    s = LibraryError("gemm: cuBLASLt rejected a matrix layout of " + std::to_string(rows) + " rows");
  } else {
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(p.lt, p.op, q.a, q.b, q.c, q.c, &p.algo, &check) != CUBLAS_STATUS_SUCCESS ||
        check.workspaceSize > p.workspace_bytes) {
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      if (cublasLtMatmulAlgoGetHeuristic(p.lt, p.op, q.a, q.b, q.c, q.c, p.pref, 1, &result, &found) !=
              CUBLAS_STATUS_SUCCESS ||
          found == 0) {
        s = NotSupported("gemm: cuBLASLt has no algorithm for " + std::to_string(rows) + " rows");
      } else {
        q.algo = result.algo;
      }
    }
    if (s.ok()) s = run_gemm(q, a, b, c, d, io, stream);
  }
  if (s.ok() && p.num_rows_plans < kMaxRowsPlans) {
    p.rows_plans[p.num_rows_plans++] = GemmRowsPlan{rows, q.b, q.c, q.algo};  // kept: destroy_plan frees it
    return s;
  }
  if (q.c) cublasLtMatrixLayoutDestroy(q.c);
  if (q.b) cublasLtMatrixLayoutDestroy(q.b);
  return s;
}

#endif

// D = act(alpha op(A) op(B) + beta C + bias): a forward epilogue's one extra operand.
inline Status run_gemm(const GemmPlan& p, const void* a, const void* b, const void* c, void* d,
                       const void* bias, cudaStream_t stream) {
  GemmEpilogueIo io;
  io.bias = bias;
  return run_gemm(p, a, b, c, d, io, stream);
}

// C = op(A) op(B) into C's buffer.
inline Status run_gemm(const GemmPlan& p, const void* a, const void* b, void* c, cudaStream_t stream) {
  return run_gemm(p, a, b, nullptr, c, nullptr, stream);
}

// One call planned and run at once (tests and tools; flowc's programs plan in create()). The
// plan is freed right after queueing: cuBLASLt reads the descriptors when the call is queued.
inline Status gemm(BlasHandle& h, const GemmDesc& d, const void* a, const void* b, void* c,
                   cudaStream_t stream) {
  GemmPlan p;
  Status s = plan_gemm(h, d, &p);
  if (s.ok()) s = run_gemm(p, a, b, c, stream);
  destroy_plan(&p);
  return s;
}

}  // namespace flowc
