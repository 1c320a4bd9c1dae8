// Vectors of floats for fastgen's CPU kernels, in GCC/Clang vector extensions: the compiler maps
// them onto the CPU it builds for (-march=native: AVX-512 zmm or AVX2 ymm registers).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace fastgen_cpu {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
// kLanes floats; aligned(4): loads and stores through it may be unaligned
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t)), aligned(4)));

inline vfloat load(const float* p) { return *reinterpret_cast<const vfloat*>(p); }
inline void store(float* p, vfloat v) { *reinterpret_cast<vfloat*>(p) = v; }

// Bit j set where x[j] > t (ordered: a NaN lane never is): a top-k scan tests each vector against its
// threshold and offers only the lanes above it, instead of every element of a block whose maximum passed.
inline uint32_t greater_mask(vfloat x, float t) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(reinterpret_cast<__m512>(x), _mm512_set1_ps(t), _CMP_GT_OQ);
#elif defined(__AVX__)
  const __m256 above = _mm256_cmp_ps(reinterpret_cast<__m256>(x), _mm256_set1_ps(t), _CMP_GT_OQ);
  return static_cast<uint32_t>(_mm256_movemask_ps(above));
#else
  uint32_t mask = 0;
  for (int j = 0; j < kLanes; ++j) mask |= static_cast<uint32_t>(x[j] > t) << j;
  return mask;
#endif
}

// exp with ~1 ulp error (Cody-Waite reduction, Cephes' polynomial), written so the compiler vectorizes
// it in a loop (libm's expf is a call per element); below -87.3 (and -inf) it gives 0.
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

// erf with absolute error < 1.5e-7 (Abramowitz & Stegun 7.1.26), vectorizable like vexp
inline float verf(float x) {
  const float a = std::fabs(x);
  const float t = 1.0f / (1.0f + 0.3275911f * a);
  const float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
  const float y = 1.0f - poly * vexp(-a * a);
  return std::copysign(y, x);
}

}  // namespace fastgen_cpu
