// Greedy decoding's argmax over the vocabulary, for CPU: an XLA FFI custom call (see
// model/kernels/row_argmax.py).
//
// Why a kernel: XLA CPU computed `argmax` of a [64, 49152] float32 batch (a 64-row decode
// step of the bundled model) as two reductions, each one pass over the 12.6 MB on one
// thread, 2-4 ms a step. Here each row is read once for its maximum, from L2 again for the
// maximum's first position, and rows are split over the calling thread and XLA's pool.
//
// Operand: logits [B, V] f32. Result: [B] s32, per row the first index of its maximum, or of
// its first NaN if it has one (jnp.argmax's answer).

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "column_items.h"
#include "ffi_helpers.h"

using raylm::Shape;

namespace {

// Operand types (aliases: the handler-binding macro cannot take commas in template args).
using LogitsBuffer = ffi::Buffer<ffi::F32, 2>;  // [B, V]
using TokensBuffer = ffi::Buffer<ffi::S32, 1>;  // [B]

typedef float Lanes __attribute__((vector_size(64)));
typedef int32_t Mask __attribute__((vector_size(64)));
constexpr int kLanes = 16;

// Row `x` of `n` values: the first index of its maximum, or of its first NaN. Compiled for
// AVX-512, AVX2 and baseline x86-64 (the vector extension's sixteen lanes split into the
// registers each has).
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
int32_t RowArgmax(const float* __restrict x, int64_t n) {
  // Pass 1: the largest non-NaN value (a NaN compares false, so it never replaces the running
  // maximum) and whether any value is NaN.
  Lanes best_lanes = Lanes{} - std::numeric_limits<float>::infinity();
  Mask nan_lanes = Mask{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Lanes v;
    std::memcpy(&v, x + i, sizeof v);
    best_lanes = v > best_lanes ? v : best_lanes;
    nan_lanes |= v != v;
  }
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int l = 0; l < kLanes; ++l) {
    best = best_lanes[l] > best ? best_lanes[l] : best;
    nan |= nan_lanes[l] != 0;
  }
  for (int64_t t = i; t < n; ++t) {
    best = x[t] > best ? x[t] : best;
    nan |= x[t] != x[t];
  }
  // Pass 2: the first position holding it (the row is in L2 by now).
  for (i = 0; i + kLanes <= n; i += kLanes) {
    Lanes v;
    std::memcpy(&v, x + i, sizeof v);
    const Mask hit = nan ? v != v : v == best;
    int32_t found = 0;
    for (int l = 0; l < kLanes; ++l) found |= hit[l];
    if (found)
      for (int l = 0; l < kLanes; ++l)
        if (hit[l]) return static_cast<int32_t>(i + l);
  }
  for (int64_t t = i; t < n; ++t)
    if (nan ? x[t] != x[t] : x[t] == best) return static_cast<int32_t>(t);
  return 0;  // n == 0
}

ffi::Error Argmax(ffi::ThreadPool thread_pool, LogitsBuffer logits, ffi::Result<TokensBuffer> out) {
  const auto d = logits.dimensions();
  if (out->dimensions()[0] != d[0])
    return ffi::Error::InvalidArgument("argmax: result must have one entry per row of " + Shape(d));
  const int64_t rows = d[0], n = d[1];
  if (n >= std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument("argmax: rows longer than int32 indices: " + Shape(d));
  const float* x = logits.typed_data();
  int32_t* y = out->typed_data();
  raylm::Run(
      rows, n, 0,
      [=](int64_t begin, int64_t end, float*) {
        for (int64_t r = begin; r < end; ++r) y[r] = RowArgmax(x + r * n, n);
      },
      thread_pool, /*columns_per_item=*/4);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmArgmax, Argmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<LogitsBuffer>()
                                  .Ret<TokensBuffer>());
