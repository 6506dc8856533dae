// The GEMM and convolution wrappers against naive double-precision references, over odd sizes,
// transposes, alpha/beta, batches with strides, groups, strides, padding and dilation.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "flowc/conv.h"
#include "flowc/gemm.h"

static unsigned state = 2024u;
static float frand() {
  state = state * 1664525u + 1013904223u;
  return (float)((state >> 8) & 0xffff) / 65536.0f * 2.0f - 1.0f;
}

static float* to_device(const std::vector<float>& h) {
  float* d = nullptr;
  FLOWC_CHECK(cudaMalloc(&d, h.size() * sizeof(float) + 4));
  FLOWC_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice));
  return d;
}

static std::vector<float> to_host(const float* d, size_t n) {
  std::vector<float> h(n);
  FLOWC_CHECK(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
  return h;
}

static double rel_error(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {
    num = std::fmax(num, std::fabs(got[i] - want[i]));
    den = std::fmax(den, std::fabs(want[i]));
  }
  return num / den;
}

static int failures = 0;

static void expect(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  failures += ok ? 0 : 1;
}

// The alignment a batch stride of `elems` float elements keeps (at most 16 bytes): what a plan
// may declare for operands that start 256-byte aligned.
static int stride_align(int64_t elems, int64_t batch) {
  if (batch <= 1) return 16;
  const int64_t bytes = elems * 4;
  int a = 16;
  while (bytes % a != 0) a /= 2;
  return a;
}
static void check_gemm(flowc::BlasHandle& h, cudaStream_t s, flowc::GemmDesc d) {
  const int64_t rows_a = d.trans_a ? d.k : d.m, rows_b = d.trans_b ? d.n : d.k;
  std::vector<float> A(d.stride_a * (d.batch - 1) + rows_a * d.lda),
      B(d.stride_b * (d.batch - 1) + rows_b * d.ldb), C(d.stride_c * (d.batch - 1) + d.m * d.ldc);
  for (auto& v : A) v = frand();
  for (auto& v : B) v = frand();
  for (auto& v : C) v = frand();
  std::vector<double> want(C.begin(), C.end());
  for (int64_t bi = 0; bi < d.batch; ++bi) {
    for (int64_t i = 0; i < d.m; ++i) {
      for (int64_t j = 0; j < d.n; ++j) {
        double acc = 0;
        for (int64_t p = 0; p < d.k; ++p) {
          double a = d.trans_a ? A[bi * d.stride_a + p * d.lda + i] : A[bi * d.stride_a + i * d.lda + p];
          double b = d.trans_b ? B[bi * d.stride_b + j * d.ldb + p] : B[bi * d.stride_b + p * d.ldb + j];
          acc += a * b;
        }
        double& c = want[bi * d.stride_c + i * d.ldc + j];
        c = d.alpha * acc + d.beta * c;
      }
    }
  }
  d.align_a = stride_align(d.stride_a, d.batch);
  d.align_b = stride_align(d.stride_b, d.batch);
  d.align_c = stride_align(d.stride_c, d.batch);
  float *dA = to_device(A), *dB = to_device(B), *dC = to_device(C);
  flowc::Status st = flowc::gemm(h, d, dA, dB, dC, s);
  FLOWC_CHECK(cudaStreamSynchronize(s));
  double err = st.ok() ? rel_error(to_host(dC, C.size()), want) : 1.0;
  bool ok = st.ok() && err < 1e-5;
  std::printf("%s gemm m=%lld n=%lld k=%lld ta=%d tb=%d batch=%lld alpha=%g beta=%g err=%.2e %s\n",
              ok ? "PASS" : "FAIL", (long long)d.m, (long long)d.n, (long long)d.k, d.trans_a, d.trans_b,
              (long long)d.batch, d.alpha, d.beta, err, st.message().c_str());
  failures += ok ? 0 : 1;
  cudaFree(dA);
  cudaFree(dB);
  cudaFree(dC);
}

// A backward epilogue (one packed product, alpha 1, beta 0) against double precision: kDGelu*
// multiplies by the tanh GELU's derivative at aux, kDGeluBgrad also sums D's columns, kBgradA
// sums op(A) over k (m values), kBgradB op(B) (n values).
static void check_gemm_backward(flowc::BlasHandle& h, cudaStream_t s, int64_t m, int64_t n, int64_t k,
                                bool ta, bool tb, flowc::GemmEpilogue e, const char* name) {
  flowc::GemmDesc d = flowc::packed_gemm(m, n, k, ta, tb);
  d.epilogue = e;
  d.ld_aux = n;
  std::vector<float> A(m * k), B(k * n), X(m * n);
  for (auto& v : A) v = frand();
  for (auto& v : B) v = frand();
  for (auto& v : X) v = 3.0f * frand();
  const bool aux = flowc::epilogue_reads_aux(e);
  const int64_t len = e == flowc::GemmEpilogue::kBgradA ? m : n;
  std::vector<double> want(m * n), want_bias(len, 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < k; ++p)
        acc += (double)(ta ? A[p * m + i] : A[i * k + p]) * (tb ? B[j * k + p] : B[p * n + j]);
      if (aux) {
        const double x = X[i * n + j], c = std::sqrt(2.0 / M_PI),
                     t = std::tanh(c * (x + 0.044715 * x * x * x));
        acc *= 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x);
      }
      want[i * n + j] = acc;
      if (e == flowc::GemmEpilogue::kDGeluBgrad) want_bias[j] += acc;
    }
  for (int64_t j = 0; j < len; ++j)
    for (int64_t p = 0; p < k; ++p) {
      if (e == flowc::GemmEpilogue::kBgradA) want_bias[j] += ta ? A[p * m + j] : A[j * k + p];
      if (e == flowc::GemmEpilogue::kBgradB) want_bias[j] += tb ? B[j * k + p] : B[p * n + j];
    }
  float *dA = to_device(A), *dB = to_device(B), *dX = to_device(X), *dD = nullptr, *dbias = nullptr;
  FLOWC_CHECK(cudaMalloc(&dD, m * n * sizeof(float)));
  FLOWC_CHECK(cudaMalloc(&dbias, len * sizeof(float)));
  flowc::GemmPlan plan;
  flowc::GemmEpilogueIo io;
  io.aux = aux ? dX : nullptr;
  io.bias_grad = flowc::epilogue_writes_bias_grad(e) ? dbias : nullptr;
  flowc::Status st = flowc::plan_gemm(h, d, &plan);
  if (st.ok()) st = flowc::run_gemm(plan, dA, dB, nullptr, dD, io, s);
  FLOWC_CHECK(cudaStreamSynchronize(s));
  double err = st.ok() ? rel_error(to_host(dD, want.size()), want) : 1.0;
  if (st.ok() && io.bias_grad != nullptr) err = std::fmax(err, rel_error(to_host(dbias, len), want_bias));
  const bool ok = st.ok() && err < 1e-5;
  std::printf("%s gemm %s m=%lld n=%lld k=%lld ta=%d tb=%d err=%.2e %s\n", ok ? "PASS" : "FAIL", name,
              (long long)m, (long long)n, (long long)k, ta, tb, err, st.message().c_str());
  failures += ok ? 0 : 1;
  flowc::destroy_plan(&plan);
  cudaFree(dA);
  cudaFree(dB);
  cudaFree(dX);
  cudaFree(dD);
  cudaFree(dbias);
}

