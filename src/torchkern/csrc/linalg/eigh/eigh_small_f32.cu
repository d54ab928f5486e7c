// The in-block Jacobi eigensolver (jacobi.cuh) for whole float matrices: one file per compute type so that
// ninja compiles them in parallel.
#include "jacobi.cuh"

namespace torchkern {
namespace jacobi {

template <>
void launch_whole<float>(const Problem<float>& pr, int64_t G, cudaStream_t stream) {
  launch_whole_impl<float>(pr, G, stream);
}

}  // namespace jacobi
}  // namespace torchkern
