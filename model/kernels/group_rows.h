// The grouping the grouped kernels share (grouped_matmul.cc, and int8_matmul.cc's for the integer
// mode's experts): x's rows are consecutive groups, one per stacked matrix (a mixture of experts'
// experts), group_sizes [G] rows each; rows past the groups are padding.
#ifndef RAYLM_GROUP_ROWS_H_
#define RAYLM_GROUP_ROWS_H_

#include <algorithm>
#include <cstdint>

namespace {

// run(g, start, rows) for each group g that has rows, its rows starting at `start`; then zeros
// for the rows past the groups. Negative sizes count as empty, and groups end at row M.
template <typename RunGroup>
void ForEachGroup(const int32_t* sizes, int64_t G, int64_t M, int64_t N, float* y, RunGroup run) {
  int64_t start = 0;
  for (int64_t g = 0; g < G && start < M; ++g) {
    const int64_t rows = std::min<int64_t>(std::max<int32_t>(sizes[g], 0), M - start);
    if (rows > 0 && N > 0) run(g, start, rows);
    start += rows;
  }
  std::fill(y + start * N, y + M * N, 0.0f);
}

}  // namespace

#endif  // RAYLM_GROUP_ROWS_H_
