// Beam top-k retrieval (Amun's fused softmax + k-best, Algorithm 4; LightSeq's retrieve step, §2.2):
// one block per (hypothesis row, vocabulary chunk). The block stages the chunk's banned-masked
// logits in shared memory while reducing the chunk's (max, sum of exp) online, then extracts the k
// best entries in k block-wide argmax rounds (ties: unbanned first, then smaller token id). The merge across chunks and
// beams runs in torch on these few candidates (fastgen/ops/beam_topk.py).
//
// Plain CUDA (no torch headers), like ngram.cu; bindings.cpp checks the tensors.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "beam_topk.h"

namespace fastgen {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxChunk = 8192;
constexpr int kNone = 0x7fffffff;  // index of "no candidate": loses every comparison

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// (max, sum of exp(x - max)) pairs; an empty side is (-inf, 0).
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
  const float top = fmaxf(m, m2);
  if (top == -INFINITY) return;  // both empty or all -inf: stays (-inf, 0)
  s = s * expf(m - top) + s2 * expf(m2 - top);
  m = top;
}

// Larger value first, then unbanned before banned (they tie only at -inf, which matters when the row's
// log-probs are NaN), then smaller index. `i` carries the banned flag in bit 30 (chunks are < 2^30).
constexpr int kBannedBit = 1 << 30;
__device__ __forceinline__ bool better(float v, int i, float v2, int i2) { return v > v2 || (v == v2 && i < i2); }

template <typename T>
__global__ void __launch_bounds__(kThreads) retrieve_kernel(BeamTopkArgs a) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  float* values = reinterpret_cast<float*>(shared_raw);
  unsigned char* taken = shared_raw + static_cast<size_t>(a.chunk) * sizeof(float);
  __shared__ float red_m[kWarps];
  __shared__ float red_s[kWarps];
  __shared__ int red_i[kWarps];

  const int64_t row = blockIdx.x;
  const int64_t chunk = blockIdx.y;
  const int64_t start = chunk * a.chunk;
  const int len = static_cast<int>(a.vocab - start < a.chunk ? a.vocab - start : a.chunk);
  const T* logits = static_cast<const T*>(a.logits) + row * a.logits_stride + start;
  const uint8_t* mask = a.mask != nullptr ? a.mask + row * a.mask_stride + start : nullptr;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;

  float m = -INFINITY;
  float s = 0.f;
  for (int j = threadIdx.x; j < len; j += kThreads) {
    const float x = to_float(logits[j]);
    if (x <= m) {
      if (x != -INFINITY) s += expf(x - m);
    } else {
      s = (m == -INFINITY ? 0.f : s * expf(m - x)) + 1.f;  // a new max rescales the running sum
      m = x;
    }
    const bool banned = mask != nullptr && mask[j] != 0;
    values[j] = banned ? -INFINITY : x;
    taken[j] = banned ? 2 : 0;  // bit 0: already picked, bit 1: banned
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const float m2 = __shfl_down_sync(0xffffffffu, m, offset);
    const float s2 = __shfl_down_sync(0xffffffffu, s, offset);
    combine(m, s, m2, s2);
  }
  if (lane == 0) {
    red_m[warp] = m;
    red_s[warp] = s;
  }
  __syncthreads();
  const int64_t slot = row * a.num_chunks + chunk;
  if (threadIdx.x == 0) {
    float bm = red_m[0], bs = red_s[0];
    for (int w = 1; w < kWarps; ++w) combine(bm, bs, red_m[w], red_s[w]);
    a.chunk_max[slot] = bm;
    a.chunk_sum[slot] = bs;
  }
  __syncthreads();  // the reduction slots are reused below

  float* out_values = a.cand_values + slot * a.k;
  int64_t* out_tokens = a.cand_tokens + slot * a.k;
  for (int round = 0; round < a.k; ++round) {
    float bv = -INFINITY;
    int bi = kNone;
    for (int j = threadIdx.x; j < len; j += kThreads) {
      const int key = (taken[j] & 2) ? (j | kBannedBit) : j;
      if (!(taken[j] & 1) && better(values[j], key, bv, bi)) {
        bv = values[j];
        bi = key;
      }
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      const float v2 = __shfl_down_sync(0xffffffffu, bv, offset);
      const int i2 = __shfl_down_sync(0xffffffffu, bi, offset);
      if (better(v2, i2, bv, bi)) {
        bv = v2;
        bi = i2;
      }
    }
    if (lane == 0) {
      red_m[warp] = bv;
      red_i[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kWarps; ++w) {
        if (better(red_m[w], red_i[w], bv, bi)) {
          bv = red_m[w];
          bi = red_i[w];
        }
      }
      const bool found = bi != kNone;
      const int j = bi & (kBannedBit - 1);
      out_values[round] = found ? bv : -INFINITY;
      out_tokens[round] = found ? start + j : -1;
      if (found) taken[j] |= 1;
    }
    __syncthreads();  // `taken` and the reduction slots are reused next round
  }
}

template <typename T>
cudaError_t launch_typed(const BeamTopkArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned int>(a.rows), static_cast<unsigned int>(a.num_chunks));
  const size_t shared_bytes = static_cast<size_t>(a.chunk) * (sizeof(float) + 1);
  retrieve_kernel<T><<<grid, kThreads, shared_bytes, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t beam_topk_retrieve_launch(const BeamTopkArgs& args, cudaStream_t stream) {
  if (args.rows <= 0 || args.vocab <= 0) return cudaSuccess;
  if (args.rows > 0x7fffffff || args.num_chunks > 65535 || args.k < 1 || args.chunk < 1 ||
      args.chunk > kMaxChunk || args.vocab > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  switch (args.logits_type) {
    case ScoreType::kFloat32:
      return launch_typed<float>(args, stream);
    case ScoreType::kFloat16:
      return launch_typed<__half>(args, stream);
    case ScoreType::kBFloat16:
      return launch_typed<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace fastgen
