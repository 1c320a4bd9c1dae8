// fastgen_cpu::quantize_rows_u8 and fastgen_cpu::scale_rows_add_ — the passes around an int8 product.
//
// Why: the int8 mode's oneDNN product takes u8 activation codes and returns int32 sums scaled to
// float; around it, torch ops took seven passes over the activations and the output (row max as amax
// and amin, a division, quantize_per_tensor, int_repr, the row scale, the bias), each allocating: on
// bart-base's encoder (1024 x 768 and 1024 x 3072 inputs) about as long as the products themselves.
// These two kernels do the same arithmetic in two passes (one reads each row twice from L1/L2).
//
// quantize_rows_u8(x (M, K) float32) -> (codes (M, K) uint8, row_max (M, 1) float32):
//   row_max[m] = max(max_k |x[m, k]|, tiny); codes = clamp(round(x * (127 / row_max)) + 128, 1, 255)
//   — the int8 reference's symmetric codes in [-127, 127], shifted by 128 into u8 (oneDNN's zero point);
//   a row holding a NaN or an infinity gets row_max NaN and codes 128 (zero), so its outputs are NaN.
// quantize_rows_u8_zp(x (M, K) float32) -> (codes (M, K) uint8, scale (M, 1) float32, zero (M, 1) float32):
//   each row's own asymmetric grid: lo = min(min_k x, 0), hi = max(max_k x, 0), scale = max(hi - lo, tiny) / 255,
//   zero = round(-lo / scale), codes = clamp(round(x / scale) + zero, 0, 255) — 255 steps over the row's
//   range where the symmetric grid spends 254 over [-max|x|, max|x|]: twice as fine on a one-signed row (a
//   post-GELU fc2 input). A non-finite row: scale NaN, zero 0, codes 0.
// scale_rows_add_(y (M, N) float32, row_scale (M, 1), bias (N,) or none, activation, row_zero, col_sum):
//   y = act(y * row_scale + bias), in place; with row_zero (M, 1) and col_sum (N,) (each weight row's
//   codes summed, times its scale): y = act((y - row_zero * col_sum) * row_scale + bias), the asymmetric
//   grid's zero point taken out of a product computed with zero point 0; activation 0 none, 1 GELU (erf form, |error| < 1e-7 * |y|),
//   2 ReLU, 3 SiLU — the feed-forward activation fused into the pass that scales fc1's output. NaN stays
//   NaN through each (as torch's activations keep it). A bias of any stride is read through a copy.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "int8_rows.h"

namespace {

using namespace fastgen_cpu;

std::tuple<at::Tensor, at::Tensor> quantize_rows_u8(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "quantize_rows_u8: a contiguous 2-D float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1);
  auto codes = at::empty({M, K}, x.options().dtype(at::kByte));
  auto row_max = at::empty({M, 1}, x.options());
  const float* src = x.data_ptr<float>();
  uint8_t* dst = codes.data_ptr<uint8_t>();
  float* maxes = row_max.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, K)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = src + m * K;
      float peak = 0.0f;
      int32_t nonfinite = 0;  // max ignores a NaN: test each element against the largest finite float
#pragma omp simd reduction(max : peak) reduction(| : nonfinite)
      for (int64_t k = 0; k < K; ++k) {
        const float a = std::fabs(row[k]);
        peak = std::max(peak, a);
        nonfinite |= !(a <= std::numeric_limits<float>::max());
      }
      uint8_t* out = dst + m * K;
      if (nonfinite) {  // the reference's NaN row: zero codes, a NaN scale
        maxes[m] = std::numeric_limits<float>::quiet_NaN();
        std::fill(out, out + K, uint8_t{128});
        continue;
      }
      peak = std::max(peak, kTiny);
      maxes[m] = peak;
      const float inv = 127.0f / peak;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) {
        const float code = std::nearbyint(row[k] * inv);
        out[k] = static_cast<uint8_t>(static_cast<int32_t>(std::min(std::max(code, -127.0f), 127.0f)) + 128);
      }
    }
  });
  return {codes, row_max};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows_u8_zp(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "quantize_rows_u8_zp: a contiguous 2-D float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1);
  auto codes = at::empty({M, K}, x.options().dtype(at::kByte));
  auto row_scale = at::empty({M, 1}, x.options());
  auto row_zero = at::empty({M, 1}, x.options());
  const float* src = x.data_ptr<float>();
  uint8_t* dst = codes.data_ptr<uint8_t>();
  float* scales = row_scale.data_ptr<float>();
  float* zeros = row_zero.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, K)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      quantize_row_zp(src + m * K, K, dst + m * K, scales + m, zeros + m);
    }
  });
  return {codes, row_scale, row_zero};
}

