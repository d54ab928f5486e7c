"""Batched symmetric eigensolver, matrix inverse p-th roots and Kronecker-factored preconditioning.

``eigh`` (eigendecompositions of symmetric matrices, optionally warm-started from a previous eigenbasis),
``matrix_inverse_root`` (Shampoo's roots), ``kron`` (exact batched Kronecker product) and
``kron_precondition`` ((L kron R + damping I)^-1 applied to a gradient matrix without forming the
Kronecker product: K-FAC / Shampoo). The math is in docs/design.md ("Symmetric eigensolver", "Inverse
roots", "Kronecker preconditioning"); the twins are in ``torchkern.linalg.twins``.

Kernels behind them (``csrc/linalg/``): ``eigh`` runs cyclic Jacobi with the matrix and its eigenvectors in one
thread block's shared memory (jacobi.cuh; n <= 136 in float32, 118 in float64; a batch too small to fill the GPU
spreads each matrix's eigenvector rows over up to 8 blocks), and above that a block Jacobi method in float64 whose 64
x 64 subproblems get a sweep each in 4 x 4 groups (jacobi_tiles.cuh) and whose rotations are one launch per round of
64 x 64 tiles on the float64 tensor cores (eigh.cu); cuSOLVER takes the calls where it is faster: its batched solver
(syev_batched.cpp) the cold starts of 96 <= n <= 256 (float64: 128) and of large batches above, and float32 warm
starts up to n = 256 of large batches and at 128 <= n <= 136 of any, its one-matrix solver the cold starts of fewer
than 8 matrices from n = 704; float32 cold starts from n = 384 (but single matrices from 704), and their warm starts
at full accuracy, go to a tridiagonal solver: Householder reduction on a cluster of blocks per matrix, bisection and
inverse iteration in float64, the eigenvectors back by compact WY products (tridiagonal.cuh). The coupled Newton
iteration of the roots runs, for n <= 128 (float32, half types computed in float32; n <= 64 in float64), the
whole iteration of one matrix inside one thread block with the matrices in shared memory (or, for 64 < n <= 128 on
sm_90 when the batch leaves SMs idle, a cluster of two blocks per matrix); larger matrices use cuBLAS batched
products with fused elementwise steps and a per-matrix "done" mask. For n >= 64 both start the iteration's scaling
from a Lanczos estimate of each matrix's smallest eigenvalue (``twins.py``: about 2 of 10 steps saved on moderately
conditioned matrices). A matrix whose iteration does not converge falls back to a float64 ``eigh`` root. ``kron`` is
one write-bound kernel.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import torch

from .._checks import fail, opmath_dtype
from . import constants, ops, twins  # noqa: F401  (ops: registers the family's ops)

__all__ = ["eigh", "kron", "kron_precondition", "matrix_inverse_root"]

Factor = Union[torch.Tensor, Sequence[torch.Tensor]]
_METHODS = ("auto", "eigh", "newton")


def _batch_indices(bad: torch.Tensor, batch: torch.Size, limit: int = 10) -> str:
    idx = bad.reshape(-1).nonzero().flatten().tolist()
    if len(batch) == 1:
        shown = [str(i) for i in idx[:limit]]
    else:
        shown = [str(tuple(int(v) for v in torch.unravel_index(torch.tensor(i), tuple(batch)))) for i in idx[:limit]]
    more = f", ... ({len(idx)} matrices in all)" if len(idx) > limit else ""
    return "[" + ", ".join(shown) + more + "]"


def _raise_nonfinite(G: torch.Tensor, bad: torch.Tensor, op: str = "matrix_inverse_root", name: str = "G") -> None:
    batch = G.shape[:-2]
    if len(batch) == 0:
        fail(op, f"{name} contains NaN or Inf")
    fail(op, f"{name} contains NaN or Inf in the matrices at batch indices {_batch_indices(bad, batch)}")


def eigh(A: torch.Tensor, Q0: torch.Tensor | None = None, *, solver: str = "auto",
         tol: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigendecomposition of symmetric matrices: ``A = V diag(w) V^T``, returns ``(w, V)``.

    Same contract as ``torch.linalg.eigh``: eigenvalues ``w`` (..., n) in ascending order, orthonormal
    eigenvectors as the columns of ``V`` (..., n, n); signs (and the basis of a repeated eigenvalue's space)
    are unspecified. The symmetric part ``(A + A^T) / 2`` is decomposed (torch.linalg.eigh reads only the
    lower triangle): identical for symmetric input.

    Args:
        A: (..., n, n), any batch shape (also none); float32 or float64; float16 and bfloat16 are computed
            in float32 and returned in A's dtype.
        Q0: optional (..., n, n) orthogonal matrix, e.g. the eigenvectors of a previous call on a matrix
            that has changed little since (an optimizer's statistics one step later): the decomposition
            starts from ``Q0^T A Q0``, which is then nearly diagonal, and rotates the result back
            (``V = Q0 V'``). The result is the same as without it (up to rounding, signs and the
            basis of repeated eigenvalues); the work is less. Q0 must be orthogonal to working precision
            (the eigenvectors inherit its error). Same shape, dtype and device as A; not differentiated.
            Where cuSOLVER or the tridiagonal solver takes the call (below) Q0 goes unused: a direct method
            gains nothing from it.
        solver: ``"auto"`` (the fastest of the solvers below for the shape, measured), ``"jacobi"`` (the
            Jacobi kernels at every size, e.g. to compare them) or ``"tridiagonal"`` (the tridiagonal solver at
            every size; float32, float16 and bfloat16 input only). CPU: LAPACK either way.
        tol: where the Jacobi kernels stop: a matrix is done once its off-diagonal norm is at most
            ``tol * ||A||_F`` (residual and orthogonality then of that order). None: the smallest, and the
            default, 1e-6 for float32 and the half types, 1e-13 for float64; a looser one saves sweeps where
            less accuracy will do (an optimizer's preconditioner under its damping). cuSOLVER and LAPACK solve
            to working precision whatever it is.

    Returns:
        ``(w, V)`` with A's dtype; V is contiguous.

    Raises:
        RuntimeError: non-square or non-floating A, Q0 of another shape, dtype or device, an unknown solver
            (or ``"tridiagonal"`` for float64 A),
            or NaN/Inf in A (the message lists the batch indices of those matrices; checking costs one host
            sync, as torch.linalg.eigh's own error check does; ``torch.ops.torchkern.eigh`` is the op
            without it, which returns NaN for those matrices).

    Differentiable in A by the standard formula (``twins.eigh_backward``); like torch.linalg.eigh's, the
    gradient through V is not finite when eigenvalues coincide.

    Kernels (CUDA): cyclic two-sided Jacobi with the matrix and its eigenvectors in shared memory, one
    thread block per matrix (up to 8 for a batch too small to fill the GPU, each with a slice of the
    eigenvectors' rows), every sweep in one launch (n <= 136 in float32, n <= 118 in float64 on sm_90's
    shared memory), and a block Jacobi method above, whose 64 x 64 subproblems get one sweep each and whose
    rotations are one launch per round of 64 x 64 tiles on the float64 tensor cores. cuSOLVER where it is faster
    (``solver="auto"``): its batched solver (cusolverDnXsyevBatched, which torch.linalg.eigh calls only up to
    n = 32) for 96 <= n <= 256 (float64: 128) and for large batches above, and for the float32 warm starts up
    to n = 256 of large batches and at 128 <= n <= 136 of any (the in-block kernel's largest sizes); its
    one-matrix solver for cold starts of fewer than 8 matrices from n = 704.
    Float32 cold starts from n = 384 (a single matrix: up to 703) take the tridiagonal solver: A = Q T Q^T by
    Householder reflections on a cluster of up to 8 thread blocks per matrix, T's eigenvalues by bisection and its
    eigenvectors by inverse iteration in float64, Q Z in float64 products (docs/design.md, "Symmetric eigensolver");
    so do their warm starts, unless ``tol`` >= 1e-4 (the Jacobi warm start then stops after a sweep or two).
    """
    w, V = torch.ops.torchkern.eigh(A, Q0, solver, tol)
    if w.numel() and bool(torch.isnan(w).any()):  # the one sync; only on this rare path is A looked at
        for name, X in (("A", A), ("Q0", Q0)):
            bad = ~torch.isfinite(X).flatten(-2).all(-1) if X is not None else None
            if bad is not None and bool(bad.any()):
                _raise_nonfinite(X, bad, "eigh", name)
        batch = w.shape[:-1]
        where = f" at batch indices {_batch_indices(torch.isnan(w).any(-1), batch)}" if len(batch) else ""
        fail("eigh", f"no eigendecomposition of the finite matrices{where} (a solver did not converge; please report "
             "this as a bug)")
    return w, V


