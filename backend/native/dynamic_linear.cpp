// CPU linears with int8 dynamic activations and int4 or int8 weights ("8da4w" /
// "8da8w", torchao's Int8DynamicActivationIntxWeightConfig, ExecuTorch's usual
// LLM schemes), for every step width: each activation row is quantized to int8
// per token (asymmetric, torchao's arithmetic in the activations' dtype), then
// dotted with the weights in integers, as llama.cpp's Q4_0 / Q8_0 dot their
// Q8_0-quantized activations. Called by AOTInductor's generated code as the C
// shims of offgraph_kv::int4_da8_linear_rows / int8_da8_linear_rows and compiled
// into each CPU program's shared object (backend/cpu_kernels.py).
//
// Why integers: with fp32 activations a 4-bit weight costs a widening and an FMA
// per 16 values, more than streaming its half byte (SmolLM2 int4 decoded no
// faster than int8); one VNNI dot takes 64 weight-activation products.
//
// Weights come in tiles of 16 outputs (one 32-bit lane each, so one VNNI dot
// with four broadcast activations updates all 16), as backend/quantized_linear.py
// (pack_int4_tiles, pack_int8_tiles) lays them out; N is padded to whole tiles
// with zero rows, and the output has the row-sum tensor's N:
//
// int4, in groups of G inputs (symmetric, q in [-8, 7], stored as n = q + 8):
//   packed [N/16, K/8, 64] uint8: byte 4r + j of tile (b, t) holds n of output
//     16b + r at input 8t + j in its low nibble and at 8t + 4 + j in its high one;
//   scale  [N/16, K/G, 16] (fp32 / bf16 / fp16): output 16b + r's scale for group g;
//   rowsum [N] fp32: sum_k w[n, k], the dequantized row's sum;
//   y[n] = sx * (sum_g scale[n, g] * (sum_{k in g} n_k xq_k - 8 sum_{k in g} xq_k) - zp * rowsum[n])
// int8, one scale per output row (q in [-128, 127]):
//   packed [N/16, K/4, 64] int8: byte 4r + j of tile (b, t) = q[16b + r, 4t + j];
//   scale  [N] (fp32 / bf16 / fp16); wsum [N] int32: sum_k q[n, k];
//   y[n] = sx * scale[n] * (sum_k (xq_k + 128) q_k - (128 + zp) * wsum[n])
// with xq the row's int8 values, zp its zero point and sx its scale. The integer
// sums are exact (int4: int32 per group; int8: int32 per 2^16 inputs, then
// int64), the rest fp32; the output takes x's dtype.

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include "float16.h"
#include "linear_call.h"
#include "shim_view.h"
#include "shared_rows.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using namespace offgraph_kv_native;
using namespace offgraph_kv_native::vec;

constexpr int64_t kTileRows = 16;     // outputs per tile
constexpr int64_t kTileBytes = 64;
constexpr int64_t kTokenBatch = 4;    // activation rows sharing each tile load
constexpr int64_t kTilesPerThread = 32;  // a thread below this many tiles of outputs costs more than it reads

// ----------------------------------------------------------------------------
// Integer dots of one tile with a token's activations: acc lane r += sum_j w[r, j] * xq[j]
// over the tile's low nibbles (inputs 0..3) and high nibbles (4..7). IVec holds
// kLanes 32-bit lanes: 16 outputs per register on AVX-512, 8 on AVX2 (two per tile).
// ----------------------------------------------------------------------------

