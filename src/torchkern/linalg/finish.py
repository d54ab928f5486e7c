"""How the public ``eigh`` and ``matrix_inverse_root`` finish a call: the one host sync that checks the results.

The raw ops (``torch.ops.torchkern.eigh``, ``matrix_inverse_root_newton``) never wait for the device: a matrix
with a NaN or Inf entry comes back NaN. The public functions read one number back, and only when it shows a bad
matrix do they look further: which argument was not finite (an error naming it and the batch indices), which
warm start was not orthogonal, which Newton iteration did not converge (replaced by a float64 eigh root, that
matrix alone). These steps are ops of their own (``_eigh_finish``, ``_newton_finish``, registered in ``ops.py``)
so that ``torch.compile(fullgraph=True)`` keeps them in its graph as opaque calls instead of tracing a branch on a
device value.
"""

from __future__ import annotations

import torch

from .._checks import dtype_name, fail
from . import constants, twins

# Probe vectors per matrix for Q0's orthogonality: for symmetric E = Q0^T Q0 - I, E v = 0 for a random v only
# when E = 0 (almost surely), and ||E v|| / ||v|| <= ||E||_2, so an orthogonal Q0 is never refused.
_PROBES = 2
_PROBE_SEED = 7


def batch_indices(bad: torch.Tensor, batch: torch.Size, limit: int = 10) -> str:
    """The batch indices where ``bad`` (shape ``batch``) is true, as a message shows them (at most ``limit``)."""
    idx = bad.reshape(-1).nonzero().flatten().tolist()
    if len(batch) == 1:
        shown = [str(i) for i in idx[:limit]]
    else:
        shown = [str(tuple(int(v) for v in torch.unravel_index(torch.tensor(i), tuple(batch)))) for i in idx[:limit]]
    more = f", ... ({len(idx)} matrices in all)" if len(idx) > limit else ""
    return "[" + ", ".join(shown) + more + "]"


def where(bad: torch.Tensor, batch: torch.Size) -> str:
    """`` in the matrices at batch indices [...]`` for a batch, nothing for a single matrix."""
    return f" in the matrices at batch indices {batch_indices(bad, batch)}" if len(batch) else ""


def raise_if_nonfinite(op: str, name: str, X: torch.Tensor | None) -> None:
    """An error naming ``name`` and the matrices of X (..., n, n) with a NaN or Inf entry, if there are any."""
    if X is None:
        return
    bad = ~torch.isfinite(X).flatten(-2).all(-1)
    if bool(bad.any()):
        fail(op, f"{name} contains NaN or Inf{where(bad, X.shape[:-2])}")


def orthogonality_tol(dtype: torch.dtype) -> float:
    """How far from orthogonal a Q0 of ``dtype`` may be (constants.EIGH_Q0_ORTH_TOL_*; a half type's own rounding of
    an orthogonal matrix, about its unit roundoff, stays far inside the bound too)."""
    if dtype == torch.float64:
        return constants.EIGH_Q0_ORTH_TOL_F64
    return max(constants.EIGH_Q0_ORTH_TOL_F32, 16 * torch.finfo(dtype).eps)


def orthogonality_deviation(Q: torch.Tensor) -> torch.Tensor:
    """max over fixed pseudo-random probe vectors v of ||Q^T Q v - v|| / ||v||, per matrix of Q (..., n, n), in
    float64 (float32 products would follow torch's TF32 switch): 4 n^2 multiply-adds a probe, no n^3 product."""
    n = Q.shape[-1]
    gen = torch.Generator().manual_seed(_PROBE_SEED)
    v = torch.randn(n, _PROBES, generator=gen, dtype=torch.float64).to(Q.device)
    Q64 = Q.double()
    dev = Q64.mT @ (Q64 @ v) - v
    return (dev.norm(dim=-2) / v.norm(dim=-2)).amax(-1)


def eigh_finish(w: torch.Tensor, A: torch.Tensor, Q0: torch.Tensor | None, op: str = "eigh",
                name: str = "A") -> torch.Tensor:
    """``w`` (a copy) once the decomposition of A (from Q0) is known good: one host sync. Raises, naming the
    argument and the matrices, for a NaN or Inf in A or Q0 and for a Q0 that is not orthogonal (its eigenvectors
    would inherit the error; :func:`orthogonality_deviation`); a NaN from finite input is a solver's failure."""
    bad = torch.isnan(w).any()  # the one flag read back (Q0's probes join it)
    deviation = tol = None
    if Q0 is not None and Q0.numel():
        tol = orthogonality_tol(Q0.dtype)
        deviation = orthogonality_deviation(Q0)
        bad = bad | (deviation > tol).any()
    if bool(bad):
        raise_if_nonfinite(op, name, A)
        raise_if_nonfinite(op, "Q0", Q0)
        batch = w.shape[:-1]
        if deviation is not None and bool((deviation > tol).any()):
            fail(op, f"Q0 must be orthogonal (||Q0^T Q0 v - v|| <= {tol:g} ||v||), got {deviation.max().item():.3g}"
                     f"{where(deviation > tol, batch)}")
        fail(op, f"no eigendecomposition of the finite matrices{where(torch.isnan(w).any(-1), batch)} (a solver did "
                 "not converge; please report this as a bug)")
    return w.clone()


def newton_finish(G: torch.Tensor, root: torch.Tensor, err: torch.Tensor, p: int, eps: float, tol: float,
                  fallback: bool) -> torch.Tensor:
    """The Newton root in G's dtype once every matrix is known good: one host sync (whether any failed). A
    non-finite G raises, naming the matrices; a matrix that did not converge (or whose root does not fit G's
    dtype, :func:`twins.newton_failed`) gets the float64 eigh root, or, with ``fallback=False``, raises."""
    out = root.to(G.dtype)
    failed = twins.newton_failed(err, tol, out)
    if not bool(failed.any()):
        return out if out is not root else out.clone()
    raise_if_nonfinite("matrix_inverse_root", "G", G)
    if not fallback:
        fail("matrix_inverse_root", f"the Newton iteration did not converge{where(failed, G.shape[:-2])} (error "
             f"above max(tol, {constants.NEWTON_ACCEPT:g}), not finite, or a root beyond {dtype_name(G.dtype)}'s "
             f"range); fallback=True uses a float64 eigendecomposition for them")
    return twins.replace_failed(G, out, failed, p, eps, torch.ops.torchkern.eigh)


def newton_finish_fake(G, root, err, p, eps, tol, fallback):
    return torch.empty_like(root, dtype=G.dtype, memory_format=torch.contiguous_format)


def eigh_finish_fake(w, A, Q0, op="eigh", name="A"):
    return torch.empty_like(w)


__all__ = ["batch_indices", "eigh_finish", "newton_finish", "orthogonality_deviation", "orthogonality_tol",
           "raise_if_nonfinite", "where"]
