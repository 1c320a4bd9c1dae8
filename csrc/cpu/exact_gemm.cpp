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
// chains with SIMD. Up to 256 rows (AVX2: 128): lanes run rows side by side for one column n, each lane
// its own sequential chain; a register tile holds 1-4 row vectors (balanced: 80 rows are two tiles of
// 48) by up to 12 columns, and each weight element, read in place (row-major (N, K): a column's k run is
// contiguous) and broadcast once, feeds every row vector of the tile — a decode step's product needs no
// copy of the weight. More rows: lanes run consecutive columns of a panel of w packed k-major, x packed
// in row tiles (the usual BLAS layout). Threads split columns or rows, never k. Measured on an Intel Xeon
// (Emerald Rapids, AVX-512, one core): 16 to 64 rows of bart-base's 768 -> 3072 and 3072 -> 768
// 1.2-1.5x MKL, 16 rows of 768 -> 768 and of a vocabulary projection ~1.2x, 64 rows of a 256-wide
// model's products 0.6-0.9x MKL (the calibration keeps MKL there). Nothing is assumed at run time:
// fastgen.ops.linear keeps this kernel for a shape only where it returned torch.equal results to F.linear
// on the real input, and is faster.
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

constexpr int64_t kLineFloats = 16;  // floats per 64-byte cache line
// Row-lane tiles fetch the next column group's weight rows ahead when K is below this: measured on an Intel
// Xeon (Emerald Rapids, one core, 16 rows, weights from DRAM) 10-18% faster at K = 512 and 768, and no
// faster at K = 1,024 and 3,072, where the hardware prefetcher follows the longer runs by itself.
constexpr int64_t kPrefetchBelowK = 1024;

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kTileCols[4] = {12, 12, 8, 6};  // R * cols sums + R inputs + 1 broadcast <= 32 zmm
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
constexpr int kTileCols[4] = {12, 6, 4, 2};  // R * cols sums + R inputs + 1 broadcast <= 16 ymm
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
constexpr int kTileCols[4] = {4, 4, 4, 4};
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

// One tile: R * kLanes rows (xt: this tile's input, k-major, R * kLanes floats per k) by `cols` = kC
// columns n0.. of the weight read in place (row-major (N, K): column j's k run is contiguous, one
// broadcast per step). Registers hold the R x kC block sums; the running totals live in `out`
// (kC x R * kLanes, column-major in lanes), touched once per k block, so every register but the
// inputs and one broadcast goes to sums: with R row vectors each broadcast weight feeds R FMAs and
// the loop is bound by the FMA units, not the loads.
template <int R, int kC>
void tile(const float* xt, const float* w, int64_t K, int64_t n0, const float* bias, int64_t block,
          bool bias_last, const float* next, int64_t next_cols, float* out) {
  V s[R][kC];
  for (int64_t k0 = 0; k0 < K; k0 += block) {
    const int64_t k1 = std::min(K, k0 + block);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 12
      for (int j = 0; j < kC; ++j) s[r][j] = vzero();
    for (int64_t k = k0; k < k1; ++k) {
      if (next != nullptr && (k & (kLineFloats - 1)) == 0) {
        // the next group's columns, a line each as this group's reach it: a column's k run is only K floats
        // long (3 KB at K = 768), too short for the hardware prefetcher to ramp up on its own
        for (int64_t j = 0; j < next_cols; ++j) __builtin_prefetch(next + j * K + k, 0, 2);
      }
      V xv[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) xv[r] = vload(xt + (k * R + r) * kLanes);
#pragma GCC unroll 12
      for (int j = 0; j < kC; ++j) {
        const V wv = vset1(w[j * K + k]);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) s[r][j] = vfma(xv[r], wv, s[r][j]);
      }
    }
    for (int j = 0; j < kC; ++j) {
      for (int r = 0; r < R; ++r) {
        float* c = out + (j * R + r) * kLanes;
        if (k0 != 0) {
          vstore(c, vadd(vload(c), s[r][j]));
        } else {
          vstore(c, (bias != nullptr && !bias_last) ? vadd(vset1(bias[n0 + j]), s[r][j]) : s[r][j]);
        }
      }
    }
  }
  for (int j = 0; j < kC; ++j) {
    for (int r = 0; r < R; ++r) {
      float* c = out + (j * R + r) * kLanes;
      if (K == 0) vstore(c, (bias != nullptr && !bias_last) ? vset1(bias[n0 + j]) : vzero());
      if (bias != nullptr && bias_last) vstore(c, vadd(vload(c), vset1(bias[n0 + j])));
    }
  }
}

using TileFn = void (*)(const float*, const float*, int64_t, int64_t, const float*, int64_t, bool, const float*,
                        int64_t, float*);

template <int R, int... kC>
constexpr TileFn pick_tile(int cols, std::integer_sequence<int, kC...>) {
  TileFn fns[] = {&tile<R, kC + 1>...};
  return fns[cols - 1];
}

// columns per tile for R row vectors: R * cols sums + R inputs + 1 broadcast fit the registers
constexpr int cols_for(int r) { return kTileCols[r - 1]; }

