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
// sweeps loop on the device (eigh_block_method_host.h), so the call returns without waiting for them.
#include <cuda_runtime.h>

#include "eigh_block_round.cuh"
#include "jacobi_tiles.cuh"
#include "launchers.h"
#include "torchkern/launch.cuh"
#include "torchkern/reduce.cuh"

#if !defined(TORCHKERN_EIGH_MAX_SWEEPS) || !defined(TORCHKERN_EIGH_INNER_SWEEPS)
#error "build through torchkern's loader: it defines the TORCHKERN_EIGH_* constants (linalg/constants.py)"
#endif

namespace torchkern {
namespace eigh {
namespace {

// The off-diagonal sum of squares of A (B, N, N) after a sweep, per (matrix, chunk of kOffRows rows): one pass over
// A, summed in a fixed order so that the stopping rule sees the same sums on every run. Matrices that have stopped
// are skipped.
constexpr int kOffRows = kBlockNormRows;
constexpr int kOffThreads = 256;
__global__ void __launch_bounds__(kOffThreads)
    offdiag_rows_kernel(const BlockBuffers* __restrict__ buf, int N, int chunks) {
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
__global__ void copy_back_kernel(const BlockBuffers* __restrict__ buf, int64_t pairs) {
  const double2* a1 = reinterpret_cast<const double2*>(buf->a[1]);
  const double2* w1 = reinterpret_cast<const double2*>(buf->w[1]);
  double2* a0 = reinterpret_cast<double2*>(buf->a[0]);
  double2* w0 = reinterpret_cast<double2*>(buf->w[0]);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < pairs; i += int64_t(gridDim.x) * blockDim.x) {
    __stwb(a0 + i, __ldg(a1 + i));
    __stwb(w0 + i, __ldg(w1 + i));
  }
}

// Sweep end, one block: a matrix goes on while its off-diagonal norm after the sweep (the sum of its chunks'
// partial sums) exceeds tol ||A||_F. loop[0] counts the sweeps, loop[1] gets the count of matrices that go on;
// with `use_handle` the device loop repeats while one does and fewer than max_sweeps have run.
constexpr int kSweepEndThreads = 256;
__global__ void __launch_bounds__(kSweepEndThreads)
    sweep_end_kernel(const BlockBuffers* __restrict__ buf, int64_t batch, int chunks, int max_sweeps,
                     unsigned long long handle, bool use_handle) {
  int going = 0;
  for (int64_t b = threadIdx.x; b < batch; b += kSweepEndThreads) {
    if (buf->active[b]) {
      double off2 = 0.0;
      for (int c = 0; c < chunks; ++c) off2 += buf->off_partial[b * chunks + c];
      const bool go = off2 > buf->stop2[b];
      buf->active[b] = go;
      going += go;
    }
  }
  __shared__ int scratch[kSweepEndThreads / 32];
  going = block_reduce<kSweepEndThreads>(going, scratch);
  if (threadIdx.x == 0) {
    const int sweeps = ++buf->loop[0];
    buf->loop[1] = going;
#if CUDART_VERSION >= 12040  // conditional graph nodes
    if (use_handle) cudaGraphSetConditional(handle, going > 0 && sweeps < max_sweeps);
#else
    (void)handle, (void)use_handle, (void)sweeps, (void)max_sweeps;
#endif
  }
}

// A call's buffers into the device memory its kernels read them from.
__global__ void set_buffers_kernel(BlockBuffers* dst, const BlockBuffers value) { *dst = value; }

}  // namespace

bool block_method_fits() { return jacobi::tiles::fits(); }

cudaError_t block_method_opt_in() {
  static int opted_in[kCachedDevices] = {};
  opt_in_smem(opted_in, block_round_kernel, kRoundSmem);
  jacobi::tiles::opt_in();
  return cudaGetLastError();
}

cudaError_t block_buffers_launch(BlockBuffers* dst, const BlockBuffers& value, cudaStream_t stream) {
  set_buffers_kernel<<<1, 1, 0, stream>>>(dst, value);
  return cudaGetLastError();
}

// nb - 1 rounds from buffers 0, alternating with buffers 1 (an odd count: the sweep ends in those), the off-diagonal
// norms, the stopping rule, the copy back. After a whole sweep of the circle method's moves every block row is back at
// its own position, so the result's layout does not depend on the number of sweeps.
cudaError_t block_sweep_launch(const BlockSweepParams& p, cudaStream_t stream) {
  const int64_t N = p.N, b = kBlock, nb = N / b, P = nb / 2, G = p.batch * P;
  jacobi::tiles::Tiles pr{};
  pr.buf = p.buf;
  pr.batch_stride = N * N;
  pr.tile_stride = 2 * b * (N + 1);
  pr.per = static_cast<int>(P);
  pr.ld = static_cast<int>(N);
  pr.max_sweeps = TORCHKERN_EIGH_INNER_SWEEPS;
  pr.stop_scale = double(N);
  const auto round_blocks = static_cast<unsigned>(p.batch * round_jobs(static_cast<int>(P)));
  for (int round = 0; round < nb - 1; ++round) {
    pr.from = round % 2;
    jacobi::tiles::launch(pr, G, stream);  // U: each pair slot's rotation
    block_round_kernel<<<round_blocks, kRoundThreads, kRoundSmem, stream>>>(p.buf, round % 2, p.N,
                                                                            static_cast<int>(P));
  }
  const int off_chunks = static_cast<int>(N / kOffRows);
  offdiag_rows_kernel<<<static_cast<unsigned>(p.batch * off_chunks), kOffThreads, 0, stream>>>(p.buf, p.N, off_chunks);
  sweep_end_kernel<<<1, kSweepEndThreads, 0, stream>>>(p.buf, p.batch, off_chunks, TORCHKERN_EIGH_MAX_SWEEPS, p.handle,
                                                       p.use_handle);
  const int64_t pairs = p.batch * N * N / 2;
  copy_back_kernel<<<grid_for(pairs, 256), 256, 0, stream>>>(p.buf, pairs);
  return cudaGetLastError();
}

}  // namespace eigh
}  // namespace torchkern
