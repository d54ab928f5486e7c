// Shared by langevin_chain.cu (elementwise energies, host entry) and langevin_chain_rows.cu
// (row-coupled energies): split in two so ninja compiles the two halves in parallel.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/cuda/PhiloxUtils.cuh>

#include <cstdint>

#include "../energies.cuh"

namespace torchkern {
namespace chain {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRowChunks = 8;  // row kernel: d <= 32 * 4 * 8 = 1024

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

// Launches the one-warp-per-row chain for Rosenbrock or Ackley (langevin_chain_rows.cu);
// chunks = 4-column groups per lane, one of 1, 2, 4, kMaxRowChunks.
template <typename T>
void launch_rows(int kind, int chunks, const T* x, T* out, T* traj, const ChainArgs<at::opmath_type<T>>& a,
                 const at::PhiloxCudaState& philox);

}  // namespace chain
}  // namespace torchkern
