// The fused MLP-energy chain kernel (see mlp_chain.h for the math, the geometry and the layout).
// Included once per operand precision by mlp_chain_{bf16,tf32,fp32}.cu.
//
// One evaluation (energy and input gradient of the block's rows) is 2H products in this order:
// forward of hidden layers 0..H-1, backward of layers H-1..0. Product g's epilogue:
//   forward l < H-1: a = phi(acc + b_l) -> act[l % 2], phi'(.) -> deriv[l]
//   forward H-1:     D = phi'(acc + b) * w -> deriv[H-1]; energy partials phi(.) . w per 16-column tile
//   backward l > 0:  deriv[l-1] = acc * deriv[l-1] (the chain rule, in place)
//   backward 0:      acc = dE/dx: the sampler's update (Langevin step, HMC kick/drift) or the score.
// Every product reads a buffer that its epilogue does not write, so a warp runs its epilogue as soon as its
// own tiles are done; a __syncthreads separates products.
//
// Noise: Langevin step t draws eps of element i = row * d + col from Philox call (draw t, group i / 4),
// component i % 4: the counters of t separate langevin_step calls, as the analytic chains. Restarts use
// draws n_steps (row decision, group = row) and n_steps + 1 (new values); HMC trajectory t draws momenta at
// 2t and its acceptance uniform at 2t + 1 (group = row).
#pragma once

#include <cuda_bf16.h>

#include <type_traits>

#include "../energies.cuh"
#include "mlp_chain.h"
#include "mlp_operands.cuh"
#include "mlp_wgmma.cuh"
#include "torchkern/launch.cuh"
#include "torchkern/philox.cuh"
#include "torchkern/reduce.cuh"

namespace torchkern {
namespace mlp {

// The accumulators of a warp's unit of at most 2 x 2 tiles of 16 x 16. Tensor cores: tile (i, j) holds two
// m16n8 accumulators, v[i][j][4 h + e] = row g + 8 (e / 2), column 8 h + 2 t + e % 2 (g = lane / 4,
// t = lane % 4: the mma layout). FP32: row 16 i + (lane & 15), columns 16 j + 8 (lane >> 4) + [0, 8).
struct Accum {
  float v[2][2][8];
};

__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Four 8 x 8 b16 matrices from shared memory (ldmatrix.x4): lane l gives the shared address of row l % 8 of
// matrix l / 8 and receives its part of each matrix in r[0..3]; kTrans transposes each matrix.
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], unsigned addr) {
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  }
}

// ------------------------------------------------------------------------------------------ small helpers

// (phi(h), phi'(h)) of 8 pre-activations, by the formulas of torch's kernels (forward and backward), so the
// twins agree to rounding. One call per 8 elements, the switch outside the loops: a call per element (with
// its switch) was 40% of the bf16 kernel's instructions. Not inlined: inlined copies in every product
// variant made nvcc 13.0's cicc crash (intermittently). Arguments and result travel in registers.
struct Act8 {
  float a[8], d[8];
};

// kFast (the tensor-core precisions, whose operands are rounded to bf16 or tf32 anyway): SiLU's sigmoid from the
// hardware exp2 and reciprocal (relative error ~1e-6 instead of an ulp; 18 instructions per element to 4), with
// subnormal results flushed to zero (__expf's rescaling of them was two more instructions per element; a sigmoid
// that small is 0 or 1 in float32 either way).
__device__ __forceinline__ float fast_sigmoid(float h) {
  float e, s;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(h * -1.44269504088896341f));  // exp(-h)
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(1.f + e));
  return s;
}

// SiLU, the default activation, is also inlined where the tensor-core epilogue calls it (activate8's call, switch
// and argument shuffling were ~30 instructions per 8 elements); the other activations go through activate8.
template <bool kFast>
__device__ __forceinline__ Act8 silu8(float4 h0, float4 h1) {
  const float h[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
  Act8 r;
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    const float s = kFast ? fast_sigmoid(h[q]) : 1.f / (1.f + expf(-h[q]));
    r.a[q] = h[q] * s;
    // phi' = s (1 + h (1 - s)), torch's formula; kFast: as s + a (1 - s) = s + (a - a s), one instruction less
    r.d[q] = kFast ? s + fmaf(-r.a[q], s, r.a[q]) : s * (1.f + h[q] * (1.f - s));
  }
  return r;
}

template <bool kFast>
static __device__ __noinline__ Act8 activate8(int act, float slope, float4 h0, float4 h1) {
  const float h[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
  Act8 r;
  switch (act) {
    case kSilu:
      r = silu8<kFast>(h0, h1);
      break;
    case kSoftplus:
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const float z = expf(h[q]);
        const bool linear = h[q] > static_cast<float>(TORCHKERN_SOFTPLUS_THRESHOLD);
        r.a[q] = linear ? h[q] : log1pf(z);
        r.d[q] = linear ? 1.f : z / (z + 1.f);
      }
      break;
    case kTanh:
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        r.a[q] = tanhf(h[q]);
        r.d[q] = 1.f - r.a[q] * r.a[q];
      }
      break;
    case kGelu:
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const float cdf = 0.5f * (1.f + erff(h[q] * 0.70710678118654752f));
        r.a[q] = h[q] * cdf;
        r.d[q] = cdf + h[q] * expf(-0.5f * h[q] * h[q]) * 0.39894228040143268f;  // 1 / sqrt(2 pi)
      }
      break;
    case kRelu:
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        r.a[q] = h[q] < 0.f ? 0.f : h[q];  // NaN stays NaN
        r.d[q] = h[q] > 0.f ? 1.f : 0.f;
      }
      break;
    default:  // kLeakyRelu
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        r.a[q] = h[q] > 0.f ? h[q] : h[q] * slope;
        r.d[q] = h[q] > 0.f ? 1.f : slope;
      }
      break;
  }
  return r;
}

// 8 consecutive elements (16-byte aligned) of T in shared memory, as floats.
template <class Op>
__device__ __forceinline__ void load8(const typename Op::T* src, float (&v)[8]) {
  if constexpr (sizeof(typename Op::T) == 2) {
    const uint4 bits = *reinterpret_cast<const uint4*>(src);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&bits);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 f = __bfloat1622float2(h[q]);
      v[2 * q] = f.x;
      v[2 * q + 1] = f.y;
    }
  } else {
    const float4 a = reinterpret_cast<const float4*>(src)[0], b = reinterpret_cast<const float4*>(src)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  }
}

