"""Twins of the optim ops: shampoo_graft (Shampoo's grafting direction, Adam or AdaGrad, and its norm, per parameter;
also SOAP's Adam step in the eigenbasis) and cholesky_qr (one pass of Cholesky QR, the power steps' factorization)."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .._checks import check, check_float, dtype_name, fail, opmath_dtype, shape

OP = "shampoo_graft"


def check_shampoo_graft(grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                        graft_sqs: Sequence[torch.Tensor], out: Sequence[torch.Tensor], eps: Sequence[float],
                        scale: Sequence[float], found_inf: torch.Tensor | None = None,
                        steps: torch.Tensor | None = None) -> None:
    n = len(grads)
    check(n > 0, OP, "grads must hold at least one tensor")
    check(len(exp_avgs) in (0, n), OP,
          f"exp_avgs must be empty or hold one tensor per grad ({n}), got {len(exp_avgs)}")
    check(len(graft_sqs) == n and len(out) == n and len(eps) == n and len(scale) == n, OP,
          f"graft_sqs, out, eps and scale must hold one entry per grad ({n}), got {len(graft_sqs)}, {len(out)}, "
          f"{len(eps)} and {len(scale)}")
    g0 = grads[0]
    check_float(OP, "grads[0]", g0)
    state = opmath_dtype(g0.dtype)
    if found_inf is not None:
        check(found_inf.dtype == torch.float32 and found_inf.numel() == 1 and found_inf.device == g0.device, OP,
              f"found_inf must be a float32 tensor of one element on {g0.device}, got {dtype_name(found_inf.dtype)} "
              f"{shape(found_inf)} on {found_inf.device}")
    if steps is not None:
        check(steps.dtype == torch.float32 and steps.shape == (n,) and steps.device == g0.device
              and steps.is_contiguous(), OP,
              f"steps must be a contiguous float32 tensor of shape [{n}] on {g0.device}, got "
              f"{dtype_name(steps.dtype)} {shape(steps)} on {steps.device}"
              + ("" if steps.is_contiguous() else " (not contiguous)"))
    for i, g in enumerate(grads):  # messages built only on failure: this runs on every optimizer step
        if not (g.dtype == g0.dtype and g.device == g0.device):
            fail(OP, f"grads[{i}] must have the dtype and device of grads[0] ({dtype_name(g0.dtype)}, {g0.device}), "
                     f"got {dtype_name(g.dtype)}, {g.device}")
        for name, states in (("exp_avgs", exp_avgs), ("graft_sqs", graft_sqs), ("out", out)):
            if not states:
                continue
            s = states[i]
            if not (s.dtype == state and s.device == g0.device and s.shape == g.shape and s.is_contiguous()):
                fail(OP, f"{name}[{i}] must be a contiguous {dtype_name(state)} tensor of shape {shape(g)} on "
                         f"{g0.device}, got {dtype_name(s.dtype)} {shape(s)} on {s.device}"
                         + ("" if s.is_contiguous() else " (not contiguous)"))


def shampoo_graft(grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor], graft_sqs: Sequence[torch.Tensor],
                  out: Sequence[torch.Tensor], beta1: float, sq_decay: float, sq_weight: float, eps: Sequence[float],
                  scale: Sequence[float], found_inf: torch.Tensor | None = None,
                  steps: torch.Tensor | None = None) -> torch.Tensor:
    """Per tensor i: ``m <- lerp(m, g, 1 - beta1)`` (``m = g`` when ``exp_avgs`` is empty),
    ``v <- sq_decay v + sq_weight g^2``, ``out[i] = d = m / (sqrt(v) + eps[i]) * scale[i]``; returns the (n,)
    norms ||d||. ``exp_avgs``, ``graft_sqs`` and ``out`` are updated in place; states and ``out`` have the
    state dtype (float64 for float64 grads, float32 otherwise). ``found_inf`` nonzero (a float32 scalar on the
    device, read there): a skipped step, states unchanged, ``out`` and the norms zero.

    ``steps`` (float32 (n,), the steps each tensor has taken, read and counted up on the device unless the step
    is skipped): Adam's bias corrections for step ``t = steps[i] + 1`` applied to ``eps[i]`` and ``scale[i]``:
    ``eps[i] sqrt(b2)`` and ``scale[i] sqrt(b2) / b1``, ``b1 = 1 - beta1^t`` (1 without ``exp_avgs``),
    ``b2 = 1 - sq_decay^t`` (1 when sq_decay is 1)."""
    check_shampoo_graft(grads, exp_avgs, graft_sqs, out, eps, scale, found_inf, steps)
    if steps is not None:
        return _counted(grads, exp_avgs, graft_sqs, out, beta1, sq_decay, sq_weight, eps, scale, found_inf, steps)
    dtype = graft_sqs[0].dtype
    if found_inf is not None:
        return _skippable(grads, exp_avgs, graft_sqs, out, beta1, sq_decay, sq_weight, eps, scale, found_inf)
    g = [x if x.dtype == dtype else x.to(dtype) for x in grads]
    if exp_avgs:
        torch._foreach_lerp_(list(exp_avgs), g, 1.0 - beta1)
    m = list(exp_avgs) if exp_avgs else g
    sqs = list(graft_sqs)
    torch._foreach_mul_(sqs, sq_decay)
    torch._foreach_addcmul_(sqs, g, g, sq_weight)
    denoms = torch._foreach_sqrt(sqs)
    torch._foreach_add_(denoms, list(eps))
    out = list(out)
    torch._foreach_copy_(out, m)
    torch._foreach_div_(out, denoms)
    torch._foreach_mul_(out, list(scale))
    return torch.stack(torch._foreach_norm(out))


def _skippable(grads, exp_avgs, graft_sqs, out, beta1, sq_decay, sq_weight, eps, scale, found_inf) -> torch.Tensor:
    """shampoo_graft with a device-side skip flag: the step runs on copies, which replace the states only where
    the flag is zero (no host sync; the gradients of a skipped step may hold NaN/Inf and touch nothing)."""
    skip = found_inf.reshape(()) != 0
    dtype = graft_sqs[0].dtype
    zero = torch.zeros((), dtype=dtype, device=skip.device)
    g = [torch.where(skip, zero, x.to(dtype)) for x in grads]
    m = [t.clone() for t in exp_avgs]
    v = [t.clone() for t in graft_sqs]
    norms = shampoo_graft(g, m, v, out, beta1, sq_decay, sq_weight, eps, scale)
    for new, old in zip(m + v, list(exp_avgs) + list(graft_sqs)):
        old.copy_(torch.where(skip, old, new))
    for d in out:
        d.copy_(torch.where(skip, zero, d))
    return torch.where(skip, zero, norms)


def _counted(grads, exp_avgs, graft_sqs, out, beta1, sq_decay, sq_weight, eps, scale, found_inf, steps):
    """shampoo_graft with the bias corrections taken from ``steps`` on the device (float64, as the kernel) as 0-d
    factors of eps and scale (no host sync), then ``steps`` counted up where the step is not skipped."""
    t = steps.double() + 1.0
    b1 = 1.0 - beta1 ** t if exp_avgs else torch.ones_like(t)
    b2 = 1.0 - sq_decay ** t if sq_decay < 1.0 else torch.ones_like(t)
    dtype = graft_sqs[0].dtype
    root_b2 = b2.sqrt()
    eps_t = [(root_b2[i] * e).to(dtype) for i, e in enumerate(eps)]  # no host list copied to the device
    scale_t = [(root_b2[i] / b1[i] * c).to(dtype) for i, c in enumerate(scale)]
    norms = shampoo_graft(grads, exp_avgs, graft_sqs, out, beta1, sq_decay, sq_weight, eps_t, scale_t, found_inf)
    steps.add_(1.0 if found_inf is None else (found_inf.reshape(()) == 0).float())
    return norms


def check_cholesky_qr(X: torch.Tensor, shift: float) -> None:
    op = "cholesky_qr"
    check(X.dtype in (torch.float32, torch.float64), op, f"X must be float32 or float64, got {dtype_name(X.dtype)}")
    check(X.dim() >= 2, op, f"X must have shape [..., m, n] (at least 2 dims), got {shape(X)}")
    check(math.isfinite(shift) and shift >= 0.0, op, f"shift must be a finite number >= 0, got {shift:g}")


def cholesky_qr(X: torch.Tensor, shift: float) -> torch.Tensor:
    """``X R^-1`` with ``R^T R = X^T X + shift I`` (R upper triangular), per matrix of X (..., m, n): the Q factor of
    one Cholesky QR pass. A matrix whose shifted Gram matrix is not numerically positive definite (a Cholesky pivot
    that is not a finite positive number, also from NaN or Inf input) comes back NaN, the others unaffected."""
    check_cholesky_qr(X, shift)
    G = X.mT @ X
    G.diagonal(dim1=-2, dim2=-1).add_(shift)
    L, info = torch.linalg.cholesky_ex(G)
    Y = torch.linalg.solve_triangular(L.mT, X, upper=True, left=False)
    return torch.where((info == 0)[..., None, None], Y, math.nan).contiguous()
