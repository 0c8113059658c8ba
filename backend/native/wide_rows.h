// Wide steps (prefill chunks) of bf16 activations: y = x W^T as a GEMM on the
// AVX-512 bf16 dot product (vdpbf16ps: a pair of exact bf16 products a lane,
// summed in fp32), over weights the formats hand over as bf16 rows: bf16
// weights as stored, int8 / int4 dequantized a block of rows at a time with
// torchao's rounding (the value in fp32, then bf16: what its dequantize + mm
// computes).
//
// Why a GEMM of our own: ATen's (oneDNN) was as fast here (64 x 576 x 1536:
// 187 GFLOP/s against 178-198), but it needs each weight dequantized whole
// first, and the process then holds its primitive cache and code: on SmolLM2
// int4, ~25 MiB beyond the weights and the KV after a prefill. ATen's int8
// GEMM, which reads int8 as stored, took 2x oneDNN's time.
//
// Layout: 16 activation rows a vector, pair-interleaved (lane i of a 32-bit
// word vector holds row 16t + i's inputs 2p and 2p + 1), laid out once per call
// (RowPairs); each weight pair is broadcast, so the weights need no packing.
// A register tile is 8 outputs x 32 rows, 16 accumulators, over all of K (the
// tile's weights, 8 rows, and activations stay in L1 / L2 for SmolLM2's K up
// to 1,536). One core's peak here is ~230 GFLOP/s (one vdpbf16ps a cycle).
#pragma once

#include "float16.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__GNUC__)
#include <immintrin.h>
#define OFFGRAPH_KV_WIDE_ROWS 1
// The bf16 dot product is not among every AVX-512 build's flags: the functions using it carry its
// target themselves, and their callers ask the CPU first (has_bf16_dots; wide steps at export).
#define OFFGRAPH_KV_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

namespace offgraph_kv_native {

#ifdef OFFGRAPH_KV_WIDE_ROWS

constexpr int64_t kWideLanes = 16;    // activation rows a vector
constexpr int kWideOutputs = 8;       // outputs a register tile
constexpr int kWideVectors = 2;       // activation vectors a register tile
constexpr int64_t kWideBlock = 32;    // outputs whose bf16 rows a format hands over at once

// The activations, pair-interleaved: words[(t * pairs + p) * 16 + i] = row 16t + i's inputs 2p, 2p + 1
// (zero past the last row).
struct RowPairs {
  std::vector<uint32_t> words;
  int64_t tiles = 0, pairs = 0;
};

inline RowPairs row_pairs(const Bf16* x, int64_t x_row, int64_t x_col, int64_t rows, int64_t k) {
  RowPairs a;
  a.tiles = (rows + kWideLanes - 1) / kWideLanes;
  a.pairs = k / 2;
  a.words.assign(a.tiles * a.pairs * kWideLanes, 0u);
  for (int64_t r = 0; r < rows; ++r) {
    uint32_t* out = a.words.data() + (r / kWideLanes) * a.pairs * kWideLanes + r % kWideLanes;
    const Bf16* row = x + r * x_row;
    for (int64_t p = 0; p < a.pairs; ++p)
      out[p * kWideLanes] = uint32_t(row[2 * p * x_col].x) | uint32_t(row[(2 * p + 1) * x_col].x) << 16;
  }
  return a;
}

// tile[o][16 v + i] = sum over pairs of weight row o's pair . activation row 16 v + i's, for NR weight
// rows (w: their first, `stride` words apart) and MV vectors of rows (x: the first's words).
template <int NR, int MV>
OFFGRAPH_KV_BF16_TARGET void wide_tile(const uint32_t* __restrict x, int64_t pairs, const uint32_t* __restrict w,
                                       int64_t stride, float* tile) {
  __m512 acc[NR][MV];
  for (int o = 0; o < NR; ++o)
    for (int v = 0; v < MV; ++v) acc[o][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = (__m512bh)_mm512_loadu_si512(x + (v * pairs + p) * kWideLanes);
#pragma GCC unroll 8
    for (int o = 0; o < NR; ++o) {
      const __m512bh wv = (__m512bh)_mm512_set1_epi32(int(w[o * stride + p]));
#pragma GCC unroll 2
      for (int v = 0; v < MV; ++v) acc[o][v] = _mm512_dpbf16_ps(acc[o][v], wv, xv[v]);
    }
  }
  for (int o = 0; o < NR; ++o)
    for (int v = 0; v < MV; ++v) _mm512_storeu_ps(tile + o * kWideVectors * kWideLanes + v * kWideLanes, acc[o][v]);
}

using WideTile = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, float*);

