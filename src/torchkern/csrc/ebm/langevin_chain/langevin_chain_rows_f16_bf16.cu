// The row-coupled Langevin chains (langevin_chain_rows.cuh) for float16 and bfloat16 states; the other dtypes are in
// langevin_chain_rows_f32_f64.cu, so that ninja compiles the two halves in parallel.
#include "langevin_chain_rows.cuh"

namespace torchkern {
namespace chain {

TORCHKERN_INSTANTIATE_ROWS(__half)
TORCHKERN_INSTANTIATE_ROWS(__nv_bfloat16)

}  // namespace chain
}  // namespace torchkern
