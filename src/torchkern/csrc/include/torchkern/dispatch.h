// Dtype dispatch on the host side: ATen's dispatch for code that runs on tensors, and the map from
// at::ScalarType to the DType a torch-free launcher takes.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "torchkern/common.h"

// float32, float64, float16, bfloat16; inside, scalar_t is the storage type and
// at::opmath_type<scalar_t> the compute type (float for the half types).
#define TORCHKERN_DISPATCH_FLOATING(dtype, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, name, __VA_ARGS__)

namespace torchkern {

// The DType of a float tensor (the caller has checked it: TORCHKERN_CHECK_FLOAT).
inline DType to_dtype(at::ScalarType type) {
  TORCH_CHECK(type == at::kFloat || type == at::kDouble || type == at::kHalf || type == at::kBFloat16,
              "torchkern: no kernel for dtype ", c10::toString(type));
  return type == at::kFloat ? DType::kFloat32
         : type == at::kDouble ? DType::kFloat64
         : type == at::kHalf   ? DType::kFloat16
                               : DType::kBFloat16;
}

}  // namespace torchkern
