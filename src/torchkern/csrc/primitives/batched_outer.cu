// batched_outer(a, b)[k, i, j] = a[k, i] * b[k, j].
//
// Floor: writing the [B, n, m] output (the inputs are n + m per batch, tiny next
// to n * m), so this should run at write bandwidth. Each thread writes one 16-byte
// vector with a streaming store; a[k, i] is one load per vector and b's row is
// read from L1/L2. 32-bit index math whenever the output allows it.
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "launchers.h"
#include "torchkern/dispatch.cuh"
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
  const index_t idx = static_cast<index_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= total) return;
  const index_t row = idx / m_vec;  // = k * n + i, which is also a's flat index
  const index_t j = idx - row * m_vec;
  const index_t k = row / n;
  const opmath_t<T> s = to_opmath(a[row]);
  const Vec<T, V> bv = load_vec<T, V>(b + static_cast<int64_t>(k) * m_vec * V, j);
  Vec<T, V> r;
#pragma unroll
  for (int e = 0; e < V; ++e) r.v[e] = from_opmath<T>(s * to_opmath(bv.v[e]));
  if constexpr (sizeof(Vec<T, V>) == 16) {
    store_vec_streaming<T, V>(out, idx, r);
  } else {
    store_vec<T, V>(out, idx, r);
  }
}

template <typename T, int V>
cudaError_t launch(T* out, const T* a, const T* b, int64_t batch, int64_t n, int64_t m, cudaStream_t stream) {
  const int64_t m_vec = m / V, total = batch * n * m_vec;
  const auto blocks = static_cast<unsigned>((total + kThreads - 1) / kThreads);
  // 32-bit index math when every index the grid forms fits.
  if (static_cast<int64_t>(blocks) * kThreads < std::numeric_limits<int32_t>::max()) {
    batched_outer_kernel<T, V, int32_t><<<blocks, kThreads, 0, stream>>>(
        out, a, b, static_cast<int32_t>(total), static_cast<int32_t>(n), static_cast<int32_t>(m_vec));
  } else {
    batched_outer_kernel<T, V, int64_t><<<blocks, kThreads, 0, stream>>>(out, a, b, total, n, m_vec);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t batched_outer_launch(const BatchedOuterParams& p, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = kVec16<T>;
    T* out = static_cast<T*>(p.out);
    const T* a = static_cast<const T*>(p.a);
    const T* b = static_cast<const T*>(p.b);
    if (p.m % V == 0 && is_aligned(out, 16) && is_aligned(b, 16)) {
      return launch<T, V>(out, a, b, p.batch, p.n, p.m, stream);
    }
    return launch<T, 1>(out, a, b, p.batch, p.n, p.m, stream);
  });
}

}  // namespace torchkern