inline int32_t load4(const void* p) {  // four bytes, any alignment
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512BW__)
using IVec = __m512i;
inline IVec izero() { return _mm512_setzero_si512(); }
inline IVec iload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline IVec ibroadcast(const void* p) { return _mm512_set1_epi32(load4(p)); }  // four bytes to every lane
inline void isplit(IVec w, IVec* lo, IVec* hi) {
  const IVec m = _mm512_set1_epi8(15);
  *lo = _mm512_and_si512(w, m);
  *hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m);
}
// idot: u8 at most 15 (int4 nibbles); idot_full: any u8 (int8 tiles' xq + 128).
inline IVec idot(IVec acc, IVec u8, IVec s8) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u8, s8);
#else  // 15 * 128 * 2 fits int16: maddubs cannot saturate here
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u8, s8), _mm512_set1_epi16(1)));
#endif
}
inline IVec idot_full(IVec acc, IVec u8, IVec s8) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u8, s8);
#else  // 255 * 128 * 2 overflows maddubs' int16 pairs: even and odd bytes widened, two exact madds
  const IVec ue = _mm512_and_si512(u8, _mm512_set1_epi16(0xff)), uo = _mm512_srli_epi16(u8, 8);
  const IVec se = _mm512_srai_epi16(_mm512_slli_epi16(s8, 8), 8), so = _mm512_srai_epi16(s8, 8);
  return _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_madd_epi16(ue, se), _mm512_madd_epi16(uo, so)));
#endif
}
inline IVec isub(IVec a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
inline Vec ito_float(IVec a) { return _mm512_cvtepi32_ps(a); }
inline void istore(int32_t* p, IVec a) { _mm512_storeu_si512(p, a); }
inline IVec iadd(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
// Lanes rounded to bf16 / fp16 and back (finite values; ties to even, as torch's casts).
inline Vec vround_bf16(Vec v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xffff0000u))));
}
inline Vec vround_half(Vec v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// Integral lanes in [-128, 127] to int8 (saturating).
inline void vstore_int8(int8_t* p, Vec v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
}
constexpr int kChains = 4;  // independent dot chains for one token's outputs (int8 tiles)
#define OFFGRAPH_KV_INT_VECTOR 1
#elif defined(__AVX2__) && defined(__FMA__)
using IVec = __m256i;
inline IVec izero() { return _mm256_setzero_si256(); }
inline IVec iload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline IVec ibroadcast(const void* p) { return _mm256_set1_epi32(load4(p)); }
inline void isplit(IVec w, IVec* lo, IVec* hi) {
  const IVec m = _mm256_set1_epi8(15);
  *lo = _mm256_and_si256(w, m);
  *hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m);
}
inline IVec idot(IVec acc, IVec u8, IVec s8) {  // u8 at most 15, as above
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
}
inline IVec idot_full(IVec acc, IVec u8, IVec s8) {  // any u8, as above
  const IVec ue = _mm256_and_si256(u8, _mm256_set1_epi16(0xff)), uo = _mm256_srli_epi16(u8, 8);
  const IVec se = _mm256_srai_epi16(_mm256_slli_epi16(s8, 8), 8), so = _mm256_srai_epi16(s8, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ue, se), _mm256_madd_epi16(uo, so)));
}
inline IVec isub(IVec a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
inline Vec ito_float(IVec a) { return _mm256_cvtepi32_ps(a); }
inline void istore(int32_t* p, IVec a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a); }
inline IVec iadd(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline Vec vround_bf16(Vec v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xffff0000u))));
}
inline Vec vround_half(Vec v) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
#else
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  for (float& e : f) e = round_to<Half>(e);
  return _mm256_load_ps(f);
#endif
}
inline void vstore_int8(int8_t* p, Vec v) {
  const __m256i i = _mm256_cvtps_epi32(v);
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
}
constexpr int kChains = 2;  // 16 registers: two
#define OFFGRAPH_KV_INT_VECTOR 1
#endif

#ifdef OFFGRAPH_KV_INT_VECTOR
template <int C>
inline IVec isum(const IVec (&chains)[C]) {
  IVec s = chains[0];
  for (int c = 1; c < C; ++c) s = iadd(s, chains[c]);
  return s;
}
#endif

// ----------------------------------------------------------------------------
// Per-token activation quantization, torchao's (choose_qparams_affine, ASYMMETRIC,
// then quantize_affine), each op rounded to X as torch's op in X's dtype rounds.
// ----------------------------------------------------------------------------

