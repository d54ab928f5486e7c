// matrix_inverse_root_newton(G, p, eps, max_iters, tol) -> (root, error, iterations), of the symmetric part
// (G + G^T) / 2 on every path.
//
// The scaled coupled Newton iteration (linalg/twins.py: docs/design.md's iteration with a per-matrix
// scaling that cuts the step count) per matrix of a batch; each matrix stops at its own
// iteration (tol, the stall rule in small_matrix.cuh, a non-finite error, or max_iters).
//
// Small matrices (n <= 128 for float32/float16/bfloat16, n <= 64 for float64): one block per
// matrix runs the whole iteration in shared memory (small_matrix.cuh); for 64 < n <= 128 on sm_90,
// a batch with no more matrices than the GPU holds block pairs runs each on a cluster of two.
//
// Large matrices: per iteration, one fused elementwise kernel builds P = a I + b M with the
// matrix's own coefficients (P = I for a matrix that is done, so the products below leave its X
// and M exactly as they are: the "done mask" costs nothing extra), cuBLAS batched products
// X <- X P and M <- P^p M (P^p by squaring; p = 4: 4 products of n^3 multiply-adds per
// iteration), then a row-sum kernel over (matrix, 8-row chunk) blocks and a one-thread-per-matrix
// update compute ||M - I||_inf, apply the stopping rule, advance the scaling (next step's a, b)
// and count the matrices still active (spreading the rows over blocks matters: one block per
// matrix left a batch of 16 matrices latency-bound on 16 SMs).
// The host side (matrix_inverse_root_newton_host.h) runs the products and the loop that reads back, once an
// iteration, the count of matrices still going.
// For n >= 64 both paths start from a Lanczos estimate of each matrix's smallest eigenvalue (the
// first scaling in linalg/twins.py; small_matrix::smallest_ritz_value in the small kernel, the
// Lanczos stages here), which saves 1 to 4 of about 10 steps on matrices with a condition number up
// to 1e4.
// The products run in the compute dtype through at::bmm, so they follow torch's TF32 setting
// (off by default): leave TF32 off for float32 roots at 1e-4 accuracy.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "launchers.h"
#include "small_matrix.cuh"
#include "torchkern/launch.cuh"
#include "torchkern/reduce.cuh"

