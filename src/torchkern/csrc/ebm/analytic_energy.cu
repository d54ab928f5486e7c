// Analytic energies and scores of a [B, d] batch in one pass: analytic_energy,
// analytic_score, analytic_energy_and_score (kinds and formulas: energies.cuh).
//
// One warp per row: lanes stride over the row's columns, the energy is a warp sum.
// Rosenbrock reads its neighbours (cached loads); Ackley first reduces sum x^2 and
// sum cos(c x), then writes the score. Half types compute in float.
#include "energies.cuh"
#include "launchers.h"
#include "torchkern/dispatch.cuh"
#include "torchkern/reduce.cuh"

namespace torchkern {
namespace {

constexpr int kWarps = 8;

template <int kKind, bool kEnergy, bool kScore, typename T>
__global__ void __launch_bounds__(kWarps * 32)
analytic_kernel(const T* __restrict__ x,   // [B, d]
                T* __restrict__ energy,    // [B], unused unless kEnergy
                T* __restrict__ score,     // [B, d], unused unless kScore
                int64_t batch, int d, EnergyParams<opmath_t<T>> p) {
  using C = opmath_t<T>;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= batch) return;  // whole warps leave together
  const T* xr = x + row * d;
  T* sr = kScore ? score + row * d : nullptr;
  C e = C(0);
  if constexpr (kKind == kAckley) {
    C s2 = C(0), sc = C(0);
    for (int j = lane; j < d; j += 32) {
      const C v = to_opmath(xr[j]);
      s2 += v * v;
      sc += cos(p.p2 * v);
    }
    const AckleyTerms<C> t = ackley_terms(warp_sum(s2), warp_sum(sc), d, p);
    e = t.energy;
    if constexpr (kScore) {
      for (int j = lane; j < d; j += 32) {
        const C v = to_opmath(xr[j]);
        sr[j] = from_opmath<T>(-(t.radial * v + t.wave * sin(p.p2 * v)));
      }
    }
  } else {
    for (int j = lane; j < d; j += 32) {
      const C v = to_opmath(xr[j]);
      C g;
      if constexpr (kKind == kRosenbrock) {
        const bool has_prev = j > 0, has_next = j + 1 < d;
        const C xp = has_prev ? to_opmath(xr[j - 1]) : C(0);
        const C xn = has_next ? to_opmath(xr[j + 1]) : C(0);
        if constexpr (kEnergy) e += rosenbrock_energy(v, xn, has_next, p);
        g = rosenbrock_grad(v, xp, xn, has_prev, has_next, p);
      } else {
        if constexpr (kEnergy) e += elementwise_energy<kKind>(v, p);
        g = elementwise_grad<kKind>(v, p);
      }
      if constexpr (kScore) sr[j] = from_opmath<T>(-g);
    }
    if constexpr (kEnergy) {
      e = warp_sum(e);
      if constexpr (kKind == kRastrigin) e += p.p0 * C(d);
    }
  }
  if constexpr (kEnergy) {
    if (lane == 0) energy[row] = from_opmath<T>(e);
  }
}

template <bool kEnergy, bool kScore, typename T>
void launch_kind(const AnalyticParams& p, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>((p.batch + kWarps - 1) / kWarps);
  TORCHKERN_KIND_SWITCH(p.kind, kKind, [&] {
    analytic_kernel<kKind, kEnergy, kScore, T><<<grid, kWarps * 32, 0, stream>>>(
        static_cast<const T*>(p.x), static_cast<T*>(p.energy), static_cast<T*>(p.score), p.batch, p.d,
        energy_params<opmath_t<T>>(p.params));
  });
}

}  // namespace

cudaError_t analytic_launch(const AnalyticParams& p, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (p.energy && p.score) {
      launch_kind<true, true, T>(p, stream);
    } else if (p.energy) {
      launch_kind<true, false, T>(p, stream);
    } else {
      launch_kind<false, true, T>(p, stream);
    }
    return cudaGetLastError();
  });
}

}  // namespace torchkern
