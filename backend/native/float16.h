// The 16-bit float types the CPU kernels read (bf16, fp16) and their scalar
// widening to fp32, shared by decode_attention.cpp and decode_linear.cpp.
// Scalar forms serve tails and machines without the vector conversions.
#pragma once

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

}  // namespace offgraph_kv_native