template <class Op>
__device__ __forceinline__ void store8(typename Op::T* dst, const float (&v)[8]) {
  if constexpr (sizeof(typename Op::T) == 2) {
    uint4 bits;
    __nv_bfloat16* h = reinterpret_cast<__nv_bfloat16*>(&bits);
#pragma unroll
    for (int q = 0; q < 8; ++q) h[q] = __float2bfloat16_rn(v[q]);
    *reinterpret_cast<uint4*>(dst) = bits;
  } else {
    reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

// v[q0 + i] + bias[q0 + i], i < 4.
__device__ __forceinline__ float4 pre_activation(const float (&v)[8], const float (&bias)[8], int q0) {
  return make_float4(v[q0] + bias[q0], v[q0 + 1] + bias[q0 + 1], v[q0 + 2] + bias[q0 + 2], v[q0 + 3] + bias[q0 + 3]);
}

// 8 consecutive floats of global memory (32-byte aligned: offsets are multiples of kAlign, columns of 8).
__device__ __forceinline__ void load8_global(const float* src, float (&v)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(src)), b = __ldg(reinterpret_cast<const float4*>(src) + 1);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ __forceinline__ uint4 philox_bits(const PhiloxKey& key, uint64_t draw, uint64_t group) {
  const uint64_t ctr = key.draw + draw;
  return philox4x32_10(make_uint4(static_cast<uint32_t>(ctr), static_cast<uint32_t>(ctr >> 32),
                                  static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32)),
                       static_cast<uint32_t>(key.seed), static_cast<uint32_t>(key.seed >> 32));
}

__device__ __forceinline__ uint32_t bits_component(const uint4& b, int c) {
  return c == 0 ? b.x : c == 1 ? b.y : c == 2 ? b.z : b.w;
}

// Standard normal of flat element i at `draw` (the langevin_step layout).
__device__ __forceinline__ float normal_at(const PhiloxKey& key, uint64_t draw, int64_t i) {
  return component(normal4(key, draw, static_cast<uint64_t>(i) / 4), static_cast<int>(i % 4));
}

// Uniform in (0, 1] of flat element i at `draw`.
__device__ __forceinline__ float uniform_at(const PhiloxKey& key, uint64_t draw, int64_t i) {
  return uniform_open0(bits_component(philox_bits(key, draw, static_cast<uint64_t>(i) / 4), static_cast<int>(i % 4)));
}

constexpr int log2_exact(int v) { return v == 1 ? 0 : 1 + log2_exact(v / 2); }
static_assert((1 << log2_exact(kWarps)) == kWarps, "pass widths are powers of two (gemm_info shifts)");

// ------------------------------------------------------------------------------------------ one product

struct Gemm {
  bool fwd;
  int layer, K, N;
  int ur, uc;      // a warp's unit: ur x uc tiles of 16 x 16
  int ru;          // row units (warps along the rows); warps along the columns: kWarps / ru
  int pw, passes;  // columns per pass, passes
  int chunks;      // streamed K chunks per pass (1 when resident: the whole K at once)
};

// Product g of an evaluation (g < H: forward of layer g; else backward of layer 2H - 1 - g).
__device__ __forceinline__ Gemm gemm_info(const Params& p, int g, int rt) {
  Gemm G;
  const int H = p.n_hidden;
  G.fwd = g < H;
  G.layer = G.fwd ? g : 2 * H - 1 - g;
  const int in = p.dims[G.layer], out = p.dims[G.layer + 1];
  G.K = G.fwd ? in : out;
  G.N = G.fwd ? out : in;
  // Wide units (rt x 2 tiles) reuse each loaded fragment most; narrow ones (1 x 1) keep every warp busy on
  // narrow outputs. Cost in tile-products per warp: wide passes x 2 rt, narrow passes x 1; ties go wide.
  // Pass widths are powers of two: shifts, not divisions (nvcc merged the two constant divisors of rt = 1, 2 into
  // a runtime division, 9% of the step loop's instructions).
  constexpr int kWideShift = log2_exact(kWidePass), kNarrowShift = log2_exact(kWarps * 16);  // narrow, rt = 1
  const int wide_passes = (G.N + kWidePass - 1) >> kWideShift;
  const int narrow_shift = kNarrowShift - (rt - 1), narrow_pw = 1 << narrow_shift;
  const int narrow_passes = (G.N + narrow_pw - 1) >> narrow_shift;
  if (narrow_passes < wide_passes * 2 * rt) {
    G.ur = 1, G.uc = 1, G.ru = rt, G.pw = narrow_pw, G.passes = narrow_passes;
  } else {
    G.ur = rt, G.uc = 2, G.ru = 1, G.pw = kWidePass, G.passes = wide_passes;
  }
  G.chunks = p.resident ? 1 : G.K / kKChunk;
  return G;
}

template <class Op>
struct Ctx {
  using T = typename Op::T;
  static constexpr int kPad = 16 / sizeof(T);  // 16 bytes of padding per row: no bank conflicts on tiles
  static constexpr int kSeg = 16 / sizeof(T);  // elements per 16-byte copy

  const Params* p;
  char* smem;
  int tid, warp, lane, rt, nvalid;
  int64_t row0;
  PhiloxKey key;
  float* xs;   // [rows, ld_xs]
  T* xop;      // the first product's operand: xb (the states rounded, on tensor cores) or xs
  float* pm;   // HMC momenta [rows, ld_xs]
  float* epart;
  float* rowv;
  float* grad;  // wgmma: the input gradient's partial sums (stage slot)
  uint64_t smem16;  // wgmma: the dynamic shared memory's shared-window address in 16-byte units
  T* stage;
  int ld_xs, ld_xop, ld_act, ld_epart, stage_elems;
  // what the last product's epilogue does
  bool need_energy;
  int t;          // Langevin step
  bool keep;      // Langevin: write the trajectory slot `slot`
  int slot;
  float kick;     // HMC: p -= kick g, then (drift) x += step p
  bool drift;
  // the weight stream: the next chunk to issue and the count issued (thread 0's), the count consumed (everyone's),
  // the shared addresses of the stages' mbarriers (8 bytes each, after the stages)
  int s_g, s_pass, s_chunk;
  unsigned issued, consumed, bars;

  __device__ T* act(int i) const { return reinterpret_cast<T*>(smem + p->smem[kSlotAct0 + i]); }
  __device__ T* deriv(int l) const { return reinterpret_cast<T*>(smem + p->smem[kSlotDeriv0 + l]); }
  __device__ int ld_deriv(int l) const { return p->dims[l + 1] + kPad; }
  __device__ T* w_res(int l) const { return reinterpret_cast<T*>(smem + p->smem[kSlotW0 + l]); }
  __device__ float* row_value(int which) const { return rowv + which * p->rows; }
  // Index of the states' operand copy at (row, col): interleaved for wgmma (the first product's B), else rows.
  __device__ int xop_at(int row, int col) const {
    if constexpr (Op::kWgmma) {
      return wg::core_index(row, col, p->dims[0]);
    } else {
      return row * ld_xop + col;
    }
  }
};

// The weight stream's copies: a chunk is one bulk copy (TMA), issued by thread 0 (the others compute no addresses
// and issue nothing: per-thread 16-byte copies were a third of the TF32 kernel's instructions), completing on its
// stage's mbarrier with the byte count it expects; the threads wait on the barrier's phase.
__device__ __forceinline__ void stage_barrier_init(unsigned bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Until the phase of parity `parity` of the barrier at `bar` has completed.
__device__ __forceinline__ void stage_wait(unsigned bar, unsigned parity) {
  uint32_t done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}

// Until chunk i of the stream has landed: stage i % 2, whose barrier completes its phase i / 2 for that chunk.
template <class Op>
__device__ __forceinline__ void wait_chunk(const Ctx<Op>& c, unsigned i) {
  stage_wait(c.bars + 8 * (i & 1u), (i >> 1) & 1u);
}

// Issues the next chunk of the schedule into its stage and advances the cursor (thread 0): rows n0 + [0, pw) of
// product g's k chunk, one contiguous piece of the packed image (mlp_chain.h, stream_image_elems). Chunk i goes
// to stage i % 2, whose barrier completes its phase i / 2 when the bytes have landed.
template <class Op>
__device__ void issue_chunk(Ctx<Op>& c) {
  using T = typename Op::T;
  constexpr int kRow = stream_row(sizeof(T));
  const Params& p = *c.p;
  const Gemm G = gemm_info(p, c.s_g, c.rt);
  const int n0 = c.s_pass * G.pw;
  const int64_t image = G.fwd ? 0 : stream_image_elems(p.dims[G.layer], p.dims[G.layer + 1], kRow);
  const T* src = static_cast<const T*>(p.weights) + p.w_off[G.layer] + image +
                 (static_cast<int64_t>(c.s_chunk) * G.N + n0) * kRow;
  const unsigned stage = c.issued & 1u;
  bulk_copy(smem_address(c.stage + stage * c.stage_elems), src, min(G.pw, G.N - n0) * kRow * sizeof(T),
            c.bars + 8 * stage);
  ++c.issued;
  if (++c.s_chunk == G.chunks) {
    c.s_chunk = 0;
    if (++c.s_pass == G.passes) {
      c.s_pass = 0;
      if (++c.s_g == 2 * p.n_hidden) c.s_g = 0;
    }
  }
}

// acc(unit) += A[r0 + [0, 16 kUR), ka + [0, kc)] x B[[0, kc), c0 + [0, 16 kUC)], where B(k, n) is
// B[n * ldb + k] (kByN: column-major, as the forward products' resident W and every streamed chunk) or
// B[k * ldb + n] (the backward products' resident W). Operands are stored rounded: no conversion here.
template <class Op, int kUR, int kUC, bool kByN>
__device__ __forceinline__ void mma_range(Accum& acc, const typename Op::T* A, int lda, int r0, int ka,
                                          const typename Op::T* B, int ldb, int c0, int kc, int lane) {
  if constexpr (Op::kTensorCores) {
    using T = typename Op::T;
    constexpr int kHalf = 16 / sizeof(T);  // the k extent of one 8 x 8 b16 matrix: 8 bf16 or 4 tf32
    // Lane l's row addresses. A (row-major): rows r0 + 16 i + l % 16, k + 8 (l / 16) b16 columns.
    // B by n (B(k, n) = B[n ldb + k]): n rows (l % 8) + 8 (l / 16), k + kHalf ((l / 8) % 2).
    // B by k, bf16 (B[k ldb + n], transposed loads): k rows (l % 8) + 8 ((l / 8) % 2), n + 8 (l / 16).
    const T* a_row = A + (r0 + (lane & 15)) * lda + ka + (lane >> 4) * kHalf;
    const T* b_row = kByN ? B + (c0 + (lane & 7) + ((lane >> 4) << 3)) * ldb + ((lane >> 3) & 1) * kHalf
                          : B + ((lane & 7) + (((lane >> 3) & 1) << 3)) * ldb + c0 + ((lane >> 4) << 3);
    const int g = lane >> 2, t = lane & 3;
    // The rows' shared-window addresses, computed once: a k step adds a constant (the loop's integer work was
    // as many instructions as its mma).
    unsigned a_addr[kUR], b_addr[kUC];
#pragma unroll
    for (int i = 0; i < kUR; ++i) a_addr[i] = smem_address(a_row + 16 * i * lda);
#pragma unroll
    for (int j = 0; j < kUC; ++j) b_addr[j] = smem_address(kByN ? b_row + 16 * j * ldb : b_row + 16 * j);
    const unsigned b_k_bytes = kByN ? sizeof(T) : ldb * sizeof(T);  // B's bytes per unit of k
    struct Frags {
      uint32_t a[kUR][4], b[kUC][4];  // b[j]: {b0, b1} of the n8 tile 16 j, then of 16 j + 8
    };
    auto load = [&](Frags& f, int k) {
#pragma unroll
      for (int i = 0; i < kUR; ++i) ldmatrix_x4<false>(f.a[i], a_addr[i] + k * sizeof(T));
#pragma unroll
      for (int j = 0; j < kUC; ++j) {
        if constexpr (kByN || sizeof(T) == 2) {
          ldmatrix_x4<!kByN>(f.b[j], b_addr[j] + k * b_k_bytes);
        } else {  // tf32 B(k = t (+4), n = g (+8)): 32-bit elements, no transposed load
          const T* bk = B + (k + t) * ldb + c0 + 16 * j + g;
          f.b[j][0] = __float_as_uint(bk[0]);
          f.b[j][1] = __float_as_uint(bk[4 * ldb]);
          f.b[j][2] = __float_as_uint(bk[8]);
          f.b[j][3] = __float_as_uint(bk[4 * ldb + 8]);
        }
      }
    };
    // A lone tile (a narrow product's unit) accumulates its odd k steps apart, in the unit's unused tile (0, 1):
    // two independent chains of dependent mma instead of one, summed at the end.
    constexpr bool kTwoChains = kUR == 1 && kUC == 1;
    if constexpr (kTwoChains) {
#pragma unroll
      for (int q = 0; q < 8; ++q) acc.v[0][1][q] = 0.f;
    }
    auto multiply = [&](const Frags& f, auto odd_step) {
#pragma unroll
      for (int i = 0; i < kUR; ++i) {
#pragma unroll
        for (int j = 0; j < kUC; ++j) {
          float* v = acc.v[i][kTwoChains && decltype(odd_step)::value ? 1 : j];
          float(&lo)[4] = *reinterpret_cast<float(*)[4]>(v);
          float(&hi)[4] = *reinterpret_cast<float(*)[4]>(v + 4);
          Op::mma(lo, f.a[i], f.b[j][0], f.b[j][1]);
          Op::mma(hi, f.a[i], f.b[j][2], f.b[j][3]);
        }
      }
    };
    // Software-pipelined: the next step's fragments load while this step multiplies (an mma waited for its
    // ldmatrix in 11% of the kernel's samples). kc is a multiple of 32: whole pairs of steps.
    Frags cur, next;
    load(cur, 0);
    for (int k = 0; k < kc; k += 2 * Op::kK) {
      load(next, k + Op::kK);
      multiply(cur, std::false_type{});
      if (k + 2 * Op::kK < kc) load(cur, k + 2 * Op::kK);
      multiply(next, std::true_type{});
    }
    if constexpr (kTwoChains) {
#pragma unroll
      for (int q = 0; q < 8; ++q) acc.v[0][0][q] += acc.v[0][1][q];
    }
  } else if constexpr (kByN) {  // FP32, B by n: 4 k at a time, one 16-byte load per row of A and column of B
    const int rr = lane & 15, cc = (lane >> 4) * 8;
    for (int k = 0; k < kc; k += 4) {
      float4 a[kUR];
#pragma unroll
      for (int i = 0; i < kUR; ++i) a[i] = *reinterpret_cast<const float4*>(A + (r0 + 16 * i + rr) * lda + ka + k);
#pragma unroll
      for (int j = 0; j < kUC; ++j) {
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const float4 b = *reinterpret_cast<const float4*>(B + (c0 + 16 * j + cc + q) * ldb + k);
#pragma unroll
          for (int i = 0; i < kUR; ++i) {  // k in order: the same sums as one k at a time
            float& v = acc.v[i][j][q];
            v = fmaf(a[i].w, b.w, fmaf(a[i].z, b.z, fmaf(a[i].y, b.y, fmaf(a[i].x, b.x, v))));
          }
        }
      }
    }
  } else {  // FP32, B by k: one k at a time, 8 consecutive columns of B per load
    const int rr = lane & 15, cc = (lane >> 4) * 8;
#pragma unroll 4
    for (int k = 0; k < kc; ++k) {
      float a[kUR];
#pragma unroll
      for (int i = 0; i < kUR; ++i) a[i] = A[(r0 + 16 * i + rr) * lda + ka + k];
#pragma unroll
      for (int j = 0; j < kUC; ++j) {
        float b[8];
        load8<Op>(B + k * ldb + c0 + 16 * j + cc, b);
#pragma unroll
        for (int i = 0; i < kUR; ++i) {
#pragma unroll
          for (int q = 0; q < 8; ++q) acc.v[i][j][q] = fmaf(a[i], b[q], acc.v[i][j][q]);
        }
      }
    }
  }
}

// The sampler's use of dE/dx at block row `row`, columns col and col + 1 (col even; either may lie past d): g the
// gradient pair, eps Langevin's noise pair.
template <class Op>
__device__ __forceinline__ void update_pair(Ctx<Op>& c, int row, int col, float g0, float g1, float e0, float e1) {
  const Params& p = *c.p;
  if (row >= c.nvalid || col >= p.d) return;
  const int n = col + 1 < p.d ? 2 : 1;
  const float g[2] = {g0, g1}, eps[2] = {e0, e1};
  const int64_t r = c.row0 + row, base = r * p.d + col;
  float* xs = c.xs + row * c.ld_xs + col;
  typename Op::T* xop = c.xop + c.xop_at(row, col);  // col and col + 1 share a row of 8 in both layouts
  if (p.mode == kEval) {
    for (int q = 0; q < n; ++q) p.score[base + q] = -g[q];
  } else if (p.mode == kLangevin) {
    const StepParams<float> s{p.step, p.noise_coef, p.lo, p.hi};
    for (int q = 0; q < n; ++q) {
      const float v = langevin_update(xs[q], g[q], eps[q], s, p.clamp);
      if (!isfinite(v) && p.finite_steps[r] > c.t) note_non_finite(p.finite_steps, r, c.t);  // diverged: rare
      xs[q] = v;
      if constexpr (Op::kTensorCores) xop[q] = Op::operand(v);
      if (c.keep) p.traj[(r * p.kept + c.slot) * p.d + col + q] = v;
    }
  } else {  // HMC: kick, then drift
    float* pm = c.pm + row * c.ld_xs + col;
    for (int q = 0; q < n; ++q) {
      const float m = pm[q] - c.kick * g[q];
      pm[q] = m;
      if (c.drift) {
        const float v = xs[q] + p.step * m;
        xs[q] = v;
        if constexpr (Op::kTensorCores) xop[q] = Op::operand(v);
      }
    }
  }
}

// Step c.t's Langevin noise of flat element i = row * d + col: injected, or Philox (see the top of this file).
template <class Op>
__device__ __forceinline__ float noise_at(const Ctx<Op>& c, int64_t i) {
  const Params& p = *c.p;
  return p.noise ? p.noise[static_cast<int64_t>(c.t) * p.batch * p.d + i] : normal_at(c.key, c.t, i);
}

// Whether Langevin's noise comes in whole Philox groups of 4 columns (drawn, not injected, and d a multiple of 4:
// no group straddles two rows). Block-uniform.
template <class Op>
__device__ __forceinline__ bool philox_groups(const Ctx<Op>& c) {
  const Params& p = *c.p;
  return p.mode == kLangevin && !p.noise && p.d % 4 == 0;
}

// Step c.t's Langevin noise of the 4 elements [base, base + 4) of one row, of which the first `valid` are in range
// (zeros after): one Philox group where philox_groups(c) (base is then a multiple of 4), else element by element.
template <class Op>
__device__ __forceinline__ float4 noise4(const Ctx<Op>& c, int64_t base, int valid) {
  if (philox_groups(c)) return normal4(c.key, static_cast<uint64_t>(c.t), static_cast<uint64_t>(base / 4));
  float e[4] = {};
  for (int q = 0; q < min(4, valid); ++q) e[q] = noise_at(c, base + q);
  return make_float4(e[0], e[1], e[2], e[3]);
}

// The FP32 path's update for the lane's 8 columns [col, col + 8) of block row `row`.
template <class Op>
__device__ void update(Ctx<Op>& c, int row, int col, const float (&g)[8]) {
  const Params& p = *c.p;
  if (row >= c.nvalid || col >= p.d) return;
  const int64_t base = (c.row0 + row) * p.d + col;
  float eps[8] = {};
  if (p.mode == kLangevin) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float4 e = noise4(c, base + 4 * h, p.d - col - 4 * h);
      eps[4 * h] = e.x, eps[4 * h + 1] = e.y, eps[4 * h + 2] = e.z, eps[4 * h + 3] = e.w;
    }
  }
