// eigh(A, Q0=None, solver="auto", tol=None) -> (eigenvalues ascending, eigenvectors as columns) of the symmetric part
// of A, the CUDA entry point: it checks the arguments, asks the router (eigh_route.h) which solver takes the call and
// hands that solver the batch as (B, n, n) (eigh_solvers.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "eigh_route.h"
#include "eigh_solvers.h"
#include "torchkern/checks.h"

#if !defined(TORCHKERN_EIGH_TOL_F32) || !defined(TORCHKERN_EIGH_TOL_F64)
#error "build through torchkern's loader: it defines the TORCHKERN_EIGH_* constants (linalg/constants.py)"
#endif

namespace torchkern {
namespace eigh {
namespace {

std::tuple<at::Tensor, at::Tensor> eigh_cuda(const at::Tensor& A, const c10::optional<at::Tensor>& warm_start,
                                             c10::string_view solver_choice, c10::optional<double> tol_choice) {
  TORCHKERN_OP("eigh");
  const bool jacobi_only = solver_choice == "jacobi", tridiagonal_only = solver_choice == "tridiagonal";
  const bool cusolver_only = solver_choice == "cusolver";
  TORCHKERN_CHECK(jacobi_only || tridiagonal_only || cusolver_only || solver_choice == "auto",
                  "solver must be 'auto', 'jacobi', 'tridiagonal' or 'cusolver', got '", std::string(solver_choice),
                  "'");
  TORCHKERN_CHECK_FLOAT(A);
  TORCHKERN_CHECK(!tridiagonal_only || A.scalar_type() != at::kDouble,
                  "solver='tridiagonal' computes in float32 (float32, float16 and bfloat16 input); float64 A takes "
                  "'auto' or 'jacobi'");
  const double min_tol = A.scalar_type() == at::kDouble ? TORCHKERN_EIGH_TOL_F64 : TORCHKERN_EIGH_TOL_F32;
  TORCHKERN_CHECK(!tol_choice.has_value() || (*tol_choice >= min_tol && *tol_choice < 1.0),
                  "tol must be None or a number in [", min_tol, ", 1) for ", A.scalar_type(), " input, got ",
                  tol_choice.value_or(0.0));
  TORCHKERN_CHECK(A.dim() >= 2 && A.size(-1) == A.size(-2), "A must have shape [..., n, n] (square matrices), got ",
                  A.sizes());
  if (warm_start.has_value()) {
    const at::Tensor& Q0 = *warm_start;  // the messages name the argument as the caller knows it
    TORCHKERN_CHECK_SAME_SHAPE(A, Q0);
    TORCHKERN_CHECK_SAME_DTYPE(A, Q0);
    TORCHKERN_CHECK_SAME_DEVICE(A, Q0);
  }
  TORCHKERN_CHECK_CUDA(A);
  const at::cuda::OptionalCUDAGuard guard(A.device());
  const int64_t n = A.size(-1);
  const std::vector<int64_t> w_shape(A.sizes().begin(), A.sizes().end() - 1);
  if (A.numel() == 0) return {at::empty(w_shape, A.options()), at::empty(A.sizes(), A.options())};
  const int64_t B = A.numel() / (n * n);
  const bool f64 = A.scalar_type() == at::kDouble;
  const Call call{B, n, f64, warm_start.has_value(), tol_choice.value_or(min_tol)};
  const Device device{[&] { return in_block_fits(n, f64); }, [&] { return tridiagonal_fits(n); },
                      [] { return syev_batched_available(); }};
  TORCHKERN_CHECK(!cusolver_only || syev_batched_available(),
                  "solver='cusolver' needs cusolverDnXsyevBatched (cuSOLVER >= 11.7.1, CUDA 12.6.2), which the "
                  "cuSOLVER torch loaded lacks");
  const Choice choice = jacobi_only        ? Choice::kJacobi
                        : tridiagonal_only ? Choice::kTridiagonal
                        : cusolver_only    ? Choice::kCusolver
                                           : Choice::kAuto;
  const at::Tensor X = A.reshape({B, n, n}).contiguous();
  const at::Tensor Q = warm_start.has_value() ? warm_start->reshape({B, n, n}).contiguous() : at::Tensor();
  Result result;
  switch (route(choice, call, device)) {
    case Solver::kInBlock: result = solve_in_block(X, Q, call.tol); break;
    case Solver::kBlockMethod: result = solve_block_method(X, Q, call.tol); break;
    case Solver::kSyevBatched: result = solve_syev_batched(X, Q); break;
    case Solver::kTridiagonal: result = solve_tridiagonal(X, Q); break;
    case Solver::kTorch: result = solve_torch(X, Q); break;
  }
  const auto& [w, V] = result;
  return {w.reshape(w_shape), V.reshape(A.sizes())};
}

}  // namespace
}  // namespace eigh
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) { m.impl("eigh", &torchkern::eigh::eigh_cuda); }
