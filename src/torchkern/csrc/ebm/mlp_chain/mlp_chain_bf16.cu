// The fused MLP-energy chain kernel with bf16 operands (mlp_chain_kernel.cuh); one file per precision so
// that ninja compiles the three in parallel. p.wgmma (sm_90a, the planner's choice) runs the warpgroup products.
#include "mlp_chain_kernel.cuh"

namespace torchkern {
namespace mlp {

template <>
void launch<kBf16>(const Params& p, const at::PhiloxCudaState& philox, size_t smem_bytes) {
  if (p.wgmma) {
    launch_op<kBf16, Bf16WgOp>(p, philox, smem_bytes);
  } else {
    launch_op<kBf16, Bf16Op>(p, philox, smem_bytes);
  }
}

}  // namespace mlp
}  // namespace torchkern
