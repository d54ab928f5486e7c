// Dtype dispatch and compile-time switches.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

// float32, float64, float16, bfloat16; inside, scalar_t is the storage type and
// at::opmath_type<scalar_t> the compute type (float for the half types).
#define TORCHKERN_DISPATCH_FLOATING(dtype, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, name, __VA_ARGS__)

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
