// Host checks that several of the family's ops share (ops.cpp, mlp_chain/mlp_ops_host.h), in the words of
// ebm/twins.py: an analytic energy's arguments, the Langevin step's, the run arguments of every chain op
// (langevin_chain, hmc_chain_, mlp_langevin_chain_, mlp_hmc_chain_), HMC's, and the MLP chains' `start`; and the
// Langevin step's StepArgs, here rather than in launchers.h, which the kernel units include (<optional>).
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "launchers.h"
#include "torchkern/checks.h"

namespace torchkern {

inline StepArgs make_step_args(double step, double sigma, std::optional<double> lo, std::optional<double> hi) {
  return StepArgs{step, sigma * std::sqrt(2.0 * step), lo.value_or(-INFINITY), hi.value_or(INFINITY),
                  lo.has_value() || hi.has_value()};
}

inline void check_analytic_args(const char* torchkern_op_name, const at::Tensor& x, int64_t kind,
                                at::ArrayRef<double> params) {
  TORCHKERN_CHECK_FLOAT(x);
  TORCHKERN_CHECK_DIM(x, 2, "[B, d]");
  TORCHKERN_CHECK(kind >= 0 && kind < kNumKinds, "kind must be in [0, ", static_cast<int>(kNumKinds), "), got ", kind);
  TORCHKERN_CHECK(params.size() == kEnergyParams, "params must hold ", kEnergyParams, " numbers, got ", params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    TORCHKERN_CHECK(std::isfinite(params[i]), "params[", i, "] must be a finite number, got ", params[i]);
  }
  static const char* names[] = {"double_well", "harmonic", "rastrigin", "rosenbrock", "ackley"};  // KIND_NAMES
  static_assert(sizeof(names) / sizeof(names[0]) == kNumKinds, "one name per kind (ebm/constants.py)");
  const int64_t min_d = kind == kRosenbrock ? 2 : 1;
  TORCHKERN_CHECK(x.size(1) >= min_d, "x must have at least ", min_d, " columns for ", names[kind], ", got ",
                  x.sizes());
}

inline void check_step_args(const char* torchkern_op_name, double step, double sigma, std::optional<double> lo,
                            std::optional<double> hi) {
  TORCHKERN_CHECK(step > 0 && std::isfinite(step), "step_size must be a finite number > 0, got ", step);
  TORCHKERN_CHECK(sigma >= 0 && std::isfinite(sigma), "noise_scale must be a finite number >= 0, got ", sigma);
  if (lo.has_value() && hi.has_value()) {
    TORCHKERN_CHECK(*lo <= *hi, "clamp must satisfy min <= max, got (", *lo, ", ", *hi, ")");
  }
}

// `uniform` is HMC's injected acceptance draws; the Langevin ops have none.
inline void check_chain_run(const char* torchkern_op_name, const at::Tensor& x, int64_t n_steps, int64_t thin,
                            const std::optional<at::Tensor>& injected_noise,
                            const std::optional<at::Tensor>& injected_uniform = std::nullopt) {
  TORCHKERN_CHECK(n_steps >= 0 && n_steps <= TORCHKERN_MAX_STEPS, "n_steps must be in [0, ", TORCHKERN_MAX_STEPS,
                  "], got ", n_steps);
  TORCHKERN_CHECK(thin >= 1, "thin must be >= 1, got ", thin);
  const int64_t batch = x.size(0), d = x.size(1);
  if (injected_noise.has_value()) {
    const at::Tensor& noise = *injected_noise;  // named so that TORCHKERN_CHECK_FLOAT's message says "noise"
    TORCHKERN_CHECK_FLOAT(noise);
    TORCHKERN_CHECK(noise.device() == x.device(), "noise must be on ", x.device().str(), " like x, got ",
                    noise.device().str());
    TORCHKERN_CHECK(noise.dim() == 3 && noise.size(0) == n_steps && noise.size(1) == batch && noise.size(2) == d,
                    "noise must have shape [", n_steps, ", ", batch, ", ", d, "] ([n_steps, B, d]), got ",
                    noise.sizes());
  }
  if (injected_uniform.has_value()) {
    const at::Tensor& uniform = *injected_uniform;
    TORCHKERN_CHECK_FLOAT(uniform);
    TORCHKERN_CHECK(uniform.device() == x.device(), "uniform must be on ", x.device().str(), " like x, got ",
                    uniform.device().str());
    TORCHKERN_CHECK(uniform.dim() == 2 && uniform.size(0) == n_steps && uniform.size(1) == batch,
                    "uniform must have shape [", n_steps, ", ", batch, "] ([n_steps, B]), got ", uniform.sizes());
  }
}

// The HMC ops (hmc_chain_, mlp_hmc_chain_): twins.check_hmc.
inline void check_hmc_run(const char* torchkern_op_name, const at::Tensor& x, double step_size, int64_t n_leapfrog,
                          int64_t n_steps, int64_t thin, const std::optional<at::Tensor>& injected_noise,
                          const std::optional<at::Tensor>& injected_uniform) {
  TORCHKERN_CHECK(step_size > 0 && std::isfinite(step_size), "step_size must be a finite number > 0, got ", step_size);
  TORCHKERN_CHECK(n_leapfrog >= 1 && n_leapfrog <= TORCHKERN_MAX_LEAPFROG, "n_leapfrog must be in [1, ",
                  TORCHKERN_MAX_LEAPFROG, "], got ", n_leapfrog);
  check_chain_run(torchkern_op_name, x, n_steps, thin, injected_noise, injected_uniform);
}

// The MLP chains' `start`: the chains' starting states, read instead of x's (x is then only written, so a caller
// keeping its states needs no copy of them). Like x (dtype, device, shape); x itself or apart from x's memory.
inline void check_start(const char* torchkern_op_name, const at::Tensor& x,
                        const std::optional<at::Tensor>& starting_states) {
  if (!starting_states.has_value()) return;
  const at::Tensor& start = *starting_states;  // named so that the messages say "start"
  TORCHKERN_CHECK_SAME_DTYPE(x, start);
  TORCHKERN_CHECK_SAME_DEVICE(x, start);
  TORCHKERN_CHECK_SAME_SHAPE(x, start);
  const bool same = start.storage_offset() == x.storage_offset() && start.strides() == x.strides();
  TORCHKERN_CHECK(same || !start.is_alias_of(x), "start must be x itself or not share x's memory");
}

}  // namespace torchkern
