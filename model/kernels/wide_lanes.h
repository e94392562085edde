// Whether a kernel runs its sixteen-lane (AVX-512) family, shared by the kernels that have one.
#ifndef RAYLM_WIDE_LANES_H_
#define RAYLM_WIDE_LANES_H_

#include <cstdlib>

namespace raylm {

// The CPU has x86-64-v4's AVX-512 subsets and the environment variable `narrow_override` is
// unset (tests set it to check the eight-lane family on AVX-512 machines too). Callers keep
// the answer in a static, so every call of a process sums alike.
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

}  // namespace raylm

#endif  // RAYLM_WIDE_LANES_H_