static void check_conv(flowc::ConvHandle& h, cudaStream_t s, flowc::ConvDesc d) {
  const int64_t oh = d.out_h(), ow = d.out_w(), cg = d.c / d.groups, kg = d.k / d.groups;
  std::vector<float> X(d.n * d.c * d.h * d.w), W(d.k * cg * d.r * d.s);
  for (auto& v : X) v = frand();
  for (auto& v : W) v = frand();
  std::vector<double> want(d.n * d.k * oh * ow, 0.0);
  for (int64_t img = 0; img < d.n; ++img)
    for (int64_t o = 0; o < d.k; ++o)
      for (int64_t y = 0; y < oh; ++y)
        for (int64_t x = 0; x < ow; ++x) {
          double acc = 0;
          const int64_t g = o / kg;
          for (int64_t ci = 0; ci < cg; ++ci)
            for (int64_t i = 0; i < d.r; ++i)
              for (int64_t j = 0; j < d.s; ++j) {
                int64_t iy = y * d.stride_h - d.pad_h + i * d.dil_h,
                        ix = x * d.stride_w - d.pad_w + j * d.dil_w;
                if (iy < 0 || iy >= d.h || ix < 0 || ix >= d.w) continue;
                acc += (double)X[((img * d.c + g * cg + ci) * d.h + iy) * d.w + ix] *
                       W[((o * cg + ci) * d.r + i) * d.s + j];
              }
          want[((img * d.k + o) * oh + y) * ow + x] = acc;
        }
  float *dX = to_device(X), *dW = to_device(W), *dY = nullptr;
  FLOWC_CHECK(cudaMalloc(&dY, want.size() * sizeof(float)));
  flowc::Status st = flowc::conv2d_forward(h, d, dX, dW, dY, s);
  FLOWC_CHECK(cudaStreamSynchronize(s));
  double err = st.ok() ? rel_error(to_host(dY, want.size()), want) : 1.0;
  bool ok = st.ok() && err < 1e-5;
  std::printf(
      "%s conv n=%lld c=%lld %lldx%lld k=%lld %lldx%lld groups=%lld stride=%lld,%lld pad=%lld,%lld "
      "dil=%lld,%lld err=%.2e %s\n",
      ok ? "PASS" : "FAIL", (long long)d.n, (long long)d.c, (long long)d.h, (long long)d.w, (long long)d.k,
      (long long)d.r, (long long)d.s, (long long)d.groups, (long long)d.stride_h, (long long)d.stride_w,
      (long long)d.pad_h, (long long)d.pad_w, (long long)d.dil_h, (long long)d.dil_w, err,
      st.message().c_str());
  failures += ok ? 0 : 1;
  cudaFree(dX);
  cudaFree(dW);
  cudaFree(dY);
}

