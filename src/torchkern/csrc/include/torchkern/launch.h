// Launch helpers: grid sizing from the device, the current stream, launch checks.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace torchkern {

// Multiprocessors of the current device (cached per device; the query is not free).
inline int sm_count() {
  static int cached[64] = {};
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 64 && cached[device]) return cached[device];
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  if (device < 64) cached[device] = count;
  return count;
}

// Blocks for a grid-stride loop over `work` items, `per_block` items per block per
// pass: enough resident blocks to fill every SM, never more than the work needs.
inline unsigned int grid_for(int64_t work, int64_t per_block, int blocks_per_sm = 8) {
  const int64_t needed = (work + per_block - 1) / per_block;
  const int64_t resident = static_cast<int64_t>(sm_count()) * blocks_per_sm;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min(needed, resident)));
}

// The same, with blocks per SM from the kernel's real occupancy (registers, shared
// memory): a grid that assumes more resident blocks than fit runs in uneven waves.
template <typename Kernel>
inline unsigned int grid_for(Kernel kernel, int threads, int64_t work, int64_t per_block, size_t smem_bytes = 0) {
  const int64_t needed = (work + per_block - 1) / per_block;
  if (needed <= sm_count()) return static_cast<unsigned int>(std::max<int64_t>(1, needed));  // one wave anyway
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem_bytes));
  return grid_for(work, per_block, std::max(per_sm, 1));
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

}  // namespace torchkern
