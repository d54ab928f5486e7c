// hmc_chain_: Hamiltonian Monte Carlo (identity mass) on an analytic energy in ONE launch, x updated in place.
//
// One warp owns a row (d <= 32 * 4 * kMaxChunks = 1024), lane l holding columns 4 (l + 32 k) + [0, 4) of the
// position, the momentum, the gradient, and the trajectory's start with its energy and gradient (restored
// when the proposal is rejected), all in registers. Energies and kinetic energies are warp sums (every lane
// ends with the same bits, so every lane takes the same accept decision). Per trajectory t: momenta from
// Philox draw 2t (the langevin_step layout: element i = row * d + col, group i / 4, component i % 4), half
// kick, n_leapfrog x (drift, kick) with the last kick halved, and accept where log u < H0 - H1 with u from
// draw 2t + 1 (group = row); a divergent trajectory (non-finite H1) is rejected and ends the row's count of
// finite trajectories. float16/bfloat16 states run in float32 (converted on the host). Instantiated per compute
// type by hmc_chain_f32.cu (with the launcher) and hmc_chain_f64.cu, units that ninja compiles in parallel.
#pragma once

#include "../energies.cuh"
#include "../launchers.h"
#include "torchkern/dispatch.cuh"
#include "torchkern/philox.cuh"
#include "torchkern/reduce.cuh"

namespace torchkern {
namespace hmc {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxChunks = kHmcChainMaxD / (32 * 4);

template <typename C>
struct HmcArgs {
  const C* noise;    // [n_steps, B, d] or null
  const C* uniform;  // [n_steps, B] or null
  int64_t batch;
  int d, n_steps, n_leapfrog, thin, kept;
  C step;
  EnergyParams<C> p;
};

// The row's energy (every lane gets it) and dE/dx of the lane's columns (0 past d).
template <int kKind, int kChunks, typename C>
__device__ __forceinline__ C energy_grad(const C (&v)[kChunks][4], C (&g)[kChunks][4], int lane, int d,
                                         const EnergyParams<C>& p) {
  C e = C(0);
  if constexpr (kKind == kRosenbrock) {
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      C xp[4], xn[4];
      row_neighbours(v, k, lane, xp, xn);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = 4 * (lane + 32 * k) + c;
        const bool in = j < d;
        g[k][c] = in ? rosenbrock_grad(v[k][c], xp[c], xn[c], j > 0, j + 1 < d, p) : C(0);
        if (in) e += rosenbrock_energy(v[k][c], xn[c], j + 1 < d, p);
      }
    }
    return warp_sum(e);
  } else if constexpr (kKind == kAckley) {
    C s2 = C(0), sc = C(0);
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (4 * (lane + 32 * k) + c < d) {
          s2 += v[k][c] * v[k][c];
          sc += cos(p.p2 * v[k][c]);
        }
      }
    }
    const AckleyTerms<C> t = ackley_terms(warp_sum(s2), warp_sum(sc), d, p);
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        g[k][c] = 4 * (lane + 32 * k) + c < d ? t.radial * v[k][c] + t.wave * sin(p.p2 * v[k][c]) : C(0);
      }
    }
    return t.energy;
  } else {
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const bool in = 4 * (lane + 32 * k) + c < d;
        g[k][c] = in ? elementwise_grad<kKind>(v[k][c], p) : C(0);
        if (in) e += elementwise_energy<kKind>(v[k][c], p);
      }
    }
    e = warp_sum(e);
    return kKind == kRastrigin ? e + p.p0 * C(d) : e;
  }
}

template <int kChunks, typename C>
__device__ __forceinline__ C half_square_sum(const C (&m)[kChunks][4]) {
  C s = C(0);
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
#pragma unroll
    for (int c = 0; c < 4; ++c) s += m[k][c] * m[k][c];
  }
  return C(0.5) * warp_sum(s);
}

template <int kKind, int kChunks, typename C>
__global__ void __launch_bounds__(kThreads)
hmc_row_kernel(C* __restrict__ x,              // [B, d], in place
               C* __restrict__ traj,           // [B, kept, d] or null
               C* __restrict__ energy,         // [B, kept] or null
               bool* __restrict__ accepted,    // [B, n_steps] or null
               int64_t* __restrict__ count,    // [B]
               int64_t* __restrict__ finite,   // [B]: trajectories before the first divergent one
               HmcArgs<C> a, PhiloxState philox) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (r >= a.batch) return;  // whole warps leave together
  const int d = a.d;
  const int64_t row_base = r * d, n = a.batch * d;
  const bool use_philox = !(a.noise && a.uniform);
  const PhiloxKey key = use_philox ? unpack_key(philox) : PhiloxKey{};
  C v[kChunks][4], m[kChunks][4], g[kChunks][4], v0[kChunks][4], g0[kChunks][4];
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int j = 4 * (lane + 32 * k) + c;
      v[k][c] = j < d ? x[row_base + j] : C(0);
    }
  }
  C e = a.n_steps > 0 ? energy_grad<kKind>(v, g, lane, d, a.p) : C(0);
  int64_t accepts = 0;
  int finite_trajectories = a.n_steps;
