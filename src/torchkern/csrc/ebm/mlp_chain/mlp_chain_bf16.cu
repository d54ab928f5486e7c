// The fused MLP-energy chain kernel with bf16 operands (mlp_chain_kernel.cuh); one file per precision so
// that ninja compiles the three in parallel. p.wgmma (sm_90a, the planner's choice) runs the warpgroup products,
// planned here before the launch.
#include "mlp_chain_kernel.cuh"

namespace torchkern {
namespace mlp {

namespace {

// The warpgroup path's per-product plan (WgProduct, mlp_chain.h) from p's widths and shared-memory layout:
// forward of layer l: A = W_l K-major (LBO 128, SBO n_l * 16; a tile is 8 core rows of n_l / 8 matrices, a k step
// 256 bytes); backward: A = W_l^T MN-major (LBO n_l * 16 between core rows of K, SBO 128; a tile 8 matrices, a k
// step n_l * 32 bytes); B [32 chains x K] K-major (LBO 128, SBO K * 16). The input-gradient product splits K
// between the warpgroups where d fits one 64-row tile.
void wg_plan(Params& p) {
  const int H = p.n_hidden;
  for (int g = 0; g < 2 * H; ++g) {
    const bool fwd = g < H;
    const int l = fwd ? g : 2 * H - 1 - g, in = p.dims[l], out = p.dims[l + 1];
    const int M = fwd ? out : in, K = fwd ? in : out;
    WgProduct& P = p.wg[g];
    P.tiles = (M + 63) / 64;
    P.split = !fwd && l == 0 && P.tiles == 1;
    const int kc = P.split ? K / 2 : K;
    P.ksteps = kc / 16;
    P.mine = P.split ? 1 : (P.tiles + 1) / 2;
    P.a_tile = fwd ? static_cast<uint32_t>(in) * 8 : 64;
    P.a_inc = fwd ? 16 : static_cast<uint32_t>(in) * 2;
    const unsigned w = static_cast<unsigned>(p.smem[kSlotW0 + l]);
    const unsigned bsrc = static_cast<unsigned>(p.smem[fwd ? (l == 0 ? kSlotXb : kSlotAct0 + ((l - 1) & 1))
                                                           : kSlotAct0 + (l & 1)]);
    for (int wg = 0; wg < 2; ++wg) {
      const unsigned k0 = P.split ? static_cast<unsigned>(wg * kc) : 0u;
      P.b[wg] = wg::descriptor(bsrc + k0 / 8 * 128, 128, static_cast<unsigned>(K) * 16);
      P.a[wg] = fwd ? wg::descriptor(w, 128, static_cast<unsigned>(in) * 16)
                    : wg::descriptor(w + k0 / 8 * static_cast<unsigned>(in / 8) * 128, static_cast<unsigned>(in) * 16,
                                     128);
    }
  }
}

}  // namespace

template <>
cudaError_t launch<kBf16>(const Params& p, const PhiloxState& philox, cudaStream_t stream) {
  if (!p.wgmma) return launch_op<kBf16, Bf16Op>(p, philox, stream);
  Params planned = p;
  wg_plan(planned);
  return launch_op<kBf16, Bf16WgOp>(planned, philox, stream);
}

}  // namespace mlp
}  // namespace torchkern
