// The eigh op's solvers on tensors (docs/design.md, "Symmetric eigensolver"), one host file each (their kernels: the
// .cu files of the same names, launchers.h); ../ops.cpp routes a call to one (eigh_route.h). Every solver takes X
// (B, n, n), contiguous, in the op's input dtype, and Q0 (B, n, n) or an undefined tensor, and returns (w (B, n)
// ascending, V (B, n, n) with the eigenvectors as columns) in X's dtype. Each decomposes the symmetric part of X
// scaled by a power of two (max |x| in [0.5, 1): exact, and nothing overflows or underflows on the way), and gives
// NaN outputs for a matrix with a NaN or Inf entry in X or Q0. The Jacobi solvers start from Q0^T X Q0 and return
// Q0 V'; the direct ones only check Q0.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>

namespace torchkern {
namespace eigh {

using Result = std::tuple<at::Tensor, at::Tensor>;

Result solve_in_block(const at::Tensor& X, const at::Tensor& Q, double tol);      // eigh_in_block_host.h
Result solve_block_method(const at::Tensor& X, const at::Tensor& Q, double tol);  // eigh_block_method_host.h
Result solve_syev_batched(const at::Tensor& X, const at::Tensor& Q);              // eigh_syev_batched_host.h
Result solve_tridiagonal(const at::Tensor& X, const at::Tensor& Q);               // eigh_tridiagonal_host.h
Result solve_torch(const at::Tensor& X, const at::Tensor& Q);                     // eigh_torch_host.h

// Whether the loaded cuSOLVER has cusolverDnXsyevBatched (eigh_route.h's Device; the others: launchers.h).
bool syev_batched_available();

}  // namespace eigh
}  // namespace torchkern
