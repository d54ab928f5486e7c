"""Argument checks for the pure-PyTorch twins and the fake kernels.

Each function raises the message that the matching macro in
``csrc/include/torchkern/checks.h`` raises, word for word, so an error reads the
same whichever backend runs. ``op`` is the op's short name ("mul").
"""

from __future__ import annotations

import torch

SUPPORTED_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def opmath_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel computes in for inputs of ``dtype`` (at::opmath_type): float64 for float64, float32
    otherwise (half types are upcast)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shape(x: torch.Tensor) -> str:
    return str(list(x.shape))


def fail(op: str, message: str) -> None:
    raise RuntimeError(f"torchkern.{op}: {message}")


def check(cond: bool, op: str, message: str) -> None:
    if not cond:
        fail(op, message)


def check_float(op: str, name: str, x: torch.Tensor) -> None:
    if x.dtype not in SUPPORTED_FLOATS:
        fail(op, f"{name} must be float32, float64, float16 or bfloat16, got {dtype_name(x.dtype)}")


def check_same_dtype(op: str, ref_name: str, ref: torch.Tensor, name: str, x: torch.Tensor) -> None:
    if x.dtype != ref.dtype:
        fail(op, f"{name} must have dtype {dtype_name(ref.dtype)} like {ref_name}, got {dtype_name(x.dtype)}")


def check_same_device(op: str, ref_name: str, ref: torch.Tensor, name: str, x: torch.Tensor) -> None:
    if x.device != ref.device:
        fail(op, f"{name} must be on {ref.device} like {ref_name}, got {x.device}")


def check_same_shape(op: str, ref_name: str, ref: torch.Tensor, name: str, x: torch.Tensor) -> None:
    if x.shape != ref.shape:
        fail(op, f"{name} must have shape {shape(ref)} like {ref_name}, got {shape(x)}")


def check_dim(op: str, name: str, x: torch.Tensor, ndim: int, layout: str) -> None:
    if x.dim() != ndim:
        fail(op, f"{name} must have shape {layout} ({ndim} dims), got {shape(x)}")


def check_float_pair(op: str, a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    """Both floating point, same dtype, same device: the checks every two-tensor op starts with."""
    check_float(op, a_name, a)
    check_float(op, b_name, b)
    check_same_dtype(op, a_name, a, b_name, b)
    check_same_device(op, a_name, a, b_name, b)
