// Gaussian energy E = 1/2 (x - mu)^T P (x - mu) and score -P (x - mu) (P symmetric) of a [B, d] batch.
//
// Small d, float32/float16/bfloat16 (P fits in shared memory beside a tile of rows): one fused
// register-tiled kernel reads x once and writes score and energy. A block holds P (float) and
// kTileRows rows of r = x - mu (float) in shared memory; each thread accumulates an 8 x 8 tile of
// r P (8 rows, 2 x 4 columns) from 16- and 8-byte shared loads, each value serving 8 FMAs.
// float64 keeps the simpler warp-per-4-rows kernel. Large d: score = mu P - x P in one cuBLAS call
// (addmm with the bias row mu P), then a row-wise epilogue E = -1/2 sum (x - mu) * score. The
// energy is exact for any P (1/2 r.(P^T r) = 1/2 r.(P r)); the score assumes P symmetric, which
// GaussianEnergy checks at construction. The GEMM runs on the host (ops.cpp); this file's launchers do the rest.
#include <cstdint>

#include "launchers.h"
#include "torchkern/dispatch.cuh"
#include "torchkern/launch.cuh"
#include "torchkern/reduce.cuh"
#include "torchkern/vec.cuh"

namespace torchkern {
namespace {

constexpr int kWarps = 8;
constexpr int kRows = 4;
constexpr int kSharedBytes = 48 * 1024;

// ---------------------------------------------------------------------------------------------
// Register-tiled kernel (float32, float16, bfloat16; computes in float).
//
// Block: kTileThreads threads as kTY x kTX; thread (ty, tx) owns rows ty + kTY * i (i < kTM) of
// the block's kTileRows-row tile and, in each column pass of kTileCols columns, the columns
// pass * kTileCols + tx * 4 + {0..3} and the same + 32. Per k-step of 2 it reads its 8 rows of
// r as float2 (row stride ldr = 4 * odd: the 4 rows a warp reads at once sit in distinct banks)
// and 2 x 2 float4 of P (8 threads read 128 contiguous bytes, the warp's 4 row groups the same
// ones), for 128 FMAs. 128 threads, <= 128 registers: 4 blocks (16 warps) per SM at d = 64.

constexpr int kTileThreads = 128;
constexpr int kTX = 8;                          // threads along columns (lane bits 0..2)
constexpr int kTY = kTileThreads / kTX;         // 16 threads along rows
constexpr int kTM = 8;                          // rows per thread
constexpr int kTileRows = kTY * kTM;            // 128 rows per tile
constexpr int kTileCols = kTX * 8;              // 64 columns per pass
constexpr int kTiledMaxD = 128;
constexpr int64_t kTiledMaxSharedBytes = 112 * 1024;  // at least 2 blocks per SM on sm_90

// Shared memory of the tiled kernel, in floats: P [kpad, ldp], mu [kpad], r [kTileRows, ldr],
// e_rows [kTileRows]. Everything past d (P's rows and columns, mu, r's columns up to kpad) is zero.
struct TileLayout {
  int kpad;  // d rounded up to 4: the reduction extent
  int ldp;   // d rounded up to whole column passes
  int ldr;   // kpad, plus 4 when kpad / 4 is even
  __host__ __device__ explicit TileLayout(int d)
      : kpad((d + 3) & ~3),
        ldp((d + kTileCols - 1) / kTileCols * kTileCols),
        ldr(kpad + ((kpad >> 2) & 1 ? 0 : 4)) {}
  __host__ __device__ int64_t floats() const {
    return static_cast<int64_t>(kpad) * ldp + kpad + static_cast<int64_t>(kTileRows) * (ldr + 1);
  }
};

// kVec: d is a multiple of 16 / sizeof(T) and x is 16-byte aligned: x is read in 16-byte
// vectors and score written in 4-element vectors.
// The scalar variant's epilogue needs a few more registers than 128: 3 blocks per SM.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kTileThreads, kVec ? 4 : 3)
gaussian_tiled_kernel(const T* __restrict__ x,          // [B, d]
                      const T* __restrict__ mean,       // [d]
                      const T* __restrict__ precision,  // [d, d]
                      T* __restrict__ energy,           // [B]
                      T* __restrict__ score,            // [B, d]
                      int64_t batch, int d) {
  extern __shared__ float4 tile_shared[];
  const TileLayout L(d);
  float* P = reinterpret_cast<float*>(tile_shared);  // [kpad, ldp]
  float* mu = P + L.kpad * L.ldp;                    // [kpad]
  float* r = mu + L.kpad;                            // [kTileRows, ldr]
  float* e_rows = r + kTileRows * L.ldr;             // [kTileRows]: energy over the passes so far
  const int tid = threadIdx.x;
  for (int i = tid; i < L.kpad * L.ldp; i += kTileThreads) {
    const int k = i / L.ldp, c = i - k * L.ldp;
    P[i] = k < d && c < d ? to_opmath(precision[k * d + c]) : 0.f;
  }
  for (int i = tid; i < L.kpad; i += kTileThreads) mu[i] = i < d ? to_opmath(mean[i]) : 0.f;

  const int tx = tid % kTX, ty = tid / kTX;
  const int warp = tid / 32, lane = tid % 32;
  const int passes = L.ldp / kTileCols;
  const int64_t tiles = (batch + kTileRows - 1) / kTileRows;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t row0 = tile * kTileRows;
    __syncthreads();  // first tile: P and mu are written; later tiles: nobody reads r any more
    // r = x - mu; rows past the batch and columns past d are zero.
    if constexpr (kVec) {
      constexpr int N = kVec16<T>;
      const int per_row = d / N;
      for (int v = tid; v < kTileRows * per_row; v += kTileThreads) {
        const int rl = v / per_row, c = (v - rl * per_row) * N;
        const int64_t row = row0 + rl;
        float f[N];
        if (row < batch) {
          const Vec<T, N> xv = load_vec<T, N>(x, (row * d + c) / N);
#pragma unroll
          for (int j = 0; j < N; ++j) f[j] = to_opmath(xv.v[j]) - mu[c + j];
        } else {
#pragma unroll
          for (int j = 0; j < N; ++j) f[j] = 0.f;
        }
#pragma unroll
        for (int j = 0; j < N; j += 4) {
          *reinterpret_cast<float4*>(r + rl * L.ldr + c + j) = make_float4(f[j], f[j + 1], f[j + 2], f[j + 3]);
        }
      }
    } else {
      for (int rl = warp; rl < kTileRows; rl += kTileThreads / 32) {
        const int64_t row = row0 + rl;
        for (int c = lane; c < L.kpad; c += 32) {
          r[rl * L.ldr + c] = row < batch && c < d ? to_opmath(x[row * d + c]) - mu[c] : 0.f;
        }
      }
    }
    __syncthreads();

    for (int pass = 0; pass < passes; ++pass) {
      const int col0 = pass * kTileCols + tx * 4;  // this thread's columns: col0 + {0..3}, col0 + 32 + {0..3}
      float acc[kTM][8];
#pragma unroll
      for (int i = 0; i < kTM; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
      }
      const float* rp = r + ty * L.ldr;
      const float* pp = P + col0;
      // Not unrolled: 128 FMAs per iteration already hide the shared loads' latency with the
      // other warps, and an unrolled loop's prefetched fragments would not fit in registers.
#pragma unroll 1
      for (int k = 0; k < L.kpad; k += 2) {
        float2 a[kTM];
#pragma unroll
        for (int i = 0; i < kTM; ++i) a[i] = *reinterpret_cast<const float2*>(rp + i * kTY * L.ldr + k);
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          const float4 b0 = *reinterpret_cast<const float4*>(pp + (k + kk) * L.ldp);
          const float4 b1 = *reinterpret_cast<const float4*>(pp + (k + kk) * L.ldp + 32);
#pragma unroll
          for (int i = 0; i < kTM; ++i) {
            const float ai = kk == 0 ? a[i].x : a[i].y;
            acc[i][0] += ai * b0.x;
            acc[i][1] += ai * b0.y;
            acc[i][2] += ai * b0.z;
            acc[i][3] += ai * b0.w;
            acc[i][4] += ai * b1.x;
            acc[i][5] += ai * b1.y;
            acc[i][6] += ai * b1.z;
            acc[i][7] += ai * b1.w;
          }
        }
      }
      // The score of this pass's columns and E = 1/2 r.(r P) summed over them (after the k loop,
      // so the partials need no registers during it).
      float e[kTM];
#pragma unroll
      for (int i = 0; i < kTM; ++i) {
        const int rl = ty + i * kTY;
        const int64_t row = row0 + rl;
        const float* rr = r + rl * L.ldr;
        e[i] = 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int c = col0 + h * 32;
          if constexpr (kVec) {  // d % 4 == 0: the 4 columns are all in range or all past d
            if (c < d) {
              const float4 rv = *reinterpret_cast<const float4*>(rr + c);
              e[i] += rv.x * acc[i][4 * h] + rv.y * acc[i][4 * h + 1] + rv.z * acc[i][4 * h + 2] +
                      rv.w * acc[i][4 * h + 3];
              if (row < batch) {
                Vec<T, 4> out;
#pragma unroll
                for (int j = 0; j < 4; ++j) out.v[j] = from_opmath<T>(-acc[i][4 * h + j]);
                store_vec<T, 4>(score, (row * d + c) / 4, out);
              }
            }
          } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              if (c + j < d) {
                e[i] += rr[c + j] * acc[i][4 * h + j];
                if (row < batch) score[row * d + c + j] = from_opmath<T>(-acc[i][4 * h + j]);
              }
            }
          }
        }
      }
      // Sum over the kTX threads that share the rows (lanes differing in bits 0..2); the total
      // over passes stays in e_rows[rl], which this thread alone touches (no barrier).
