// The solvers' way in and out (eigh_prep.cu): a few launches in place of some thirty ATen ops, whose host time left
// the GPU idle for about a millisecond a call at 64 x 256^2.
//
// In: per matrix, whether X or Q0 has a non-finite entry and the exponent e of its largest |x| (frexp: max |x| 2^-e
// in [0.5, 1), 0 for a zero or a non-finite matrix), then the scaled and symmetrized matrix 2^-e (X + X^T) / 2
// (zero for a flagged matrix), padded with zeros to N >= n. Out: eigenvalues scaled back by 2^e and the eigenvectors
// as columns, gathered in ascending order, cast to the output dtype, NaN for flagged matrices. Scaling by powers of
// two is exact.
#pragma once

#include <ATen/core/Tensor.h>

namespace torchkern {
namespace eigh {

// S (B, N, N), float32 or float64: the scaled, symmetrized X (B, n, n) padded with zeros; exponent, flagged (B) int32.
// Q (B, n, n) or undefined: only checked for non-finite entries.
void prep_direct(const at::Tensor& X, const at::Tensor& Q, at::Tensor& S, at::Tensor& exponent, at::Tensor& flagged);

// The block method's way in: A (B, N, N) float64 as prep_direct's S, the basis W (B, N, N) float64 = Q0^T on the
// n x n corner (Q undefined: I) and I on the padding (a flagged matrix: I), and per matrix the rotation threshold
// thr = tol ||A||_F / N and the stopping bound stop2 = (tol ||A||_F)^2 (float64).
void prep_block(const at::Tensor& X, const at::Tensor& Q, at::Tensor& A, at::Tensor& W, at::Tensor& exponent,
                at::Tensor& flagged, at::Tensor& thr, at::Tensor& stop2, double tol);

// w (B, n) = 2^e values, values (B, n) ascending, and V (B, n, n), both in w's dtype, from vectors (B, N, N) of
// values' dtype (float32 or float64): with `rows`, V's column j is row order[b, j] of vectors (row j without
// order), else column j of vectors (order undefined). NaN for flagged matrices and, given `failed` (B) int32, for
// those with failed != 0.
void finish(const at::Tensor& vectors, bool rows, const at::Tensor& values, const at::Tensor& order,
            const at::Tensor& exponent, const at::Tensor& flagged, const at::Tensor& failed, at::Tensor& w,
            at::Tensor& V);

}  // namespace eigh
}  // namespace torchkern