static bool says(const flowc::Status& st, const char* text) {
  return !st.ok() && st.message().find(text) != std::string::npos;
}

// The libraries' rules the wrappers (and, on the host, the emulator) enforce: docs/runtime.md,
// "What the emulator enforces".
static void check_contracts(flowc::BlasHandle& blas, flowc::ConvHandle& conv, cudaStream_t s) {
  float* buf = nullptr;
  FLOWC_CHECK(cudaMalloc(&buf, 4096 * sizeof(float)));
  FLOWC_CHECK(cudaMemset(buf, 0, 4096 * sizeof(float)));
  // A pointer below the alignment its plan declared to cuBLASLt.
  flowc::GemmDesc d = flowc::packed_gemm(8, 8, 8);
  flowc::Status st = flowc::gemm(blas, d, buf + 1, buf + 512, buf + 1024, s);
  expect(says(st, "operand A is only 4-byte aligned, below the 16 bytes"),
         "gemm refuses A below its declared alignment: " + st.message());
  d.align_a = 4;
  expect(flowc::gemm(blas, d, buf + 1, buf + 512, buf + 1024, s).ok(),
         "gemm takes A at its declared 4-byte alignment");
  d = flowc::packed_gemm(8, 8, 8, false, false, 3);
  d.stride_a = 8 * 8 + 1;
  st = flowc::gemm(blas, d, buf, buf + 512, buf + 1024, s);
  expect(says(st, "batch stride of A (260 bytes) breaks its declared 16-byte alignment"),
         "gemm refuses a batch stride that breaks the alignment: " + st.message());
  d = flowc::packed_gemm(8, 8, 8);
  d.align_b = 6;
  expect(says(flowc::gemm(blas, d, buf, buf + 512, buf + 1024, s), "not a power of two"),
         "gemm refuses an alignment that is no power of two");
  // cuBLASLt's type table: TF32 compute takes float32 operands only.
  {
    flowc::GemmDesc t32 = flowc::packed_gemm(8, 8, 8);
    t32.type = flowc::DataType::kBF16;
    t32.tf32 = true;
    flowc::GemmPlan tp;
    expect(says(flowc::plan_gemm(blas, t32, &tp), "tf32 applies to float32 operands only"),
           "gemm refuses tf32 with narrow operands");
    flowc::destroy_plan(&tp);
  }
  // Workspaces: 256-byte aligned, and at least what a call may use.
  flowc::BlasHandle other;
  expect(
      says(flowc::create_blas(&other, reinterpret_cast<unsigned char*>(buf) + 16, 1024), "256-byte aligned"),
      "create_blas refuses a workspace that is not 256-byte aligned");
  d.align_b = 16;
  d.workspace = 1 << 20;
  expect(says(flowc::gemm(blas, d, buf, buf + 512, buf + 1024, s),
              "may use 1048576 bytes of workspace but its stream's handle has 0"),
         "gemm refuses a handle with less workspace than the call's");
  // Narrow split-K partial sums are added in float32 (REDUCTION_SCHEME_MASK = COMPUTE_TYPE).
  expect(flowc::reduction_schemes(flowc::packed_gemm(8, 8, 8)) == flowc::kReduceAll &&
             flowc::reduction_schemes([] {
               auto n = flowc::packed_gemm(8, 8, 8);
               n.type = flowc::DataType::kBF16;
               return n;
             }()) == flowc::kReduceComputeType,
         "narrow plans reduce split-K in the compute type");
  {
    constexpr int m = 32, n = 32, k = 1024;
    std::vector<flowc::bf16> A(m * k), B(k * n), D(m * n);
    std::vector<double> want(m * n, 0.0);
    for (auto& v : A) v = flowc::bf16(frand());
    for (auto& v : B) v = flowc::bf16(frand());
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j)
        for (int p = 0; p < k; ++p)
          want[i * n + j] += double(float(A[i * k + p])) * double(float(B[p * n + j]));
    flowc::bf16 *dA, *dB, *dD;
    FLOWC_CHECK(cudaMalloc(&dA, A.size() * 2));
    FLOWC_CHECK(cudaMalloc(&dB, B.size() * 2));
    FLOWC_CHECK(cudaMalloc(&dD, D.size() * 2));
    FLOWC_CHECK(cudaMemcpy(dA, A.data(), A.size() * 2, cudaMemcpyHostToDevice));
    FLOWC_CHECK(cudaMemcpy(dB, B.data(), B.size() * 2, cudaMemcpyHostToDevice));
    flowc::GemmDesc nd = flowc::packed_gemm(m, n, k);
    nd.type = flowc::DataType::kBF16;
    st = flowc::gemm(blas, nd, dA, dB, dD, s);
    FLOWC_CHECK(cudaMemcpy(D.data(), dD, D.size() * 2, cudaMemcpyDeviceToHost));
    // One rounding of the float32 sum: every element is the nearest bfloat16 or a neighbour.
    int worse = 0;
    for (int i = 0; i < m * n; ++i) {
      const float lo = float(flowc::bf16(float(want[i]))), got = float(D[i]);
      const float ulp = std::fabs(lo) * (1.0f / 128.0f) + 1e-30f;
      worse += std::fabs(got - float(want[i])) > ulp;
    }
    expect(st.ok() && worse == 0, "bf16 gemm k=1024 is rounded once (" + std::to_string(worse) +
                                      " elements off by more than an ulp)");
    cudaFree(dA);
    cudaFree(dB);
    cudaFree(dD);
  }
  // Convolutions: exact float32 never takes a transform algorithm.
  flowc::ConvDesc c;
  c.c = 4;
  c.h = c.w = 8;
  c.k = 4;
  c.r = c.s = 3;
  expect(!flowc::conv_algorithm_allowed(c, flowc::ConvAlgo::kWinograd) &&
             !flowc::conv_algorithm_allowed(c, flowc::ConvAlgo::kFftTiling) &&
             flowc::conv_algorithm_allowed(c, flowc::ConvAlgo::kImplicitPrecompGemm),
         "exact fp32 convolutions exclude FFT and Winograd");
  flowc::ConvDesc t = c;
  t.math = flowc::ConvMath::kTF32;
  flowc::ConvDesc h = c;
  h.type = flowc::DataType::kBF16;
  expect(flowc::conv_algorithm_allowed(t, flowc::ConvAlgo::kWinograd) &&
             flowc::conv_algorithm_allowed(h, flowc::ConvAlgo::kFft),
         "tf32 and narrow convolutions may use them");
  c.workspace = 4096;
  expect(
      says(flowc::conv2d_forward(conv, c, buf, buf + 512, buf + 1024, s), "may use 4096 bytes of workspace"),
      "conv refuses a handle with less workspace than the call's");
  c.workspace = -1;
  // The fused identity call forces IMPLICIT_PRECOMP_GEMM; refused, the fallback runs the plain
  // convolution's own algorithm. A NaN stays NaN through the fused ReLU (ONNX's Relu).
  c.has_bias = true;
  flowc::ConvPlan plan;
  expect(flowc::plan_conv(conv, c, &plan).ok() && plan.fused &&
             flowc::plan_algorithm(plan) == flowc::ConvAlgo::kImplicitPrecompGemm,
         "the fused identity convolution forces IMPLICIT_PRECOMP_GEMM");
  setenv("FLOWC_SIM_REFUSE_FUSED_CONV", "1", 1);  // host: the emulated fused call is refused
  st = flowc::run_conv(plan, buf, buf + 512, buf + 2048, nullptr, buf + 1024, s);
  unsetenv("FLOWC_SIM_REFUSE_FUSED_CONV");
  FLOWC_CHECK(cudaStreamSynchronize(s));
  if (flowc::kHostTarget) {
    expect(st.ok() && !plan.fused && std::string(flowc::plan_path(plan)) == "conv+epilogue" &&
               flowc::plan_algorithm(plan) == flowc::plan_fallback_algorithm(plan) &&
               flowc::plan_algorithm(plan) != flowc::ConvAlgo::kImplicitPrecompGemm,
           "refused, the fused identity convolution falls back with the plain algorithm");
  }
  flowc::destroy_plan(&plan);
  c.relu = true;
  FLOWC_CHECK(cudaMemset(buf, 0, 4096 * sizeof(float)));
  const float nan = std::nanf("");
  FLOWC_CHECK(cudaMemcpy(buf + 2048, &nan, sizeof(float), cudaMemcpyHostToDevice));  // bias[0]
  st = flowc::conv2d_forward(conv, c, buf, buf + 512, buf + 1024, s, buf + 2048);
  std::vector<float> y = to_host(buf + 1024, 4 * 36);
  expect(st.ok() && std::isnan(y[0]) && y[36] == 0.0f, "a NaN stays NaN through the fused ReLU");
  cudaFree(buf);
}

