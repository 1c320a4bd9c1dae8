// Vectors of floats for fastgen's CPU kernels, in GCC/Clang vector extensions: the compiler maps
// them onto the CPU it builds for (-march=native: AVX-512 zmm or AVX2 ymm registers).
#pragma once

#include <cstdint>

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

}  // namespace fastgen_cpu
