// The in-block Newton kernel (small_matrix.cuh) for float64: one file per instantiation so that ninja compiles them in
// parallel.
#include "small_matrix.cuh"

namespace torchkern {

cudaError_t newton_small_f64(const newton::SmallParams& p, bool* launched, cudaStream_t stream) {
  return small_matrix::newton_small_dispatch<double, double>(p, launched, stream);
}

}  // namespace torchkern
