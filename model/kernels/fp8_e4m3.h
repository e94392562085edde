// float8 e4m3fn (sign, 4 exponent bits with bias 7, 3 mantissa bits, no infinities) as stored
// by JAX's float8_e4m3fn, and its exact widening to float32; shared by both CPU kernels.
#ifndef RAYLM_FP8_E4M3_H_
#define RAYLM_FP8_E4M3_H_

#include <cstdint>
#include <cstring>

namespace raylm {

struct Fp8E4m3 {
  uint8_t bits;
};

// The sign moves to bit 31, exponent and mantissa under float32's, and the exponent is
// rebiased by adding 120 (127 - 7). That is exact for normal numbers; a subnormal (exponent
// 0, value m/8 * 2^-6) comes out as 2^-7 * (1 + m/8), so 2^-7 is subtracted and the rest
// doubled, again exactly. Branch-free (a loop around it vectorises) and no float32 denormal
// appears, so flush-to-zero modes do not matter. (dense_matmul.cc's Fp8FromLaneTops is the same
// steps on vector lanes.)
inline float Fp8ToFloat(Fp8E4m3 x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x80) << 24;
  const uint32_t exponent_mantissa = static_cast<uint32_t>(x.bits & 0x7F) << 20;
  const uint32_t bias = 120u << 23;
  const uint32_t value_bits = (sign | exponent_mantissa) + bias, step_bits = sign | bias;
  float value, step;
  std::memcpy(&value, &value_bits, sizeof value);
  std::memcpy(&step, &step_bits, sizeof step);
  return (exponent_mantissa & 0x07800000u) == 0 ? (value - step) * 2.0f : value;
}

}  // namespace raylm

#endif  // RAYLM_FP8_E4M3_H_
