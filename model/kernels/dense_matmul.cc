// Small-batch dense matmul for CPU, an XLA FFI custom call (see model/kernels/dense.py).
//
// Why a kernel: a decode step multiplies a few rows (1..32 sequences) by every weight
// matrix. XLA's CPU dot runs these shapes at a third to a half of what the two cores can
// do (its GEMM packs and blocks for large matrices; one row takes a separate GEMV path
// and two rows already cost three times one). Here the weight is read as stored, each
// output row's K inputs contiguous ([N, K], the layout model/decoder/params.py keeps), so weights
// stream from memory once in order while the few activation rows stay in cache; a tile of
// MR activation rows x NR weight rows keeps MR*NR float32 vector accumulators in registers,
// and the first row tile prefetches the next weight rows, so memory keeps streaming while
// the other row tiles compute.
//
// Operands: x [M, K] f32, w [N, K] f32 (or bf16 / f16, below). Result: y [M, N] f32, y = x . w^T.
// Quantized weights (model/quantization/quant_array.py): w [N, K] int8 or float8 e4m3fn with one f32
// scale per output row, y = (x . w^T) * scale. The kernel reads the 8-bit weights and widens
// them in registers (never an f32 copy of the matrix): at one to a few rows a step is bound
// by reading weights, so a quarter of the bytes is most of the speed-up.
//
// 16-bit float weights (bfloat16 or float16, as a float32 model keeps a checkpoint's 16-bit
// matrices): w [N, K] read as stored and widened in registers (exactly: every 16-bit float is a
// float32), then the float32 tiles, so y is the float32 kernel's on the widened matrix, bit for
// bit, from half the bytes.
//
// GGUF block weights (model/quantization/gguf_blocks.py): llama.cpp's block types (Q4_0 .. Q8_0, K-quants, IQ4) kept as
// stored, 32 weights per block along k with a float32 scale (and offset) per block, widened
// with exactly the arithmetic of the gguf package's dequantization (gguf_blocks.h). With up to
// one row tile of inputs the widened weights stay in registers (GgufTile); with more, each
// tile of weight rows is widened once into an L1 panel that every row tile then reads. Either
// way the sums are the float32 tiles' on the dequantized matrix, bit for bit, from a fifth of
// the bytes.
//
// Calls of many rows (prompt chunks) run the same tiles through a loop nest blocked for the
// caches, each weight panel widened once per call (prompt_gemm.inc); model/kernels/dense.py picks it
// above KERNEL_MAX_ROWS rows.
//
// Every output element is summed in the same order whatever M, the tile it falls in or the
// thread that computes it (lanes over k, then the lanes in a fixed order, then the k tail), so
// a row's result does not depend on what else is in the batch. There are two tile families,
// eight lanes (AVX2 and older) and sixteen (AVX-512); a process runs one of them.

#include <cstdint>
#include <string>

#include "dense_columns.h"
#include "ffi_helpers.h"
#include "gguf_columns.h"
#include "gguf_operands.h"
#include "prompt_gemm.inc"

using raylm::Fp8E4m3;
using raylm::GgufRows;
using raylm::Matrix;