#pragma unroll 1
  for (int t = 0; t < a.n_steps; ++t) {
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int64_t i0 = row_base + 4 * (lane + 32 * k);
      const int skew = static_cast<int>(i0 % 4);
      float4 n4{}, n4_next{};
      if (!a.noise && 4 * (lane + 32 * k) < d) {
        chunk_normals(key, 2 * static_cast<uint64_t>(t), i0, skew > 0, n4, n4_next);
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = 4 * (lane + 32 * k) + c;
        const int64_t i = row_base + j;
        C z = C(0);
        if (j < d) z = a.noise ? a.noise[t * n + i] : static_cast<C>(chunk_normal(n4, n4_next, skew, c));
        m[k][c] = z;
        v0[k][c] = v[k][c];
        g0[k][c] = g[k][c];
      }
    }
    const C k0 = half_square_sum(m), e0 = e;
#pragma unroll 1
    for (int s = 0; s <= a.n_leapfrog; ++s) {
      if (s > 0) e = energy_grad<kKind>(v, g, lane, d, a.p);
      const C kick = s == 0 || s == a.n_leapfrog ? C(0.5) * a.step : a.step;
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          m[k][c] -= kick * g[k][c];
          if (s < a.n_leapfrog) v[k][c] += a.step * m[k][c];  // zero momentum past d: padding stays 0
        }
      }
    }
    const C k1 = half_square_sum(m);
    const C u = a.uniform ? a.uniform[static_cast<int64_t>(t) * a.batch + r]
                          : static_cast<C>(uniform_open0(
                                philox4x32_10(make_uint4(static_cast<uint32_t>(key.draw + 2 * t + 1),
                                                         static_cast<uint32_t>((key.draw + 2 * t + 1) >> 32),
                                                         static_cast<uint32_t>(r), static_cast<uint32_t>(r >> 32)),
                                              static_cast<uint32_t>(key.seed), static_cast<uint32_t>(key.seed >> 32))
                                    .x));
    const bool accept = log(u) < (e0 + k0) - (e + k1);  // false for a NaN or infinite proposal energy
    if (finite_trajectories == a.n_steps && !isfinite(e + k1)) finite_trajectories = t;  // a divergent trajectory
    if (!accept) {
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
#pragma unroll
        for (int c = 0; c < 4; ++c) v[k][c] = v0[k][c], g[k][c] = g0[k][c];
      }
      e = e0;
    }
    accepts += accept;
    if (accepted && lane == 0) accepted[r * a.n_steps + t] = accept;
    if ((t + 1) % a.thin == 0) {
      const int slot = (t + 1) / a.thin - 1;
      if (energy && lane == 0) energy[r * a.kept + slot] = e;
      if (traj) {
#pragma unroll
        for (int k = 0; k < kChunks; ++k) {
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int j = 4 * (lane + 32 * k) + c;
            if (j < d) traj[(r * a.kept + slot) * d + j] = v[k][c];
          }
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int j = 4 * (lane + 32 * k) + c;
      if (j < d) x[row_base + j] = v[k][c];
    }
  }
  if (lane == 0) {
    count[r] = accepts;
    finite[r] = finite_trajectories;
  }
}

}  // namespace

// Runs hmc_chain_ on states of compute type C (hmc_chain_launch, hmc_chain_f32.cu, picks C by p.dtype).
template <typename C>
cudaError_t launch(const HmcChainParams& p, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>((p.batch + kWarps - 1) / kWarps);
  HmcArgs<C> a;
  a.noise = static_cast<const C*>(p.noise);
  a.uniform = static_cast<const C*>(p.uniform);
  a.batch = p.batch;
  a.d = p.d;
  a.n_steps = p.n_steps;
  a.n_leapfrog = p.n_leapfrog;
  a.thin = p.thin;
  a.kept = p.kept;
  a.step = static_cast<C>(p.step);
  a.p = energy_params<C>(p.params);
  C* x = static_cast<C*>(p.x);
  C* traj = static_cast<C*>(p.traj);
  C* energy = static_cast<C*>(p.energy);
  TORCHKERN_KIND_SWITCH(p.kind, kKind, [&] {
    if (p.d <= 128) {
      hmc_row_kernel<kKind, 1, C><<<grid, kThreads, 0, stream>>>(x, traj, energy, p.accepted, p.accept_count,
                                                                 p.finite_steps, a, p.philox);
    } else {
      hmc_row_kernel<kKind, kMaxChunks, C><<<grid, kThreads, 0, stream>>>(x, traj, energy, p.accepted,
                                                                          p.accept_count, p.finite_steps, a, p.philox);
    }
  });
  return cudaGetLastError();
}

}  // namespace hmc
}  // namespace torchkern
