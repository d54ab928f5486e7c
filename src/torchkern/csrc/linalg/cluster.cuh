// Thread block clusters (sm_90) as the linalg kernels use them: the Newton roots' pairs (small_matrix.cuh) and the
// tridiagonal reduction's clusters of up to eight (tridiagonal.cuh).
// The ranks and peer addresses come from the runtime's cluster intrinsics (cuda_runtime.h), which cooperative
// groups' this_cluster() wraps: its header alone costs a unit about 6 s of compile.
#pragma once

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
  return static_cast<int>(__clusterRelativeBlockRank());
#else
  return 0;
#endif
}

// A launch on `blocks` blocks of `threads` in clusters of `size`, for cudaLaunchKernelEx and
// cudaOccupancyMaxActiveClusters; `attach` = false leaves the cluster attribute off (a launch of single blocks,
// which devices before sm_90 take). Not copyable: config points at the attribute.
struct ClusterLaunch {
  cudaLaunchAttribute cluster{};
  cudaLaunchConfig_t config{};

  ClusterLaunch(unsigned blocks, unsigned threads, unsigned size, size_t smem, cudaStream_t stream, bool attach) {
    config.gridDim = dim3(blocks);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = size, cluster.val.clusterDim.y = 1, cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = attach ? 1 : 0;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
};

// Block `rank`'s copy of a shared buffer (before sm_90 only rank 0, this block, exists).
template <typename X>
__device__ __forceinline__ X* cluster_peer(X* p, int rank) {
#if __CUDA_ARCH__ >= 900
  return static_cast<X*>(__cluster_map_shared_rank(p, static_cast<unsigned>(rank)));
#else
  return p;
#endif
}

}  // namespace torchkern
