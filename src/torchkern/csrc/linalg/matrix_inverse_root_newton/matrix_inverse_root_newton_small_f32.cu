// The in-block Newton kernel (small_matrix.cuh) for float32, and the launcher (launchers.h: small_launch), which hands
// the other dtypes to their own files: one file per instantiation so that ninja compiles them in parallel.
#include "small_matrix.cuh"

namespace torchkern {
namespace newton {

cudaError_t small_launch(const SmallParams& p, bool* launched, cudaStream_t stream) {
  *launched = false;
  switch (p.dtype) {
    case DType::kFloat32: return small_matrix::newton_small_dispatch<float, float>(p, launched, stream);
    case DType::kFloat64: return newton_small_f64(p, launched, stream);
    case DType::kFloat16: return newton_small_f16(p, launched, stream);
    case DType::kBFloat16: return newton_small_bf16(p, launched, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace newton
}  // namespace torchkern
