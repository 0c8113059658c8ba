// The 16-bit float types the CPU kernels read (bf16, fp16), their scalar
// widening to fp32 and narrowing from it (round to nearest even, as torch's
// casts), shared by the CPU kernels (native/*.cpp).
// Scalar forms serve tails and machines without the vector conversions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace offgraph_kv_native {

struct Bf16 { uint16_t x; };
struct Half { uint16_t x; };

inline float widen(float x) { return x; }

inline float widen(Bf16 v) {  // bf16 is the top half of an fp32
  const uint32_t bits = uint32_t(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float widen(Half v) {
  const uint16_t h = v.x;
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else {  // zero or subnormal: man * 2^-24, exact in fp32
    float f = float(man) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, Bf16* out) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if (std::isnan(x)) {
    out->x = uint16_t((bits >> 16) | 0x40);
    return;
  }
  out->x = uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
inline void from_float(float x, Half* out) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint16_t sign = uint16_t((bits >> 16) & 0x8000);
  const float a = std::fabs(x);
  if (std::isnan(x)) {
    out->x = uint16_t(sign | 0x7e00);
  } else if (a >= 65520.f) {  // rounds past the largest half
    out->x = uint16_t(sign | 0x7c00);
  } else if (a < 6.103515625e-05f) {  // subnormal half: a multiple of 2^-24, rounded to even
    out->x = uint16_t(sign | uint16_t(std::nearbyint(a * 16777216.f)));
  } else {
    uint32_t m;
    std::memcpy(&m, &a, 4);
    const uint32_t rounded = m + 0xfffu + ((m >> 13) & 1u);
    out->x = uint16_t(sign | uint16_t((rounded - (112u << 23)) >> 13));
  }
}

// x rounded to T and back: what a torch op computing in T's dtype leaves (its math in fp32, one rounding).
template <typename T>
inline float round_to(float x) {
  T t;
  from_float(x, &t);
  return widen(t);
}

}  // namespace offgraph_kv_native
