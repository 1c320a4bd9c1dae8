// fastgen_cpu::int8_linear_vnni — a decode step's int8 linear in one call: quantize, product, scale.
//
// Why: at a decode step's row counts oneDNN's u8 x s8 product has a floor of ~30 us per call on an Intel
// Xeon (Emerald Rapids, AMX) — more than MKL's fp32 product of a 16 x 256 x 256 step — and the int8 mode
// pays two more calls around it (the row quantizer, the scaling pass). A small model's step makes 25 such
// products. This op does all three in one call with AVX-512 VNNI (vpdpbusd: four u8 x s8 products summed
// into each int32 lane, exactly), on a weight packed once (pack_int8_vnni).
//
// Semantics are the asymmetric grid's (fastgen.ops.int8_linear, int8_rows.h): per row m the codes
// xq = quantize_row_zp(x[m]) with (scale[m], zero[m]); acc[m, n] = sum_k xq[m, k] * Wq[n, k] in int32 (exact);
// y[m, n] = act((float(acc) * scale_w[n] - zero[m] * col_sums[n]) * scale[m] + bias[n]) — oneDNN's output
// (float(acc) * scale_w) followed by scale_rows_add_, so it differs from that path by float rounding at most.
//
// pack_int8_vnni(Wq (N, K) int8) -> (ceil(N / 16), ceil(K / 4), 16, 4) int8: panels of 16 outputs, for each
// group of four k the 16 outputs' four codes side by side (what one vpdpbusd reads); zeros past N and K.
// int8_vnni_native() says whether this build has the VNNI path (else a plain loop computes the same sums).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

#include "int8_rows.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define FASTGEN_VNNI 1
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using namespace fastgen_cpu;

constexpr int kPanel = 16;     // outputs per panel (int32 lanes of a zmm register)
constexpr int kTileRows = 8;   // rows per register tile
constexpr int kTilePanels = 3; // panels per register tile: 8 x 3 sums + 3 weights + 1 input of 32 zmm
constexpr int64_t kBlockQuads = 16;  // groups of four k per 64-byte row of an AMX tile
constexpr int64_t kAmxChunkPairs = 8;  // pairs of panels per AMX chunk: 256 outputs, a 32 x 256 int32 accumulator
constexpr int64_t kVnniMaxChunkGroups = 8;  // groups of panels per VNNI chunk: 384 outputs, an 8 x 384 accumulator
constexpr int64_t kVnniChunkBytes = int64_t{1} << 18;  // a VNNI chunk's packed weight at most (L2)
// multiply-adds a thread's share must hold before a product is split across threads: a decode step's small
// products ran slower on two threads than on one (the fork, and each thread's tile configuration, cost more)
constexpr int64_t kMinMacsPerThread = int64_t{1} << 22;

// at::parallel_for's grain for `items` items of `macs_per_item` each
inline int64_t grain_for(int64_t macs_per_item) {
  return std::max<int64_t>(1, kMinMacsPerThread / std::max<int64_t>(1, macs_per_item));
}

// groups of four k in a packed panel: padded to whole AMX k blocks (zeros)
inline int64_t padded_quads(int64_t K) { return ((K + 3) / 4 + kBlockQuads - 1) / kBlockQuads * kBlockQuads; }

at::Tensor pack_int8_vnni(const at::Tensor& codes) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous(),
              "pack_int8_vnni: a contiguous 2-D int8 CPU tensor of weight codes");
  const int64_t N = codes.size(0), K = codes.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel, quads = padded_quads(K);
  auto packed = at::zeros({panels, quads, kPanel, 4}, codes.options());
  const int8_t* src = codes.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t p = n / kPanel, j = n % kPanel;
    for (int64_t k = 0; k < K; ++k) dst[((p * quads + k / 4) * kPanel + j) * 4 + k % 4] = src[n * K + k];
  }
  return packed;
}

