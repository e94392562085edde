// The operand check the GGUF block kernels share: one matrix (dense_matmul.cc) or a stack of
// experts (grouped_matmul.cc) passed as q, scale, offset, supers and codebook buffers. It says
// in one message what the buffers must be, and gives the GgufRows they describe. Kept in one
// place so that a weight format both kernels read is checked the same way by both.
#ifndef RAYLM_GGUF_OPERANDS_H_
#define RAYLM_GGUF_OPERANDS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "ffi_helpers.h"
#include "gguf_blocks.h"

namespace raylm {

// Whether `d` is `lead` followed by one more dimension; its last dimension, or -1 where not.
inline int64_t LastAfter(ffi::Span<const int64_t> d, ffi::Span<const int64_t> lead) {
  if (d.size() != lead.size() + 1) return -1;
  for (size_t i = 0; i < lead.size(); ++i)
    if (d[i] != lead[i]) return -1;
  return d[lead.size()];
}

// GGUF block weights (gguf_blocks.h) with leading dimensions `lead` ([N] for a matrix, [G, N]
// for G stacked experts) of rows of K, K a multiple of 32:
// - q [..., K/2] uint8 (4-bit blocks), [..., K] int8 (8-bit blocks), or [..., K] float8_e4m3fn
//   (fp8 values under float32 scales, no offset: block-scaled FP8 checkpoints);
// - scale [..., K/32] or [..., K/16] (group 32 or 16);
// - offset like scale (always for 4-bit blocks without a codebook), or [..., 0];
// - float32 tables with supers [..., 0], or int8 ones with supers [..., K/256 * 2] (two levels);
// - codebook [16] (4-bit codes, offset [..., 0]) or [0].
// Checks the buffers agree and fills `rows` with all their rows (a stack's experts one after
// another: GgufRows::From picks one); an empty message when they agree.
inline std::string GgufRowsOf(ffi::AnyBuffer q, ffi::AnyBuffer scale, ffi::AnyBuffer offset,
                              ffi::Span<const int64_t> supers_dims, const float* supers,
                              ffi::Span<const int64_t> codebook_dims, const float* codebook,
                              ffi::Span<const int64_t> lead, int64_t K, GgufRows* rows) {
  const bool nibbles = q.element_type() == ffi::DataType::U8, coded = codebook_dims[0] > 0;
  const bool fp8 = q.element_type() == ffi::DataType::F8E4M3FN;
  const int64_t q_last = LastAfter(q.dimensions(), lead), scales = LastAfter(scale.dimensions(), lead);
  const int64_t offsets = LastAfter(offset.dimensions(), lead), super_pairs = LastAfter(supers_dims, lead);
  const bool two_level = super_pairs > 0;
  const ffi::DataType table = two_level ? ffi::DataType::S8 : ffi::DataType::F32;
  const bool bytes = nibbles || fp8 || q.element_type() == ffi::DataType::S8;
  const bool tables = (scales == K / 32 || scales == K / 16) && scale.element_type() == table &&
                      offset.element_type() == table && super_pairs >= 0 &&
                      (!two_level || (K % kGgufSuper == 0 && super_pairs == K / kGgufSuper * 2));
  const bool offsets_agree = coded ? nibbles && offsets == 0 && codebook_dims[0] == 16
                                   : offsets == scales || (offsets == 0 && !nibbles);
  const bool agree = bytes && K % kGgufBlock == 0 && K > 0 && q_last == (nibbles ? K / 2 : K) && tables &&
                     offsets_agree && (!fp8 || (offsets == 0 && !coded && !two_level));
  if (!agree) {
    const std::string n = lead.size() == 1 ? "N" : "G, N";
    return "q [" + n + ", K/2] uint8 or [" + n + ", K] int8 or float8_e4m3fn (float32 scale, offset [" + n +
           ", 0]), scale [" + n + ", K/32] or [" + n + ", K/16], offset like scale (always for uint8 q without a "
           "codebook) or [" + n + ", 0], float32 tables with supers [" + n + ", 0] or int8 ones with supers [" + n +
           ", K/256 * 2], codebook [16] (uint8 q, offset [" + n + ", 0]) or [0], K a multiple of 32; got " +
           (lead.size() == 1 ? "N " + std::to_string(lead[0]) + ", " : "") + "K " + std::to_string(K) + ", q " +
           Shape(q.dimensions()) + ", scale " + Shape(scale.dimensions()) + ", offset " +
           Shape(offset.dimensions()) + ", supers " + Shape(supers_dims) + ", codebook " + Shape(codebook_dims);
  }
  *rows = GgufRows{static_cast<const uint8_t*>(q.untyped_data()), scale.untyped_data(),
                   offsets ? offset.untyped_data() : nullptr, two_level ? supers : nullptr, K, nibbles,
                   K / scales, coded ? codebook : nullptr, fp8};
  return "";
}

}  // namespace raylm

#endif  // RAYLM_GGUF_OPERANDS_H_
