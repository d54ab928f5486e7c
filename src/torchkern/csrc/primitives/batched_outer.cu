// batched_outer(a, b)[k, i, j] = a[k, i] * b[k, j].
//
// Floor: writing the [B, n, m] output (the inputs are n + m per batch, tiny next
// to n * m), so this should run at write bandwidth. Each thread writes one 16-byte
// vector with a streaming store; a[k, i] is one load per vector and b's row is
// read from L1/L2. 32-bit index math whenever the output allows it.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

#include "torchkern/checks.h"
#include "torchkern/dispatch.h"
#include "torchkern/launch.h"
#include "torchkern/vec.cuh"

namespace torchkern {
namespace {

constexpr int kThreads = 256;

// One 16-byte output vector per thread, no grid-stride loop: the layout that also serves the elementwise
// kernels best (many short blocks balance the last wave).
template <typename T, int V, typename index_t>
__global__ void __launch_bounds__(kThreads)
batched_outer_kernel(T* __restrict__ out,        // [B, n, m]
                     const T* __restrict__ a,    // [B, n]
                     const T* __restrict__ b,    // [B, m]
                     index_t total,              // B * n * m / V
                     index_t n,
                     index_t m_vec) {            // m / V
  using C = at::opmath_type<T>;
  const index_t idx = static_cast<index_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= total) return;
  const index_t row = idx / m_vec;  // = k * n + i, which is also a's flat index
  const index_t j = idx - row * m_vec;
  const index_t k = row / n;
  const C s = static_cast<C>(a[row]);
  const Vec<T, V> bv = load_vec<T, V>(b + static_cast<int64_t>(k) * m_vec * V, j);
  Vec<T, V> r;
#pragma unroll
  for (int e = 0; e < V; ++e) r.v[e] = static_cast<T>(s * static_cast<C>(bv.v[e]));
  if constexpr (sizeof(Vec<T, V>) == 16) {
    store_vec_streaming<T, V>(out, idx, r);
  } else {
    store_vec<T, V>(out, idx, r);
  }
}

template <typename T, int V>
void launch_batched_outer(T* out, const T* a, const T* b, int64_t batch, int64_t n, int64_t m) {
  const int64_t m_vec = m / V, total = batch * n * m_vec;
  const cudaStream_t stream = current_stream();
  const auto blocks = static_cast<unsigned>((total + kThreads - 1) / kThreads);
  // 32-bit index math when every index the grid forms fits.
  if (static_cast<int64_t>(blocks) * kThreads < std::numeric_limits<int32_t>::max()) {
    batched_outer_kernel<T, V, int32_t><<<blocks, kThreads, 0, stream>>>(
        out, a, b, static_cast<int32_t>(total), static_cast<int32_t>(n), static_cast<int32_t>(m_vec));
  } else {
    batched_outer_kernel<T, V, int64_t><<<blocks, kThreads, 0, stream>>>(out, a, b, total, n, m_vec);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor batched_outer_cuda(const at::Tensor& a, const at::Tensor& b) {
  TORCHKERN_OP("batched_outer");
  TORCHKERN_CHECK_FLOAT(a);
  TORCHKERN_CHECK_FLOAT(b);
  TORCHKERN_CHECK_SAME_DTYPE(a, b);
  TORCHKERN_CHECK_SAME_DEVICE(a, b);
  TORCHKERN_CHECK_DIM(a, 2, "[B, n]");
  TORCHKERN_CHECK_DIM(b, 2, "[B, m]");
  TORCHKERN_CHECK(b.size(0) == a.size(0), "b must have shape [B, m] with B = ", a.size(0), " like a, got ",
                  shape_str(b.sizes()));
  TORCHKERN_CHECK_CUDA(a);
  const at::cuda::OptionalCUDAGuard guard(a.device());
  const int64_t batch = a.size(0), n = a.size(1), m = b.size(1);
  at::Tensor out = at::empty({batch, n, m}, a.options());
  if (out.numel() == 0) return out;
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  TORCHKERN_DISPATCH_FLOATING(a.scalar_type(), "batched_outer", [&] {
    constexpr int V = kVec16<scalar_t>;
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    const scalar_t* pa = ac.const_data_ptr<scalar_t>();
    const scalar_t* pb = bc.const_data_ptr<scalar_t>();
    if (m % V == 0 && is_aligned(o, 16) && is_aligned(pb, 16)) {
      launch_batched_outer<scalar_t, V>(o, pa, pb, batch, n, m);
    } else {
      launch_batched_outer<scalar_t, 1>(o, pa, pb, batch, n, m);
    }
  });
  return out;
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) { m.impl("batched_outer", &torchkern::batched_outer_cuda); }
