// linalg's host side (docs/design.md, "Kernel sources"): each op's argument checks, device guard, allocation and
// launch (kron), or its hand-over to the host code of its folder (eigh: the router and the solvers; the Newton root:
// the in-block launcher, else the large path), and the family's registration for CUDA tensors.
#include <ATen/ExpandUtils.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "eigh/eigh_route.h"
#include "eigh/eigh_solvers.h"
#include "eigh/launchers.h"
#include "launchers.h"
#include "matrix_inverse_root_newton/launchers.h"
#include "matrix_inverse_root_newton/matrix_inverse_root_newton.h"
// The host code of eigh's solvers and of the Newton root's large path: compiled here, in the family's one host
// translation unit, since torch's headers are most of a host file's compile time.
#include "eigh/eigh_block_method_host.h"
#include "eigh/eigh_in_block_host.h"
#include "eigh/eigh_prep_host.h"
#include "eigh/eigh_syev_batched_host.h"
#include "eigh/eigh_torch_host.h"
#include "eigh/eigh_tridiagonal_host.h"
#include "matrix_inverse_root_newton/matrix_inverse_root_newton_host.h"
#include "torchkern/checks.h"
#include "torchkern/dispatch.h"
#include "torchkern/launch.h"

#if !defined(TORCHKERN_EIGH_TOL_F32) || !defined(TORCHKERN_EIGH_TOL_F64)
#error "build through torchkern's loader: it defines the TORCHKERN_EIGH_* constants (linalg/constants.py)"
#endif