// acc (rows x panels * 16 int32) = codes rows [m0, m0 + rows) against panels [p0, p0 + panels); codes rows
// are `stride` bytes apart (a multiple of 4, zero-padded past K)
template <int R, int C>
void tile(const uint8_t* xq, int64_t stride, const int8_t* w, int64_t panel_quads, int64_t quads, int32_t* acc,
          int64_t acc_stride) {
#if defined(FASTGEN_VNNI)
  // The unroll pragmas keep the R x C sums in registers: without them GCC 12 stored every sum to the stack
  // and copied it between registers on each k step, at half the speed (~95 against ~190 GMAC/s at
  // 64 x 256 -> 6000, AMD EPYC, 1 thread).
  __m512i s[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) s[r][c] = _mm512_setzero_si512();
  for (int64_t q = 0; q < quads; ++q) {
    __m512i wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w + (c * panel_quads + q) * kPanel * 4);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, xq + r * stride + q * 4, 4);
      const __m512i xv = _mm512_set1_epi32(four);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) s[r][c] = _mm512_dpbusd_epi32(s[r][c], xv, wv[c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) _mm512_storeu_si512(acc + r * acc_stride + c * kPanel, s[r][c]);
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int j = 0; j < kPanel; ++j) {
        int32_t sum = 0;
        for (int64_t q = 0; q < quads; ++q)
          for (int t = 0; t < 4; ++t)
            sum += int32_t{xq[r * stride + q * 4 + t]} * int32_t{w[((c * panel_quads + q) * kPanel + j) * 4 + t]};
        acc[r * acc_stride + c * kPanel + j] = sum;
      }
#endif
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, int64_t, int32_t*, int64_t);

template <int... kR>
TileFn pick_tile(int rows, int panels, std::integer_sequence<int, kR...>) {
  TileFn fns[][kTilePanels] = {{&tile<kR + 1, 1>, &tile<kR + 1, 2>, &tile<kR + 1, 3>}...};
  return fns[rows - 1][panels - 1];
}

template <int64_t kAct>
void finish_row(const int32_t* acc, float* y, int64_t cols, const float* scale_w, float s, float z,
                const float* col_sums, const float* b) {
  for (int64_t j = 0; j < cols; ++j) y[j] = static_cast<float>(acc[j]) * scale_w[j];
  shift_scale_row<kAct>(y, cols, s, z, col_sums, b);
}

#if defined(__x86_64__) && defined(__GNUC__)
// AMX: tiles of 16 rows x 64 bytes. C += A . B with A 16 rows x 64 u8 codes (k), B 16 groups of four k x 16
// outputs (a packed panel's 16 quads: 64 bytes each, contiguous), C 16 x 16 int32. Two A and two B tiles
// per step feed four C tiles (32 rows x 32 outputs).
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out the AMX tile state only on request (once per process); false where the CPU or kernel lacks it
bool amx_permitted() {
  static const bool permitted = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!(edx & (1u << 24)) || !(edx & (1u << 25))) return false;  // AMX-TILE, AMX-INT8
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return permitted;
}

// rows [m0, m0 + 32) of the codes (padded to whole 32-row blocks) against panels p0, p0 + 1 (p0 + 1 < panels:
// `two`); acc: 32 rows x 32 int32, `acc_stride` int32 apart
__attribute__((target("amx-tile,amx-int8"))) void amx_block(const uint8_t* xq, int64_t stride, const int8_t* w0,
                                                             const int8_t* w1, int64_t blocks, bool two_rows,
                                                             bool two, int32_t* acc, int64_t acc_stride) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    _tile_loadd(4, xq + kb * 64, stride);
    _tile_loadd(6, w0 + kb * kBlockQuads * kPanel * 4, kPanel * 4);
    _tile_dpbusd(0, 4, 6);
    if (two) {
      _tile_loadd(7, w1 + kb * kBlockQuads * kPanel * 4, kPanel * 4);
      _tile_dpbusd(1, 4, 7);
    }
    if (two_rows) {
      _tile_loadd(5, xq + 16 * stride + kb * 64, stride);
      _tile_dpbusd(2, 5, 6);
      if (two) _tile_dpbusd(3, 5, 7);
    }
  }
  _tile_stored(0, acc, acc_stride * 4);
  _tile_stored(1, acc + 16, acc_stride * 4);
  _tile_stored(2, acc + 16 * acc_stride, acc_stride * 4);
  _tile_stored(3, acc + 16 * acc_stride + 16, acc_stride * 4);
}

