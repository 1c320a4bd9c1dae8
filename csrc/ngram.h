// N-gram blocking: the C interface between the plain-CUDA kernel (ngram.cu) and bindings.cpp.
// Semantics: fastgen.ops.ngram.ban_repeated_ngrams / ban_encoder_ngrams (this header repeats none of it).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace fastgen {

enum class ScoreType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct NgramBanArgs {
  const void* hay;          // tokens searched for windows: the hypotheses themselves, or the B×S input ids
  int64_t hay_stride;       // elements between rows
  int64_t hay_width;
  const void* tokens;       // N×L hypotheses; the prefix is the last n-1 of each row's valid tokens
  int64_t tokens_stride;
  int64_t tokens_width;
  int token_bytes;          // 4 (int32) or 8 (int64); hay and tokens share it
  const int64_t* lengths;   // N valid-token counts, or nullptr to use length_scalar for every row
  int64_t length_scalar;
  void* scores;             // N×V, rows contiguous; banned entries become -inf, nothing else is written
  int64_t scores_stride;
  int64_t vocab;
  ScoreType score_type;
  int64_t rows;
  int n;
  int64_t beams;            // hypothesis row r searches hay row r / beams
  bool decoder;             // hay is tokens: windows end at the row's valid length, not at hay_width
};

// Enqueues the kernel on `stream`; returns the launch error (cudaSuccess when nothing to do).
cudaError_t ngram_ban_launch(const NgramBanArgs& args, cudaStream_t stream);

// CUDART_VERSION the kernels were compiled against (for build reports).
int ngram_cuda_runtime_version();

}  // namespace fastgen
