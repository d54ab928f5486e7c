// linear_grad_sq_norms(a, g, bias): squared per-sample gradient norms of an nn.Linear layer
// without materializing the per-sample gradients (docs/design.md, "Per-sample gradients").
//
//   no sequence dim, a [B, d_in], g [B, d_out]:   ||W_i||^2 = ||g_i||^2 ||a_i||^2,   ||b_i||^2 = ||g_i||^2
//   sequence dim, a [B, T, d_in], g [B, T, d_out]: ||W_i||^2 = <g_i g_i^T, a_i a_i^T>_F (T x T Gram matrices),
//                                                 ||b_i||^2 = ||sum_t g_it||^2 = sum of all entries of g_i g_i^T
//
// Floors (Linear 1024 -> 1024, B = 256, float32): without T the op reads 2 MB, a single launch.
// With T = 32 it reads 64 MB and does 2 B T^2 (d_in + d_out) = 1.07 GFLOP, so it is bound by FP32
// FMA throughput: the Gram kernel keeps a 4 x 4 register tile per thread (two 16-byte shared loads
// per 16 FMAs) and splits the reduction over four thread groups of one block.
//
// The Gram form costs ~T^2 (d_in + d_out) per sample, the materialized one (W_i = g_i^T a_i, then
// its squared sum) ~T d_in d_out; ops.cpp picks the Gram form when T (d_in + d_out) <= d_in d_out
// and otherwise computes the materialized form with cuBLAS (per_sample/twins.py use_gram: same rule).
//
// Results come back in the compute type (float32 for float16/bfloat16 inputs, whose squared norms
// overflow easily in half precision). Every block writes its own partial sum: deterministic.
#include <cuda_runtime.h>

#include <cstdint>

#include "launchers.h"
#include "torchkern/dispatch.cuh"
#include "torchkern/reduce.cuh"

