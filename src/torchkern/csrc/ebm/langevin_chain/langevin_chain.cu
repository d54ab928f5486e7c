// langevin_chain: a whole Langevin chain on an analytic energy in ONE launch, the state in registers.
//
// Elementwise-separable energies (DoubleWell, Harmonic, Rastrigin): one thread owns a group
// of 4 consecutive elements of the flat [B * d] state for all steps. Row-coupled energies
// (Rosenbrock: neighbours; Ackley: row sums): one warp owns a row, lane l holding the chunks
// of 4 columns 4 (l + 32 k) + [0, 4) for k < kChunks (d <= 1024); neighbours come by shuffles,
// sums by warp reductions. Longer rows of those two run step by step (score + fused step).
//
// Noise: the Philox counter of element i at step t is (offset / 4 + t, i / 4), component i % 4,
// exactly what t separate langevin_step calls would reserve, so a chain and its steps draw
// the same numbers. The trajectory [B, n_steps // thin, d] is written only when asked.
// finite_steps [B]: each chain's steps before its first non-finite state (n_steps for one that stayed finite).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

#include "../chain_checks.h"
#include "langevin_chain.cuh"
#include "torchkern/checks.h"
#include "torchkern/dispatch.h"
#include "../energies.cuh"
#include "torchkern/launch.h"
#include "torchkern/philox.cuh"

namespace torchkern {
namespace {

using chain::ChainArgs;
using chain::kMaxRowChunks;
using chain::kThreads;

// kPlain: Philox noise, no clamp, no trajectory (the common call), with those branches compiled
// out of the step loop (on an H200 at 65536 x 128 x 200, a copy of the loop that kept the noise
// and clamp checks at run time took 15% longer than one without them).
template <int kKind, typename T, bool kPlain>
__global__ void __launch_bounds__(kThreads)
chain_elementwise_kernel(const T* __restrict__ x,  // [B, d]
                         T* __restrict__ out,      // [B, d]
                         T* __restrict__ traj,     // [B, kept, d]
                         ChainArgs<at::opmath_type<T>> a, at::PhiloxCudaState philox) {
  using C = at::opmath_type<T>;
  const int64_t n = a.batch * a.d;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t base = 4 * g;
  if (base >= n) return;
  const int count = n - base < 4 ? static_cast<int>(n - base) : 4;
  const bool injected = !kPlain && a.noise;
  const PhiloxKey key = injected ? PhiloxKey{} : unpack_key(philox);
  C v[4];
  int64_t row[4];  // trajectory indices (unused when kPlain)
  int col[4];
  unsigned noted = 0;  // bit c: element c's non-finite state is recorded
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    v[c] = c < count ? static_cast<C>(x[base + c]) : C(0);
    row[c] = (base + c) / a.d;
    col[c] = static_cast<int>(base + c - row[c] * a.d);
  }
#pragma unroll 1
  for (int t = 0; t < a.n_steps; ++t) {
    C eps[4];
    if (injected) {
#pragma unroll
      for (int c = 0; c < 4; ++c) eps[c] = c < count ? a.noise[t * n + base + c] : C(0);
    } else {
      const float4 e = normal4(key, t, g);
      eps[0] = e.x, eps[1] = e.y, eps[2] = e.z, eps[3] = e.w;
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      v[c] = langevin_update(v[c], elementwise_grad<kKind>(v[c], a.p), eps[c], a.s, !kPlain && a.clamp);
    }
    if (!(isfinite(v[0]) && isfinite(v[1]) && isfinite(v[2]) && isfinite(v[3]))) {  // diverged: rare
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (c < count && !(noted >> c & 1) && !isfinite(v[c])) {
          note_non_finite(a.finite_steps, (base + c) / a.d, t);
          noted |= 1u << c;
        }
      }
    }
    if (!kPlain && a.kept && (t + 1) % a.thin == 0) {
      const int slot = (t + 1) / a.thin - 1;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (c < count) traj[(row[c] * a.kept + slot) * a.d + col[c]] = static_cast<T>(v[c]);
      }
    }
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    if (c < count) out[base + c] = static_cast<T>(v[c]);
  }
}

