// The integer compute mode's vector families (int8_matmul.cc): AVX-512 VNNI (int8_vnni.inc) and
// AVX2 (int8_avx2.inc) tiles of the arithmetic int8_matmul.cc describes, and their quantization of
// the activations, each the same bits as int8_panels.h's portable loops.
#ifndef RAYLM_INT8_FAMILIES_H_
#define RAYLM_INT8_FAMILIES_H_

#include <algorithm>
#include <cstdint>

#include "int8_panels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace {

#if defined(__x86_64__) && defined(__GNUC__)
#define RAYLM_INT8_VECTOR_FAMILIES 1

// Packed weights per column panel (read again by every block of rows) and quantized rows per
// block: together about half of a core's L2, as in prompt_gemm.inc.
constexpr int64_t kInt8PanelBytes = 256 << 10;
constexpr int64_t kInt8RowBlockBytes = 128 << 10;

#include "int8_vnni.inc"
#include "int8_avx2.inc"
#endif

}  // namespace

#endif  // RAYLM_INT8_FAMILIES_H_