namespace torchkern {
namespace {

// ------------------------------------------------------------------ no sequence dim

constexpr int kRowThreads = 256;

template <typename T, bool kBias>
__global__ void __launch_bounds__(kRowThreads)
rows_sq_norms_kernel(opmath_t<T>* __restrict__ out,         // [B]
                     const T* __restrict__ a,               // [B, d_in]
                     const T* __restrict__ g,               // [B, d_out]
                     int64_t d_in, int64_t d_out) {
  using C = opmath_t<T>;
  __shared__ C scratch[kRowThreads / 32];
  const int64_t i = blockIdx.x;
  const T* ai = a + i * d_in;
  const T* gi = g + i * d_out;
  C sa = 0, sg = 0;
  for (int64_t k = threadIdx.x; k < d_in; k += kRowThreads) {
    const C x = to_opmath(ai[k]);
    sa += x * x;
  }
  for (int64_t k = threadIdx.x; k < d_out; k += kRowThreads) {
    const C x = to_opmath(gi[k]);
    sg += x * x;
  }
  sa = block_reduce<kRowThreads>(sa, scratch);
  sg = block_reduce<kRowThreads>(sg, scratch);
  if (threadIdx.x == 0) out[i] = kBias ? sg * sa + sg : sg * sa;
}

// ------------------------------------------------------------------ sequence dim: Gram tiles

constexpr int kTile = kGramTile;            // Gram tile: kTile x kTile entries per block
constexpr int kChunk = 64;                  // reduction columns staged in shared memory per step
constexpr int kGroups = 4;                  // thread groups splitting each chunk's columns
constexpr int kGramThreads = 64 * kGroups;  // 64 threads x (4 x 4 entries) = one 32 x 32 tile per group
constexpr int kPitch = kChunk + 4;          // row pitch: 16-byte aligned, conflict-free float4 reads

template <typename C>
struct alignas(4 * sizeof(C)) Quad {
  C e[4];
};

// Rows [r0, r0 + kTile) x columns [k0, k0 + kChunk) of x ([T, K], row-major), as kQuadsPerThread groups of 4
// consecutive columns per thread, converted to C and zero outside the matrix. Loaded into registers first (the
// next chunk is in flight while the current one is multiplied), then stored to shared memory.
constexpr int kQuadsPerThread = kTile * kChunk / 4 / kGramThreads;

template <typename T, typename C>
__device__ __forceinline__ void load_chunk(Quad<C> (&regs)[kQuadsPerThread], const T* __restrict__ x, int64_t T_len,
                                           int64_t K, int64_t r0, int64_t k0, bool vec_ok) {
#pragma unroll
  for (int j = 0; j < kQuadsPerThread; ++j) {
    const int q = threadIdx.x + j * kGramThreads;
    const int64_t row = r0 + q / (kChunk / 4), col = k0 + (q % (kChunk / 4)) * 4;
#pragma unroll
    for (int e = 0; e < 4; ++e) regs[j].e[e] = C(0);
    if (row < T_len) {
      const T* src = x + row * K + col;
      if (vec_ok && col + 3 < K) {
        struct alignas(4 * sizeof(T)) Raw { T e[4]; };
        const Raw raw = *reinterpret_cast<const Raw*>(src);
#pragma unroll
        for (int e = 0; e < 4; ++e) regs[j].e[e] = to_opmath(raw.e[e]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (col + e < K) regs[j].e[e] = to_opmath(src[e]);
      }
    }
  }
}

template <typename C>
__device__ __forceinline__ void store_chunk(C* __restrict__ dst, const Quad<C> (&regs)[kQuadsPerThread]) {
#pragma unroll
  for (int j = 0; j < kQuadsPerThread; ++j) {
    const int q = threadIdx.x + j * kGramThreads;
    *reinterpret_cast<Quad<C>*>(dst + (q / (kChunk / 4)) * kPitch + (q % (kChunk / 4)) * 4) = regs[j];
  }
}

// Tile (p, q) of the Gram matrix x x^T: each thread accumulates rows tr + 8 u, columns tc + 8 v of the tile
// (u, v < 4) over its group's quarter of each chunk; the tile summed over the groups ends in
// red[kTile][kTile + 1] (shared).
template <typename T, typename C>
__device__ void gram_tile(C* __restrict__ red, C* __restrict__ sp, C* __restrict__ sq, const T* __restrict__ x,
                          int64_t T_len, int64_t K, int64_t p0, int64_t q0, bool vec_ok) {
  const int group = threadIdx.x / 64, lane = threadIdx.x % 64, tr = lane % 8, tc = lane / 8;
  const bool diagonal = p0 == q0;
  C acc[4][4];
#pragma unroll
  for (int u = 0; u < 4; ++u)
#pragma unroll
    for (int v = 0; v < 4; ++v) acc[u][v] = 0;
  const C* cols = diagonal ? sp : sq;
  Quad<C> next_p[kQuadsPerThread], next_q[kQuadsPerThread];
  load_chunk<T, C>(next_p, x, T_len, K, p0, 0, vec_ok);
  if (!diagonal) load_chunk<T, C>(next_q, x, T_len, K, q0, 0, vec_ok);
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    __syncthreads();  // previous chunk consumed
    store_chunk<C>(sp, next_p);
    if (!diagonal) store_chunk<C>(sq, next_q);
    __syncthreads();
    if (k0 + kChunk < K) {
      load_chunk<T, C>(next_p, x, T_len, K, p0, k0 + kChunk, vec_ok);
      if (!diagonal) load_chunk<T, C>(next_q, x, T_len, K, q0, k0 + kChunk, vec_ok);
    }
#pragma unroll
    for (int kk = group * (kChunk / kGroups); kk < (group + 1) * (kChunk / kGroups); kk += 4) {
      Quad<C> rv[4], cv[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        rv[u] = *reinterpret_cast<const Quad<C>*>(sp + (tr + 8 * u) * kPitch + kk);
        cv[u] = *reinterpret_cast<const Quad<C>*>(cols + (tc + 8 * u) * kPitch + kk);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e)
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
          for (int v = 0; v < 4; ++v) acc[u][v] += rv[u].e[e] * cv[v].e[e];
    }
  }
  // Sum the groups' partial tiles: group 0 writes, the others add in turn (fixed order: deterministic).
  for (int gi = 0; gi < kGroups; ++gi) {
    __syncthreads();
    if (group == gi) {
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          C& slot = red[(tr + 8 * u) * (kTile + 1) + tc + 8 * v];
          slot = gi == 0 ? acc[u][v] : slot + acc[u][v];
        }
    }
  }
  __syncthreads();
}

// One block per (sample, upper-triangular tile pair (p, q)): out[i, pair] = w * (sum_{ts} A_ts G_ts [+ G_ts]),
// w = 2 for an off-diagonal pair (the Gram matrices are symmetric), 1 on the diagonal.
template <typename T, bool kBias>
__global__ void __launch_bounds__(kGramThreads)
gram_sq_norms_kernel(opmath_t<T>* __restrict__ out,         // [B, pairs]
                     const T* __restrict__ a,               // [B, T, d_in]
                     const T* __restrict__ g,               // [B, T, d_out]
                     int64_t T_len, int64_t d_in, int64_t d_out, int tiles, bool vec_a, bool vec_g) {
  using C = opmath_t<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  C* sp = reinterpret_cast<C*>(smem_raw);  // [kTile][kPitch]
  C* sq = sp + kTile * kPitch;             // [kTile][kPitch]
  C* ra = sq + kTile * kPitch;             // [kTile][kTile + 1]: A tile
  C* rg = ra + kTile * (kTile + 1);        // [kTile][kTile + 1]: G tile
  __shared__ C scratch[kGramThreads / 32];

  const int64_t i = blockIdx.x;
  int pair = blockIdx.y, p = 0;
  while (pair >= tiles - p) pair -= tiles - p++;  // pair index -> (p, q), p <= q
  const int q = p + pair;
  gram_tile<T, C>(ra, sp, sq, a + i * T_len * d_in, T_len, d_in, int64_t(p) * kTile, int64_t(q) * kTile, vec_a);
  gram_tile<T, C>(rg, sp, sq, g + i * T_len * d_out, T_len, d_out, int64_t(p) * kTile, int64_t(q) * kTile, vec_g);
  C s = 0;
  for (int e = threadIdx.x; e < kTile * kTile; e += kGramThreads) {
    const int idx = (e / kTile) * (kTile + 1) + e % kTile;
    s += kBias ? rg[idx] * (ra[idx] + C(1)) : rg[idx] * ra[idx];
  }
  s = block_reduce<kGramThreads>(s, scratch);
  if (threadIdx.x == 0) out[i * gridDim.y + blockIdx.y] = p == q ? s : C(2) * s;
}

bool quad_aligned(const void* ptr, int64_t K, int64_t elem) {
  return K % 4 == 0 && reinterpret_cast<std::uintptr_t>(ptr) % (4 * elem) == 0;
}

}  // namespace

