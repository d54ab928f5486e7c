// Small-matrix Newton kernel instantiated for storage type double (compute double): one file per
// instantiation so ninja compiles them in parallel. The kernel is in small_matrix.cuh.
#include "small_matrix.cuh"

namespace torchkern {

template <>
bool newton_small_launch<double>(const double* G, double* out, void* err, int* iters, int64_t batch, int n, int p, double eps,
                            int max_iters, double tol, cudaStream_t stream) {
  return small_matrix::newton_small_dispatch<double, double>(G, out, err, iters, batch, n, p, eps, max_iters, tol, stream);
}

}  // namespace torchkern