TileFn tile_fn(int rows, int cols) {
  switch (rows) {
    case 1: return pick_tile<1>(cols, std::make_integer_sequence<int, cols_for(1)>{});
    case 2: return pick_tile<2>(cols, std::make_integer_sequence<int, cols_for(2)>{});
    case 3: return pick_tile<3>(cols, std::make_integer_sequence<int, cols_for(3)>{});
    default: return pick_tile<4>(cols, std::make_integer_sequence<int, cols_for(4)>{});
  }
}

// Many rows: SIMD lanes run kPanelVecs * kLanes consecutive columns n (a panel of the weight, packed
// k-major), each x[m, k] is broadcast once for all of them, kR rows per register tile; one k block at a
// time (the running totals c live in y between blocks, so all registers go to block sums). As in any
// BLAS, both operands are packed per call: the weight into panels, a chunk of rows of x per k block
// into tiles (k-major), so the micro-kernel reads two sequential streams that stay in L1/L2.
constexpr int kPanel = kPanelVecs * kLanes;  // columns per panel
// more rows than this take the packed panels (the row-lane tiles read the weight once per tile of rows)
constexpr int64_t kRowLaneMaxRows = 16 * kLanes;
constexpr int64_t kChunkTiles = 8;            // row tiles per chunk of x packed at a time

// x(r, k) = xa[k * kPanelRows + r]; w(k, j) = panel[k * kPanel + j]; k in [0, kb)
template <int kR>
void panel_block(const float* xa, const float* panel, int64_t kb, int cols, const float* bpad, bool first_block,
                 bool last_block, bool bias_last, float* y, int64_t N) {
  constexpr int C = kPanelVecs;
  V s[kR][C];
#pragma GCC unroll 8
  for (int r = 0; r < kR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < C; ++v) s[r][v] = vzero();
  for (int64_t k = 0; k < kb; ++k) {
    V wv[C];
#pragma GCC unroll 4
    for (int v = 0; v < C; ++v) wv[v] = vload(panel + k * kPanel + v * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r) {
      const V xv = vset1(xa[k * kPanelRows + r]);
#pragma GCC unroll 4
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

// The weight (N, K) as panels of kPanel columns, k-major: panel p holds w[p * kPanel + j, k] at
// [p][k][j] (zeros past N).
void pack_panels(const float* wp, int64_t K, int64_t N, float* wpk) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t p = q0; p < q1; ++p) {
      float* panel = wpk + p * K * kPanel;
      const int64_t n0 = p * kPanel;
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - n0));
      for (int64_t k = 0; k < K; ++k) {
        for (int j = 0; j < cols; ++j) panel[k * kPanel + j] = wp[(n0 + j) * K + k];
        for (int j = cols; j < kPanel; ++j) panel[k * kPanel + j] = 0.0f;
      }
    }
  });
}

void panel_linear(const float* xp, const float* wpk, const float* b, float* yp, int64_t M, int64_t K, int64_t N,
                  int64_t block, bool bias_last) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  if (K == 0) {  // no products: the bias (or zeros)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) yp[m * N + n] = b != nullptr ? b[n] : 0.0f;
    return;
  }
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
          chunk_panels(xa.data(), wpk, b, yp, m0, m1, K, N, k0, k1, 0, panels, bias_last);
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
        chunk_panels(xa.data(), wpk, b, yp, m0, m1, K, N, k0, k1, q0, q1, bias_last);
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
  if (M > kRowLaneMaxRows) {
    std::vector<float> wpk(((N + kPanel - 1) / kPanel) * K * kPanel);
    pack_panels(w.data_ptr<float>(), K, N, wpk.data());
    panel_linear(x.data_ptr<float>(), wpk.data(), b, y.data_ptr<float>(), M, K, N, block, bias_at == kBiasLast);
    return y;
  }
  // rows in tiles of up to 4 row vectors, balanced (80 rows: two tiles of 3 vectors, not 4 + 1)
  const int64_t vecs = (M + kLanes - 1) / kLanes;
  const int64_t tiles = (vecs + 3) / 4;
  const int R = static_cast<int>((vecs + tiles - 1) / tiles);
  const int64_t kTile = R * kLanes;  // rows per tile
  // the input, k-major per tile (rows past M are zeros and never stored)
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
  const int kC = cols_for(R);
  const int64_t groups = (N + kC - 1) / kC;
  const bool last = bias_at == kBiasLast;
  // work items (column group, row tile), tiles innermost: a group's weight rows stay in cache across tiles
  at::parallel_for(0, groups * tiles, 1, [&](int64_t i0, int64_t i1) {
    alignas(64) float out[4 * 12 * kLanes];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / tiles, t = i % tiles;
      const int64_t n0 = g * kC;
      const int cols = static_cast<int>(std::min<int64_t>(kC, N - n0));
      // the last row tile of a group fetches the next group's weight rows ahead where they are short
      const bool fetch = K < kPrefetchBelowK && t == tiles - 1 && n0 + kC < N;
      const int64_t next_cols = fetch ? std::min<int64_t>(kC, N - n0 - kC) : 0;
      tile_fn(R, cols)(xtp + t * K * kTile, wp + n0 * K, K, n0, b, block, last, fetch ? wp + (n0 + kC) * K : nullptr,
                       next_cols, out);
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
