// The in-block Jacobi solver's warm-start rotations (launchers.h: warm_rotate_launch) and its reach (in_block_fits);
// the whole-matrix kernel is jacobi.cuh's (eigh_small_f32.cu, eigh_small_f64.cu), the host side eigh_in_block_host.h.
#include <type_traits>

#include "jacobi.cuh"
#include "launchers.h"
#include "torchkern/launch.cuh"

#if !defined(TORCHKERN_EIGH_SMALL_MAX_N)
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

}  // namespace

bool in_block_fits(int64_t n, bool f64) {
  return n <= TORCHKERN_EIGH_SMALL_MAX_N && (f64 ? jacobi::fits<double>(n) : jacobi::fits<float>(n));
}

// Whether warm_rotate_kernel takes n on this device (its shared memory, a tile per thread).
bool warm_rotate_fits(int64_t n) {
  const int64_t tiles = rotate_ld(n) / kRotTile;
  return tiles * tiles <= kRotThreads && rotate_smem(n) <= static_cast<int64_t>(smem_optin_bytes());
}

cudaError_t warm_rotate_launch(const WarmRotateParams& p, cudaStream_t stream) {
  const int tiles = rotate_ld(p.n) / kRotTile;
  const unsigned threads = (tiles * tiles + 31) / 32 * 32;
  const auto launch = [&](auto in) {
    constexpr bool kIn = decltype(in)::value;
    static int opted_in[kCachedDevices] = {};
    opt_in_smem(opted_in, warm_rotate_kernel<kIn>, smem_optin_bytes());
    warm_rotate_kernel<kIn><<<static_cast<unsigned>(p.batch), threads, rotate_smem(p.n), stream>>>(p.X, p.Q, p.Y,
                                                                                                   p.n);
  };
  if (p.in) launch(std::true_type{});
  else launch(std::false_type{});
  return cudaGetLastError();
}

}  // namespace eigh
}  // namespace torchkern
