// mlp_energy_and_score: E(x) and -dE/dx of an MLP energy for a [B, d] batch, by the fused chain kernel in its
// evaluation mode (one forward and one input-gradient pass; see mlp_chain.cuh).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <tuple>

#include "mlp_host.h"

namespace torchkern {
namespace {

std::tuple<at::Tensor, at::Tensor> mlp_energy_and_score_cuda(const at::Tensor& x, at::TensorList weights,
                                                             at::TensorList biases, int64_t activation,
                                                             double negative_slope, int64_t precision,
                                                             at::IntArrayRef layout) {
  TORCHKERN_OP("mlp_energy_and_score");
  mlp::check_mlp(torchkern_op_name, x, weights, biases, activation, precision);
  TORCHKERN_CHECK_CUDA(x);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const at::Tensor work = mlp::float32_contiguous(x);
  at::Tensor energy = at::empty({x.size(0)}, work.options());
  at::Tensor score = at::empty(x.sizes(), work.options());
  if (x.size(0) > 0) {
    mlp::Params p = mlp::blank_params();
    p.mode = mlp::kEval;
    p.energy = energy.mutable_data_ptr<float>();
    p.score = score.mutable_data_ptr<float>();
    mlp::run(torchkern_op_name, p, work, work, weights, biases, activation, negative_slope, precision, layout,
             at::PhiloxCudaState());
  }
  return {mlp::as_dtype(energy, x.scalar_type()), mlp::as_dtype(score, x.scalar_type())};
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) { m.impl("mlp_energy_and_score", &torchkern::mlp_energy_and_score_cuda); }
