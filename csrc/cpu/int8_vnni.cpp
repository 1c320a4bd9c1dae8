// fastgen_cpu::int8_linear_vnni — a decode step's int8 linear in one call: quantize, product, scale.
//
// Why: at a decode step's row counts oneDNN's u8 x s8 product has a floor of ~30 us per call on an Intel
// Xeon (Emerald Rapids, AMX) — more than MKL's fp32 product of a 16 x 256 x 256 step — and the int8 mode
// pays two more calls around it (the row quantizer, the scaling pass). A small model's step makes 25 such
// products. This op does all three in one call with AVX-512 VNNI (vpdpbusd: four u8 x s8 products summed
// into each int32 lane, exactly), on a weight packed once (pack_int8_vnni).
//
// Semantics are the asymmetric grid's (fastgen.ops.int8_linear, int8_rows.h): per row m the codes
// xq = quantize_row_zp(x[m]) with (scale[m], zero[m]); acc[m, n] = sum_k xq[m, k] * Wq[n, k] in int32 (exact);
// y[m, n] = act((float(acc) * scale_w[n] - zero[m] * col_sums[n]) * scale[m] + bias[n]) — oneDNN's output
// (float(acc) * scale_w) followed by scale_rows_add_, so it differs from that path by float rounding at most.
//
// pack_int8_vnni(Wq (N, K) int8) -> (ceil(N / 16), ceil(K / 4), 16, 4) int8: panels of 16 outputs, for each
// group of four k the 16 outputs' four codes side by side (what one vpdpbusd reads); zeros past N and K.
// int8_vnni_native() says whether this build has the VNNI path (else a plain loop computes the same sums).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

#include "int8_rows.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define FASTGEN_VNNI 1
#endif

namespace {

using namespace fastgen_cpu;

constexpr int kPanel = 16;     // outputs per panel (int32 lanes of a zmm register)
constexpr int kTileRows = 8;   // rows per register tile
constexpr int kTilePanels = 3; // panels per register tile: 8 x 3 sums + 3 weights + 1 input of 32 zmm

at::Tensor pack_int8_vnni(const at::Tensor& codes) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous(),
              "pack_int8_vnni: a contiguous 2-D int8 CPU tensor of weight codes");
  const int64_t N = codes.size(0), K = codes.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel, quads = (K + 3) / 4;
  auto packed = at::zeros({panels, quads, kPanel, 4}, codes.options());
  const int8_t* src = codes.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t p = n / kPanel, j = n % kPanel;
    for (int64_t k = 0; k < K; ++k) dst[((p * quads + k / 4) * kPanel + j) * 4 + k % 4] = src[n * K + k];
  }
  return packed;
}

// acc (rows x panels * 16 int32) = codes rows [m0, m0 + rows) against panels [p0, p0 + panels); codes rows
// are `stride` bytes apart (a multiple of 4, zero-padded past K)
template <int R, int C>
void tile(const uint8_t* xq, int64_t stride, const int8_t* w, int64_t quads, int32_t* acc) {
#if defined(FASTGEN_VNNI)
  __m512i s[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) s[r][c] = _mm512_setzero_si512();
  for (int64_t q = 0; q < quads; ++q) {
    __m512i wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w + (c * quads + q) * kPanel * 4);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, xq + r * stride + q * 4, 4);
      const __m512i xv = _mm512_set1_epi32(four);
      for (int c = 0; c < C; ++c) s[r][c] = _mm512_dpbusd_epi32(s[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_si512(acc + (r * C + c) * kPanel, s[r][c]);
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int j = 0; j < kPanel; ++j) {
        int32_t sum = 0;
        for (int64_t q = 0; q < quads; ++q)
          for (int t = 0; t < 4; ++t)
            sum += int32_t{xq[r * stride + q * 4 + t]} * int32_t{w[((c * quads + q) * kPanel + j) * 4 + t]};
        acc[(r * C + c) * kPanel + j] = sum;
      }
#endif
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, int32_t*);

template <int R, int... kC>
constexpr TileFn pick_cols(int panels, std::integer_sequence<int, kC...>) {
  TileFn fns[] = {&tile<R, kC + 1>...};
  return fns[panels - 1];
}

template <int... kR>
TileFn pick_tile(int rows, int panels, std::integer_sequence<int, kR...>) {
  TileFn fns[][kTilePanels] = {{&tile<kR + 1, 1>, &tile<kR + 1, 2>, &tile<kR + 1, 3>}...};
  return fns[rows - 1][panels - 1];
}

