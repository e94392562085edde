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

// GGUF block experts (gguf_blocks.h): q [G, N, K/2] uint8 (4-bit blocks) or [G, N, K] int8 (8-bit
// blocks), scale [G, N, K/group] (group 32 or 16) and offset like scale (always for 4-bit blocks)
// or [G, N, 0], float32 with supers [G, N, 0] or int8 with supers [G, N, K/256 * 2]; K a multiple
// of 32.
ffi::Error GroupedGgufMatmul(ffi::ThreadPool thread_pool, Matrix x, ffi::AnyBuffer q, ffi::AnyBuffer scale,
                             ffi::AnyBuffer offset, Stacked supers, GroupSizes group_sizes, Codebook codebook,
                             ffi::Result<Matrix> y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  const auto qd = q.dimensions(), sd = scale.dimensions(), od = offset.dimensions(), pd = supers.dimensions();
  const bool nibbles = q.element_type() == ffi::DataType::U8, two_level = pd[2] > 0;
  const bool coded = codebook.dimensions()[0] > 0;
  const ffi::DataType table = two_level ? ffi::DataType::S8 : ffi::DataType::F32;
  const bool shaped = sd.size() == 3 && od.size() == 3 && qd.size() == 3;
  std::string error = shaped ? GroupShapeError("grouped_gguf_matmul", x.dimensions(), sd, K, group_sizes.dimensions(),
                                               y->dimensions())
                             : "grouped_gguf_matmul: q, scale and offset must be 3-D";
  const int64_t scales = shaped ? sd[2] : -1;
  const bool fp8 = q.element_type() == ffi::DataType::F8E4M3FN;
  const bool agree = shaped && (nibbles || q.element_type() == ffi::DataType::S8 || fp8) && K % raylm::kGgufBlock == 0 &&
                     K > 0 && (scales == K / 32 || scales == K / 16) && qd[0] == sd[0] && qd[1] == sd[1] &&
                     qd[2] == (nibbles ? K / 2 : K) && od[0] == sd[0] && od[1] == sd[1] &&
                     (coded ? nibbles && od[2] == 0 && codebook.dimensions()[0] == 16
                            : od[2] == scales || (od[2] == 0 && !nibbles)) &&
                     scale.element_type() == table &&
                     offset.element_type() == table && pd[0] == sd[0] && pd[1] == sd[1] &&
                     (!two_level || (K % raylm::kGgufSuper == 0 && pd[2] == K / raylm::kGgufSuper * 2)) &&
                     (!fp8 || (od[2] == 0 && !coded && !two_level));
  if (error.empty() && !agree)
    error = "grouped_gguf_matmul: q [G, N, K/2] uint8 or [G, N, K] int8 or float8_e4m3fn (float32 scale, offset "
            "[G, N, 0]), scale [G, N, K/32] or [G, N, K/16], "
            "offset like scale (always for uint8 q without a codebook) or [G, N, 0], float32 tables with supers "
            "[G, N, 0] or int8 ones with supers [G, N, K/256 * 2], codebook [16] (uint8 q, offset [G, N, 0]) or [0], "
            "K a multiple of 32; got K " + std::to_string(K) + ", q " + raylm::Shape(qd) + ", scale " +
            raylm::Shape(sd) + ", offset " + raylm::Shape(od) + ", supers " + raylm::Shape(pd) + ", codebook " +
            raylm::Shape(codebook.dimensions());
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const int64_t G = sd[0], N = sd[1];
  const float* xs = x.typed_data();
  float* ys = y->typed_data();
  const auto* qs = static_cast<const uint8_t*>(q.untyped_data());
  ForEachGroup(group_sizes.typed_data(), G, M, N, ys, [&](int64_t g, int64_t start, int64_t rows) {
    const int64_t table_bytes = two_level ? 1 : 4;
    const GgufRows w{qs + g * N * qd[2], static_cast<const char*>(scale.untyped_data()) + g * N * scales * table_bytes,
                     od[2] ? static_cast<const char*>(offset.untyped_data()) + g * N * scales * table_bytes : nullptr,
                     two_level ? supers.typed_data() + g * N * pd[2] : nullptr, K, nibbles, K / scales,
                     coded ? codebook.typed_data() : nullptr, fp8};
    const float* xg = xs + start * K;
    float* yg = ys + start * N;
    Run(N, K, kMaxWeightRowsPerTile * K,
        [=](int64_t n_begin, int64_t n_end, float* panel) { GgufColumns(xg, w, yg, rows, N, K, n_begin, n_end, panel); },
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
