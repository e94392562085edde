// IEEE binary16 (float16) and its exact widening to float32: the integer kernel's block scales
// (int8_matmul.cc), which GGUF stores as float16, for its portable loops (the vector families
// convert with F16C's vcvtph2ps, which gives the same values).
#ifndef RAYLM_FLOAT16_H_
#define RAYLM_FLOAT16_H_

#include <cstdint>
#include <cstring>

namespace raylm {

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);  // infinity or NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);  // rebias 15 -> 127
  } else if (mantissa == 0) {
    bits = sign;  // zero
  } else {  // subnormal: normalise (the value is mantissa * 2^-24, exact in float32)
    exponent = 113;
    while (!(mantissa & 0x400u)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace raylm

#endif  // RAYLM_FLOAT16_H_
