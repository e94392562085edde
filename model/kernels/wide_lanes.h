// Whether a kernel runs its sixteen-lane (AVX-512) family, shared by the kernels that have one.
#ifndef RAYLM_WIDE_LANES_H_
#define RAYLM_WIDE_LANES_H_

#include <cstdlib>

namespace raylm {

// The CPU has x86-64-v4's AVX-512 subsets and the environment variable `narrow_override` is
// unset (tests set it to check the eight-lane family on AVX-512 machines too). Callers keep
// the answer in a static (UseWideLanes), so every call of a process sums alike.
inline bool CpuRunsWideLanes(const char* narrow_override) {
#if defined(__x86_64__) && defined(__GNUC__)
  return std::getenv(narrow_override) == nullptr && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512cd");
#else
  (void)narrow_override;
  return false;
#endif
}

// The kernel families that have a sixteen-lane form. Its sums differ from the eight-lane
// form's in the last bits (another order of additions), so a process runs one form of a
// family for every call.
enum class LaneFamily {
  kDenseTiles,  // the dense kernel's tiles, which the grouped and LoRA kernels run too
  kAttention,   // paged decode attention
};

// The environment variable that keeps `family` at eight lanes on AVX-512 CPUs.
constexpr const char* NarrowOverride(LaneFamily family) {
  return family == LaneFamily::kDenseTiles ? "RAYLM_DENSE_NARROW_TILES" : "RAYLM_ATTENTION_NARROW_LANES";
}

namespace {  // one answer per library, as each kernel had its own

// Whether this process runs `kFamily`'s sixteen-lane form (CpuRunsWideLanes), decided once, so
// every call of a process sums alike.
template <LaneFamily kFamily>
bool UseWideLanes() {
  static const bool wide = CpuRunsWideLanes(NarrowOverride(kFamily));
  return wide;
}

}  // namespace

}  // namespace raylm

#endif  // RAYLM_WIDE_LANES_H_