constexpr TileConfig tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  return config;
}

// in memory, not built on the stack at the call: ldtilecfg reads 64 bytes the compiler does not see it read
// (GCC 12 dropped the stores of a stack copy in one build: a #GP, SIGSEGV)
alignas(64) constexpr TileConfig kTileConfig = tile_config();

__attribute__((target("amx-tile,amx-int8"))) void amx_begin() { _tile_loadconfig(&kTileConfig); }

__attribute__((target("amx-tile,amx-int8"))) void amx_end() { _tile_release(); }
#else
bool amx_permitted() { return false; }
#endif

#if defined(FASTGEN_VNNI)
// finish_row without an activation in one pass over the row: the same operations in the same order (the sum's
// float times the weight's scale, rounded; minus zero * col_sum, fused; times the row's scale, plus the bias,
// fused), as the compiler emits them for finish_row's two loops, so the same bits, but y is written once. The
// second pass re-read the whole output: ~3.5% of a small BART's int8 generate call (AMD EPYC, 1 thread, perf).
void finish_row_plain(const int32_t* acc, float* y, int64_t cols, const float* sw, float s, float z, const float* c,
                      const float* b) {
  const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z);
  int64_t j = 0;
  for (; j + kPanel <= cols; j += kPanel) {
    const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc + j)), _mm512_loadu_ps(sw + j));
    const __m512 u = _mm512_fnmadd_ps(vz, _mm512_loadu_ps(c + j), t);
    _mm512_storeu_ps(y + j, b != nullptr ? _mm512_fmadd_ps(u, vs, _mm512_loadu_ps(b + j)) : _mm512_mul_ps(u, vs));
  }
  if (j < cols) finish_row<kNone>(acc + j, y + j, cols - j, sw + j, s, z, c + j, b != nullptr ? b + j : nullptr);
}
#endif

template <int64_t kAct>
void finish_rows(const int32_t* acc, int64_t acc_stride, int rows, int64_t m0, float* yp, int64_t n, int64_t n0,
                 int64_t cols, const float* sw, const float* row_scale, const float* row_zero, const float* cs,
                 const float* b) {
  for (int r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    const float* bias = b != nullptr ? b + n0 : nullptr;
#if defined(FASTGEN_VNNI)
    if constexpr (kAct == kNone) {
      finish_row_plain(acc + r * acc_stride, yp + m * n + n0, cols, sw + n0, row_scale[m], row_zero[m], cs + n0, bias);
      continue;
    }
#endif
    finish_row<kAct>(acc + r * acc_stride, yp + m * n + n0, cols, sw + n0, row_scale[m], row_zero[m], cs + n0, bias);
  }
}

