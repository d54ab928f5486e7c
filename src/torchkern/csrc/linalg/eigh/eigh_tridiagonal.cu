// eigh's tridiagonal solver (float32 compute; tridiagonal.cuh has the kernels and the method): the shared way in
// (eigh_prep.h: flags, exponent, the scaled and symmetrized matrix, here in float32), A = Q T Q^T by Householder
// reflections on clusters of blocks, T's eigenpairs in float64 (bisection, sort, inverse iteration), the
// eigenvectors Q Z through the reflections' compact WY form, panel by panel from the last, in float64 products
// (cuBLAS: float32 matmuls would follow torch's TF32 flag), and the shared way out. Q0, when given, is only checked.
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/triu.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <tuple>

#include "../cluster.cuh"
#include "eigh_prep.h"
#include "eigh_solvers.h"
#include "torchkern/launch.h"
#include "tridiagonal.cuh"

namespace torchkern {
namespace eigh {
namespace {

// The largest cluster sytrd_kernel may take for n on this device: a power of two, at most 8 and the matrix's column
// chunks, on sm_90; one block before.
int tridiagonal_max_cluster(int64_t n) {
  const int64_t chunks = (n + tridiagonal::kChunk - 1) / tridiagonal::kChunk;
  int K = compute_capability() >= 90 ? tridiagonal::kMaxCluster : 1;
  while (K > 1 && K > chunks) K /= 2;  // (the kernel's sums over the cluster are shuffles)
  return K;
}

// Blocks per matrix for sytrd_kernel (0 where not tridiagonal_fits). A cluster of K blocks streams 1/K of the trailing
// matrix each, but per step the cluster's barriers cost the same; so the largest K up to tridiagonal_max_cluster
// whose clusters all fit on the GPU at once for a batch of B, else the smallest K that fits (many matrices: the
// fewest blocks per matrix do the least waiting).
int tridiagonal_cluster(int64_t B, int n, size_t* smem) {
  namespace td = tridiagonal;
  static int opted_in[kCachedDevices] = {};
  opt_in_smem(opted_in, td::sytrd_kernel, smem_optin_bytes());
  if (!tridiagonal_fits(n)) return 0;
  int fits = 0;
  for (int K = tridiagonal_max_cluster(n); K >= 1; K = K > 1 ? K / 2 : 0) {
    const size_t bytes = td::sytrd_smem_floats(n, K) * sizeof(float);
    if (bytes > smem_optin_bytes()) break;  // fewer blocks need more
    fits = K;
    *smem = bytes;
    const ClusterLaunch launch(static_cast<unsigned>(K), td::kThreads, static_cast<unsigned>(K), bytes, nullptr,
                               /*attach=*/true);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, td::sytrd_kernel, &launch.config) != cudaSuccess) {
      (void)cudaGetLastError();  // a refused query leaves its error behind
      continue;
    }
    if (B <= clusters) return K;
  }
  return fits;  // (*smem: its bytes, set when it fit)
}

// The tridiagonal solver (float32 compute; tridiagonal.cuh has the kernels and the method): the block method's way
// in (flags, exponent, the scaled and symmetrized matrix, here in float32), A = Q T Q^T by Householder reflections
// on clusters of blocks, T's eigenpairs in float64 (bisection, sort, inverse iteration), the eigenvectors Q Z
// through the reflections' compact WY form, panel by panel from the last, in float64 products (cuBLAS: float32

}  // namespace

// Whether the tridiagonal solver takes n on this device: its prefetch bound, and its shared memory at that largest
// cluster (fewer blocks need more).
bool tridiagonal_fits(int64_t n) {
  namespace td = tridiagonal;
  return n <= td::kPrefetch * td::kThreads &&
         td::sytrd_smem_floats(static_cast<int>(n), tridiagonal_max_cluster(n)) * sizeof(float) <= smem_optin_bytes();
}

