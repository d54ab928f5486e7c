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
#include <cuda_runtime.h>

#include <cstdint>

#include "launchers.h"
#include "torchkern/dispatch.cuh"
#include "torchkern/reduce.cuh"

namespace torchkern {
namespace {

constexpr int kMaxTensors = kGraftMaxTensors;
constexpr int kThreads = 256;
constexpr int64_t kChunk = kGraftChunk;  // elements per block: 32 per thread

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
    const C gi = to_opmath(g[i]);
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

}  // namespace

cudaError_t shampoo_graft_launch(const ShampooGraftParams& p, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = opmath_t<T>;
    GraftTable<T, C> table{};
    table.count = p.count;
    for (int t = 0; t < p.count; ++t) {
      table.g[t] = static_cast<const T*>(p.g[t]);
      table.m[t] = static_cast<C*>(p.m[t]);
      table.v[t] = static_cast<C*>(p.v[t]);
      table.d[t] = static_cast<C*>(p.d[t]);
      table.numel[t] = p.numel[t];
      table.eps[t] = p.eps[t];
      table.scale[t] = p.scale[t];
      table.first_chunk[t] = p.first_chunk[t];
    }
    table.first_chunk[p.count] = p.first_chunk[p.count];
    const int chunks = p.first_chunk[p.count];
    C* partial = static_cast<C*>(p.partial);
    graft_kernel<T, C><<<chunks, kThreads, 0, stream>>>(table, p.beta1, p.sq_decay, p.sq_weight, p.found_inf, p.steps,
                                                        partial);
    TORCHKERN_RETURN_IF_ERROR(cudaGetLastError());
    graft_norms_kernel<T, C><<<p.count, 32, 0, stream>>>(table, partial, p.found_inf, p.steps,
                                                         static_cast<C*>(p.norms));
    return cudaGetLastError();
  });
}

}  // namespace torchkern