template <typename X>
float smallest_normal();
template <>
float smallest_normal<float>() { return std::numeric_limits<float>::min(); }
template <>
float smallest_normal<Bf16>() { return std::numeric_limits<float>::min(); }  // bf16 has fp32's exponent
template <>
float smallest_normal<Half>() { return 6.103515625e-05f; }

struct QuantRow {
  float scale;  // the row's scale as torchao stores it (X), widened
  int32_t zero;
};

#ifdef OFFGRAPH_KV_INT_VECTOR
inline Vec vround_to(Vec v, float) { return v; }
inline Vec vround_to(Vec v, Bf16) { return vround_bf16(v); }
inline Vec vround_to(Vec v, Half) { return vround_half(v); }
#endif

// xq[i] for i < k and the sums of every group of `group` values. A non-finite activation makes the
// row's scale NaN (its outputs NaN: torchao's are NaN or meaningless there too).
template <typename X>
QuantRow quantize_row(const X* x, int64_t stride, int64_t k, int64_t group, int8_t* xq, int32_t* sums) {
  float lo = 0.f, hi = 0.f;
  bool nan = false;
  int64_t i = 0;
#ifdef OFFGRAPH_KV_INT_VECTOR
  if (stride == 1) {
    Vec vlo = vzero(), vhi = vzero(), bad = vzero();  // bad: v - v, NaN where v is not finite
    for (; i + kLanes <= k; i += kLanes) {
      const Vec v = vload(x + i);
      vlo = vmin(v, vlo);
      vhi = vmax(v, vhi);
      bad = vadd(bad, vsub(v, v));
    }
    lo = -vhmax(vsub(vzero(), vlo));
    hi = vhmax(vhi);
    nan = std::isnan(vsum(bad));
  }
#endif
  for (; i < k; ++i) {
    const float v = widen(x[i * stride]);
    nan |= !std::isfinite(v);
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  float scale = round_to<X>(round_to<X>(hi - lo) / 255.f);
  scale = std::max(scale, smallest_normal<X>());
  if (nan) scale = std::numeric_limits<float>::quiet_NaN();
  const float zf = std::min(127.f, std::max(-128.f, -128.f - std::nearbyint(round_to<X>(lo / scale))));
  const int32_t zero = std::isnan(zf) ? 0 : int32_t(zf);
  const float inv = round_to<X>(1.f / scale);
  i = 0;
#ifdef OFFGRAPH_KV_INT_VECTOR
  if (stride == 1) {
    const Vec vinv = vset(inv), vz = vset(float(zero)), top = vset(127.f), bottom = vset(-128.f);
    for (; i + kLanes <= k; i += kLanes) {
      const Vec q = vadd(vround(vround_to(vmul(vload(x + i), vinv), X{})), vz);
      vstore_int8(xq + i, vmin(top, vmax(bottom, q)));
    }
  }
#endif
  for (; i < k; ++i) {
    const float q = std::nearbyint(round_to<X>(widen(x[i * stride]) * inv)) + float(zero);
    xq[i] = std::isnan(q) ? int8_t(-128) : int8_t(std::min(127.f, std::max(-128.f, q)));
  }
  for (int64_t g = 0; g < k / group; ++g) {
    int32_t s = 0;
    for (int64_t i = 0; i < group; ++i) s += xq[g * group + i];
    sums[g] = s;
  }
  return {scale, zero};
}

struct Tokens {  // the quantized activations of the step's rows
  const int8_t* xq;      // [R, K]
  const uint8_t* xu;     // [R, K]: xq + 128 (int8 weights: VNNI's unsigned operand), or null
  const int32_t* sums;   // [R, K/G]: xq's sums per group (int4 weights)
  const QuantRow* rows;  // [R]
  int64_t k, groups;
};

// Each format computes d[t][r] for tile-row block b's 16 outputs and tokens t0..t0+T-1 (block),
// then an output from d (finish).
template <typename S>
struct Int4Tiles {
  static constexpr int64_t kInputs = 8;  // per tile
  static constexpr int64_t kMaxGroup = 1 << 20;  // a group's dot fits int32: 15 * 128 * 2^20 < 2^31
  const uint8_t* packed;
  const S* scale;
  const float* rowsum;
  int64_t k, groups, group;

  // d = sum_g scale * (sum n xq - 8 sum xq): before the row's scale and zero point.
  template <int T>
  void block(int64_t b, const Tokens& x, int64_t t0, float (*out)[kTileRows]) const {
    const int64_t tiles = k / kInputs, per_group = group / kInputs;
    const uint8_t* base = packed + b * tiles * kTileBytes;
#ifdef OFFGRAPH_KV_INT_VECTOR
    constexpr int kParts = int(kTileRows / kLanes);  // registers per tile: 1 (AVX-512) or 2 (AVX2)
    Vec accf[T][kParts];
    for (int t = 0; t < T; ++t)
      for (int p = 0; p < kParts; ++p) accf[t][p] = vzero();
    for (int64_t g = 0; g < groups; ++g) {
      // One token: the low and high nibbles' dots in chains of their own (a single chain waits out
      // each dot's latency); several tokens are independent chains already.
      constexpr int C = T == 1 ? 2 : 1;
      IVec acc[T][kParts][C];
      for (int t = 0; t < T; ++t)
        for (int p = 0; p < kParts; ++p)
          for (int c = 0; c < C; ++c) acc[t][p][c] = izero();
      for (int64_t j = 0; j < per_group; ++j) {
        const int64_t tile = g * per_group + j;
        const uint8_t* src = base + tile * kTileBytes;
        for (int p = 0; p < kParts; ++p) {
          IVec lo, hi;
          isplit(iload(src + p * kLanes * 4), &lo, &hi);
          for (int t = 0; t < T; ++t) {
            const int8_t* xt = x.xq + (t0 + t) * x.k + tile * kInputs;
            acc[t][p][0] = idot(acc[t][p][0], lo, ibroadcast(xt));
            acc[t][p][C - 1] = idot(acc[t][p][C - 1], hi, ibroadcast(xt + 4));
          }
        }
      }
      const S* sc = scale + (b * groups + g) * kTileRows;
      for (int p = 0; p < kParts; ++p) {
        const Vec s = vload(sc + p * kLanes);
        for (int t = 0; t < T; ++t) {
          const int32_t offset = 8 * x.sums[(t0 + t) * x.groups + g];  // the stored nibbles' +8, for the group
          accf[t][p] = vfma(ito_float(isub(isum(acc[t][p]), offset)), s, accf[t][p]);
        }
      }
    }
    for (int t = 0; t < T; ++t)
      for (int p = 0; p < kParts; ++p) vstore(out[t] + p * kLanes, accf[t][p]);
#else
    for (int t = 0; t < T; ++t)
      for (int64_t r = 0; r < kTileRows; ++r) out[t][r] = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      for (int t = 0; t < T; ++t) {
        const int8_t* xt = x.xq + (t0 + t) * x.k;
        for (int64_t r = 0; r < kTileRows; ++r) {
          int32_t dot = 0;
          for (int64_t j = 0; j < per_group; ++j) {
            const int64_t tile = g * per_group + j;
            const uint8_t* src = base + tile * kTileBytes + r * 4;
            for (int64_t i = 0; i < 4; ++i)
              dot += int32_t(src[i] & 15) * xt[tile * kInputs + i] + int32_t(src[i] >> 4) * xt[tile * kInputs + 4 + i];
          }
          dot -= 8 * x.sums[(t0 + t) * x.groups + g];
          out[t][r] += float(dot) * widen(scale[(b * groups + g) * kTileRows + r]);
        }
      }
    }
#endif
  }
  float finish(const QuantRow& q, float d, int64_t n) const { return q.scale * (d - float(q.zero) * rowsum[n]); }
};

