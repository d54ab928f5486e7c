"""Twin of linear_grad_sq_norms: per-sample squared gradient norms of an nn.Linear layer."""

from __future__ import annotations

import torch

from .._checks import check, check_float_pair, opmath_dtype, shape


def use_gram(seq_len: int, d_in: int, d_out: int) -> bool:
    """Gram form (~T^2 (d_in + d_out) FLOPs per sample) when it is no dearer than materializing (~T d_in d_out)."""
    return seq_len * (d_in + d_out) <= d_in * d_out


def check_linear_grad_sq_norms(a: torch.Tensor, g: torch.Tensor, bias: bool) -> None:
    op = "linear_grad_sq_norms"
    check_float_pair(op, "a", a, "g", g)
    check(a.dim() in (2, 3), op, f"a must have shape [B, d_in] or [B, T, d_in], got {shape(a)}")
    layout, dims = ("[B, d_out]", "B") if a.dim() == 2 else ("[B, T, d_out]", "B, T")
    ok = g.dim() == a.dim() and g.shape[0] == a.shape[0] and (a.dim() == 2 or g.shape[1] == a.shape[1])
    check(ok, op, f"g must have shape {layout} with {dims} like a {shape(a)}, got {shape(g)}")


def linear_grad_sq_norms(a: torch.Tensor, g: torch.Tensor, bias: bool = False) -> torch.Tensor:
    check_linear_grad_sq_norms(a, g, bias)
    ct = opmath_dtype(a.dtype)
    a, g = a.to(ct), g.to(ct)
    if a.dim() == 2:
        g2 = g.square().sum(1)
        out = g2 * a.square().sum(1)
        return out + g2 if bias else out
    if use_gram(a.shape[1], a.shape[2], g.shape[2]):
        gram_g = torch.bmm(g, g.transpose(1, 2))
        out = (gram_g * torch.bmm(a, a.transpose(1, 2))).sum((1, 2))
        return out + gram_g.sum((1, 2)) if bias else out
    out = torch.bmm(g.transpose(1, 2), a).square().sum((1, 2))
    return out + g.sum(1).square().sum(1) if bias else out
