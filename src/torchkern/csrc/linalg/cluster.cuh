// Thread block clusters (sm_90) as the linalg kernels use them: the Newton roots' pairs (small_matrix.cuh) and the
// tridiagonal reduction's clusters of up to eight (tridiagonal.cuh).
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

namespace torchkern {

// A cluster barrier in two halves: arrive (release: this thread's memory operations so far, shared memory local or
// remote included, are ordered before it) and wait (acquire: returns once every thread of the cluster has arrived,
// with their writes visible), so that independent work can run in between. Only for kernels launched as clusters.
__device__ __forceinline__ void cluster_arrive() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __trap();
#endif
}

// Both halves at once; before sm_90 (where a "cluster" is one block) a block barrier.
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
  cluster_arrive();
  cluster_wait();
#else
  __syncthreads();
#endif
}

__device__ __forceinline__ int cluster_rank() {
#if __CUDA_ARCH__ >= 900
  return static_cast<int>(cooperative_groups::this_cluster().block_rank());
#else
  return 0;
#endif
}

// Block `rank`'s copy of a shared buffer (before sm_90 only rank 0, this block, exists).
template <typename X>
__device__ __forceinline__ X* cluster_peer(X* p, int rank) {
#if __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().map_shared_rank(p, rank);
#else
  return p;
#endif
}

}  // namespace torchkern
