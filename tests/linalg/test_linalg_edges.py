"""The public linalg functions at their edges: arguments whose results could not be finite, warm starts that are
not orthogonal, factor shapes that would broadcast into another result, and torch.compile(fullgraph=True)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from linalg_testing import check_eigh, generator, raises, rel_err, root_ref, spd, spectrum
from testing import devices, requires_cuda

from torchkern import linalg
from torchkern.linalg import constants, finish, twins

F32_MAX = "3.40282e+38"

# ----------------------------------------------------------------------------- roots: eps and the result's range


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("method", ["newton", "eigh"])
@pytest.mark.parametrize("eps", [float("inf"), float("nan"), 1e39])
def test_root_eps_beyond_the_compute_range_is_refused(device, method, eps):
    G = torch.eye(2, device=device)
    message = (f"torchkern.matrix_inverse_root: eps must be a finite number in [0, {F32_MAX}] (the range of float32, "
               f"the compute dtype), got {eps:g}")
    for half in (torch.float32, torch.float16):  # half types compute in float32
        with raises(message):
            linalg.matrix_inverse_root(G.to(half), 4, eps=eps, method=method)
        with raises(message):
            twins.matrix_inverse_root(G.to(half), 4, eps=eps, method=method)
    with raises(message):  # the op itself (its kernel casts eps to the compute type)
        torch.ops.torchkern.matrix_inverse_root_newton(G, 4, eps, 10, 1e-6)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("method", ["newton", "eigh"])
def test_root_eps_within_float64_with_float64_compute(device, method):
    # 1e39 is beyond float32 but float64=True computes in float64: (I + 1e39 I)^(-1/4), returned in float32
    X = linalg.matrix_inverse_root(torch.eye(3, device=device), 4, eps=1e39, method=method, float64=True)
    torch.testing.assert_close(X.cpu(), torch.eye(3) * (1 + 1e39) ** -0.25, rtol=1e-6, atol=0)
    with raises("torchkern.matrix_inverse_root: eps must be a finite number in [0, 1.79769e+308] (the range of "
                "float64, the compute dtype), got inf"):
        linalg.matrix_inverse_root(torch.eye(3, device=device), 4, eps=float("inf"), method=method, float64=True)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("p", [1, 2])
def test_root_float16_newton_of_a_root_beyond_float16(device, p):
    # zeros with eps = 1e-6: the float32 iteration converges to 1e6 (p = 1), beyond float16's 65504; that matrix
    # falls back to the eigh root, clamped at float16's smallest normal number, and its error is finite. p = 2
    # (1e3) fits and stays Newton's.
    G = torch.zeros(3, 4, 4, dtype=torch.float16, device=device)
    G[1] = torch.eye(4)
    for fn in (linalg.matrix_inverse_root, twins.matrix_inverse_root):
        X, err = fn(G, p, method="newton", return_error=True)
        assert torch.isfinite(X).all() and torch.isfinite(err).all(), (X, err)
        expected = torch.finfo(torch.float16).tiny ** -1.0 if p == 1 else 1e3
        torch.testing.assert_close(X[0].float().cpu(), expected * torch.eye(4), rtol=2e-3, atol=0)
        torch.testing.assert_close(X[1].float().cpu(), (1 + 1e-6) ** (-1 / p) * torch.eye(4), rtol=2e-3, atol=0)
        assert (err[1] <= 1e-2).all()
    refused = raises("torchkern.matrix_inverse_root: the Newton iteration did not converge in the matrices at batch "
                     "indices [0, 2] (error above max(tol, 0.001), not finite, or a root beyond float16's range); "
                     "fallback=True uses a float64 eigendecomposition for them")
    with refused if p == 1 else contextlib.nullcontext():
        linalg.matrix_inverse_root(G, p, method="newton", fallback=False)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("method", ["newton", "eigh"])
def test_root_near_the_top_of_float32(device, method):
    # entries near float32's largest value: G + eps I and the eigenvalues (up to 4e38, or 6e38 with eps) overflow
    # float32 unless the computation is scaled; the roots are finite and right
    G64 = torch.stack([1e38 * (torch.ones(3, 3, dtype=torch.float64) + torch.eye(3, dtype=torch.float64)),
                       3e38 * torch.eye(3, dtype=torch.float64)])
    G = G64.float().to(device)
    for eps in (1e-6, 3e38):
        X = linalg.matrix_inverse_root(G, 4, eps=eps, method=method)
        assert torch.isfinite(X).all()
        assert rel_err(X, root_ref(G, 4, eps)) <= 1e-5, eps


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_root_eigh_of_a_singular_huge_float64_matrix(device):
    # float64 at 1e300 with eps = 0 and a zero eigenvalue: the clamp's floor in the scaled units underflows; the
    # root stays finite
    G = torch.diag(torch.tensor([1e300, 0.0], dtype=torch.float64)).to(device)
    X = linalg.matrix_inverse_root(G, 2, eps=0.0, method="eigh")
    assert torch.isfinite(X).all()
    torch.testing.assert_close(X[0, 0].cpu(), torch.tensor(1e-150, dtype=torch.float64))


# ----------------------------------------------------------------------------- eigh: Q0 must be orthogonal


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_eigh_refuses_a_warm_start_that_is_not_orthogonal(device):
    n = 8
    A = spectrum("random", n, batch=(3,)).float().to(device)
    Q0 = torch.linalg.eigh(A.double().cpu())[1].float().to(device)
    bad = Q0.clone()
    bad[1] = bad[1] * 2  # orthogonal columns of norm 2: Q0^T A Q0 has 4x the eigenvalues
    with raises("torchkern.eigh: Q0 must be orthogonal (||Q0^T Q0 v - v|| <= 0.0001 ||v||), got 3 in the matrices "
                "at batch indices [1]"):
        linalg.eigh(A, bad)
    noise = torch.randn(n, n, generator=generator("skew", n)).to(device)
    skew = Q0[2] + 1e-2 * noise  # a basis from the wrong computation
    with pytest.raises(RuntimeError, match=r"^torchkern\.eigh: Q0 must be orthogonal \(.*\), got [0-9.]+$"):
        linalg.eigh(A[2], skew)
    w, V = linalg.eigh(A, Q0)  # the eigenbasis it came from passes
    check_eigh(A.double().cpu(), w, V, torch.float32)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16],
                         ids=["float32", "float64", "float16", "bfloat16"])
def test_eigh_orthogonality_tolerance_admits_every_orthogonal_basis(device, dtype):
    # bases from QR and from an eigensolver, rounded to the dtype, are within the tolerance; one scaled by
    # 1 + 10 tol is not
    n = 64
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    Q = torch.linalg.qr(torch.randn(2, n, n, generator=generator("qr", n, dtype), dtype=compute))[0]
    V = torch.linalg.eigh(spectrum("cond1e8", n, batch=(2,)).to(compute))[1]
    tol = finish.orthogonality_tol(dtype)
    for basis in (Q, V):
        assert finish.orthogonality_deviation(basis.to(dtype).to(device)).max().item() <= tol / 10
    assert (finish.orthogonality_deviation((Q * (1 + 10 * tol)).to(dtype).to(device)) > tol).all()
    assert tol == (constants.EIGH_Q0_ORTH_TOL_F64 if dtype == torch.float64 else
                   max(constants.EIGH_Q0_ORTH_TOL_F32, 16 * torch.finfo(dtype).eps))


# ----------------------------------------------------------------------------- kron_precondition: factor shapes


def test_kron_precondition_refuses_a_d_of_other_dims():
    grad = torch.randn(4, 3)
    QL, QR = torch.eye(4), torch.eye(3)
    with raises("torchkern.kron_precondition: left[1] (d) must have shape [4] like left[0] (Q) without its last "
                "dim, got [2, 4]"):
        linalg.kron_precondition(grad, (QL, torch.ones(2, 4)), (QR, torch.ones(3)))
    with raises("torchkern.kron_precondition: right[1] (d) must have shape [2, 3] like right[0] (Q) without its last "
                "dim, got [3]"):
        linalg.kron_precondition(grad, (QL, torch.ones(4)), (QR.expand(2, 3, 3), torch.ones(3)))
    with raises("torchkern.kron_precondition: the batch dims of grad [2, 4, 3], left [3, 4, 4] and right [3, 3] do "
                "not broadcast"):
        linalg.kron_precondition(torch.randn(2, 4, 3), (QL.expand(3, 4, 4), torch.ones(3, 4)), (QR, torch.ones(3)))
    with raises("torchkern.kron_precondition: damping must be a finite number >= 0, got inf"):
        linalg.kron_precondition(grad, (QL, torch.ones(4)), (QR, torch.ones(3)), float("inf"))


def test_kron_precondition_batched_factors_pair_matrix_by_matrix():
    # a batch of eigendecompositions (K-FAC's stacked factors): each gradient by its own pair
    m, n = 4, 3
    L, R = spd(m, 20.0, batch=(2,)), spd(n, 20.0, batch=(2,))
    dL, QL = torch.linalg.eigh(L)
    dR, QR = torch.linalg.eigh(R)
    grad = torch.randn(2, m, n, generator=generator("grad", m, n), dtype=torch.float64)
    out = linalg.kron_precondition(grad, (QL, dL), (QR, dR), 0.1)
    for i in range(2):
        K = torch.kron(L[i], R[i]) + 0.1 * torch.eye(m * n, dtype=torch.float64)
        torch.testing.assert_close(out[i], torch.linalg.solve(K, grad[i].reshape(-1)).reshape(m, n))


# ----------------------------------------------------------------------------- torch.compile(fullgraph=True)


def _compiled(fn, backend="aot_eager"):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_compile_fullgraph_eigh_and_roots(device):
    A = spectrum("random", 6, batch=(2,)).float().to(device)
    Q0 = torch.linalg.eigh(A.double().cpu())[1].float().to(device)
    G = spd(6, 10.0, batch=(2,)).float().to(device)
    cases = {
        "eigh": (lambda a: linalg.eigh(a), (A,)),
        "eigh_warm": (lambda a, q: linalg.eigh(a, q), (A, Q0)),
        "root_eigh": (lambda g: linalg.matrix_inverse_root(g, 4, method="eigh"), (G,)),
        "root_newton": (lambda g: linalg.matrix_inverse_root(g, 4, method="newton", return_error=True), (G,)),
        "root_auto": (lambda g: linalg.matrix_inverse_root(g, 2), (G,)),
    }
    for name, (fn, args) in cases.items():
        got, expected = _compiled(fn)(*args), fn(*args)
        for g, e in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else
                        (expected,)):
            torch.testing.assert_close(g.abs(), e.abs(), msg=name)  # (eigenvector signs are free)
    bad = A.clone()
    bad[1, 0, 0] = float("nan")
    with raises("torchkern.eigh: A contains NaN or Inf in the matrices at batch indices [1]"):
        _compiled(lambda a: linalg.eigh(a))(bad)  # the check stays in the graph


def test_compile_fullgraph_eigh_backward():
    A = spectrum("random", 5, batch=(2,)).requires_grad_(True)
    fn = lambda a: linalg.eigh(a)[0].pow(2).sum()  # noqa: E731
    (g_compiled,) = torch.autograd.grad(_compiled(fn)(A), A)
    (g_eager,) = torch.autograd.grad(fn(A), A)
    torch.testing.assert_close(g_compiled, g_eager)


@requires_cuda
def test_compile_fullgraph_inductor_cuda():
    G = spd(32, 10.0, batch=(4,)).float().cuda()
    fn = lambda g: linalg.matrix_inverse_root(g, 4) + linalg.eigh(g)[0].sum()  # noqa: E731
    torch.testing.assert_close(_compiled(fn, "inductor")(G), fn(G))


def test_finish_ops_opcheck():
    A = spectrum("random", 5, batch=(2,)).float()
    w, V = torch.ops.torchkern.eigh(A)
    torch.library.opcheck(torch.ops.torchkern._eigh_finish.default, (w, A, V))
    torch.library.opcheck(torch.ops.torchkern._eigh_finish.default, (w.double().requires_grad_(True), A.double(),
                                                                      None, "matrix_inverse_root", "G"))
    G = spd(5, 10.0, batch=(2,)).float()
    root, err, _ = torch.ops.torchkern.matrix_inverse_root_newton(G, 4, 1e-6, 100, 1e-6)
    torch.library.opcheck(torch.ops.torchkern._newton_finish.default, (G, root, err, 4, 1e-6, 1e-6, True))
