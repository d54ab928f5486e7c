// The elementwise kernel behind add_constant (x + c) and mul (a * b): memory-bound.
//
// Floor: add_constant moves 2 * numel * sizeof(T) bytes, mul 3 * numel * sizeof(T);
// both should run at the device copy bandwidth. One 16-byte vector per thread per input:
// on an H200 at 2^26 and 2^28 floats that layout ran at 101% of torch's add, against 97%
// for 4 vectors per thread (fewer, longer blocks leave a ragged last wave). Half types
// compute in float and round once, as torch does.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "torchkern/dispatch.cuh"
#include "torchkern/launch.cuh"
#include "torchkern/vec.cuh"

namespace torchkern {

constexpr int kElementwiseThreads = 256;

template <int kInputs, typename T, typename Op>
__device__ __forceinline__ T apply(const Op& op, T x, T y) {
  if constexpr (kInputs == 1) {
    return from_opmath<T>(op(to_opmath(x)));
  } else {
    return from_opmath<T>(op(to_opmath(x), to_opmath(y)));
  }
}

// out[i] = op(in0[i] [, in1[i]]) for i < n, in V-wide vectors (V = 1 when unaligned), one vector
// per thread and no grid-stride loop: registers stay low, occupancy high, and many short blocks
// let the scheduler balance the last wave (the layout of torch's own vectorized kernel).
template <typename T, int V, int kInputs, typename Op>
__global__ void __launch_bounds__(kElementwiseThreads)
elementwise_kernel(T* __restrict__ out,           // [n]
                   const T* __restrict__ in0,     // [n]
                   const T* __restrict__ in1,     // [n], unused when kInputs == 1
                   int64_t n, Op op) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kElementwiseThreads + threadIdx.x;
  if (i < n / V) {
    const Vec<T, V> x = load_vec<T, V>(in0, i);
    Vec<T, V> y;
    if constexpr (kInputs == 2) y = load_vec<T, V>(in1, i);
    Vec<T, V> r;
#pragma unroll
    for (int k = 0; k < V; ++k) r.v[k] = apply<kInputs>(op, x.v[k], kInputs == 2 ? y.v[k] : x.v[k]);
    store_vec<T, V>(out, i, r);
  }
  // The last n % V elements: one each for the first threads of the grid.
  if constexpr (V > 1) {
    const int64_t tail = n / V * V + i;
    if (tail < n) out[tail] = apply<kInputs>(op, in0[tail], kInputs == 2 ? in1[tail] : in0[tail]);
  }
}

template <int kInputs, typename T, typename Op>
cudaError_t launch_elementwise(T* out, const T* in0, const T* in1, int64_t n, Op op, cudaStream_t stream) {
  constexpr int V = kVec16<T>;
  const bool aligned = is_aligned(out, 16) && is_aligned(in0, 16) && (kInputs == 1 || is_aligned(in1, 16));
  const int64_t vectors = aligned ? max_of<int64_t>(1, n / V) : n;  // at least one block for the tail
  const auto blocks = static_cast<unsigned>((vectors + kElementwiseThreads - 1) / kElementwiseThreads);
  if (aligned) {
    elementwise_kernel<T, V, kInputs><<<blocks, kElementwiseThreads, 0, stream>>>(out, in0, in1, n, op);
  } else {
    elementwise_kernel<T, 1, kInputs><<<blocks, kElementwiseThreads, 0, stream>>>(out, in0, in1, n, op);
  }
  return cudaGetLastError();
}

}  // namespace torchkern
