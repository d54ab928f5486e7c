// Dtype dispatch on the host side: the map from at::ScalarType to the DType a torch-free launcher takes (the
// launchers dispatch on it: dispatch.cuh).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "torchkern/common.h"

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
