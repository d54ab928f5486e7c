// The solvers' way in and out (launchers.h: prep_launch, finish_launch): per (matrix, kPrepRows rows) the largest |x|
// and whether X or Q0 has a non-finite entry (prep_stats_kernel); per 32 x 32 tile of the padded matrix the scaled,
// symmetrized matrix, the block method's basis and the tile's sum of squares (prep_write_kernel); the block method's
// thresholds (prep_norms_kernel); and the gather of the results (finish_kernel).
#include <cmath>

#include "launchers.h"
#include "torchkern/dispatch.cuh"
#include "torchkern/launch.cuh"
#include "torchkern/reduce.cuh"

namespace torchkern {
namespace eigh {
namespace {

constexpr int kPrepThreads = 256;
constexpr int kTile = kPrepTile;  // the write and finish passes: 32 x 8 threads per 32 x 32 tile

template <typename T>
__device__ inline double as_double(T x) {
  return static_cast<double>(to_opmath(x));
}

// x rounded to T as torch's casts round (to the compute type, then to the storage type, each to nearest even).
template <typename T>
__device__ inline T to_storage(double x) {
  return from_opmath<T>(static_cast<opmath_t<T>>(x));
}

template <typename T>
__global__ void __launch_bounds__(kPrepThreads)
    prep_stats_kernel(const T* __restrict__ X, const T* __restrict__ Q, double* __restrict__ part_max,
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
// U = float or double, W = part_sq = nullptr for the direct solvers, which take the matrix alone.
template <typename T, typename U>
__global__ void __launch_bounds__(kTile * 8)
    prep_write_kernel(const T* __restrict__ X, const T* __restrict__ Q, const double* __restrict__ part_max,
                      const int* __restrict__ part_bad, U* __restrict__ A, double* __restrict__ W,
                      int* __restrict__ exponent, int* __restrict__ flagged, double* __restrict__ part_sq, int n, int N,
                      int chunks) {
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
    if (W != nullptr && Q != nullptr) {
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
    // 2^-e x_ij / 2 + 2^-e x_ji / 2: exact scalings, one rounding
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
__global__ void prep_norms_kernel(const double* __restrict__ part_sq, double* __restrict__ thr,
                                  double* __restrict__ stop2, int64_t batch, int per, double tol, int N) {
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < batch; b += int64_t(gridDim.x) * blockDim.x) {
    double s = 0.0;
    for (int k = 0; k < per; ++k) s += part_sq[b * per + k];
    const double norm = sqrt(s);
    thr[b] = norm * (tol / double(N));
    stop2[b] = (norm * tol) * (norm * tol);
  }
}

// V[b, i, j] = vectors[b, k, i] with k = order[b, j] (or j) when `rows`, else vectors[b, i, j]; w[b, j] = 2^e
// values[b, j]; cast to T, NaN for a flagged (or failed) matrix; per 32 x 32 tile of V.
template <typename T, typename S>
__global__ void __launch_bounds__(kTile * 8)
    finish_kernel(const S* __restrict__ vectors, bool rows, const S* __restrict__ values,
                  const int64_t* __restrict__ order, const int* __restrict__ exponent, const int* __restrict__ flagged,
                  const int* __restrict__ failed, T* __restrict__ w, T* __restrict__ V, int n, int N) {
  const int tiles = (n + kTile - 1) / kTile;
  const int64_t b = blockIdx.x / (tiles * tiles);
  const int t = static_cast<int>(blockIdx.x - b * tiles * tiles), ti = t / tiles, tj = t - ti * tiles;
  const int lane = threadIdx.x, row = threadIdx.y;
  __shared__ double tile[kTile][kTile + 1];
  const bool bad = flagged[b] || (failed != nullptr && failed[b] != 0);
  const S* src = vectors + b * int64_t(N) * N;
  for (int r = row; r < kTile; r += 8) {
    if (!rows) {  // columns in order: r the component i, lane the eigenvalue j (coalesced along j)
      const int i = ti * kTile + r, j = tj * kTile + lane;
      tile[lane][r] = (i < n && j < n) ? static_cast<double>(src[int64_t(i) * N + j]) : 0.0;
      continue;
    }
    const int j = tj * kTile + r, i = ti * kTile + lane;  // r the eigenvalue j, lane the component i
    double x = 0.0;
    if (j < n && i < n) {
      const int64_t k = order != nullptr ? order[b * n + j] : j;
      x = static_cast<double>(src[k * N + i]);
    }
    tile[r][lane] = x;
  }
  __syncthreads();
  const T nan = to_storage<T>(NAN);
  for (int r = row; r < kTile; r += 8) {
    const int i = ti * kTile + r, j = tj * kTile + lane;
    if (i < n && j < n) V[b * int64_t(n) * n + int64_t(i) * n + j] = bad ? nan : to_storage<T>(tile[lane][r]);
  }
  if (ti == 0 && row == 0) {
    const int j = tj * kTile + lane;
    if (j < n) w[b * n + j] = bad ? nan : to_storage<T>(ldexp(static_cast<double>(values[b * n + j]), exponent[b]));
  }
}

}  // namespace

cudaError_t prep_launch(const PrepParams& p, cudaStream_t stream) {
  const int chunks = (p.n + kPrepRows - 1) / kPrepRows;
  const int64_t tiles = (p.N + kTile - 1) / kTile;
  const unsigned write_blocks = static_cast<unsigned>(p.batch * tiles * tiles);
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* X = static_cast<const T*>(p.X);
    const T* Q = static_cast<const T*>(p.Q);
    prep_stats_kernel<T><<<static_cast<unsigned>(p.batch * chunks), kPrepThreads, 0, stream>>>(
        X, Q, p.part_max, p.part_bad, p.n, chunks);
    if (p.W != nullptr) {  // the block method's: float64, with the basis and the sums of squares
      prep_write_kernel<T, double><<<write_blocks, dim3(kTile, 8), 0, stream>>>(
          X, Q, p.part_max, p.part_bad, static_cast<double*>(p.S), p.W, p.exponent, p.flagged, p.part_sq, p.n, p.N,
          chunks);
      prep_norms_kernel<<<static_cast<unsigned>((p.batch + 127) / 128), 128, 0, stream>>>(
          p.part_sq, p.thr, p.stop2, p.batch, static_cast<int>(tiles * tiles), p.tol, p.N);
    } else if (p.s_f64) {
      prep_write_kernel<T, double><<<write_blocks, dim3(kTile, 8), 0, stream>>>(
          X, nullptr, p.part_max, p.part_bad, static_cast<double*>(p.S), nullptr, p.exponent, p.flagged, nullptr, p.n,
          p.N, chunks);
    } else {
      prep_write_kernel<T, float><<<write_blocks, dim3(kTile, 8), 0, stream>>>(
          X, nullptr, p.part_max, p.part_bad, static_cast<float*>(p.S), nullptr, p.exponent, p.flagged, nullptr, p.n,
          p.N, chunks);
    }
    return cudaGetLastError();
  });
}

cudaError_t finish_launch(const FinishParams& p, cudaStream_t stream) {
  const int tiles = (p.n + kTile - 1) / kTile;
  const unsigned blocks = static_cast<unsigned>(p.batch * tiles * tiles);
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto gather = [&](auto zero) {
      using S = decltype(zero);
      finish_kernel<T, S><<<blocks, dim3(kTile, 8), 0, stream>>>(
          static_cast<const S*>(p.vectors), p.rows, static_cast<const S*>(p.values), p.order, p.exponent, p.flagged,
          p.failed, static_cast<T*>(p.w), static_cast<T*>(p.V), p.n, p.N);
    };
    if (p.f64) gather(0.0);
    else gather(0.0f);
    return cudaGetLastError();
  });
}

}  // namespace eigh
}  // namespace torchkern
