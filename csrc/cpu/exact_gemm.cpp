// fastgen_cpu::ordered_linear — x @ w.T (+ bias) with a fixed summation order per output element.
//
// Why: the exact mode must return upstream's bits, and upstream's bits are an order of additions,
// not a library. On the CPUs seen so far MKL's F.linear computes every output element as
//
//     c = bias[n]                                   (bias_last = 0; no bias: c = s of the first block)
//     for each block of `block` consecutive k:      (k = 0..block-1, block..2*block-1, ...)
//         s = 0; for k in the block: s = fma(x[m, k], w[n, k], s)    (one rounding per step)
//         c = c + s
//     (bias_last = 1: c = c + bias[n] at the end)
//
// Everything else — vector width, tiling, packing, threads — is free, so this kernel computes the same
// chains with SIMD: up to 16 (AVX2: 8) rows, lanes run the rows side by side for one column n, each
// lane its own sequential chain, a register tile holding kCols columns, w read in place (row-major
// (N, K): a column's k run is contiguous, broadcast per step) — a decode step's product needs no copy;
// more rows: lanes run consecutive columns of a panel of w packed k-major, x packed in row tiles
// (the usual BLAS layout). Threads split columns or rows, never k. Measured on an Intel Xeon (Emerald
// Rapids, AVX-512, one core, a loaded machine): 16 x 768 -> 3072 and the 16-row vocabulary projection
// 1.1-1.4x MKL, 16 x 768 -> 768 about even; 1024-row products 0.5-0.7x MKL (there the calibration keeps
// MKL). Nothing is assumed at run time: fastgen.ops.linear
// keeps this kernel for a shape only where it returned torch.equal results to F.linear on the real
// input, and is faster.
//
// Arithmetic is done with FMA/add intrinsics (builtins the compiler cannot reassociate, whatever the
// build's fast-math flags); the scalar path uses std::fma.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRows = 1;    // row vectors per tile
constexpr int kCols = 12;  // 12 block sums + 12 totals + 1 input: 25 of 32 zmm registers
constexpr int kPanelRows = 8, kPanelVecs = 3;  // 24 block sums + 3 weights + 1 input: 28 of 32 zmm
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset1(float v) { return _mm512_set1_ps(v); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
constexpr int kRows = 1;
constexpr int kCols = 6;  // 6 + 6 + 1 of 16 ymm registers
constexpr int kPanelRows = 6, kPanelVecs = 2;  // 12 block sums + 2 weights + 1 input of 16 ymm
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset1(float v) { return _mm256_set1_ps(v); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
// a + b as fma(a, 1, b): one rounding, and a builtin the vectorizer's reassociation leaves alone
inline V vadd(V a, V b) { return _mm256_fmadd_ps(a, _mm256_set1_ps(1.0f), b); }
#else
constexpr int kLanes = 1;
constexpr int kRows = 1;
constexpr int kCols = 4;
constexpr int kPanelRows = 2, kPanelVecs = 4;
using V = float;
inline V vzero() { return 0.0f; }
inline V vset1(float v) { return v; }
inline V vload(const float* p) { return *p; }
inline void vstore(float* p, V v) { *p = v; }
inline V vfma(V a, V b, V c) { return std::fma(a, b, c); }
inline V vadd(V a, V b) { return std::fma(a, 1.0f, b); }
#endif

enum BiasAt : int64_t { kBiasFirst = 0, kBiasLast = 1 };

// One tile: kLanes rows (xt: this tile's input, k-major, kLanes floats per k) by `cols` <= kCols
// columns n0.. of w; writes the totals to out (cols x kLanes, column-major in lanes).
// w(j, k) = w[j * col_stride + k * k_stride] (the weight in place: col_stride K, k_stride 1).
template <int kC>
void tile(const float* xt, const float* w, int64_t col_stride, int64_t k_stride, int64_t K, int64_t n0,
          const float* bias, int64_t block, bool bias_last, float* out) {
  constexpr int R = kRows;
  V c[R][kC];
  V s[R][kC];
  for (int64_t k0 = 0; k0 < K; k0 += block) {
    const int64_t k1 = std::min(K, k0 + block);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kC; ++j) s[r][j] = vzero();
    for (int64_t k = k0; k < k1; ++k) {
      V xv[R];
      for (int r = 0; r < R; ++r) xv[r] = vload(xt + (k * R + r) * kLanes);
      for (int j = 0; j < kC; ++j) {
        const V wv = vset1(w[j * col_stride + k * k_stride]);
        for (int r = 0; r < R; ++r) s[r][j] = vfma(xv[r], wv, s[r][j]);
      }
    }
    for (int r = 0; r < R; ++r) {
      if (k0 == 0) {
        for (int j = 0; j < kC; ++j)
          c[r][j] = (bias != nullptr && !bias_last) ? vadd(vset1(bias[n0 + j]), s[r][j]) : s[r][j];
      } else {
        for (int j = 0; j < kC; ++j) c[r][j] = vadd(c[r][j], s[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if (K == 0) {
      for (int j = 0; j < kC; ++j) c[r][j] = (bias != nullptr && !bias_last) ? vset1(bias[n0 + j]) : vzero();
    }
    if (bias != nullptr && bias_last) {
      for (int j = 0; j < kC; ++j) c[r][j] = vadd(c[r][j], vset1(bias[n0 + j]));
    }
    for (int j = 0; j < kC; ++j) vstore(out + (j * R + r) * kLanes, c[r][j]);
  }
}

using TileFn = void (*)(const float*, const float*, int64_t, int64_t, int64_t, int64_t, const float*, int64_t, bool,
                        float*);

template <int... kC>
constexpr TileFn pick_tile(int cols, std::integer_sequence<int, kC...>) {
  TileFn fns[] = {&tile<kC + 1>...};
  return fns[cols - 1];
}


// Many rows: SIMD lanes run kPanelVecs * kLanes consecutive columns n (a panel of the weight, packed
// k-major), each x[m, k] is broadcast once for all of them, kR rows per register tile; one k block at a
// time (the running totals c live in y between blocks, so all registers go to block sums). As in any
// BLAS, both operands are packed per call: the weight into panels, a chunk of rows of x per k block
// into tiles (k-major), so the micro-kernel reads two sequential streams that stay in L1/L2.
constexpr int kPanel = kPanelVecs * kLanes;  // columns per panel
constexpr int64_t kChunkTiles = 8;            // row tiles per chunk of x packed at a time

// x(r, k) = xa[k * kPanelRows + r]; w(k, j) = panel[k * kPanel + j]; k in [0, kb)
template <int kR>
void panel_block(const float* xa, const float* panel, int64_t kb, int cols, const float* bpad, bool first_block,
                 bool last_block, bool bias_last, float* y, int64_t N) {
  constexpr int C = kPanelVecs;
  V s[kR][C];
  for (int r = 0; r < kR; ++r)
    for (int v = 0; v < C; ++v) s[r][v] = vzero();
  for (int64_t k = 0; k < kb; ++k) {
    V wv[C];
    for (int v = 0; v < C; ++v) wv[v] = vload(panel + k * kPanel + v * kLanes);
    for (int r = 0; r < kR; ++r) {
      const V xv = vset1(xa[k * kPanelRows + r]);
      for (int v = 0; v < C; ++v) s[r][v] = vfma(xv, wv[v], s[r][v]);
    }
  }
  for (int r = 0; r < kR; ++r) {
    alignas(64) float out[kPanel];
    float* dst = y + r * N;
    if (!first_block || (bpad != nullptr && !bias_last)) {  // c = c + s (c: the totals so far, or the bias)
      alignas(64) float prev[kPanel] = {};
      if (!first_block) {
        for (int j = 0; j < cols; ++j) prev[j] = dst[j];
      } else {
        for (int j = 0; j < kPanel; ++j) prev[j] = bpad[j];
      }
      for (int v = 0; v < C; ++v) s[r][v] = vadd(vload(prev + v * kLanes), s[r][v]);
    }
    if (last_block && bpad != nullptr && bias_last)
      for (int v = 0; v < C; ++v) s[r][v] = vadd(s[r][v], vload(bpad + v * kLanes));
    for (int v = 0; v < C; ++v) vstore(out + v * kLanes, s[r][v]);
    for (int j = 0; j < cols; ++j) dst[j] = out[j];
  }
}

using PanelFn = void (*)(const float*, const float*, int64_t, int, const float*, bool, bool, bool, float*, int64_t);

template <int... kR>
constexpr PanelFn pick_panel(int rows, std::integer_sequence<int, kR...>) {
  PanelFn fns[] = {&panel_block<kR + 1>...};
  return fns[rows - 1];
}

// Rows [m0, m1) of x, k in [k0, k1), packed as tiles of kPanelRows rows: tile t at xa + t * kb * kPanelRows.
void pack_rows(const float* xp, int64_t K, int64_t m0, int64_t m1, int64_t k0, int64_t k1, float* xa) {
  const int64_t kb = k1 - k0;
  for (int64_t t = 0; m0 + t * kPanelRows < m1; ++t) {
    float* dst = xa + t * kb * kPanelRows;
    for (int r = 0; r < kPanelRows; ++r) {
      const int64_t m = m0 + t * kPanelRows + r;
      if (m >= m1) {
        for (int64_t k = 0; k < kb; ++k) dst[k * kPanelRows + r] = 0.0f;
        continue;
      }
      const float* src = xp + m * K + k0;
      for (int64_t k = 0; k < kb; ++k) dst[k * kPanelRows + r] = src[k];
    }
  }
}

// One chunk of rows [m0, m1) against panels [p0, p1) for the k block [k0, k1) (xa: the chunk, packed).
void chunk_panels(const float* xa, const float* wpk, const float* b, float* yp, int64_t m0, int64_t m1, int64_t K,
                  int64_t N, int64_t k0, int64_t k1, int64_t p0, int64_t p1, bool bias_last) {
  const int64_t kb = k1 - k0;
  alignas(64) float bpad[kPanel];
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * kPanel;
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - n0));
    std::fill(bpad, bpad + kPanel, 0.0f);
    if (b != nullptr) std::copy(b + n0, b + n0 + cols, bpad);
    const float* panel = wpk + p * K * kPanel + k0 * kPanel;
    for (int64_t m = m0, t = 0; m < m1; m += kPanelRows, ++t) {
      const int rows = static_cast<int>(std::min<int64_t>(kPanelRows, m1 - m));
      pick_panel(rows, std::make_integer_sequence<int, kPanelRows>{})(
          xa + t * kb * kPanelRows, panel, kb, cols, b != nullptr ? bpad : nullptr, k0 == 0, k1 == K, bias_last,
          yp + m * N + n0, N);
    }
  }
}

void panel_linear(const float* xp, const float* wp, const float* b, float* yp, int64_t M, int64_t K, int64_t N,
                  int64_t block, bool bias_last) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  if (K == 0) {  // no products: the bias (or zeros)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) yp[m * N + n] = b != nullptr ? b[n] : 0.0f;
    return;
  }
  std::vector<float> wpk(panels * K * kPanel);
  at::parallel_for(0, panels, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t p = q0; p < q1; ++p) {
      float* panel = wpk.data() + p * K * kPanel;
      const int64_t n0 = p * kPanel;
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - n0));
      for (int64_t k = 0; k < K; ++k) {
        for (int j = 0; j < cols; ++j) panel[k * kPanel + j] = wp[(n0 + j) * K + k];
        for (int j = cols; j < kPanel; ++j) panel[k * kPanel + j] = 0.0f;
      }
    }
  });
  const int64_t chunk = kPanelRows * kChunkTiles;
  const int64_t chunks = (M + chunk - 1) / chunk;
  const int64_t kmax = std::min(K, block);
  if (chunks >= at::get_num_threads()) {  // threads over chunks of rows
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      std::vector<float> xa(chunk * kmax);
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t m0 = c * chunk, m1 = std::min(M, m0 + chunk);
        for (int64_t k0 = 0; k0 < K; k0 += block) {
          const int64_t k1 = std::min(K, k0 + block);
          pack_rows(xp, K, m0, m1, k0, k1, xa.data());
          chunk_panels(xa.data(), wpk.data(), b, yp, m0, m1, K, N, k0, k1, 0, panels, bias_last);
        }
      }
    });
    return;
  }
  std::vector<float> xa(chunk * kmax);  // few chunks: threads over panels
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t m0 = c * chunk, m1 = std::min(M, m0 + chunk);
    for (int64_t k0 = 0; k0 < K; k0 += block) {
      const int64_t k1 = std::min(K, k0 + block);
      pack_rows(xp, K, m0, m1, k0, k1, xa.data());
      at::parallel_for(0, panels, 1, [&](int64_t q0, int64_t q1) {
        chunk_panels(xa.data(), wpk.data(), b, yp, m0, m1, K, N, k0, k1, q0, q1, bias_last);
      });
    }
  }
}

