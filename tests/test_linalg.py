"""torchkern.linalg: matrix_inverse_root (eigh and Newton), kron, kron_precondition.

Roots are checked against a float64 eigendecomposition of the same (dtype-rounded) input;
kron and kron_precondition against explicit torch.kron products. On CPU the Newton op is its
twin; on CUDA the same tests exercise the kernels (small in-block kernel for n <= 128, batched
cuBLAS path above), plus kernel-vs-twin comparisons.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from testing import FLOAT_DTYPES, cuda_devices, devices, dtypes, noncontiguous, randn, requires_cuda

import torchkern
from torchkern._library import has_cuda_kernel
from torchkern import linalg
from torchkern.linalg import constants, twins

# ----------------------------------------------------------------------------- helpers

_GEN = torch.Generator().manual_seed(4)


def spd(n: int, cond: float = 10.0, batch: tuple = (), rank: int | None = None) -> torch.Tensor:
    """float64 symmetric PSD matrices with eigenvalues log-spaced in [1/cond, 1] (zeros past ``rank``)."""
    Q, _ = torch.linalg.qr(torch.randn(*batch, n, n, generator=_GEN, dtype=torch.float64))
    lam = torch.logspace(0, -math.log10(cond), n, dtype=torch.float64) if n > 1 else torch.ones(1, dtype=torch.float64)
    if rank is not None:
        lam[rank:] = 0
    G = (Q * lam) @ Q.mT
    return 0.5 * (G + G.mT)


def root_ref(G: torch.Tensor, p: int, eps: float) -> torch.Tensor:
    """float64 eigendecomposition root of (G + eps I), eigenvalues clamped at eps (DESIGN.md)."""
    A = G.double().cpu()
    A = 0.5 * (A + A.mT) + eps * torch.eye(A.shape[-1], dtype=torch.float64)
    lam, Q = torch.linalg.eigh(A)
    return (Q * lam.clamp_min(max(eps, 1e-300)).pow(-1.0 / p).unsqueeze(-2)) @ Q.mT


def rel_err(X: torch.Tensor, R: torch.Tensor) -> float:
    X = X.double().cpu()
    return ((X - R).flatten(-2).norm(dim=-1) / R.flatten(-2).norm(dim=-1)).max().item()


# relative Frobenius error bounds vs float64 eigh, measured with ~5x margin
WELL_TOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
COND_TOL_F32_NEWTON = {1: 5e-2, 2: 2e-2, 4: 6e-3, 8: 2e-3}
RANKDEF_TOL_F32 = 5e-4


def newton_tol(dtype):
    return 1e-12 if dtype == torch.float64 else 1e-6


# ----------------------------------------------------------------------------- roots


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("method", ["newton", "eigh"])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", dtypes())
def test_root_well_conditioned(device, method, p, dtype):
    G = spd(24, cond=10.0, batch=(3,)).to(dtype)
    X, err = linalg.matrix_inverse_root(G.to(device), p, eps=1e-6, method=method, tol=newton_tol(dtype),
                                        return_error=True)
    assert X.dtype == dtype and X.shape == G.shape and X.device == torch.device(device)
    assert err.shape == (3,)
    assert rel_err(X, root_ref(G, p, 1e-6)) <= WELL_TOL[dtype]
    # the error of the returned root: half types show their own rounding, about p eps of the dtype
    bound = 10 * p * torch.finfo(dtype).eps if dtype in (torch.float16, torch.bfloat16) else 1e-4
    assert err.max().item() <= bound


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_root_condition_1e6(device, p, dtype):
    G = spd(48, cond=1e6, batch=(2,))
    R = root_ref(G.to(dtype), p, 0.0)  # the root of the rounded input: rounding alone moves it by ~1e-3 in float32
    Xn = linalg.matrix_inverse_root(G.to(dtype).to(device), p, eps=0.0, method="newton", tol=newton_tol(dtype))
    Xe = linalg.matrix_inverse_root(G.to(dtype).to(device), p, eps=0.0, method="eigh", float64=True)
    bound = 1e-8 if dtype == torch.float64 else COND_TOL_F32_NEWTON[p]
    assert rel_err(Xn, R) <= bound
    assert rel_err(Xe, R) <= (1e-8 if dtype == torch.float64 else 1e-5)  # float64 eigh: only the input rounding


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("method", ["newton", "eigh"])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_root_rank_deficient(device, method, p, dtype):
    G = spd(40, cond=10.0, batch=(2,), rank=20).to(dtype)
    X = linalg.matrix_inverse_root(G.to(device), p, eps=1e-3, method=method, tol=newton_tol(dtype))
    assert torch.isfinite(X).all()
    assert rel_err(X, root_ref(G, p, 1e-3)) <= (1e-9 if dtype == torch.float64 else RANKDEF_TOL_F32)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("n", [8, 64, 128, 160])
def test_root_mixed_batch_each_matrix_stops_on_its_own(device, n):
    # easy (identity-like), hard (cond 1e6), medium, rank-deficient: one batch
    G = torch.stack([torch.eye(n, dtype=torch.float64) * 0.5 + 1e-3 * spd(n, 2.0), spd(n, 1e6), spd(n, 100.0),
                     spd(n, 10.0, rank=n // 2)])
    eps, p = 1e-4, 4
    X, err, iters = torch.ops.torchkern.matrix_inverse_root_newton(G.float().to(device), p, eps, 100, 1e-6)
    iters = iters.cpu()
    assert iters[0] < iters[1], f"the easy matrix should stop before the hard one, iterations {iters.tolist()}"
    assert len(set(iters.tolist())) >= 2
    for i in range(G.shape[0]):  # each one right, whatever its neighbours did
        assert rel_err(X[i], root_ref(G[i], p, eps)) <= 2e-4, i
    # the same matrices one at a time give the same iteration counts: a matrix's result does not depend on its batch
    for i in range(G.shape[0]):
        _, _, it_i = torch.ops.torchkern.matrix_inverse_root_newton(G[i:i + 1].float().to(device), p, eps, 100, 1e-6)
        assert it_i.item() == iters[i].item()


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_newton_scaling_step(p):
    # P = a I + b M sends an eigenvalue m of M to m (a + b m)^p = h(c m); over [low, 1] the images
    # stay in [next_low, 1] with both ends attained, c = -b (p + 1) / a lies in [1, 1 + p / 2], and
    # the bound grows. (The iteration's correctness rests on this; see twins.)
    low = torch.tensor([1e-12, 1e-6, 1e-3, 0.1, 0.5, 0.9, 1 - 1e-9, 1.0], dtype=torch.float64)
    a, b, next_low = twins.newton_scaling(low, p)
    c = -b * (p + 1) / a
    assert ((c >= 1 - 1e-12) & (c <= 1 + p / 2 + 1e-12)).all(), c
    m = low[:, None] + (1 - low[:, None]) * torch.linspace(0, 1, 2001, dtype=torch.float64)
    image = m * (a[:, None] + b[:, None] * m) ** p
    torch.testing.assert_close(image.amin(1), next_low, rtol=1e-9, atol=0)
    torch.testing.assert_close(image.amax(1), torch.ones_like(low), rtol=1e-6, atol=0)
    assert (next_low[low < 1] > low[low < 1]).all()


def plain_newton_steps(G: torch.Tensor, p: int, eps: float, tol: float = 1e-6) -> list[int]:
    """Steps of DESIGN.md's unscaled iteration (c = 1, z = (p + 1) / (2 ||A||_F)) in float32, same stopping rule."""
    A = G.float() + eps * torch.eye(G.shape[-1])
    z = (p + 1) / (2 * torch.linalg.matrix_norm(A))
    M = z[:, None, None] * A
    steps = []
    for Mi in M:
        err, prev, k = twins.inf_norm_residual(Mi).item(), math.inf, 0
        while err > tol and k < 100 and not (prev <= constants.STALL_BELOW and err > constants.STALL_RATIO * prev):
            P = (p + 1) / p * torch.eye(Mi.shape[-1]) - Mi / p
            Mi = torch.linalg.matrix_power(P, p) @ Mi
            prev, err, k = err, twins.inf_norm_residual(Mi).item(), k + 1
        steps.append(k)
    return steps


