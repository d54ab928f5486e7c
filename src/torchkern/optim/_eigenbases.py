"""Eigenbases of Kronecker factors: eigendecompositions (warm-started where the linalg family can), one step of
power iteration from a previous basis, and Rayleigh quotients. SOAP's bases, K-FAC's and Shampoo's "qr" refreshes."""

from __future__ import annotations

import math

import torch


def eigh(A: torch.Tensor, Q0: torch.Tensor | None = None,
         tol: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (ascending) and eigenvectors of a batch of symmetric matrices (..., n, n); ``tol``: the Jacobi
    kernels' stopping tolerance (:func:`torchkern.linalg.eigh`).

    ``torch.ops.torchkern.eigh`` (:func:`torchkern.linalg.eigh` without its NaN check, so no host sync; a
    non-finite result is NaN, which the callers' guards drop), warm-started from the previous basis ``Q0``:
    statistics that change slowly converge in a sweep or two from there. ``torch.linalg.eigh`` where the
    linalg family has no such op. A float32 decomposition that does not converge (clustered spectra, on the
    LAPACK/cuSOLVER paths that raise) is retried in float64.
    """
    try:
        if hasattr(torch.ops.torchkern, "eigh"):
            return torch.ops.torchkern.eigh(A, Q0, "auto", tol)
        return torch.linalg.eigh(A)
    except torch.linalg.LinAlgError:
        if A.dtype == torch.float64:
            raise
        d, Q = torch.linalg.eigh(A.double())
        return d.to(A.dtype), Q.to(A.dtype)


def power_step(S: torch.Tensor, Q0: torch.Tensor, sizes: torch.Tensor | None = None) -> torch.Tensor:
    """One step of power iteration from the bases ``Q0``: ``qr(S Q0 P)`` for a batch (k, n, n), ``P`` ordering the
    columns by their Rayleigh quotients ``q_j^T S q_j``, largest first, and R's diagonal positive.

    ``sizes`` (k,) int64, optional: matrix j is padded, its own statistics in the leading ``sizes[j]`` rows and
    columns, zeros around them, and Q0's padding the identity (SOAP's buckets). The padding's columns are ordered
    last and keep their axes, so the result is the unpadded matrix's step with an identity block beside it.

    Householder QR of many 1024^2 matrices is slow on GPUs (its panels are sequential: 36 ms for eight on an
    H100). Since ``Q0`` is orthogonal, ``qr(S Q0 P) = Q0 qr(M P)`` with ``M = Q0^T S Q0``, whose columns, once
    scaled to unit norm (which leaves Q unchanged), are close to the axes wherever ``Q0`` is close to the
    eigenbasis: that is well conditioned, and Cholesky QR in float64 factors it (``torch.ops.torchkern.cholesky_qr``:
    on CUDA a factorization blocked by 64 columns, each block's factor and its inverse in one launch, the rest in
    batched products); a first pass shifted by ``11 (n^2 + n (n + 1)) u ||X||^2`` (Fukaya et al. 2020, shifted
    CholeskyQR) cannot break down on rank-deficient statistics, and unshifted passes restore orthogonality. The
    passes together give X's own Q factor whatever the shift (the product of their triangular factors is X's R),
    so one shift, from the padded size, serves every matrix of a batch. A column at the level of rounding (a
    direction the statistics never saw) keeps its own axis. A failed factorization makes its matrix NaN, so the
    caller's finiteness check keeps the old basis (docs/design.md, "SOAP")."""
    k, n = S.shape[0], S.shape[-1]
    wide = torch.float64
    M = (Q0.mT @ (S @ Q0)).to(wide)
    key = M.diagonal(dim1=-2, dim2=-1)
    size = torch.full((k, 1, 1), n, dtype=wide, device=S.device) if sizes is None else sizes.to(wide)[:, None, None]
    if sizes is not None:  # the padding's columns last
        pad = torch.arange(n, device=S.device) >= sizes[:, None]
        key = torch.where(pad, -math.inf, key)
    order = key.argsort(dim=-1, descending=True)
    X = M.gather(-1, order.unsqueeze(-2).expand_as(M))
    norms = torch.linalg.vector_norm(X, dim=-2, keepdim=True)
    # a column below the rounding of M's products carries no direction: it keeps its own axis (which, M being
    # PSD, its near-zero row leaves orthogonal to the other columns); so do the padding's zero columns
    floor = size * torch.finfo(S.dtype).eps * norms.amax(dim=-1, keepdim=True)
    eye = torch.eye(n, dtype=wide, device=S.device)
    X = torch.where(norms > floor, X / norms, eye)
    shift = 11 * (2 * n * n + n) * torch.finfo(wide).eps * n  # ||X||_2^2 <= ||X||_F^2 = n
    # after the shifted pass cond(X) <~ sqrt(n / shift); each unshifted pass leaves cond^2 u of orthogonality
    # error: one reaches float32's 1e-7 at worst, float64 statistics take a second
    for s in (shift, 0.0) if S.dtype != torch.float64 else (shift, 0.0, 0.0):
        X = torch.ops.torchkern.cholesky_qr(X, s)
    return (Q0.to(wide) @ X).to(S.dtype)


def rayleigh_quotients(S: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """``q_j^T S q_j`` for every column of the bases Q (k, n, n): S's eigenvalues where Q is its eigenbasis, the
    diagonal of S in Q otherwise (the eigenvalues K-FAC's and Shampoo's "qr" refreshes take with power_step)."""
    return (Q * (S @ Q)).sum(dim=-2)
