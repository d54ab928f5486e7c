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
    assert err.max().item() <= (1e-3 if dtype in (torch.float16, torch.bfloat16) else 1e-4)


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
    X, e_newton = linalg.matrix_inverse_root(G, 4, method="newton", return_error=True)
    Xe, e_eigh = linalg.matrix_inverse_root(G, 4, method="eigh", return_error=True)
    # both report ||X^p (G + eps I) - I||_inf (Newton through M, which equals it in exact arithmetic)
    A = G.double().cpu() + 1e-6 * torch.eye(16, dtype=torch.float64)
    direct = twins.inf_norm_residual(torch.linalg.matrix_power(X.double().cpu(), 4) @ A)
    assert (e_newton.cpu().double() <= 1e-4).all() and (e_eigh.cpu().double() <= 1e-4).all()
    assert (direct <= 1e-4).all()
    # max_iters=0: M0 = A / u with u = min(||A||_F, ||A||_inf), error ||M0 - I||_inf, root u^(-1/p) I
    X0, e0 = linalg.matrix_inverse_root(G, 4, method="newton", max_iters=0, return_error=True)
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
    with _raises("torchkern.matrix_inverse_root: eps must be >= 0, got -1.0"):
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
    with _raises("torchkern.kron_precondition: left[1] (d) must have shape [4], got [3]"):
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