def auto_method(G: torch.Tensor, float64: bool = False) -> str:
    """What ``method="auto"`` runs: "newton" for float32/float16/bfloat16 on CUDA (every n: the
    small kernel for n <= 128, batched cuBLAS products above), "eigh" on the CPU (LAPACK is fast
    there and more accurate) and for float64 input or ``float64=True`` (asking for float64 means
    asking for accuracy, which eigh gives on the hard cases)."""
    if float64 or G.dtype == torch.float64 or G.device.type != "cuda":
        return "eigh"
    return "newton"


def matrix_inverse_root(G: torch.Tensor, p: int, eps: float = 1e-6, method: str = "auto", max_iters: int = 100,
                        tol: float = 1e-6, return_error: bool = False, *, float64: bool = False,
                        fallback: bool = True):
    """``(A + eps I)^(-1/p)`` with ``A = (G + G^T) / 2``, for symmetric positive semi-definite ``G`` (..., n, n).

    Every method uses the symmetric part of G, identically (for symmetric G that is G itself); a
    non-symmetric G is not rejected.

    Args:
        G: (..., n, n), any batch shape (also none); float32, float64, float16 or bfloat16
            (half types are computed in float32).
        p: positive integer root (Shampoo: 4 for a 2-D block's two sides, 2 for one side).
        eps: added to the diagonal; with ``"eigh"`` eigenvalues are also clamped at ``eps`` (at the dtype's
            smallest normal number when eps = 0, so a singular G gives a finite, if meaningless, root).
        method: ``"eigh"`` (:func:`eigh`: root = Q diag(max(l, eps)^(-1/p)) Q^T), ``"newton"``
            (docs/design.md's coupled Newton iteration with each step scaled from a lower bound on the
            spectrum, which bounds the step count, see ``torchkern.linalg.twins``; each matrix of a batch
            stops at its own iteration: at ``||M - I||_inf <= tol``, at ``max_iters``, or once it has
            stalled at the rounding floor), or ``"auto"`` (:func:`auto_method`).
        max_iters, tol: Newton's stopping rule (ignored by ``"eigh"``).
        return_error: also return the per-matrix error of the returned root, shape G.shape[:-2]:
            ``||X^p A - I||_inf`` with ``A = (G + G^T) / 2 + eps I``, computed in float64 (only when asked).
        float64: compute in float64 (either method); the result still has G's dtype.
        fallback: Newton only. A matrix whose iteration did not converge (final ``||M - I||_inf`` above
            ``max(tol, 1e-3)`` or not finite: a diverging or non-finite iterate, or a spent budget) gets the
            float64 ``"eigh"`` root instead, that matrix alone; with ``fallback=False`` the call raises,
            naming those matrices.

    Returns:
        The root, G's shape and dtype (contiguous); with ``return_error`` a tuple (root, error).

    Raises:
        RuntimeError: non-square or non-floating G, ``p`` not a positive integer, an unknown method, NaN/Inf
            in G (the message lists the batch indices of those matrices), or, with ``fallback=False``, Newton
            not converging (the message lists those matrices).

    Accuracy in float32 (relative Frobenius error against a float64 root of the same float32 input,
    eps = 0, n = 64, eigenvalues log-spaced over the condition number, measured with the twins): Newton
    about 1e-6 at condition 1e2, 1e-5 (p = 4) to 4e-5 (p = 2) at 1e4, 8e-4 to 3e-3 at 1e6, 6e-2 to 0.15
    at 1e8; from about 1e9 float32 cannot resolve the spectrum, the iteration fails, and the fallback
    returns the float64 root. ``"eigh"`` in float32 does no better (2e-2 at 1e6); ``float64=True`` gives
    about 3e-8 at every condition number shown: use it, or eps > 0, for ill-conditioned statistics.

    Cost: Newton's convergence and NaN checks read back one number, ``error.max()``, and only when it
    shows a failing matrix is anything else looked at (G, to name non-finite matrices; then the fallback
    for the failing matrices alone). The eigh path checks ``isfinite(G)`` first (one reduction and one
    sync; eigh syncs anyway). ``return_error`` costs p products per matrix.

    Differentiable only with ``method="eigh"`` (through :func:`eigh`); the Newton op has no autograd
    formula.
    """
    twins.check_root_args("matrix_inverse_root", G, p, max_iters, tol, eps)
    if method not in _METHODS:
        fail("matrix_inverse_root", f"method must be 'auto', 'eigh' or 'newton', got {method!r}")
    if method == "auto":
        method = auto_method(G, float64)
    err_dtype = opmath_dtype(torch.float64 if float64 else G.dtype)
    if G.numel() == 0:
        out = torch.empty_like(G, memory_format=torch.contiguous_format)
        return (out, G.new_zeros(G.shape[:-2], dtype=err_dtype)) if return_error else out
    if method == "eigh":
        finite = torch.isfinite(G).flatten(-2).all(-1)
        if not bool(finite.all()):
            _raise_nonfinite(G, ~finite)
        root, _ = twins.matrix_inverse_root_eigh(G, p, eps, torch.float64 if float64 else None,
                                                 torch.ops.torchkern.eigh)
    else:
        H = G.double() if float64 and G.dtype != torch.float64 else G
        root, err, _ = torch.ops.torchkern.matrix_inverse_root_newton(H, int(p), float(eps), int(max_iters),
                                                                      float(tol))
        if not err.max().item() <= max(tol, constants.NEWTON_ACCEPT):  # the one sync (max propagates NaN)
            bad = ~torch.isfinite(G).flatten(-2).all(-1)
            if bool(bad.any()):
                _raise_nonfinite(G, bad)
            failed = twins.newton_failed(err, tol)
            if not fallback:
                where = "" if G.dim() == 2 else f" at batch indices {_batch_indices(failed, G.shape[:-2])}"
                fail("matrix_inverse_root", f"the Newton iteration did not converge for the matrices{where} "
                     f"(error above max(tol, {constants.NEWTON_ACCEPT:g}) or not finite); fallback=True uses "
                     f"a float64 eigendecomposition for them")
            root = twins.replace_failed(G, root, failed, p, eps, torch.ops.torchkern.eigh)
    out = root.to(G.dtype)
    return (out, twins.root_residual(out, G, p, eps).to(err_dtype)) if return_error else out


