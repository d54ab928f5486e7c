// hmc_chain_'s launcher and its kernels for float32 states (hmc_chain.cuh; float16/bfloat16 states run in float32);
// float64's are in hmc_chain_f64.cu, so that ninja compiles the two in parallel.
#include "hmc_chain.cuh"

namespace torchkern {
namespace hmc {

extern template cudaError_t launch<double>(const HmcChainParams& p, cudaStream_t stream);  // hmc_chain_f64.cu

}  // namespace hmc

cudaError_t hmc_chain_launch(const HmcChainParams& p, cudaStream_t stream) {
  return p.dtype == DType::kFloat64 ? hmc::launch<double>(p, stream) : hmc::launch<float>(p, stream);
}

}  // namespace torchkern
