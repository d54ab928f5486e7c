// The fused MLP-energy chain kernel with bf16 operands (mlp_chain_kernel.cuh); one file per precision so
// that ninja compiles the three in parallel.
#include "mlp_chain_kernel.cuh"

namespace torchkern {
namespace mlp {

template <>
void launch<kBf16>(const Params& p, const at::PhiloxCudaState& philox, size_t smem_bytes) {
  launch_op<kBf16, Bf16Op>(p, philox, smem_bytes);
}

}  // namespace mlp
}  // namespace torchkern