template <typename S>
struct Int8Tiles {
  static constexpr int64_t kInputs = 4;  // per tile
  static constexpr int64_t kChunk = 1 << 16;  // inputs whose dot fits int32: 255 * 128 * 2^16 < 2^31
  const int8_t* packed;
  const S* scale;
  const int32_t* wsum;
  int64_t k, outputs;

  // d = scale * (sum (xq + 128) q - (128 + zp) wsum): exact in integers, then one rounding.
  template <int T>
  void block(int64_t b, const Tokens& x, int64_t t0, float (*out)[kTileRows]) const {
    const int64_t tiles = k / kInputs;
    const uint8_t* base = reinterpret_cast<const uint8_t*>(packed) + b * tiles * kTileBytes;
    int64_t total[T][kTileRows] = {};
    for (int64_t c0 = 0; c0 < tiles; c0 += kChunk / kInputs) {
      const int64_t c1 = std::min(tiles, c0 + kChunk / kInputs);
      int32_t part[T][kTileRows];
#ifdef OFFGRAPH_KV_INT_VECTOR
      constexpr int kParts = int(kTileRows / kLanes);
      // One token: consecutive tiles in chains of their own (see Int4Tiles), indexed by constants only
      // (an index known at run time keeps the array in memory).
      constexpr int C = T == 1 ? kChains : 1;
      IVec acc[T][kParts][C];
      for (int t = 0; t < T; ++t)
        for (int p = 0; p < kParts; ++p)
          for (int c = 0; c < C; ++c) acc[t][p][c] = izero();
      auto dots = [&](int64_t tile, auto chain) {
        constexpr int c = decltype(chain)::value;
        const uint8_t* src = base + tile * kTileBytes;
        for (int p = 0; p < kParts; ++p) {
          const IVec w = iload(src + p * kLanes * 4);
          for (int t = 0; t < T; ++t)
            acc[t][p][c] = idot_full(acc[t][p][c], ibroadcast(x.xu + (t0 + t) * x.k + tile * kInputs), w);
        }
      };
      int64_t tile = c0;
      if constexpr (C > 1) {
        for (; tile + C <= c1; tile += C) {
          dots(tile, std::integral_constant<int, 0>{});
          dots(tile + 1, std::integral_constant<int, C - 1>{});
          if constexpr (C == 4) {
            dots(tile + 2, std::integral_constant<int, 1>{});
            dots(tile + 3, std::integral_constant<int, 2>{});
          }
        }
      }
      for (; tile < c1; ++tile) dots(tile, std::integral_constant<int, 0>{});
      for (int t = 0; t < T; ++t)
        for (int p = 0; p < kParts; ++p) istore(part[t] + p * kLanes, isum(acc[t][p]));
#else
      for (int t = 0; t < T; ++t) {
        const uint8_t* xt = x.xu + (t0 + t) * x.k;
        for (int64_t r = 0; r < kTileRows; ++r) {
          int32_t dot = 0;
          for (int64_t tile = c0; tile < c1; ++tile) {
            const int8_t* src = reinterpret_cast<const int8_t*>(base + tile * kTileBytes) + r * 4;
            for (int64_t i = 0; i < 4; ++i) dot += int32_t(xt[tile * kInputs + i]) * src[i];
          }
          part[t][r] = dot;
        }
      }
#endif
      for (int t = 0; t < T; ++t)
        for (int64_t r = 0; r < kTileRows; ++r) total[t][r] += part[t][r];
    }
    const int64_t n0 = b * kTileRows;
    for (int t = 0; t < T; ++t) {
      const int64_t offset = 128 + x.rows[t0 + t].zero;
      for (int64_t r = 0; r < kTileRows; ++r) {
        const int64_t n = n0 + r;  // padding rows have zero weights: their d is never read
        out[t][r] = n < outputs ? float(total[t][r] - offset * wsum[n]) * widen(scale[n]) : 0.f;
      }
    }
  }
  float finish(const QuantRow& q, float d, int64_t) const { return q.scale * d; }
};

