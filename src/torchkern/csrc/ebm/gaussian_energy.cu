// Gaussian energy E = 1/2 (x - mu)^T P (x - mu) and score -P (x - mu) (P symmetric) of a [B, d] batch.
//
// Small d, float32/float16/bfloat16 (P fits in shared memory beside a tile of rows): one fused
// register-tiled kernel reads x once and writes score and energy. A block holds P (float) and
// kTileRows rows of r = x - mu (float) in shared memory; each thread accumulates an 8 x 8 tile of
// r P (8 rows, 2 x 4 columns) from 16- and 8-byte shared loads, each value serving 8 FMAs.
// float64 keeps the simpler warp-per-4-rows kernel. Large d: score = mu P - x P in one cuBLAS call
// (addmm with the bias row mu P), then a row-wise epilogue E = -1/2 sum (x - mu) * score. The
// energy is exact for any P (1/2 r.(P^T r) = 1/2 r.(P r)); the score assumes P symmetric, which
// GaussianEnergy checks at construction.
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "torchkern/checks.h"
#include "torchkern/dispatch.h"
#include "torchkern/launch.h"
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
    P[i] = k < d && c < d ? static_cast<float>(precision[k * d + c]) : 0.f;
  }
  for (int i = tid; i < L.kpad; i += kTileThreads) mu[i] = i < d ? static_cast<float>(mean[i]) : 0.f;

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
          for (int j = 0; j < N; ++j) f[j] = static_cast<float>(xv.v[j]) - mu[c + j];
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
          r[rl * L.ldr + c] = row < batch && c < d ? static_cast<float>(x[row * d + c]) - mu[c] : 0.f;
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
                for (int j = 0; j < 4; ++j) out.v[j] = static_cast<T>(-acc[i][4 * h + j]);
                store_vec<T, 4>(score, (row * d + c) / 4, out);
              }
            }
          } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              if (c + j < d) {
                e[i] += rr[c + j] * acc[i][4 * h + j];
                if (row < batch) score[row * d + c + j] = static_cast<T>(-acc[i][4 * h + j]);
              }
            }
          }
        }
      }
      // Sum over the kTX threads that share the rows (lanes differing in bits 0..2); the total
      // over passes stays in e_rows[rl], which this thread alone touches (no barrier).
#pragma unroll
      for (int i = 0; i < kTM; ++i) {
#pragma unroll
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
            energy[row0 + rl] = static_cast<T>(0.5f * total);
          }
        }
      }
    }
  }
}

