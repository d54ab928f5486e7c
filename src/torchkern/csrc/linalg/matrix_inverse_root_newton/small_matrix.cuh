// Small dense matrices held in one thread block's shared memory: a register-tiled fp32/fp64
// GEMM (in place: C = A * B may overwrite A or B), block reductions, and the scaled coupled
// Newton iteration for the matrix inverse p-th root of one matrix per block (the math, and why
// it is scaled, in linalg/twins.py; newton_scaling below is shared with the large path).
//
// Layout: an NMAX x NMAX matrix, row-major with leading dimension LD = NMAX + 4 (16-byte rows,
// rows 4 banks apart). Matrices of size n < NMAX are zero-padded, and every product keeps the
// padding zero, so the GEMM needs no bounds checks.
//
// Thread tiling: THREADS = TX * TY threads; thread (tx, ty) owns rows ty + TY*i (i < TM) and
// columns 4*tx + 4*TX*j + e (j < TN4, e < 4). Per step of 4 k's it loads TM 4-wide A fragments
// (rows of A, one 16-byte load each; the warp's two ty values make them broadcasts) and 4*TN4
// 4-wide B fragments (a row of B, contiguous across tx), then does TM*4*TN4*4 FMAs: for
// NMAX = 128 (8 x 8 tile, 256 threads) that is 256 FMAs per 16 loads.
//
// Pairs (CLUSTER = 2, sm_90): a batch too small to fill the GPU with one block per matrix (64
// matrices of 128^2 left half of an H200's SMs idle) runs each matrix on a cluster of two blocks.
// Both keep full copies of X, M and P; each computes half of every product's tiles and writes
// them to its own and its peer's copy (distributed shared memory), so the copies stay bitwise
// equal and both blocks take the same scalar decisions (err, scaling, stopping) in lockstep.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "../cluster.cuh"
#include "launchers.h"
#include "torchkern/dispatch.cuh"
#include "torchkern/launch.cuh"
#include "torchkern/reduce.cuh"

