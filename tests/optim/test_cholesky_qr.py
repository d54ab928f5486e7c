"""The cholesky_qr op (one pass of Cholesky QR, the power step's factorization) against Householder QR and its
twin: conditioning, the shift, per-matrix failures, extreme scales, layouts, opcheck and bad inputs."""

from __future__ import annotations

import math

import pytest
import torch

from testing import devices, noncontiguous, requires_cuda


def _q_factor(X: torch.Tensor) -> torch.Tensor:
    """Householder QR's Q of X (float64), columns signed so that R's diagonal is positive (Cholesky QR's)."""
    Q, R = torch.linalg.qr(X.double())
    return Q * torch.sign(R.diagonal(dim1=-2, dim2=-1)).unsqueeze(-2)



def _conditioned(shape: tuple, cond: float, seed: int, dtype=torch.float64) -> torch.Tensor:
    """Random matrices with singular values spread log-uniformly from 1 to 1 / cond."""
    g = torch.Generator().manual_seed(seed)
    *batch, m, n = shape
    U = torch.linalg.qr(torch.randn(*batch, m, n, generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(*batch, n, n, generator=g, dtype=torch.float64))[0]
    return ((U * torch.logspace(0, -math.log10(cond), n, dtype=torch.float64)) @ V.mT).to(dtype)



@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(3, 1, 1), (3, 9, 5), (2, 2, 63, 63), (3, 64, 64), (2, 72, 65), (2, 130, 130),
                                   (2, 200, 200)], ids=str)
def test_cholesky_qr_is_the_q_factor(device, dtype, shape):
    """With no shift the pass is X's Q factor (R's diagonal positive), within Cholesky QR's error cond(X)^2 u, at
    sizes below, at and across the kernel's 64-column blocks; batch dimensions of any rank."""
    X = _conditioned(shape, 10.0, seed=shape[-1]).to(device, dtype)
    Y = torch.ops.torchkern.cholesky_qr(X, 0.0)
    assert Y.shape == X.shape and Y.dtype == dtype and Y.is_contiguous()
    tol = 2e-4 if dtype == torch.float32 else 1e-11
    assert (Y.double() - _q_factor(X).to(device)).abs().max().item() < tol



@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cholesky_qr_shift_and_second_pass(device, dtype):
    """A shifted pass on ill-conditioned matrices, then unshifted ones (the power step's passes): X's Q factor,
    orthonormal to the dtype's rounding; the shifted pass matches R^T R = X^T X + shift I."""
    X = _conditioned((3, 150, 150), 1e6 if dtype == torch.float64 else 1e2, seed=5).to(device, dtype)
    shift = 1e-3
    Y1 = torch.ops.torchkern.cholesky_qr(X, shift)
    R = torch.linalg.cholesky(X.double().mT @ X.double() + shift * torch.eye(150, dtype=torch.float64,
                                                                            device=device)).mT
    expected = torch.linalg.solve_triangular(R, X.double(), upper=True, left=False)
    tol = 1e-3 if dtype == torch.float32 else 1e-10
    assert (Y1.double() - expected).abs().max().item() < tol
    Y2 = torch.ops.torchkern.cholesky_qr(Y1, 0.0)  # cond(Y1)^2 u of orthogonality error: float64's cond(Y1) ~ 3e4
    if dtype == torch.float64:
        Y2 = torch.ops.torchkern.cholesky_qr(Y2, 0.0)
    eye = torch.eye(150, dtype=torch.float64, device=device)
    assert (Y2.double().mT @ Y2.double() - eye).abs().max().item() < (1e-4 if dtype == torch.float32 else 1e-13)
    assert (Y2.double() - _q_factor(X).to(device)).abs().max().item() < (1e-3 if dtype == torch.float32 else 1e-8)



@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(8, 256, 256), (4, 300, 100), (1, 1000, 1000)], ids=str)
def test_cholesky_qr_kernel_matches_twin(dtype, shape):
    from torchkern.optim import twins

    X = _conditioned(shape, 100.0, seed=7, dtype=dtype).cuda()
    for shift in (0.0, 0.5):
        got, want = torch.ops.torchkern.cholesky_qr(X, shift), twins.cholesky_qr(X, shift)
        assert (got - want).abs().max().item() < (1e-3 if dtype == torch.float32 else 1e-10)



@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_cholesky_qr_failures_are_per_matrix(device):
    """A matrix whose Gram matrix is singular (a zero column, past the first block) or holds NaN or Inf comes back
    all NaN, the others as if alone; a shift makes the singular one factorable."""
    X = _conditioned((4, 100, 100), 10.0, seed=3).to(device)
    X[1, :, 70] = 0.0
    X[2, 5, 5] = math.nan
    X[3, 0, 90] = math.inf
    Y = torch.ops.torchkern.cholesky_qr(X, 0.0)
    assert torch.isfinite(Y[0]).all() and torch.isnan(Y[1:]).all()
    assert (Y[0] - torch.ops.torchkern.cholesky_qr(X[:1], 0.0)[0]).abs().max().item() < 1e-12
    assert torch.isfinite(torch.ops.torchkern.cholesky_qr(X[:2], 1e-3)).all()



@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("scale", [1e-140, 1e140])
def test_cholesky_qr_extreme_scales(device, scale):
    """Entries far from 1 (float64): the same Q while the Gram matrix is representable."""
    X = _conditioned((2, 80, 80), 10.0, seed=4).to(device)
    Y = torch.ops.torchkern.cholesky_qr(X * scale, 0.0)
    assert (Y - _q_factor(X).to(device)).abs().max().item() < 1e-11



@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_cholesky_qr_noncontiguous_and_empty(device):
    X = _conditioned((3, 70, 70), 10.0, seed=6).to(device)
    torch.testing.assert_close(torch.ops.torchkern.cholesky_qr(noncontiguous(X), 0.1),
                               torch.ops.torchkern.cholesky_qr(X, 0.1), rtol=0, atol=1e-13)
    torch.testing.assert_close(torch.ops.torchkern.cholesky_qr(X.mT, 0.1),
                               torch.ops.torchkern.cholesky_qr(X.mT.contiguous(), 0.1), rtol=0, atol=1e-13)
    for shape in [(0, 5, 3), (2, 0, 3), (2, 4, 0)]:
        Y = torch.ops.torchkern.cholesky_qr(torch.zeros(shape, dtype=torch.float64, device=device), 1.0)
        assert Y.shape == shape



@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_cholesky_qr_opcheck(device):
    X = _conditioned((2, 70, 66), 10.0, seed=8).to(device)
    torch.library.opcheck(torch.ops.torchkern.cholesky_qr.default, (X, 0.25))



@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_cholesky_qr_bad_inputs(device):
    op = torch.ops.torchkern.cholesky_qr
    X = torch.randn(2, 4, 3, device=device)
    with pytest.raises(RuntimeError, match=r"torchkern.cholesky_qr: X must be float32 or float64, got float16"):
        op(X.half(), 0.0)
    with pytest.raises(RuntimeError, match=r"torchkern.cholesky_qr: X must have shape \[\.\.\., m, n\] \(at least 2 "
                                           r"dims\), got \[5\]"):
        op(torch.randn(5, device=device), 0.0)
    for shift in (math.nan, -1.0, math.inf):
        with pytest.raises(RuntimeError, match=r"torchkern.cholesky_qr: shift must be a finite number >= 0, got "):
            op(X, shift)
