// The primitives' host side: argument checks, allocation, the device guard, the stream and the dtype, then the
// torch-free launchers of the .cu files (launchers.h); their registration for CUDA tensors; and their Autograd
// kernels, which keep a call that records no graph in C++.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <string>

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

// These ops are cheap enough that the per-call cost of a Python autograd kernel (about 5 us on an H200 host,
// measured) doubled a small call against torch eager. So their Autograd key runs the C++ kernel below: with grad
// mode off, or no input requiring grad, it calls the backend kernel directly; otherwise it calls the op's
// differentiable variant `torchkern::_<op>_differentiable` (same schema and kernels), whose autograd is the op's
// formula in torchkern/primitives/ops.py. Its headers stay those of torch/library.h: torch/csrc/autograd's would
// make this the family's longest compile.
bool records_autograd(const at::Tensor& t) {
  return t.defined() && c10::GradMode::is_enabled() && t.requires_grad();
}
bool records_autograd(double) { return false; }

// No formula here or in ops.py computes a forward-mode tangent: an error rather than a result without one.
void check_no_tangent(const std::string& name, const at::Tensor& t) {
  TORCH_CHECK(!t.defined() || !t._fw_grad(/*level=*/0).defined(), "torchkern.", name,
              ": forward-mode AD (a dual tensor input) is not supported");
}
void check_no_tangent(const std::string&, double) {}

// The Autograd kernel of `torchkern::<name>`, whose signature is Tensor(Args...).
template <class... Args>
class Routed {
 public:
  explicit Routed(const std::string& name)
      : name_(name),
        plain_(handle("torchkern::" + name)),
        differentiable_(handle("torchkern::_" + name + "_differentiable")) {}

  at::Tensor operator()(Args... args) const {
    (check_no_tangent(name_, args), ...);
    if ((records_autograd(args) || ...)) return differentiable_.call(args...);
    const at::AutoDispatchBelowADInplaceOrView below;
    return plain_.call(args...);
  }

 private:
  using Handle = c10::TypedOperatorHandle<at::Tensor(Args...)>;
  static Handle handle(const std::string& name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<at::Tensor(Args...)>();
  }
  std::string name_;
  Handle plain_, differentiable_;
};

// The handles are looked up on the first call: the schemas are defined in Python, after this library loads.
at::Tensor add_constant_autograd(const at::Tensor& x, double c) {
  static const Routed<const at::Tensor&, double> op("add_constant");
  return op(x, c);
}

at::Tensor mul_autograd(const at::Tensor& a, const at::Tensor& b) {
  static const Routed<const at::Tensor&, const at::Tensor&> op("mul");
  return op(a, b);
}

at::Tensor batched_outer_autograd(const at::Tensor& a, const at::Tensor& b) {
  static const Routed<const at::Tensor&, const at::Tensor&> op("batched_outer");
  return op(a, b);
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) {
  m.impl("add_constant", &torchkern::add_constant_cuda);
  m.impl("mul", &torchkern::mul_cuda);
  m.impl("batched_outer", &torchkern::batched_outer_cuda);
  // The differentiable variants, which the Autograd kernels call when a graph is recorded, run the same kernels.
  m.impl("_add_constant_differentiable", &torchkern::add_constant_cuda);
  m.impl("_mul_differentiable", &torchkern::mul_cuda);
  m.impl("_batched_outer_differentiable", &torchkern::batched_outer_cuda);
}

TORCH_LIBRARY_IMPL(torchkern, Autograd, m) {
  m.impl("add_constant", &torchkern::add_constant_autograd);
  m.impl("mul", &torchkern::mul_autograd);
  m.impl("batched_outer", &torchkern::batched_outer_autograd);
}
