// The fused MLP-energy chain kernel with tf32 operands (mlp_chain_kernel.cuh); one file per precision so
// that ninja compiles the three in parallel.
#include "mlp_chain_kernel.cuh"

namespace torchkern {
namespace mlp {

template <>
cudaError_t launch<kTf32>(const Params& p, const PhiloxState& philox, cudaStream_t stream) {
  return launch_op<kTf32, Tf32Op>(p, philox, stream);
}

}  // namespace mlp
}  // namespace torchkern
