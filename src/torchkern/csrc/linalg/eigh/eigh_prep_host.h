// The solvers' way in and out on tensors (eigh_prep.h): scratch and outputs allocated here, the kernels launched
// through launchers.h.
// Part of linalg's one host translation unit (../ops.cpp includes it): torch's headers are parsed once.
#pragma once

#include "eigh_prep.h"

#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sort.h>
#include <c10/cuda/CUDAException.h>

#include "launchers.h"
#include "torchkern/dispatch.h"
#include "torchkern/launch.h"

namespace torchkern {
namespace eigh {
namespace {

// The parameters every way in shares, with its scratch (kept alive by `scratch`).
PrepParams prep_params(const at::Tensor& X, const at::Tensor& Q, const Scaled& s, at::Tensor (&scratch)[2]) {
  const int64_t B = X.size(0), n = X.size(1), chunks = (n + kPrepRows - 1) / kPrepRows;
  scratch[0] = at::empty({B * chunks}, X.options().dtype(at::kDouble));
  scratch[1] = at::empty({B * chunks}, X.options().dtype(at::kInt));
  PrepParams p{};
  p.X = X.const_data_ptr();
  p.Q = Q.defined() ? Q.const_data_ptr() : nullptr;
  p.dtype = to_dtype(X.scalar_type());
  p.batch = B;
  p.n = static_cast<int>(n);
  p.N = static_cast<int>(s.S.size(1));
  p.S = s.S.mutable_data_ptr();
  p.s_f64 = s.S.scalar_type() == at::kDouble;
  p.exponent = s.exponent.mutable_data_ptr<int>();
  p.flagged = s.flagged.mutable_data_ptr<int>();
  p.part_max = scratch[0].mutable_data_ptr<double>();
  p.part_bad = scratch[1].mutable_data_ptr<int>();
  return p;
}

Scaled allocate(const at::Tensor& X, at::ScalarType type, int64_t N) {
  const int64_t B = X.size(0);
  const auto iopt = X.options().dtype(at::kInt);
  return {at::empty({B, N, N}, X.options().dtype(type)), at::empty({B}, iopt), at::empty({B}, iopt)};
}

}  // namespace

Scaled prep_direct(const at::Tensor& X, const at::Tensor& Q, at::ScalarType type, int64_t N) {
  Scaled s = allocate(X, type, N);
  at::Tensor scratch[2];
  C10_CUDA_CHECK(prep_launch(prep_params(X, Q, s, scratch), current_stream()));
  return s;
}

Scaled prep_block(const at::Tensor& X, const at::Tensor& Q, int64_t N, double tol, at::Tensor& W, at::Tensor& thr,
                  at::Tensor& stop2) {
  Scaled s = allocate(X, at::kDouble, N);
  at::Tensor scratch[2];
  PrepParams p = prep_params(X, Q, s, scratch);
  const int64_t tiles = N / kPrepTile;
  const at::Tensor part_sq = at::empty({X.size(0) * tiles * tiles}, X.options().dtype(at::kDouble));
  p.W = W.mutable_data_ptr<double>();
  p.part_sq = part_sq.mutable_data_ptr<double>();
  p.thr = thr.mutable_data_ptr<double>();
  p.stop2 = stop2.mutable_data_ptr<double>();
  p.tol = tol;
  C10_CUDA_CHECK(prep_launch(p, current_stream()));
  return s;
}

Result finish(const at::Tensor& X, const Scaled& scaled, const at::Tensor& vectors, bool rows,
              const at::Tensor& values, const at::Tensor& order, const at::Tensor& failed) {
  const int64_t B = X.size(0), n = X.size(1);
  at::Tensor w = at::empty({B, n}, X.options()), V = at::empty({B, n, n}, X.options());
  FinishParams p{};
  p.vectors = vectors.const_data_ptr();
  p.values = values.const_data_ptr();
  p.f64 = vectors.scalar_type() == at::kDouble;
  p.rows = rows;
  p.order = order.defined() ? order.const_data_ptr<int64_t>() : nullptr;
  p.exponent = scaled.exponent.const_data_ptr<int>();
  p.flagged = scaled.flagged.const_data_ptr<int>();
  p.failed = failed.defined() ? failed.const_data_ptr<int>() : nullptr;
  p.w = w.mutable_data_ptr();
  p.V = V.mutable_data_ptr();
  p.dtype = to_dtype(X.scalar_type());
  p.batch = B;
  p.n = static_cast<int>(n);
  p.N = static_cast<int>(vectors.size(1));
  C10_CUDA_CHECK(finish_launch(p, current_stream()));
  return {w, V};
}

at::Tensor orthogonality_step(const at::Tensor& V) {
  const at::Tensor gram = at::bmm(V.transpose(1, 2), V);
  gram.diagonal(0, 1, 2).sub_(3.0);
  return at::bmm(V, gram).mul_(-0.5);
}

Result finish_sorted(const at::Tensor& X, const Scaled& scaled, const at::Tensor& vectors, const at::Tensor& values,
                     const at::Tensor& failed) {
  const auto [sorted, order] = at::sort(values, /*dim=*/1);
  return finish(X, scaled, vectors, /*rows=*/true, sorted, order, failed);
}

}  // namespace eigh
}  // namespace torchkern
