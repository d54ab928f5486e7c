// eigh's in-block Jacobi solver, the host side: n small enough for one thread block's shared memory (jacobi.cuh: A in
// the compute type and V in double) runs the whole cyclic Jacobi on one block per matrix. The kernel flags non-finite
// matrices, scales and symmetrizes itself, so a cold start is one launch; a warm start rotates the matrix into Q0's
// basis first and the eigenvectors back after.
// Part of linalg's one host translation unit (../ops.cpp includes it): torch's headers are parsed once.
#pragma once

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/matmul.h>
#include <c10/cuda/CUDAException.h>

#include <tuple>

#include "eigh_prep.h"
#include "eigh_solvers.h"
#include "launchers.h"
#include "torchkern/launch.h"

namespace torchkern {
namespace eigh {
namespace {

// (w (B, n), V (B, n, n)) of X (B, n, n) in its dtype, float32 or float64: the whole cyclic Jacobi per matrix.
Result solve(const at::Tensor& X, double tol) {
  const int64_t B = X.size(0), n = X.size(1);
  at::Tensor w = at::empty({B, n}, X.options()), V = at::empty({B, n, n}, X.options());
  const at::Tensor Xc = X.contiguous();
  C10_CUDA_CHECK(jacobi_launch({Xc.const_data_ptr(), w.mutable_data_ptr(), V.mutable_data_ptr(),
                                X.scalar_type() == at::kDouble, B, static_cast<int>(n), tol},
                               current_stream()));
  return {w, V};
}

// Y (B, n, n) float32 = Q^T X^T Q (in) or Q X, per matrix; X, Q float32, contiguous.
at::Tensor warm_rotate(const at::Tensor& X, const at::Tensor& Q, bool in) {
  at::Tensor Y = at::empty_like(X);
  C10_CUDA_CHECK(warm_rotate_launch({X.const_data_ptr<float>(), Q.const_data_ptr<float>(), Y.mutable_data_ptr<float>(),
                                     in, X.size(0), static_cast<int>(X.size(1))},
                                    current_stream()));
  return Y;
}

}  // namespace

Result solve_in_block(const at::Tensor& X, const at::Tensor& Q, double tol) {
  const auto dtype = X.scalar_type();
  const at::ScalarType cdt = dtype == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t n = X.size(1);
  if (!Q.defined()) {
    const auto [w, V] = solve(X.to(cdt), tol);
    return {w.to(dtype), V.to(dtype)};
  }
  if (cdt == at::kFloat && warm_rotate_fits(n)) {
    // Q0^T X Q0 in float64 sums can neither overflow nor underflow, and the kernel scales, symmetrizes ((Q0^T X Q0 +
    // Q0^T X^T Q0) / 2 = Q0^T X_sym Q0) and flags non-finite entries (a NaN or Inf in X or Q0 makes the product's
    // matrix non-finite), so the rotations are all there is around it
    const at::Tensor Qf = Q.to(at::kFloat).contiguous();
    const auto [w, V] = solve(warm_rotate(X.to(at::kFloat).contiguous(), Qf, /*in=*/true), tol);
    return {w.to(dtype), warm_rotate(V, Qf, /*in=*/false).to(dtype)};
  }
  // Beyond warm_rotate_kernel's shared memory, and float64: the scaled, symmetrized matrix (flagged where X or Q0 has
  // a non-finite entry), rotated by float64 products (float32 matmuls would follow torch's TF32 flag, 1e-3 accuracy
  // when a training script turns it on), and the eigenvectors rotated back
  const Scaled scaled = prep_direct(X, Q, cdt, n);
  const at::Tensor Q64 = Q.to(at::kDouble);
  const at::Tensor R = at::matmul(Q64.transpose(1, 2), at::matmul(scaled.S.to(at::kDouble), Q64)).to(cdt);
  const auto [w_rot, V_rot] = solve(R, tol);
  return finish(X, scaled, at::matmul(Q64, V_rot.to(at::kDouble)), /*rows=*/false, w_rot.to(at::kDouble));
}

}  // namespace eigh
}  // namespace torchkern
