// kron(A, B)[..., i*p + k, j*q + l] = A[..., i, j] * B[..., k, l], batch dims broadcast.
//
// Floor: writing the output (the inputs are m*n + p*q per batch, tiny next to m*n*p*q), so
// this is a pure write-bandwidth kernel: blockIdx.y walks output rows (batch, i, k are uniform
// per row: no per-element divisions but one), threads walk a row's columns in 16-byte vectors
// when q allows it, with streaming stores.
#include <type_traits>

#include "launchers.h"
#include "torchkern/dispatch.cuh"
#include "torchkern/launch.cuh"
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
  using C = opmath_t<T>;
  const int cols_v = n * q / V;  // vectors per output row
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t bi = row / p;  // = batch * m + i
    const int k = static_cast<int>(row - bi * p);
    const int64_t batch = bi / m;
    const T* a_row = A + bi * n;                          // A[batch, i, :]
    const T* b_row = B + (batch * p + k) * int64_t(q);    // B[batch, k, :]
    for (int cv = blockIdx.x * kThreads + threadIdx.x; cv < cols_v; cv += gridDim.x * kThreads) {
      const int c = cv * V, j = c / q, l = c - j * q;  // V divides q: one vector never straddles two j
      const C a = to_opmath(a_row[j]);
      Vec<T, V> r;
#pragma unroll
      for (int e = 0; e < V; ++e) r.v[e] = from_opmath<T>(a * to_opmath(b_row[l + e]));
      if constexpr (sizeof(Vec<T, V>) == 16) {
        store_vec_streaming<T, V>(out + row * int64_t(n) * q, cv, r);
      } else {
        store_vec<T, V>(out + row * int64_t(n) * q, cv, r);
      }
    }
  }
}

}  // namespace

cudaError_t kron_launch(const KronParams& prm, cudaStream_t stream) {
  const int64_t rows = prm.batch * prm.m * prm.p, cols = int64_t(prm.n) * prm.q;
  return dispatch_dtype(prm.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = kVec16<T>;
    T* out = static_cast<T*>(prm.out);
    const auto launch = [&](auto vec) {
      constexpr int W = decltype(vec)::value;
      const int64_t cols_v = cols / W;
      const unsigned gx = static_cast<unsigned>(min_of<int64_t>((cols_v + kThreads - 1) / kThreads, 1024));
      const int64_t want_y = max_of<int64_t>(1, int64_t(sm_count()) * 8 / gx);
      const unsigned gy = static_cast<unsigned>(min_of<int64_t>(min_of<int64_t>(rows, want_y * 8), 65535));
      kron_kernel<T, W><<<dim3(gx, gy), kThreads, 0, stream>>>(out, static_cast<const T*>(prm.A),
                                                                static_cast<const T*>(prm.B), rows, prm.m, prm.n,
                                                                prm.p, prm.q);
    };
    if (prm.q % V == 0 && is_aligned(out, 16)) {
      launch(std::integral_constant<int, V>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
    return cudaGetLastError();
  });
}

}  // namespace torchkern
