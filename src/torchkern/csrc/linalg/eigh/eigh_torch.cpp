// eigh through torch.linalg.eigh (cuSOLVER's syevd, one matrix after another) between the shared way in and out
// (eigh_prep.h): the router sends it the shapes where it is the fastest (linalg/constants.py, EIGH_TORCH_*). Q0, when
// given, is only checked.
#include <ATen/ops/empty.h>
#include <ATen/ops/linalg_eigh.h>

#include <tuple>

#include "eigh_prep.h"
#include "eigh_solvers.h"

namespace torchkern {
namespace eigh {

Result solve_torch(const at::Tensor& X, const at::Tensor& Q) {
  const int64_t B = X.size(0), n = X.size(1);
  const auto iopt = X.options().dtype(at::kInt);
  at::Tensor exponent = at::empty({B}, iopt), flagged = at::empty({B}, iopt);
  at::Tensor S = at::empty({B, n, n}, X.options().dtype(X.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  prep_direct(X, Q, S, exponent, flagged);
  const auto [values, vectors] = at::linalg_eigh(S);
  // torch returns the eigenvectors column-major (LAPACK's layout): then their transposes are rows, stored contiguously
  const bool rows = vectors.mT().is_contiguous();
  const at::Tensor stored = rows ? vectors.mT() : vectors.contiguous();
  at::Tensor w = at::empty({B, n}, X.options()), V = at::empty({B, n, n}, X.options());
  finish(stored, rows, values.contiguous(), at::Tensor(), exponent, flagged, at::Tensor(), w, V);
  return {w, V};
}

}  // namespace eigh
}  // namespace torchkern
