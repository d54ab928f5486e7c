// The Newton inverse root's large path, the host side (the iteration and its kernels: matrix_inverse_root_newton.cu):
// the state's buffers, the batched products X <- X P and M <- P^p M (cuBLAS through at::bmm, in the compute type) and
// the loop that stops once no matrix goes on. For n < kSyncCheckFromN the count of iteration k is read after
// iteration k + 1 has been queued, so the GPU never waits for the host (the price: one extra, frozen, no-op iteration
// at the end); from there an iteration costs milliseconds, so the host waits for each iteration's own count instead.
// Part of linalg's one host translation unit (../ops.cpp includes it): torch's headers are parsed once.
#pragma once

#include "matrix_inverse_root_newton.h"

#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <utility>

#include "launchers.h"
#include "torchkern/launch.h"

#if !defined(TORCHKERN_LANCZOS_STEPS) || !defined(TORCHKERN_LANCZOS_MIN_N)
#error "build through torchkern's loader: it defines the TORCHKERN_LANCZOS_* constants (linalg/constants.py)"
#endif

namespace torchkern {
namespace newton {
namespace {

constexpr int kSyncCheckFromN = 512;  // from this n on the convergence check waits for its own iteration

}  // namespace

void solve_large(const at::Tensor& A, at::Tensor& root, at::Tensor& err, at::Tensor& iters, int p, double eps,
                 int max_iters, double tol, bool wait) {
  const cudaStream_t stream = current_stream();
  const int64_t batch = A.size(0);
  const int n = static_cast<int>(A.size(1)), chunks = (n + kRowsPerChunk - 1) / kRowsPerChunk;
  const auto copt = A.options(), iopt = A.options().dtype(at::kInt);
  at::Tensor X = at::empty({batch, n, n}, copt), M = at::empty_like(X), P = at::empty_like(X);
  at::Tensor Xn = at::empty_like(X), Mn = at::empty_like(X), S1, S2;
  if (p > 1) S1 = at::empty_like(X);
  if (p > 3) S2 = at::empty_like(X);
  at::Tensor prev = at::empty({batch}, copt), active = at::empty({batch}, iopt), is_bad = at::empty({batch}, iopt);
  at::Tensor counts = at::zeros({max_iters + 1}, iopt);
  at::Tensor partial = at::empty({batch, chunks}, copt), row_max = at::empty({batch, chunks}, copt);
  at::Tensor bad = at::empty({batch, chunks}, iopt);
  at::Tensor z = at::empty({batch}, copt), xz = at::empty({batch}, copt);
  at::Tensor coef = at::empty({2, batch}, copt), next_low = at::empty({batch}, copt.dtype(at::kDouble));
  LargeParams s{};
  s.A = A.const_data_ptr();
  s.X = X.mutable_data_ptr();
  s.M = M.mutable_data_ptr();
  s.P = P.mutable_data_ptr();
  s.partial = partial.mutable_data_ptr();
  s.row_max = row_max.mutable_data_ptr();
  s.bad = bad.mutable_data_ptr<int>();
  s.z = z.mutable_data_ptr();
  s.xz = xz.mutable_data_ptr();
  s.is_bad = is_bad.mutable_data_ptr<int>();
  s.err = err.mutable_data_ptr();
  s.prev = prev.mutable_data_ptr();
  s.iters = iters.mutable_data_ptr<int>();
  s.active = active.mutable_data_ptr<int>();
  s.counts = counts.mutable_data_ptr<int>();
  s.coef_a = coef.select(0, 0).mutable_data_ptr();
  s.coef_b = coef.select(0, 1).mutable_data_ptr();
  s.next_low = next_low.mutable_data_ptr<double>();
  s.f64 = A.scalar_type() == at::kDouble;
  s.batch = batch;
  s.n = n;
  s.p = p;
  s.eps = eps;
  s.tol = tol;
  C10_CUDA_CHECK(large_launch(Stage::kStart, s, 0, stream));
  at::Tensor ritz;  // the Lanczos estimates, of M (none when no step runs, or n is below their range)
  if (max_iters > 0 && n >= TORCHKERN_LANCZOS_MIN_N) {
    ritz = at::empty({batch}, copt);
    at::Tensor V = at::empty({batch, n, 1}, copt), V_prev = at::empty({batch, n}, copt), W = at::empty_like(V);
    at::Tensor tri = at::empty({batch, 2, TORCHKERN_LANCZOS_STEPS}, copt), scale = at::empty({batch}, copt);
    at::Tensor taken = at::empty({batch}, iopt);
    s.ritz = ritz.mutable_data_ptr();
    s.V = V.mutable_data_ptr();
    s.V_prev = V_prev.mutable_data_ptr();
    s.W = W.mutable_data_ptr();
    s.tri = tri.mutable_data_ptr();
    s.scale = scale.mutable_data_ptr();
    s.taken = taken.mutable_data_ptr<int>();
    C10_CUDA_CHECK(large_launch(Stage::kLanczosStart, s, 0, stream));
    const at::Tensor Mt = M.transpose(1, 2);  // A v as A^T v, as the twin and the small kernel compute it
    for (int j = 0; j < std::min(TORCHKERN_LANCZOS_STEPS, n); ++j) {
      at::bmm_out(W, Mt, V);
      C10_CUDA_CHECK(large_launch(Stage::kLanczosStep, s, j, stream));
    }
    C10_CUDA_CHECK(large_launch(Stage::kLanczosRitz, s, 0, stream));
  }
  C10_CUDA_CHECK(large_launch(Stage::kFirstUpdate, s, 0, stream));
  // One iteration: P = a I + b M, X <- X P, M <- P^p M, then each matrix's residual and stopping rule (a
  // matrix that has stopped gets P = I, so its X and M stay bitwise as they are).
  const auto iterate = [&](int it) {
    s.M = M.mutable_data_ptr();
    C10_CUDA_CHECK(large_launch(Stage::kStep, s, it, stream));
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
    s.M = M.mutable_data_ptr();
    C10_CUDA_CHECK(large_launch(Stage::kCheck, s, it, stream));
  };
  if (!wait) {  // every iteration queued, no host round trip: the same result, later ones possibly for nothing
    for (int it = 0; it < max_iters; ++it) iterate(it);
    root.copy_(X.view(root.sizes()));
    return;
  }
  const int* counts_d = counts.const_data_ptr<int>();
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

}  // namespace newton
}  // namespace torchkern
