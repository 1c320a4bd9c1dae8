// Beam top-k retrieval: the C interface between the plain-CUDA kernel (beam_topk.cu) and bindings.cpp.
// Semantics and buffer layouts: fastgen.ops.beam_topk (_run_kernel, _merge_candidates).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "ngram.h"  // ScoreType

namespace fastgen {

struct BeamTopkArgs {
  const void* logits;      // N×V, rows contiguous; read once, accumulated in float32
  int64_t logits_stride;   // elements between rows
  ScoreType logits_type;
  const uint8_t* mask;     // nonzero = banned (after the normalisation); nullptr: no bans
  int64_t mask_stride;     // 0: one V-long mask shared by every row
  int64_t rows;
  int64_t vocab;
  int k;                   // candidates kept per chunk
  int chunk;               // vocabulary entries per block (<= kMaxChunk)
  int64_t num_chunks;      // ceil(vocab / chunk)
  float* cand_values;      // N×num_chunks×k masked logits, best first (-inf where absent)
  int64_t* cand_tokens;    // N×num_chunks×k token ids (-1 where absent)
  float* chunk_max;        // N×num_chunks max logit of the chunk (bans ignored)
  float* chunk_sum;        // N×num_chunks sum of exp(logit - chunk max), 0 for an all -inf chunk
};

// Enqueues the kernel on `stream`; returns the launch error (cudaSuccess when nothing to do).
cudaError_t beam_topk_retrieve_launch(const BeamTopkArgs& args, cudaStream_t stream);

}  // namespace fastgen
