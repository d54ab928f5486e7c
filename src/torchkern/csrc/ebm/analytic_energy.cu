// Analytic energies and scores of a [B, d] batch in one pass: analytic_energy,
// analytic_score, analytic_energy_and_score (kinds and formulas: energies.cuh).
//
// One warp per row: lanes stride over the row's columns, the energy is a warp sum.
// Rosenbrock reads its neighbours (cached loads); Ackley first reduces sum x^2 and
// sum cos(c x), then writes the score. Half types compute in float.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

#include "torchkern/checks.h"
#include "torchkern/dispatch.h"
#include "energies.cuh"
#include "torchkern/launch.h"
#include "torchkern/reduce.cuh"

namespace torchkern {
namespace {

constexpr int kWarps = 8;

template <int kKind, bool kEnergy, bool kScore, typename T>
__global__ void __launch_bounds__(kWarps * 32)
analytic_kernel(const T* __restrict__ x,   // [B, d]
                T* __restrict__ energy,    // [B], unused unless kEnergy
                T* __restrict__ score,     // [B, d], unused unless kScore
                int64_t batch, int d, EnergyParams<at::opmath_type<T>> p) {
  using C = at::opmath_type<T>;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= batch) return;  // whole warps leave together
  const T* xr = x + row * d;
  T* sr = kScore ? score + row * d : nullptr;
  C e = C(0);
  if constexpr (kKind == kAckley) {
    C s2 = C(0), sc = C(0);
    for (int j = lane; j < d; j += 32) {
      const C v = static_cast<C>(xr[j]);
      s2 += v * v;
      sc += cos(p.p2 * v);
    }
    const AckleyTerms<C> t = ackley_terms(warp_sum(s2), warp_sum(sc), d, p);
    e = t.energy;
    if constexpr (kScore) {
      for (int j = lane; j < d; j += 32) {
        const C v = static_cast<C>(xr[j]);
        sr[j] = static_cast<T>(-(t.radial * v + t.wave * sin(p.p2 * v)));
      }
    }
  } else {
    for (int j = lane; j < d; j += 32) {
      const C v = static_cast<C>(xr[j]);
      C g;
      if constexpr (kKind == kRosenbrock) {
        const bool has_prev = j > 0, has_next = j + 1 < d;
        const C xp = has_prev ? static_cast<C>(xr[j - 1]) : C(0);
        const C xn = has_next ? static_cast<C>(xr[j + 1]) : C(0);
        if constexpr (kEnergy) e += rosenbrock_energy(v, xn, has_next, p);
        g = rosenbrock_grad(v, xp, xn, has_prev, has_next, p);
      } else {
        if constexpr (kEnergy) e += elementwise_energy<kKind>(v, p);
        g = elementwise_grad<kKind>(v, p);
      }
      if constexpr (kScore) sr[j] = static_cast<T>(-g);
    }
    if constexpr (kEnergy) {
      e = warp_sum(e);
      if constexpr (kKind == kRastrigin) e += p.p0 * C(d);
    }
  }
  if constexpr (kEnergy) {
    if (lane == 0) energy[row] = static_cast<T>(e);
  }
}

template <bool kEnergy, bool kScore>
std::tuple<at::Tensor, at::Tensor> analytic_cuda(const char* op, const at::Tensor& x, int64_t kind,
                                                 at::ArrayRef<double> params) {
  check_analytic_args(op, x, kind, params);
  const char* torchkern_op_name = op;
  TORCHKERN_CHECK_CUDA(x);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const int64_t batch = x.size(0), d = x.size(1);
  at::Tensor energy = at::empty({kEnergy ? batch : 0}, x.options());
  at::Tensor score = at::empty({kScore ? batch : 0, d}, x.options());
  if (batch == 0 || d == 0) return {energy, score};
  TORCHKERN_DISPATCH_FLOATING(x.scalar_type(), "analytic_energy", [&] {
    using C = at::opmath_type<scalar_t>;
    const EnergyParams<C> p{static_cast<C>(params[0]), static_cast<C>(params[1]), static_cast<C>(params[2])};
    TORCHKERN_KIND_SWITCH(static_cast<int>(kind), kKind, [&] {
      const unsigned grid = static_cast<unsigned>((batch + kWarps - 1) / kWarps);
      analytic_kernel<kKind, kEnergy, kScore, scalar_t><<<grid, kWarps * 32, 0, current_stream()>>>(
          xc.const_data_ptr<scalar_t>(), kEnergy ? energy.mutable_data_ptr<scalar_t>() : nullptr,
          kScore ? score.mutable_data_ptr<scalar_t>() : nullptr, batch, static_cast<int>(d), p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {energy, score};
}

at::Tensor analytic_energy_cuda(const at::Tensor& x, int64_t kind, at::ArrayRef<double> params) {
  return std::get<0>(analytic_cuda<true, false>("torchkern.analytic_energy", x, kind, params));
}

at::Tensor analytic_score_cuda(const at::Tensor& x, int64_t kind, at::ArrayRef<double> params) {
  return std::get<1>(analytic_cuda<false, true>("torchkern.analytic_score", x, kind, params));
}

std::tuple<at::Tensor, at::Tensor> analytic_energy_and_score_cuda(const at::Tensor& x, int64_t kind,
                                                                  at::ArrayRef<double> params) {
  return analytic_cuda<true, true>("torchkern.analytic_energy_and_score", x, kind, params);
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) {
  m.impl("analytic_energy", &torchkern::analytic_energy_cuda);
  m.impl("analytic_score", &torchkern::analytic_score_cuda);
  m.impl("analytic_energy_and_score", &torchkern::analytic_energy_and_score_cuda);
}