// cudnnDestroy after the stream the handle last ran on: the emulator stops the program.
static int destroy_order() {
  cudaStream_t s;
  FLOWC_CHECK(cudaStreamCreate(&s));
  flowc::ConvHandle conv;
  FLOWC_CHECK(flowc::create_conv(&conv).ok() ? cudaSuccess : cudaErrorInvalidValue);
  float* buf = nullptr;
  FLOWC_CHECK(cudaMalloc(&buf, 4096 * sizeof(float)));
  flowc::ConvDesc c;
  c.c = c.k = 2;
  c.h = c.w = 4;
  c.r = c.s = 1;
  FLOWC_CHECK(flowc::conv2d_forward(conv, c, buf, buf + 512, buf + 1024, s).ok() ? cudaSuccess
                                                                                 : cudaErrorInvalidValue);
  FLOWC_CHECK(cudaStreamDestroy(s));
  flowc::destroy_conv(&conv);
  std::printf("destroyed\n");
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "destroy-order") return destroy_order();
  cudaStream_t s;
  FLOWC_CHECK(cudaStreamCreate(&s));
  flowc::BlasHandle blas;
  flowc::Status st = flowc::create_blas(&blas);
  if (!st.ok()) {
    std::printf("FAIL create_blas: %s\n", st.message().c_str());
    return 1;
  }
  const int sizes[][3] = {{1, 1, 1}, {7, 13, 5}, {33, 17, 65}, {64, 64, 64}, {129, 3, 31}};
  for (auto& mnk : sizes)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        flowc::GemmDesc d = flowc::packed_gemm(mnk[0], mnk[1], mnk[2], ta, tb);
        check_gemm(blas, s, d);
      }
  flowc::GemmDesc d = flowc::packed_gemm(9, 11, 7, false, true, 3);
  d.alpha = 0.5f;
  d.beta = -2.0f;
  check_gemm(blas, s, d);
  d = flowc::packed_gemm(5, 6, 7, true, false, 4);
  d.lda += 3;  // padded rows and gaps between batch items
  d.ldb += 1;
  d.ldc += 2;
  d.stride_a = d.k * d.lda + 5;
  d.stride_b = d.k * d.ldb + 1;
  d.stride_c = d.m * d.ldc + 7;
  d.beta = 1.0f;
  check_gemm(blas, s, d);
  const struct {
    flowc::GemmEpilogue e;
    const char* name;
  } backward[] = {{flowc::GemmEpilogue::kDGelu, "dgelu"},
                  {flowc::GemmEpilogue::kDGeluBgrad, "dgelu+bgrad"},
                  {flowc::GemmEpilogue::kBgradA, "bgrad(A)"},
                  {flowc::GemmEpilogue::kBgradB, "bgrad(B)"}};
  for (const auto& b : backward) {
    check_gemm_backward(blas, s, 9, 16, 13, false, true, b.e, b.name);
    check_gemm_backward(blas, s, 24, 8, 5, true, false, b.e, b.name);
  }
  {
    // The backward epilogues' rules: the GELU input's leading dimension, its presence, one
    // product with alpha 1 and beta 0.
    flowc::GemmDesc g = flowc::packed_gemm(4, 12, 4);
    g.epilogue = flowc::GemmEpilogue::kDGelu;
    g.ld_aux = 12;
    flowc::GemmPlan gp;
    expect(says(flowc::plan_gemm(blas, g, &gp), "multiple of 8"),
           "gemm refuses a GELU input whose leading dimension is no multiple of 8");
    g.ld_aux = 16;
    g.beta = 1.0f;
    expect(says(flowc::plan_gemm(blas, g, &gp), "alpha 1 and beta 0"),
           "gemm refuses a backward epilogue with beta");
    g.beta = 0.0f;
    float* rules_buf = nullptr;
    FLOWC_CHECK(cudaMalloc(&rules_buf, 64 * sizeof(float)));
    expect(flowc::plan_gemm(blas, g, &gp).ok() &&
               says(flowc::run_gemm(gp, rules_buf, rules_buf, nullptr, rules_buf, flowc::GemmEpilogueIo{}, s),
                    "needs the GELU's input"),
           "gemm refuses a GELU gradient without the GELU's input");
    flowc::destroy_plan(&gp);
    cudaFree(rules_buf);
  }
  flowc::GemmDesc bad = flowc::packed_gemm(4, 4, 4);
  bad.lda = 2;
  bool rejected = !flowc::gemm(blas, bad, nullptr, nullptr, nullptr, s).ok();
  std::printf("%s gemm rejects a short leading dimension\n", rejected ? "PASS" : "FAIL");
  failures += rejected ? 0 : 1;

  flowc::ConvHandle conv;
  st = flowc::create_conv(&conv);
  if (!st.ok()) {
    std::printf("FAIL create_conv: %s\n", st.message().c_str());
    return 1;
  }
  auto cd = [](int64_t n, int64_t c, int64_t h, int64_t w, int64_t k, int64_t r, int64_t sk, int64_t g,
               int64_t stride, int64_t pad, int64_t dil) {
    flowc::ConvDesc d;
    d.n = n;
    d.c = c;
    d.h = h;
    d.w = w;
    d.k = k;
    d.r = r;
    d.s = sk;
    d.groups = g;
    d.stride_h = d.stride_w = stride;
    d.pad_h = d.pad_w = pad;
    d.dil_h = d.dil_w = dil;
    return d;
  };
  check_conv(conv, s, cd(1, 3, 9, 11, 5, 3, 3, 1, 1, 1, 1));
  check_conv(conv, s, cd(2, 4, 13, 7, 6, 3, 2, 2, 2, 1, 1));
  check_conv(conv, s, cd(1, 8, 10, 10, 8, 3, 3, 8, 1, 2, 2));  // depthwise, dilated
  check_conv(conv, s, cd(3, 6, 15, 17, 9, 5, 5, 3, 3, 2, 1));
  check_conv(conv, s, cd(1, 5, 1, 1, 7, 1, 1, 1, 1, 0, 1));  // 1x1 on 1x1
  flowc::ConvDesc cbad = cd(1, 5, 8, 8, 6, 3, 3, 2, 1, 0, 1);
  rejected = !flowc::conv2d_forward(conv, cbad, nullptr, nullptr, nullptr, s).ok();
  std::printf("%s conv rejects channels that do not divide by groups\n", rejected ? "PASS" : "FAIL");
  failures += rejected ? 0 : 1;

  check_contracts(blas, conv, s);

  flowc::destroy_conv(&conv);
  flowc::destroy_blas(&blas);
  FLOWC_CHECK(cudaStreamDestroy(s));
  std::printf("%d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
