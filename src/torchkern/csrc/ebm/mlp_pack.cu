// The fused MLP chain's weight packing (mlp_host.h `pack`): the network's float32 layers copied into the kernel's
// padded geometry (widths rounded up to kAlign, zeros in the padding) in ONE launch. Packing by a zeroed buffer
// and a copy per tensor was ten launches (the op's host time fell from 0.21 to 0.06 ms on an H200 host).
#include "mlp_chain.cuh"

#include <cuda_bf16.h>

#include "torchkern/launch.h"

namespace torchkern {
namespace mlp {
namespace {

template <class T>
__device__ __forceinline__ T to_operand(float v) {
  if constexpr (sizeof(T) == 2) {
    return __float2bfloat16_rn(v);
  } else {
    return v;
  }
}

// Element i of [operands | vecs]: hidden layer l's W_l at p.w_off[l] ([dims[l+1], dims[l]]); then b_l at
// p.b_off[l], the output row at p.wlast_off and its bias at p.blast_off (vecs, float32).
template <class T>
__global__ void mlp_pack_kernel(const __grid_constant__ Params p, const __grid_constant__ PackSource s, T* wpack,
                                float* vpack, int64_t w_elems, int64_t v_elems) {
  const int H = p.n_hidden;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < w_elems + v_elems; i += stride) {
    float v = 0.f;
    if (i < w_elems) {
      int l = 0;
      while (l + 1 < H && i >= p.w_off[l + 1]) ++l;
      const int64_t k = i - p.w_off[l];
      const int r = static_cast<int>(k / p.dims[l]), col = static_cast<int>(k % p.dims[l]);
      if (r < s.out[l] && col < s.in[l]) v = s.w[l][static_cast<int64_t>(r) * s.in[l] + col];
      wpack[i] = to_operand<T>(v);
      continue;
    }
    const int j = static_cast<int>(i - w_elems);
    if (j < p.wlast_off) {
      int l = 0;
      while (l + 1 < H && j >= p.b_off[l + 1]) ++l;
      if (j - p.b_off[l] < s.out[l]) v = s.b[l][j - p.b_off[l]];
    } else if (j < p.blast_off) {
      if (j - p.wlast_off < s.in[H]) v = s.w[H][j - p.wlast_off];
    } else if (j == p.blast_off) {
      v = s.b[H][0];
    }
    vpack[j] = v;
  }
}

}  // namespace

void launch_pack(const Params& p, const PackSource& s, void* wpack, float* vpack, int64_t w_elems, int64_t v_elems,
                 bool bf16) {
  const unsigned grid = grid_for(w_elems + v_elems, 256, 2);
  if (bf16) {
    mlp_pack_kernel<__nv_bfloat16><<<grid, 256, 0, current_stream()>>>(
        p, s, static_cast<__nv_bfloat16*>(wpack), vpack, w_elems, v_elems);
  } else {
    mlp_pack_kernel<float><<<grid, 256, 0, current_stream()>>>(p, s, static_cast<float*>(wpack), vpack, w_elems,
                                                               v_elems);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace mlp
}  // namespace torchkern
