// The optimizers' host side: argument checks, allocation, the device guard, the stream and the dtype, then the
// torch-free launchers of the .cu files (launchers.h), with cholesky_qr's batched products between its launches;
// and their registration for CUDA tensors.
#include <ATen/core/Tensor.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "launchers.h"
#include "torchkern/checks.h"
#include "torchkern/dispatch.h"
#include "torchkern/launch.h"

namespace torchkern {
namespace {

at::Tensor cholesky_qr_cuda(const at::Tensor& X_in, double shift) {
  TORCHKERN_OP("cholesky_qr");
  TORCHKERN_CHECK(X_in.scalar_type() == at::kFloat || X_in.scalar_type() == at::kDouble,
                  "X must be float32 or float64, got ", X_in.scalar_type());
  TORCHKERN_CHECK(X_in.dim() >= 2, "X must have shape [..., m, n] (at least 2 dims), got ", X_in.sizes());
  TORCHKERN_CHECK(std::isfinite(shift) && shift >= 0.0, "shift must be a finite number >= 0, got ", shift);
  TORCHKERN_CHECK_CUDA(X_in);
  const at::cuda::OptionalCUDAGuard guard(X_in.device());
  const int64_t m = X_in.size(-2), n = X_in.size(-1);
  at::Tensor out = at::empty_like(X_in, at::MemoryFormat::Contiguous);
  if (out.numel() == 0) return out;
  at::Tensor work = X_in.reshape({-1, m, n}).clone(at::MemoryFormat::Contiguous);  // X_j, then X_j - Y_<j L_j<^T
  const int64_t k = work.size(0);
  TORCHKERN_CHECK(k < (int64_t(1) << 31), "too many matrices in one call: ", k);
  at::Tensor Y = out.view({k, m, n});
  // G: the shifted Gram matrix; as the factorization goes, L_jj in the diagonal blocks' lower triangles and
  // L_ij^T (i > j) above the diagonal, at (j, i): there no later trailing update writes, and no product reads
  // across the trailing square it updates (each product below writes a region none of its operands touches)
  at::Tensor G = at::matmul(work.mT(), work);
  G.diagonal(0, -2, -1).add_(shift);
  // L_jj^-1 of the current block column
  at::Tensor D = at::empty({k, kCholeskyBlock, kCholeskyBlock}, work.options());
  at::Tensor info = at::zeros({k}, work.options().dtype(at::kInt));
  const DType dtype = to_dtype(work.scalar_type());
  const cudaStream_t stream = current_stream();
  for (int64_t j0 = 0; j0 < n; j0 += kCholeskyBlock) {
    const int64_t j1 = std::min<int64_t>(j0 + kCholeskyBlock, n), nb = j1 - j0;
    C10_CUDA_CHECK(block_cholesky_launch({G.mutable_data_ptr(), D.mutable_data_ptr(), info.mutable_data_ptr<int>(), k,
                                          n, static_cast<int>(nb), static_cast<int>(j0), dtype},
                                         stream));
    const at::Tensor Dj = D.slice(1, 0, nb).slice(2, 0, nb);
    if (j1 < n) {
      at::Tensor Lt = G.slice(1, j0, j1).slice(2, j1, n);  // (L_ij)^T for i > j, from G_ij: D_j G_ij^T
      at::bmm_out(Lt, Dj, G.slice(1, j1, n).slice(2, j0, j1).mT());
      G.slice(1, j1, n).slice(2, j1, n).baddbmm_(Lt.mT(), Lt, 1.0, -1.0);
    }
    at::Tensor Xj = work.slice(2, j0, j1);
    if (j0 > 0) Xj.baddbmm_(Y.slice(2, 0, j0), G.slice(1, 0, j0).slice(2, j0, j1), 1.0, -1.0);
    at::Tensor Yj = Y.slice(2, j0, j1);
    at::bmm_out(Yj, Xj, Dj.mT());
  }
  // a failed block leaves the columns before it finite: the whole matrix is NaN, as the twin's
  Y.masked_fill_(info.ne(0).view({k, 1, 1}), std::numeric_limits<double>::quiet_NaN());
  return out;
}

at::Tensor shampoo_graft_cuda(at::TensorList grads, at::TensorList exp_avgs, at::TensorList graft_sqs,
                              at::TensorList out, double beta1, double sq_decay, double sq_weight,
                              at::ArrayRef<double> eps, at::ArrayRef<double> scale,
                              const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& steps) {
  TORCHKERN_OP("shampoo_graft");
  const size_t n = grads.size();
  TORCHKERN_CHECK(n > 0, "grads must hold at least one tensor");
  TORCHKERN_CHECK(exp_avgs.empty() || exp_avgs.size() == n, "exp_avgs must be empty or hold one tensor per grad (",
                  n, "), got ", exp_avgs.size());
  TORCHKERN_CHECK(graft_sqs.size() == n && out.size() == n && eps.size() == n && scale.size() == n,
                  "graft_sqs, out, eps and scale must hold one entry per grad (", n, "), got ", graft_sqs.size(), ", ",
                  out.size(), ", ", eps.size(), " and ", scale.size());
  const at::Tensor& g0 = grads[0];
  TORCHKERN_CHECK(is_supported_float(g0.scalar_type()), "grads[0] must be float32, float64, float16 or bfloat16, got ",
                  g0.scalar_type());
  TORCHKERN_CHECK(g0.is_cuda(), "grads[0] must be a CUDA tensor, got ", g0.device().str());
  const at::ScalarType state_type = g0.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& g = grads[i];
    TORCHKERN_CHECK(g.scalar_type() == g0.scalar_type() && g.device() == g0.device(), "grads[", i,
                    "] must have the dtype and device of grads[0] (", g0.scalar_type(), ", ", g0.device().str(),
                    "), got ", g.scalar_type(), ", ", g.device().str());
    const auto check_state = [&](const at::Tensor& s, const char* name) {
      TORCHKERN_CHECK(s.scalar_type() == state_type && s.device() == g0.device() && s.sizes() == g.sizes() &&
                          s.is_contiguous(),
                      name, "[", i, "] must be a contiguous ", state_type, " tensor of shape ", g.sizes(), " on ",
                      g0.device().str(), ", got ", s.scalar_type(), " ", s.sizes(), " on ", s.device().str(),
                      s.is_contiguous() ? "" : " (not contiguous)");
    };
    if (!exp_avgs.empty()) check_state(exp_avgs[i], "exp_avgs");
    check_state(graft_sqs[i], "graft_sqs");
    check_state(out[i], "out");
  }
  const float* found = nullptr;
  if (found_inf.has_value()) {
    const at::Tensor& f = *found_inf;
    TORCHKERN_CHECK(f.scalar_type() == at::kFloat && f.numel() == 1 && f.device() == g0.device(),
                    "found_inf must be a float32 tensor of one element on ", g0.device().str(), ", got ",
                    f.scalar_type(), " ", f.sizes(), " on ", f.device().str());
    found = f.const_data_ptr<float>();
  }
  float* step_counts = nullptr;
  if (steps.has_value()) {
    const at::Tensor& s = *steps;
    TORCHKERN_CHECK(s.scalar_type() == at::kFloat && s.dim() == 1 && s.numel() == static_cast<int64_t>(n) &&
                        s.device() == g0.device() && s.is_contiguous(),
                    "steps must be a contiguous float32 tensor of shape [", n, "] on ", g0.device().str(), ", got ",
                    s.scalar_type(), " ", s.sizes(), " on ", s.device().str(),
                    s.is_contiguous() ? "" : " (not contiguous)");
    step_counts = s.mutable_data_ptr<float>();
  }
  const at::cuda::OptionalCUDAGuard guard(g0.device());
  at::Tensor norms = at::empty({static_cast<int64_t>(n)}, g0.options().dtype(state_type));
  const cudaStream_t stream = current_stream();
  const DType dtype = to_dtype(g0.scalar_type());
  std::vector<at::Tensor> contiguous_grads;  // kept alive until the launches are queued
  for (size_t start = 0; start < n; start += kGraftMaxTensors) {
    ShampooGraftParams p{};
    p.count = static_cast<int>(std::min<size_t>(kGraftMaxTensors, n - start));
    int chunks = 0;
    for (int t = 0; t < p.count; ++t) {
      const size_t i = start + t;
      contiguous_grads.push_back(grads[i].contiguous());
      p.g[t] = contiguous_grads.back().const_data_ptr();
      p.m[t] = exp_avgs.empty() ? nullptr : exp_avgs[i].mutable_data_ptr();
      p.v[t] = graft_sqs[i].mutable_data_ptr();
      p.d[t] = out[i].mutable_data_ptr();
      p.numel[t] = grads[i].numel();
      p.eps[t] = eps[i];
      p.scale[t] = scale[i];
      p.first_chunk[t] = chunks;
      const int64_t own = (p.numel[t] + kGraftChunk - 1) / kGraftChunk;
      TORCHKERN_CHECK(chunks + own < (int64_t(1) << 30), "too many elements in one call");
      chunks += static_cast<int>(own > 0 ? own : 1);  // an empty tensor still gets a block: its norm is 0
    }
    p.first_chunk[p.count] = chunks;
    at::Tensor partial = at::empty({chunks}, norms.options());
    p.beta1 = beta1;
    p.sq_decay = sq_decay;
    p.sq_weight = sq_weight;
    p.found_inf = found;
    p.steps = step_counts == nullptr ? nullptr : step_counts + start;
    p.partial = partial.mutable_data_ptr();
    p.norms = static_cast<char*>(norms.mutable_data_ptr()) + start * norms.element_size();
    p.dtype = dtype;
    C10_CUDA_CHECK(shampoo_graft_launch(p, stream));
  }
  return norms;
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) {
  m.impl("cholesky_qr", &torchkern::cholesky_qr_cuda);
  m.impl("shampoo_graft", &torchkern::shampoo_graft_cuda);
}
