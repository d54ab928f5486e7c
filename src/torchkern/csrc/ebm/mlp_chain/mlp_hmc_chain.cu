// mlp_hmc_chain_: Hamiltonian Monte Carlo on an MLP energy in ONE launch (mlp_chain.cuh), x updated in place (from
// `start`'s states where given).
// Trajectory t: momenta from Philox draw 2t (the langevin_step layout), n_leapfrog + 1 gradient evaluations
// (half kick, drifts and kicks, half kick), the acceptance uniform from draw 2t + 1 (group = row).
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "../chain_checks.h"
#include "mlp_host.h"
#include "torchkern/philox.cuh"

namespace torchkern {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> mlp_hmc_chain_cuda(
    at::Tensor& x, at::TensorList weights, at::TensorList biases, int64_t activation, double negative_slope,
    double step_size, int64_t n_leapfrog, int64_t n_steps, int64_t thin, bool return_trajectory, bool return_energy,
    bool return_acceptance, int64_t precision, at::IntArrayRef layout, std::optional<at::Generator> generator,
    const std::optional<at::Tensor>& noise, const std::optional<at::Tensor>& uniform,
    const std::optional<at::Tensor>& start) {
  TORCHKERN_OP("mlp_hmc_chain_");
  mlp::check_mlp(torchkern_op_name, x, weights, biases, activation, precision);
  check_hmc_run(torchkern_op_name, x, step_size, n_leapfrog, n_steps, thin, noise, uniform);
  check_start(torchkern_op_name, x, start);
  const int64_t batch = x.size(0), d = x.size(1), kept = n_steps / thin;
  TORCHKERN_CHECK_CUDA(x);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  at::Tensor traj = at::empty({batch, return_trajectory ? kept : 0, d}, x.options().dtype(at::kFloat));
  at::Tensor energy = at::empty({batch, return_energy ? kept : 0}, x.options().dtype(at::kFloat));
  at::Tensor accepted = at::zeros({batch, return_acceptance ? n_steps : 0}, x.options().dtype(at::kBool));
  if (start.has_value()) x.copy_(*start);  // the kernel restores rejected proposals from x: the chains start there
  const bool runs = batch > 0 && n_steps > 0;
  at::Tensor count = runs ? at::empty({batch}, x.options().dtype(at::kLong))  // the kernel writes every row's
                          : at::zeros({batch}, x.options().dtype(at::kLong));
  at::Tensor finite_steps = runs ? at::empty({batch}, x.options().dtype(at::kLong))
                                 : at::zeros({batch}, x.options().dtype(at::kLong));
  if (runs) {
    at::Tensor work = mlp::float32_contiguous(x);
    const at::Tensor nz = noise.has_value() ? mlp::float32_contiguous(*noise) : at::Tensor();
    const at::Tensor un = uniform.has_value() ? mlp::float32_contiguous(*uniform) : at::Tensor();
    mlp::Params p = mlp::blank_params();
    p.mode = mlp::kHmc;
    p.traj = return_trajectory && kept ? traj.mutable_data_ptr<float>() : nullptr;
    p.energy = return_energy && kept ? energy.mutable_data_ptr<float>() : nullptr;
    p.accepted = return_acceptance ? accepted.mutable_data_ptr<bool>() : nullptr;
    p.accept_count = count.mutable_data_ptr<int64_t>();
    p.finite_steps = finite_steps.mutable_data_ptr<int64_t>();
    p.noise = nz.defined() ? nz.const_data_ptr<float>() : nullptr;
    p.uniform = un.defined() ? un.const_data_ptr<float>() : nullptr;
    p.step = static_cast<float>(step_size);
    p.n_leapfrog = static_cast<int>(n_leapfrog);
    p.n_steps = static_cast<int>(n_steps);
    p.thin = static_cast<int>(std::min<int64_t>(thin, 1 << 30));
    p.kept = static_cast<int>(kept);
    p.use_philox = !(noise.has_value() && uniform.has_value());
    const at::PhiloxCudaState philox =
        p.use_philox ? reserve_philox(generator, 2 * static_cast<uint64_t>(n_steps)) : at::PhiloxCudaState();
    mlp::run(torchkern_op_name, p, work, work, weights, biases, activation, negative_slope, precision, layout,
             philox);
    if (!work.is_same(x)) x.copy_(work);
  }
  return {mlp::as_dtype(traj, x.scalar_type()), mlp::as_dtype(energy, x.scalar_type()), accepted, count,
          finite_steps};
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) { m.impl("mlp_hmc_chain_", &torchkern::mlp_hmc_chain_cuda); }
