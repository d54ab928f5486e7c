// mlp_langevin_chain_: Langevin chains on an MLP energy in ONE launch (mlp_chain.cuh), x updated in place (from
// `start`'s states where given).
// Before the first step, each row is redrawn with probability restart_fraction (replay-buffer restarts),
// from U(restart_low, restart_high) or N(0, I). Philox draws: t for step t's noise (the langevin_step
// counters), n_steps and n_steps + 1 for the restarts.
#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "../chain_checks.h"
#include "../energies.cuh"
#include "mlp_host.h"
#include "torchkern/philox.cuh"

namespace torchkern {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> mlp_langevin_chain_cuda(
    at::Tensor& x, at::TensorList weights, at::TensorList biases, int64_t activation, double negative_slope,
    double step_size, double noise_scale, std::optional<double> clamp_min, std::optional<double> clamp_max,
    int64_t n_steps, int64_t thin, bool return_trajectory, bool return_energy, double restart_fraction,
    std::optional<double> restart_low, std::optional<double> restart_high, int64_t precision, at::IntArrayRef layout,
    std::optional<at::Generator> generator, const std::optional<at::Tensor>& noise,
    const std::optional<at::Tensor>& start) {
  TORCHKERN_OP("mlp_langevin_chain_");
  mlp::check_mlp(torchkern_op_name, x, weights, biases, activation, precision);
  check_step_args(torchkern_op_name, step_size, noise_scale, clamp_min, clamp_max);
  check_chain_run(torchkern_op_name, x, n_steps, thin, noise);
  check_start(torchkern_op_name, x, start);
  TORCHKERN_CHECK(restart_fraction >= 0 && restart_fraction <= 1, "restart_fraction must be in [0, 1], got ",
                  restart_fraction);
  TORCHKERN_CHECK(restart_low.has_value() == restart_high.has_value(),
                  "restart_low and restart_high must be given together, got (",
                  restart_low.has_value() ? detail::message(*restart_low) : "None", ", ",
                  restart_high.has_value() ? detail::message(*restart_high) : "None", ")");
  if (restart_low.has_value()) {
    TORCHKERN_CHECK(std::isfinite(*restart_low) && std::isfinite(*restart_high) && *restart_low <= *restart_high,
                    "restart range must be finite with low <= high, got (", *restart_low, ", ", *restart_high, ")");
  }
  TORCHKERN_CHECK_CUDA(x);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const int64_t batch = x.size(0), d = x.size(1), kept = n_steps / thin;
  at::Tensor traj = at::empty({batch, return_trajectory ? kept : 0, d}, x.options().dtype(at::kFloat));
  at::Tensor energy = at::empty({batch, return_energy ? kept : 0}, x.options().dtype(at::kFloat));
  at::Tensor finite_steps = at::full({batch}, n_steps, x.options().dtype(at::kLong));
  const bool restart = restart_fraction > 0;
  if (batch > 0 && (n_steps > 0 || restart)) {
    at::Tensor work = mlp::float32_contiguous(x);
    const at::Tensor from = start.has_value() ? mlp::float32_contiguous(*start) : work;
    const at::Tensor nz = noise.has_value() ? mlp::float32_contiguous(*noise) : at::Tensor();
    mlp::Params p = mlp::blank_params();
    p.mode = mlp::kLangevin;
    p.traj = return_trajectory && kept ? traj.mutable_data_ptr<float>() : nullptr;
    p.energy = return_energy && kept ? energy.mutable_data_ptr<float>() : nullptr;
    p.noise = nz.defined() ? nz.const_data_ptr<float>() : nullptr;
    p.finite_steps = finite_steps.mutable_data_ptr<int64_t>();
    const StepParams<float> s = make_step_params<float>(step_size, noise_scale, clamp_min, clamp_max);
    p.step = s.step, p.noise_coef = s.noise_coef, p.lo = s.lo, p.hi = s.hi;
    p.clamp = clamp_min.has_value() || clamp_max.has_value();
    p.restart_fraction = static_cast<float>(restart_fraction);
    p.restart_uniform = restart_low.has_value();
    p.restart_lo = static_cast<float>(restart_low.value_or(0.0));
    p.restart_hi = static_cast<float>(restart_high.value_or(0.0));
    p.n_steps = static_cast<int>(n_steps);
    p.thin = static_cast<int>(std::min<int64_t>(thin, 1 << 30));
    p.kept = static_cast<int>(kept);
    // Draws: one per step (none with injected noise), plus two for the restarts.
    const int64_t draws = restart ? n_steps + 2 : (noise.has_value() ? 0 : n_steps);
    p.use_philox = draws > 0;
    const at::PhiloxCudaState philox =
        draws > 0 ? reserve_philox(generator, static_cast<uint64_t>(draws)) : at::PhiloxCudaState();
    mlp::run(torchkern_op_name, p, work, from, weights, biases, activation, negative_slope, precision, layout,
             philox);
    if (!work.is_same(x)) x.copy_(work);
  } else if (start.has_value()) {
    x.copy_(*start);
  }
  return {mlp::as_dtype(traj, x.scalar_type()), mlp::as_dtype(energy, x.scalar_type()), finite_steps};
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) { m.impl("mlp_langevin_chain_", &torchkern::mlp_langevin_chain_cuda); }
