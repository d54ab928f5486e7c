// langevin_step / langevin_step_: x' = x - eta grad + sigma sqrt(2 eta) eps [clamped], one pass.
//
// Floor: read x and grad, write x' (3 * numel * sizeof(T) bytes). eps comes from Philox
// inside the kernel (philox.cuh): one Philox call per group of 4 elements, counter
// (offset / 4, group), so the numbers do not depend on the launch shape. Each thread takes
// whole groups with vector loads when the pointers allow; the last n % 4 elements are one
// partial group. `noise` (test-only) replaces eps.
#include "energies.cuh"
#include "launchers.h"
#include "torchkern/dispatch.cuh"
#include "torchkern/launch.cuh"
#include "torchkern/philox.cuh"
#include "torchkern/vec.cuh"

namespace torchkern {
namespace {

constexpr int kThreads = 256;

template <typename T, bool kVec>
__device__ __forceinline__ void load4(const T* p, int64_t group, opmath_t<T> (&v)[4]) {
  if constexpr (kVec) {
    const Vec<T, 4> w = load_vec<T, 4>(p, group);
#pragma unroll
    for (int c = 0; c < 4; ++c) v[c] = to_opmath(w.v[c]);
  } else {
#pragma unroll
    for (int c = 0; c < 4; ++c) v[c] = to_opmath(p[4 * group + c]);
  }
}

// out may alias x (in place): each element is read and written by one thread.
template <typename T, bool kVec, bool kNoise, bool kClamp>
__global__ void __launch_bounds__(kThreads)
langevin_step_kernel(T* out,                                       // [n]
                     const T* x,                                   // [n]
                     const T* __restrict__ grad,                   // [n]
                     const opmath_t<T>* __restrict__ noise,        // [n], only with kNoise
                     int64_t n, StepParams<opmath_t<T>> s, PhiloxState philox) {
  using C = opmath_t<T>;
  PhiloxKey key{};
  if constexpr (!kNoise) key = unpack_key(philox);
  const int64_t groups = n / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (int64_t g = first; g < groups; g += stride) {
    C xv[4], gv[4], ev[4];
    load4<T, kVec>(x, g, xv);
    load4<T, kVec>(grad, g, gv);
    if constexpr (kNoise) {
      load4<C, false>(noise, g, ev);
    } else {
      const float4 e = normal4(key, 0, g);
      ev[0] = e.x, ev[1] = e.y, ev[2] = e.z, ev[3] = e.w;
    }
    Vec<T, 4> r;
#pragma unroll
    for (int c = 0; c < 4; ++c) r.v[c] = from_opmath<T>(langevin_update(xv[c], gv[c], ev[c], s, kClamp));
    if constexpr (kVec) {
      store_vec<T, 4>(out, g, r);
    } else {
#pragma unroll
      for (int c = 0; c < 4; ++c) out[4 * g + c] = r.v[c];
    }
  }
  if (first == 0 && n % 4) {  // the partial last group
    const float4 e = kNoise ? float4{} : normal4(key, 0, groups);
    for (int64_t i = 4 * groups; i < n; ++i) {
      const C eps = kNoise ? noise[i] : static_cast<C>(component(e, static_cast<int>(i - 4 * groups)));
      out[i] = from_opmath<T>(langevin_update(to_opmath(x[i]), to_opmath(grad[i]), eps, s, kClamp));
    }
  }
}

}  // namespace

cudaError_t langevin_step_launch(const LangevinStepParams& p, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = opmath_t<T>;
    const StepParams<C> s = step_params<C>(p.step);
    constexpr int kAlign = 4 * sizeof(T);
    const bool vec = is_aligned(p.out, kAlign) && is_aligned(p.x, kAlign) && is_aligned(p.grad, kAlign);
    const unsigned grid = grid_for((p.n + 3) / 4, kThreads);
    TORCHKERN_BOOL_SWITCH(vec, kVec, [&] {
      TORCHKERN_BOOL_SWITCH(p.noise != nullptr, kNoise, [&] {
        TORCHKERN_BOOL_SWITCH(p.step.clamp, kClamp, [&] {
          langevin_step_kernel<T, kVec, kNoise, kClamp><<<grid, kThreads, 0, stream>>>(
              static_cast<T*>(p.out), static_cast<const T*>(p.x), static_cast<const T*>(p.grad),
              static_cast<const C*>(p.noise), p.n, s, p.philox);
        });
      });
    });
    return cudaGetLastError();
  });
}

}  // namespace torchkern