#pragma unroll
      for (int i = 0; i < kTM; ++i) {
        e[i] = warp_sum<kTX>(e[i]);
      }
      if (tx == 0) {
#pragma unroll
        for (int i = 0; i < kTM; ++i) {
          const int rl = ty + i * kTY;
          const float total = pass == 0 ? e[i] : e_rows[rl] + e[i];
          if (pass + 1 < passes) {
            e_rows[rl] = total;
          } else if (row0 + rl < batch) {
            energy[row0 + rl] = from_opmath<T>(0.5f * total);
          }
        }
      }
    }
  }
}

// Shared memory the tiled kernel may use on the current device: min(the device's opt-in limit,
// kTiledMaxSharedBytes).
int64_t tiled_shared_limit() {
  return min_of<int64_t>(static_cast<int64_t>(smem_optin_bytes()), kTiledMaxSharedBytes);
}

// Runs the tiled kernel (gaussian_fused has checked that its shared memory fits); batch > 0.
template <typename T>
void launch_tiled(const GaussianParams& p, cudaStream_t stream) {
  const int64_t shared = TileLayout(p.d).floats() * static_cast<int64_t>(sizeof(float));
  const bool vec = p.d % kVec16<T> == 0 && is_aligned(p.x, 16);
  TORCHKERN_BOOL_SWITCH(vec, kVec, [&] {
    static int opted_in[kCachedDevices] = {};  // the opt-in and the carveout, once per device
    per_device(opted_in, [](int) {
      cudaFuncSetAttribute(gaussian_tiled_kernel<T, kVec>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(tiled_shared_limit()));
      cudaFuncSetAttribute(gaussian_tiled_kernel<T, kVec>, cudaFuncAttributePreferredSharedMemoryCarveout,
                           cudaSharedmemCarveoutMaxShared);
      return 0;
    });
    const int64_t tiles = (p.batch + kTileRows - 1) / kTileRows;
    const unsigned grid = grid_for(gaussian_tiled_kernel<T, kVec>, kTileThreads, tiles, 1, shared);
    gaussian_tiled_kernel<T, kVec><<<grid, kTileThreads, shared, stream>>>(
        static_cast<const T*>(p.x), static_cast<const T*>(p.mean), static_cast<const T*>(p.precision),
        static_cast<T*>(p.energy), static_cast<T*>(p.score), p.batch, p.d);
  });
}

