// The per-row passes around an int8 product, shared by int8_rows.cpp (around oneDNN's product) and
// int8_vnni.cpp (around fastgen's own): the asymmetric row quantizer and the scaling epilogue.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "vec.h"

namespace fastgen_cpu {

enum Activation : int64_t { kNone = 0, kGelu = 1, kRelu = 2, kSilu = 3 };

template <int64_t kAct>
inline float activate(float v) {
  if constexpr (kAct == kGelu) return 0.5f * v * (1.0f + verf(v * 0.70710678118654752f));
  if constexpr (kAct == kRelu) return v < 0.0f ? 0.0f : v;  // NaN passes, as torch.relu's
  if constexpr (kAct == kSilu) return v / (1.0f + vexp(-v));
  return v;
}

template <int64_t kAct>
void scale_row(float* row, int64_t N, float s, const float* b) {
  if (b != nullptr) {
#pragma omp simd
    for (int64_t n = 0; n < N; ++n) row[n] = activate<kAct>(row[n] * s + b[n]);
  } else {
#pragma omp simd
    for (int64_t n = 0; n < N; ++n) row[n] = activate<kAct>(row[n] * s);
  }
}

constexpr float kTiny = 1e-30f;  // fastgen.ops.int8_linear.TINY: an all-zero row keeps a finite scale

// One row of quantize_rows_u8_zp (int8_rows.cpp): its asymmetric grid's codes, scale and zero point.
inline void quantize_row_zp(const float* row, int64_t K, uint8_t* out, float* scale_out, float* zero_out) {
  // min and max ignore a NaN, so a second loop looks for an all-ones exponent (NaN or infinity) in the
  // bits, where no float flag can fold the test away. Two loops, and the comparisons written out: with
  // the flag inside this loop, or with std::min/std::max, gcc 12 ran its scalar version (5x slower).
  float lo = 0.0f, hi = 0.0f;
#pragma omp simd reduction(min : lo) reduction(max : hi)
  for (int64_t k = 0; k < K; ++k) {
    const float v = row[k];
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(row);
  uint32_t nonfinite = 0;
#pragma omp simd reduction(| : nonfinite)
  for (int64_t k = 0; k < K; ++k) nonfinite |= static_cast<uint32_t>((bits[k] & 0x7f800000u) == 0x7f800000u);
  if (nonfinite) {  // the reference's NaN row: zero codes, a NaN scale
    *scale_out = std::numeric_limits<float>::quiet_NaN();
    *zero_out = 0.0f;
    std::fill(out, out + K, uint8_t{0});
    return;
  }
  const float scale = std::max(hi - lo, kTiny) / 255.0f;
  const float zero = std::nearbyint(-lo / scale);
  *scale_out = scale;
  *zero_out = zero;
  const float inv = 1.0f / scale;
#pragma omp simd
  for (int64_t k = 0; k < K; ++k) {
    const float code = std::nearbyint(row[k] * inv) + zero;
    out[k] = static_cast<uint8_t>(static_cast<int32_t>(std::min(std::max(code, 0.0f), 255.0f)));
  }
}

// Not inlined: every caller (oneDNN's scaling pass, the VNNI and AMX ops) runs this one compiled copy, so the
// backends' outputs agree bit for bit (inlined, each call site vectorized GELU its own way: 1-ulp differences).
template <int64_t kAct>
__attribute__((noinline)) void shift_scale_row(float* row, int64_t N, float s, float z, const float* c,
                                               const float* b) {
  if (b != nullptr) {
#pragma omp simd
    for (int64_t n = 0; n < N; ++n) row[n] = activate<kAct>((row[n] - z * c[n]) * s + b[n]);
  } else {
#pragma omp simd
    for (int64_t n = 0; n < N; ++n) row[n] = activate<kAct>((row[n] - z * c[n]) * s);
  }
}

template <int64_t kAct>
void scale_one_row(float* row, int64_t N, float s, const float* zero, const float* c, const float* b) {
  if (zero != nullptr) {
    shift_scale_row<kAct>(row, N, s, *zero, c, b);
  } else {
    scale_row<kAct>(row, N, s, b);
  }
}

}  // namespace fastgen_cpu