def kron(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Exact Kronecker product, batched: A (..., m, n), B (..., p, q) -> (..., m*p, n*q).

    ``out[..., i*p + k, j*q + l] = A[..., i, j] * B[..., k, l]``; for unbatched inputs this is
    ``torch.kron(A, B)``. Batch dims broadcast. Same dtype (any float type) and device.
    Differentiable in both arguments. Raises RuntimeError for fewer than 2 dims, mismatched
    dtypes/devices or batch dims that do not broadcast.
    """
    return torch.ops.torchkern.kron(A, B)


def kron_precondition(grad: torch.Tensor, left: Factor, right: Factor, damping: float = 0.0) -> torch.Tensor:
    """Kronecker-factored preconditioning of a gradient matrix, never forming the Kronecker product.

    grad: (..., m, n). ``left`` and ``right`` are both given in one of two forms:

    * inverse factors, tensors ``L_inv`` (m, m) and ``R_inv`` (n, n) (e.g. Shampoo's inverse
      4th roots): returns ``L_inv @ grad @ R_inv``. ``damping`` must be 0 (fold it into the factors).
    * eigendecompositions ``(Q_L, d_L)`` of L (m, m)/(m,) and ``(Q_R, d_R)`` of R (n, n)/(n,)
      (K-FAC, docs/design.md): V = Q_L^T grad Q_R; V = V / (d_L d_R^T + damping); returns
      ``Q_L V Q_R^T``, which is ``(L kron R + damping I)^-1 vec(grad)`` with row-major vec.

    Mixing the forms (a tensor on one side, a tuple on the other) is rejected: the damping term
    belongs to the Kronecker product as a whole and has no meaning for a lone inverse factor.
    Factors may carry leading batch dims that broadcast with grad's. Differentiable (torch
    matmuls and elementwise ops). Raises RuntimeError for mismatched sizes, dtypes, devices.
    """
    return twins.kron_precondition(grad, left, right, damping)
