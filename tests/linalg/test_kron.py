"""kron (an exact batched Kronecker product) and kron_precondition, against explicit torch.kron products."""

from __future__ import annotations

import pytest
import torch
from linalg_testing import raises, spd
from testing import devices, dtypes, noncontiguous, randn, requires_cuda

import torchkern
from torchkern import linalg
from torchkern._library import has_cuda_kernel
from torchkern.linalg import twins


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
    with raises("torchkern.kron: A must have shape [..., m, n] (at least 2 dims), got [3]"):
        linalg.kron(A[0], A)
    with raises("torchkern.kron: B must have dtype float32 like A, got float64"):
        linalg.kron(A, A.double())
    with raises("torchkern.kron: the batch dims of A [2, 2, 3] and B [3, 2, 3] do not broadcast"):
        linalg.kron(torch.randn(2, 2, 3), torch.randn(3, 2, 3))
    with raises("torchkern.kron: A must be float32, float64, float16 or bfloat16, got int64"):
        linalg.kron(A.long(), A)


@requires_cuda
def test_kron_large_kernel():
    A, B = randn(4, 16, 16, device="cuda"), randn(4, 32, 36, device="cuda")
    torch.testing.assert_close(linalg.kron(A, B), twins.kron(A, B), rtol=0, atol=0)


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
    with raises("torchkern.kron_precondition: left must have shape [4, 4] (m = grad.shape[-2]) or be a tuple "
                 "(Q, d), got [3, 3]"):
        linalg.kron_precondition(grad, R, R)
    with raises("torchkern.kron_precondition: right must have shape [3, 3] (n = grad.shape[-1]) or be a tuple "
                 "(Q, d), got [4, 4]"):
        linalg.kron_precondition(grad, L, L)
    with raises("torchkern.kron_precondition: left[1] (d) must have shape [4] like left[0] (Q) without its last "
                 "dim, got [3]"):
        linalg.kron_precondition(grad, (Q, torch.ones(3)), (R, torch.ones(3)))
    with raises("torchkern.kron_precondition: left and right must both be inverse factors or both be (Q, d) "
                 "eigendecompositions, got left as (Q, d) and right as a tensor"):
        linalg.kron_precondition(grad, (Q, d), R)
    with raises("torchkern.kron_precondition: damping applies to the (Q, d) form only (fold it into the inverse "
                 "factors), got damping=0.1 with inverse factors"):
        linalg.kron_precondition(grad, L, R, 0.1)
    with raises("torchkern.kron_precondition: grad must have shape [..., m, n] (at least 2 dims), got [3]"):
        linalg.kron_precondition(grad[0], L, R)
    with raises("torchkern.kron_precondition: left must have dtype float32 like grad, got float64"):
        linalg.kron_precondition(grad, L.double(), R)
    with raises("torchkern.kron_precondition: left must be a tensor (an inverse factor) or a tuple (Q, d) "
                 "(an eigendecomposition), got int"):
        linalg.kron_precondition(grad, 3, R)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_kron_opcheck(device):
    A, B = randn(2, 3, 4, device=device, requires_grad=True), randn(1, 5, 2, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.torchkern.kron.default, (A, B))
    torch.library.opcheck(torch.ops.torchkern.kron.default, (A[0].detach(), B[0].detach()))


def test_kron_has_cuda_kernel_when_built():
    info = torchkern.backend_info()
    if info.backend != "cuda":
        pytest.skip(f"backend is {info.backend}: {info.reason}")
    assert has_cuda_kernel("kron")
