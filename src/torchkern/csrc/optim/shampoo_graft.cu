// shampoo_graft(grads, exp_avgs, graft_sqs, out, beta1, sq_decay, sq_weight, eps, scale, found_inf, steps)
// -> norms:
// Shampoo's grafting direction for every parameter of a group in one op (the math is in optim/shampoo.py and
// the twin); SOAP's Adam step in the eigenbasis and its AdamW step for 1-D parameters use it too:
//
//   m <- m + (1 - beta1) (g - m)         (exp_avgs given; otherwise m = g)
//   v <- sq_decay v + sq_weight g^2      (Adam: beta2, 1 - beta2; AdaGrad: 1, 1)
//   out_i = d = m / (sqrt(v) + eps_i) scale_i,  norms_i = ||d||_2
//
// found_inf (optional, a float32 scalar on the device): when it is nonzero the step is skipped on the device,
// without the host reading it: m and v are left as they are, out is zero and so are the norms. The optimizers
// pass their "gradients not all finite" flag, so a skipped step changes no state.
//
// steps (optional, float32 (n,) on the device, the steps each tensor has taken): this step is steps_i + 1, and
// Adam's bias corrections come from it on the device: eps_i sqrt(b2), scale_i sqrt(b2) / b1 with
// b1 = 1 - beta1^t (1 without exp_avgs) and b2 = 1 - sq_decay^t (1 when sq_decay is 1, AdaGrad); steps_i is
// then counted up, unless the step is skipped. No per-step host value is left in the call, so an optimizer
// step made of it can be replayed as a CUDA graph (optim/_common.py, StepGraph).
//
// The directions go to caller-allocated ``out`` tensors (a custom op may mutate lists of tensors but, for
// torch.compile, not return a list as well).
//
// Why an op: torch's foreach version is nine launches (lerp, mul, addcmul, sqrt, add, div, mul, norm,
// stack), each ~40-60 us of host time on the GPU hosts, where a Shampoo training step is host-bound.
// Floor: read g, m, v and write m, v, d once (6 passes over the parameters; the foreach chain makes ~15).
//
// Up to kMaxTensors tensors per launch, their pointers passed by value (no host-to-device table copy);
// every block handles one chunk of one tensor and writes its partial sum of d^2, and a second kernel adds
// each tensor's partials in order: deterministic.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "torchkern/checks.h"
#include "torchkern/dispatch.h"
#include "torchkern/launch.h"
#include "torchkern/reduce.cuh"

namespace torchkern {
namespace {

constexpr int kMaxTensors = 32;
constexpr int kThreads = 256;
constexpr int64_t kChunk = 8 * kThreads * 4;  // elements per block: 8192, so a 1024^2 weight spreads over 128 blocks

template <typename T, typename C>
struct GraftTable {
  const T* g[kMaxTensors];
  C* m[kMaxTensors];  // null: no gradient EMA, m = g
  C* v[kMaxTensors];
  C* d[kMaxTensors];
  int64_t numel[kMaxTensors];
  double eps[kMaxTensors];  // before the bias corrections, which are taken in double: 1 - 0.999^t cancels
  double scale[kMaxTensors];
  int first_chunk[kMaxTensors + 1];  // tensor t owns chunks [first_chunk[t], first_chunk[t + 1])
  int count;
};

template <typename T, typename C>
__global__ void __launch_bounds__(kThreads)
graft_kernel(const __grid_constant__ GraftTable<T, C> table, double beta1_d, double sq_decay_d, double sq_weight_d,
             const float* __restrict__ found_inf,  // [] or null
             const float* __restrict__ steps,      // [count] or null
             C* __restrict__ partial) {
  const C beta1 = C(beta1_d), sq_decay = C(sq_decay_d), sq_weight = C(sq_weight_d);
  __shared__ C scratch[kThreads / 32];
  const int chunk = blockIdx.x;
  const bool skip = found_inf != nullptr && *found_inf != 0.f;  // uniform across the block: no divergence
  int t = 0;
  while (chunk >= table.first_chunk[t + 1]) ++t;
  const int64_t begin = int64_t(chunk - table.first_chunk[t]) * kChunk;
  const int64_t end = begin + kChunk < table.numel[t] ? begin + kChunk : table.numel[t];
  const T* __restrict__ g = table.g[t];
  C* __restrict__ m = table.m[t];
  C* __restrict__ v = table.v[t];
  C* __restrict__ d = table.d[t];
  double eps_d = table.eps[t], scale_d = table.scale[t];
  if (steps != nullptr) {
    const double step = double(steps[t]) + 1.0;
    const double b1 = m != nullptr ? 1.0 - pow(beta1_d, step) : 1.0;
    const double b2 = sq_decay_d < 1.0 ? 1.0 - pow(sq_decay_d, step) : 1.0;
    eps_d *= sqrt(b2);
    scale_d *= sqrt(b2) / b1;
  }
  const C eps = C(eps_d), scale = C(scale_d);
  C sum = 0;
  if (skip) {  // a skipped step: the states stay bitwise as they are (g may hold NaN/Inf: never read)
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) d[i] = C(0);
    if (threadIdx.x == 0) partial[chunk] = C(0);
    return;
  }
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const C gi = static_cast<C>(g[i]);
    C mi = gi;
    if (m != nullptr) {
      mi = m[i] + (C(1) - beta1) * (gi - m[i]);
      m[i] = mi;
    }
    const C vi = sq_decay * v[i] + sq_weight * gi * gi;
    v[i] = vi;
    const C di = mi / (sqrt(vi) + eps) * scale;
    d[i] = di;
    sum += di * di;
  }
  sum = block_reduce<kThreads>(sum, scratch);
  if (threadIdx.x == 0) partial[chunk] = sum;
}

