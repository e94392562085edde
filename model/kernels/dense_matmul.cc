// Small-batch dense matmul for CPU, an XLA FFI custom call (see model/dense.py).
//
// Why a kernel: a decode step multiplies a few rows (1..32 sequences) by every weight
// matrix. XLA's CPU dot runs these shapes at a third to a half of what the two cores can
// do (its GEMM packs and blocks for large matrices; one row takes a separate GEMV path
// and two rows already cost three times one). Here the weight is read as stored, each
// output row's K inputs contiguous ([N, K], the layout model/params.py keeps), so weights
// stream from memory once in order while the few activation rows stay in cache; a tile of
// MR activation rows x NR weight rows keeps MR*NR float32 vector accumulators in registers.
//
// Operands: x [M, K] f32, w [N, K] f32. Result: y [M, N] f32, y = x . w^T.
// Quantized weights (model/quantization.py): w [N, K] int8 or float8 e4m3fn with one f32
// scale per output row, y = (x . w^T) * scale. The kernel reads the 8-bit weights and widens
// them in registers (never an f32 copy of the matrix): at one to a few rows a step is bound
// by reading weights, so a quarter of the bytes is most of the speed-up.
//
// Every output element is summed in the same order whatever M, the tile it falls in or the
// thread that computes it (eight lanes over k, then the lanes in order, then the k tail), so
// a row's result does not depend on what else is in the batch.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "fp8_e4m3.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using raylm::Fp8E4m3;

