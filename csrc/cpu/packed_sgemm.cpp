// fastgen_cpu::mkl_pack_weight / fastgen_cpu::mkl_packed_linear — an fp32 linear on MKL's packed-B sgemm.
//
// Why: a decode step's products are short (a few to a few dozen rows against a weight of 0.25-6 MB), and a
// plain sgemm re-packs the weight into its kernel's panels at every call. MKL can keep the weight packed
// (cblas_sgemm_pack once, cblas_sgemm_compute per call), which is how CTranslate2 runs its fp32 products on
// Intel CPUs (packed with the m = 1 hint, valid for any row count). On an Intel Xeon (1 thread) a small
// BART's decoder products ran 15-18% faster at 40-64 rows than oneDNN's packed linear, between the step's
// other work, and up to 1.7x faster than sgemm at 16 rows in isolation.
//
// MKL is reached through the symbols torch's own library exports (torch links MKL statically where it was
// built with it). They are weak references: on a torch without MKL they are null and mkl_sgemm_available()
// says so; nothing here is called then. Results are MKL's sgemm arithmetic on a packed operand: for most shapes
// at 16+ rows bit-identical to F.linear, but not always (the fast_gemm mode uses it, not the exact one).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstddef>
#include <cstdint>
#include <optional>

#include "int8_rows.h"

extern "C" {
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k) __attribute__((weak));
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src,
                      int ld, float* dest) __attribute__((weak));
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc) __attribute__((weak));
}

namespace {

// MKL's CBLAS enum values (mkl_cblas.h)
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;
constexpr int kPackHintRows = 1;  // the m the weight is packed for: any row count may use it (CTranslate2's choice)
// the packed tensor: a header (the weight's N and K, so that a product of another shape is refused rather than read
// out of bounds), then MKL's buffer, 64-byte aligned as the header's length keeps it
constexpr int64_t kHeaderBytes = 64;

bool mkl_sgemm_available() {
  return cblas_sgemm_pack_get_size != nullptr && cblas_sgemm_pack != nullptr && cblas_sgemm_compute != nullptr;
}

int64_t packed_bytes(int64_t out_features, int64_t in_features) {
  return static_cast<int64_t>(cblas_sgemm_pack_get_size(kBMatrix, kPackHintRows, static_cast<int>(out_features),
                                                        static_cast<int>(in_features)));
}

// weight (N, K) fp32 -> a uint8 tensor: the header, then MKL's packed form of weight^T
at::Tensor mkl_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(mkl_sgemm_available(), "mkl_pack_weight: this torch exports no MKL packed sgemm");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "mkl_pack_weight: weight must be a 2-D float32 CPU tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n > 0 && k > 0 && n < INT32_MAX && k < INT32_MAX, "mkl_pack_weight: shape out of MKL's range");
  // empty, not zeros: MKL sizes the buffer generously (7.6 MB for a 256 x 256 weight) and writes the weight's bytes
  // only, so the pages it never touches cost no memory
  at::Tensor packed = at::empty({kHeaderBytes + packed_bytes(n, k)}, w.options().dtype(at::kByte));
  int64_t* header = reinterpret_cast<int64_t*>(packed.data_ptr<uint8_t>());
  header[0] = n;
  header[1] = k;
  cblas_sgemm_pack(kRowMajor, kBMatrix, kTrans, kPackHintRows, static_cast<int>(n), static_cast<int>(k), 1.0f,
                   w.data_ptr<float>(), static_cast<int>(k),
                   reinterpret_cast<float*>(packed.data_ptr<uint8_t>() + kHeaderBytes));
  return packed;
}

template <int64_t kAct>
void activate_rows(float* y, int64_t count) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) y[i] = fastgen_cpu::activate<kAct>(y[i]);
}

// x (..., K) fp32; packed from mkl_pack_weight of an (out_features, K) weight; bias (out_features,) or none;
// activation: 0 none, 1 GELU (erf form, |error| < 1e-7 * |y|), 2 ReLU, 3 SiLU, applied to the output in place (the
// fast_gemm mode's fc1 with its activation fused, as the int8 mode fuses it into its scaling pass)
at::Tensor mkl_packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                             const std::optional<at::Tensor>& bias, int64_t activation) {
  TORCH_CHECK(activation >= fastgen_cpu::kNone && activation <= fastgen_cpu::kSilu,
              "mkl_packed_linear: unknown activation ", activation);
  TORCH_CHECK(mkl_sgemm_available(), "mkl_packed_linear: this torch exports no MKL packed sgemm");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1,
              "mkl_packed_linear: x must be a float32 CPU tensor");
  const int64_t k = x.size(-1), n = out_features;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() > kHeaderBytes,
              "mkl_packed_linear: packed is not the packed form of a weight (mkl_pack_weight)");
  const int64_t* header = reinterpret_cast<const int64_t*>(packed.data_ptr<uint8_t>());
  TORCH_CHECK(header[0] == n && header[1] == k && packed.numel() == kHeaderBytes + packed_bytes(n, k),
              "mkl_packed_linear: packed is the packed form of a (", header[0], ", ", header[1], ") weight, not of a (",
              n, ", ", k, ") one");
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  auto shape = x.sizes().vec();
  shape.back() = n;
  at::Tensor y;
  float beta = 0.0f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n, "mkl_packed_linear: bias of ", n, " floats");
    y = at::empty({m, n}, x2.options());  // F.linear's addmm: C = bias, then C += x @ w^T (a copy: never the bias)
    y.copy_(bias->reshape({1, n}).expand({m, n}));
    beta = 1.0f;
  } else {
    y = at::empty({m, n}, x2.options());
  }
  if (m > 0)
    cblas_sgemm_compute(kRowMajor, kNoTrans, kPacked, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                        x2.data_ptr<float>(), static_cast<int>(k),
                        reinterpret_cast<const float*>(packed.data_ptr<uint8_t>() + kHeaderBytes), static_cast<int>(k), beta,
                        y.data_ptr<float>(), static_cast<int>(n));
  float* data = y.data_ptr<float>();
  switch (activation) {
    case fastgen_cpu::kGelu:
      activate_rows<fastgen_cpu::kGelu>(data, m * n);
      break;
    case fastgen_cpu::kRelu:
      activate_rows<fastgen_cpu::kRelu>(data, m * n);
      break;
    case fastgen_cpu::kSilu:
      activate_rows<fastgen_cpu::kSilu>(data, m * n);
      break;
    default:
      break;
  }
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastgen_cpu, lib) {
  lib.def("mkl_sgemm_available() -> bool", &mkl_sgemm_available);
  lib.def("mkl_pack_weight(Tensor weight) -> Tensor");
  lib.def("mkl_packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias, int activation=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastgen_cpu, CPU, lib) {
  lib.impl("mkl_pack_weight", &mkl_pack_weight);
  lib.impl("mkl_packed_linear", &mkl_packed_linear);
}