template <int64_t kAct>
void finish_row(const int32_t* acc, float* y, int64_t cols, const float* scale_w, float s, float z,
                const float* col_sums, const float* b) {
  for (int64_t j = 0; j < cols; ++j) y[j] = static_cast<float>(acc[j]) * scale_w[j];
  shift_scale_row<kAct>(y, cols, s, z, col_sums, b);
}

at::Tensor int8_linear_vnni(const at::Tensor& x, const at::Tensor& packed, int64_t n, const at::Tensor& scale_w,
                            const at::Tensor& col_sums, const std::optional<at::Tensor>& bias, int64_t activation) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "int8_linear_vnni: x must be a contiguous 2-D float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), quads = (K + 3) / 4, panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(0) == panels && packed.size(1) == quads && packed.size(2) == kPanel && packed.size(3) == 4,
              "int8_linear_vnni: packed must come from pack_int8_vnni for an (n, K) weight");
  TORCH_CHECK(scale_w.scalar_type() == at::kFloat && scale_w.numel() == n && scale_w.is_contiguous() &&
                  col_sums.scalar_type() == at::kFloat && col_sums.numel() == n && col_sums.is_contiguous(),
              "int8_linear_vnni: one contiguous float32 scale and code sum per output");
  TORCH_CHECK(activation >= kNone && activation <= kSilu, "int8_linear_vnni: unknown activation ", activation);
  const float* b = nullptr;
  at::Tensor dense_bias;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->dim() == 1,
                "int8_linear_vnni: bias must hold one float32 per output");
    dense_bias = bias->contiguous();
    b = dense_bias.data_ptr<float>();
  }
  auto y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  // the activation codes, rows padded to whole groups of four k (zeros), and each row's grid
  const int64_t stride = quads * 4;
  auto codes = at::zeros({M, stride}, x.options().dtype(at::kByte));
  auto grid = at::empty({2, M}, x.options());
  const float* xp = x.data_ptr<float>();
  uint8_t* xq = codes.data_ptr<uint8_t>();
  float* row_scale = grid.data_ptr<float>();
  float* row_zero = row_scale + M;
  at::parallel_for(0, M, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, K)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row_zp(xp + m * K, K, xq + m * stride, row_scale + m, row_zero + m);
  });
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sw = scale_w.data_ptr<float>();
  const float* cs = col_sums.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t groups = (panels + kTilePanels - 1) / kTilePanels;
  // threads over groups of panels; each group's weight (3 panels x K codes) stays in cache across row tiles
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) int32_t acc[kTileRows * kTilePanels * kPanel];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = g * kTilePanels;
      const int tp = static_cast<int>(std::min<int64_t>(kTilePanels, panels - p0));
      const int64_t n0 = p0 * kPanel;
      const int64_t cols = std::min<int64_t>(tp * kPanel, n - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
        pick_tile(rows, tp, std::make_integer_sequence<int, kTileRows>{})(xq + m0 * stride, stride,
                                                                           wp + p0 * quads * kPanel * 4, quads, acc);
        for (int r = 0; r < rows; ++r) {
          const int64_t m = m0 + r;
          const int32_t* row_acc = acc + r * tp * kPanel;
          float* out = yp + m * n + n0;
          const float* bias_part = b != nullptr ? b + n0 : nullptr;
          switch (activation) {
            case kGelu:
              finish_row<kGelu>(row_acc, out, cols, sw + n0, row_scale[m], row_zero[m], cs + n0, bias_part);
              break;
            case kRelu:
              finish_row<kRelu>(row_acc, out, cols, sw + n0, row_scale[m], row_zero[m], cs + n0, bias_part);
              break;
            case kSilu:
              finish_row<kSilu>(row_acc, out, cols, sw + n0, row_scale[m], row_zero[m], cs + n0, bias_part);
              break;
            default:
              finish_row<kNone>(row_acc, out, cols, sw + n0, row_scale[m], row_zero[m], cs + n0, bias_part);
          }
        }
      }
    }
  });
  return y;
}

bool int8_vnni_native() {
#if defined(FASTGEN_VNNI)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastgen_cpu, lib) {
  lib.def("pack_int8_vnni(Tensor codes) -> Tensor");
  lib.def(
      "int8_linear_vnni(Tensor x, Tensor packed, int n, Tensor scale_w, Tensor col_sums, Tensor? bias, "
      "int activation) -> Tensor");
  lib.def("int8_vnni_native() -> bool", &int8_vnni_native);
}

TORCH_LIBRARY_IMPL(fastgen_cpu, CPU, lib) {
  lib.impl("pack_int8_vnni", &pack_int8_vnni);
  lib.impl("int8_linear_vnni", &int8_linear_vnni);
}