// Opt-in shared memory for the tiled kernel on the current device: min(the device's limit,
// kTiledMaxSharedBytes), set once per instantiation and device.
template <typename T, bool kVec>
int64_t prepare_tiled_kernel() {
  static std::atomic<int> limit[64] = {};
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 64 && limit[device].load()) return limit[device].load();
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const int bytes = static_cast<int>(std::min<int64_t>(optin, kTiledMaxSharedBytes));
  C10_CUDA_CHECK(
      cudaFuncSetAttribute(gaussian_tiled_kernel<T, kVec>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  C10_CUDA_CHECK(cudaFuncSetAttribute(gaussian_tiled_kernel<T, kVec>,
                                      cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  if (device < 64) limit[device].store(bytes);
  return bytes;
}

// Runs the tiled kernel and returns the score, or an undefined tensor where its shared memory
// does not fit (the caller takes the GEMM path). x, mean, precision contiguous; batch > 0.
template <typename T>
at::Tensor launch_tiled(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& precision,
                        at::Tensor& energy) {
  const int64_t batch = x.size(0);
  const int d = static_cast<int>(x.size(1));
  const int64_t shared = TileLayout(d).floats() * static_cast<int64_t>(sizeof(float));
  const bool vec = d % kVec16<T> == 0 && is_aligned(x.const_data_ptr<T>(), 16);
  return TORCHKERN_BOOL_SWITCH(vec, kVec, [&] {
    if (shared > prepare_tiled_kernel<T, kVec>()) return at::Tensor();
    at::Tensor score = at::empty({batch, d}, x.options());
    const int64_t tiles = (batch + kTileRows - 1) / kTileRows;
    const unsigned grid = grid_for(gaussian_tiled_kernel<T, kVec>, kTileThreads, tiles, 1, shared);
    gaussian_tiled_kernel<T, kVec><<<grid, kTileThreads, shared, current_stream()>>>(
        x.const_data_ptr<T>(), mean.const_data_ptr<T>(), precision.const_data_ptr<T>(), energy.mutable_data_ptr<T>(),
        score.mutable_data_ptr<T>(), batch, d);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return score;
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
  using C = at::opmath_type<T>;
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
  using C = at::opmath_type<T>;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= batch) return;
  C e = C(0);
  for (int j = lane; j < d; j += 32) {
    e += (static_cast<C>(x[row * d + j]) - static_cast<C>(mean[j])) * static_cast<C>(score[row * d + j]);
  }
  e = warp_sum(e);
  if (lane == 0) energy[row] = static_cast<T>(C(-0.5) * e);
}

std::tuple<at::Tensor, at::Tensor> gaussian_cuda(const char* torchkern_op_name, const at::Tensor& x,
                                                 const at::Tensor& mean, const at::Tensor& precision) {
  TORCHKERN_CHECK_FLOAT(x);
  TORCHKERN_CHECK_FLOAT(mean);
  TORCHKERN_CHECK_SAME_DTYPE(x, mean);
  TORCHKERN_CHECK_SAME_DEVICE(x, mean);
  TORCHKERN_CHECK_FLOAT(precision);
  TORCHKERN_CHECK_SAME_DTYPE(x, precision);
  TORCHKERN_CHECK_SAME_DEVICE(x, precision);
  TORCHKERN_CHECK_DIM(x, 2, "[B, d]");
  const int64_t batch = x.size(0), d = x.size(1);
  TORCHKERN_CHECK(mean.dim() == 1 && mean.size(0) == d, "mean must have shape [d] with d = ", d, " like x, got ",
                  mean.sizes());
  TORCHKERN_CHECK(precision.dim() == 2 && precision.size(0) == d && precision.size(1) == d,
                  "precision must have shape [d, d] with d = ", d, " like x, got ", precision.sizes());
  TORCHKERN_CHECK_CUDA(x);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), mc = mean.contiguous(), pc = precision.contiguous();
  at::Tensor energy = at::empty({batch}, x.options());
  if (batch == 0) return {energy, at::empty({0, d}, x.options())};
  if (d <= kTiledMaxD) {
    at::Tensor score;
    switch (x.scalar_type()) {
      case at::kFloat: score = launch_tiled<float>(xc, mc, pc, energy); break;
      case at::kHalf: score = launch_tiled<at::Half>(xc, mc, pc, energy); break;
      case at::kBFloat16: score = launch_tiled<at::BFloat16>(xc, mc, pc, energy); break;
      default: break;
    }
    if (score.defined()) return {energy, score};
  }
  const int64_t warp_shared = (d * d + d + kWarps * kRows * d) * static_cast<int64_t>(sizeof(double));
  if (x.scalar_type() == at::kDouble && warp_shared <= kSharedBytes) {
    at::Tensor score = at::empty({batch, d}, x.options());
    const int64_t groups = (batch + kRows - 1) / kRows;
    const unsigned grid = grid_for(groups, kWarps, 4);
    gaussian_warp_kernel<double><<<grid, kWarps * 32, warp_shared, current_stream()>>>(
        xc.const_data_ptr<double>(), mc.const_data_ptr<double>(), pc.const_data_ptr<double>(),
        energy.mutable_data_ptr<double>(), score.mutable_data_ptr<double>(), batch, static_cast<int>(d));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {energy, score};
  }
  // score = mu P - x P (P symmetric): one GEMM with a bias row.
  const at::Tensor score = at::addmm(at::matmul(mc, pc).unsqueeze(0), xc, pc, /*beta=*/1, /*alpha=*/-1);
  TORCHKERN_DISPATCH_FLOATING(x.scalar_type(), "gaussian_energy", [&] {
    const unsigned grid = static_cast<unsigned>((batch + kWarps - 1) / kWarps);
    gaussian_energy_epilogue<scalar_t><<<grid, kWarps * 32, 0, current_stream()>>>(
        xc.const_data_ptr<scalar_t>(), mc.const_data_ptr<scalar_t>(), score.const_data_ptr<scalar_t>(),
        energy.mutable_data_ptr<scalar_t>(), batch, static_cast<int>(d));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {energy, score.contiguous()};
}

at::Tensor gaussian_energy_cuda(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& precision) {
  return std::get<0>(gaussian_cuda("torchkern.gaussian_energy", x, mean, precision));
}

at::Tensor gaussian_score_cuda(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& precision) {
  return std::get<1>(gaussian_cuda("torchkern.gaussian_score", x, mean, precision));
}

std::tuple<at::Tensor, at::Tensor> gaussian_energy_and_score_cuda(const at::Tensor& x, const at::Tensor& mean,
                                                                  const at::Tensor& precision) {
  return gaussian_cuda("torchkern.gaussian_energy_and_score", x, mean, precision);
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) {
  m.impl("gaussian_energy", &torchkern::gaussian_energy_cuda);
  m.impl("gaussian_score", &torchkern::gaussian_score_cuda);
  m.impl("gaussian_energy_and_score", &torchkern::gaussian_energy_and_score_cuda);
}
