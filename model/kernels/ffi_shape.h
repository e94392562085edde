// A buffer's dimensions as text ("[2, 3]"), for the kernels' error messages.
#ifndef RAYLM_FFI_SHAPE_H_
#define RAYLM_FFI_SHAPE_H_

#include <string>

#include "xla/ffi/api/ffi.h"

namespace raylm {

inline std::string Shape(const xla::ffi::AnyBuffer::Dimensions& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

}  // namespace raylm

#endif  // RAYLM_FFI_SHAPE_H_
