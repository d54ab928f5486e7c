"""Helpers of the linalg tests: test matrices, float64 references, the eigensolver's accuracy bars.

Roots are checked against a float64 eigendecomposition of the same (dtype-rounded) input; eigendecompositions
against the bars below; kron and kron_precondition against explicit torch.kron products.
"""

from __future__ import annotations

import functools
import math
import re
import zlib

import pytest
import torch

from torchkern.linalg import twins


def generator(*key) -> torch.Generator:
    """A generator seeded from ``key`` (what the draws are for, and their parameters): a test's random input is the
    same whichever tests ran before it, under any ``-n`` and ``--dist``, so a failure reproduces."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def spd(n: int, cond: float = 10.0, batch: tuple = (), rank: int | None = None, draw: int = 0) -> torch.Tensor:
    """float64 symmetric PSD matrices with eigenvalues log-spaced in [1/cond, 1] (zeros past ``rank``); ``draw``
    tells apart the matrices of the same parameters."""
    gen = generator("spd", n, cond, tuple(batch), rank, draw)
    Q, _ = torch.linalg.qr(torch.randn(*batch, n, n, generator=gen, dtype=torch.float64))
    lam = torch.logspace(0, -math.log10(cond), n, dtype=torch.float64) if n > 1 else torch.ones(1, dtype=torch.float64)
    if rank is not None:
        lam[rank:] = 0
    G = (Q * lam) @ Q.mT
    return 0.5 * (G + G.mT)


def root_ref(G: torch.Tensor, p: int, eps: float) -> torch.Tensor:
    """float64 eigendecomposition root of (G + eps I), eigenvalues clamped at eps (docs/design.md, "Inverse
    roots")."""
    A = G.double().cpu()
    A = 0.5 * (A + A.mT) + eps * torch.eye(A.shape[-1], dtype=torch.float64)
    lam, Q = torch.linalg.eigh(A)
    return (Q * lam.clamp_min(max(eps, 1e-300)).pow(-1.0 / p).unsqueeze(-2)) @ Q.mT


def rel_err(X: torch.Tensor, R: torch.Tensor) -> float:
    X = X.double().cpu()
    return ((X - R).flatten(-2).norm(dim=-1) / R.flatten(-2).norm(dim=-1)).max().item()


def newton_tol(dtype: torch.dtype) -> float:
    return 1e-12 if dtype == torch.float64 else 1e-6


def raises(message: str):
    """pytest.raises for a RuntimeError whose message is exactly ``message``."""
    return pytest.raises(RuntimeError, match="^" + re.escape(message) + "$")


# The eigensolver's bars: ||A V - V diag(w)||_F <= 1e-5 ||A||_F and ||V^T V - I||_2 <= 1e-5 in float32 (1e-12 in
# float64; the spectral norm: in Frobenius norm even LAPACK's float32 eigenvectors exceed 1e-5 from n = 128 on),
# eigenvalues within float32's floor of a float64 reference (rounding A to float32 alone moves them by up to
# eps ||A||_F).
EIGH_RES = {torch.float32: 1e-5, torch.float64: 1e-12}
EIGH_ORTH = {torch.float32: 1e-5, torch.float64: 1e-12}
# eigenvalue error over ||A||_F: a backward-stable solver's floor is about sqrt(n) eps (seen in float32: 8.6 eps at
# n = 136, condition 1e8); 16 eps covers n <= 256 in float32
EIGH_VALUES = {torch.float32: 16 * torch.finfo(torch.float32).eps, torch.float64: 1e-12}
EIGH_KINDS = ["random", "clustered", "repeated", "rank_deficient", "cond1e8", "zero", "diagonal"]
# CUDA eigh's solvers: "auto" (the fastest for the shape, linalg/constants.py), or at every size "jacobi" (the Jacobi
# kernels), "tridiagonal" (Householder reduction and inverse iteration, float32 compute only) or "cusolver" (cuSOLVER's
# batched solver, where the loaded cuSOLVER has it)
EIGH_SOLVERS = list(twins.EIGH_SOLVERS)


def spectrum(kind: str, n: int, batch: tuple = (), draw: int = 0) -> torch.Tensor:
    """float64 symmetric test matrices of one spectrum class (``draw``: as for :func:`spd`)."""
    gen = generator("spectrum", kind, n, tuple(batch), draw)
    Q, _ = torch.linalg.qr(torch.randn(*batch, n, n, generator=gen, dtype=torch.float64))
    if kind == "random":
        G = torch.randn(*batch, n, n, generator=gen, dtype=torch.float64)
        return G + G.mT
    if kind == "clustered":  # eigenvalues within 1e-6 of each other, and of -1
        lam = torch.cat([1 + 1e-6 * torch.rand(n - n // 2, generator=gen, dtype=torch.float64),
                         -1 + 1e-6 * torch.rand(n // 2, generator=gen, dtype=torch.float64)])
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
        return torch.diag_embed(torch.randn(*batch, n, generator=gen, dtype=torch.float64))
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


def skip_solver(device: str, solver: str, dtype: torch.dtype = torch.float32) -> None:
    if device == "cpu" and solver != "auto":
        pytest.skip("the solver choice is CUDA's (the CPU runs LAPACK either way)")
    if solver == "tridiagonal" and dtype == torch.float64:
        pytest.skip("the tridiagonal solver computes in float32 (test_eigh_bad_inputs: float64 is refused)")
    if solver == "cusolver" and not cusolver_available():
        pytest.skip("the loaded cuSOLVER has no cusolverDnXsyevBatched")


@functools.cache
def cusolver_available() -> bool:
    try:
        torch.ops.torchkern.eigh(torch.eye(2, device="cuda"), None, "cusolver")
    except RuntimeError as exc:
        if "needs cusolverDnXsyevBatched" in str(exc):
            return False
        raise
    return True