namespace torchkern {

// Stall rule and scaling floor of the Newton iteration, and the Lanczos estimate's constants: from
// torchkern/linalg/constants.py, as -D flags from the loader (the twin imports the same names).
#if !defined(TORCHKERN_NEWTON_STALL_BELOW) || !defined(TORCHKERN_LANCZOS_STEPS)
#error "build through torchkern's loader: it defines the TORCHKERN_NEWTON_* constants (linalg/constants.py)"
#endif
constexpr double kStallBelow = TORCHKERN_NEWTON_STALL_BELOW;
constexpr double kStallRatio = TORCHKERN_NEWTON_STALL_RATIO;
constexpr double kScaleFloor = TORCHKERN_NEWTON_SCALE_FLOOR;

// One step of the scaled iteration for a spectrum in [low, 1]: P = a I + b M, and the lower bound
// after the step (linalg/twins.py: newton_scaling, same formulas, in double on every path).
struct NewtonScaling {
  double a, b, next_low;
};

__host__ __device__ inline NewtonScaling newton_scaling(double low, int p) {
  double c = 1.0;
  if (low < 1.0) {
    const double lg = log(low);
    c = (p + 1) * expm1(lg / p) / expm1(lg * (p + 1) / p);
    c = c >= 1.0 ? fmin(c, 1.0 + 0.5 * p) : 1.0;  // also NaN -> 1
  }
  const double s = pow(c, 1.0 / p);
  const double x = c * low;
  const double hx = x * pow((p + 1 - x) / p, p), hc = c * pow((p + 1 - c) / p, p);
  return {s * (p + 1) / p, -s * c / p, fmin(hx, hc)};
}

// The first bound on the bottom of M0's spectrum (linalg/twins.py): the largest of eps / u,
// 1 - ||M0 - I||_inf, the floor, and the Lanczos estimate `ritz` of M0's smallest eigenvalue
// (smallest_ritz_value below; NaN: none) divided by kRitzHedge; at most 1.
constexpr double kRitzHedge = TORCHKERN_RITZ_HEDGE;
constexpr int kLanczosSteps = TORCHKERN_LANCZOS_STEPS;
constexpr int kLanczosMinN = TORCHKERN_LANCZOS_MIN_N;  // below, the estimate costs about what it saves

__host__ __device__ inline double newton_first_low(double eps, double u, double err, double ritz) {
  const double bound = fmax(fmax(eps / u, 1.0 - err), kScaleFloor);
  return fmin(1.0, fmax(bound, ritz / kRitzHedge));  // fmax drops a NaN estimate
}

namespace small_matrix {

template <int NMAX_, int TM_, int TN4_, int CLUSTER_ = 1>
struct Config {
  static constexpr int NMAX = NMAX_, TM = TM_, TN4 = TN4_, CLUSTER = CLUSTER_;
  static constexpr int TX = NMAX / (4 * TN4);  // threads along columns
  static constexpr int TY = NMAX / TM;         // threads along rows
  static constexpr int THREADS = TX * TY;
  static constexpr int LD = NMAX + 4;
  static_assert(TX <= 32 && 32 % TX == 0, "a row's threads must sit in one warp");
  static_assert(THREADS % 32 == 0, "whole warps");
  // NMAX >= 64: products use the symmetric path (sym_gemm_inplace) on a 16 x 16 grid of T x T tiles
  static constexpr bool kSym = NMAX >= 64;
  static constexpr int T = NMAX / 16;
  static_assert(!kSym || (THREADS == 256 && T % 4 == 0), "the symmetric path wants 8 warps and 4 | T");
  static_assert(CLUSTER == 1 || (CLUSTER == 2 && kSym), "pairs split the symmetric path's tiles");
  template <typename C>
  static constexpr size_t smem_bytes() { return 3 * size_t(NMAX) * LD * sizeof(C); }
};

template <typename C>
struct Four {
  C v[4];
};

template <typename C>
__device__ __forceinline__ Four<C> load4(const C* p) {
  Four<C> r;
  if constexpr (sizeof(C) == 4) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    r.v[0] = t.x, r.v[1] = t.y, r.v[2] = t.z, r.v[3] = t.w;
  } else {
    const double2 a = reinterpret_cast<const double2*>(p)[0], b = reinterpret_cast<const double2*>(p)[1];
    r.v[0] = a.x, r.v[1] = a.y, r.v[2] = b.x, r.v[3] = b.y;
  }
  return r;
}

template <typename C>
__device__ __forceinline__ void store4(C* p, const C* v) {
  if constexpr (sizeof(C) == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    reinterpret_cast<double2*>(p)[0] = make_double2(v[0], v[1]);
    reinterpret_cast<double2*>(p)[1] = make_double2(v[2], v[3]);
  }
}

template <typename C>
__device__ __forceinline__ void store2(C* p, C a, C b) {
  if constexpr (sizeof(C) == 4) *reinterpret_cast<float2*>(p) = make_float2(a, b);
  else *reinterpret_cast<double2*>(p) = make_double2(a, b);
}

// ---------------------------------------------------------------------------------------------
// Lanczos estimate of the smallest eigenvalue of a symmetric n x n matrix in shared memory (twin:
// smallest_ritz_value in linalg/twins.py: same start vector, steps and early stop) by a block of
// WARPS warps: min(kLanczosSteps, n) steps without reorthogonalization (the smallest Ritz value
// stays above the smallest eigenvalue, which is all the estimate needs), then the smallest
// eigenvalue of the tridiagonal matrix T by multisection on Sturm counts. A v is computed as A^T v:
// lane l owns columns 4l..4l+3 (so n <= 128) and warp w rows w, w + WARPS, ... < ROWS (rows
// n..ROWS-1 must be zero); warp 0 sums the warps' pieces and does the vector work, while the others
// wait at the step's barrier. The steps' latency, not their arithmetic, is the cost, which is why
// the kernels ask for the estimate only where it saves more than it costs (kLanczosMinN).

// Start vector entry i (before normalization): a 32-bit integer hash of i, mapped to [-1/2, 1/2).
__device__ __forceinline__ double lanczos_start(uint32_t i) {
  uint32_t x = (i + 1u) * 2654435761u;
  x ^= x >> 15;
  x *= 2246822519u;
  x ^= x >> 13;
  return static_cast<double>(x) * 0x1p-32 - 0.5;
}

// The bookkeeping after Lanczos step j (diagonal a, previous off-diagonal beta_last, new one b), shared
// by both paths and the twin: scale (T's largest row sum of |.| so far) grows, and the steps go on
// while b is above sqrt(machine epsilon) times scale (else an invariant subspace, or NaN: stop).
template <typename C>
__device__ __forceinline__ bool lanczos_goes_on(C a, C beta_last, C b, C& scale) {
  constexpr C kTiny = sizeof(C) == 4 ? C(3.4526698300124393e-4) : C(1.4901161193847656e-8);
  scale = fmax(scale, fabs(a) + beta_last + b);
  return b > kTiny * scale;
}

// Eigenvalues below x of the tridiagonal matrix with diagonal d and squared off-diagonal o2
// (entries past the steps taken are padded with d = 2, o2 = 0: above the scaled spectrum).
__device__ __forceinline__ int sturm_count(const float (&d)[kLanczosSteps], const float (&o2)[kLanczosSteps], float x) {
  int count = 0;
  float q = 1.0f;
#pragma unroll
  for (int i = 0; i < kLanczosSteps; ++i) {
    q = d[i] - x - (i ? __fdividef(o2[i - 1], q) : 0.0f);
    if (fabsf(q) < 1e-30f) q = -1e-30f;  // a zero pivot: x is (nearly) an eigenvalue, count it
    count += q < 0.0f;
  }
  return count;
}

// The smallest eigenvalue of T / scale (in d, o2) to float resolution, by the whole block: each
// round, thread t counts at the (t + 1)-th of THREADS + 1 points of [lo, hi] and the interval
// shrinks to the piece that holds it. ballots: shared scratch of THREADS / 32 words.
template <int THREADS>
__device__ __forceinline__ float smallest_tridiagonal_eigenvalue(const float (&d)[kLanczosSteps],
                                                                 const float (&o2)[kLanczosSteps],
                                                                 unsigned* ballots) {
  constexpr int kWarps = THREADS / 32;
  // rounds until (THREADS + 1)^rounds >= 2^24 (float resolution of T, whose norm is about 1)
  constexpr int kRounds = THREADS >= 255 ? 3 : THREADS >= 63 ? 4 : 5;
  float lo = INFINITY, hi = INFINITY;  // Gershgorin's bottom; the smallest diagonal entry (>= the answer)
#pragma unroll
  for (int i = 0; i < kLanczosSteps; ++i) {
    const float radius = (i ? sqrtf(o2[i - 1]) : 0.0f) + (i + 1 < kLanczosSteps ? sqrtf(o2[i]) : 0.0f);
    lo = fminf(lo, d[i] - radius);
    hi = fminf(hi, d[i]);
  }
  for (int round = 0; round < kRounds; ++round) {
    const float width = (hi - lo) * (1.0f / (THREADS + 1));
    const unsigned below = __ballot_sync(0xffffffffu, sturm_count(d, o2, lo + width * (threadIdx.x + 1)) > 0);
    if (threadIdx.x % 32 == 0) ballots[threadIdx.x / 32] = below;
    __syncthreads();
    int first = THREADS;  // the first point with an eigenvalue below it (THREADS: none, the answer is above all)
#pragma unroll
    for (int w = kWarps - 1; w >= 0; --w) {
      const unsigned bits = ballots[w];
      if (bits) first = 32 * w + __ffs(bits) - 1;
    }
    __syncthreads();  // ballots are rewritten next round
    hi = first < THREADS ? lo + width * (first + 1) : hi;
    lo = lo + width * first;
  }
  return 0.5f * (lo + hi);
}

// The smallest eigenvalue of the k x k tridiagonal matrix T of k Lanczos steps (diagonal alpha,
// off-diagonal beta[0..k-2]; scale: its largest row sum of |.|), by the whole block (THREADS), in float
// on T / scale. NaN where it is not finite.
template <int THREADS, typename C>
__device__ C ritz_estimate(const C* alpha, const C* beta, int k, C scale, unsigned* ballots) {
  const float s = static_cast<float>(scale), inv = s > 0.0f ? 1.0f / s : 0.0f;
  float d[kLanczosSteps], o2[kLanczosSteps];
#pragma unroll
  for (int i = 0; i < kLanczosSteps; ++i) {
    const float o = i + 1 < k ? static_cast<float>(beta[i]) * inv : 0.0f;
    d[i] = i < k ? static_cast<float>(alpha[i]) * inv : 2.0f;
    o2[i] = o * o;
  }
  const double estimate = static_cast<double>(smallest_tridiagonal_eigenvalue<THREADS>(d, o2, ballots)) * s;
  return static_cast<C>(isfinite(estimate) ? estimate : NAN);
}

// A: n <= 128 rows of `ld` entries (ld a multiple of 4, at least n; A 16-byte aligned; rows n..ROWS-1
// and the columns from n to the next multiple of 4 zero). work: shared scratch of (WARPS + 1) ld +
// 2 kLanczosSteps + 2 + WARPS C and WARPS words. Called by every thread of the block; all get the result.
// Each thread keeps its ROWS / WARPS x 4 piece of A in registers for all the steps: reading A from
// shared memory every step would take 512 cycles of its bandwidth at n = 128, more than the rest.
template <int ROWS, int WARPS, typename C>
__device__ C smallest_ritz_value(const C* A, int ld, int n, C* work) {
  static_assert(ROWS % WARPS == 0, "whole rows per warp");
  constexpr int kRows = ROWS / WARPS;           // rows per warp: warp + i WARPS
  C* partial = work;                            // [WARPS, ld] the warps' pieces of A^T v
  C* v = partial + WARPS * ld;                  // [ld] the current vector, for broadcasts
  C* alpha = v + ld;                            // [kLanczosSteps] T's diagonal
  C* beta = alpha + kLanczosSteps;              // [kLanczosSteps] T's off-diagonal
  C* dots = beta + kLanczosSteps;               // [WARPS] the warps' pieces of v . A^T v
  C* shared = dots + WARPS;                     // [0]: steps taken, [1]: the scale of T
  unsigned* ballots = reinterpret_cast<unsigned*>(shared + 2);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, c0 = 4 * lane;
  const bool owner = c0 < n;
  const int steps = min(kLanczosSteps, n);
  C piece[kRows][4];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const Four<C> a = owner ? load4(A + (warp + i * WARPS) * ld + c0) : Four<C>{};
#pragma unroll
    for (int e = 0; e < 4; ++e) piece[i][e] = a.v[e];
  }
  // warp 0's state: its lanes' parts of the current and the previous vector
  C own[4], prev[4] = {C(0), C(0), C(0), C(0)}, beta_last = C(0), scale = C(0);  // scale: largest row sum of |T|
  if (warp == 0) {
    C sq = C(0);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      own[e] = c0 + e < n ? static_cast<C>(lanczos_start(c0 + e)) : C(0);
      sq += own[e] * own[e];
    }
    const C inv_norm = C(1) / sqrt(warp_sum(sq));
#pragma unroll
    for (int e = 0; e < 4; ++e) own[e] *= inv_norm;
    if (owner) store4(v + c0, own);
    if (lane == 0) shared[0] = C(steps);
  }
  __syncthreads();
  for (int j = 0; j < steps; ++j) {
    // this warp's rows of A^T v, and their part of v . A^T v (reduced here, off warp 0's path)
    C w[4] = {C(0), C(0), C(0), C(0)};
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const C vr = v[warp + i * WARPS];
#pragma unroll
      for (int e = 0; e < 4; ++e) w[e] = fma(piece[i][e], vr, w[e]);
    }
    const Four<C> mine = load4(v + (owner ? c0 : 0));
    const C dot = warp_sum(owner ? w[0] * mine.v[0] + w[1] * mine.v[1] + w[2] * mine.v[2] + w[3] * mine.v[3] : C(0));
    if (owner) store4(partial + warp * ld + c0, w);
    if (lane == 0) dots[warp] = dot;
    __syncthreads();
    if (warp == 0) {
      C a = C(0);
#pragma unroll
      for (int q = 0; q < WARPS; ++q) a += dots[q];
      C x[4] = {C(0), C(0), C(0), C(0)};
      if (owner) {
#pragma unroll
        for (int q = 0; q < WARPS; ++q) {
          const Four<C> part = load4(partial + q * ld + c0);
#pragma unroll
          for (int e = 0; e < 4; ++e) x[e] += part.v[e];
        }
      }
      C sq = C(0);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        w[e] = x[e] - a * own[e] - beta_last * prev[e];
        sq += w[e] * w[e];
      }
      sq = warp_sum(sq);
      const C inv_b = sq > C(0) ? rsqrt(sq) : C(0), b = sq * inv_b;  // b = ||w||, and 1 / b without a division
      const bool go = lanczos_goes_on(a, beta_last, b, scale);
      if (lane == 0) alpha[j] = a, beta[j] = b, shared[1] = scale;
      if (!go) {
        if (lane == 0) shared[0] = C(j + 1);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) prev[e] = own[e], own[e] = w[e] * inv_b;
        if (owner) store4(v + c0, own);
        beta_last = b;
      }
    }
    __syncthreads();
    if (static_cast<int>(shared[0]) <= j + 1) break;  // warp 0 stopped (uniform: read after the barrier)
  }
  return ritz_estimate<32 * WARPS>(alpha, beta, static_cast<int>(shared[0]), shared[1], ballots);
}

