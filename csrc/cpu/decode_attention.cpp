// fastgen::decode_attention — attention for a few query rows over a long key/value set, on CPU, fp32.
//
// Why: in a beam-search decode step each input's M = beams x q query rows attend over the same
// S encoder keys (cross-attention, K/V shared across beams). Stock SDPA on CPU runs its flash
// kernel per (batch, head) pair with blocked GEMM calls sized for long queries; at M = 4, S = 256,
// D = 64 that costs ~3x the time it takes to read K and V once. Here each (batch, head) pair reads
// each key and value row once, in order, and does the M dot products / updates on it while it is
// in L1: a single streaming pass, bound by memory bandwidth.
//
// Semantics (torch reference: fastgen.ops.decode_attention.decode_attention_reference):
//   out[b, m, h, :] = softmax_s(scale * q[b, h, m, :] . k[b, h, s, :] + mask[b, h, m, s]) @ v[b, h, :, :]
// mask: none, additive float32, or bool (true = attend), broadcast over size-1 dims. A row whose
// every position is masked out gets zeros. The output is laid out (B, M, H, D), the layout
// Transformers' attention functions return. Reductions run in another order than SDPA's: results
// agree to float32 rounding, not bit for bit (the opt-in fast modes use it, never the exact mode).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

// exp on the reals with ~1 ulp error (Cody-Waite reduction, Cephes' polynomial), written so the
// compiler vectorizes it (libm's expf is a call per element). exp(-inf) and anything below -87.3
// give 0 through the `x < -87.3` select.
inline float vexp(float x) {
  const float clamped = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float r = (clamped - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.3f ? 0.0f : p * scale;
}

// o[:] = w * sum_s p[s] * v[s, :]; kD > 0 fixes D at compile time so the accumulator lives in registers
template <int kD>
inline void weighted_rows(const float* v, int64_t v_row_stride, const float* p, int64_t S, int64_t D, float w,
                          float* o) {
  constexpr int64_t kMax = kD > 0 ? kD : 1;
  if constexpr (kD > 0) {
    float acc[kMax] = {};
    for (int64_t s = 0; s < S; ++s) {
      const float* vrow = v + s * v_row_stride;
      const float ps = p[s];
#pragma omp simd
      for (int64_t d = 0; d < kD; ++d) acc[d] += ps * vrow[d];
    }
    for (int64_t d = 0; d < kD; ++d) o[d] = acc[d] * w;
  } else {
    for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
    for (int64_t s = 0; s < S; ++s) {
      const float* vrow = v + s * v_row_stride;
      const float ps = p[s];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += ps * vrow[d];
    }
    for (int64_t d = 0; d < D; ++d) o[d] *= w;
  }
}

// q . k over D floats; kD > 0 fixes D at compile time
template <int kD>
inline float dot(const float* q, const float* k, int64_t D) {
  const int64_t n = kD > 0 ? kD : D;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += q[d] * k[d];
  return sum;
}

struct Strides {
  int64_t b, h, m, s;
};

Strides strides_of(const at::Tensor& t) {  // (B, H, M|S, D|S) view strides, 0 where broadcast
  auto st = [&](int dim) { return t.size(dim) == 1 ? int64_t{0} : t.stride(dim); };
  return {st(0), st(1), st(2), st(3)};
}

template <typename MaskT, int kD>
void run(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const MaskT* mask,
         Strides ms, float scale, at::Tensor& out) {
  const int64_t B = query.size(0), H = query.size(1), M = query.size(2), D = query.size(3);
  const int64_t S = key.size(2);
  const Strides qs = strides_of(query), ks = strides_of(key), vs = strides_of(value);
  const float* q_base = query.data_ptr<float>();
  const float* k_base = key.data_ptr<float>();
  const float* v_base = value.data_ptr<float>();
  float* o_base = out.data_ptr<float>();  // (B, M, H, D) contiguous
  // a pair costs ~ M*S*D*4 flops; keep small problems on one thread
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, M * S * D / 64));
  at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(M * S));
    std::vector<float> qrow(static_cast<size_t>(M * D));
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / H, h = pair % H;
      const float* q = q_base + b * qs.b + h * qs.h;
      const float* k = k_base + b * ks.b + h * ks.h;
      const float* v = v_base + b * vs.b + h * vs.h;
      for (int64_t m = 0; m < M; ++m) {  // scaled queries, contiguous
        float* dst = qrow.data() + m * D;
        const float* src = q + m * qs.m;
        for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
      }
      // 1. scores, one query row at a time (the pair's keys come from L2 after the first row)
      for (int64_t m = 0; m < M; ++m) {
        const float* qm = qrow.data() + m * D;
        float* row = scores.data() + m * S;
        for (int64_t s = 0; s < S; ++s) row[s] = dot<kD>(qm, k + s * ks.m, D);
      }
      // 2. mask and softmax numerators per row
      std::vector<float> inv_sum(static_cast<size_t>(M));
      for (int64_t m = 0; m < M; ++m) {
        float* row = scores.data() + m * S;
        if (mask != nullptr) {
          const MaskT* mrow = mask + b * ms.b + h * ms.h + m * ms.m;
          for (int64_t s = 0; s < S; ++s) {
            if constexpr (std::is_same_v<MaskT, bool>) {
              if (!mrow[s * ms.s]) row[s] = -std::numeric_limits<float>::infinity();
            } else {
              row[s] += mrow[s * ms.s];
            }
          }
        }
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < S; ++s) peak = std::max(peak, row[s]);
        if (peak == -std::numeric_limits<float>::infinity()) {  // everything masked out
          for (int64_t s = 0; s < S; ++s) row[s] = 0.0f;
          inv_sum[m] = 0.0f;
          continue;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t s = 0; s < S; ++s) {
          const float e = vexp(row[s] - peak);
          row[s] = e;
          sum += e;
        }
        inv_sum[m] = 1.0f / sum;
      }
      // 3. weighted sum of values, one query row at a time: its D accumulators stay in registers and
      // the pair's value rows (S x D floats) come from L2 after the first row's pass
      for (int64_t m = 0; m < M; ++m) {
        const float* p = scores.data() + m * S;
        float* o = o_base + ((b * M + m) * H + h) * D;
        weighted_rows<kD>(v, vs.m, p, S, D, inv_sum[m], o);
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

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "decode_attention: CPU tensors only");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat,
              "decode_attention: float32 tensors only");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "decode_attention: expected (B, H, L, D)");
  const int64_t B = query.size(0), H = query.size(1), M = query.size(2), D = query.size(3), S = key.size(2);
  TORCH_CHECK(key.size(0) == B && value.size(0) == B && key.size(1) == H && value.size(1) == H,
              "decode_attention: key/value batch and heads must equal the query's");
  TORCH_CHECK(key.size(3) == D && value.size(3) == D && value.size(2) == S, "decode_attention: shape mismatch");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1,
              "decode_attention: the last dimension must be contiguous");
  auto out = at::empty({B, M, H, D}, query.options());
  if (B * H * M == 0) return out;
  if (!mask.has_value()) {
    dispatch<float>(query, key, value, nullptr, {0, 0, 0, 0}, static_cast<float>(scale), out);
    return out;
  }
  const at::Tensor& m = *mask;
  TORCH_CHECK(m.device().is_cpu() && m.dim() == 4, "decode_attention: the mask must be a 4-D CPU tensor");
  const bool broadcastable = (m.size(0) == 1 || m.size(0) == B) && (m.size(1) == 1 || m.size(1) == H) &&
                             (m.size(2) == 1 || m.size(2) == M) && m.size(3) == S;
  TORCH_CHECK(broadcastable, "decode_attention: the mask must broadcast to (B, H, M, S)");
  const Strides ms = strides_of(m);
  if (m.scalar_type() == at::kBool) {
    dispatch<bool>(query, key, value, m.data_ptr<bool>(), ms, static_cast<float>(scale), out);
  } else {
    TORCH_CHECK(m.scalar_type() == at::kFloat, "decode_attention: the mask must be bool or float32");
    dispatch<float>(query, key, value, m.data_ptr<float>(), ms, static_cast<float>(scale), out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastgen_cpu, lib) {
  lib.def("decode_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastgen_cpu, CPU, lib) { lib.impl("decode_attention", &decode_attention); }
