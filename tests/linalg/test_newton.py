"""The Newton iteration of the inverse root: its scaled steps and Lanczos start (the twin), and the CUDA kernels
against the twin (the in-block kernel for n <= 128, batched cuBLAS products above)."""

from __future__ import annotations

import math

import pytest
import torch
from linalg_testing import generator, newton_tol, rel_err, root_ref, spd
from testing import cuda_devices, devices, dtypes, requires_cuda

import torchkern
from torchkern._library import has_cuda_kernel
from torchkern.linalg import constants, twins


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
    """Steps of the unscaled iteration (c = 1, z = (p + 1) / (2 ||A||_F); docs/design.md, "Inverse roots") in
    float32, same stopping rule."""
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
    B = torch.randn(n, n, generator=generator("lanczos_miss", n), dtype=torch.float64)
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


@requires_cuda
def test_newton_kernel_large_n_synchronous_check():
    # n >= 512: the convergence check waits for each iteration's own count (no speculative iteration)
    G = torch.stack([torch.eye(520, dtype=torch.float64) * 0.5 + 1e-3 * spd(520, 2.0), spd(520, 1e4)]).float().cuda()
    X, err, iters = torch.ops.torchkern.matrix_inverse_root_newton(G, 4, 1e-6, 100, 1e-6)
    assert iters[0] < iters[1], iters.tolist()
    assert rel_err(X, root_ref(G, 4, 1e-6)) <= 1e-4
    X1, _, it1 = torch.ops.torchkern.matrix_inverse_root_newton(G[:1], 4, 1e-6, 100, 1e-6)
    assert it1.item() == iters[0].item()


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


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_newton_opcheck(device):
    G = spd(12, 10.0, batch=(2,)).float().to(device)
    torch.library.opcheck(torch.ops.torchkern.matrix_inverse_root_newton.default, (G, 4, 1e-6, 50, 1e-6))
    torch.library.opcheck(torch.ops.torchkern.matrix_inverse_root_newton.default, (G[0], 2, 1e-6, 50, 1e-6))
    torch.library.opcheck(torch.ops.torchkern.matrix_inverse_root_newton.default, (G, 4, 1e-6, 50, 1e-6, False))


def test_newton_has_cuda_kernel_when_built():
    info = torchkern.backend_info()
    if info.backend != "cuda":
        pytest.skip(f"backend is {info.backend}: {info.reason}")
    assert has_cuda_kernel("matrix_inverse_root_newton")
