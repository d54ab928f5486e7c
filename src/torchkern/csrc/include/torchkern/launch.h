// The host side's launch helpers: the current stream, and (from launch.cuh) the device-attribute caches.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "torchkern/launch.cuh"

namespace torchkern {

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

}  // namespace torchkern
