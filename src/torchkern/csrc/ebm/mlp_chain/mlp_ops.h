// The fused MLP-energy ops' host functions (mlp_ops_host.h), for ../ops.cpp's registration.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace torchkern {

std::tuple<at::Tensor, at::Tensor> mlp_energy_and_score_cuda(const at::Tensor& x, at::TensorList weights,
                                                             at::TensorList biases, int64_t activation,
                                                             double negative_slope, int64_t precision,
                                                             at::IntArrayRef layout);

std::tuple<at::Tensor, at::Tensor, at::Tensor> mlp_langevin_chain_cuda(
    at::Tensor& x, at::TensorList weights, at::TensorList biases, int64_t activation, double negative_slope,
    double step_size, double noise_scale, std::optional<double> clamp_min, std::optional<double> clamp_max,
    int64_t n_steps, int64_t thin, bool return_trajectory, bool return_energy, double restart_fraction,
    std::optional<double> restart_low, std::optional<double> restart_high, int64_t precision, at::IntArrayRef layout,
    std::optional<at::Generator> generator, const std::optional<at::Tensor>& noise,
    const std::optional<at::Tensor>& start);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> mlp_hmc_chain_cuda(
    at::Tensor& x, at::TensorList weights, at::TensorList biases, int64_t activation, double negative_slope,
    double step_size, int64_t n_leapfrog, int64_t n_steps, int64_t thin, bool return_trajectory, bool return_energy,
    bool return_acceptance, int64_t precision, at::IntArrayRef layout, std::optional<at::Generator> generator,
    const std::optional<at::Tensor>& noise, const std::optional<at::Tensor>& uniform,
    const std::optional<at::Tensor>& start);

}  // namespace torchkern
