// The ebm family's host side: for the analytic and Gaussian energies, the Langevin step and chain and the analytic
// HMC chain, the argument checks (the words of ebm/twins.py), the device guard, allocation, the Philox counters and
// the launchers of the .cu files (launchers.h); the MLP ops' host side is mlp_chain/mlp_ops_host.h, compiled here:
// one host translation unit per family, since torch's headers are most of a host file's compile time. And the
// registration of every ebm op for CUDA tensors.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "host_checks.h"
#include "launchers.h"
#include "mlp_chain/mlp_ops.h"
#include "mlp_chain/mlp_ops_host.h"
#include "torchkern/checks.h"
#include "torchkern/dispatch.h"
#include "torchkern/launch.h"
#include "torchkern/philox.h"

namespace torchkern {
namespace {

// The compute type's dtype of a float tensor: float64 for float64, float32 otherwise (at::opmath_type).
at::ScalarType opmath_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void copy_params(double (&out)[kEnergyParams], at::ArrayRef<double> params) {
  std::copy(params.begin(), params.end(), out);
}

// --------------------------------------------------------------------------------------------- analytic energies

std::tuple<at::Tensor, at::Tensor> analytic_cuda(const char* torchkern_op_name, const at::Tensor& x, int64_t kind,
                                                 at::ArrayRef<double> params, bool energy_out, bool score_out) {
  check_analytic_args(torchkern_op_name, x, kind, params);
  TORCHKERN_CHECK_CUDA(x);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const int64_t batch = x.size(0), d = x.size(1);
  at::Tensor energy = at::empty({energy_out ? batch : 0}, x.options());
  at::Tensor score = at::empty({score_out ? batch : 0, d}, x.options());
  if (batch == 0 || d == 0) return {energy, score};
  AnalyticParams p{};
  p.x = xc.const_data_ptr();
  p.energy = energy_out ? energy.mutable_data_ptr() : nullptr;
  p.score = score_out ? score.mutable_data_ptr() : nullptr;
  p.batch = batch;
  p.d = static_cast<int>(d);
  p.kind = static_cast<int>(kind);
  copy_params(p.params, params);
  p.dtype = to_dtype(x.scalar_type());
  C10_CUDA_CHECK(analytic_launch(p, current_stream()));
  return {energy, score};
}

at::Tensor analytic_energy_cuda(const at::Tensor& x, int64_t kind, at::ArrayRef<double> params) {
  return std::get<0>(analytic_cuda("torchkern.analytic_energy", x, kind, params, true, false));
}

at::Tensor analytic_score_cuda(const at::Tensor& x, int64_t kind, at::ArrayRef<double> params) {
  return std::get<1>(analytic_cuda("torchkern.analytic_score", x, kind, params, false, true));
}

std::tuple<at::Tensor, at::Tensor> analytic_energy_and_score_cuda(const at::Tensor& x, int64_t kind,
                                                                  at::ArrayRef<double> params) {
  return analytic_cuda("torchkern.analytic_energy_and_score", x, kind, params, true, true);
}

// ------------------------------------------------------------------------------------------------------ Gaussian

std::tuple<at::Tensor, at::Tensor> gaussian_cuda(const char* torchkern_op_name, const at::Tensor& x,
                                                 const at::Tensor& mean, const at::Tensor& precision) {
  TORCHKERN_CHECK_FLOAT(x);
  TORCHKERN_CHECK_FLOAT(mean);
  TORCHKERN_CHECK_SAME_DTYPE(x, mean);
  TORCHKERN_CHECK_SAME_DEVICE(x, mean);
  TORCHKERN_CHECK_FLOAT(precision);
  TORCHKERN_CHECK_SAME_DTYPE(x, precision);
  TORCHKERN_CHECK_SAME_DEVICE(x, precision);
  TORCHKERN_CHECK_DIM(x, 2, "[B, d]");
  const int64_t batch = x.size(0), d = x.size(1);
  TORCHKERN_CHECK(mean.dim() == 1 && mean.size(0) == d, "mean must have shape [d] with d = ", d, " like x, got ",
                  mean.sizes());
  TORCHKERN_CHECK(precision.dim() == 2 && precision.size(0) == d && precision.size(1) == d,
                  "precision must have shape [d, d] with d = ", d, " like x, got ", precision.sizes());
  TORCHKERN_CHECK_CUDA(x);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), mc = mean.contiguous(), pc = precision.contiguous();
  at::Tensor energy = at::empty({batch}, x.options());
  if (batch == 0) return {energy, at::empty({0, d}, x.options())};
  GaussianParams p{};
  p.x = xc.const_data_ptr();
  p.mean = mc.const_data_ptr();
  p.precision = pc.const_data_ptr();
  p.energy = energy.mutable_data_ptr();
  p.batch = batch;
  p.d = static_cast<int>(d);
  p.dtype = to_dtype(x.scalar_type());
  if (gaussian_fused(p.d, p.dtype)) {
    at::Tensor score = at::empty({batch, d}, x.options());
    p.score = score.mutable_data_ptr();
    C10_CUDA_CHECK(gaussian_launch(p, current_stream()));
    return {energy, score};
  }
  // score = mu P - x P (P symmetric): one GEMM with a bias row, then the energy from it.
  at::Tensor score = at::addmm(at::matmul(mc, pc).unsqueeze(0), xc, pc, /*beta=*/1, /*alpha=*/-1).contiguous();
  p.score = score.mutable_data_ptr();
  C10_CUDA_CHECK(gaussian_energy_launch(p, current_stream()));
  return {energy, score};
}

at::Tensor gaussian_energy_cuda(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& precision) {
  return std::get<0>(gaussian_cuda("torchkern.gaussian_energy", x, mean, precision));
}

at::Tensor gaussian_score_cuda(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& precision) {
  return std::get<1>(gaussian_cuda("torchkern.gaussian_score", x, mean, precision));
}

std::tuple<at::Tensor, at::Tensor> gaussian_energy_and_score_cuda(const at::Tensor& x, const at::Tensor& mean,
                                                                  const at::Tensor& precision) {
  return gaussian_cuda("torchkern.gaussian_energy_and_score", x, mean, precision);
}

// ------------------------------------------------------------------------------------------------ Langevin step

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
  const at::Tensor nc = noise.has_value() ? noise->to(opmath_dtype(xc)).contiguous() : at::Tensor();
  LangevinStepParams p{};
  p.out = out.mutable_data_ptr();
  p.x = xc.const_data_ptr();
  p.grad = gc.const_data_ptr();
  p.noise = nc.defined() ? nc.const_data_ptr() : nullptr;
  p.n = n;
  p.step = make_step_args(step_size, noise_scale, lo, hi);
  p.philox = noise.has_value() ? PhiloxState() : reserve_philox(generator, 1);
  p.dtype = to_dtype(xc.scalar_type());
  C10_CUDA_CHECK(langevin_step_launch(p, current_stream()));
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

// ----------------------------------------------------------------------------------------------- Langevin chain

// Rows too long for one warp's registers: score op + in-place step op per step, reserving the
// same Philox offsets the fused kernel would, so the noise is the same.
void chain_by_steps(at::Tensor& state, at::Tensor& traj, at::Tensor& finite_steps, int64_t kind,
                    at::ArrayRef<double> params, double step_size, double noise_scale, std::optional<double> lo,
                    std::optional<double> hi, int64_t n_steps, int64_t thin, int64_t kept,
                    const std::optional<at::Generator>& generator, const std::optional<at::Tensor>& noise) {
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
    const std::optional<at::Tensor> eps =
        noise.has_value() ? std::optional<at::Tensor>(noise->select(0, t)) : std::nullopt;
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
  if (!is_elementwise(static_cast<int>(kind)) && d > kLangevinChainMaxRowD) {
    chain_by_steps(out, traj, finite_steps, kind, params, step_size, noise_scale, clamp_min, clamp_max, n_steps,
                   thin, kept, generator, noise);
    return {out, traj, finite_steps};
  }
  const at::Tensor nc = noise.has_value() ? noise->to(opmath_dtype(x)).contiguous() : at::Tensor();
  LangevinChainParams p{};
  p.x = out.mutable_data_ptr();
  p.traj = kept ? traj.mutable_data_ptr() : nullptr;
  p.noise = nc.defined() ? nc.const_data_ptr() : nullptr;
  p.finite_steps = finite_steps.mutable_data_ptr<int64_t>();
  p.batch = batch;
  p.d = static_cast<int>(d);
  p.kind = static_cast<int>(kind);
  copy_params(p.params, params);
  p.n_steps = static_cast<int>(n_steps);
  p.thin = static_cast<int>(std::min<int64_t>(thin, std::numeric_limits<int>::max()));
  p.kept = static_cast<int>(kept);
  p.step = make_step_args(step_size, noise_scale, clamp_min, clamp_max);
  p.philox = noise.has_value() ? PhiloxState() : reserve_philox(generator, static_cast<uint64_t>(n_steps));
  p.dtype = to_dtype(x.scalar_type());
  C10_CUDA_CHECK(langevin_chain_launch(p, current_stream()));
  return {out, traj, finite_steps};
}

// ---------------------------------------------------------------------------------------------------- HMC chain

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> hmc_chain_cuda(
    at::Tensor& x, int64_t kind, at::ArrayRef<double> params, double step_size, int64_t n_leapfrog, int64_t n_steps,
    int64_t thin, bool return_trajectory, bool return_energy, bool return_acceptance,
    std::optional<at::Generator> generator, const std::optional<at::Tensor>& noise,
    const std::optional<at::Tensor>& uniform) {
  TORCHKERN_OP("hmc_chain_");
  check_analytic_args(torchkern_op_name, x, kind, params);
  check_hmc_run(torchkern_op_name, x, step_size, n_leapfrog, n_steps, thin, noise, uniform);
  const int64_t batch = x.size(0), d = x.size(1), kept = n_steps / thin;
  TORCHKERN_CHECK(d <= kHmcChainMaxD, "x must have at most ", kHmcChainMaxD,
                  " columns for the fused HMC kernel (HamiltonianMonteCarlo samples wider rows by its generic path), "
                  "got ", x.sizes());
  TORCHKERN_CHECK_CUDA(x);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const at::ScalarType ct = opmath_dtype(x);  // float16/bfloat16 states run in float32
  at::Tensor traj = at::empty({batch, return_trajectory ? kept : 0, d}, x.options().dtype(ct));
  at::Tensor energy = at::empty({batch, return_energy ? kept : 0}, x.options().dtype(ct));
  at::Tensor accepted = at::zeros({batch, return_acceptance ? n_steps : 0}, x.options().dtype(at::kBool));
  at::Tensor count = at::zeros({batch}, x.options().dtype(at::kLong));
  at::Tensor finite = at::zeros({batch}, x.options().dtype(at::kLong));  // the kernel writes every row
  if (batch > 0 && n_steps > 0) {
    at::Tensor work = x.scalar_type() == ct && x.is_contiguous() ? x : x.to(ct).contiguous();
    const at::Tensor nz = noise.has_value() ? noise->to(ct).contiguous() : at::Tensor();
    const at::Tensor un = uniform.has_value() ? uniform->to(ct).contiguous() : at::Tensor();
    HmcChainParams p{};
    p.x = work.mutable_data_ptr();
    p.traj = return_trajectory && kept ? traj.mutable_data_ptr() : nullptr;
    p.energy = return_energy && kept ? energy.mutable_data_ptr() : nullptr;
    p.accepted = return_acceptance ? accepted.mutable_data_ptr<bool>() : nullptr;
    p.accept_count = count.mutable_data_ptr<int64_t>();
    p.finite_steps = finite.mutable_data_ptr<int64_t>();
    p.noise = nz.defined() ? nz.const_data_ptr() : nullptr;
    p.uniform = un.defined() ? un.const_data_ptr() : nullptr;
    p.batch = batch;
    p.d = static_cast<int>(d);
    p.kind = static_cast<int>(kind);
    copy_params(p.params, params);
    p.step = step_size;
    p.n_leapfrog = static_cast<int>(n_leapfrog);
    p.n_steps = static_cast<int>(n_steps);
    p.thin = static_cast<int>(std::min<int64_t>(thin, 1 << 30));
    p.kept = static_cast<int>(kept);
    const bool use_philox = !(noise.has_value() && uniform.has_value());
    p.philox = use_philox ? reserve_philox(generator, 2 * static_cast<uint64_t>(n_steps)) : PhiloxState();
    p.dtype = to_dtype(ct);
    C10_CUDA_CHECK(hmc_chain_launch(p, current_stream()));
    if (!work.is_same(x)) x.copy_(work);
  }
  return {traj.to(x.scalar_type()), energy.to(x.scalar_type()), accepted, count, finite};
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) {
  m.impl("analytic_energy", &torchkern::analytic_energy_cuda);
  m.impl("analytic_score", &torchkern::analytic_score_cuda);
  m.impl("analytic_energy_and_score", &torchkern::analytic_energy_and_score_cuda);
  m.impl("gaussian_energy", &torchkern::gaussian_energy_cuda);
  m.impl("gaussian_score", &torchkern::gaussian_score_cuda);
  m.impl("gaussian_energy_and_score", &torchkern::gaussian_energy_and_score_cuda);
  m.impl("langevin_step", &torchkern::langevin_step_cuda);
  m.impl("langevin_step_", &torchkern::langevin_step_inplace_cuda);
  m.impl("langevin_chain", &torchkern::langevin_chain_cuda);
  m.impl("hmc_chain_", &torchkern::hmc_chain_cuda);
  m.impl("mlp_energy_and_score", &torchkern::mlp_energy_and_score_cuda);
  m.impl("mlp_langevin_chain_", &torchkern::mlp_langevin_chain_cuda);
  m.impl("mlp_hmc_chain_", &torchkern::mlp_hmc_chain_cuda);
}
