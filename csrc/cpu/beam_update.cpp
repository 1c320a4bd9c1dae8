// fastgen_cpu::beam_update_ — the bookkeeping of one beam-search step after its top-k, in one call.
//
// Why: on a small model most of a CPU beam step is not the decoder. After the top 2M candidates of an
// input are known, Transformers' loop (5.24 `_beam_search`, steps c-f) runs ~40 small torch ops per
// step: the candidates' sequences and beam indices gathered, the stopping criteria, the running beams
// chosen, the finished beams merged, the early-stop heuristic. Each costs a dispatch, for a few hundred
// integers. This does the same arithmetic in plain loops, in upstream's order and float32 rounding, and
// calls torch.topk itself wherever upstream does, so ties break as upstream's do: the results are
// upstream's bit for bit (tests/optimizer/test_beam_update.py compares every buffer, every step).
//
// The stopping criteria it knows are the length limit (`hits_max`: every candidate of this step reaches
// it) and end-of-sequence tokens (`eos`); a caller with other criteria runs upstream's ops instead.
//
// Shapes (B inputs, M beams, K = candidates per input, L = max length, G = L - prompt):
//   topk_scores (B, K) f32, topk_beams (B, K) i64, topk_tokens (B, K) i64: this step's candidates
//   running_sequences (B, M, L) i64, running_scores (B, M) f32, running_indices (B, M, G) i32,
//   sequences (B, M, L) i64, scores (B, M) f32, indices (B, M, G) i32, finished (B, M) bool,
//   unsatisfied (B, 1) bool: upstream's running and finished state, updated in place
//   active (B,) i64: each input's index in the original batch (the beam indices carry it)
// Returns the rows the cache is reordered by, (B * M) i64, local to the current batch, and which candidates
// hit a stopping criterion, (B, K) bool (upstream's next_token_hits_stopping_criteria).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/topk.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

constexpr float kMinus = -1.0e9f;  // upstream's "-1.0e9" multiplied by a 0/1 float32 mask: -1e9 or -0.0

inline float masked(bool on) { return on ? kMinus : -0.0f; }

void check(const at::Tensor& t, at::ScalarType dtype, int64_t dim, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == dim && t.is_contiguous(),
              "beam_update_: ", name, " must be a contiguous CPU tensor of ", dim, " dims and dtype ", dtype);
}

