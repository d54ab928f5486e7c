// The solvers' way in and out on tensors (eigh_prep_host.h; the kernels: eigh_prep.cu, launchers.h's prep_launch and
// finish_launch): a few launches in place of some thirty ATen ops, whose host time left the GPU idle for about a
// millisecond a call at 64 x 256^2.
//
// In: per matrix, whether X or Q0 has a non-finite entry and the exponent e of its largest |x| (max |x| 2^-e in
// [0.5, 1), 0 for a zero or a non-finite matrix), then the scaled and symmetrized matrix 2^-e (X + X^T) / 2 (zero for
// a flagged matrix), padded with zeros to N >= n. Out: eigenvalues scaled back by 2^e and the eigenvectors as
// columns, in ascending order, cast to X's dtype, NaN for flagged matrices. Scaling by powers of two is exact.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "eigh_solvers.h"

namespace torchkern {
namespace eigh {

struct Scaled {
  at::Tensor S;         // [B, N, N]
  at::Tensor exponent;  // [B] int32
  at::Tensor flagged;   // [B] int32
};

// The direct solvers' way in: S of `type` (float32 or float64). Q (or undefined) is only checked.
Scaled prep_direct(const at::Tensor& X, const at::Tensor& Q, at::ScalarType type, int64_t N);

// The block method's way in: S float64, the basis W [B, N, N] = Q^T (I without Q) with I on the padding, and per
// matrix thr = tol ||S||_F / N and stop2 = (tol ||S||_F)^2 (float64). N: a multiple of 64.
Scaled prep_block(const at::Tensor& X, const at::Tensor& Q, int64_t N, double tol, at::Tensor& W, at::Tensor& thr,
                  at::Tensor& stop2);

// (w [B, n], V [B, n, n]) in X's dtype from vectors [B, N, N] and values [B, n] (float32 or float64, ascending): with
// `rows`, V's column j is row order[b, j] of vectors (row j with order undefined), else column j of vectors. NaN for
// the flagged matrices and for those with failed != 0 (when defined).
Result finish(const at::Tensor& X, const Scaled& scaled, const at::Tensor& vectors, bool rows,
              const at::Tensor& values, const at::Tensor& order = at::Tensor(),
              const at::Tensor& failed = at::Tensor());

// finish for a solver whose eigenvalues come in any order (values [B, n], float64 or float32), with the eigenvectors
// as the rows of `vectors`: sorts them (cuSOLVER's routines can leave the copies of a repeated eigenvalue out of order
// by an ulp) and gathers each eigenvector with its eigenvalue.
Result finish_sorted(const at::Tensor& X, const Scaled& scaled, const at::Tensor& vectors, const at::Tensor& values,
                     const at::Tensor& failed = at::Tensor());

// One Newton-Schulz step towards the nearest orthogonal matrix, V (3 I - V^T V) / 2 for V [B, m, n] (float64 products:
// float32 ones would follow torch's TF32 flag): it squares the error E = V^T V - I (to about 3/4 E^2) and moves V by
// O(||E||), each column only towards the columns that E couples it with.
at::Tensor orthogonality_step(const at::Tensor& V);

}  // namespace eigh
}  // namespace torchkern
