// The per-sample family's launchers, as ops.cpp calls them: plain pointers, sizes and a dtype; each returns the
// CUDA error of its launches (common.h). Torch-free: included by the kernels' .cu files and by ops.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "torchkern/common.h"

namespace torchkern {

// linear_grad_sq_norms's Gram kernel covers the T x T Gram matrices in kGramTile x kGramTile tiles: one block per
// sample and upper-triangular pair of tiles, each writing its own partial sum.
constexpr int kGramTile = 32;

// The Gram kernel's blocks per sample for a sequence of T_len rows; a grid's y dimension holds kMaxGramPairs.
inline int64_t gram_pairs(int64_t T_len) {
  const int64_t tiles = (T_len + kGramTile - 1) / kGramTile;
  return tiles * (tiles + 1) / 2;
}
constexpr int64_t kMaxGramPairs = 65535;

// Squared per-sample gradient norms of an nn.Linear layer (linear_grad_sq_norms.cu), B > 0: without `sequence`,
// contiguous a [B, d_in] and g [B, d_out], out [B]; with it, a [B, T_len, d_in] and g [B, T_len, d_out], all sizes
// > 0, out [B, gram_pairs(T_len)] (the partial sums). a and g hold `dtype`, out its compute type (float for float16
// and bfloat16).
struct LinearGradSqNormsParams {
  void* out;
  const void* a;
  const void* g;
  int64_t batch;
  int64_t T_len;
  int64_t d_in;
  int64_t d_out;
  bool sequence;
  bool bias;
  DType dtype;
};
cudaError_t linear_grad_sq_norms_launch(const LinearGradSqNormsParams& p, cudaStream_t stream);

}  // namespace torchkern
