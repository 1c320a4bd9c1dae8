// fastgen_cpu::attention — softmax(scale * q k^T + mask) v on CPU, fp32, for the opt-in fast modes.
//
// Why: stock SDPA on CPU runs its flash kernel per (batch, head) pair with blocked GEMM calls. At a
// beam-search decode step (M = beams x 1 query rows over S = 256 shared encoder keys, D = 64) that
// costs ~3x the time it takes to read K and V once; on the encoder (M = S = 256) it reached ~40
// GFLOP/s on one AMD EPYC core (MKL's kernels there). Here each (batch, head) pair goes through its
// query rows in blocks of kRows, with register-blocked loops the compiler vectorizes for the CPU at
// hand (built with -march=native):
//   scores  few rows (M <= kDotRows): one dot product per key row, each key read once from memory;
//           many rows: K transposed once per pair into panels, then a kRows x kColVecs-vector block
//           of scores accumulated in registers over D (the GEMM micro-kernel form);
//   softmax per row, exp by a vectorizable polynomial;
//   values  kRows x D accumulators in registers, each value row read once per block.
//
// Semantics (torch reference: fastgen.ops.cpu_attention.attention_reference):
//   out[b, m, h, :] = softmax_s(scale * q[b, h, m, :] . k[b, h, s, :] + mask[b, h, m, s]) @ v[b, h, :, :]
// mask: none, additive float32, or bool (true = attend), broadcast over size-1 dims. A row whose
// every position is masked out gets zeros. The output is laid out (B, M, H, D), the layout
// Transformers' attention functions return. Sums run in another order than SDPA's: results agree to
// float32 rounding, not bit for bit (the fast modes use it, never the exact mode).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "vec.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using fastgen_cpu::kLanes;
using fastgen_cpu::load;
using fastgen_cpu::store;
using fastgen_cpu::vexp;
using fastgen_cpu::vfloat;

constexpr int64_t kRows = 4;      // query rows per block
constexpr int kColVecs = kLanes == 16 ? 4 : 2;  // vectors of scores per row in the micro-kernel (registers)
constexpr int64_t kDotRows = 16;  // up to this many query rows: dot products, no transposed K
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Strides {
  int64_t b, h, m, s;
};

Strides strides_of(const at::Tensor& t) {  // (B, H, M|S, D|S) view strides, 0 where broadcast
  auto st = [&](int dim) { return t.size(dim) == 1 ? int64_t{0} : t.stride(dim); };
  return {st(0), st(1), st(2), st(3)};
}

// scores[r, s] = q[r] . k[s] for rows r < R (rows `stride` floats apart), by dot products (few rows: each key
// row read once)
template <int kD>
void scores_by_dots(const float* q, int64_t R, const float* k, int64_t k_stride, int64_t S, int64_t D,
                    float* scores, int64_t stride) {
  const int64_t n = kD > 0 ? kD : D;
  for (int64_t r = 0; r < R; ++r) {
    const float* qr = q + r * n;
    float* row = scores + r * stride;
    for (int64_t s = 0; s < S; ++s) {
      const float* ks = k + s * k_stride;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < n; ++d) sum += qr[d] * ks[d];
      row[s] = sum;
    }
  }
}

// K transposed into panels of kCols keys: panel[p][d][c] = k[p * kCols + c][d], zero past S, so the
// micro-kernel reads each panel (D x kCols floats) front to back
constexpr int64_t kCols = kColVecs * kLanes;

void transpose_into_panels(const float* k, int64_t k_stride, int64_t S, int64_t D, float* panels) {
  const int64_t padded = (S + kCols - 1) / kCols * kCols;
  for (int64_t s = 0; s < padded; ++s) {
    float* dst = panels + (s / kCols) * D * kCols + (s % kCols);
    if (s >= S) {
      for (int64_t d = 0; d < D; ++d) dst[d * kCols] = 0.0f;
      continue;
    }
    const float* krow = k + s * k_stride;
    for (int64_t d = 0; d < D; ++d) dst[d * kCols] = krow[d];
  }
}

