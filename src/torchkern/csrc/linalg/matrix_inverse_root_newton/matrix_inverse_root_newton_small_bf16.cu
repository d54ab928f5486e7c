// The in-block Newton kernel (small_matrix.cuh) for bfloat16 storage, computed in float32: one file per instantiation
// so that ninja compiles them in parallel.
#include <cuda_bf16.h>

#include "small_matrix.cuh"

namespace torchkern {

cudaError_t newton_small_bf16(const newton::SmallParams& p, bool* launched, cudaStream_t stream) {
  return small_matrix::newton_small_dispatch<__nv_bfloat16, float>(p, launched, stream);
}

}  // namespace torchkern
