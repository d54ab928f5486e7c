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

#include <string>

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

}  // namespace torchkern

// Names the op for the checks that follow in this scope.
#define TORCHKERN_OP(name) [[maybe_unused]] static constexpr const char* torchkern_op_name = "torchkern." name

#define TORCHKERN_CHECK_CUDA(x) \
  TORCH_CHECK((x).is_cuda(), torchkern_op_name, ": " #x " must be a CUDA tensor, got ", (x).device().str())

#define TORCHKERN_CHECK_FLOAT(x)                                                                         \
  TORCH_CHECK(::torchkern::is_supported_float((x).scalar_type()), torchkern_op_name,                     \
              ": " #x " must be float32, float64, float16 or bfloat16, got ", ::torchkern::dtype_name((x).scalar_type()))

#define TORCHKERN_CHECK_SAME_DTYPE(ref, x)                                                               \
  TORCH_CHECK((x).scalar_type() == (ref).scalar_type(), torchkern_op_name, ": " #x " must have dtype ", \
              ::torchkern::dtype_name((ref).scalar_type()), " like " #ref ", got ",                      \
              ::torchkern::dtype_name((x).scalar_type()))

#define TORCHKERN_CHECK_SAME_DEVICE(ref, x)                                                               \
  TORCH_CHECK((x).device() == (ref).device(), torchkern_op_name, ": " #x " must be on ",                \
              (ref).device().str(), " like " #ref ", got ", (x).device().str())

#define TORCHKERN_CHECK_SAME_SHAPE(ref, x)                                                                \
  TORCH_CHECK((x).sizes() == (ref).sizes(), torchkern_op_name, ": " #x " must have shape ",            \
              ::torchkern::shape_str((ref).sizes()), " like " #ref ", got ", ::torchkern::shape_str((x).sizes()))

// TORCHKERN_CHECK_DIM(x, 2, "[B, n]"): rank check that shows the expected layout.
#define TORCHKERN_CHECK_DIM(x, ndim, layout)                                                              \
  TORCH_CHECK((x).dim() == (ndim), torchkern_op_name, ": " #x " must have shape " layout " (", ndim,      \
              " dims), got ", ::torchkern::shape_str((x).sizes()))

// Free-form check with the op's name in front: TORCHKERN_CHECK(cond, "step_size must be > 0, got ", s).
#define TORCHKERN_CHECK(cond, ...) TORCH_CHECK((cond), torchkern_op_name, ": ", __VA_ARGS__)
