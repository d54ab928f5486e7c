// cuSOLVER's batched symmetric eigensolver (cusolverDnXsyevBatched, cuSOLVER >= 11.7.1 / CUDA 12.6.2), which
// torch.linalg.eigh calls only for n <= 32 (above, it loops over syevd one matrix at a time). eigh.cu sends it the
// calls where it beats the Jacobi kernels (linalg/constants.py, EIGH_SYEV_*).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace torchkern {

// Whether the loaded cuSOLVER has the batched routine. Its symbols are looked up once, in the library torch
// loaded (torchkern does not link cuSOLVER itself: torch loads it lazily, under a soname that follows its CUDA).
bool syev_batched_available();

// cuSOLVER's decomposition of X [B, n, n], symmetric, float32 or float64, on the current stream: (w [B, n], the
// eigenvalues as the routine leaves them, V [B, n, n] with the eigenvectors as its rows, info [B] int, nonzero for
// a matrix that did not converge). A contiguous X is overwritten (pass a temporary). The caller sorts (the routine
// can leave the copies of a repeated eigenvalue out of order by an ulp: seen on an H200, cuSOLVER 12.0 of CUDA
// 13.0) and makes the matrices with info != 0 NaN (never the case for the scaled, symmetrized matrices eigh.cu
// passes; eigh's Python wrapper names them if it ever happens).
std::tuple<at::Tensor, at::Tensor, at::Tensor> syev_batched(at::Tensor X);

}  // namespace torchkern