template <int kKind, typename T>
void launch_elementwise(const T* x, T* out, T* traj, const ChainArgs<at::opmath_type<T>>& a,
                        const at::PhiloxCudaState& philox) {
  const int64_t groups = (a.batch * a.d + 3) / 4;
  const unsigned grid = static_cast<unsigned>((groups + kThreads - 1) / kThreads);
  if (!a.noise && !a.clamp && !a.kept) {
    chain_elementwise_kernel<kKind, T, true><<<grid, kThreads, 0, current_stream()>>>(x, out, traj, a, philox);
  } else {
    chain_elementwise_kernel<kKind, T, false><<<grid, kThreads, 0, current_stream()>>>(x, out, traj, a, philox);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Rows too long for one warp's registers: score op + in-place step op per step, reserving the
// same Philox offsets the fused kernel would, so the noise is the same.
void chain_by_steps(at::Tensor& state, at::Tensor& traj, at::Tensor& finite_steps, int64_t kind,
                    at::ArrayRef<double> params, double step_size,
                    double noise_scale, std::optional<double> lo, std::optional<double> hi, int64_t n_steps,
                    int64_t thin, int64_t kept, const std::optional<at::Generator>& generator,
                    const std::optional<at::Tensor>& noise) {
  static auto score_op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("torchkern::analytic_score", "")
                             .typed<at::Tensor(const at::Tensor&, int64_t, at::ArrayRef<double>)>();
  static auto step_op = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("torchkern::langevin_step", "")
                            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, double,
                                              std::optional<double>, std::optional<double>,
                                              std::optional<at::Generator>, const std::optional<at::Tensor>&)>();
  at::Tensor x = state;
  at::Tensor alive = at::ones({state.size(0)}, state.options().dtype(at::kBool));
  finite_steps.zero_();
  for (int64_t t = 0; t < n_steps; ++t) {
    const at::Tensor grad = score_op.call(x, kind, params).neg_();
    const std::optional<at::Tensor> eps = noise.has_value() ? std::optional<at::Tensor>(noise->select(0, t)) : std::nullopt;
    x = step_op.call(x, grad, step_size, noise_scale, lo, hi, generator, eps);
    alive.logical_and_(x.isfinite().all(1));
    finite_steps.add_(alive);
    if (kept && (t + 1) % thin == 0) traj.select(1, (t + 1) / thin - 1).copy_(x);
  }
  state.copy_(x);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> langevin_chain_cuda(
    const at::Tensor& x, int64_t kind, at::ArrayRef<double> params, double step_size, double noise_scale,
    std::optional<double> clamp_min, std::optional<double> clamp_max, int64_t n_steps, int64_t thin,
    bool return_trajectory, std::optional<at::Generator> generator, const std::optional<at::Tensor>& noise) {
  TORCHKERN_OP("langevin_chain");
  check_analytic_args(torchkern_op_name, x, kind, params);
  check_step_args(torchkern_op_name, step_size, noise_scale, clamp_min, clamp_max);
  check_chain_run(torchkern_op_name, x, n_steps, thin, noise);
  const int64_t batch = x.size(0), d = x.size(1);
  TORCHKERN_CHECK_CUDA(x);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const int64_t kept = return_trajectory ? n_steps / thin : 0;
  at::Tensor out = x.contiguous().clone();  // a fresh buffer, also when x is already contiguous
  at::Tensor traj = at::empty({batch, kept, d}, x.options());
  at::Tensor finite_steps = at::full({batch}, n_steps, x.options().dtype(at::kLong));
  if (out.numel() == 0 || n_steps == 0) return {out, traj, finite_steps};
  const bool by_steps = !is_elementwise(static_cast<int>(kind)) && d > 32 * 4 * kMaxRowChunks;
  if (by_steps) {
    chain_by_steps(out, traj, finite_steps, kind, params, step_size, noise_scale, clamp_min, clamp_max, n_steps,
                   thin, kept, generator, noise);
    return {out, traj, finite_steps};
  }
  const at::ScalarType opmath = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor nc = noise.has_value() ? noise->to(opmath).contiguous() : at::Tensor();
  const at::PhiloxCudaState philox =
      noise.has_value() ? at::PhiloxCudaState() : reserve_philox(generator, static_cast<uint64_t>(n_steps));
  TORCHKERN_DISPATCH_FLOATING(x.scalar_type(), "langevin_chain", [&] {
    using C = at::opmath_type<scalar_t>;
    ChainArgs<C> a;
    a.noise = nc.defined() ? nc.const_data_ptr<C>() : nullptr;
    a.finite_steps = finite_steps.mutable_data_ptr<int64_t>();
    a.batch = batch;
    a.d = static_cast<int>(d);
    a.n_steps = static_cast<int>(n_steps);
    a.thin = static_cast<int>(std::min<int64_t>(thin, std::numeric_limits<int>::max()));
    a.kept = static_cast<int>(kept);
    a.clamp = clamp_min.has_value() || clamp_max.has_value();
    a.p = EnergyParams<C>{static_cast<C>(params[0]), static_cast<C>(params[1]), static_cast<C>(params[2])};
    a.s = make_step_params<C>(step_size, noise_scale, clamp_min, clamp_max);
    // The input is read from `out` (a copy): the kernels read each element before writing it.
    const scalar_t* xin = out.const_data_ptr<scalar_t>();
    scalar_t* xout = out.mutable_data_ptr<scalar_t>();
    scalar_t* tp = kept ? traj.mutable_data_ptr<scalar_t>() : nullptr;
    switch (static_cast<int>(kind)) {
      case kDoubleWell: launch_elementwise<kDoubleWell, scalar_t>(xin, xout, tp, a, philox); break;
      case kHarmonic: launch_elementwise<kHarmonic, scalar_t>(xin, xout, tp, a, philox); break;
      case kRastrigin: launch_elementwise<kRastrigin, scalar_t>(xin, xout, tp, a, philox); break;
      default: {
        const int64_t need = (d + 127) / 128;
        const int chunks = need <= 1 ? 1 : need <= 2 ? 2 : need <= 4 ? 4 : kMaxRowChunks;
        chain::launch_rows<scalar_t>(static_cast<int>(kind), chunks, xin, xout, tp, a, philox);
      }
    }
  });
  return {out, traj, finite_steps};
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) { m.impl("langevin_chain", &torchkern::langevin_chain_cuda); }
