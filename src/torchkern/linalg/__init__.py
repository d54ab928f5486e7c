"""Batched symmetric eigensolver, matrix inverse p-th roots and Kronecker-factored preconditioning.

``eigh`` (eigendecompositions of symmetric matrices, optionally warm-started from a previous eigenbasis),
``matrix_inverse_root`` (Shampoo's roots), ``kron`` (exact batched Kronecker product) and
``kron_precondition`` ((L kron R + damping I)^-1 applied to a gradient matrix without forming the
Kronecker product: K-FAC / Shampoo). The methods, the kernels behind them and which one takes a call are in
docs/design.md ("Symmetric eigensolver", "Inverse roots", "Kronecker preconditioning and K-FAC"); the routing
thresholds, with the measurements behind them, in ``torchkern.linalg.constants``; the twins in
``torchkern.linalg.twins``.

The public ``eigh`` and ``matrix_inverse_root`` check their results with one host sync (``finish.py``) and
work under ``torch.compile(fullgraph=True)``; the raw ops (``torch.ops.torchkern.eigh``,
``torch.ops.torchkern.matrix_inverse_root_newton``) never sync and return NaN for a matrix with a NaN or Inf entry.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from .._checks import fail, opmath_dtype
from . import ops, twins  # noqa: F401  (ops: registers the family's ops)

__all__ = ["eigh", "kron", "kron_precondition", "matrix_inverse_root"]

Factor = Union[torch.Tensor, Sequence[torch.Tensor]]
_METHODS = ("auto", "eigh", "newton")


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
            basis of repeated eigenvalues); the work is less. Same shape, dtype and device as A; not
            differentiated. Q0 must be orthogonal to working precision (the eigenvectors inherit its error): one
            that is not by far (``constants.EIGH_Q0_ORTH_TOL_*``, measured on two probe vectors per matrix: a
            few matrix-vector products) is refused. Where a direct solver takes the call (cuSOLVER, the
            tridiagonal solver; docs/design.md) Q0 goes unused: a direct method gains nothing from it.
        solver: ``"auto"`` (the fastest solver for the shape, measured: ``linalg/constants.py``), or one at every
            size, e.g. to compare them: ``"jacobi"`` (the Jacobi kernels), ``"tridiagonal"`` (the tridiagonal
            solver; float32, float16 and bfloat16 input only) or ``"cusolver"`` (cuSOLVER's batched solver, where
            the loaded cuSOLVER has it). CPU: LAPACK either way.
        tol: where the Jacobi kernels stop: a matrix is done once its off-diagonal norm is at most
            ``tol * ||A||_F`` (residual and orthogonality then of that order). None: the smallest, and the
            default (``constants.EIGH_TOL_F32`` for float32 and the half types, ``EIGH_TOL_F64`` for float64);
            a looser one saves sweeps where less accuracy will do (an optimizer's preconditioner under its
            damping). The direct solvers and LAPACK solve to working precision whatever it is.

    Returns:
        ``(w, V)`` with A's dtype; V is contiguous.

    Raises:
        RuntimeError: non-square or non-floating A, Q0 of another shape, dtype or device, or not orthogonal, an
            unknown or unavailable solver (or ``"tridiagonal"`` for float64 A), or NaN/Inf in A or Q0 (the
            messages list the batch indices of those matrices). Checking costs one host sync, as
            torch.linalg.eigh's own error check does; ``torch.ops.torchkern.eigh`` is the op without it, which
            returns NaN for those matrices and takes Q0 as given.

    Differentiable in A by the standard formula (``twins.eigh_backward``); like torch.linalg.eigh's, the
    gradient through V is not finite when eigenvalues coincide.
    """
    w, V = torch.ops.torchkern.eigh(A, Q0, solver, tol)
    return torch.ops.torchkern._eigh_finish(w, A, Q0), V


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
        p: positive integer root (Shampoo's default: 2 on each side of a 2-D block; Gupta et al.: 4).
        eps: added to the diagonal, a finite number from 0 up to the compute dtype's largest (G + eps I must
            be finite there: float32's range for float32 and the half types, float64's with ``float64=True``);
            with ``"eigh"`` eigenvalues are also clamped at ``eps`` (at the result dtype's smallest normal number
            when eps = 0, so a singular G gives a finite, if meaningless, root).
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
            ``max(tol, constants.NEWTON_ACCEPT)`` or not finite: a diverging or non-finite iterate, or a spent
            budget), or whose root does not fit G's dtype (float16 roots beyond 65504), gets the float64
            ``"eigh"`` root instead, that matrix alone; with ``fallback=False`` the call raises, naming those
            matrices.

    Returns:
        The root, G's shape and dtype (contiguous); with ``return_error`` a tuple (root, error).

    Raises:
        RuntimeError: non-square or non-floating G, ``p`` not a positive integer, ``eps`` out of range, an
            unknown method, NaN/Inf in G (the message lists the batch indices of those matrices), or, with
            ``fallback=False``, Newton not converging (the message lists those matrices).

    Accuracy in float32 (relative Frobenius error against a float64 root of the same float32 input,
    eps = 0, n = 64, eigenvalues log-spaced over the condition number, measured with the twins): Newton
    about 1e-6 at condition 1e2, 1e-5 (p = 4) to 4e-5 (p = 2) at 1e4, 8e-4 to 3e-3 at 1e6, 6e-2 to 0.15
    at 1e8; from about 1e9 float32 cannot resolve the spectrum, the iteration fails, and the fallback
    returns the float64 root. ``"eigh"`` in float32 does no better (2e-2 at 1e6); ``float64=True`` gives
    about 3e-8 at every condition number shown: use it, or eps > 0, for ill-conditioned statistics.

    Cost: each method reads back one flag (Newton: whether a matrix failed; eigh: whether an eigenvalue is NaN),
    and only when it is set is anything else looked at (G, to name non-finite matrices; then the fallback for the
    failing matrices alone). ``return_error`` costs p products per matrix.

    Differentiable only with ``method="eigh"`` (through :func:`eigh`); the Newton op has no autograd
    formula.
    """
    compute = torch.float64 if float64 else opmath_dtype(G.dtype)
    twins.check_root_args("matrix_inverse_root", G, p, max_iters, tol, eps, compute)
    if method not in _METHODS:
        fail("matrix_inverse_root", f"method must be 'auto', 'eigh' or 'newton', got {method!r}")
    if method == "auto":
        method = auto_method(G, float64)
    if G.numel() == 0:
        out = torch.empty_like(G, memory_format=torch.contiguous_format)
        return (out, G.new_zeros(G.shape[:-2], dtype=compute)) if return_error else out
    if method == "eigh":
        def checked_eigh(A):  # G's non-finite matrices named by the one sync after the decomposition
            w, V = torch.ops.torchkern.eigh(A)
            return torch.ops.torchkern._eigh_finish(w, G, None, "matrix_inverse_root", "G"), V

        out = twins.matrix_inverse_root_eigh(G, p, eps, compute, checked_eigh).to(G.dtype)
    else:
        H = G.to(compute) if float64 else G
        root, err, _ = torch.ops.torchkern.matrix_inverse_root_newton(H, int(p), float(eps), int(max_iters), float(tol))
        out = torch.ops.torchkern._newton_finish(G, root, err, int(p), float(eps), float(tol), fallback)
    return (out, twins.root_residual(out, G, p, eps).to(compute)) if return_error else out


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
    Factors may carry leading batch dims that broadcast with grad's; each ``d`` has its ``Q``'s batch dims
    (``d.shape == Q.shape[:-1]``: one eigenvalue vector per basis). ``d_L d_R^T + damping`` must have no
    zero entry (positive d, or damping > 0) for the result to be finite. Differentiable (torch matmuls and
    elementwise ops). Raises RuntimeError for mismatched sizes, dtypes, devices, batch dims that do not
    broadcast, or a negative or non-finite damping.
    """
    return twins.kron_precondition(grad, left, right, damping)