// scores[r, s] = q[r] . k[s] for kRows query rows (zero rows past the block) and every panel: kRows x
// kColVecs vectors of scores stay in registers while d runs (the GEMM micro-kernel form); scores rows
// are `padded` floats apart
void scores_by_panels(const float* q, const float* panels, int64_t padded, int64_t D, float* scores) {
  for (int64_t s0 = 0; s0 < padded; s0 += kCols) {
    const float* panel = panels + (s0 / kCols) * D * kCols;
    vfloat acc[kRows][kColVecs] = {};
    for (int64_t d = 0; d < D; ++d) {
      vfloat kv[kColVecs];
      for (int c = 0; c < kColVecs; ++c) kv[c] = load(panel + d * kCols + c * kLanes);
      for (int64_t r = 0; r < kRows; ++r) {
        const float qv = q[r * D + d];
        for (int c = 0; c < kColVecs; ++c) acc[r][c] += qv * kv[c];
      }
    }
    for (int64_t r = 0; r < kRows; ++r)
      for (int c = 0; c < kColVecs; ++c) store(scores + r * padded + s0 + c * kLanes, acc[r][c]);
  }
}

inline float row_max(const float* row, int64_t S) {
  vfloat acc = vfloat{} + kNegInf;
  int64_t s = 0;
  for (; s + kLanes <= S; s += kLanes) {
    const vfloat x = load(row + s);
    acc = x > acc ? x : acc;
  }
#if defined(__AVX512F__)
  float peak = _mm512_reduce_max_ps(reinterpret_cast<__m512>(acc));  // a tree, not 16 dependent maxss
#else
  float peak = kNegInf;
  for (int i = 0; i < kLanes; ++i) peak = std::max(peak, acc[i]);
#endif
  for (; s < S; ++s) peak = std::max(peak, row[s]);
  return peak;
}

// adds the mask to rows r < R (query rows m0 + r; rows `stride` floats apart, stride >= S rounded up to whole
// vectors), turns their first S entries into softmax numerators (zeros after them); 1/sum per row
template <typename MaskT>
void softmax_rows(float* scores, int64_t stride, int64_t R, int64_t S, const MaskT* mask, Strides ms, int64_t m0,
                  float* inv_sum) {
  for (int64_t r = 0; r < R; ++r) {
    float* row = scores + r * stride;
    if (mask != nullptr) {
      const MaskT* mrow = mask + (m0 + r) * ms.m;
      if (ms.s == 1) {
#pragma omp simd
        for (int64_t s = 0; s < S; ++s) {
          if constexpr (std::is_same_v<MaskT, bool>) {
            row[s] = mrow[s] ? row[s] : kNegInf;
          } else {
            row[s] += mrow[s];
          }
        }
      } else {
        for (int64_t s = 0; s < S; ++s) {
          if constexpr (std::is_same_v<MaskT, bool>) {
            row[s] = mrow[s * ms.s] ? row[s] : kNegInf;
          } else {
            row[s] += mrow[s * ms.s];
          }
        }
      }
    }
    // the row's padding to whole vectors (stride >= S rounded up) holds -inf: every loop below runs whole
    // vectors (a row of 15 keys ran its scalar tail loop, 15 scalar exps, before)
    const int64_t whole = (S + kLanes - 1) / kLanes * kLanes;
    std::fill(row + S, row + whole, kNegInf);
    const float peak = row_max(row, whole);
    if (peak == kNegInf) {  // everything masked out: zeros
      std::fill(row, row + whole, 0.0f);
      inv_sum[r] = 0.0f;
      continue;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t s = 0; s < whole; ++s) {
      const float e = vexp(row[s] - peak);  // 0 in the padding
      row[s] = e;
      sum += e;
    }
    inv_sum[r] = 1.0f / sum;
  }
}

