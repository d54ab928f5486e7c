// The in-block Jacobi eigensolver (jacobi.cuh) for whole double matrices: one file per compute type so that
// ninja compiles them in parallel.
#include "jacobi.cuh"

namespace torchkern {
namespace jacobi {

template <>
void launch_whole<double>(const Problem<double>& pr, int64_t G, cudaStream_t stream) {
  launch_whole_impl<double>(pr, G, stream);
}

}  // namespace jacobi
}  // namespace torchkern
