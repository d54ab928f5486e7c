// Device math of the analytic energies (docs/design.md, "Energies") and the Langevin update, shared by the
// energy/score kernels and the chain kernels; torch-free. C is the compute type (float, or double).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "launchers.h"

namespace torchkern {

template <typename C>
struct EnergyParams {
  C p0, p1, p2;  // DoubleWell (h, b), Harmonic (k), Rastrigin (a), Rosenbrock (a, b), Ackley (a, b, c)
};

template <typename C>
EnergyParams<C> energy_params(const double (&params)[kEnergyParams]) {
  return EnergyParams<C>{static_cast<C>(params[0]), static_cast<C>(params[1]), static_cast<C>(params[2])};
}

template <typename C>
__device__ __forceinline__ void sincos_2pi(C x, C* s, C* c) {
  if constexpr (sizeof(C) == 8) {
    sincospi(2 * x, s, c);
  } else {
    sincospif(2 * x, s, c);
  }
}

// Elementwise kinds: one coordinate's energy term (without Rastrigin's constant a d) ...
template <int kKind, typename C>
__device__ __forceinline__ C elementwise_energy(C x, const EnergyParams<C>& p) {
  if constexpr (kKind == kDoubleWell) {
    const C t = x * x - p.p1 * p.p1;
    return p.p0 * t * t;
  } else if constexpr (kKind == kHarmonic) {
    return C(0.5) * p.p0 * x * x;
  } else {
    C s, c;
    sincos_2pi(x, &s, &c);
    return x * x - p.p0 * c;
  }
}

// ... and dE/dx of that coordinate.
template <int kKind, typename C>
__device__ __forceinline__ C elementwise_grad(C x, const EnergyParams<C>& p) {
  if constexpr (kKind == kDoubleWell) {
    return C(4) * p.p0 * x * (x * x - p.p1 * p.p1);
  } else if constexpr (kKind == kHarmonic) {
    return p.p0 * x;
  } else {
    C s, c;
    sincos_2pi(x, &s, &c);
    return C(2) * x + C(6.283185307179586476925) * p.p0 * s;
  }
}

// Rosenbrock, coordinate j with neighbours xp = x_{j-1}, xn = x_{j+1}: the term owned by j
// (j < d - 1) and dE/dx_j.
template <typename C>
__device__ __forceinline__ C rosenbrock_energy(C x, C xn, bool has_next, const EnergyParams<C>& p) {
  if (!has_next) return C(0);
  const C u = xn - x * x, v = p.p0 - x;
  return p.p1 * u * u + v * v;
}

template <typename C>
__device__ __forceinline__ C rosenbrock_grad(C x, C xp, C xn, bool has_prev, bool has_next, const EnergyParams<C>& p) {
  C g = C(0);
  if (has_next) g += C(-4) * p.p1 * x * (xn - x * x) - C(2) * (p.p0 - x);
  if (has_prev) g += C(2) * p.p1 * (x - xp * xp);
  return g;
}

// Rosenbrock in the one-warp-per-row layout (lane l holds columns 4 (l + 32 k) + [0, 4) in v[k]): the neighbours
// x_{j-1} (xp) and x_{j+1} (xn) of the lane's columns of chunk k, by shuffles; all 32 lanes take part. Past the
// row's ends they are garbage that rosenbrock_energy and rosenbrock_grad ignore (has_prev, has_next).
template <int kChunks, typename C>
__device__ __forceinline__ void row_neighbours(const C (&v)[kChunks][4], int k, int lane, C (&xp)[4], C (&xn)[4]) {
  constexpr unsigned kFull = 0xffffffffu;
  const C next_same = __shfl_down_sync(kFull, v[k][0], 1);
  const C next_wrap = __shfl_sync(kFull, v[k + 1 < kChunks ? k + 1 : k][0], 0);
  const C prev_same = __shfl_up_sync(kFull, v[k][3], 1);
  const C prev_wrap = __shfl_sync(kFull, v[k > 0 ? k - 1 : k][3], 31);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    xn[c] = c < 3 ? v[k][c + 1] : (lane < 31 ? next_same : next_wrap);
    xp[c] = c > 0 ? v[k][c - 1] : (lane > 0 ? prev_same : prev_wrap);
  }
}

