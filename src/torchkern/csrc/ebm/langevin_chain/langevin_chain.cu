// langevin_chain: a whole Langevin chain on an analytic energy in ONE launch, the state in registers.
//
// Elementwise-separable energies (DoubleWell, Harmonic, Rastrigin): one thread owns a group
// of 4 consecutive elements of the flat [B * d] state for all steps. Row-coupled energies
// (Rosenbrock: neighbours; Ackley: row sums): one warp owns a row, lane l holding the chunks
// of 4 columns 4 (l + 32 k) + [0, 4) for k < kChunks (d <= 1024); neighbours come by shuffles,
// sums by warp reductions. Longer rows of those two run step by step (score + fused step, on the host: ops.cpp).
//
// Noise: the Philox counter of element i at step t is (offset / 4 + t, i / 4), component i % 4,
// exactly what t separate langevin_step calls would reserve, so a chain and its steps draw
// the same numbers. The trajectory [B, n_steps // thin, d] is written only when asked.
// finite_steps [B]: each chain's steps before its first non-finite state (n_steps for one that stayed finite).
#include "langevin_chain.cuh"

namespace torchkern {
namespace {

using chain::ChainArgs;
using chain::kMaxRowChunks;
using chain::kThreads;

// kPlain: Philox noise, no clamp, no trajectory (the common call), with those branches compiled
// out of the step loop (on an H200 at 65536 x 128 x 200, a copy of the loop that kept the noise
// and clamp checks at run time took 15% longer than one without them).
template <int kKind, typename T, bool kPlain>
__global__ void __launch_bounds__(kThreads)
chain_elementwise_kernel(const T* __restrict__ x,  // [B, d]
                         T* __restrict__ out,      // [B, d]
                         T* __restrict__ traj,     // [B, kept, d]
                         ChainArgs<opmath_t<T>> a, PhiloxState philox) {
  using C = opmath_t<T>;
  const int64_t n = a.batch * a.d;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t base = 4 * g;
  if (base >= n) return;
  const int count = n - base < 4 ? static_cast<int>(n - base) : 4;
  const bool injected = !kPlain && a.noise;
  const PhiloxKey key = injected ? PhiloxKey{} : unpack_key(philox);
  C v[4];
  int64_t row[4];  // trajectory indices (unused when kPlain)
  int col[4];
  unsigned noted = 0;  // bit c: element c's non-finite state is recorded
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    v[c] = c < count ? to_opmath(x[base + c]) : C(0);
    row[c] = (base + c) / a.d;
    col[c] = static_cast<int>(base + c - row[c] * a.d);
  }
#pragma unroll 1
  for (int t = 0; t < a.n_steps; ++t) {
    C eps[4];
    if (injected) {
#pragma unroll
      for (int c = 0; c < 4; ++c) eps[c] = c < count ? a.noise[t * n + base + c] : C(0);
    } else {
      const float4 e = normal4(key, t, g);
      eps[0] = e.x, eps[1] = e.y, eps[2] = e.z, eps[3] = e.w;
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      v[c] = langevin_update(v[c], elementwise_grad<kKind>(v[c], a.p), eps[c], a.s, !kPlain && a.clamp);
    }
    if (!(isfinite(v[0]) && isfinite(v[1]) && isfinite(v[2]) && isfinite(v[3]))) {  // diverged: rare
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (c < count && !(noted >> c & 1) && !isfinite(v[c])) {
          note_non_finite(a.finite_steps, (base + c) / a.d, t);
          noted |= 1u << c;
        }
      }
    }
    if (!kPlain && a.kept && (t + 1) % a.thin == 0) {
      const int slot = (t + 1) / a.thin - 1;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (c < count) traj[(row[c] * a.kept + slot) * a.d + col[c]] = from_opmath<T>(v[c]);
      }
    }
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    if (c < count) out[base + c] = from_opmath<T>(v[c]);
  }
}

template <int kKind, typename T>
void launch_elementwise(const T* x, T* out, T* traj, const ChainArgs<opmath_t<T>>& a, const PhiloxState& philox,
                        cudaStream_t stream) {
  const int64_t groups = (a.batch * a.d + 3) / 4;
  const unsigned grid = static_cast<unsigned>((groups + kThreads - 1) / kThreads);
  if (!a.noise && !a.clamp && !a.kept) {
    chain_elementwise_kernel<kKind, T, true><<<grid, kThreads, 0, stream>>>(x, out, traj, a, philox);
  } else {
    chain_elementwise_kernel<kKind, T, false><<<grid, kThreads, 0, stream>>>(x, out, traj, a, philox);
  }
}

}  // namespace

cudaError_t langevin_chain_launch(const LangevinChainParams& p, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = opmath_t<T>;
    ChainArgs<C> a;
    a.noise = static_cast<const C*>(p.noise);
    a.finite_steps = p.finite_steps;
    a.batch = p.batch;
    a.d = p.d;
    a.n_steps = p.n_steps;
    a.thin = p.thin;
    a.kept = p.kept;
    a.clamp = p.step.clamp;
    a.p = energy_params<C>(p.params);
    a.s = step_params<C>(p.step);
    // The input is read from x and the result written there: the kernels read each element before writing it.
    const T* xin = static_cast<const T*>(p.x);
    T* xout = static_cast<T*>(p.x);
    T* tp = static_cast<T*>(p.traj);
    switch (p.kind) {
      case kDoubleWell: launch_elementwise<kDoubleWell, T>(xin, xout, tp, a, p.philox, stream); break;
      case kHarmonic: launch_elementwise<kHarmonic, T>(xin, xout, tp, a, p.philox, stream); break;
      case kRastrigin: launch_elementwise<kRastrigin, T>(xin, xout, tp, a, p.philox, stream); break;
      default: {
        const int need = (p.d + 127) / 128;
        const int chunks = need <= 1 ? 1 : need <= 2 ? 2 : need <= 4 ? 4 : kMaxRowChunks;
        chain::launch_rows<T>(p.kind, chunks, xin, xout, tp, a, p.philox, stream);
      }
    }
    return cudaGetLastError();
  });
}

}  // namespace torchkern
