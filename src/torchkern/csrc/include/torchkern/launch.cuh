// Launch helpers, torch-free: device-attribute caches and grid sizing. None throws: a failed runtime call here
// leaves its error for the launcher's closing cudaGetLastError() (common.h), which the host side checks.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "torchkern/common.h"

namespace torchkern {

// query(device) for the current device, computed once per device: device and function attributes
// are not free, and ops ask for them on every launch. `cache` is the caller's static table (stored as
// value + 1, so 0 means "not asked yet"); a device past its end is asked every time.
constexpr int kCachedDevices = 64;

// std::min and std::max for the launchers' host code, without <algorithm>: in C++20 that header alone costs a
// unit about a second of compile.
template <typename T>
constexpr T min_of(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
constexpr T max_of(T a, T b) {
  return a < b ? b : a;
}

template <typename Query>
inline int per_device(int (&cache)[kCachedDevices], Query query) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return query(0);
  if (device >= kCachedDevices) return query(device);
  if (!cache[device]) cache[device] = query(device) + 1;
  return cache[device] - 1;
}

// 0 where the query fails (its error is left for the launcher).
inline int device_attribute(cudaDeviceAttr attribute, int device) {
  int value = 0;
  return cudaDeviceGetAttribute(&value, attribute, device) == cudaSuccess ? value : 0;
}

// Multiprocessors of the current device.
inline int sm_count() {
  static int cache[kCachedDevices] = {};
  return per_device(cache, [](int device) { return device_attribute(cudaDevAttrMultiProcessorCount, device); });
}

// Compute capability of the current device as 10 * major + minor (90 for sm_90).
inline int compute_capability() {
  static int cache[kCachedDevices] = {};
  return per_device(cache, [](int device) {
    return 10 * device_attribute(cudaDevAttrComputeCapabilityMajor, device) +
           device_attribute(cudaDevAttrComputeCapabilityMinor, device);
  });
}

// Shared memory a block may opt in to on the current device.
inline size_t smem_optin_bytes() {
  static int cache[kCachedDevices] = {};
  return static_cast<size_t>(
      per_device(cache, [](int device) { return device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device); }));
}

// Lets `kernel` use `bytes` of dynamic shared memory (above 48 KiB needs the opt-in), once per
// device. `opted_in` is a static table of the caller's own, one per kernel: kernels of the same
// signature share an instantiation of this function, so it cannot own the table.
template <typename Kernel>
inline void opt_in_smem(int (&opted_in)[kCachedDevices], Kernel kernel, size_t bytes) {
  per_device(opted_in, [&](int) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    return 0;
  });
}

// Blocks for a grid-stride loop over `work` items, `per_block` items per block per
// pass: enough resident blocks to fill every SM, never more than the work needs.
inline unsigned int grid_for(int64_t work, int64_t per_block, int blocks_per_sm = 8) {
  const int64_t needed = (work + per_block - 1) / per_block;
  const int64_t resident = static_cast<int64_t>(sm_count()) * blocks_per_sm;
  return static_cast<unsigned int>(max_of<int64_t>(1, min_of(needed, resident)));
}

// The same, with blocks per SM from the kernel's real occupancy (registers, shared
// memory): a grid that assumes more resident blocks than fit runs in uneven waves.
template <typename Kernel>
inline unsigned int grid_for(Kernel kernel, int threads, int64_t work, int64_t per_block, size_t smem_bytes = 0) {
  const int64_t needed = (work + per_block - 1) / per_block;
  if (needed <= sm_count()) return static_cast<unsigned int>(max_of<int64_t>(1, needed));  // one wave anyway
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem_bytes);
  return grid_for(work, per_block, max_of(per_sm, 1));
}

}  // namespace torchkern