namespace torchkern {
namespace newton {
namespace {


constexpr int kRowThreads = 256;  // init / check kernels: one block per matrix, one warp per row

constexpr int kRowsPerBlock = kRowThreads / 32;
static_assert(kRowsPerBlock == kRowsPerChunk, "launchers.h's chunks are the row kernel's");

// Row reductions spread over (matrix, chunk of 8 rows) blocks, so that a batch of a few large
// matrices still fills the GPU. kInit: the chunk's Frobenius norm (squares summed in double) and max
// row sum of |A| for A = G + eps I, and a non-finite flag; else: max over rows of sum_c |M - I|
// (skipping matrices that are done).
template <typename T, typename C, bool kInit>
__global__ void __launch_bounds__(kRowThreads)
newton_rows_kernel(const T* __restrict__ src,  // [B, n, n]
                   C* __restrict__ partial,    // [B, chunks]
                   C* __restrict__ row_max,    // [B, chunks] (kInit)
                   int* __restrict__ bad,      // [B, chunks] (kInit)
                   const int* __restrict__ active,  // [B] (!kInit; nullptr: all)
                   int n, int chunks, C eps) {
  __shared__ C scratch[kRowsPerBlock], scratch_max[kRowsPerBlock];
  __shared__ double scratch_sq[kRowsPerBlock];
  const int64_t idx = blockIdx.x, b = idx / chunks;
  if constexpr (!kInit) {
    if (active != nullptr && !active[b]) return;  // (nullptr: every matrix)
  }
  const int r = static_cast<int>(idx - b * chunks) * kRowsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  C s = C(0), t = C(0);  // kInit: t = sum of |A|; else s = sum of |M - I|
  double sq = 0.0;       // kInit: sum of squares, in double (a tiny G's squares underflow float)
  bool finite = true;
  if (r < n) {
    const T* row = src + (b * n + r) * int64_t(n);
#pragma unroll 4
    for (int c = lane; c < n; c += 32) {
      const C v = static_cast<C>(row[c]);
      if constexpr (kInit) {
        finite &= isfinite(v);
        const C a = v + (r == c ? eps : C(0));
        sq += static_cast<double>(a) * a;
        t += fabs(a);
      } else {
        s += fabs(v - (r == c ? C(1) : C(0)));
      }
    }
  }
  if constexpr (kInit) {
    sq = warp_sum(sq);
    t = warp_sum(t);
    finite = __all_sync(0xffffffffu, finite);
  } else {
    s = warp_sum(s);
  }
  if (threadIdx.x % 32 == 0) {
    if constexpr (kInit) {
      scratch_sq[threadIdx.x / 32] = finite ? sq : NAN;
      scratch_max[threadIdx.x / 32] = t;
    } else {
      scratch[threadIdx.x / 32] = s;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if constexpr (kInit) {  // the chunk's Frobenius norm (its square may be out of float's range)
      double total = scratch_sq[0];
      C m = scratch_max[0];
      for (int w = 1; w < kRowsPerBlock; ++w) total += scratch_sq[w], m = fmax(m, scratch_max[w]);
      partial[idx] = static_cast<C>(sqrt(total));
      row_max[idx] = m;
      bad[idx] = total != total;
    } else {
      C v = scratch[0];
      for (int w = 1; w < kRowsPerBlock; ++w) {
        const C x = scratch[w];
        v = (x > v || x != x) ? x : v;
      }
      partial[idx] = v;
    }
  }
}

// The Lanczos estimate on this path (n >= kLanczosMinN; the small kernel makes its own): per step
// one batched product W = M^T V (the host's, cuBLAS; M = A / u as filled below) and one kernel with a block per
// matrix for the vector work (alpha, the new vector, beta, the early stop: small_matrix's
// smallest_ritz_value step for step, state in global memory); then a block per matrix turns T into
// the estimate. A matrix that stopped early skips the remaining steps' vector work.
constexpr int kLanczosThreads = 256;

template <typename C>
__device__ __forceinline__ C block_sum(C v, C* scratch) {
  return block_reduce<kLanczosThreads, C, false>(v, scratch);
}

// V = the start vector (small_matrix::lanczos_start, normalized), V_prev = 0, per matrix.
template <typename C>
__global__ void __launch_bounds__(kLanczosThreads)
lanczos_start_kernel(C* __restrict__ V, C* __restrict__ V_prev, int* __restrict__ taken, int n) {
  __shared__ C scratch[kLanczosThreads / 32];
  C* v = V + int64_t(blockIdx.x) * n;
  C sq = C(0);
  for (int i = threadIdx.x; i < n; i += kLanczosThreads) {
    const C x = static_cast<C>(small_matrix::lanczos_start(i));
    v[i] = x;
    sq += x * x;
  }
  const C inv_norm = C(1) / sqrt(block_sum(sq, scratch));
  for (int i = threadIdx.x; i < n; i += kLanczosThreads) {  // each thread rescales the entries it wrote
    v[i] *= inv_norm;
    V_prev[int64_t(blockIdx.x) * n + i] = C(0);
  }
  if (threadIdx.x == 0) taken[blockIdx.x] = 0;
}

// Step j of every matrix still going (taken == j): W = M^T v is given; alpha, w = W - alpha v -
// beta_{j-1} v_prev (into W, which the next step's product overwrites), beta = ||w||, T's entries and
// scale; then v_prev = v, v = w / beta, or a stop.
template <typename C>
__global__ void __launch_bounds__(kLanczosThreads)
lanczos_step_kernel(C* __restrict__ W, C* __restrict__ V, C* __restrict__ V_prev, C* __restrict__ tri,
                    C* __restrict__ scale, int* __restrict__ taken, int n, int j) {
  __shared__ C scratch[kLanczosThreads / 32];
  const int64_t b = blockIdx.x;
  if (taken[b] != j) return;  // stopped at an earlier step
  C* w = W + b * n;
  C* v = V + b * n;
  C* v_prev = V_prev + b * n;
  C* alpha = tri + b * 2 * kLanczosSteps;
  C* beta = alpha + kLanczosSteps;
  C dot = C(0);
  for (int i = threadIdx.x; i < n; i += kLanczosThreads) dot += w[i] * v[i];
  const C a = block_sum(dot, scratch), beta_last = j ? beta[j - 1] : C(0);
  C sq = C(0);
  for (int i = threadIdx.x; i < n; i += kLanczosThreads) {
    const C x = w[i] - a * v[i] - beta_last * v_prev[i];
    w[i] = x;
    sq += x * x;
  }
  const C bn = sqrt(block_sum(sq, scratch));
  C sc = j ? scale[b] : C(0);
  const bool go = small_matrix::lanczos_goes_on(a, beta_last, bn, sc);
  if (go) {
    const C inv_b = C(1) / bn;
    for (int i = threadIdx.x; i < n; i += kLanczosThreads) {  // each thread reads back the entries it wrote
      v_prev[i] = v[i];
      v[i] = w[i] * inv_b;
    }
  }
  if (threadIdx.x == 0) {
    alpha[j] = a, beta[j] = bn, scale[b] = sc;
    taken[b] = go ? j + 1 : -(j + 1);  // negative: stopped after j + 1 steps
  }
}

// ritz[b] = the smallest eigenvalue of matrix b's T (small_matrix::ritz_estimate), one warp each.
template <typename C>
__global__ void __launch_bounds__(32)
lanczos_ritz_kernel(const C* __restrict__ tri, const C* __restrict__ scale, const int* __restrict__ taken,
                    C* __restrict__ ritz) {
  __shared__ unsigned ballots[1];
  const int64_t b = blockIdx.x;
  const C* alpha = tri + b * 2 * kLanczosSteps;
  const int k = abs(taken[b]);
  const C theta = small_matrix::ritz_estimate<32>(alpha, alpha + kLanczosSteps, k, scale[b], ballots);
  if (threadIdx.x == 0) ritz[b] = theta;
}

// One thread per matrix: u = min(||A||_F, ||A||_inf) from the partial sums, z = 1 / u and
// xz = u^(-1/p).
template <typename C>
__global__ void newton_scale_kernel(const C* __restrict__ partial, const C* __restrict__ row_max,
                                    const int* __restrict__ bad, C* __restrict__ z, C* __restrict__ xz,
                                    int* __restrict__ is_bad, int64_t batch, int chunks, int p) {
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < batch; b += int64_t(gridDim.x) * blockDim.x) {
    double sq = 0.0;  // the chunks' Frobenius norms squared and summed in double
    C inf_norm = C(0);
    int any_bad = 0;
    for (int c = 0; c < chunks; ++c) {
      const double x = partial[b * chunks + c];
      sq += x * x;
      inf_norm = fmax(inf_norm, row_max[b * chunks + c]);
      any_bad |= bad[b * chunks + c];
    }
    const C u = fmin(static_cast<C>(sqrt(sq)), inf_norm);  // an infinite Frobenius norm: the row sums decide
    z[b] = C(1) / u;
    xz[b] = pow(u, C(-1) / C(p));
    is_bad[b] = any_bad;
  }
}

// M = z A, X = xz I (NaN for a non-finite matrix), elementwise over the batch.
template <typename C>
__global__ void newton_fill_kernel(const C* __restrict__ G, C* __restrict__ X, C* __restrict__ M,
                                   const C* __restrict__ z, const C* __restrict__ xz, const int* __restrict__ is_bad,
                                   int64_t total, int n, C eps) {
  const int64_t nn = int64_t(n) * n;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / nn, j = i - b * nn;
    const bool diag = (j / n) == (j % n);
    M[i] = z[b] * (G[i] + (diag ? eps : C(0)));
    X[i] = is_bad[b] ? C(NAN) : (diag ? xz[b] : C(0));
  }
}

// Per-matrix scaling state: the coefficients of the next step's P = a I + b M and the lower
// bound that step leaves (newton_scaling in small_matrix.cuh).
template <typename C>
struct ScalingState {
  C* a;
  C* b;
  double* next_low;
};

// One thread per matrix: err = max of the partial row sums; kInit sets up the state, else the
// stopping rule (docs/design.md + stall rule) updates it; for a matrix that goes on, the next step's
// scaling; counts the matrices still active. z = 1 / u (kInit: the first lower bound needs eps / u).
template <typename C, bool kInit>
__global__ void newton_update_kernel(const C* __restrict__ partial, const int* __restrict__ is_bad, C* __restrict__ err,
                                     C* __restrict__ prev, int* __restrict__ iters, int* __restrict__ active,
                                     int* __restrict__ count, ScalingState<C> scaling, const C* __restrict__ z,
                                     const C* __restrict__ ritz, double eps, int p, int64_t batch, int chunks, C tol) {
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < batch; b += int64_t(gridDim.x) * blockDim.x) {
    if (!kInit && !active[b]) continue;
    C e = C(0);
    for (int c = 0; c < chunks; ++c) {
      const C x = partial[b * chunks + c];
      e = (x > e || x != x) ? x : e;
    }
    bool go;
    double low;
    if constexpr (kInit) {
      const bool bad_b = is_bad[b];
      go = !bad_b && e > tol && isfinite(e);
      err[b] = bad_b ? C(NAN) : e;
      prev[b] = C(INFINITY);
      iters[b] = 0;
      low = newton_first_low(eps, 1.0 / static_cast<double>(z[b]), static_cast<double>(e),
                             ritz ? static_cast<double>(ritz[b]) : NAN);
    } else {
      const C before = err[b];
      const bool stalled = before <= C(kStallBelow) && e > C(kStallRatio) * before;
      go = e > tol && isfinite(e) && !stalled;
      prev[b] = before;
      err[b] = e;
      iters[b] += 1;
      low = fmin(1.0, fmax(scaling.next_low[b], 1.0 - static_cast<double>(e)));
    }
    active[b] = go;
    if (go) {
      const NewtonScaling step = newton_scaling(low, p);
      scaling.a[b] = static_cast<C>(step.a);
      scaling.b[b] = static_cast<C>(step.b);
      scaling.next_low[b] = step.next_low;
      atomicAdd(count, 1);
    }
  }
}

// P = a I + b M (the matrix's own coefficients) for active matrices, P = I for the others.
template <typename C>
__global__ void newton_step_kernel(const C* __restrict__ M, C* __restrict__ P, const int* __restrict__ active,
                                   const C* __restrict__ coef_a, const C* __restrict__ coef_b, int64_t total, int n) {
  const int64_t nn = int64_t(n) * n;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / nn, j = i - b * nn;
    const bool diag = (j / n) == (j % n);
    P[i] = active[b] ? coef_b[b] * M[i] + (diag ? coef_a[b] : C(0)) : (diag ? C(1) : C(0));
  }
}

}  // namespace

