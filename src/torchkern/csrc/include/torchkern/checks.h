// Argument checks shared by every host entry point.
//
// Each entry point names its op once with TORCHKERN_OP("name"); the macros put
// that name, the argument's name and what was expected into the message. The
// pure-PyTorch twins raise the same messages (torchkern/_checks.py), so an
// error reads the same whichever backend runs.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace torchkern {

// "float32", "int64", ... : the names torch.dtype prints after "torch.".
inline const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    case at::kComplexHalf: return "complex32";
    default: return c10::toString(t);
  }
}

// "[3, 4]", as Python prints list(x.shape). Built by hand: the message must not
// depend on how a given torch version streams IntArrayRef.
inline std::string shape_str(c10::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(sizes[i]);
  }
  return out + "]";
}

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// Error messages are assembled here without std::ostream: numbers never go through
// operator<<. Host code compiled by nvcc against some libstdc++ versions (seen with
// torch 2.11 on an H200 host) instantiates ostream's number formatting locally, and
// that copy dereferences a null locale facet: streaming an int into a TORCH_CHECK
// message segfaulted instead of raising. Only whole strings reach TORCH_CHECK.
namespace detail {

inline std::string message_part(const std::string& s) { return s; }
inline std::string message_part(const char* s) { return s; }
inline std::string message_part(char c) { return std::string(1, c); }
inline std::string message_part(bool b) { return b ? "true" : "false"; }
inline std::string message_part(c10::IntArrayRef sizes) { return shape_str(sizes); }
inline std::string message_part(at::ScalarType t) { return dtype_name(t); }
inline std::string message_part(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}
inline std::string message_part(float v) { return message_part(static_cast<double>(v)); }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline std::string message_part(T v) {
  return std::to_string(v);
}

template <typename... Args>
std::string message(const Args&... args) {
  std::string out;
  (out += ... += message_part(args));
  return out;
}

}  // namespace detail
}  // namespace torchkern

// Names the op for the checks that follow in this scope.
#define TORCHKERN_OP(name) [[maybe_unused]] static constexpr const char* torchkern_op_name = "torchkern." name

// Free-form check with the op's name in front; arguments may be strings, numbers,
// shapes (x.sizes()) and dtypes: TORCHKERN_CHECK(s > 0, "step_size must be > 0, got ", s).
#define TORCHKERN_CHECK(cond, ...) \
  TORCH_CHECK((cond), ::torchkern::detail::message(torchkern_op_name, ": ", __VA_ARGS__))

#define TORCHKERN_CHECK_CUDA(x) TORCHKERN_CHECK((x).is_cuda(), #x " must be a CUDA tensor, got ", (x).device().str())

#define TORCHKERN_CHECK_FLOAT(x)                                                          \
  TORCHKERN_CHECK(::torchkern::is_supported_float((x).scalar_type()),                     \
                  #x " must be float32, float64, float16 or bfloat16, got ", (x).scalar_type())

#define TORCHKERN_CHECK_SAME_DTYPE(ref, x)                                                                 \
  TORCHKERN_CHECK((x).scalar_type() == (ref).scalar_type(), #x " must have dtype ", (ref).scalar_type(), \
                  " like " #ref ", got ", (x).scalar_type())

#define TORCHKERN_CHECK_SAME_DEVICE(ref, x)                                                            \
  TORCHKERN_CHECK((x).device() == (ref).device(), #x " must be on ", (ref).device().str(), " like " #ref \
                  ", got ", (x).device().str())

#define TORCHKERN_CHECK_SAME_SHAPE(ref, x) \
  TORCHKERN_CHECK((x).sizes() == (ref).sizes(), #x " must have shape ", (ref).sizes(), " like " #ref ", got ", (x).sizes())

// TORCHKERN_CHECK_DIM(x, 2, "[B, n]"): rank check that shows the expected layout.
#define TORCHKERN_CHECK_DIM(x, ndim, layout) \
  TORCHKERN_CHECK((x).dim() == (ndim), #x " must have shape " layout " (", ndim, " dims), got ", (x).sizes())
