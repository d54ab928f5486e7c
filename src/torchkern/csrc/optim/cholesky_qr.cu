// cholesky_qr(X, shift) -> Y = X R^-1, R^T R = X^T X + shift I (R upper triangular; NaN for a matrix whose
// Gram matrix is not numerically positive definite). One pass of Cholesky QR, as SOAP's, K-FAC's and Shampoo's
// power steps take it (optim/soap.py, power_step; the math and the shift are there and in docs/design.md).
//
// Why an op: cuSOLVER's batched Cholesky of eight 1024^2 float64 Gram matrices takes 1.9 ms (H200), the inverse of
// the factor in batched products 1.3 ms more, and a refresh takes two passes: most of SOAP's refresh, which is most
// of what SOAP's step costs beyond AdamW's on large layers. Here the factorization is blocked by kB = 64 columns:
// per block column j one launch factors the (k, 64, 64) diagonal blocks and inverts their factors in shared memory
// (block_cholesky_kernel, here), and batched cuBLAS products do the rest (ops.cpp, cholesky_qr_cuda):
//
//   L_jj, D_j = chol(G_jj), L_jj^-1                 (the kernel; G_jj already holds the trailing updates)
//   L_ij^T = D_j G_ij^T (i > j),  G_ii' -= L_ij L_i'j^T (the trailing matrix, both triangles: one product)
//   Y_j = (X_j - Y_<j L_j,<j^T) D_j^T               (the columns of Y, left to right)
//
// Five launches a block column, the products ATen calls that write their strided views in place: chained matmuls
// and copies instead spend ~150 us of host time a block column on the H200 hosts, more than the GPU does (eight
// 1024^2: 2.95 ms a pass against 2.23; cuSOLVER's Cholesky and the factor's inverse take 2.96).
//
// Work: n^3/3 multiply-adds for the factor (2 n^3 / 3 here, the trailing square in full) and m n^2 / 2 for Y, all
// but the diagonal blocks in products; n / 64 launches of the small kernel in a chain. The error is that of Cholesky
// QR with explicit inverses of the diagonal blocks, cond(L_jj) u each (a diagonal block of a factor is no worse
// conditioned than the factor).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "launchers.h"

namespace torchkern {
namespace {

constexpr int kB = kCholeskyBlock;  // block columns per launch
constexpr int kLd = kB + 1;         // shared-memory row stride (odd: a column's elements in distinct banks)
constexpr int kThreads = 256;       // 64 columns x 4 lanes in the inverse

// One thread block per matrix: factor the nb x nb diagonal block of G at (j0, j0) (lower triangle read), write L
// to it (lower triangle) and L^-1 to D (nb x nb of a kB-strided (k, kB, kB) buffer, upper triangle zero). A pivot
// that is not a finite positive number marks the matrix in `info` (the first failing column + 1) and writes NaN.
template <typename T>
__global__ void __launch_bounds__(kThreads) block_cholesky_kernel(T* G, int64_t batch_stride, int64_t ld, int nb,
                                                                  int j0, T* D, int* info) {
  __shared__ T S[kB * kLd];  // L in the lower triangle; L^-1's strict lower triangle, transposed, in the upper
  __shared__ T dinv[kB];     // 1 / L_ii
  const int tid = threadIdx.x;
  T* g = G + blockIdx.x * batch_stride + j0 * ld + j0;
  T* d = D + blockIdx.x * kB * kB;
  for (int i = tid; i < nb * nb; i += kThreads) {
    const int r = i / nb, c = i % nb;
    if (r >= c) S[r * kLd + c] = g[r * ld + c];
  }
  __syncthreads();
  bool failed = false;
  int failed_at = 0;
  const int tr = tid / 16, tc = tid % 16;  // the trailing update's 16 x 16 thread tile
  for (int c = 0; c < nb; ++c) {  // right-looking: scale column c, then update the trailing triangle with it
    const T pivot = S[c * kLd + c];  // every thread reads the same value after the barrier: a uniform branch
    if (!(pivot > T(0)) || !isfinite(pivot)) {
      failed = true;
      failed_at = c;
      break;
    }
    const T scale = rsqrt(pivot);  // 1 / L_cc
    for (int i = c + 1 + tid; i < nb; i += kThreads) S[i * kLd + c] *= scale;
    __syncthreads();
    if (tid == 0) {  // read by no thread before the next barrier
      S[c * kLd + c] = pivot * scale;
      dinv[c] = scale;
    }
    for (int r = c + 1 + tr; r < nb; r += 16) {
      const T lr = S[r * kLd + c];
      for (int q = c + 1 + tc; q <= r; q += 16) S[r * kLd + q] -= lr * S[q * kLd + c];
    }
    __syncthreads();
  }
  if (failed) {
    for (int i = tid; i < nb * nb; i += kThreads) {
      const int r = i / nb, c = i % nb;
      if (r >= c) g[r * ld + c] = std::numeric_limits<T>::quiet_NaN();
      d[r * kB + c] = std::numeric_limits<T>::quiet_NaN();
    }
    if (tid == 0 && info[blockIdx.x] == 0) info[blockIdx.x] = j0 + failed_at + 1;
    return;
  }
  // L^-1 by rows: X_ij = -(sum_{j <= p < i} L_ip X_pj) / L_ii, row i after row i - 1; lane (j, q) sums every
  // fourth p, the four partial sums added by shuffles within the lane's group of four
  const int j = tid / 4, q = tid % 4;
  for (int i = 1; i < nb; ++i) {
    T sum = T(0);
    if (j < i) {
      for (int p = j + q; p < i; p += 4) sum += S[i * kLd + p] * (p == j ? dinv[j] : S[j * kLd + p]);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // every lane takes part: no shuffle behind the branch above
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (j < i && q == 0) S[j * kLd + i] = -sum * dinv[i];  // X_ij at (j, i): row i's reads are of columns < i
    __syncthreads();
  }
  for (int i = tid; i < nb * nb; i += kThreads) {
    const int r = i / nb, c = i % nb;
    if (r >= c) g[r * ld + c] = S[r * kLd + c];
    d[r * kB + c] = r > c ? S[c * kLd + r] : (r == c ? dinv[r] : T(0));
  }
}

template <typename T>
cudaError_t launch(const BlockCholeskyParams& p, cudaStream_t stream) {
  block_cholesky_kernel<T><<<static_cast<unsigned>(p.count), kThreads, 0, stream>>>(
      static_cast<T*>(p.G), p.n * p.n, p.n, p.nb, p.j0, static_cast<T*>(p.D), p.info);
  return cudaGetLastError();
}

}  // namespace

cudaError_t block_cholesky_launch(const BlockCholeskyParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kFloat32: return launch<float>(p, stream);
    case DType::kFloat64: return launch<double>(p, stream);
    default: return cudaErrorInvalidValue;  // the host side takes float32 and float64 only
  }
}

}  // namespace torchkern
