"""Twin of shampoo_graft: Shampoo's grafting direction (Adam or AdaGrad) and its norm, per parameter."""

from __future__ import annotations

from typing import Sequence

import torch

from .._checks import check, check_float, dtype_name, opmath_dtype, shape

OP = "shampoo_graft"


def check_shampoo_graft(grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                        graft_sqs: Sequence[torch.Tensor], out: Sequence[torch.Tensor], eps: Sequence[float],
                        scale: Sequence[float]) -> None:
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
    for i, g in enumerate(grads):
        check(g.dtype == g0.dtype and g.device == g0.device, OP,
              f"grads[{i}] must have the dtype and device of grads[0] ({dtype_name(g0.dtype)}, {g0.device}), got "
              f"{dtype_name(g.dtype)}, {g.device}")
        for name, states in (("exp_avgs", exp_avgs), ("graft_sqs", graft_sqs), ("out", out)):
            if not states:
                continue
            s = states[i]
            ok = s.dtype == state and s.device == g0.device and s.shape == g.shape and s.is_contiguous()
            check(ok, OP, f"{name}[{i}] must be a contiguous {dtype_name(state)} tensor of shape {shape(g)} on "
                          f"{g0.device}, got {dtype_name(s.dtype)} {shape(s)} on {s.device}"
                          + ("" if s.is_contiguous() else " (not contiguous)"))


def shampoo_graft(grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor], graft_sqs: Sequence[torch.Tensor],
                  out: Sequence[torch.Tensor], beta1: float, sq_decay: float, sq_weight: float, eps: Sequence[float],
                  scale: Sequence[float]) -> torch.Tensor:
    """Per tensor i: ``m <- lerp(m, g, 1 - beta1)`` (``m = g`` when ``exp_avgs`` is empty),
    ``v <- sq_decay v + sq_weight g^2``, ``out[i] = d = m / (sqrt(v) + eps[i]) * scale[i]``; returns the (n,)
    norms ||d||. ``exp_avgs``, ``graft_sqs`` and ``out`` are updated in place; states and ``out`` have the
    state dtype (float64 for float64 grads, float32 otherwise)."""
    check_shampoo_graft(grads, exp_avgs, graft_sqs, out, eps, scale)
    dtype = graft_sqs[0].dtype
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
