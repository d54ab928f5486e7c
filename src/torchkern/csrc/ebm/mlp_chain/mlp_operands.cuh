// The MLP chain's operand policies (Bf16Op, Tf32Op, Fp32Op): the type a product's operands are kept in, how a
// float is rounded into it, and the tensor-core mma that reads them. Shared by the kernel (mlp_chain_kernel.cuh)
// and the weight packing (mlp_pack.cu), so that packed weights are rounded exactly as the kernel rounds what it
// writes.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace torchkern {
namespace mlp {

// v rounded to TF32 (cvt.rna.tf32.f32: to nearest, ties away from zero), as the float a tf32 mma reads exactly.
__device__ __forceinline__ float round_tf32(float v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return __uint_as_float(r);
}

// T: how operands are kept in shared memory. operand() rounds a float to what a product reads: every buffer a
// product reads holds values rounded once when they are written (the packed weights, the states' operand copy,
// activations, D), so the k loop converts nothing (TF32's cvt.rna was two thirds of its k loop's instructions).
// store() keeps a value that no product reads (phi'(h) before the chain rule turns it into D): bf16 rounds, the
// float policies keep it exact. Tensor-core policies name the mma shape: bf16 m16n8k16, tf32 m16n8k8, FP32
// accumulators; fragments are loaded with ldmatrix (16-byte rows; a tf32 element is two of its b16 halves, so the
// non-transposed loads serve tf32 too).

struct Bf16Op {
  using T = __nv_bfloat16;
  static constexpr bool kTensorCores = true;
  static constexpr bool kWgmma = false;
  static constexpr int kK = 16;
  __device__ static T store(float v) { return __float2bfloat16_rn(v); }
  __device__ static T operand(float v) { return __float2bfloat16_rn(v); }
  __device__ static float load(T v) { return __bfloat162float(v); }
  // d (16 x 8) += a (16 x 16, row-major) b (16 x 8, column-major)
  __device__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

struct Tf32Op {
  using T = float;
  static constexpr bool kTensorCores = true;
  static constexpr bool kWgmma = false;
  static constexpr int kK = 8;
  __device__ static T store(float v) { return v; }
  __device__ static T operand(float v) { return round_tf32(v); }
  __device__ static float load(T v) { return v; }
  __device__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

struct Fp32Op {  // the exact path: FP32 FMAs, each lane owning the elements its epilogue handles
  using T = float;
  static constexpr bool kTensorCores = false;
  static constexpr bool kWgmma = false;
  __device__ static T store(float v) { return v; }
  __device__ static T operand(float v) { return v; }
  __device__ static float load(T v) { return v; }
};

// bf16 operands on Hopper's warpgroup products (mlp_wgmma.cuh): the products transposed, [features x 32 chains]
// = W [features x K] x [K x 32], so the 32 chains of a block are the wgmma's N and the weights its 64-row A; the
// same rounding as Bf16Op. (With 16 chains ptxas serialized the products: that layout keeps mma.sync.)
struct Bf16WgOp : Bf16Op {
  static constexpr bool kWgmma = true;
  static constexpr int kWgRows = 32;
};

}  // namespace mlp
}  // namespace torchkern
