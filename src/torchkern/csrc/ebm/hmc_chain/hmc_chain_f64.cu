// hmc_chain_'s kernels for float64 states (hmc_chain.cuh); float32 and the launcher are in hmc_chain_f32.cu, so
// that ninja compiles the two in parallel.
#include "hmc_chain.cuh"

namespace torchkern {
namespace hmc {

template cudaError_t launch<double>(const HmcChainParams& p, cudaStream_t stream);

}  // namespace hmc
}  // namespace torchkern
