// IEEE binary16 (float16) and its exact widening to float32: the integer kernel's block scales
// (int8_matmul.cc), which GGUF stores as float16, for its portable loops (the vector families
// convert with F16C's vcvtph2ps, which gives the same values); and float16 weight matrices
// (Fp16), which the dense kernel's tiles widen in registers (lane_loads.h).
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

// A float16 value as the dense kernel reads a weight matrix's (numpy / JAX float16).
struct Fp16 {
  uint16_t bits;
};

inline float Fp16ToFloat(Fp16 v) { return HalfToFloat(v.bits); }

// A vector of float16 at p widened to float32 lanes, HalfToFloat lane-wise in plain vector
// arithmetic (any target; F16C's vcvtph2ps gives the same values where a family may use it):
// exponent and mantissa moved into float32's fields and rebiased; infinities and NaNs rebiased
// once more; zeros and subnormals made normal by one more exponent step, then that step's
// value (2^-14) subtracted, which is exact. `Floats` holds the result, `Halves` and `Words`
// the same number of 16- and 32-bit lanes.
template <typename Floats, typename Halves, typename Words>
__attribute__((always_inline)) inline Floats LoadFp16Lanes(const Fp16* p) {
  Halves halves;
  std::memcpy(&halves, p, sizeof halves);
  const Words h = __builtin_convertvector(halves, Words);
  const Words sign = (h & 0x8000u) << 16;
  const Words shifted = (h & 0x7FFFu) << 13;       // exponent and mantissa, float32's places
  const Words exponent = shifted & 0x0F800000u;    // float16's exponent field, moved
  Words bits = shifted + (112u << 23);             // rebias 15 -> 127
  bits = exponent == 0x0F800000u ? bits + (112u << 23) : bits;  // infinity or NaN: exponent 255
  const Floats magic = reinterpret_cast<Floats>(Words{} + (113u << 23));  // 2^-14
  const Floats small = reinterpret_cast<Floats>(bits + (1u << 23)) - magic;
  const Words value = exponent == 0 ? reinterpret_cast<Words>(small) : bits;
  return reinterpret_cast<Floats>(value | sign);
}

}  // namespace raylm

#endif  // RAYLM_FLOAT16_H_