// Block b's outputs for tokens t0..t0+T-1 into dst, whose row t starts at output n_base (row stride `stride`).
template <int T, typename X, typename Format>
void block_rows(const Format& w, int64_t b, const Tokens& x, int64_t t0, int64_t outputs, X* dst, int64_t stride,
                int64_t n_base) {
  float d[T][kTileRows];
  w.template block<T>(b, x, t0, d);
  const int64_t n0 = b * kTileRows, count = std::min(kTileRows, outputs - n0);
  for (int t = 0; t < T; ++t) {
    const QuantRow& q = x.rows[t0 + t];
    X* yt = dst + (t0 + t) * stride + (n0 - n_base);
    for (int64_t r = 0; r < count; ++r) from_float(w.finish(q, d[t][r], n0 + r), yt + r);
  }
}

// Every token of blocks [b0, b1) (blocks outermost: a block's weights stay in cache while every token
// batch passes over them), into dst as block_rows takes it.
template <typename X, typename Format>
void blocks_rows(const Format& w, int64_t b0, int64_t b1, const Tokens& x, int64_t rows, int64_t outputs, X* dst,
                 int64_t stride, int64_t n_base) {
  for (int64_t b = b0; b < b1; ++b) {
    int64_t t = 0;
    for (; t + kTokenBatch <= rows; t += kTokenBatch)
      block_rows<kTokenBatch>(w, b, x, t, outputs, dst, stride, n_base);
    switch (rows - t) {
      case 3: block_rows<3>(w, b, x, t, outputs, dst, stride, n_base); break;
      case 2: block_rows<2>(w, b, x, t, outputs, dst, stride, n_base); break;
      case 1: block_rows<1>(w, b, x, t, outputs, dst, stride, n_base); break;
      default: break;
    }
  }
}

