// fastgen_cpu::log_softmax_top_k — a beam step's candidates without the rows x vocabulary log-probs.
//
// Why: upstream's beam step writes log_softmax(logits) for every row and token, adds each beam's running
// score to all of them and takes the top 2 x beams per input over beams x vocabulary: three passes over a
// rows x vocabulary buffer and a write of it (a small model, 64 rows x 6,000: ~0.4 ms of a ~5 ms step). The
// order within a row is the logits' order (log-softmax subtracts one number per row), so the input's best
// candidates are among each row's best k logits. Here one pass finds a row's best k logits (and its
// maximum), a second sums exp(x - max) with a vectorized polynomial, and only the k candidates per row get
// their log-probs and scores. For the approximate modes only: the polynomial's exp and the summation order
// differ from torch's log_softmax by float rounding (its bits are not upstream's).
//
// log_softmax_top_k(logits (B * M, V) float32 contiguous, scores (B, M) float32, k)
//   -> (values (B, k), beams (B, k) int64, tokens (B, k) int64, ok () bool)
// values[b] descending = (x - max - log(sum exp(x - max))) + scores[b, beam], ties by the lower beam * V + token
// (torch.topk's order on CPU). ok is false when a row holds a NaN or no finite maximum (nothing usable is
// returned then: the caller takes the ordinary path).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "best_k.h"
#include "vec.h"

namespace {

using fastgen_cpu::BestK;
using fastgen_cpu::vexp;

// the row's best k logits (values, indices) and log(sum exp(x - max)); false on a NaN or no finite maximum
bool scan_row(const float* row, int64_t V, BestK& best, float& log_sum) {
  const bool nan = fastgen_cpu::scan_best(row, V, best);
  const float peak = best.values[0];
  if (nan || best.filled == 0 || !std::isfinite(peak)) return false;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < V; ++j) sum += vexp(row[j] - peak);
  log_sum = std::log(sum);
  return true;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> log_softmax_top_k(const at::Tensor& logits,
                                                                             const at::Tensor& scores, int64_t k) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.is_contiguous(),
              "log_softmax_top_k: logits must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(scores.device().is_cpu() && scores.scalar_type() == at::kFloat && scores.dim() == 2,
              "log_softmax_top_k: scores must be a 2-D float32 CPU tensor (inputs, beams)");
  const int64_t B = scores.size(0), M = scores.size(1), V = logits.size(1);
  TORCH_CHECK(logits.size(0) == B * M, "log_softmax_top_k: logits must hold inputs x beams rows");
  TORCH_CHECK(k >= 1 && k <= M * V, "log_softmax_top_k: needs 1 <= k <= beams x vocabulary");
  const at::Tensor beam_scores = scores.contiguous();
  const int64_t per_row = std::min(k, V);  // an input's best k hold at most k of any one row
  std::vector<float> cand_values(B * M * per_row);
  std::vector<int64_t> cand_tokens(B * M * per_row);
  std::vector<float> log_sums(B * M);
  std::atomic<bool> ok{true};
  const float* data = logits.data_ptr<float>();
  at::parallel_for(0, B * M, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      BestK best{cand_values.data() + r * per_row, cand_tokens.data() + r * per_row, per_row};
      if (!scan_row(data + r * V, V, best, log_sums[r]) || best.filled < per_row) ok = false;
    }
  });
  auto values = at::empty({B, k}, logits.options());
  auto beams = at::empty({B, k}, logits.options().dtype(at::kLong));
  auto tokens = at::empty({B, k}, logits.options().dtype(at::kLong));
  if (!ok) return {values, beams, tokens, at::scalar_tensor(false, logits.options().dtype(at::kBool))};
  const float* running = beam_scores.data_ptr<float>();
  float* out_values = values.data_ptr<float>();
  int64_t* out_beams = beams.data_ptr<int64_t>();
  int64_t* out_tokens = tokens.data_ptr<int64_t>();
  std::vector<float> merged_values(k);
  std::vector<int64_t> merged_flat(k);
  for (int64_t b = 0; b < B; ++b) {
    BestK best{merged_values.data(), merged_flat.data(), k};
    for (int64_t m = 0; m < M; ++m) {  // beams in order, each row's candidates descending: ties keep the lower
      const int64_t r = b * M + m;
      const float peak = cand_values[r * per_row];  // the row's maximum: its best logit
      for (int64_t j = 0; j < per_row; ++j) {
        const float log_prob = (cand_values[r * per_row + j] - peak) - log_sums[r];
        best.offer(log_prob + running[b * M + m], m * V + cand_tokens[r * per_row + j]);
      }
    }
    for (int64_t j = 0; j < k; ++j) {
      out_values[b * k + j] = merged_values[j];
      out_beams[b * k + j] = merged_flat[j] / V;
      out_tokens[b * k + j] = merged_flat[j] % V;
    }
  }
  return {values, beams, tokens, at::scalar_tensor(true, logits.options().dtype(at::kBool))};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastgen_cpu, lib) {
  lib.def("log_softmax_top_k(Tensor logits, Tensor scores, int k) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastgen_cpu, CPU, lib) { lib.impl("log_softmax_top_k", &log_softmax_top_k); }
