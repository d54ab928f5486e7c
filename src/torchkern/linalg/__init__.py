"""Batched matrix inverse p-th roots and Kronecker-factored preconditioning.

``matrix_inverse_root`` (Shampoo's roots), ``kron`` (exact batched Kronecker product) and
``kron_precondition`` ((L kron R + damping I)^-1 applied to a gradient matrix without forming the
Kronecker product: K-FAC / Shampoo). The math is in docs/design.md ("Inverse roots", "Kronecker preconditioning"); the twins are in ``torchkern.linalg.twins``.

Kernels behind them (``csrc/linalg/``): the coupled Newton iteration runs, for n <= 128 (float32,
half types computed in float32; n <= 64 in float64), the whole iteration of one matrix inside
one thread block with the matrices in shared memory (or, for 64 < n <= 128 on sm_90 when the batch
leaves SMs idle, a cluster of two blocks per matrix); larger matrices use cuBLAS batched products
with fused elementwise steps and a per-matrix "done" mask. For n >= 64 both start the iteration's
scaling from a Lanczos estimate of each matrix's smallest eigenvalue (``twins.py``: about 2 of 10
steps saved on moderately conditioned matrices). ``kron`` is one write-bound kernel.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import torch

from .._checks import fail, opmath_dtype
from . import ops, twins  # noqa: F401  (ops: registers the family's ops)

__all__ = ["kron", "kron_precondition", "matrix_inverse_root"]

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


def _raise_nonfinite(G: torch.Tensor, bad: torch.Tensor) -> None:
    batch = G.shape[:-2]
    if len(batch) == 0:
        fail("matrix_inverse_root", "G contains NaN or Inf")
    fail("matrix_inverse_root", f"G contains NaN or Inf in the matrices at batch indices {_batch_indices(bad, batch)}")


def auto_method(G: torch.Tensor, float64: bool = False) -> str:
    """What ``method="auto"`` runs: "newton" for float32/float16/bfloat16 on CUDA (every n: the
    small kernel for n <= 128, batched cuBLAS products above), "eigh" on the CPU (LAPACK is fast
    there and more accurate) and for float64 input or ``float64=True`` (asking for float64 means
    asking for accuracy, which eigh gives on the hard cases)."""
    if float64 or G.dtype == torch.float64 or G.device.type != "cuda":
        return "eigh"
    return "newton"


def matrix_inverse_root(G: torch.Tensor, p: int, eps: float = 1e-6, method: str = "auto", max_iters: int = 100,
                        tol: float = 1e-6, return_error: bool = False, *, float64: bool = False):
    """``(G + eps I)^(-1/p)`` for symmetric positive semi-definite ``G`` of shape (..., n, n).

    Args:
        G: (..., n, n), any batch shape (also none); float32, float64, float16 or bfloat16
            (half types are computed in float32). Only the symmetric part is meaningful.
        p: positive integer root (Shampoo: 4 for a 2-D block's two sides, 2 for one side).
        eps: added to the diagonal; with ``"eigh"`` eigenvalues are also clamped at ``eps``
            (docs/design.md), which makes rank-deficient G well defined.
        method: ``"eigh"`` (torch.linalg.eigh: root = Q diag(max(l, eps)^(-1/p)) Q^T),
            ``"newton"`` (docs/design.md's coupled Newton iteration with each step scaled from a lower
            bound on the spectrum, which bounds the step count, see ``torchkern.linalg.twins``; each
            matrix of a batch stops at its own iteration: at ``||M - I||_inf <= tol``, at
            ``max_iters``, or once it has stalled at the rounding floor), or ``"auto"``
            (:func:`auto_method`).
        max_iters, tol: Newton's stopping rule (ignored by ``"eigh"``).
        return_error: also return the per-matrix error, shape G.shape[:-2]: for ``"newton"`` the
            final ``||M - I||_inf``; for ``"eigh"`` the residual ``||X^p (G + eps I) - I||_inf``, the
            quantity Newton's ``M - I`` equals in exact arithmetic (computed only when asked for).
        float64: compute in float64 (either method); the result still has G's dtype.

    Returns:
        The root, G's shape and dtype (contiguous); with ``return_error`` a tuple (root, error).

    Raises:
        RuntimeError: non-square or non-floating G, ``p`` not a positive integer, an unknown
            method, or NaN/Inf in G (the message lists the batch indices of those matrices).

    The NaN/Inf check costs one host sync and no extra pass over G on the Newton path: the
    kernel flags a non-finite matrix by a NaN error, and the Python layer reads back one number,
    ``error.max()`` (which propagates NaN); only when it is NaN does it look at G to name the matrices.
    The eigh path checks ``isfinite(G)`` first (one reduction and one sync; eigh syncs anyway).

    Differentiable only with ``method="eigh"`` (through torch.linalg.eigh); the Newton op has no
    autograd formula.
    """
    twins.check_root_args("matrix_inverse_root", G, p, max_iters, tol, eps)
    if method not in _METHODS:
        fail("matrix_inverse_root", f"method must be 'auto', 'eigh' or 'newton', got {method!r}")
    if method == "auto":
        method = auto_method(G, float64)
    if G.numel() == 0:
        out = torch.empty_like(G, memory_format=torch.contiguous_format)
        err = G.new_zeros(G.shape[:-2], dtype=opmath_dtype(torch.float64 if float64 else G.dtype))
        return (out, err) if return_error else out
    if method == "eigh":
        finite = torch.isfinite(G).flatten(-2).all(-1)
        if not bool(finite.all()):
            _raise_nonfinite(G, ~finite)
        root, A = twins.matrix_inverse_root_eigh(G, p, eps, torch.float64 if float64 else None)
        out = root.to(G.dtype)
        return (out, twins.eigh_residual(root, A, p)) if return_error else out
    H = G.double() if float64 and G.dtype != torch.float64 else G
    root, err, _ = torch.ops.torchkern.matrix_inverse_root_newton(H, int(p), float(eps), int(max_iters), float(tol))
    if math.isnan(err.max().item()):  # the one sync (max propagates NaN); only on this rare path is G looked at
        bad = ~torch.isfinite(G).flatten(-2).all(-1)
        if bool(bad.any()):
            _raise_nonfinite(G, bad)
    root = root.to(G.dtype)
    return (root, err) if return_error else root


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
