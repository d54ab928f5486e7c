// The in-block Jacobi eigensolver (jacobi.cuh) for whole float64 matrices (eigh_small_f32.cu has the float32 ones and
// the launcher): one file per compute type so that ninja compiles them in parallel.
#include "jacobi.cuh"

namespace torchkern {
namespace jacobi {

template <>
cudaError_t launch_whole<double>(const Problem<double>& pr, int64_t G, cudaStream_t stream) {
  return launch_whole_impl<double>(pr, G, stream);
}

}  // namespace jacobi
}  // namespace torchkern