cudaError_t linear_grad_sq_norms_launch(const LinearGradSqNormsParams& p, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = opmath_t<T>;
    C* o = static_cast<C*>(p.out);
    const T* pa = static_cast<const T*>(p.a);
    const T* pg = static_cast<const T*>(p.g);
    return TORCHKERN_BOOL_SWITCH(p.bias, kBias, [&] {
      if (!p.sequence) {
        rows_sq_norms_kernel<T, kBias><<<p.batch, kRowThreads, 0, stream>>>(o, pa, pg, p.d_in, p.d_out);
        return cudaGetLastError();
      }
      const int tiles = static_cast<int>((p.T_len + kTile - 1) / kTile);
      const auto pairs = static_cast<unsigned>(gram_pairs(p.T_len));  // ops.cpp checked it against kMaxGramPairs
      const size_t smem = sizeof(C) * (2 * kTile * kPitch + 2 * kTile * (kTile + 1));
      auto kernel = gram_sq_norms_kernel<T, kBias>;
      TORCHKERN_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      const dim3 grid(static_cast<unsigned>(p.batch), pairs);
      kernel<<<grid, kGramThreads, smem, stream>>>(o, pa, pg, p.T_len, p.d_in, p.d_out, tiles,
                                                  quad_aligned(pa, p.d_in, sizeof(T)),
                                                  quad_aligned(pg, p.d_out, sizeof(T)));
      return cudaGetLastError();
    });
  });
}

}  // namespace torchkern
