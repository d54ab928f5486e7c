// The in-block Jacobi eigensolver (jacobi.cuh) for whole float32 matrices, and jacobi_launch (launchers.h), which
// hands float64 ones to eigh_small_f64.cu: one file per compute type so that ninja compiles them in parallel.
#include "jacobi.cuh"
#include "launchers.h"

#if !defined(TORCHKERN_EIGH_MAX_SWEEPS)
#error "build through torchkern's loader: it defines the TORCHKERN_EIGH_* constants (linalg/constants.py)"
#endif

namespace torchkern {
namespace jacobi {

template <>
cudaError_t launch_whole<float>(const Problem<float>& pr, int64_t G, cudaStream_t stream) {
  return launch_whole_impl<float>(pr, G, stream);
}

}  // namespace jacobi

namespace eigh {

cudaError_t jacobi_launch(const JacobiParams& p, cudaStream_t stream) {
  const auto run = [&](auto zero) {
    using TA = decltype(zero);
    jacobi::Problem<TA> pr{};
    pr.A = static_cast<const TA*>(p.A);
    pr.batch_stride = int64_t(p.n) * p.n;
    pr.split = jacobi::split_for(p.batch, p.n);
    pr.ld = p.n;
    pr.n = p.n;
    pr.max_sweeps = TORCHKERN_EIGH_MAX_SWEEPS;
    pr.tol = p.tol;
    pr.w = static_cast<TA*>(p.w);
    pr.V = static_cast<TA*>(p.V);
    return jacobi::launch_whole<TA>(pr, p.batch, stream);
  };
  return p.f64 ? run(0.0) : run(0.0f);
}

}  // namespace eigh
}  // namespace torchkern
