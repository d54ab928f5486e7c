// The primitives' host side: argument checks, allocation, the device guard, the stream and the dtype, then the
// torch-free launchers of the .cu files (launchers.h); and their registration for CUDA tensors.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "launchers.h"
#include "torchkern/checks.h"
#include "torchkern/dispatch.h"
#include "torchkern/launch.h"

namespace torchkern {
namespace {

at::Tensor add_constant_cuda(const at::Tensor& x, double c) {
  TORCHKERN_OP("add_constant");
  TORCHKERN_CHECK_FLOAT(x);
  TORCHKERN_CHECK_CUDA(x);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  if (out.numel() == 0) return out;
  C10_CUDA_CHECK(add_constant_launch({out.mutable_data_ptr(), xc.const_data_ptr(), out.numel(), c,
                                      to_dtype(x.scalar_type())},
                                     current_stream()));
  return out;
}

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
  C10_CUDA_CHECK(mul_launch({out.mutable_data_ptr(), ac.const_data_ptr(), bc.const_data_ptr(), out.numel(),
                             to_dtype(a.scalar_type())},
                            current_stream()));
  return out;
}

at::Tensor batched_outer_cuda(const at::Tensor& a, const at::Tensor& b) {
  TORCHKERN_OP("batched_outer");
  TORCHKERN_CHECK_FLOAT(a);
  TORCHKERN_CHECK_FLOAT(b);
  TORCHKERN_CHECK_SAME_DTYPE(a, b);
  TORCHKERN_CHECK_SAME_DEVICE(a, b);
  TORCHKERN_CHECK_DIM(a, 2, "[B, n]");
  TORCHKERN_CHECK_DIM(b, 2, "[B, m]");
  TORCHKERN_CHECK(b.size(0) == a.size(0), "b must have shape [B, m] with B = ", a.size(0), " like a, got ",
                  shape_str(b.sizes()));
  TORCHKERN_CHECK_CUDA(a);
  const at::cuda::OptionalCUDAGuard guard(a.device());
  const int64_t batch = a.size(0), n = a.size(1), m = b.size(1);
  at::Tensor out = at::empty({batch, n, m}, a.options());
  if (out.numel() == 0) return out;
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  C10_CUDA_CHECK(batched_outer_launch({out.mutable_data_ptr(), ac.const_data_ptr(), bc.const_data_ptr(), batch, n, m,
                                       to_dtype(a.scalar_type())},
                                      current_stream()));
  return out;
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) {
  m.impl("add_constant", &torchkern::add_constant_cuda);
  m.impl("mul", &torchkern::mul_cuda);
  m.impl("batched_outer", &torchkern::batched_outer_cuda);
}