template <int MV, int... NR>
constexpr std::array<WideTile, sizeof...(NR)> wide_tiles_of(std::integer_sequence<int, NR...>) {
  return {&wide_tile<NR + 1, MV>...};
}

// The tile for nr outputs (1..8) and mv vectors (1..2).
inline WideTile wide_tile_for(int nr, int mv) {
  static constexpr auto one = wide_tiles_of<1>(std::make_integer_sequence<int, kWideOutputs>{});
  static constexpr auto two = wide_tiles_of<2>(std::make_integer_sequence<int, kWideOutputs>{});
  return (mv == 1 ? one : two)[nr - 1];
}

// y[r, n] for all rows and outputs. bf16_rows(n0, count, scratch) returns outputs n0 .. n0 + count's
// weights as bf16 rows of k (its own, or dequantized into scratch, room for kWideBlock rows). The
// outputs are split over the threads OpenMP allows, in blocks of kWideBlock.
template <typename X, typename Bf16Rows>
void wide_rows(const RowPairs& a, int64_t rows, int64_t k, int64_t outputs, const Bf16Rows& bf16_rows, X* y) {
  const int64_t blocks = (outputs + kWideBlock - 1) / kWideBlock;
  int64_t parts = 1;
#ifdef _OPENMP
  parts = std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), blocks));
#endif
#pragma omp parallel num_threads(parts) if (parts > 1)
  {
    const std::unique_ptr<uint16_t[]> scratch(new uint16_t[kWideBlock * k]);  // uninitialised: the formats fill it
    alignas(64) float tile[kWideOutputs * kWideVectors * kWideLanes];
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n0 = b * kWideBlock, count = std::min(kWideBlock, outputs - n0);
      const uint32_t* w = reinterpret_cast<const uint32_t*>(bf16_rows(n0, count, scratch.get()));
      for (int64_t t = 0; t < a.tiles; t += kWideVectors) {
        const int mv = int(std::min<int64_t>(kWideVectors, a.tiles - t));
        for (int64_t o = 0; o < count; o += kWideOutputs) {
          const int nr = int(std::min<int64_t>(kWideOutputs, count - o));
          wide_tile_for(nr, mv)(a.words.data() + t * a.pairs * kWideLanes, a.pairs, w + o * a.pairs, a.pairs, tile);
          const int64_t last = std::min(rows, (t + mv) * kWideLanes);
          for (int j = 0; j < nr; ++j)
            for (int64_t r = t * kWideLanes; r < last; ++r)
              from_float(tile[j * kWideVectors * kWideLanes + (r - t * kWideLanes)], y + r * outputs + n0 + o + j);
        }
      }
    }
  }
}

// Dequantization into bf16 rows, 16 values at a time: v (fp32) times a scale, rounded to nearest even.
OFFGRAPH_KV_BF16_TARGET inline void bf16_store(uint16_t* out, __m512 v, __mmask16 keep = 0xFFFF) {
  _mm256_mask_storeu_epi16(out, keep, (__m256i)_mm512_cvtneps_pbh(v));
}

#endif  // OFFGRAPH_KV_WIDE_ROWS

}  // namespace offgraph_kv_native