std::tuple<at::Tensor, at::Tensor> beam_update_(const at::Tensor& topk_scores, const at::Tensor& topk_beams, const at::Tensor& topk_tokens,
                        at::Tensor running_sequences, at::Tensor running_scores, at::Tensor running_indices,
                        at::Tensor sequences, at::Tensor scores, at::Tensor indices, at::Tensor finished,
                        at::Tensor unsatisfied, const std::optional<at::Tensor>& eos, bool hits_max, int64_t cur_len,
                        int64_t prompt_len, int64_t max_length, double length_penalty, int64_t early_stopping,
                        const at::Tensor& active) {
  check(topk_scores, at::kFloat, 2, "topk_scores");
  check(topk_beams, at::kLong, 2, "topk_beams");
  check(topk_tokens, at::kLong, 2, "topk_tokens");
  check(running_sequences, at::kLong, 3, "running_sequences");
  check(running_scores, at::kFloat, 2, "running_scores");
  check(running_indices, at::kInt, 3, "running_indices");
  check(sequences, at::kLong, 3, "sequences");
  check(scores, at::kFloat, 2, "scores");
  check(indices, at::kInt, 3, "indices");
  check(finished, at::kBool, 2, "finished");
  check(unsatisfied, at::kBool, 2, "unsatisfied");
  check(active, at::kLong, 1, "active");
  const int64_t B = running_sequences.size(0), M = running_sequences.size(1), L = running_sequences.size(2);
  const int64_t K = topk_scores.size(1), G = running_indices.size(2);
  const int64_t length = cur_len + 1, generated = cur_len + 1 - prompt_len;
  TORCH_CHECK(topk_scores.size(0) == B && K >= M && length <= L && generated >= 1 && generated <= G,
              "beam_update_: shapes do not agree");
  TORCH_CHECK(early_stopping >= 0 && early_stopping <= 2, "beam_update_: early_stopping is 0, 1 or 2 (never)");
  std::vector<int64_t> eos_ids;
  if (eos.has_value() && eos->defined()) {
    at::Tensor e = eos->to(at::kLong).contiguous();
    eos_ids.assign(e.data_ptr<int64_t>(), e.data_ptr<int64_t>() + e.numel());
  }
  const float* cand = topk_scores.data_ptr<float>();
  const int64_t* beams = topk_beams.data_ptr<int64_t>();
  const int64_t* tokens = topk_tokens.data_ptr<int64_t>();
  int64_t* run_seq = running_sequences.data_ptr<int64_t>();
  float* run_score = running_scores.data_ptr<float>();
  int32_t* run_idx = running_indices.data_ptr<int32_t>();
  int64_t* seq = sequences.data_ptr<int64_t>();
  float* score = scores.data_ptr<float>();
  int32_t* idx = indices.data_ptr<int32_t>();
  bool* done = finished.data_ptr<bool>();
  bool* open = unsatisfied.data_ptr<bool>();
  const int64_t* origin = active.data_ptr<int64_t>();

  // the candidates' sequences and beam indices (upstream's topk_sequences / topk_beam_indices), from the old state
  std::vector<int64_t> cand_seq(B * K * length);
  std::vector<int32_t> cand_idx(B * K * generated);
  auto hit_flags = at::empty({B, K}, finished.options());
  bool* hits = hit_flags.data_ptr<bool>();
  auto running = at::empty({B, K}, topk_scores.options());  // topk_running_log_probs
  auto merged = at::empty({B, M + K}, topk_scores.options());
  float* run_cand = running.data_ptr<float>();
  float* merge = merged.data_ptr<float>();
  const float divisor = static_cast<float>(std::pow(static_cast<double>(generated), length_penalty));
  for (int64_t b = 0; b < B; ++b) {
    bool all_done = true;
    for (int64_t m = 0; m < M; ++m) all_done = all_done && done[b * M + m];
    const bool full = all_done && early_stopping == 1;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t c = b * K + k, parent = beams[c];
      std::memcpy(&cand_seq[c * length], run_seq + (b * M + parent) * L, cur_len * sizeof(int64_t));
      cand_seq[c * length + cur_len] = tokens[c];
      std::memcpy(&cand_idx[c * generated], run_idx + (b * M + parent) * G, (generated - 1) * sizeof(int32_t));
      cand_idx[c * generated + generated - 1] = static_cast<int32_t>(parent + origin[b] * M);
      bool hit = hits_max;
      for (int64_t e : eos_ids) hit = hit || tokens[c] == e;
      hits[c] = hit;
      run_cand[c] = cand[c] + masked(hit);
      // upstream's _update_finished_beams: candidate scores, then its three -1e9 terms in its order
      float s = cand[c] / divisor;
      s += masked(full);
      s += masked(!open[b]);
      s += masked(!(hit && k < M));
      merge[b * (M + K) + M + k] = s;
    }
    for (int64_t m = 0; m < M; ++m) merge[b * (M + K) + m] = score[b * M + m];
  }
  const at::Tensor next = std::get<1>(at::topk(running, M)).contiguous();      // the running beams' candidates
  const at::Tensor kept = std::get<1>(at::topk(merged, M)).contiguous();       // the finished beams after merging
  const int64_t* next_k = next.data_ptr<int64_t>();
  const int64_t* kept_k = kept.data_ptr<int64_t>();
  auto reorder = at::empty({B * M}, active.options());
  int64_t* rows = reorder.data_ptr<int64_t>();
  std::vector<int64_t> old_seq(M * length);
  std::vector<int32_t> old_idx(M * generated);
  std::vector<char> old_done(M);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t m = 0; m < M; ++m) {  // running state: the best M candidates that did not stop
      const int64_t c = b * K + next_k[b * M + m];
      std::memcpy(run_seq + (b * M + m) * L, &cand_seq[c * length], length * sizeof(int64_t));
      std::memcpy(run_idx + (b * M + m) * G, &cand_idx[c * generated], generated * sizeof(int32_t));
      run_score[b * M + m] = run_cand[c];
      rows[b * M + m] = b * M + beams[c];
    }
    for (int64_t m = 0; m < M; ++m) {  // finished state: the best M of the old finished beams and the new
      std::memcpy(&old_seq[m * length], seq + (b * M + m) * L, length * sizeof(int64_t));
      std::memcpy(&old_idx[m * generated], idx + (b * M + m) * G, generated * sizeof(int32_t));
      old_done[m] = done[b * M + m];
    }
    for (int64_t m = 0; m < M; ++m) {
      const int64_t j = kept_k[b * M + m];
      const int64_t c = b * K + (j - M);
      const bool old = j < M;
      std::memcpy(seq + (b * M + m) * L, old ? &old_seq[j * length] : &cand_seq[c * length], length * sizeof(int64_t));
      std::memcpy(idx + (b * M + m) * G, old ? &old_idx[j * generated] : &cand_idx[c * generated],
                  generated * sizeof(int32_t));
      score[b * M + m] = merge[b * (M + K) + j];
      done[b * M + m] = old ? old_done[j] : (hits[c] && (j - M) < M);
    }
  }
  // upstream's _check_early_stop_heuristic at the new length (cur_len + 1)
  const int64_t best_length = (early_stopping == 2 && length_penalty > 0.0) ? max_length - prompt_len : generated;
  const float best_divisor = static_cast<float>(std::pow(static_cast<double>(best_length), length_penalty));
  for (int64_t b = 0; b < B; ++b) {
    const float best = run_score[b * M] / best_divisor;
    float worst = score[b * M];
    for (int64_t m = 1; m < M; ++m) worst = std::fmin(worst, score[b * M + m]);
    bool better = false;
    for (int64_t m = 0; m < M; ++m) better = better || best > (done[b * M + m] ? worst : kMinus);
    open[b] = open[b] && better;
  }
  return {reorder, hit_flags};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastgen_cpu, lib) {
  lib.def(
      "beam_update_(Tensor topk_scores, Tensor topk_beams, Tensor topk_tokens, Tensor(a!) running_sequences, "
      "Tensor(b!) running_scores, Tensor(c!) running_indices, Tensor(d!) sequences, Tensor(e!) scores, "
      "Tensor(f!) indices, Tensor(g!) finished, Tensor(h!) unsatisfied, Tensor? eos, bool hits_max, int cur_len, "
      "int prompt_len, int max_length, float length_penalty, int early_stopping, Tensor active) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastgen_cpu, CPU, lib) { lib.impl("beam_update_", &beam_update_); }
