// langevin_chain for row-coupled energies (Rosenbrock, Ackley): one warp owns a row (see
// langevin_chain.cu for the layout and the noise contract). float32, float16 and bfloat16 states share the float
// kernels: the dtype, a run-time argument, picks the conversions of the row's reads and writes (to_opmath /
// from_opmath either way), each a loop of its own outside the step's update, so the kernels to compile are halved.
#include "langevin_chain.cuh"
#include "torchkern/reduce.cuh"

namespace torchkern {
namespace chain {
namespace {

// Calls f(Type<T>{}) with T the storage type of `dtype` among those that compute in C.
template <typename C, typename F>
__device__ __forceinline__ void with_storage(DType dtype, F&& f) {
  if constexpr (sizeof(C) == 8) {
    f(Type<double>{});
  } else if (dtype == DType::kFloat16) {
    f(Type<__half>{});
  } else if (dtype == DType::kBFloat16) {
    f(Type<__nv_bfloat16>{});
  } else {
    f(Type<float>{});
  }
}

// f(k, c, j) for each of the lane's columns j = 4 (lane + 32 k) + c, unrolled (v[k][c] holds column j).
template <int kChunks, typename F>
__device__ __forceinline__ void for_lane_columns(int lane, F&& f) {
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
#pragma unroll
    for (int c = 0; c < 4; ++c) f(k, c, 4 * (lane + 32 * k) + c);
  }
}

// The lane's columns of a row of `dtype` at `row` (d columns): read into v (0 past d) ...
template <int kChunks, typename C>
__device__ __forceinline__ void load_row(C (&v)[kChunks][4], const void* row, int d, int lane, DType dtype) {
  with_storage<C>(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    for_lane_columns<kChunks>(lane, [&](int k, int c, int j) {
      v[k][c] = j < d ? to_opmath(static_cast<const T*>(row)[j]) : C(0);
    });
  });
}

// ... and written from v.
template <int kChunks, typename C>
__device__ __forceinline__ void store_row(void* row, const C (&v)[kChunks][4], int d, int lane, DType dtype) {
  with_storage<C>(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    for_lane_columns<kChunks>(lane, [&](int k, int c, int j) {
      if (j < d) static_cast<T*>(row)[j] = from_opmath<T>(v[k][c]);
    });
  });
}

template <int kKind, int kChunks, typename C>
__global__ void __launch_bounds__(kThreads)
chain_row_kernel(const void* __restrict__ x,  // [B, d] of dtype
                 void* __restrict__ out,      // [B, d] of dtype
                 void* __restrict__ traj,     // [B, kept, d] of dtype
                 DType dtype, ChainArgs<C> a, PhiloxState philox) {
  const int64_t elem = dtype == DType::kFloat64 ? 8 : dtype == DType::kFloat32 ? 4 : 2;  // bytes
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (r >= a.batch) return;  // whole warps leave together
  const int d = a.d;
  const int64_t n = a.batch * d, row_base = r * d;
  const bool groups_aligned = d % 4 == 0;  // then each chunk is one Philox group
  const PhiloxKey key = a.noise ? PhiloxKey{} : unpack_key(philox);
  C v[kChunks][4];
  load_row(v, static_cast<const char*>(x) + row_base * elem, d, lane, dtype);
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
      float4 e4{};
      if (!a.noise && groups_aligned) e4 = normal4(key, t, (row_base + j0) / 4);
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
          eps = static_cast<C>(component(normal4(key, t, i / 4), static_cast<int>(i % 4)));
        }
        v[k][c] = langevin_update(v[k][c], grad[k][c], eps, a.s, a.clamp);
        finite = finite && isfinite(v[k][c]);
      }
    }
    if (keep) store_row(static_cast<char*>(traj) + (r * a.kept + slot) * d * elem, v, d, lane, dtype);
    if (!finite && !noted) {  // diverged: rare
      note_non_finite(a.finite_steps, r, t);
      noted = true;
    }
  }
  store_row(static_cast<char*>(out) + row_base * elem, v, d, lane, dtype);
}

}  // namespace

template <int kKind, typename C>
static void launch_row(int chunks, DType dtype, const void* x, void* out, void* traj, const ChainArgs<C>& a,
                       const PhiloxState& philox, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>((a.batch + kWarps - 1) / kWarps);
  switch (chunks) {
    case 1: chain_row_kernel<kKind, 1, C><<<grid, kThreads, 0, stream>>>(x, out, traj, dtype, a, philox); break;
    case 2: chain_row_kernel<kKind, 2, C><<<grid, kThreads, 0, stream>>>(x, out, traj, dtype, a, philox); break;
    case 4: chain_row_kernel<kKind, 4, C><<<grid, kThreads, 0, stream>>>(x, out, traj, dtype, a, philox); break;
    default:
      chain_row_kernel<kKind, kMaxRowChunks, C><<<grid, kThreads, 0, stream>>>(x, out, traj, dtype, a, philox);
  }
}

template <typename C>
void launch_rows(int kind, int chunks, DType dtype, const void* x, void* out, void* traj, const ChainArgs<C>& a,
                 const PhiloxState& philox, cudaStream_t stream) {
  if (kind == kRosenbrock) {
    launch_row<kRosenbrock, C>(chunks, dtype, x, out, traj, a, philox, stream);
  } else {
    launch_row<kAckley, C>(chunks, dtype, x, out, traj, a, philox, stream);
  }
}

template void launch_rows<float>(int, int, DType, const void*, void*, void*, const ChainArgs<float>&,
                                 const PhiloxState&, cudaStream_t);
template void launch_rows<double>(int, int, DType, const void*, void*, void*, const ChainArgs<double>&,
                                  const PhiloxState&, cudaStream_t);

}  // namespace chain
}  // namespace torchkern
