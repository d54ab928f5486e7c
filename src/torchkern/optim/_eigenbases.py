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


def null_floor(S: torch.Tensor) -> torch.Tensor:
    """(k,) for factors S (k, n, n): ``n u ||S||_F`` with ``u`` the unit roundoff of S's dtype, the size of the
    rounding in S and in its eigendecomposition (eigh's backward error). An eigenvalue (or Rayleigh quotient) at
    or below it belongs to the factor's numerical null space: directions the statistics never resolved."""
    return S.shape[-1] * torch.finfo(S.dtype).eps * torch.linalg.matrix_norm(S)


def _orthonormalize(X: torch.Tensor, passes: tuple[float, ...]) -> torch.Tensor:
    """Cholesky QR passes of X (k, n, n, float64) with the given shifts: the Q factor, i.e. Gram-Schmidt of the
    columns in their order (each pass's triangular factor keeps the span of every leading set of columns)."""
    for shift in passes:
        X = torch.ops.torchkern.cholesky_qr(X, shift)
    return X


def _shifts(n: int, dtype: torch.dtype) -> tuple[float, ...]:
    """Shifted Cholesky QR (Fukaya et al. 2020) for unit columns (``||X||_2^2 <= ||X||_F^2 = n``): the shifted pass
    cannot break down on nearly dependent columns; after it cond(X) <~ sqrt(n / shift), and each unshifted pass
    leaves cond^2 u of orthogonality error: one reaches float32's 1e-7 at worst, float64 bases take a second."""
    shift = 11 * (2 * n * n + n) * torch.finfo(torch.float64).eps * n
    return (shift, 0.0) if dtype != torch.float64 else (shift, 0.0, 0.0)


def _complete(Y: torch.Tensor, live: torch.Tensor, dtype: torch.dtype,
              axes: torch.Tensor | None = None) -> torch.Tensor:
    """The columns of Y (k, n, n, float64, columns in order of importance) where ``live`` (k, n), made orthonormal,
    and in every other slot j the axis e_j (column j of ``axes`` if given), made orthogonal to the columns before
    it (Gram-Schmidt in order).

    Where a factor is rank-deficient, the eigenvectors of its numerical null space are any orthonormal basis of
    it: an eigensolver's (or a QR's) choice there is rounding, and two factors that differ by a rounding error get
    unrelated bases. SOAP's Adam normalizes per coordinate of the basis, and the next gradients have components
    in those directions, so that choice would reach the update (a relative change of 1e-15 in the gradients moved
    a float64 run's parameters by 3e-2 after six steps). Filling the null space from the axes in a fixed order
    makes the basis a continuous function of the factor there too; in a previous basis's frame the axes are its
    own columns, so directions the statistics still do not resolve keep the basis they had."""
    n = Y.shape[-1]
    if axes is None:
        axes = torch.eye(n, dtype=Y.dtype, device=Y.device)
    X = torch.where(live.unsqueeze(-2), Y / torch.linalg.vector_norm(Y, dim=-2, keepdim=True).clamp_min(1e-300), axes)
    return _orthonormalize(X, _shifts(n, dtype))


def eigenbasis(S: torch.Tensor, Q0: torch.Tensor | None = None) -> torch.Tensor:
    """The eigenbases (k, n, n) of factors S (k, n, n), columns by eigenvalue, largest first, by an eigendecomposition
    warm-started from the previous bases ``Q0`` (:func:`eigh`); in each numerical null space (:func:`null_floor`)
    the previous basis's trailing columns (the axes without ``Q0``), made orthogonal to the rest
    (:func:`_complete`). A non-finite factor gives NaN (the callers keep their old basis)."""
    d, Q = eigh(S, Q0)
    d, Q = d.flip(-1), Q.flip(-1).to(torch.float64)  # largest first: the null space fills the trailing slots
    live = d > null_floor(S).unsqueeze(-1)
    if Q0 is None:
        return _complete(Q, live, S.dtype).to(S.dtype)
    Q0 = Q0.to(torch.float64)
    return (Q0 @ _complete(Q0.mT @ Q, live, S.dtype)).to(S.dtype)


