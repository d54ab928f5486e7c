// The in-block Newton kernel (small_matrix.cuh) computing in float32 (float32, float16 and bfloat16 storage share its
// instantiations), and the launcher (launchers.h: small_launch), which hands float64 to its own file: one file per
// compute type so that ninja compiles the two in parallel.
#include "small_matrix.cuh"

namespace torchkern {
namespace newton {

cudaError_t small_launch(const SmallParams& p, bool* launched, cudaStream_t stream) {
  *launched = false;
  switch (p.dtype) {
    case DType::kFloat32:
    case DType::kFloat16:
    case DType::kBFloat16: return small_matrix::newton_small_dispatch<float>(p, launched, stream);
    case DType::kFloat64: return newton_small_f64(p, launched, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace newton
}  // namespace torchkern