at::Tensor ordered_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                          int64_t block, int64_t bias_at) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "ordered_linear: x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_contiguous(),
              "ordered_linear: w must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) == w.size(1), "ordered_linear: x and w must share the inner dimension");
  TORCH_CHECK(block > 0, "ordered_linear: block must be positive");
  TORCH_CHECK(bias_at == kBiasFirst || bias_at == kBiasLast, "ordered_linear: bias_at is 0 (first) or 1 (last)");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* b = nullptr;
  if (bias.has_value()) {
    const at::Tensor& bt = *bias;
    TORCH_CHECK(bt.device().is_cpu() && bt.scalar_type() == at::kFloat && bt.dim() == 1 && bt.size(0) == N &&
                    bt.is_contiguous(),
                "ordered_linear: bias must be a contiguous float32 CPU vector of w.size(0)");
    b = bt.data_ptr<float>();
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (M > kLanes * kRows) {
    panel_linear(x.data_ptr<float>(), w.data_ptr<float>(), b, y.data_ptr<float>(), M, K, N, block,
                 bias_at == kBiasLast);
    return y;
  }
  constexpr int64_t kTile = kRows * kLanes;  // rows per tile
  const int64_t tiles = (M + kTile - 1) / kTile;
  // the input, k-major per tile of kTile rows (rows past M are zeros and never stored)
  auto xt = at::zeros({tiles, K, kTile}, x.options());
  const float* xp = x.data_ptr<float>();
  float* xtp = xt.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t rows = std::min<int64_t>(kTile, M - t * kTile);
      float* dst = xtp + t * K * kTile;
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = xp + (t * kTile + r) * K;
        for (int64_t k = 0; k < K; ++k) dst[k * kTile + r] = src[k];
      }
    }
  });
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t groups = (N + kCols - 1) / kCols;
  const bool last = bias_at == kBiasLast;
  // work items: (column group, row tile): one tile here (more rows take panel_linear); w read in place
  at::parallel_for(0, groups * tiles, 1, [&](int64_t i0, int64_t i1) {
    alignas(64) float out[kCols * kTile];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / tiles, t = i % tiles;
      const int64_t n0 = g * kCols;
      const int cols = static_cast<int>(std::min<int64_t>(kCols, N - n0));
      pick_tile(cols, std::make_integer_sequence<int, kCols>{})(xtp + t * K * kTile, wp + n0 * K, K, 1, K, n0, b,
                                                                 block, last, out);
      const int64_t rows = std::min<int64_t>(kTile, M - t * kTile);
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = yp + (t * kTile + r) * N + n0;
        for (int j = 0; j < cols; ++j) dst[j] = out[j * kTile + r];
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastgen_cpu, lib) {
  lib.def("ordered_linear(Tensor x, Tensor w, Tensor? bias, int block, int bias_at) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastgen_cpu, CPU, lib) { lib.impl("ordered_linear", &ordered_linear); }