// The step's rows quantized as torchao quantizes them, owned for as long as any thread reads them.
struct QuantizedRows {
  std::vector<int8_t> xq;
  std::vector<uint8_t> xu;
  std::vector<int32_t> sums;
  std::vector<QuantRow> q;
  Tokens tokens;
  template <typename X>
  QuantizedRows(const X* x, int64_t x_row, int64_t x_col, int64_t rows, int64_t k, int64_t group, bool unsigned_x)
      : xq(rows * k), xu(unsigned_x ? rows * k : 0), sums(rows * (k / group)), q(rows) {
    const int64_t groups = k / group;
    for (int64_t r = 0; r < rows; ++r)
      q[r] = quantize_row(x + r * x_row, x_col, k, group, xq.data() + r * k, sums.data() + r * groups);
    for (size_t i = 0; i < xu.size(); ++i) xu[i] = uint8_t(int32_t(xq[i]) + 128);
    tokens = Tokens{xq.data(), unsigned_x ? xu.data() : nullptr, sums.data(), q.data(), k, groups};
  }
  QuantizedRows(const QuantizedRows&) = delete;  // tokens points into the vectors
  QuantizedRows& operator=(const QuantizedRows&) = delete;
};

constexpr int64_t kSharedTiles = 4;                // a helpers' chunk: 64 outputs (shared_rows.h)
constexpr int64_t kSharedFromTiles = 4 * kSharedTiles;

