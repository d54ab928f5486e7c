// eigh through torch.linalg.eigh (cuSOLVER's syevd, one matrix after another) between the shared way in and out
// (eigh_prep.h): the router sends it the shapes where it is the fastest (linalg/constants.py, EIGH_TORCH_*). Q0, when
// given, is only checked.
// Part of linalg's one host translation unit (../ops.cpp includes it): torch's headers are parsed once.
#pragma once

#include <ATen/ops/linalg_eigh.h>

#include <tuple>

#include "eigh_prep.h"
#include "eigh_solvers.h"

namespace torchkern {
namespace eigh {

Result solve_torch(const at::Tensor& X, const at::Tensor& Q) {
  const Scaled scaled = prep_direct(X, Q, X.scalar_type() == at::kDouble ? at::kDouble : at::kFloat, X.size(1));
  const auto [values, vectors] = at::linalg_eigh(scaled.S);
  // torch returns the eigenvectors column-major (LAPACK's layout): their transposes are then rows, stored
  // contiguously (contiguous() copies nothing). Sorted, as cuSOLVER's eigenvalues need (eigh_prep.h, finish_sorted).
  return finish_sorted(X, scaled, vectors.mT().contiguous(), values);
}

}  // namespace eigh
}  // namespace torchkern
