// linalg's launchers of single-file ops (docs/design.md, "Kernel sources"): torch-free params and launchers, included
// by the op's .cu file and by ops.cpp. The ops of several files have theirs in their folders (eigh/launchers.h,
// matrix_inverse_root_newton/launchers.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "torchkern/common.h"

namespace torchkern {

// out[g, i*p + k, j*q + l] = A[g, i, j] * B[g, k, l]: contiguous out [batch, m*p, n*q], A [batch, m, n] and
// B [batch, p, q] of `dtype` (the host broadcasts the batch dims).
struct KronParams {
  void* out;
  const void* A;
  const void* B;
  int64_t batch;
  int m, n, p, q;
  DType dtype;
};
cudaError_t kron_launch(const KronParams& prm, cudaStream_t stream);

}  // namespace torchkern
