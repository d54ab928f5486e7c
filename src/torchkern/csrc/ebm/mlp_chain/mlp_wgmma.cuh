// Hopper's warpgroup products (wgmma, sm_90a) for the bf16 MLP chain (mlp_chain_kernel.cuh, Bf16WgOp): the
// shared-memory descriptors, the asynchronous multiply-accumulate and its fences, and the transposed 8 x 8 store
// that writes an epilogue's results as the next product's operand.
//
// Operands live in shared memory "interleaved" (no swizzle): an operand of R rows and K columns (K contiguous) is
// stored as 8 x 8 core matrices of 128 contiguous bytes, element (r, k) at core_index(r, k, K). A product reads
// it K-major (rows = M or N) or, through the transpose bit, MN-major (rows = K): one copy of W_l serves the
// forward product (A = W_l) and the backward one (A = W_l^T). PTX ISA, "Asynchronous Warpgroup Level Matrix
// Shared Memory Layout": without swizzling, LBO is the byte distance between core matrices adjacent in K and SBO
// between those adjacent in M or N, for both major orders.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TORCHKERN_WGMMA 1  // this device pass has wgmma (sm_90a); elsewhere its functions trap, never called
#else
#define TORCHKERN_WGMMA 0
#endif

namespace torchkern {
namespace mlp {
namespace wg {

// Element (r, k) of an interleaved operand with K columns (K a multiple of 8).
__host__ __device__ __forceinline__ int core_index(int r, int k, int K) {
  return ((r >> 3) * (K >> 3) + (k >> 3)) * 64 + (r & 7) * 8 + (k & 7);
}

// The 64-bit matrix descriptor (no swizzle, base offset 0): address, LBO and SBO in 16-byte units, 14 bits each.
// Adding (bytes >> 4) to a descriptor moves its start (addresses stay below 2^18: no carry out of the field).
__host__ __device__ __forceinline__ uint64_t descriptor(unsigned addr, unsigned lbo, unsigned sbo) {
  return static_cast<uint64_t>((addr >> 4) & 0x3FFFu) | static_cast<uint64_t>((lbo >> 4) & 0x3FFFu) << 16 |
         static_cast<uint64_t>((sbo >> 4) & 0x3FFFu) << 32;
}

// d (64 x kN, f32) = A (64 x 16, bf16) B (16 x kN, bf16) (+ d when kAccumulate), A K-major or (kTransA) MN-major,
// B K-major; the warpgroup's thread holds d in the mma accumulator layout: warp w rows 16 w + lane / 4 (+ 8), per
// n8 tile i columns 8 i + 2 (lane % 4) (+ 1): d[4 i + {0, 1}] (row), d[4 i + {2, 3}] (row + 8). The first product
// of a sum writes d without reading it, so no register copy of a zeroed accumulator reaches the products (a
// non-wgmma access to an accumulator between them makes ptxas serialize every wgmma).
template <int kN, int kTransA, bool kAccumulate>
__device__ __forceinline__ void mma_async(float (&d)[kN / 2], uint64_t a, uint64_t b) {
#if TORCHKERN_WGMMA
  static_assert(kN == 32, "32 chains per block (m64n32k16)");
  if constexpr (kAccumulate) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15}, %16, %17, 1, 1, 1, %18, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b), "n"(kTransA));
  } else {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15}, %16, %17, 0, 1, 1, %18, 0;\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]),
          "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15])
        : "l"(a), "l"(b), "n"(kTransA));
  }
#else
  __trap();
#endif
}

// desc's start address += inc (16-byte units), kept in sequence with the products (volatile: computed ahead, an
// unrolled run's descriptors took a register pair each). The add touches the low word only (one integer add, not
// two with a carry): the address field never carries out (shared addresses stay below 2^18 bytes).
__device__ __forceinline__ void advance(uint64_t& desc, uint32_t inc) {
  asm volatile("{\n.reg .b32 lo, hi;\nmov.b64 {lo, hi}, %0;\nadd.u32 lo, lo, %1;\nmov.b64 %0, {lo, hi};\n}"
               : "+l"(desc) : "r"(inc));
}

// Orders the warpgroup's earlier register and shared-memory accesses before its next mma_async.
__device__ __forceinline__ void fence() {
#if TORCHKERN_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void commit() {
#if TORCHKERN_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

// Until at most kPending of this warpgroup's committed groups are still running.
template <int kPending>
__device__ __forceinline__ void wait() {
#if TORCHKERN_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
#endif
}

// Keeps the compiler from moving accesses to an accumulator across the asynchronous product's issue and wait.
template <int kN>
__device__ __forceinline__ void pin(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Generic-proxy shared-memory writes (epilogues, the state update, the weight copy) made visible to the async
// proxy that mma_async reads through; each writing thread runs it before the barrier that precedes the product.
__device__ __forceinline__ void fence_shared_for_async() {
#if TORCHKERN_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// Four 8 x 8 b16 matrices, each held in the mma fragment layout (lane: row lane / 4, columns 2 (lane % 4) + {0, 1}
// in r[q]), stored transposed: lane l gives the address of memory row l % 8 of matrix l / 8, which receives the
// matrix's column l % 8.
__device__ __forceinline__ void store_transposed_x4(unsigned addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                                    uint32_t r3) {
#if TORCHKERN_WGMMA
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
#else
  __trap();
#endif
}

}  // namespace wg
}  // namespace mlp
}  // namespace torchkern