def power_step(S: torch.Tensor, Q0: torch.Tensor, sizes: torch.Tensor | None = None,
               complete: bool = False) -> torch.Tensor:
    """One step of power iteration from the bases ``Q0``: ``qr(S Q0 P)`` for a batch (k, n, n), ``P`` ordering the
    columns by their Rayleigh quotients ``q_j^T S q_j``, largest first, and R's diagonal positive. ``complete``: the
    columns beyond S's numerical rank, which are rounding, are Q0's own made orthogonal to the rest
    (:func:`_complete`; SOAP's bases, whose null-space columns reach its update: Shampoo's roots and K-FAC's
    preconditioner are the same for any basis of a null space).

    ``sizes`` (k,) int64, optional: matrix j is padded, its own statistics in the leading ``sizes[j]`` rows and
    columns, zeros around them, and Q0's padding the identity (SOAP's buckets). The padding's columns are ordered
    last and keep their axes, so the result is the unpadded matrix's step with an identity block beside it.

    Householder QR of many 1024^2 matrices is slow on GPUs (its panels are sequential: 36 ms for eight on an
    H100). Since ``Q0`` is orthogonal, ``qr(S Q0 P) = Q0 qr(M P)`` with ``M = Q0^T S Q0``, whose columns, once
    scaled to unit norm (which leaves Q unchanged), are close to the axes wherever ``Q0`` is close to the
    eigenbasis: that is well conditioned, and Cholesky QR in float64 factors it (``torch.ops.torchkern.cholesky_qr``:
    on CUDA a factorization blocked by 64 columns, each block's factor and its inverse in one launch, the rest in
    batched products). The first pass is shifted (:func:`_shifts`) so that rank-deficient statistics cannot break
    it. With ``complete``, the Rayleigh quotients of the resulting columns tell those S resolves from those beyond
    its rank, and the resolved columns with, in the other slots, the axes go through the passes again. The passes
    give X's own Q factor whatever the shift (the product of their triangular factors is X's R), so one shift, from
    the padded size, serves every matrix of a batch. A failed factorization makes its matrix NaN, so the caller's
    finiteness check keeps the old basis (docs/design.md, "SOAP")."""
    k, n = S.shape[0], S.shape[-1]
    wide = torch.float64
    M = (Q0.mT @ (S @ Q0)).to(wide)
    key = M.diagonal(dim1=-2, dim2=-1)
    size = torch.full((k, 1, 1), n, dtype=wide, device=S.device) if sizes is None else sizes.to(wide)[:, None, None]
    if sizes is not None:  # the padding's columns last
        pad = torch.arange(n, device=S.device) >= sizes[:, None]
        key = torch.where(pad, -math.inf, key)
    order = key.sort(dim=-1, descending=True, stable=True).indices  # stable: the padding keeps its order
    X = M.gather(-1, order.unsqueeze(-2).expand_as(M))
    axes = torch.eye(n, dtype=wide, device=S.device).expand(k, n, n).gather(-1, order.unsqueeze(-2).expand(k, n, n))
    norms = torch.linalg.vector_norm(X, dim=-2, keepdim=True)
    # a zero column (the padding's, or a direction M cannot see) starts as its own axis: no division by zero
    floor = size * torch.finfo(S.dtype).eps * norms.amax(dim=-1, keepdim=True)
    X = torch.where(norms > floor, X / norms, axes)
    Y = _orthonormalize(X, _shifts(n, S.dtype))
    if complete:
        # beyond S's rank a column of the Q factor is rounding, orthogonal to the resolved ones: a direction of S's
        # null space, with a Rayleigh quotient at its floor; its slot takes the axis of the column sorted into it
        live = (Y * (M @ Y)).sum(dim=-2) > null_floor(S).to(wide).unsqueeze(-1)
        Y = _complete(Y, live, S.dtype, axes)
    return (Q0.to(wide) @ Y).to(S.dtype)


def rayleigh_quotients(S: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """``q_j^T S q_j`` for every column of the bases Q (k, n, n): S's eigenvalues where Q is its eigenbasis, the
    diagonal of S in Q otherwise (the eigenvalues K-FAC's and Shampoo's "qr" refreshes take with power_step)."""
    return (Q * (S @ Q)).sum(dim=-2)
