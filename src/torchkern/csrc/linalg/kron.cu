// kron(A, B)[..., i*p + k, j*q + l] = A[..., i, j] * B[..., k, l], batch dims broadcast.
//
// Floor: writing the output (the inputs are m*n + p*q per batch, tiny next to m*n*p*q), so
// this is a pure write-bandwidth kernel: blockIdx.y walks output rows (batch, i, k are uniform
// per row: no per-element divisions but one), threads walk a row's columns in 16-byte vectors
// when q allows it, with streaming stores.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ExpandUtils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "torchkern/checks.h"
#include "torchkern/dispatch.h"
#include "torchkern/launch.h"
#include "torchkern/vec.cuh"

namespace torchkern {
namespace {

constexpr int kThreads = 256;

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
kron_kernel(T* __restrict__ out,        // [Bt, m*p, n*q]
            const T* __restrict__ A,    // [Bt, m, n]
            const T* __restrict__ B,    // [Bt, p, q]
            int64_t rows,               // Bt * m * p
            int m, int n, int p, int q) {
  using C = at::opmath_type<T>;
  const int cols_v = n * q / V;  // vectors per output row
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t bi = row / p;  // = batch * m + i
    const int k = static_cast<int>(row - bi * p);
    const int64_t batch = bi / m;
    const T* a_row = A + bi * n;                          // A[batch, i, :]
    const T* b_row = B + (batch * p + k) * int64_t(q);    // B[batch, k, :]
    for (int cv = blockIdx.x * kThreads + threadIdx.x; cv < cols_v; cv += gridDim.x * kThreads) {
      const int c = cv * V, j = c / q, l = c - j * q;  // V divides q: one vector never straddles two j
      const C a = static_cast<C>(a_row[j]);
      Vec<T, V> r;
#pragma unroll
      for (int e = 0; e < V; ++e) r.v[e] = static_cast<T>(a * static_cast<C>(b_row[l + e]));
      if constexpr (sizeof(Vec<T, V>) == 16) {
        store_vec_streaming<T, V>(out + row * int64_t(n) * q, cv, r);
      } else {
        store_vec<T, V>(out + row * int64_t(n) * q, cv, r);
      }
    }
  }
}

at::Tensor kron_cuda(const at::Tensor& A, const at::Tensor& B) {
  TORCHKERN_OP("kron");
  TORCHKERN_CHECK_FLOAT(A);
  TORCHKERN_CHECK_FLOAT(B);
  TORCHKERN_CHECK_SAME_DTYPE(A, B);
  TORCHKERN_CHECK_SAME_DEVICE(A, B);
  TORCHKERN_CHECK(A.dim() >= 2, "A must have shape [..., m, n] (at least 2 dims), got ", A.sizes());
  TORCHKERN_CHECK(B.dim() >= 2, "B must have shape [..., p, q] (at least 2 dims), got ", B.sizes());
  TORCHKERN_CHECK_CUDA(A);
  const at::cuda::OptionalCUDAGuard guard(A.device());
  const auto a_batch = A.sizes().slice(0, A.dim() - 2), b_batch = B.sizes().slice(0, B.dim() - 2);
  const auto batch = at::infer_size(a_batch, b_batch);
  const int64_t m = A.size(-2), n = A.size(-1), p = B.size(-2), q = B.size(-1);
  std::vector<int64_t> out_shape(batch.begin(), batch.end());
  out_shape.push_back(m * p);
  out_shape.push_back(n * q);
  at::Tensor out = at::empty(out_shape, A.options());
  if (out.numel() == 0) return out;
  TORCHKERN_CHECK(m * p < (int64_t(1) << 31) && n * q < (int64_t(1) << 31), "output matrices are too large");
  std::vector<int64_t> a_shape(batch.begin(), batch.end()), b_shape(batch.begin(), batch.end());
  a_shape.insert(a_shape.end(), {m, n});
  b_shape.insert(b_shape.end(), {p, q});
  // the inputs are small next to the output: materialize the broadcast once
  const at::Tensor Ac = A.expand(a_shape).contiguous(), Bc = B.expand(b_shape).contiguous();
  const int64_t rows = out.numel() / (n * q);
  TORCHKERN_DISPATCH_FLOATING(A.scalar_type(), "kron", [&] {
    constexpr int V = kVec16<scalar_t>;
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    const scalar_t* pa = Ac.const_data_ptr<scalar_t>();
    const scalar_t* pb = Bc.const_data_ptr<scalar_t>();
    const cudaStream_t stream = current_stream();
    auto launch = [&](auto vec) {
      constexpr int W = decltype(vec)::value;
      const int64_t cols_v = n * q / W;
      const unsigned gx = static_cast<unsigned>(std::min<int64_t>((cols_v + kThreads - 1) / kThreads, 1024));
      const int64_t want_y = std::max<int64_t>(1, int64_t(sm_count()) * 8 / gx);
      const unsigned gy = static_cast<unsigned>(std::min<int64_t>({rows, want_y * 8, 65535}));
      kron_kernel<scalar_t, W><<<dim3(gx, gy), kThreads, 0, stream>>>(o, pa, pb, rows, static_cast<int>(m),
                                                                       static_cast<int>(n), static_cast<int>(p),
                                                                       static_cast<int>(q));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (q % V == 0 && is_aligned(o, 16)) {
      launch(std::integral_constant<int, V>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
  });
  return out;
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) { m.impl("kron", &torchkern::kron_cuda); }
