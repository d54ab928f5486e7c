// The host side of the fused MLP-energy ops (mlp_energy_and_score, mlp_langevin_chain_, mlp_hmc_chain_; registered
// by ../ops.cpp): argument checks (the words of ebm/twins.py), the planner's layout checked against the device,
// the weights packed into the kernel's padded layout, the Philox counters, and the launchers of mlp_chain.h.
//
// mlp_langevin_chain_ updates x in place (from `start`'s states where given). Before the first step each row is
// redrawn with probability restart_fraction (replay-buffer restarts), from U(restart_low, restart_high) or
// N(0, I). Philox draws: t for step t's noise (the langevin_step counters), n_steps and n_steps + 1 for the
// restarts. mlp_hmc_chain_: trajectory t draws its momenta at 2t (the langevin_step layout) and its acceptance
// uniform at 2t + 1 (group = row); n_leapfrog + 1 gradient evaluations (half kick, drifts and kicks, half kick).
// Part of ebm's one host translation unit (../ops.cpp includes it): torch's headers are parsed once.
#pragma once

#include "mlp_ops.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../host_checks.h"
#include "../launchers.h"
#include "mlp_chain.h"
#include "torchkern/checks.h"
#include "torchkern/launch.h"
#include "torchkern/philox.h"

namespace torchkern {
namespace mlp {
namespace {

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

void check_mlp(const char* torchkern_op_name, const at::Tensor& x, at::TensorList weights,
               at::TensorList biases, int64_t activation, int64_t precision) {
  TORCHKERN_CHECK_FLOAT(x);
  TORCHKERN_CHECK_DIM(x, 2, "[B, d]");
  const int64_t n = static_cast<int64_t>(weights.size());
  TORCHKERN_CHECK(n >= 2 && n <= kMaxHidden + 1, "weights must hold 2 to ", kMaxHidden + 1,
                  " matrices (hidden layers and the output layer), got ", n);
  TORCHKERN_CHECK(static_cast<int64_t>(biases.size()) == n, "biases must hold one vector per weight (", n, "), got ",
                  biases.size());
  int64_t width = x.size(1);
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& w = weights[i];
    const at::Tensor& b = biases[i];
    const bool last = i == n - 1;
    // the names "weights[i]" / "biases[i]" are spelled in each message: TORCH_CHECK builds a message only on failure
    TORCHKERN_CHECK(is_supported_float(w.scalar_type()), "weights[", i, "] must be float32, float64, float16 or "
                    "bfloat16, got ", w.scalar_type());
    TORCHKERN_CHECK(w.device() == x.device(), "weights[", i, "] must be on ", x.device().str(), " like x, got ",
                    w.device().str());
    TORCHKERN_CHECK(w.dim() == 2 && w.size(1) == width && w.size(0) >= 1 && (!last || w.size(0) == 1), "weights[", i,
                    "] must have shape [", last ? "1" : "n", ", ", width, "], got ", w.sizes());
    TORCHKERN_CHECK(is_supported_float(b.scalar_type()), "biases[", i, "] must be float32, float64, float16 or "
                    "bfloat16, got ", b.scalar_type());
    TORCHKERN_CHECK(b.device() == x.device(), "biases[", i, "] must be on ", x.device().str(), " like x, got ",
                    b.device().str());
    TORCHKERN_CHECK(b.dim() == 1 && b.size(0) == w.size(0), "biases[", i, "] must have shape [", w.size(0),
                    "] like weights[", i, "]'s rows, got ", b.sizes());
    width = w.size(0);
  }
  TORCHKERN_CHECK(activation >= 0 && activation < kActivations, "activation must be in [0, ",
                  static_cast<int>(kActivations), "), got ", activation);
  TORCHKERN_CHECK(precision >= 0 && precision < 3, "precision must be in [0, 3), got ", precision);
}

// The planner's layout [rows, resident, byte offsets in Slot order] (ebm/mlp.py), checked against this device.
void apply_layout(const char* torchkern_op_name, Params& p, at::IntArrayRef layout) {
  TORCHKERN_CHECK(static_cast<int>(layout.size()) == kSlots + 2, "layout must hold ", kSlots + 2,
                  " numbers from torchkern.ebm.mlp.plan(), got ", layout.size());
  TORCHKERN_CHECK(layout[0] == 16 || layout[0] == 32, "layout[0] (rows per block) must be 16 or 32, got ", layout[0]);
  p.rows = static_cast<int>(layout[0]);
  TORCHKERN_CHECK(layout[1] >= 0 && layout[1] <= 2, "layout[1] (0 streamed, 1 resident, 2 warpgroup products) must be "
                  "0, 1 or 2, got ", layout[1]);
  p.resident = layout[1] != 0;
  p.wgmma = layout[1] == 2;
  TORCHKERN_CHECK(!p.wgmma || p.rows == 32, "layout[1] = 2 (warpgroup products) needs 32 rows per block, got ",
                  p.rows);
  TORCHKERN_CHECK(!p.wgmma || compute_capability() == 90, "layout[1] = 2 (warpgroup products) needs an sm_90 device, "
                  "got sm_", compute_capability());
  for (int s = 0; s < kSlots; ++s) {
    const int64_t off = layout[2 + s];
    TORCHKERN_CHECK(off % 128 == 0 && off >= (s ? layout[1 + s] : 0),
                    "layout offsets must ascend in multiples of 128 bytes, got ", off, " for slot ", s);
    p.smem[s] = static_cast<int>(off);
  }
  const int64_t optin = static_cast<int64_t>(smem_optin_bytes());
  TORCHKERN_CHECK(layout[1 + kSlots] <= optin, "layout needs ", layout[1 + kSlots],
                  " bytes of shared memory per block, the device allows ", optin);
}

// x as a float32 contiguous tensor: x itself when it is one (no dispatch: a no-op .to and .contiguous cost a
// microsecond each, and the op's host time is on every sampler call's path).
at::Tensor float32_contiguous(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat && x.is_contiguous() ? x : x.to(at::kFloat).contiguous();
}

// t in `dtype` (t itself when it has it, without a dispatch).
at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

// Packs the network into p's padded geometry (widths rounded up to kAlign, zeros in the padding; one launch,
// mlp_pack.cu) in one allocation: the hidden layers' weights as operands (bf16, else float32; resident as W_l,
// streamed as the stages' images, mlp_chain.h), then, 128-byte aligned, the biases, the output row and its bias
// as float32. p.resident is set (apply_layout).
at::Tensor pack(Params& p, const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                int64_t precision) {
  const int H = static_cast<int>(weights.size()) - 1;
  p.n_hidden = H;
  p.dims[0] = static_cast<int>(round_up(x.size(1), kAlign));
  int64_t woff = 0, voff = 0;
  for (int l = 0; l < H; ++l) {
    p.dims[l + 1] = static_cast<int>(round_up(weights[l].size(0), p.wgmma ? kWgAlign : kAlign));
    p.w_off[l] = woff;
    woff += p.resident ? static_cast<int64_t>(p.dims[l + 1]) * p.dims[l]
                       : 2 * stream_image_elems(p.dims[l], p.dims[l + 1], stream_row(precision == kBf16 ? 2 : 4));
    p.b_off[l] = static_cast<int>(voff);
    voff += p.dims[l + 1];
  }
  p.wlast_off = static_cast<int>(voff);
  p.blast_off = static_cast<int>(voff + p.dims[H]);
  PackSource s{};
  std::vector<at::Tensor> sources;  // the layers as float32 contiguous tensors (themselves where they are); alive
  sources.reserve(2 * (H + 1));     // until the launch is queued
  for (int l = 0; l <= H; ++l) {
    sources.push_back(float32_contiguous(weights[l]));
    sources.push_back(float32_contiguous(biases[l]));
    s.w[l] = sources[2 * l].const_data_ptr<float>();
    s.b[l] = sources[2 * l + 1].const_data_ptr<float>();
    s.out[l] = static_cast<int>(weights[l].size(0));
    s.in[l] = static_cast<int>(weights[l].size(1));
  }
  const int64_t operand_bytes = woff * (precision == kBf16 ? 2 : 4), v_elems = p.blast_off + kAlign;
  const int64_t vec_at = round_up(operand_bytes, 128);
  at::Tensor packed = at::empty({vec_at + v_elems * 4}, x.options().dtype(at::kByte));
  uint8_t* base = packed.mutable_data_ptr<uint8_t>();
  float* vecs = reinterpret_cast<float*>(base + vec_at);
  C10_CUDA_CHECK(launch_pack(p, s, base, vecs, woff, v_elems, static_cast<int>(precision), current_stream()));
  p.weights = base;
  p.vecs = vecs;
  return packed;
}

// Fills what every mode shares and launches; `work` is x as float32, contiguous (updated in place), `start` the
// starting states as float32, contiguous (work itself unless the op was given `start`).
void run(const char* torchkern_op_name, Params& p, const at::Tensor& work, const at::Tensor& start,
         at::TensorList weights, at::TensorList biases, int64_t activation, double negative_slope,
         int64_t precision, at::IntArrayRef layout, const PhiloxState& philox) {
  apply_layout(torchkern_op_name, p, layout);
  p.x = work.mutable_data_ptr<float>();
  p.x_start = start.const_data_ptr<float>();
  p.batch = work.size(0);
  p.d = static_cast<int>(work.size(1));
  p.activation = static_cast<int>(activation);
  p.slope = static_cast<float>(negative_slope);
  TORCHKERN_CHECK(!p.wgmma || precision == kBf16, "layout[1] = 2 (warpgroup products) needs precision bf16 (",
                  static_cast<int>(kBf16), "), got ", precision);
  const at::Tensor packed = pack(p, work, weights, biases, precision);  // kept alive until the launch is queued
  for (int l = 0; p.wgmma && l <= p.n_hidden; ++l) {  // a product's K is at most 64 steps of 16 (wg_issue)
    TORCHKERN_CHECK(p.dims[l] <= kWgMaxWidth, "layout[1] = 2 (warpgroup products) takes widths up to ", kWgMaxWidth,
                    ", got ", p.dims[l], " (padded) at layer ", l);
  }
  const cudaStream_t stream = current_stream();
  switch (precision) {
    case kBf16: C10_CUDA_CHECK(launch<kBf16>(p, philox, stream)); break;
    case kTf32: C10_CUDA_CHECK(launch<kTf32>(p, philox, stream)); break;
    default: C10_CUDA_CHECK(launch<kFp32>(p, philox, stream));
  }
}

Params blank_params() {
  Params p{};
  p.thin = 1;
  return p;
}

}  // namespace
}  // namespace mlp