// dst = A * B over the padded NMAX x NMAX matrices (k up to kmax, a multiple of 4 >= n); dst may
// be A or B. Returns ||dst - I_n||_inf when kErr (only meaningful with dst = M).
template <typename Cfg, typename C, bool kErr>
__device__ __forceinline__ C gemm_inplace(C* dst, const C* A, const C* B, int kmax, int n, C* scratch) {
  constexpr int TM = Cfg::TM, TN = 4 * Cfg::TN4, TX = Cfg::TX, TY = Cfg::TY, LD = Cfg::LD;
  const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
  C acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = C(0);

  const C* a_base = A + ty * LD;
  const C* b_base = B + 4 * tx;
#pragma unroll 1
  for (int k0 = 0; k0 < kmax; k0 += 4) {
    Four<C> a[TM];
#pragma unroll
    for (int i = 0; i < TM; ++i) a[i] = load4(a_base + i * TY * LD + k0);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      Four<C> b[Cfg::TN4];
#pragma unroll
      for (int j = 0; j < Cfg::TN4; ++j) b[j] = load4(b_base + (k0 + kk) * LD + 4 * TX * j);
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = fma(a[i].v[kk], b[j / 4].v[j % 4], acc[i][j]);
    }
  }
  __syncthreads();  // everyone has read A and B: now dst may be overwritten
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < Cfg::TN4; ++j) store4(dst + (ty + i * TY) * LD + 4 * tx + 4 * TX * j, &acc[i][4 * j]);
  C err = C(0);
  if constexpr (kErr) {
    // row sums of |dst - I| from the registers: partial over this thread's columns, then over the
    // TX threads of the row (adjacent lanes), then the max over rows across the block
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      const int r = ty + i * TY;
      C s = C(0);
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        const int c = 4 * tx + 4 * TX * (j / 4) + (j % 4);
        s += fabs(acc[i][j] - ((r == c && r < n) ? C(1) : C(0)));
      }
      err = nan_max(err, warp_sum<TX>(s));
    }
    err = block_reduce<Cfg::THREADS, C, true>(err, scratch);
  }
  __syncthreads();
  return err;
}