def test_smallest_ritz_value_brackets_the_bottom():
    # Lanczos (the first scaling's estimate): exact once the steps span the space (n <= LANCZOS_STEPS),
    # above the smallest eigenvalue and below the smallest diagonal entry otherwise
    G = spd(8, 1e3, batch=(3,))
    lam = torch.linalg.eigvalsh(G)[:, 0]
    torch.testing.assert_close(twins.smallest_ritz_value(G), lam, rtol=1e-8, atol=0)
    G = spd(160, 1e3, batch=(3,))
    lam, theta = torch.linalg.eigvalsh(G)[:, 0], twins.smallest_ritz_value(G)
    assert (theta >= lam * (1 - 1e-9)).all() and (theta <= G.diagonal(dim1=-2, dim2=-1).amin(-1)).all()
    # an invariant start (the identity) stops after one step
    torch.testing.assert_close(twins.smallest_ritz_value(2 * torch.eye(50, dtype=torch.float64)[None]),
                               torch.tensor([2.0], dtype=torch.float64))


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("n", [64, 100, 128, 200])
def test_root_newton_lanczos_start_saves_steps(device, n):
    # moderately conditioned matrices, eps far below the spectrum: the bounds eps / u and 1 - err say
    # little, and 10 steps were the rule; the hedged Lanczos estimate starts close to the bottom
    G = torch.stack([spd(n, 10.0), spd(n, 100.0), spd(n, 1e3)])
    X, err, iters = torch.ops.torchkern.matrix_inverse_root_newton(G.float().to(device), 4, 1e-6, 100, 1e-6)
    assert all(i <= most for i, most in zip(iters.tolist(), [6, 7, 8])), iters.tolist()
    assert (err.cpu() <= 1e-6).all()
    assert rel_err(X, root_ref(G.float(), 4, 1e-6)) <= 2e-5


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_root_newton_when_lanczos_misses_the_bottom(device):
    # the bottom eigenvector orthogonal to the Lanczos start vector: the Krylov space never sees
    # it (but for rounding), the estimate lands far above it, and that costs steps, not accuracy
    n = 96
    v0 = twins.lanczos_start(n, torch.float64, "cpu")
    B = torch.randn(n, n, generator=_GEN, dtype=torch.float64)
    B[:, 0] -= v0 * (v0 @ B[:, 0])
    Q, _ = torch.linalg.qr(B)
    lam = torch.logspace(0, -2, n, dtype=torch.float64).flip(0)
    lam[0] = 1e-5  # on Q[:, 0], orthogonal to v0; the rest of the spectrum in [1e-2, 1]
    G = (Q * lam) @ Q.mT
    G = 0.5 * (G + G.mT)
    assert twins.smallest_ritz_value(G[None]).item() > 1e-3
    X, err, iters = torch.ops.torchkern.matrix_inverse_root_newton(G[None].float().to(device), 4, 1e-6, 100, 1e-6)
    assert err.item() <= 1e-6 and iters.item() <= 16, (err.item(), iters.item())
    assert rel_err(X[0], root_ref(G.float(), 4, 1e-6)) <= 3e-4  # float32 at condition 1e5: about 1e-4


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_root_newton_scaled_steps_on_eps_floored_statistics(device):
    # Shampoo-like statistics: rank-deficient, normalized, eps relative to the norm, so the
    # spectrum reaches down to eps: the worst case of the unscaled iteration, which the scaling bounds.
    G = spd(64, 10.0, batch=(3,), rank=16)
    G = G / torch.linalg.matrix_norm(G)[:, None, None]
    X, err, iters = torch.ops.torchkern.matrix_inverse_root_newton(G.float().to(device), 4, 1e-6, 100, 1e-6)
    assert iters.max().item() <= 11, iters.tolist()
    assert min(plain_newton_steps(G, 4, 1e-6)) >= 17
    assert (err.cpu() <= 1e-6).all()
    # float32 resolves the eigenvalues at the 1e-6 floor to about 1%: c = 1 gives 3.4e-3 here, the scaled 3.0e-3
    assert rel_err(X, root_ref(G.float(), 4, 1e-6)) <= 6e-3


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("batch", [(), (3,), (2, 3), (0,)], ids=["none", "B", "B1xB2", "empty"])
@pytest.mark.parametrize("method", ["newton", "eigh", "auto"])
def test_root_batch_shapes(device, batch, method):
    G = spd(6, 10.0, batch=batch).float().to(device)
    X, err = linalg.matrix_inverse_root(G, 2, method=method, return_error=True)
    assert X.shape == G.shape and err.shape == G.shape[:-2] and X.is_contiguous()
    if G.numel():
        assert rel_err(X, root_ref(G, 2, 1e-6)) <= 1e-5


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_root_noncontiguous_and_p_only_positional(device):
    G = spd(12, 10.0, batch=(2,)).float().to(device)
    X = linalg.matrix_inverse_root(noncontiguous(G), 4, method="newton")
    assert rel_err(X, root_ref(G, 4, 1e-6)) <= 1e-5
    X1 = linalg.matrix_inverse_root(G[:, :1, :1].contiguous(), 3)  # n = 1: a scalar root
    torch.testing.assert_close(X1.cpu(), (G[:, :1, :1].cpu() + 1e-6).pow(-1 / 3))


