// What the kernels' XLA FFI handlers share: the `ffi` alias, a buffer's dimensions as text for
// their error messages, and the step from a buffer's element type to the C++ type a kernel
// reads it as.
#ifndef RAYLM_FFI_HELPERS_H_
#define RAYLM_FFI_HELPERS_H_

#include <cstdint>
#include <string>

#include "bfloat16.h"
#include "float16.h"
#include "fp8_e4m3.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace raylm {

using Matrix = ffi::Buffer<ffi::F32, 2>;  // aliases: the binding macro cannot take commas

// A buffer's dimensions as text ("[2, 3]").
inline std::string Shape(const ffi::AnyBuffer::Dimensions& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// The element type of a buffer whose values a kernel reads as T.
template <typename T>
constexpr ffi::DataType kDataTypeOf = ffi::DataType::INVALID;
template <>
constexpr ffi::DataType kDataTypeOf<float> = ffi::DataType::F32;
template <>
constexpr ffi::DataType kDataTypeOf<Bf16> = ffi::DataType::BF16;
template <>
constexpr ffi::DataType kDataTypeOf<Fp16> = ffi::DataType::F16;
template <>
constexpr ffi::DataType kDataTypeOf<int8_t> = ffi::DataType::S8;
template <>
constexpr ffi::DataType kDataTypeOf<Fp8E4m3> = ffi::DataType::F8E4M3FN;

// run(data) with `buffer`'s data as `const T*`, T the first of Ts whose element type the buffer
// has; a handler's result: Success, or InvalidArgument(`wrong_type`) when it has none of them.
template <typename... Ts, typename Fn>
ffi::Error RunOnDataOf(const ffi::AnyBuffer& buffer, const char* wrong_type, Fn&& run) {
  const bool ran = ((buffer.element_type() == kDataTypeOf<Ts> &&
                     (run(static_cast<const Ts*>(buffer.untyped_data())), true)) ||
                    ...);
  return ran ? ffi::Error::Success() : ffi::Error::InvalidArgument(wrong_type);
}

}  // namespace raylm

#endif  // RAYLM_FFI_HELPERS_H_
