// langevin_chain for row-coupled energies (Rosenbrock, Ackley): one warp owns a row (see
// langevin_chain.cu for the layout and the noise contract). Instantiated by langevin_chain_rows_f32_f64.cu and
// langevin_chain_rows_f16_bf16.cu, two units that ninja compiles in parallel.
#pragma once

#include "langevin_chain.cuh"
#include "torchkern/reduce.cuh"

namespace torchkern {
namespace chain {
namespace {

template <int kKind, int kChunks, typename T>
__global__ void __launch_bounds__(kThreads)
chain_row_kernel(const T* __restrict__ x,  // [B, d]
                 T* __restrict__ out,      // [B, d]
                 T* __restrict__ traj,     // [B, kept, d]
                 ChainArgs<opmath_t<T>> a, PhiloxState philox) {
  using C = opmath_t<T>;
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (r >= a.batch) return;  // whole warps leave together
  const int d = a.d;
  const int64_t n = a.batch * d, row_base = r * d;
  const bool groups_aligned = d % 4 == 0;  // then each chunk is one Philox group
  const PhiloxKey key = a.noise ? PhiloxKey{} : unpack_key(philox);
  C v[kChunks][4];
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int j = 4 * (lane + 32 * k) + c;
      v[k][c] = j < d ? to_opmath(x[row_base + j]) : C(0);
    }
  }
  bool noted = false;  // this lane recorded a non-finite state of the row
#pragma unroll 1
  for (int t = 0; t < a.n_steps; ++t) {
    bool finite = true;
    C grad[kChunks][4];
    if constexpr (kKind == kRosenbrock) {
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        C xp[4], xn[4];
        row_neighbours(v, k, lane, xp, xn);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int j = 4 * (lane + 32 * k) + c;
          grad[k][c] = rosenbrock_grad(v[k][c], xp[c], xn[c], j > 0, j + 1 < d, a.p);
        }
      }
    } else {  // Ackley
      C s2 = C(0), sc = C(0);
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if (4 * (lane + 32 * k) + c < d) {
            s2 += v[k][c] * v[k][c];
            sc += cos(a.p.p2 * v[k][c]);
          }
        }
      }
      const AckleyTerms<C> terms = ackley_terms(warp_sum(s2), warp_sum(sc), d, a.p);
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
#pragma unroll
        for (int c = 0; c < 4; ++c) grad[k][c] = terms.radial * v[k][c] + terms.wave * sin(a.p.p2 * v[k][c]);
      }
    }
    const bool keep = a.kept && (t + 1) % a.thin == 0;
    const int slot = (t + 1) / a.thin - 1;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int j0 = 4 * (lane + 32 * k);
      if (j0 >= d) continue;
      const int skew = static_cast<int>((row_base + j0) % 4);  // 0 where groups_aligned
      float4 e4{}, e4_next{};
      if (!a.noise) chunk_normals(key, t, row_base + j0, !groups_aligned, e4, e4_next);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = j0 + c;
        if (j >= d) break;
        const int64_t i = row_base + j;
        C eps;
        if (a.noise) {
          eps = a.noise[t * n + i];
        } else if (groups_aligned) {
          eps = static_cast<C>(component(e4, c));
        } else {
          eps = static_cast<C>(chunk_normal(e4, e4_next, skew, c));
        }
        v[k][c] = langevin_update(v[k][c], grad[k][c], eps, a.s, a.clamp);
        finite = finite && isfinite(v[k][c]);
        if (keep) traj[(r * a.kept + slot) * d + j] = from_opmath<T>(v[k][c]);
      }
    }
    if (!finite && !noted) {  // diverged: rare
      note_non_finite(a.finite_steps, r, t);
      noted = true;
    }
  }
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int j = 4 * (lane + 32 * k) + c;
      if (j < d) out[row_base + j] = from_opmath<T>(v[k][c]);
    }
  }
}

}  // namespace

template <int kKind, typename T>
static void launch_row(int chunks, const T* x, T* out, T* traj, const ChainArgs<opmath_t<T>>& a,
                       const PhiloxState& philox, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>((a.batch + kWarps - 1) / kWarps);
  switch (chunks) {
    case 1: chain_row_kernel<kKind, 1, T><<<grid, kThreads, 0, stream>>>(x, out, traj, a, philox); break;
    case 2: chain_row_kernel<kKind, 2, T><<<grid, kThreads, 0, stream>>>(x, out, traj, a, philox); break;
    case 4: chain_row_kernel<kKind, 4, T><<<grid, kThreads, 0, stream>>>(x, out, traj, a, philox); break;
    default: chain_row_kernel<kKind, kMaxRowChunks, T><<<grid, kThreads, 0, stream>>>(x, out, traj, a, philox);
  }
}

template <typename T>
void launch_rows(int kind, int chunks, const T* x, T* out, T* traj, const ChainArgs<opmath_t<T>>& a,
                 const PhiloxState& philox, cudaStream_t stream) {
  if (kind == kRosenbrock) {
    launch_row<kRosenbrock, T>(chunks, x, out, traj, a, philox, stream);
  } else {
    launch_row<kAckley, T>(chunks, x, out, traj, a, philox, stream);
  }
}

// launch_rows for states of type T, in the unit that compiles T's kernels.
#define TORCHKERN_INSTANTIATE_ROWS(T)                                                                          \
  template void launch_rows<T>(int, int, const T*, T*, T*, const ChainArgs<opmath_t<T>>&, const PhiloxState&, \
                               cudaStream_t);

}  // namespace chain
}  // namespace torchkern
