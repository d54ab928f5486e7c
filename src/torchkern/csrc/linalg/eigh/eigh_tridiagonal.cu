// eigh's tridiagonal solver, the launchers (launchers.h) of its kernels (tridiagonal.cuh has them and the method):
// the reduction on clusters of blocks, T's splitting and eigenvalues, its eigenvectors by inverse iteration, and the
// panels' compact WY factors. The host side (eigh_tridiagonal_host.h) sorts and multiplies between them.
#include <cuda_runtime.h>

#include "../cluster.cuh"
#include "launchers.h"
#include "torchkern/launch.cuh"
#include "tridiagonal.cuh"

namespace torchkern {
namespace eigh {
namespace td = tridiagonal;
static_assert(kTridiagonalChunk == td::kChunk && kTridiagonalPanel == td::kPanel,
              "launchers.h's sizes are the kernels'");

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

// The kernels' shared memory is dynamic only, so that all of the opt-in is theirs to take.
void opt_in_tridiagonal() {
  static int opted_split[kCachedDevices] = {}, opted_bisect[kCachedDevices] = {}, opted_inverse[kCachedDevices] = {};
  opt_in_smem(opted_split, td::split_kernel, smem_optin_bytes());
  opt_in_smem(opted_bisect, td::bisect_kernel, smem_optin_bytes());
  opt_in_smem(opted_inverse, td::inverse_iteration_kernel, smem_optin_bytes());
}

unsigned per_row(int n) { return static_cast<unsigned>((n + td::kTridThreads - 1) / td::kTridThreads); }

}  // namespace

// Whether the tridiagonal solver takes n on this device: its prefetch bound, and its shared memory at that largest
// cluster (fewer blocks need more).
bool tridiagonal_fits(int64_t n) {
  return n <= td::kPrefetch * td::kThreads &&
         td::sytrd_smem_floats(static_cast<int>(n), tridiagonal_max_cluster(n)) * sizeof(float) <= smem_optin_bytes();
}

cudaError_t tridiagonal_reduce_launch(const TridiagonalParams& p, cudaStream_t stream) {
  size_t smem = 0;
  const int K = tridiagonal_cluster(p.batch, p.n, &smem);
  if (K == 0) return cudaErrorInvalidConfiguration;  // (the host checks tridiagonal_fits first)
  const ClusterLaunch launch(static_cast<unsigned>(p.batch * K), td::kThreads, static_cast<unsigned>(K), smem, stream,
                             /*attach=*/K > 1);
  const td::SytrdArgs args{p.S, p.Wt, p.d, p.e, p.tau, p.n, p.ld};
  TORCHKERN_RETURN_IF_ERROR(cudaLaunchKernelEx(&launch.config, td::sytrd_kernel, args, K));
  return cudaGetLastError();
}

cudaError_t tridiagonal_eigenvalues_launch(const TridiagonalParams& p, cudaStream_t stream) {
  opt_in_tridiagonal();
  const size_t split_smem = (p.n + td::kTridThreads / 32) * sizeof(double);
  td::split_kernel<<<static_cast<unsigned>(p.batch), td::kTridThreads, split_smem, stream>>>(p.d, p.e, p.bounds, p.lo,
                                                                                           p.hi, p.n);
  td::bisect_kernel<<<dim3(per_row(p.n), static_cast<unsigned>(p.batch)), td::kTridThreads,
                      2 * p.n * sizeof(double), stream>>>(p.d, p.e, p.bounds, p.lo, p.hi, p.lam, p.n);
  return cudaGetLastError();
}

cudaError_t tridiagonal_vectors_launch(const TridiagonalParams& p, const InverseIterationParams& q,
                                       cudaStream_t stream) {
  opt_in_tridiagonal();
  const int64_t n = p.n, b0 = q.b0;
  td::inverse_iteration_kernel<<<dim3(per_row(p.n), static_cast<unsigned>(q.group)), td::kTridThreads,
                                 3 * n * sizeof(double), stream>>>(
      p.d + b0 * n, p.e + b0 * n, p.bounds + 3 * b0, p.lo + b0 * n, p.hi + b0 * n, q.sorted + b0 * n,
      q.order + b0 * n, q.Z + b0 * n * n, q.U0, q.U1, q.swaps, p.n);
  return cudaGetLastError();
}

cudaError_t tridiagonal_panels_launch(const TridiagonalParams& p, cudaStream_t stream) {
  const int panels = (p.n + td::kPanel - 1) / td::kPanel;
  const dim3 grid(static_cast<unsigned>(panels), static_cast<unsigned>(p.batch));
  td::panel_t_kernel<<<grid, dim3(td::kPanel, td::kPanel), 0, stream>>>(p.S, p.tau, p.T, p.n, p.ld);
  return cudaGetLastError();
}

}  // namespace eigh
}  // namespace torchkern
