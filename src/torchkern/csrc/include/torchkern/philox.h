// The host side of philox.cuh: counters reserved from PyTorch's CUDA generator, as a torch-free PhiloxState.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>

#include <cstdint>
#include <mutex>
#include <optional>

#include "torchkern/philox.cuh"

namespace torchkern {

// Reserve `draws_per_group` Philox calls per element group from the generator (default: the current
// device's), the way PyTorch's own random kernels do (graph-capture safe).
inline PhiloxState reserve_philox(const std::optional<at::Generator>& generator, uint64_t draws_per_group) {
  auto* gen =
      at::get_generator_or_default<at::CUDAGeneratorImpl>(generator, at::cuda::detail::getDefaultCUDAGenerator());
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    state = gen->philox_cuda_state(4 * draws_per_group);  // in 32-bit values: 4 per Philox call
  }
  PhiloxState out;
  out.captured = state.captured_;
  if (state.captured_) {
    out.seed_ptr = state.seed_.ptr;
    out.offset_ptr = state.offset_.ptr;
    out.offset_intragraph = state.offset_intragraph_;
  } else {
    out.seed = state.seed_.val;
    out.offset = state.offset_.val;
  }
  return out;
}

}  // namespace torchkern
