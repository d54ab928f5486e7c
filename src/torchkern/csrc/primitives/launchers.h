// The primitives' launchers, as ops.cpp calls them: plain pointers, sizes and a dtype; each returns the CUDA error
// of its launch (common.h). Torch-free: included by the kernels' .cu files and by ops.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "torchkern/common.h"

namespace torchkern {

// out[i] = x[i] + c, i < n; contiguous [n] arrays of `dtype`, c cast to its compute type.
struct AddConstantParams {
  void* out;
  const void* x;
  int64_t n;
  double c;
  DType dtype;
};
cudaError_t add_constant_launch(const AddConstantParams& p, cudaStream_t stream);

// out[i] = a[i] * b[i], i < n; contiguous [n] arrays of `dtype`.
struct MulParams {
  void* out;
  const void* a;
  const void* b;
  int64_t n;
  DType dtype;
};
cudaError_t mul_launch(const MulParams& p, cudaStream_t stream);

// out[k, i, j] = a[k, i] * b[k, j]; contiguous out [batch, n, m], a [batch, n], b [batch, m] of `dtype`.
struct BatchedOuterParams {
  void* out;
  const void* a;
  const void* b;
  int64_t batch;
  int64_t n;
  int64_t m;
  DType dtype;
};
cudaError_t batched_outer_launch(const BatchedOuterParams& p, cudaStream_t stream);

}  // namespace torchkern