// out[r] = inv_sum[r] * sum_s p[r, s] v[s] for rows r < R; out rows o_stride floats apart.
// kD a multiple of kLanes: R x D accumulators in registers, each value row read once per block.
template <int kD, int kR>
void weighted_values_blocked(const float* p, int64_t p_stride, int64_t S, const float* v, int64_t v_stride,
                             const float* inv_sum, float* out, int64_t o_stride) {
  constexpr int kVecs = kD / kLanes;
  vfloat acc[kR][kVecs] = {};
  for (int64_t s = 0; s < S; ++s) {
    const float* vs = v + s * v_stride;
    vfloat vv[kVecs];
    for (int c = 0; c < kVecs; ++c) vv[c] = load(vs + c * kLanes);
    for (int r = 0; r < kR; ++r) {
      const float pr = p[r * p_stride + s];
      for (int c = 0; c < kVecs; ++c) acc[r][c] += pr * vv[c];
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < kVecs; ++c) store(out + r * o_stride + c * kLanes, acc[r][c] * inv_sum[r]);
}

template <int kD>
void weighted_values(const float* p, int64_t p_stride, int64_t R, int64_t S, const float* v, int64_t v_stride,
                     int64_t D, const float* inv_sum, float* out, int64_t o_stride) {
  constexpr bool kBlocked = kD > 0 && kD % kLanes == 0 && kD / kLanes * kRows <= 16;
  static_assert(kRows == 4, "the blocked forms below are for up to four rows");
  if constexpr (kBlocked) {  // R rows of accumulators in registers (a decode step's self-attention has one)
    constexpr int kB = kBlocked ? kD : kLanes;
    switch (R) {
      case 1:
        return weighted_values_blocked<kB, 1>(p, p_stride, S, v, v_stride, inv_sum, out, o_stride);
      case 2:
        return weighted_values_blocked<kB, 2>(p, p_stride, S, v, v_stride, inv_sum, out, o_stride);
      case 3:
        return weighted_values_blocked<kB, 3>(p, p_stride, S, v, v_stride, inv_sum, out, o_stride);
      default:
        return weighted_values_blocked<kB, 4>(p, p_stride, S, v, v_stride, inv_sum, out, o_stride);
    }
  } else {
    for (int64_t r = 0; r < R; ++r) {
      float* o = out + r * o_stride;
      std::fill(o, o + D, 0.0f);
      for (int64_t s = 0; s < S; ++s) {
        const float* vs = v + s * v_stride;
        const float pr = p[r * p_stride + s];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += pr * vs[d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] *= inv_sum[r];
    }
  }
}

template <typename MaskT, int kD>
void run(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const MaskT* mask, Strides ms,
         float scale, at::Tensor& out) {
  const int64_t B = query.size(0), H = query.size(1), M = query.size(2), D = query.size(3);
  const int64_t S = key.size(2);
  const Strides qs = strides_of(query), ks = strides_of(key), vs = strides_of(value);
  const float* q_base = query.data_ptr<float>();
  const float* k_base = key.data_ptr<float>();
  const float* v_base = value.data_ptr<float>();
  float* o_base = out.data_ptr<float>();  // (B, M, H, D) contiguous
  const bool panels = M > kDotRows;  // many query rows: K transposed once per pair pays for itself
  // scores rows: whole panels, or whole vectors (the softmax runs whole vectors)
  const int64_t padded = panels ? (S + kCols - 1) / kCols * kCols : (S + kLanes - 1) / kLanes * kLanes;
  // a pair costs ~ 4*M*S*D flops; keep small problems on one thread
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, M * S * D / 64));
  at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(kRows * padded));
    std::vector<float> qblock(static_cast<size_t>(kRows * D));
    std::vector<float> kt(panels ? static_cast<size_t>(D * padded) : 0);
    float inv_sum[kRows];
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / H, h = pair % H;
      const float* q = q_base + b * qs.b + h * qs.h;
      const float* k = k_base + b * ks.b + h * ks.h;
      const float* v = v_base + b * vs.b + h * vs.h;
      const MaskT* pair_mask = mask == nullptr ? nullptr : mask + b * ms.b + h * ms.h;
      if (panels) transpose_into_panels(k, ks.m, S, D, kt.data());
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int64_t R = std::min(kRows, M - m0);
        // the block's queries, scaled and contiguous (zeros past R, which the panels' micro-kernel reads)
        for (int64_t r = 0; r < (panels ? kRows : R); ++r) {
          float* dst = qblock.data() + r * D;
          if (r >= R) {
            std::fill(dst, dst + D, 0.0f);
            continue;
          }
          const float* src = q + (m0 + r) * qs.m;
          for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
        }
        if (panels) {
          scores_by_panels(qblock.data(), kt.data(), padded, D, scores.data());
        } else {
          scores_by_dots<kD>(qblock.data(), R, k, ks.m, S, D, scores.data(), padded);
        }
        softmax_rows<MaskT>(scores.data(), padded, R, S, pair_mask, ms, m0, inv_sum);
        float* out_rows = o_base + ((b * M + m0) * H + h) * D;
        weighted_values<kD>(scores.data(), padded, R, S, v, vs.m, D, inv_sum, out_rows, H * D);
      }
    }
  });
}

