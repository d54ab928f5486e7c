// The fused MLP chain's weight packing (mlp_ops_host.h `pack`): the network's float32 layers copied into the kernel's
// padded geometry (widths rounded up to kAlign, zeros in the padding; streamed weights as the stages' image) and
// rounded as the products read them, in ONE launch. Packing by a zeroed buffer and a copy per tensor takes ten
// launches (the op's host time 0.21 against 0.06 ms on an H200 host).
#include "mlp_chain.h"
#include "mlp_operands.cuh"
#include "torchkern/launch.cuh"

namespace torchkern {
namespace mlp {
namespace {

// Hidden layer l's weight at [r, col] of W_l, zero in the padding.
__device__ __forceinline__ float weight(const PackSource& s, int l, int r, int col) {
  return r < s.out[l] && col < s.in[l] ? s.w[l][static_cast<int64_t>(r) * s.in[l] + col] : 0.f;
}

// Element i of [operands | vecs]: hidden layer l's weights at p.w_off[l] (resident: W_l [dims[l+1], dims[l]];
// streamed: its forward and backward images, mlp_chain.h); then b_l at p.b_off[l], the output row at
// p.wlast_off and its bias at p.blast_off (vecs, float32). Operands rounded by Op (mlp_operands.cuh).
template <class Op>
__global__ void mlp_pack_kernel(const __grid_constant__ Params p, const __grid_constant__ PackSource s,
                                typename Op::T* wpack, float* vpack, int64_t w_elems, int64_t v_elems) {
  constexpr int kRow = stream_row(sizeof(typename Op::T));
  const int H = p.n_hidden;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < w_elems + v_elems; i += stride) {
    float v = 0.f;
    if (i < w_elems) {
      int l = 0;
      while (l + 1 < H && i >= p.w_off[l + 1]) ++l;
      int64_t k = i - p.w_off[l];
      const int in = p.dims[l], out = p.dims[l + 1];
      if (p.resident) {
        v = weight(s, l, static_cast<int>(k / in), static_cast<int>(k % in));
      } else {
        const int64_t image = stream_image_elems(in, out, kRow);
        const bool fwd = k < image;
        k -= fwd ? 0 : image;
        const int N = fwd ? out : in;  // the product's output width
        const int chunk = static_cast<int>(k / (static_cast<int64_t>(N) * kRow));
        const int n = static_cast<int>(k / kRow % N), kk = static_cast<int>(k % kRow);
        const int kg = chunk * kKChunk + kk;  // B(kg, n): W_l[n, kg] forward, W_l[kg, n] backward
        if (kk < kKChunk) v = fwd ? weight(s, l, n, kg) : weight(s, l, kg, n);
      }
      wpack[i] = Op::operand(v);
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

template <class Op>
void launch_pack_as(const Params& p, const PackSource& s, void* wpack, float* vpack, int64_t w_elems, int64_t v_elems,
                    cudaStream_t stream) {
  mlp_pack_kernel<Op><<<grid_for(w_elems + v_elems, 256, 2), 256, 0, stream>>>(
      p, s, static_cast<typename Op::T*>(wpack), vpack, w_elems, v_elems);
}

}  // namespace

cudaError_t launch_pack(const Params& p, const PackSource& s, void* wpack, float* vpack, int64_t w_elems,
                        int64_t v_elems, int precision, cudaStream_t stream) {
  if (precision == kBf16) {
    launch_pack_as<Bf16Op>(p, s, wpack, vpack, w_elems, v_elems, stream);
  } else if (precision == kTf32) {
    launch_pack_as<Tf32Op>(p, s, wpack, vpack, w_elems, v_elems, stream);
  } else {
    launch_pack_as<Fp32Op>(p, s, wpack, vpack, w_elems, v_elems, stream);
  }
  return cudaGetLastError();
}

}  // namespace mlp
}  // namespace torchkern