std::tuple<at::Tensor, at::Tensor> mlp_energy_and_score_cuda(const at::Tensor& x, at::TensorList weights,
                                                             at::TensorList biases, int64_t activation,
                                                             double negative_slope, int64_t precision,
                                                             at::IntArrayRef layout) {
  TORCHKERN_OP("mlp_energy_and_score");
  mlp::check_mlp(torchkern_op_name, x, weights, biases, activation, precision);
  TORCHKERN_CHECK_CUDA(x);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const at::Tensor work = mlp::float32_contiguous(x);
  at::Tensor energy = at::empty({x.size(0)}, work.options());
  at::Tensor score = at::empty(x.sizes(), work.options());
  if (x.size(0) > 0) {
    mlp::Params p = mlp::blank_params();
    p.mode = mlp::kEval;
    p.energy = energy.mutable_data_ptr<float>();
    p.score = score.mutable_data_ptr<float>();
    mlp::run(torchkern_op_name, p, work, work, weights, biases, activation, negative_slope, precision, layout,
             PhiloxState());
  }
  return {mlp::as_dtype(energy, x.scalar_type()), mlp::as_dtype(score, x.scalar_type())};
}

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
    const StepArgs s = make_step_args(step_size, noise_scale, clamp_min, clamp_max);
    p.step = static_cast<float>(s.step), p.noise_coef = static_cast<float>(s.noise_coef);
    p.lo = static_cast<float>(s.lo), p.hi = static_cast<float>(s.hi);
    p.clamp = s.clamp;
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
    const PhiloxState philox = draws > 0 ? reserve_philox(generator, static_cast<uint64_t>(draws)) : PhiloxState();
    mlp::run(torchkern_op_name, p, work, from, weights, biases, activation, negative_slope, precision, layout,
             philox);
    if (!work.is_same(x)) x.copy_(work);
  } else if (start.has_value()) {
    x.copy_(*start);
  }
  return {mlp::as_dtype(traj, x.scalar_type()), mlp::as_dtype(energy, x.scalar_type()), finite_steps};
}

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
    const PhiloxState philox =
        p.use_philox ? reserve_philox(generator, 2 * static_cast<uint64_t>(n_steps)) : PhiloxState();
    mlp::run(torchkern_op_name, p, work, work, weights, biases, activation, negative_slope, precision, layout,
             philox);
    if (!work.is_same(x)) x.copy_(work);
  }
  return {mlp::as_dtype(traj, x.scalar_type()), mlp::as_dtype(energy, x.scalar_type()), accepted, count,
          finite_steps};
}

}  // namespace torchkern