// Inverse iteration's scratch (17 bytes per entry) goes by groups of matrices.
Result solve_tridiagonal(const at::Tensor& X, const at::Tensor& Q) {
  namespace td = tridiagonal;
  const int64_t B = X.size(0), n = X.size(1);
  const int ni = static_cast<int>(n);
  const cudaStream_t stream = current_stream();
  const auto iopt = X.options().dtype(at::kInt), fopt = X.options().dtype(at::kFloat);
  const auto dopt = X.options().dtype(at::kDouble);
  const int64_t ld = (n + td::kChunk - 1) / td::kChunk * td::kChunk;  // S's rows: whole column chunks
  at::Tensor exponent = at::empty({B}, iopt), flagged = at::empty({B}, iopt);
  at::Tensor S = at::empty({B, ld, ld}, fopt);  // zero padding past n
  prep_direct(X, Q, S, exponent, flagged);
  // A = Q T Q^T
  at::Tensor Wt = at::empty({B, td::kPanel, ld}, fopt);
  at::Tensor d = at::empty({B, n}, dopt), e = at::zeros({B, n}, dopt), tau = at::zeros({B, n}, fopt);
  size_t smem = 0;
  const int K = tridiagonal_cluster(B, ni, &smem);
  TORCH_CHECK(K > 0, "torchkern.eigh: the tridiagonal solver's reduction does not fit this GPU's shared memory at n = ",
              n, " (solver='auto' or 'jacobi' take it)");
  {
    const ClusterLaunch launch(static_cast<unsigned>(B * K), td::kThreads, static_cast<unsigned>(K), smem, stream,
                               /*attach=*/K > 1);
    const td::SytrdArgs args{S.mutable_data_ptr<float>(), Wt.mutable_data_ptr<float>(), d.mutable_data_ptr<double>(),
                             e.mutable_data_ptr<double>(), tau.mutable_data_ptr<float>(), ni, static_cast<int>(ld)};
    C10_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, td::sytrd_kernel, args, K));
  }
  // T's eigenvalues, ascending, and eigenvectors Z (columns, in that order); the kernels' shared memory is dynamic
  // only, so that all of the opt-in is theirs to take
  static int opted_split[kCachedDevices] = {}, opted_bisect[kCachedDevices] = {}, opted_inverse[kCachedDevices] = {};
  opt_in_smem(opted_split, td::split_kernel, smem_optin_bytes());
  opt_in_smem(opted_bisect, td::bisect_kernel, smem_optin_bytes());
  opt_in_smem(opted_inverse, td::inverse_iteration_kernel, smem_optin_bytes());
  at::Tensor bounds = at::empty({B, 3}, dopt), lo = at::empty({B, n}, iopt), hi = at::empty({B, n}, iopt);
  const size_t split_smem = (n + td::kTridThreads / 32) * sizeof(double);
  td::split_kernel<<<static_cast<unsigned>(B), td::kTridThreads, split_smem, stream>>>(
      d.const_data_ptr<double>(), e.mutable_data_ptr<double>(), bounds.mutable_data_ptr<double>(),
      lo.mutable_data_ptr<int>(), hi.mutable_data_ptr<int>(), ni);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor lam = at::empty({B, n}, dopt);
  const unsigned per_row = static_cast<unsigned>((n + td::kTridThreads - 1) / td::kTridThreads);
  td::bisect_kernel<<<dim3(per_row, static_cast<unsigned>(B)), td::kTridThreads, 2 * n * sizeof(double), stream>>>(
      d.const_data_ptr<double>(), e.const_data_ptr<double>(), bounds.const_data_ptr<double>(),
      lo.const_data_ptr<int>(), hi.const_data_ptr<int>(), lam.mutable_data_ptr<double>(), ni);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor sorted, order;
  std::tie(sorted, order) = at::sort(lam, /*dim=*/1);
  at::Tensor Z = at::zeros({B, n, n}, dopt);
  {
    const int64_t group = std::max<int64_t>(1, std::min<int64_t>(B, (int64_t(1) << 30) / (17 * n * n)));
    at::Tensor U0 = at::empty({group, n, n}, dopt), U1 = at::empty_like(U0);
    at::Tensor swaps = at::empty({group, n, n}, X.options().dtype(at::kByte));
    for (int64_t b0 = 0; b0 < B; b0 += group) {
      const int64_t g = std::min(group, B - b0);
      td::inverse_iteration_kernel<<<dim3(per_row, static_cast<unsigned>(g)), td::kTridThreads,
                                     3 * n * sizeof(double), stream>>>(
          d.const_data_ptr<double>() + b0 * n, e.const_data_ptr<double>() + b0 * n,
          bounds.const_data_ptr<double>() + 3 * b0, lo.const_data_ptr<int>() + b0 * n,
          hi.const_data_ptr<int>() + b0 * n, sorted.const_data_ptr<double>() + b0 * n,
          order.const_data_ptr<int64_t>() + b0 * n, Z.mutable_data_ptr<double>() + b0 * n * n,
          U0.mutable_data_ptr<double>(), U1.mutable_data_ptr<double>(), swaps.mutable_data_ptr<uint8_t>(), ni);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  // Q Z = H_0 H_1 .. H_{n-2} Z: the panels' I - V T V^T from the last, each on the rows its reflections touch
  const int64_t panels = (n + td::kPanel - 1) / td::kPanel;
  at::Tensor T = at::empty({B, panels, td::kPanel, td::kPanel}, dopt);
  td::panel_t_kernel<<<dim3(static_cast<unsigned>(panels), static_cast<unsigned>(B)), dim3(td::kPanel, td::kPanel),
                       0, stream>>>(S.const_data_ptr<float>(), tau.const_data_ptr<float>(),
                                    T.mutable_data_ptr<double>(), ni, static_cast<int>(ld));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor R = at::triu(S.narrow(1, 0, n).narrow(2, 0, n), 1).to(at::kDouble);  // row i: reflection i's v
  for (int64_t panel = panels - 1; panel >= 0; --panel) {
    const int64_t p = panel * td::kPanel, rows = std::min<int64_t>(td::kPanel, n - 1 - p), m = n - 1 - p;
    if (rows <= 0) continue;
    const at::Tensor Rp = R.narrow(1, p, rows).narrow(2, p + 1, m);  // V^T on the rows the panel touches
    const at::Tensor Tp = T.select(1, panel).narrow(1, 0, rows).narrow(2, 0, rows);
    at::Tensor Zp = Z.narrow(1, p + 1, m);
    Zp.baddbmm_(Rp.transpose(1, 2), at::bmm(Tp, at::bmm(Rp, Zp)), /*beta=*/1.0, /*alpha=*/-1.0);
  }
  at::Tensor w = at::empty({B, n}, X.options()), V = at::empty({B, n, n}, X.options());
  finish(Z, /*rows=*/false, sorted, at::Tensor(), exponent, flagged, at::Tensor(), w, V);
  return {w, V};
}

}  // namespace eigh
}  // namespace torchkern
