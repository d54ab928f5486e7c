// Host side of the fused MLP-energy ops (mlp_energy_and_score.cu, mlp_langevin_chain.cu, mlp_hmc_chain.cu):
// argument checks (the words of ebm/twins.py), packing the weights into the kernel's padded layout, the
// planner's layout, and the launch.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <vector>

#include "mlp_chain.cuh"
#include "mlp_wgmma.cuh"
#include "torchkern/checks.h"
#include "torchkern/launch.h"

namespace torchkern {
namespace mlp {

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

inline void check_mlp(const char* torchkern_op_name, const at::Tensor& x, at::TensorList weights,
                      at::TensorList biases, int64_t activation, int64_t precision) {
  TORCHKERN_CHECK_FLOAT(x);
  TORCHKERN_CHECK_DIM(x, 2, "[B, d]");
  const int64_t n = static_cast<int64_t>(weights.size());
  TORCHKERN_CHECK(n >= 2 && n <= kMaxHidden + 1, "weights must hold 2 to ", kMaxHidden + 1,
                  " matrices (hidden layers and the output layer), got ", n);
  TORCHKERN_CHECK(static_cast<int64_t>(biases.size()) == n, "biases must hold one vector per weight (", n, "), got ",
                  biases.size());
  int64_t width = x.size(1);
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& w = weights[i];
    const at::Tensor& b = biases[i];
    const bool last = i == n - 1;
    // the names "weights[i]" / "biases[i]" are spelled in each message: TORCH_CHECK builds a message only on failure
    TORCHKERN_CHECK(is_supported_float(w.scalar_type()), "weights[", i, "] must be float32, float64, float16 or "
                    "bfloat16, got ", w.scalar_type());
    TORCHKERN_CHECK(w.device() == x.device(), "weights[", i, "] must be on ", x.device().str(), " like x, got ",
                    w.device().str());
    TORCHKERN_CHECK(w.dim() == 2 && w.size(1) == width && w.size(0) >= 1 && (!last || w.size(0) == 1), "weights[", i,
                    "] must have shape [", last ? "1" : "n", ", ", width, "], got ", w.sizes());
    TORCHKERN_CHECK(is_supported_float(b.scalar_type()), "biases[", i, "] must be float32, float64, float16 or "
                    "bfloat16, got ", b.scalar_type());
    TORCHKERN_CHECK(b.device() == x.device(), "biases[", i, "] must be on ", x.device().str(), " like x, got ",
                    b.device().str());
    TORCHKERN_CHECK(b.dim() == 1 && b.size(0) == w.size(0), "biases[", i, "] must have shape [", w.size(0),
                    "] like weights[", i, "]'s rows, got ", b.sizes());
    width = w.size(0);
  }
  TORCHKERN_CHECK(activation >= 0 && activation < kActivations, "activation must be in [0, ",
                  static_cast<int>(kActivations), "), got ", activation);
  TORCHKERN_CHECK(precision >= 0 && precision < 3, "precision must be in [0, 3), got ", precision);
}

// The planner's layout [rows, resident, byte offsets in Slot order] (ebm/mlp.py), checked against this device.
inline void apply_layout(const char* torchkern_op_name, Params& p, at::IntArrayRef layout) {
  TORCHKERN_CHECK(static_cast<int>(layout.size()) == kSlots + 2, "layout must hold ", kSlots + 2,
                  " numbers from torchkern.ebm.mlp.plan(), got ", layout.size());
  TORCHKERN_CHECK(layout[0] == 16 || layout[0] == 32, "layout[0] (rows per block) must be 16 or 32, got ", layout[0]);
  p.rows = static_cast<int>(layout[0]);
  TORCHKERN_CHECK(layout[1] >= 0 && layout[1] <= 2, "layout[1] (0 streamed, 1 resident, 2 warpgroup products) must be "
                  "0, 1 or 2, got ", layout[1]);
  p.resident = layout[1] != 0;
  p.wgmma = layout[1] == 2;
  TORCHKERN_CHECK(!p.wgmma || p.rows == 32, "layout[1] = 2 (warpgroup products) needs 32 rows per block, got ",
                  p.rows);
  TORCHKERN_CHECK(!p.wgmma || compute_capability() == 90, "layout[1] = 2 (warpgroup products) needs an sm_90 device, "
                  "got sm_", compute_capability());
  for (int s = 0; s < kSlots; ++s) {
    const int64_t off = layout[2 + s];
    TORCHKERN_CHECK(off % 128 == 0 && off >= (s ? layout[1 + s] : 0),
                    "layout offsets must ascend in multiples of 128 bytes, got ", off, " for slot ", s);
    p.smem[s] = static_cast<int>(off);
  }
  const int64_t optin = static_cast<int64_t>(smem_optin_bytes());
  TORCHKERN_CHECK(layout[1 + kSlots] <= optin, "layout needs ", layout[1 + kSlots],
                  " bytes of shared memory per block, the device allows ", optin);
}

// x as a float32 contiguous tensor: x itself when it is one (no dispatch: a no-op .to and .contiguous cost a
// microsecond each, and the op's host time is on every sampler call's path).
inline at::Tensor float32_contiguous(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat && x.is_contiguous() ? x : x.to(at::kFloat).contiguous();
}

// t in `dtype` (t itself when it has it, without a dispatch).
inline at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

// Packs the network into p's padded geometry (widths rounded up to kAlign, zeros in the padding; one launch,
// mlp_pack.cu) in one allocation: the hidden layers' weights as operands (bf16, else float32; resident as W_l,
// streamed as the stages' images, mlp_chain.cuh), then, 128-byte aligned, the biases, the output row and its bias
// as float32. p.resident is set (apply_layout).
inline at::Tensor pack(Params& p, const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                       int64_t precision) {
  const int H = static_cast<int>(weights.size()) - 1;
  p.n_hidden = H;
  p.dims[0] = static_cast<int>(round_up(x.size(1), kAlign));
  int64_t woff = 0, voff = 0;
  for (int l = 0; l < H; ++l) {
    p.dims[l + 1] = static_cast<int>(round_up(weights[l].size(0), p.wgmma ? kWgAlign : kAlign));
    p.w_off[l] = woff;
    woff += p.resident ? static_cast<int64_t>(p.dims[l + 1]) * p.dims[l]
                       : 2 * stream_image_elems(p.dims[l], p.dims[l + 1], stream_row(precision == kBf16 ? 2 : 4));
    p.b_off[l] = static_cast<int>(voff);
    voff += p.dims[l + 1];
  }
  p.wlast_off = static_cast<int>(voff);
  p.blast_off = static_cast<int>(voff + p.dims[H]);
  PackSource s{};
  std::vector<at::Tensor> sources;  // the layers as float32 contiguous tensors (themselves where they are); alive
  sources.reserve(2 * (H + 1));     // until the launch is queued
  for (int l = 0; l <= H; ++l) {
    sources.push_back(float32_contiguous(weights[l]));
    sources.push_back(float32_contiguous(biases[l]));
    s.w[l] = sources[2 * l].const_data_ptr<float>();
    s.b[l] = sources[2 * l + 1].const_data_ptr<float>();
    s.out[l] = static_cast<int>(weights[l].size(0));
    s.in[l] = static_cast<int>(weights[l].size(1));
  }
  const int64_t operand_bytes = woff * (precision == kBf16 ? 2 : 4), v_elems = p.blast_off + kAlign;
  const int64_t vec_at = round_up(operand_bytes, 128);
  at::Tensor packed = at::empty({vec_at + v_elems * 4}, x.options().dtype(at::kByte));
  uint8_t* base = packed.mutable_data_ptr<uint8_t>();
  float* vecs = reinterpret_cast<float*>(base + vec_at);
  launch_pack(p, s, base, vecs, woff, v_elems, static_cast<int>(precision));
  p.weights = base;
  p.vecs = vecs;
  return packed;
}

// The warpgroup path's per-product plan (WgProduct, mlp_chain.cuh) from p's widths and shared-memory layout:
// forward of layer l: A = W_l K-major (LBO 128, SBO n_l * 16; a tile is 8 core rows of n_l / 8 matrices, a k step
// 256 bytes); backward: A = W_l^T MN-major (LBO n_l * 16 between core rows of K, SBO 128; a tile 8 matrices, a k
// step n_l * 32 bytes); B [32 chains x K] K-major (LBO 128, SBO K * 16). The input-gradient product splits K
// between the warpgroups where d fits one 64-row tile.
inline void wg_plan(Params& p) {
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

// Fills what every mode shares and launches; `work` is x as float32, contiguous (updated in place), `start` the
// starting states as float32, contiguous (work itself unless the op was given `start`).
inline void run(const char* torchkern_op_name, Params& p, const at::Tensor& work, const at::Tensor& start,
                at::TensorList weights, at::TensorList biases, int64_t activation, double negative_slope,
                int64_t precision, at::IntArrayRef layout, const at::PhiloxCudaState& philox) {
  apply_layout(torchkern_op_name, p, layout);
  p.x = work.mutable_data_ptr<float>();
  p.x_start = start.const_data_ptr<float>();
  p.batch = work.size(0);
  p.d = static_cast<int>(work.size(1));
  p.activation = static_cast<int>(activation);
  p.slope = static_cast<float>(negative_slope);
  TORCHKERN_CHECK(!p.wgmma || precision == kBf16, "layout[1] = 2 (warpgroup products) needs precision bf16 (",
                  static_cast<int>(kBf16), "), got ", precision);
  const at::Tensor packed = pack(p, work, weights, biases, precision);  // kept alive until the launch is queued
  for (int l = 0; p.wgmma && l <= p.n_hidden; ++l) {  // a product's K is at most 64 steps of 16 (wg_issue)
    TORCHKERN_CHECK(p.dims[l] <= kWgMaxWidth, "layout[1] = 2 (warpgroup products) takes widths up to ", kWgMaxWidth,
                    ", got ", p.dims[l], " (padded) at layer ", l);
  }
  if (p.wgmma) wg_plan(p);
  const size_t smem = static_cast<size_t>(p.smem[kSlotEnd]);
  switch (precision) {
    case kBf16: launch<kBf16>(p, philox, smem); break;
    case kTf32: launch<kTf32>(p, philox, smem); break;
    default: launch<kFp32>(p, philox, smem);
  }
}

inline Params blank_params() {
  Params p{};
  p.thin = 1;
  return p;
}

}  // namespace mlp
}  // namespace torchkern