def test_auto_method():
    assert linalg.auto_method(torch.zeros(2, 2)) == "eigh"
    assert linalg.auto_method(torch.zeros(2, 2, dtype=torch.float64)) == "eigh"
    if torch.cuda.is_available():
        assert linalg.auto_method(torch.zeros(2, 2, device="cuda")) == "newton"
        assert linalg.auto_method(torch.zeros(2, 2, device="cuda"), float64=True) == "eigh"


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_root_error_semantics(device):
    G = spd(16, 10.0, batch=(2,)).float().to(device)
    A = G.double().cpu() + 1e-6 * torch.eye(16, dtype=torch.float64)
    for method in ("newton", "eigh"):  # both report ||X^p (G + eps I) - I||_inf of the root they return
        X, err = linalg.matrix_inverse_root(G, 4, method=method, return_error=True)
        direct = twins.inf_norm_residual(torch.linalg.matrix_power(X.double().cpu(), 4) @ A)
        torch.testing.assert_close(err.cpu().double(), direct, rtol=1e-6, atol=1e-12)
        assert err.dtype == torch.float32 and (direct <= 1e-4).all()
    # the op, max_iters=0: M0 = A / u with u = min(||A||_F, ||A||_inf), error ||M0 - I||_inf, root u^(-1/p) I
    X0, e0, _ = torch.ops.torchkern.matrix_inverse_root_newton(G, 4, 1e-6, 0, 1e-6)
    u = torch.minimum(torch.linalg.matrix_norm(A), A.abs().sum(-1).amax(-1))
    torch.testing.assert_close(X0.cpu().double(), u.pow(-0.25)[:, None, None] * torch.eye(16, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(e0.cpu().double(), twins.inf_norm_residual(A / u[:, None, None]),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_root_float64_option(device):
    G = spd(32, 1e6).float().to(device)
    X = linalg.matrix_inverse_root(G, 4, eps=0.0, method="eigh", float64=True)
    assert X.dtype == torch.float32
    assert rel_err(X, root_ref(G, 4, 0.0)) <= 1e-6
    Xn = linalg.matrix_inverse_root(G, 4, eps=0.0, method="newton", float64=True, tol=1e-12)
    assert Xn.dtype == torch.float32 and rel_err(Xn, root_ref(G, 4, 0.0)) <= 1e-6


def test_root_eigh_is_differentiable():
    G = spd(5, 10.0).requires_grad_(True)
    torch.autograd.gradcheck(lambda g: linalg.matrix_inverse_root(0.5 * (g + g.mT), 2, method="eigh"), (G,))


# ----------------------------------------------------------------------------- bad inputs


def _raises(message: str):
    return pytest.raises(RuntimeError, match="^" + re.escape(message) + "$")


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("method", ["newton", "eigh"])
def test_root_nan_names_the_matrices(device, method):
    G = spd(8, 10.0, batch=(2, 3)).float().to(device)
    G[0, 2, 1, 1] = float("nan")
    G[1, 0, 3, 4] = float("inf")
    with _raises("torchkern.matrix_inverse_root: G contains NaN or Inf in the matrices at batch indices "
                 "[(0, 2), (1, 0)]"):
        linalg.matrix_inverse_root(G, 4, method=method)
    with _raises("torchkern.matrix_inverse_root: G contains NaN or Inf in the matrices at batch indices [2]"):
        linalg.matrix_inverse_root(G[0], 4, method=method)
    with _raises("torchkern.matrix_inverse_root: G contains NaN or Inf"):
        linalg.matrix_inverse_root(G[0, 2], 4, method=method)


def test_root_bad_inputs():
    G = spd(4, 10.0).float()
    with _raises("torchkern.matrix_inverse_root: G must have shape [..., n, n] (square matrices), got [3, 4]"):
        linalg.matrix_inverse_root(G[:3], 4)
    with _raises("torchkern.matrix_inverse_root: G must have shape [..., n, n] (square matrices), got [4]"):
        linalg.matrix_inverse_root(G[0], 4)
    with _raises("torchkern.matrix_inverse_root: p must be a positive integer, got 0"):
        linalg.matrix_inverse_root(G, 0)
    with _raises("torchkern.matrix_inverse_root: p must be a positive integer, got 2.5"):
        linalg.matrix_inverse_root(G, 2.5)
    with _raises("torchkern.matrix_inverse_root: method must be 'auto', 'eigh' or 'newton', got 'svd'"):
        linalg.matrix_inverse_root(G, 4, method="svd")
    with _raises("torchkern.matrix_inverse_root: G must be float32, float64, float16 or bfloat16, got int64"):
        linalg.matrix_inverse_root(torch.eye(3, dtype=torch.long), 4)
    with _raises("torchkern.matrix_inverse_root: eps must be a finite number in [0, 3.40282e+38] (the range of "
                 "float32, the compute dtype), got -1"):
        linalg.matrix_inverse_root(G, 4, eps=-1.0)


# ----------------------------------------------------------------------------- kernels vs twin (CUDA)


@requires_cuda
@pytest.mark.parametrize("n", [1, 3, 17, 32, 33, 64, 100, 128, 129, 200])
@pytest.mark.parametrize("dtype", dtypes())
def test_newton_kernel_matches_twin(n, dtype):
    G = spd(n, 100.0, batch=(5,)).to(dtype)
    tol = newton_tol(dtype)
    X, err, it = torch.ops.torchkern.matrix_inverse_root_newton(G.cuda(), 4, 1e-6, 100, tol)
    Xt, errt, itt = twins.matrix_inverse_root_newton(G, 4, 1e-6, 100, tol)
    assert X.dtype == dtype and err.dtype == torchkern._checks.opmath_dtype(dtype) and it.dtype == torch.int32
    # same math, different summation order: iteration counts agree within one step
    assert (it.cpu() - itt).abs().max().item() <= 1, (it.tolist(), itt.tolist())
    R = root_ref(G, 4, 1e-6)
    bound = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    assert rel_err(X, R) <= bound and rel_err(Xt, R) <= bound


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("n", [32, 200, 600])
@pytest.mark.parametrize("max_iters", [3, 40])
def test_newton_without_waiting_gives_the_same_roots(device, n, max_iters):
    if device == "cpu" and n > 200:
        pytest.skip("the twin runs all max_iters iterations: kept small on the CPU")
    # wait=False queues every iteration instead of stopping once all matrices have: the matrices that
    # stopped stay bitwise as they were, so the results equal the waiting loop's, cut short or not
    G = torch.stack([spd(n, 10.0), spd(n, 1e4), torch.eye(n, dtype=torch.float64)]).float().to(device)
    waited = torch.ops.torchkern.matrix_inverse_root_newton(G, 4, 1e-6, max_iters, 1e-6)
    queued = torch.ops.torchkern.matrix_inverse_root_newton(G, 4, 1e-6, max_iters, 1e-6, False)
    for a, b in zip(waited, queued):
        assert torch.equal(a, b)
    if max_iters == 40:
        assert rel_err(queued[0], root_ref(G.double().cpu(), 4, 1e-6)) <= 1e-4


@requires_cuda
@pytest.mark.parametrize("device", cuda_devices())
@pytest.mark.parametrize("n", [64, 100, 128])
def test_newton_kernel_large_batch_and_device(device, n):
    # More matrices than the GPU holds pairs of blocks: n in (64, 128] then runs one block per matrix,
    # while its first three alone run as pairs (small_matrix.cuh); both agree with the reference and
    # with each other.
    batch = 2 * torch.cuda.get_device_properties(device).multi_processor_count + 1
    G = spd(n, 1e3, batch=(batch,)).float().to(device)
    X, _, iters = torch.ops.torchkern.matrix_inverse_root_newton(G, 4, 1e-6, 100, 1e-6)
    assert X.device == torch.device(device)
    assert rel_err(X, root_ref(G, 4, 1e-6)) <= 1e-4
    X3, _, iters3 = torch.ops.torchkern.matrix_inverse_root_newton(G[:3], 4, 1e-6, 100, 1e-6)
    assert rel_err(X3, X[:3].double().cpu()) <= 1e-5
    assert (iters3 - iters[:3]).abs().max().item() <= 1


def test_newton_has_cuda_kernel_when_built():
    info = torchkern.backend_info()
    if info.backend != "cuda":
        pytest.skip(f"backend is {info.backend}: {info.reason}")
    assert has_cuda_kernel("matrix_inverse_root_newton") and has_cuda_kernel("kron")


# ----------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_opcheck(device):
    G = spd(12, 10.0, batch=(2,)).float().to(device)
    torch.library.opcheck(torch.ops.torchkern.matrix_inverse_root_newton.default, (G, 4, 1e-6, 50, 1e-6))
    torch.library.opcheck(torch.ops.torchkern.matrix_inverse_root_newton.default, (G[0], 2, 1e-6, 50, 1e-6))
    torch.library.opcheck(torch.ops.torchkern.matrix_inverse_root_newton.default, (G, 4, 1e-6, 50, 1e-6, False))
    A, B = randn(2, 3, 4, device=device, requires_grad=True), randn(1, 5, 2, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.torchkern.kron.default, (A, B))
    torch.library.opcheck(torch.ops.torchkern.kron.default, (A[0].detach(), B[0].detach()))


# ----------------------------------------------------------------------------- kron


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtypes())
def test_kron_matches_torch_kron(device, dtype):
    A, B = randn(3, 4, dtype=dtype, device=device), randn(5, 2, dtype=dtype, device=device)
    torch.testing.assert_close(linalg.kron(A, B), torch.kron(A, B), rtol=0, atol=0)
    # batched, with broadcasting and a non-contiguous input; odd and vectorizable widths
    for (m, n), (p, q) in (((3, 4), (5, 2)), ((2, 3), (4, 8)), ((1, 1), (3, 7))):
        A, B = randn(2, 3, m, n, dtype=dtype, device=device), randn(3, p, q, dtype=dtype, device=device)
        out = linalg.kron(noncontiguous(A), B)
        expected = torch.stack([torch.stack([torch.kron(A[i, j], B[j]) for j in range(3)]) for i in range(2)])
        assert out.shape == (2, 3, m * p, n * q) and out.is_contiguous()
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_kron_gradcheck(device):
    A = randn(2, 3, 2, dtype=torch.float64, device=device, requires_grad=True)
    B = randn(1, 2, 3, dtype=torch.float64, device=device, requires_grad=True)
    torch.autograd.gradcheck(linalg.kron, (A, B))
    torch.autograd.gradgradcheck(linalg.kron, (A, B))


def test_kron_bad_inputs():
    A = torch.randn(2, 3)
    with _raises("torchkern.kron: A must have shape [..., m, n] (at least 2 dims), got [3]"):
        linalg.kron(A[0], A)
    with _raises("torchkern.kron: B must have dtype float32 like A, got float64"):
        linalg.kron(A, A.double())
    with _raises("torchkern.kron: the batch dims of A [2, 2, 3] and B [3, 2, 3] do not broadcast"):
        linalg.kron(torch.randn(2, 2, 3), torch.randn(3, 2, 3))
    with _raises("torchkern.kron: A must be float32, float64, float16 or bfloat16, got int64"):
        linalg.kron(A.long(), A)


@requires_cuda
def test_kron_large_kernel():
    A, B = randn(4, 16, 16, device="cuda"), randn(4, 32, 36, device="cuda")
    torch.testing.assert_close(linalg.kron(A, B), twins.kron(A, B), rtol=0, atol=0)


# ----------------------------------------------------------------------------- kron_precondition


def _eig(M):
    d, Q = torch.linalg.eigh(M)
    return Q, d


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_kron_precondition_eigen_form_matches_explicit_kron(device, dtype):
    m, n, damping = 4, 3, 0.1
    L, R = spd(m, 20.0).to(dtype), spd(n, 20.0).to(dtype)
    grad = randn(2, m, n, dtype=dtype)
    out = linalg.kron_precondition(grad.to(device), _eig(L.to(device)), _eig(R.to(device)), damping)
    # row-major vec: (L kron R) vec(G) = vec(L G R^T)
    K = torch.kron(L, R) + damping * torch.eye(m * n, dtype=dtype)
    expected = torch.linalg.solve(K, grad.reshape(2, m * n, 1)).reshape(2, m, n)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.cpu(), expected, **tol)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_kron_precondition_inverse_form_matches_explicit_kron(device):
    m, n = 5, 3
    Li = linalg.matrix_inverse_root(spd(m, 10.0).to(device), 4)
    Ri = linalg.matrix_inverse_root(spd(n, 10.0).to(device), 4)
    grad = randn(m, n, dtype=torch.float64, device=device)
    out = linalg.kron_precondition(grad, Li, Ri)
    expected = (torch.kron(Li, Ri) @ grad.reshape(-1)).reshape(m, n)  # Ri symmetric: (Li kron Ri^T) vec(G)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out, twins.kron_precondition(grad, Li, Ri))


def test_kron_precondition_gradcheck():
    Q, d = _eig(spd(3, 5.0))
    Qr, dr = _eig(spd(2, 5.0))
    grad = randn(3, 2, dtype=torch.float64, requires_grad=True)
    d, dr = d.requires_grad_(True), dr.requires_grad_(True)
    torch.autograd.gradcheck(lambda g, a, b: linalg.kron_precondition(g, (Q, a), (Qr, b), 0.1), (grad, d, dr))


def test_kron_precondition_bad_inputs():
    grad = torch.randn(4, 3)
    L, R = torch.eye(4), torch.eye(3)
    Q, d = torch.eye(4), torch.ones(4)
    with _raises("torchkern.kron_precondition: left must have shape [4, 4] (m = grad.shape[-2]) or be a tuple "
                 "(Q, d), got [3, 3]"):
        linalg.kron_precondition(grad, R, R)
    with _raises("torchkern.kron_precondition: right must have shape [3, 3] (n = grad.shape[-1]) or be a tuple "
                 "(Q, d), got [4, 4]"):
        linalg.kron_precondition(grad, L, L)
    with _raises("torchkern.kron_precondition: left[1] (d) must have shape [4] like left[0] (Q) without its last "
                 "dim, got [3]"):
        linalg.kron_precondition(grad, (Q, torch.ones(3)), (R, torch.ones(3)))
    with _raises("torchkern.kron_precondition: left and right must both be inverse factors or both be (Q, d) "
                 "eigendecompositions, got left as (Q, d) and right as a tensor"):
        linalg.kron_precondition(grad, (Q, d), R)
    with _raises("torchkern.kron_precondition: damping applies to the (Q, d) form only (fold it into the inverse "
                 "factors), got damping=0.1 with inverse factors"):
        linalg.kron_precondition(grad, L, R, 0.1)
    with _raises("torchkern.kron_precondition: grad must have shape [..., m, n] (at least 2 dims), got [3]"):
        linalg.kron_precondition(grad[0], L, R)
    with _raises("torchkern.kron_precondition: left must have dtype float32 like grad, got float64"):
        linalg.kron_precondition(grad, L.double(), R)
    with _raises("torchkern.kron_precondition: left must be a tensor (an inverse factor) or a tuple (Q, d) "
                 "(an eigendecomposition), got int"):
        linalg.kron_precondition(grad, 3, R)


def test_public_api_matches_twin_signature():
    import inspect
    assert list(inspect.signature(linalg.matrix_inverse_root).parameters) == \
        list(inspect.signature(twins.matrix_inverse_root).parameters)
    G = spd(6, 10.0, batch=(2,)).float()
    for method in ("newton", "eigh"):
        torch.testing.assert_close(linalg.matrix_inverse_root(G, 4, method=method),
                                   twins.matrix_inverse_root(G, 4, method=method))


@requires_cuda
def test_newton_kernel_large_n_synchronous_check():
    # n >= 512: the convergence check waits for each iteration's own count (no speculative iteration)
    G = torch.stack([torch.eye(520, dtype=torch.float64) * 0.5 + 1e-3 * spd(520, 2.0), spd(520, 1e4)]).float().cuda()
    X, err, iters = torch.ops.torchkern.matrix_inverse_root_newton(G, 4, 1e-6, 100, 1e-6)
    assert iters[0] < iters[1], iters.tolist()
    assert rel_err(X, root_ref(G, 4, 1e-6)) <= 1e-4
    X1, _, it1 = torch.ops.torchkern.matrix_inverse_root_newton(G[:1], 4, 1e-6, 100, 1e-6)
    assert it1.item() == iters[0].item()


# ---------------------------------------------------------------------------------------------- the small kernel's
# symmetric products (n in (32, 128]; float64 (32, 64]): the root is exactly symmetric and matches the twin,
# around every tile and padding boundary (CUDA only).


@requires_cuda
@pytest.mark.parametrize("n", [1, 2, 3, 31, 33, 48, 63, 64, 65, 100, 127, 128])
@pytest.mark.parametrize("p", [1, 3, 4])
@pytest.mark.parametrize("dtype", dtypes())
def test_newton_small_kernel_symmetric_and_matches_twin(n, p, dtype):
    G = spd(n, 100.0, batch=(3,)).to(dtype)
    tol = newton_tol(dtype)
    X, err, it = torch.ops.torchkern.matrix_inverse_root_newton(G.cuda(), p, 1e-6, 100, tol)
    Xt, errt, itt = twins.matrix_inverse_root_newton(G, p, 1e-6, 100, tol)
    X, err = X.cpu(), err.cpu()
    if n > 32 and (dtype != torch.float64 or n <= 64):  # the symmetric path: exactly symmetric
        assert torch.equal(X, X.mT)
    assert (it.cpu() - itt).abs().max().item() <= 1, (it.tolist(), itt.tolist())
    R = root_ref(G, p, 1e-6)
    bound = {torch.float64: 1e-10, torch.float32: 3e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    assert rel_err(X, R) <= bound and rel_err(Xt, R) <= bound
    # the error is ||M - I||_inf of the final M: close to the twin's (both at the rounding floor or below tol)
    assert (err.double() <= max(10 * tol, 1e-4)).all(), err.tolist()


# ----------------------------------------------------------------------------- eigh
# Bars (issue 13): ||A V - V diag(w)||_F <= 1e-5 ||A||_F and ||V^T V - I||_2 <= 1e-5 in float32 (1e-12 in float64;
# the spectral norm: in Frobenius norm even LAPACK's float32 eigenvectors exceed 1e-5 from n = 128 on), eigenvalues
# within float32's floor of a float64 reference: 8 eps ||A||_F (rounding A to float32 alone moves them by up to
# eps ||A||_F). On CUDA: n <= 136 (float32) / 118 (float64) runs the in-block kernel, above the block method.

EIGH_RES = {torch.float32: 1e-5, torch.float64: 1e-12}
EIGH_ORTH = {torch.float32: 1e-5, torch.float64: 1e-12}
# eigenvalue error over ||A||_F: a backward-stable solver's floor is about sqrt(n) eps (seen in float32: 8.6 eps at
# n = 136, condition 1e8); 16 eps covers n <= 256 in float32
EIGH_VALUES = {torch.float32: 16 * torch.finfo(torch.float32).eps, torch.float64: 1e-12}


def spectrum(kind: str, n: int, batch: tuple = ()) -> torch.Tensor:
    """float64 symmetric test matrices of one spectrum class."""
    Q, _ = torch.linalg.qr(torch.randn(*batch, n, n, generator=_GEN, dtype=torch.float64))
    if kind == "random":
        G = torch.randn(*batch, n, n, generator=_GEN, dtype=torch.float64)
        return G + G.mT
    if kind == "clustered":  # eigenvalues within 1e-6 of each other, and of -1
        lam = torch.cat([1 + 1e-6 * torch.rand(n - n // 2, generator=_GEN, dtype=torch.float64),
                         -1 + 1e-6 * torch.rand(n // 2, generator=_GEN, dtype=torch.float64)])
    elif kind == "repeated":  # three eigenvalues, each many times
        lam = torch.tensor([2.0, -0.5, 1.0], dtype=torch.float64).repeat(n // 3 + 1)[:n]
    elif kind == "rank_deficient":
        lam = torch.logspace(0, -1, n, dtype=torch.float64)
        lam[max(1, n // 4):] = 0
    elif kind == "cond1e8":
        lam = torch.logspace(0, -8, n, dtype=torch.float64)
    elif kind == "zero":
        return torch.zeros(*batch, n, n, dtype=torch.float64)
    elif kind == "diagonal":
        return torch.diag_embed(torch.randn(*batch, n, generator=_GEN, dtype=torch.float64))
    else:
        raise ValueError(kind)
    A = (Q * lam) @ Q.mT
    return 0.5 * (A + A.mT)


def check_eigh(A: torch.Tensor, w: torch.Tensor, V: torch.Tensor, dtype: torch.dtype) -> None:
    """The bars above, for eigh(A) = (w, V) computed from A in ``dtype``."""
    A = A.to(dtype).double().cpu()  # the rounded input is the problem solved
    w, V = w.double().cpu(), V.double().cpu()
    n = A.shape[-1]
    assert w.shape == A.shape[:-1] and V.shape == A.shape
    assert torch.isfinite(w).all() and torch.isfinite(V).all()
    assert (w[..., 1:] >= w[..., :-1]).all(), "eigenvalues must be ascending"
    norm = torch.linalg.matrix_norm(A).clamp_min(1e-300)
    res = torch.linalg.matrix_norm(A @ V - V * w.unsqueeze(-2)) / norm
    orth = torch.linalg.matrix_norm(V.mT @ V - torch.eye(n, dtype=torch.float64), 2)
    values = (w - torch.linalg.eigvalsh(A)).abs().amax(-1) / norm
    assert res.max() <= EIGH_RES[dtype], f"residual {res.max():.2e}"
    assert orth.max() <= EIGH_ORTH[dtype], f"orthogonality {orth.max():.2e}"
    assert values.max() <= EIGH_VALUES[dtype], f"eigenvalues {values.max():.2e}"


EIGH_KINDS = ["random", "clustered", "repeated", "rank_deficient", "cond1e8", "zero", "diagonal"]
# CUDA eigh's solvers: "auto" (the fastest for the shape, linalg/constants.py), "jacobi" (the Jacobi kernels at every
# size) or "tridiagonal" (Householder reduction and inverse iteration, float32 compute only)
EIGH_SOLVERS = list(twins.EIGH_SOLVERS)


def skip_solver(device: str, solver: str, dtype: torch.dtype = torch.float32) -> None:
    if device == "cpu" and solver != "auto":
        pytest.skip("the solver choice is CUDA's (the CPU runs LAPACK either way)")
    if solver == "tridiagonal" and dtype == torch.float64:
        pytest.skip("the tridiagonal solver computes in float32 (test_eigh_bad_inputs: float64 is refused)")


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("kind", EIGH_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_eigh_spectra(device, kind, dtype):
    for n in (1, 2, 3, 17, 64, 100):
        A = spectrum(kind, n, batch=(3,))
        w, V = linalg.eigh(A.to(dtype).to(device))
        assert w.dtype == dtype and V.dtype == dtype and V.is_contiguous()
        check_eigh(A, w, V, dtype)


@requires_cuda
@pytest.mark.parametrize("kind", EIGH_KINDS)
@pytest.mark.parametrize("n", [127, 128, 136, 137, 200, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("solver", EIGH_SOLVERS)
def test_eigh_kernel_sizes(kind, n, dtype, solver):
    # around the in-block kernel's limit (136 float32, 118 float64) and the block method above it (padding:
    # 137 and 200 are not multiples of 64); "auto": cuSOLVER's batched solver for these cold starts (float64 to 128)
    skip_solver("cuda", solver, dtype)
    A = spectrum(kind, n, batch=(2,))
    w, V = linalg.eigh(A.to(dtype).cuda(), solver=solver)
    check_eigh(A, w, V, dtype)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_eigh_block_method_mixed_batch(dtype):
    # One batch of the block method whose matrices converge after different sweeps (a diagonal one after the
    # first, a zero one too): the matrices that have stopped keep moving through the rounds' seats unchanged
    # while the others rotate; every one meets the bars. n = 300: five pairs of 64-row slots, 20 rows of padding.
    n = 300
    A = torch.cat([spectrum(kind, n, batch=(1,)) for kind in ("diagonal", "random", "zero", "cond1e8", "clustered")])
    w, V = linalg.eigh(A.to(dtype).cuda())
    check_eigh(A, w, V, dtype)


@requires_cuda
@pytest.mark.parametrize("solver", EIGH_SOLVERS)
def test_eigh_block_method_noncontiguous(solver):
    # the block method's preparation reads A and Q0 in its own layout (and cuSOLVER's path copies them): strided
    # views give the same decomposition
    A = spectrum("random", 150, batch=(3,)).float().cuda()
    Q0 = torch.linalg.eigh(A.double())[1].float()
    for warm in (None, Q0):
        w, _ = linalg.eigh(A, warm, solver=solver)
        w2, V2 = linalg.eigh(noncontiguous(A), None if warm is None else noncontiguous(warm), solver=solver)
        check_eigh(A, w2, V2, torch.float32)
        torch.testing.assert_close(w2, w, rtol=0, atol=1e-5 * A.abs().max().item())


@requires_cuda
@pytest.mark.parametrize("batch", [1, 8], ids=["cusolver", "block"])
def test_eigh_large_cold_starts(batch):
    # from n = 704 a cold start of one matrix goes to cuSOLVER; a batch of 8 to the block method in float64, to the
    # tridiagonal solver in float32 (linalg/constants.py): all meet the bars
    A = spectrum("random", 704, batch=(batch,))
    for dtype in (torch.float64, torch.float32):
        w, V = linalg.eigh(A.to(dtype).cuda())
        check_eigh(A, w, V, dtype)


@requires_cuda
@pytest.mark.parametrize("kind", EIGH_KINDS)
@pytest.mark.parametrize("n", [1, 2, 3, 33, 100, 383, 520])
def test_eigh_tridiagonal_sizes(kind, n):
    # the tridiagonal solver forced below its range (a cluster of 1 to 8 blocks per matrix: n / 32 column chunks
    # and at most 8; 383 and 520: a last panel and a last chunk in part), every spectrum class
    A = spectrum(kind, n, batch=(2,))
    w, V = linalg.eigh(A.float().cuda(), solver="tridiagonal")
    check_eigh(A, w, V, torch.float32)


@requires_cuda
def test_eigh_tridiagonal_mixed_batch_1024():
    # one batch of 1024^2 matrices of every spectrum class (split tridiagonals: the zero and diagonal ones, the
    # others' float32 noise; clusters), the size of the issue's bar, which "auto" sends to the tridiagonal solver
    assert 1024 >= constants.EIGH_TRIDIAGONAL_MIN_N
    A = torch.cat([spectrum(kind, 1024, batch=(1,)) for kind in EIGH_KINDS])
    w, V = linalg.eigh(A.float().cuda())
    check_eigh(A, w, V, torch.float32)
    w2, V2 = linalg.eigh(A.float().cuda(), solver="tridiagonal")  # the same solver, deterministic
    torch.testing.assert_close(w2, w, rtol=0, atol=0)
    torch.testing.assert_close(V2, V, rtol=0, atol=0)


@requires_cuda
@pytest.mark.parametrize("n", [7, 102, 128])
def test_eigh_row_slices_agree(n):
    # A batch too small to fill the GPU splits each matrix's eigenvectors over several blocks (jacobi.cuh, "Row
    # slices"), a batch of 300 does not: the same matrices alone and within the batch meet the bars and agree to
    # the float32 floor. n = 102: an odd number of rotation pairs; n = 7 alone: seven blocks of one row each.
    # (solver="jacobi": the in-block kernel's cold starts; cuSOLVER's from n = 96)
    A = spectrum("random", n, batch=(300,))
    X = A.float().cuda()
    w_all, V_all = linalg.eigh(X, solver="jacobi")
    for i in (0, 1, 299):
        w, V = linalg.eigh(X[i], solver="jacobi")
        check_eigh(A[i], w, V, torch.float32)
        scale = torch.linalg.matrix_norm(A[i]).item()
        assert (w - w_all[i]).abs().max().item() <= EIGH_VALUES[torch.float32] * scale
    check_eigh(A, w_all, V_all, torch.float32)


@requires_cuda
@pytest.mark.parametrize("n", [16, 64, 96, 120, 160])
@pytest.mark.parametrize("solver", EIGH_SOLVERS)
def test_eigh_kernel_float64_paths(n, solver):
    # float64: the in-block kernel up to 118, the block method above (cuSOLVER's batched solver for 96 and 120),
    # all at float64 accuracy
    skip_solver("cuda", solver, torch.float64)
    A = spectrum("cond1e8", n, batch=(3,))
    w, V = linalg.eigh(A.cuda(), solver=solver)
    check_eigh(A, w, V, torch.float64)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("batch", [(), (1,), (2, 3), (0,), (37,)], ids=["none", "one", "B1xB2", "empty", "many"])
def test_eigh_batch_shapes_and_layouts(device, batch):
    A = spectrum("random", 9, batch=batch).float().to(device)
    w, V = linalg.eigh(A)
    assert w.shape == (*batch, 9) and V.shape == A.shape and w.device == A.device
    if A.numel():
        check_eigh(A, w, V, torch.float32)
        w2, V2 = linalg.eigh(noncontiguous(A))
        check_eigh(A, w2, V2, torch.float32)
        torch.testing.assert_close(w2, w, rtol=0, atol=1e-5 * A.abs().max().item())
    w0, V0 = linalg.eigh(torch.empty(*batch, 0, 0, device=device))
    assert w0.shape == (*batch, 0) and V0.shape == (*batch, 0, 0)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("exponent", [-100, 100])
@pytest.mark.parametrize("n", [24, 150])  # CUDA: the in-block kernel; 150: cuSOLVER, or the block method's preparation
@pytest.mark.parametrize("solver", EIGH_SOLVERS)
def test_eigh_extreme_scales(device, dtype, exponent, n, solver):
    # tiny and huge matrices (2^-100 ... 2^100 in float32, 2^-1000 ... 2^1000 in float64; powers of two, so the
    # scaled input is exactly the scaled rounded matrix): no under- or overflow, the eigenvalues scale. The twin
    # (LAPACK) rescales by factors of its own, so the comparison allows the dtype's floor, a few eps * ||A||.
    skip_solver(device, solver, dtype)
    scale = 2.0 ** (exponent * (10 if dtype == torch.float64 else 1))
    A = spectrum("random", n, batch=(2,)).to(dtype)
    w, V = linalg.eigh((A.double() * scale).to(dtype).to(device), solver=solver)
    w1, _ = linalg.eigh(A.to(device), solver=solver)
    check_eigh(A, w / scale, V, dtype)
    floor = 8 * torch.finfo(dtype).eps * w1.abs().max().item()
    torch.testing.assert_close((w / scale).cpu(), w1.cpu(), rtol=0, atol=floor)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("n", [12, 150])  # CUDA: the in-block kernel; 150: cuSOLVER, or the block method's casts
@pytest.mark.parametrize("solver", EIGH_SOLVERS)
def test_eigh_half_types_compute_in_float32(device, dtype, n, solver):
    skip_solver(device, solver)
    A = spectrum("random", n, batch=(2,)).to(dtype)
    w, V = linalg.eigh(A.to(device), solver=solver)
    assert w.dtype == dtype and V.dtype == dtype
    # the same rounded input, in float32: the result rounded to dtype
    w32, V32 = linalg.eigh(A.float().to(device), solver=solver)
    torch.testing.assert_close(w.cpu(), w32.to(dtype).cpu(), rtol=0, atol=0)
    torch.testing.assert_close(V.abs().cpu(), V32.abs().to(dtype).cpu(), rtol=0,
                               atol=2 * torch.finfo(dtype).eps)  # float32 eigenvector signs may differ


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("n", [5, 48, 100, 128, 160])  # CUDA float32: one-launch rotations up to 120, then ATen's
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_eigh_warm_start(device, n, dtype):
    # Q0: the eigenbasis of the statistics one optimizer step earlier (a small PSD update); on CUDA the Jacobi
    # kernels' warm start too where "auto" gives the call to cuSOLVER (float32 from n = EIGH_SYEV_WARM_MIN_N)
    A0 = spectrum("cond1e8", n, batch=(2,))
    Z = torch.randn(2, n, n, generator=_GEN, dtype=torch.float64)
    A = A0 + 1e-2 * (Z @ Z.mT) / n
    _, Q0 = torch.linalg.eigh(A0)
    w_cold, _ = linalg.eigh(A.to(dtype).to(device))
    for solver in ("auto", "jacobi") if device == "cuda" else ("auto",):
        w, V = linalg.eigh(A.to(dtype).to(device), Q0.to(dtype).to(device), solver=solver)
        check_eigh(A, w, V, dtype)
        assert (w - w_cold).abs().max().item() <= 2 * EIGH_VALUES[dtype] * torch.linalg.matrix_norm(A).max().item()
    # the identity as Q0: the same problem as without it
    w_id, V_id = linalg.eigh(A.to(dtype).to(device), torch.eye(n, dtype=dtype, device=device).expand(2, n, n))
    check_eigh(A, w_id, V_id, dtype)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("n", [7, 64, 128])
def test_eigh_warm_start_decomposes_the_symmetric_part(device, n):
    # A non-symmetric A: with a warm start too, its symmetric part is decomposed (the rotations may work on A or on
    # A^T); float16 input is computed in float32
    S = spectrum("random", n, batch=(3,))
    Z = torch.randn(3, n, n, generator=_GEN, dtype=torch.float64)
    A = S + 0.3 * (Z - Z.mT)
    Q0 = torch.linalg.eigh(S + 1e-3 * (Z + Z.mT))[1]
    for dtype in (torch.float32, torch.float16):
        A_in = A.to(dtype)
        w, V = linalg.eigh(A_in.to(device), Q0.to(dtype).to(device))
        w_cold, _ = linalg.eigh(A_in.to(device))
        assert w.dtype == dtype and V.dtype == dtype
        if dtype == torch.float32:
            check_eigh((A_in.double() + A_in.double().mT) / 2, w, V, dtype)
            tol = 2 * EIGH_VALUES[dtype] * torch.linalg.matrix_norm(A_in.double()).max().item()
        else:  # both rounded to float16 from float32 results: two of its units in the last place
            tol = 2 * torch.finfo(dtype).eps * torch.linalg.matrix_norm(A_in.double(), 2).max().item()
        assert (w.double() - w_cold.double()).abs().max().item() <= tol


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("n", [48, 100, 200])  # CUDA: the in-block kernel, its warm start's ATen rotations, blocks
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_eigh_tolerance(device, n, warm):
    # a looser tol stops the Jacobi kernels sooner: the residual within it, orthogonality unchanged (the rotations
    # are orthogonal however many there are), eigenvalues ascending; the default keeps the full accuracy. The CPU
    # (LAPACK) and cuSOLVER ignore it: "jacobi" here, so that CUDA runs the kernels
    A = spectrum("random", n, batch=(3,))
    Q0 = torch.linalg.eigh(A + 1e-2 * torch.eye(n, dtype=A.dtype) * torch.randn(3, n, 1, generator=_GEN,
                                                                                  dtype=A.dtype))[1]
    eye = torch.eye(n, dtype=torch.float64)
    for tol in (1e-2, 1e-4, None):
        w, V = linalg.eigh(A.float().to(device), Q0.float().to(device) if warm else None,
                           solver="jacobi" if device != "cpu" else "auto", tol=tol)
        w, V = w.double().cpu(), V.double().cpu()
        if tol is None:
            check_eigh(A, w, V, torch.float32)
            continue
        norm = torch.linalg.matrix_norm(A)
        res = (torch.linalg.matrix_norm(A @ V - V * w.unsqueeze(-2)) / norm).max().item()
        orth = torch.linalg.matrix_norm(V.mT @ V - eye, 2).max().item()  # rotations stay orthogonal at any tol
        assert res <= tol and orth <= 1e-5 and bool((w.diff(dim=-1) >= 0).all()), (tol, res, orth)


def test_eigh_is_differentiable():
    # the symmetric part is decomposed, so gradcheck may perturb A freely; the gradient is symmetric
    A = spectrum("random", 5, batch=(2,)).requires_grad_(True)
    torch.autograd.gradcheck(lambda a: linalg.eigh(a)[0], (A,))
    torch.autograd.gradcheck(lambda a: (lambda w, V: V * w.unsqueeze(-2))(*linalg.eigh(a)), (A,))
    torch.autograd.gradcheck(lambda a: linalg.eigh(a)[1].abs(), (A,))  # sign-invariant function of V
    w, V = linalg.eigh(A)
    (g,) = torch.autograd.grad((w * torch.arange(5.0, dtype=torch.float64)).sum() + V.abs().sum(), A)
    torch.testing.assert_close(g, g.mT)
    Q0 = torch.linalg.eigh(A.detach())[1]
    torch.autograd.gradcheck(lambda a: linalg.eigh(a, Q0)[0], (A,))


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_eigh_opcheck(device):
    A = spectrum("random", 6, batch=(2,)).float().to(device)
    Q0 = torch.linalg.eigh(A.cpu())[1].to(device)
    torch.library.opcheck(torch.ops.torchkern.eigh.default, (A,))
    torch.library.opcheck(torch.ops.torchkern.eigh.default, (A[0], Q0[0]))
    torch.library.opcheck(torch.ops.torchkern.eigh.default, (A.double().requires_grad_(True), None))
    torch.library.opcheck(torch.ops.torchkern.eigh.default, (A, None, "jacobi"))
    torch.library.opcheck(torch.ops.torchkern.eigh.default, (A, Q0, "jacobi", 1e-4))
    torch.library.opcheck(torch.ops.torchkern.eigh.default, (A, Q0, "tridiagonal"))


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("solver", EIGH_SOLVERS)
def test_eigh_nan_names_the_matrices(device, solver):
    skip_solver(device, solver)
    A = spectrum("random", 6, batch=(2, 3)).float().to(device)
    A[0, 2, 1, 1] = float("nan")
    A[1, 0, 3, 4] = float("inf")
    with _raises("torchkern.eigh: A contains NaN or Inf in the matrices at batch indices [(0, 2), (1, 0)]"):
        linalg.eigh(A)
    with _raises("torchkern.eigh: A contains NaN or Inf"):
        linalg.eigh(A[0, 2])
    Q0 = torch.eye(6, device=device).repeat(3, 1, 1)
    Q0[1, 0, 0] = float("nan")
    with _raises("torchkern.eigh: Q0 contains NaN or Inf in the matrices at batch indices [1]"):
        linalg.eigh(spectrum("random", 6, batch=(3,)).float().to(device), Q0)
    # the op itself: NaN for those matrices only, the others decomposed, with and without a warm start (one
    # with a NaN in Q0 too); the sizes take the in-block kernel and the block method (150 cold: cuSOLVER's, unless
    # "jacobi")
    for n in (6, 150):
        A = spectrum("random", n, batch=(2, 3)).float().to(device)
        A[0, 2, 1, 1] = float("nan")
        A[1, 0, 3, 4] = float("inf")
        Q0 = torch.linalg.qr(torch.randn(6, n, n, generator=_GEN, dtype=torch.float64))[0].float().to(device)
        Q0[4, 2, 0] = float("nan")
        for warm, bad in ((None, [2, 3]), (Q0, [2, 3, 4])):
            w, V = torch.ops.torchkern.eigh(A.flatten(0, 1), warm, solver)
            bad = torch.isin(torch.arange(6), torch.tensor(bad))
            assert torch.isnan(w[bad]).all() and torch.isnan(V[bad]).all()
            check_eigh(A.flatten(0, 1)[~bad], w[~bad], V[~bad], torch.float32)


@requires_cuda
@pytest.mark.parametrize("B, n", [(64, 256), (4, 128), (3, constants.EIGH_TRIDIAGONAL_MIN_N)])
def test_eigh_warm_start_goes_to_the_cold_solver(B, n):
    # float32 warm starts that a direct solver takes as it takes their cold starts (Q0 unused: the same results, bit
    # for bit, from the same deterministic solver): cuSOLVER's batched solver at 64 x 256^2, above
    # EIGH_SYEV_WARM_MIN_ELEMS, and at 4 x 128^2, the in-block kernel's largest sizes (EIGH_SYEV_WARM_MIN_N); the
    # tridiagonal solver from EIGH_TRIDIAGONAL_MIN_N at full accuracy, but at tol = EIGH_WARM_JACOBI_MIN_TOL the
    # Jacobi kernels' warm start (the same as solver="jacobi"). The results meet the bars, and a non-finite A or Q0
    # still makes its matrix NaN.
    tridiagonal = n >= constants.EIGH_TRIDIAGONAL_MIN_N
    assert tridiagonal or B * n * n >= constants.EIGH_SYEV_WARM_MIN_ELEMS or n >= constants.EIGH_SYEV_WARM_MIN_N
    assert tridiagonal or n <= constants.EIGH_SYEV_MAX_N_F32
    A = spectrum("cond1e8", n, batch=(B,))
    Q0 = torch.linalg.eigh(A + 1e-3 * torch.eye(n, dtype=torch.float64))[1].float().cuda()
    X = A.float().cuda()
    w, V = linalg.eigh(X, Q0)
    check_eigh(A, w, V, torch.float32)
    w_cold, V_cold = linalg.eigh(X)
    torch.testing.assert_close(w, w_cold, rtol=0, atol=0)
    torch.testing.assert_close(V, V_cold, rtol=0, atol=0)
    if tridiagonal:
        tol = constants.EIGH_WARM_JACOBI_MIN_TOL
        w, V = linalg.eigh(X, Q0, tol=tol)
        w_jacobi, V_jacobi = linalg.eigh(X, Q0, solver="jacobi", tol=tol)
        torch.testing.assert_close(w, w_jacobi, rtol=0, atol=0)
        torch.testing.assert_close(V, V_jacobi, rtol=0, atol=0)
    X[B - 1, 0, 1] = float("inf")
    Q0[1, 2, 2] = float("nan")
    w, V = torch.ops.torchkern.eigh(X, Q0)
    bad = torch.isin(torch.arange(B), torch.tensor([1, B - 1]))
    assert torch.isnan(w[bad]).all() and torch.isnan(V[bad]).all()
    check_eigh(A[~bad], w[~bad], V[~bad], torch.float32)


def test_eigh_bad_inputs():
    A = torch.randn(4, 4)
    with _raises("torchkern.eigh: A must have shape [..., n, n] (square matrices), got [3, 4]"):
        linalg.eigh(A[:3])
    with _raises("torchkern.eigh: A must have shape [..., n, n] (square matrices), got [4]"):
        linalg.eigh(A[0])
    with _raises("torchkern.eigh: A must be float32, float64, float16 or bfloat16, got int64"):
        linalg.eigh(A.long())
    with _raises("torchkern.eigh: Q0 must have shape [4, 4] like A, got [3, 3]"):
        linalg.eigh(A, torch.eye(3))
    with _raises("torchkern.eigh: Q0 must have dtype float32 like A, got float64"):
        linalg.eigh(A, torch.eye(4, dtype=torch.float64))
    for device in ["cpu"] + ["cuda"] * torch.cuda.is_available():  # the twin's message and the kernel's
        with _raises("torchkern.eigh: solver must be 'auto', 'jacobi' or 'tridiagonal', got 'qr'"):
            linalg.eigh(A.to(device), solver="qr")
        with _raises("torchkern.eigh: solver='tridiagonal' computes in float32 (float32, float16 and bfloat16 "
                     "input); float64 A takes 'auto' or 'jacobi'"):
            linalg.eigh(A.double().to(device), solver="tridiagonal")
        with _raises("torchkern.eigh: tol must be None or a number in [1e-06, 1) for float32 input, got 1e-09"):
            linalg.eigh(A.to(device), tol=1e-9)
        with _raises("torchkern.eigh: tol must be None or a number in [1e-13, 1) for float64 input, got 2"):
            linalg.eigh(A.double().to(device), tol=2.0)
        with _raises("torchkern.eigh: tol must be None or a number in [1e-06, 1) for float16 input, got nan"):
            linalg.eigh(A.half().to(device), tol=float("nan"))
    if torch.cuda.is_available():
        with _raises("torchkern.eigh: Q0 must be on cuda:0 like A, got cpu"):
            linalg.eigh(A.cuda(), torch.eye(4))
        with _raises("torchkern.eigh: Q0 must be on cpu like A, got cuda:0"):
            linalg.eigh(A, torch.eye(4, device="cuda"))


@requires_cuda
@pytest.mark.parametrize("device", cuda_devices())
def test_eigh_kernel_matches_twin(device):
    # a batch with every spectrum class, both paths: the kernel's eigenvalues against the twin's
    for n in (40, 150):
        A = torch.stack([spectrum(kind, n) for kind in EIGH_KINDS]).float()
        w, V = torch.ops.torchkern.eigh(A.to(device))
        wt, _ = twins.eigh(A)
        assert w.device == torch.device(device)
        check_eigh(A, w, V, torch.float32)
        norm = torch.linalg.matrix_norm(A.double())
        assert ((w.cpu().double() - wt.double()).abs().amax(-1) <= 2 * EIGH_VALUES[torch.float32] * norm).all()


def test_eigh_has_cuda_kernel_when_built():
    info = torchkern.backend_info()
    if info.backend != "cuda":
        pytest.skip(f"backend is {info.backend}: {info.reason}")
    assert has_cuda_kernel("eigh")


# ----------------------------------------------------------------------------- roots that never return NaN
# Issue 13: a matrix whose Newton iteration does not converge falls back (alone) to a float64 eigh root; every
# path takes the symmetric part of G (issue 12, item 11); tiny and huge scales neither under- nor overflow.

COND_TOL_NEWTON_F32 = {1e2: 1e-5, 1e4: 2e-4, 1e6: 1.5e-2}  # the docstring's numbers with ~5x margin


def newton_op_roots(G: torch.Tensor, p: int, eps: float) -> torch.Tensor:
    return torch.ops.torchkern.matrix_inverse_root_newton(G, p, eps, 100, 1e-6)[0]


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_root_issue_repro_rank_deficient_statistics(device):
    g = torch.Generator().manual_seed(1)
    W = torch.randn(8, 256, 32, generator=g) * torch.logspace(0, -3, 256)[None, :, None]
    G = (W @ W.transpose(-1, -2)).to(device)  # PSD, rank 32, entries up to ~30
    R, err = linalg.matrix_inverse_root(G, 4, eps=1e-6, method="newton", return_error=True)
    Re = linalg.matrix_inverse_root(G, 4, eps=1e-6, method="eigh", float64=True)
    assert torch.isfinite(R).all() and torch.isfinite(err).all()
    assert rel_err(R, Re.double().cpu()) <= 1e-3
    with pytest.raises(RuntimeError, match=r"^torchkern\.matrix_inverse_root: the Newton iteration did not converge "
                                           r"in the matrices at batch indices \["):
        linalg.matrix_inverse_root(G, 4, eps=1e-6, method="newton", fallback=False)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("method", ["newton", "eigh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_root_tiny_and_huge_scales(device, method, dtype):
    # eye(3) * 1e-25 with eps = 0: ||A||_F^2 underflows float32; roots scale by scale^(-1/p)
    X = linalg.matrix_inverse_root((torch.eye(3) * 1e-25).to(dtype).to(device), 2, eps=0.0, method=method)
    torch.testing.assert_close(X.cpu().double(), 10 ** 12.5 * torch.eye(3, dtype=torch.float64), rtol=1e-5, atol=0)
    G = spd(20, 100.0, batch=(2,))
    R = root_ref(G, 4, 1e-6)
    big = 1e300 if dtype == torch.float64 else 1e30
    for scale in (1 / big, big):
        Xs = linalg.matrix_inverse_root((G * scale).to(dtype).to(device), 4, eps=1e-6 * scale, method=method)
        assert rel_err(Xs.double() * scale ** 0.25, R) <= 1e-4


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("p", [2, 4])
def test_root_condition_numbers_float32(device, p):
    # eps = 0, spectra log-spaced over the condition number: Newton's float32 accuracy as documented and
    # float64=True accurate; from 1e8 on, rounding G to float32 can leave it indefinite (no root to compare
    # with): finite roots and errors (the fallback where Newton fails)
    for cond in (1e2, 1e4, 1e6, 1e8, 1e10):
        G = spd(48, cond, batch=(2,)).float().to(device)
        X, err = linalg.matrix_inverse_root(G, p, eps=0.0, method="newton", return_error=True)
        assert torch.isfinite(X).all() and torch.isfinite(err).all(), cond
        if cond in COND_TOL_NEWTON_F32:
            R = root_ref(G, p, 0.0)
            assert rel_err(X, R) <= COND_TOL_NEWTON_F32[cond], cond
            X64 = linalg.matrix_inverse_root(G, p, eps=0.0, method="eigh", float64=True)
            assert rel_err(X64, R) <= 1e-6, cond


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("method", ["newton", "eigh", "auto"])
def test_root_exact_rank_deficiency_and_zero_matrices(device, method):
    n = 16
    G = torch.stack([spd(n, 10.0, rank=n // 2), torch.zeros(n, n, dtype=torch.float64)]).float().to(device)
    X = linalg.matrix_inverse_root(G, 4, eps=1e-3, method=method)  # well defined with eps > 0
    assert rel_err(X, root_ref(G, 4, 1e-3)) <= 1e-4
    torch.testing.assert_close(X[1].cpu(), 1e-3 ** -0.25 * torch.eye(n), rtol=1e-5, atol=1e-5)
    X0, err = linalg.matrix_inverse_root(G, 4, eps=0.0, method=method, return_error=True)  # singular: finite
    assert torch.isfinite(X0).all() and not torch.isnan(err).any()


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_root_mixed_batch_falls_back_per_matrix(device):
    # converging and failing matrices in one batch: only the failing ones change, each gets its right root
    n, p, eps = 32, 4, 1e-6
    g = torch.Generator().manual_seed(3)
    W = torch.randn(n, 4, generator=g, dtype=torch.float64) * 30
    indefinite = spd(n, 10.0) - 0.5 * torch.eye(n, dtype=torch.float64)  # not PSD: Newton surely diverges
    G = torch.stack([spd(n, 10.0), W @ W.T, spd(n, 1e4), torch.eye(n, dtype=torch.float64) * 1e-25,
                     spd(n, 1e10), indefinite, spd(n, 100.0) * 1e20]).float().to(device)
    raw, err, _ = torch.ops.torchkern.matrix_inverse_root_newton(G, p, eps, 100, 1e-6)
    failed = twins.newton_failed(err, 1e-6).cpu()
    assert failed[5] and not failed.all(), err.tolist()
    X, reported = linalg.matrix_inverse_root(G, p, eps=eps, method="newton", return_error=True)
    assert torch.isfinite(X).all()
    assert torch.equal(X[~failed.to(X.device)], raw[~failed.to(raw.device)])  # the converged ones: Newton's, bitwise
    for i in failed.nonzero().flatten().tolist():  # the others: the float64 eigh root
        Xe = linalg.matrix_inverse_root(G[i], p, eps=eps, method="eigh", float64=True)
        torch.testing.assert_close(X[i], Xe, rtol=1e-6, atol=0)
    torch.testing.assert_close(reported.cpu(), twins.root_residual(X.cpu(), G.cpu(), p, eps).float())


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("n", [8, 40, 160])
def test_root_uses_the_symmetric_part_on_every_path(device, n):
    # issue 12, item 11: a non-symmetric G is the same as its symmetric part, for every method and kernel path
    G = spd(n, 10.0, batch=(2,))
    S = torch.randn(2, n, n, generator=_GEN, dtype=torch.float64) * 0.05
    N = (G + S - S.mT).float().to(device)  # G plus an antisymmetric part
    R = root_ref(G.float(), 4, 1e-6)
    roots = {m: linalg.matrix_inverse_root(N, 4, method=m) for m in ("newton", "eigh")}
    roots["op"] = newton_op_roots(N, 4, 1e-6)
    for method, X in roots.items():
        assert rel_err(X, R) <= 1e-4, method
    assert rel_err(roots["newton"], roots["eigh"].double().cpu()) <= 1e-4
    w, _ = linalg.eigh(N)
    torch.testing.assert_close(w.cpu().double(), torch.linalg.eigvalsh(G.float().double()), rtol=0, atol=1e-5)


def test_root_fallback_for_a_spent_budget():
    # max_iters too small to converge: the matrix falls back (the op alone keeps its unconverged iterate)
    G = spd(16, 1e3, batch=(2,)).float()
    X = linalg.matrix_inverse_root(G, 4, method="newton", max_iters=2)
    assert rel_err(X, root_ref(G, 4, 1e-6)) <= 1e-5
    with pytest.raises(RuntimeError, match=r"did not converge in the matrices at batch indices \[0, 1\]"):
        linalg.matrix_inverse_root(G, 4, method="newton", max_iters=2, fallback=False)
    with pytest.raises(RuntimeError, match=r"^torchkern\.matrix_inverse_root: the Newton iteration did not converge "
                                           r"\(error"):
        linalg.matrix_inverse_root(G[0], 4, method="newton", max_iters=2, fallback=False)