void finish(int64_t activation, const int32_t* acc, int64_t acc_stride, int rows, int64_t m0, float* yp, int64_t n,
            int64_t n0, int64_t cols, const float* sw, const float* row_scale, const float* row_zero, const float* cs,
            const float* b) {
  switch (activation) {
    case kGelu:
      return finish_rows<kGelu>(acc, acc_stride, rows, m0, yp, n, n0, cols, sw, row_scale, row_zero, cs, b);
    case kRelu:
      return finish_rows<kRelu>(acc, acc_stride, rows, m0, yp, n, n0, cols, sw, row_scale, row_zero, cs, b);
    case kSilu:
      return finish_rows<kSilu>(acc, acc_stride, rows, m0, yp, n, n0, cols, sw, row_scale, row_zero, cs, b);
    default:
      return finish_rows<kNone>(acc, acc_stride, rows, m0, yp, n, n0, cols, sw, row_scale, row_zero, cs, b);
  }
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const at::Tensor& scale_w,
                       const at::Tensor& col_sums, const std::optional<at::Tensor>& bias, int64_t activation,
                       bool amx) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "int8_linear_vnni: x must be a contiguous 2-D float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), quads = (K + 3) / 4, panels = (n + kPanel - 1) / kPanel;
  const int64_t panel_quads = padded_quads(K);
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(0) == panels && packed.size(1) == panel_quads && packed.size(2) == kPanel &&
                  packed.size(3) == 4,
              "int8_linear_vnni: packed must come from pack_int8_vnni for an (n, K) weight");
  TORCH_CHECK(scale_w.scalar_type() == at::kFloat && scale_w.numel() == n && scale_w.is_contiguous() &&
                  col_sums.scalar_type() == at::kFloat && col_sums.numel() == n && col_sums.is_contiguous(),
              "int8_linear_vnni: one contiguous float32 scale and code sum per output");
  TORCH_CHECK(activation >= kNone && activation <= kSilu, "int8_linear_vnni: unknown activation ", activation);
  TORCH_CHECK(!amx || amx_permitted(), "int8_linear_amx: this CPU or kernel gives no AMX");
  const float* b = nullptr;
  at::Tensor dense_bias;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->dim() == 1,
                "int8_linear_vnni: bias must hold one float32 per output");
    dense_bias = bias->contiguous();
    b = dense_bias.data_ptr<float>();
  }
  auto y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  // the activation codes, each row padded with zeros to whole 64-byte k blocks, rows to whole 32-row blocks
  // (AMX reads them), and each row's grid
  const int64_t stride = panel_quads * 4, padded_rows = (M + 31) / 32 * 32;
  auto codes = at::zeros({padded_rows, stride}, x.options().dtype(at::kByte));
  auto grid = at::empty({2, M}, x.options());
  const float* xp = x.data_ptr<float>();
  uint8_t* xq = codes.data_ptr<uint8_t>();
  float* row_scale = grid.data_ptr<float>();
  float* row_zero = row_scale + M;
  at::parallel_for(0, M, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, K)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row_zp(xp + m * K, K, xq + m * stride, row_scale + m, row_zero + m);
  });
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sw = scale_w.data_ptr<float>();
  const float* cs = col_sums.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t panel_bytes = panel_quads * kPanel * 4;
#if defined(__x86_64__) && defined(__GNUC__)
  if (amx) {
    // threads over chunks of up to kAmxChunkPairs pairs of panels, a whole number of chunks per thread (even
    // shares). Within a chunk, each 32-row block's products fill a 32 x (chunk width) accumulator (L1) and the
    // epilogue runs on whole chunk rows: per 32 x 32 block it was two vectors a call (a GELU product took
    // 1.2-1.3x as long; Intel Xeon AMX, 1 thread, measured in one process)
    const int64_t pairs = (panels + 1) / 2, threads = at::get_num_threads();
    const int64_t per_thread = (pairs + threads * kAmxChunkPairs - 1) / (threads * kAmxChunkPairs);
    const int64_t chunk_pairs = std::max<int64_t>(1, (pairs + threads * per_thread - 1) / (threads * per_thread));
    const int64_t chunks = (pairs + chunk_pairs - 1) / chunk_pairs;
    at::parallel_for(0, chunks, grain_for(M * chunk_pairs * 2 * kPanel * K), [&](int64_t c0, int64_t c1) {
      constexpr int64_t acc_stride = kAmxChunkPairs * 2 * kPanel;
      alignas(64) int32_t acc[32 * acc_stride];
      amx_begin();
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t q0 = c * chunk_pairs, q1 = std::min(pairs, q0 + chunk_pairs), n0 = q0 * 2 * kPanel;
        const int64_t cols = std::min<int64_t>(q1 * 2 * kPanel, n) - n0;
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
          const int rows = static_cast<int>(std::min<int64_t>(32, M - m0));
          for (int64_t q = q0; q < q1; ++q) {
            const int64_t p0 = 2 * q;
            const bool two = p0 + 1 < panels;
            amx_block(xq + m0 * stride, stride, wp + p0 * panel_bytes, wp + (p0 + 1) * panel_bytes * two,
                      panel_quads / kBlockQuads, rows > 16, two, acc + (q - q0) * 2 * kPanel, acc_stride);
          }
          finish(activation, acc, acc_stride, rows, m0, yp, n, n0, cols, sw, row_scale, row_zero, cs, b);
        }
      }
      amx_end();
    });
    return y;
  }
