// bfloat16 as JAX stores it (a float32's top 16 bits) and its exact widening to float32: the
// LoRA kernel's opt-in slot dtype (lora_delta.cc) read by the dense kernel's tiles and its own.
#ifndef RAYLM_BFLOAT16_H_
#define RAYLM_BFLOAT16_H_

#include <cstdint>
#include <cstring>

namespace raylm {

struct Bf16 {
  uint16_t bits;
};

inline float Bf16ToFloat(Bf16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// A vector of bfloat16 at p widened to float32 lanes (each value to the top half of its lane):
// `Floats` holds the result, `Halves` and `Words` the same number of 16- and 32-bit lanes.
template <typename Floats, typename Halves, typename Words>
__attribute__((always_inline)) inline Floats LoadBf16Lanes(const Bf16* p) {
  Halves halves;
  std::memcpy(&halves, p, sizeof halves);
  return reinterpret_cast<Floats>(__builtin_convertvector(halves, Words) << 16);
}

}  // namespace raylm

#endif  // RAYLM_BFLOAT16_H_
