// The optimizers' launchers, as ops.cpp calls them: plain pointers, sizes and a dtype; each returns the CUDA error
// of its launches (common.h). Torch-free: included by the kernels' .cu files and by ops.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "torchkern/common.h"

namespace torchkern {

// cholesky_qr factors kCholeskyBlock columns per launch of its kernel (cholesky_qr.cu).
constexpr int kCholeskyBlock = 64;

// One block column [j0, j0 + nb) (nb <= kCholeskyBlock) of cholesky_qr's factorization of `count` matrices
// (cholesky_qr.cu): G [count, n, n], the shifted Gram matrices with the block column's trailing updates, factored
// in place; D [count, kCholeskyBlock, kCholeskyBlock], the inverses of the diagonal blocks' factors; info [count],
// 0 or the first failing column + 1. G and D hold `dtype`, float32 or float64.
struct BlockCholeskyParams {
  void* G;
  void* D;
  int* info;
  int64_t count;
  int64_t n;
  int nb;
  int j0;
  DType dtype;
};
cudaError_t block_cholesky_launch(const BlockCholeskyParams& p, cudaStream_t stream);

// shampoo_graft takes up to kGraftMaxTensors tensors per launch, their pointers passed by value, in chunks of
// kGraftChunk elements, one block a chunk: a 1024^2 weight spreads over 128 blocks (shampoo_graft.cu).
constexpr int kGraftMaxTensors = 32;
constexpr int64_t kGraftChunk = 8192;

// One launch of shampoo_graft over `count` tensors (shampoo_graft.cu): gradients g of `dtype` (contiguous), the
// states m (null: no gradient EMA, m = g), v and the directions d in its compute type (float for float16 and
// bfloat16), numel, eps and scale per tensor; tensor t owns chunks [first_chunk[t], first_chunk[t + 1]), every
// tensor at least one. found_inf (a float32 scalar, or null) skips the step; steps (float32 [count], or null) are
// the steps each tensor has taken. partial [first_chunk[count]] and norms [count] of the compute type.
struct ShampooGraftParams {
  const void* g[kGraftMaxTensors];
  void* m[kGraftMaxTensors];
  void* v[kGraftMaxTensors];
  void* d[kGraftMaxTensors];
  int64_t numel[kGraftMaxTensors];
  double eps[kGraftMaxTensors];
  double scale[kGraftMaxTensors];
  int first_chunk[kGraftMaxTensors + 1];
  int count;
  double beta1;
  double sq_decay;
  double sq_weight;
  const float* found_inf;
  float* steps;
  void* partial;
  void* norms;
  DType dtype;
};
cudaError_t shampoo_graft_launch(const ShampooGraftParams& p, cudaStream_t stream);

}  // namespace torchkern
