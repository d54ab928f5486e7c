// eigh's launchers (docs/design.md, "Kernel sources"): the params and launchers of the kernels in this folder,
// torch-free, included by the .cu files that define them and by the host side (eigh_*.cpp, ../ops.cpp), which
// allocates and turns a returned error into an exception. Every launcher runs on the stream it is given and returns
// the CUDA error of what it started.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "torchkern/common.h"

namespace torchkern {
namespace eigh {

// ----------------------------------------------------------------------------- the way in and out (eigh_prep.cu)

constexpr int kPrepRows = 16;  // rows of a matrix per block of the first pass: scratch of ceil(n / 16) per matrix
constexpr int kPrepTile = 32;  // the write pass's tiles: the block method's scratch of (N / 32)^2 per matrix

// Per matrix of X [B, n, n] (dtype), the non-finite flag (of X or Q, when given) and the exponent e of its largest
// |x| (max |x| 2^-e in [0.5, 1); 0 for a zero or a flagged matrix); S [B, N, N] = 2^-e (X + X^T) / 2 padded with
// zeros (zero for a flagged matrix), in float64 (s_f64) or float32. The block method's way in (W given): also
// W [B, N, N] = Q^T on the n x n corner (I without Q, and for a flagged matrix) and I on the padding, and per
// matrix thr = tol ||S||_F / N and stop2 = (tol ||S||_F)^2.
struct PrepParams {
  const void* X;
  const void* Q;  // or nullptr
  DType dtype;
  int64_t batch;
  int n, N;
  void* S;
  bool s_f64;
  int* exponent;       // [B]
  int* flagged;        // [B]
  double* part_max;    // [B, ceil(n / kPrepRows)] scratch
  int* part_bad;       // [B, ceil(n / kPrepRows)] scratch
  double* W = nullptr;        // the block method's: [B, N, N] (S float64, N a multiple of kPrepTile)
  double* part_sq = nullptr;  // [B, (N / kPrepTile)^2] scratch
  double* thr = nullptr;      // [B]
  double* stop2 = nullptr;    // [B]
  double tol = 0.0;
};
cudaError_t prep_launch(const PrepParams& p, cudaStream_t stream);

// w [B, n] = 2^e values (ascending), V [B, n, n] in dtype, from vectors [B, N, N] of values' type (float64 or
// float32): with `rows`, V's column j is row order[b, j] of vectors (row j without order), else column j of vectors.
// NaN for flagged matrices and for those with failed != 0 (when given).
struct FinishParams {
  const void* vectors;
  const void* values;  // [B, n]
  bool f64;            // vectors' and values' type
  bool rows;
  const int64_t* order;  // [B, n] or nullptr
  const int* exponent;   // [B]
  const int* flagged;    // [B]
  const int* failed;     // [B] or nullptr
  void* w;
  void* V;
  DType dtype;
  int64_t batch;
  int n, N;
};
cudaError_t finish_launch(const FinishParams& p, cudaStream_t stream);

// ----------------------------------------------------------------------------- in-block Jacobi (jacobi.cuh)

// Whether the in-block kernel takes n on this device (its shared memory; at most TORCHKERN_EIGH_SMALL_MAX_N).
bool in_block_fits(int64_t n, bool f64);

// The whole cyclic Jacobi of each matrix of A [B, n, n] (float64, or float32), one matrix per block (or a few: a
// batch too small to fill the GPU splits V's rows): w [B, n] ascending and V [B, n, n] (columns), A's type. The
// kernel flags non-finite matrices (NaN outputs), scales and symmetrizes itself. (eigh_small_f32.cu)
struct JacobiParams {
  const void* A;
  void* w;
  void* V;
  bool f64;
  int64_t batch;
  int n;
  double tol;
};
cudaError_t jacobi_launch(const JacobiParams& p, cudaStream_t stream);

// A warm start's rotations in one launch a side (float32, n up to warm_rotate_fits): Y = Q^T X^T Q (in) or Y = Q X,
// per matrix of [B, n, n], float64 sums of the exact products, rounded once. (eigh_in_block.cu)
bool warm_rotate_fits(int64_t n);
struct WarmRotateParams {
  const float* X;
  const float* Q;
  float* Y;
  bool in;
  int64_t batch;
  int n;
};
cudaError_t warm_rotate_launch(const WarmRotateParams& p, cudaStream_t stream);

// ----------------------------------------------------------------------------- the block method (eigh_block_method.cu)

constexpr int kBlockNormRows = 16;  // rows of a matrix per partial off-diagonal sum (N is a multiple)

// One call's buffers, in device memory: the block method's kernels read them from there, so that a CUDA graph of
// its sweeps serves every call of one shape (each call writes its own first).
struct BlockBuffers {
  double* a[2];         // [B, N, N] the matrix: a round reads a[from] and writes a[1 - from]
  double* w[2];         // [B, N, N] the basis W = V^T, likewise
  double* U;            // [B N / 64, 64, 64] the tiles' rotations
  const double* thr;    // [B] rotation threshold (relative to the whole matrix)
  const double* stop2;  // [B] (tol ||A||_F)^2
  int* active;          // [B]: 0 for a matrix that has converged
  double* off_partial;  // [B, N / kBlockNormRows] the off-diagonal sums of squares after a sweep
  int* loop;            // [2] sweeps run, matrices going on
};

// Whether the subproblems' kernel fits this device's shared memory.
bool block_method_fits();

// The kernels' shared memory, opted in once per device: before a CUDA graph capture, which records launches only.
cudaError_t block_method_opt_in();

// *dst = value (a one-thread kernel: the value travels as a launch parameter, so no host memory has to outlive it).
cudaError_t block_buffers_launch(BlockBuffers* dst, const BlockBuffers& value, cudaStream_t stream);

// One sweep, its kernels reading the call's buffers from buf (device memory): nb - 1 rounds (the tile solves and the
// rotations), the off-diagonal norms, the stopping rule (in a CUDA graph's WHILE node, with use_handle: the
// conditional handle is set to go on while a matrix does and fewer than TORCHKERN_EIGH_MAX_SWEEPS have run), the
// copy of the result back into buffers 0.
struct BlockSweepParams {
  const BlockBuffers* buf;
  int64_t batch;
  int N;
  unsigned long long handle;  // cudaGraphConditionalHandle (CUDA 12.4)
  bool use_handle;
};
cudaError_t block_sweep_launch(const BlockSweepParams& p, cudaStream_t stream);

// ----------------------------------------------------------------------------- tridiagonal (eigh_tridiagonal.cu)

// Whether the tridiagonal solver takes n on this device (its prefetch bound and its shared memory).
bool tridiagonal_fits(int64_t n);

constexpr int kTridiagonalChunk = 32;  // the reduction's column chunks: S's rows are whole chunks
constexpr int kTridiagonalPanel = 32;  // reflections per panel

// The solver's arrays (n x n matrices, ld the padded row length), float32 where it reduces, float64 after.
struct TridiagonalParams {
  float* S;        // [B, ld, ld] the scaled matrix; the reflections' vectors are left in its rows
  float* Wt;       // [B, kTridiagonalPanel, ld] scratch of the reduction
  double* d;       // [B, n] T's diagonal
  double* e;       // [B, n] T's off-diagonal (zeroed where T splits)
  float* tau;      // [B, n] the reflections' scales
  double* bounds;  // [B, 3] per matrix: Gershgorin bounds and T's norm
  int* lo;         // [B, n] the first row of each row's unreduced block
  int* hi;         // [B, n] one past its last
  double* lam;     // [B, n] the eigenvalues in row order
  double* T;       // [B, panels, kTridiagonalPanel, kTridiagonalPanel] the panels' compact WY factors
  int64_t batch;
  int n, ld;
};
// A = Q T Q^T (the reduction, on clusters of blocks).
cudaError_t tridiagonal_reduce_launch(const TridiagonalParams& p, cudaStream_t stream);
// T's splitting and eigenvalues (bisection).
cudaError_t tridiagonal_eigenvalues_launch(const TridiagonalParams& p, cudaStream_t stream);
// T's eigenvectors Z [g, n, n] (columns, in the order of `sorted`) of matrices b0 .. b0 + g - 1, by inverse iteration
// with scratch U0, U1 [g, n, n] and swaps [g, n, n].
struct InverseIterationParams {
  const double* sorted;  // [B, n] the eigenvalues ascending
  const int64_t* order;  // [B, n] their rows
  double* Z;             // [B, n, n]
  double* U0;
  double* U1;
  uint8_t* swaps;
  int64_t b0, group;
};
cudaError_t tridiagonal_vectors_launch(const TridiagonalParams& p, const InverseIterationParams& q,
                                       cudaStream_t stream);
// The panels' compact WY factors T from S's reflections and tau.
cudaError_t tridiagonal_panels_launch(const TridiagonalParams& p, cudaStream_t stream);

}  // namespace eigh
}  // namespace torchkern
