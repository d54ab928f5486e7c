// The Newton inverse root's launchers (docs/design.md, "Kernel sources"): torch-free params and launchers of the
// kernels in this folder, included by the .cu files that define them and by the host side
// (matrix_inverse_root_newton_host.h, ../ops.cpp). Every launcher runs on the stream it is given and returns the CUDA
// error of what it started.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "torchkern/common.h"

namespace torchkern {
namespace newton {

// The whole iteration of each matrix of G [B, n, n] (dtype) in one block's shared memory (small_matrix.cuh): root
// [B, n, n] (dtype), err [B] (the compute type: float64 for float64, else float32) and iters [B] int32. Launches it
// where it takes the call (n up to 128, float64 up to 64, the device's shared memory: *launched), else nothing.
struct SmallParams {
  const void* G;
  void* out;
  void* err;
  int* iters;
  DType dtype;
  int64_t batch;
  int n, p;
  double eps;
  int max_iters;
  double tol;
};
cudaError_t small_launch(const SmallParams& p, bool* launched, cudaStream_t stream);  // (..._small_f32.cu)

// The large path's state (matrix_inverse_root_newton.cu), every array in the compute type (float64, or float32)
// unless said otherwise. A matrix's rows are reduced in chunks of kRowsPerChunk.
constexpr int kRowsPerChunk = 8;

struct LargeParams {
  const void* A;   // [B, n, n] (G + G^T) / 2
  void* X;         // [B, n, n] the root's iterate
  void* M;         // [B, n, n] X^p (A + eps I)
  void* P;         // [B, n, n] the step's polynomial in M
  void* partial;   // [B, chunks] the chunks' row reductions
  void* row_max;   // [B, chunks]
  int* bad;        // [B, chunks] a non-finite entry
  void* z;         // [B] 1 / u
  void* xz;        // [B] u^(-1/p)
  int* is_bad;     // [B]
  void* err;       // [B] ||M - I||_inf
  void* prev;      // [B] the error one step before
  int* iters;      // [B] int32
  int* active;     // [B] int32: the matrix goes on
  int* counts;     // [max_iters + 1] int32: matrices going on after the first update and each step (zeroed)
  void* coef_a;    // [B] the next step's P = a I + b M
  void* coef_b;    // [B]
  double* next_low;  // [B] the lower bound the next step leaves
  void* ritz;        // [B] the Lanczos estimate, or nullptr (none)
  void* V;           // [B, n] the Lanczos vectors
  void* V_prev;      // [B, n]
  void* W;           // [B, n] M^T v, from the host's product
  void* tri;         // [B, 2, LANCZOS_STEPS] the tridiagonal's entries
  void* scale;       // [B] its running row-sum bound
  int* taken;        // [B] steps taken (negative: stopped)
  bool f64;
  int64_t batch;
  int n, p;
  double eps, tol;
};

enum class Stage {
  kStart,          // u, z = 1 / u, M = z (A + eps I), X = u^(-1/p) I (NaN for a non-finite matrix), ||M - I||_inf
  kLanczosStart,   // the Lanczos start vectors
  kLanczosStep,    // step `it` after the host's W = M^T V
  kLanczosRitz,    // the estimate from the tridiagonal
  kFirstUpdate,    // the error, the first scaling, counts[0]
  kStep,           // P from M and the scaling (I for a matrix that has stopped)
  kCheck,          // after the host's products of iteration `it`: the error, the stopping rule, counts[it + 1]
};
cudaError_t large_launch(Stage stage, const LargeParams& p, int it, cudaStream_t stream);

}  // namespace newton
}  // namespace torchkern
