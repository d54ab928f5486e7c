// The row-coupled Langevin chains (langevin_chain_rows.cuh) for float32 and float64 states; the other dtypes are in
// langevin_chain_rows_f16_bf16.cu, so that ninja compiles the two halves in parallel.
#include "langevin_chain_rows.cuh"

namespace torchkern {
namespace chain {

TORCHKERN_INSTANTIATE_ROWS(float)
TORCHKERN_INSTANTIATE_ROWS(double)

}  // namespace chain
}  // namespace torchkern
