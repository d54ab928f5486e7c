// The Newton inverse root's large path on tensors (matrix_inverse_root_newton_host.h), for ../ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>

namespace torchkern {
namespace newton {

// The iteration on A [B, n, n] = (G + G^T) / 2 in the compute type (contiguous): root [B, n, n] (G's dtype) from the
// final X, err [B] and iters [B] (docs/design.md, "Inverse roots"). wait=false queues all max_iters iterations.
void solve_large(const at::Tensor& A, at::Tensor& root, at::Tensor& err, at::Tensor& iters, int p, double eps,
                 int max_iters, double tol, bool wait);

}  // namespace newton
}  // namespace torchkern