namespace torchkern {
namespace {

at::Tensor kron_cuda(const at::Tensor& A, const at::Tensor& B) {
  TORCHKERN_OP("kron");
  TORCHKERN_CHECK_FLOAT(A);
  TORCHKERN_CHECK_FLOAT(B);
  TORCHKERN_CHECK_SAME_DTYPE(A, B);
  TORCHKERN_CHECK_SAME_DEVICE(A, B);
  TORCHKERN_CHECK(A.dim() >= 2, "A must have shape [..., m, n] (at least 2 dims), got ", A.sizes());
  TORCHKERN_CHECK(B.dim() >= 2, "B must have shape [..., p, q] (at least 2 dims), got ", B.sizes());
  TORCHKERN_CHECK_CUDA(A);
  const at::cuda::OptionalCUDAGuard guard(A.device());
  const auto a_batch = A.sizes().slice(0, A.dim() - 2), b_batch = B.sizes().slice(0, B.dim() - 2);
  const auto batch = at::infer_size(a_batch, b_batch);
  const int64_t m = A.size(-2), n = A.size(-1), p = B.size(-2), q = B.size(-1);
  std::vector<int64_t> out_shape(batch.begin(), batch.end());
  out_shape.push_back(m * p);
  out_shape.push_back(n * q);
  at::Tensor out = at::empty(out_shape, A.options());
  if (out.numel() == 0) return out;
  TORCHKERN_CHECK(m * p < (int64_t(1) << 31) && n * q < (int64_t(1) << 31), "output matrices are too large");
  std::vector<int64_t> a_shape(batch.begin(), batch.end()), b_shape(batch.begin(), batch.end());
  a_shape.insert(a_shape.end(), {m, n});
  b_shape.insert(b_shape.end(), {p, q});
  // the inputs are small next to the output: materialize the broadcast once
  const at::Tensor Ac = A.expand(a_shape).contiguous(), Bc = B.expand(b_shape).contiguous();
  C10_CUDA_CHECK(kron_launch({out.mutable_data_ptr(), Ac.const_data_ptr(), Bc.const_data_ptr(), Ac.numel() / (m * n),
                              static_cast<int>(m), static_cast<int>(n), static_cast<int>(p), static_cast<int>(q),
                              to_dtype(A.scalar_type())},
                             current_stream()));
  return out;
}

}  // namespace

namespace eigh {
namespace {

// eigh(A, Q0=None, solver="auto", tol=None) -> (eigenvalues ascending, eigenvectors as columns) of the symmetric part
// of A: the router (eigh/eigh_route.h) picks the solver, which gets the batch as (B, n, n) (eigh/eigh_solvers.h).
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

namespace {

// matrix_inverse_root_newton(G, p, eps, max_iters, tol, wait) -> (root, error, iterations), of the symmetric part
// (G + G^T) / 2 (docs/design.md, "Inverse roots"): the in-block kernel where it takes the call, else the large path.
std::tuple<at::Tensor, at::Tensor, at::Tensor> matrix_inverse_root_newton_cuda(const at::Tensor& G, int64_t p,
                                                                               double eps, int64_t max_iters,
                                                                               double tol, bool wait) {
  TORCHKERN_OP("matrix_inverse_root");
  TORCHKERN_CHECK_FLOAT(G);
  TORCHKERN_CHECK(G.dim() >= 2 && G.size(-1) == G.size(-2), "G must have shape [..., n, n] (square matrices), got ",
                  G.sizes());
  TORCHKERN_CHECK(p >= 1, "p must be a positive integer, got ", p);
  TORCHKERN_CHECK(max_iters >= 0, "max_iters must be >= 0, got ", max_iters);
  TORCHKERN_CHECK(tol >= 0, "tol must be >= 0, got ", tol);
  // G + eps I must be finite in the compute type (float32 for the half types)
  const bool f64 = G.scalar_type() == at::kDouble;
  const double top = f64 ? std::numeric_limits<double>::max() : std::numeric_limits<float>::max();
  TORCHKERN_CHECK(eps >= 0 && eps <= top, "eps must be a finite number in [0, ", top, "] (the range of ",
                  f64 ? "float64" : "float32", ", the compute dtype), got ", eps);
  TORCHKERN_CHECK_CUDA(G);
  TORCHKERN_CHECK(G.size(-1) < (1 << 20) && max_iters < (1 << 30), "n and max_iters are too large");
  const at::cuda::OptionalCUDAGuard guard(G.device());
  const auto batch_shape = G.sizes().slice(0, G.dim() - 2);
  const at::ScalarType cdt = f64 ? at::kDouble : at::kFloat;
  at::Tensor root = at::empty(G.sizes(), G.options());
  at::Tensor err = at::empty(batch_shape, G.options().dtype(cdt));
  at::Tensor iters = at::empty(batch_shape, G.options().dtype(at::kInt));
  if (G.numel() == 0) {
    err.zero_();
    iters.zero_();
    return {root, err, iters};
  }
  const int n = static_cast<int>(G.size(-1));
  const int64_t batch = G.numel() / (int64_t(n) * n);
  const at::Tensor Gc = G.contiguous();
  bool small = false;
  C10_CUDA_CHECK(newton::small_launch({Gc.const_data_ptr(), root.mutable_data_ptr(), err.mutable_data_ptr(),
                                       iters.mutable_data_ptr<int>(), to_dtype(G.scalar_type()), batch, n,
                                       static_cast<int>(p), eps, static_cast<int>(max_iters), tol},
                                      &small, current_stream()));
  if (!small) {  // the symmetric part, as the small kernels and the twin take it
    const at::Tensor Gs = Gc.to(cdt).view({batch, n, n});
    const at::Tensor sym = at::add(at::mul(Gs, 0.5), at::mul(Gs.transpose(1, 2), 0.5));
    newton::solve_large(sym, root, err, iters, static_cast<int>(p), eps, static_cast<int>(max_iters), tol, wait);
  }
  return {root, err, iters};
}

}  // namespace
}  // namespace torchkern

TORCH_LIBRARY_IMPL(torchkern, CUDA, m) {
  m.impl("kron", &torchkern::kron_cuda);
  m.impl("eigh", &torchkern::eigh::eigh_cuda);
  m.impl("matrix_inverse_root_newton", &torchkern::matrix_inverse_root_newton_cuda);
}
