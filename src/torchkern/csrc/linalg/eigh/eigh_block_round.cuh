// The block method's rounds (eigh_block_method.cu includes this file; docs/design.md, "Symmetric eigensolver"). After
// a round's tile solves, one launch applies J = diag(U_0 .. U_{P-1}) to both sides of A and to the basis W while the
// block rows move to their next seats (the circle method), on the float64 tensor cores.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jacobi_tiles.cuh"

#if !defined(TORCHKERN_EIGH_BLOCK)
#error "build through torchkern's loader: it defines the TORCHKERN_EIGH_* constants (linalg/constants.py)"
#endif

namespace torchkern {
namespace eigh {
namespace {  // (one translation unit includes this file)

constexpr int kBlock = TORCHKERN_EIGH_BLOCK;

// The seat a half block row (b rows) moves to after a round, positions 2k (T_k: the first half of pair slot k)
// and 2k + 1 (B_k, its second half): the circle method's moves, T_0 stays, T_k -> T_{k+1} (1 <= k <= P - 2),
// T_{P-1} -> B_{P-1}, B_k -> B_{k-1} (k >= 1), B_0 -> T_1. Every pair of block rows shares a slot once in
// 2P - 1 rounds, after which every one is back at its starting seat.
__host__ __device__ inline int next_position(int pos, int P) {
  const int k = pos / 2;
  if (pos % 2 == 0) return k == 0 ? 0 : (k <= P - 2 ? 2 * (k + 1) : 2 * (P - 1) + 1);
  return k >= 1 ? 2 * (k - 1) + 1 : 2;
}

// A round of the block method after its tile solves, in one launch: A' = Pi J^T A J Pi^T and W' = Pi J^T W, with
// J = diag(U_0 .. U_{P-1}) (U_k: pair slot k's 2b x 2b rotation) and Pi the moves above. Block (k, l) of J^T A J
// is U_k^T A_kl U_l, so every 2b x 2b tile is independent: a thread block takes one tile of A (k <= l; the
// mirror tile (l, k) is the transpose, stored from the same results, so A' stays exactly symmetric) or of W (one
// side: U_k^T W_kl, W's columns stay), multiplies in shared memory on the float64 tensor cores (mma m8n8k4) and
// stores each b x b quarter at its half rows' (and, for A, half columns') next seats. It replaces fifteen
// batched cuBLAS products and a transposing copy per round, whose small shapes (2b rows by N) kept them at a
// fifth of the float64 tensor-core rate, and whose three passes over A cost memory traffic. A matrix that has
// converged (U = I) only moves its tiles.
constexpr int kPair = 2 * kBlock;     // rows of a pair slot, the tile size
constexpr int kRoundLd = kPair + 4;   // shared row stride in doubles: = 4 (mod 16) spreads a fragment load's lanes
constexpr int kRoundThreads = 256;    // 8 warps, each 16 x 32 of the 64 x 64 output (2 x 4 mma tiles)
// U_k (then U_l) and the tile (then T): 68 KiB, so three blocks share an sm_90 multiprocessor and the kernel fits
// the 99 KiB a block may have on sm_86 and sm_89
constexpr size_t kRoundSmem = 2 * size_t(kPair) * kRoundLd * sizeof(double);
static_assert(kPair == 64 && kPair == jacobi::tiles::kM,
              "block_round_kernel's warp tiling and the tile solver cover 64 x 64 tiles (EIGH_BLOCK = 32)");

// A round's thread blocks per matrix: A's tiles (k, l) with k <= l, then W's P^2 tiles.
__host__ __device__ inline int upper_tiles(int P) { return P * (P + 1) / 2; }
__host__ __device__ inline int round_jobs(int P) { return upper_tiles(P) + P * P; }

// d += a b (D 8 x 8, A 8 x 4 row-major, B 4 x 8 column-major; lane = 4 g + q holds A[g][q], B[q][g] and
// D[g][2q], D[g][2q + 1]).
__device__ __forceinline__ void dmma(double (&d)[2], double a, double b) {
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
               : "+d"(d[0]), "+d"(d[1])
               : "d"(a), "d"(b));
}

// kPair x kPair doubles from src (rows `ld` apart) to shared dst (rows kRoundLd apart), 16 bytes per load.
// (The global side through __ldg, as in every kernel that reads the block method's buffers from BlockBuffers: a
// pointer loaded from memory is a generic one, whose plain loads and stores were generic instructions, and the
// round kernel 26% slower.)
__device__ __forceinline__ void load_pair_tile(double* __restrict__ dst, const double* __restrict__ src, int64_t ld) {
  for (int i = threadIdx.x; i < kPair * kPair / 2; i += kRoundThreads) {
    const int r = i / (kPair / 2), c = 2 * (i % (kPair / 2));
    *reinterpret_cast<double2*>(dst + r * kRoundLd + c) = __ldg(reinterpret_cast<const double2*>(src + r * ld + c));
  }
}

// acc += L R over k (kPair) for this warp's 16 x 32 region at (row0, col0): L(i, m) is left[m][i] when
// kLeftT (U_k^T, read from U_k as stored), else left[i][m]; R(m, j) = right[m][j].
template <bool kLeftT>
__device__ __forceinline__ void pair_product(const double* __restrict__ left, const double* __restrict__ right,
                                             int row0, int col0, double (&acc)[2][4][2]) {
  const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
#pragma unroll 4
  for (int k0 = 0; k0 < kPair; k0 += 4) {
    double a[2], b[4];
#pragma unroll
    for (int rt = 0; rt < 2; ++rt) {
      const int i = row0 + 8 * rt + g, m = k0 + q;
      a[rt] = kLeftT ? left[m * kRoundLd + i] : left[i * kRoundLd + m];
    }
#pragma unroll
    for (int ct = 0; ct < 4; ++ct) b[ct] = right[(k0 + q) * kRoundLd + col0 + 8 * ct + g];
#pragma unroll
    for (int rt = 0; rt < 2; ++rt) {
#pragma unroll
      for (int ct = 0; ct < 4; ++ct) dmma(acc[rt][ct], a[rt], b[ct]);
    }
  }
}

// From the buffers of round parity `from` to the others (jacobi::tiles::BlockBuffers).
__global__ void __launch_bounds__(kRoundThreads, 3)
    block_round_kernel(const jacobi::tiles::BlockBuffers* __restrict__ buf, int from, int N, int P) {
  extern __shared__ __align__(16) double round_smem[];
  double* u = round_smem;  // U_k, then U_l
  double* tile = round_smem + kPair * kRoundLd;
  // the job: a tile (k, l), k <= l, of A (the first P (P + 1) / 2 of a matrix's jobs), else a tile of W
  const int a_jobs = upper_tiles(P), jobs = round_jobs(P);
  const int64_t mat = blockIdx.x / jobs;
  int job = static_cast<int>(blockIdx.x % jobs), k = 0, l;
  const bool two_sided = job < a_jobs;
  if (two_sided) {
    while (job >= P - k) job -= P - k++;
    l = k + job;
  } else {
    k = (job - a_jobs) / P;
    l = (job - a_jobs) % P;
  }
  const int64_t NN = int64_t(N) * N;
  const double* src = (two_sided ? buf->a[from] : buf->w[from]) + mat * NN;
  double* dst = (two_sided ? buf->a[1 - from] : buf->w[1 - from]) + mat * NN;
  const double* U = buf->U;
  const bool rotate = buf->active[mat] != 0;  // uniform over the block
  load_pair_tile(tile, src + int64_t(k) * kPair * N + l * kPair, N);
  if (rotate) load_pair_tile(u, U + (mat * P + k) * kPair * kPair, kPair);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int row0 = (warp / 2) * 16, col0 = (warp % 2) * 32;
  double acc[2][4][2];
  const auto each = [&](auto&& f) {  // f(rt, ct, row, col) over this lane's accumulator pairs
#pragma unroll
    for (int rt = 0; rt < 2; ++rt) {
#pragma unroll
      for (int ct = 0; ct < 4; ++ct) f(rt, ct, row0 + 8 * rt + g, col0 + 8 * ct + 2 * q);
    }
  };
  if (rotate) {
    each([&](int rt, int ct, int, int) { acc[rt][ct][0] = acc[rt][ct][1] = 0.0; });
    pair_product<true>(u, tile, row0, col0, acc);  // T = U_k^T X
    if (two_sided) {  // then T U_l: T replaces X and U_l replaces U_k (after every warp has read both)
      __syncthreads();
      each([&](int rt, int ct, int r, int c) {
        *reinterpret_cast<double2*>(tile + r * kRoundLd + c) = make_double2(acc[rt][ct][0], acc[rt][ct][1]);
        acc[rt][ct][0] = acc[rt][ct][1] = 0.0;
      });
      load_pair_tile(u, U + (mat * P + l) * kPair * kPair, kPair);
      __syncthreads();
      pair_product<false>(tile, u, row0, col0, acc);
    }
  } else {  // converged: the tile moves unchanged
    each([&](int rt, int ct, int r, int c) {
      acc[rt][ct][0] = tile[r * kRoundLd + c];
      acc[rt][ct][1] = tile[r * kRoundLd + c + 1];
    });
  }
  // store: rows of half s of pair slot k go to seat next(2k + s); A's columns likewise, W's stay
  each([&](int rt, int ct, int r, int c) {
    const int64_t dr = int64_t(next_position(2 * k + r / kBlock, P)) * kBlock + r % kBlock;
    const int64_t dc = two_sided ? int64_t(next_position(2 * l + c / kBlock, P)) * kBlock + c % kBlock
                                 : int64_t(l) * kPair + c;
    __stwb(reinterpret_cast<double2*>(dst + dr * N + dc), make_double2(acc[rt][ct][0], acc[rt][ct][1]));
    if (two_sided && k != l) {  // the mirror tile
      __stwb(dst + dc * N + dr, acc[rt][ct][0]);
      __stwb(dst + (dc + 1) * N + dr, acc[rt][ct][1]);
    }
  });
}

}  // namespace
}  // namespace eigh
}  // namespace torchkern