// Ackley from the row sums s2 = sum x^2 and sc = sum cos(c x): dE/dx_j = radial x_j + wave sin(c x_j).
template <typename C>
struct AckleyTerms {
  C energy, radial, wave;
};

template <typename C>
__device__ __forceinline__ AckleyTerms<C> ackley_terms(C s2, C sc, int d, const EnergyParams<C>& p) {
  const C r = sqrt(s2 / C(d));
  const C ea = exp(-p.p1 * r), ec = exp(sc / C(d));
  AckleyTerms<C> t;
  t.energy = -p.p0 * ea - ec + p.p0 + C(2.718281828459045235360);
  t.radial = r > C(0) ? p.p0 * p.p1 * ea / (C(d) * r) : C(0);
  t.wave = ec * p.p2 / C(d);
  return t;
}

// ---------------------------------------------------------------- Langevin update
// StepArgs (launchers.h) in the compute type.
template <typename C>
struct StepParams {
  C step, noise_coef, lo, hi;
};

template <typename C>
StepParams<C> step_params(const StepArgs& a) {
  return StepParams<C>{static_cast<C>(a.step), static_cast<C>(a.noise_coef), static_cast<C>(a.lo),
                       static_cast<C>(a.hi)};
}

template <typename C>
__device__ __forceinline__ C langevin_update(C x, C grad, C eps, const StepParams<C>& s, bool clamp) {
  C y = x - s.step * grad + s.noise_coef * eps;
  if (clamp) y = y < s.lo ? s.lo : (y > s.hi ? s.hi : y);  // NaN stays NaN, as torch.clamp
  return y;
}

// The standard normals of the 4 consecutive elements i0 + [0, 4) of a row in the langevin_step layout (element i
// is component i % 4 of Philox group i / 4), one Philox call per group: lo = group i0 / 4 and, where the row starts
// inside a group (`skewed`), hi = group i0 / 4 + 1; element c is chunk_normal(lo, hi, i0 % 4, c).
__device__ __forceinline__ void chunk_normals(const PhiloxKey& key, uint64_t step, int64_t i0, bool skewed, float4& lo,
                                              float4& hi) {
  lo = normal4(key, step, static_cast<uint64_t>(i0 / 4));
  if (skewed) hi = normal4(key, step, static_cast<uint64_t>(i0 / 4 + 1));
}

__device__ __forceinline__ float chunk_normal(const float4& lo, const float4& hi, int skew, int c) {
  return component(skew + c < 4 ? lo : hi, (skew + c) & 3);
}

// The chain ops' finite_steps (int64 [B], filled with n_steps by the host): chain `row` had a non-finite state
// after step t + 1, so at most t finite steps.
__device__ __forceinline__ void note_non_finite(int64_t* finite_steps, int64_t row, int t) {
  atomicMin(reinterpret_cast<unsigned long long*>(finite_steps + row), static_cast<unsigned long long>(t));
}

}  // namespace torchkern

// Turns the runtime kind into a constexpr int for templated kernels:
//   TORCHKERN_KIND_SWITCH(kind, kKind, [&] { launch<kKind>(...); });
#define TORCHKERN_KIND_CASE(value, NAME, ...) \
  case value: {                               \
    constexpr int NAME = value;               \
    return __VA_ARGS__();                     \
  }
#define TORCHKERN_KIND_SWITCH(kind, NAME, ...)                                            \
  [&] {                                                                                   \
    switch (kind) {                                                                       \
      TORCHKERN_KIND_CASE(::torchkern::kDoubleWell, NAME, __VA_ARGS__)                    \
      TORCHKERN_KIND_CASE(::torchkern::kHarmonic, NAME, __VA_ARGS__)                      \
      TORCHKERN_KIND_CASE(::torchkern::kRastrigin, NAME, __VA_ARGS__)                     \
      TORCHKERN_KIND_CASE(::torchkern::kRosenbrock, NAME, __VA_ARGS__)                    \
      default: {                                                                          \
        constexpr int NAME = ::torchkern::kAckley;                                        \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
    }                                                                                     \
  }()