#pragma unroll
  for (int q = 0; q < 8; q += 2) update_pair(c, row, col + q, g[q], g[q + 1], eps[q], eps[q + 1]);
}

// The tensor-core update, straight from the accumulators' mma layout (see epilogue_frag): tile (i, j) of the unit
// at (r0, cb). Langevin's Philox groups are 4 columns, so lanes t and t ^ 1 (the same rows) share each group of
// the lane's column pairs: a lane draws the groups of half h = t & 1 (rows g, g + 8) and trades the pairs it does
// not use with its neighbour. Injected noise, or d not a multiple of 4 (groups straddle rows): element by element.
template <class Op, int kUR, int kUC>
__device__ __forceinline__ void update_frag(Ctx<Op>& c, const Accum& acc, int r0, int cb) {
  const Params& p = *c.p;
  const int g = c.lane >> 2, t = c.lane & 3, mine = t & 1;
  const bool grouped = philox_groups(c);
#pragma unroll
  for (int i = 0; i < kUR; ++i) {
    const int row = r0 + 16 * i + g;
#pragma unroll
    for (int j = 0; j < kUC; ++j) {
      const int col = cb + 16 * j + 2 * t;  // half h adds 8
      float eps[8] = {};  // eps[4 h + 2 e2 + e]: row + 8 e2, column col + 8 h + e (the accumulators' order)
      if (grouped) {
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          const int64_t first = (c.row0 + row + 8 * e2) * p.d + cb + 16 * j + 8 * mine + 4 * (t >> 1);
          const float4 n = normal4(c.key, static_cast<uint64_t>(c.t), static_cast<uint64_t>(first / 4));
          const float keep0 = mine ? n.z : n.x, keep1 = mine ? n.w : n.y;
          const float give0 = mine ? n.x : n.z, give1 = mine ? n.y : n.w;
          const float got0 = __shfl_xor_sync(0xffffffffu, give0, 1), got1 = __shfl_xor_sync(0xffffffffu, give1, 1);
          eps[4 * mine + 2 * e2] = keep0, eps[4 * mine + 2 * e2 + 1] = keep1;
          eps[4 * (1 - mine) + 2 * e2] = got0, eps[4 * (1 - mine) + 2 * e2 + 1] = got1;
        }
      } else if (p.mode == kLangevin) {
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const int rq = row + 8 * ((q >> 1) & 1), cq = col + 8 * (q >> 2) + (q & 1);
          if (rq < c.nvalid && cq < p.d) eps[q] = noise_at(c, (c.row0 + rq) * p.d + cq);
        }
      }
      const float* v = acc.v[i][j];
#pragma unroll
      for (int q = 0; q < 8; q += 2) {
        update_pair(c, row + 8 * ((q >> 1) & 1), col + 8 * (q >> 2), v[q], v[q + 1], eps[q], eps[q + 1]);
      }
    }
  }
}

