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
//
// Every output element is summed in the same order whatever M, the tile it falls in or the
// thread that computes it (eight lanes over k, then the lanes in order, then the k tail), so
// a row's result does not depend on what else is in the batch.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Matrix = ffi::Buffer<ffi::F32, 2>;  // alias: the binding macro cannot take commas

// Eight float32 lanes (one AVX2 register; two SSE registers in the portable clone).
typedef float Vec8 __attribute__((vector_size(32)));

inline Vec8 Load8(const float* p) {
  Vec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float SumLanes(Vec8 v) {
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// y[i, j] = x[i, :] . w[j, :] for i < MR, j < NR. MR = 3, NR = 4 measured best of 2x4,
// 4x3, 2x5, 3x4 and 4x2 on the dev machine (12 accumulators, 4 weight vectors, 1 input).
// Multiversioned so the same binary uses AVX-512 / AVX2+FMA where the CPU has them.
template <int MR, int NR>
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void Tile(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t K,
          int64_t N) {
  Vec8 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = Vec8{};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    Vec8 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = Load8(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const Vec8 xv = Load8(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = SumLanes(acc[i][j]);
      for (int64_t t = k; t < K; ++t) s += x[i * K + t] * w[j * K + t];
      y[i * N + j] = s;
    }
}

constexpr int kRowsPerTile = 3, kWeightRowsPerTile = 4;

// Output columns [n_begin, n_end) for all M rows.
void Columns(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
             int64_t n_begin, int64_t n_end) {
  constexpr int MR = kRowsPerTile, NR = kWeightRowsPerTile;
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR) {  // NR weight rows stay in L1 while every input row passes
    int64_t m = 0;
    for (; m + MR <= M; m += MR) Tile<MR, NR>(x + m * K, w + n * K, y + m * N + n, K, N);
    for (; m < M; ++m) Tile<1, NR>(x + m * K, w + n * K, y + m * N + n, K, N);
  }
  for (; n < n_end; ++n)
    for (int64_t m = 0; m < M; ++m) Tile<1, 1>(x + m * K, w + n * K, y + m * N + n, K, N);
}

// Weight rows per work item: a multiple of the tile, small enough that two threads share
// the work evenly, large enough that claiming an item costs nothing next to computing it.
constexpr int64_t kColumnsPerItem = 64;
// Below this many weights (256 KiB) a call runs on the calling thread alone: waking a pool
// thread costs tens of microseconds, about what reading this much takes. Counted in weights,
// not multiply-adds: at one row the call is bound by memory bandwidth, which one core does
// not saturate.
constexpr int64_t kMinParallelWeights = int64_t{1} << 16;

// Splits the columns over the calling thread and XLA's intra-op pool. Items are claimed one
// by one from a shared counter, so the caller never waits for an item nobody has started and
// a helper that starts late finds nothing left and touches only `state`.
void Run(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
         ffi::ThreadPool& pool) {
  const int64_t items = (N + kColumnsPerItem - 1) / kColumnsPerItem;
  const int64_t threads =
      N * K >= kMinParallelWeights ? std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), items) : 1;
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto participate = [state, items, x, w, y, M, N, K] {
    for (int64_t i = state->next.fetch_add(1); i < items; i = state->next.fetch_add(1)) {
      Columns(x, w, y, M, N, K, i * kColumnsPerItem, std::min(N, (i + 1) * kColumnsPerItem));
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < threads; ++t) pool.Schedule(decltype(participate)(participate));
  participate();
  while (state->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

ffi::Error DenseMatmul(ffi::ThreadPool thread_pool, Matrix x, Matrix w, ffi::Result<Matrix> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (wd[1] != K || yd[0] != M || yd[1] != N)
    return ffi::Error::InvalidArgument(
        "dense_matmul: x [M, K] . w [N, K]^T -> y [M, N]; got x [" + std::to_string(M) + ", " +
        std::to_string(K) + "], w [" + std::to_string(N) + ", " + std::to_string(wd[1]) +
        "], y [" + std::to_string(yd[0]) + ", " + std::to_string(yd[1]) + "]");
  if (M > 0 && N > 0) Run(x.typed_data(), w.typed_data(), y->typed_data(), M, N, K, thread_pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaylmDenseMatmul, DenseMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Matrix>()
                                  .Ret<Matrix>());
