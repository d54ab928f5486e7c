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
// Host syncs, one per iteration: for n < 512 the count of iteration k is copied to pinned memory
// and read after iteration k + 1 has been queued, so the GPU never waits for the host (the price:
// one extra, frozen, no-op iteration at the end); for n >= 512 an iteration costs milliseconds,
// so the host waits for each iteration's own count instead (microseconds of idle GPU per
// iteration rather than a wasted iteration). Not CUDA-graph capturable for that reason.
// For n >= 64 both paths start from a Lanczos estimate of each matrix's smallest eigenvalue (the
// first scaling in linalg/twins.py; small_matrix::smallest_ritz_value in the small kernel,
// lanczos_large here), which saves 1 to 4 of about 10 steps on matrices with a condition number up
// to 1e4.
// The products run in the compute dtype through at::bmm, so they follow torch's TF32 setting
// (off by default): leave TF32 off for float32 roots at 1e-4 accuracy.
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <utility>

#include "torchkern/checks.h"
#include "torchkern/dispatch.h"
#include "torchkern/launch.h"
#include "small_matrix.cuh"

namespace torchkern {
namespace {

constexpr int kRowThreads = 256;  // init / check kernels: one block per matrix, one warp per row

constexpr int kRowsPerBlock = kRowThreads / 32;
constexpr int kSyncCheckFromN = 512;  // from this n on the convergence check waits for its own iteration

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
                   const int* __restrict__ active,  // [B] (!kInit)
                   int n, int chunks, C eps) {
  __shared__ C scratch[kRowsPerBlock], scratch_max[kRowsPerBlock];
  __shared__ double scratch_sq[kRowsPerBlock];
  const int64_t idx = blockIdx.x, b = idx / chunks;
  if constexpr (!kInit) {
    if (!active[b]) return;
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
// one batched product W = M^T V (cuBLAS; M = A / u as filled below) and one kernel with a block per
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

// ritz (B) for M (B, n, n), compute type, contiguous.
template <typename C>
void lanczos_large(const at::Tensor& M, at::Tensor& ritz, int64_t batch, int n, cudaStream_t stream) {
  const auto opt = M.options();
  at::Tensor V = at::empty({batch, n, 1}, opt), V_prev = at::empty({batch, n}, opt), W = at::empty({batch, n, 1}, opt);
  at::Tensor tri = at::empty({batch, 2, kLanczosSteps}, opt), scale = at::empty({batch}, opt);
  at::Tensor taken = at::empty({batch}, opt.dtype(at::kInt));
  const unsigned grid = static_cast<unsigned>(batch);
  lanczos_start_kernel<C><<<grid, kLanczosThreads, 0, stream>>>(V.mutable_data_ptr<C>(), V_prev.mutable_data_ptr<C>(),
                                                                taken.mutable_data_ptr<int>(), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor Mt = M.transpose(1, 2);  // A v as A^T v, as the twin and the small kernel compute it
  for (int j = 0; j < std::min(kLanczosSteps, n); ++j) {
    at::bmm_out(W, Mt, V);
    lanczos_step_kernel<C><<<grid, kLanczosThreads, 0, stream>>>(
        W.mutable_data_ptr<C>(), V.mutable_data_ptr<C>(), V_prev.mutable_data_ptr<C>(), tri.mutable_data_ptr<C>(),
        scale.mutable_data_ptr<C>(), taken.mutable_data_ptr<int>(), n, j);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  lanczos_ritz_kernel<C><<<grid, 32, 0, stream>>>(tri.const_data_ptr<C>(), scale.const_data_ptr<C>(),
                                                 taken.const_data_ptr<int>(), ritz.mutable_data_ptr<C>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
template <typename T, typename C>
__global__ void newton_fill_kernel(const T* __restrict__ G, C* __restrict__ X, C* __restrict__ M,
                                   const C* __restrict__ z, const C* __restrict__ xz, const int* __restrict__ is_bad,
                                   int64_t total, int n, C eps) {
  const int64_t nn = int64_t(n) * n;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / nn, j = i - b * nn;
    const bool diag = (j / n) == (j % n);
    M[i] = z[b] * (static_cast<C>(G[i]) + (diag ? eps : C(0)));
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

template <typename T, typename C>
void newton_large(const at::Tensor& G, at::Tensor& root, at::Tensor& err, at::Tensor& iters, int64_t batch, int n,
                  int p, double eps, int max_iters, double tol, bool wait) {
  const cudaStream_t stream = current_stream();
  const auto copt = G.options().dtype(c10::CppTypeToScalarType<C>::value);
  at::Tensor X = at::empty({batch, n, n}, copt), M = at::empty_like(X), P = at::empty_like(X);
  at::Tensor Xn = at::empty_like(X), Mn = at::empty_like(X), S1, S2;
  if (p > 1) S1 = at::empty_like(X);
  if (p > 3) S2 = at::empty_like(X);
  at::Tensor prev = at::empty({batch}, copt);
  at::Tensor active = at::empty({batch}, G.options().dtype(at::kInt));
  at::Tensor counts = at::zeros({max_iters + 1}, G.options().dtype(at::kInt));
  int* counts_d = counts.mutable_data_ptr<int>();
  C* err_p = err.mutable_data_ptr<C>();
  C* prev_p = prev.mutable_data_ptr<C>();
  int* iters_p = iters.mutable_data_ptr<int>();
  int* active_p = active.mutable_data_ptr<int>();

  const int chunks = (n + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t total = batch * int64_t(n) * n;
  const unsigned ew_grid = grid_for(total, 256, 4), per_matrix_grid = static_cast<unsigned>((batch + 127) / 128);
  at::Tensor partial = at::empty({batch, chunks}, copt), row_max = at::empty({batch, chunks}, copt);
  at::Tensor bad = at::empty({batch, chunks}, G.options().dtype(at::kInt));
  at::Tensor z = at::empty({batch}, copt), xz = at::empty({batch}, copt);
  at::Tensor is_bad = at::empty({batch}, G.options().dtype(at::kInt));
  at::Tensor coef = at::empty({2, batch}, copt), next_low = at::empty({batch}, G.options().dtype(at::kDouble));
  const ScalingState<C> scaling{coef.mutable_data_ptr<C>(), coef.mutable_data_ptr<C>() + batch,
                                next_low.mutable_data_ptr<double>()};
  C* partial_p = partial.mutable_data_ptr<C>();
  newton_rows_kernel<T, C, true><<<static_cast<unsigned>(batch * chunks), kRowThreads, 0, stream>>>(
      G.const_data_ptr<T>(), partial_p, row_max.mutable_data_ptr<C>(), bad.mutable_data_ptr<int>(), nullptr, n,
      chunks, static_cast<C>(eps));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  newton_scale_kernel<C><<<per_matrix_grid, 128, 0, stream>>>(partial_p, row_max.const_data_ptr<C>(),
                                                              bad.const_data_ptr<int>(), z.mutable_data_ptr<C>(),
                                                              xz.mutable_data_ptr<C>(), is_bad.mutable_data_ptr<int>(),
                                                              batch, chunks, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  newton_fill_kernel<T, C><<<ew_grid, 256, 0, stream>>>(G.const_data_ptr<T>(), X.mutable_data_ptr<C>(),
                                                         M.mutable_data_ptr<C>(), z.const_data_ptr<C>(),
                                                         xz.const_data_ptr<C>(), is_bad.const_data_ptr<int>(), total,
                                                         n, static_cast<C>(eps));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // every matrix counts as active for this one residual pass
  at::Tensor all = at::ones({batch}, G.options().dtype(at::kInt));
  newton_rows_kernel<C, C, false><<<static_cast<unsigned>(batch * chunks), kRowThreads, 0, stream>>>(
      M.const_data_ptr<C>(), partial_p, nullptr, nullptr, all.const_data_ptr<int>(), n, chunks, C(0));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor ritz;  // the Lanczos estimates, of M (none when no step runs, or n is below their range)
  if (max_iters > 0 && n >= kLanczosMinN) {
    ritz = at::empty({batch}, copt);
    lanczos_large<C>(M, ritz, batch, n, stream);
  }
  newton_update_kernel<C, true><<<per_matrix_grid, 128, 0, stream>>>(
      partial_p, is_bad.const_data_ptr<int>(), err_p, prev_p, iters_p, active_p, counts_d, scaling,
      z.const_data_ptr<C>(), ritz.defined() ? ritz.const_data_ptr<C>() : nullptr, eps, p, batch, chunks,
      static_cast<C>(tol));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // One iteration: P = a I + b M, X <- X P, M <- P^p M, then each matrix's residual and stopping rule (a
  // matrix that has stopped gets P = I, so its X and M stay bitwise as they are).
  const auto iterate = [&](int it) {
    newton_step_kernel<C><<<ew_grid, 256, 0, stream>>>(M.const_data_ptr<C>(), P.mutable_data_ptr<C>(), active_p,
                                                          scaling.a, scaling.b, total, n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    at::bmm_out(Xn, X, P);
    std::swap(X, Xn);
    at::Tensor base = P;
    for (int q = p;;) {
      if (q & 1) {
        at::bmm_out(Mn, base, M);
        std::swap(M, Mn);
      }
      q >>= 1;
      if (!q) break;
      at::Tensor& next = (base.is_same(S1)) ? S2 : S1;
      at::bmm_out(next, base, base);
      base = next;
    }
    newton_rows_kernel<C, C, false><<<static_cast<unsigned>(batch * chunks), kRowThreads, 0, stream>>>(
        M.const_data_ptr<C>(), partial_p, nullptr, nullptr, active_p, n, chunks, C(0));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    newton_update_kernel<C, false><<<per_matrix_grid, 128, 0, stream>>>(
        partial_p, nullptr, err_p, prev_p, iters_p, active_p, counts_d + it + 1, scaling, nullptr, nullptr, eps, p, batch,
        chunks, static_cast<C>(tol));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (!wait) {  // every iteration queued, no host round trip: the same result, later ones possibly for nothing
    for (int it = 0; it < max_iters; ++it) iterate(it);
    root.copy_(X.view(root.sizes()));
    return;
  }
  at::Tensor host = at::empty({max_iters + 1}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
  int* host_p = host.mutable_data_ptr<int>();
  struct Events {  // two timing-free events, destroyed on every way out
    cudaEvent_t e[2] = {nullptr, nullptr};
    ~Events() {
      for (cudaEvent_t x : e)
        if (x) cudaEventDestroy(x);
    }
  } ev;
  for (cudaEvent_t& x : ev.e) C10_CUDA_CHECK(cudaEventCreateWithFlags(&x, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaMemcpyAsync(host_p, counts_d, sizeof(int), cudaMemcpyDeviceToHost, stream));
  C10_CUDA_CHECK(cudaEventRecord(ev.e[0], stream));

  const bool speculative = n < kSyncCheckFromN;
  if (!speculative) C10_CUDA_CHECK(cudaEventSynchronize(ev.e[0]));
  for (int it = 0; it < max_iters && (speculative || host_p[0] != 0); ++it) {
    // queue iteration it (a no-op for matrices that are done) ...
    iterate(it);
    C10_CUDA_CHECK(cudaMemcpyAsync(host_p + it + 1, counts_d + it + 1, sizeof(int), cudaMemcpyDeviceToHost, stream));
    C10_CUDA_CHECK(cudaEventRecord(ev.e[(it + 1) % 2], stream));
    // ... then, speculatively, read the count of the iteration before it (if none was active,
    // iteration it was a no-op); or, for large n, where one iteration costs milliseconds and a
    // wasted one more than the host round trip, wait for this iteration's own count.
    const int look = speculative ? it : it + 1;
    C10_CUDA_CHECK(cudaEventSynchronize(ev.e[look % 2]));
    if (host_p[look] == 0) break;
  }
  root.copy_(X.view(root.sizes()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> matrix_inverse_root_newton_cuda(const at::Tensor& G, int64_t p,
                                                                               double eps, int64_t max_iters,
                                                                               double tol, bool wait) {
  TORCHKERN_OP("matrix_inverse_root");
  TORCHKERN_CHECK_FLOAT(G);
  TORCHKERN_CHECK(G.dim() >= 2 && G.size(-1) == G.size(-2), "G must have shape [..., n, n] (square matrices), got ",
                  G.sizes());
  TORCHKERN_CHECK(p >= 1, "p must be a positive integer, got ", p);
  TORCHKERN_CHECK(max_iters >= 0, "max_iters must be >= 0, got ", max_iters);
  TORCHKERN_CHECK(tol >= 0, "tol must be >= 0, got ", tol);
  // G + eps I must be finite in the compute type (float32 for the half types)
  const bool f64 = G.scalar_type() == at::kDouble;
  const double top = f64 ? std::numeric_limits<double>::max() : std::numeric_limits<float>::max();
  TORCHKERN_CHECK(eps >= 0 && eps <= top, "eps must be a finite number in [0, ", top, "] (the range of ",
                  f64 ? "float64" : "float32", ", the compute dtype), got ", eps);
  TORCHKERN_CHECK_CUDA(G);
  TORCHKERN_CHECK(G.size(-1) < (1 << 20) && max_iters < (1 << 30), "n and max_iters are too large");
  const at::cuda::OptionalCUDAGuard guard(G.device());
  const auto batch_shape = G.sizes().slice(0, G.dim() - 2);
  const at::ScalarType cdt = f64 ? at::kDouble : at::kFloat;
  at::Tensor root = at::empty(G.sizes(), G.options());
  at::Tensor err = at::empty(batch_shape, G.options().dtype(cdt));
  at::Tensor iters = at::empty(batch_shape, G.options().dtype(at::kInt));
  if (G.numel() == 0) {
    err.zero_();
    iters.zero_();
    return {root, err, iters};
  }
  const int n = static_cast<int>(G.size(-1));
  const int64_t batch = G.numel() / (int64_t(n) * n);
  const at::Tensor Gc = G.contiguous();
  TORCHKERN_DISPATCH_FLOATING(G.scalar_type(), "matrix_inverse_root_newton", [&] {
    using C = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const bool small = newton_small_launch<scalar_t>(Gc.const_data_ptr<scalar_t>(), root.mutable_data_ptr<scalar_t>(),
                                                     err.mutable_data_ptr(), iters.mutable_data_ptr<int>(), batch, n,
                                                     static_cast<int>(p), eps, static_cast<int>(max_iters), tol,
                                                     current_stream());
    if (!small) {  // the symmetric part, as the small kernels and the twin take it
      const at::Tensor Gs = Gc.to(c10::CppTypeToScalarType<C>::value).view({batch, n, n});
      const at::Tensor sym = at::add(at::mul(Gs, 0.5), at::mul(Gs.transpose(1, 2), 0.5));
      newton_large<C, C>(sym, root, err, iters, batch, n, static_cast<int>(p), eps, static_cast<int>(max_iters), tol,
                         wait);
    }
  });
  return {root, err, iters};
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) {
  m.impl("matrix_inverse_root_newton", &torchkern::matrix_inverse_root_newton_cuda);
}
