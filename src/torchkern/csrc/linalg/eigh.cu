// eigh(A, Q0=None) -> (eigenvalues ascending, eigenvectors as columns) of the symmetric part of A.
//
// Every path zeroes matrices with a NaN or Inf entry (their outputs become NaN), scales each matrix by a
// power of two so that max |a_ij| lies in [0.5, 1) (exact; nothing in the norms, the rotation formulas or
// Q0^T A Q0 overflows or underflows), and symmetrizes, (A + A^T) / 2: the in-block kernel does all three
// itself, the block method in its preparation kernels; otherwise ATen ops do it first, as the twin does. With Q0
// it solves Q0^T A Q0 and returns Q0 V' (a warm start: from an eigenbasis of a nearby matrix, the rotated matrix
// is nearly diagonal and Jacobi needs few sweeps).
//
// n small enough for one thread block's shared memory (jacobi.cuh: A in the compute type and V in double,
// 12 m (m + 1) bytes in float32, 16 m (m + 1) in float64, m = n rounded up to even: n <= 136 and n <= 118
// on sm_90's 227 KiB): one block per matrix runs the whole cyclic Jacobi.
//
// Larger n: block Jacobi in float64 (float32 accumulation over the many rounds lost the 1e-5 residual in an
// emulation; float64 products run on the tensor cores of sm_80+). The padded matrix (N = n rounded up to
// 2b, b = TORCHKERN_EIGH_BLOCK) is split into nb = N / b block rows; a round pairs them up (positions 2k and
// 2k + 1 form pair k), a sweep of cyclic Jacobi rotates each pair's 2b x 2b diagonal tile (jacobi_tiles.cuh:
// U_k, unsorted, so that U_k stays close to a permutation-free rotation and the block pairs keep their
// meaning), and the rotation J = diag(U_k) is applied to both sides of A and to the basis W = V^T while the
// block rows move to the next round's positions (the circle method: one block row stays, the others move one
// seat along a cycle; every pair of block rows meets once in nb - 1 rounds): A <- Pi J^T A J Pi^T and
// W <- Pi J^T W, with Pi the move, in one launch of 2b x 2b tiles on the float64 tensor cores
// (block_round_kernel). FLOPs per round about 8 B N^2 b (half for A's two sides, computed on and above the
// diagonal only, half for W), per sweep about 8 B N^3. A matrix stops after the first sweep that leaves its
// off-diagonal norm <= tol ||A||_F (summed from the matrix after the sweep: a sum of the tiles' norms as the
// sweep reaches them learns of convergence one sweep late); the sweeps loop on the device (a CUDA graph's WHILE
// node), so the call returns without waiting for them.
// cuSOLVER takes the calls where it is faster (linalg/constants.py, choose_solver below): its batched solver
// (syev_batched.h) the cold starts of 96 <= n <= 256 (float64: 128) and of large batches above, and the float32
// warm starts up to n = 256 of large batches and of the in-block kernel's largest sizes, from
// TORCHKERN_EIGH_SYEV_WARM_MIN_N (Q0 ignored: a direct method gains nothing from it); torch.linalg.eigh (syevd,
// one matrix after another) the other cold starts from n = TORCHKERN_EIGH_TORCH_FROM_N on, except batches of at
// least TORCHKERN_EIGH_BLOCK_MIN_BATCH matrices up to n = TORCHKERN_EIGH_BLOCK_MAX_N. Before those, float32 cold
// starts from n = TORCHKERN_EIGH_TRIDIAGONAL_MIN_N (but single matrices from TORCHKERN_EIGH_TORCH_FROM_N) go to the
// tridiagonal solver (tridiagonal.cuh, eigh_tridiagonal below): Householder reduction, T's eigenpairs in float64,
// the eigenvectors back by compact WY products; so do their warm starts (Q0 ignored), unless the caller's tol is at
// least TORCHKERN_EIGH_WARM_JACOBI_MIN_TOL (then the Jacobi warm start stops after a sweep or two).
#include <ATen/core/Tensor.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/add.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/floor_divide.h>
#include <ATen/ops/frexp.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/linalg_eigh.h>
#include <ATen/ops/logical_or.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/neg.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/triu.h>
#include <ATen/ops/sub.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "jacobi.cuh"
#include "jacobi_tiles.cuh"
#include "syev_batched.h"
#include "tridiagonal.cuh"
#include "torchkern/checks.h"
#include "torchkern/dispatch.h"
#include "torchkern/launch.h"
#include "torchkern/reduce.cuh"

#if !defined(TORCHKERN_EIGH_TOL_F32) || !defined(TORCHKERN_EIGH_BLOCK)
#error "build through torchkern's loader: it defines the TORCHKERN_EIGH_* constants (linalg/constants.py)"
#endif