// A decode linear's chunks of kSharedTiles blocks for the step's helpers.
template <typename X, typename Format>
class SharedDynamic final : public offgraph_kv_native::SharedCall {
 public:
  SharedDynamic(const X* x, int64_t x_row, int64_t x_col, int64_t rows, int64_t outputs, int64_t group,
                bool unsigned_x, const Format& w, X* y)
      : SharedCall(((outputs + kTileRows - 1) / kTileRows + kSharedTiles - 1) / kSharedTiles),
        x_(x, x_row, x_col, rows, w.k, group, unsigned_x), w_(w), rows_(rows), outputs_(outputs), y_(y) {}
  void compute_into_outputs(int64_t c) override {
    blocks_rows(w_, first(c), last(c), x_.tokens, rows_, outputs_, y_, outputs_, 0);
  }
  size_t scratch_bytes() const override { return size_t(rows_ * kSharedTiles * kTileRows) * sizeof(X); }
  void compute_into_scratch(int64_t c, void* scratch) override {
    blocks_rows(w_, first(c), last(c), x_.tokens, rows_, outputs_, static_cast<X*>(scratch),
                kSharedTiles * kTileRows, first(c) * kTileRows);
  }
  void publish(int64_t c, const void* scratch) override {
    const X* s = static_cast<const X*>(scratch);
    const int64_t n0 = first(c) * kTileRows, n = std::min(outputs_, last(c) * kTileRows) - n0;
    for (int64_t r = 0; r < rows_; ++r)
      std::memcpy(y_ + r * outputs_ + n0, s + r * kSharedTiles * kTileRows, size_t(n) * sizeof(X));
  }

 private:
  int64_t first(int64_t c) const { return c * kSharedTiles; }
  int64_t last(int64_t c) const { return std::min((outputs_ + kTileRows - 1) / kTileRows, first(c) + kSharedTiles); }
  const QuantizedRows x_;
  const Format w_;
  const int64_t rows_, outputs_;
  X* const y_;
};

// The step's rows quantized, then the outputs' tiles split over the threads OpenMP allows, or, for a
// decode step with helpers, shared with them (shared_rows.h).
template <typename X, typename Format>
void linear(const X* x, int64_t x_row, int64_t x_col, int64_t rows, int64_t outputs, int64_t group, bool unsigned_x,
            const Format& w, X* y) {
  const int64_t blocks = (outputs + kTileRows - 1) / kTileRows;
  if (step_helpers > 0 && blocks >= kSharedFromTiles) {
    HelperPool::get().run(
        std::make_shared<SharedDynamic<X, Format>>(x, x_row, x_col, rows, outputs, group, unsigned_x, w, y),
        step_helpers);
    return;
  }
  const QuantizedRows xr(x, x_row, x_col, rows, w.k, group, unsigned_x);
  int64_t parts = 1;
#ifdef _OPENMP
  parts = std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), blocks / kTilesPerThread));
#endif
#pragma omp parallel for num_threads(parts) if (parts > 1) schedule(static)
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t per = (blocks + parts - 1) / parts, b0 = std::min(blocks, p * per);
    blocks_rows(w, b0, std::min(blocks, b0 + per), xr.tokens, rows, outputs, y, outputs, 0);
  }
}

// packed [B, K/inputs, 64] of `dtype` and the outputs n (B tiles of rows hold them, the last one padded).
bool tiles(AtenTensorHandle packed, int32_t dtype, int64_t inputs, View* pv) {
  return view_of(packed, 3, pv) && contiguous(*pv) && pv->dtype == dtype && pv->sizes[2] == kTileBytes &&
         pv->sizes[0] >= 1 && pv->sizes[1] >= 1 && pv->sizes[1] <= (int64_t(1) << 40) / inputs;
}
bool fills(int64_t outputs, int64_t blocks) {
  return outputs > (blocks - 1) * kTileRows && outputs <= blocks * kTileRows;
}

// The activations' dtype and the scales' (scale_dtype) resolved, a new output made, then linear()
// over the weights format(S{}) describes; the one tail of both entry points.
template <typename Format>
AOTITorchError rows_through(AtenTensorHandle x, int32_t scale_dtype, int64_t k, int64_t outputs, int64_t group,
                            bool unsigned_x, AtenTensorHandle* ret, Format&& format) {
  View xv;
  AtenTensorHandle out = nullptr;
  void* y = nullptr;
  if (!activations(x, k, outputs, &xv, &out, &y)) return AOTI_TORCH_FAILURE;
  bool ok = false;
  with_float_type(xv.dtype, [&](auto xt) {
    using X = decltype(xt);
    ok = with_float_type(scale_dtype, [&](auto st) {
      linear(static_cast<const X*>(xv.data), xv.strides[0], xv.strides[1], xv.sizes[0], outputs, group, unsigned_x,
             format(st), static_cast<X*>(y));
    });
  });
  return finish(ok, out, ret);
}