// ---------------------------------------------------------------------------------------------
// Symmetric products. Every product of the iteration (X P, P P, P^(2^j) M) multiplies commuting
// symmetric matrices, so its result is symmetric: only the T x T tiles (I, J), I <= J, of a
// 16 x 16 tile grid are computed, and each is written twice (as is and mirrored), which keeps
// X, M and P exactly symmetric (M0 is symmetrized at load). With symmetric operands
// C[r][c] = sum_k A[k][r] B[k][c]: both operands are read as rows (two 16-byte loads per T = 8
// values), and k is split over lanes with a shuffle reduction so that the work balances:
//   warps 0..6: warp w owns the 16 off-diagonal tiles of tile rows w and 14 - w (15 - w + w + 1
//     tiles), lane = t + 16 h computes tile t over k = h, h + 2, ... (h = 0, 1);
//   warp 7: the 16 diagonal tiles (upper half only, k split in 2 as above), then the 8 tiles of
//     tile row 7 (lane = t + 8 q: tile (7, 8 + t) over k = q, q + 4, ...).
// FMAs per lane: T^2 kmax / 2 (warps 0..6), (T (T+1) / 2) kmax / 2 + T^2 kmax / 4 (warp 7): about
// 0.52 of the full product. Interleaving k (rather than splitting it in two ranges) puts the lanes
// of the two halves on rows k and k + 1, i.e. on different banks.

// acc[i][j] = sum over k = k0, k0 + kstep, ... < kmax of A[k][r0 + i] * B[k][c0 + (j ^ 4 swap)]
// (= (A B)[r0 + i][c0 + (j ^ 4 swap)] for symmetric A); kDiag: only j >= i (and swap = 0).
// swap (0 or 1, T = 8) exchanges the two 16-byte halves of each B row: the 8 lanes that load
// together (a quarter warp) hold 8 consecutive tiles of one tile row, whose halves fall on only 4
// of the 8 bank groups (a row is 33 groups of 16 bytes); swapping the halves for lanes 4..7 of each
// 8 spreads them over all 8. Callers store the accumulators with the same column mask (cx = 4 swap).
template <int T, int LD, bool kDiag, typename C>
__device__ __forceinline__ void tile_product(C (&acc)[T][T], const C* A, const C* B, int r0, int c0, int k0, int kstep,
                                             int kmax, int swap = 0) {
#pragma unroll
  for (int i = 0; i < T; ++i)
#pragma unroll
    for (int j = 0; j < T; ++j) acc[i][j] = C(0);
  const C* a = A + k0 * LD + r0;
  const C* b = B + k0 * LD + c0;
  const int step = kstep * LD;
#pragma unroll 2
  for (int k = k0; k < kmax; k += kstep, a += step, b += step) {
    Four<C> av[T / 4], bv[T / 4];
#pragma unroll
    for (int s = 0; s < T / 4; ++s) av[s] = load4(a + 4 * s), bv[s] = load4(b + 4 * (T / 4 > 1 ? s ^ swap : s));
#pragma unroll
    for (int i = 0; i < T; ++i)
#pragma unroll
      for (int j = 0; j < T; ++j)
        if (!kDiag || j >= i) acc[i][j] = fma(av[i / 4].v[i % 4], bv[j / 4].v[j % 4], acc[i][j]);
  }
}

// Sum `in` with the lane whose index differs in `mask`, keeping half the rows: the lane with
// `upper` set keeps rows [R/2, R), its partner rows [0, R/2). Both get keep + received.
template <int R, int T, typename C>
__device__ __forceinline__ void halve_rows(const C (&in)[R][T], C (&out)[R / 2][T], bool upper, int mask) {
#pragma unroll
  for (int i = 0; i < R / 2; ++i)
#pragma unroll
    for (int j = 0; j < T; ++j) {
      const C lo = in[i][j], hi = in[i + R / 2][j];
      out[i][j] = (upper ? hi : lo) + __shfl_xor_sync(0xffffffffu, upper ? lo : hi, mask);
    }
}

