// The ebm ops' launchers, as ops.cpp calls them: plain pointers, sizes, the energy's numbers and a dtype; each
// launches on the stream it is given and returns the CUDA error of its launches (common.h). Torch-free: included
// by the kernels' .cu files and by the host side. The MLP ops' launchers are in mlp_chain/mlp_chain.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mlp_chain/mlp_chain.h"
#include "torchkern/common.h"
#include "torchkern/philox.cuh"

namespace torchkern {

// The analytic energies by the integer the ops take, and their parameter count (ebm/constants.py, handed over
// as -D flags by the loader).
#if !defined(TORCHKERN_ENERGY_KINDS) || !defined(TORCHKERN_ENERGY_PARAMS) || !defined(TORCHKERN_MAX_STEPS)
#error "build through torchkern's loader: it defines the TORCHKERN_ENERGY_* constants (ebm/constants.py)"
#endif
enum EnergyKind : int {
  kDoubleWell = TORCHKERN_ENERGY_DOUBLE_WELL,
  kHarmonic = TORCHKERN_ENERGY_HARMONIC,
  kRastrigin = TORCHKERN_ENERGY_RASTRIGIN,
  kRosenbrock = TORCHKERN_ENERGY_ROSENBROCK,
  kAckley = TORCHKERN_ENERGY_ACKLEY,
  kNumKinds = TORCHKERN_ENERGY_KINDS,
};
constexpr int kEnergyParams = TORCHKERN_ENERGY_PARAMS;

constexpr bool is_elementwise(int kind) { return kind == kDoubleWell || kind == kHarmonic || kind == kRastrigin; }

// The Langevin update x' = x - step g + noise_coef eps, clamped to [lo, hi] when `clamp` (infinite bounds where
// absent), noise_coef = sigma sqrt(2 step); the kernels take it in their compute type.
struct StepArgs {
  double step, noise_coef, lo, hi;
  bool clamp;
};

// analytic_energy, analytic_score, analytic_energy_and_score: energy [B] and score [B, d] of x [B, d], all
// contiguous and of `dtype`; a null output is not computed.
struct AnalyticParams {
  const void* x;
  void* energy;
  void* score;
  int64_t batch;
  int d;
  int kind;
  double params[kEnergyParams];
  DType dtype;
};
cudaError_t analytic_launch(const AnalyticParams& p, cudaStream_t stream);

// gaussian_*: energy [B] = 1/2 (x - mu)^T P (x - mu) and score [B, d] = -P (x - mu) of x [B, d], mean [d],
// precision [d, d] (symmetric), all contiguous and of `dtype`.
struct GaussianParams {
  const void* x;
  const void* mean;
  const void* precision;
  void* energy;
  void* score;
  int64_t batch;
  int d;
  DType dtype;
};
// Whether gaussian_launch's fused kernels take d columns of `dtype` on the current device; where they do not,
// the host computes the score by a GEMM and gaussian_energy_launch the energy from it.
bool gaussian_fused(int d, DType dtype);
cudaError_t gaussian_launch(const GaussianParams& p, cudaStream_t stream);
cudaError_t gaussian_energy_launch(const GaussianParams& p, cudaStream_t stream);  // from p.score

// langevin_step, langevin_step_: out = x - step grad + noise_coef eps [clamped] over n elements, all contiguous
// and of `dtype` (out may be x); eps from Philox, or `noise` [n] in the compute type (float64 for float64, else
// float32).
struct LangevinStepParams {
  void* out;
  const void* x;
  const void* grad;
  const void* noise;
  int64_t n;
  StepArgs step;
  PhiloxState philox;
  DType dtype;
};
cudaError_t langevin_step_launch(const LangevinStepParams& p, cudaStream_t stream);

// langevin_chain: n_steps Langevin steps on an analytic energy with d <= kLangevinChainMaxRowD where the kind is
// row-coupled (Rosenbrock, Ackley; longer rows run step by step on the host). x [B, d] holds the starting states
// and receives the final ones; traj [B, kept, d] (null: none kept) the states after every thin-th step; noise
// [n_steps, B, d] in the compute type, or null (Philox). finite_steps [B] holds n_steps on entry (note_non_finite).
constexpr int kLangevinChainMaxRowD = 32 * 4 * 8;
struct LangevinChainParams {
  void* x;
  void* traj;
  const void* noise;
  int64_t* finite_steps;
  int64_t batch;
  int d;
  int kind;
  double params[kEnergyParams];
  int n_steps, thin, kept;
  StepArgs step;
  PhiloxState philox;
  DType dtype;
};
cudaError_t langevin_chain_launch(const LangevinChainParams& p, cudaStream_t stream);

// hmc_chain_: n_steps HMC trajectories (identity mass) on an analytic energy, d <= kHmcChainMaxD; x [B, d] is
// updated in place. float32 or float64 throughout (`dtype`): x, traj [B, kept, d] and energy [B, kept] (null: not
// kept), noise [n_steps, B, d] and uniform [n_steps, B] (null: Philox). accepted [B, n_steps] (or null),
// accept_count [B] and finite_steps [B] (the trajectories before the first divergent one) are written for every row.
constexpr int kHmcChainMaxD = 32 * 4 * 8;
struct HmcChainParams {
  void* x;
  void* traj;
  void* energy;
  bool* accepted;
  int64_t* accept_count;
  int64_t* finite_steps;
  const void* noise;
  const void* uniform;
  int64_t batch;
  int d;
  int kind;
  double params[kEnergyParams];
  double step;
  int n_leapfrog, n_steps, thin, kept;
  PhiloxState philox;
  DType dtype;
};
cudaError_t hmc_chain_launch(const HmcChainParams& p, cudaStream_t stream);

}  // namespace torchkern
