// Grouped matmul for CPU, XLA FFI custom calls: a mixture of experts' stacked experts
// (model/kernels/grouped_matmul.py).
//
// x [M, K] f32 whose rows are consecutive groups, group_sizes [G] int32 rows each, and G weight
// matrices stacked [G, N, K]; group g's rows times matrix g, y [M, N] f32. Rows past the groups
// (padding) come out as zeros. Each group is one call of the dense kernel's path for its weight
// format (dense_matmul.cc): float32, 8-bit (int8 or float8 e4m3fn) with a scale per output row,
// or GGUF blocks as stored. So only the rows routed to an expert are computed
// and only the experts that got rows are read, in their stored bytes: 8-bit and block experts are
// never widened into a float32 copy of the stack. And since the dense path sums each output in
// the same order whatever the batch, a token's result does not depend on what else was routed
// with it, and 8-bit and block experts give the float32 kernel's sums on the widened weights bit
// for bit (times the scale, for 8-bit ones).
//
// The dense kernel's loop nests (dense_columns.h, gguf_columns.h) are compiled into this library,
// so its tiles inline here as there and both libraries pick the same tile family: this file adds
// only the grouping.

#include <algorithm>
#include <cstdint>
#include <string>

#include "dense_columns.h"
#include "ffi_helpers.h"
#include "gguf_columns.h"
#include "gguf_operands.h"
#include "group_rows.h"

using raylm::Fp8E4m3;
using raylm::GgufRows;
using raylm::Matrix;

namespace {

using Stacked = ffi::Buffer<ffi::F32, 3>;
using GroupSizes = ffi::Buffer<ffi::S32, 1>;
using Codebook = ffi::Buffer<ffi::F32, 1>;  // a GGUF block matrix's 16 code values, or [0] (gguf_blocks.h)

// Checks x [M, K], weights [G, N, ...] of K inputs per row (`w_inputs`), group_sizes [G] and
// y [M, N] agree; an empty message when they do.
std::string GroupShapeError(const char* name, ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd,
                            int64_t w_inputs, ffi::Span<const int64_t> sizes, ffi::Span<const int64_t> yd) {
  if (wd.size() == 3 && w_inputs == xd[1] && sizes[0] == wd[0] && yd[0] == xd[0] && yd[1] == wd[1]) return "";
  return std::string(name) + ": x [M, K], w [G, N, K], group_sizes [G] -> y [M, N]; got x " + raylm::Shape(xd) +
         ", w " + raylm::Shape(wd) + " (" + std::to_string(w_inputs) + " inputs per row), group_sizes " +
         raylm::Shape(sizes) + ", y " + raylm::Shape(yd);
}

ffi::Error GroupedMatmul(ffi::ThreadPool thread_pool, Matrix x, Stacked w, GroupSizes group_sizes,
                         ffi::Result<Matrix> y) {
  const std::string error = GroupShapeError("grouped_matmul", x.dimensions(), w.dimensions(), w.dimensions()[2],
                                            group_sizes.dimensions(), y->dimensions());
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], G = w.dimensions()[0], N = w.dimensions()[1];
  const float *xs = x.typed_data(), *ws = w.typed_data();
  float* ys = y->typed_data();
  ForEachGroup(group_sizes.typed_data(), G, M, N, ys, [&](int64_t g, int64_t start, int64_t rows) {
    RunDense(xs + start * K, ws + g * N * K, nullptr, ys + start * N, rows, N, K, thread_pool);
  });
  return ffi::Error::Success();
}

// 8-bit experts w [G, N, K] (int8 or float8 e4m3fn, told apart by the buffer's type) with a
// scale per (expert, output row), scale [G, N].
template <typename W>
void GroupedQuantized(const float* x, const W* w, const float* scale, const int32_t* sizes, float* y, int64_t M,
                      int64_t G, int64_t N, int64_t K, ffi::ThreadPool& pool) {
  ForEachGroup(sizes, G, M, N, y, [&](int64_t g, int64_t start, int64_t rows) {
    RunDense(x + start * K, w + g * N * K, scale + g * N, y + start * N, rows, N, K, pool);
  });
}

ffi::Error GroupedQuantizedMatmul(ffi::ThreadPool thread_pool, Matrix x, ffi::AnyBuffer w, Matrix scale,
                                  GroupSizes group_sizes, ffi::Result<Matrix> y) {
  const auto wd = w.dimensions();
  std::string error = GroupShapeError("grouped_quantized_matmul", x.dimensions(), wd, wd.size() == 3 ? wd[2] : -1,
                                      group_sizes.dimensions(), y->dimensions());
  if (error.empty() && (scale.dimensions()[0] != wd[0] || scale.dimensions()[1] != wd[1]))
    error = "grouped_quantized_matmul: scale must be [G, N] for w " + raylm::Shape(wd) + ", got " +
            raylm::Shape(scale.dimensions());
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], G = wd[0], N = wd[1];
  return raylm::RunOnDataOf<int8_t, Fp8E4m3>(w, "grouped_quantized_matmul: w must be int8 or float8_e4m3fn",
                                             [&](const auto* ws) {
                                               GroupedQuantized(x.typed_data(), ws, scale.typed_data(),
                                                                group_sizes.typed_data(), y->typed_data(), M, G, N,
                                                                K, thread_pool);
                                             });
}

// GGUF block experts [G, N, ...] (gguf_operands.h), K a multiple of 32.
ffi::Error GroupedGgufMatmul(ffi::ThreadPool thread_pool, Matrix x, ffi::AnyBuffer q, ffi::AnyBuffer scale,
                             ffi::AnyBuffer offset, Stacked supers, GroupSizes group_sizes, Codebook codebook,
                             ffi::Result<Matrix> y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  const auto sd = scale.dimensions();
  GgufRows experts{};
  std::string error = GroupShapeError("grouped_gguf_matmul", x.dimensions(), sd, K, group_sizes.dimensions(),
                                      y->dimensions());
  if (error.empty()) {
    error = raylm::GgufRowsOf(q, scale, offset, supers.dimensions(), supers.typed_data(), codebook.dimensions(),
                              codebook.typed_data(), sd.first(2), K, &experts);
    if (!error.empty()) error = "grouped_gguf_matmul: " + error;
  }
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const int64_t G = sd[0], N = sd[1];
  const float* xs = x.typed_data();
  float* ys = y->typed_data();
  ForEachGroup(group_sizes.typed_data(), G, M, N, ys, [&](int64_t g, int64_t start, int64_t rows) {
    const GgufRows w = experts.From(g * N);
    const float* xg = xs + start * K;
    float* yg = ys + start * N;
    Run(N, K, kMaxWeightRowsPerTile * K,
        [=](int64_t n_begin, int64_t n_end, float* panel) {
          GgufColumns(xg, w, yg, rows, N, K, n_begin, n_end, panel);
        },
        thread_pool);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmGroupedMatmul, GroupedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Stacked>()
                                  .Arg<GroupSizes>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmGroupedQuantizedMatmul, GroupedQuantizedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Matrix>()
                                  .Arg<GroupSizes>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmGroupedGgufMatmul, GroupedGgufMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Stacked>()
                                  .Arg<GroupSizes>()
                                  .Arg<Codebook>()
                                  .Ret<Matrix>());
