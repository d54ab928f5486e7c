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
// its squared sum) ~T d_in d_out; the host picks the Gram form when T (d_in + d_out) <= d_in d_out
// and otherwise computes the materialized form with cuBLAS (per_sample/twins.py use_gram: same rule).
//
// Results come back in the compute type (float32 for float16/bfloat16 inputs, whose squared norms
// overflow easily in half precision). Every block writes its own partial sum: deterministic.
#include <ATen/core/Tensor.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "torchkern/checks.h"
#include "torchkern/dispatch.h"
#include "torchkern/launch.h"
#include "torchkern/reduce.cuh"

namespace torchkern {
namespace {

// ------------------------------------------------------------------ no sequence dim

constexpr int kRowThreads = 256;

template <typename T, bool kBias>
__global__ void __launch_bounds__(kRowThreads)
rows_sq_norms_kernel(at::opmath_type<T>* __restrict__ out,  // [B]
                     const T* __restrict__ a,               // [B, d_in]
                     const T* __restrict__ g,               // [B, d_out]
                     int64_t d_in, int64_t d_out) {
  using C = at::opmath_type<T>;
  __shared__ C scratch[kRowThreads / 32];
  const int64_t i = blockIdx.x;
  const T* ai = a + i * d_in;
  const T* gi = g + i * d_out;
  C sa = 0, sg = 0;
  for (int64_t k = threadIdx.x; k < d_in; k += kRowThreads) {
    const C x = static_cast<C>(ai[k]);
    sa += x * x;
  }
  for (int64_t k = threadIdx.x; k < d_out; k += kRowThreads) {
    const C x = static_cast<C>(gi[k]);
    sg += x * x;
  }
  sa = block_reduce<kRowThreads>(sa, scratch);
  sg = block_reduce<kRowThreads>(sg, scratch);
  if (threadIdx.x == 0) out[i] = kBias ? sg * sa + sg : sg * sa;
}

// ------------------------------------------------------------------ sequence dim: Gram tiles

constexpr int kTile = 32;                   // Gram tile: kTile x kTile entries per block
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
        for (int e = 0; e < 4; ++e) regs[j].e[e] = static_cast<C>(raw.e[e]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (col + e < K) regs[j].e[e] = static_cast<C>(src[e]);
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
gram_sq_norms_kernel(at::opmath_type<T>* __restrict__ out,  // [B, pairs]
                     const T* __restrict__ a,               // [B, T, d_in]
                     const T* __restrict__ g,               // [B, T, d_out]
                     int64_t T_len, int64_t d_in, int64_t d_out, int tiles, bool vec_a, bool vec_g) {
  using C = at::opmath_type<T>;
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

// ------------------------------------------------------------------ host

// The rule per_sample/twins.py use_gram applies too: Gram form when it does fewer FLOPs than materializing.
bool use_gram(int64_t T_len, int64_t d_in, int64_t d_out) { return T_len * (d_in + d_out) <= d_in * d_out; }

bool quad_aligned(const void* ptr, int64_t K, int64_t elem) {
  return K % 4 == 0 && reinterpret_cast<std::uintptr_t>(ptr) % (4 * elem) == 0;
}

at::Tensor linear_grad_sq_norms_cuda(const at::Tensor& a, const at::Tensor& g, bool bias) {
  TORCHKERN_OP("linear_grad_sq_norms");
  TORCHKERN_CHECK_FLOAT(a);
  TORCHKERN_CHECK_FLOAT(g);
  TORCHKERN_CHECK_SAME_DTYPE(a, g);
  TORCHKERN_CHECK_SAME_DEVICE(a, g);
  TORCHKERN_CHECK(a.dim() == 2 || a.dim() == 3, "a must have shape [B, d_in] or [B, T, d_in], got ", a.sizes());
  TORCHKERN_CHECK(g.dim() == a.dim() && g.size(0) == a.size(0) && (a.dim() == 2 || g.size(1) == a.size(1)),
                  "g must have shape ", a.dim() == 2 ? "[B, d_out]" : "[B, T, d_out]", " with B",
                  a.dim() == 2 ? "" : ", T", " like a ", a.sizes(), ", got ", g.sizes());
  TORCHKERN_CHECK_CUDA(a);
  const at::cuda::OptionalCUDAGuard guard(a.device());
  const at::ScalarType out_type = a.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t batch = a.size(0), d_in = a.size(-1), d_out = g.size(-1);
  const int64_t T_len = a.dim() == 3 ? a.size(1) : 1;
  at::Tensor out = at::empty({batch}, a.options().dtype(out_type));
  if (batch == 0) return out;
  if (T_len == 0 || (d_in == 0 && (d_out == 0 || !bias))) return out.zero_();
  const at::Tensor ac = a.contiguous(), gc = g.contiguous();

  if (a.dim() == 3 && !use_gram(T_len, d_in, d_out)) {
    // Long sequences: W_i = g_i^T a_i is cheaper than two T x T Gram matrices (cuBLAS, compute type).
    const at::Tensor gf = gc.to(out_type), af = ac.to(out_type);
    at::Tensor sq = at::bmm(gf.transpose(1, 2), af).square_().sum({1, 2});
    if (bias) sq.add_(gf.sum(1).square_().sum(1));
    return sq;
  }

  TORCHKERN_DISPATCH_FLOATING(a.scalar_type(), "linear_grad_sq_norms", [&] {
    using C = at::opmath_type<scalar_t>;
    C* o = out.mutable_data_ptr<C>();
    const scalar_t* pa = ac.const_data_ptr<scalar_t>();
    const scalar_t* pg = gc.const_data_ptr<scalar_t>();
    const cudaStream_t stream = current_stream();
    TORCHKERN_BOOL_SWITCH(bias, kBias, [&] {
      if (a.dim() == 2) {
        rows_sq_norms_kernel<scalar_t, kBias><<<batch, kRowThreads, 0, stream>>>(o, pa, pg, d_in, d_out);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return;
      }
      const int tiles = static_cast<int>((T_len + kTile - 1) / kTile);
      const int pairs = tiles * (tiles + 1) / 2;
      TORCHKERN_CHECK(pairs <= 65535, "sequence length ", T_len, " is too long for the Gram kernel");
      const size_t smem = sizeof(C) * (2 * kTile * kPitch + 2 * kTile * (kTile + 1));
      auto kernel = gram_sq_norms_kernel<scalar_t, kBias>;
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      at::Tensor partial = pairs == 1 ? out : at::empty({batch, pairs}, out.options());
      const dim3 grid(static_cast<unsigned>(batch), static_cast<unsigned>(pairs));
      kernel<<<grid, kGramThreads, smem, stream>>>(partial.mutable_data_ptr<C>(), pa, pg, T_len, d_in, d_out, tiles,
                                                  quad_aligned(pa, d_in, sizeof(scalar_t)),
                                                  quad_aligned(pg, d_out, sizeof(scalar_t)));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (pairs > 1) at::sum_out(out, partial, {1});
    });
  });
  return out;
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) { m.impl("linear_grad_sq_norms", &torchkern::linear_grad_sq_norms_cuda); }