// The FP32 path's epilogue of product g for the lane's 8 outputs v at (row, [col, col + 8)).
template <class Op>
__device__ __forceinline__ void epilogue(Ctx<Op>& c, const Gemm& G, int row, int col, const float (&v)[8]) {
  const Params& p = *c.p;
  const int l = G.layer;
  if (G.fwd) {
    float bias[8];
    load8_global(p.vecs + p.b_off[l] + col, bias);
    const Act8 ad =
        activate8<Op::kTensorCores>(p.activation, p.slope, pre_activation(v, bias, 0), pre_activation(v, bias, 4));
    if (l < p.n_hidden - 1) {
      store8<Op>(c.act(l & 1) + row * c.ld_act + col, ad.a);
      store8<Op>(c.deriv(l) + row * c.ld_deriv(l) + col, ad.d);
    } else {
      float w[8], d[8], e = 0.f;
      load8_global(p.vecs + p.wlast_off + col, w);
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        d[q] = ad.d[q] * w[q];
        e += ad.a[q] * w[q];
      }
      store8<Op>(c.deriv(l) + row * c.ld_deriv(l) + col, d);
      if (c.need_energy) {  // warp-uniform; lanes l and l ^ 16 hold the two halves of the tile's row
        e += __shfl_xor_sync(0xffffffffu, e, 16);
        if (c.lane < 16) c.epart[row * c.ld_epart + col / 16] = e;
      }
    }
  } else if (l > 0) {
    typename Op::T* dst = c.deriv(l - 1) + row * c.ld_deriv(l - 1) + col;
    float s[8];
    load8<Op>(dst, s);
#pragma unroll
    for (int q = 0; q < 8; ++q) s[q] *= v[q];
    store8<Op>(dst, s);
  } else {
    update(c, row, col, v);
  }
}

// Two consecutive elements of T in shared memory (4- or 8-byte aligned: columns 2 t of an even-padded row).
template <class Op>
__device__ __forceinline__ float2 load2(const typename Op::T* src) {
  if constexpr (sizeof(typename Op::T) == 2) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src));
  } else {
    return *reinterpret_cast<const float2*>(src);
  }
}

// kOperand: a product reads the pair (Op::operand rounds it), else Op::store keeps it.
template <class Op, bool kOperand>
__device__ __forceinline__ void store2(typename Op::T* dst, float a, float b) {
  if constexpr (sizeof(typename Op::T) == 2) {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
  } else if constexpr (kOperand) {
    *reinterpret_cast<float2*>(dst) = make_float2(Op::operand(a), Op::operand(b));
  } else {
    *reinterpret_cast<float2*>(dst) = make_float2(a, b);
  }
}

