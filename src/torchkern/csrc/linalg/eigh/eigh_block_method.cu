// eigh's block method: block Jacobi in float64 for matrices above the in-block kernel's size (docs/design.md,
// "Symmetric eigensolver"). The padded matrix (N = n rounded up to 2b, b = TORCHKERN_EIGH_BLOCK) is split into
// nb = N / b block rows; a round pairs them up (positions 2k and 2k + 1 form pair k), a sweep of cyclic Jacobi
// rotates each pair's 2b x 2b diagonal tile (jacobi_tiles.cuh: U_k, unsorted, so that U_k stays close to a
// permutation-free rotation and the block pairs keep their meaning), and the rotation J = diag(U_k) is applied to
// both sides of A and to the basis W = V^T while the block rows move to the next round's positions (the circle
// method: one block row stays, the others move one seat along a cycle; every pair of block rows meets once in
// nb - 1 rounds): A <- Pi J^T A J Pi^T and W <- Pi J^T W, with Pi the move, in one launch of 2b x 2b tiles on the
// float64 tensor cores (eigh_block_round.cuh). FLOPs per round about 8 B N^2 b (half for A's two sides, computed on
// and above the diagonal only, half for W), per sweep about 8 B N^3. Float64 throughout: float32 accumulation over
// the many rounds lost the 1e-5 residual in an emulation, and float64 products run on the tensor cores of sm_80+.
// A matrix stops after the first sweep that leaves its off-diagonal norm <= tol ||A||_F (summed from the matrix
// after the sweep: a sum of the tiles' norms as the sweep reaches them learns of convergence one sweep late); the
// sweeps loop on the device (eigh_sweep_loop.cuh), so the call returns without waiting for them.
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <tuple>

#include "eigh_block_round.cuh"
#include "eigh_prep.h"
#include "eigh_solvers.h"
#include "eigh_sweep_loop.cuh"
#include "jacobi_tiles.cuh"
#include "torchkern/launch.h"
#include "torchkern/reduce.cuh"

#if !defined(TORCHKERN_EIGH_MAX_SWEEPS) || !defined(TORCHKERN_EIGH_INNER_SWEEPS)
#error "build through torchkern's loader: it defines the TORCHKERN_EIGH_* constants (linalg/constants.py)"
#endif