namespace torchkern {
namespace {

constexpr int kBlock = TORCHKERN_EIGH_BLOCK;
constexpr int kMaxSweeps = TORCHKERN_EIGH_MAX_SWEEPS;
constexpr int kInnerSweeps = TORCHKERN_EIGH_INNER_SWEEPS;
constexpr int kSmallMaxN = TORCHKERN_EIGH_SMALL_MAX_N;
constexpr int kTorchFromN = TORCHKERN_EIGH_TORCH_FROM_N;  // 0: never

// Who solves B matrices of size n: the Jacobi kernels (in-block or block method), cuSOLVER's batched solver,
// torch.linalg.eigh's loop of syevd (faster than the block method for a few large matrices) or the tridiagonal
// solver (float32 cold starts of large matrices); linalg/constants.py has the measurements behind the thresholds.
enum class Solver { kJacobi, kSyevBatched, kSyevdLoop, kTridiagonal };

// The largest cluster sytrd_kernel may take for n on this device: a power of two, at most 8 and the matrix's column
// chunks, on sm_90; one block before.
int tridiagonal_max_cluster(int64_t n) {
  const int64_t chunks = (n + tridiagonal::kChunk - 1) / tridiagonal::kChunk;
  int K = compute_capability() >= 90 ? tridiagonal::kMaxCluster : 1;
  while (K > 1 && K > chunks) K /= 2;  // (the kernel's sums over the cluster are shuffles)
  return K;
}

// Whether the tridiagonal solver takes n on this device: its prefetch bound, and its shared memory at that largest
// cluster (fewer blocks need more).
bool tridiagonal_fits(int64_t n) {
  namespace td = tridiagonal;
  return n <= td::kPrefetch * td::kThreads &&
         td::sytrd_smem_floats(static_cast<int>(n), tridiagonal_max_cluster(n)) * sizeof(float) <= smem_optin_bytes();
}

// `tol`: the caller's stopping tolerance, which only the Jacobi kernels honour; a warm start goes to them where the
// tridiagonal solver would take the cold start only when tol lets them stop after a sweep or two.
Solver choose_solver(int64_t B, int64_t n, bool f64, bool warm, double tol) {
  const bool one_at_a_time = kTorchFromN > 0 && n >= kTorchFromN && B < TORCHKERN_EIGH_TRIDIAGONAL_MIN_BATCH;
  const bool tridiagonal_takes = !f64 && n >= TORCHKERN_EIGH_TRIDIAGONAL_MIN_N && !one_at_a_time && tridiagonal_fits(n);
  if (tridiagonal_takes && (!warm || tol < TORCHKERN_EIGH_WARM_JACOBI_MIN_TOL)) return Solver::kTridiagonal;
  const int64_t elems = B * n * n;
  const int64_t max_n = f64 ? TORCHKERN_EIGH_SYEV_MAX_N_F64 : TORCHKERN_EIGH_SYEV_MAX_N_F32;
  const bool in_block_largest = n >= TORCHKERN_EIGH_SYEV_WARM_MIN_N && n <= kSmallMaxN && jacobi::fits<float>(n);
  const bool batched_wins =
      warm ? !f64 && n <= max_n && (elems >= TORCHKERN_EIGH_SYEV_WARM_MIN_ELEMS || in_block_largest)
           : n <= max_n || elems >= TORCHKERN_EIGH_SYEV_MIN_ELEMS;
  if (n >= TORCHKERN_EIGH_SYEV_MIN_N && batched_wins && syev_batched_available()) return Solver::kSyevBatched;
  const bool loop_wins = kTorchFromN > 0 && n >= kTorchFromN &&
                         (B < TORCHKERN_EIGH_BLOCK_MIN_BATCH || n > TORCHKERN_EIGH_BLOCK_MAX_N);
  return !warm && loop_wins ? Solver::kSyevdLoop : Solver::kJacobi;
}

// 2^(k) for an int tensor k, applied in two halves so that neither factor overflows the dtype.
at::Tensor times_pow2(const at::Tensor& x, const at::Tensor& k) {
  const at::Tensor half = at::floor_divide(k, 2);
  const at::Tensor two = at::scalar_tensor(2.0, x.options());
  const at::Tensor low = at::pow(two, half.to(x.scalar_type()));
  const at::Tensor high = at::pow(two, at::sub(k, half).to(x.scalar_type()));
  return at::mul(at::mul(x, low), high);
}

// A warm start's rotations on the in-block path (float32 input, n <= 120 on sm_90): kIn, Y = Q^T X^T Q (the solver
// decomposes its symmetric part, the same as Q^T X Q's, and X^T spares a transposed load); else Y = Q X (the
// eigenvectors back from the rotated basis). One block per matrix, the operands in shared memory as float64
// (converted once: float -> float64 conversions run at a quarter of the float64 FMA rate on sm_90), float64 sums
// of the float32 inputs' exact products, Y rounded once to float32: the float64 matmuls' results up to summation
// order. One launch a side for the eight ATen ops (conversions to and from float64, three matmuls) whose host time
// was most of a small warm start's cost. A thread owns 8 x 8 outputs; the 8 rows of the left factor (stored
// transposed) and the 8 columns of the right one that it reads per k are consecutive.
constexpr int kRotTile = 8;
constexpr int kRotThreads = 256;  // a thread per tile up to n = 128

// Row stride of the padded operands: whole tiles everywhere (the padding is zero).
__host__ __device__ inline int rotate_ld(int64_t n) {
  return static_cast<int>((n + kRotTile - 1) / kRotTile * kRotTile);
}

// Shared memory of warm_rotate_kernel: two n x n float64 operands (kIn: T = X^T Q then overwrites the first).
int64_t rotate_smem(int64_t n) { return 2 * static_cast<int64_t>(rotate_ld(n)) * rotate_ld(n) * sizeof(double); }

// Whether warm_rotate_kernel takes n on this device (its shared memory, a tile per thread).
bool warm_rotate_fits(int64_t n) {
  const int64_t tiles = rotate_ld(n) / kRotTile;
  return tiles * tiles <= kRotThreads && rotate_smem(n) <= static_cast<int64_t>(smem_optin_bytes());
}

// acc(i0 + a, j0 + c) = sum_k L(i0 + a, k) R(k, j0 + c), with Lt = L^T and R row-major (leading dimension ld).
__device__ __forceinline__ void rotate_tile(const double* __restrict__ Lt, const double* __restrict__ R, int ld,
                                            int n, int i0, int j0, double (&acc)[kRotTile][kRotTile]) {
  for (int k = 0; k < n; ++k) {
    double l[kRotTile], r[kRotTile];
#pragma unroll
    for (int c = 0; c < kRotTile; c += 2) {  // 16-byte loads
      const double2 lv = *reinterpret_cast<const double2*>(Lt + k * ld + i0 + c);
      const double2 rv = *reinterpret_cast<const double2*>(R + k * ld + j0 + c);
      l[c] = lv.x, l[c + 1] = lv.y, r[c] = rv.x, r[c + 1] = rv.y;
    }
#pragma unroll
    for (int a = 0; a < kRotTile; ++a) {
#pragma unroll
      for (int c = 0; c < kRotTile; ++c) acc[a][c] = fma(l[a], r[c], acc[a][c]);
    }
  }
}

template <bool kIn>
__global__ void __launch_bounds__(kRotThreads) warm_rotate_kernel(const float* __restrict__ X,
                                                                  const float* __restrict__ Q, float* __restrict__ Y,
                                                                  int n) {
  extern __shared__ __align__(16) double rot_smem[];
  const int ld = rotate_ld(n), tiles = ld / kRotTile;
  // kIn: left = X as stored (X^T's transpose), right = Q; else left = Q transposed, right = X (the rotated basis)
  double* left = rot_smem;
  double* right = rot_smem + ld * ld;
  const int64_t off = static_cast<int64_t>(blockIdx.x) * n * n;
  const float* lsrc = (kIn ? X : Q) + off;
  const float* rsrc = (kIn ? Q : X) + off;
  for (int i = threadIdx.x; i < ld * ld; i += blockDim.x) {  // zero padding: whole tiles everywhere
    const int r = i / ld, c = i % ld;
    const bool in = r < n && c < n;
    right[i] = in ? rsrc[r * n + c] : 0.0;
    left[i] = in ? lsrc[kIn ? r * n + c : c * n + r] : 0.0;  // transposed: strided reads (from L1), contiguous stores
  }
  __syncthreads();
  const int t = threadIdx.x;  // one tile per thread
  const bool mine = t < tiles * tiles;
  const int i0 = t / tiles * kRotTile, j0 = t % tiles * kRotTile;
  double acc[kRotTile][kRotTile] = {};
  if (mine) rotate_tile(left, right, ld, n, i0, j0, acc);
  if constexpr (kIn) {  // T = X^T Q replaces X; then Y = Q^T T (the left factor's transpose is Q itself)
    __syncthreads();
    if (mine) {
#pragma unroll
      for (int a = 0; a < kRotTile; ++a) {
#pragma unroll
        for (int c = 0; c < kRotTile; ++c) {
          left[(i0 + a) * ld + j0 + c] = acc[a][c];
          acc[a][c] = 0.0;
        }
      }
    }
    __syncthreads();
    if (mine) rotate_tile(right, left, ld, n, i0, j0, acc);
  }
  if (mine) {
    for (int a = 0; a < kRotTile && i0 + a < n; ++a) {
      for (int c = 0; c < kRotTile && j0 + c < n; ++c) Y[off + (i0 + a) * n + j0 + c] = static_cast<float>(acc[a][c]);
    }
  }
}

// Y [B, n, n] float32 = Q^T X^T Q (kIn) or Q X, per matrix (warm_rotate_kernel); X, Q float32, contiguous.
template <bool kIn>
at::Tensor warm_rotate(const at::Tensor& X, const at::Tensor& Q) {
  const int n = static_cast<int>(X.size(1)), tiles = rotate_ld(n) / kRotTile;
  at::Tensor Y = at::empty_like(X);
  static int opted_in[kCachedDevices] = {};
  opt_in_smem(opted_in, warm_rotate_kernel<kIn>, smem_optin_bytes());
  warm_rotate_kernel<kIn><<<static_cast<unsigned>(X.size(0)), (tiles * tiles + 31) / 32 * 32, rotate_smem(n),
                            current_stream()>>>(X.const_data_ptr<float>(), Q.const_data_ptr<float>(),
                                                Y.mutable_data_ptr<float>(), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return Y;
}

// The off-diagonal sum of squares of A (B, N, N) after a sweep, per (matrix, chunk of kOffRows rows): one pass
// over A (it was a clone, a square and a sum: four passes and three launches a sweep), summed in a fixed order so
// that the stopping rule sees the same sums on every run. Matrices that have stopped are skipped.
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

// Conditional graph nodes (CUDA 12.4): the block method's sweeps loop on the device (launch_sweeps).
#if CUDART_VERSION >= 12040
#define TORCHKERN_DEVICE_LOOP 1
using LoopHandle = cudaGraphConditionalHandle;
#else
using LoopHandle = unsigned long long;
#endif

// Sweep end, one block: a matrix goes on while its off-diagonal norm after the sweep (the sum of its chunks'
// partial sums) exceeds tol ||A||_F. loop[0] counts the sweeps, loop[1] gets the count of matrices that go on;
// with `use_handle` the device loop repeats while one does and fewer than max_sweeps have run.
constexpr int kSweepEndThreads = 256;
__global__ void __launch_bounds__(kSweepEndThreads)
    sweep_end_kernel(const jacobi::tiles::BlockBuffers* __restrict__ buf, int64_t batch, int chunks, int max_sweeps,
                     LoopHandle handle, bool use_handle) {
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
#ifdef TORCHKERN_DEVICE_LOOP
    if (use_handle) cudaGraphSetConditional(handle, going > 0 && sweeps < max_sweeps);
#endif
  }
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

// A call's buffers into the device memory its kernels read them from (a launch parameter: no host memory to keep
// alive until a copy runs).
__global__ void set_buffers_kernel(jacobi::tiles::BlockBuffers* dst, const jacobi::tiles::BlockBuffers value) {
  *dst = value;
}

// The block method's sweeps as a loop on the device: a CUDA graph whose WHILE node (a conditional node, CUDA 12.4)
// repeats one sweep while sweep_end_kernel says a matrix goes on, so that the host neither waits for a sweep nor
// learns the count (a round trip per sweep held the host for the whole call: K-FAC's refresh steps left the GPU
// idle while the host caught up). Instantiating the graph costs milliseconds, so one is kept per (device, stream,
// B, N), its kernels reading the call's buffers from a BlockBuffers struct that each call writes first (the
// stream orders a call's write after the previous call's sweeps); the few least recently used go when more
// shapes come (destroying one waits for its last launch).
constexpr size_t kSweepGraphs = 8;

struct SweepGraph {
  int device;
  cudaStream_t stream;
  int64_t B, N;
  cudaGraphExec_t exec;
  jacobi::tiles::BlockBuffers* buf;  // device memory, from the caching allocator on `stream`
};

// sweep(stream, buf, handle, use_handle) enqueues one sweep reading `buf`. Returns false, having launched nothing,
// where the runtime or the driver has no conditional nodes.
template <class Sweep>
bool launch_sweeps(int64_t B, int64_t N, const jacobi::tiles::BlockBuffers& buffers, cudaStream_t stream,
                   const Sweep& sweep) {
#ifdef TORCHKERN_DEVICE_LOOP
  struct Cache {
    std::mutex mu;
    std::vector<SweepGraph> graphs;  // least recently used first
    bool unsupported = false;
  };
  static auto* cache = new Cache;  // never destroyed: at exit the driver may be gone before it
  const std::lock_guard<std::mutex> lock(cache->mu);  // a call's write and launch stay together
  if (cache->unsupported) return false;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  auto& graphs = cache->graphs;
  auto it = std::find_if(graphs.begin(), graphs.end(), [&](const SweepGraph& g) {
    return g.device == device && g.stream == stream && g.B == B && g.N == N;
  });
  if (it == graphs.end()) {
    struct Owned {  // released on every way out, a capture left open by an exception included
      cudaGraph_t graph = nullptr;
      cudaStream_t capture = nullptr;
      bool capturing = false;
      ~Owned() {
        if (capturing) {
          cudaGraph_t partial = nullptr;
          cudaStreamEndCapture(capture, &partial);
          if (partial != nullptr) cudaGraphDestroy(partial);
        }
        if (graph != nullptr) cudaGraphDestroy(graph);  // the executable graph keeps what it needs
        if (capture != nullptr) cudaStreamDestroy(capture);
      }
    } o;
    LoopHandle handle{};
    cudaGraphNodeParams params{};
    cudaGraphNode_t node = nullptr;
    bool ok = cudaGraphCreate(&o.graph, 0) == cudaSuccess &&
              cudaGraphConditionalHandleCreate(&handle, o.graph, 1, cudaGraphCondAssignDefault) == cudaSuccess;
    if (ok) {
      params.type = cudaGraphNodeTypeConditional;
      params.conditional.handle = handle;
      params.conditional.type = cudaGraphCondTypeWhile;
      params.conditional.size = 1;
#if CUDART_VERSION >= 13000
      ok = cudaGraphAddNode(&node, o.graph, nullptr, nullptr, 0, &params) == cudaSuccess;
#else
      ok = cudaGraphAddNode(&node, o.graph, nullptr, 0, &params) == cudaSuccess;
#endif
    }
    // (allocated before the capture, in which a cudaMalloc is not allowed)
    auto* buf = static_cast<jacobi::tiles::BlockBuffers*>(
        c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(sizeof(jacobi::tiles::BlockBuffers), stream));
    ok = ok && cudaStreamCreateWithFlags(&o.capture, cudaStreamNonBlocking) == cudaSuccess &&
         cudaStreamBeginCaptureToGraph(o.capture, params.conditional.phGraph_out[0], nullptr, nullptr, 0,
                                       cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    if (!ok) {
      c10::cuda::CUDACachingAllocator::raw_delete(buf);
      (void)cudaGetLastError();  // an unsupported call's error is not the caller's
      cache->unsupported = true;
      return false;
    }
    o.capturing = true;
    try {
      sweep(o.capture, buf, handle, true);
    } catch (...) {
      c10::cuda::CUDACachingAllocator::raw_delete(buf);
      throw;
    }
    cudaGraph_t body = nullptr;
    o.capturing = false;
    cudaGraphExec_t exec = nullptr;
    if (cudaStreamEndCapture(o.capture, &body) != cudaSuccess ||
        cudaGraphInstantiate(&exec, o.graph, 0) != cudaSuccess) {
      c10::cuda::CUDACachingAllocator::raw_delete(buf);
      (void)cudaGetLastError();  // nothing was launched: the host loop takes this call and the next ones
      cache->unsupported = true;
      return false;
    }
    if (graphs.size() == kSweepGraphs) {
      C10_CUDA_CHECK(cudaGraphExecDestroy(graphs.front().exec));
      c10::cuda::CUDACachingAllocator::raw_delete(graphs.front().buf);
      graphs.erase(graphs.begin());
    }
    graphs.push_back({device, stream, B, N, exec, buf});
  } else {
    std::rotate(it, it + 1, graphs.end());  // now the most recently used
  }
  const SweepGraph& g = graphs.back();
  set_buffers_kernel<<<1, 1, 0, stream>>>(g.buf, buffers);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  C10_CUDA_CHECK(cudaGraphLaunch(g.exec, stream));
  return true;
#else
  (void)B, (void)N, (void)buffers, (void)stream, (void)sweep;
  return false;
#endif
}

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

// The block method's way in and out, a few launches instead of some thirty ATen ops whose host time left the GPU
// idle for about a millisecond a call at 64 x 256^2 (torch.profiler, tenth session). In: per (matrix, kPrepRows
// rows), the largest |x| and whether X or Q0 has a non-finite entry (block_prep_stats_kernel); per 32 x 32 tile of
// the padded matrix, A = 2^-e (X + X^T) / 2 with e from frexp of the matrix's largest |x| (zero for a non-finite
// matrix) and W = Q0^T or I (block_prep_write_kernel); the thresholds from the tiles' sums of squares
// (block_prep_norms_kernel). Out: eigenvalues and eigenvectors gathered in ascending order, scaled back, cast, NaN
// for the flagged matrices (block_finish_kernel). The arithmetic is the ATen ops' (scaling by powers of two is
// exact).
constexpr int kPrepRows = 16;
constexpr int kPrepThreads = 256;
constexpr int kTile = 32;  // the write and finish passes: 32 x 8 threads per 32 x 32 tile

template <typename T>
__device__ inline double as_double(T x) {
  return static_cast<double>(static_cast<at::opmath_type<T>>(x));
}

template <typename T>
__global__ void __launch_bounds__(kPrepThreads)
    block_prep_stats_kernel(const T* __restrict__ X, const T* __restrict__ Q, double* __restrict__ part_max,
                            int* __restrict__ part_bad, int n, int chunks) {
  const int64_t b = blockIdx.x / chunks;
  const int chunk = static_cast<int>(blockIdx.x - b * chunks);
  const int64_t base = b * int64_t(n) * n, end = int64_t(min(n, (chunk + 1) * kPrepRows)) * n;
  double m = 0.0;
  bool bad = false;
  for (int64_t k = int64_t(chunk) * kPrepRows * n + threadIdx.x; k < end; k += blockDim.x) {
    const double x = as_double(X[base + k]);
    bad |= !isfinite(x) || (Q != nullptr && !isfinite(as_double(Q[base + k])));
    m = fmax(m, fabs(x));
  }
  __shared__ double scratch[kPrepThreads / 32];
  m = block_reduce<kPrepThreads, double, true>(m, scratch);  // m is never NaN (fmax drops NaN; bad flags it)
  const int any_bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) {
    part_max[blockIdx.x] = m;
    part_bad[blockIdx.x] = any_bad != 0;
  }
}

// U = double for the block method (A padded to N, a multiple of kTile, with W and the tiles' sums of squares);
// U = float or double, N = n, W = part_sq = nullptr for cuSOLVER's batched solver, which takes the matrix alone.
template <typename T, typename U>
__global__ void __launch_bounds__(kTile * 8)
    block_prep_write_kernel(const T* __restrict__ X, const T* __restrict__ Q, const double* __restrict__ part_max,
                            const int* __restrict__ part_bad, U* __restrict__ A, double* __restrict__ W,
                            int* __restrict__ exponent, int* __restrict__ flagged, double* __restrict__ part_sq,
                            int n, int N, int chunks) {
  const int tiles = (N + kTile - 1) / kTile;
  const int64_t b = blockIdx.x / (tiles * tiles);
  const int t = static_cast<int>(blockIdx.x - b * tiles * tiles), ti = t / tiles, tj = t - ti * tiles;
  const int lane = threadIdx.x, row = threadIdx.y;  // (32, 8) threads
  __shared__ double up[kTile][kTile + 1], mirror[kTile][kTile + 1], q_mirror[kTile][kTile + 1];
  __shared__ int s_e, s_bad;
  __shared__ double s_sq[8];
  if (row == 0) {  // the matrix's exponent and flag from its chunks (every tile of the matrix the same)
    double m = 0.0;
    int bad = 0;
    for (int c = lane; c < chunks; c += 32) {
      m = fmax(m, part_max[b * chunks + c]);
      bad |= part_bad[b * chunks + c];
    }
    m = warp_max(m);
    bad = __any_sync(0xffffffffu, bad);
    if (lane == 0) {
      int e = 0;
      if (!bad) frexp(m, &e);  // 0 for a zero matrix
      s_e = e;
      s_bad = bad;
      if (t == 0) {
        exponent[b] = e;
        flagged[b] = bad;
      }
    }
  }
  const int64_t in = b * int64_t(n) * n, out = b * int64_t(N) * N;
  for (int r = row; r < kTile; r += 8) {
    const int i = ti * kTile + r, j = tj * kTile + lane, i2 = tj * kTile + r, j2 = ti * kTile + lane;
    up[r][lane] = (i < n && j < n) ? as_double(X[in + int64_t(i) * n + j]) : 0.0;
    mirror[r][lane] = (i2 < n && j2 < n) ? as_double(X[in + int64_t(i2) * n + j2]) : 0.0;
    if (Q != nullptr) {  // (the cuSOLVER path passes neither Q nor W)
      q_mirror[r][lane] = (i2 < n && j2 < n) ? as_double(Q[in + int64_t(i2) * n + j2]) : 0.0;
    }
  }
  __syncthreads();
  const int shift = -s_e - 1;
  const bool bad = s_bad;
  double sq = 0.0;
  for (int r = row; r < kTile; r += 8) {
    const int i = ti * kTile + r, j = tj * kTile + lane;
    if (i >= N || j >= N) continue;
    // 2^-e x_ij / 2 + 2^-e x_ji / 2: the ATen ops' scale, then halves summed (exact scalings, one rounding)
    const U v = static_cast<U>(bad ? 0.0 : ldexp(up[r][lane], shift) + ldexp(mirror[lane][r], shift));
    A[out + int64_t(i) * N + j] = v;
    sq += double(v) * double(v);
    if (W == nullptr) continue;
    const bool inside = Q != nullptr && !bad && i < n && j < n;  // a flagged matrix rotates its zeros by I
    W[out + int64_t(i) * N + j] = inside ? q_mirror[lane][r] : (i == j ? 1.0 : 0.0);  // Q0^T, the padding I
  }
  if (part_sq == nullptr) return;  // (uniform over the block)
  sq = warp_sum(sq);
  if (lane == 0) s_sq[row] = sq;
  __syncthreads();
  if (row == 0 && lane == 0) {
    double total = 0.0;
    for (int w = 0; w < 8; ++w) total += s_sq[w];
    part_sq[blockIdx.x] = total;
  }
}

// One thread per matrix: thr = ||A||_F tol / N (the tiles' rotation threshold) and stop2 = (tol ||A||_F)^2.
__global__ void block_prep_norms_kernel(const double* __restrict__ part_sq, double* __restrict__ thr,
                                        double* __restrict__ stop2, int64_t batch, int per, double tol, int N) {
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < batch; b += int64_t(gridDim.x) * blockDim.x) {
    double s = 0.0;
    for (int k = 0; k < per; ++k) s += part_sq[b * per + k];
    const double norm = sqrt(s);
    thr[b] = norm * (tol / double(N));
    stop2[b] = (norm * tol) * (norm * tol);
  }
}

// V[b, i, j] = W[b, order[b, j], i] (the basis row of the j-th smallest eigenvalue, as column j; without `order`,
// W[b, i, j]: W's columns are the eigenvectors in order) and w[b, j] = 2^e sorted[b, j], cast to T, NaN for a
// flagged matrix (or one cuSOLVER reports as not converged: failed[b] != 0); per 32 x 32 tile of V.
template <typename T, typename S>
__global__ void __launch_bounds__(kTile * 8)
    block_finish_kernel(const S* __restrict__ W, const S* __restrict__ sorted, const int64_t* __restrict__ order,
                        const int* __restrict__ exponent,
                        const int* __restrict__ flagged, const int* __restrict__ failed, T* __restrict__ w,
                        T* __restrict__ V, int n, int N) {
  const int tiles = (n + kTile - 1) / kTile;
  const int64_t b = blockIdx.x / (tiles * tiles);
  const int t = static_cast<int>(blockIdx.x - b * tiles * tiles), ti = t / tiles, tj = t - ti * tiles;
  const int lane = threadIdx.x, row = threadIdx.y;
  __shared__ double tile[kTile][kTile + 1];
  const bool bad = flagged[b] || (failed != nullptr && failed[b] != 0);
  for (int r = row; r < kTile; r += 8) {
    if (order == nullptr) {  // W's columns are the eigenvectors, in order: r the component i, lane the eigenvalue j
      const int i = ti * kTile + r, j = tj * kTile + lane;
      tile[lane][r] = (i < n && j < n) ? static_cast<double>(W[b * int64_t(N) * N + int64_t(i) * N + j]) : 0.0;
      continue;
    }
    const int j = tj * kTile + r, i = ti * kTile + lane;  // r: the eigenvalue j = tj * kTile + r, lane: the component i
    double x = 0.0;
    if (j < n && i < n) {
      const int64_t k = order[b * n + j];
      x = static_cast<double>(W[b * int64_t(N) * N + k * N + i]);
    }
    tile[r][lane] = x;
  }
  __syncthreads();
  const T nan = static_cast<T>(NAN);
  for (int r = row; r < kTile; r += 8) {
    const int i = ti * kTile + r, j = tj * kTile + lane;
    if (i < n && j < n) V[b * int64_t(n) * n + int64_t(i) * n + j] = bad ? nan : static_cast<T>(tile[lane][r]);
  }
  if (ti == 0 && row == 0) {
    const int j = tj * kTile + lane;
    if (j < n) w[b * n + j] = bad ? nan : static_cast<T>(ldexp(static_cast<double>(sorted[b * n + j]), exponent[b]));
  }
}

// The block method on X (B, n, n) of any float dtype (contiguous), from Q0^T A Q0 with Q (B, n, n; undefined for a
// cold start): returns (w ascending, V) in X's dtype, NaN for matrices with a non-finite entry in X or Q. It works
// in float64 on A = 2^-e (X + X^T) / 2 padded to N, with the accumulated rotations W = V^T starting from Q0^T (so
// that they end as (Q0 V')^T: no product on the way out); polish: one orthogonality correction of V, which only
// float64 results need.
std::tuple<at::Tensor, at::Tensor> block_method(const at::Tensor& X, const at::Tensor& Q, double tol, bool polish) {
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
  const int stat_chunks = static_cast<int>((n + kPrepRows - 1) / kPrepRows), tiles = static_cast<int>(N / kTile);
  at::Tensor part_max = at::empty({B * stat_chunks}, opt), part_bad = at::empty({B * stat_chunks}, iopt);
  at::Tensor part_sq = at::empty({B * tiles * tiles}, opt);
  TORCHKERN_DISPATCH_FLOATING(X.scalar_type(), "eigh_block_prep", [&] {
    const scalar_t* q = Q.defined() ? Q.const_data_ptr<scalar_t>() : nullptr;
    block_prep_stats_kernel<scalar_t><<<static_cast<unsigned>(B * stat_chunks), kPrepThreads, 0, stream>>>(
        X.const_data_ptr<scalar_t>(), q, part_max.mutable_data_ptr<double>(), part_bad.mutable_data_ptr<int>(),
        static_cast<int>(n), stat_chunks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    block_prep_write_kernel<scalar_t, double><<<static_cast<unsigned>(B * tiles * tiles), dim3(kTile, 8), 0, stream>>>(
        X.const_data_ptr<scalar_t>(), q, part_max.const_data_ptr<double>(), part_bad.const_data_ptr<int>(),
        A.mutable_data_ptr<double>(), W.mutable_data_ptr<double>(), exponent.mutable_data_ptr<int>(),
        flagged.mutable_data_ptr<int>(), part_sq.mutable_data_ptr<double>(), static_cast<int>(n),
        static_cast<int>(N), stat_chunks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  block_prep_norms_kernel<<<static_cast<unsigned>((B + 127) / 128), 128, 0, stream>>>(
      part_sq.const_data_ptr<double>(), thr.mutable_data_ptr<double>(), stop2.mutable_data_ptr<double>(), B,
      tiles * tiles, tol, static_cast<int>(N));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  const int out_tiles = static_cast<int>((n + kTile - 1) / kTile);
  TORCHKERN_DISPATCH_FLOATING(X.scalar_type(), "eigh_block_finish", [&] {
    block_finish_kernel<scalar_t, double><<<static_cast<unsigned>(B * out_tiles * out_tiles), dim3(kTile, 8), 0,
                                            stream>>>(
        W.const_data_ptr<double>(), sorted.const_data_ptr<double>(), order.const_data_ptr<int64_t>(),
        exponent.const_data_ptr<int>(), flagged.const_data_ptr<int>(), nullptr,
        w.mutable_data_ptr<scalar_t>(), V.mutable_data_ptr<scalar_t>(), static_cast<int>(n), static_cast<int>(N));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  // The basis went through hundreds of rounds of products, each adding rounding to V^T V - I (measured: 1e-12 at
  // n = 256, the float64 bar's edge). For float64 results one correction V <- V (3 I - V^T V) / 2 squares that
  // error (two products, a few percent of one sweep; host time of the same order at 256^2) and moves V by
  // O(error), leaving the residual as it was (a flagged matrix's NaN stays NaN); rounding to float32 adds far
  // more (about 1e-7) than it removes.
  if (polish) {
    const at::Tensor gram = at::bmm(V.transpose(1, 2), V);
    gram.diagonal(0, 1, 2).sub_(3.0);
    V = at::bmm(V, gram).mul_(-0.5);
  }
  return {w, V};
}

// The way in of the direct solvers (cuSOLVER's batched one, the tridiagonal one): per matrix the non-finite flag (of X
// or Q, when defined) and exponent, and S (B, N, N), N >= n, the scaled and symmetrized matrix in S's dtype (float32
// or float64), zero past n: two launches.
void prep_direct(const at::Tensor& X, const at::Tensor& Q, at::Tensor& S, at::Tensor& exponent, at::Tensor& flagged) {
  const int64_t B = X.size(0), n = X.size(1), N = S.size(1);
  const cudaStream_t stream = current_stream();
  const int chunks = static_cast<int>((n + kPrepRows - 1) / kPrepRows);
  const int64_t tiles = (N + kTile - 1) / kTile;
  at::Tensor part_max = at::empty({B * chunks}, X.options().dtype(at::kDouble));
  at::Tensor part_bad = at::empty({B * chunks}, X.options().dtype(at::kInt));
  const int ni = static_cast<int>(n);
  TORCHKERN_DISPATCH_FLOATING(X.scalar_type(), "eigh_direct_prep", [&] {
    const scalar_t* q = Q.defined() ? Q.const_data_ptr<scalar_t>() : nullptr;
    block_prep_stats_kernel<scalar_t><<<static_cast<unsigned>(B * chunks), kPrepThreads, 0, stream>>>(
        X.const_data_ptr<scalar_t>(), q, part_max.mutable_data_ptr<double>(), part_bad.mutable_data_ptr<int>(), ni,
        chunks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const auto write = [&](auto zero) {
      using U = decltype(zero);
      block_prep_write_kernel<scalar_t, U><<<static_cast<unsigned>(B * tiles * tiles), dim3(kTile, 8), 0, stream>>>(
          X.const_data_ptr<scalar_t>(), nullptr, part_max.const_data_ptr<double>(), part_bad.const_data_ptr<int>(),
          S.mutable_data_ptr<U>(), nullptr, exponent.mutable_data_ptr<int>(), flagged.mutable_data_ptr<int>(),
          nullptr, ni, static_cast<int>(N), chunks);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (S.scalar_type() == at::kDouble) write(0.0);
    else write(0.0f);
  });
}

// cuSOLVER's batched solver with the block method's way in and out: the non-finite flags and largest |x| per
// matrix, the scaled and symmetrized matrix in the compute type (float32 for float32 and half input), the call, a
// sort of the eigenvalues, and one kernel that gathers the eigenvectors in order, transposed, scaled back, cast and
// NaN for flagged or unconverged matrices: five launches and a sort where some forty ATen ops had cost about a
// third of a millisecond of host time a call (1.29 ms against the bare call's 0.94 at 64 x 128^2, H200). Q, when
// defined, is only checked: a non-finite Q0 flags its matrix, as on every path.
std::tuple<at::Tensor, at::Tensor> eigh_syev_batched(const at::Tensor& X, const at::Tensor& Q, bool f64) {
  const int64_t B = X.size(0), n = X.size(1);
  const cudaStream_t stream = current_stream();
  const auto iopt = X.options().dtype(at::kInt);
  const int tiles = static_cast<int>((n + kTile - 1) / kTile);
  const auto tile_blocks = static_cast<unsigned>(B * tiles * tiles);
  at::Tensor exponent = at::empty({B}, iopt), flagged = at::empty({B}, iopt);
  at::Tensor S = at::empty({B, n, n}, X.options().dtype(f64 ? at::kDouble : at::kFloat));
  prep_direct(X, Q, S, exponent, flagged);
  const int ni = static_cast<int>(n);
  at::Tensor w_raw, V_rows, info, sorted, order;  // (no structured bindings: the lambdas below capture them)
  std::tie(w_raw, V_rows, info) = syev_batched(std::move(S));
  std::tie(sorted, order) = at::sort(w_raw, /*dim=*/1);
  at::Tensor w = at::empty({B, n}, X.options()), V = at::empty({B, n, n}, X.options());
  TORCHKERN_DISPATCH_FLOATING(X.scalar_type(), "eigh_syev_finish", [&] {
    const auto gather = [&](auto zero) {
      using U = decltype(zero);
      block_finish_kernel<scalar_t, U><<<tile_blocks, dim3(kTile, 8), 0, stream>>>(
          V_rows.const_data_ptr<U>(), sorted.const_data_ptr<U>(), order.const_data_ptr<int64_t>(),
          exponent.const_data_ptr<int>(), flagged.const_data_ptr<int>(), info.const_data_ptr<int>(),
          w.mutable_data_ptr<scalar_t>(), V.mutable_data_ptr<scalar_t>(), ni, ni);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (f64) gather(0.0);
    else gather(0.0f);
  });
  return {w, V};
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
// matmuls would follow torch's TF32 flag), and the finish kernel's way out. Q, when defined, is only checked, as
// on cuSOLVER's path. Inverse iteration's scratch (17 bytes per entry) goes by groups of matrices.
std::tuple<at::Tensor, at::Tensor> eigh_tridiagonal(const at::Tensor& X, const at::Tensor& Q) {
  namespace td = tridiagonal;
  const int64_t B = X.size(0), n = X.size(1);
  const int ni = static_cast<int>(n);
  const cudaStream_t stream = current_stream();
  const auto iopt = X.options().dtype(at::kInt), fopt = X.options().dtype(at::kFloat);
  const auto dopt = X.options().dtype(at::kDouble);
  const int tiles = static_cast<int>((n + kTile - 1) / kTile);
  const int64_t ld = (n + td::kChunk - 1) / td::kChunk * td::kChunk;  // S's rows: whole column chunks
  const auto tile_blocks = static_cast<unsigned>(B * tiles * tiles);
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
  TORCHKERN_DISPATCH_FLOATING(X.scalar_type(), "eigh_tridiagonal_finish", [&] {
    block_finish_kernel<scalar_t, double><<<tile_blocks, dim3(kTile, 8), 0, stream>>>(
        Z.const_data_ptr<double>(), sorted.const_data_ptr<double>(), nullptr, exponent.const_data_ptr<int>(),
        flagged.const_data_ptr<int>(), nullptr, w.mutable_data_ptr<scalar_t>(), V.mutable_data_ptr<scalar_t>(), ni,
        ni);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {w, V};
}

std::tuple<at::Tensor, at::Tensor> eigh_cuda(const at::Tensor& A, const c10::optional<at::Tensor>& warm_start,
                                             c10::string_view solver_choice, c10::optional<double> tol_choice) {
  TORCHKERN_OP("eigh");
  const bool jacobi_only = solver_choice == "jacobi", tridiagonal_only = solver_choice == "tridiagonal";
  TORCHKERN_CHECK(jacobi_only || tridiagonal_only || solver_choice == "auto",
                  "solver must be 'auto', 'jacobi' or 'tridiagonal', got '", std::string(solver_choice), "'");
  TORCHKERN_CHECK_FLOAT(A);
  TORCHKERN_CHECK(!tridiagonal_only || A.scalar_type() != at::kDouble,
                  "solver='tridiagonal' computes in float32 (float32, float16 and bfloat16 input); float64 A takes "
                  "'auto' or 'jacobi'");
  const double min_tol = A.scalar_type() == at::kDouble ? TORCHKERN_EIGH_TOL_F64 : TORCHKERN_EIGH_TOL_F32;
  TORCHKERN_CHECK(!tol_choice.has_value() || (*tol_choice >= min_tol && *tol_choice < 1.0),
                  "tol must be None or a number in [", min_tol, ", 1) for ", A.scalar_type(), " input, got ",
                  tol_choice.value_or(0.0));
  TORCHKERN_CHECK(A.dim() >= 2 && A.size(-1) == A.size(-2), "A must have shape [..., n, n] (square matrices), got ",
                  A.sizes());
  if (warm_start.has_value()) {
    const at::Tensor& Q0 = *warm_start;  // the messages name the argument as the caller knows it
    TORCHKERN_CHECK_SAME_SHAPE(A, Q0);
    TORCHKERN_CHECK_SAME_DTYPE(A, Q0);
    TORCHKERN_CHECK_SAME_DEVICE(A, Q0);
  }
  TORCHKERN_CHECK_CUDA(A);
  const at::cuda::OptionalCUDAGuard guard(A.device());
  const auto batch_shape = A.sizes().slice(0, A.dim() - 2);
  const int64_t n = A.size(-1);
  std::vector<int64_t> w_shape(batch_shape.begin(), batch_shape.end());
  w_shape.push_back(n);
  if (A.numel() == 0) return {at::empty(w_shape, A.options()), at::empty(A.sizes(), A.options())};
  const int64_t B = A.numel() / (n * n);
  const bool f64 = A.scalar_type() == at::kDouble;
  const double tol = tol_choice.value_or(min_tol);  // the Jacobi kernels' stopping rule; cuSOLVER has none
  // the in-block kernel and cuSOLVER compute in float32 (float64 for float64 input); the block method in float64
  const bool small = n <= kSmallMaxN && (f64 ? jacobi::fits<double>(n) : jacobi::fits<float>(n));
  const at::ScalarType cdt = f64 ? at::kDouble : at::kFloat;
  const auto solve_small = [&](const at::Tensor& X, at::Tensor& w, at::Tensor& V) {
    w = at::empty({B, n}, X.options());
    V = at::empty({B, n, n}, X.options());
    const at::Tensor Xc = X.contiguous();
    const auto run = [&](auto zero) {
      using TA = decltype(zero);
      jacobi::Problem<TA> pr{};
      pr.A = Xc.const_data_ptr<TA>();
      pr.batch_stride = n * n;
      pr.split = jacobi::split_for(B, static_cast<int>(n));
      pr.ld = static_cast<int>(n);
      pr.n = static_cast<int>(n);
      pr.max_sweeps = kMaxSweeps;
      pr.tol = tol;
      pr.w = w.mutable_data_ptr<TA>();
      pr.V = V.mutable_data_ptr<TA>();
      jacobi::launch_whole<TA>(pr, B, current_stream());
    };
    if (f64) run(0.0);
    else run(0.0f);
  };
  const auto finish = [&](const at::Tensor& w, const at::Tensor& V) -> std::tuple<at::Tensor, at::Tensor> {
    return {w.to(A.scalar_type()).reshape(w_shape), V.to(A.scalar_type()).reshape(A.sizes()).contiguous()};
  };
  const Solver solver = jacobi_only        ? Solver::kJacobi
                        : tridiagonal_only ? Solver::kTridiagonal
                                           : choose_solver(B, n, f64, warm_start.has_value(), tol);
  // From here on a warm start is one that the Jacobi kernels take.
  const bool warm = warm_start.has_value() && solver == Solver::kJacobi;
  if (!small && solver == Solver::kJacobi) {  // the block method, in X's dtype
    const at::Tensor Q = warm ? warm_start->reshape({B, n, n}).contiguous() : at::Tensor();
    const auto [w, V] = block_method(A.reshape({B, n, n}).contiguous(), Q, tol, /*polish=*/f64);
    return {w.reshape(w_shape), V.reshape(A.sizes())};
  }
  if (solver == Solver::kTridiagonal || solver == Solver::kSyevBatched) {  // the direct solvers: Q0 only checked
    const at::Tensor M = A.reshape({B, n, n}).contiguous();
    const at::Tensor Q = warm_start.has_value() ? warm_start->reshape({B, n, n}).contiguous() : at::Tensor();
    const auto [w, V] = solver == Solver::kTridiagonal ? eigh_tridiagonal(M, Q) : eigh_syev_batched(M, Q, f64);
    return {w.reshape(w_shape), V.reshape(A.sizes())};
  }
  at::Tensor X = A.reshape({B, n, n}).to(cdt);
  at::Tensor w, V;
  if (small && solver == Solver::kJacobi && !warm) {  // the kernel flags non-finite matrices, scales, symmetrizes
    solve_small(X, w, V);
    return finish(w, V);
  }
  if (small && solver == Solver::kJacobi && !f64) {
    // A warm start of float32 (or half) input: Q0^T A Q0 in float64 can neither overflow nor underflow, and the
    // kernel scales, symmetrizes ((Q0^T A Q0 + Q0^T A^T Q0) / 2 = Q0^T A_sym Q0) and flags non-finite entries
    // itself (a NaN or Inf in A or Q0 makes the product's matrix non-finite), so the rotations are all there is
    // around it: one launch a side where warm_rotate_kernel fits, else five ATen ops. Float64 sums of the exact
    // products: never torch's float32 matmul, which follows the global TF32 flag (1e-3 accuracy when a script
    // turns it on).
    if (warm_rotate_fits(n)) {
      const at::Tensor Q = warm_start->reshape({B, n, n}).to(at::kFloat).contiguous();
      solve_small(warm_rotate<true>(X.contiguous(), Q), w, V);
      return finish(w, warm_rotate<false>(V, Q));
    }
    const at::Tensor Q = warm_start->reshape({B, n, n}).to(at::kDouble);
    solve_small(at::matmul(Q.transpose(1, 2), at::matmul(X.to(at::kDouble), Q)).to(at::kFloat), w, V);
    return finish(w, at::matmul(Q, V.to(at::kDouble)));
  }
  // A float64 warm start on the in-block path, or a call for torch.linalg.eigh: zero the non-finite matrices,
  // scale by 2^-e (max |x| in [0.5, 1)), symmetrize (as the twin does)
  const at::Tensor zero = at::scalar_tensor(0.0, X.options());
  at::Tensor bad = at::isfinite(X).flatten(1).all(1).logical_not();
  X = at::where(bad.view({B, 1, 1}), zero, X);
  const at::Tensor e = std::get<1>(at::frexp(X.abs().amax(at::IntArrayRef({1, 2}))));  // int32; 0 for zero
  X = times_pow2(X, at::neg(e).view({B, 1, 1}));
  X = at::add(at::mul(X, 0.5), at::mul(X.transpose(1, 2), 0.5));
  at::Tensor Q;
  if (warm) {
    // the rotations in float64: float32 products would follow torch's global TF32 flag (1e-3 accuracy when a
    // training script turns it on), far from the 1e-5 residual
    Q = warm_start->reshape({B, n, n}).to(at::kDouble);
    X = at::matmul(Q.transpose(1, 2), at::matmul(X.to(at::kDouble), Q)).to(cdt);
    const at::Tensor bad_q = at::isfinite(X).flatten(1).all(1).logical_not();  // a non-finite Q0
    X = at::where(bad_q.view({B, 1, 1}), zero, X);
    bad = at::logical_or(bad, bad_q);
  }
  if (solver == Solver::kJacobi) {  // a float64 warm start on the in-block path
    solve_small(X, w, V);
    V = at::matmul(Q, V.to(at::kDouble));
  } else {  // cuSOLVER's syevd, one matrix after another
    std::tie(w, V) = at::linalg_eigh(X);
  }
  w = times_pow2(w.to(at::kDouble), e.view({B, 1}));  // in float64: no intermediate over- or underflow
  w = at::where(bad.view({B, 1}), at::scalar_tensor(NAN, w.options()), w);
  V = at::where(bad.view({B, 1, 1}), at::scalar_tensor(NAN, V.options()), V);  // V needs no scaling back
  return finish(w, V);
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) { m.impl("eigh", &torchkern::eigh_cuda); }
