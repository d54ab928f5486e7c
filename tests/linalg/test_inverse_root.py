"""matrix_inverse_root, the public function: accuracy against a float64 eigendecomposition root of the same
(dtype-rounded) input, batch shapes and layouts, errors, and the roots that must never be NaN (the fallback of a
Newton iteration that does not converge, the symmetric part on every path, extreme scales)."""

from __future__ import annotations

import pytest
import torch
from linalg_testing import generator, newton_tol, raises, rel_err, root_ref, spd
from testing import devices, dtypes, noncontiguous

from torchkern import linalg
from torchkern.linalg import twins


# relative Frobenius error bounds against a float64 eigh root, measured with ~5x margin
WELL_TOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
COND_TOL_F32_NEWTON = {1: 5e-2, 2: 2e-2, 4: 6e-3, 8: 2e-3}
RANKDEF_TOL_F32 = 5e-4
COND_TOL_NEWTON_F32 = {1e2: 1e-5, 1e4: 2e-4, 1e6: 1.5e-2}  # the docstring's numbers with ~5x margin


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


def test_public_api_matches_twin_signature():
    import inspect
    assert list(inspect.signature(linalg.matrix_inverse_root).parameters) == \
        list(inspect.signature(twins.matrix_inverse_root).parameters)
    G = spd(6, 10.0, batch=(2,)).float()
    for method in ("newton", "eigh"):
        torch.testing.assert_close(linalg.matrix_inverse_root(G, 4, method=method),
                                   twins.matrix_inverse_root(G, 4, method=method))


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("method", ["newton", "eigh"])
def test_root_nan_names_the_matrices(device, method):
    G = spd(8, 10.0, batch=(2, 3)).float().to(device)
    G[0, 2, 1, 1] = float("nan")
    G[1, 0, 3, 4] = float("inf")
    with raises("torchkern.matrix_inverse_root: G contains NaN or Inf in the matrices at batch indices "
                 "[(0, 2), (1, 0)]"):
        linalg.matrix_inverse_root(G, 4, method=method)
    with raises("torchkern.matrix_inverse_root: G contains NaN or Inf in the matrices at batch indices [2]"):
        linalg.matrix_inverse_root(G[0], 4, method=method)
    with raises("torchkern.matrix_inverse_root: G contains NaN or Inf"):
        linalg.matrix_inverse_root(G[0, 2], 4, method=method)


def test_root_bad_inputs():
    G = spd(4, 10.0).float()
    with raises("torchkern.matrix_inverse_root: G must have shape [..., n, n] (square matrices), got [3, 4]"):
        linalg.matrix_inverse_root(G[:3], 4)
    with raises("torchkern.matrix_inverse_root: G must have shape [..., n, n] (square matrices), got [4]"):
        linalg.matrix_inverse_root(G[0], 4)
    with raises("torchkern.matrix_inverse_root: p must be a positive integer, got 0"):
        linalg.matrix_inverse_root(G, 0)
    with raises("torchkern.matrix_inverse_root: p must be a positive integer, got 2.5"):
        linalg.matrix_inverse_root(G, 2.5)
    with raises("torchkern.matrix_inverse_root: method must be 'auto', 'eigh' or 'newton', got 'svd'"):
        linalg.matrix_inverse_root(G, 4, method="svd")
    with raises("torchkern.matrix_inverse_root: G must be float32, float64, float16 or bfloat16, got int64"):
        linalg.matrix_inverse_root(torch.eye(3, dtype=torch.long), 4)
    with raises("torchkern.matrix_inverse_root: eps must be a finite number in [0, 3.40282e+38] (the range of "
                 "float32, the compute dtype), got -1"):
        linalg.matrix_inverse_root(G, 4, eps=-1.0)


def newton_op_roots(G: torch.Tensor, p: int, eps: float) -> torch.Tensor:
    return torch.ops.torchkern.matrix_inverse_root_newton(G, p, eps, 100, 1e-6)[0]


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_root_rank_deficient_statistics_fall_back(device):
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
    indefinite = spd(n, 10.0, draw=1) - 0.5 * torch.eye(n, dtype=torch.float64)  # not PSD: Newton surely diverges
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
    # a non-symmetric G is the same as its symmetric part, for every method and kernel path
    G = spd(n, 10.0, batch=(2,))
    S = torch.randn(2, n, n, generator=generator("skew", n), dtype=torch.float64) * 0.05
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
