// Small-matrix Newton kernel for float16 and bfloat16 storage (computed in float32).
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "small_matrix.cuh"

namespace torchkern {

template <>
bool newton_small_launch<c10::Half>(const c10::Half* G, c10::Half* out, void* err, int* iters, int64_t batch, int n,
                                    int p, double eps, int max_iters, double tol, cudaStream_t stream) {
  return small_matrix::newton_small_dispatch<c10::Half, float>(G, out, err, iters, batch, n, p, eps, max_iters, tol,
                                                               stream);
}

template <>
bool newton_small_launch<c10::BFloat16>(const c10::BFloat16* G, c10::BFloat16* out, void* err, int* iters,
                                        int64_t batch, int n, int p, double eps, int max_iters, double tol,
                                        cudaStream_t stream) {
  return small_matrix::newton_small_dispatch<c10::BFloat16, float>(G, out, err, iters, batch, n, p, eps, max_iters,
                                                                   tol, stream);
}

}  // namespace torchkern