namespace {

using Matrix = ffi::Buffer<ffi::F32, 2>;  // aliases: the binding macro cannot take commas
using Scales = ffi::Buffer<ffi::F32, 1>;

// Eight float32 lanes (one AVX2 register; two SSE registers in the portable clone).
typedef float Vec8 __attribute__((vector_size(32)));

inline Vec8 Load8(const float* p) {
  Vec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Eight 8-bit weights widened to float32 lanes. Both formats first place byte i at the top
// of 32-bit lane i (one broadcast load and one byte shuffle; plain vector extensions, which
// GCC lowers well for every clone, where a direct int8 -> float conversion came out scalar).
typedef int8_t I8x32 __attribute__((vector_size(32)));
typedef int32_t I32x8 __attribute__((vector_size(32)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));
typedef int64_t I64x4 __attribute__((vector_size(32)));

inline I32x8 BytesAtLaneTops(const void* p) {
  int64_t bits;
  std::memcpy(&bits, p, sizeof bits);
  const I64x4 copies = {bits, bits, bits, bits};
  I8x32 bytes;
  std::memcpy(&bytes, &copies, sizeof bytes);
  // The shuffle stays within each 16-byte half (a single vpshufb): the upper half's lanes
  // take bytes 4..7 of their own copy.
  const I8x32 index = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3,
                       20, 20, 20, 20, 21, 21, 21, 21, 22, 22, 22, 22, 23, 23, 23, 23};
  const I8x32 moved = __builtin_shuffle(bytes, index);
  I32x8 lanes;
  std::memcpy(&lanes, &moved, sizeof lanes);
  return lanes;
}

inline Vec8 LoadWeights(const float* p) { return Load8(p); }

// int8: an arithmetic shift sign-extends the top byte, then an exact conversion.
inline Vec8 LoadWeights(const int8_t* p) { return __builtin_convertvector(BytesAtLaneTops(p) >> 24, Vec8); }

// float8 e4m3fn: raylm::Fp8ToFloat (fp8_e4m3.h) on eight lanes, the byte already at the top.
inline Vec8 LoadWeights(const Fp8E4m3* p) {
  const U32x8 top = reinterpret_cast<U32x8>(BytesAtLaneTops(p));
  const U32x8 sign = top & 0x80000000u, exponent_mantissa = (top >> 4) & 0x07F00000u;
  const U32x8 bias = U32x8{} + (120u << 23);
  const Vec8 value = reinterpret_cast<Vec8>((sign | exponent_mantissa) + bias);
  const Vec8 subnormal = (value - reinterpret_cast<Vec8>(sign | bias)) * 2.0f;
  return (exponent_mantissa & 0x07800000u) == 0 ? subnormal : value;
}

inline float Widen(float w) { return w; }
inline float Widen(int8_t w) { return static_cast<float>(w); }
inline float Widen(Fp8E4m3 w) { return raylm::Fp8ToFloat(w); }

inline float SumLanes(Vec8 v) {
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// y[i, j] = x[i, :] . w[j, :] for i < MR, j < NR. MR = 3, NR = 4 measured best of 2x4,
// 4x3, 2x5, 3x4 and 4x2 on the dev machine (12 accumulators, 4 weight vectors, 1 input).
// Multiversioned so the same binary uses AVX-512 / AVX2+FMA where the CPU has them.
template <int MR, int NR, typename W>
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void Tile(const float* __restrict x, const W* __restrict w, const float* __restrict scale,
          float* __restrict y, int64_t K, int64_t N) {
  Vec8 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = Vec8{};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if constexpr (sizeof(W) == 1) {
      // 8-bit rows are short (576 B for K = 576): too short for the hardware prefetcher to
      // pick up before they end, which left a one-row call at a third of DRAM bandwidth.
      // Fetch the next tile's rows (contiguous after these) one tile ahead.
      if (k % 64 == 0)
        for (int j = 0; j < NR; ++j) __builtin_prefetch(w + (NR + j) * K + k);
    }
    Vec8 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = LoadWeights(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const Vec8 xv = Load8(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = SumLanes(acc[i][j]);
      // std::fma, not `s += x * w`: whether the compiler fuses a written multiply-add
      // depends on how it vectorises each instantiation, and the float32-panel and direct
      // 8-bit tiles must round the tail alike (batch invariance).
      for (int64_t t = k; t < K; ++t) s = std::fma(x[i * K + t], Widen(w[j * K + t]), s);
      y[i * N + j] = scale ? s * scale[j] : s;
    }
}

// out[0 .. count) = w[0 .. count) widened to float32 (exactly: both formats fit).
template <typename W>
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void WidenRows(const W* __restrict w, float* __restrict out, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const Vec8 v = LoadWeights(w + i);
    std::memcpy(out + i, &v, sizeof v);
  }
  for (; i < count; ++i) out[i] = Widen(w[i]);
}

constexpr int kRowsPerTile = 3, kWeightRowsPerTile = 4;

// Output columns [n_begin, n_end) for all M rows. `scale` is null for float32 weights.
// 8-bit weights feeding more than one input row are widened once per tile of weight rows
// into `panel` (NR * K floats, L1-resident), which every row then reads: widening them in
// every row tile made 4..32-row calls slower than float32. The widened values are exact, so
// a row's sums are the same on either path (the batch-invariance the engine relies on).
template <typename W>
void Columns(const float* x, const W* w, const float* scale, float* y, int64_t M, int64_t N, int64_t K,
             int64_t n_begin, int64_t n_end, float* panel) {
  constexpr int MR = kRowsPerTile, NR = kWeightRowsPerTile;
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR) {  // NR weight rows stay in L1 while every input row passes
    int64_t m = 0;
    const float* s = scale ? scale + n : nullptr;
    if (sizeof(W) == 1 && M > 1) {
      WidenRows(w + n * K, panel, NR * K);
      for (; m + MR <= M; m += MR) Tile<MR, NR>(x + m * K, panel, s, y + m * N + n, K, N);
      for (; m < M; ++m) Tile<1, NR>(x + m * K, panel, s, y + m * N + n, K, N);
      continue;
    }
    for (; m + MR <= M; m += MR) Tile<MR, NR>(x + m * K, w + n * K, s, y + m * N + n, K, N);
    for (; m < M; ++m) Tile<1, NR>(x + m * K, w + n * K, s, y + m * N + n, K, N);
  }
  for (; n < n_end; ++n)
    for (int64_t m = 0; m < M; ++m)
      Tile<1, 1>(x + m * K, w + n * K, scale ? scale + n : nullptr, y + m * N + n, K, N);
}

// Weight rows per work item: a multiple of the tile, small enough that two threads share
// the work evenly, large enough that claiming an item costs nothing next to computing it.
constexpr int64_t kColumnsPerItem = 64;
// Below this many weights (256 KiB) a call runs on the calling thread alone: waking a pool
// thread costs tens of microseconds, about what reading this much takes. Counted in weights,
// not multiply-adds: at one row the call is bound by memory bandwidth, which one core does
// not saturate. (8-bit weights use the same count: half the work of a parallel call is
// converting them, which the second core shares.)
constexpr int64_t kMinParallelWeights = int64_t{1} << 16;

// Splits the columns over the calling thread and XLA's intra-op pool. Items are claimed one
// by one from a shared counter, so the caller never waits for an item nobody has started and
// a helper that starts late finds nothing left and touches only `state`.
template <typename W>
void Run(const float* x, const W* w, const float* scale, float* y, int64_t M, int64_t N, int64_t K,
         ffi::ThreadPool& pool) {
  const int64_t items = (N + kColumnsPerItem - 1) / kColumnsPerItem;
  const int64_t threads =
      N * K >= kMinParallelWeights ? std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), items) : 1;
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto participate = [state, items, x, w, scale, y, M, N, K] {
    std::unique_ptr<float[]> panel(sizeof(W) == 1 && M > 1 ? new float[kWeightRowsPerTile * K] : nullptr);
    for (int64_t i = state->next.fetch_add(1); i < items; i = state->next.fetch_add(1)) {
      Columns(x, w, scale, y, M, N, K, i * kColumnsPerItem, std::min(N, (i + 1) * kColumnsPerItem), panel.get());
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < threads; ++t) pool.Schedule(decltype(participate)(participate));
  participate();
  while (state->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

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

ffi::Error DenseMatmul(ffi::ThreadPool thread_pool, Matrix x, Matrix w, ffi::Result<Matrix> y) {
  const std::string error = ShapeError(x.dimensions(), w.dimensions(), nullptr, y->dimensions());
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[0];
  if (M > 0 && N > 0) Run(x.typed_data(), w.typed_data(), nullptr, y->typed_data(), M, N, K, thread_pool);
  return ffi::Error::Success();
}

// 8-bit weights (int8 or float8 e4m3fn, told apart by the buffer's type) with a scale per
// output row: y = (x . w^T) * scale.
ffi::Error QuantizedMatmul(ffi::ThreadPool thread_pool, Matrix x, ffi::AnyBuffer w, Scales scale,
                           ffi::Result<Matrix> y) {
  if (w.dimensions().size() != 2) return ffi::Error::InvalidArgument("dense_matmul: w must be [N, K]");
  const int64_t scale_n = scale.dimensions()[0];
  const std::string error = ShapeError(x.dimensions(), w.dimensions(), &scale_n, y->dimensions());
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[0];
  if (M == 0 || N == 0) return ffi::Error::Success();
  switch (w.element_type()) {
    case ffi::DataType::S8:
      Run(x.typed_data(), static_cast<const int8_t*>(w.untyped_data()), scale.typed_data(), y->typed_data(), M,
          N, K, thread_pool);
      return ffi::Error::Success();
    case ffi::DataType::F8E4M3FN:
      Run(x.typed_data(), static_cast<const Fp8E4m3*>(w.untyped_data()), scale.typed_data(), y->typed_data(), M,
          N, K, thread_pool);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("dense_matmul: quantized weights must be int8 or float8_e4m3fn");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmDenseMatmul, DenseMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Matrix>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmDenseMatmulQuantized, QuantizedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Scales>()
                                  .Ret<Matrix>());