at::Tensor& scale_rows_add_(at::Tensor& y, const at::Tensor& row_scale, const std::optional<at::Tensor>& bias,
                            int64_t activation, const std::optional<at::Tensor>& row_zero,
                            const std::optional<at::Tensor>& col_sum) {
  TORCH_CHECK(activation >= kNone && activation <= kSilu, "scale_rows_add_: unknown activation ", activation);
  TORCH_CHECK(y.device().is_cpu() && y.scalar_type() == at::kFloat && y.dim() == 2 && y.is_contiguous(),
              "scale_rows_add_: y must be a contiguous 2-D float32 CPU tensor");
  const int64_t M = y.size(0), N = y.size(1);
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.numel() == M && row_scale.is_contiguous(),
              "scale_rows_add_: one float32 scale per row");
  const float* b = nullptr;
  at::Tensor dense_bias;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->dim() == 1,
                "scale_rows_add_: bias must hold one float32 per column");
    dense_bias = bias->contiguous();  // the tensor itself where it is already dense
    b = dense_bias.data_ptr<float>();
  }
  const float* zeros = nullptr;
  const float* sums = nullptr;
  TORCH_CHECK(row_zero.has_value() == col_sum.has_value(), "scale_rows_add_: row_zero and col_sum go together");
  if (row_zero.has_value()) {
    TORCH_CHECK(row_zero->scalar_type() == at::kFloat && row_zero->numel() == M && row_zero->is_contiguous() &&
                    col_sum->scalar_type() == at::kFloat && col_sum->numel() == N && col_sum->is_contiguous(),
                "scale_rows_add_: one float32 zero point per row, one contiguous float32 sum per column");
    zeros = row_zero->data_ptr<float>();
    sums = col_sum->data_ptr<float>();
  }
  float* data = y.data_ptr<float>();
  const float* scales = row_scale.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, N)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      float* row = data + m * N;
      switch (activation) {
        case kGelu:
          scale_one_row<kGelu>(row, N, scales[m], zeros ? zeros + m : nullptr, sums, b);
          break;
        case kRelu:
          scale_one_row<kRelu>(row, N, scales[m], zeros ? zeros + m : nullptr, sums, b);
          break;
        case kSilu:
          scale_one_row<kSilu>(row, N, scales[m], zeros ? zeros + m : nullptr, sums, b);
          break;
        default:
          scale_one_row<kNone>(row, N, scales[m], zeros ? zeros + m : nullptr, sums, b);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastgen_cpu, lib) {
  lib.def("quantize_rows_u8(Tensor x) -> (Tensor, Tensor)");
  lib.def("quantize_rows_u8_zp(Tensor x) -> (Tensor, Tensor, Tensor)");
  lib.def(
      "scale_rows_add_(Tensor(a!) y, Tensor row_scale, Tensor? bias, int activation=0, Tensor? row_zero=None, "
      "Tensor? col_sum=None) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(fastgen_cpu, CPU, lib) {
  lib.impl("quantize_rows_u8", &quantize_rows_u8);
  lib.impl("quantize_rows_u8_zp", &quantize_rows_u8_zp);
  lib.impl("scale_rows_add_", &scale_rows_add_);
}
