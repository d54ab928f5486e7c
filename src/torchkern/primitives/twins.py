"""Twins of add_constant, mul and batched_outer."""

from __future__ import annotations

import torch

from .._checks import check, check_dim, check_float, check_float_pair, check_same_shape, shape


def check_add_constant(x: torch.Tensor, c: float) -> None:
    check_float("add_constant", "x", x)


def add_constant(x: torch.Tensor, c: float) -> torch.Tensor:
    check_add_constant(x, c)
    return torch.add(x, c).contiguous()


def check_mul(a: torch.Tensor, b: torch.Tensor) -> None:
    check_float_pair("mul", "a", a, "b", b)
    check_same_shape("mul", "a", a, "b", b)


def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    check_mul(a, b)
    return torch.mul(a, b).contiguous()


def check_batched_outer(a: torch.Tensor, b: torch.Tensor) -> None:
    check_float_pair("batched_outer", "a", a, "b", b)
    check_dim("batched_outer", "a", a, 2, "[B, n]")
    check_dim("batched_outer", "b", b, 2, "[B, m]")
    check(b.shape[0] == a.shape[0], "batched_outer",
          f"b must have shape [B, m] with B = {a.shape[0]} like a, got {shape(b)}")


def batched_outer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    check_batched_outer(a, b)
    return (a.unsqueeze(2) * b.unsqueeze(1)).contiguous()