// Product g's epilogue on the tensor cores, for every product but the last backward one (the sampler's update:
// update_frag), straight from the accumulators' mma layout: in tile (i, j), lane (g = lane / 4, t = lane % 4)
// holds columns 16 j + 8 h + 2 t + {0, 1} (h = 0, 1) of rows 16 i + g (v[4 h], v[4 h + 1]) and 16 i + g + 8
// (v[4 h + 2], v[4 h + 3]). Each pair is one shared-memory access, and the bias (and output weight) pairs are
// loaded once per pass; a round trip through shared memory to consecutive columns cost as much as the epilogue's
// arithmetic. Rows are the unit's from r0, columns from cb.
template <class Op, int kUR, int kUC, bool kFwd>
__device__ __forceinline__ void epilogue_frag(Ctx<Op>& c, const Gemm& G, const Accum& acc, int r0, int cb) {
  using T = typename Op::T;
  const Params& p = *c.p;
  const int l = G.layer, g = c.lane >> 2, t2 = 2 * (c.lane & 3);
  if constexpr (kFwd) {
    const bool last = l == p.n_hidden - 1;
    float bias[kUC][4], wl[kUC][4];  // per tile column j: the pairs of halves h = 0, 1
#pragma unroll
    for (int j = 0; j < kUC; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = cb + 16 * j + 8 * h + t2;
        const float2 b = __ldg(reinterpret_cast<const float2*>(p.vecs + p.b_off[l] + col));
        const float2 w =
            last ? __ldg(reinterpret_cast<const float2*>(p.vecs + p.wlast_off + col)) : make_float2(0.f, 0.f);
        bias[j][2 * h] = b.x, bias[j][2 * h + 1] = b.y, wl[j][2 * h] = w.x, wl[j][2 * h + 1] = w.y;
      }
    }
#pragma unroll
    for (int i = 0; i < kUR; ++i) {
      const int row = r0 + 16 * i + g;
#pragma unroll
      for (int j = 0; j < kUC; ++j) {
        const float* v = acc.v[i][j];
        const float* b = bias[j];
        // q = 4 h + e: column pair element e % 2 of half h, row + 8 (e / 2)
        const float4 h0 = make_float4(v[0] + b[0], v[1] + b[1], v[2] + b[0], v[3] + b[1]);
        const float4 h1 = make_float4(v[4] + b[2], v[5] + b[3], v[6] + b[2], v[7] + b[3]);
        const Act8 ad = p.activation == kSilu ? silu8<Op::kTensorCores>(h0, h1)
                                              : activate8<Op::kTensorCores>(p.activation, p.slope, h0, h1);
        const int col = cb + 16 * j + t2;
        T* dv = c.deriv(l) + row * c.ld_deriv(l) + col;
        const int ldd = 8 * c.ld_deriv(l);
        if (!last) {
          T* av = c.act(l & 1) + row * c.ld_act + col;
          const int lda = 8 * c.ld_act;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            store2<Op, true>(av + 8 * h, ad.a[4 * h], ad.a[4 * h + 1]);
            store2<Op, true>(av + lda + 8 * h, ad.a[4 * h + 2], ad.a[4 * h + 3]);
            store2<Op, false>(dv + 8 * h, ad.d[4 * h], ad.d[4 * h + 1]);  // phi': the chain rule's, not a product's
            store2<Op, false>(dv + ldd + 8 * h, ad.d[4 * h + 2], ad.d[4 * h + 3]);
          }
        } else {
          const float* w = wl[j];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            store2<Op, true>(dv + 8 * h, ad.d[4 * h] * w[2 * h], ad.d[4 * h + 1] * w[2 * h + 1]);
            store2<Op, true>(dv + ldd + 8 * h, ad.d[4 * h + 2] * w[2 * h], ad.d[4 * h + 3] * w[2 * h + 1]);
          }
          if (c.need_energy) {  // warp-uniform; the four lanes t of a row hold its 16 columns
            float e_top = 0.f, e_bottom = 0.f;  // rows g and g + 8 of this tile
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              e_top += ad.a[4 * h] * w[2 * h] + ad.a[4 * h + 1] * w[2 * h + 1];
              e_bottom += ad.a[4 * h + 2] * w[2 * h] + ad.a[4 * h + 3] * w[2 * h + 1];
            }
#pragma unroll
            for (int m = 1; m < 4; m <<= 1) {
              e_top += __shfl_xor_sync(0xffffffffu, e_top, m);
              e_bottom += __shfl_xor_sync(0xffffffffu, e_bottom, m);
            }
            if (t2 == 0) {
              c.epart[row * c.ld_epart + (cb + 16 * j) / 16] = e_top;
              c.epart[(row + 8) * c.ld_epart + (cb + 16 * j) / 16] = e_bottom;
            }
          }
        }
      }
    }
  } else {  // backward of layer l > 0: deriv[l - 1] *= acc (the chain rule, in place)
    T* base = c.deriv(l - 1) + (r0 + g) * c.ld_deriv(l - 1) + cb + t2;
    const int ld = c.ld_deriv(l - 1);
#pragma unroll
    for (int i = 0; i < kUR; ++i) {
#pragma unroll
      for (int j = 0; j < kUC; ++j) {
#pragma unroll
        for (int q = 0; q < 8; q += 2) {  // q = 4 h + 2 e2: half h, row + 8 e2
          T* dst = base + (16 * i + 8 * ((q >> 1) & 1)) * ld + 16 * j + 8 * (q >> 2);
          if constexpr (sizeof(T) == 2) {
            // bf16: the pair product in bf16x2 (acc rounded to bf16 first; twins.mlp_math rounds the same): one
            // instruction instead of unpacking both operands to float and packing the result
            __nv_bfloat162* d2 = reinterpret_cast<__nv_bfloat162*>(dst);
            *d2 = __hmul2(*d2, __floats2bfloat162_rn(acc.v[i][j][q], acc.v[i][j][q + 1]));
          } else {
            const float2 s = load2<Op>(dst);
            store2<Op, true>(dst, s.x * acc.v[i][j][q], s.y * acc.v[i][j][q + 1]);
          }
        }
      }
    }
  }
}

template <class Op, int kUR, int kUC, bool kFwd>
__device__ void run_gemm(Ctx<Op>& c, const Gemm& G) {
  using T = typename Op::T;
  constexpr int kPad = Ctx<Op>::kPad;
  const Params& p = *c.p;
  const int l = G.layer;
  const T* A;
  int lda;
  if (kFwd) {
    A = l == 0 ? c.xop : c.act((l - 1) & 1);
    lda = l == 0 ? c.ld_xop : c.ld_act;
  } else {
    A = c.deriv(l);
    lda = c.ld_deriv(l);
  }
  const int r0 = (G.ru == 1 ? 0 : c.warp & 1) * kUR * 16;  // G.ru is 1 or 2 (= rt)
  const int c0 = (G.ru == 1 ? c.warp : c.warp >> 1) * kUC * 16;  // the unit's first column within a pass
  const int rr = c.lane & 15, cc = (c.lane >> 4) * 8;
  for (int pass = 0; pass < G.passes; ++pass) {
    const int n0 = pass * G.pw;
    const bool active = n0 + c0 < G.N;  // warp-uniform; units never straddle N (widths are multiples of 32)
    Accum acc;
#pragma unroll
    for (int i = 0; i < kUR; ++i) {
#pragma unroll
      for (int j = 0; j < kUC; ++j) {
#pragma unroll
        for (int q = 0; q < 8; ++q) acc.v[i][j][q] = 0.f;
      }
    }
    if (p.resident) {
      const int ldw = p.dims[l] + kPad;
      const T* B = kFwd ? c.w_res(l) + n0 * ldw : c.w_res(l) + n0;
      if (active) mma_range<Op, kUR, kUC, kFwd>(acc, A, lda, r0, 0, B, ldw, c0, G.K, c.lane);
    } else {
      for (int ch = 0; ch < G.chunks; ++ch) {
        if (c.tid == 0) issue_chunk(c);  // the chunk after this one, into the other stage
        wait_chunk(c, c.consumed);
        const T* B = c.stage + (c.consumed & 1u) * c.stage_elems;  // by n, both directions
        constexpr int ldb = stream_row(sizeof(T));
        if (active) mma_range<Op, kUR, kUC, true>(acc, A, lda, r0, ch * kKChunk, B, ldb, c0, kKChunk, c.lane);
        __syncthreads();  // every warp is done with this stage before the next issue overwrites it
        ++c.consumed;
      }
    }
    if (!active) continue;
    if constexpr (Op::kTensorCores) {
      if (kFwd || l > 0) {
        epilogue_frag<Op, kUR, kUC, kFwd>(c, G, acc, r0, n0 + c0);
      } else {
        update_frag<Op, kUR, kUC>(c, acc, r0, n0 + c0);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kUR; ++i) {
#pragma unroll
        for (int j = 0; j < kUC; ++j) epilogue(c, G, r0 + 16 * i + rr, n0 + c0 + 16 * j + cc, acc.v[i][j]);
      }
    }
  }
}

// Per-row sums by one warp per row, in a fixed order (reproducible): sum_{j < n} src[row * ld + j] * scale
// (squared when kSquare) into row value `which`, plus `offset`.
template <class Op, bool kSquare>
__device__ void row_sums(Ctx<Op>& c, const float* src, int ld, int n, float scale, float offset, int which) {
  for (int row = c.warp; row < c.p->rows; row += kWarps) {
    float s = 0.f;
    for (int j = c.lane; j < n; j += 32) {
      const float v = src[row * ld + j];
      s += kSquare ? v * v : v;
    }
    s = warp_sum(s);
    if (c.lane == 0) c.row_value(which)[row] = s * scale + offset;
  }
}

// ------------------------------------------------------------------------------------------ warpgroup products