// norms[t] = sqrt(sum of tensor t's partials), in chunk order; one warp per tensor. Then tensor t's step is
// counted (after graft_kernel has read it).
template <typename T, typename C>
__global__ void graft_norms_kernel(const __grid_constant__ GraftTable<T, C> table, const C* __restrict__ partial,
                                   const float* __restrict__ found_inf, float* __restrict__ steps,
                                   C* __restrict__ norms) {
  const int t = blockIdx.x;
  C sum = 0;
  for (int c = table.first_chunk[t] + threadIdx.x; c < table.first_chunk[t + 1]; c += 32) sum += partial[c];
  sum = warp_sum(sum);
  if (threadIdx.x == 0) {
    norms[t] = sqrt(sum);
    if (steps != nullptr && !(found_inf != nullptr && *found_inf != 0.f)) steps[t] += 1.f;
  }
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

  TORCHKERN_DISPATCH_FLOATING(g0.scalar_type(), "shampoo_graft", [&] {
    using C = at::opmath_type<scalar_t>;
    std::vector<at::Tensor> contiguous_grads;  // kept alive until the launches are queued
    for (size_t start = 0; start < n; start += kMaxTensors) {
      GraftTable<scalar_t, C> table{};
      table.count = static_cast<int>(std::min<size_t>(kMaxTensors, n - start));
      int chunks = 0;
      for (int t = 0; t < table.count; ++t) {
        const size_t i = start + t;
        contiguous_grads.push_back(grads[i].contiguous());
        table.g[t] = contiguous_grads.back().const_data_ptr<scalar_t>();
        table.m[t] = exp_avgs.empty() ? nullptr : exp_avgs[i].mutable_data_ptr<C>();
        table.v[t] = graft_sqs[i].mutable_data_ptr<C>();
        table.d[t] = out[i].mutable_data_ptr<C>();
        table.numel[t] = grads[i].numel();
        table.eps[t] = eps[i];
        table.scale[t] = scale[i];
        table.first_chunk[t] = chunks;
        const int64_t own = (table.numel[t] + kChunk - 1) / kChunk;
        TORCHKERN_CHECK(chunks + own < (int64_t(1) << 30), "too many elements in one call");
        chunks += static_cast<int>(own > 0 ? own : 1);  // an empty tensor still gets a block: its norm is 0
      }
      table.first_chunk[table.count] = chunks;
      at::Tensor partial = at::empty({chunks}, norms.options());
      float* counts = step_counts == nullptr ? nullptr : step_counts + start;
      graft_kernel<scalar_t, C><<<chunks, kThreads, 0, stream>>>(table, beta1, sq_decay, sq_weight, found, counts,
                                                                 partial.mutable_data_ptr<C>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      graft_norms_kernel<scalar_t, C><<<table.count, 32, 0, stream>>>(
          table, partial.const_data_ptr<C>(), found, counts, norms.mutable_data_ptr<C>() + start);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return norms;
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) { m.impl("shampoo_graft", &torchkern::shampoo_graft_cuda); }
