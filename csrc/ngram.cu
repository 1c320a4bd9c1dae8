// N-gram blocking kernel (FastSeq Algorithm 1, generalised): one block per hypothesis row, the
// row's tokens staged in shared memory, one thread per candidate n-gram start, looping when the
// row has more windows than the block has threads (so no 1024-thread ceiling).
//
// Plain CUDA on purpose: no torch/ATen/c10 includes, so `nvcc -c` works on machines whose torch
// has no CUDA headers; bindings.cpp checks the tensors and calls ngram_ban_launch().

#include <cuda_runtime.h>

#include <cstdint>

#include "ngram.h"

namespace fastgen {
namespace {

// Default dynamic shared memory a block may use without an opt-in; longer rows read global memory.
constexpr int64_t kMaxSharedBytes = 48 * 1024;
constexpr int kMaxThreads = 512;

// Bit patterns of -inf, written through an unsigned type of the score's width (no half headers needed).
constexpr uint32_t kNegInfFloat32 = 0xff800000u;
constexpr uint16_t kNegInfFloat16 = 0xfc00u;
constexpr uint16_t kNegInfBFloat16 = 0xff80u;

template <typename T, typename S, bool kShared>
__global__ void ban_ngrams_kernel(const T* __restrict__ hay, int64_t hay_stride, int64_t hay_width,
                                  const T* __restrict__ tokens, int64_t tokens_stride, int64_t tokens_width,
                                  const int64_t* __restrict__ lengths, int64_t length_scalar,
                                  S* __restrict__ scores, int64_t scores_stride, int64_t vocab, int n,
                                  int64_t beams, bool decoder, S neg_inf) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const int64_t row = blockIdx.x;
  int64_t length = lengths != nullptr ? lengths[row] : length_scalar;
  length = length < 0 ? 0 : (length > tokens_width ? tokens_width : length);
  const int64_t prefix_start = length - (n - 1);
  const int64_t hay_len = decoder ? length : hay_width;
  const int64_t windows = hay_len - n + 1;
  // Both conditions are the same for every thread of the block, so returning before
  // __syncthreads() is safe.
  if (prefix_start < 0 || windows <= 0) return;

  const T* hay_row = hay + (row / beams) * hay_stride;
  const T* prefix = tokens + row * tokens_stride + prefix_start;
  if (kShared) {
    // Each token is read by up to n windows: load the row once, coalesced.
    T* staged = reinterpret_cast<T*>(shared_raw);
    for (int64_t j = threadIdx.x; j < hay_len; j += blockDim.x) staged[j] = hay_row[j];
    if (decoder) {
      prefix = staged + prefix_start;  // the prefix is the row's own tail
    } else {
      T* staged_prefix = staged + hay_width;
      for (int64_t j = threadIdx.x; j < n - 1; j += blockDim.x) staged_prefix[j] = prefix[j];
      prefix = staged_prefix;
    }
    __syncthreads();
    hay_row = staged;
  }

  S* score_row = scores + row * scores_stride;
  for (int64_t i = threadIdx.x; i < windows; i += blockDim.x) {
    bool match = true;
    for (int k = 0; k < n - 1; ++k) {
      if (hay_row[i + k] != prefix[k]) {
        match = false;
        break;
      }
    }
    if (match) {
      // Racing writes of one token all store the same value; ids outside [0, V) cannot be sampled.
      const int64_t banned = static_cast<int64_t>(hay_row[i + n - 1]);
      if (banned >= 0 && banned < vocab) score_row[banned] = neg_inf;
    }
  }
}

template <typename T, typename S>
cudaError_t launch_typed(const NgramBanArgs& a, S neg_inf, cudaStream_t stream) {
  const int64_t max_windows = (a.decoder ? a.tokens_width : a.hay_width) - a.n + 1;
  if (a.rows <= 0 || max_windows <= 0) return cudaSuccess;
  const int64_t warps = (max_windows + 31) / 32;
  const int threads = static_cast<int>(warps * 32 < kMaxThreads ? warps * 32 : kMaxThreads);
  const int64_t shared_bytes =
      (a.decoder ? a.tokens_width : a.hay_width + a.n - 1) * static_cast<int64_t>(sizeof(T));
  const auto* hay = static_cast<const T*>(a.hay);
  const auto* tokens = static_cast<const T*>(a.tokens);
  auto* scores = static_cast<S*>(a.scores);
  const dim3 grid(static_cast<unsigned int>(a.rows));
  if (shared_bytes <= kMaxSharedBytes) {
    ban_ngrams_kernel<T, S, true><<<grid, threads, static_cast<size_t>(shared_bytes), stream>>>(
        hay, a.hay_stride, a.hay_width, tokens, a.tokens_stride, a.tokens_width, a.lengths, a.length_scalar,
        scores, a.scores_stride, a.vocab, a.n, a.beams, a.decoder, neg_inf);
  } else {
    ban_ngrams_kernel<T, S, false><<<grid, threads, 0, stream>>>(
        hay, a.hay_stride, a.hay_width, tokens, a.tokens_stride, a.tokens_width, a.lengths, a.length_scalar,
        scores, a.scores_stride, a.vocab, a.n, a.beams, a.decoder, neg_inf);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_for_tokens(const NgramBanArgs& a, cudaStream_t stream) {
  switch (a.score_type) {
    case ScoreType::kFloat32:
      return launch_typed<T, uint32_t>(a, kNegInfFloat32, stream);
    case ScoreType::kFloat16:
      return launch_typed<T, uint16_t>(a, kNegInfFloat16, stream);
    case ScoreType::kBFloat16:
      return launch_typed<T, uint16_t>(a, kNegInfBFloat16, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t ngram_ban_launch(const NgramBanArgs& args, cudaStream_t stream) {
  if (args.rows > 0x7fffffff || args.n < 1 || args.beams < 1) return cudaErrorInvalidValue;
  if (args.token_bytes == 4) return launch_for_tokens<int32_t>(args, stream);
  if (args.token_bytes == 8) return launch_for_tokens<int64_t>(args, stream);
  return cudaErrorInvalidValue;
}

int ngram_cuda_runtime_version() { return CUDART_VERSION; }

}  // namespace fastgen
