// The fused MLP-energy chain: what the host side of its ops (mlp_ops_host.h: mlp_energy_and_score,
// mlp_langevin_chain_, mlp_hmc_chain_) shares with the kernel (mlp_chain_kernel.cuh, one instantiation per operand
// precision in mlp_chain_{bf16,tf32,fp32}.cu, compiled in parallel): the parameters, the geometry and the
// launchers. Torch-free, read by nvcc and the host compiler.
//
// The energy: E(x) = w^T phi(h_H) + b, h_1 = W_0 x + b_0, h_{l+1} = W_l phi(h_l) + b_l (H hidden layers).
// Its input gradient: D_{H-1} = phi'(h_H) * w, D_{l-1} = (D_l W_l) * phi'(h_l), dE/dx = D_0 W_0.
// A block owns `rows` (32 or 16) chains for the whole run: their states, activations and phi' values stay
// in shared memory, every step is 2H matrix products (H forward, H backward) on tensor cores (mma.sync bf16 m16n8k16
// or tf32 m16n8k8, fragments by ldmatrix, FP32 accumulation) or on FP32 FMAs (the exact path), each followed by an
// elementwise epilogue (bias + activation, the chain rule, or the sampler's update).
//
// Geometry: every width is padded with zeros to a multiple of kAlign. A warp owns a unit of output tiles:
// `rows/16 x 2` tiles (32 columns; a pass covers kWidePass columns) or, for narrow outputs, 1 x 1 tiles.
// Weights either stay resident in shared memory (copied once) or are streamed per product in chunks of
// kKChunk input rows/columns through two stages, one bulk copy (TMA) per chunk (the chunk after the one being
// multiplied is in flight, across product and step boundaries: the sequence of chunks repeats every evaluation).
// Streamed weights are packed as an image of the stages (stream_image_elems): every chunk a product reads is one
// contiguous piece of global memory, laid out as the stage it is copied to, so the copy computes no addresses.
// Operands are rounded once, when written (TF32: the packed weights too), never in the products' k loops.
// On sm_90a, bf16 with resident weights runs on warpgroup products instead (wgmma, mlp_wgmma.cuh; p.wgmma): every
// product transposed, [features x chains] = W [features x K] x [K x chains], the weights the 64-row A operand and
// the block's chains the N, hidden widths padded to kWgAlign, the operands interleaved (mlp_wgmma.cuh), phi'
// kept per thread in the accumulators' order; the buffers' meanings per slot are listed with Slot.
// The planner in ebm/mlp.py chooses rows and residency and lays out shared memory: it hands the kernel the
// byte offset of each buffer (Slot order below = constants.MLP_SLOTS).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "torchkern/philox.cuh"

#if !defined(TORCHKERN_MLP_SLOTS) || !defined(TORCHKERN_ACT_KINDS) || !defined(TORCHKERN_PREC_FP32)
#error "build through torchkern's loader: it defines the TORCHKERN_MLP_* constants (ebm/constants.py)"
#endif