cudaError_t large_launch(Stage stage, const LargeParams& p, int it, cudaStream_t stream) {
  const auto run = [&](auto zero) {
    using C = decltype(zero);
    const int64_t batch = p.batch, total = batch * int64_t(p.n) * p.n;
    const int n = p.n, chunks = (n + kRowsPerBlock - 1) / kRowsPerBlock;
    const unsigned rows_grid = static_cast<unsigned>(batch * chunks), ew_grid = grid_for(total, 256, 4);
    const unsigned per_matrix_grid = static_cast<unsigned>((batch + 127) / 128);
    const unsigned lanczos_grid = static_cast<unsigned>(batch);
    C* partial = static_cast<C*>(p.partial);
    const ScalingState<C> scaling{static_cast<C*>(p.coef_a), static_cast<C*>(p.coef_b), p.next_low};
    switch (stage) {
      case Stage::kStart:
        newton_rows_kernel<C, C, true><<<rows_grid, kRowThreads, 0, stream>>>(
            static_cast<const C*>(p.A), partial, static_cast<C*>(p.row_max), p.bad, nullptr, n, chunks,
            static_cast<C>(p.eps));
        newton_scale_kernel<C><<<per_matrix_grid, 128, 0, stream>>>(partial, static_cast<const C*>(p.row_max), p.bad,
                                                                    static_cast<C*>(p.z), static_cast<C*>(p.xz),
                                                                    p.is_bad, batch, chunks, p.p);
        newton_fill_kernel<C><<<ew_grid, 256, 0, stream>>>(static_cast<const C*>(p.A), static_cast<C*>(p.X),
                                                            static_cast<C*>(p.M), static_cast<const C*>(p.z),
                                                            static_cast<const C*>(p.xz), p.is_bad, total, n,
                                                            static_cast<C>(p.eps));
        // every matrix counts as active for this one residual pass
        newton_rows_kernel<C, C, false><<<rows_grid, kRowThreads, 0, stream>>>(
            static_cast<const C*>(p.M), partial, nullptr, nullptr, nullptr, n, chunks, C(0));
        break;
      case Stage::kLanczosStart:
        lanczos_start_kernel<C><<<lanczos_grid, kLanczosThreads, 0, stream>>>(static_cast<C*>(p.V),
                                                                              static_cast<C*>(p.V_prev), p.taken, n);
        break;
      case Stage::kLanczosStep:
        lanczos_step_kernel<C><<<lanczos_grid, kLanczosThreads, 0, stream>>>(
            static_cast<C*>(p.W), static_cast<C*>(p.V), static_cast<C*>(p.V_prev), static_cast<C*>(p.tri),
            static_cast<C*>(p.scale), p.taken, n, it);
        break;
      case Stage::kLanczosRitz:
        lanczos_ritz_kernel<C><<<lanczos_grid, 32, 0, stream>>>(static_cast<const C*>(p.tri),
                                                                static_cast<const C*>(p.scale), p.taken,
                                                                static_cast<C*>(p.ritz));
        break;
      case Stage::kFirstUpdate:
        newton_update_kernel<C, true><<<per_matrix_grid, 128, 0, stream>>>(
            partial, p.is_bad, static_cast<C*>(p.err), static_cast<C*>(p.prev), p.iters, p.active, p.counts, scaling,
            static_cast<const C*>(p.z), static_cast<const C*>(p.ritz), p.eps, p.p, batch, chunks,
            static_cast<C>(p.tol));
        break;
      case Stage::kStep:
        newton_step_kernel<C><<<ew_grid, 256, 0, stream>>>(static_cast<const C*>(p.M), static_cast<C*>(p.P), p.active,
                                                            scaling.a, scaling.b, total, n);
        break;
      case Stage::kCheck:
        newton_rows_kernel<C, C, false><<<rows_grid, kRowThreads, 0, stream>>>(
            static_cast<const C*>(p.M), partial, nullptr, nullptr, p.active, n, chunks, C(0));
        newton_update_kernel<C, false><<<per_matrix_grid, 128, 0, stream>>>(
            partial, nullptr, static_cast<C*>(p.err), static_cast<C*>(p.prev), p.iters, p.active, p.counts + it + 1,
            scaling, nullptr, nullptr, p.eps, p.p, batch, chunks, static_cast<C>(p.tol));
        break;
    }
  };
  if (p.f64) run(0.0);
  else run(0.0f);
  return cudaGetLastError();
}

}  // namespace newton
}  // namespace torchkern