#endif
  // Threads over chunks of groups of panels, a whole number of chunks per thread (even shares). A chunk's
  // weight (up to kVnniChunkBytes) stays in cache across the row tiles; each 8-row tile's products fill an
  // 8 x (chunk width) accumulator and the epilogue runs on whole chunk rows: per 8 x 48 tile it took ~40% as
  // long as the products (AMD EPYC, 1 thread, 64 x 256 -> 6000, py-spy)
  const int64_t groups = (panels + kTilePanels - 1) / kTilePanels, threads = at::get_num_threads();
  const int64_t group_bytes = kTilePanels * panel_bytes;
  const int64_t fit = std::clamp<int64_t>(kVnniChunkBytes / group_bytes, 1, kVnniMaxChunkGroups);
  const int64_t per_thread = (groups + threads * fit - 1) / (threads * fit);
  const int64_t chunk_groups = std::max<int64_t>(1, (groups + threads * per_thread - 1) / (threads * per_thread));
  const int64_t chunks = (groups + chunk_groups - 1) / chunk_groups;
  at::parallel_for(0, chunks, grain_for(M * chunk_groups * kTilePanels * kPanel * K), [&](int64_t c0, int64_t c1) {
    constexpr int64_t acc_stride = kVnniMaxChunkGroups * kTilePanels * kPanel;
    alignas(64) int32_t acc[kTileRows * acc_stride];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t g0 = c * chunk_groups, g1 = std::min(groups, g0 + chunk_groups), n0 = g0 * kTilePanels * kPanel;
      const int64_t cols = std::min<int64_t>(g1 * kTilePanels * kPanel, n) - n0;
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t p0 = g * kTilePanels;
          const int tp = static_cast<int>(std::min<int64_t>(kTilePanels, panels - p0));
          pick_tile(rows, tp, std::make_integer_sequence<int, kTileRows>{})(
              xq + m0 * stride, stride, wp + p0 * panel_bytes, panel_quads, quads,
              acc + (g - g0) * kTilePanels * kPanel, acc_stride);
        }
        finish(activation, acc, acc_stride, rows, m0, yp, n, n0, cols, sw, row_scale, row_zero, cs, b);
      }
    }
  });
  return y;
}

at::Tensor int8_linear_vnni(const at::Tensor& x, const at::Tensor& packed, int64_t n, const at::Tensor& scale_w,
                            const at::Tensor& col_sums, const std::optional<at::Tensor>& bias, int64_t activation) {
  return int8_linear(x, packed, n, scale_w, col_sums, bias, activation, false);
}

at::Tensor int8_linear_amx(const at::Tensor& x, const at::Tensor& packed, int64_t n, const at::Tensor& scale_w,
                           const at::Tensor& col_sums, const std::optional<at::Tensor>& bias, int64_t activation) {
  return int8_linear(x, packed, n, scale_w, col_sums, bias, activation, true);
}

bool int8_amx_ready() { return amx_permitted(); }

bool int8_vnni_native() {
#if defined(FASTGEN_VNNI)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastgen_cpu, lib) {
  lib.def("pack_int8_vnni(Tensor codes) -> Tensor");
  lib.def(
      "int8_linear_vnni(Tensor x, Tensor packed, int n, Tensor scale_w, Tensor col_sums, Tensor? bias, "
      "int activation) -> Tensor");
  lib.def(
      "int8_linear_amx(Tensor x, Tensor packed, int n, Tensor scale_w, Tensor col_sums, Tensor? bias, "
      "int activation) -> Tensor");
  lib.def("int8_vnni_native() -> bool", &int8_vnni_native);
  lib.def("int8_amx_ready() -> bool", &int8_amx_ready);
}

TORCH_LIBRARY_IMPL(fastgen_cpu, CPU, lib) {
  lib.impl("pack_int8_vnni", &pack_int8_vnni);
  lib.impl("int8_linear_vnni", &int8_linear_vnni);
  lib.impl("int8_linear_amx", &int8_linear_amx);
}
