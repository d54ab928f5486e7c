// The fused MLP-energy chain kernel with fp32 operands (mlp_chain_kernel.cuh); one file per precision so
// that ninja compiles the three in parallel.
#include "mlp_chain_kernel.cuh"

namespace torchkern {
namespace mlp {

template <>
void launch<kFp32>(const Params& p, const at::PhiloxCudaState& philox, size_t smem_bytes) {
  launch_op<kFp32, Fp32Op>(p, philox, smem_bytes);
}

}  // namespace mlp
}  // namespace torchkern
