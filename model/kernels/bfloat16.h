// bfloat16 as JAX stores it (a float32's top 16 bits) and its exact widening to float32: the
// LoRA kernel's opt-in slot dtype (lora_delta.cc) read by the dense kernel's tiles.
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

}  // namespace raylm

#endif  // RAYLM_BFLOAT16_H_
