"""Eigenbases of the Kronecker factors: the power step against Householder QR of the ordered product, of padded
matrices as of unpadded ones; the numerical null space of a rank-deficient factor filled by the previous basis, so
that bases, and SOAP's steps, are continuous in the gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchkern.optim import SOAP
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


def _rank_deficient(n, rank, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(n, rank, generator=g, dtype=torch.float64)
    return (W @ W.T).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_eigenbasis_fills_the_null_space_from_the_previous_basis(dtype, warm):
    """A factor of rank 5 of 12: its 5 resolved eigenvectors, largest first, then the previous basis's trailing
    columns (the axes for a cold start) made orthogonal to them: eigh's arbitrary null-space basis never shows, so
    a factor that differs by a relative 1e-15 gets the same basis to rounding."""
    from torchkern.optim._eigenbases import eigenbasis

    S = _rank_deficient(12, 5, 0, dtype)[None]
    Q0 = torch.linalg.qr(torch.randn(1, 12, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64))[0]
    Q0 = Q0.to(dtype) if warm else None
    Q = eigenbasis(S, Q0)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    eye = torch.eye(12, dtype=torch.float64)
    assert (Q[0].double().T @ Q[0].double() - eye).abs().max() < tol
    d, V = torch.linalg.eigh(S[0].double())
    assert ((Q[0, :, :5].double().T @ V[:, -5:]).abs().sum(0) - 1).abs().max() < 10 * tol  # the resolved eigenvectors
    ref = eye if Q0 is None else Q0[0].double()
    null = torch.eye(12, dtype=torch.float64) - V[:, -5:] @ V[:, -5:].T
    expected = torch.linalg.qr(torch.cat([Q[0, :, :5].double(), null @ ref[:, 5:]], 1))[0][:, 5:]
    assert ((Q[0, :, 5:].double().T @ expected).abs().diagonal() - 1).abs().max() < 100 * tol
    perturbed = eigenbasis(S * (1 + 1e-15) + 1e-17 * S.abs().max() * torch.eye(12, dtype=dtype), Q0)
    assert (perturbed.double() - Q.double()).abs().max() < (1e-9 if dtype == torch.float64 else 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_power_step_fills_the_null_space_from_the_previous_basis(dtype):
    """A rank-5 factor seen from a basis far from its eigenbasis (every column of Q0^T S Q0 nonzero, 5 independent):
    the first 5 columns span S's range, the other 7 are the columns of Q0 sorted into those slots (by their Rayleigh
    quotients) made orthogonal to them, so a factor that differs by a relative 1e-15 gets the same basis."""
    from torchkern.optim._eigenbases import power_step

    S = _rank_deficient(12, 5, 2, dtype)[None]
    Q0 = torch.linalg.qr(torch.randn(1, 12, 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64))[0]
    Q = power_step(S, Q0.to(dtype), complete=True).double()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    _, V = torch.linalg.eigh(S[0].double())
    range_ = V[:, -5:]
    assert (range_.T @ Q[0, :, :5]).svd().S.min() > 1 - 10 * tol  # the leading columns span the range
    null = torch.eye(12, dtype=torch.float64) - range_ @ range_.T
    order = (Q0[0] * (S[0].double() @ Q0[0])).sum(0).sort(descending=True, stable=True).indices
    expected = torch.linalg.qr(torch.cat([Q[0, :, :5], null @ Q0[0][:, order[5:]]], 1))[0][:, 5:]
    assert ((Q[0, :, 5:].T @ expected).abs().diagonal() - 1).abs().max() < 100 * tol
    perturbed = power_step(S * (1 + 1e-15), Q0.to(dtype), complete=True).double()
    assert (perturbed - Q).abs().max() < (1e-9 if dtype == torch.float64 else 1e-3)


def _soap_run(refresh, perturb=None, halves=False, steps=6):
    """The float64 12 -> 24 (tanh) -> 5 MLP, 16-row batches, SOAP(lr=1e-2, precondition_frequency=2): its parameters
    after ``steps`` steps, with every gradient multiplied by (1 + ``perturb``) or each batch's gradient taken as two
    half-batch backward passes (both change the gradients by rounding only)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 5)).double()
    opt = SOAP(model.parameters(), lr=1e-2, precondition_frequency=2, refresh=refresh)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 12, generator=g, dtype=torch.float64), torch.randint(0, 5, (16,), generator=g)
        opt.zero_grad()
        if halves:
            for part in (slice(0, 8), slice(8, 16)):
                (F.cross_entropy(model(x[part]), y[part]) / 2).backward()
        else:
            F.cross_entropy(model(x), y).backward()
        if perturb:
            for p in model.parameters():
                p.grad.mul_(1 + perturb)
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("refresh", ["qr", "eigh"])
def test_soap_steps_are_continuous_in_the_gradients(refresh):
    """Gradients that differ by rounding (a relative 1e-15, or a batch's gradient as two half-batch passes) move the
    parameters after six steps by 1e-9 at most: the rank-deficient first factors' null spaces get the same bases
    (they moved by 3e-2 when an eigensolver's choice there reached Adam's per-coordinate normalization)."""
    base = _soap_run(refresh)
    assert (_soap_run(refresh, perturb=1e-15) - base).abs().max() <= 1e-9
    assert (_soap_run(refresh, halves=True) - base).abs().max() <= 1e-9