// Product g of an evaluation on wgmma (Bf16WgOp, mlp_wgmma.cuh), transposed: out [M features x kN chains] =
// A [M x K] B [K x kN], B the product's input kept as an interleaved [kN x K] operand (the states' copy, the
// activations, D), A = W_l (forward: M = n_{l+1}, K = n_l) or W_l^T through the transpose bit (backward: M = n_l,
// K = n_{l+1}). The 64-row tiles of M alternate between the two warpgroups, a pair at a time: the second tile
// multiplies while the first one's epilogue runs. The input-gradient product (backward of layer 0) has M = d: for
// d <= 64 one tile, so its warpgroups split K instead and write two partial gradients that the update adds.

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Stores a warp's 16 x kN results (bf16 pairs pk[q / 2] = (v[q], v[q + 1]) in accumulator order) transposed into
// the interleaved operand dst [kN x M] at features f0 + [0, 16): each 8 x 8 block of the accumulators is one core
// matrix of the next product's B.
template <int kN>
__device__ __forceinline__ void wg_store_operand(const uint32_t (&pk)[kN / 4], __nv_bfloat16* dst, int M, int f0,
                                                 int lane) {
  const int q = lane >> 3, j = lane & 7;  // lane's matrix q: rows + 8 (q % 2) of n8 tile i0 + q / 2; its chain j
#pragma unroll
  for (int i0 = 0; i0 < kN / 8; i0 += 2) {
    const int n = 8 * (i0 + (q >> 1)) + j, k = f0 + 8 * (q & 1);
    wg::store_transposed_x4(smem_address(dst + wg::core_index(n, k, M)), pk[2 * i0], pk[2 * i0 + 1],
                            pk[2 * i0 + 2], pk[2 * i0 + 3]);
  }
}

// The epilogue of tile `tile` (features 64 tile + 16 (warp % 4) + lane / 4 (+ 8)) of product (fwd, l): the
// mma.sync path's epilogues (epilogue_frag) on the transposed accumulators, with the same roundings.
template <class Op>
__device__ __forceinline__ void wg_epilogue(Ctx<Op>& c, bool fwd, int l, int tile, int part,
                                            const float (&v)[Op::kWgRows / 2]) {
  constexpr int kN = Op::kWgRows, kPacks = kN / 4, kVecs = kN / 16;  // bf16 pairs; uint4 of phi' per thread
  const Params& p = *c.p;
  const int H = p.n_hidden, g = c.lane >> 2, t = c.lane & 3, tw = c.tid & 127;
  const int f0 = 64 * tile + 16 * (c.warp & 3), f = f0 + g;
  uint32_t pk[kPacks];
  if (fwd) {
    const bool last = l == H - 1;
    const float b0 = __ldg(p.vecs + p.b_off[l] + f), b1 = __ldg(p.vecs + p.b_off[l] + f + 8);
    const float w0 = last ? __ldg(p.vecs + p.wlast_off + f) : 0.f;
    const float w1 = last ? __ldg(p.vecs + p.wlast_off + f + 8) : 0.f;
    uint32_t pd[kPacks];
    float e[kN / 4];  // energy partials of the lane's chains 8 i + 2 t + {0, 1}
#pragma unroll
    for (int i0 = 0; i0 < kN / 8; i0 += 2) {  // n8 tiles i0, i0 + 1: 8 values
      const float* u = v + 4 * i0;
      const float4 h0 = make_float4(u[0] + b0, u[1] + b0, u[2] + b1, u[3] + b1);
      const float4 h1 = make_float4(u[4] + b0, u[5] + b0, u[6] + b1, u[7] + b1);
      const Act8 ad = p.activation == kSilu ? silu8<true>(h0, h1) : activate8<true>(p.activation, p.slope, h0, h1);
#pragma unroll
      for (int h = 0; h < 4; ++h) {  // pair h: rows + 8 (h % 2) of n8 tile i0 + h / 2
        const float w = h & 1 ? w1 : w0;
        if (!last) {
          pk[2 * i0 + h] = pack_bf16(ad.a[2 * h], ad.a[2 * h + 1]);
          pd[2 * i0 + h] = pack_bf16(ad.d[2 * h], ad.d[2 * h + 1]);  // phi': the chain rule's, rounded as stored
        } else {
          pk[2 * i0 + h] = pack_bf16(ad.d[2 * h] * w, ad.d[2 * h + 1] * w);
        }
      }
      if (last) {
#pragma unroll
        for (int s = 0; s < 2; ++s) {  // n8 tile i0 + s, chains + {0, 1}
          e[2 * (i0 + s)] = ad.a[4 * s] * w0 + ad.a[4 * s + 2] * w1;
          e[2 * (i0 + s) + 1] = ad.a[4 * s + 1] * w0 + ad.a[4 * s + 3] * w1;
        }
      }
    }
    wg_store_operand<kN>(pk, c.act(l & 1), p.dims[l + 1], f0, c.lane);
    if (!last) {
      uint4* dst = reinterpret_cast<uint4*>(c.deriv(l)) + tile * kVecs * 128 + tw;
#pragma unroll
      for (int h = 0; h < kVecs; ++h) dst[h * 128] = make_uint4(pd[4 * h], pd[4 * h + 1], pd[4 * h + 2], pd[4 * h + 3]);
    } else if (c.need_energy) {  // sum over the warp's 16 features (lanes g), one partial per chain and 16 features
#pragma unroll
      for (int q = 0; q < kN / 4; ++q) {
#pragma unroll
        for (int m = 4; m < 32; m <<= 1) e[q] += __shfl_xor_sync(0xffffffffu, e[q], m);
      }
      if (g == 0) {
#pragma unroll
        for (int q = 0; q < kN / 4; ++q) c.epart[(8 * (q >> 1) + 2 * t + (q & 1)) * c.ld_epart + f0 / 16] = e[q];
      }
    }
  } else if (l > 0) {  // D_{l-1} = acc * phi'(h_l) in bf16 pairs (epilogue_frag's rounding), the next product's B
    const uint4* src = reinterpret_cast<const uint4*>(c.deriv(l - 1)) + tile * kVecs * 128 + tw;
#pragma unroll
    for (int h = 0; h < kVecs; ++h) {
      const uint4 d4 = src[h * 128];
      const uint32_t d[4] = {d4.x, d4.y, d4.z, d4.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const __nv_bfloat162 a = __floats2bfloat162_rn(v[2 * (4 * h + q)], v[2 * (4 * h + q) + 1]);
        const __nv_bfloat162 r = __hmul2(a, *reinterpret_cast<const __nv_bfloat162*>(&d[q]));
        pk[4 * h + q] = *reinterpret_cast<const uint32_t*>(&r);
      }
    }
    wg_store_operand<kN>(pk, c.act((l - 1) & 1), p.dims[l], f0, c.lane);
  } else {  // the input gradient (this warpgroup's part of K), float [chain, feature]
    const int d0 = p.dims[0], ld = d0 + 4;
    float* gr = c.grad + part * kN * ld;
#pragma unroll
    for (int q = 0; q < kN / 2; ++q) {
      const int n = 8 * (q >> 2) + 2 * t + (q & 1), fq = f + 8 * ((q >> 1) & 1);
      if (fq < d0) gr[n * ld + fq] = v[q];
    }
  }
}

// One committed group of kSteps k16 products into acc, straight-line from its fence to its commit (a loop or
// branch among a group's products made ptxas serialize every product of the evaluation, C7520). The A and B
// descriptors advance by a_inc and 16 (256 bytes: two core matrices of K) per step; kFirst: the first product
// writes acc without reading it (no zeroed copy of it reaches the products).
template <int kN, int kTransA, int kSteps, bool kFirst>
__device__ __forceinline__ void wg_group(float (&acc)[kN / 2], uint64_t& a, uint32_t a_inc, uint64_t& b) {
  wg::fence();
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    if (kFirst && s == 0) {
      wg::mma_async<kN, kTransA, false>(acc, a, b);
    } else {
      wg::mma_async<kN, kTransA, true>(acc, a, b);
    }
    wg::advance(a, a_inc);
    wg::advance(b, 16);
  }
  wg::commit();
}

// A tile's ksteps (<= 64) products as committed groups: 1, then 8 at a time, then 4, 2, 1 by the bits of the rest
// (longer unrolled groups cost registers: one of 32 steps took all 255 and spilled).
template <int kN, int kTransA>
__device__ __forceinline__ void wg_issue(float (&acc)[kN / 2], uint64_t a, uint32_t a_inc, uint64_t b, int ksteps) {
  wg_group<kN, kTransA, 1, true>(acc, a, a_inc, b);
  const int rest = ksteps - 1;
#pragma unroll 1
  for (int i = 0; i < (rest >> 3); ++i) wg_group<kN, kTransA, 8, false>(acc, a, a_inc, b);
  if (rest & 4) wg_group<kN, kTransA, 4, false>(acc, a, a_inc, b);
  if (rest & 2) wg_group<kN, kTransA, 2, false>(acc, a, a_inc, b);
  if (rest & 1) wg_group<kN, kTransA, 1, false>(acc, a, a_inc, b);
}

