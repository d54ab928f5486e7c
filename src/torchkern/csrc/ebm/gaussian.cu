// Gaussian energy E = 1/2 (x - mu)^T P (x - mu) and score -P (x - mu) (P symmetric) of a [B, d] batch.
//
// Small d (P fits in shared memory): one fused kernel reads x once and writes score and
// energy; each warp takes kRows rows at a time so every P element read from shared memory
// serves kRows rows. Large d: score = mu P - x P in one cuBLAS call (addmm with the bias
// row mu P), then a row-wise epilogue E = -1/2 sum (x - mu) * score. The energy is exact
// for any P (1/2 r.(P^T r) = 1/2 r.(P r)); the score assumes P symmetric, which
// GaussianEnergy checks at construction.
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

#include "torchkern/checks.h"
#include "torchkern/dispatch.h"
#include "torchkern/launch.h"

namespace torchkern {
namespace {

constexpr int kWarps = 8;
constexpr int kRows = 4;
constexpr int kSharedBytes = 48 * 1024;

template <typename C>
__device__ __forceinline__ C warp_sum(C v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
gaussian_fused_kernel(const T* __restrict__ x,          // [B, d]
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
  const int64_t elem = x.scalar_type() == at::kDouble ? 8 : 4;
  const int64_t shared = (d * d + d + kWarps * kRows * d) * elem;
  if (shared <= kSharedBytes) {
    at::Tensor score = at::empty({batch, d}, x.options());
    TORCHKERN_DISPATCH_FLOATING(x.scalar_type(), "gaussian_energy", [&] {
      const int64_t groups = (batch + kRows - 1) / kRows;
      const unsigned grid = grid_for(groups, kWarps, 4);
      gaussian_fused_kernel<scalar_t><<<grid, kWarps * 32, shared, current_stream()>>>(
          xc.const_data_ptr<scalar_t>(), mc.const_data_ptr<scalar_t>(), pc.const_data_ptr<scalar_t>(),
          energy.mutable_data_ptr<scalar_t>(), score.mutable_data_ptr<scalar_t>(), batch, static_cast<int>(d));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
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
