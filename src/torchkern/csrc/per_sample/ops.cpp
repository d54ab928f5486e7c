// The per-sample family's host side: argument checks, allocation, the device guard, the stream and the dtype, then
// the torch-free launchers of the .cu files (launchers.h); and their registration for CUDA tensors.
#include <ATen/core/Tensor.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "launchers.h"
#include "torchkern/checks.h"
#include "torchkern/dispatch.h"
#include "torchkern/launch.h"

namespace torchkern {
namespace {

// The rule per_sample/twins.py use_gram applies too: Gram form when it does fewer FLOPs than materializing.
bool use_gram(int64_t T_len, int64_t d_in, int64_t d_out) { return T_len * (d_in + d_out) <= d_in * d_out; }

at::Tensor linear_grad_sq_norms_cuda(const at::Tensor& a, const at::Tensor& g, bool bias) {
  TORCHKERN_OP("linear_grad_sq_norms");
  TORCHKERN_CHECK_FLOAT(a);
  TORCHKERN_CHECK_FLOAT(g);
  TORCHKERN_CHECK_SAME_DTYPE(a, g);
  TORCHKERN_CHECK_SAME_DEVICE(a, g);
  TORCHKERN_CHECK(a.dim() == 2 || a.dim() == 3, "a must have shape [B, d_in] or [B, T, d_in], got ", a.sizes());
  TORCHKERN_CHECK(g.dim() == a.dim() && g.size(0) == a.size(0) && (a.dim() == 2 || g.size(1) == a.size(1)),
                  "g must have shape ", a.dim() == 2 ? "[B, d_out]" : "[B, T, d_out]", " with B",
                  a.dim() == 2 ? "" : ", T", " like a ", a.sizes(), ", got ", g.sizes());
  TORCHKERN_CHECK_CUDA(a);
  const at::cuda::OptionalCUDAGuard guard(a.device());
  const at::ScalarType out_type = a.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t batch = a.size(0), d_in = a.size(-1), d_out = g.size(-1);
  const int64_t T_len = a.dim() == 3 ? a.size(1) : 1;
  at::Tensor out = at::empty({batch}, a.options().dtype(out_type));
  if (batch == 0) return out;
  if (T_len == 0 || (d_in == 0 && (d_out == 0 || !bias))) return out.zero_();
  const at::Tensor ac = a.contiguous(), gc = g.contiguous();

  if (a.dim() == 3 && !use_gram(T_len, d_in, d_out)) {
    // Long sequences: W_i = g_i^T a_i is cheaper than two T x T Gram matrices (cuBLAS, compute type).
    const at::Tensor gf = gc.to(out_type), af = ac.to(out_type);
    at::Tensor sq = at::bmm(gf.transpose(1, 2), af).square_().sum({1, 2});
    if (bias) sq.add_(gf.sum(1).square_().sum(1));
    return sq;
  }

  const int64_t pairs = a.dim() == 3 ? gram_pairs(T_len) : 1;
  TORCHKERN_CHECK(pairs <= kMaxGramPairs, "sequence length ", T_len, " is too long for the Gram kernel");
  at::Tensor partial = pairs == 1 ? out : at::empty({batch, pairs}, out.options());
  C10_CUDA_CHECK(linear_grad_sq_norms_launch({partial.mutable_data_ptr(), ac.const_data_ptr(), gc.const_data_ptr(),
                                              batch, T_len, d_in, d_out, a.dim() == 3, bias,
                                              to_dtype(a.scalar_type())},
                                             current_stream()));
  if (pairs > 1) at::sum_out(out, partial, {1});
  return out;
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) { m.impl("linear_grad_sq_norms", &torchkern::linear_grad_sq_norms_cuda); }
