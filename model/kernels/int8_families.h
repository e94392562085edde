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

// How far ahead of its block a tile asks for a packed group's bytes. A decode row reads each weight
// once, from memory: without asking, the AVX2 six-bit tile spent a fifth of an 8B model's decode
// step waiting for the first line of each block. 1024 and 4096 bytes measured within the noise
// of 2048 (AVX2, one to four rows).
constexpr int64_t kInt8PrefetchBytes = 2048;

// One packed group's bytes as a tile walks its blocks (Int8Panels::Vector without its per-call
// index arithmetic, which the compiler kept in the loops).
template <Format F>
struct GroupVectors {
  static constexpr int64_t kBlockBytes = VectorsOf(F) * kVectorBytes;
  const uint8_t* first;  // block 0's vector 0, from column n's lane

  GroupVectors(const Int8Panels& w, int64_t n) : first(w.Vector(n, 0, 0)) {}
  // Vector t of block b, from `lane` bytes past column n's lane (AVX2's next eight columns: 32).
  const uint8_t* At(int64_t b, int t, int64_t lane = 0) const {
    return first + b * kBlockBytes + t * kVectorBytes + lane;
  }
  // Asks for the lines kInt8PrefetchBytes past block b's start (past the group's end: the next
  // group's, which the tile's thread reads next; a prefetch never faults).
  void Prefetch(int64_t b) const {
    const char* ahead = reinterpret_cast<const char*>(first + b * kBlockBytes + kInt8PrefetchBytes);
    for (int64_t line = 0; line < kBlockBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
  }
};

#include "int8_vnni.inc"
#include "int8_avx2.inc"
#endif

}  // namespace

#endif  // RAYLM_INT8_FAMILIES_H_