// Rows [rb, rb + R) of tile (r0, c0) as they are (register column j is tile column j ^ cx, cx = 4 *
// tile_product's swap) ...
template <int R, int T, int LD, typename C>
__device__ __forceinline__ void store_tile_rows(C* dst, const C (&v)[R][T], int r0, int c0, int rb, int cx = 0) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int s = 0; s < T / 4; ++s) store4(dst + (r0 + rb + i) * LD + c0 + ((4 * s) ^ cx), &v[i][4 * s]);
}

// ... and mirrored into tile (c0, r0): column j of the rows becomes a piece of row c0 + j, stored
// 4 or 2 values at a time where R allows (rb is a multiple of R). The lanes that store together
// hold tiles of one tile row, so column j of all of them lies in rows 8 (T) apart, which share
// banks (a row is 4 banks): each lane writes its columns in the order j = jj ^ x, x = lane % T (with
// cx: x ^ cx), after permuting its registers with compile-time-indexed selects (a butterfly on x).
// That turns an 8-way bank conflict into none, for 3 R T selects. cx as in store_tile_rows.
template <int R, int T, int LD, typename C>
__device__ __forceinline__ void store_tile_mirror(C* dst, const C (&v)[R][T], int r0, int c0, int rb, int cx = 0) {
  const int x = (threadIdx.x % T) ^ cx;  // the rows written, jj ^ x ^ cx = jj ^ (lane % T), differ across lanes
  C w[R][T];
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < T; ++j) w[i][j] = v[i][j];
#pragma unroll
  for (int b = 1; b < T; b <<= 1) {  // afterwards w[i][jj] = v[i][jj ^ x]
    const bool flip = x & b;
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int j = 0; j < T; ++j) {
        if (j & b) continue;
        const C lo = w[i][j], hi = w[i][j | b];
        w[i][j] = flip ? hi : lo;
        w[i][j | b] = flip ? lo : hi;
      }
  }
#pragma unroll
  for (int jj = 0; jj < T; ++jj) {
    C* row = dst + (c0 + (jj ^ x ^ cx)) * LD + r0 + rb;
    if constexpr (R % 4 == 0) {
#pragma unroll
      for (int s = 0; s < R / 4; ++s) {
        const C q[4] = {w[4 * s][jj], w[4 * s + 1][jj], w[4 * s + 2][jj], w[4 * s + 3][jj]};
        store4(row + 4 * s, q);
      }
    } else if constexpr (R % 2 == 0) {
#pragma unroll
      for (int s = 0; s < R / 2; ++s) store2(row + 2 * s, w[2 * s][jj], w[2 * s + 1][jj]);
    } else {
#pragma unroll
      for (int i = 0; i < R; ++i) row[i] = w[i][jj];
    }
  }
}

// Both: rows [rb, rb + R) of tile (r0, c0), r0 != c0, and their mirror image.
template <int R, int T, int LD, typename C>
__device__ __forceinline__ void store_tile_and_mirror(C* dst, const C (&v)[R][T], int r0, int c0, int rb, int cx = 0) {
  store_tile_rows<R, T, LD>(dst, v, r0, c0, rb, cx);
  store_tile_mirror<R, T, LD>(dst, v, r0, c0, rb, cx);
}

// ||M - I_n||_inf (kMinusIdentity) or ||M||_inf from shared memory: one warp per row.
template <typename Cfg, typename C, bool kMinusIdentity = true>
__device__ __forceinline__ C residual_by_rows(const C* M, int n, C* scratch) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  C err = C(0);
  for (int r = warp; r < n; r += Cfg::THREADS / 32) {
    C s = C(0);
    for (int c = lane; c < n; c += 32) s += fabs(M[r * Cfg::LD + c] - ((kMinusIdentity && r == c) ? C(1) : C(0)));
    err = nan_max(err, warp_sum(s));
  }
  return block_reduce<Cfg::THREADS, C, true>(err, scratch);
}

// Write rows [rb, rb + H) of diagonal tile (r0, r0): the upper triangle as is and mirrored.
template <int H, int T, int LD, typename C>
__device__ __forceinline__ void store_diagonal_tile(C* dst, const C (&v)[H][T], int r0, int rb) {
#pragma unroll
  for (int i = 0; i < H; ++i)
#pragma unroll
    for (int j = 0; j < T; ++j) {
      const int r = r0 + rb + i, c = r0 + j;
      if (c >= r) dst[r * LD + c] = v[i][j];
      if (c > r) dst[c * LD + r] = v[i][j];
    }
}

// dst = A * B for symmetric, commuting A and B (see above); dst may be A or B. Returns
// ||dst - I_n||_inf when kErr. kmax: a multiple of 4 >= n (rows k >= n of A and B are zero).
template <typename Cfg, typename C, bool kErr>
__device__ __forceinline__ C sym_gemm_inplace(C* dst, const C* A, const C* B, int kmax, int n, C* scratch) {
  constexpr int T = Cfg::T, LD = Cfg::LD, H = T / 2, Q = T / 4;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // lane roles (warp-uniform branches): warps 0..6: tile (I, J), k parity h; warp 7: diagonal tile
  // (t, t), k parity h, then tile (7, 8 + t8), k residue q mod 4
  const int t = lane % 16, h = lane / 16, t8 = lane % 8, q = lane / 8, hi = q >> 1, lo = q & 1;
  const bool first = t < 15 - warp;
  const int I = warp < 7 ? (first ? warp : 14 - warp) : t, J = warp < 7 ? (first ? warp + 1 + t : t) : t;
  const int swap = T == 8 ? (lane >> 2) & 1 : 0;  // tile_product: lanes 4..7 of each 8 (partners share it)
  C acc[T][T], res[H][T], quarter[Q][T];
  if (warp < 7) {
    tile_product<T, LD, false>(acc, A, B, I * T, J * T, h, 2, kmax, swap);
    halve_rows<T, T>(acc, res, h == 1, 16);
  } else {
    tile_product<T, LD, true>(acc, A, B, I * T, I * T, h, 2, kmax);
    halve_rows<T, T>(acc, res, h == 1, 16);
    tile_product<T, LD, false>(acc, A, B, 7 * T, (8 + t8) * T, q, 4, kmax, swap);
    C half[H][T];
    halve_rows<T, T>(acc, half, hi == 1, 16);
    halve_rows<H, T>(half, quarter, lo == 1, 8);
  }
  __syncthreads();  // everyone has read A and B: now dst may be overwritten
  if (warp < 7) {
    store_tile_and_mirror<H, T, LD>(dst, res, I * T, J * T, h * H, 4 * swap);
  } else {
    store_diagonal_tile<H, T, LD>(dst, res, I * T, h * H);
    store_tile_and_mirror<Q, T, LD>(dst, quarter, 7 * T, (8 + t8) * T, hi * H + lo * Q, 4 * swap);
  }
  __syncthreads();
  if constexpr (kErr) return residual_by_rows<Cfg, C>(dst, n, scratch);
  return C(0);
}