namespace {

using Scales = ffi::Buffer<ffi::F32, 1>;  // aliases: the binding macro cannot take commas

// Which loop nest a handler runs: the small-batch one above (decode steps) or the prompt GEMM
// (prompt_gemm.inc). model/kernels/dense.py picks by the call's rows; both give every row the same sums.
enum class Nest { kSmallBatch, kPrompt };

// Checks x [M, K], w [N, K], scale [N] (when given) and y [M, N] agree; an empty message
// when they do.
std::string ShapeError(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd, const int64_t* scale_n,
                       ffi::Span<const int64_t> yd) {
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (wd[1] == K && yd[0] == M && yd[1] == N && (!scale_n || *scale_n == N)) return "";
  return "dense_matmul: x [M, K] . w [N, K]^T (* scale [N]) -> y [M, N]; got x [" + std::to_string(M) +
         ", " + std::to_string(K) + "], w [" + std::to_string(N) + ", " + std::to_string(wd[1]) + "], " +
         (scale_n ? "scale [" + std::to_string(*scale_n) + "], " : "") + "y [" + std::to_string(yd[0]) +
         ", " + std::to_string(yd[1]) + "]";
}

// y = x . w^T (* scale) for float32 or 8-bit weights by the loop nest `kNest`.
template <Nest kNest, typename W>
void RunMatmul(const float* x, const W* w, const float* scale, float* y, int64_t M, int64_t N, int64_t K,
               ffi::ThreadPool& pool) {
  if constexpr (kNest == Nest::kPrompt) {
    RunPromptGemm(x, w, scale, y, M, N, K, pool);
  } else {
    RunDense(x, w, scale, y, M, N, K, pool);
  }
}

template <Nest kNest>
ffi::Error DenseMatmul(ffi::ThreadPool thread_pool, Matrix x, Matrix w, ffi::Result<Matrix> y) {
  const std::string error = ShapeError(x.dimensions(), w.dimensions(), nullptr, y->dimensions());
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[0];
  if (M > 0 && N > 0) RunMatmul<kNest>(x.typed_data(), w.typed_data(), nullptr, y->typed_data(), M, N, K, thread_pool);
  return ffi::Error::Success();
}

// 8-bit weights (int8 or float8 e4m3fn, told apart by the buffer's type) with a scale per
// output row: y = (x . w^T) * scale.
template <Nest kNest>
ffi::Error QuantizedMatmul(ffi::ThreadPool thread_pool, Matrix x, ffi::AnyBuffer w, Scales scale,
                           ffi::Result<Matrix> y) {
  if (w.dimensions().size() != 2) return ffi::Error::InvalidArgument("dense_matmul: w must be [N, K]");
  const int64_t scale_n = scale.dimensions()[0];
  const std::string error = ShapeError(x.dimensions(), w.dimensions(), &scale_n, y->dimensions());
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[0];
  if (M == 0 || N == 0) return ffi::Error::Success();
  return raylm::RunOnDataOf<int8_t, Fp8E4m3>(
      w, "dense_matmul: quantized weights must be int8 or float8_e4m3fn", [&](const auto* ws) {
        RunMatmul<kNest>(x.typed_data(), ws, scale.typed_data(), y->typed_data(), M, N, K, thread_pool);
      });
}

// 16-bit float weights (bfloat16 or float16, told apart by the buffer's type): y = x . w^T.
template <Nest kNest>
ffi::Error HalfMatmul(ffi::ThreadPool thread_pool, Matrix x, ffi::AnyBuffer w, ffi::Result<Matrix> y) {
  if (w.dimensions().size() != 2) return ffi::Error::InvalidArgument("dense_matmul: w must be [N, K]");
  const std::string error = ShapeError(x.dimensions(), w.dimensions(), nullptr, y->dimensions());
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[0];
  if (M == 0 || N == 0) return ffi::Error::Success();
  return raylm::RunOnDataOf<raylm::Bf16, raylm::Fp16>(
      w, "dense_matmul: 16-bit weights must be bfloat16 or float16", [&](const auto* ws) {
        RunMatmul<kNest>(x.typed_data(), ws, nullptr, y->typed_data(), M, N, K, thread_pool);
      });
}

// GgufRowsOf for a call x [M, K] . blocks^T -> y [M, N] (N from y); an empty message when all agree.
std::string GgufCallOf(const Matrix& x, ffi::AnyBuffer q, ffi::AnyBuffer scale, ffi::AnyBuffer offset,
                       Matrix supers, Scales codebook, const Matrix& y, GgufRows* rows) {
  const int64_t lead[] = {y.dimensions()[1]};
  std::string error = raylm::GgufRowsOf(q, scale, offset, supers.dimensions(), supers.typed_data(),
                                        codebook.dimensions(), codebook.typed_data(), ffi::Span<const int64_t>(lead, 1),
                                        x.dimensions()[1], rows);
  if (error.empty() && y.dimensions()[0] != x.dimensions()[0]) error = "y must be [M, N]";
  return error.empty() ? error : "x [M, K], y [M, N]; " + error;
}

// x [M, K] . blocks^T -> y [M, N].
template <Nest kNest>
ffi::Error GgufMatmul(ffi::ThreadPool thread_pool, Matrix x, ffi::AnyBuffer q, ffi::AnyBuffer scale,
                      ffi::AnyBuffer offset, Matrix supers, Scales codebook, ffi::Result<Matrix> y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = y->dimensions()[1];
  GgufRows w{};
  const std::string error = GgufCallOf(x, q, scale, offset, supers, codebook, *y, &w);
  if (!error.empty()) return ffi::Error::InvalidArgument("gguf_matmul: " + error);
  if (M == 0 || N == 0) return ffi::Error::Success();
  const float* xs = x.typed_data();
  float* ys = y->typed_data();
  if constexpr (kNest == Nest::kPrompt) {
    RunPromptGemm(xs, w, nullptr, ys, M, N, K, thread_pool);
  } else {
    Run(N, K, kMaxWeightRowsPerTile * K,
        [=](int64_t n_begin, int64_t n_end, float* panel) { GgufColumns(xs, w, ys, M, N, K, n_begin, n_end, panel); },
        thread_pool);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmDenseMatmul, DenseMatmul<Nest::kSmallBatch>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Matrix>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmDenseMatmulQuantized, QuantizedMatmul<Nest::kSmallBatch>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Scales>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmDenseMatmulHalf, HalfMatmul<Nest::kSmallBatch>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmGgufMatmul, GgufMatmul<Nest::kSmallBatch>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Matrix>()
                                  .Arg<Scales>()
                                  .Ret<Matrix>());

// The same four products by the prompt GEMM (prompt_gemm.inc), for calls of many rows.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmDenseMatmulPrompt, DenseMatmul<Nest::kPrompt>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Matrix>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmDenseMatmulQuantizedPrompt, QuantizedMatmul<Nest::kPrompt>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Scales>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmDenseMatmulHalfPrompt, HalfMatmul<Nest::kPrompt>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmGgufMatmulPrompt, GgufMatmul<Nest::kPrompt>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Matrix>()
                                  .Arg<Scales>()
                                  .Ret<Matrix>());
