// langevin_step / langevin_step_: x' = x - eta grad + sigma sqrt(2 eta) eps [clamped], one pass.
//
// Floor: read x and grad, write x' (3 * numel * sizeof(T) bytes). eps comes from Philox
// inside the kernel (philox.cuh): one Philox call per group of 4 elements, counter
// (offset / 4, group), so the numbers do not depend on the launch shape. Each thread takes
// whole groups with vector loads when the pointers allow; the last n % 4 elements are one
// partial group. `noise` (test-only) replaces eps.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "torchkern/checks.h"
#include "torchkern/dispatch.h"
#include "energies.cuh"
#include "torchkern/launch.h"
#include "torchkern/philox.cuh"
#include "torchkern/vec.cuh"

namespace torchkern {
namespace {

constexpr int kThreads = 256;

template <typename T, bool kVec>
__device__ __forceinline__ void load4(const T* p, int64_t group, at::opmath_type<T> (&v)[4]) {
  if constexpr (kVec) {
    const Vec<T, 4> w = load_vec<T, 4>(p, group);
#pragma unroll
    for (int c = 0; c < 4; ++c) v[c] = static_cast<at::opmath_type<T>>(w.v[c]);
  } else {
#pragma unroll
    for (int c = 0; c < 4; ++c) v[c] = static_cast<at::opmath_type<T>>(p[4 * group + c]);
  }
}

// out may alias x (in place): each element is read and written by one thread.
template <typename T, bool kVec, bool kNoise, bool kClamp>
__global__ void __launch_bounds__(kThreads)
langevin_step_kernel(T* out,                                       // [n]
                     const T* x,                                   // [n]
                     const T* __restrict__ grad,                   // [n]
                     const at::opmath_type<T>* __restrict__ noise, // [n], only with kNoise
                     int64_t n, StepParams<at::opmath_type<T>> s, at::PhiloxCudaState philox) {
  using C = at::opmath_type<T>;
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
    for (int c = 0; c < 4; ++c) r.v[c] = static_cast<T>(langevin_update(xv[c], gv[c], ev[c], s, kClamp));
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
      out[i] = static_cast<T>(langevin_update(static_cast<C>(x[i]), static_cast<C>(grad[i]), eps, s, kClamp));
    }
  }
}

void check_step(const char* torchkern_op_name, const at::Tensor& x, const at::Tensor& grad, double step_size,
                double noise_scale, std::optional<double> lo, std::optional<double> hi,
                const std::optional<at::Tensor>& noise) {
  TORCHKERN_CHECK_FLOAT(x);
  TORCHKERN_CHECK_FLOAT(grad);
  TORCHKERN_CHECK_SAME_DTYPE(x, grad);
  TORCHKERN_CHECK_SAME_DEVICE(x, grad);
  TORCHKERN_CHECK_SAME_SHAPE(x, grad);
  check_step_args(torchkern_op_name, step_size, noise_scale, lo, hi);
  if (noise.has_value()) {
    const at::Tensor& noise_ = *noise;
    TORCHKERN_CHECK_FLOAT(noise_);
    TORCHKERN_CHECK(noise_.device() == x.device(), "noise must be on ", x.device().str(), " like x, got ",
                    noise_.device().str());
    TORCHKERN_CHECK(noise_.sizes() == x.sizes(), "noise must have shape ", x.sizes(), " like x, got ", noise_.sizes());
  }
  TORCHKERN_CHECK_CUDA(x);
}

// out (contiguous, may be x itself) <- one step from contiguous x and grad.
void launch_step(at::Tensor& out, const at::Tensor& xc, const at::Tensor& grad, double step_size, double noise_scale,
                 std::optional<double> lo, std::optional<double> hi, const std::optional<at::Generator>& generator,
                 const std::optional<at::Tensor>& noise) {
  const int64_t n = out.numel();
  if (n == 0) return;
  const at::Tensor gc = grad.contiguous();
  const at::ScalarType opmath = xc.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor nc = noise.has_value() ? noise->to(opmath).contiguous() : at::Tensor();
  const at::PhiloxCudaState philox = noise.has_value() ? at::PhiloxCudaState() : reserve_philox(generator, 1);
  const bool clamp = lo.has_value() || hi.has_value();
  TORCHKERN_DISPATCH_FLOATING(xc.scalar_type(), "langevin_step", [&] {
    using C = at::opmath_type<scalar_t>;
    const auto s = make_step_params<C>(step_size, noise_scale, lo, hi);
    constexpr int kAlign = 4 * sizeof(scalar_t);
    const bool vec = is_aligned(out.data_ptr(), kAlign) && is_aligned(xc.const_data_ptr(), kAlign) &&
                     is_aligned(gc.const_data_ptr(), kAlign);
    const unsigned grid = grid_for((n + 3) / 4, kThreads);
    const C* noise_ptr = nc.defined() ? nc.const_data_ptr<C>() : nullptr;
    TORCHKERN_BOOL_SWITCH(vec, kVec, [&] {
      TORCHKERN_BOOL_SWITCH(nc.defined(), kNoise, [&] {
        TORCHKERN_BOOL_SWITCH(clamp, kClamp, [&] {
          langevin_step_kernel<scalar_t, kVec, kNoise, kClamp><<<grid, kThreads, 0, current_stream()>>>(
              out.mutable_data_ptr<scalar_t>(), xc.const_data_ptr<scalar_t>(), gc.const_data_ptr<scalar_t>(),
              noise_ptr, n, s, philox);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
    });
  });
}

at::Tensor langevin_step_cuda(const at::Tensor& x, const at::Tensor& grad, double step_size, double noise_scale,
                              std::optional<double> clamp_min, std::optional<double> clamp_max,
                              std::optional<at::Generator> generator, const std::optional<at::Tensor>& noise) {
  check_step("torchkern.langevin_step", x, grad, step_size, noise_scale, clamp_min, clamp_max, noise);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  launch_step(out, xc, grad, step_size, noise_scale, clamp_min, clamp_max, generator, noise);
  return out;
}

void langevin_step_inplace_cuda(at::Tensor& x, const at::Tensor& grad, double step_size, double noise_scale,
                                std::optional<double> clamp_min, std::optional<double> clamp_max,
                                std::optional<at::Generator> generator, const std::optional<at::Tensor>& noise) {
  check_step("torchkern.langevin_step_", x, grad, step_size, noise_scale, clamp_min, clamp_max, noise);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  if (x.is_contiguous()) {
    launch_step(x, x, grad, step_size, noise_scale, clamp_min, clamp_max, generator, noise);
  } else {
    const at::Tensor xc = x.contiguous();
    at::Tensor out = at::empty(x.sizes(), x.options());
    launch_step(out, xc, grad, step_size, noise_scale, clamp_min, clamp_max, generator, noise);
    x.copy_(out);
  }
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) {
  m.impl("langevin_step", &torchkern::langevin_step_cuda);
  m.impl("langevin_step_", &torchkern::langevin_step_inplace_cuda);
}