// The other block's copy of a shared buffer (pairs only; sm_90).
template <typename C>
__device__ __forceinline__ C* peer_copy(C* p) {
#if __CUDA_ARCH__ < 900
  __trap();
#endif
  return cluster_peer(p, cluster_rank() ^ 1);
}

// sym_gemm_inplace split over a pair: 16 warps (g = 8 * rank + warp) for 120 off-diagonal tiles
// and 16 half-cost diagonal ones. Warps g = 2w, 2w + 1 (w < 7) take the 16 tiles of tile rows w
// and 14 - w, 8 each; warp 14 the 8 of tile row 7; each with k split in 4 (lane = t8 + 8 q, rows
// hi H + lo Q of the tile after the reduction). Warp 15 takes the diagonal tiles (lane = t + 16 h,
// k split in 2), the same work per lane.
template <int T>
__device__ __forceinline__ void pair_tile(int g, int t8, int& I, int& J) {
  I = 7, J = 8 + t8;
  if (g < 14) {
    const int w = g / 2, e = (g % 2) * 8 + t8;
    const bool first = e < 15 - w;
    I = first ? w : 14 - w;
    J = first ? w + 1 + e : e;
  }
}

// Stores: remote stores are slow per request, so only whole 16-byte rows of the upper tiles go to
// the peer, and each block mirrors the peer's tiles into its own lower triangle afterwards (with
// the same lane roles as the peer's warp g ^ 8). Two cluster barriers, split so that the shuffle
// reductions and the local stores overlap them: one before the stores (both blocks have read A and
// B), one after the remote stores (the peer's tiles have arrived); a block barrier after the mirror.
template <typename Cfg, typename C, bool kErr>
__device__ __forceinline__ C sym_gemm_pair(C* dst, const C* A, const C* B, int kmax, int n, C* scratch) {
  constexpr int T = Cfg::T, LD = Cfg::LD, H = T / 2, Q = T / 4;
  const int g = 8 * cluster_rank() + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = lane % 16, h = lane / 16, t8 = lane % 8, q = lane / 8, hi = q >> 1, lo = q & 1, rq = hi * H + lo * Q;
  int I, J;
  pair_tile<T>(g, t8, I, J);
  const int swap = T == 8 ? (lane >> 2) & 1 : 0, cx = 4 * swap;  // as in sym_gemm_inplace
  C acc[T][T], res[H][T], quarter[Q][T];
  if (g == 15) {
    tile_product<T, LD, true>(acc, A, B, t * T, t * T, h, 2, kmax);
    cluster_arrive();  // done reading A and B
    halve_rows<T, T>(acc, res, h == 1, 16);
  } else {
    tile_product<T, LD, false>(acc, A, B, I * T, J * T, q, 4, kmax, swap);
    cluster_arrive();
    C half[H][T];
    halve_rows<T, T>(acc, half, hi == 1, 16);
    halve_rows<H, T>(half, quarter, lo == 1, 8);
  }
  cluster_wait();  // both blocks are done reading: dst may be overwritten in both copies
  C* const peer = peer_copy(dst);
  if (g == 15) {
    store_tile_rows<H, T, LD>(peer, res, t * T, t * T, h * H);  // below the diagonal: zeros, mirrored over there
    cluster_arrive();
    store_diagonal_tile<H, T, LD>(dst, res, t * T, h * H);
  } else {
    store_tile_rows<Q, T, LD>(peer, quarter, I * T, J * T, rq, cx);
    cluster_arrive();
    store_tile_rows<Q, T, LD>(dst, quarter, I * T, J * T, rq, cx);
    store_tile_mirror<Q, T, LD>(dst, quarter, I * T, J * T, rq, cx);
  }
  cluster_wait();  // the peer's tiles have arrived
  const int gp = g ^ 8;  // the peer's warp with this warp's lane roles
  if (gp == 15) {
#pragma unroll
    for (int i = 0; i < H; ++i)
#pragma unroll
      for (int j = 0; j < T; ++j) {
        const int r = t * T + h * H + i, c = t * T + j;
        if (c < r) dst[r * LD + c] = dst[c * LD + r];
      }
  } else {
    pair_tile<T>(gp, t8, I, J);
#pragma unroll
    for (int i = 0; i < Q; ++i)
#pragma unroll
      for (int s = 0; s < T / 4; ++s) {
        const Four<C> v = load4(dst + (I * T + rq + i) * LD + J * T + 4 * s);
#pragma unroll
        for (int e = 0; e < 4; ++e) quarter[i][4 * s + e] = v.v[e];
      }
    store_tile_mirror<Q, T, LD>(dst, quarter, I * T, J * T, rq);
  }
  __syncthreads();
  if constexpr (kErr) return residual_by_rows<Cfg, C>(dst, n, scratch);
  return C(0);
}

