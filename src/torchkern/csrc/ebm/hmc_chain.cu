// hmc_chain_: Hamiltonian Monte Carlo (identity mass) on an analytic energy in ONE launch, x updated in place.
//
// One warp owns a row (d <= 32 * 4 * kMaxChunks = 1024), lane l holding columns 4 (l + 32 k) + [0, 4) of the
// position, the momentum, the gradient, and the trajectory's start with its energy and gradient (restored
// when the proposal is rejected), all in registers. Energies and kinetic energies are warp sums (every lane
// ends with the same bits, so every lane takes the same accept decision). Per trajectory t: momenta from
// Philox draw 2t (the langevin_step layout: element i = row * d + col, group i / 4, component i % 4), half
// kick, n_leapfrog x (drift, kick) with the last kick halved, and accept where log u < H0 - H1 with u from
// draw 2t + 1 (group = row); a divergent trajectory (non-finite H1) is rejected and ends the row's count of
// finite trajectories. float16/bfloat16 states run in float32 (converted on the host).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "chain_checks.h"
#include "energies.cuh"
#include "torchkern/checks.h"
#include "torchkern/dispatch.h"
#include "torchkern/launch.h"
#include "torchkern/philox.cuh"
#include "torchkern/reduce.cuh"

namespace torchkern {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxChunks = 8;

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
  constexpr unsigned kFull = 0xffffffffu;
  C e = C(0);
  if constexpr (kKind == kRosenbrock) {
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const C next_same = __shfl_down_sync(kFull, v[k][0], 1);
      const C next_wrap = __shfl_sync(kFull, v[k + 1 < kChunks ? k + 1 : k][0], 0);
      const C prev_same = __shfl_up_sync(kFull, v[k][3], 1);
      const C prev_wrap = __shfl_sync(kFull, v[k > 0 ? k - 1 : k][3], 31);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = 4 * (lane + 32 * k) + c;
        const C xn = c < 3 ? v[k][c + 1] : (lane < 31 ? next_same : next_wrap);
        const C xp = c > 0 ? v[k][c - 1] : (lane > 0 ? prev_same : prev_wrap);
        const bool in = j < d;
        g[k][c] = in ? rosenbrock_grad(v[k][c], xp, xn, j > 0, j + 1 < d, p) : C(0);
        if (in) e += rosenbrock_energy(v[k][c], xn, j + 1 < d, p);
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
               HmcArgs<C> a, at::PhiloxCudaState philox) {
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
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = 4 * (lane + 32 * k) + c;
        const int64_t i = row_base + j;
        C z = C(0);
        if (j < d) {
          z = a.noise ? a.noise[t * n + i]
                      : static_cast<C>(component(normal4(key, 2 * static_cast<uint64_t>(t), i / 4),
                                                 static_cast<int>(i % 4)));
        }
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

template <int kKind, typename C>
void launch_hmc(int chunks, C* x, C* traj, C* energy, bool* accepted, int64_t* count, int64_t* finite,
                const HmcArgs<C>& a, const at::PhiloxCudaState& philox) {
  const unsigned grid = static_cast<unsigned>((a.batch + kWarps - 1) / kWarps);
  if (chunks == 1) {
    hmc_row_kernel<kKind, 1, C><<<grid, kThreads, 0, current_stream()>>>(x, traj, energy, accepted, count, finite, a,
                                                                         philox);
  } else {
    hmc_row_kernel<kKind, kMaxChunks, C><<<grid, kThreads, 0, current_stream()>>>(x, traj, energy, accepted, count,
                                                                                  finite, a, philox);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> hmc_chain_cuda(
    at::Tensor& x, int64_t kind, at::ArrayRef<double> params, double step_size, int64_t n_leapfrog, int64_t n_steps,
    int64_t thin, bool return_trajectory, bool return_energy, bool return_acceptance,
    std::optional<at::Generator> generator, const std::optional<at::Tensor>& noise,
    const std::optional<at::Tensor>& uniform) {
  TORCHKERN_OP("hmc_chain_");
  check_analytic_args(torchkern_op_name, x, kind, params);
  check_hmc_run(torchkern_op_name, x, step_size, n_leapfrog, n_steps, thin, noise, uniform);
  const int64_t batch = x.size(0), d = x.size(1), kept = n_steps / thin;
  TORCHKERN_CHECK(d <= 32 * 4 * kMaxChunks, "x must have at most ", 32 * 4 * kMaxChunks,
                  " columns for the fused HMC kernel (HamiltonianMonteCarlo samples wider rows by its generic path), "
                  "got ", x.sizes());
  TORCHKERN_CHECK_CUDA(x);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const at::ScalarType ct = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor traj = at::empty({batch, return_trajectory ? kept : 0, d}, x.options().dtype(ct));
  at::Tensor energy = at::empty({batch, return_energy ? kept : 0}, x.options().dtype(ct));
  at::Tensor accepted = at::zeros({batch, return_acceptance ? n_steps : 0}, x.options().dtype(at::kBool));
  at::Tensor count = at::zeros({batch}, x.options().dtype(at::kLong));
  at::Tensor finite = at::zeros({batch}, x.options().dtype(at::kLong));  // the kernel writes every row
  if (batch > 0 && n_steps > 0) {
    at::Tensor work = x.scalar_type() == ct && x.is_contiguous() ? x : x.to(ct).contiguous();
    const at::Tensor nz = noise.has_value() ? noise->to(ct).contiguous() : at::Tensor();
    const at::Tensor un = uniform.has_value() ? uniform->to(ct).contiguous() : at::Tensor();
    const bool use_philox = !(noise.has_value() && uniform.has_value());
    const at::PhiloxCudaState philox =
        use_philox ? reserve_philox(generator, 2 * static_cast<uint64_t>(n_steps)) : at::PhiloxCudaState();
    const int chunks = d <= 128 ? 1 : kMaxChunks;
    AT_DISPATCH_FLOATING_TYPES(ct, "hmc_chain_", [&] {
      using C = scalar_t;
      HmcArgs<C> a;
      a.noise = nz.defined() ? nz.const_data_ptr<C>() : nullptr;
      a.uniform = un.defined() ? un.const_data_ptr<C>() : nullptr;
      a.batch = batch;
      a.d = static_cast<int>(d);
      a.n_steps = static_cast<int>(n_steps);
      a.n_leapfrog = static_cast<int>(n_leapfrog);
      a.thin = static_cast<int>(std::min<int64_t>(thin, 1 << 30));
      a.kept = static_cast<int>(kept);
      a.step = static_cast<C>(step_size);
      a.p = EnergyParams<C>{static_cast<C>(params[0]), static_cast<C>(params[1]), static_cast<C>(params[2])};
      C* tp = return_trajectory && kept ? traj.mutable_data_ptr<C>() : nullptr;
      C* ep = return_energy && kept ? energy.mutable_data_ptr<C>() : nullptr;
      bool* ap = return_acceptance ? accepted.mutable_data_ptr<bool>() : nullptr;
      TORCHKERN_KIND_SWITCH(static_cast<int>(kind), kKind, [&] {
        launch_hmc<kKind, C>(chunks, work.mutable_data_ptr<C>(), tp, ep, ap, count.mutable_data_ptr<int64_t>(),
                             finite.mutable_data_ptr<int64_t>(), a, philox);
      });
    });
    if (!work.is_same(x)) x.copy_(work);
  }
  return {traj.to(x.scalar_type()), energy.to(x.scalar_type()), accepted, count, finite};
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) { m.impl("hmc_chain_", &torchkern::hmc_chain_cuda); }