template <class Op>
__device__ __forceinline__ void wg_product(Ctx<Op>& c, int g) {
  constexpr int kN = Op::kWgRows;
  const Params& p = *c.p;
  const WgProduct& P = p.wg[g];  // the product's geometry and descriptors, planned on the host (wg_plan)
  const bool fwd = g < p.n_hidden;
  const int l = fwd ? g : 2 * p.n_hidden - 1 - g;
  // the warpgroup, broadcast so that the compiler sees a warp-uniform value
  const int wgi = __shfl_sync(0xffffffffu, c.warp >> 2, 0);
  const uint64_t a0 = P.a[wgi] + c.smem16, b = P.b[wgi] + c.smem16;
  // Warpgroup w takes tiles w, w + 2, ...; the control flow around the products is the same in both warpgroups
  // (block-uniform values only): with an odd tile count the second warpgroup repeats the last tile and skips its
  // epilogue.
  for (int j = 0; j < P.mine; j += 2) {
    const int ta = P.split ? 0 : min(2 * j + wgi, P.tiles - 1), tb = min(2 * j + 2 + wgi, P.tiles - 1);
    const bool own_a = P.split || 2 * j + wgi < P.tiles, own_b = 2 * j + 2 + wgi < P.tiles;
    const bool pair = j + 1 < P.mine;
    float acc_a[kN / 2], acc_b[kN / 2];
    // Tile a's products, then (a pair) tile b's, in flight during a's epilogue. a is waited for before b is
    // issued: a wait that left b's groups pending (a count known only at run time) made ptxas serialize the
    // products, and issuing b as one group ahead of a's wait ran slower (0.76 against 0.74 ms).
    if (fwd) {
      wg_issue<kN, 0>(acc_a, a0 + ta * P.a_tile, P.a_inc, b, P.ksteps);
    } else {
      wg_issue<kN, 1>(acc_a, a0 + ta * P.a_tile, P.a_inc, b, P.ksteps);
    }
    wg::wait<0>();
    wg::pin(acc_a);
    if (pair) {
      if (fwd) {
        wg_issue<kN, 0>(acc_b, a0 + tb * P.a_tile, P.a_inc, b, P.ksteps);
      } else {
        wg_issue<kN, 1>(acc_b, a0 + tb * P.a_tile, P.a_inc, b, P.ksteps);
      }
    }
    if (own_a) wg_epilogue(c, fwd, l, ta, P.split ? wgi : 0, acc_a);
    if (pair) {
      wg::wait<0>();
      wg::pin(acc_b);
      if (own_b) wg_epilogue(c, fwd, l, tb, 0, acc_b);
    }
  }
}

// The sampler's update from the input gradient: one Philox group (4 consecutive features of a chain) per thread
// and pass, the two warpgroups' partial sums added where the input-gradient product split K.
template <class Op>
__device__ __forceinline__ void wg_update(Ctx<Op>& c) {
  constexpr int kN = Op::kWgRows;
  const Params& p = *c.p;
  const int d0 = p.dims[0], ld = d0 + 4;
  const bool split = p.wg[2 * p.n_hidden - 1].split;
  for (int it = c.tid; it < kN * (d0 >> 2); it += kThreads) {
    const int row = it % kN, col = (it / kN) * 4;
    if (row >= c.nvalid || col >= p.d) continue;
    const float* src = c.grad + row * ld + col;
    float4 g = *reinterpret_cast<const float4*>(src);
    if (split) {
      const float4 h = *reinterpret_cast<const float4*>(src + kN * ld);
      g = make_float4(g.x + h.x, g.y + h.y, g.z + h.z, g.w + h.w);
    }
    const float4 eps =
        p.mode == kLangevin ? noise4(c, (c.row0 + row) * p.d + col, p.d - col) : make_float4(0.f, 0.f, 0.f, 0.f);
    update_pair(c, row, col, g.x, g.y, eps.x, eps.y);
    update_pair(c, row, col + 2, g.z, g.w, eps.z, eps.w);
  }
}

// Energy (when `energy`) and gradient of the block's rows; full = false: the forward products only.
// Ends after a __syncthreads; row value kRowE holds the energies. Called from one site (the kernel's step loop).
// On warpgroup products (Op::kWgmma) the update runs after the last product (wg_update), not in its epilogue.
template <class Op>
__device__ __forceinline__ void evaluate(Ctx<Op>& c, bool full, bool energy) {
  const Params& p = *c.p;
  const int H = p.n_hidden;
  c.need_energy = energy;
  for (int g = 0; g < (full ? 2 * H : H); ++g) {
    if constexpr (Op::kWgmma) {
      wg_product(c, g);
      wg::fence_shared_for_async();  // the epilogue's operands, for the next product's reads
    } else {
      const Gemm G = gemm_info(p, g, c.rt);
      if (G.ur == 2) {
        if (G.fwd) run_gemm<Op, 2, 2, true>(c, G); else run_gemm<Op, 2, 2, false>(c, G);
      } else if (G.uc == 2) {
        if (G.fwd) run_gemm<Op, 1, 2, true>(c, G); else run_gemm<Op, 1, 2, false>(c, G);
      } else {
        if (G.fwd) run_gemm<Op, 1, 1, true>(c, G); else run_gemm<Op, 1, 1, false>(c, G);
      }
    }
    __syncthreads();
    if (energy && g == H - 1) {
      row_sums<Op, false>(c, c.epart, c.ld_epart, p.dims[H] / 16, 1.f, p.vecs[p.blast_off], kRowE);
      __syncthreads();
    }
  }
  if constexpr (Op::kWgmma) {
    if (full) {
      wg_update(c);
      wg::fence_shared_for_async();  // the states' operand copy, for the next evaluation's first product
      __syncthreads();
    }
  }
}

