// The vector ISA a CPU program was compiled for (inductor's flags: AVX-512 or
// AVX2 + FMA), as one small set of operations over fp32 lanes, shared by
// rows_attention.cpp and decode_linear.cpp. Loads widen the stored formats
// (bf16, fp16, int8, packed nibbles) to fp32 in registers, so no kernel
// converts a row into scratch first. Without either ISA, OFFGRAPH_KV_VECTOR is
// undefined and the kernels take their scalar loops.
#pragma once

#include "float16.h"

#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace offgraph_kv_native {
namespace vec {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset(float x) { return _mm512_set1_ps(x); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const Bf16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline Vec vload(const Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vec vload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// kLanes packed bytes' low and high nibbles less `offset`, as floats (exact: small integers).
inline void vnibbles(const uint8_t* p, int32_t offset, Vec* lo, Vec* hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i o = _mm512_set1_epi32(offset);
  *lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(b, _mm512_set1_epi32(15)), o));
  *hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), o));
}
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }  // b where either is NaN
inline Vec vmin(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec vround(Vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vpow2(Vec n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline float vsum(Vec a) { return _mm512_reduce_add_ps(a); }
inline float vhmax(Vec a) { return _mm512_reduce_max_ps(a); }
// The four sums of a..d, in one 4-lane register (lane i: the i-th argument's).
inline __m128 vsum4(Vec a, Vec b, Vec c, Vec d) {
  auto halve = [](Vec x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  };
  const __m256 ab = _mm256_hadd_ps(halve(a), halve(b)), cd = _mm256_hadd_ps(halve(c), halve(d));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#define OFFGRAPH_KV_VECTOR 1
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float x) { return _mm256_set1_ps(x); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const Bf16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#ifdef __F16C__
inline Vec vload(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#else
inline Vec vload(const Half* p) {
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = widen(p[i]);
  return _mm256_load_ps(f);
}
#endif
inline Vec vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void vnibbles(const uint8_t* p, int32_t offset, Vec* lo, Vec* hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i o = _mm256_set1_epi32(offset);
  *lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(15)), o));
  *hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), o));
}
inline void vstore(float* p, Vec a) { _mm256_storeu_ps(p, a); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }  // b where either is NaN
inline Vec vmin(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec vround(Vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vpow2(Vec n) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline float vsum(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vhmax(Vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline __m128 vsum4(Vec a, Vec b, Vec c, Vec d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#define OFFGRAPH_KV_VECTOR 1
#else
constexpr int64_t kLanes = 1;
#endif

#ifdef OFFGRAPH_KV_VECTOR
// e^x in every lane, within ~2 ulp of expf (Cody-Waite reduction x = n ln2 + r,
// then a degree-6 polynomial for e^r, as Cephes' expf). Below -87.3 it returns
// e^-87.3 (~1e-38) instead of rounding towards 0: only softmax weights of
// logits far below the peak come out there, where either is 0 in any sum.
// NaN stays NaN (vmax / vmin keep their second operand where either is NaN).
inline Vec vexp(Vec x) {
  x = vmin(vset(88.3762626647949f), vmax(vset(-87.3365447504f), x));
  const Vec n = vround(vmul(x, vset(1.44269504088896341f)));
  Vec r = vfma(n, vset(-0.693359375f), x);
  r = vfma(n, vset(2.12194440e-4f), r);
  Vec p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset(1.f)));
  return vmul(p, vpow2(n));
}
#endif

}  // namespace vec
}  // namespace offgraph_kv_native