// The product used by the kernel: symmetric path for NMAX >= 64 (split over the pair when
// CLUSTER = 2), the full GEMM below that.
template <typename Cfg, typename C, bool kErr>
__device__ __forceinline__ C product(C* dst, const C* A, const C* B, int kmax, int n, C* scratch) {
  if constexpr (Cfg::CLUSTER == 2) return sym_gemm_pair<Cfg, C, kErr>(dst, A, B, kmax, n, scratch);
  else if constexpr (Cfg::kSym) return sym_gemm_inplace<Cfg, C, kErr>(dst, A, B, kmax, n, scratch);
  else return gemm_inplace<Cfg, C, kErr>(dst, A, B, kmax, n, scratch);
}

// One matrix per block: the whole scaled Newton iteration in shared memory (linalg/twins.py).
// A = (G + G^T) / 2 + eps I, u = min(||A||_F, ||A||_inf), X = u^(-1/p) I, M = A / u, low from newton_first_low;
// repeat P = a I + b M (newton_scaling(low)); X <- X P; M <- P^p M (P^p by squaring, in place);
// low <- min(1, max(next_low, 1 - err)) until err = ||M - I||_inf <= tol, the stall rule, a
// non-finite err, or max_iters. The scalar recurrence runs in double, redundantly in every
// thread (uniform, so no broadcast is needed).
// Buffers: X, M, P (3 NMAX x LD). A matrix with a non-finite entry: root NaN, err NaN, iters 0.
// Pairs: block 2b + r works on matrix b; all of the above runs redundantly in both blocks except
// the products, which split their tiles (sym_gemm_pair), and the output, which splits its rows.
template <typename Cfg, typename T, typename C>
__global__ void __launch_bounds__(Cfg::THREADS)
newton_small_kernel(const T* __restrict__ G,  // [B, n, n]
                    T* __restrict__ out,      // [B, n, n]
                    C* __restrict__ err_out,  // [B]
                    int* __restrict__ iters_out,  // [B]
                    int n, int p, C eps, int max_iters, C tol) {
  constexpr int NMAX = Cfg::NMAX, LD = Cfg::LD, THREADS = Cfg::THREADS;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  C* X = reinterpret_cast<C*>(smem_raw);
  C* M = X + NMAX * LD;
  C* P = M + NMAX * LD;
  __shared__ C scratch[THREADS / 32];
  __shared__ double scratch_sq[THREADS / 32];
  const int64_t b = blockIdx.x / Cfg::CLUSTER;
  const T* g = G + b * n * n;
  const int tid = threadIdx.x;

  // zero all three buffers (the padding must stay zero), then load A = (G + G^T) / 2 + eps I into M
  // (matrix_inverse_root's contract on every path; the symmetric products also need M exactly
  // symmetric), with G staged in P (read transposed from shared memory rather than uncoalesced from
  // global memory). Where the two entries agree, the entry itself: symmetric input stays bitwise.
  for (int i = tid; i < 3 * NMAX * LD; i += THREADS) X[i] = C(0);
  __syncthreads();
  bool finite = true;
  for (int i = tid; i < n * n; i += THREADS) {
    const int r = i / n, c = i - r * n;
    const C v = to_opmath(g[i]);
    finite &= isfinite(v);
    P[r * LD + c] = v;
  }
  __syncthreads();
  double sq = 0.0;  // ||A||_F^2 in double: the squares of a tiny (or huge) G under- (over-)flow float
  for (int i = tid; i < n * n; i += THREADS) {
    const int r = i / n, c = i - r * n;
    C v = P[r * LD + c];
    const C w = P[c * LD + r];
    if (w != v) v = C(0.5) * v + C(0.5) * w;
    if (r == c) v += eps;
    M[r * LD + c] = v;
    sq += static_cast<double>(v) * v;
  }
  const C nonfinite = block_reduce<THREADS, C, false>(finite ? C(0) : C(1), scratch);
  sq = block_reduce<THREADS, double, false>(sq, scratch_sq);
  T* o = out + b * n * n;
  const int rank = Cfg::CLUSTER == 1 ? 0 : cluster_rank();  // this block's share of the output
  if (nonfinite > C(0)) {  // both blocks of a pair return here, before any barrier
    for (int i = tid + rank * THREADS; i < n * n; i += Cfg::CLUSTER * THREADS) o[i] = from_opmath<T>(C(NAN));
    if (tid == 0 && rank == 0) err_out[b] = C(NAN), iters_out[b] = 0;
    return;
  }
  __syncthreads();  // M complete before the row sums
  // both >= the top eigenvalue (a Frobenius norm past float's range becomes inf: the row sums decide)
  const C u = fmin(static_cast<C>(sqrt(sq)), residual_by_rows<Cfg, C, false>(M, n, scratch));
  const C inv_u = C(1) / u, xz = pow(u, C(-1) / C(p));
  for (int i = tid; i < NMAX * NMAX; i += THREADS) {
    const int r = i / NMAX, c = i - r * NMAX;
    M[r * LD + c] *= inv_u;
    if (r == c && r < n) X[r * LD + c] = xz;
  }
  __syncthreads();
  C err = residual_by_rows<Cfg, C>(M, n, scratch);  // ends with a barrier: M is complete
  const int kmax = (n + 3) & ~3;
  int it = 0;
  bool active = err > tol && isfinite(err);
  // the Lanczos estimate, in P's space (P is built later); rows n..NMAX-1 of M are zero
  const bool estimate = active && max_iters > 0 && n >= kLanczosMinN;
  const C ritz = estimate ? smallest_ritz_value<NMAX, THREADS / 32, C>(M, LD, n, P) : C(NAN);
  double low = newton_first_low(static_cast<double>(eps), static_cast<double>(u), static_cast<double>(err),
                                static_cast<double>(ritz));
  while (active && it < max_iters) {
    const NewtonScaling step = newton_scaling(low, p);
    const C diag = static_cast<C>(step.a), slope = static_cast<C>(step.b);
    for (int i = tid; i < NMAX * NMAX; i += THREADS) {
      const int r = i / NMAX, c = i - r * NMAX;
      P[r * LD + c] = slope * M[r * LD + c] + ((r == c && r < n) ? diag : C(0));
    }
    __syncthreads();
    if (it == 0) {  // X = xz I, so X P = xz P, bitwise what the product gives (one nonzero term)
      for (int i = tid; i < NMAX * LD; i += THREADS) X[i] = xz * P[i];
    } else {
      product<Cfg, C, false>(X, X, P, kmax, n, scratch);  // X <- X P
    }
    C new_err = C(0);
    for (int q = p;;) {  // M <- P^p M: multiply in P^(2^j) for each set bit j, squaring P in between
      if (q & 1) {
        if ((q >> 1) == 0) new_err = product<Cfg, C, true>(M, P, M, kmax, n, scratch);
        else product<Cfg, C, false>(M, P, M, kmax, n, scratch);
      }
      q >>= 1;
      if (!q) break;
      product<Cfg, C, false>(P, P, P, kmax, n, scratch);
    }
    ++it;
    const C prev = err;
    err = new_err;
    low = fmin(1.0, fmax(step.next_low, 1.0 - static_cast<double>(err)));
    const bool stalled = prev <= C(kStallBelow) && err > C(kStallRatio) * prev;
    active = err > tol && isfinite(err) && !stalled;
  }
  for (int i = tid + rank * THREADS; i < n * n; i += Cfg::CLUSTER * THREADS) {
    const int r = i / n, c = i - r * n;
    o[i] = from_opmath<T>(X[r * LD + c]);
  }
  if (tid == 0 && rank == 0) err_out[b] = err, iters_out[b] = it;
}