namespace torchkern {
namespace mlp {

constexpr int kWarps = TORCHKERN_MLP_WARPS;
constexpr int kThreads = 32 * kWarps;
constexpr int kKChunk = TORCHKERN_MLP_K_CHUNK;
constexpr int kAlign = TORCHKERN_MLP_ALIGN;
constexpr int kWgAlign = TORCHKERN_MLP_WGMMA_ALIGN;
constexpr int kWgMaxWidth = TORCHKERN_MLP_WGMMA_MAX_WIDTH;
constexpr int kMaxHidden = TORCHKERN_MLP_MAX_HIDDEN;
constexpr int kWidePass = TORCHKERN_MLP_WIDE_PASS;
constexpr int kRowValues = TORCHKERN_MLP_ROW_VALUES;
constexpr int kSlots = TORCHKERN_MLP_SLOTS;
static_assert(kWidePass == 32 * kWarps, "a wide pass: 32 columns per warp");
static_assert(kAlign % kKChunk == 0 && kKChunk % 16 == 0, "chunks tile every padded width");

enum Slot : int {
  kSlotXs = TORCHKERN_MLP_SLOT_XS,          // float [rows, d0 + 4]: the states
  kSlotXb = TORCHKERN_MLP_SLOT_XB,          // bf16 [rows, d0 + 8]: their operand copy (bf16 only)
  kSlotP = TORCHKERN_MLP_SLOT_P,            // float [rows, d0 + 4]: HMC momenta
  kSlotAct0 = TORCHKERN_MLP_SLOT_ACT0,      // T [rows, ld_act]: activations of hidden layer l (l < H - 1) ...
  kSlotAct1 = TORCHKERN_MLP_SLOT_ACT1,      // ... in act[l % 2]
  kSlotDeriv0 = TORCHKERN_MLP_SLOT_DERIV0,  // T [rows, n_{l+1} + pad]: phi'(h), then D_l, of hidden layer l
  kSlotW0 = TORCHKERN_MLP_SLOT_W0,          // T [n_{l+1}, n_l + pad]: resident weights of hidden layer l
  kSlotStage = TORCHKERN_MLP_SLOT_STAGE,    // T [2, stage elements]: streamed weight chunks; 2 mbarriers
  kSlotEpart = TORCHKERN_MLP_SLOT_EPART,    // float [rows, n_H / 16]: energy partial sums per column tile
  kSlotRows = TORCHKERN_MLP_SLOT_ROWS,      // float [kRowValues, rows]: per-row scalars (RowValue)
  kSlotEnd = TORCHKERN_MLP_SLOT_END,        // total bytes
};
// With p.wgmma: xb is bf16 [rows, d0] interleaved (the first product's B); act0/act1 the products' interleaved
// B operands [rows, widest n_l] (activations forward, D backward); deriv[l] phi'(h) of hidden layer l < H - 1 in
// each thread's accumulator order (uint4 [tiles, rows / 16, 128]); w[l] W_l interleaved [n_{l+1}, n_l] (plus the
// over-read slack of a last 64-row tile of W_0^T); stage the input gradient, float [2, rows, d0 + 4].

static_assert(kSlotEnd + 1 == kSlots, "Slot mirrors constants.MLP_SLOTS");
static_assert(kSlotW0 == kSlotDeriv0 + kMaxHidden && kSlotStage == kSlotW0 + kMaxHidden, "one slot per layer");

enum RowValue : int { kRowE = 0, kRowE0, kRowK0, kRowK1, kRowAccept, kRowRestart, kRowCount };
static_assert(kRowCount < kRowValues, "room for every per-row scalar");

enum Mode : int { kEval = 0, kLangevin = 1, kHmc = 2 };

enum Activation : int {
  kSilu = TORCHKERN_ACT_SILU,
  kSoftplus = TORCHKERN_ACT_SOFTPLUS,
  kTanh = TORCHKERN_ACT_TANH,
  kGelu = TORCHKERN_ACT_GELU,
  kRelu = TORCHKERN_ACT_RELU,
  kLeakyRelu = TORCHKERN_ACT_LEAKY_RELU,
  kActivations = TORCHKERN_ACT_KINDS,
};

enum Precision : int { kBf16 = TORCHKERN_PREC_BF16, kTf32 = TORCHKERN_PREC_TF32, kFp32 = TORCHKERN_PREC_FP32 };

// One product of the warpgroup path (p.wgmma), planned before the launch (mlp_chain_bf16.cu, wg_plan) so that the
// kernel computes no geometry per product and step (the chain of dependent uniform instructions that did was ~80
// per warp and product). Descriptors (mlp_wgmma.cuh) hold shared addresses relative to the dynamic shared memory;
// the kernel adds its base. [w]: warpgroup w's (they differ where the input-gradient product splits K).
struct WgProduct {
  uint64_t a[2], b[2];     // A's tile 0 and B at this warpgroup's first k step
  uint32_t a_tile, a_inc;  // descriptor steps (16-byte units): A's next 64-row tile, A's next k step
  int ksteps, tiles, mine;  // k steps of 16 per tile (this warpgroup's part of K), 64-row tiles, tiles per group
  bool split;              // K split between the warpgroups (two partial input gradients)
};

struct Params {
  // Tensors (float32, contiguous). x is updated in place (the final states; HMC: the accepted ones).
  float* x;                 // [B, d]
  const float* x_start;     // [B, d]: the starting states (Langevin: `start` where the op was given one; else x)
  float* traj;              // [B, kept, d] or null
  float* energy;            // Langevin/HMC: [B, kept] or null; eval: [B]
  float* score;             // eval: [B, d]
  bool* accepted;           // HMC: [B, n_steps] or null
  int64_t* accept_count;    // HMC: [B]
  int64_t* finite_steps;    // Langevin, HMC: [B] steps (trajectories) before the first non-finite state (divergent
                            // trajectory); Langevin: n_steps on entry (note_non_finite)
  const void* weights;      // packed operands (bf16 or float) of hidden layer l at w_off[l] (see launch_pack)
  const float* vecs;        // packed float: b_l [dims[l+1]] at b_off[l]; w [dims[H]] at wlast_off; b at blast_off
  const float* noise;       // injected [n_steps, B, d] (Langevin eps, HMC momenta) or null
  const float* uniform;     // injected [n_steps, B] (HMC) or null
  int64_t batch;
  int d;
  int rows;                 // chains per block: 16 or 32
  bool resident;            // weights in shared memory (else streamed)
  bool wgmma;               // bf16 on Hopper's warpgroup products (Bf16WgOp; resident, hidden widths of kWgAlign)
  int n_hidden;             // H
  int dims[kMaxHidden + 1];  // padded widths: dims[0] = d rounded up, dims[l + 1] = hidden layer l's
  int64_t w_off[kMaxHidden];
  int b_off[kMaxHidden];
  int wlast_off, blast_off;
  int activation;
  float slope;              // LeakyReLU
  int mode;
  // Langevin: x' = x - step g + noise_coef eps, clamped to [lo, hi] when clamp; HMC: step = leapfrog step.
  float step, noise_coef, lo, hi;
  bool clamp;
  float restart_fraction;   // Langevin: rows redrawn before the first step
  bool restart_uniform;     // redrawn from U(restart_lo, restart_hi), else N(0, 1)
  float restart_lo, restart_hi;
  bool use_philox;
  int n_leapfrog;
  int n_steps, thin, kept;  // kept: n_steps // thin where a trace is asked for
  int smem[kSlots];         // byte offsets (the planner's layout)
  WgProduct wg[2 * kMaxHidden];  // p.wgmma: product g (forward of layer g < H, then backward of 2H - 1 - g)
};

// Elements of a streamed chunk's row (and of a stage's): kKChunk operands and 16 bytes of padding (no bank
// conflicts on the fragments' loads).
__host__ __device__ constexpr int stream_row(int operand_bytes) { return kKChunk + 16 / operand_bytes; }

// Streamed weights (p.resident false): hidden layer l's two images at p.w_off[l], the forward product's then the
// backward product's, each stream_image_elems(dims[l], dims[l + 1], row) elements (row = stream_row). A product's
// image holds its operand B(k, n) chunk by chunk: for k chunk c, for each output column n < N,
// B(c kKChunk + [0, kKChunk), n) and the padding. Forward of layer l: B(k, n) = W_l[n, k]; backward:
// B(k, n) = W_l[k, n]. Pass p's piece of chunk c is rows [n0, n0 + pw) of chunk c: contiguous.
__host__ __device__ inline int64_t stream_image_elems(int in, int out, int row) {
  return static_cast<int64_t>(in) * out / kKChunk * row;
}

// The network's layers as float32 contiguous tensors ([out, in] weights, [out] biases), for the packing launch.
struct PackSource {
  const float* w[kMaxHidden + 1];
  const float* b[kMaxHidden + 1];
  int out[kMaxHidden + 1], in[kMaxHidden + 1];
};

// Writes the network into p's padded geometry in one launch (mlp_pack.cu): w_elems operands in `precision`'s
// operand type, rounded as its products read them (mlp_operands.cuh: bf16, TF32-rounded floats, exact floats) at
// p.w_off (resident: W_l [dims[l+1], dims[l]]; streamed: the images above), v_elems float32 vectors at p.b_off,
// p.wlast_off, p.blast_off, zeros elsewhere.
cudaError_t launch_pack(const Params& p, const PackSource& s, void* wpack, float* vpack, int64_t w_elems,
                        int64_t v_elems, int precision, cudaStream_t stream);

// Launches the kernel for one precision (mlp_chain_<precision>.cu): grid ceil(batch / rows), kThreads
// threads, p.smem[kSlotEnd] bytes of dynamic shared memory; bf16 plans the warpgroup products first where p.wgmma.
template <int kPrecision>
cudaError_t launch(const Params& p, const PhiloxState& philox, cudaStream_t stream);

}  // namespace mlp
}  // namespace torchkern
