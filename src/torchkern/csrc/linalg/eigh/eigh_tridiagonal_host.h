// eigh's tridiagonal solver (float32 compute), the host side: the shared way in (eigh_prep.h: flags, exponent, the
// scaled and symmetrized matrix, here in float32), A = Q T Q^T by Householder reflections on clusters of blocks, T's
// eigenpairs in float64 (bisection, sort, inverse iteration, an orthogonalization step), the eigenvectors Q Z through
// the reflections' compact WY form, panel by panel from the last, in float64 products (cuBLAS: float32 matmuls would
// follow torch's TF32 flag), and the shared way out. Q0, when given, is only checked. The kernels: tridiagonal.cuh,
// eigh_tridiagonal.cu.
// Part of linalg's one host translation unit (../ops.cpp includes it): torch's headers are parsed once.
#pragma once

#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/triu.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <tuple>

#include "eigh_prep.h"
#include "eigh_solvers.h"
#include "launchers.h"
#include "torchkern/launch.h"

namespace torchkern {
namespace eigh {

// Inverse iteration's scratch (17 bytes per entry) goes by groups of matrices.
Result solve_tridiagonal(const at::Tensor& X, const at::Tensor& Q) {
  const int64_t B = X.size(0), n = X.size(1), np = kTridiagonalPanel;
  const cudaStream_t stream = current_stream();
  const auto iopt = X.options().dtype(at::kInt), fopt = X.options().dtype(at::kFloat);
  const auto dopt = X.options().dtype(at::kDouble);
  TORCH_CHECK(tridiagonal_fits(n), "torchkern.eigh: the tridiagonal solver's reduction does not fit this GPU's shared "
              "memory at n = ", n, " (solver='auto' or 'jacobi' take it)");
  const int64_t ld = (n + kTridiagonalChunk - 1) / kTridiagonalChunk * kTridiagonalChunk;  // whole column chunks
  const Scaled scaled = prep_direct(X, Q, at::kFloat, ld);  // zero padding past n
  const at::Tensor& S = scaled.S;
  const int64_t panels = (n + np - 1) / np;
  at::Tensor Wt = at::empty({B, np, ld}, fopt);
  at::Tensor d = at::empty({B, n}, dopt), e = at::zeros({B, n}, dopt), tau = at::zeros({B, n}, fopt);
  at::Tensor bounds = at::empty({B, 3}, dopt), lo = at::empty({B, n}, iopt), hi = at::empty({B, n}, iopt);
  at::Tensor lam = at::empty({B, n}, dopt), T = at::empty({B, panels, np, np}, dopt);
  const TridiagonalParams p{S.mutable_data_ptr<float>(), Wt.mutable_data_ptr<float>(), d.mutable_data_ptr<double>(),
                            e.mutable_data_ptr<double>(), tau.mutable_data_ptr<float>(),
                            bounds.mutable_data_ptr<double>(), lo.mutable_data_ptr<int>(), hi.mutable_data_ptr<int>(),
                            lam.mutable_data_ptr<double>(), T.mutable_data_ptr<double>(), B, static_cast<int>(n),
                            static_cast<int>(ld)};
  // A = Q T Q^T; T's eigenvalues, ascending, and eigenvectors Z (columns, in that order)
  C10_CUDA_CHECK(tridiagonal_reduce_launch(p, stream));
  C10_CUDA_CHECK(tridiagonal_eigenvalues_launch(p, stream));
  const auto [sorted, order] = at::sort(lam, /*dim=*/1);
  at::Tensor Z = at::zeros({B, n, n}, dopt);
  {
    const int64_t group = std::max<int64_t>(1, std::min<int64_t>(B, (int64_t(1) << 30) / (17 * n * n)));
    at::Tensor U0 = at::empty({group, n, n}, dopt), U1 = at::empty_like(U0);
    at::Tensor swaps = at::empty({group, n, n}, X.options().dtype(at::kByte));
    for (int64_t b0 = 0; b0 < B; b0 += group) {
      C10_CUDA_CHECK(tridiagonal_vectors_launch(
          p, {sorted.const_data_ptr<double>(), order.const_data_ptr<int64_t>(), Z.mutable_data_ptr<double>(),
              U0.mutable_data_ptr<double>(), U1.mutable_data_ptr<double>(), swaps.mutable_data_ptr<uint8_t>(), b0,
              std::min(group, B - b0)},
          stream));
    }
  }
  // Each eigenvector is solved for alone, so those of close eigenvalues lose orthogonality as their gap shrinks (the
  // "clustered" spectrum at n = 520, emulated in float64: Z^T Z - I of 4e-6 where two eigenvalues are 5e-12 ||T||
  // apart, 1e-7 at 1e-10), which LAPACK's stein prevents by Gram-Schmidt within each cluster. One orthogonality_step
  // squares that error (to 1e-11 there) and mixes only the vectors it couples, whose eigenvalues are that close: the
  // residual stays.
  Z = orthogonality_step(Z);
  // Q Z = H_0 H_1 .. H_{n-2} Z: the panels' I - V T V^T from the last, each on the rows its reflections touch
  C10_CUDA_CHECK(tridiagonal_panels_launch(p, stream));
  const at::Tensor R = at::triu(S.narrow(1, 0, n).narrow(2, 0, n), 1).to(at::kDouble);  // row i: reflection i's v
  for (int64_t panel = panels - 1; panel >= 0; --panel) {
    const int64_t p0 = panel * np, rows = std::min<int64_t>(np, n - 1 - p0), m = n - 1 - p0;
    if (rows <= 0) continue;
    const at::Tensor Rp = R.narrow(1, p0, rows).narrow(2, p0 + 1, m);  // V^T on the rows the panel touches
    const at::Tensor Tp = T.select(1, panel).narrow(1, 0, rows).narrow(2, 0, rows);
    at::Tensor Zp = Z.narrow(1, p0 + 1, m);
    Zp.baddbmm_(Rp.transpose(1, 2), at::bmm(Tp, at::bmm(Rp, Zp)), /*beta=*/1.0, /*alpha=*/-1.0);
  }
  return finish(X, scaled, Z, /*rows=*/false, sorted);
}

}  // namespace eigh
}  // namespace torchkern