// The kernel for Cfg, with its shared memory opted in (once per device), and its launch config.
template <typename Cfg, typename T, typename C>
struct SmallLaunch : ClusterLaunch {
  static constexpr size_t smem = Cfg::template smem_bytes<C>();
  static constexpr auto kernel = newton_small_kernel<Cfg, T, C>;

  SmallLaunch(int64_t batch, cudaStream_t stream)
      : ClusterLaunch(static_cast<unsigned>(batch * Cfg::CLUSTER), Cfg::THREADS, Cfg::CLUSTER, smem, stream,
                      /*attach=*/Cfg::CLUSTER > 1) {
    static int opted_in[kCachedDevices] = {};
    opt_in_smem(opted_in, kernel, smem);
  }
};

template <typename Cfg, typename T, typename C>
cudaError_t newton_small_run(const newton::SmallParams& p, bool* launched, cudaStream_t stream) {
  using Launch = SmallLaunch<Cfg, T, C>;
  *launched = Launch::smem + sizeof(C) * 32 <= smem_optin_bytes();
  if (!*launched) return cudaSuccess;
  const Launch launch(p.batch, stream);
  TORCHKERN_RETURN_IF_ERROR(cudaLaunchKernelEx(&launch.config, Launch::kernel, static_cast<const T*>(p.G),
                                               static_cast<T*>(p.out), static_cast<C*>(p.err), p.iters, p.n, p.p,
                                               static_cast<C>(p.eps), p.max_iters, static_cast<C>(p.tol)));
  return cudaGetLastError();
}

// Whether a batch of `batch` matrices should run as pairs: the device and the kernel's build are
// sm_90 or newer (a build from older PTX would trap), and every pair fits on the GPU at once
// (with more matrices than that, one block per matrix already fills it).
template <typename Cfg, typename T, typename C>
bool pairs_fit(int64_t batch) {
  using Launch = SmallLaunch<Cfg, T, C>;
  static int cache[kCachedDevices] = {};
  const int pairs = per_device(cache, [](int device) {  // (a failed query leaves its error for the launcher)
    cudaFuncAttributes attributes;
    if (cudaFuncGetAttributes(&attributes, Launch::kernel) != cudaSuccess) return 0;
    if (device_attribute(cudaDevAttrComputeCapabilityMajor, device) < 9 || attributes.ptxVersion < 90) return 0;
    int count = 0;
    const Launch launch(2 * 1024, nullptr);  // the grid is not part of the answer
    if (cudaOccupancyMaxActiveClusters(&count, Launch::kernel, &launch.config) != cudaSuccess) return 0;
    return count;
  });
  return batch <= pairs;
}

// Tile configurations by size: 16 (2x4 tiles, 32 threads), 32 (4x4, 64), 64 (4x4, 256), 128 (8x8, 256),
// and 128 on a pair of blocks.
using Cfg16 = Config<16, 2, 1>;
using Cfg32 = Config<32, 4, 1>;
using Cfg64 = Config<64, 4, 1>;
using Cfg128 = Config<128, 8, 2>;
using Cfg128Pair = Config<128, 8, 2, 2>;

// The launcher for storage type T computing in C (float for float/half/bf16, double for double): *launched false (and
// nothing launched) where the large path takes the call.
template <typename T, typename C>
cudaError_t newton_small_dispatch(const newton::SmallParams& p, bool* launched, cudaStream_t stream) {
  const auto run = [&](auto config) {
    using Cfg = decltype(config);
    return newton_small_run<Cfg, T, C>(p, launched, stream);
  };
  *launched = false;
  if (p.n <= 16) return run(Cfg16{});
  if (p.n <= 32) return run(Cfg32{});
  if (p.n <= 64) return run(Cfg64{});
  if constexpr (sizeof(C) == 4) {
    if (p.n <= 128) return pairs_fit<Cfg128Pair, T, C>(p.batch) ? run(Cfg128Pair{}) : run(Cfg128{});
  }
  return cudaSuccess;  // float64 above 64 (3 x 128^2 doubles do not fit) and everything above 128: the large path
}

}  // namespace small_matrix

// The instantiations, one file each (matrix_inverse_root_newton_small_{f32,f64,f16,bf16}.cu, the first with the
// launcher).
cudaError_t newton_small_f64(const newton::SmallParams& p, bool* launched, cudaStream_t stream);
cudaError_t newton_small_f16(const newton::SmallParams& p, bool* launched, cudaStream_t stream);
cudaError_t newton_small_bf16(const newton::SmallParams& p, bool* launched, cudaStream_t stream);

}  // namespace torchkern