// ---------------------------------------------------------------------------------------------
// float64: each warp takes kRows rows at a time so every P element read from shared memory
// serves kRows rows.
template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
gaussian_warp_kernel(const T* __restrict__ x,          // [B, d]
                      const T* __restrict__ mean,       // [d]
                      const T* __restrict__ precision,  // [d, d]
                      T* __restrict__ energy,           // [B]
                      T* __restrict__ score,            // [B, d]
                      int64_t batch, int d) {
  using C = opmath_t<T>;
  extern __shared__ unsigned char shared_raw[];
  C* P = reinterpret_cast<C*>(shared_raw);       // [d, d]
  C* mu = P + d * d;                             // [d]
  C* r_all = mu + d;                             // [kWarps, kRows, d]
  for (int i = threadIdx.x; i < d * d; i += blockDim.x) P[i] = static_cast<C>(precision[i]);
  for (int i = threadIdx.x; i < d; i += blockDim.x) mu[i] = static_cast<C>(mean[i]);
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  C* r = r_all + warp * kRows * d;
  const int64_t groups = (batch + kRows - 1) / kRows;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kWarps + warp; g < groups;
       g += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t row0 = g * kRows;
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      const int64_t row = row0 + k;
      for (int j = lane; j < d; j += 32) r[k * d + j] = row < batch ? static_cast<C>(x[row * d + j]) - mu[j] : C(0);
    }
    __syncwarp();
    C e[kRows] = {};
    for (int j = lane; j < d; j += 32) {
      C acc[kRows] = {};
      for (int i = 0; i < d; ++i) {
        const C pij = P[i * d + j];  // = P[j, i]: lanes read consecutive words, r is a broadcast
#pragma unroll
        for (int k = 0; k < kRows; ++k) acc[k] += pij * r[k * d + i];
      }
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        const int64_t row = row0 + k;
        e[k] += r[k * d + j] * acc[k];
        if (row < batch) score[row * d + j] = static_cast<T>(-acc[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      const C ek = warp_sum(e[k]);
      if (lane == 0 && row0 + k < batch) energy[row0 + k] = static_cast<T>(C(0.5) * ek);
    }
    __syncwarp();  // r is rewritten by the next group
  }
}

