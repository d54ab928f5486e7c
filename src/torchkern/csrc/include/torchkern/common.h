// What kernel translation units (.cu) and the host side (.cpp) share: the dtype enum, the switch that turns a
// runtime bool into a template parameter, and the launch-error convention. Torch-free and compilable by the host
// compiler (docs/design.md, "Kernel sources").
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace torchkern {

// The dtype of the tensors a launcher gets as plain pointers; the host side maps at::ScalarType to it
// (dispatch.h: to_dtype), the kernel side to a storage type (dispatch.cuh: dispatch_dtype).
enum class DType : int8_t { kFloat32, kFloat64, kFloat16, kBFloat16 };

}  // namespace torchkern

// A launcher (`cudaError_t <op>_launch(const <Op>Params&, cudaStream_t)`) returns the CUDA error of what it
// started: cudaGetLastError() after its last launch, which also reports a failed runtime call before it (a
// device-attribute query, an opt-in). Inside one, a step whose error must stop it early:
//   TORCHKERN_RETURN_IF_ERROR(cudaFuncSetAttribute(...));
// The host side turns the error into an exception: C10_CUDA_CHECK(<op>_launch(params, stream)).
#define TORCHKERN_RETURN_IF_ERROR(expr)          \
  do {                                           \
    const cudaError_t torchkern_error_ = (expr); \
    if (torchkern_error_ != cudaSuccess) {       \
      return torchkern_error_;                   \
    }                                            \
  } while (0)

// Turns a runtime bool into a constexpr one, so the kernel has no branch on it:
//   TORCHKERN_BOOL_SWITCH(has_clamp, kClamp, [&] { launch<kClamp>(...); });
#define TORCHKERN_BOOL_SWITCH(cond, name, ...) \
  [&] {                                        \
    if (cond) {                                \
      constexpr bool name = true;              \
      return __VA_ARGS__();                    \
    } else {                                   \
      constexpr bool name = false;             \
      return __VA_ARGS__();                    \
    }                                          \
  }()