namespace torchkern {
namespace eigh {
namespace {

constexpr int kMaxSweeps = TORCHKERN_EIGH_MAX_SWEEPS;
constexpr int kInnerSweeps = TORCHKERN_EIGH_INNER_SWEEPS;

// The off-diagonal sum of squares of A (B, N, N) after a sweep, per (matrix, chunk of kOffRows rows): one pass over
// A, summed in a fixed order so that the stopping rule sees the same sums on every run. Matrices that have stopped
// are skipped.
constexpr int kOffRows = 16;  // divides N (a multiple of 2b)
constexpr int kOffThreads = 256;
__global__ void __launch_bounds__(kOffThreads)
    offdiag_rows_kernel(const jacobi::tiles::BlockBuffers* __restrict__ buf, int N, int chunks) {
  const int64_t b = blockIdx.x / chunks;
  const int chunk = static_cast<int>(blockIdx.x - b * chunks);
  if (!buf->active[b]) return;
  const double* A = buf->a[1];  // a sweep's result
  double s = 0.0;
  for (int r = 0; r < kOffRows; ++r) {
    const int i = chunk * kOffRows + r;
    const double* row = A + (b * N + i) * int64_t(N);
    for (int j = threadIdx.x; j < N; j += kOffThreads) {
      const double x = __ldg(row + j);
      s += j == i ? 0.0 : x * x;
    }
  }
  __shared__ double scratch[kOffThreads / 32];
  s = block_reduce<kOffThreads>(s, scratch);
  if (threadIdx.x == 0) buf->off_partial[blockIdx.x] = s;
}

// A sweep's result back into buffers 0 (a graph's body cannot swap them): two passes over A and W, about 1% of a
// sweep.
__global__ void copy_back_kernel(const jacobi::tiles::BlockBuffers* __restrict__ buf, int64_t pairs) {
  const double2* a1 = reinterpret_cast<const double2*>(buf->a[1]);
  const double2* w1 = reinterpret_cast<const double2*>(buf->w[1]);
  double2* a0 = reinterpret_cast<double2*>(buf->a[0]);
  double2* w0 = reinterpret_cast<double2*>(buf->w[0]);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < pairs; i += int64_t(gridDim.x) * blockDim.x) {
    __stwb(a0 + i, __ldg(a1 + i));
    __stwb(w0 + i, __ldg(w1 + i));
  }
}

}  // namespace

// On X (B, n, n) of any float dtype (contiguous), from Q0^T A Q0 with Q (B, n, n; undefined for a cold start). It
// works in float64 on A = 2^-e (X + X^T) / 2 padded to N, with the accumulated rotations W = V^T starting from Q0^T
// (so that they end as (Q0 V')^T: no product on the way out). Float64 results get one orthogonality correction of V.
Result solve_block_method(const at::Tensor& X, const at::Tensor& Q, double tol) {
  const int64_t B = X.size(0), n = X.size(1), b = kBlock;
  // N: n padded to whole block pairs, and at least two pairs (the circle method's moves need them)
  const int64_t N = std::max<int64_t>((n + 2 * b - 1) / (2 * b) * (2 * b), 4 * b), nb = N / b, P = nb / 2, G = B * P;
  const auto opt = X.options().dtype(at::kDouble), iopt = X.options().dtype(at::kInt);
  const cudaStream_t stream = current_stream();
  TORCH_CHECK(jacobi::tiles::fits(), "torchkern.eigh: the block method's subproblems (64 x 64 tiles) need ",
              jacobi::tiles::kSmem / 1024, " KiB of shared memory per thread block, more than this GPU allows");
  // A and the basis W = V^T by position, each with the buffer a round writes (every entry of it).
  at::Tensor A = at::empty({B, N, N}, opt), A_next = at::empty_like(A);
  at::Tensor W = at::empty({B, N, N}, opt), W_next = at::empty_like(W);
  at::Tensor U = at::empty({G, 2 * b, 2 * b}, opt);
  at::Tensor exponent = at::empty({B}, iopt), flagged = at::empty({B}, iopt);
  at::Tensor thr = at::empty({B}, opt), stop2 = at::empty({B}, opt);
  prep_block(X, Q, A, W, exponent, flagged, thr, stop2, tol);
  if (Q.defined()) {
    // A <- Q0^T A Q0 on the n x n corner (W holds Q0^T there), the products in float64: float32 ones would
    // follow torch's global TF32 flag (1e-3 accuracy when a training script turns it on), far from the 1e-5
    // residual. The thresholds above are from A's norm, which the rotation keeps.
    at::Tensor corner = A.narrow(1, 0, n).narrow(2, 0, n);
    const at::Tensor Qt = W.narrow(1, 0, n).narrow(2, 0, n);
    const at::Tensor AQ = at::bmm(corner, Qt.transpose(1, 2));
    at::bmm_out(corner, Qt, AQ);
  }
  static int opted_in[kCachedDevices] = {};
  opt_in_smem(opted_in, block_round_kernel, kRoundSmem);
  jacobi::tiles::opt_in();  // before a capture, which records launches only
  const auto round_blocks = static_cast<unsigned>(B * round_jobs(static_cast<int>(P)));
  at::Tensor active = at::ones({B}, iopt);
  const int off_chunks = static_cast<int>(N / kOffRows);
  at::Tensor off_partial = at::empty({B * off_chunks}, opt);
  at::Tensor loop = at::zeros({2}, iopt);  // sweeps run, matrices going on (sweep_end_kernel)
  const jacobi::tiles::BlockBuffers buffers{
      {A.mutable_data_ptr<double>(), A_next.mutable_data_ptr<double>()},
      {W.mutable_data_ptr<double>(), W_next.mutable_data_ptr<double>()},
      U.mutable_data_ptr<double>(),
      thr.const_data_ptr<double>(),
      stop2.const_data_ptr<double>(),
      active.mutable_data_ptr<int>(),
      off_partial.mutable_data_ptr<double>(),
      loop.mutable_data_ptr<int>()};
  // One sweep, its kernels reading the call's buffers from `buf`: nb - 1 rounds from buffers 0, alternating with
  // buffers 1 (an odd count: the sweep ends in those), the off-diagonal norms, the stopping rule, the copy back.
  // After a whole sweep of the circle method's moves every block row is back at its own position, so the
  // result's layout does not depend on the number of sweeps.
  const int64_t pairs = B * N * N / 2;
  const auto sweep = [=](cudaStream_t s, const jacobi::tiles::BlockBuffers* buf, LoopHandle handle,
                         bool use_handle) {
    jacobi::tiles::Tiles pr{};
    pr.buf = buf;
    pr.batch_stride = N * N;
    pr.tile_stride = 2 * b * (N + 1);
    pr.per = static_cast<int>(P);
    pr.ld = static_cast<int>(N);
    pr.max_sweeps = kInnerSweeps;
    pr.stop_scale = double(N);
    for (int round = 0; round < nb - 1; ++round) {
      pr.from = round % 2;
      jacobi::tiles::launch(pr, G, s);  // U: each pair slot's rotation
      block_round_kernel<<<round_blocks, kRoundThreads, kRoundSmem, s>>>(buf, round % 2, static_cast<int>(N),
                                                                          static_cast<int>(P));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    offdiag_rows_kernel<<<static_cast<unsigned>(B * off_chunks), kOffThreads, 0, s>>>(buf, static_cast<int>(N),
                                                                                      off_chunks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    sweep_end_kernel<<<1, kSweepEndThreads, 0, s>>>(buf, B, off_chunks, kMaxSweeps, handle, use_handle);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    copy_back_kernel<<<grid_for(pairs, 256), 256, 0, s>>>(buf, pairs);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (!launch_sweeps(B, N, buffers, stream, sweep)) {  // no device loop: the host reads the count after each sweep
    at::Tensor buf = at::empty({static_cast<int64_t>(sizeof(buffers))}, X.options().dtype(at::kByte));
    auto* dbuf = reinterpret_cast<jacobi::tiles::BlockBuffers*>(buf.mutable_data_ptr());
    set_buffers_kernel<<<1, 1, 0, stream>>>(dbuf, buffers);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    at::Tensor host = at::empty({1}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
    cudaEvent_t event = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    struct EventGuard {
      cudaEvent_t e;
      ~EventGuard() { cudaEventDestroy(e); }
    } event_guard{event};
    for (int s = 0; s < kMaxSweeps; ++s) {
      sweep(stream, dbuf, LoopHandle{}, false);
      C10_CUDA_CHECK(cudaMemcpyAsync(host.mutable_data_ptr<int>(), loop.const_data_ptr<int>() + 1, sizeof(int),
                                     cudaMemcpyDeviceToHost, stream));
      C10_CUDA_CHECK(cudaEventRecord(event, stream));
      C10_CUDA_CHECK(cudaEventSynchronize(event));
      if (*host.const_data_ptr<int>() == 0) break;
    }
  }
  // The result, in buffers 0: the eigenvalues on A's diagonal, the padding's coordinates (which never rotate: their
  // rows and columns are zero) last.
  at::Tensor sorted, order;
  std::tie(sorted, order) = at::sort(A.diagonal(0, 1, 2).narrow(1, 0, n), 1);
  at::Tensor w = at::empty({B, n}, X.options()), V = at::empty({B, n, n}, X.options());
  finish(W, /*rows=*/true, sorted, order, exponent, flagged, at::Tensor(), w, V);
  // The basis went through hundreds of rounds of products, each adding rounding to V^T V - I (measured: 1e-12 at
  // n = 256, the float64 bar's edge). For float64 results one correction V <- V (3 I - V^T V) / 2 squares that
  // error (two products, a few percent of one sweep) and moves V by O(error), leaving the residual as it was (a
  // flagged matrix's NaN stays NaN); rounding to float32 adds far more (about 1e-7) than it removes.
  if (X.scalar_type() == at::kDouble) {
    const at::Tensor gram = at::bmm(V.transpose(1, 2), V);
    gram.diagonal(0, 1, 2).sub_(3.0);
    V = at::bmm(V, gram).mul_(-0.5);
  }
  return {w, V};
}

}  // namespace eigh
}  // namespace torchkern
