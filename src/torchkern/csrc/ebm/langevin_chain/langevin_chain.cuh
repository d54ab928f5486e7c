// Shared by langevin_chain.cu (elementwise energies, the launcher) and langevin_chain_rows.cuh (row-coupled
// energies, instantiated per dtype pair by langevin_chain_rows_{f32_f64,f16_bf16}.cu): units that ninja compiles in
// parallel.
#pragma once

#include <cstdint>

#include "../energies.cuh"
#include "../launchers.h"
#include "torchkern/dispatch.cuh"
#include "torchkern/philox.cuh"

namespace torchkern {
namespace chain {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRowChunks = kLangevinChainMaxRowD / (32 * 4);  // row kernel: 4-column groups per lane

template <typename C>
struct ChainArgs {
  const C* noise;  // [n_steps, B, d] or null
  int64_t* finite_steps;  // [B], n_steps on entry (note_non_finite)
  int64_t batch;
  int d;
  int n_steps, thin, kept;  // kept = n_steps // thin when the trajectory is asked, else 0
  bool clamp;
  EnergyParams<C> p;
  StepParams<C> s;
};

// Launches the one-warp-per-row chain for Rosenbrock or Ackley (langevin_chain_rows.cuh);
// chunks = 4-column groups per lane, one of 1, 2, 4, kMaxRowChunks.
template <typename T>
void launch_rows(int kind, int chunks, const T* x, T* out, T* traj, const ChainArgs<opmath_t<T>>& a,
                 const PhiloxState& philox, cudaStream_t stream);

}  // namespace chain
}  // namespace torchkern