template <class Op>
__global__ void __launch_bounds__(kThreads, 1)
mlp_chain_kernel(const __grid_constant__ Params p, const __grid_constant__ PhiloxState philox) {
  using T = typename Op::T;
  constexpr int kPad = Ctx<Op>::kPad;
  extern __shared__ __align__(128) char smem[];
  Ctx<Op> c;
  c.p = &p;
  c.smem = smem;
  c.tid = threadIdx.x;
  c.warp = threadIdx.x / 32;
  c.lane = threadIdx.x % 32;
  c.rt = p.rows / 16;
  c.row0 = static_cast<int64_t>(blockIdx.x) * p.rows;
  c.nvalid = static_cast<int>(p.batch - c.row0 < p.rows ? p.batch - c.row0 : p.rows);
  c.key = p.use_philox ? unpack_key(philox) : PhiloxKey{};
  const int d = p.d, d0 = p.dims[0], H = p.n_hidden;
  c.ld_xs = d0 + 4;
  c.xs = reinterpret_cast<float*>(smem + p.smem[kSlotXs]);
  c.pm = reinterpret_cast<float*>(smem + p.smem[kSlotP]);
  if constexpr (Op::kTensorCores) {
    c.xop = reinterpret_cast<T*>(smem + p.smem[kSlotXb]);
    c.ld_xop = Op::kWgmma ? d0 : d0 + kPad;  // wgmma: interleaved, unpadded (xop_at)
  } else {
    c.xop = c.xs;
    c.ld_xop = c.ld_xs;
  }
  int widest = 0;  // activations are kept for hidden layers 0..H-2
  for (int l = 0; l + 1 < H; ++l) widest = max(widest, p.dims[l + 1]);
  c.ld_act = widest + kPad;
  c.epart = reinterpret_cast<float*>(smem + p.smem[kSlotEpart]);
  c.ld_epart = p.dims[H] / 16;
  c.rowv = reinterpret_cast<float*>(smem + p.smem[kSlotRows]);
  c.stage = reinterpret_cast<T*>(smem + p.smem[kSlotStage]);
  c.grad = reinterpret_cast<float*>(smem + p.smem[kSlotStage]);
  c.smem16 = smem_address(smem) >> 4;
  c.stage_elems = kWidePass * stream_row(sizeof(T));
  c.bars = smem_address(c.stage + 2 * c.stage_elems);
  c.s_g = c.s_pass = c.s_chunk = 0;
  c.issued = c.consumed = 0;
  c.need_energy = c.keep = c.drift = false;
  c.t = c.slot = 0;
  c.kick = 0.f;

  // Zero the states (padding rows and columns must be finite zeros: they enter the first product) and
  // the per-row scalars; copy resident weights; start the weight stream.
  for (int i = c.tid; i < p.rows * c.ld_xs; i += kThreads) {
    c.xs[i] = 0.f;
    if (p.mode == kHmc) c.pm[i] = 0.f;
  }
  if constexpr (Op::kTensorCores) {
    for (int i = c.tid; i < p.rows * c.ld_xop; i += kThreads) c.xop[i] = Op::operand(0.f);
  }
  for (int i = c.tid; i < kRowValues * p.rows; i += kThreads) c.rowv[i] = 0.f;
  if (p.resident) {
    constexpr int kSeg = Ctx<Op>::kSeg;
    for (int l = 0; l < H; ++l) {
      const int in = p.dims[l], segs_row = in / kSeg;
      const T* src = static_cast<const T*>(p.weights) + p.w_off[l];
      T* dst = c.w_res(l);
      for (int s = c.tid; s < p.dims[l + 1] * segs_row; s += kThreads) {
        const int r = s / segs_row, q = s % segs_row;
        const int at = Op::kWgmma ? wg::core_index(r, q * kSeg, in) : r * (in + kPad) + q * kSeg;
        *reinterpret_cast<uint4*>(dst + at) =
            __ldg(reinterpret_cast<const uint4*>(src + static_cast<int64_t>(r) * in + q * kSeg));
      }
    }
  } else if (c.tid == 0) {
    stage_barrier_init(c.bars);
    stage_barrier_init(c.bars + 8);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // the init before the copies' completion
    issue_chunk(c);
  }
  __syncthreads();  // the row scalars are zero before the restart flags are set
  const bool restart = p.mode == kLangevin && p.restart_fraction > 0.f;
  if (restart && c.tid < c.nvalid) {
    const float u = uniform_open0(philox_bits(c.key, p.n_steps, c.row0 + c.tid).x);
    c.row_value(kRowRestart)[c.tid] = u < p.restart_fraction ? 1.f : 0.f;
  }
  __syncthreads();
  for (int i = c.tid; i < c.nvalid * d; i += kThreads) {
    const int row = i / d, col = i % d;
    const int64_t flat = c.row0 * d + i;
    float v = p.x_start[flat];
    if (restart && c.row_value(kRowRestart)[row] != 0.f) {
      v = p.restart_uniform
              ? p.restart_lo + (p.restart_hi - p.restart_lo) * uniform_at(c.key, p.n_steps + 1, flat)
              : normal_at(c.key, p.n_steps + 1, flat);
    }
    c.xs[row * c.ld_xs + col] = v;
    if constexpr (Op::kTensorCores) c.xop[c.xop_at(row, col)] = Op::operand(v);
  }
  if constexpr (Op::kWgmma) wg::fence_shared_for_async();  // the weights and the states, for the first product
  __syncthreads();

  // Eval: one evaluation. Langevin: steps t < n_steps (with the energy where the trace records it: the state after
  // t steps, slot t / thin - 1), then the final state's energy where recorded. HMC: trajectory t's evaluations
  // i = 0..n_leapfrog (half kick, drifts and kicks, half kick), then its acceptance. One call site of evaluate for
  // every mode, so that it is inlined once (a site per mode doubled the kernel's code and its compile time) and c
  // stays in registers (a call taking c by reference put it in local memory).
  const bool eval = p.mode == kEval, hmc = p.mode == kHmc;
  const float* e_row = c.row_value(kRowE);
  int finite_trajectories = p.n_steps;  // HMC, thread `row` < nvalid's: its row's trajectories before a divergent one
  for (int t = 0, i = 0;;) {
    bool full, record;
    if (hmc) {
      if (t == p.n_steps) break;
      if (i == 0) {  // the trajectory's momenta
        for (int j = c.tid; j < c.nvalid * d; j += kThreads) {
          const int64_t flat = c.row0 * d + j;
          c.pm[(j / d) * c.ld_xs + j % d] = p.noise ? p.noise[static_cast<int64_t>(t) * p.batch * d + flat]
                                                    : normal_at(c.key, 2 * static_cast<uint64_t>(t), flat);
        }
        __syncthreads();
        row_sums<Op, true>(c, c.pm, c.ld_xs, d, 0.5f, 0.f, kRowK0);
        __syncthreads();  // without it ptxas serialized the warpgroup products (C7518)
      }
      c.kick = i == 0 || i == p.n_leapfrog ? 0.5f * p.step : p.step;
      c.drift = i < p.n_leapfrog;
      full = true;
      record = i == 0 || i == p.n_leapfrog;
    } else {
      record = eval || (p.energy && t > 0 && t % p.thin == 0);
      full = eval || t < p.n_steps;
      if (!full && !record) break;
      c.t = t;
      c.keep = !eval && p.traj && (t + 1) % p.thin == 0;
      c.slot = c.keep ? (t + 1) / p.thin - 1 : 0;  // an integer division per step only where a trace is kept
    }
    evaluate(c, full, record);
    if (!hmc) {
      if (record && c.tid < c.nvalid) {
        const float e = e_row[c.tid];
        if (eval) {
          p.energy[c.row0 + c.tid] = e;
        } else {
          p.energy[(c.row0 + c.tid) * p.kept + t / p.thin - 1] = e;
        }
      }
      if (eval || t == p.n_steps) break;
      ++t;
      continue;
    }
    if (i == 0 && c.tid < p.rows) c.row_value(kRowE0)[c.tid] = e_row[c.tid];
    if (i < p.n_leapfrog) {
      ++i;
      continue;
    }
    // the end of trajectory t: accept or restore its start
    row_sums<Op, true>(c, c.pm, c.ld_xs, d, 0.5f, 0.f, kRowK1);
    __syncthreads();
    const bool keep = (t + 1) % p.thin == 0;
    const int slot = (t + 1) / p.thin - 1;
    if (c.tid < c.nvalid) {
      const int row = c.tid;
      const int64_t r = c.row0 + row;
      const float u = p.uniform ? p.uniform[static_cast<int64_t>(t) * p.batch + r]
                                : uniform_open0(philox_bits(c.key, 2 * static_cast<uint64_t>(t) + 1, r).x);
      const float h0 = c.row_value(kRowE0)[row] + c.row_value(kRowK0)[row];
      const float h1 = e_row[row] + c.row_value(kRowK1)[row];
      const bool accept = logf(u) < h0 - h1;  // false for a NaN or infinite h1: a diverged proposal
      if (finite_trajectories == p.n_steps && !isfinite(h1)) finite_trajectories = t;
      c.row_value(kRowAccept)[row] = accept ? 1.f : 0.f;
      c.row_value(kRowCount)[row] += accept ? 1.f : 0.f;
      if (p.accepted) p.accepted[r * p.n_steps + t] = accept;
      if (p.energy && keep) p.energy[r * p.kept + slot] = accept ? e_row[row] : c.row_value(kRowE0)[row];
    }
    __syncthreads();
    for (int j = c.tid; j < c.nvalid * d; j += kThreads) {
      const int row = j / d, col = j % d;
      const int64_t flat = c.row0 * d + j;
      float* xv = c.xs + row * c.ld_xs + col;
      if (c.row_value(kRowAccept)[row] != 0.f) {
        p.x[flat] = *xv;
      } else {
        *xv = p.x[flat];
        if constexpr (Op::kTensorCores) c.xop[c.xop_at(row, col)] = Op::operand(*xv);
      }
      if (p.traj && keep) p.traj[((c.row0 + row) * p.kept + slot) * d + col] = *xv;
    }
    if constexpr (Op::kWgmma) wg::fence_shared_for_async();
    __syncthreads();
    i = 0;
    ++t;
  }
  if (hmc) {
    if (c.tid < c.nvalid) {
      p.accept_count[c.row0 + c.tid] = static_cast<int64_t>(c.row_value(kRowCount)[c.tid]);
      p.finite_steps[c.row0 + c.tid] = finite_trajectories;
    }
  } else if (!eval) {
    for (int i = c.tid; i < c.nvalid * d; i += kThreads) p.x[c.row0 * d + i] = c.xs[(i / d) * c.ld_xs + i % d];
  }
  // the schedule's last prefetch (chunk `consumed`) lands before the block's shared memory goes
  if (!p.resident && c.tid == 0) wait_chunk(c, c.consumed);
}

template <int kPrecision, class Op>
cudaError_t launch_op(const Params& p, const PhiloxState& philox, cudaStream_t stream) {
  static int opted_in[kCachedDevices] = {};
  opt_in_smem(opted_in, mlp_chain_kernel<Op>, smem_optin_bytes());
  const unsigned grid = static_cast<unsigned>((p.batch + p.rows - 1) / p.rows);
  mlp_chain_kernel<Op><<<grid, kThreads, static_cast<size_t>(p.smem[kSlotEnd]), stream>>>(p, philox);
  return cudaGetLastError();
}

}  // namespace mlp
}  // namespace torchkern