// E = -1/2 sum_j (x - mu)_j score_j, one warp per row.
template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
gaussian_energy_epilogue(const T* __restrict__ x,      // [B, d]
                         const T* __restrict__ mean,   // [d]
                         const T* __restrict__ score,  // [B, d]
                         T* __restrict__ energy,       // [B]
                         int64_t batch, int d) {
  using C = opmath_t<T>;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= batch) return;
  C e = C(0);
  for (int j = lane; j < d; j += 32) {
    e += (to_opmath(x[row * d + j]) - to_opmath(mean[j])) * to_opmath(score[row * d + j]);
  }
  e = warp_sum(e);
  if (lane == 0) energy[row] = from_opmath<T>(C(-0.5) * e);
}

// Shared memory of the float64 kernel: P, mu and each warp's kRows rows of r.
int64_t warp_shared_bytes(int d) {
  return (static_cast<int64_t>(d) * d + d + kWarps * kRows * d) * static_cast<int64_t>(sizeof(double));
}

}  // namespace

bool gaussian_fused(int d, DType dtype) {
  if (dtype == DType::kFloat64) return warp_shared_bytes(d) <= kSharedBytes;
  return d <= kTiledMaxD && TileLayout(d).floats() * static_cast<int64_t>(sizeof(float)) <= tiled_shared_limit();
}

cudaError_t gaussian_launch(const GaussianParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kFloat32: launch_tiled<float>(p, stream); break;
    case DType::kFloat16: launch_tiled<__half>(p, stream); break;
    case DType::kBFloat16: launch_tiled<__nv_bfloat16>(p, stream); break;
    case DType::kFloat64: {
      const int64_t groups = (p.batch + kRows - 1) / kRows;
      gaussian_warp_kernel<double><<<grid_for(groups, kWarps, 4), kWarps * 32, warp_shared_bytes(p.d), stream>>>(
          static_cast<const double*>(p.x), static_cast<const double*>(p.mean),
          static_cast<const double*>(p.precision), static_cast<double*>(p.energy), static_cast<double*>(p.score),
          p.batch, p.d);
    }
  }
  return cudaGetLastError();
}

cudaError_t gaussian_energy_launch(const GaussianParams& p, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const unsigned grid = static_cast<unsigned>((p.batch + kWarps - 1) / kWarps);
    gaussian_energy_epilogue<T><<<grid, kWarps * 32, 0, stream>>>(
        static_cast<const T*>(p.x), static_cast<const T*>(p.mean), static_cast<const T*>(p.score),
        static_cast<T*>(p.energy), p.batch, p.d);
    return cudaGetLastError();
  });
}

}  // namespace torchkern
