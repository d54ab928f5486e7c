// Warp and block reductions: the one copy every family uses.
#pragma once

#include <cuda_runtime.h>

namespace torchkern {

// Max that propagates NaN (as torch.max does): a NaN on either side wins.
template <typename C>
__device__ __forceinline__ C nan_max(C a, C b) {
  return b > a || b != b ? b : a;
}

// Sum over groups of WIDTH lanes (lanes that differ only in their low log2(WIDTH) bits; default the
// whole warp). Every lane of the group gets the sum. All 32 lanes must take part.
template <int WIDTH = 32, typename C>
__device__ __forceinline__ C warp_sum(C v) {
  static_assert(WIDTH >= 1 && WIDTH <= 32 && (WIDTH & (WIDTH - 1)) == 0, "WIDTH: a power of two up to 32");
#pragma unroll
  for (int m = WIDTH / 2; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// The same for the NaN-propagating max.
template <int WIDTH = 32, typename C>
__device__ __forceinline__ C warp_max(C v) {
#pragma unroll
  for (int m = WIDTH / 2; m > 0; m >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

// Block-wide sum (kMax: NaN-propagating max) over THREADS threads, through `scratch` (at least
// THREADS / 32 entries); every thread gets the result. Safe to call back to back with one scratch:
// it waits for the previous call's readers before writing.
template <int THREADS, typename C, bool kMax = false>
__device__ __forceinline__ C block_reduce(C v, C* scratch) {
  static_assert(THREADS % 32 == 0, "whole warps");
  v = kMax ? warp_max(v) : warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read by the previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[0];
#pragma unroll
  for (int w = 1; w < THREADS / 32; ++w) v = kMax ? nan_max(v, scratch[w]) : v + scratch[w];
  return v;
}

}  // namespace torchkern
