// eigh's in-block Jacobi solver: n small enough for one thread block's shared memory (jacobi.cuh: A in the compute
// type and V in double) runs the whole cyclic Jacobi on one block per matrix. The kernel flags non-finite matrices,
// scales and symmetrizes itself, so a cold start is one launch; a warm start rotates the matrix into Q0's basis first
// and the eigenvectors back after.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/matmul.h>
#include <c10/cuda/CUDAException.h>

#include <tuple>

#include "eigh_prep.h"
#include "eigh_solvers.h"
#include "jacobi.cuh"
#include "torchkern/launch.h"

#if !defined(TORCHKERN_EIGH_MAX_SWEEPS) || !defined(TORCHKERN_EIGH_SMALL_MAX_N)
#error "build through torchkern's loader: it defines the TORCHKERN_EIGH_* constants (linalg/constants.py)"
#endif

namespace torchkern {
namespace eigh {
namespace {

// A warm start's rotations (float32 input, n <= 120 on sm_90): kIn, Y = Q^T X^T Q (the solver
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

// (w (B, n), V (B, n, n)) of X (B, n, n) in its dtype, float32 or float64: the whole cyclic Jacobi per matrix.
Result solve(const at::Tensor& X, double tol) {
  const int64_t B = X.size(0), n = X.size(1);
  at::Tensor w = at::empty({B, n}, X.options()), V = at::empty({B, n, n}, X.options());
  const at::Tensor Xc = X.contiguous();
  const auto run = [&](auto zero) {
    using TA = decltype(zero);
    jacobi::Problem<TA> pr{};
    pr.A = Xc.const_data_ptr<TA>();
    pr.batch_stride = n * n;
    pr.split = jacobi::split_for(B, static_cast<int>(n));
    pr.ld = static_cast<int>(n);
    pr.n = static_cast<int>(n);
    pr.max_sweeps = TORCHKERN_EIGH_MAX_SWEEPS;
    pr.tol = tol;
    pr.w = w.mutable_data_ptr<TA>();
    pr.V = V.mutable_data_ptr<TA>();
    jacobi::launch_whole<TA>(pr, B, current_stream());
  };
  if (X.scalar_type() == at::kDouble) run(0.0);
  else run(0.0f);
  return {w, V};
}

}  // namespace

bool in_block_fits(int64_t n, bool f64) {
  return n <= TORCHKERN_EIGH_SMALL_MAX_N && (f64 ? jacobi::fits<double>(n) : jacobi::fits<float>(n));
}

Result solve_in_block(const at::Tensor& X, const at::Tensor& Q, double tol) {
  const auto dtype = X.scalar_type();
  const at::ScalarType cdt = dtype == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t B = X.size(0), n = X.size(1);
  if (!Q.defined()) {
    const auto [w, V] = solve(X.to(cdt), tol);
    return {w.to(dtype), V.to(dtype)};
  }
  if (cdt == at::kFloat && warm_rotate_fits(n)) {
    // Q0^T X Q0 in float64 sums can neither overflow nor underflow, and the kernel scales, symmetrizes ((Q0^T X Q0 +
    // Q0^T X^T Q0) / 2 = Q0^T X_sym Q0) and flags non-finite entries (a NaN or Inf in X or Q0 makes the product's
    // matrix non-finite), so the rotations are all there is around it
    const at::Tensor Qf = Q.to(at::kFloat).contiguous();
    const auto [w, V] = solve(warm_rotate<true>(X.to(at::kFloat).contiguous(), Qf), tol);
    return {w.to(dtype), warm_rotate<false>(V, Qf).to(dtype)};
  }
  // Beyond warm_rotate_kernel's shared memory, and float64: the scaled, symmetrized matrix (flagged where X or Q0 has
  // a non-finite entry), rotated by float64 products (float32 matmuls would follow torch's TF32 flag, 1e-3 accuracy
  // when a training script turns it on), and the eigenvectors rotated back
  at::Tensor S = at::empty({B, n, n}, X.options().dtype(cdt));
  at::Tensor exponent = at::empty({B}, X.options().dtype(at::kInt)), flagged = at::empty_like(exponent);
  prep_direct(X, Q, S, exponent, flagged);
  const at::Tensor Q64 = Q.to(at::kDouble);
  const at::Tensor R = at::matmul(Q64.transpose(1, 2), at::matmul(S.to(at::kDouble), Q64)).to(cdt);
  const auto [w_rot, V_rot] = solve(R, tol);
  const at::Tensor V64 = at::matmul(Q64, V_rot.to(at::kDouble));
  at::Tensor w = at::empty({B, n}, X.options()), V = at::empty({B, n, n}, X.options());
  finish(V64, /*rows=*/false, w_rot.to(at::kDouble), at::Tensor(), exponent, flagged, at::Tensor(), w, V);
  return {w, V};
}

}  // namespace eigh
}  // namespace torchkern