template <typename MaskT>
void dispatch(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const MaskT* mask, Strides ms,
              float scale, at::Tensor& out) {
  switch (query.size(3)) {
    case 64:
      return run<MaskT, 64>(query, key, value, mask, ms, scale, out);
    case 128:
      return run<MaskT, 128>(query, key, value, mask, ms, scale, out);
    default:
      return run<MaskT, 0>(query, key, value, mask, ms, scale, out);
  }
}

at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "fastgen_cpu::attention: CPU tensors only");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat,
              "fastgen_cpu::attention: float32 tensors only");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "fastgen_cpu::attention: expected (B, H, L, D)");
  const int64_t B = query.size(0), H = query.size(1), M = query.size(2), D = query.size(3), S = key.size(2);
  TORCH_CHECK(key.size(0) == B && value.size(0) == B && key.size(1) == H && value.size(1) == H,
              "fastgen_cpu::attention: key/value batch and heads must equal the query's");
  TORCH_CHECK(key.size(3) == D && value.size(3) == D && value.size(2) == S, "fastgen_cpu::attention: shape mismatch");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1,
              "fastgen_cpu::attention: the last dimension must be contiguous");
  auto out = at::empty({B, M, H, D}, query.options());
  if (B * H * M == 0) return out;
  if (S == 0) return out.zero_();
  if (!mask.has_value()) {
    dispatch<float>(query, key, value, nullptr, {0, 0, 0, 0}, static_cast<float>(scale), out);
    return out;
  }
  const at::Tensor& m = *mask;
  TORCH_CHECK(m.device().is_cpu() && m.dim() == 4, "fastgen_cpu::attention: the mask must be a 4-D CPU tensor");
  const bool broadcastable = (m.size(0) == 1 || m.size(0) == B) && (m.size(1) == 1 || m.size(1) == H) &&
                             (m.size(2) == 1 || m.size(2) == M) && m.size(3) == S;
  TORCH_CHECK(broadcastable, "fastgen_cpu::attention: the mask must broadcast to (B, H, M, S)");
  const Strides ms = strides_of(m);
  if (m.scalar_type() == at::kBool) {
    dispatch<bool>(query, key, value, m.data_ptr<bool>(), ms, static_cast<float>(scale), out);
  } else {
    TORCH_CHECK(m.scalar_type() == at::kFloat, "fastgen_cpu::attention: the mask must be bool or float32");
    dispatch<float>(query, key, value, m.data_ptr<float>(), ms, static_cast<float>(scale), out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastgen_cpu, lib) {
  lib.def("attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastgen_cpu, CPU, lib) { lib.impl("attention", &attention); }
