// mul(a, b) = a * b: memory-bound, 3 * numel * sizeof(T) bytes (kernel in elementwise.cuh).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "elementwise.cuh"
#include "torchkern/checks.h"
#include "torchkern/dispatch.h"

namespace torchkern {
namespace {

struct Multiply {
  template <typename C>
  __device__ __forceinline__ C operator()(C a, C b) const { return a * b; }
};

at::Tensor mul_cuda(const at::Tensor& a, const at::Tensor& b) {
  TORCHKERN_OP("mul");
  TORCHKERN_CHECK_FLOAT(a);
  TORCHKERN_CHECK_FLOAT(b);
  TORCHKERN_CHECK_SAME_DTYPE(a, b);
  TORCHKERN_CHECK_SAME_DEVICE(a, b);
  TORCHKERN_CHECK_SAME_SHAPE(a, b);
  TORCHKERN_CHECK_CUDA(a);
  const at::cuda::OptionalCUDAGuard guard(a.device());
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor out = at::empty_like(ac);
  if (out.numel() == 0) return out;
  TORCHKERN_DISPATCH_FLOATING(a.scalar_type(), "mul", [&] {
    launch_elementwise<2>(out.mutable_data_ptr<scalar_t>(), ac.const_data_ptr<scalar_t>(),
                          bc.const_data_ptr<scalar_t>(), out.numel(), Multiply{});
  });
  return out;
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) { m.impl("mul", &torchkern::mul_cuda); }
