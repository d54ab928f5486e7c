"""Eigenbases of the Kronecker factors: the power step against Householder QR of the ordered product, of padded
matrices as of unpadded ones."""

from __future__ import annotations

import pytest
import torch

from testing import devices


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [48, 150])
def test_soap_power_step_is_qr_of_the_ordered_product(device, dtype, n):
    """power_step against Householder QR of S Q0 P (float64), column by column up to sign, on statistics of full
    rank, of rank 5, zero, and 1e8-conditioned; the result is orthonormal and finite in every case. n = 150
    takes the triangular inverse's block levels (its leaf is 64)."""
    from torchkern.optim._eigenbases import power_step

    g = torch.Generator().manual_seed(0)
    W = torch.randn(4, n, n, generator=g, dtype=torch.float64)
    S = W @ W.mT / n
    S[1] = W[1, :, :5] @ W[1, :, :5].T  # rank 5
    S[2] = 0.0
    V = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    S[3] = (V * torch.logspace(0, -8, n, dtype=torch.float64)) @ V.T
    # the previous bases: eigenbases of nearby statistics (as an optimizer's are), and the identity
    Q0 = torch.linalg.eigh(S + 0.05 * torch.eye(n, dtype=torch.float64) * torch.rand(n, generator=g,
                                                                                     dtype=torch.float64))[1]
    Q0[2] = torch.eye(n, dtype=torch.float64)
    S, Q0 = S.to(device, dtype), Q0.to(device, dtype)
    Q = power_step(S, Q0)
    assert Q.dtype == dtype and torch.isfinite(Q).all()
    eye = torch.eye(n, dtype=torch.float64, device=device)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert (Q.double().mT @ Q.double() - eye).abs().max() < tol
    SQ = S.double() @ Q0.double()
    order = (Q0.double() * SQ).sum(-2).argsort(dim=-1, descending=True)
    ref = torch.linalg.qr(SQ.gather(-1, order[:, None, :].expand_as(SQ)))[0]
    # columns resolved by the data agree with Householder's up to sign; beyond S's rank any completion is a QR, and
    # float32 products resolve directions down to about 1e-4 of the largest eigenvalue (of 1e-8: the first half)
    for b, rank in ((0, n), (1, 5), (3, n if dtype == torch.float64 else n // 2)):
        cos = (Q[b].double() * ref[b]).sum(0).abs()[:rank]
        assert cos.min() > 1 - (1e-4 if dtype == torch.float32 else 1e-9), (b, cos.min())
    assert torch.equal(Q[2], Q0[2])  # zero statistics: the basis stays (every column keeps its axis)



@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_soap_power_step_of_padded_matrices(device, dtype):
    """power_step with ``sizes``: each padded matrix's step is the unpadded matrix's step (to rounding), with the
    identity on the padding and exact zeros between the two."""
    from torchkern.optim._eigenbases import power_step

    g = torch.Generator().manual_seed(0)
    sizes, n = [5, 8, 3, 1], 8
    S, Q0 = torch.zeros(4, n, n, dtype=torch.float64), torch.eye(n, dtype=torch.float64).repeat(4, 1, 1)
    for j, d in enumerate(sizes):
        W = torch.randn(d, d + 2, generator=g, dtype=torch.float64)
        S[j, :d, :d] = W @ W.T
        Q0[j, :d, :d] = torch.linalg.eigh(S[j, :d, :d] + 0.1 * torch.diag(torch.rand(d, generator=g,
                                                                                    dtype=torch.float64)))[1]
    S, Q0 = S.to(device, dtype), Q0.to(device, dtype)
    Q = power_step(S, Q0, torch.tensor(sizes, device=device))
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for j, d in enumerate(sizes):
        ref = power_step(S[j:j + 1, :d, :d], Q0[j:j + 1, :d, :d])[0]
        torch.testing.assert_close(Q[j, :d, :d], ref, rtol=tol, atol=tol)
        assert torch.equal(Q[j, d:, d:], torch.eye(n - d, dtype=dtype, device=device))
        assert not Q[j, :d, d:].any() and not Q[j, d:, :d].any()