AOTITorchError int4_da8_linear(AtenTensorHandle x, AtenTensorHandle packed, AtenTensorHandle scale,
                               AtenTensorHandle rowsum, AtenTensorHandle* ret) {
  constexpr int64_t kInputs = Int4Tiles<float>::kInputs, kMaxGroup = Int4Tiles<float>::kMaxGroup;
  View pv, sv, rv;
  if (!tiles(packed, aoti_torch_dtype_uint8(), kInputs, &pv)) return AOTI_TORCH_FAILURE;
  const int64_t blocks = pv.sizes[0], k = pv.sizes[1] * kInputs;
  if (!view_of(scale, 3, &sv) || !contiguous(sv) || sv.sizes[0] != blocks || sv.sizes[2] != kTileRows ||
      sv.sizes[1] < 1 || k % sv.sizes[1] || (k / sv.sizes[1]) % kInputs || k / sv.sizes[1] > kMaxGroup)
    return AOTI_TORCH_FAILURE;
  const int64_t groups = sv.sizes[1];
  if (!view_of(rowsum, 1, &rv) || !contiguous(rv) || rv.dtype != aoti_torch_dtype_float32() ||
      !fills(rv.sizes[0], blocks))  // the tiles' rows past rowsum's are padding
    return AOTI_TORCH_FAILURE;
  const int64_t outputs = rv.sizes[0];
  return rows_through(x, sv.dtype, k, outputs, k / groups, false, ret, [&](auto st) {
    using S = decltype(st);
    return Int4Tiles<S>{static_cast<const uint8_t*>(pv.data), static_cast<const S*>(sv.data),
                        static_cast<const float*>(rv.data), k, groups, k / groups};
  });
}

AOTITorchError int8_da8_linear(AtenTensorHandle x, AtenTensorHandle packed, AtenTensorHandle scale,
                               AtenTensorHandle wsum, AtenTensorHandle* ret) {
  constexpr int64_t kInputs = Int8Tiles<float>::kInputs;
  View pv, sv, wv;
  if (!tiles(packed, aoti_torch_dtype_int8(), kInputs, &pv)) return AOTI_TORCH_FAILURE;
  const int64_t blocks = pv.sizes[0], k = pv.sizes[1] * kInputs;
  if (!view_of(wsum, 1, &wv) || !contiguous(wv) || wv.dtype != aoti_torch_dtype_int32() || !fills(wv.sizes[0], blocks))
    return AOTI_TORCH_FAILURE;
  const int64_t outputs = wv.sizes[0];
  if (!view_of(scale, 1, &sv) || !contiguous(sv) || sv.sizes[0] != outputs) return AOTI_TORCH_FAILURE;
  return rows_through(x, sv.dtype, k, outputs, k, true, ret, [&](auto st) {
    using S = decltype(st);
    return Int8Tiles<S>{static_cast<const int8_t*>(pv.data), static_cast<const S*>(sv.data),
                        static_cast<const int32_t*>(wv.data), k, outputs};
  });
}

}  // namespace

extern "C" AOTITorchError aoti_torch_cpu_int4_da8_linear_rows(AtenTensorHandle x, AtenTensorHandle packed,
                                                              AtenTensorHandle scale, AtenTensorHandle rowsum,
                                                              AtenTensorHandle* ret0) {
  return guarded([&] { return int4_da8_linear(x, packed, scale, rowsum, ret0); });
}

extern "C" AOTITorchError aoti_torch_cpu_int8_da8_linear_rows(AtenTensorHandle x, AtenTensorHandle packed,
                                                              AtenTensorHandle scale, AtenTensorHandle wsum,
                                                              AtenTensorHandle* ret0) {
  return guarded([&] { return int8_da8_linear(x, packed, scale, wsum, ret0); });
}
