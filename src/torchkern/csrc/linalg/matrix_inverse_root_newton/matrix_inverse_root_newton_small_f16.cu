// The in-block Newton kernel (small_matrix.cuh) for float16 storage, computed in float32: one file per instantiation
// so that ninja compiles them in parallel.
#include <cuda_fp16.h>

#include "small_matrix.cuh"

namespace torchkern {

cudaError_t newton_small_f16(const newton::SmallParams& p, bool* launched, cudaStream_t stream) {
  return small_matrix::newton_small_dispatch<__half, float>(p, launched, stream);
}

}  // namespace torchkern
