// Which solver takes an eigh call. Plain C++ (no CUDA, no torch): the thresholds are linalg/constants.py's, handed
// over as -D flags, and the device's facts come in a struct, so that the tests compile this header on a CPU with
// those facts mocked (tests/linalg/test_eigh_route.py). linalg/constants.py has the measurements behind each rule.
#pragma once

#include <cstdint>
#include <functional>

#if !defined(TORCHKERN_EIGH_TRIDIAGONAL_MIN_N) || !defined(TORCHKERN_EIGH_TORCH_F32_N0)
#error "build through torchkern's loader: it defines the TORCHKERN_EIGH_* constants (linalg/constants.py)"
#endif

namespace torchkern {
namespace eigh {

enum class Solver {
  kInBlock,      // cyclic Jacobi, a matrix per thread block (jacobi.cuh)
  kBlockMethod,  // block Jacobi in float64 (eigh_block_method.cu)
  kSyevBatched,  // cuSOLVER's batched solver (eigh_syev_batched_host.h)
  kTridiagonal,  // Householder reduction and inverse iteration, float32 (eigh_tridiagonal.cu)
  kTorch,        // torch.linalg.eigh: syevd, one matrix after another (eigh_torch_host.h)
};

// What the caller asked for: the op's `solver` argument.
enum class Choice { kAuto, kJacobi, kTridiagonal, kCusolver };

struct Call {
  int64_t batch, n;
  bool f64;    // float64 input (else float32, float16 or bfloat16: computed in float32)
  bool warm;   // a Q0 was given
  double tol;  // the Jacobi kernels' stopping tolerance
};

// What this device and the loaded libraries offer for the call's n and compute type, asked only where a rule needs
// it (the first question about cuSOLVER loads it).
struct Device {
  std::function<bool()> in_block_fits;     // the in-block kernel's shared memory holds the matrix
  std::function<bool()> tridiagonal_fits;  // the tridiagonal reduction's shared memory holds it
  std::function<bool()> syev_batched;      // the loaded cuSOLVER has cusolverDnXsyevBatched
};

// A step of the torch.linalg.eigh table (constants.EIGH_TORCH_F32 / _F64): from n = from_n on, cold starts of fewer
// than below_batch matrices.
struct TorchStep {
  int64_t from_n, below_batch;
};

#define TORCHKERN_EIGH_TORCH_STEPS(P)                                                                    \
  {                                                                                                      \
    {P##_N0, P##_B0}, {P##_N1, P##_B1}, {P##_N2, P##_B2}, {P##_N3, P##_B3}, {P##_N4, P##_B4},            \
        {P##_N5, P##_B5}, {P##_N6, P##_B6}, { P##_N7, P##_B7 }                                          \
  }
constexpr TorchStep kTorchF32[] = TORCHKERN_EIGH_TORCH_STEPS(TORCHKERN_EIGH_TORCH_F32);
constexpr TorchStep kTorchF64[] = TORCHKERN_EIGH_TORCH_STEPS(TORCHKERN_EIGH_TORCH_F64);
#undef TORCHKERN_EIGH_TORCH_STEPS

// The batch below which torch.linalg.eigh takes an n x n cold start (0: never): the last step at or below n.
inline int64_t torch_below_batch(int64_t n, bool f64) {
  int64_t below = 0;
  for (const TorchStep& step : f64 ? kTorchF64 : kTorchF32) {
    if (step.from_n <= n) below = step.below_batch;
  }
  return below;
}

inline Solver jacobi_solver(const Device& d) { return d.in_block_fits() ? Solver::kInBlock : Solver::kBlockMethod; }

// solver="auto": the fastest solver for the shape, as measured.
inline Solver route_auto(const Call& c, const Device& d) {
  const int64_t elems = c.batch * c.n * c.n;
  const int64_t syev_max_n = c.f64 ? TORCHKERN_EIGH_SYEV_MAX_N_F64 : TORCHKERN_EIGH_SYEV_MAX_N_F32;
  const bool torch_cold = c.batch < torch_below_batch(c.n, c.f64);
  const bool tridiagonal_cold =
      !c.f64 && c.n >= TORCHKERN_EIGH_TRIDIAGONAL_MIN_N && !torch_cold && d.tridiagonal_fits();
  const auto syev = [&] { return c.n >= TORCHKERN_EIGH_SYEV_MIN_N && d.syev_batched(); };
  if (!c.warm) {
    if (torch_cold) return Solver::kTorch;
    if (tridiagonal_cold) return Solver::kTridiagonal;
    if ((c.n <= syev_max_n || elems >= TORCHKERN_EIGH_SYEV_MIN_ELEMS) && syev()) return Solver::kSyevBatched;
    // the block method's range: few matrices, or sizes where syevd's loop is faster at any batch
    const bool beyond_block = TORCHKERN_EIGH_TORCH_FROM_N > 0 && c.n >= TORCHKERN_EIGH_TORCH_FROM_N &&
                              (c.batch < TORCHKERN_EIGH_BLOCK_MIN_BATCH || c.n > TORCHKERN_EIGH_BLOCK_MAX_N);
    return beyond_block ? Solver::kTorch : jacobi_solver(d);
  }
  // A warm start goes where its cold start goes when a direct solver is faster than the Jacobi warm start (Q0 then
  // unused); the tridiagonal solver's, unless tol lets the Jacobi kernels stop after a sweep or two.
  if (tridiagonal_cold && c.tol < TORCHKERN_EIGH_WARM_JACOBI_MIN_TOL) return Solver::kTridiagonal;
  if (!c.f64 && c.n <= syev_max_n &&
      (elems >= TORCHKERN_EIGH_SYEV_WARM_MIN_ELEMS || (c.n >= TORCHKERN_EIGH_SYEV_WARM_MIN_N && d.in_block_fits())) &&
      syev()) {
    return Solver::kSyevBatched;
  }
  return jacobi_solver(d);
}

inline Solver route(Choice choice, const Call& c, const Device& d) {
  switch (choice) {
    case Choice::kJacobi:
      return jacobi_solver(d);
    case Choice::kTridiagonal:
      return Solver::kTridiagonal;
    case Choice::kCusolver:
      return Solver::kSyevBatched;
    default:
      return route_auto(c, d);
  }
}

}  // namespace eigh
}  // namespace torchkern
