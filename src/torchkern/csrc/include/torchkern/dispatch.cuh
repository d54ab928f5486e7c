// Dtypes on the kernel side, torch-free: the storage type of a DType, the type it computes in, and the
// conversions between the two.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "torchkern/common.h"

namespace torchkern {

// The compute type of a storage type: float for the half types (as at::opmath_type), else the type itself.
template <typename T>
struct OpMath {
  using type = T;
};
template <>
struct OpMath<__half> {
  using type = float;
};
template <>
struct OpMath<__nv_bfloat16> {
  using type = float;
};
template <typename T>
using opmath_t = typename OpMath<T>::type;

// Explicit conversions: torch's nvcc flags (-D__CUDA_NO_HALF_CONVERSIONS__ and the like) remove the implicit
// ones. To the storage type they round once, to nearest even, as torch's own casts do, so a kernel that computes
// in opmath_t and stores once gives torch's bits.
template <typename T>
__host__ __device__ __forceinline__ T to_opmath(T x) {
  return x;
}
__host__ __device__ __forceinline__ float to_opmath(__half x) { return __half2float(x); }
__host__ __device__ __forceinline__ float to_opmath(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__host__ __device__ __forceinline__ T from_opmath(opmath_t<T> x) {
  return x;
}
template <>
__host__ __device__ __forceinline__ __half from_opmath<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__host__ __device__ __forceinline__ __nv_bfloat16 from_opmath<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// A type as a value, for dispatch_dtype's callback.
template <typename T>
struct Type {
  using type = T;
};

// Calls f(Type<T>{}) with T the storage type of `dtype` and returns its error:
//   return dispatch_dtype(p.dtype, [&](auto tag) { using T = typename decltype(tag)::type; ... });
template <typename F>
cudaError_t dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f(Type<float>{});
    case DType::kFloat64: return f(Type<double>{});
    case DType::kFloat16: return f(Type<__half>{});
    case DType::kBFloat16: return f(Type<__nv_bfloat16>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace torchkern
